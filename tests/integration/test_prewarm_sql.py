"""ccm_prewarm() on a real hot standby: what it loads, what it skips and why, and how it
gives way to replay (the pg_test server is a primary, where it only refuses to run)."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from harness import block_list
from harness.cluster import Cluster, Node

# The extension's own code paths: on every version, the assertion-enabled one included.
pytestmark = pytest.mark.every_version


def address(node: Node, table: str, dbname: str = "postgres") -> tuple[int, int, int]:
    """(tablespace, database, relfilenode) of a table, as buffer tags name it."""
    return node.sql(
        "SELECT CASE WHEN c.reltablespace = 0 THEN d.dattablespace ELSE c.reltablespace END::int8, "
        "CASE WHEN c.relisshared THEN 0 ELSE d.oid END::int8, pg_relation_filenode(c.oid)::int8 "
        "FROM pg_class c, pg_database d WHERE c.oid = %s::regclass AND d.datname = current_database()",
        [table], dbname=dbname)[0]


def blocks(node: Node, table: str, dbname: str = "postgres") -> int:
    return node.one("SELECT pg_relation_size(%s::regclass) / 8192", [table], dbname=dbname)


def listing(rel: tuple[int, int, int], numbers, usage: int = 5, fork: int = 0) -> bytes:
    return block_list.encode([(*rel, fork, n, usage) for n in numbers])


def prewarm(node: Node, data: bytes, dbname: str = "postgres", **settings) -> tuple[int, int, int, int]:
    with node.connect(dbname=dbname) as conn:
        for name, value in settings.items():
            conn.execute(f"SET ccm.{name} = {value}")
        return conn.execute("SELECT requested, loaded, already_cached, skipped FROM ccm_prewarm(%s)", [data]).fetchone()


def cached(node: Node, relfilenode: int, min_usage: int = 0) -> int:
    return node.one("SELECT count(*) FROM pg_buffercache WHERE relfilenode = %s AND usagecount >= %s",
                    [relfilenode, min_usage])


@pytest.fixture
def pair():
    with Cluster() as built:
        built.primary.sql("CREATE TABLE t AS SELECT g AS id, repeat('x', 200) AS pad FROM generate_series(1, 20000) g")
        built.primary.sql("CREATE DATABASE other")
        built.primary.sql("CREATE TABLE o AS SELECT g AS id FROM generate_series(1, 20000) g", dbname="other")
        built.primary.sql("CREATE EXTENSION pg_buffercache", dbname="other")
        built.make_standby_cold()
        yield built


@pytest.mark.smoke
def test_loads_counts_and_raises_usage_counts(pair):
    standby = pair.standby
    rel, n = address(standby, "t"), blocks(standby, "t")
    before = cached(standby, rel[2])
    assert before < n // 2, "the standby should start cold"
    assert prewarm(standby, listing(rel, range(n))) == (n, n - before, before, 0)
    assert cached(standby, rel[2], min_usage=5) == n, "every block loaded with the primary's usage count"
    # Again: all cached now. Past the end of the file, a missing relation, a missing database.
    assert prewarm(standby, listing(rel, range(n))) == (n, 0, n, 0)
    gone = (rel[0], rel[1], 4_000_000_000)
    nowhere = (rel[0], 4_000_000_000, rel[2])
    data = block_list.encode([(*rel, 0, 0, 5), (*rel, 0, n, 5), (*rel, 0, n + 10, 5),
                              (*gone, 0, 0, 5), (*nowhere, 0, 0, 5)])
    assert prewarm(standby, data) == (5, 0, 1, 4)
    assert prewarm(standby, block_list.encode([])) == (0, 0, 0, 0)


def test_other_databases_are_read_by_a_worker_connected_to_them(pair):
    standby = pair.standby
    rel, n = address(standby, "o", dbname="other"), blocks(standby, "o", dbname="other")
    before = cached(standby, rel[2])
    assert before < n // 2, "the standby should start cold"
    # Called from database postgres: a worker connected to database other reads them.
    assert prewarm(standby, listing(rel, range(n)), dbname="postgres") == (n, n - before, before, 0)
    assert cached(standby, rel[2], min_usage=5) == n
    # template0 takes no connections, and a database that does not exist: skipped.
    template0 = standby.one("SELECT oid::int8 FROM pg_database WHERE datname = 'template0'")
    data = block_list.encode([(rel[0], template0, rel[2], 0, 0, 5), (rel[0], 4_000_000_000, rel[2], 0, 0, 5)])
    assert prewarm(standby, data) == (2, 0, 0, 2)
    # Shared catalogs (database 0) are read by the caller, from any database.
    shared = address(standby, "pg_database")
    assert shared[1] == 0
    m = blocks(standby, "pg_database")
    requested, loaded, already, skipped = prewarm(standby, listing(shared, range(m)))
    assert (requested, loaded + already, skipped) == (m, m, 0)


@pytest.mark.smoke
def test_bad_lists_are_rejected_with_22P03(pair):
    standby = pair.standby
    rel = address(standby, "t")
    for data in (listing(rel, range(10))[:-1], standby.one("SELECT ccm_buffer_filter()")):
        with standby.connect() as conn:
            with pytest.raises(psycopg.Error) as raised:
                conn.execute("SELECT * FROM ccm_prewarm(%s)", [data])
            assert raised.value.sqlstate == "22P03"
            assert raised.value.diag.message_primary == "invalid pg_ccm block list"
    # No list names more blocks than the standby has buffers.
    nbuffers = standby.one("SELECT setting::int FROM pg_settings WHERE name = 'shared_buffers'")
    with standby.connect() as conn:
        with pytest.raises(psycopg.Error) as raised:
            conn.execute("SELECT * FROM ccm_prewarm(%s)", [listing(rel, range(nbuffers + 1))])
    assert raised.value.sqlstate == "54000"
    assert raised.value.diag.message_primary == "pg_ccm block list has too many blocks"


def test_a_relation_replay_holds_locked_is_skipped_not_waited_for(pair):
    primary, standby = pair.primary, pair.standby
    rel, n = address(standby, "t"), blocks(standby, "t")
    with primary.connect(autocommit=False) as locker:
        locker.execute("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        locker.execute("SELECT pg_switch_wal()")  # ship the lock record now
        standby.wait_until(lambda: standby.one(
            "SELECT count(*) FROM pg_locks WHERE relation = 't'::regclass AND mode = 'AccessExclusiveLock'") == 1,
            "replay to take the lock")
        started = time.monotonic()
        assert prewarm(standby, listing(rel, range(n))) == (n, 0, 0, n)
        assert time.monotonic() - started < 5
        locker.commit()
    pair.wait_caught_up()
    standby.wait_until(lambda: prewarm(standby, listing(rel, range(n)))[3] == 0, "the lock to be released")


def test_a_recovery_conflict_cancels_the_statement_not_the_session(tmp_path):
    """Replay needs an AccessExclusiveLock the prewarm holds: past max_standby_streaming_delay
    it cancels the statement (SQLSTATE 40001); the session lives on."""
    standby_settings = {"max_standby_streaming_delay": "'500ms'"}
    with Cluster(standby_settings=standby_settings) as cluster:
        primary, standby = cluster.primary, cluster.standby
        primary.sql("CREATE TABLE t AS SELECT g AS id, repeat('x', 200) AS pad FROM generate_series(1, 5000) g")
        cluster.make_standby_cold()
        rel, n = address(standby, "t"), blocks(standby, "t")
        outcome: dict[str, object] = {}
        with standby.connect() as conn:
            def run() -> None:
                try:
                    conn.execute("SET ccm.test_prewarm_delay_ms = 20000")  # held under the lock
                    conn.execute("SELECT * FROM ccm_prewarm(%s)", [listing(rel, range(n))])
                    outcome["finished"] = True
                except psycopg.Error as error:
                    outcome["error"] = error

            worker = threading.Thread(target=run)
            worker.start()
            standby.wait_until(lambda: standby.one(
                "SELECT count(*) FROM pg_locks WHERE relation = 't'::regclass AND granted") >= 1, "the prewarm's lock")
            primary.sql("TRUNCATE t")
            worker.join(timeout=60)
            error = outcome.get("error")
            assert isinstance(error, psycopg.Error), outcome
            assert error.sqlstate == "40001", error
            assert "conflict with recovery" in str(error)
            assert conn.execute("SELECT 1").fetchone() == (1,), "the session survives the conflict"
        cluster.wait_caught_up()
        assert standby.one("SELECT count(*) FROM t") == 0


def test_sequences_are_skipped(pair):
    """ALTER SEQUENCE gives a sequence new storage without an AccessExclusiveLock, so the
    lock that guards every other relation would not guard it."""
    primary, standby = pair.primary, pair.standby
    primary.sql("CREATE SEQUENCE s")
    pair.wait_caught_up()
    assert prewarm(standby, listing(address(standby, "s"), [0])) == (1, 0, 0, 1)


def test_errors_carry_no_backtrace_when_the_server_has_rust_backtrace_set():
    """pgrx raises ERRORs as Rust panics, whose hook captures a backtrace and prints it in the
    DETAIL whenever RUST_BACKTRACE is set in the server's environment: symbolizing it took
    0.3 s per ERROR here (4 s on a throttled disk) while a cancel or a recovery conflict
    waited. pg_ccm turns the capture off at load time: the DETAIL is ours alone, and a
    cancelled call returns at once."""
    with Cluster() as built:
        for node in (built.primary, built.standby):
            node.environment = {"RUST_BACKTRACE": "1"}
            node.restart()
        with built.primary.connect() as conn:
            with pytest.raises(psycopg.Error) as raised:
                conn.execute("SELECT * FROM ccm_prewarm('\\x')")
        assert raised.value.sqlstate == "55000"
        assert raised.value.diag.message_detail == "ccm_prewarm() loads blocks only on a standby."

        standby = built.standby
        built.primary.sql("CREATE TABLE t AS SELECT g AS id FROM generate_series(1, 20000) g")
        built.wait_caught_up()
        rel, n = address(standby, "t"), blocks(standby, "t")
        with standby.connect() as conn:
            pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
            conn.execute("SET ccm.test_prewarm_delay_ms = 60000")
            thread, outcome = run_in_background(
                lambda: conn.execute("SELECT * FROM ccm_prewarm(%s)", [listing(rel, range(n))]).fetchone())
            standby.wait_until(lambda: standby.one("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]) == "active",
                               "the call to start")
            cancelled = time.monotonic()
            standby.sql("SELECT pg_cancel_backend(%s)", [pid])
            thread.join(timeout=30)
            took = time.monotonic() - cancelled
        error = outcome["error"]
        assert error.sqlstate == "57014", outcome
        assert "backtrace" not in (error.diag.message_detail or "") and "pg_ccm::" not in str(error), str(error)
        assert took < 5, f"the cancel took {took:.1f} s"


@pytest.fixture
def slow_workers():
    """A pair whose standby's prewarm workers sleep 3 s after each run (the failpoint, set in
    the standby's configuration so that workers see it too)."""
    with Cluster(standby_settings={"ccm.test_prewarm_delay_ms": 3000}) as built:
        built.primary.sql("CREATE DATABASE other")
        built.primary.sql("CREATE TABLE o AS SELECT g AS id FROM generate_series(1, 20000) g", dbname="other")
        built.make_standby_cold()
        yield built


