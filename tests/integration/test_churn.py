"""ccm_prewarm against replay's truncations, drops and rewrites: nothing replay wrote may be lost.

The standby runs a test build (scripts/install.sh --test-build) whose failpoint
`ccm.test_prewarm_delay_ms` makes ccm_prewarm() sleep after its reads, widening the windows
in which replay truncates, re-extends or drops a relation under it from microseconds to
seconds. Data safety is judged on the nodes themselves: row counts and ordered digests of
every table on both nodes, the standby's log, and amcheck on the promoted standby.
"""

from __future__ import annotations

import random
import re
import threading
import time

import psycopg
import pytest

from harness import block_list
from harness.agent import AgentProcess
from harness.cluster import Cluster, Node

# The extension's own code paths: on every version, the assertion-enabled one included.
pytestmark = pytest.mark.every_version

# What must never appear in the standby's log: a PANIC, the startup process dying, replay
# finding a page it does not expect, an invalid page, or a FATAL of any session, but for
# connection attempts while the server starts or stops and a client that went away (those
# say nothing about the standby).
ALLOWED_FATAL = ("connection to client lost", "the database system is starting up",
                 "the database system is not yet accepting connections", "the database system is shutting down",
                 "terminating connection due to administrator command", "terminating walreceiver")
FORBIDDEN_LOG = re.compile(r"PANIC|startup process .* (terminated|exited)|unexpected data beyond EOF|invalid page|"
                           r"FATAL: (?!\s*(" + "|".join(map(re.escape, ALLOWED_FATAL)) + "))")


def digest(node: Node, table: str) -> tuple[int, str]:
    """Row count and an md5 of the rows in primary-key order."""
    return node.sql(
        f"SELECT count(*), coalesce(md5(string_agg(t::text, ',' ORDER BY id)), '') FROM {table} t"
    )[0]


def tables(node: Node) -> list[str]:
    return [row[0] for row in node.sql(
        "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relkind = 'r' "
        "AND relname LIKE 'churn%' ORDER BY relname")]


def assert_same_data(primary: Node, standby: Node) -> None:
    names = tables(primary)
    assert names, "no tables to compare"
    assert tables(standby) == names
    for name in names:
        if digest(standby, name) != digest(primary, name):
            positions = (primary.one("SELECT pg_current_wal_insert_lsn()::text"),
                         standby.one("SELECT pg_last_wal_replay_lsn()::text") if standby.in_recovery() else None)
            raise AssertionError(f"table {name} differs on the standby: {digest(standby, name)} vs "
                                 f"{digest(primary, name)} (primary insert LSN, standby replay LSN: {positions})")


def assert_clean_log(node: Node) -> None:
    bad = [line for line in node.logfile.read_text(errors="replace").splitlines() if FORBIDDEN_LOG.search(line)]
    assert not bad, f"{node.name} logged:\n" + "\n".join(bad[:20])


def assert_amcheck_passes(node: Node) -> None:
    corrupt = node.sql(
        "SELECT c.relname, v.* FROM pg_class c, LATERAL verify_heapam(c.oid) v "
        "WHERE c.relkind IN ('r', 'm', 't') AND c.relpersistence = 'p'")
    assert not corrupt, f"verify_heapam: {corrupt[:10]}"
    node.sql("SELECT bt_index_check(c.oid, true) FROM pg_class c JOIN pg_am a ON a.oid = c.relam "
             "WHERE a.amname = 'btree' AND c.relkind = 'i' AND c.relpersistence = 'p'")


def assert_nothing_lost(primary: Node, standby: Node) -> None:
    """The verdict: a clean standby log, the standby still replaying, the same data on both
    nodes before and after promotion, and amcheck passing on the promoted standby."""
    assert_clean_log(standby)
    assert standby.in_recovery()
    assert_same_data(primary, standby)
    standby.promote()
    assert_same_data(primary, standby)
    assert_amcheck_passes(standby)


def wait_for_replay(cluster: Cluster) -> None:
    """Waits until the standby has replayed everything; if it cannot (the standby stopped),
    fails with what the standby logged."""
    try:
        cluster.wait_caught_up(timeout=60)
    except (psycopg.Error, TimeoutError):
        assert_clean_log(cluster.standby)
        raise


def fill(conn: psycopg.Connection, table: str, first: int, rows: int) -> None:
    conn.execute(f"INSERT INTO {table} SELECT g, repeat('x', 280) FROM generate_series(%s::int, %s::int) g",
                 [first, first + rows - 1])


def blocks_of(node: Node, table: str) -> int:
    return node.one("SELECT pg_relation_size(%s::regclass) / 8192", [table])


