"""max_replay_lag: warming a standby whose replay is behind waits for replay.

A real primary and standby. Replay on the standby is paused (pg_wal_replay_pause()) while the
primary writes, so the standby has received WAL it has not replayed: its replay lag is real,
read by the agent after every batch. Above max_replay_lag (16MB by default) the agent loads at
most one batch per cycle; once replay resumes it finishes. Warmth is measured with
pg_buffercache on both nodes.
"""

from __future__ import annotations

import pytest

from harness.agent import AgentProcess
from harness.cluster import coverage

from test_warmup import wait_hot

# The agent reads replay lag from pg_stat_replication and pg_last_wal_replay_lsn(), the same on
# every supported version: scripts/test.sh runs this on the newest only.
pytestmark = pytest.mark.agent_only

BATCH = 64


def lag_bytes(standby) -> int:
    return standby.one("SELECT pg_wal_lsn_diff(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::int8")


def cold_standby_far_behind(cluster, load_factory) -> int:
    """A cold standby, a hot set on the primary, and then 32 MB of WAL the standby received
    but has not replayed (replay paused). Returns the hot set's size."""
    primary, standby = cluster.primary, cluster.standby
    cluster.make_standby_cold()
    load = load_factory(primary, seconds=600)
    wait_hot(primary)
    load.stop()
    standby.sql("SELECT pg_wal_replay_pause()")
    primary.sql("CREATE TABLE wal_filler AS SELECT g, repeat('x', 500) AS pad FROM generate_series(1, 80000) g")
    standby.wait_until(lambda: lag_bytes(standby) > 32 << 20, "32 MB of WAL received and not replayed", timeout=60)
    return coverage(primary, standby)[1]


def test_warming_waits_for_replay_above_max_replay_lag(cluster, load_factory, log_dir):
    primary, standby = cluster.primary, cluster.standby
    hot = cold_standby_far_behind(cluster, load_factory)
    assert hot > 20 * BATCH, f"the read load should make a hot set, got {hot} buffers"

    with AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="300ms",
                      extra=["--batch-blocks", str(BATCH), "--fill-room", "false"]) as agent:
        agent.wait_for(lambda: agent.metric("ccm_agent_cycles_total") >= 10, "ten cycles")
        cycles = agent.metric("ccm_agent_cycles_total")
        loaded = agent.metric("ccm_agent_blocks_loaded_total")
        # One batch per cycle at most while replay is behind (the first cycle's included).
        assert 0 < loaded <= (cycles + 1) * BATCH, f"{loaded} blocks in {cycles} cycles"
        assert agent.metric("ccm_agent_replay_lag_pauses_total") >= cycles - 2
        assert "warming it waits for replay" in agent.log()
        assert coverage(primary, standby)[0] < 0.9

        standby.sql("SELECT pg_wal_replay_resume()")
        standby.wait_until(lambda: coverage(primary, standby)[0] >= 0.99, "the hot set once replay caught up",
                           timeout=60, interval=0.5)
        agent.wait_for(lambda: "caught up; warming it again" in agent.log(), "the agent to say so")


def test_max_replay_lag_off_warms_regardless(cluster, load_factory, log_dir):
    primary, standby = cluster.primary, cluster.standby
    cold_standby_far_behind(cluster, load_factory)
    try:
        with AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="300ms",
                          extra=["--batch-blocks", str(BATCH), "--fill-room", "false", "--max-replay-lag", "off"]) as agent:
            standby.wait_until(lambda: coverage(primary, standby)[0] >= 0.99, "the hot set despite the lag", timeout=30,
                               interval=0.5)
            assert agent.metric("ccm_agent_replay_lag_pauses_total") == 0
    finally:
        standby.sql("SELECT pg_wal_replay_resume()")
