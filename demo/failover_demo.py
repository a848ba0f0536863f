#!/usr/bin/env python3
"""pg_ccm failover demo: what a warm standby is worth when the primary dies.

The same real failover runs on one pgbench data set with ccm-agent keeping the tier-0 standby's
shared_buffers mirroring the primary's hot set, and without CCM. Each run:

  1. starts a primary and a streaming standby on loopback ports (pg_ccm preloaded on both),
     copied from a stopped template data directory that is built once per scenario;
  2. makes the standby cold (restartpoint, restart, its files dropped from the OS page cache)
     and, in a CCM run only, starts `ccm-agent run --interval 1s` (with `--fill-room false` in
     the "hot set only" run) and times it until the standby covers 99% of the hot set;
  3. warms the primary with Aurora's CCM-test workload:
        pgbench -b tpcb-like@1 -b select-only@20 -M prepared -P 1 -c CLIENTS -j 2 -T WARM --log
  4. measures coverage at the failover: the share of the primary's hot buffers (usage
     count > 3) that the standby caches, with pg_buffercache on both nodes;
  5. emulates separate hosts: the STANDBY's data files are dropped from the OS page cache
     (sync, then vmtouch -e = POSIX_FADV_DONTNEED), in every run. On one machine both nodes
     would otherwise share the kernel's cache (and the standby's replay and prewarm reads leave
     its files there), so the "cold" standby would read from memory. On separate hosts, and on
     Aurora, which has no double buffering, the new primary has only its shared_buffers;
  6. fails over for real: SIGKILL of the primary's postmaster, `pg_ctl promote` of the standby,
     then the same workload at once against the new primary for AFTER seconds, with TPS (pgbench
     -P 1), latency (pgbench's per-transaction log: p50 and p99 per second) and storage reads
     recorded (sampled every second): pg_stat_database.blks_read and, from PostgreSQL 16,
     pg_stat_io's reads of relations.

It prints the runs side by side (pre-failover TPS and latency; time from promotion until TPS
first reaches, and until it reaches and keeps, 90% of it; TPS and latency in the first 10 s;
time until p99 latency is back within 2x its pre-failover value; blocks read from storage by the
new primary in the first 60 s; coverage at failover; the agent's warm-up time) and the ratio of
storage reads, checks the project's targets, and writes demo-output/failover.png and
demo-output/results.json. From PostgreSQL 16 the storage reads, their ratio and its target are
pg_stat_io's reads (real reads only), with blks_read beside them; on 15 they are blks_read's,
which also counts every page a relation is extended by, so that a write workload never reaches 0.

PostgreSQL version: `--pg N` (make demo PG=N, or ARGS='--pg N') runs the servers and pgbench of
/usr/lib/postgresql/N/bin; the default is the newest version installed there (15 to 18) that has
pg_ccm installed. The version is printed first and recorded in results.json; a version without
pg_ccm stops the demo with the command that installs it (scripts/install.sh --pg N).

Scenarios: `uniform` (default; pgbench's uniform access, the data fits in shared_buffers),
`skewed` (data about 3x shared_buffers, both scripts pick aid with random_exponential, so the hot
set is a subset of the data); `all` runs both. `large` (chosen only by name: scale 300, about
4.5 GB, shared_buffers 5GB) is the uniform workload at the largest size this 2-core, 23 GB
machine runs comfortably for both nodes; it runs ccm-agent twice by default (`--fill-room both`):
with its default fill_room (colder blocks fill the standby's unused buffers) and the hot set only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.agent import AGENT_BIN, AgentProcess  # noqa: E402
from harness.cluster import (Cluster, Node, PgVersionError, coverage, pg_bin, pg_version_text, pgbench,  # noqa: E402
                             resolve_pg_versions, use_pg_version)

# "progress: 12.0 s, 23712.1 tps, lat 0.168 ms stddev 0.090, 0 failed"
PROGRESS = re.compile(r"^progress: ([\d.]+) s, ([\d.]+) tps")
# Children die with us even if we are SIGKILLed (setpriv execs the command: its parent is us).
DIE_WITH_US = ["setpriv", "--pdeathsig", "TERM", "--"]
HOT_THRESHOLD = 3  # coverage counts the primary's buffers with usage count > 3 (Aurora's default)
PRE_WINDOW = 20  # seconds before the kill averaged for the pre-failover TPS
READS_WINDOW = 60  # the storage-read figure covers the new primary's first 60 s
TARGET_SECONDS, TARGET_READS, TARGET_COVERAGE = 2.0, 0.05, 0.99
FIRST_WINDOW = 10  # "the first 10 s" after promotion (TPS, latency, full-page images)
LATENCY_FACTOR = 2.0  # p99 "back to normal": within this factor of the pre-failover p99
REJOIN_TIMEOUT = 25  # the epilogue waits this long for the rejoined node's coverage

INTERACTIVE = sys.stdout.isatty()


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C so that every cluster and agent is stopped."""


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(signal.Signals(signum).name)


