"""The SQL surface on live servers: hostile input, preloading, unlogged relations on a standby."""

from __future__ import annotations

import os
import random
import struct

import psycopg
import pytest

from harness import block_list
from harness.cluster import Cluster, Node

# The extension's own code paths: on every version, the assertion-enabled one included.
pytestmark = pytest.mark.every_version


def sqlstate_of(node: Node, query: str, params) -> str | None:
    with node.connect() as conn:
        try:
            conn.execute(query, params).fetchall()
        except psycopg.Error as error:
            return error.sqlstate
    return None


def flip_bit(data: bytes, rng: random.Random) -> bytes:
    mutated = bytearray(data)
    position = rng.randrange(len(mutated))
    mutated[position] ^= 1 << rng.randrange(8)
    return bytes(mutated)


@pytest.mark.smoke
def test_hostile_bytea_is_rejected_and_the_server_keeps_running(cluster):
    primary, standby = cluster.primary, cluster.standby
    postmaster = standby.postmaster_pid()
    good_list = standby.one("SELECT ccm_hot_blocks(NULL, 50, 0)") or b""
    good_filter = standby.one("SELECT ccm_buffer_filter()")
    rng = random.Random(7)
    cases: list[bytes] = [
        b"",
        b"CCMB",
        good_list[:-1],
        good_list + b"\x00",
        b"CCMB" + bytes([2]) + good_list[5:],  # another version
        b"XXXX" + good_list[4:],
        # A header that declares four billion blocks in a few bytes.
        b"CCMB" + struct.pack("<BBHIIQQ", 1, 0, 0, 0xFFFFFFFF, 0xFFFFFFFF, 0, 0) + b"\x01" * 16,
        good_filter[:40],
        b"CCMF" + struct.pack("<BBHQQQ", 1, 7, 0, 0, 0, 1 << 40),
        *(os.urandom(rng.randrange(1, 4096)) for _ in range(50)),
        *(flip_bit(good_list, rng) for _ in range(30)),
    ]
    for case in cases:
        for query in ("SELECT * FROM ccm_prewarm(%s)", "SELECT * FROM ccm_block_list_info(%s)"):
            state = sqlstate_of(standby, query, [case])
            # A mutation may still be a valid list; anything else must be a clean 22P03.
            assert state in (None, "22P03"), f"{query} on {case[:48].hex()}: {state}"
    for case in [good_filter[:-1], good_filter[:31], b"CCMF", good_list, os.urandom(100)]:
        assert sqlstate_of(primary, "SELECT ccm_hot_blocks(%s)", [case]) == "22P03"
        assert sqlstate_of(primary, "SELECT * FROM ccm_filter_info(%s)", [case]) == "22P03"
    assert standby.postmaster_pid() == postmaster
    assert standby.one("SELECT 1") == 1
    assert "terminated by signal" not in standby.logfile.read_text(errors="replace")


def test_unlogged_and_vanished_relations_are_skipped_on_the_standby(cluster):
    primary, standby = cluster.primary, cluster.standby
    primary.sql("CREATE UNLOGGED TABLE u AS SELECT g FROM generate_series(1, 50000) g")
    primary.sql("CREATE TABLE l AS SELECT g FROM generate_series(1, 50000) g")
    for _ in range(5):
        primary.sql("SELECT count(*) FROM u")
    cluster.wait_caught_up()
    spc, db = primary.sql("SELECT (SELECT oid FROM pg_tablespace WHERE spcname = 'pg_default')::int8, oid::int8 FROM pg_database WHERE datname = 'postgres'")[0]
    unlogged = primary.one("SELECT pg_relation_filenode('u')::int8")
    logged = primary.one("SELECT pg_relation_filenode('l')::int8")
    # The primary never sends unlogged pages: the standby has no main fork for them.
    sent = primary.sql("SELECT relfilenode::int8 FROM ccm_unpack_block_list(ccm_hot_blocks(NULL, NULL, 0))")
    assert (unlogged,) not in sent
    # A list naming them anyway is skipped on the standby, block by block.
    crafted = block_list.encode(
        [(spc, db, unlogged, 0, b, 5) for b in range(10)]
        + [(spc, db, logged, 0, b, 5) for b in range(10)]
        + [(spc, db, 4_000_000_000, 0, b, 5) for b in range(5)]  # no such relation
        + [(spc, 4_000_000_000, logged, 0, 0, 5)]  # no such database
        + [(spc, db, logged, 0, 100_000, 5)]  # past the end of the file
    )
    requested, loaded, cached, skipped = standby.sql("SELECT * FROM ccm_prewarm(%s)", [crafted])[0]
    assert requested == 27
    assert loaded + cached == 10
    assert skipped == 17