def test_prewarm_keeps_what_replay_wrote_after_a_truncation(tmp_path):
    """The review's scenario, made deterministic by the failpoint: ccm_prewarm loads the tail
    of a queue table; VACUUM truncates it; the queue fills again (replay re-extends it and
    dirties the new pages) while ccm_prewarm still runs. Every row must reach the standby.

    Before the fix, ccm_prewarm's end-of-call drop (DropRelFileNodeBuffers from the size it
    had just read) threw those dirty pages away: the standby lost the rows."""
    with Cluster(settings={"autovacuum": "off"}) as cluster:
        primary, standby = cluster.primary, cluster.standby
        primary.sql("CREATE EXTENSION amcheck")
        primary.sql("CREATE TABLE churn_queue (id int PRIMARY KEY, pad text) WITH (fillfactor = 100)")
        with primary.connect() as conn:
            fill(conn, "churn_queue", 1, 25_000)  # about 1000 blocks
        total = blocks_of(primary, "churn_queue")
        # Consume the tail now, so that the VACUUM below has only to truncate: a cleanup
        # record would conflict with ccm_prewarm's snapshot and make replay wait for the call.
        keep = 25_000 // 2 - 500
        primary.sql("DELETE FROM churn_queue WHERE id > %s", [keep])
        primary.sql("VACUUM (TRUNCATE false) churn_queue")
        assert blocks_of(primary, "churn_queue") == total
        cluster.make_standby_cold()

        rel = primary.sql("SELECT reltablespace, reldatabase, relfilenode FROM pg_buffercache "
                          "WHERE relfilenode = pg_relation_filenode('churn_queue') LIMIT 1")
        spc, db, relfilenode = (int(v) for v in rel[0]) if rel else (0, 0, 0)
        if not rel:  # the table's pages may have left the primary's cache: name it directly
            spc = primary.one("SELECT oid FROM pg_tablespace WHERE spcname = 'pg_default'")
            db = primary.one("SELECT oid FROM pg_database WHERE datname = current_database()")
            relfilenode = primary.one("SELECT pg_relation_filenode('churn_queue')")
        tail = [(int(spc), int(db), int(relfilenode), 0, block, 5) for block in range(total // 2, total)]
        delay_ms = 3000
        result: dict[str, object] = {}

        def prewarm() -> None:
            try:
                with standby.connect() as conn:
                    conn.execute(f"SET ccm.test_prewarm_delay_ms = {delay_ms}")
                    result["row"] = conn.execute("SELECT * FROM ccm_prewarm(%s)", [block_list.encode(tail)]).fetchone()
            except psycopg.Error as error:  # a recovery conflict may cancel it: that is allowed
                result["error"] = error

        worker = threading.Thread(target=prewarm)
        worker.start()
        # The reads take milliseconds; then the call sleeps at its failpoints.
        time.sleep(0.5)
        primary.sql("VACUUM churn_queue")  # truncates the empty tail
        assert blocks_of(primary, "churn_queue") < total // 2, "VACUUM should have truncated the queue"
        # While ccm_prewarm is still inside the call, the queue fills again.
        time.sleep(delay_ms / 1000)
        with primary.connect() as conn:
            fill(conn, "churn_queue", keep + 1, 8_000)
        worker.join(timeout=120)
        assert not worker.is_alive()
        # More rows on the pages replay re-created: on a page replay no longer has, redo fails.
        with primary.connect() as conn:
            conn.execute("UPDATE churn_queue SET pad = repeat('y', 10) WHERE id > %s", [keep])
        wait_for_replay(cluster)

        assert "error" in result or result["row"][0] == len(tail), result
        assert_nothing_lost(primary, standby)


class Churn:
    """DDL and VACUUM truncation on the primary, with readers keeping the pages hot."""

    def __init__(self, node: Node, seconds: float, seed: int = 20261123):
        self.node = node
        self.deadline = time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.errors: list[BaseException] = []
        self.rounds = 0
        self.threads = [threading.Thread(target=self._guard, args=(work,), daemon=True)
                        for work in (self._queue, self._ddl, self._readers)]

    def __enter__(self) -> "Churn":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.deadline = 0
        for thread in self.threads:
            thread.join(timeout=120)

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    def _guard(self, work) -> None:
        try:
            with self.node.connect() as conn:
                work(conn)
        except BaseException as error:  # reported by the test
            self.errors.append(error)

    def _queue(self, conn: psycopg.Connection) -> None:
        # A queue: the tail fills, is read, is consumed, and VACUUM truncates it; again.
        next_id = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM churn_queue").fetchone()[0]
        while self.running():
            rows = self.rng.randrange(2_000, 8_000)
            fill(conn, "churn_queue", next_id, rows)
            next_id += rows
            for _ in range(4):
                conn.execute("SELECT count(*) FROM churn_queue WHERE id >= %s", [next_id - rows])
            conn.execute("DELETE FROM churn_queue WHERE id >= %s", [next_id - self.rng.randrange(rows // 2, rows)])
            conn.execute("VACUUM churn_queue")
            self.rounds += 1

    def _ddl(self, conn: psycopg.Connection) -> None:
        while self.running():
            conn.execute("DROP TABLE IF EXISTS churn_dropped")
            conn.execute("CREATE TABLE churn_dropped (id int PRIMARY KEY, pad text)")
            fill(conn, "churn_dropped", 1, self.rng.randrange(1_000, 5_000))
            conn.execute("TRUNCATE churn_truncated")
            fill(conn, "churn_truncated", 1, self.rng.randrange(1_000, 5_000))
            conn.execute("VACUUM FULL churn_rewritten")
            conn.execute("UPDATE churn_rewritten SET pad = md5(random()::text) WHERE id %% 7 = %s",
                         [self.rng.randrange(7)])
            time.sleep(self.rng.uniform(0.05, 0.3))

    def _readers(self, conn: psycopg.Connection) -> None:
        while self.running():
            for table in ("churn_queue", "churn_dropped", "churn_truncated", "churn_rewritten"):
                try:
                    conn.execute(f"SELECT count(*) FROM {table}")
                except psycopg.errors.UndefinedTable:
                    pass  # between DROP and CREATE


def test_churn_with_the_agent_loses_nothing(tmp_path, log_dir):
    """The agent warms a small standby every 200 ms (with the failpoint widening every
    call) while the primary truncates, re-extends, drops, truncates and rewrites tables.
    Afterwards: a clean standby log, identical data on both nodes, before and after
    promotion, and amcheck passes on the promoted node."""
    settings = {"autovacuum": "off", "shared_buffers": "'32MB'"}
    with Cluster(settings=settings, standby_settings={"ccm.test_prewarm_delay_ms": 200}) as cluster:
        primary, standby = cluster.primary, cluster.standby
        primary.sql("CREATE EXTENSION amcheck")
        with primary.connect() as conn:
            for name in ("churn_queue", "churn_dropped", "churn_truncated", "churn_rewritten"):
                conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, pad text)")
            fill(conn, "churn_rewritten", 1, 20_000)
            # Bigger than the standby's shared_buffers: standby readers evict, the agent reloads.
            conn.execute("CREATE TABLE churn_filler AS SELECT g AS id, repeat('f', 500) AS pad "
                         "FROM generate_series(1, 60000) g")
            conn.execute("ALTER TABLE churn_filler ADD PRIMARY KEY (id)")
        cluster.wait_caught_up()

        stop = threading.Event()
        evictions: list[BaseException] = []

        def evict_on_standby() -> None:
            try:
                with standby.connect() as conn:
                    conn.execute("SET enable_seqscan = off")  # index scans use no ring buffer
                    while not stop.is_set():
                        first = random.randrange(50_000)
                        try:
                            conn.execute("SELECT sum(length(pad)) FROM churn_filler WHERE id BETWEEN %s AND %s",
                                         [first, first + 8_000])
                        except psycopg.errors.SerializationFailure:
                            pass  # a recovery conflict cancelled it
            except BaseException as error:
                evictions.append(error)

        evictor = threading.Thread(target=evict_on_standby, daemon=True)
        with AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="200ms") as agent:
            evictor.start()
            with Churn(primary, seconds=45) as churn:
                while churn.running() and not churn.errors:
                    time.sleep(0.5)
            stop.set()
            evictor.join(timeout=60)
            assert not churn.errors, churn.errors
            assert not evictions, evictions
            assert churn.rounds >= 5, f"only {churn.rounds} truncation rounds"
            wait_for_replay(cluster)
            assert agent.metric("ccm_agent_blocks_loaded_total") > 0, agent.log()[-3000:]
            assert agent.alive()

        assert_nothing_lost(primary, standby)


@pytest.mark.smoke
def test_prewarm_refuses_to_run_on_a_primary(cluster):
    rel = cluster.primary.sql("SELECT reltablespace::int8, reldatabase::int8, relfilenode::int8 "
                              "FROM pg_buffercache WHERE relfilenode IS NOT NULL AND reldatabase <> 0 LIMIT 1")[0]
    data = block_list.encode([(*rel, 0, 0, 1)])
    with cluster.primary.connect() as conn:
        with pytest.raises(psycopg.Error) as raised:
            conn.execute("SELECT * FROM ccm_prewarm(%s)", [data])
    assert raised.value.sqlstate == "55000"
    assert raised.value.diag.message_primary == "recovery is not in progress"
