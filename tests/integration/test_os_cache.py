"""The page-cache tier (extension 0.9.0): what the primary's kernel caches of its relation
files, read into each failover candidate's page cache, never its shared_buffers.

Residency is measured with util-linux's fincore on the nodes' own files, not with pg_ccm's
counters. Both nodes run on one host but have their own files, so each file's pages in the
page cache are that node's: the standby's are dropped (vmtouch -e) to stand for a host that
never read them.

- A table larger than shared_buffers is read on the primary (a sequential scan through a ring
  of buffers: its pages end up in the page cache, not in shared_buffers). The agent makes the
  standby's page cache hold it, loading a fraction of it into shared_buffers; the agent's
  metrics and `status` say how much the standby holds.
- Above the standby's memory headroom (ccm.os_cache_min_free) nothing is read.
- What was read outlasts the standby's own churn: under a memory limit, the WAL of a large
  write streaming through the standby evicts its own pages, not the mirror.
- While a client session runs a query on the standby (its own readers), nothing is read (what
  it holds is still measured); once it ends, the standby catches up.
- The primary's list holds main forks of permanent relations only: not an unlogged table, a
  temporary one, or another fork.
- ccm_os_prefetch refuses to run on a primary and refuses malformed lists, with SQLSTATEs.
- WAL every reader has passed leaves the page cache: a standby's once replayed, a primary's
  once sent to the standby and past every logical slot's restart_lsn (not a physical slot's
  whose standby is away), a promoted standby's new WAL too; with ccm.os_cache_release_wal off
  the same WAL stays cached.
- A fast shutdown requested while the WAL release worker walks pg_wal is not held up by it.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

import psycopg
import pytest

from harness.agent import AgentProcess, run_agent_json
from harness.cgroups import MemoryCgroup, controller_available
from harness.cluster import Cluster, Node, make_table, read
from harness.logical import lsn_to_int, resident_bytes
from harness.wait import wait_for

# Slices of the whole data directory at once: the tests' clusters are small.
SCAN = ("SELECT list, complete FROM ccm_os_cached_blocks(0, 0, 0, -1, 1048576, 100000)")


def resident_share(node: Node, relpath: str) -> float:
    """Share of the pages of a relation's first segment file in the page cache (fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE",
                          str(node.datadir / relpath)], check=True, capture_output=True, text=True).stdout
    res, size = (int(v) for v in out.split())
    return res / size if size else 1.0


def cold_big_table(cluster, megabytes: int = 200) -> str:
    """A table four times larger than a quarter of shared_buffers (128 MB), read on the
    primary; the standby's copy dropped from the page cache. Returns its file's path."""
    primary, standby = cluster.primary, cluster.standby
    make_table(primary, "big", megabytes)
    read(primary, "big")
    relpath = primary.one("SELECT pg_relation_filepath('big')")
    primary.sql("CHECKPOINT")
    cluster.wait_caught_up()
    standby.sql("CHECKPOINT")
    standby.drop_os_cache()
    assert resident_share(primary, relpath) > 0.95
    assert resident_share(standby, relpath) < 0.05
    return relpath


def test_the_standby_page_cache_comes_to_hold_the_primarys(cluster, log_dir):
    primary, standby = cluster.primary, cluster.standby
    relpath = cold_big_table(cluster)
    member = f"127.0.0.1:{standby.port}"
    agent = AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="500ms").start()
    try:
        wait_for("the standby's page cache to hold the primary's table",
                 lambda: resident_share(standby, relpath) > 0.95, timeout=60, describe=agent.log)
        # Into the page cache, not through shared_buffers: what the agent loaded there (its
        # hot set and fill_room's colder blocks) is a fraction of the table.
        assert agent.metric("ccm_agent_blocks_loaded_total") < 0.5 * 200 * 128
        agent.wait_for(lambda: agent.metric(f'ccm_agent_os_cache_coverage_ratio{{node="{member}"}}', -1) >= 0.9,
                       "the agent's metric of the standby's page cache", timeout=60)
        assert agent.metric("ccm_agent_os_cache_primary_bytes") >= 200 * 2**20
        assert agent.metric(f'ccm_agent_os_cache_read_bytes_total{{node="{member}"}}') >= 0.9 * 200 * 2**20
    finally:
        agent.stop()
    status = run_agent_json("status", "--primary", primary.conninfo(), "--standby", standby.conninfo())
    [seen] = [s for s in status["standbys"] if s["name"] == member]
    assert status["os_cache_bytes"] >= 200 * 2**20
    assert seen["os_coverage"] >= 0.9, seen
    assert seen["os_held_bytes"] <= status["os_cache_bytes"]


