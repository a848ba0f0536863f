"""Does mirroring the primary's page cache cost a standby's own readers anything? A read
replica's workload (pgbench -S on the standby, its working set in the standby's page cache)
while ccm-agent runs with the page-cache tier on and off, in interleaved rounds.

Each round drops the standby's copy of a table of BIG_MB that the primary caches, so that the
tier has that much to read into the standby's page cache during the round (at its start), and
then runs the standby's workload for ROUND_S seconds. Printed: each round's TPS, and per arm
the median TPS and the blocks the tier advised.

    python3 bench/standby_reader.py PG_VERSION [BIG_MB] [ROUNDS] [ROUND_S]
"""

import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from harness.agent import AgentProcess  # noqa: E402
from harness.cluster import PG_BIN, Cluster, make_table, pgbench, read, use_pg_version  # noqa: E402
from harness.wait import wait_for  # noqa: E402


def evict(path: Path) -> None:
    subprocess.run(["vmtouch", "-q", "-e", str(path)], check=True)


def standby_tps(port: int, seconds: int) -> float:
    out = subprocess.run([str(PG_BIN / "pgbench"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-n", "-S",
                          "-c", "4", "-j", "2", "-T", str(seconds), "postgres"], capture_output=True, text=True, check=True)
    return float(re.search(r"tps = ([\d.]+)", out.stdout)[1])


def main() -> None:
    version = int(sys.argv[1])
    big_mb = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    round_s = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    use_pg_version(version)
    results: dict[str, list[tuple[float, float]]] = {"tier off": [], "tier on": []}
    with Cluster(settings={"shared_buffers": "'128MB'", "max_wal_size": "'4GB'"}) as cluster, \
            tempfile.TemporaryDirectory() as logs:
        primary, standby = cluster.primary, cluster.standby
        pgbench(primary, "-i", "-s", "20", "-q")  # the replica's own working set, about 300 MB
        make_table(primary, "big", big_mb)
        primary.sql("CHECKPOINT")
        read(primary, "big")
        cluster.wait_caught_up()
        big = standby.datadir / primary.one("SELECT pg_relation_filepath('big')")
        for round_no in range(rounds):
            for arm in ("tier off", "tier on"):
                evict(big.parent)  # the standby's whole database; its own set is read again below
                standby_tps(standby.port, 10)
                evict(big)
                extra = ["--os-cache", "false"] if arm == "tier off" else ["--os-cache-pause", "1s"]
                agent = AgentProcess(primary.conninfo(), standby.conninfo(), Path(logs), interval="1s", extra=extra)
                agent.start()
                try:
                    wait_for("the agent's first cycle", lambda: agent.metric("ccm_agent_cycles_total") > 0, timeout=60)
                    tps = standby_tps(standby.port, round_s)
                    advised = agent.metric("ccm_agent_os_cache_read_bytes_total") / 8192
                finally:
                    agent.stop()
                results[arm].append((tps, advised))
                print(f"round {round_no + 1}, {arm}: {tps:.0f} TPS on the standby, {advised:.0f} blocks read into "
                      "its page cache by the tier", flush=True)
    for arm, values in results.items():
        print(f"{arm}: median {statistics.median(t for t, _ in values):.0f} TPS over {len(values)} rounds "
              f"({', '.join(f'{t:.0f}' for t, _ in values)})")


if __name__ == "__main__":
    main()