def prewarm_workers(node: Node) -> int:
    return node.one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_ccm prewarm'")


def run_in_background(target) -> tuple[threading.Thread, dict]:
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["row"] = target()
        except psycopg.Error as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_cancelled_call_terminates_its_worker(slow_workers):
    standby = slow_workers.standby
    rel, n = address(standby, "o", dbname="other"), blocks(standby, "o", dbname="other")
    with standby.connect() as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        thread, outcome = run_in_background(
            lambda: conn.execute("SELECT * FROM ccm_prewarm(%s)", [listing(rel, range(n))]).fetchone())
        standby.wait_until(lambda: prewarm_workers(standby) == 1, "the worker to start")
        standby.sql("SELECT pg_cancel_backend(%s)", [pid])
        thread.join(timeout=30)
        assert outcome["error"].sqlstate == "57014", outcome
        standby.wait_until(lambda: prewarm_workers(standby) == 0, "the worker to be terminated", timeout=5)
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_terminated_call_terminates_its_worker_and_crashes_nothing():
    """pg_terminate_backend() on a caller waiting for its worker (FATAL: the portal's memory is
    deleted before the resource owner detaches the segment, whose callback terminates the
    worker): the worker is terminated at once, no backend crashes (on the assertion-enabled
    server, an Assert or freed memory read would), the server is not restarted."""
    # The worker sleeps a minute after its run: only the caller's callback ends it sooner.
    with Cluster(standby_settings={"ccm.test_prewarm_delay_ms": 60000}) as built:
        built.primary.sql("CREATE DATABASE other")
        built.primary.sql("CREATE TABLE o AS SELECT g AS id FROM generate_series(1, 20000) g", dbname="other")
        built.make_standby_cold()
        standby = built.standby
        postmaster = standby.postmaster_pid()
        rel, n = address(standby, "o", dbname="other"), blocks(standby, "o", dbname="other")
        conn = standby.connect()
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        thread, outcome = run_in_background(
            lambda: conn.execute("SELECT * FROM ccm_prewarm(%s)", [listing(rel, range(n))]).fetchone())
        standby.wait_until(lambda: prewarm_workers(standby) == 1, "the worker to start")
        # BgWorkerShutdown up to 16, BgworkerShutdown from 17 on.
        standby.wait_until(lambda: standby.one("SELECT lower(wait_event) FROM pg_stat_activity WHERE pid = %s", [pid])
                           == "bgworkershutdown", "the caller to wait for its worker")
        assert standby.one("SELECT pg_terminate_backend(%s)", [pid])
        thread.join(timeout=30)
        assert isinstance(outcome.get("error"), psycopg.OperationalError), outcome
        standby.wait_until(lambda: prewarm_workers(standby) == 0, "the worker to be terminated", timeout=5)
        assert standby.postmaster_pid() == postmaster
        assert standby.one("SELECT 1") == 1
        log = standby.logfile.read_text(errors="replace")
        assert "TRAP" not in log and "terminated by signal" not in log and "server process" not in log, log[-3000:]


def test_a_database_dropped_under_its_worker_is_skipped(slow_workers):
    """Replaying DROP DATABASE terminates every session of that database, the worker too:
    its blocks are skipped, the call succeeds, replay goes on."""
    primary, standby = slow_workers.primary, slow_workers.standby
    rel, n = address(standby, "o", dbname="other"), blocks(standby, "o", dbname="other")
    thread, outcome = run_in_background(lambda: prewarm(standby, listing(rel, range(n))))
    standby.wait_until(lambda: prewarm_workers(standby) == 1, "the worker to start")
    primary.sql("DROP DATABASE other")
    thread.join(timeout=60)
    requested, loaded, already, skipped = outcome["row"]
    assert requested == n and skipped > 0 and loaded + already + skipped == n, outcome
    slow_workers.wait_caught_up()
    assert standby.one("SELECT count(*) FROM pg_database WHERE datname = 'other'") == 0
    assert "PANIC" not in standby.logfile.read_text(errors="replace")
