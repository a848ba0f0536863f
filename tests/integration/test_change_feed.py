"""The change feed (extension 0.5.0, ccm_buffer_changes): a steady cycle moves what changed.

Real primary and standby (shared_buffers 128MB each). Warmth is measured with pg_buffercache
on both nodes, never with the agent's own counters alone:

- a standby that evicts hot blocks under its own read load gets them back: its feed reports
  the evictions, so the agent sends them again (an agent that missed removals would leave
  the coverage low and load nothing);
- a warm, idle pair exchanges a small fraction of what one bloom filter of the standby
  weighs (the agent's TCP sockets to both nodes, as `ss` counts them), and the agent's own
  ccm_agent_bytes_total agrees with ss;
- a standby restarted cold resets its feed, and is warmed again;
- a cold standby with room for all it lacks is sent its blocks in file order, as autoprewarm
  reads them, not hottest first (which reads a file in scattered pieces): the buffers it
  fills, in the order a restarted server hands them out, follow the files;
- with extension 0.4.0 on the nodes (older than 0.5.0, the oldest the agent calls), the
  agent names the node, the version and what to run, loads nothing, and warms the standby
  once the catalog is updated;
- a cancel ends a long pass at its next slice (the feed's lock is not held across the pass),
  the next call starts the feed over as interrupted, and a second caller still waits for a
  pass in progress instead of running into it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import psycopg
import pytest

from harness.agent import AgentProcess
from harness.cluster import Cluster, coverage, make_table, read


HOT_MB = 16
# The standby's own reads: each table under a quarter of shared_buffers (so cached in
# ordinary buffers, not a ring), together more than its shared_buffers.
OWN_TABLES = 6
OWN_MB = 24


def prepared_cluster(extension_version: str | None = None) -> Cluster:
    cluster = Cluster(settings={"shared_buffers": "'128MB'"})
    cluster.create(extensions=() if extension_version else ("pg_ccm", "pg_buffercache"))
    primary = cluster.primary
    if extension_version:
        primary.sql(f"CREATE EXTENSION pg_ccm VERSION '{extension_version}'")
        primary.sql("CREATE EXTENSION pg_buffercache")
    make_table(primary, "hot", HOT_MB)
    for i in range(OWN_TABLES):
        make_table(primary, f"own_{i}", OWN_MB)
    # Compact and frozen, so that reads set no hint bits that replay would then cache.
    primary.sql("VACUUM (FULL, FREEZE)")
    primary.sql("ANALYZE")
    read(primary, "hot", times=6)
    cluster.wait_caught_up()
    return cluster


def hot_on_standby(cluster: Cluster) -> float:
    return coverage(cluster.primary, cluster.standby)[0]


@contextmanager
def warm_agent(cluster: Cluster, log_dir, interval: str = "300ms"):
    """ccm-agent on the cluster (the hot set only: fill_room off), once the standby holds the
    primary's hot set."""
    with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval=interval,
                      extra=["--fill-room", "false"]) as agent:
        cluster.standby.wait_until(lambda: hot_on_standby(cluster) >= 0.99, "the hot set on the standby", timeout=30)
        yield agent


@pytest.mark.every_version
def test_hot_blocks_the_standby_evicts_under_its_own_reads_come_back(log_dir):
    cluster = prepared_cluster()
    try:
        primary, standby = cluster.primary, cluster.standby
        with warm_agent(cluster, log_dir) as agent:
            assert "does not serve the change feed" not in agent.log()
            loaded_before = agent.metric("ccm_agent_blocks_loaded_total")
            hot_blocks = coverage(primary, standby)[1]

            # The standby's own reads push its clock sweep around several times: blocks the
            # agent loaded with usage 5 decay and are evicted.
            for _ in range(3):
                for i in range(OWN_TABLES):
                    read(standby, f"own_{i}", times=2)

            standby.wait_until(lambda: hot_on_standby(cluster) >= 0.99, "the hot set back on the standby",
                               timeout=30)
            reloaded = agent.metric("ccm_agent_blocks_loaded_total") - loaded_before
            assert reloaded >= 0.5 * hot_blocks, (
                f"the agent loaded {reloaded} blocks again for a hot set of {hot_blocks}: the standby's "
                f"evictions were not seen\n{agent.log()[-3000:]}")
            # One reset per node (the agent's first call), none since.
            assert agent.metric("ccm_agent_feed_resets_total") == 2, agent.log()[-3000:]
    finally:
        cluster.destroy()


