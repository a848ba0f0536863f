#!/usr/bin/env python3
"""pg_ccm benchmarks: figures, side by side in one run, on real PostgreSQL servers.

    python3 bench/ccm_bench.py [--shared-buffers 4GB] [--only scan,filter,list,prewarm,overhead]

Sections:
  scan      hot-set scan speed (buffer headers per second) with shared_buffers full
  filter    filter size per cached buffer at 1% false positives, and build speed
  list      block-list bytes per block, clustered and scattered hot sets
  prewarm   ccm_prewarm against pg_prewarm(rel, 'buffer') on the same cold relation of a
            streaming standby, and a scattered list against reading the same blocks one at a time
  overhead  primary TPS under pgbench with and without a running ccm-agent

"Cold" means: server restarted (empty shared_buffers; a standby after a restartpoint) and the
relation's files evicted from the OS page cache (sync + POSIX_FADV_DONTNEED via vmtouch -e).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import block_list  # noqa: E402
from harness.agent import AgentProcess  # noqa: E402
from harness.cluster import Cluster, Node, PG_BIN, pgbench  # noqa: E402


def say(text: str = "") -> None:
    print(text, flush=True)


def timed(node: Node, query: str, params=None, repeat: int = 1, setup: tuple[str, ...] = ()) -> tuple[float, list]:
    """Median wall time of a statement over `repeat` runs, and the last result."""
    times, rows = [], []
    with node.connect() as conn:
        for statement in setup:
            conn.execute(statement)
        for _ in range(repeat):
            started = time.perf_counter()
            rows = conn.execute(query, params).fetchall()
            times.append(time.perf_counter() - started)
    return statistics.median(times), rows


def relation_path(node: Node, table: str) -> Path:
    return node.datadir / node.one("SELECT pg_relation_filepath(%s::regclass)", [table])


COLD_RUNS = 3


def cold_timed(cluster: Cluster, query: str, params=None, setup: tuple[str, ...] = ()) -> tuple[float, list]:
    """Median over COLD_RUNS runs on the standby, each from a cold start (restarted after a
    restartpoint, files evicted from the OS cache; single cold runs vary a lot)."""
    times, rows = [], []
    for _ in range(COLD_RUNS):
        cluster.make_standby_cold()
        seconds, rows = timed(cluster.standby, query, params, setup=setup)
        times.append(seconds)
    return statistics.median(times), rows


def fill_table(node: Node, table: str, megabytes: int) -> int:
    """A table of about `megabytes` MB (one 8 kB page holds 7 rows of 1 kB)."""
    rows = megabytes * 128 * 7
    node.sql(f"DROP TABLE IF EXISTS {table}")
    node.sql(f"CREATE TABLE {table} AS SELECT g AS id, repeat('x', 1000) AS pad FROM generate_series(1, {rows}) g")
    node.sql(f"VACUUM {table}")
    return node.one(f"SELECT pg_relation_size('{table}') / 8192")


def whole_relation_list(node: Node, table: str, blocks) -> bytes:
    spc, db = node.sql(
        "SELECT (SELECT oid FROM pg_tablespace WHERE spcname = 'pg_default')::int8, oid::int8 "
        "FROM pg_database WHERE datname = current_database()"
    )[0]
    rel = node.one("SELECT pg_relation_filenode(%s::regclass)::int8", [table])
    return block_list.encode([(spc, db, rel, 0, b, 5) for b in blocks])


def bench_scan(node: Node, nbuffers: int) -> None:
    say("## Hot-set scan speed")
    fill = nbuffers * 8 // 1024 * 9 // 10
    say(f"filling 90% of shared_buffers ({fill} MB of {nbuffers} buffers) and reading it twice (usage count 2) ...")
    fill_table(node, "scan_fill", fill)
    node.sql("SELECT pg_prewarm('scan_fill', 'buffer')")
    node.sql("SELECT pg_prewarm('scan_fill', 'buffer')")
    valid = node.one("SELECT count(*) FROM pg_buffercache WHERE relfilenode IS NOT NULL")
    say(f"valid buffers: {valid} of {nbuffers}")
    filter_all = node.one("SELECT ccm_buffer_filter(0.01)")
    cases = [
        ("nothing hot (threshold 4): header scan only", "SELECT ccm_hot_blocks(NULL, NULL, 4)", None),
        ("hot set = all valid buffers (threshold 0), no filter: every block listed", "SELECT ccm_hot_blocks(NULL, NULL, 0)", None),
        ("hot set = all valid buffers, standby filter holds them all", "SELECT ccm_hot_blocks(%s, NULL, 0)", [filter_all]),
        ("same, capped at the hottest 50% (agent's max_blocks path)", f"SELECT ccm_hot_blocks(%s, {nbuffers // 2}, 0)", [filter_all]),
    ]
    say("| case | hot buffers | listed | ms per scan | headers/s |")
    say("|---|---:|---:|---:|---:|")
    for label, query, params in cases:
        seconds, rows = timed(node, query, params, repeat=9)
        found, listed = node.sql("SELECT hot_buffers_found, blocks FROM ccm_block_list_info(%s)", [rows[0][0]])[0]
        say(f"| {label} | {found} | {listed} | {seconds * 1000:.1f} | {nbuffers / seconds / 1e6:.1f} M |")
    say()


def bench_filter(node: Node) -> None:
    say("## Filter size and build speed")
    say("| false-positive rate | cached buffers | filter bytes | bits per buffer | estimated fp | build ms | buffers/s |")
    say("|---:|---:|---:|---:|---:|---:|---:|")
    for rate in (0.01, 0.001):
        seconds, rows = timed(node, "SELECT (ccm_filter_info(f)).* FROM ccm_buffer_filter(%s) f", [rate], repeat=5)
        bits, hashes, items, fp, nbytes = rows[0]
        say(f"| {rate} | {items} | {nbytes} | {nbytes * 8 / items:.2f} | {fp:.4f} | {seconds * 1000:.1f} | {items / seconds / 1e6:.1f} M |")
    say()


def bench_list(node: Node) -> None:
    say("## Block-list size")
    say("| hot set | blocks | bytes | bytes per block |")
    say("|---|---:|---:|---:|")
    clustered = node.one("SELECT ccm_hot_blocks(NULL, NULL, 1)")
    info = node.sql("SELECT blocks, bytes FROM ccm_block_list_info(%s)", [clustered])[0]
    say(f"| clustered (90% of shared_buffers: one whole relation) | {info[0]} | {info[1]} | {info[1] / max(info[0], 1):.3f} |")
    blocks = node.one("SELECT pg_relation_size('scan_fill') / 8192")
    rng = random.Random(1)
    scattered = whole_relation_list(node, "scan_fill", sorted(rng.sample(range(blocks), min(100_000, blocks // 10))))
    info = node.sql("SELECT blocks, bytes FROM ccm_block_list_info(%s)", [scattered])[0]
    say(f"| scattered (10% of a {blocks * 8 // 1024} MB relation at random) | {info[0]} | {info[1]} | {info[1] / info[0]:.3f} |")
    say()


def bench_prewarm(cluster: Cluster, megabytes: int) -> None:
    say(f"## Prewarm throughput on a standby (cold relation: restarted standby, files evicted from the OS cache; median of {COLD_RUNS} cold runs)")
    blocks = fill_table(cluster.primary, "prewarm_rel", megabytes)
    cluster.primary.sql("CHECKPOINT")
    cluster.wait_caught_up(timeout=600)
    node = cluster.standby
    full_list = whole_relation_list(node, "prewarm_rel", range(blocks))
    say("| method | blocks | seconds | MB/s | vs baseline |")
    say("|---|---:|---:|---:|---:|")
    mb = blocks * 8 / 1024
    base, _ = cold_timed(cluster, "SELECT pg_prewarm('prewarm_rel', 'buffer')")
    say(f"| pg_prewarm(rel, 'buffer') | {blocks} | {base:.2f} | {mb / base:.0f} | 1.00 |")
    for label, setup in PREWARM_MODES:
        ours, rows = cold_timed(cluster, "SELECT loaded FROM ccm_prewarm(%s)", [full_list], setup=setup)
        assert rows[0][0] == blocks, rows
        say(f"| ccm_prewarm(whole relation), {label} | {blocks} | {ours:.2f} | {mb / ours:.0f} | {base / ours:.2f} |")

    rng = random.Random(2)
    for percent in (5, 15):
        sample = sorted(rng.sample(range(blocks), blocks * percent // 100))
        scattered = whole_relation_list(node, "prewarm_rel", sample)
        mb = len(sample) * 8 / 1024
        one_by_one, _ = cold_timed(
            cluster,
            "SELECT sum(pg_prewarm('prewarm_rel', 'buffer', 'main', b, b)) FROM unnest(%s::int8[]) b",
            [sample],
        )
        say(f"| pg_prewarm one block at a time, random {percent}% of the blocks | {len(sample)} | {one_by_one:.2f} | {mb / one_by_one:.0f} | 1.00 |")
        for label, setup in PREWARM_MODES:
            ours, rows = cold_timed(cluster, "SELECT loaded FROM ccm_prewarm(%s)", [scattered], setup=setup)
            assert rows[0][0] == len(sample), rows
            say(f"| ccm_prewarm(same list), {label} | {len(sample)} | {ours:.2f} | {mb / ours:.0f} | {one_by_one / ours:.2f} |")
    say()


PREWARM_MODES = [
    ("2 readahead threads (default)", ()),
    ("advice from the backend only (ccm.prewarm_readahead_threads = 0)", ("SET ccm.prewarm_readahead_threads = 0",)),
]


def tps(node: Node, seconds: int, clients: int) -> float:
    out = pgbench(node, "-b", "select-only", "-c", str(clients), "-j", "2", "-T", str(seconds), "-n", "-M", "prepared").stdout
    for line in out.splitlines():
        if line.startswith("tps = "):
            return float(line.split()[2])
    raise RuntimeError(out)


def bench_overhead(cluster: Cluster, rounds: int, seconds: int, clients: int, log_dir: Path) -> None:
    say("## Primary TPS with and without a running ccm-agent (pgbench select-only, interleaved rounds)")
    pgbench(cluster.primary, "-i", "-s", "20", "-q")
    cluster.wait_caught_up()
    tps(cluster.primary, 10, clients)  # warm the primary
    without, with_agent = [], []
    for _ in range(rounds):
        without.append(tps(cluster.primary, seconds, clients))
        with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval="1s"):
            with_agent.append(tps(cluster.primary, seconds, clients))
    say("| run | TPS per round | median TPS |")
    say("|---|---|---:|")
    say(f"| without agent | {', '.join(f'{t:.0f}' for t in without)} | {statistics.median(without):.0f} |")
    say(f"| with agent (1 s interval) | {', '.join(f'{t:.0f}' for t in with_agent)} | {statistics.median(with_agent):.0f} |")
    change = statistics.median(with_agent) / statistics.median(without) - 1
    say(f"\nTPS change with the agent: {change:+.2%}")
    say()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared-buffers", default="4GB")
    parser.add_argument("--prewarm-mb", type=int, default=1024, help="size of the cold relation")
    parser.add_argument("--only", default="scan,filter,list,prewarm,overhead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    only = set(args.only.split(","))

    say(f"# pg_ccm benchmark — {time.strftime('%Y-%m-%d %H:%M')} — `{' '.join(sys.argv)}`")
    say()
    settings = {"shared_buffers": f"'{args.shared_buffers}'", "fsync": "on", "max_wal_size": "'8GB'"}
    if only & {"scan", "filter", "list"}:
        with Cluster(settings=settings) as cluster:
            node = cluster.primary
            # The node runs alone: no standby replaying these big loads.
            cluster.standby.stop()
            node.sql("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
            nbuffers = node.one("SELECT setting::int8 FROM pg_settings WHERE name = 'shared_buffers'")
            bench_scan(node, nbuffers)
            if "filter" in only:
                bench_filter(node)
            if "list" in only:
                bench_list(node)
    if "prewarm" in only:
        # ccm_prewarm runs only on a standby: the relation is loaded on the primary and read,
        # cold, on its streaming standby; pg_prewarm is measured there too.
        with Cluster(settings=settings) as cluster:
            cluster.primary.sql("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
            bench_prewarm(cluster, args.prewarm_mb)
    if "overhead" in only:
        with Cluster(settings={"shared_buffers": "'512MB'"}) as cluster:
            bench_overhead(cluster, args.rounds, args.seconds, args.clients, cluster.base)


if __name__ == "__main__":
    main()
