#!/usr/bin/env python3
"""Logical WAL cache benchmark: catch-up of a paused logical consumer after a write burst,
with the cache off, at its default and at a size that covers the burst, side by side.

    python3 bench/wal_cache_bench.py [--pg N] [--scale 10] [--burst-transactions 60000] [--memory 512M]

PostgreSQL: the server and client programs of /usr/lib/postgresql/N/bin for `--pg N`; by default
the newest version installed there (15 to 18) that has pg_ccm installed. The version is printed
first and in the summary; a version without pg_ccm stops the benchmark at once, naming
`scripts/install.sh --pg N`.

For each cache size (0, 2048 pages = 16 MB, and one that covers the burst) it:
  1. starts a primary (wal_level=logical, shared_buffers 128MB) inside a memory cgroup
     (cgroup v1, limit --memory) and loads pgbench data; a logical slot (test_decoding) is
     created and a pg_recvlogical consumer keeps up with it;
  2. measures the primary's TPS (pgbench tpcb-like, --tps-seconds) with the consumer running;
  3. pauses the consumer (it exits; the slot stays) and runs a write burst: pgbench with a
     script inserting 40 rows per transaction, a fixed number of transactions;
  4. creates the memory pressure of a busy host in the same cgroup: a process takes --hog-mb
     of anonymous memory (there is no swap, so the page cache must shrink) and another
     streams a large file through the page cache in a loop; then waits a few seconds,
  5. resumes the consumer (pg_recvlogical --endpos = the end of the burst) and times it until
     it has decoded everything, recording the walsender's reads from storage
     (/proc/<pid>/io read_bytes) and the slot's cache_hit / cache_miss.

--read-iops/--read-mbps put the server in a cgroup v1 blkio group that throttles its reads
from the disk, to emulate network block storage (EBS gp3's baseline: 3000 IOPS, 125 MB/s)
instead of this machine's local disk.

The server runs with the memory-lock limit of this machine (RLIMIT_MEMLOCK 8 MB for
postgres here; see README: pages beyond it are held by touching, not locking), or with
--ipc-lock, with the CAP_IPC_LOCK capability, which lifts the limit.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.cgroups import BlkioThrottle, MemoryCgroup, controller_available, data_device  # noqa: E402
from harness.cluster import (Cluster, Node, PgVersionError, pg_bin, pg_version_text, pgbench,  # noqa: E402
                             resolve_pg_versions, use_pg_version)
from harness.logical import Recvlogical, pages_between, wal_cache_row, wal_cache_status  # noqa: E402

def say(text: str = "") -> None:
    print(text, flush=True)


class Streamer:
    """Reads a large file again and again through the page cache, inside the cgroup."""

    def __init__(self, cgroup: MemoryCgroup, path: Path):
        # Dropped from the page cache before every pass, so that each pass really reads it and
        # its pages are charged to this cgroup (pages cached by an earlier run are not).
        script = f"while true; do vmtouch -q -e {path}; dd if={path} of=/dev/null bs=1M status=none; done"
        self.process = subprocess.Popen([*cgroup.wrapper, "sh", "-c", script], start_new_session=True)

    def stop(self) -> None:
        os.killpg(self.process.pid, 15)
        self.process.wait()


class MemoryHog:
    """Anonymous memory held (and touched every second) inside the cgroup: applications
    growing on a busy host. Without swap it cannot be reclaimed, so the page cache (WAL
    included) must shrink to what is left."""

    def __init__(self, cgroup: MemoryCgroup, megabytes: int):
        code = (f"import time\nb = bytearray({megabytes} * 2**20)\n"
                "while True:\n    b[::4096] = b'x' * len(b[::4096])\n    time.sleep(1)\n")
        self.process = subprocess.Popen([*cgroup.wrapper, sys.executable, "-c", code])

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_big_file(path: Path, megabytes: int) -> None:
    if path.exists() and path.stat().st_size == megabytes * 2**20:
        return
    say(f"writing {megabytes} MB of streaming data to {path}")
    subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=1M", f"count={megabytes}", "status=none"], check=True)


def tps_of(output: str) -> float:
    for line in output.splitlines():
        if line.startswith("tps = "):
            return float(line.split()[2])
    raise RuntimeError(output)


def walsender_read_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except FileNotFoundError:
        return None
    return None


def settle_restart_lsn(primary: Node, timeout: float = 15) -> None:
    """Lets the running consumer move the slot's restart_lsn up to now, so that the paused
    consumer re-reads the burst and not also up to 15 s of the WAL before it: a checkpoint
    logs the running transactions, which give decoding a new restart point once confirmed."""
    primary.sql("CHECKPOINT")
    target = primary.one("SELECT pg_current_wal_lsn()::text")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if primary.one("SELECT restart_lsn >= %s::pg_lsn FROM pg_replication_slots WHERE slot_name = 'bench'", [target]):
            return
        time.sleep(0.2)


BURST_SCRIPT = "INSERT INTO burst (payload) SELECT repeat(md5(random()::text), 4) FROM generate_series(1, 40);\n"


def run_one(args: argparse.Namespace, cache_pages: int, big_file: Path) -> dict:
    cgroup = MemoryCgroup(f"pg_ccm_bench_{cache_pages}", args.memory)
    throttle = None
    cluster = Cluster(settings={
        "wal_level": "logical", "shared_buffers": "'128MB'", "ccm.logical_wal_cache": cache_pages,
        "max_wal_size": "'4GB'", "checkpoint_timeout": "'30min'", "wal_keep_size": "0",
    })
    cluster.primary.wrapper = cgroup.wrapper
    cluster.primary.ipc_lock = args.ipc_lock
    if args.read_iops or args.read_mbps:
        throttle = BlkioThrottle(f"pg_ccm_bench_{cache_pages}", data_device(cluster.base), args.read_iops, args.read_mbps)
        cluster.primary.wrapper = [*throttle.wrapper, *cgroup.wrapper]
    result: dict = {"cache_pages": cache_pages}
    streamer = hog = None
    try:
        cluster.create(extensions=("pg_ccm",), standby=False)
        primary = cluster.primary
        pgbench(primary, "-i", "-s", str(args.scale), "-q")
        primary.sql("CREATE TABLE burst (id bigserial PRIMARY KEY, payload text)")
        primary.sql("SELECT pg_create_logical_replication_slot('bench', 'test_decoding')")
        consumer = Recvlogical(primary, "bench")
        try:
            time.sleep(1)
            worker = wal_cache_status(primary)["worker_pid"]
            cpu_before = cpu_seconds(worker) if worker else 0.0
            out = pgbench(primary, "-c", "2", "-j", "2", "-T", str(args.tps_seconds), "-n").stdout
            result["tps"] = tps_of(out)
            result["worker_cpu_pct"] = 100 * (cpu_seconds(worker) - cpu_before) / args.tps_seconds if worker else 0.0
            settle_restart_lsn(primary)
        finally:
            consumer.stop()

        primary.sql("SELECT aurora_stat_reset_wal_cache(NULL)")
        # Decoding resumes at restart_lsn, which trails confirmed_flush by up to the interval
        # of running-xacts records (15 s): that WAL is read again, though nothing is sent.
        start, restart = primary.sql("SELECT confirmed_flush_lsn::text, restart_lsn::text FROM pg_replication_slots WHERE slot_name = 'bench'")[0]
        script = cluster.base / "burst.sql"
        script.write_text(BURST_SCRIPT)
        pgbench(primary, "-c", "4", "-j", "2", "-t", str(args.burst_transactions // 4), "-n", "-f", str(script))
        end = primary.one("SELECT pg_current_wal_flush_lsn()::text")
        result["burst_mb"] = pages_between(start, end) * 8192 / 2**20
        result["reread_mb"] = pages_between(restart, end) * 8192 / 2**20
        time.sleep(0.2)
        result["held_blocks"] = wal_cache_status(primary)["held_blocks"]

        hog = MemoryHog(cgroup, args.hog_mb) if args.hog_mb else None
        streamer = Streamer(cgroup, big_file)
        time.sleep(args.pressure_seconds)

        started = time.perf_counter()
        consumer = Recvlogical(primary, "bench", endpos=end)
        read_bytes: dict[int, int] = {}
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                for (pid,) in primary.sql("SELECT pid FROM pg_stat_replication WHERE application_name = 'pg_recvlogical'"):
                    value = walsender_read_bytes(pid)
                    if value is not None:
                        read_bytes[pid] = value
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = consumer.wait(timeout=args.timeout)
        result["catch_up_s"] = time.perf_counter() - started
        done.set()
        sampler.join()
        if code != 0:
            raise RuntimeError(f"pg_recvlogical exited {code}: {consumer.process.stderr.read()}")
        result["walsender_read_mb"] = sum(read_bytes.values()) / 2**20
        time.sleep(0.1)
        row = wal_cache_row(primary, "bench")
        result.update(hits=row["cache_hit"], misses=row["cache_miss"], hit_rate=row["hit_rate"])
    finally:
        if streamer:
            streamer.stop()
        if hog:
            hog.stop()
        cluster.destroy()
        cgroup.remove()
        if throttle:
            throttle.remove()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", type=int, metavar="N",
                        help="PostgreSQL major version to run (default: the newest installed one that has pg_ccm)")
    parser.add_argument("--scale", type=int, default=10, help="pgbench scale (default 10, 150 MB)")
    parser.add_argument("--burst-transactions", type=int, default=8000,
                        help="transactions of the burst, each inserting 40 rows of 128 bytes (default 8000)")
    parser.add_argument("--read-iops", type=int, default=0, help="throttle the server's reads to this many IOPS (0: no limit)")
    parser.add_argument("--read-mbps", type=int, default=0, help="throttle the server's reads to this many MB/s (0: no limit)")
    parser.add_argument("--covering-pages", type=int, default=0,
                        help="the cache size that covers the burst, in 8 kB pages (default: what the first two runs decoded on resume, from restart_lsn to the end of the burst, + 25%%)")
    parser.add_argument("--memory", default="512M", help="memory limit of the server's cgroup")
    parser.add_argument("--hog-mb", type=int, default=200,
                        help="anonymous memory taken in the cgroup while the consumer catches up (default 200)")
    parser.add_argument("--stream-file-mb", type=int, default=2048, help="size of the file streamed for memory pressure")
    parser.add_argument("--pressure-seconds", type=float, default=5.0, help="streaming before the consumer resumes")
    parser.add_argument("--tps-seconds", type=int, default=20, help="length of the TPS measurement")
    parser.add_argument("--ipc-lock", action="store_true",
                        help="start the server with CAP_IPC_LOCK (systemd: AmbientCapabilities=CAP_IPC_LOCK), "
                             "so that the whole cache is locked whatever RLIMIT_MEMLOCK says")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/pg_ccm-bench"))
    args = parser.parse_args()
    try:
        (version,) = resolve_pg_versions(args.pg)
    except PgVersionError as error:
        parser.error(str(error))
    use_pg_version(version)
    say(f"{pg_version_text()} ({pg_bin()})")
    # SIGTERM unwinds like Ctrl-C, so that servers, cgroups and the pressure processes go.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if not controller_available("memory"):
        sys.exit("this benchmark needs the cgroup v1 memory controller (/sys/fs/cgroup/memory)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    big_file = args.workdir / "stream.bin"
    make_big_file(big_file, args.stream_file_mb)

    results = []
    sizes = [0, 2048, args.covering_pages]
    for index, pages in enumerate(sizes):
        if pages == 0 and index == 2:
            # Size the covering cache from what the first two runs decoded on resume (from
            # restart_lsn to the end of the burst), plus a quarter.
            pages = int(max(r["reread_mb"] for r in results) * 1.25 * 128)
        say(f"== ccm.logical_wal_cache = {pages} pages ({pages * 8 / 1024:.0f} MB)")
        result = run_one(args, pages, big_file)
        say("   " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
        results.append(result)

    say()
    storage = "local disk, unthrottled"
    if args.read_iops or args.read_mbps:
        limits = [f"{args.read_iops} IOPS" if args.read_iops else "", f"{args.read_mbps} MB/s" if args.read_mbps else ""]
        storage = "reads throttled to " + " and ".join(limit for limit in limits if limit)
    if args.ipc_lock:
        storage += "; server with CAP_IPC_LOCK"
    else:
        storage += "; server with this machine's RLIMIT_MEMLOCK (8 MB)"
    reread = ", ".join(f"{r['reread_mb']:.0f}" for r in results)
    say(f"{pg_version_text()}: catch-up after a write burst of {results[0]['burst_mb']:.0f} MB of WAL; decoding resumes at the slot's "
        f"restart_lsn and reads {reread} MB per run "
        f"(pgbench scale {args.scale}, cgroup memory {args.memory} with {args.hog_mb} MB taken and a {args.stream_file_mb} MB file streamed meanwhile, {storage})")
    say()
    say("| ccm.logical_wal_cache | held at resume | catch-up | walsender reads from storage | cache_hit | cache_miss | hit_rate | TPS before the burst | worker CPU |")
    say("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        say(f"| {r['cache_pages']} pages ({r['cache_pages'] * 8 / 1024:.0f} MB) | {r['held_blocks']} pages | {r['catch_up_s']:.1f} s | "
            f"{r['walsender_read_mb']:.1f} MB | {r['hits']} | {r['misses']} | {r['hit_rate']} | {r['tps']:.0f} | {r['worker_cpu_pct']:.1f}% |")
    off, covering = results[0], results[2]
    say()
    say(f"covering cache vs off: catch-up {off['catch_up_s'] / covering['catch_up_s']:.1f}x faster (target >= 5x); "
        f"TPS {100 * (covering['tps'] / off['tps'] - 1):+.1f}% (default {100 * (results[1]['tps'] / off['tps'] - 1):+.1f}%)")


if __name__ == "__main__":
    main()
