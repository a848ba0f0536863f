"""One agent, several standbys: every host of the --standby string that is a standby of the
primary is warmed, in its order; one standby's trouble is its own; `wait` tells when they are
warm; a standby that follows another primary is never warmed.

Warmth is measured with pg_buffercache on every node (harness `coverage`), not only with the
agent's counters.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from harness.agent import AgentProcess, agent_command, run_agent, run_agent_json
from harness.cluster import Cluster, Node, coverage, multi_host_conninfo

from test_warmup import warm_primary

# Which standbys the agent warms, in which order, and how it keeps one's trouble its own is the
# agent's logic: scripts/test.sh runs it on the newest version only (the extension's calls it
# makes are every_version tests elsewhere).
pytestmark = pytest.mark.agent_only


def name(node: Node) -> str:
    """The standby's name in the agent's metrics, logs and `wait --member`: host:port."""
    return f"127.0.0.1:{node.port}"


def standby_metric(agent: AgentProcess, metric: str, node: Node) -> float | None:
    """One standby's series of a per-standby metric (None while it has none)."""
    return agent.metrics().get(f'{metric}{{node="{name(node)}"}}')


def wait_warm(agent: AgentProcess, primary: Node, standbys: list[Node], target: float = 0.99,
              timeout: float = 30) -> dict[str, float]:
    """Polls pg_buffercache on the primary and on each standby until every standby holds
    `target` of the primary's hot set (usage count > 3); returns each one's coverage."""
    seen: dict[str, float] = {}

    def warm() -> bool:
        for standby in standbys:
            seen[standby.name], _ = coverage(primary, standby)
        return all(fraction >= target for fraction in seen.values())

    try:
        agent.wait_for(warm, f"{', '.join(s.name for s in standbys)} to hold {target:.0%} of the hot set", timeout)
    except TimeoutError as error:
        raise AssertionError(f"coverage {seen} after {timeout}s") from error
    return seen


def settle_hint_bits(primary: Node, *tables: str) -> None:
    """Sets the tables' hint bits and visibility map now, so that reading them later writes
    no WAL: with wal_log_hints, the first read after a checkpoint would log every page, and
    the standbys would replay those pages into their caches, warm without the agent. With
    synchronous_commit off, a hint bit waits for its commit record to be flushed: the
    CHECKPOINT flushes it first."""
    primary.sql("CHECKPOINT")
    for table in tables:
        primary.sql(f"VACUUM {table}")


def cycle_errors(agent: AgentProcess) -> dict[str, float]:
    return {k: v for k, v in agent.metrics().items() if k.startswith("ccm_agent_cycle_errors_total") and v}


@pytest.mark.smoke
def test_one_agent_warms_every_standby_of_the_standby_string(cluster, load_factory, log_dir):
    second = cluster.add_standby("standby2")
    standbys = [cluster.standby, second]
    cluster.make_standby_cold()  # the new clone is cold: it replayed only since its backup
    warm_primary(load_factory, cluster)
    for standby in standbys:
        before, hot = coverage(cluster.primary, standby)
        assert hot > 500, f"the read load should make a hot set, got {hot} buffers"
        assert before < 0.5, f"{standby.name} should start cold, coverage {before:.1%}"

    standby_string = multi_host_conninfo(standbys)
    with AgentProcess(cluster.primary.conninfo(), standby_string, log_dir, interval="500ms") as agent:
        wait_warm(agent, cluster.primary, standbys, timeout=20)
        for standby in standbys:
            assert standby_metric(agent, "ccm_agent_standby_up", standby) == 1
            assert standby_metric(agent, "ccm_agent_standby_blocks_loaded_total", standby) > 500
        # The gauges show the scan before each cycle's transfer: warm from the next cycle.
        # The per-standby gauges are set during a cycle, the lowest coverage at its end: they
        # agree from the cycle after, so both are polled.
        agent.wait_for(lambda: all(0.9 <= (standby_metric(agent, "ccm_agent_standby_coverage_ratio", s) or 0) <= 1
                                   for s in standbys)
                       and 0.9 <= agent.metric("ccm_agent_coverage_ratio") <= 1,
                       "every standby's coverage gauge and the lowest coverage", timeout=5)
        assert not cycle_errors(agent), agent.log()[-3000:]

        status = run_agent_json("status", "--primary", cluster.primary.conninfo(), "--standby", standby_string)
        assert [s["name"] for s in status["standbys"]] == [name(s) for s in standbys]
        assert [s["role"] for s in status["standbys"]] == ["standby", "standby"]
        assert all(s["coverage"] >= 0.95 for s in status["standbys"]), status["standbys"]
        assert status["standby"]["port"] == cluster.standby.port, "`standby` stays the first standby"