@contextmanager
def shielded() -> Iterator[None]:
    """Cleanup that a second Ctrl-C or SIGTERM must not cut short."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- scenarios ---------------------------------------------------------------------------


def megabytes(size: str) -> float:
    """A PostgreSQL memory setting ("5GB", "256MB", "131072" = 8 kB pages) in MB."""
    match = re.fullmatch(r"\s*(\d+)\s*(B|kB|MB|GB|TB)?\s*", size)
    if not match:
        raise ValueError(f"not a PostgreSQL memory size: {size!r}")
    unit = {"B": 1 / 2**20, "kB": 1 / 1024, "MB": 1, "GB": 1024, "TB": 2**20, None: 8 / 1024}[match.group(2)]
    return int(match.group(1)) * unit


@dataclass
class Scenario:
    name: str
    scale: int
    shared_buffers: str
    workload: list[str]  # pgbench arguments choosing the scripts
    description: str

    def settings(self, args: argparse.Namespace) -> dict[str, str]:
        return {
            "shared_buffers": f"'{self.shared_buffers}'",
            "ccm.usage_threshold": str(args.usage_threshold),
            # Room for both workloads' WAL (tens of MB/s right after a checkpoint), so that no
            # WAL-triggered checkpoint, with its burst of full-page images, lands at a random
            # moment of a measurement; the one that promotion requests remains, in every run.
            # A checkpoint is requested at about max_wal_size / (1 + checkpoint_completion_target)
            # of WAL, and between two checkpoints every page changed writes one full-page image,
            # so with a data set as large as shared_buffers the room grows with it.
            "max_wal_size": f"'{max(4096, round(3 * megabytes(self.shared_buffers)))}MB'",
            # Nor a timed one: longer than a run, so that the only checkpoints are the run's own
            # (the standby made cold, the promotion). At 5 GB a timed checkpoint's writes and
            # full-page images would land in one run's measurement and not in another's.
            "checkpoint_timeout": f"'{min(1440, 30 + (args.warm_seconds + args.after_seconds) // 60)}min'",
            **dict(args.set),
        }


AURORA_MIX = ["-b", "tpcb-like@1", "-b", "select-only@20"]
SCENARIO_NAMES = {"uniform": ["uniform"], "skewed": ["skewed"], "all": ["uniform", "skewed"], "large": ["large"]}
FILL_ROOM_DEFAULT = {"large": "both"}  # --fill-room when not given; "on" for the others


def skewed_scripts(workdir: Path, scale: int, skew: float) -> tuple[Path, Path]:
    """pgbench's select-only and tpcb-like with aid drawn from random_exponential: the
    lowest aids are the hottest and the access probability falls by e every 1/skew of the
    table. Scale is written in (custom scripts get :scale = 1 unless told)."""
    accounts = 100000 * scale
    aid = f"\\set aid random_exponential(1, {accounts}, {skew})\n"
    select = workdir / "select-only-exponential.sql"
    select.write_text(aid + "SELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n")
    tpcb = workdir / "tpcb-like-exponential.sql"
    tpcb.write_text(
        aid
        + f"\\set bid random(1, {scale})\n"
        f"\\set tid random(1, {10 * scale})\n"
        "\\set delta random(-5000, 5000)\n"
        "BEGIN;\n"
        "UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;\n"
        "SELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n"
        "UPDATE pgbench_tellers SET tbalance = tbalance + :delta WHERE tid = :tid;\n"
        "UPDATE pgbench_branches SET bbalance = bbalance + :delta WHERE bid = :bid;\n"
        "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);\n"
        "END;\n"
    )
    for script in (select, tpcb):
        script.chmod(0o644)
    return select, tpcb


def scenarios(args: argparse.Namespace, workdir: Path) -> list[Scenario]:
    chosen = []
    for name in SCENARIO_NAMES[args.scenario]:
        if name == "uniform":
            chosen.append(Scenario(
                "uniform", args.scale, args.shared_buffers, AURORA_MIX,
                f"pgbench scale {args.scale} (about {15 * args.scale} MB), shared_buffers {args.shared_buffers}, "
                "uniform access: the whole data set is the hot set",
            ))
        elif name == "skewed":
            select, tpcb = skewed_scripts(workdir, args.skewed_scale, args.skew)
            chosen.append(Scenario(
                "skewed", args.skewed_scale, args.skewed_shared_buffers,
                ["-f", f"{tpcb}@1", "-f", f"{select}@20"],
                f"pgbench scale {args.skewed_scale} (about {15 * args.skewed_scale} MB), shared_buffers "
                f"{args.skewed_shared_buffers}, aid = random_exponential(..., {args.skew}) in both scripts: "
                "the hot set is a subset of the data",
            ))
        else:
            chosen.append(Scenario(
                "large", args.large_scale, args.large_shared_buffers, AURORA_MIX,
                f"pgbench scale {args.large_scale} (about {15 * args.large_scale} MB), shared_buffers "
                f"{args.large_shared_buffers} on both nodes, uniform access",
            ))
    return chosen


@dataclass(frozen=True)
class Mode:
    """One run of a scenario: with ccm-agent (fill_room as the agent defaults, or off) or without CCM."""
    name: str
    slug: str  # the run's directory
    agent_args: tuple[str, ...] | None  # None: no agent

    @property
    def fill_room(self) -> bool | None:
        return None if self.agent_args is None else "--fill-room" not in self.agent_args


CCM = Mode("with ccm-agent", "ccm", ())
CCM_HOT_SET_ONLY = Mode("with ccm-agent (hot set only)", "ccm-hot-set-only", ("--fill-room", "false"))
NO_CCM = Mode("without CCM", "none", None)


def fill_room_choice(args: argparse.Namespace, scenario: str) -> str:
    return args.fill_room or FILL_ROOM_DEFAULT.get(scenario, "on")


def modes(args: argparse.Namespace, scenario: str) -> list[Mode]:
    """The runs of a scenario, in order: the CCM runs --fill-room asks for, then the one without."""
    ccm = {"on": [CCM], "off": [CCM_HOT_SET_ONLY], "both": [CCM, CCM_HOT_SET_ONLY]}[fill_room_choice(args, scenario)]
    return {"ccm": ccm, "none": [NO_CCM], "both": [*ccm, NO_CCM]}[args.only]


# -- measuring ---------------------------------------------------------------------------


class Workload:
    """pgbench with -P 1; its per-second progress lines are parsed live from stderr. With
    `log_dir`, pgbench also logs every transaction there (--log), read by latencies()."""

    def __init__(self, node: Node, scenario: Scenario, clients: int, seconds: int, label: str,
                 log_dir: Path | None = None):
        self.label, self.seconds, self.log_dir = label, seconds, log_dir
        self.tps: list[float] = []
        self.other_lines: list[str] = []
        log = []
        if log_dir is not None:
            log_dir.mkdir(parents=True)
            log = ["--log", f"--log-prefix={log_dir / 'pgbench'}"]
        argv = [str(pg_bin() / "pgbench"), "-h", "127.0.0.1", "-p", str(node.port), "-U", "postgres",
                "-n", "-M", "prepared", "-P", "1", "-c", str(clients), "-j", str(min(2, clients)),
                "-T", str(seconds), *log, *scenario.workload, "postgres"]
        self.started, self.started_epoch = time.monotonic(), time.time()
        self.process = subprocess.Popen(DIE_WITH_US + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            match = PROGRESS.match(line)
            if not match:
                self.other_lines.append(line.rstrip())
                continue
            self.tps.append(float(match.group(2)))
            self._show(float(match.group(1)))

    def _show(self, elapsed: float) -> None:
        if INTERACTIVE:
            print(f"\r    {self.label}: {elapsed:4.0f} / {self.seconds} s   {self.tps[-1]:8.0f} tps   ", end="", flush=True)
        elif len(self.tps) % 10 == 0 or len(self.tps) == self.seconds:
            first = (len(self.tps) - 1) // 10 * 10
            values = " ".join(f"{v:.0f}" for v in self.tps[first:])
            print(f"    {self.label} {first + 1:>3}-{len(self.tps):<3} s: {values} tps", flush=True)

    def wait(self) -> None:
        self.process.wait()
        self.reader.join()
        if INTERACTIVE:
            print(flush=True)
        if self.process.returncode != 0:
            tail = "\n".join(self.other_lines[-20:])
            raise RuntimeError(f"pgbench ({self.label}) exited with {self.process.returncode}:\n{tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait()
        self.reader.join()
        if INTERACTIVE:
            print(flush=True)

    def latencies(self) -> dict[int, array]:
        """Latencies in microseconds from the per-transaction log, by the one-second interval
        (1, 2, ... as -P 1 counts them from pgbench's start) in which each transaction ended.
        Streamed: a minute at 20000 TPS is over a million lines."""
        assert self.log_dir is not None
        buckets: dict[int, array] = {}
        for path in sorted(self.log_dir.glob("pgbench.*")):  # one file per thread (-j)
            with open(path) as log:
                for line in log:
                    # client_id transaction_no time script_no time_epoch time_us [...]; time is the
                    # latency in us ("failed" or "skipped" instead: no latency), time_epoch.time_us
                    # the end of the transaction.
                    fields = line.split()
                    if len(fields) < 6 or not fields[2].isdigit():
                        continue
                    ended = int(fields[4]) + int(fields[5]) / 1e6
                    interval = min(self.seconds, max(1, math.ceil(ended - self.started_epoch)))
                    buckets.setdefault(interval, array("q")).append(int(fields[2]))
        return buckets


# Blocks read into shared_buffers, two ways. pg_stat_database.blks_read counts, in PostgreSQL
# 15, each page a relation is extended by too (16 extends relations without counting them there,
# but still counts pages zeroed instead of read). pg_stat_io (16+) counts reads apart from
# extends: relation reads summed over backend types and contexts, without the startup process,
# whose replay reads blks_read leaves out too and which flushes its counts only when it exits,
# at promotion (so they would land in the new primary's first second).
BLKS_READ = "(SELECT sum(blks_read)::int8 FROM pg_stat_database)"
IO_READS = "(SELECT sum(reads)::int8 FROM pg_stat_io WHERE object = 'relation' AND backend_type <> 'startup')"


def has_pg_stat_io(node: Node) -> bool:
    return bool(node.one("SELECT current_setting('server_version_num')::int >= 160000"))


def storage_reads(node: Node, io: bool, conn=None) -> tuple[int, int | None]:
    """(blks_read, pg_stat_io reads or None without `io`) of the whole node."""
    query = f"SELECT {BLKS_READ}, {IO_READS if io else 'NULL::int8'}"
    blocks, io_reads = conn.execute(query).fetchone() if conn is not None else node.sql(query)[0]
    return int(blocks), (int(io_reads or 0) if io else None)


class Sampler:
    """Calls `probe` every `interval` seconds in a thread and keeps (time.monotonic(), value),
    until stop() or until `until(value)` holds. `session` (e.g. node.connect) opens, once,
    what each call of the probe is given. The one polling loop of the demo."""

    def __init__(self, what: str, probe: Callable[[Any], Any], session: Callable[[], ContextManager] = nullcontext,
                 interval: float = 1.0, until: Callable[[Any], bool] | None = None):
        self.what, self.probe, self.session, self.interval, self.until = what, probe, session, interval, until
        self.samples: list[tuple[float, Any]] = []
        self.error: Exception | None = None
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with self.session() as handle:
                while not self.halt.is_set():
                    value = self.probe(handle)
                    self.samples.append((time.monotonic(), value))
                    if self.until is not None and self.until(value):
                        return
                    self.halt.wait(self.interval)
        except Exception as error:  # the series just ends early; callers that need it check .error
            self.error = error
            if not self.halt.is_set():
                say(f"    ({self.what} stopped: {error})")

    def wait(self, timeout: float) -> None:
        """Until `until` held, the probe failed or `timeout` passed; then stops."""
        self.thread.join(timeout)
        self.stop()

    def stop(self) -> None:
        self.halt.set()
        self.thread.join()


class ReadSampler(Sampler):
    """Blocks read (storage_reads) and full-page images of one node, sampled every second.

    Backends flush their statistics at most once a second, so a sample lags the truth by up
    to a second; the per-second series are for the chart, the totals are read separately."""

    def __init__(self, node: Node, io: bool):
        self.node, self.io = node, io
        super().__init__(f"read sampler on {node.name}", self._probe, node.connect)

    def _probe(self, conn) -> tuple[int, int | None, int]:
        blocks, io_reads = storage_reads(self.node, self.io, conn)
        # Full-page images written (pg_stat_wal.wal_fpi): after a checkpoint, the first change
        # of every page writes the whole page into WAL.
        fpi = conn.execute("SELECT wal_fpi FROM pg_stat_wal").fetchone()[0]
        return blocks, io_reads, int(fpi)

    def rates(self, origin: float, column: int = 0) -> list[tuple[float, float]]:
        """(seconds since origin, per second) between consecutive samples of one column:
        0 blks_read, 1 pg_stat_io reads (16+), 2 full-page images."""
        samples = [(t, value[column]) for t, value in self.samples if value[column] is not None]
        return [(round(t1 - origin, 2), round((v1 - v0) / (t1 - t0), 1))
                for (t0, v0), (t1, v1) in zip(samples, samples[1:]) if t1 > t0]

    def io_rates(self, origin: float) -> list[tuple[float, float]]:
        return self.rates(origin, 1)

    def fpi_rates(self, origin: float) -> list[tuple[float, float]]:
        return self.rates(origin, 2)


def agent_progress(agent: AgentProcess) -> tuple[float, int] | None:
    """The agent's coverage of the hot set at its last scan and the hot set's size (blocks);
    None before its first cycle."""
    metrics = agent.metrics()
    if not metrics.get("ccm_agent_cycles_total"):
        return None
    return metrics.get("ccm_agent_coverage_ratio", 0.0), int(metrics.get("ccm_agent_hot_set_blocks", 0))


def percentiles(latencies_us: Iterable[int]) -> tuple[float, float] | None:
    """(p50, p99) in ms, nearest rank; None without a transaction."""
    ordered = sorted(latencies_us)
    if not ordered:
        return None
    rank = lambda q: ordered[max(0, math.ceil(q * len(ordered)) - 1)] / 1000  # noqa: E731
    return round(rank(0.5), 3), round(rank(0.99), 3)


def pooled(buckets: dict[int, array], first: int, last: int) -> tuple[float, float] | None:
    """percentiles() of every transaction that ended in intervals first..last."""
    return percentiles(chain.from_iterable(buckets.get(k, ()) for k in range(first, last + 1)))


def first_and_kept(values: list[Any], ok: Callable[[Any], bool]) -> tuple[int | None, int | None]:
    """1-based positions of the first value that is ok, and of the first from which every
    later one is too (None: none is; a None value is never ok)."""
    first = next((k for k, v in enumerate(values, 1) if v is not None and ok(v)), None)
    kept = None
    for k in range(len(values), 0, -1):
        if values[k - 1] is None or not ok(values[k - 1]):
            break
        kept = k
    return first, kept


def mean_rate(series: list[list[float]], start: float, end: float) -> float | None:
    """Mean of a [time, rate] series over start <= time <= end, None if no sample falls there."""
    rates = [rate for t, rate in series if start <= t <= end]
    return round(statistics.mean(rates), 1) if rates else None


# -- one run -----------------------------------------------------------------------------


@dataclass
class RunResult:
    scenario: str
    mode: str  # "with ccm-agent" | "with ccm-agent (hot set only)" | "without CCM"
    postgresql: str = ""  # "PostgreSQL 18.6"
    fill_room: bool | None = None  # the agent's fill_room (True: its default); None without the agent
    pre_failover_tps: float = 0.0
    pre_failover_reads_per_s: float | None = None  # blks_read
    pre_failover_io_reads_per_s: float | None = None  # pg_stat_io reads (16+)
    coverage_at_failover: float = 0.0
    hot_buffers_at_failover: int = 0
    cached_coverage_at_failover: float = 0.0  # the same for every buffer the primary caches
    cached_buffers_at_failover: int = 0
    agent_blocks_loaded: int | None = None
    agent_fill_blocks_loaded: int | None = None  # of those, colder blocks filling unused buffers
    # From the agent's start until its scans found the standby covering >= 99% of the hot set
    # and kept finding it while the workload ran; None if not by then.
    agent_warm_s: float | None = None
    kill_to_promoted_s: float = 0.0
    promotion_to_workload_s: float = 0.0
    seconds_to_90pct_first: float | None = None
    seconds_to_90pct_stay: float | None = None
    first_10s_pct: float | None = None
    # Latency (pgbench's per-transaction log), ms: the old primary's last PRE_WINDOW s, the new
    # primary's first FIRST_WINDOW s (pooled), its worst one-second p99, and the time from
    # promotion until the one-second p99 is within LATENCY_FACTOR x the pre-failover p99.
    pre_failover_p50_ms: float | None = None
    pre_failover_p99_ms: float | None = None
    first_10s_p50_ms: float | None = None
    first_10s_p99_ms: float | None = None
    worst_p99_after_ms: float | None = None
    seconds_to_p99_2x_first: float | None = None
    seconds_to_p99_2x_stay: float | None = None
    blocks_read_after: int = 0  # rise of blks_read (in PostgreSQL 15, relation extension too)
    io_blocks_read_after: int | None = None  # rise of pg_stat_io reads (16+; reads only)
    blocks_read_window_s: int = 0
    post_failover_steady_tps: float | None = None
    rejoin_coverage: float | None = None
    rejoin_seconds: float | None = None
    rejoin_error: str | None = None
    # Series, times in seconds relative to the promotion (t = 0; negative before it).
    tps_before: list[list[float]] = field(default_factory=list)  # [end of interval, tps]
    tps_after: list[list[float]] = field(default_factory=list)
    latency_before: list[list[float]] = field(default_factory=list)  # [end of interval, p50 ms, p99 ms]
    latency_after: list[list[float]] = field(default_factory=list)
    agent_coverage: list[list[float]] = field(default_factory=list)  # [sample time, coverage, hot set blocks]
    reads_before: list[list[float]] = field(default_factory=list)  # [sample time, blocks/s], old primary
    reads_after: list[list[float]] = field(default_factory=list)  # new primary
    io_reads_before: list[list[float]] = field(default_factory=list)  # the same from pg_stat_io (16+)
    io_reads_after: list[list[float]] = field(default_factory=list)
    fpi_before: list[list[float]] = field(default_factory=list)  # [sample time, full-page images/s]
    fpi_after: list[list[float]] = field(default_factory=list)
    pre_failover_fpi_per_s: float | None = None
    first_10s_fpi_per_s: float | None = None
    kill_at: float = 0.0

    @property
    def transactions_in_reads_window(self) -> float:
        return sum(tps for at, tps in self.tps_after if at <= self.blocks_read_window_s)

    @property
    def storage_reads_after(self) -> int:
        """The figure the read target is checked on: pg_stat_io's reads where they exist."""
        return self.io_blocks_read_after if self.io_blocks_read_after is not None else self.blocks_read_after


# In PostgreSQL 15 blks_read also counts the new pages a relation is extended by, so even a
# fully cached workload "reads" in proportion to its writes: per transaction, the old primary's
# steady state is the floor to compare the new primary with. pg_stat_io's reads (16+) have no
# such floor.
def per_1000(blocks: float | None, transactions: float | None) -> float | None:
    return 1000 * blocks / transactions if blocks is not None and transactions else None


def compute_figures(result: RunResult, after_tps: list[float], offset: float) -> None:
    """Figures that derive from the per-second series. `offset` is the time from promotion to
    pgbench's start; its k-th progress interval ends k seconds after that."""
    before = [tps for _, tps in result.tps_before]
    tail = before[-PRE_WINDOW:]
    result.pre_failover_tps = statistics.mean(tail) if tail else 0.0
    threshold = 0.9 * result.pre_failover_tps
    # The first second at or above 90%, and the first from which every later second stays there.
    first, stay = first_and_kept(after_tps, lambda tps: tps >= threshold)
    result.seconds_to_90pct_first = round(offset + first, 2) if first is not None else None
    result.seconds_to_90pct_stay = round(offset + stay, 2) if stay is not None else None
    first10 = after_tps[:FIRST_WINDOW]
    if first10 and result.pre_failover_tps:
        result.first_10s_pct = 100.0 * statistics.mean(first10) / result.pre_failover_tps
    if len(after_tps) >= 2 * PRE_WINDOW:
        result.post_failover_steady_tps = statistics.mean(after_tps[-PRE_WINDOW:])


def per_second(buckets: dict[int, array], seconds: int) -> list[tuple[float, float] | None]:
    """percentiles() of each one-second interval 1..seconds (None: no transaction ended in it)."""
    return [percentiles(buckets.get(k, ())) for k in range(1, seconds + 1)]


def latency_series(figures: list[tuple[float, float] | None], origin: float) -> list[list[float]]:
    """[end of interval, p50, p99] of the intervals with transactions; interval k ends at origin + k."""
    return [[round(origin + k, 2), *pair] for k, pair in enumerate(figures, 1) if pair is not None]


def compute_latency(result: RunResult, warm: Workload, after: Workload, promoted: float) -> None:
    """The latency figures, from both workloads' per-transaction logs (read once pgbench ended)."""
    before, later = warm.latencies(), after.latencies()
    offset = after.started - promoted
    seconds = per_second(later, after.seconds)
    result.latency_before = latency_series(per_second(before, warm.seconds), warm.started - promoted)
    result.latency_after = latency_series(seconds, offset)
    pre = pooled(before, warm.seconds - PRE_WINDOW + 1, warm.seconds)
    result.pre_failover_p50_ms, result.pre_failover_p99_ms = pre or (None, None)
    result.first_10s_p50_ms, result.first_10s_p99_ms = pooled(later, 1, FIRST_WINDOW) or (None, None)
    p99s = [pair[1] if pair else None for pair in seconds]
    result.worst_p99_after_ms = max((p99 for p99 in p99s if p99 is not None), default=None)
    if result.pre_failover_p99_ms:
        limit = LATENCY_FACTOR * result.pre_failover_p99_ms
        first, stay = first_and_kept(p99s, lambda p99: p99 <= limit)  # a second without a transaction is not ok
        result.seconds_to_p99_2x_first = round(offset + first, 2) if first is not None else None
        result.seconds_to_p99_2x_stay = round(offset + stay, 2) if stay is not None else None


def agent_warm_seconds(samples: list[tuple[float, Any]], started: float) -> float | None:
    """From the agent's start (`started`) to the first of its scans from which every later one
    found the standby covering >= TARGET_COVERAGE of the hot set; None if the last did not."""
    seen = [(at, progress) for at, progress in samples if progress is not None]
    _, kept = first_and_kept([progress[0] for _, progress in seen], lambda share: share >= TARGET_COVERAGE)
    return round(seen[kept - 1][0] - started, 1) if kept is not None else None


def cache_overlap(primary: Node, standby: Node) -> tuple[tuple[float, int], tuple[float, int]]:
    """coverage() of the primary's hot buffers (usage count > HOT_THRESHOLD) and of every
    buffer it caches: (share on the standby, count) each, one pg_buffercache scan per node."""
    rows = primary.sql("SELECT reltablespace::int8, reldatabase::int8, relfilenode::int8, relforknumber, relblocknumber, "
                       "usagecount FROM pg_buffercache WHERE relfilenode IS NOT NULL")
    cached = {row[:5] for row in rows}
    hot = {row[:5] for row in rows if row[5] > HOT_THRESHOLD}
    on_standby = standby.cached_blocks()
    share = lambda blocks: (len(blocks & on_standby) / len(blocks) if blocks else 1.0, len(blocks))  # noqa: E731
    return share(hot), share(cached)


def build_template(scenario: Scenario, args: argparse.Namespace, workdir: Path) -> Path:
    """One primary data directory with the pgbench data, stopped, copied for every run."""
    say(f"[{scenario.name}] building the data set once: pgbench -i -s {scenario.scale}")
    started = time.monotonic()
    # Built with a smaller max_wal_size: a checkpoint keeps up to max_wal_size of WAL segments
    # for reuse, and every run copies the template's (at scale 300, gigabytes).
    settings = {**scenario.settings(args), "max_wal_size": "'1GB'"}
    cluster = Cluster(settings=settings, base=workdir / f"template-{scenario.name}", keep=True)
    node = cluster.primary
    try:
        cluster.init_primary(node)
        node.start()
        for extension in ("pg_ccm", "pg_buffercache"):
            node.sql(f"CREATE EXTENSION {extension}")
        pgbench(node, "-i", "-s", str(scenario.scale), "-q")  # generate, vacuum analyze, keys
        size = node.one("SELECT pg_size_pretty(pg_database_size('postgres'))")
        node.sql("CHECKPOINT")
        node.stop()
    except BaseException:
        with shielded():
            cluster.destroy()
        raise
    say(f"[{scenario.name}] data set ready in {time.monotonic() - started:.0f} s: database {size}")
    return node.datadir


def run_once(scenario: Scenario, template: Path, mode: Mode, args: argparse.Namespace, workdir: Path) -> RunResult:
    tag = f"[{scenario.name} / {mode.name}]"
    result = RunResult(scenario=scenario.name, mode=mode.name, postgresql=pg_version_text(), fill_room=mode.fill_room)
    cluster = Cluster(settings=scenario.settings(args), base=workdir / f"{scenario.name}-{mode.slug}", keep=args.keep)
    agent: AgentProcess | None = None
    workloads: list[Workload] = []
    samplers: list[Sampler] = []
    try:
        say(f"{tag} primary from the data set, streaming standby cloned from it (pg_basebackup)")
        cluster.create(template=template)
        primary, standby = cluster.primary, cluster.standby
        io = has_pg_stat_io(primary)
        say(f"{tag} standby made cold: restartpoint, restart, its files dropped from the OS page cache")
        cluster.make_standby_cold()
        if mode.agent_args is not None:
            agent = AgentProcess(cluster.both_nodes_conninfo("read-write"), cluster.both_nodes_conninfo("standby"), cluster.base,
                                 interval=args.agent_interval, extra=list(mode.agent_args), launcher=DIE_WITH_US)
            agent_started = time.monotonic()
            agent.start()
            samplers.append(progress := Sampler("ccm-agent metrics", lambda _: agent_progress(agent), interval=0.5))
            say(f"{tag} ccm-agent running (every {args.agent_interval}{''.join(' ' + a for a in mode.agent_args)}; "
                f"metrics on 127.0.0.1:{agent.metrics_port})")

        say(f"{tag} Aurora's CCM-test workload on the primary for {args.warm_seconds} s, {args.clients} clients")
        samplers.append(sampler := ReadSampler(primary, io))
        workloads.append(warm := Workload(primary, scenario, args.clients, args.warm_seconds, "primary    ",
                                          log_dir=cluster.base / "pgbench-primary"))
        warm.wait()
        sampler.stop()
        if agent is not None:
            progress.stop()  # "kept while the workload ran": later scans see a hot set that no longer grows

        (result.coverage_at_failover, result.hot_buffers_at_failover), \
            (result.cached_coverage_at_failover, result.cached_buffers_at_failover) = cache_overlap(primary, standby)
        if agent is not None:
            # A series cut short by a failed probe cannot tell "kept".
            result.agent_warm_s = agent_warm_seconds(progress.samples, agent_started) if progress.error is None else None
            result.agent_blocks_loaded = int(agent.metric("ccm_agent_blocks_loaded_total"))
            result.agent_fill_blocks_loaded = int(agent.metric("ccm_agent_fill_blocks_loaded_total"))
            say(f"{tag} ccm-agent: >= {TARGET_COVERAGE:.0%} of the hot set on the standby, kept while the workload ran, "
                f"{fmt_seconds(result.agent_warm_s, args.warm_seconds)} after its start")
        say(f"{tag} coverage at failover: {result.coverage_at_failover:.1%} of the primary's "
            f"{result.hot_buffers_at_failover} hot buffers (usage count > {HOT_THRESHOLD}) cached on the standby, "
            f"{result.cached_coverage_at_failover:.1%} of all its {result.cached_buffers_at_failover} buffers")

        say(f"{tag} separate hosts: dropping the standby's files from the OS page cache (sync + vmtouch -e)")
        standby.drop_os_cache()
        # Read before the kill, so that the workload starts right after the promotion: the kill
        # and the promotion add nothing (recovery's reads are counted in neither figure).
        blocks_at_promotion, io_reads_at_promotion = storage_reads(standby, io)
        say(f"{tag} FAILOVER: SIGKILL of the primary's postmaster, pg_ctl promote of the standby")
        killed = time.monotonic()
        primary.kill()
        standby.promote()
        promoted = time.monotonic()
        workloads.append(after := Workload(standby, scenario, args.clients, args.after_seconds, "new primary",
                                           log_dir=cluster.base / "pgbench-new-primary"))
        samplers.append(sampler_after := ReadSampler(standby, io))
        # A physical slot for the old primary, as Patroni keeps one per member, so that the WAL it
        # needs to rejoin is not recycled meanwhile (the new primary writes a lot of it). Taken
        # in every run, so that every run does the same.
        slot = cluster.reserve_wal_for_rejoin(standby)
        result.kill_to_promoted_s = round(promoted - killed, 3)
        result.kill_at = round(killed - promoted, 3)
        result.promotion_to_workload_s = round(after.started - promoted, 3)
        say(f"{tag} promoted {result.kill_to_promoted_s:.2f} s after the kill; same workload on the new primary "
            f"for {args.after_seconds} s")
        after.wait()
        sampler_after.stop()
        time.sleep(1.5)  # backends flush their statistics when they exit
        blocks_at_end, io_reads_at_end = storage_reads(standby, io)
        result.blocks_read_after = blocks_at_end - blocks_at_promotion
        if io_reads_at_end is not None and io_reads_at_promotion is not None:
            result.io_blocks_read_after = io_reads_at_end - io_reads_at_promotion
        result.blocks_read_window_s = args.after_seconds

        result.tps_before = [[round(warm.started + k - promoted, 2), tps] for k, tps in enumerate(warm.tps, 1)]
        result.tps_after = [[round(after.started + k - promoted, 2), tps] for k, tps in enumerate(after.tps, 1)]
        result.reads_before = [list(p) for p in sampler.rates(promoted)]
        result.reads_after = [list(p) for p in sampler_after.rates(promoted)]
        result.io_reads_before = [list(p) for p in sampler.io_rates(promoted)]
        result.io_reads_after = [list(p) for p in sampler_after.io_rates(promoted)]
        load_ended = result.tps_before[-1][0] if result.tps_before else result.kill_at
        result.fpi_before = [list(p) for p in sampler.fpi_rates(promoted)]
        result.fpi_after = [list(p) for p in sampler_after.fpi_rates(promoted)]
        result.pre_failover_reads_per_s = mean_rate(result.reads_before, load_ended - PRE_WINDOW, load_ended + 1)
        if io:
            result.pre_failover_io_reads_per_s = mean_rate(result.io_reads_before, load_ended - PRE_WINDOW, load_ended + 1)
        result.pre_failover_fpi_per_s = mean_rate(result.fpi_before, load_ended - PRE_WINDOW, load_ended + 1)
        result.first_10s_fpi_per_s = mean_rate(result.fpi_after, float("-inf"), FIRST_WINDOW + 0.5)
        if agent is not None:
            result.agent_coverage = [[round(at - promoted, 2), round(sample[0], 4), sample[1]]
                                     for at, sample in progress.samples if sample is not None]
        compute_figures(result, after.tps, result.promotion_to_workload_s)
        compute_latency(result, warm, after, promoted)
        read_by = (f"{result.io_blocks_read_after} blocks from storage (pg_stat_io; blks_read: {result.blocks_read_after})"
                   if io else f"{result.blocks_read_after} blocks from storage")
        say(f"{tag} new primary read {read_by} in its first "
            f"{args.after_seconds} s; 90% of the pre-failover TPS first reached "
            f"{fmt_seconds(result.seconds_to_90pct_first, args.after_seconds)} after promotion; p99 latency in its "
            f"first {FIRST_WINDOW} s {fmt_ms(result.first_10s_p99_ms)} ms (before: {fmt_ms(result.pre_failover_p99_ms)} ms)")

        if agent is not None and args.rejoin:
            try:
                rejoin(cluster, scenario, args, result, tag, slot)
            except Exception as error:  # the failover figures stand on their own
                result.rejoin_error = str(error).splitlines()[0] if str(error) else type(error).__name__
                say(f"{tag} rejoining the old primary failed: {error}")
        return result
    finally:
        with shielded():
            for workload in workloads:
                workload.stop()
            for each in samplers:
                each.stop()
            if agent is not None:
                agent.stop()
            cluster.destroy()


def rejoin(cluster: Cluster, scenario: Scenario, args: argparse.Namespace, result: RunResult, tag: str, slot: str) -> None:
    """The killed primary comes back as a standby of the new one (pg_rewind); the agent,
    neither restarted nor reconfigured, finds it and warms it."""
    old_primary, new_primary = cluster.primary, cluster.standby
    say(f"{tag} epilogue: the old primary rejoins as a standby of the new one (pg_rewind); the running agent finds it")
    cluster.rejoin_as_standby(old_primary, new_primary, slot=slot)
    cluster.primary, cluster.standby = new_primary, old_primary
    cluster.wait_caught_up()
    load = Workload(new_primary, scenario, args.clients, REJOIN_TIMEOUT + 5, "new primary")
    try:
        started = time.monotonic()
        watch = Sampler("coverage of the rejoined node", lambda _: coverage(new_primary, old_primary, HOT_THRESHOLD),
                        interval=0.5, until=lambda share: share[0] >= TARGET_COVERAGE)
        watch.wait(REJOIN_TIMEOUT)
    finally:
        load.stop()
    if not watch.samples:
        raise RuntimeError(f"coverage of the rejoined node not measured: {watch.error}")
    at, (fraction, _) = watch.samples[-1]
    result.rejoin_coverage, result.rejoin_seconds = fraction, round(at - started, 1)
    say(f"{tag} the rejoined old primary caches {fraction:.1%} of the new primary's hot set "
        f"{result.rejoin_seconds:.0f} s after it came back")


# -- reporting ---------------------------------------------------------------------------


def fmt_seconds(value: float | None, limit: int) -> str:
    return f"{value:.1f} s" if value is not None else f"not within {limit} s"


def fmt_pct(value: float | None) -> str:
    return f"{value:.0f}%" if value is not None else "-"


def fmt_rate(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def fmt_count(value: float | None) -> str:
    return f"{value:.0f}" if value is not None else "-"


def fmt_ms(value: float | None) -> str:
    """Milliseconds with three significant digits or so (0.183, 12.4, 250)."""
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def fmt_latency(pair: tuple[float | None, float | None]) -> str:
    return "-" if pair[0] is None else f"{fmt_ms(pair[0])} / {fmt_ms(pair[1])}"


def reads_rows(runs: list[RunResult]) -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    """The table's read rows: the old primary's steady state, and the new primary's first
    seconds. From PostgreSQL 16 the pg_stat_io figures lead and blks_read follows them."""
    window = runs[0].blocks_read_window_s
    blks_before = [
        ("  primary's blocks read per second in those seconds (steady state)",
         [fmt_count(r.pre_failover_reads_per_s) for r in runs]),
        ("  the same per 1000 transactions (relation extension counts too)",
         [fmt_rate(per_1000(r.pre_failover_reads_per_s, r.pre_failover_tps)) for r in runs]),
    ]
    blks_after = [
        (f"blocks read from storage by the new primary, first {window} s", [f"{r.blocks_read_after}" for r in runs]),
        ("  the same per 1000 transactions (compare with the old primary's above)",
         [fmt_rate(per_1000(r.blocks_read_after, r.transactions_in_reads_window)) for r in runs]),
    ]
    if all(r.io_blocks_read_after is None for r in runs):
        return blks_before, blks_after
    before = [
        ("  primary's blocks read per second in those seconds (pg_stat_io reads)",
         [fmt_count(r.pre_failover_io_reads_per_s) for r in runs]),
        ("  the same per 1000 transactions",
         [fmt_rate(per_1000(r.pre_failover_io_reads_per_s, r.pre_failover_tps)) for r in runs]),
        ("  primary's blks_read per second in those seconds (pg_stat_database)", blks_before[0][1]),
        ("  the same per 1000 transactions", blks_before[1][1]),
    ]
    after = [
        (f"blocks read from storage by the new primary, first {window} s (pg_stat_io)",
         [fmt_count(r.io_blocks_read_after) for r in runs]),
        ("  the same per 1000 transactions (compare with the old primary's above)",
         [fmt_rate(per_1000(r.io_blocks_read_after, r.transactions_in_reads_window)) for r in runs]),
        (f"  blks_read of the new primary, first {window} s (pg_stat_database)", blks_after[0][1]),
        ("  the same per 1000 transactions", blks_after[1][1]),
    ]
    return before, after


def read_ratios(with_ccm: RunResult, without: RunResult, checks: dict[str, object]) -> None:
    """Prints the storage reads with CCM over those without; "storage_read_ratio" (the one the
    target is checked on) is pg_stat_io's where it exists, else blks_read's."""
    io = with_ccm.io_blocks_read_after is not None and without.io_blocks_read_after is not None
    figures = [("storage_read_ratio", "", with_ccm.blocks_read_after, without.blocks_read_after)]
    if io:
        figures = [("storage_read_ratio", " (pg_stat_io reads)", with_ccm.io_blocks_read_after, without.io_blocks_read_after),
                   ("storage_read_ratio_blks_read", " (blks_read)",
                    with_ccm.blocks_read_after, without.blocks_read_after)]
    for key, source, ours, theirs in figures:
        if theirs:
            checks[key] = ours / theirs
            print(f"storage reads by the new primary{source}, {with_ccm.mode} / {without.mode}: {ours} / {theirs} = {ours / theirs:.1%}")
        else:
            print(f"storage reads by the new primary{source} without CCM: 0 (no ratio)")


def table_rows(runs: list[RunResult], args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    reads_before, reads_after = reads_rows(runs)
    agent = any(r.fill_room is not None for r in runs)
    rows = [
        (f"pre-failover TPS (mean of the last {PRE_WINDOW} s before the kill)",
         [f"{r.pre_failover_tps:.0f}" for r in runs]),
        ("  latency p50 / p99 in those seconds, ms",
         [fmt_latency((r.pre_failover_p50_ms, r.pre_failover_p99_ms)) for r in runs]),
        *reads_before,
        (f"coverage at failover (primary's hot buffers, usage > {HOT_THRESHOLD}, on the standby)",
         [f"{r.coverage_at_failover:.1%}" for r in runs]),
        ("  hot buffers on the primary at failover", [f"{r.hot_buffers_at_failover}" for r in runs]),
        ("  share of all the buffers the primary caches (any usage count)", [f"{r.cached_coverage_at_failover:.1%}" for r in runs]),
        ("  buffers the primary caches at failover", [f"{r.cached_buffers_at_failover}" for r in runs]),
    ]
    if agent:
        rows += [
            (f"ccm-agent: its start to >= {TARGET_COVERAGE:.0%} of the hot set, kept while the load ran",
             [fmt_seconds(r.agent_warm_s, args.warm_seconds) if r.fill_room is not None else "-" for r in runs]),
            ("  blocks ccm-agent loaded into the standby before the failover", [fmt_count(r.agent_blocks_loaded) for r in runs]),
            ("  of which colder blocks filling unused buffers (fill_room)", [fmt_count(r.agent_fill_blocks_loaded) for r in runs]),
        ]
    rows += [
        ("kill to promoted (new primary accepts writes)", [f"{r.kill_to_promoted_s:.2f} s" for r in runs]),
        ("time from promotion to 90% of pre-failover TPS: first reached",
         [fmt_seconds(r.seconds_to_90pct_first, args.after_seconds) for r in runs]),
        ("time from promotion to 90% of pre-failover TPS: reached and kept",
         [fmt_seconds(r.seconds_to_90pct_stay, args.after_seconds) for r in runs]),
        (f"TPS in the first {FIRST_WINDOW} s after promotion, % of pre-failover", [fmt_pct(r.first_10s_pct) for r in runs]),
        (f"latency p50 / p99 in the first {FIRST_WINDOW} s after promotion, ms",
         [fmt_latency((r.first_10s_p50_ms, r.first_10s_p99_ms)) for r in runs]),
        ("  worst one-second p99 after promotion, ms", [fmt_ms(r.worst_p99_after_ms) for r in runs]),
        (f"time from promotion to p99 <= {LATENCY_FACTOR:.0f}x pre-failover p99: first reached",
         [fmt_seconds(r.seconds_to_p99_2x_first, args.after_seconds) for r in runs]),
        (f"time from promotion to p99 <= {LATENCY_FACTOR:.0f}x pre-failover p99: reached and kept",
         [fmt_seconds(r.seconds_to_p99_2x_stay, args.after_seconds) for r in runs]),
        *reads_after,
        (f"full-page images written per second: old primary, last {PRE_WINDOW} s", [fmt_count(r.pre_failover_fpi_per_s) for r in runs]),
        (f"full-page images written per second: new primary, first {FIRST_WINDOW} s", [fmt_count(r.first_10s_fpi_per_s) for r in runs]),
        (f"new primary's TPS, last {PRE_WINDOW} s of the run", [fmt_count(r.post_failover_steady_tps) for r in runs]),
    ]
    if any(r.rejoin_coverage is not None or r.rejoin_error for r in runs):
        rows.append(("epilogue: rejoined old primary's coverage of the new primary's hot set", [
            f"{r.rejoin_coverage:.1%} in {r.rejoin_seconds:.0f} s" if r.rejoin_coverage is not None
            else ("failed" if r.rejoin_error else "-") for r in runs]))
    return rows


def check_targets(run: RunResult, without: RunResult | None, args: argparse.Namespace, prefix: str) -> dict[str, object]:
    """Prints the read ratio against the run without CCM and the project's targets for one
    CCM run; returns them."""
    checks: dict[str, object] = {}
    if without is not None:
        read_ratios(run, without, checks)
    first = run.seconds_to_90pct_first
    targets = [
        ("tps_90pct_within_2s", f"with CCM, >= 90% of pre-failover TPS within {TARGET_SECONDS:.0f} s of promotion",
         first is not None and round(first, 1) <= TARGET_SECONDS, fmt_seconds(first, args.after_seconds)),
        ("coverage_99pct", f"coverage at failover >= {TARGET_COVERAGE:.0%}",
         run.coverage_at_failover >= TARGET_COVERAGE, f"{run.coverage_at_failover:.1%}"),
    ]
    if "storage_read_ratio" in checks:
        ratio = float(checks["storage_read_ratio"])  # type: ignore[arg-type]
        counted = " (pg_stat_io reads)" if run.io_blocks_read_after is not None else ""
        targets.append(("reads_5pct", f"storage reads{counted} in the first {READS_WINDOW} s <= {TARGET_READS:.0%} "
                        "of the run without CCM", ratio <= TARGET_READS, f"{ratio:.1%}"))
        if run.blocks_read_window_s != READS_WINDOW:
            print(f"(the read figures cover {run.blocks_read_window_s} s, not {READS_WINDOW} s: --after-seconds)")
    for key, label, met, measured in targets:
        checks[key] = {"met": met, "measured": measured}
        print(f"target {'met    ' if met else 'NOT met'}{prefix}: {label} (measured: {measured})")
    return checks


def print_table(results: list[RunResult], args: argparse.Namespace) -> dict[str, dict[str, dict[str, object]]]:
    """Prints one table per scenario; returns the target checks per scenario and CCM run."""
    verdicts: dict[str, dict[str, dict[str, object]]] = {}
    for scenario in dict.fromkeys(r.scenario for r in results):
        runs = [r for r in results if r.scenario == scenario]
        width, columns = 74, [max(16, len(r.mode)) for r in runs]
        print()
        print(f"## {scenario} ({runs[0].postgresql})")
        print()
        print(f"| {'':<{width}} |" + "".join(f" {r.mode:>{c}} |" for r, c in zip(runs, columns)))
        print(f"|{'-' * (width + 2)}|" + "".join(f"{'-' * (c + 1)}:|" for c in columns))
        for label, values in table_rows(runs, args):
            print(f"| {label:<{width}} |" + "".join(f" {v:>{c}} |" for v, c in zip(values, columns)))

        with_agent = [r for r in runs if r.fill_room is not None]
        without = next((r for r in runs if r.fill_room is None), None)
        print()
        verdicts[scenario] = {run.mode: check_targets(run, without, args, f" [{run.mode}]" if len(with_agent) > 1 else "")
                              for run in with_agent}
    return verdicts


EXPLANATION = """\
How to read this:
- Separate hosts are emulated: both nodes run on this machine, so just before the failover the
  standby's data files are dropped from the OS page cache (sync + vmtouch -e), in every run. The
  new primary then has only what its shared_buffers hold, as on its own host (and as on Aurora,
  which has no double buffering); everything else comes from storage.
- "pre-failover TPS" is the old primary's mean over the last 20 s before the kill. The 90% times
  run from the moment the promoted standby accepts writes (pgbench starts a few milliseconds
  later) to the end of the first pgbench -P 1 interval at or above 90% of it, shown and checked
  to 0.1 s ("reached and kept": every later second too, so a single slow second anywhere, e.g.
  a checkpoint, resets it).
{reads}- "full-page images" (pg_stat_wal.wal_fpi): promotion starts a checkpoint, and the first change
  of every page after a checkpoint writes the whole 8 kB page into WAL. Right after promotion
  nearly every update is such a first change, so WAL volume jumps and write transactions slow
  down, with or without CCM; no cache transfer can avoid it.
- "coverage at failover" is the share of the primary's hot buffers (usage count > 3, Aurora's
  threshold) that the standby caches, from pg_buffercache on both nodes just before the kill.
  Without CCM the standby still caches what WAL replay touched (the pages the workload wrote).
  The next rows are the same share of every buffer the primary caches: what ccm-agent's
  fill_room adds (colder blocks into the standby's unused buffers; "hot set only" runs without).
- "ccm-agent: its start to >= 99% of the hot set" is read from the agent's own scans
  (ccm_agent_coverage_ratio, sampled every 0.5 s): from the agent's start to the first scan from
  which every later one, until the workload stopped, found the standby covering >= 99% of the
  primary's hot set at that moment. The primary warms up meanwhile, so its hot set grows.
- Latency is pgbench's per-transaction latency (--log): p50 and p99 of the transactions that
  ended in each one-second interval, and pooled over the old primary's last 20 s and the new
  primary's first 10 s. "p99 <= 2x pre-failover p99" is timed like the 90% TPS figures, on the
  one-second p99s; a second in which no transaction ended is not within it.
"""
BLKS_READ_EXPLANATION = """\
- "blocks read from storage" is the rise of sum(pg_stat_database.blks_read) on the new primary:
  every block it had to read because shared_buffers lacked it (read a moment after the clients
  disconnected, when every backend has flushed its statistics).
"""
IO_READS_EXPLANATION = """\
- "blocks read from storage" is the rise of pg_stat_io's reads of relations on the new primary,
  summed over backend types and contexts (the startup process's replay left out): every block it
  had to read because shared_buffers lacked it, and only those (pages a relation is extended by
  are extends, not reads); the ratio and the target use it. The blks_read rows beside it are
  sum(pg_stat_database.blks_read), which can count more: pages zeroed rather than read, which
  new pages of a growing relation can be. Both are read a moment after the clients
  disconnected, when every backend has flushed its statistics.
"""


def explanation(results: list[RunResult]) -> str:
    io = any(r.io_blocks_read_after is not None for r in results)
    return EXPLANATION.format(reads=IO_READS_EXPLANATION if io else BLKS_READ_EXPLANATION)


def plot_steps(axis, series: list[list[float]], column: int, left: float, **style: Any) -> None:
    """One column of a per-second series (each value covers the second that ends at its time
    stamp) as steps, from `left` on."""
    points = [p for p in series if p[0] - 1 >= left]
    if points:
        xs = [points[0][0] - 1] + [p[0] for p in points]
        ys = [points[0][column]] + [p[column] for p in points]
        axis.plot(xs, ys, drawstyle="steps-pre", **style)


def chart(results: list[RunResult], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.scenario for r in results))
    figure, axes = plt.subplots(3, len(names), figsize=(8 * len(names), 12.5), squeeze=False, sharex="col")
    colors = {CCM.name: "tab:green", CCM_HOT_SET_ONLY.name: "tab:blue", NO_CCM.name: "tab:red"}
    left = -min(30, args.warm_seconds)
    for column, scenario in enumerate(names):
        tps_axis, latency_axis, reads_axis = (axes[row][column] for row in range(3))
        for run in (r for r in results if r.scenario == scenario):
            color = colors[run.mode]
            label = f"{run.mode}: 90% after {fmt_seconds(run.seconds_to_90pct_first, args.after_seconds)}"
            # Before and after apart: between them the workload is stopped (coverage measured,
            # the standby's page cache dropped, the primary killed, the standby promoted).
            for series, name in ((run.tps_before, None), (run.tps_after, label)):
                plot_steps(tps_axis, series, 1, left, color=color, label=name, linewidth=1.4)
            tps_axis.axhline(0.9 * run.pre_failover_tps, color=color, linestyle=":", linewidth=1)
            latency_label = f"{run.mode}: p99 {fmt_ms(run.first_10s_p99_ms)} ms in the first {FIRST_WINDOW} s"
            for series, name in ((run.latency_before, None), (run.latency_after, latency_label)):
                plot_steps(latency_axis, series, 2, left, color=color, label=name, linewidth=1.4)  # p99
                plot_steps(latency_axis, series, 1, left, color=color, linewidth=0.8, alpha=0.5)  # p50
            if run.pre_failover_p99_ms:
                latency_axis.axhline(LATENCY_FACTOR * run.pre_failover_p99_ms, color=color, linestyle=":", linewidth=1)
            io = run.io_blocks_read_after is not None
            reads_label = f"{run.mode}: {run.storage_reads_after:,} blocks in the first {run.blocks_read_window_s} s"
            reads = (run.io_reads_before, run.io_reads_after) if io else (run.reads_before, run.reads_after)
            for series, name in ((reads[0], None), (reads[1], reads_label)):
                points = [p for p in series if p[0] >= left]
                reads_axis.plot([p[0] for p in points], [p[1] for p in points], color=color, linewidth=1.4, label=name)
            if run.tps_before:
                gap = (run.tps_before[-1][0], 0)
                for axis in (tps_axis, latency_axis, reads_axis):
                    axis.axvspan(*gap, color="grey", alpha=0.12, linewidth=0)
        latency_axis.set_yscale("log")
        for axis in (tps_axis, latency_axis, reads_axis):
            axis.axvline(0, color="black", linestyle="--", linewidth=1)
            axis.grid(alpha=0.3)
            axis.set_xlim(left, args.after_seconds + 1)
            if axis is not latency_axis:
                axis.set_ylim(bottom=0)
            axis.legend(loc={tps_axis: "lower right", reads_axis: "upper right"}.get(axis, "best"), fontsize=9)
        tps_axis.text(-0.4, 0.03 * tps_axis.get_ylim()[1], "primary killed,\nstandby promoted", ha="right", fontsize=8)
        tps_axis.set_title(f"{scenario}: TPS (pgbench -P 1); dotted: 90% of pre-failover TPS;\n"
                           "grey: no load (coverage measured, standby's page cache dropped, kill, promote)")
        tps_axis.set_ylabel("transactions per second")
        latency_axis.set_title(f"{scenario}: latency per second (pgbench --log), p99 and, faint, p50;\n"
                               f"dotted: {LATENCY_FACTOR:.0f}x the pre-failover p99")
        latency_axis.set_ylabel("ms (log scale)")
        counter = "pg_stat_io reads" if any(r.io_blocks_read_after is not None for r in results) else "pg_stat_database.blks_read"
        reads_axis.set_title(f"{scenario}: blocks read into shared_buffers per second\n"
                             f"({counter}: old primary before 0, new primary after)")
        reads_axis.set_ylabel("blocks per second")
        reads_axis.set_xlabel("seconds from promotion")
    figure.suptitle(f"pg_ccm failover demo on {results[0].postgresql}, with and without ccm-agent\n(separate hosts emulated: the standby's "
                    "files are dropped from the OS page cache before the failover, in every run)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# -- main --------------------------------------------------------------------------------


def setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[a-z_][a-z0-9_.]*", name.strip()):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    value = value.strip()
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", value):
        value = "'" + value.replace("'", "''") + "'"
    return name.strip(), value


def memory(text: str) -> str:
    try:
        megabytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip()


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default (flags have none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.nargs == 0 or action.default is None else super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--pg", type=int, metavar="N",
                        help="PostgreSQL major version to run (15 to 18, from /usr/lib/postgresql/N/bin; default: the "
                             "newest installed one that has pg_ccm)")
    parser.add_argument("--scenario", choices=list(SCENARIO_NAMES), default="uniform",
                        help="which data set and access pattern (all: uniform and skewed, about twice as long; "
                             "large: only by name)")
    parser.add_argument("--only", choices=["ccm", "none", "both"], default="both",
                        help="run with ccm-agent (as many runs as --fill-room asks for), without CCM, or both")
    parser.add_argument("--fill-room", choices=["on", "off", "both"],
                        help="ccm-agent's fill_room in the CCM run: on (the agent's default: colder blocks fill the "
                             "standby's unused buffers), off (--fill-room false: the hot set only), or both: two CCM "
                             "runs (default: both for --scenario large, on for the others)")
    parser.add_argument("--scale", type=int, default=50, help="pgbench scale of the uniform scenario (about 15 MB per unit)")
    parser.add_argument("--shared-buffers", type=memory, default="1GB", help="shared_buffers of both nodes, uniform scenario")
    parser.add_argument("--skewed-scale", type=int, default=50, help="pgbench scale of the skewed scenario")
    parser.add_argument("--skewed-shared-buffers", type=memory, default="256MB",
                        help="shared_buffers of both nodes, skewed scenario")
    parser.add_argument("--large-scale", type=int, default=300, help="pgbench scale of the large scenario")
    parser.add_argument("--large-shared-buffers", type=memory, default="5GB", help="shared_buffers of both nodes, large scenario")
    parser.add_argument("--skew", type=float, default=15.0,
                        help="parameter of random_exponential for aid in the skewed scenario (higher: hotter head)")
    parser.add_argument("--clients", type=int, default=4, help="pgbench clients")
    parser.add_argument("--warm-seconds", type=int, default=60, help="workload on the primary before the failover")
    parser.add_argument("--after-seconds", type=int, default=60, help="workload on the new primary after the failover")
    parser.add_argument("--agent-interval", default="1s", help="ccm-agent --interval")
    parser.add_argument("--usage-threshold", type=int, default=3, choices=range(0, 5), metavar="0-4",
                        help="pg_ccm's ccm.usage_threshold on both nodes (what the agent sends); coverage is always "
                             f"measured at usage count > {HOT_THRESHOLD}")
    parser.add_argument("--set", action="append", default=[], type=setting, metavar="NAME=VALUE",
                        help="extra postgresql.conf setting for every node, repeatable (e.g. max_wal_size=4GB)")
    parser.add_argument("--no-rejoin", dest="rejoin", action="store_false",
                        help="skip the epilogue of the CCM run (the old primary rejoins and the agent warms it)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "demo-output", help="where failover.png and results.json go")
    parser.add_argument("--keep", action="store_true", help="keep the clusters' directories (the path is printed)")
    args = parser.parse_args(argv)
    if args.warm_seconds < PRE_WINDOW or args.after_seconds < 10:
        parser.error(f"--warm-seconds must be >= {PRE_WINDOW} and --after-seconds >= 10")
    if args.clients < 1:
        parser.error("--clients must be >= 1")
    return args


def preflight(args: argparse.Namespace) -> list[str]:
    problems = []
    runs = [mode for name in SCENARIO_NAMES[args.scenario] for mode in modes(args, name)]
    if any(mode.agent_args is not None for mode in runs) and not AGENT_BIN.exists():
        problems.append(f"{AGENT_BIN} is missing: run scripts/install.sh (make demo does)")
    elif CCM_HOT_SET_ONLY in runs:
        usage = subprocess.run([str(AGENT_BIN), "run", "--help"], capture_output=True, text=True).stdout
        if "--fill-room" not in usage:
            problems.append(f"{AGENT_BIN} has no --fill-room (a hot-set-only run needs it): rebuild it with "
                            "scripts/install.sh, or pass --fill-room on")
    try:
        (args.pg,) = resolve_pg_versions(args.pg)  # names scripts/install.sh --pg N if pg_ccm is missing
        use_pg_version(args.pg)
    except PgVersionError as error:
        problems.append(str(error))
    for program in ("vmtouch", "setpriv", "sync"):
        if shutil.which(program) is None:
            problems.append(f"{program} is missing (scripts/setup.sh installs vmtouch)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        problems.append("matplotlib is missing: pip install -r tests/requirements.txt")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problems = preflight(args)
    if problems:
        for problem in problems:
            print(f"failover_demo: {problem}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)

    args.output_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pg_ccm-demo-"))
    os.chmod(workdir, 0o755)  # the postgres user must reach the clusters inside
    chosen = scenarios(args, workdir)
    per_run = 15 + args.warm_seconds + args.after_seconds
    # The data set once, then per run: a copy of it for each node, the workloads, the epilogue.
    estimate = sum(5 + s.scale / 8 + sum(per_run + s.scale / 10 + (REJOIN_TIMEOUT if args.rejoin and m.agent_args is not None else 0)
                                         for m in modes(args, s.name)) for s in chosen)
    started, started_wall = time.monotonic(), datetime.datetime.now().astimezone()
    runs = "; ".join(f"{s.name}: {', '.join(m.name for m in modes(args, s.name))}" for s in chosen)
    say(f"pg_ccm failover demo on {pg_version_text()} ({pg_bin()}), runs of {runs}; about {estimate / 60:.0f} minutes")
    say("separate hosts are emulated by dropping the standby's files from the OS page cache just before "
        "the failover, in every run")
    results: list[RunResult] = []
    try:
        for scenario in chosen:
            say(f"scenario {scenario.name}: {scenario.description}")
            template = build_template(scenario, args, workdir)
            for mode in modes(args, scenario.name):
                results.append(run_once(scenario, template, mode, args, workdir))
    except KeyboardInterrupt as stop:
        say(f"interrupted ({stop or 'Ctrl-C'}): clusters and agent stopped")
        return 130
    finally:
        with shielded():
            if args.keep:
                say(f"kept the clusters' directories in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)

    verdicts = print_table(results, args)
    print()
    print(explanation(results))
    wall = time.monotonic() - started
    png, figures = args.output_dir / "failover.png", args.output_dir / "results.json"
    chart(results, png, args)
    figures.write_text(json.dumps({
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "started": started_wall.isoformat(timespec="seconds"),
        "wall_seconds": round(wall),
        "postgresql": {"major": args.pg, "version": pg_version_text(), "bin": str(pg_bin())},
        "storage_reads": ("pg_stat_io reads of relations (startup process left out); blks_read beside them"
                          if any(r.io_blocks_read_after is not None for r in results) else "pg_stat_database.blks_read"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "targets": verdicts,
        "runs": [asdict(r) for r in results],
    }, indent=1))
    print(f"chart: {png}\nfigures and series: {figures}\nwhole demo: {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
