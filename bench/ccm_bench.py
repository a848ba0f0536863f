#!/usr/bin/env python3
"""pg_ccm benchmarks: figures, side by side in one run, on real PostgreSQL servers.

    python3 bench/ccm_bench.py [--pg N | N,M,... | all] [--shared-buffers 4GB]
                               [--only scan,filter,list,prewarm,overhead,standbys] [--io-methods worker,io_uring]
    python3 bench/ccm_bench.py --only replay [--shared-buffers 4GB] [--rounds 3] [--replay-seconds 60]
    python3 bench/ccm_bench.py --only failover [--failover-args '--clients 4,16,64 --storage both']

    make bench                                  # every section, newest PostgreSQL with pg_ccm
    make bench PG=15                            # = ARGS='--pg 15': installs pg_ccm into 15 first
    make bench ARGS='--only prewarm --pg all'   # prewarm on every installed version, one run

PostgreSQL: the servers of /usr/lib/postgresql/N/bin. `--pg` takes one version, a list
(15,17,18) or `all` (every version installed there, 15 to 18); every section runs on each, in
turn, under a heading naming it. The default is the newest installed version that has pg_ccm
installed. Each version must have pg_ccm (its pg_config --pkglibdir/pg_ccm.so): the benchmark
stops at once otherwise, naming `scripts/install.sh --pg N` (make bench installs only the
version of PG=N, or the newest).

Sections:
  scan      hot-set scan speed (buffer headers per second) with shared_buffers full
  filter    filter size per cached buffer at 1% false positives, and build speed
  list      block-list bytes per block, clustered and scattered hot sets
  prewarm   ccm_prewarm against pg_prewarm(rel, 'buffer') on the same cold relation of a
            streaming standby, and a scattered list against reading the same blocks one at a time;
            on PostgreSQL 18 once per io_method (--io-methods; a postmaster setting: the standby
            is restarted with it), "-" before 18 (no asynchronous I/O). Rows are labelled with
            the version and io_method, and with several of them a summary table compares them
  overhead  primary TPS under pgbench with and without a running ccm-agent
  standbys  the primary's cost of serving 1, 2 and 3 standbys in a cycle: one
            ccm_hot_blocks_each() scan against one ccm_hot_blocks() scan per standby, with
            shared_buffers full and filters of three partly warm standbys
  replay    (not in the default list: about 25 minutes at the defaults, ask for it with --only)
            the standby's replay lag under a write load (pgbench tpcb-like, no rate limit), sampled
            on the primary from pg_stat_replication: (a) no agent against (b) the agent warming a
            warm standby, in --rounds interleaved rounds, and (c) a standby restarted cold with the
            agent against (d) the same restart without it; with the primary's TPS, the blocks
            the agent loaded and the standby's storage reads (replay's and the rest)
  failover  (not in the default list: about two hours at the defaults; bench/failover_sweep.py, also
            runnable alone, where its options are described) the failover benchmark of issue 28:
            4, 16 and 64 clients, the local disk and cloud-like storage (3000 IOPS, 125 MB/s per
            node), with ccm-agent and without CCM, separate budgets per node; its options go in
            --failover-args, e.g. --failover-args '--clients 16 --storage cloud'
  steady    (not in the default list; bench/steady.py, also runnable alone) the steady-state
            cost of a warm standby per agent cycle at each --steady-sizes shared_buffers: CPU of
            the agent's sessions on each node, bytes on the wire per direction (ss), blocks sent,
            time from a block becoming hot to its arrival, extrapolated to 64 GB and 256 GB

"Cold" means: server restarted (empty shared_buffers; a standby after a restartpoint) and the
relation's files evicted from the OS page cache (sync + POSIX_FADV_DONTNEED via vmtouch -e).
"""

from __future__ import annotations