def test_a_warm_idle_pair_exchanges_little(log_dir):
    cluster = prepared_cluster()
    try:
        primary, standby = cluster.primary, cluster.standby
        filter_bytes = standby.one("SELECT length(ccm_buffer_filter())")
        with warm_agent(cluster, log_dir, interval="200ms") as agent:
            # The first sweeps' lists are behind us.
            cycles = agent.metric("ccm_agent_cycles_total")
            agent.wait_for(lambda: agent.metric("ccm_agent_cycles_total") >= cycles + 10, "ten more cycles")

            ports = {primary.port, standby.port}

            def totals() -> tuple[float, float, float]:
                return (agent.wire_bytes(ports), agent.metric("ccm_agent_cycles_total"),
                        agent.metric("ccm_agent_bytes_total"))

            bytes_before, cycles_before, counted_before = totals()
            time.sleep(5)
            bytes_after, cycles_after, counted_after = totals()
            series = {k for k, v in agent.metrics().items() if k.startswith("ccm_agent_bytes_total{") and v > 0}
        cycles = cycles_after - cycles_before
        per_cycle = (bytes_after - bytes_before) / cycles
        assert cycles >= 10, f"only {cycles} cycles in 5 s"
        # Both nodes, both directions, every statement of a cycle, measured by the kernel: a
        # fraction of the one filter the full exchange carries twice per cycle.
        assert per_cycle < filter_bytes / 4, (
            f"{per_cycle:.0f} bytes per idle cycle, a filter of the standby is {filter_bytes} bytes")
        # The agent's own count (ccm_agent_bytes_total, per node and direction) is what ss
        # sees on its sockets, give or take the cycle it is updated at.
        assert len(series) == 4, f"expected sent and received for both nodes: {sorted(series)}"
        counted, seen = counted_after - counted_before, bytes_after - bytes_before
        assert abs(counted - seen) <= max(0.1 * seen, 3 * per_cycle), (
            f"ccm_agent_bytes_total grew by {counted:.0f}, ss saw {seen:.0f} bytes")
    finally:
        cluster.destroy()


@pytest.mark.every_version
@pytest.mark.smoke
def test_a_standby_restarted_cold_resets_its_feed_and_is_warmed_again(log_dir):
    cluster = prepared_cluster()
    try:
        with warm_agent(cluster, log_dir) as agent:
            cluster.make_standby_cold()
            # The restarted standby's feed starts over (its shared memory is new); the agent
            # forgets what it held and warms it again. An agent that kept its old view would
            # believe the hot set cached and leave the standby cold.
            agent.wait_for(lambda: agent.metric("ccm_agent_feed_resets_total") >= 3, "the standby's feed to reset")
            cluster.standby.wait_until(lambda: hot_on_standby(cluster) >= 0.99, "the hot set on the restarted standby",
                               timeout=60)
    finally:
        cluster.destroy()


def test_an_extension_older_than_the_oldest_supported_is_named_then_warmed_once_updated(log_dir):
    cluster = prepared_cluster(extension_version="0.4.0")
    primary, standby = cluster.primary, cluster.standby
    try:
        cluster.make_standby_cold()  # replay cached what VACUUM FULL wrote
        with AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="300ms",
                          extra=["--fill-room", "false"]) as agent:  # the harness: --max-backoff 2s
            # The nodes' library (this build) is newer than the 0.4.0 catalog: the update alone
            # is missing, and the message says so.
            agent.wait_for(lambda: "extension pg_ccm 0.4.0 is older than the oldest this agent supports "
                                   "(0.5.0); run ALTER EXTENSION pg_ccm UPDATE on the primary" in agent.log(),
                           "the agent to name the old catalog")
            time.sleep(3)  # more than one retry at the slow pace
            assert agent.metric("ccm_agent_blocks_loaded_total") == 0
            assert hot_on_standby(cluster) < 0.5
            primary.sql("ALTER EXTENSION pg_ccm UPDATE")
            standby.wait_until(lambda: hot_on_standby(cluster) >= 0.99, "the hot set on the standby after the update",
                               timeout=60)
            assert agent.metric("ccm_agent_blocks_loaded_total") > 0
    finally:
        cluster.destroy()


