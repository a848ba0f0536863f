"""Faults the loop must survive: restarts, relations vanishing mid-sync, a foreign standby,
CCM switched off. Nothing here may harm replication or leave stale buffers behind."""

from __future__ import annotations

import random
import time

import pytest

from harness.agent import AgentProcess
from harness.cluster import Cluster, coverage

from test_warmup import wait_for_coverage, warm_primary


def test_agent_survives_standby_and_primary_restarts(cluster, load_factory, log_dir):
    warm_primary(load_factory, cluster)
    with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval="300ms") as agent:
        assert wait_for_coverage(cluster, 0.99, timeout=10)[0] >= 0.99

        # Standby restart: its cache is gone; the agent reconnects and warms it again.
        cluster.make_standby_cold()
        cold, _ = coverage(cluster.primary, cluster.standby)
        fraction, elapsed, hot = wait_for_coverage(cluster, 0.99, timeout=20)
        assert fraction >= 0.99, f"after standby restart: {cold:.1%} -> {fraction:.1%} of {hot} in {elapsed:.1f}s"
        assert agent.alive()

        # Primary restart: the agent waits for it, then carries on with the new hot set.
        cycles = agent.metric("ccm_agent_cycles_total")
        cluster.primary.restart()
        cluster.wait_caught_up()
        warm_primary(load_factory, cluster)
        agent.wait_for(lambda: agent.metric("ccm_agent_cycles_total") >= cycles + 5, "cycles after the primary restart")
        fraction, elapsed, hot = wait_for_coverage(cluster, 0.99, timeout=10)
        assert fraction >= 0.99, f"after primary restart: {fraction:.1%} of {hot}"
        assert agent.metric("ccm_agent_cycle_errors_total") > 0, "the restarts should have been noticed"
        assert agent.alive()
    assert agent.process.returncode == 0, "SIGTERM is a clean exit"


def relfilenode(node, table: str) -> int:
    return node.one("SELECT pg_relation_filenode(%s::regclass)::int8", [table])


def standby_buffers_of(cluster, relfilenodes: list[int]) -> int:
    return cluster.standby.one(
        "SELECT count(*) FROM pg_buffercache WHERE relfilenode = ANY(%s::oid[])", [relfilenodes]
    )


@pytest.mark.every_version
@pytest.mark.smoke
def test_drop_and_truncate_during_sync_leave_no_error_and_no_stale_buffers(cluster, log_dir):
    rng = random.Random(20261122)
    dead: list[int] = []
    with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval="50ms") as agent:
        for round_ in range(8):
            with cluster.primary.connect() as conn:
                conn.execute("DROP TABLE IF EXISTS t_drop, t_trunc")
                conn.execute("CREATE TABLE t_drop AS SELECT g, repeat('d', 300) AS pad FROM generate_series(1, 30000) g")
                conn.execute("CREATE TABLE t_trunc AS SELECT g, repeat('t', 300) AS pad FROM generate_series(1, 30000) g")
                for _ in range(5):  # usage count 5: hot
                    conn.execute("SELECT count(*) FROM t_drop")
                    conn.execute("SELECT count(*) FROM t_trunc")
            old = [relfilenode(cluster.primary, "t_drop"), relfilenode(cluster.primary, "t_trunc")]
            # Let the lists naming these blocks get under way, then pull the files from under them.
            time.sleep(rng.uniform(0.0, 0.4))
            cluster.primary.sql("DROP TABLE t_drop")
            cluster.primary.sql("TRUNCATE t_trunc")
            dead.extend(old)
            cluster.wait_caught_up()
        cycles = agent.metric("ccm_agent_cycles_total")
        agent.wait_for(lambda: agent.metric("ccm_agent_cycles_total") >= cycles + 5, "five more cycles")
        assert standby_buffers_of(cluster, dead) == 0, "buffers of dropped relfilenodes stayed on the standby"
        assert agent.metric("ccm_agent_blocks_loaded_total") > 0
        errors = {k: v for k, v in agent.metrics().items() if k.startswith("ccm_agent_cycle_errors_total") and v}
        assert not errors, f"cycle errors: {errors}\n{agent.log()[-3000:]}"
        # Read while the agent runs: at its shutdown it cancels the call in flight, whose
        # "canceling statement due to user request" is no error of the sync.
        standby_log = cluster.standby.logfile.read_text(errors="replace")
    assert "ccm-agent ERROR" not in standby_log and "PANIC" not in standby_log, standby_log[-3000:]


def test_agent_never_warms_a_standby_of_another_system(cluster, log_dir):
    with Cluster() as other:
        with AgentProcess(cluster.primary.conninfo(), other.standby.conninfo(), log_dir, interval="200ms") as agent:
            agent.wait_for(lambda: agent.metric("ccm_agent_cycle_errors_total") >= 2, "the safety check to refuse")
            assert agent.metric("ccm_agent_blocks_sent_total") == 0
            assert agent.metric("ccm_agent_cycles_total") == 0
            assert "system identifier" in agent.log()
            assert agent.alive()


def test_disabled_ccm_idles_the_agent_and_resumes(cluster, load_factory, log_dir):
    cluster.primary.sql("ALTER SYSTEM SET ccm.enabled = off")
    cluster.primary.sql("SELECT pg_reload_conf()")
    time.sleep(0.5)
    with cluster.primary.connect() as conn:
        with pytest.raises(Exception) as raised:
            conn.execute("SELECT * FROM aurora_ccm_status()")
    assert raised.value.diag.message_primary == "Cluster Cache Manager is disabled"
    assert raised.value.sqlstate == "55000"

    cluster.make_standby_cold()
    warm_primary(load_factory, cluster)
    with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval="200ms") as agent:
        agent.wait_for(lambda: "ccm_agent_enabled" in "".join(agent.metrics()) and agent.metric("ccm_agent_enabled") == 0, "the agent to notice")
        time.sleep(1)
        assert agent.metric("ccm_agent_blocks_sent_total") == 0
        cluster.primary.sql("ALTER SYSTEM RESET ccm.enabled")
        cluster.primary.sql("SELECT pg_reload_conf()")
        fraction, elapsed, hot = wait_for_coverage(cluster, 0.99, timeout=15)
        assert fraction >= 0.99, f"after re-enabling: {fraction:.1%} of {hot}"
        assert agent.metric("ccm_agent_enabled") == 1
