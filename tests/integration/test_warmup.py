"""The CCM loop end to end: a real primary, a real streaming standby, the real agent.

Warmth is measured with pg_buffercache on both nodes, not with our own counters.
"""

from __future__ import annotations

import time

import pytest

from harness.agent import AgentProcess, run_agent_json
from harness.cluster import Cluster, Node, coverage
from harness.wait import wait_for


# The read load that goes on once the hot set has formed (transactions per second): enough to
# keep the primary's hot set in use, little enough that tests running side by side on a few
# cores do not wait for each other's pgbench.
STEADY_RATE = 200


def warm_primary(load_factory, cluster, node: Node | None = None):
    """Runs a read load on the primary (or `node`) as fast as it goes until its hot set has
    formed (see `wait_hot`), then goes on at STEADY_RATE; returns that load, still running.
    With shared_buffers larger than the data set nothing is evicted, so the hot set's usage
    counts stay as the fast load left them."""
    node = node or cluster.primary
    fast = load_factory(node, seconds=600)
    wait_hot(node)
    fast.stop()
    return load_factory(node, seconds=600, rate=STEADY_RATE)


def wait_hot(node: Node, table: str = "pgbench_accounts", share: float = 0.8, timeout: float = 90) -> None:
    """Waits until `share` of the table's pages are hot (usage count > 3) in the node's
    shared_buffers: the pgbench load's hot set is then nearly all it will be."""
    query = ("SELECT count(*) FILTER (WHERE usagecount > 3)::float8 / greatest(pg_relation_size(%s::regclass) / 8192, 1) "
             "FROM pg_buffercache WHERE relfilenode = pg_relation_filenode(%s::regclass) "
             "AND reldatabase = (SELECT oid FROM pg_database WHERE datname = current_database())")
    wait_for(f"{share:.0%} of {table} to be hot on {node.name}", lambda: node.one(query, [table, table]) >= share,
             timeout=timeout, interval=0.25)


def wait_for_coverage(cluster, target: float, timeout: float) -> tuple[float, float, int]:
    """Polls pg_buffercache on both nodes until the standby holds `target` of the primary's
    hot set or `timeout` passes; returns (coverage, seconds taken, hot set size)."""
    started = time.monotonic()
    seen: list[tuple[float, int]] = []

    def covered() -> bool:
        seen.append(coverage(cluster.primary, cluster.standby))
        return seen[-1][0] >= target

    try:
        wait_for(f"{target:.0%} coverage", covered, timeout=timeout, interval=0.25)
    except TimeoutError:
        pass
    fraction, hot = seen[-1]
    return fraction, time.monotonic() - started, hot


@pytest.mark.every_version
@pytest.mark.smoke
def test_standby_holds_the_primarys_hot_set_within_ten_seconds(cluster, load_factory, log_dir):
    cluster.make_standby_cold()
    warm_primary(load_factory, cluster)
    before, hot = coverage(cluster.primary, cluster.standby)
    assert hot > 500, f"the read load should make a hot set, got {hot} buffers"
    assert before < 0.5, f"the standby should start cold, coverage {before:.1%}"

    with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval="500ms") as agent:
        fraction, elapsed, hot = wait_for_coverage(cluster, 0.99, timeout=10)
        assert fraction >= 0.99, f"coverage {fraction:.2%} of {hot} hot buffers after {elapsed:.1f}s\n{agent.log()[-3000:]}"
        assert agent.metric("ccm_agent_blocks_loaded_total") > 0
        # The gauge is the coverage the last scan found, before that cycle's transfer: it
        # shows the warm standby from the cycle after the one that warmed it.
        agent.wait_for(lambda: 0.9 <= agent.metric("ccm_agent_coverage_ratio") <= 1.0,
                       "the agent's coverage gauge to show the warm standby", timeout=5)

    # The standby got the primary's usage counts, not the 1 a plain read leaves.
    hot_on_primary = cluster.primary.cached_blocks(min_usage=4)
    hot_on_standby = cluster.standby.cached_blocks(min_usage=4)
    assert len(hot_on_primary & hot_on_standby) >= 0.9 * len(hot_on_primary)


