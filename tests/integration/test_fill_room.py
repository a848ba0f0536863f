"""fill_room: a standby that holds the primary's whole hot set and still has unused buffers
is also sent the primary's colder cached blocks, hottest first, into those buffers only.

A real primary and standby (shared_buffers 128MB each, 16384 buffers). The primary caches a
small hot table (usage 5) and a cold set larger than the standby's room (usage 1); the
standby, restarted cold, reads a table of its own first. Everything is measured with
pg_buffercache on both nodes. With fill_room off, the colder blocks stay on the primary
only: the same test against the agent without the fill step fails its first assertion.
"""

from __future__ import annotations

import pytest

from harness.agent import AgentProcess
from harness.cluster import Cluster, coverage, make_table, read

# Each table stays under a quarter of shared_buffers, so that a sequential scan caches it
# in ordinary buffers (usage 1) instead of a 256 kB ring.
COLD_TABLES = 5
TABLE_MB = 22
HOT_MB = 4
STANDBY_OWN_MB = 22
# The agent leaves 1/64 of the buffers unused (sync.rs FILL_RESERVE_DIVISOR).
RESERVE_DIVISOR = 64


def blocks_of(node, table: str) -> set:
    filenode = node.one(f"SELECT pg_relation_filenode('{table}')::int8")
    return {tag for tag in node.cached_blocks() if tag[2] == filenode}


def unused_buffers(node) -> int:
    return node.one("SELECT count(*) FROM pg_buffercache WHERE relfilenode IS NULL")


@pytest.mark.parametrize("fill_room", ["true", "false"])
def test_colder_blocks_fill_only_the_standbys_unused_buffers(fill_room, log_dir):
    with Cluster(settings={"shared_buffers": "'128MB'"}) as cluster:
        primary, standby = cluster.primary, cluster.standby
        make_table(primary, "hot", HOT_MB)
        make_table(primary, "standby_own", STANDBY_OWN_MB)
        for i in range(COLD_TABLES):
            make_table(primary, f"cold_{i}", TABLE_MB)
        # Rewritten compactly and frozen: no empty pages past the data (16+ extends relations
        # by several pages, which exist on the primary only until WAL writes them, so a scan
        # makes them hot there and the standby can never hold them), and no hint bits left
        # for the reads below to set (with wal_log_hints replay would cache those pages).
        primary.sql("VACUUM (FULL, FREEZE)")
        primary.sql("ANALYZE")  # and no autovacuum later
        # Empty caches on both nodes: CREATE TABLE AS left its write rings' buffers behind,
        # and replay cached the new pages on the standby.
        primary.restart()
        cluster.make_standby_cold()

        # The standby's own read workload, before the agent: none of it may be evicted.
        read(standby, "standby_own")
        own = blocks_of(standby, "standby_own")
        assert len(own) > 0.9 * STANDBY_OWN_MB * 128, f"the standby cached {len(own)} blocks of its own table"

        # Colder first, then hot: the primary has room for all of it, so no clock sweep
        # lowers the hot table's usage counts.
        for i in range(COLD_TABLES):
            read(primary, f"cold_{i}")
        read(primary, "hot", times=6)
        # Replay caches what the reads WAL-logged (hint bits the freeze could not set yet).
        cluster.wait_caught_up()
        before = standby.cached_blocks()
        # The primary's colder blocks the standby lacks: only fill_room can bring them.
        colder = primary.cached_blocks(min_usage=1) - primary.cached_blocks(min_usage=4) - before
        buffers = standby.one("SELECT setting::int FROM pg_settings WHERE name = 'shared_buffers'")
        room = buffers - len(before) - buffers // RESERVE_DIVISOR
        assert len(colder) > room, f"the colder set ({len(colder)}) must be larger than the standby's room ({room})"

        with AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="300ms",
                          extra=["--fill-room", fill_room]) as agent:
            standby.wait_until(lambda: coverage(primary, standby)[0] >= 0.99, "the hot set on the standby", timeout=30)
            # Filling takes a few cycles; then the standby's unused buffers stop shrinking.
            previous = [None]

            def settled() -> bool:
                now = unused_buffers(standby)
                done, previous[0] = now == previous[0], now
                return done

            standby.wait_until(settled, "the standby's unused buffers to settle", timeout=60, interval=2.0)
            filled = agent.metric("ccm_agent_fill_blocks_loaded_total")

        on_standby = standby.cached_blocks()
        colder_there = len(colder & on_standby)
        unused = unused_buffers(standby)
        if fill_room == "false":
            assert filled == 0
            assert colder_there < 0.1 * len(colder), f"{colder_there} of {len(colder)} colder blocks sent without fill_room"
            return
        assert colder_there > 0.8 * min(room, len(colder)), (
            f"only {colder_there} of {len(colder)} colder blocks on the standby, room for about {room}\n{agent.log()[-3000:]}")
        assert filled >= 0.8 * colder_there
        # Only unused buffers were filled: all the standby held before (its own reads among
        # it) is still there, and the reserve stays free (less what replay took meanwhile).
        assert before <= on_standby, f"{len(before - on_standby)} of the standby's blocks were evicted"
        assert unused >= buffers // RESERVE_DIVISOR // 2, f"{unused} unused buffers left, the reserve is {buffers // RESERVE_DIVISOR}"
        assert coverage(primary, standby)[0] >= 0.99
