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
- with extension 0.4.0 on the nodes, the agent says it uses the full filter exchange and
  still warms the standby.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

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
            assert "predates the change feed" not in agent.log()
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


def test_extension_0_4_0_is_warmed_through_the_filter_exchange(log_dir):
    cluster = prepared_cluster(extension_version="0.4.0")
    try:
        with warm_agent(cluster, log_dir) as agent:
            assert "predates the change feed" in agent.log()
            assert agent.metric("ccm_agent_feed_resets_total") == 0
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