def test_status_counters_agree_with_what_the_standby_received(cluster, load_factory):
    cluster.make_standby_cold()
    load = warm_primary(load_factory, cluster)
    load.stop()  # a still hot set, so that one sync has a definite answer

    result = run_agent_json("sync", "--once", "--primary", cluster.primary.conninfo(), "--standby", cluster.standby.conninfo())
    assert result["sent"] > 500
    # Every block sent, hot or colder (fill_room), was accounted for by the standby.
    assert result["loaded"] + result["already_cached"] + result["skipped"] == result["sent"] + result["colder_sent"]
    assert result["loaded"] > 0.9 * result["sent"]

    status = cluster.primary.sql("SELECT * FROM aurora_ccm_status()")[0]
    columns = [c.name for c in cluster.primary.connect().execute("SELECT * FROM aurora_ccm_status()").description]
    row = dict(zip(columns, status))
    assert columns == [
        "buffers_sent_last_minute", "buffers_found_last_minute",
        "buffers_sent_last_scan", "buffers_found_last_scan",
        "buffers_sent_current_scan", "buffers_found_current_scan",
        "current_scan_progress",
    ]
    # This cluster was born less than a minute ago and only this sync scanned it.
    assert row["buffers_sent_last_minute"] == result["sent"]
    assert row["buffers_found_last_scan"] == result["hot_buffers"]
    assert row["current_scan_progress"] == cluster.primary.one("SELECT setting::int8 FROM pg_settings WHERE name = 'shared_buffers'")

    fraction, hot = coverage(cluster.primary, cluster.standby)
    assert fraction >= 0.99, f"coverage {fraction:.2%} of {hot} after sync --once"


def test_agent_runs_as_a_non_superuser(cluster, load_factory):
    cluster.primary.sql("CREATE ROLE ccm LOGIN IN ROLE ccm_agent, pg_monitor")
    cluster.wait_caught_up()
    cluster.make_standby_cold()
    warm_primary(load_factory, cluster).stop()
    result = run_agent_json(
        "sync", "--once",
        "--primary", cluster.primary.conninfo(user="ccm"),
        "--standby", cluster.standby.conninfo(user="ccm"),
    )
    assert result["loaded"] > 500
    status = run_agent_json("status", "--primary", cluster.primary.conninfo(user="ccm"), "--standby", cluster.standby.conninfo(user="ccm"))
    assert status["primary"]["role"] == "primary"
    assert status["standby"]["role"] == "standby"
    assert status["coverage"] >= 0.99


@pytest.mark.every_version
def test_hottest_blocks_win_when_the_standby_is_smaller(log_dir):
    # Standby: 64 MB = 8192 buffers. Primary: two 40 MB tables, one at usage count 5 and
    # one at 4, together more than the standby holds.
    with Cluster(settings={"shared_buffers": "'256MB'"}, standby_settings={"shared_buffers": "'64MB'"}) as cluster:
        primary = cluster.primary
        for table in ("hot5", "hot4"):
            primary.sql(f"CREATE TABLE {table} AS SELECT g, repeat('x', 1000) AS pad FROM generate_series(1, 35000) g")
        primary.sql("CHECKPOINT")
        cluster.make_standby_cold()
        with primary.connect() as conn:
            for reads, table in ((5, "hot5"), (4, "hot4")):
                for _ in range(reads):
                    conn.execute(f"SELECT count(*) FROM {table}")
        hot5_rel, hot4_rel = (primary.one(f"SELECT pg_relation_filenode('{t}')::int8") for t in ("hot5", "hot4"))
        hot5 = {b for b in primary.cached_blocks(min_usage=5) if b[2] == hot5_rel}
        hot4 = {b for b in primary.cached_blocks(min_usage=4) if b[2] == hot4_rel}
        assert len(hot5) > 4000 and len(hot4) > 4000, (len(hot5), len(hot4))

        result = run_agent_json("sync", "--once", "--primary", primary.conninfo(), "--standby", cluster.standby.conninfo())
        assert result["sent"] > 0
        cached = cluster.standby.cached_blocks()
        share5 = len(hot5 & cached) / len(hot5)
        share4 = len(hot4 & cached) / len(hot4)
        assert share5 >= 0.95, f"usage-5 blocks on the standby: {share5:.1%} (usage-4: {share4:.1%})"
        assert share4 < share5


