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
- with extension 0.4.0 on the nodes, the agent says it uses the full filter exchange and
  still warms the standby.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest

from harness.agent import AgentProcess
from harness.cluster import Cluster, coverage, make_table, read

pytestmark = pytest.mark.oldest_newest

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
            time.sleep(2)  # the first sweeps' lists are behind us

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
