"""Failovers and agent faults: the agent follows the topology and never harms replication."""

from __future__ import annotations

import signal
import time

import pytest

from harness.agent import AgentProcess
from harness.cluster import Cluster, coverage, pgbench

from test_warmup import wait_for_coverage, warm_primary


@pytest.mark.smoke
def test_agent_follows_a_failover_and_warms_the_rejoined_old_primary(cluster, load_factory, log_dir):
    old_primary, old_standby = cluster.primary, cluster.standby
    load = warm_primary(load_factory, cluster)
    primary_side = cluster.both_nodes_conninfo("read-write")
    standby_side = cluster.both_nodes_conninfo("standby")
    with AgentProcess(primary_side, standby_side, log_dir, interval="300ms") as agent:
        assert wait_for_coverage(cluster, 0.99, timeout=10)[0] >= 0.99

        # The primary dies; the standby is promoted.
        load.stop()
        old_primary.kill()
        old_standby.promote()
        slot = cluster.reserve_wal_for_rejoin(old_standby)
        agent.wait_for(lambda: "promoted" in agent.log() or "looking for a new" in agent.log(), "the agent to notice the failover")
        time.sleep(2)
        assert agent.alive()
        errors_while_alone = agent.metric("ccm_agent_cycle_errors_total")

        # The old primary comes back as a standby of the new one (pg_rewind); the agent,
        # not restarted nor reconfigured, warms it from the new primary.
        cluster.rejoin_as_standby(old_primary, old_standby, slot=slot)
        cluster.primary, cluster.standby = old_standby, old_primary
        cluster.wait_caught_up()
        cluster.make_standby_cold()
        warm_primary(load_factory, cluster)
        fraction, elapsed, hot = wait_for_coverage(cluster, 0.99, timeout=20)
        assert fraction >= 0.99, f"rejoined old primary: {fraction:.1%} of {hot} after {elapsed:.1f}s\n{agent.log()[-3000:]}"
        assert agent.metric("ccm_agent_retargets_total") >= 1
        # While no standby existed, the agent backed off instead of spinning.
        assert errors_while_alone < 50, errors_while_alone


def test_killing_the_agent_mid_cycle_harms_nothing(cluster, load_factory, log_dir):
    cluster.make_standby_cold()
    warm_primary(load_factory, cluster)
    agent = AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval="100ms", extra=["--batch-blocks", "256"]).start()
    agent.wait_for(lambda: agent.metric("ccm_agent_blocks_loaded_total") > 0, "the first blocks")
    agent.stop(signal.SIGKILL)

    # Replication carries on, the workload never noticed, and nothing of the agent's stays.
    result = pgbench(cluster.primary, "-b", "tpcb-like", "-c", "2", "-T", "3", "-n")
    assert "number of failed transactions: 0 " in result.stdout, result.stdout
    cluster.wait_caught_up(timeout=30)
    for node in (cluster.primary, cluster.standby):
        node.wait_until(
            lambda node=node: node.one("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ccm-agent'") == 0,
            "the agent's sessions to end",
            timeout=30,
        )
    assert cluster.primary.one("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE a.application_name = 'ccm-agent'") == 0

    # A new agent picks up where the old one stopped.
    with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval="300ms"):
        assert wait_for_coverage(cluster, 0.99, timeout=10)[0] >= 0.99


def test_agent_waits_for_a_dead_primary_without_spinning(cluster, load_factory, log_dir):
    warm_primary(load_factory, cluster).stop()
    with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval="200ms") as agent:
        assert wait_for_coverage(cluster, 0.99, timeout=10)[0] >= 0.99
        cluster.primary.kill()
        time.sleep(1)
        before = agent.metric("ccm_agent_cycle_errors_total")
        time.sleep(8)
        during = agent.metric("ccm_agent_cycle_errors_total") - before
        assert agent.alive()
        # 200 ms cycles would make 40 attempts in 8 s; backoff (doubling to 2 s) makes a handful.
        assert 1 <= during <= 12, f"{during} failed attempts in 8 s"
        assert agent.metric("ccm_agent_node_up{side=\"primary\"}") == 0

        cluster.primary.start()
        cycles = agent.metric("ccm_agent_cycles_total")
        agent.wait_for(lambda: agent.metric("ccm_agent_cycles_total") > cycles + 3, "cycles once the primary is back", timeout=20)
        fraction, _ = coverage(cluster.primary, cluster.standby)
        assert fraction >= 0.9


def test_old_primary_rejoins_after_more_wal_than_wal_keep_size():
    """pg_rewind reads the old primary's WAL back from the divergence to the last checkpoint
    before it; the crash recovery before it must not recycle those segments, however much
    WAL the old primary wrote since that checkpoint."""
    with Cluster(settings={"shared_buffers": "'128MB'", "wal_keep_size": "'16MB'", "max_wal_size": "'1GB'"}) as cluster:
        old_primary, old_standby = cluster.primary, cluster.standby
        old_primary.sql("CHECKPOINT")
        # About 60 MB of WAL after the last checkpoint, four times wal_keep_size.
        pgbench(old_primary, "-i", "-s", "4", "-q")
        cluster.wait_caught_up()
        old_primary.kill()
        old_standby.promote()
        slot = cluster.reserve_wal_for_rejoin(old_standby)
        old_standby.sql("CREATE TABLE after_failover AS SELECT 1 AS written_on_the_new_timeline")

        cluster.rejoin_as_standby(old_primary, old_standby, slot=slot)
        cluster.primary, cluster.standby = old_standby, old_primary
        cluster.wait_caught_up()
        assert old_primary.one("SELECT pg_is_in_recovery()") is True
        assert old_primary.one("SELECT written_on_the_new_timeline FROM after_failover") == 1