@pytest.mark.every_version
def test_every_kind_of_page_reaches_the_standby(log_dir):
    """Several databases, a non-default tablespace, indexes, TOAST, visibility and free-space maps."""
    cluster = Cluster()
    try:
        primary = cluster.primary
        cluster.init_primary(primary)
        primary.start()
        primary.sql("CREATE EXTENSION pg_ccm")
        primary.sql("CREATE EXTENSION pg_buffercache")
        space = cluster.base / "ts_primary"
        space.mkdir()
        from harness.cluster import _chown_to_postgres

        _chown_to_postgres(space)
        primary.sql(f"CREATE TABLESPACE elsewhere LOCATION '{space}'")
        primary.sql("CREATE DATABASE second")
        for db in ("postgres", "second"):
            with primary.connect(dbname=db) as conn:
                conn.execute("CREATE TABLE t (id int PRIMARY KEY, doc text) TABLESPACE elsewhere")
                # Incompressible 8 kB documents go to TOAST.
                conn.execute("INSERT INTO t SELECT g, string_agg(md5(g::text || x::text), '') FROM generate_series(1, 2000) g, generate_series(1, 256) x GROUP BY g")
                conn.execute("CREATE INDEX t_doc ON t (left(doc, 20))")
                conn.execute("VACUUM t")  # visibility and free-space maps
        cluster.clone_standby(cluster.standby, primary, tablespaces={space: cluster.base / "ts_standby"})
        cluster.standby.start()
        cluster.make_standby_cold()
        for db in ("postgres", "second"):
            with primary.connect(dbname=db) as conn:
                conn.execute("SET enable_seqscan = off")
                conn.execute("SET enable_bitmapscan = off")
                for _ in range(5):
                    conn.execute("SELECT count(*) FROM t WHERE doc LIKE '%zz%'")  # heap and TOAST
                    conn.execute("SELECT count(*) FROM t WHERE left(doc, 20) > '8'")  # t_doc
                    conn.execute("SELECT count(*) FROM t WHERE id > 10")  # t_pkey, index-only: VM

        kinds = primary.sql(
            "SELECT DISTINCT d.datname, t.spcname, b.relforknumber, c.relkind "
            "FROM pg_buffercache b JOIN pg_database d ON d.oid = b.reldatabase "
            "JOIN pg_tablespace t ON t.oid = b.reltablespace "
            "LEFT JOIN pg_class c ON c.relfilenode = b.relfilenode AND d.datname = current_database() "
            "WHERE b.usagecount > 3"
        )
        assert {k[0] for k in kinds} >= {"postgres", "second"}
        assert "elsewhere" in {k[1] for k in kinds}

        result = run_agent_json("sync", "--once", "--primary", primary.conninfo(), "--standby", cluster.standby.conninfo())
        assert result["loaded"] > 1000
        fraction, hot = coverage(primary, cluster.standby)
        assert fraction >= 0.99, f"coverage {fraction:.2%} of {hot}"

        # Per kind: the primary's hot pages of each relation are on the standby.
        standby_blocks = cluster.standby.cached_blocks()
        hot_blocks = primary.cached_blocks(min_usage=4)
        for db in ("postgres", "second"):
            rels = primary.sql(
                "SELECT c.relfilenode::int8, c.relname FROM pg_class c "
                "WHERE c.oid IN ('t'::regclass, 't_pkey'::regclass, 't_doc'::regclass, "
                "                (SELECT reltoastrelid FROM pg_class WHERE relname = 't'), "
                "                (SELECT indexrelid FROM pg_index WHERE indrelid = (SELECT reltoastrelid FROM pg_class WHERE relname = 't')))",
                dbname=db,
            )
            assert len(rels) == 5
            for relfilenode, name in rels:
                hot = {b for b in hot_blocks if b[2] == relfilenode}
                assert hot, f"{db}.{name} should have hot pages on the primary"
                missing = hot - standby_blocks
                assert len(missing) <= 0.01 * len(hot), f"{db}.{name}: {len(missing)} of {len(hot)} hot pages missing"
        forks_on_standby = {row[0] for row in cluster.standby.sql(
            "SELECT DISTINCT relforknumber FROM pg_buffercache WHERE relfilenode IS NOT NULL")}
        assert {0, 1, 2} <= forks_on_standby, f"forks cached on the standby: {forks_on_standby}"
    finally:
        cluster.destroy()
