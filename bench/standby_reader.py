"""Does mirroring the primary's page cache cost a standby's own readers anything? A read
replica's workload (pgbench -S on the standby, its working set in the standby's page cache)
while ccm-agent runs in three arms, interleaved in rounds: the tier off; the tier on as shipped
(its readers first: nothing is read while client sessions run queries on the standby,
os_cache_busy_sessions 1); and the tier on without waiting for them (os_cache_busy_sessions 0).

Each round drops the standby's copy of a table of BIG_MB that the primary caches, so that the
tier has that much to read into the standby's page cache during the round, starts the standby's
workload for ROUND_S seconds and the agent right after it. Printed: each round's TPS, and per arm
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


def standby_load(port: int, seconds: int) -> subprocess.Popen:
    return subprocess.Popen([str(PG_BIN / "pgbench"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-n",
                             "-S", "-c", "4", "-j", "2", "-T", str(seconds), "postgres"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def tps(load: subprocess.Popen) -> float:
    out, _ = load.communicate()
    if load.returncode != 0:
        raise RuntimeError(f"pgbench on the standby failed ({load.returncode})")
    return float(re.search(r"tps = ([\d.]+)", out)[1])


def main() -> None:
    version = int(sys.argv[1])
    big_mb = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    round_s = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    use_pg_version(version)
    arms = {
        "tier off": ["--os-cache", "false"],
        "tier on, readers first": ["--os-cache-pause", "1s"],
        "tier on, never waits": ["--os-cache-pause", "1s", "--os-cache-busy-sessions", "0"],
    }
    results: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
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
            for arm, extra in arms.items():
                evict(big.parent)  # the standby's whole database; its own set is read again below
                tps(standby_load(standby.port, 10))
                evict(big)
                # The readers run first; the agent starts among them, as on a replica in use.
                load = standby_load(standby.port, round_s)
                agent = AgentProcess(primary.conninfo(), standby.conninfo(), Path(logs), interval="1s", extra=extra)
                agent.start()
                try:
                    wait_for("the agent's first cycle", lambda: agent.metric("ccm_agent_cycles_total") > 0, timeout=60)
                    round_tps = tps(load)
                    advised = agent.metric("ccm_agent_os_cache_read_bytes_total") / 8192
                finally:
                    agent.stop()
                results[arm].append((round_tps, advised))
                print(f"round {round_no + 1}, {arm}: {round_tps:.0f} TPS on the standby, {advised:.0f} blocks read "
                      "into its page cache by the tier", flush=True)
    for arm, values in results.items():
        print(f"{arm}: median {statistics.median(t for t, _ in values):.0f} TPS over {len(values)} rounds "
              f"({', '.join(f'{t:.0f}' for t, _ in values)}), median {statistics.median(b for _, b in values):.0f} "
              "blocks read by the tier")


if __name__ == "__main__":
    main()
