"""Hostile bytea input from unprivileged roles, on a server whose processes cannot map more
than HEADROOM bytes beyond an idle backend (the postmaster runs under ``prlimit --as``).

Finding 2 of the safety review: a 50 MB block list declaring 100 million blocks, sent by a
mere pg_monitor member to ccm_unpack_block_list() or ccm_block_list_info(), made a backend
allocate gigabytes of Rust heap; when an allocation failed, Rust aborted, and the
postmaster restarted every session. Finding 11: ccm_buffer_filter(1e-300), callable by
ccm_agent, built a 2^32-bit filter (about 1.5 GB in copies).

Under the address-space limit an oversized allocation fails deterministically (as it does
with vm.overcommit_memory=2), so this test crashes the server unless every such input is
refused with an ERROR before anything is allocated for it, and it shows that a large valid
list is streamed rather than materialised: counting its rows fits under the limit.

Detecting a crash: pg_postmaster_start_time() is checked, but a crash-restart (a backend
killed by a signal, every session terminated, crash recovery) keeps the postmaster and its
start time, as observed on PostgreSQL 15. The test therefore also keeps a bystander
session open across the attacks (a crash-restart terminates it) and reads the server log.
Against the code before the fix, the first hostile call killed its backend with SIGABRT
("memory allocation of 400000000 bytes failed") and the postmaster reinitialised.
"""

from __future__ import annotations

import struct
from pathlib import Path

import psycopg
import pytest

from harness.cluster import Node

# The extension's own code paths: on every version, the assertion-enabled one included.
pytestmark = pytest.mark.every_version

# Address space the server's processes get beyond what an idle backend maps (about 0.2 GB
# with 128 MB shared_buffers). The fixed code needs about 0.25 GB of it, to build the
# hostile list in SQL. Decoding that list the old way needed about 3 GB (0.5 GB for
# ccm_block_list_info), and materialising the rows of VALID_BLOCKS about 0.6 GB: none of
# that fits, so an implementation that allocates per block fails here.
HEADROOM = 448 << 20

# The review's 50 MB list: one relation fork, one run of 100 million blocks from block 0,
# usage counts all 0. It is a *valid* list; only its size is hostile. Built by the server.
HOSTILE_LIST = (
    "decode('43434d4201000000'||'01000000'||'00e1f505'||repeat('00',16)||"
    "'7f060000'||'05000000'||'00400000'||'00'||'01'||'00'||'ffc1d72f','hex')"
    " || decode(repeat('00',50000000),'hex')"
)
HOSTILE_BLOCKS = 100_000_000

# A valid list the inspection functions accept (their limit is 2^24 blocks, or
# shared_buffers if larger) and that is far too large to materialise under the limit.
VALID_BLOCKS = 16_000_000

MONITOR = "hostile_monitor"
AGENT = "hostile_agent"