def test_the_primary_listed_among_the_standbys_is_passed_over_silently(cluster, load_factory, log_dir):
    cluster.make_standby_cold()
    warm_primary(load_factory, cluster)
    # Patroni users list every node on both sides; here the primary even comes first.
    standby_string = multi_host_conninfo([cluster.primary, cluster.standby])
    with AgentProcess(cluster.primary.conninfo(), standby_string, log_dir, interval="300ms") as agent:
        wait_warm(agent, cluster.primary, [cluster.standby], timeout=15)
        cycles = agent.metric("ccm_agent_cycles_total")
        agent.wait_for(lambda: agent.metric("ccm_agent_cycles_total") >= cycles + 5, "five more cycles")
        assert not cycle_errors(agent), f"{cycle_errors(agent)}\n{agent.log()[-3000:]}"
        assert standby_metric(agent, "ccm_agent_standby_up", cluster.primary) == 0
        assert standby_metric(agent, "ccm_agent_standby_blocks_loaded_total", cluster.primary) == 0
        assert standby_metric(agent, "ccm_agent_standby_rank", cluster.primary) == 0
        assert standby_metric(agent, "ccm_agent_standby_rank", cluster.standby) == 1
        loud = [line for line in agent.log().splitlines() if re.search(r"Z\s+(WARN|ERROR) ", line)]
        assert not loud, "\n".join(loud)
    assert "recovery is not in progress" not in cluster.primary.logfile.read_text(errors="replace"), \
        "ccm_prewarm was called on the primary"

    # `wait` passes over the primary too: the one standby is warm.
    result = run_agent("wait", "--min-coverage", "99", "--timeout", "20s",
                       "--primary", cluster.primary.conninfo(), "--standby", standby_string, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("warm: ") and name(cluster.standby) in result.stdout
    assert name(cluster.primary) not in result.stdout


def test_a_smaller_standby_gets_the_hottest_part_and_a_bigger_one_everything(log_dir):
    # The small standby: 64 MB = 8192 buffers. The primary: two 40 MB tables (5000 blocks
    # each), one at usage count 5 and one at 4, together more than the small standby holds.
    with Cluster(settings={"shared_buffers": "'256MB'"}, standby_settings={"shared_buffers": "'64MB'"}) as cluster:
        primary, small = cluster.primary, cluster.standby
        for table in ("hot5", "hot4"):
            primary.sql(f"CREATE TABLE {table} AS SELECT g, repeat('x', 1000) AS pad FROM generate_series(1, 35000) g")
        settle_hint_bits(primary, "hot5", "hot4")
        cluster.make_standby_cold()
        big = cluster.add_standby("big", settings={"shared_buffers": "'256MB'"})
        with primary.connect() as conn:
            for reads, table in ((5, "hot5"), (4, "hot4")):
                for _ in range(reads):
                    conn.execute(f"SELECT count(*) FROM {table}")
        hot = {}
        for usage, table in ((5, "hot5"), (4, "hot4")):
            rel = primary.one("SELECT pg_relation_filenode(%s::regclass)::int8", [table])
            hot[table] = {b for b in primary.cached_blocks(min_usage=usage) if b[2] == rel}
        assert len(hot["hot5"]) > 4000 and len(hot["hot4"]) > 4000, {t: len(b) for t, b in hot.items()}

        standbys = [small, big]
        standby_string = multi_host_conninfo(standbys)
        with AgentProcess(primary.conninfo(), standby_string, log_dir, interval="300ms") as agent:
            wait_warm(agent, primary, [big], timeout=20)
            # A few more cycles: the small standby must hold its share, not trade it away.
            cycles = agent.metric("ccm_agent_cycles_total")
            agent.wait_for(lambda: agent.metric("ccm_agent_cycles_total") >= cycles + 10, "ten more cycles")
            cached = small.cached_blocks()
            share5 = len(hot["hot5"] & cached) / len(hot["hot5"])
            share4 = len(hot["hot4"] & cached) / len(hot["hot4"])
            assert share5 >= 0.95, f"usage-5 blocks on the small standby: {share5:.1%} (usage-4: {share4:.1%})"
            assert share4 < share5
            big_cached = big.cached_blocks()
            for table, blocks in hot.items():
                assert len(blocks & big_cached) >= 0.99 * len(blocks), f"{table} on the big standby"

            # The warming order is the string's.
            assert standby_metric(agent, "ccm_agent_standby_rank", small) == 0
            assert standby_metric(agent, "ccm_agent_standby_rank", big) == 1
            assert not cycle_errors(agent), agent.log()[-3000:]
        status = run_agent_json("status", "--primary", primary.conninfo(), "--standby", standby_string)
        assert [s["name"] for s in status["standbys"]] == [name(small), name(big)]


def test_a_stopped_standby_leaves_the_others_warm_and_is_warmed_again_when_back(cluster, load_factory, log_dir):
    second = cluster.add_standby("standby2")
    standbys = [cluster.standby, second]
    primary = cluster.primary
    # Hot data for later, written now.
    primary.sql("CREATE TABLE later AS SELECT g, repeat('l', 1000) AS pad FROM generate_series(1, 20000) g")
    settle_hint_bits(primary, "later")
    for standby in standbys:
        cluster.make_standby_cold(standby)
    warm_primary(load_factory, cluster)

    # The hot set's loads are counted: fill_room would load `later`, cached on the primary
    # but not yet hot, early, as a colder block.
    with AgentProcess(primary.conninfo(), multi_host_conninfo(standbys), log_dir, interval="300ms",
                      extra=["--fill-room", "false"]) as agent:
        wait_warm(agent, primary, standbys, timeout=20)

        second.stop()
        agent.wait_for(lambda: standby_metric(agent, "ccm_agent_standby_up", second) == 0, "standby2 to be seen down")
        assert standby_metric(agent, "ccm_agent_standby_up", cluster.standby) == 1
        loaded = standby_metric(agent, "ccm_agent_standby_blocks_loaded_total", cluster.standby)
        cycles = agent.metric("ccm_agent_cycles_total")

        # New hot data while standby2 is down: the first standby gets it, cycle after cycle.
        with primary.connect() as conn:
            for _ in range(5):
                conn.execute("SELECT count(*) FROM later")
        later = primary.one("SELECT pg_relation_size('later') / 8192")
        wait_warm(agent, primary, [cluster.standby], timeout=20)
        grown = standby_metric(agent, "ccm_agent_standby_blocks_loaded_total", cluster.standby) - loaded
        assert grown >= 0.9 * later, f"the first standby loaded {grown} blocks, {later} are new and hot"
        agent.wait_for(lambda: agent.metric("ccm_agent_cycles_total") >= cycles + 5, "cycles to go on while standby2 is down")
        assert standby_metric(agent, "ccm_agent_standby_up", second) == 0

        # standby2 comes back cold (a restart empties shared_buffers; no WAL since its
        # shutdown restartpoint touched the hot set): the same agent warms it again.
        loaded_before = standby_metric(agent, "ccm_agent_standby_blocks_loaded_total", second)
        second.drop_os_cache()
        second.start()
        fractions = wait_warm(agent, primary, standbys, timeout=30)
        _, hot = coverage(primary, second)
        reloaded = standby_metric(agent, "ccm_agent_standby_blocks_loaded_total", second) - loaded_before
        assert reloaded >= 0.8 * hot, f"standby2 came back cold, yet only {reloaded} of {hot} hot blocks were loaded"
        assert standby_metric(agent, "ccm_agent_standby_up", second) == 1
        assert agent.alive(), fractions


def test_wait_exits_once_every_standby_is_warm_and_times_out_naming_a_cold_one(cluster, load_factory, log_dir):
    second = cluster.add_standby("standby2")
    standbys = [cluster.standby, second]
    cluster.make_standby_cold()
    warm_primary(load_factory, cluster).stop()  # a still hot set, so that every look agrees
    sides = ["--primary", cluster.primary.conninfo(), "--standby", multi_host_conninfo(standbys)]

    waiting = subprocess.Popen(agent_command("wait", "--min-coverage", "99", "--timeout", "60s", "--interval", "200ms", *sides),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)
        assert waiting.poll() is None, f"wait returned with cold standbys: {waiting.communicate()}"
        with AgentProcess(cluster.primary.conninfo(), multi_host_conninfo(standbys), log_dir, interval="300ms"):
            out, err = waiting.communicate(timeout=90)
            # What wait said, pg_buffercache confirms (its filter has 0.1% false positives).
            fractions = {s.name: coverage(cluster.primary, s)[0] for s in standbys}
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.communicate()
    assert waiting.returncode == 0, err
    assert out.startswith("warm: "), out
    assert name(cluster.standby) in out and name(second) in out, out
    assert all(f >= 0.98 for f in fractions.values()), fractions

    # No agent runs; standby2 restarts cold, the first stays warm.
    cluster.make_standby_cold(second)
    started = time.monotonic()
    result = run_agent("wait", "--min-coverage", "99", "--timeout", "3s", *sides, timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert re.search(rf"^ccm-agent: timed out after 3s: {re.escape(name(second))} holds \d+\.\d% of the hot set "
                     rf"\(needs 99\.0%\)$", result.stderr, re.MULTILINE), result.stderr
    assert name(cluster.standby) not in result.stderr.splitlines()[-1], "the warm standby is not what is missing"
    assert 3 <= elapsed < 20, elapsed
    assert coverage(cluster.primary, second)[0] < 0.5, "wait only looks, it never warms"

    # The warm one alone is what --member asks about.
    result = run_agent("wait", "--min-coverage", "99", "--timeout", "10s", "--member", name(cluster.standby), *sides, timeout=60)
    assert result.returncode == 0, result.stderr
    assert name(cluster.standby) in result.stdout and name(second) not in result.stdout, result.stdout


def streams(node: Node, timeline: int, sender: Node) -> bool:
    row = node.sql("SELECT received_tli, sender_port FROM pg_stat_wal_receiver WHERE status = 'streaming'")
    return bool(row) and row[0] == (timeline, sender.port)


def follow_on_the_new_timeline(cluster, standby: Node, promoted: Node, table: str) -> None:
    """Re-points the stopped `standby` at `promoted` (already promoted), starts it cold, and
    waits until it streams timeline 2 from it (a write on `promoted` named `table` makes
    sure there is WAL to stream)."""
    cluster.follow(standby, promoted)
    standby.drop_os_cache()
    standby.start()
    promoted.sql(f"CREATE TABLE {table} AS SELECT 1 AS x")
    standby.wait_until(lambda: streams(standby, 2, promoted), "the standby to stream timeline 2 from the promoted one")


def test_a_standby_following_another_primary_is_never_warmed_from_the_old_one(cluster, load_factory, log_dir):
    """A partition: standby A is promoted (timeline 2) and standby B follows it, while the
    old primary keeps running and accepting writes, and the agent's --primary still names
    it. B must not be warmed from the old primary.

    Why this fails without the timeline check: B passes every other check. It shares the
    old primary's system identifier, it is in recovery, and its WAL sender (A) is a host of
    the standby string, which the sender check accepts as "another standby being warmed".
    And the old primary's hot set is pgbench_accounts, created before the fork: B has the
    same relfilenodes, so ccm_prewarm would load those blocks and B's coverage of the old
    primary's hot set would grow (the control at the end shows B is warmable). Only
    "streams timeline 2, the primary writes timeline 1" stops it.
    """
    old, a = cluster.primary, cluster.standby
    b = cluster.add_standby("standby_b")

    # B stops first; A replays everything B can have received, then is promoted: B has
    # nothing past A's fork point and can follow A's timeline without a rewind.
    b.stop()
    cluster.wait_caught_up(standby=a)
    a.promote()
    follow_on_the_new_timeline(cluster, b, a, "on_the_new_timeline")
    assert old.one("SELECT NOT pg_is_in_recovery()"), "the old primary still runs as a primary"
    old.sql("CREATE TABLE written_during_the_partition AS SELECT 1 AS x")

    load = warm_primary(load_factory, cluster, node=old)
    before, hot = coverage(old, b)
    assert hot > 500 and before < 0.5, (hot, before)

    started = time.monotonic()
    with AgentProcess(old.conninfo(), multi_host_conninfo([a, b]), log_dir, interval="200ms") as agent:
        agent.wait_for(lambda: agent.metric('ccm_agent_cycle_errors_total{stage="safety"}') >= 2,
                       "the safety check to refuse B twice", timeout=20)
        time.sleep(max(0.0, 5 - (time.monotonic() - started)))
        log = agent.log()
        assert (f"standby {name(b)} streams timeline 2 but the primary {name(old)} writes timeline 1: "
                "it follows another primary, so it is not warmed") in log, log[-3000:]
        assert agent.metric("ccm_agent_blocks_loaded_total") == 0
        assert (standby_metric(agent, "ccm_agent_standby_blocks_loaded_total", b) or 0) == 0
        assert standby_metric(agent, "ccm_agent_standby_up", b) == 0
        after, hot = coverage(old, b)
        assert after < 0.5 and after <= before + 0.05, f"B's coverage of the old primary's hot set: {before:.1%} -> {after:.1%}"
        assert agent.alive()
    load.stop()

    # Control: from the primary it does follow (A), B is warmed, with the same tables.
    warm_primary(load_factory, cluster, node=a)
    with AgentProcess(a.conninfo(), multi_host_conninfo([a, b]), log_dir, interval="300ms") as agent:
        wait_warm(agent, a, [b], timeout=20)
        assert not cycle_errors(agent), agent.log()[-3000:]


# -- two agent bugs these tests found (fixed): a down standby hid the others' coverage from
# -- status and wait; a promoted host of the standby string passed as a cascade's WAL sender.

def test_wait_passes_over_a_down_host_of_the_standby_string(cluster, load_factory):
    second = cluster.add_standby("standby2")
    standbys = [cluster.standby, second]
    cluster.make_standby_cold()
    warm_primary(load_factory, cluster).stop()
    sides = ["--primary", cluster.primary.conninfo(), "--standby", multi_host_conninfo(standbys)]
    assert run_agent("sync", "--once", *sides).returncode == 0
    assert all(coverage(cluster.primary, s)[0] >= 0.99 for s in standbys)

    second.stop()  # e.g. restarted in a rolling restart, or an old primary waiting to rejoin
    for member in ([], ["--member", name(cluster.standby)]):
        result = run_agent("wait", "--min-coverage", "99", "--timeout", "5s", *member, *sides, timeout=60)
        assert result.returncode == 0, f"wait {' '.join(member)}: {result.stderr.strip().splitlines()[-1]}"
        assert name(cluster.standby) in result.stdout and name(second) not in result.stdout


def test_a_standby_following_a_primary_of_the_same_timeline_number_is_not_warmed(cluster, load_factory, log_dir):
    """Split brain on one timeline number: standbys A and C of the dead primary are both
    promoted, and both write timeline 2; B follows A. The agent's --primary is C, its
    --standby string lists A and B. The timeline check cannot tell (2 = 2); B's WAL sender,
    A, is neither C nor a standby being warmed (A is a primary, passed over), so B must not
    be warmed from C."""
    a = cluster.standby
    b = cluster.add_standby("standby_b")
    c = cluster.add_standby("standby_c")
    b.stop()
    cluster.wait_caught_up(standby=a)
    cluster.wait_caught_up(standby=c)
    cluster.primary.stop()
    a.promote()
    c.promote()
    follow_on_the_new_timeline(cluster, b, a, "on_a")
    c.sql("CHECKPOINT")  # its control file names the new timeline
    assert c.one("SELECT timeline_id FROM pg_control_checkpoint()") == 2

    warm_primary(load_factory, cluster, node=c)
    before, hot = coverage(c, b)
    assert hot > 500 and before < 0.5, (hot, before)
    with AgentProcess(c.conninfo(), multi_host_conninfo([a, b]), log_dir, interval="200ms") as agent:
        time.sleep(5)
        after, _ = coverage(c, b)
        assert after < 0.5, f"B's coverage of C's hot set: {before:.1%} -> {after:.1%}"
        assert agent.metric("ccm_agent_blocks_loaded_total") == 0
        assert agent.metric('ccm_agent_cycle_errors_total{stage="safety"}') >= 1
        assert f"standby {name(b)} streams its WAL from 127.0.0.1:{a.port}" in agent.log()