def test_create_extension_without_preloading_explains_what_to_do():
    cluster = Cluster(settings={"shared_preload_libraries": "''"})
    try:
        node = cluster.primary
        cluster.init_primary(node)
        node.start()
        with node.connect() as conn:
            with pytest.raises(psycopg.Error) as raised:
                conn.execute("CREATE EXTENSION pg_ccm")
        assert raised.value.diag.message_primary == "pg_ccm must be loaded via shared_preload_libraries"
        assert "shared_preload_libraries" in (raised.value.diag.message_hint or "")
        assert node.one("SELECT 1") == 1
    finally:
        cluster.destroy()


def test_an_upgrade_from_0_1_0_equals_a_fresh_install():
    """ALTER EXTENSION pg_ccm UPDATE gives the same functions, bound to the same symbols of
    the library, and the same views, with the same privileges."""
    def surface(node: Node, dbname: str) -> list[tuple]:
        return node.sql(
            "SELECT p.oid::regprocedure::text, pg_get_function_result(p.oid), p.prosrc, p.proacl::text "
            "FROM pg_proc p JOIN pg_depend d ON d.objid = p.oid AND d.deptype = 'e' "
            "JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'pg_ccm' "
            "UNION ALL "
            "SELECT c.oid::regclass::text, pg_get_viewdef(c.oid), obj_description(c.oid, 'pg_class'), c.relacl::text "
            "FROM pg_class c JOIN pg_depend d ON d.objid = c.oid AND d.deptype = 'e' "
            "JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'pg_ccm' "
            "WHERE c.relkind = 'v' ORDER BY 1", dbname=dbname)

    cluster = Cluster()
    try:
        cluster.create(extensions=(), standby=False)
        primary = cluster.primary
        primary.sql("CREATE DATABASE fresh")
        primary.sql("CREATE DATABASE upgraded")
        primary.sql("CREATE EXTENSION pg_ccm", dbname="fresh")
        primary.sql("CREATE EXTENSION pg_ccm VERSION '0.1.0'", dbname="upgraded")
        old = surface(primary, "upgraded")
        assert not any("wal_cache" in row[0] for row in old)
        primary.sql("ALTER EXTENSION pg_ccm UPDATE", dbname="upgraded")
        newest = primary.one("SELECT default_version FROM pg_available_extensions WHERE name = 'pg_ccm'")
        assert primary.one("SELECT extversion FROM pg_extension WHERE extname = 'pg_ccm'", dbname="upgraded") == newest
        assert surface(primary, "upgraded") == surface(primary, "fresh")
        # 0.2.0: the WAL cache's four functions; 0.4.0: ccm_hot_blocks_each and ccm_wal_source;
        # 0.5.0: ccm_buffer_changes (0.6.0 gave it the colder lists); 0.7.0: ccm_library_version;
        # 0.8.0: ccm_report_candidates, ccm_candidate_reports and the view ccm_candidates;
        # 0.9.0: ccm_os_cached_blocks and ccm_os_prefetch.
        assert len(surface(primary, "fresh")) == len(old) + 13
    finally:
        cluster.destroy()


def test_create_extension_adopts_only_a_plain_ccm_agent_role():
    """A pre-existing role named ccm_agent would receive the transfer functions: one that can
    log in (or holds any attribute) is refused; a plain group role is adopted, naming its members
    and the roles that can add members (ADMIN OPTION)."""
    cluster = Cluster()
    try:
        cluster.create(extensions=(), standby=False)
        primary = cluster.primary
        primary.sql("CREATE ROLE ccm_agent LOGIN")
        with primary.connect() as conn:
            with pytest.raises(psycopg.Error) as raised:
                conn.execute("CREATE EXTENSION pg_ccm")
        assert raised.value.sqlstate == "42710"
        assert raised.value.diag.message_primary == 'role "ccm_agent" already exists and is not a plain group role'
        assert primary.one("SELECT count(*) FROM pg_extension WHERE extname = 'pg_ccm'") == 0

        primary.sql("ALTER ROLE ccm_agent NOLOGIN")
        primary.sql("CREATE ROLE squatter LOGIN IN ROLE ccm_agent")
        primary.sql("CREATE ROLE gatekeeper LOGIN")
        primary.sql("GRANT ccm_agent TO gatekeeper WITH ADMIN OPTION")
        notices: list[str] = []
        with primary.connect() as conn:
            conn.add_notice_handler(lambda notice: notices.append(f"{notice.message_primary} {notice.message_detail}"))
            conn.execute("CREATE EXTENSION pg_ccm")
        adopted = [n for n in notices if 'existing role "ccm_agent"' in n]
        assert len(adopted) == 1 and "squatter" in adopted[0], notices
        assert "Roles holding ADMIN OPTION on it (gatekeeper)" in adopted[0], adopted
    finally:
        cluster.destroy()