import argparse
import random
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import Sampler, percentile, say, server_settings  # noqa: E402  (bench/common.py)
from harness import block_list  # noqa: E402
from steady import add_steady_arguments, bench_steady  # noqa: E402  (bench/steady.py)
import failover_sweep  # noqa: E402  (bench/failover_sweep.py)
from harness.agent import AgentProcess  # noqa: E402
from harness.cluster import (Cluster, Node, PgVersionError, pg_bin, pg_version_text, pgbench,  # noqa: E402
                             resolve_pg_versions, use_pg_version)


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


def restart_standby_with(cluster: Cluster, io_method: str) -> str | None:
    """Restarts the standby with `io_method`, a postmaster setting; returns why it could not
    start with it (it then runs with PostgreSQL 18's default, worker), or None."""
    standby = cluster.standby
    standby.stop()
    standby.write_settings({"io_method": f"'{io_method}'"})
    logged = standby.log_size()
    try:
        standby.start()
    except RuntimeError:
        fatal = [line.strip() for line in standby.log_lines_since(logged, "FATAL")]
        standby.write_settings({"io_method": "'worker'"})
        standby.start()
        return fatal[-1] if fatal else "the server did not start"
    cluster.wait_caught_up()
    running = standby.one("SHOW io_method")
    return None if running == io_method else f"the standby runs with io_method {running}"


def bench_prewarm(cluster: Cluster, megabytes: int, io_methods: list[str]) -> list[dict]:
    """Prewarm figures, once per io_method on PostgreSQL 18 (once before 18); returns the rows."""
    say(f"## Prewarm throughput on a standby (cold relation: restarted standby, files evicted from the OS cache; median of {COLD_RUNS} cold runs)")
    blocks = fill_table(cluster.primary, "prewarm_rel", megabytes)
    cluster.primary.sql("CHECKPOINT")
    cluster.wait_caught_up(timeout=600)
    version = pg_version_text().removeprefix("PostgreSQL ")
    asynchronous = int(cluster.standby.one("SHOW server_version_num")) >= 180000
    say("| PostgreSQL | io_method | method | blocks | seconds | MB/s | vs baseline |")
    say("|---|---|---|---:|---:|---:|---:|")
    rows: list[dict] = []
    for io_method in io_methods if asynchronous else ["-"]:
        if asynchronous:
            problem = restart_standby_with(cluster, io_method)
            if problem:
                say(f"| {version} | {io_method} | not measured: {problem} | | | | |")
                continue
        rows += prewarm_rows(cluster, blocks, version, io_method)
    say()
    return rows


