"""The logical WAL cache on a live primary: real slots (test_decoding through pg_recvlogical
and the SQL functions, pgoutput through a real subscription), real WAL from pgbench.

Counting, as the README defines it: a slot consumes a WAL page when its decoding position
first passes the page's start; the page is a hit when the cache held it at the start of the
10 ms tick in which the slot consumed it."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.cgroups import BlkioThrottle, MemoryCgroup, controller_available, data_device
from harness.cluster import Cluster, Node, pgbench, run_pg
from harness.logical import (PAGE, Recvlogical, lsn_to_int, pages_between, resident_bytes,
                             wal_cache_row, wal_cache_status)

# The extension's own code paths: on every version, the assertion-enabled one included.
pytestmark = pytest.mark.every_version

LOGICAL = {"wal_level": "logical", "max_wal_size": "'1GB'", "checkpoint_timeout": "'30min'"}


@contextmanager
def primary_only(cache: str | None = None, memlock: str | None = None, ipc_lock: bool = False, **settings):
    """A primary without standby, wal_level=logical, with the given cache size."""
    extra = {**LOGICAL, **settings}
    if cache is not None:
        extra["ccm.logical_wal_cache"] = cache
    cluster = Cluster(settings=extra)
    cluster.primary.memlock = memlock
    cluster.primary.ipc_lock = ipc_lock
    try:
        cluster.create(extensions=("pg_ccm",), standby=False)
        wait_for_worker(cluster.primary, expect=cache != "0")
        yield cluster.primary
    finally:
        cluster.destroy()


def wait_for_worker(node: Node, expect: bool = True) -> None:
    if expect:
        node.wait_until(lambda: wal_cache_status(node)["oldest_ptr"] is not None, "the WAL cache worker", timeout=30)


def worker_processes(node: Node) -> list[str]:
    """Command lines of the postmaster's children that are our worker."""
    out = subprocess.run(["ps", "--ppid", str(node.postmaster_pid()), "-o", "args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pg_ccm logical WAL cache" in line]


def current_lsn(node: Node) -> str:
    return node.one("SELECT pg_current_wal_lsn()::text")


def wait_counted(node: Node, slot: str, pages: int, timeout: float = 60) -> dict:
    """Waits until the worker has counted at least `pages` WAL pages for the slot, and
    returns its row. The worker counts a tick after the slot moves; under load a tick can
    come later than the 10 ms it is due, so the tests wait for the count, not for a time."""
    node.wait_until(lambda: (wal_cache_row(node, slot) or {}).get("blks_read", 0) >= pages,
                    f"{pages} pages counted for slot {slot}", timeout=timeout)
    return wal_cache_row(node, slot)


def confirmed_flush(node: Node, slot: str) -> str:
    return node.one("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", [slot])


def wait_slot_at(node: Node, slot: str, position: str) -> None:
    node.wait_until(lambda: lsn_to_int(confirmed_flush(node, slot)) >= lsn_to_int(position), f"slot {slot} at {position}")


def write_wal(node: Node, since: str, pages: int, timeout: float = 120) -> None:
    """Runs pgbench's TPC-B transactions in rounds of 500 until `pages` WAL pages follow
    `since`: a volume of WAL, not a time, however fast this machine runs them."""
    def written() -> bool:
        pgbench(node, "-c", "2", "-j", "2", "-t", "250", "-n")
        return pages_between(since, node.one("SELECT pg_current_wal_insert_lsn()::text")) > pages

    node.wait_until(written, f"{pages} pages of WAL after {since}", timeout=timeout)


@pytest.mark.smoke
def test_a_consumer_that_keeps_up_is_served_from_the_cache():
    with primary_only() as primary:
        pgbench(primary, "-i", "-s", "2", "-q")
        created = primary.one("SELECT lsn::text FROM pg_create_logical_replication_slot('cdc', 'test_decoding')")
        consumer = Recvlogical(primary, "cdc")
        try:
            primary.wait_until(lambda: wal_cache_row(primary, "cdc")["active_pid"] is not None, "pg_recvlogical to attach")
            write_wal(primary, created, 400)
            position = current_lsn(primary)
            wait_slot_at(primary, "cdc", position)
            row = wait_counted(primary, "cdc", pages_between(created, position) - 2)
            sent = primary.one("SELECT sent_lsn::text FROM pg_stat_replication WHERE application_name = 'pg_recvlogical'")
            walsender = primary.one("SELECT pid FROM pg_stat_replication WHERE application_name = 'pg_recvlogical'")
        finally:
            consumer.stop()
    written = pages_between(created, sent)
    assert written > 300, "pgbench should have written a few MB of WAL"
    # Every page from the slot's creation to what the walsender sent, counted once.
    assert abs(row["blks_read"] - written) <= 2, (row, written)
    assert row["blks_read"] == row["cache_hit"] + row["cache_miss"]
    assert row["cache_miss"] <= written // 100, row
    assert float(row["hit_rate"].rstrip("%")) >= 99.0, row
    assert re.fullmatch(r"\d{1,3}\.\d\d%", row["hit_rate"])
    assert row["active_pid"] == walsender


def test_a_consumer_that_falls_behind_misses_what_left_the_cache():
    cache_pages = 128  # 1 MB
    with primary_only(cache=str(cache_pages)) as primary:
        pgbench(primary, "-i", "-s", "2", "-q")
        created = primary.one("SELECT lsn::text FROM pg_create_logical_replication_slot('late', 'test_decoding')")

        def far_behind() -> bool:
            # Rounds of 20,000 history rows (about 2 MB of WAL each) until the slot is 8 MB
            # behind, far beyond the 1 MB cache: a volume, not a time (120 s of pgbench on a
            # loaded CI machine once wrote less than 8 MB).
            primary.sql("INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) "
                        "SELECT 1, 1, g, g, now() FROM generate_series(1, 20000) g")
            return pages_between(created, primary.one("SELECT pg_current_wal_insert_lsn()::text")) > 8 * cache_pages

        primary.wait_until(far_behind, "8 MB of WAL past the slot", timeout=120)
        # The cache holds the pages behind the flush position. With synchronous_commit off,
        # the WAL writer flushes pgbench's last WAL up to 200 ms later (wal_writer_delay; 85
        # pages seen on 17), moving the window on: wait for it before reading the window.
        inserted = primary.one("SELECT pg_current_wal_insert_lsn()::text")
        primary.wait_until(lambda: lsn_to_int(primary.one("SELECT pg_current_wal_flush_lsn()::text")) >= lsn_to_int(inserted),
                           "pgbench's WAL to be flushed")
        primary.wait_until(lambda: lsn_to_int(wal_cache_status(primary)["newest_ptr"]) >= lsn_to_int(inserted) - PAGE,
                           "the cache's window to reach the flushed WAL")
        oldest_before = primary.one("SELECT get_oldest_wal_cache_ptr()::text")
        primary.sql("SELECT count(*) FROM pg_logical_slot_get_changes('late', NULL, NULL)")
        confirmed = confirmed_flush(primary, "late")
        row = wait_counted(primary, "late", pages_between(created, confirmed))
    consumed = pages_between(created, confirmed)
    held_when_read = pages_between(oldest_before, confirmed)
    assert consumed > 4 * cache_pages
    assert row["blks_read"] == consumed, (row, consumed)
    # The pages the cache held when the slot read them are hits, the rest misses. The
    # window may move on by a few pages of background WAL between our reading of its
    # start and the decoding.
    assert cache_pages - 8 <= row["cache_hit"] <= held_when_read + 8, (row, held_when_read)
    assert row["cache_miss"] == consumed - row["cache_hit"]
    assert row["active_pid"] is None


def test_a_pgoutput_subscription_that_keeps_up_is_served_from_the_cache():
    with primary_only() as primary:
        pgbench(primary, "-i", "-s", "1", "-q")
        primary.sql("CREATE PUBLICATION bench FOR TABLE pgbench_accounts, pgbench_branches, pgbench_tellers, pgbench_history")
        subscriber_cluster = Cluster(settings={"shared_preload_libraries": "''"})
        subscriber = subscriber_cluster.primary
        try:
            subscriber_cluster.init_primary(subscriber)
            subscriber.start()
            pgbench(subscriber, "-i", "-I", "dtp", "-s", "1", "-q")  # the tables, empty
            subscriber.sql(f"CREATE SUBSCRIPTION bench CONNECTION '{primary.conninfo()}' PUBLICATION bench WITH (copy_data = false)")
            primary.wait_until(lambda: (wal_cache_row(primary, "bench") or {}).get("active_pid"), "the subscription's walsender")
            write_wal(primary, primary.one("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'bench'"), 400)
            source = primary.one("SELECT count(*) FROM pgbench_history")
            # The apply worker reports what it received as its replay position (worker.c,
            # send_feedback), so wait for the rows themselves; a lost row times out here.
            subscriber.wait_until(
                lambda: subscriber.one("SELECT count(*) FROM pgbench_history") == source,
                "the subscriber to apply every insert")
            row = wait_counted(primary, "bench", 301)
            walsender = primary.one("SELECT pid FROM pg_stat_replication WHERE application_name = 'bench'")
            applied = subscriber.one("SELECT count(*) FROM pgbench_history")
        finally:
            subscriber_cluster.destroy()
    assert applied == source > 0, "the subscription applied the inserts"
    assert row["blks_read"] > 300
    assert row["cache_miss"] <= row["blks_read"] // 100, row
    assert row["active_pid"] == walsender


def test_reset_and_unknown_slots():
    with primary_only(cache="256") as primary:
        pgbench(primary, "-i", "-s", "1", "-q")
        for slot in ("one", "two"):
            primary.sql("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", [slot])
        pgbench(primary, "-c", "1", "-T", "1", "-n")
        for slot in ("one", "two"):
            primary.sql("SELECT count(*) FROM pg_logical_slot_get_changes(%s, NULL, NULL)", [slot])
        before = {slot: wait_counted(primary, slot, 1) for slot in ("one", "two")}
        assert all(row["blks_read"] > 0 for row in before.values()), before

        assert primary.one("SELECT aurora_stat_reset_wal_cache('one')") == "Reset the logical wal cache counter."
        one, two = wal_cache_row(primary, "one"), wal_cache_row(primary, "two")
        assert (one["cache_hit"], one["cache_miss"], one["blks_read"], one["hit_rate"]) == (0, 0, 0, None)
        assert one["last_reset_timestamp"] > before["one"]["last_reset_timestamp"]
        assert two == before["two"], "only the named slot is reset"

        assert primary.one("SELECT aurora_stat_reset_wal_cache('nosuchslot')") == "Replication slot not found. Please try again."
        primary.sql("SELECT pg_create_physical_replication_slot('physical')")
        assert primary.one("SELECT aurora_stat_reset_wal_cache('physical')") == "Replication slot not found. Please try again."
        assert wal_cache_row(primary, "physical") is None, "only logical slots are listed"

        assert primary.one("SELECT aurora_stat_reset_wal_cache(NULL)") == "Reset the logical wal cache counter."
        assert wal_cache_row(primary, "two")["blks_read"] == 0

        # Counting goes on after a reset.
        pgbench(primary, "-c", "1", "-T", "1", "-n")
        primary.sql("SELECT count(*) FROM pg_logical_slot_get_changes('one', NULL, NULL)")
        wait_counted(primary, "one", 1)

        # Not for PUBLIC; reading is for pg_monitor.
        primary.sql("CREATE ROLE watcher LOGIN; GRANT pg_monitor TO watcher; CREATE ROLE nobody LOGIN")
        with primary.connect(user="watcher") as conn:
            assert conn.execute("SELECT count(*) FROM aurora_stat_logical_wal_cache()").fetchone()[0] == 2
            assert conn.execute("SELECT get_oldest_wal_cache_ptr() IS NOT NULL").fetchone()[0]
        import psycopg
        with primary.connect(user="nobody") as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM aurora_stat_logical_wal_cache()")
        with primary.connect(user="watcher") as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT aurora_stat_reset_wal_cache(NULL)")


def test_a_dropped_slot_disappears_and_a_new_one_starts_from_zero():
    with primary_only(cache="256") as primary:
        pgbench(primary, "-i", "-s", "1", "-q")
        primary.sql("SELECT pg_create_logical_replication_slot('gone', 'test_decoding')")
        pgbench(primary, "-c", "1", "-T", "1", "-n")
        primary.sql("SELECT count(*) FROM pg_logical_slot_get_changes('gone', NULL, NULL)")
        first = wait_counted(primary, "gone", 1)
        primary.sql("SELECT pg_drop_replication_slot('gone')")
        assert wal_cache_row(primary, "gone") is None
        time.sleep(0.1)
        primary.sql("SELECT pg_create_logical_replication_slot('gone', 'test_decoding')")
        primary.wait_until(lambda: wal_cache_row(primary, "gone")["last_reset_timestamp"] is not None,
                           "the worker to count the new slot")
        again = wal_cache_row(primary, "gone")
        assert again["blks_read"] == 0 and again["hit_rate"] is None
        assert again["last_reset_timestamp"] > first["last_reset_timestamp"]


def test_the_cache_off_has_no_worker_and_small_sizes_are_raised():
    with primary_only(cache="0") as primary:
        primary.sql("SELECT pg_create_logical_replication_slot('idle', 'test_decoding')")
        pgbench(primary, "-i", "-s", "1", "-q")
        primary.sql("SELECT count(*) FROM pg_logical_slot_get_changes('idle', NULL, NULL)")
        time.sleep(0.1)
        status = wal_cache_status(primary)
        assert status["mode"] == "off" and status["worker_pid"] is None and status["held_blocks"] == 0
        assert primary.one("SELECT get_oldest_wal_cache_ptr()") is None
        assert worker_processes(primary) == []
        row = wal_cache_row(primary, "idle")
        assert (row["blks_read"], row["hit_rate"], row["last_reset_timestamp"]) == (0, None, None)

        primary.write_settings({"ccm.logical_wal_cache": 2})
        primary.restart()
        assert primary.one("SHOW ccm.logical_wal_cache") == "32kB"  # raised to 4 pages
        wait_for_worker(primary)
        status = wal_cache_status(primary)
        assert status["size_blocks"] == 4 and status["held_blocks"] == 4 and status["mode"] == "locked"
        assert len(worker_processes(primary)) == 1
        with pytest.raises(Exception, match="cannot be changed without restarting"):
            primary.sql("SET ccm.logical_wal_cache = 100")


def test_the_cache_holds_the_newest_wal_in_memory_across_a_restart():
    cache_pages = 512  # 4 MB
    # No autovacuum: its WAL (a vacuum of pgbench_accounts after the restart) would push the
    # slot's position out of the 4 MB window this test reads back.
    with primary_only(cache=str(cache_pages), autovacuum="off") as primary:
        primary.sql("SELECT pg_create_logical_replication_slot('kept', 'test_decoding')")
        pgbench(primary, "-i", "-s", "3", "-q")  # tens of MB of WAL
        primary.sql("SELECT count(*) FROM pg_logical_slot_get_changes('kept', NULL, NULL)")
        primary.wait_until(lambda: wal_cache_status(primary)["locked_blocks"] == cache_pages, "the cache to be locked")
        check_the_window_survives_eviction(primary, cache_pages)

        worker_before = wal_cache_status(primary)["worker_pid"]
        primary.restart()
        wait_for_worker(primary)
        status = wal_cache_status(primary)
        assert status["worker_pid"] != worker_before
        check_the_window_survives_eviction(primary, cache_pages)
        # Counting starts again at the slot's position, and a consumer that keeps up hits.
        assert wal_cache_row(primary, "kept")["blks_read"] == 0
        start = confirmed_flush(primary, "kept")
        # Well under 4 MB of WAL, full-page images after the restart's checkpoint included
        # (30 transactions wrote 3.2 MB of it, too close to the cache's size).
        pgbench(primary, "-c", "1", "-t", "10", "-n")
        behind = primary.one("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), confirmed_flush_lsn)::int8 "
                             "FROM pg_replication_slots WHERE slot_name = 'kept'")
        assert behind < cache_pages * 8192 * 3 // 4, f"the slot is {behind} bytes behind: too close to the cache's size"
        primary.sql("SELECT count(*) FROM pg_logical_slot_get_changes('kept', NULL, NULL)")
        consumed = pages_between(start, confirmed_flush(primary, "kept"))
        assert consumed > 0
        row = wait_counted(primary, "kept", consumed)
        assert row["blks_read"] == consumed and row["cache_miss"] == 0, (row, consumed)


def check_the_window_survives_eviction(primary: Node, cache_pages: int) -> None:
    """Drops pg_wal from the OS page cache (sync, then POSIX_FADV_DONTNEED on every file):
    the pages the cache holds stay resident, the WAL before them goes."""
    status = wal_cache_status(primary)
    assert status["mode"] == "locked" and status["held_blocks"] == cache_pages, status
    start, end = lsn_to_int(status["oldest_ptr"]), lsn_to_int(status["newest_ptr"])
    segment_size = 16 * 1024 * 1024
    timeline = primary.one("SELECT timeline_id FROM pg_control_checkpoint()")
    subprocess.run(["sync"], check=True)
    subprocess.run(["vmtouch", "-q", "-e", str(primary.datadir / "pg_wal")], check=True)
    # Each segment overlapping the held window keeps at least its share of it.
    for segno in range(start // segment_size, (end - 1) // segment_size + 1):
        seg_start, seg_end = segno * segment_size, (segno + 1) * segment_size
        share = min(end, seg_end) - max(start, seg_start)
        name = f"{timeline:08X}{segno // 256:08X}{segno % 256:08X}"
        assert resident_bytes(primary.datadir / "pg_wal" / name) >= share, name
    older = start // segment_size - 1
    if older >= 0:
        name = f"{timeline:08X}{older // 256:08X}{older % 256:08X}"
        path = primary.datadir / "pg_wal" / name
        if path.exists():
            assert resident_bytes(path) == 0, f"{name}, before the window, should have been dropped"


def wait_locked(primary: Node, blocks: int, what: str) -> tuple[dict, str]:
    """Waits until the cache reports `blocks` pages locked and the kernel's count of the
    worker's locked memory (VmLck) is those pages, in one sample; returns the cache's status
    and the worker's /proc status. While WAL is still written (the checkpoint and autovacuum
    after pgbench -i), a tick unlocks the pages that leave the window before it locks the new
    ones, so two separate reads can fall on either side of that."""
    seen: list[int] = []

    def sample() -> tuple[dict, str] | None:
        status = wal_cache_status(primary)
        worker_status = Path(f"/proc/{status['worker_pid']}/status").read_text()
        locked_kb = int(re.search(r"VmLck:\s+(\d+) kB", worker_status).group(1))
        seen[:] = [status["locked_blocks"], locked_kb]
        return (status, worker_status) if seen == [blocks, blocks * PAGE // 1024] else None

    return primary.wait_until(sample, what, describe=lambda: f"last seen: {seen[0]} pages locked, VmLck {seen[1]} kB")


def test_a_low_memory_lock_limit_locks_the_newest_pages_only():
    # The default cache is 16 MB; lower the server's RLIMIT_MEMLOCK to 4 MB (raising it
    # would need CAP_SYS_RESOURCE, which these machines' root lacks).
    with primary_only(memlock=str(4 * 1024 * 1024)) as primary:
        pgbench(primary, "-i", "-s", "3", "-q")
        status, _ = wait_locked(primary, 512, "the lock limit's 512 pages locked")
        limits = Path(f"/proc/{status['worker_pid']}/limits").read_text()
        assert re.search(r"Max locked memory\s+4194304\s+4194304", limits), limits
        assert status["mode"] == "partly locked", status
        assert status["lock_limit_bytes"] == 4 * 1024 * 1024
        assert status["locked_blocks"] == 512
        # The rest of the window is held while it stays resident.
        assert 512 < status["held_blocks"] <= 2048


@pytest.mark.skipif(os.geteuid() != 0, reason="granting CAP_IPC_LOCK to the server needs root")
def test_cap_ipc_lock_locks_the_whole_cache_beyond_the_memory_lock_limit():
    # As systemd's AmbientCapabilities=CAP_IPC_LOCK would: mlock() then ignores RLIMIT_MEMLOCK,
    # here held at 4 MB under the default 16 MB cache.
    with primary_only(memlock=str(4 * 1024 * 1024), ipc_lock=True) as primary:
        pgbench(primary, "-i", "-s", "3", "-q")
        status, worker_status = wait_locked(primary, 2048, "the whole cache locked")
        assert int(re.search(r"CapEff:\s+([0-9a-f]+)", worker_status).group(1), 16) & (1 << 14), worker_status
        assert status["mode"] == "locked", status
        assert status["lock_limit_bytes"] is None
        assert status["locked_blocks"] == status["held_blocks"] == 2048
        check_the_window_survives_eviction(primary, 2048)


def test_the_agent_reports_the_wal_cache(log_dir):
    from harness.agent import AgentProcess, run_agent_json

    with Cluster(settings=LOGICAL) as cluster:
        primary = cluster.primary
        primary.sql("CREATE ROLE ccm LOGIN IN ROLE ccm_agent, pg_monitor")
        pgbench(primary, "-i", "-s", "1", "-q")
        primary.sql("SELECT pg_create_logical_replication_slot('cdc', 'test_decoding')")
        consumer = Recvlogical(primary, "cdc")
        agent = AgentProcess(primary.conninfo(user="ccm"), cluster.standby.conninfo(user="ccm"), log_dir)
        try:
            pgbench(primary, "-c", "1", "-T", "2", "-n")
            wait_slot_at(primary, "cdc", current_lsn(primary))
            wait_counted(primary, "cdc", 1)
            status = run_agent_json("status", "--primary", primary.conninfo(user="ccm"),
                                    "--standby", cluster.standby.conninfo(user="ccm"))
            with agent:
                agent.wait_for(lambda: agent.metric('ccm_agent_wal_cache_slot_hit_blocks{slot="cdc"}') > 0,
                               "the slot's hits in the metrics")
                assert agent.metric("ccm_agent_wal_cache_held_blocks") > 0
        finally:
            consumer.stop()
    cache = status["wal_cache"]
    assert cache["mode"] in ("locked", "partly locked") and cache["size_blocks"] == 2048
    [slot] = cache["slots"]
    assert slot["name"] == "cdc" and slot["blks_read"] > 0 and slot["active_pid"] is not None
    assert slot["hit_rate"].endswith("%")


# -- the worker's safety: bounded locking, the memory cap, retries ---------------------------

def emit_wal(node: Node, megabytes: int) -> None:
    """Writes `megabytes` MB of WAL quickly: non-transactional logical messages of 1 MB."""
    node.sql("SELECT count(pg_logical_emit_message(false, 'pg_ccm test', repeat('x', 1048576))) "
             "FROM generate_series(1, %s)", [megabytes])


def server_log(node: Node) -> str:
    return node.logfile.read_text(errors="replace")


def read_throttle(name: str, path: Path, mbps: int) -> BlkioThrottle:
    """Limits reads from the disk holding `path` (as the benchmark's --read-mbps does)."""
    if not controller_available("blkio"):
        pytest.skip("slowing down reads needs the cgroup v1 blkio controller")
    device = data_device(path)
    if device is None:
        pytest.skip(f"{path} is not on a block device")
    return BlkioThrottle(name, device, mbps=mbps)


@pytest.mark.skipif(os.geteuid() != 0, reason="granting CAP_IPC_LOCK and throttling reads need root")
def test_a_fast_shutdown_does_not_wait_for_a_large_cache_to_be_locked():
    """mlock() reads what it locks from storage, synchronously, deaf to SIGTERM. A worker
    that locked its whole window in one call kept `pg_ctl stop -m fast` waiting until the
    window was read: here 1 GB of evicted WAL at 20 MB/s, about 50 s. It now locks in steps
    of a few MB, checks for shutdown between them, and shows its progress meanwhile."""
    cache_pages = 131072  # 1 GB
    # Clusters live under the temporary directory.
    throttle = read_throttle(f"pg_ccm_test_{os.getpid()}", Path(tempfile.gettempdir()), 20)
    with primary_only(cache="1GB", ipc_lock=True, max_wal_size="'4GB'", wal_keep_size="'2GB'") as primary:
        try:
            emit_wal(primary, 1100)
            primary.wait_until(lambda: wal_cache_status(primary)["locked_blocks"] == cache_pages,
                               "the whole cache to be locked", timeout=120)
            primary.stop()
            # The next worker has to read the whole window back from storage to lock it.
            subprocess.run(["sync"], check=True)
            subprocess.run(["vmtouch", "-q", "-e", str(primary.datadir / "pg_wal")], check=True)
            primary.wrapper = throttle.wrapper
            primary.start()
            primary.wait_until(lambda: len(worker_processes(primary)) == 1, "the worker to start", timeout=30)
            time.sleep(1)
            first = wal_cache_status(primary)
            time.sleep(1)
            second = wal_cache_status(primary)
            started = time.monotonic()
            primary.stop("fast")
            elapsed = time.monotonic() - started
            assert not primary.is_running()
            log = server_log(primary)
        finally:
            primary.stop("immediate")
            throttle.remove()
    assert elapsed < 5, f"pg_ctl stop -m fast took {elapsed:.1f} s"
    # Meanwhile the worker published its progress, newest pages first. The window it holds is
    # what it has locked and the resident pages just older than those (as its last residency
    # check found them), so its mode is "partly locked", or "locked" when the page just older
    # than the locked ones was found evicted (held_blocks 581 = locked_blocks 581 once, a
    # second in). Either way the mode must be the one its counts give.
    for status in (first, second):
        locked_all_held = status["locked_blocks"] == status["held_blocks"]
        assert status["mode"] == ("locked" if locked_all_held else "partly locked"), (first, second)
    assert 0 < first["locked_blocks"] < second["locked_blocks"] < cache_pages // 2, (first, second)
    assert second["size_blocks"] == cache_pages
    assert "terminated by signal" not in log and "PANIC" not in log, log[-2000:]


def test_an_oversized_cache_is_capped_at_a_quarter_of_physical_memory():
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cap_pages = physical // 4 // PAGE
    if cap_pages >= 4 * 1024 * 1024:
        pytest.skip("with 128 GB of RAM or more the setting's 32 GB maximum is below the cap")
    with primary_only(cache="32GB") as primary:
        assert primary.one("SHOW ccm.logical_wal_cache") == "32GB", "the setting itself is kept"
        status = wal_cache_status(primary)
        assert status["size_blocks"] == cap_pages, status
        log = server_log(primary)
    warning = re.search(r"WARNING:  ccm\.logical_wal_cache \(33554432 kB\) exceeds a quarter of the "
                        r"server.s memory, using (\d+) kB", log)
    assert warning and int(warning.group(1)) == cap_pages * PAGE // 1024, log[-2000:]
    assert "HINT:  Lower ccm.logical_wal_cache." in log


@pytest.mark.skipif(not controller_available("memory"), reason="no cgroup v1 memory controller here")
def test_in_a_container_the_cap_is_a_quarter_of_the_memory_limit():
    """A server in a memory cgroup (a container's limit) counts the limit, not the host's RAM:
    512 MB asked under a 1 GB limit gives 256 MB, with the WARNING."""
    limit = 1 << 30
    cgroup = MemoryCgroup("pg_ccm_wal_cap", str(limit))
    try:
        cluster = Cluster(settings={**LOGICAL, "ccm.logical_wal_cache": "'512MB'"})
        cluster.primary.wrapper = cgroup.wrapper
        try:
            cluster.create(extensions=("pg_ccm",), standby=False)
            wait_for_worker(cluster.primary)
            status = wal_cache_status(cluster.primary)
            log = server_log(cluster.primary)
        finally:
            cluster.destroy()
    finally:
        cgroup.remove()
    assert status["size_blocks"] == limit // 4 // PAGE, status
    assert re.search(r"WARNING:  ccm\.logical_wal_cache \(524288 kB\) exceeds a quarter of the server.s "
                     r"memory, using 262144 kB", log), log[-2000:]


def test_a_failed_lock_is_retried_until_it_succeeds():
    """A failed mlock() (EAGAIN under memory pressure, or as here ENOMEM from a lowered
    RLIMIT_MEMLOCK) no longer turns locking off until the worker restarts: the worker warns
    once, keeps the pages mapped, and retries with a backoff of 1 s doubling to a minute."""
    cache_pages = 512  # 4 MB, the server's whole lock limit
    limit = 4 * 1024 * 1024
    with primary_only(cache=str(cache_pages), memlock=str(limit)) as primary:
        emit_wal(primary, 8)
        primary.wait_until(lambda: wal_cache_status(primary)["locked_blocks"] == cache_pages, "the cache to be locked")
        worker = wal_cache_status(primary)["worker_pid"]
        # Lower the worker's soft limit (as its own user, which needs no privilege).
        run_pg(["prlimit", f"--pid={worker}", f"--memlock={limit // 4}:{limit}"])

        def warned() -> bool:
            emit_wal(primary, 1)
            return "could not lock logical WAL cache pages in memory" in server_log(primary)
        primary.wait_until(warned, "the lock to fail", timeout=30)
        failing = wal_cache_status(primary)
        assert failing["mode"] in ("partly locked", "mapped") and failing["locked_blocks"] < cache_pages, failing
        assert failing["held_blocks"] == cache_pages, "the unlocked pages stay mapped and resident"

        run_pg(["prlimit", f"--pid={worker}", f"--memlock={limit}:{limit}"])

        def relocked() -> bool:
            emit_wal(primary, 1)
            status = wal_cache_status(primary)
            return status["mode"] == "locked" and status["locked_blocks"] == cache_pages
        primary.wait_until(relocked, "locking to resume", timeout=90, interval=0.5)
        assert wal_cache_status(primary)["worker_pid"] == worker, "the same worker, not a restart"
        log = server_log(primary)
    assert log.count("could not lock logical WAL cache pages in memory") == 1, "one WARNING per failure streak"
    assert "DETAIL:  Locking is retried in 1 s" in log
    assert "pg_ccm logical WAL cache pages are locked in memory again" in log
