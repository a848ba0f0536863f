"""What a pass of the page-cache tier (extension 0.9.0) costs once the standby holds the
primary's page cache: the pass the agent repeats after every pause (os_cache_pause).

A table of SIZE_MB is written and read on the primary (its file in the page cache), the standby
is made to hold it (one ccm_os_prefetch pass); then a steady pass is timed, as the agent makes
it: the primary's walk in slices (ccm_os_cached_blocks, 1 GB of cached blocks or 2048 files
each) and the standby's count of the same lists (ccm_os_prefetch, which finds everything
cached and reads nothing). Measured: each backend's CPU time (/proc/<pid>/schedstat) and the
bytes of the lists (what crosses the wire twice: primary to agent, agent to standby), per GB
of page cache and extrapolated to 64 GB at the default pause of 2 minutes.

    python3 bench/os_cache_cost.py PG_VERSION SIZE_MB
"""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from harness.cluster import Cluster, make_table, read, use_pg_version  # noqa: E402

SLICE = "SELECT list, last_spc, last_db, last_rel, last_block, complete FROM ccm_os_cached_blocks(%s, %s, %s, %s, 131072, 2048)"
PAUSE_S = 120  # os_cache_pause, the default


def cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e6


def walk(conn) -> list[bytes]:
    lists, after = [], (0, 0, 0, -1)
    while True:
        row = conn.execute(SLICE, after).fetchone()
        lists.append(row[0])
        if row[5]:
            return lists
        after = row[1:5]


def main() -> None:
    version, size_mb = int(sys.argv[1]), int(sys.argv[2])
    use_pg_version(version)
    with Cluster(settings={"shared_buffers": "'128MB'", "max_wal_size": "'4GB'"}) as cluster:
        primary, standby = cluster.primary, cluster.standby
        make_table(primary, "t", size_mb)
        primary.sql("CHECKPOINT")
        read(primary, "t")
        cluster.wait_caught_up()
        with primary.connect() as p, standby.connect() as s:
            for list_ in walk(p):  # the standby holds it all
                s.execute("SELECT * FROM ccm_os_prefetch(%s)", [list_])
            time.sleep(2)
            pp, sp = p.info.backend_pid, s.info.backend_pid
            c0, t0 = cpu_ms(pp), time.perf_counter()
            lists = walk(p)
            primary_ms, wall_ms = cpu_ms(pp) - c0, (time.perf_counter() - t0) * 1e3
            c0 = cpu_ms(sp)
            held = requested = 0
            for list_ in lists:
                row = s.execute("SELECT requested, already_cached FROM ccm_os_prefetch(%s, false)", [list_]).fetchone()
                requested, held = requested + row[0], held + row[1]
            standby_ms = cpu_ms(sp) - c0
        cached_gb = requested * 8192 / 2**30
        list_bytes = sum(len(x) for x in lists)
        per_gb = lambda v: v / cached_gb  # noqa: E731
        print(f"PostgreSQL {version}, a {size_mb} MB table; the primary caches {cached_gb:.2f} GB of relation files, "
              f"the standby holds {held / max(requested, 1):.1%} of it")
        print(f"one steady pass: {len(lists)} slices, {list_bytes} bytes of lists ({list_bytes / requested:.3f} per block), "
              f"primary {primary_ms:.0f} ms CPU ({wall_ms:.0f} ms wall), standby {standby_ms:.0f} ms CPU")
        print(f"per GB of page cache: primary {per_gb(primary_ms):.1f} ms, standby {per_gb(standby_ms):.1f} ms, "
              f"{per_gb(list_bytes) / 1024:.0f} kB of lists")
        bytes_64 = 2 * per_gb(list_bytes) * 64
        print(f"at 64 GB, a pass every {PAUSE_S} s: primary {per_gb(primary_ms) * 64 / PAUSE_S / 10:.2f}% of a core, "
              f"standby {per_gb(standby_ms) * 64 / PAUSE_S / 10:.2f}%, {bytes_64 / PAUSE_S / 1024:.0f} kB/s on the wire "
              "(the lists twice: from the primary, to one standby)")


if __name__ == "__main__":
    main()