def prewarm_rows(cluster: Cluster, blocks: int, version: str, io_method: str) -> list[dict]:
    node = cluster.standby
    rows: list[dict] = []

    def row(case: str, method: str, count: int, seconds: float, baseline: float) -> None:
        rows.append({"postgresql": version, "io_method": io_method, "case": case, "method": method,
                     "blocks": count, "seconds": seconds})
        mb = count * 8 / 1024
        say(f"| {version} | {io_method} | {method} | {count} | {seconds:.2f} | {mb / seconds:.0f} | {baseline / seconds:.2f} |")

    full_list = whole_relation_list(node, "prewarm_rel", range(blocks))
    base, _ = cold_timed(cluster, "SELECT pg_prewarm('prewarm_rel', 'buffer')")
    row("whole relation", "pg_prewarm(rel, 'buffer')", blocks, base, base)
    for label, setup in PREWARM_MODES:
        ours, result = cold_timed(cluster, "SELECT loaded FROM ccm_prewarm(%s)", [full_list], setup=setup)
        assert result[0][0] == blocks, result
        row("whole relation", f"ccm_prewarm(whole relation), {label}", blocks, ours, base)

    rng = random.Random(2)
    for percent in (5, 15):
        sample = sorted(rng.sample(range(blocks), blocks * percent // 100))
        scattered = whole_relation_list(node, "prewarm_rel", sample)
        case = f"random {percent}%"
        one_by_one, _ = cold_timed(
            cluster,
            "SELECT sum(pg_prewarm('prewarm_rel', 'buffer', 'main', b, b)) FROM unnest(%s::int8[]) b",
            [sample],
        )
        row(case, f"pg_prewarm one block at a time, random {percent}% of the blocks", len(sample), one_by_one, one_by_one)
        for label, setup in PREWARM_MODES:
            ours, result = cold_timed(cluster, "SELECT loaded FROM ccm_prewarm(%s)", [scattered], setup=setup)
            assert result[0][0] == len(sample), result
            row(case, f"ccm_prewarm(same list), {label}", len(sample), ours, one_by_one)
    return rows


def prewarm_summary(rows: list[dict]) -> None:
    """One line per PostgreSQL version and io_method: each case's baseline against ccm_prewarm
    with its default settings (seconds, and how many times faster)."""
    configurations = list(dict.fromkeys((r["postgresql"], r["io_method"]) for r in rows))
    if len(configurations) < 2:
        return
    cases = list(dict.fromkeys(r["case"] for r in rows))
    say(f"## Prewarm by PostgreSQL version and io_method (seconds, median of {COLD_RUNS} cold runs; "
        f"ccm_prewarm with {PREWARM_MODES[0][0]})")
    say("| PostgreSQL | io_method | " + " | ".join(
        f"{case}: {'pg_prewarm' if case == 'whole relation' else 'one block at a time'} | {case}: ccm_prewarm | speed-up"
        for case in cases) + " |")
    say("|---|---|" + "---:|---:|---:|" * len(cases))
    for version, io_method in configurations:
        cells = []
        for case in cases:
            mine = [r for r in rows if (r["postgresql"], r["io_method"], r["case"]) == (version, io_method, case)]
            if len(mine) < 2:
                cells.append("- | - | -")
                continue
            baseline, ours = mine[0]["seconds"], mine[1]["seconds"]
            cells.append(f"{baseline:.2f} | {ours:.2f} | {baseline / ours:.2f}x")
        say(f"| {version} | {io_method} | " + " | ".join(cells) + " |")
    say()


PREWARM_MODES = [
    ("2 readahead threads (default)", ()),
    ("advice from the backend only (ccm.prewarm_readahead_threads = 0)", ("SET ccm.prewarm_readahead_threads = 0",)),
]


def parse_tps(out: str) -> float:
    for line in out.splitlines():
        if line.startswith("tps = "):
            return float(line.split()[2])
    raise RuntimeError(out)


def tps(node: Node, seconds: int, clients: int) -> float:
    return parse_tps(pgbench(node, "-b", "select-only", "-c", str(clients), "-j", "2", "-T", str(seconds), "-n", "-M", "prepared").stdout)


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


STANDBY_STATES = (30, 60, 90)  # percent of the relation each simulated standby caches


def bench_standbys(node: Node, nbuffers: int) -> None:
    """One scan for k standbys against k scans, on a primary whose shared_buffers are full.

    The standbys' filters are the primary's own ccm_buffer_filter() at three moments of
    filling the relation (30, 60 and 90% of it cached), so they are real filters of the
    hot set's blocks, the standbys lacking 70, 40 and 10% of it. Every valid buffer counts
    as hot (usage threshold 0), so the lists are as long as they can be; max_blocks is
    shared_buffers (standbys as big as the primary) or half of it (standbys half as big:
    the path that ranks the hot set).
    """
    say("## One scan for several standbys (ccm_hot_blocks_each) against one scan per standby (ccm_hot_blocks)")
    fill = nbuffers * 8 // 1024 * 9 // 10
    say(f"filling 90% of shared_buffers ({fill} MB of {nbuffers} buffers); standby filters taken at "
        f"{', '.join(f'{p}%' for p in STANDBY_STATES)} of it cached ...")
    blocks = fill_table(node, "standbys_fill", fill)
    node.sql("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
    filters, done = [], 0
    for percent in STANDBY_STATES:
        upto = blocks * percent // 100
        node.sql("SELECT pg_prewarm('standbys_fill', 'buffer', 'main', %s, %s)", [done, upto - 1])
        done = upto
        filters.append(node.one("SELECT ccm_buffer_filter(0.01)"))
    node.sql("SELECT pg_prewarm('standbys_fill', 'buffer')")
    valid = node.one("SELECT count(*) FROM pg_buffercache WHERE relfilenode IS NOT NULL")
    say(f"valid buffers: {valid} of {nbuffers}; filter bytes: {', '.join(str(len(f)) for f in filters)}")
    repeat = 7
    say("| standbys | max_blocks per standby | blocks listed | one scan, ms | one scan per standby, ms | ratio |")
    say("|---:|---:|---:|---:|---:|---:|")
    with node.connect() as conn:
        for cap in (nbuffers, nbuffers // 2):
            for k in range(1, len(filters) + 1):
                mine = filters[:k]
                each, separate = [], []
                for _ in range(repeat):
                    started = time.perf_counter()
                    lists = conn.execute("SELECT ccm_hot_blocks_each(%s::bytea[], %s::int8[], 0)",
                                         [mine, [cap] * k]).fetchone()[0]
                    each.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    singles = [conn.execute("SELECT ccm_hot_blocks(%s, %s, 0)", [f, cap]).fetchone()[0] for f in mine]
                    separate.append(time.perf_counter() - started)
                listed = [conn.execute("SELECT blocks FROM ccm_block_list_info(%s)", [b]).fetchone()[0] for b in lists]
                alone = [conn.execute("SELECT blocks FROM ccm_block_list_info(%s)", [b]).fetchone()[0] for b in singles]
                assert listed == alone, f"one scan listed {listed}, one scan per standby {alone}"
                one, many = statistics.median(each), statistics.median(separate)
                say(f"| {k} | {cap} | {' + '.join(map(str, listed))} | {one * 1000:.1f} | {many * 1000:.1f} | {many / one:.2f}x |")
    say()


# -- replay: warming against WAL replay -------------------------------------------------------

REPLAY_PHASES = {
    "a": "(a) no agent",
    "b": "(b) agent running, standby warm",
    "c": "(c) standby restarted cold, agent running",
    "d": "(d) standby restarted cold, no agent",
}
MB_PER_PGBENCH_SCALE = 15  # pgbench_accounts and its index, per scale unit
LOADED = "ccm_agent_blocks_loaded_total"


class LagSampler(Sampler):
    """The standby's replay lag, sampled on the primary from pg_stat_replication every
    `interval` seconds in a thread, on a fixed schedule, while the `with` block runs.

    Each sample is (replay_lag in seconds or None, byte lag pg_current_wal_lsn() - replay_lsn
    or None), or None when the primary has no walsender row (standby not streaming).
    replay_lag is NULL once the standby has replayed everything and the primary sent nothing
    since; the figures count that as 0."""

    QUERY = ("SELECT EXTRACT(epoch FROM replay_lag)::float8, pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::float8 "
             "FROM pg_stat_replication ORDER BY backend_start LIMIT 1")

    what = "replay lag sampling"

    def __init__(self, node: Node, interval: float):
        super().__init__(interval)
        self.node = node
        self.samples: list[tuple[float | None, float | None] | None] = []

    def run(self) -> None:
        with self.node.connect() as conn:
            self.loop(lambda: self.samples.append(conn.execute(self.QUERY).fetchone()))


def standby_read_bytes(node: Node) -> tuple[int | None, dict[int, int]]:
    """The startup (replay) process's pid and read_bytes (/proc/PID/io: bytes fetched from
    storage, OS page cache misses) of each of the node's server processes but our own."""
    with node.connect() as conn:
        startup, me = conn.execute("SELECT (SELECT pid FROM pg_stat_activity WHERE backend_type = 'startup'), "
                                   "pg_backend_pid()").fetchone()
        counts: dict[int, int] = {}
        for pid in node.child_pids():
            if pid == me:
                continue
            try:
                for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                    if line.startswith("read_bytes:"):
                        counts[pid] = int(line.split()[1])
            except OSError:  # exited, or not ours to read
                pass
    return startup, counts


def settle(cluster: Cluster) -> None:
    """A checkpoint on the primary, then waits until the standby has replayed everything and
    streams, so every phase starts from the same place (each first change of a page after a
    checkpoint writes a full-page image: more WAL to replay at the start of a phase)."""
    cluster.primary.sql("CHECKPOINT")
    cluster.wait_caught_up(timeout=1800)
    cluster.primary.wait_until(lambda: cluster.primary.one("SELECT count(*) FROM pg_stat_replication "
                                                           "WHERE state = 'streaming'") > 0,
                               "the standby to stream", timeout=120)


def wait_warm(agent: AgentProcess, timeout: float = 600) -> None:
    """Waits until a whole agent cycle loaded nothing new (no write load runs meanwhile)."""
    seen = {"cycles": agent.metric("ccm_agent_cycles_total"), "loaded": agent.metric(LOADED)}

    def settled() -> bool:
        cycles, loaded = agent.metric("ccm_agent_cycles_total"), agent.metric(LOADED)
        if cycles == seen["cycles"]:
            return False
        quiet = loaded == seen["loaded"]
        seen.update(cycles=cycles, loaded=loaded)
        return quiet and cycles >= 2

    try:
        agent.wait_for(settled, "the standby to be warm (an agent cycle that loads nothing)", timeout=timeout)
    except TimeoutError:
        say(f"(the agent still loaded blocks in every cycle after {timeout:.0f} s; measuring anyway)")


def replay_phase(cluster: Cluster, phase: str, round_no: int, args: argparse.Namespace,
                 agent: AgentProcess | None) -> dict:
    """One phase: pgbench tpcb-like on the primary for --replay-seconds while LagSampler
    samples the standby's replay lag; `agent` (if any) is running. Prints and returns its row."""
    standby = cluster.standby
    loaded_before = agent.metric(LOADED) if agent else 0.0
    startup_before, reads_before = standby_read_bytes(standby)
    with LagSampler(cluster.primary, args.replay_interval) as sampler:
        out = pgbench(cluster.primary, "-b", "tpcb-like", "-c", str(args.replay_clients), "-j", "2",
                      "-T", str(args.replay_seconds), "-n", "-M", "prepared").stdout
    loaded = agent.metric(LOADED) - loaded_before if agent else 0.0
    startup, reads = standby_read_bytes(standby)
    replay_read = reads.get(startup, 0) - reads_before.get(startup, 0) if startup == startup_before else None
    other_read = sum(count - reads_before.get(pid, 0) for pid, count in reads.items() if pid != startup)
    present = [s for s in sampler.samples if s is not None]  # taken while the standby streamed
    lags = [(lag or 0.0) * 1000 for lag, _ in present]
    byte_lags = [b for _, b in present if b is not None]
    row = {
        "postgresql": pg_version_text().removeprefix("PostgreSQL "),
        "phase": phase, "label": REPLAY_PHASES[phase], "round": round_no,
        "samples": len(sampler.samples), "null_samples": sum(1 for lag, _ in present if lag is None),
        "missing_samples": len(sampler.samples) - len(present),
        "p50_ms": percentile(lags, 50), "p99_ms": percentile(lags, 99), "max_ms": max(lags, default=None),
        "bytes_p50": percentile(byte_lags, 50), "bytes_p99": percentile(byte_lags, 99),
        "tps": parse_tps(out), "blocks_loaded": int(loaded) if agent else None,
        "replay_read_mb": None if replay_read is None else replay_read / 2**20, "other_read_mb": other_read / 2**20,
    }
    say(replay_row_text(row, str(round_no)))
    return row


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


REPLAY_HEADER = ("| phase | round | replay lag p50 ms | p99 ms | max ms | byte lag p50 kB | byte lag p99 kB | TPS "
                 "| blocks loaded | standby reads MB: replay / other | NULL lag samples |\n"
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def replay_row_text(row: dict, round_text: str) -> str:
    kb = lambda b: None if b is None else b / 1024  # noqa: E731
    return (f"| {row['label']} | {round_text} | {fmt(row['p50_ms'], 1)} | {fmt(row['p99_ms'], 1)} | {fmt(row['max_ms'], 1)} "
            f"| {fmt(kb(row['bytes_p50']))} | {fmt(kb(row['bytes_p99']))} | {fmt(row['tps'])} | {fmt(row['blocks_loaded'])} "
            f"| {fmt(row['replay_read_mb'], 1)} / {fmt(row['other_read_mb'], 1)} "
            f"| {row['null_samples']} of {row['samples']}"
            + (f" ({row['missing_samples']} not streaming)" if row["missing_samples"] else "") + " |")


def replay_summary(rows: list[dict]) -> None:
    """Per phase, the median over rounds of each figure (max: the largest), and the verdicts."""
    say()
    say(f"### Replay lag by phase (median over {max(r['round'] for r in rows)} round(s); max: the largest)")
    say(REPLAY_HEADER)
    by_phase = {phase: [r for r in rows if r["phase"] == phase] for phase in REPLAY_PHASES}

    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    for phase, mine in by_phase.items():
        if not mine:
            continue
        summary = {key: median([r[key] for r in mine]) for key in
                   ("p50_ms", "p99_ms", "bytes_p50", "bytes_p99", "tps", "blocks_loaded", "replay_read_mb", "other_read_mb")}
        summary.update(label=REPLAY_PHASES[phase], max_ms=max((r["max_ms"] for r in mine if r["max_ms"] is not None), default=None),
                       samples=sum(r["samples"] for r in mine), null_samples=sum(r["null_samples"] for r in mine),
                       missing_samples=sum(r["missing_samples"] for r in mine))
        say(replay_row_text(summary, "all"))
    say()
    for ours, baseline, what in (("b", "a", "steady warming"), ("c", "d", "warming a cold standby")):
        say(replay_verdict(by_phase[ours], by_phase[baseline], what))
    say()
    say("replay_lag is NULL in pg_stat_replication when the standby has replayed all WAL sent and none came "
        "since; such samples count as 0 ms (column NULL lag samples). Standby reads are /proc/PID/io read_bytes "
        "(storage reads, OS page cache misses) of the standby's processes during the phase: replay = the startup "
        "process, other = the rest (the agent's ccm_prewarm session among them; processes that exited during "
        "the phase are not counted).")
    say()


def replay_verdict(ours: list[dict], baseline: list[dict], what: str) -> str:
    """p99 replay lag of phase `ours` against `baseline`: the difference of the medians over
    rounds, "within noise" if it is smaller than the larger round-to-round spread (max - min)."""
    if not ours or not baseline:
        return f"{what}: not measured"
    a, b = ours[0]["phase"], baseline[0]["phase"]
    mine = [r["p99_ms"] for r in ours if r["p99_ms"] is not None]
    base = [r["p99_ms"] for r in baseline if r["p99_ms"] is not None]
    if not mine or not base:
        return f"{what}: no replay lag samples"
    m, n = statistics.median(mine), statistics.median(base)
    spread = max(max(mine) - min(mine), max(base) - min(base))
    tps_change = statistics.median(r["tps"] for r in ours) / statistics.median(r["tps"] for r in baseline) - 1
    head = f"Verdict, {what} (({a}) against ({b})): p99 replay lag {m:.1f} against {n:.1f} ms"
    tail = f"; primary TPS {tps_change:+.1%}"
    if len(mine) < 2 and len(base) < 2:
        return f"{head}, {m - n:+.1f} ms (one round: no spread to compare with, use --rounds 2 or more){tail}"
    if abs(m - n) < spread:
        return f"{head}: within noise ({m - n:+.1f} ms, round-to-round spread {spread:.1f} ms){tail}"
    change = f", {m / n - 1:+.0%}" if n > 0 else ""
    return (f"{head}: {'an increase' if m > n else 'a decrease'} ({m - n:+.1f} ms{change}), beyond the round-to-round "
            f"spread ({spread:.1f} ms){tail}")


def bench_replay(cluster: Cluster, args: argparse.Namespace, log_dir: Path) -> list[dict]:
    """Warming against WAL replay: the standby's replay lag under a write load in the four
    phases of REPLAY_PHASES, --rounds times, the order of (a)/(b) and of (c)/(d) alternating
    from round to round. Returns the rows (one per phase and round)."""
    primary, standby = cluster.primary, cluster.standby
    nbuffers = primary.one("SELECT setting::int8 FROM pg_settings WHERE name = 'shared_buffers'")
    sb_mb = nbuffers * 8 // 1024
    scale = args.replay_scale or max(1, round(1.5 * sb_mb / MB_PER_PGBENCH_SCALE))
    say(f"## Replay lag of a streaming standby while ccm-agent warms it (pgbench tpcb-like, {args.replay_clients} "
        f"clients, no rate limit, {args.replay_seconds} s phases, lag sampled every {args.replay_interval} s)")
    say(f"pgbench -i -s {scale} (shared_buffers {sb_mb} MB on both nodes) ...")
    pgbench(primary, "-i", "-s", str(scale), "-I", "dtGvp")
    data_mb = primary.one("SELECT pg_database_size(current_database()) / 1048576")
    say(f"data {data_mb} MB = {data_mb / sb_mb:.2f} x shared_buffers; waiting for the standby to replay it ...")
    settle(cluster)
    say(f"warming the primary with {min(args.replay_seconds, 30)} s of the load ...")
    pgbench(primary, "-b", "tpcb-like", "-c", str(args.replay_clients), "-j", "2", "-T", str(min(args.replay_seconds, 30)),
            "-n", "-M", "prepared")

    def new_agent() -> AgentProcess:
        return AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="1s").start()

    say()
    say(REPLAY_HEADER)
    rows: list[dict] = []
    for round_no in range(1, args.rounds + 1):
        # (a) and (b): a warm standby, the agent stopped or warming it.
        settle(cluster)
        agent = new_agent()
        wait_warm(agent)
        for phase in ("b", "a") if round_no % 2 else ("a", "b"):
            if phase == "a":
                agent.stop()
            elif not agent.alive():
                agent = new_agent()
                wait_warm(agent)
            settle(cluster)
            rows.append(replay_phase(cluster, phase, round_no, args, agent if phase == "b" else None))
        agent.stop()
        # (c) and (d): right after a restart with empty shared_buffers and OS cache, the agent
        # starting with the load (it then loads the most) or not at all.
        for phase in ("d", "c") if round_no % 2 else ("c", "d"):
            cluster.make_standby_cold()
            settle(cluster)
            agent = new_agent() if phase == "c" else None
            try:
                rows.append(replay_phase(cluster, phase, round_no, args, agent))
            finally:
                if agent:
                    agent.stop()
    replay_summary(rows)
    return rows


def run_sections(only: set[str], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every chosen section on the PostgreSQL in use; returns the rows of the sections that
    keep them (prewarm, replay), by section."""
    settings = {"shared_buffers": f"'{args.shared_buffers}'", "fsync": "on", "max_wal_size": "'8GB'", **args.set}
    prewarm: list[dict] = []
    replay: list[dict] = []
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
    if "standbys" in only:
        with Cluster(settings=settings) as cluster:
            node = cluster.primary
            cluster.standby.stop()  # the filters are the primary's own: no standby needed
            nbuffers = node.one("SELECT setting::int8 FROM pg_settings WHERE name = 'shared_buffers'")
            bench_standbys(node, nbuffers)
    if "prewarm" in only:
        # ccm_prewarm runs only on a standby: the relation is loaded on the primary and read,
        # cold, on its streaming standby; pg_prewarm is measured there too.
        with Cluster(settings=settings) as cluster:
            cluster.primary.sql("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
            prewarm = bench_prewarm(cluster, args.prewarm_mb, args.io_methods)
    if "overhead" in only:
        with Cluster(settings={"shared_buffers": "'512MB'"}) as cluster:
            bench_overhead(cluster, args.rounds, args.seconds, args.clients, cluster.base)
    if "steady" in only:
        bench_steady(args)  # its own clusters, one per --steady-sizes size
    if "failover" in only:
        # Its own clusters, cgroups and data set; its tables go to stdout and demo-output/.
        code = failover_sweep.main(["--pg", str(args.pg_version), *shlex.split(args.failover_args)])
        if code:
            raise SystemExit(code)
    if "replay" in only:
        # Both nodes with the benchmark's shared_buffers (the standby is cloned with the
        # primary's configuration).
        with Cluster(settings=settings) as cluster:
            replay = bench_replay(cluster, args, cluster.base)
    return {"prewarm": prewarm, "replay": replay}


SECTIONS = ("scan", "filter", "list", "prewarm", "overhead", "standbys", "replay", "steady", "failover")
DEFAULT_SECTIONS = SECTIONS[:-3]  # replay, steady and failover only when asked for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", metavar="N|N,M,...|all",
                        help="PostgreSQL major version(s) to run (default: the newest installed one that has pg_ccm)")
    parser.add_argument("--shared-buffers", default="4GB")
    parser.add_argument("--prewarm-mb", type=int, default=1024, help="size of the cold relation")
    parser.add_argument("--io-methods", default="worker,io_uring",
                        help="PostgreSQL 18's io_method values the prewarm section runs with, in turn (default worker,io_uring)")
    parser.add_argument("--only", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated sections among {','.join(SECTIONS)} (default {','.join(DEFAULT_SECTIONS)}; "
                             "replay (about 25 minutes at the defaults), steady (its --steady-sizes) and failover "
                             "(about two hours) run only when named)")
    parser.add_argument("--failover-args", default="",
                        help="options of bench/failover_sweep.py for the failover section, in one string")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the overhead and replay sections (default 3)")
    parser.add_argument("--seconds", type=int, default=20, help="length of an overhead round (default 20)")
    parser.add_argument("--clients", type=int, default=4, help="pgbench clients of the overhead section (default 4)")
    parser.add_argument("--replay-scale", type=int, default=None,
                        help="pgbench scale of the replay section (default: data about 1.5 x --shared-buffers, "
                             f"{MB_PER_PGBENCH_SCALE} MB per scale unit)")
    parser.add_argument("--replay-seconds", type=int, default=60, help="length of each replay phase (default 60)")
    parser.add_argument("--replay-clients", type=int, default=8,
                        help="pgbench tpcb-like clients of the replay section, 2 threads, no rate limit (default 8)")
    parser.add_argument("--replay-interval", type=float, default=0.25,
                        help="seconds between replay lag samples (default 0.25)")
    add_steady_arguments(parser)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a server setting for every node of every section (repeatable), e.g. maintenance_io_concurrency=64")
    args = parser.parse_args()
    args.set = server_settings(parser, args.set)
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        parser.error(f"--only: unknown section(s) {','.join(sorted(only - set(SECTIONS)))}; choose among {','.join(SECTIONS)}")
    args.io_methods = [m for m in args.io_methods.split(",") if m]
    if not all(re.fullmatch(r"[a-z_]+", m) for m in args.io_methods) or not args.io_methods:
        parser.error(f"--io-methods: expected names such as worker,io_uring,sync, got {args.io_methods}")
    try:
        versions = resolve_pg_versions(args.pg)
    except PgVersionError as error:
        parser.error(str(error))

    say(f"# pg_ccm benchmark — {time.strftime('%Y-%m-%d %H:%M')} — `{' '.join(sys.argv)}`")
    say()
    prewarm: list[dict] = []
    for version in versions:
        use_pg_version(version)
        args.pg_version = version
        say(f"# {pg_version_text()} ({pg_bin()})")
        say()
        prewarm += run_sections(only, args)["prewarm"]
    prewarm_summary(prewarm)


if __name__ == "__main__":
    main()