def test_nothing_is_read_above_the_standbys_headroom(cluster, log_dir):
    primary, standby = cluster.primary, cluster.standby
    relpath = cold_big_table(cluster, megabytes=40)
    # More headroom than the host has memory: not one block may be read.
    standby.sql("ALTER SYSTEM SET ccm.os_cache_min_free = '1TB'")
    standby.sql("SELECT pg_reload_conf()")
    list_, _ = primary.sql(SCAN)[0]
    with standby.connect() as conn:
        row = conn.execute("SELECT requested, already_cached, advised, limited "
                           "FROM ccm_os_prefetch(%s)", [list_]).fetchone()
    requested, cached, advised, limited = row
    assert requested > 40 * 128 and advised == 0 and limited, row
    agent = AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="500ms").start()
    try:
        # Two passes: the first tried to read, the second found the same blocks missing.
        agent.wait_for(lambda: agent.metric("ccm_agent_os_cache_coverage_ratio", -1) >= 0,
                       "a pass over the primary's page cache", timeout=60)
        assert agent.metric("ccm_agent_os_cache_primary_bytes") >= 40 * 2**20
        assert agent.metric("ccm_agent_os_cache_coverage_ratio") < 0.05
        assert agent.metric("ccm_agent_os_cache_read_bytes_total") == 0
    finally:
        agent.stop()
    assert resident_share(standby, relpath) < 0.05


@pytest.mark.skipif(os.geteuid() != 0 or not controller_available("memory"),
                    reason="a memory limit for the standby needs root and the cgroup v1 memory controller")
def test_the_mirror_outlasts_the_standbys_own_churn(log_dir):
    # The standby's processes, shared_buffers and page cache within 640 MB: the mirrored table
    # (200 MB) fits, but not beside the WAL and the new table of a 200 MB write. Measured on
    # 18: with pages only advised, 6% of the mirror was left; read back twice, 92% on an idle
    # machine and 73% in a CI run with three other test workers beside it (the kernel
    # deactivates part of the active list as the inactive list refaults, and how much depends
    # on timing). Half separates the two: most of the mirror outlasts the write, or it does not.
    group = MemoryCgroup("pg_ccm_os_mirror", str(640 * 2**20))
    try:
        # The standby keeps the WAL it replayed cached (ccm.os_cache_release_wal off), so that
        # the mirror competes with it, as it did before that setting.
        cluster = Cluster(settings={"shared_buffers": "'128MB'", "max_wal_size": "'2GB'"},
                          standby_settings={"ccm.os_cache_min_free": "'32MB'", "ccm.os_cache_release_wal": "off"})
        cluster.standby.wrapper = group.wrapper
        try:
            cluster.create()
            standby = cluster.standby
            relpath = cold_big_table(cluster)
            agent = AgentProcess(cluster.primary.conninfo(), standby.conninfo(), log_dir, interval="500ms",
                                 extra=["--fill-room", "false"]).start()
            try:
                wait_for("the standby's page cache to hold the primary's table",
                         lambda: resident_share(standby, relpath) > 0.95, timeout=60, describe=agent.log)
            finally:
                agent.stop()
            make_table(cluster.primary, "churn", 200)
            cluster.wait_caught_up()
            standby.sql("CHECKPOINT")
            kept = resident_share(standby, relpath)
            assert kept > 0.5, (f"the standby kept {kept:.0%} of the mirrored table; its group holds "
                                f"{group.page_cache_mb():.0f} MB of page cache")
        finally:
            cluster.destroy()
    finally:
        group.remove()


def test_a_standbys_own_readers_come_first(cluster, log_dir):
    primary, standby = cluster.primary, cluster.standby
    relpath = cold_big_table(cluster, megabytes=40)
    member = f"127.0.0.1:{standby.port}"
    reader = standby.connect(autocommit=True)
    reader_pid = reader.info.backend_pid

    def read_for_long() -> None:
        with pytest.raises(psycopg.errors.QueryCanceled):
            reader.execute("SELECT pg_sleep(600)")

    query = threading.Thread(target=read_for_long, daemon=True)
    query.start()
    # Only the hot set in shared_buffers (the table, read through a ring, is not hot), and a
    # pass at once after one that read nothing, so that the catching up below is not a pause.
    agent = AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="500ms",
                         extra=["--fill-room", "false", "--os-cache-pause", "1s"]).start()
    try:
        agent.wait_for(lambda: agent.metric(f'ccm_agent_os_cache_waiting{{node="{member}"}}', -1) == 1,
                       "the page-cache tier to wait for the standby's reader", timeout=60)
        # What it holds is still measured: a pass completes and says it holds nothing.
        coverage = f'ccm_agent_os_cache_coverage_ratio{{node="{member}"}}'
        agent.wait_for(lambda: agent.metric(coverage, -1) >= 0, "a pass over the busy standby", timeout=60)
        assert agent.metric(coverage) < 0.05
        assert agent.metric(f'ccm_agent_os_cache_read_bytes_total{{node="{member}"}}') == 0
        assert resident_share(standby, relpath) < 0.05
        assert "reading into its page cache waits for them" in agent.log()
        standby.sql("SELECT pg_cancel_backend(%s)", [reader_pid])
        query.join(timeout=30)
        wait_for("the standby's page cache to hold the primary's table once its reader ended",
                 lambda: resident_share(standby, relpath) > 0.95, timeout=60, describe=agent.log)
        assert agent.metric(f'ccm_agent_os_cache_waiting{{node="{member}"}}') == 0
    finally:
        agent.stop()
        reader.close()


