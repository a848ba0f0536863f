"""Logical replication consumers and WAL-cache readings, for tests and the benchmark."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from harness.cluster import PG_BIN, Node

PAGE = 8192


def lsn_to_int(lsn: str) -> int:
    high, low = lsn.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def pages_between(start: str | int, end: str | int) -> int:
    """WAL pages a slot consumes going from `start` to `end` (as our counters count them)."""
    start = lsn_to_int(start) if isinstance(start, str) else start
    end = lsn_to_int(end) if isinstance(end, str) else end
    return -(-end // PAGE) - -(-start // PAGE)


class Recvlogical:
    """pg_recvlogical streaming a slot's changes to /dev/null; it confirms every second."""

    def __init__(self, node: Node, slot: str, endpos: str | None = None, options: dict[str, str] | None = None):
        argv = [str(PG_BIN / "pg_recvlogical"), "-h", "127.0.0.1", "-p", str(node.port), "-U", "postgres",
                "-d", "postgres", "-S", slot, "--start", "-f", "/dev/null", "-s", "1", "-F", "1", "--no-loop"]
        if endpos:
            argv += ["--endpos", endpos]
        for key, value in (options or {}).items():
            argv += ["-o", f"{key}={value}"]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait(self, timeout: float | None = None) -> int:
        self.process.wait(timeout=timeout)
        return self.process.returncode

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.process.communicate(timeout=30)


def wal_cache_row(node: Node, slot: str) -> dict[str, Any] | None:
    rows = node.sql(
        "SELECT name, active_pid, cache_hit, cache_miss, blks_read, hit_rate, last_reset_timestamp "
        "FROM aurora_stat_logical_wal_cache() WHERE name = %s", [slot])
    if not rows:
        return None
    keys = ("name", "active_pid", "cache_hit", "cache_miss", "blks_read", "hit_rate", "last_reset_timestamp")
    return dict(zip(keys, rows[0]))


def wal_cache_status(node: Node) -> dict[str, Any]:
    with node.connect() as conn:
        cur = conn.execute("SELECT * FROM ccm_logical_wal_cache_status()")
        names = [column.name for column in cur.description]
        return dict(zip(names, cur.fetchone()))


def resident_bytes(path: Path) -> int:
    """Bytes of the file in the OS page cache (util-linux fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip() or 0)