def one_run_list(blocks: int, usage: int) -> bytes:
    """A list of one relation fork whose blocks 0..blocks-1 all have usage count `usage`:
    the densest encoding there is (half a byte per block)."""
    header = b"CCMB" + struct.pack("<BBHIIQQ", 1, 0, 0, 1, blocks, 0, 0)
    group = struct.pack("<IIIB", 1663, 5, 16384, 0) + b"\x01\x00"  # one run, from block 0
    length, varint = blocks - 1, bytearray()
    while length >= 0x80:
        varint.append((length & 0x7F) | 0x80)
        length >>= 7
    varint.append(length)
    nibbles = bytes([usage | usage << 4]) * (blocks // 2) + (bytes([usage]) if blocks % 2 else b"")
    return header + group + bytes(varint) + nibbles


def mapped_bytes(pid: int) -> int:
    """VmSize: the address space a process uses, which RLIMIT_AS bounds."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmSize for {pid}")


def address_space_limit(pid: int) -> int | None:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max address space"):
            soft = line.split()[3]
            return None if soft == "unlimited" else int(soft)
    return None


def sqlstate_of(conn: psycopg.Connection, query: str, params=None) -> str | None:
    try:
        conn.execute(query, params).fetchall()
    except psycopg.Error as error:
        return error.sqlstate
    return None


def restart_under_address_space_limit(node: Node, limit: int) -> None:
    node.stop()
    node.wrapper = ["prlimit", f"--as={limit}", "--"]
    node.start()
    pid = node.postmaster_pid()
    assert pid is not None and address_space_limit(pid) == limit


def test_hostile_lists_and_rates_raise_errors_under_an_address_space_limit(cluster):
    primary = cluster.primary
    primary.sql(f"CREATE ROLE {MONITOR} LOGIN")
    primary.sql(f"GRANT pg_monitor TO {MONITOR}")
    primary.sql(f"CREATE ROLE {AGENT} LOGIN")
    primary.sql(f"GRANT ccm_agent TO {AGENT}")
    assert primary.sql(
        "SELECT r.rolname FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.roleid "
        "WHERE m.member = %s::regrole", [MONITOR]
    ) == [("pg_monitor",)]

    # Lists stored in a table: TOASTed (compressed, out of line), so the functions read a
    # copy detoasted into the SRF's memory, across calls.
    primary.sql("CREATE TABLE hostile_lists (id int PRIMARY KEY, list bytea)")
    primary.sql("INSERT INTO hostile_lists VALUES (1, %s), (2, %s)", [one_run_list(1_000_000, 5), one_run_list(1000, 3)])
    primary.sql(f"GRANT SELECT ON hostile_lists TO {MONITOR}")
    assert primary.one("SELECT pg_column_compression(list) FROM hostile_lists WHERE id = 1") == "pglz"

    with primary.connect(user=MONITOR) as conn:
        conn.execute("SELECT * FROM ccm_block_list_info(%s)", [one_run_list(10, 5)]).fetchall()
        idle = mapped_bytes(conn.execute("SELECT pg_backend_pid()").fetchone()[0])
    limit = (idle + HEADROOM) // (1 << 20) * (1 << 20)
    restart_under_address_space_limit(primary, limit)
    postmaster = primary.postmaster_pid()
    started = primary.one("SELECT pg_postmaster_start_time()")
    bystander = primary.connect()
    bystander_pid = bystander.execute("SELECT pg_backend_pid()").fetchone()[0]

    with primary.connect(user=MONITOR) as conn:
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        assert address_space_limit(backend) == limit
        # The limit is armed: an allocation beyond it fails, as an ERROR from palloc.
        assert sqlstate_of(conn, "SELECT length(repeat('x', 900000000))") == "53200"

        # The review's list, to both inspection functions: refused from its header (54000
        # program_limit_exceeded), before any block is allocated or any row emitted.
        for query in (
            f"SELECT count(*) FROM ccm_unpack_block_list({HOSTILE_LIST})",
            f"SELECT * FROM ccm_block_list_info({HOSTILE_LIST})",
        ):
            with pytest.raises(psycopg.Error) as refused:
                conn.execute(query).fetchall()
            assert refused.value.sqlstate == "54000", query
            assert f"declares {HOSTILE_BLOCKS} blocks" in (refused.value.diag.message_detail or "")
            # The session survives; so does the server.
            assert conn.execute("SELECT pg_backend_pid()").fetchone()[0] == backend

        # A large valid list is streamed: its rows never exist all at once.
        valid = one_run_list(VALID_BLOCKS, 5)
        assert len(valid) < VALID_BLOCKS // 2 + 64
        info = conn.execute("SELECT relation_forks, blocks, bytes FROM ccm_block_list_info(%s)", [valid]).fetchone()
        assert info == (1, VALID_BLOCKS, len(valid))
        counted = conn.execute(
            "SELECT count(*), min(relblocknumber), max(relblocknumber), min(usagecount), max(usagecount) "
            "FROM ccm_unpack_block_list(%s)", [valid]
        ).fetchone()
        assert counted == (VALID_BLOCKS, 0, VALID_BLOCKS - 1, 5, 5)

        # TOASTed arguments, through a FunctionScan (materialised) and a ProjectSet (streamed
        # straight into the aggregate).
        assert conn.execute(
            "SELECT l.id, count(*), max(u.relblocknumber), max(u.usagecount) "
            "FROM hostile_lists l, ccm_unpack_block_list(l.list) u GROUP BY l.id ORDER BY l.id"
        ).fetchall() == [(1, 1_000_000, 999_999, 5), (2, 1000, 999, 3)]
        assert conn.execute(
            "SELECT count(*), sum((b).usagecount) FROM (SELECT ccm_unpack_block_list(list) AS b FROM hostile_lists) s"
        ).fetchone() == (1_001_000, 5_003_000)

        # Malformed input still raises 22P03 and emits nothing, however large it claims to be.
        corrupt = valid[:-1] + b"\x66"  # a usage count of 6 in the last byte
        assert sqlstate_of(conn, "SELECT count(*) FROM ccm_unpack_block_list(%s)", [corrupt]) == "22P03"
        assert sqlstate_of(conn, "SELECT * FROM ccm_block_list_info(%s)", [corrupt]) == "22P03"
        assert conn.execute("SELECT pg_backend_pid()").fetchone()[0] == backend

    with primary.connect(user=AGENT) as conn:
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        # A 2^32-bit filter is never built: the rate is refused before anything is allocated.
        for rate in ("1e-300", "1e-7", "0", "1", "'NaN'"):
            assert sqlstate_of(conn, f"SELECT ccm_buffer_filter({rate})") == "22023", rate
        with pytest.raises(psycopg.Error) as refused:
            conn.execute("SELECT ccm_buffer_filter(1e-300)")
        assert refused.value.diag.message_primary == "invalid false_positive_rate: 1e-300"
        assert refused.value.diag.message_hint
        # The smallest accepted rate makes a filter of at most about 29 bits per buffer.
        nbuffers = conn.execute("SELECT setting::int8 FROM pg_settings WHERE name = 'shared_buffers'").fetchone()[0]
        bits = conn.execute("SELECT bits FROM ccm_filter_info(ccm_buffer_filter(1e-6))").fetchone()[0]
        assert 64 <= bits <= 29 * nbuffers + 64
        assert conn.execute("SELECT pg_backend_pid()").fetchone()[0] == backend

    # Nothing crashed: same postmaster, no crash-restart (which would have terminated the
    # bystander), no backend killed by a signal.
    assert primary.postmaster_pid() == postmaster
    assert primary.one("SELECT pg_postmaster_start_time()") == started
    with bystander:
        assert bystander.execute("SELECT pg_backend_pid()").fetchone()[0] == bystander_pid
    log = primary.logfile.read_text(errors="replace")
    assert "terminated by signal" not in log
    assert "all server processes terminated; reinitializing" not in log