@pytest.mark.every_version
def test_the_primarys_list_holds_permanent_main_forks_only(cluster):
    primary = cluster.primary
    make_table(primary, "kept", 2)
    primary.sql("CREATE UNLOGGED TABLE scratch AS SELECT g, repeat('x', 200) AS pad FROM generate_series(1, 9000) g")
    primary.sql("VACUUM kept")  # a visibility map and a free space map
    primary.sql("CHECKPOINT")  # written out: every block of it in the page cache
    with primary.connect() as conn:
        conn.autocommit = True
        conn.execute("CREATE TEMP TABLE tmp AS SELECT g, repeat('x', 200) AS pad FROM generate_series(1, 9000) g")
        conn.execute("SELECT count(*) FROM kept")
        conn.execute("SELECT count(*) FROM scratch")
        conn.execute("SELECT count(*) FROM tmp")
        temp_node = conn.execute("SELECT pg_relation_filenode('tmp')").fetchone()[0]
        blocks = set()
        after = (0, 0, 0, -1)
        # Small slices, so that the cursor is exercised: a slice cut in a file goes on after it.
        for _ in range(100_000):
            row = conn.execute("SELECT list, last_spc, last_db, last_rel, last_block, complete, in_play "
                               "FROM ccm_os_cached_blocks(%s, %s, %s, %s, 64, 16)", after).fetchone()
            assert row[6] is True
            blocks |= set(conn.execute("SELECT reltablespace::int8, reldatabase::int8, relfilenode::int8, "
                                       "relforknumber, relblocknumber FROM ccm_unpack_block_list(%s)",
                                       [row[0]]).fetchall())
            if row[5]:
                break
            after = row[1:5]
    nodes = {name: primary.one("SELECT pg_relation_filenode(%s)", [name]) for name in ("kept", "scratch")}
    kept = {b for b in blocks if b[2] == nodes["kept"]}
    assert len(kept) == primary.one("SELECT pg_relation_size('kept') / 8192"), "every block of a table read"
    assert all(b[3] == 0 for b in blocks), "main forks only"
    assert not any(b[2] in (nodes["scratch"], temp_node) for b in blocks), "no unlogged or temporary relation"


@pytest.mark.every_version
def test_prefetch_refuses_a_primary_and_malformed_lists(cluster):
    primary, standby = cluster.primary, cluster.standby
    list_, _ = primary.sql(SCAN)[0]
    with pytest.raises(psycopg.Error) as refused:
        primary.sql("SELECT * FROM ccm_os_prefetch(%s)", [list_])
    assert refused.value.sqlstate == "55000", refused.value
    for bad in (b"", b"CCMB", b"XXXX" + list_[4:], list_[:-1] if len(list_) > 32 else list_[:20]):
        with pytest.raises(psycopg.Error) as malformed:
            standby.sql("SELECT * FROM ccm_os_prefetch(%s)", [bad])
        assert malformed.value.sqlstate and malformed.value.sqlstate[:2] in ("22", "54"), malformed.value
    for args in ("0, 0, 0, -1, 0, 1", "0, 0, 0, -1, 1, 0", "0, 0, 0, -1, 1048577, 1"):
        with pytest.raises(psycopg.Error) as bounded:
            primary.sql(f"SELECT * FROM ccm_os_cached_blocks({args})")
        assert bounded.value.sqlstate == "22023", bounded.value
    # Only the agent's role may call them.
    primary.sql("DROP ROLE IF EXISTS ccm_nobody")
    primary.sql("CREATE ROLE ccm_nobody LOGIN")
    for call in ("ccm_os_cached_blocks(0, 0, 0, -1, 1, 1)", "ccm_os_prefetch('')"):
        with pytest.raises(psycopg.Error) as denied:
            with primary.connect() as conn:
                conn.execute("SET ROLE ccm_nobody")
                conn.execute(f"SELECT * FROM {call}")
        assert denied.value.sqlstate == "42501", denied.value


SEGMENT = 16 * 2**20


