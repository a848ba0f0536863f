"""Does what the page-cache tier read into a standby outlast the standby's own churn? A standby
under a memory limit (its processes, shared_buffers and page cache in one cgroup v1 memory
group, as a small host or a container) is made to hold a table the primary caches, with one
ccm_os_prefetch call; then tables are written on the primary, step by step, and the share of
the mirrored table still in the standby's page cache (fincore) is printed after each step's WAL
was received and replayed, with the group's file LRU lists (memory.stat).

To compare with an extension that only advises (before the read-back), install that build
(scripts/install.sh of an earlier commit) and run the same command.

    python3 bench/os_cache_churn.py PG_VERSION [LIMIT_MB] [MIRROR_MB] [STEP_MB] [STEPS]
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from harness.cgroups import MemoryCgroup  # noqa: E402
from harness.cluster import Cluster, make_table, read, use_pg_version  # noqa: E402

SCAN = "SELECT list FROM ccm_os_cached_blocks(0, 0, 0, -1, 1048576, 100000)"


def resident_share(path) -> float:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", str(path)],
                         check=True, capture_output=True, text=True).stdout
    res, size = (int(v) for v in out.split())
    return res / size if size else 1.0


def lru_mb(group: MemoryCgroup) -> str:
    stat = dict(line.split() for line in (group.path / "memory.stat").read_text().splitlines())
    return f"active_file {int(stat['active_file']) >> 20} MB, inactive_file {int(stat['inactive_file']) >> 20} MB"


def main() -> None:
    version = int(sys.argv[1])
    limit_mb, mirror_mb, step_mb, steps = (int(a) for a in (sys.argv[2:] + ["640", "200", "100", "4"][len(sys.argv) - 2:]))
    use_pg_version(version)
    group = MemoryCgroup("pg_ccm_os_churn", str(limit_mb * 2**20))
    try:
        cluster = Cluster(settings={"shared_buffers": "'128MB'", "max_wal_size": "'4GB'"},
                          standby_settings={"ccm.os_cache_min_free": "'32MB'"})
        cluster.standby.wrapper = group.wrapper
        try:
            cluster.create()
            primary, standby = cluster.primary, cluster.standby
            make_table(primary, "mirrored", mirror_mb)
            read(primary, "mirrored")
            primary.sql("CHECKPOINT")
            cluster.wait_caught_up()
            standby.sql("CHECKPOINT")
            standby.drop_os_cache()
            path = standby.datadir / primary.one("SELECT pg_relation_filepath('mirrored')")
            [(list_,)] = primary.sql(SCAN)
            advised = standby.one("SELECT advised FROM ccm_os_prefetch(%s)", [list_])
            print(f"{mirror_mb} MB mirrored ({advised} blocks read) in a {limit_mb} MB group: "
                  f"{resident_share(path):.1%} resident; {lru_mb(group)}", flush=True)
            for step in range(1, steps + 1):
                make_table(primary, f"churn{step}", step_mb)
                cluster.wait_caught_up()
                standby.sql("CHECKPOINT")
                print(f"after {step * step_mb} MB written on the primary: {resident_share(path):.1%} of the "
                      f"mirror resident; {lru_mb(group)}", flush=True)
        finally:
            cluster.destroy()
    finally:
        group.remove()


if __name__ == "__main__":
    main()
