#!/usr/bin/env python3
"""Cold reads on a streaming standby: pg_prewarm of a data set against one ccm_prewarm call
of the primary's hot list, each after a cold restart of the standby, alternated over rounds.

    python3 bench/cold_read.py [--pg N] [--size 2GB] [--rounds 3] [--ranges 25000]

On a fresh primary and standby with shared_buffers = --size on both, the data set of
bench/steady.py (a table and its index, 0.95 x shared_buffers) is read 4 times on the primary,
so that all of it is hot, and `ccm_hot_blocks()` lists it. Then, per round, each after a cold
restart of the standby (CHECKPOINT on both, stopped, its files dropped from the page cache,
started, caught up): pg_prewarm of the table and the index; one ccm_prewarm() call of the
whole list with the default readahead threads; the same with
ccm.prewarm_readahead_threads = 0. No load runs, and no agent: this compares the two
functions' reads, not the agent's cycle (bench/steady.py --cold-restart does that).

--ranges N: instead, per round, pg_prewarm of the table in ranges of N blocks, each range's
time printed in order: where in the file a cold read is slow, and whether that place moves
from one restart to the next.

--batches N: instead, per round and each after its own cold restart, pg_prewarm of the table
and index, then the primary's hot blocks (pg_buffercache, usage count above 3) read by
ccm_prewarm calls of N blocks each, as the agent's cold load makes them: hottest first
(usage count down, then file order, agent's split_hottest_first), in file order, and in
file order with one usage count for all (so that each call, too, reads in file order); each
call's time printed. With --load, bench/steady.py's read-mostly load runs on the primary
throughout (after the data set has been made hot), so that usage counts differ as under
the agent.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import say  # noqa: E402
from harness import block_list  # noqa: E402
from harness.cluster import (Cluster, PgVersionError, pg_bin, pg_version_text,  # noqa: E402
                             resolve_pg_versions, use_pg_version)
from steady import (DATA, build_data, parse_sizes, prewarm, prewarm_cold, restart_standby_cold,  # noqa: E402
                    cpu_seconds, start_load)


def cold(cluster: Cluster) -> None:
    restart_standby_cold(cluster)
    cluster.wait_caught_up()


def timed(read) -> tuple[int, float]:
    started = time.monotonic()
    blocks = read()
    return blocks, time.monotonic() - started


def compare(cluster: Cluster, rounds: int) -> None:
    primary, standby = cluster.primary, cluster.standby
    prewarm(primary, 4)
    hot = bytes(primary.one("SELECT ccm_hot_blocks()"))

    def ccm_prewarm(threads: int | None):
        """A cold restart, then one ccm_prewarm call of the whole list: (blocks, seconds)."""
        def read() -> int:
            with standby.connect() as conn:
                if threads is not None:
                    conn.execute(f"SET ccm.prewarm_readahead_threads = {threads}")
                return conn.execute("SELECT loaded FROM ccm_prewarm(%s)", [hot]).fetchone()[0]

        def run() -> tuple[int, float]:
            cold(cluster)
            return timed(read)
        return run

    kinds = {"pg_prewarm": lambda: prewarm_cold(cluster)[:2], "ccm_prewarm": ccm_prewarm(None),
             "ccm_prewarm, readahead threads 0": ccm_prewarm(0)}
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    for round_ in range(1, rounds + 1):
        for name, run in kinds.items():
            blocks, took = run()
            seconds[name].append(took)
            say(f"round {round_}: {name} read {blocks:,} blocks in {took:.2f} s")
    say()
    say("| read | median | rounds |")
    say("|---|---:|---|")
    for name, values in seconds.items():
        say(f"| {name} | {statistics.median(values):.2f} s | {', '.join(f'{v:.2f}' for v in values)} |")


def ranges(cluster: Cluster, rounds: int, step: int) -> None:
    standby = cluster.standby
    blocks = cluster.primary.one(f"SELECT pg_relation_size('{DATA}') / 8192")
    for round_ in range(1, rounds + 1):
        cold(cluster)
        cells = []
        for first in range(0, blocks, step):
            last = min(blocks, first + step) - 1
            _, took = timed(lambda: standby.one("SELECT pg_prewarm(%s, 'buffer', 'main', %s, %s)", [DATA, first, last]))
            cells.append(f"{first // 1000}k {took * 1000:.0f}")
        say(f"round {round_}, ms per {step:,} blocks: " + ", ".join(cells))


def batch_reads(cluster: Cluster, rounds: int, size: int) -> None:
    primary, standby = cluster.primary, cluster.standby
    hot = primary.sql("SELECT reltablespace::int8, reldatabase::int8, relfilenode::int8, relforknumber, "
                      "relblocknumber, usagecount FROM pg_buffercache WHERE relfilenode IS NOT NULL AND usagecount > 3")
    usages = statistics.multimode(row[5] for row in hot)
    say(f"hot blocks on the primary: {len(hot):,}; by usage count: "
        + ", ".join(f"{u}: {sum(1 for row in hot if row[5] == u):,}" for u in sorted({row[5] for row in hot}))
        + f" (most: {usages})")
    orders = {"hottest first": sorted(hot, key=lambda row: (-row[5], row[:5])), "file order": sorted(hot),
              # ccm_prewarm reads a call's blocks hottest first: one usage count for all of
              # them leaves the file order alone within each call too
              "file order, one usage count": sorted(row[:5] + (5,) for row in hot)}

    def batched(order: list[tuple]) -> list[bytes]:
        return [block_list.encode(order[i:i + size]) for i in range(0, len(order), size)]

    lists = {name: batched(order) for name, order in orders.items()}
    seconds: dict[str, list[float]] = {name: [] for name in ("pg_prewarm", *lists)}

    def pg_prewarm(conn) -> int:
        return sum(conn.execute("SELECT pg_prewarm(%s)", [relation]).fetchone()[0] for relation in (DATA, f"{DATA}_pkey"))

    def ccm_batches(batches: list[bytes], calls: list[float]):
        def read(conn) -> int:
            loaded = 0
            for batch in batches:
                at = time.monotonic()
                loaded += conn.execute("SELECT loaded FROM ccm_prewarm(%s)", [batch]).fetchone()[0]
                calls.append(time.monotonic() - at)
            return loaded
        return read

    cpu: dict[str, list[float]] = {name: [] for name in seconds}
    say(f"untimed first read (the host's cache, see bench/steady.py): {prewarm_cold(cluster)[1]:.2f} s")
    for round_ in range(1, rounds + 1):
        for name in seconds:
            calls: list[float] = []
            read = pg_prewarm if name == "pg_prewarm" else ccm_batches(lists[name], calls)
            cold(cluster)
            with standby.connect() as conn:
                pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
                cpu_before, began = cpu_seconds(pid), time.monotonic()
                loaded = read(conn)
                took, used = time.monotonic() - began, cpu_seconds(pid) - cpu_before
            seconds[name].append(took)
            cpu[name].append(used)
            say(f"round {round_}: {name}: {loaded:,} blocks loaded in {took:.2f} s, the backend's CPU {used:.2f} s"
                + (f"; {len(calls)} calls of {size:,} blocks, ms each: {' '.join(f'{c * 1000:.0f}' for c in calls)}"
                   if calls else ""))
    say()
    say("| read | median | rounds | the backend's CPU, median |")
    say("|---|---:|---|---:|")
    for name, values in seconds.items():
        say(f"| {name} | {statistics.median(values):.2f} s | {', '.join(f'{v:.2f}' for v in values)} | "
            f"{statistics.median(cpu[name]):.2f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", metavar="N", help="PostgreSQL major version (default: the newest with pg_ccm)")
    parser.add_argument("--size", default="2GB", help="shared_buffers of both nodes (default 2GB)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--ranges", type=int, default=0, metavar="N", help="time pg_prewarm per N blocks instead")
    parser.add_argument("--batches", type=int, default=0, metavar="N",
                        help="ccm_prewarm calls of N blocks, hottest first and in file order, instead")
    parser.add_argument("--load", action="store_true", help="bench/steady.py's read-mostly load on the primary")
    args = parser.parse_args()
    try:
        [(label, size)] = parse_sizes(args.size)
        [version] = resolve_pg_versions(args.pg)
    except (ValueError, PgVersionError) as error:
        parser.error(str(error))
    use_pg_version(version)
    say(f"# cold reads on a standby — {time.strftime('%Y-%m-%d %H:%M')} — `{' '.join(sys.argv)}`")
    say(f"# {pg_version_text()} ({pg_bin()}), shared_buffers {label}")
    cluster = Cluster(settings={"shared_buffers": f"'{label}'", "max_wal_size": f"'{max(8, 3 * size >> 30)}GB'",
                                "checkpoint_timeout": "'1h'"})
    load = None
    try:
        primary, standby = cluster.primary, cluster.standby
        cluster.create(extensions=("pg_ccm", "pg_buffercache", "pg_prewarm"), standby=False)
        rows = build_data(primary, size, 0.95, 1000)
        primary.restart()
        cluster.clone_standby(standby, primary)
        standby.start()
        cluster.wait_caught_up(timeout=1800)
        if args.load or args.batches:
            prewarm(primary, 4)
        if args.load:
            load = start_load(primary, rows, 2, 2000, 1, 24 * 3600, cluster.base)
            time.sleep(20)
        if args.ranges:
            ranges(cluster, args.rounds, args.ranges)
        elif args.batches:
            batch_reads(cluster, args.rounds, args.batches)
        else:
            compare(cluster, args.rounds)
    finally:
        if load is not None:
            load.terminate()
            load.wait()
        cluster.destroy()


if __name__ == "__main__":
    main()