def wal_cached_share(node: Node, start: int = 0, end: int = 2**64) -> float:
    """The share of the node's WAL segment files lying wholly between the LSNs `start` and `end`
    (any timeline) that the page cache holds (fincore); 0 when there are none."""
    cached = size = 0
    for path in (node.datadir / "pg_wal").iterdir():
        if not re.fullmatch(r"[0-9A-F]{24}(\.partial)?", path.name):
            continue
        segno = int(path.name[8:16], 16) * 256 + int(path.name[16:24], 16)
        if segno * SEGMENT < start or (segno + 1) * SEGMENT > end:
            continue
        try:
            cached += resident_bytes(path)
            size += path.stat().st_size
        except (subprocess.CalledProcessError, FileNotFoundError):
            pass  # removed meanwhile: none of it is cached any more
    return cached / size if size else 0.0


def position(node: Node, query: str) -> int:
    return lsn_to_int(node.one(f"SELECT ({query})::text"))


@pytest.mark.every_version
@pytest.mark.parametrize("release", ["on", "off"])
def test_wal_every_reader_has_passed_leaves_the_page_cache(release):
    # wal_keep_size keeps the segment files in pg_wal (neither removed nor recycled), so that
    # only pg_ccm can make them leave the page cache; the logical WAL cache, which maps and
    # locks the newest WAL for logical walsenders (pages no advice can drop), is off.
    with Cluster(settings={"shared_buffers": "'128MB'", "max_wal_size": "'1GB'", "wal_keep_size": "'1GB'",
                           "wal_level": "logical", "ccm.os_cache_release_wal": release,
                           "ccm.logical_wal_cache": 0}) as cluster:
        primary, standby = cluster.primary, cluster.standby
        # Decoding through a logical slot starts at its restart_lsn: the WAL after it stays.
        # A physical slot's standby that is away reads its WAL from storage when it comes back.
        held = position(primary, "SELECT lsn FROM pg_create_logical_replication_slot('decoding', 'pgoutput')")
        primary.sql("SELECT pg_create_physical_replication_slot('away', true)")
        make_table(primary, "written", 96)
        cluster.wait_caught_up()
        replayed = position(standby, "SELECT pg_last_wal_replay_lsn()")
        assert replayed - held > 64 * 2**20
        if release == "on":
            wait_for("the WAL the standby replayed to leave its page cache",
                     lambda: wal_cached_share(standby, end=replayed) < 0.05, timeout=30)
        else:
            time.sleep(3)
            assert wal_cached_share(standby, end=replayed) > 0.8, "without pg_ccm the replayed WAL stays cached"
        kept = wal_cached_share(primary, held, replayed)
        assert kept > 0.8, f"the primary kept {kept:.0%} of the WAL after a logical slot's restart_lsn"
        primary.sql("SELECT pg_drop_replication_slot('decoding')")
        sent = position(primary, "SELECT min(sent_lsn) FROM pg_stat_replication")
        if release == "on":
            wait_for("the WAL every reader has passed to leave the primary's page cache",
                     lambda: wal_cached_share(primary, end=sent) < 0.05, timeout=30)
            standby.promote()
            promoted = position(standby, "SELECT pg_current_wal_lsn()")
            make_table(standby, "written_after", 48)
            flushed = position(standby, "SELECT pg_current_wal_flush_lsn()")
            wait_for("the new primary's own WAL to leave its page cache",
                     lambda: wal_cached_share(standby, promoted, flushed) < 0.05, timeout=30)
        else:
            assert wal_cached_share(primary, end=sent) > 0.8


WALK_FAILPOINT = "pg_ccm failpoint: the WAL release worker sleeps"


@pytest.mark.every_version
def test_a_fast_shutdown_is_not_held_up_by_the_wal_release_worker():
    # The test build's failpoint makes the WAL release worker sleep 3 s before each walk of
    # pg_wal and say so in the log; the fast shutdown is requested during that sleep, so the
    # walk that follows, over the segment files below the flush, asks at each file whether to
    # stop. Asked through pgrx's sigterm_received() (the first version), that consumed the
    # request: the main loop's wait_latch no longer saw it, and the postmaster waited for the
    # worker forever (a CI rehearsal's pg_ctl stop timed out that way, on PostgreSQL 15).
    with Cluster(settings={"ccm.test_wal_release_delay_ms": 3000}) as cluster:
        primary = cluster.primary
        primary.sql("CREATE TABLE walked (id int)")
        for number in range(6):
            primary.sql(f"INSERT INTO walked VALUES ({number})")
            primary.sql("SELECT pg_switch_wal()")
        cluster.wait_caught_up()
        offset = primary.log_size()
        wait_for("the WAL release worker to be about to walk pg_wal",
                 lambda: primary.log_lines_since(offset, WALK_FAILPOINT), timeout=30, interval=0.05)
        primary.stop(timeout=30)  # raises, with the processes still running, if it does not stop