@pytest.mark.every_version
def test_a_cold_standby_with_room_is_read_in_file_order(log_dir):
    # Two tables of 3,072 blocks each, "first" created first (the lower relfilenode: first in
    # file order) and made usage 4 on the primary, "second" usage 5: both hot, second hotter.
    # Hottest first, second's blocks would be read before first's.
    cluster = Cluster(settings={"shared_buffers": "'128MB'"})
    try:
        cluster.create(extensions=("pg_ccm", "pg_buffercache", "pg_prewarm"))
        primary, standby = cluster.primary, cluster.standby
        tables = {"first": 4, "second": 5}
        for table in tables:
            primary.sql(f"CREATE TABLE {table} (id int8, pad text) WITH (autovacuum_enabled = off)")
            primary.sql(f"INSERT INTO {table} SELECT g, repeat('x', 1000) FROM generate_series(1, 3072 * 7) g")
        primary.sql("VACUUM (FREEZE)")
        nodes = {table: primary.one("SELECT pg_relation_filenode(%s)::int8", [table]) for table in tables}
        assert nodes["first"] < nodes["second"], nodes
        primary.restart()  # the load left both tables cached; read them afresh below
        cluster.make_standby_cold()
        for table, usage in tables.items():
            for _ in range(usage):
                primary.sql("SELECT pg_prewarm(%s)", [table])

        with AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="300ms",
                          extra=["--fill-room", "false"]) as agent:
            standby.wait_until(lambda: hot_on_standby(cluster) >= 0.99, "the hot set on the standby", timeout=30)
            # More than one batch (4,096 blocks), so that the order across batches counts too.
            assert agent.metric("ccm_agent_blocks_loaded_total") >= 6000, agent.log()[-3000:]

        # A restarted server hands out its unused buffers in ascending order, so each block's
        # buffer says when it was read.
        def buffers(table: str) -> list[int]:
            return [row[0] for row in standby.sql(
                "SELECT bufferid FROM pg_buffercache WHERE relfilenode = %s AND relforknumber = 0 ORDER BY 1",
                [nodes[table]])]

        first, second = buffers("first"), buffers("second")
        assert len(first) >= 3000 and len(second) >= 3000, (len(first), len(second))
        last_first, early_second = first[int(0.95 * len(first))], second[int(0.05 * len(second))]
        assert last_first < early_second, (
            f"the standby read the hotter table's blocks before the colder one's: 95% of 'first' in "
            f"buffers up to {last_first}, 5% of 'second' in buffers up to {early_second}")
    finally:
        cluster.destroy()


# A pass over 1 GB of shared_buffers is 8 slices of 16384 headers; the test build's failpoint
# makes each last SLICE_MS more under the feed's lock (where interrupts are held off).
FEED_CALL = "SELECT seq, reset_reason FROM ccm_buffer_changes(%s, %s)"


@pytest.fixture
def big_pool():
    """A lone primary with 1 GB of shared_buffers (the feed works the same on any node)."""
    built = Cluster(settings={"shared_buffers": "'1GB'"})
    try:
        built.create(standby=False)
        yield built.primary
    finally:
        built.destroy()


def feed_call_in_background(node, subscriber: int, slice_ms: int) -> tuple[threading.Thread, dict, int]:
    conn = node.connect(autocommit=True)
    conn.execute(f"SET ccm.test_feed_slice_delay_ms = {slice_ms}")
    pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["row"] = conn.execute(FEED_CALL, [subscriber, 0]).fetchone()
            outcome["ended"] = time.monotonic()
        except psycopg.Error as error:
            outcome["error"] = error
            outcome["ended"] = time.monotonic()
        finally:
            conn.close()

    thread = threading.Thread(target=run)
    thread.start()
    node.wait_until(lambda: node.one("SELECT wait_event IS NULL AND state = 'active' FROM pg_stat_activity WHERE pid = %s",
                                     [pid]), "the feed call to start")
    return thread, outcome, pid


@pytest.mark.every_version
def test_a_cancel_ends_a_long_change_feed_pass_at_its_next_slice(big_pool):
    node = big_pool
    thread, outcome, pid = feed_call_in_background(node, 42, slice_ms=1000)
    cancelled = time.monotonic()
    node.sql("SELECT pg_cancel_backend(%s)", [pid])
    thread.join(timeout=30)
    assert outcome["error"].sqlstate == "57014", outcome
    # The whole pass lasts 8 s here; a lock held across it made the cancel wait for its end.
    took = outcome["ended"] - cancelled
    assert took < 4, f"the cancel took {took:.1f} s"
    # Another session: the cancelled pass is over, so it does not wait, and starts over.
    assert node.sql(FEED_CALL, [42, 0])[0][1] == "interrupted"


@pytest.mark.every_version
def test_a_second_feed_caller_waits_for_a_pass_in_progress(big_pool):
    node = big_pool
    first, outcome, _ = feed_call_in_background(node, 7, slice_ms=300)
    second = node.sql(FEED_CALL, [8, 0])[0]
    first.join(timeout=30)
    assert "row" in outcome, outcome
    # The first pass finished undisturbed and answered first (a second pass run into it would
    # have answered at once, and first); the second then took the feed over.
    assert outcome["row"][0] < second[0], (outcome["row"], second)
    assert second[1] == "new subscriber"
