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
`typical` (chosen only by name: scale 60, about 900 MB, shared_buffers 512MB in 2 GB of memory
per node) is the usual deployment, where the kernel's page cache holds most of the working set:
each node runs in a memory group of its own (its processes and its page cache), and a third
ccm-agent run also mirrors the primary's page cache (extension 0.9.0) and keeps the standby's page
cache at the kill instead of dropping it; the shared_buffers runs pass `--os-cache false`.
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
import textwrap
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
from harness.cgroups import Budget, MemoryCgroup, NodeCgroups, controller_available, data_device  # noqa: E402
from harness import pagecache  # noqa: E402
from harness.wait import wait_for  # noqa: E402
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
    # memory.limit_in_bytes of each node's group with separate budgets, so that each node's
    # page cache is its own (the `typical` scenario); None: no memory group.
    node_memory: str | None = None
    extra_settings: dict[str, str] = field(default_factory=dict)

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
            # With separate budgets the primary may work until --settle-timeout before its window.
            "checkpoint_timeout": f"'{min(1440, 30 + (args.warm_seconds + args.after_seconds + self.settling(args)) // 60)}min'",
            **self.extra_settings,
            **dict(args.set),
        }

    @staticmethod
    def settling(args: argparse.Namespace) -> int:
        return args.settle_timeout + args.pre_seconds if getattr(args, "separate_budgets", False) else 0


AURORA_MIX = ["-b", "tpcb-like@1", "-b", "select-only@20"]
SCENARIO_NAMES = {"uniform": ["uniform"], "skewed": ["skewed"], "all": ["uniform", "skewed"], "large": ["large"],
                  "typical": ["typical"]}
FILL_ROOM_DEFAULT = {"large": "both"}  # --fill-room when not given; "on" for the others
# Scenarios run with separate budgets unless told otherwise.
BUDGETED = ("large", "typical")


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
        elif name == "typical":
            chosen.append(Scenario(
                "typical", args.typical_scale, args.typical_shared_buffers, AURORA_MIX,
                f"pgbench scale {args.typical_scale} (about {15 * args.typical_scale} MB), shared_buffers "
                f"{args.typical_shared_buffers} in {args.typical_node_memory} of memory per node (its memory "
                "group holds its processes and its page cache): the data fits the node's memory, not its "
                "shared_buffers, uniform access",
                node_memory=f"{int(megabytes(args.typical_node_memory))}M",  # memory.limit_in_bytes' syntax
                # The page-cache tier reads only while more than this is free in the node's group.
                extra_settings={"ccm.os_cache_min_free": "'128MB'"},
            ))
        else:
            chosen.append(Scenario(
                "large", args.large_scale, args.large_shared_buffers, AURORA_MIX,
                f"pgbench scale {args.large_scale} (about {15 * args.large_scale} MB), shared_buffers "
                f"{args.large_shared_buffers} on both nodes, uniform access",
            ))
    return chosen


@dataclass(frozen=True)
class Arm:
    """One arm of the comparison: what runs beside the nodes and how the failover finds the
    standby. Arms are data: a new one (say, a standby whose own page cache survives) is one
    more entry in ARMS, and every report and the sweep (bench/failover_sweep.py) show it."""
    name: str
    slug: str  # the run's directory, and its name on the command line (--arms)
    agent_args: tuple[str, ...] | None  # ccm-agent run's extra arguments; None: no agent
    # Separate hosts emulated: the standby's files leave the OS page cache just before the
    # kill (demo/README.md, "Separate hosts on one machine"). An arm that models a standby
    # host with a page cache of its own turns it off and gives the nodes `node_memory`.
    drop_standby_page_cache: bool = True
    # memory.limit_in_bytes of each node's group (separate budgets only). The group is charged
    # with the node's page cache and with its shared memory (shared_buffers, touched by the
    # postmaster's children), so a limit must leave room for shared_buffers.
    node_memory: str | None = None

    @property
    def fill_room(self) -> bool | None:
        return None if self.agent_args is None else "--fill-room" not in self.agent_args


# The shared_buffers arms leave the page-cache tier off: their standby's page cache is dropped
# before the kill anyway, and its reads would only compete with the hot set's.
CCM = Arm("with ccm-agent", "ccm", ("--os-cache", "false"))
CCM_HOT_SET_ONLY = Arm("with ccm-agent (hot set only)", "ccm-hot-set-only", ("--fill-room", "false", "--os-cache", "false"))
# Both caches: the standby's page cache is its own (a memory group per node, the scenario's
# node_memory), made cold at the start and kept at the kill, with whatever replay, the hot set's
# reads and the page-cache tier put in it.
CCM_PAGE_CACHE = Arm("with ccm-agent (both caches)", "ccm-page-cache", (), drop_standby_page_cache=False)
NO_CCM = Arm("without CCM", "none", None)
ARMS = {arm.slug: arm for arm in (CCM, CCM_HOT_SET_ONLY, CCM_PAGE_CACHE, NO_CCM)}


@dataclass(frozen=True)
class Storage:
    """What each node's reads from the data disk are limited to (separate budgets only)."""
    name: str
    read_iops: int = 0  # 0: no limit
    read_mbps: int = 0
    description: str = ""


def storages(args: argparse.Namespace) -> dict[str, Storage]:
    return {
        "local": Storage("local", 0, 0, "this machine's local disk, reads unthrottled (counted per node)"),
        "cloud": Storage("cloud", args.cloud_iops, args.cloud_mbps,
                         f"each node's reads throttled to {args.cloud_iops} IOPS and {args.cloud_mbps} MB/s "
                         "(a general-purpose cloud SSD volume's baseline)"),
    }


def fill_room_choice(args: argparse.Namespace, scenario: str) -> str:
    return args.fill_room or FILL_ROOM_DEFAULT.get(scenario, "on")


def modes(args: argparse.Namespace, scenario: str) -> list[Arm]:
    """The runs of a scenario, in order: the CCM runs --fill-room asks for, then the one without."""
    ccm = {"on": [CCM], "off": [CCM_HOT_SET_ONLY], "both": [CCM, CCM_HOT_SET_ONLY]}[fill_room_choice(args, scenario)]
    if scenario == "typical":
        ccm = [*ccm, CCM_PAGE_CACHE]
    if args.arms:
        return [ARMS[slug] for slug in args.arms.split(",")]
    return {"ccm": ccm, "none": [NO_CCM], "both": [*ccm, NO_CCM]}[args.only]


# -- measuring ---------------------------------------------------------------------------


class Workload:
    """pgbench with -P 1; its per-second progress lines are parsed live from stderr. With
    `log_dir`, pgbench also logs every transaction there (--log), read by latencies()."""

    def __init__(self, node: Node, scenario: Scenario, clients: int, seconds: int, label: str,
                 log_dir: Path | None = None, launcher: list[str] | None = None):
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
        # `launcher`: a command prefix that puts pgbench into a CPU set (separate budgets).
        self.process = subprocess.Popen([*DIE_WITH_US, *(launcher or []), *argv], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
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
    """Blocks read (storage_reads), full-page images and, with `groups` (the node's own
    cgroups), the requests and bytes its disk served, of one node, sampled every second.

    Backends flush their statistics at most once a second, so a pg_stat_* sample lags the
    truth by up to a second; the blkio counters do not lag. The per-second series are for the
    chart; the totals over a whole workload are read separately, once the clients are gone."""

    BLKS_READ, IO_READS, FPI, DEVICE_READS, DEVICE_BYTES = range(5)

    def __init__(self, node: Node, io: bool, groups: NodeCgroups | None = None):
        self.node, self.io, self.groups = node, io, groups
        super().__init__(f"read sampler on {node.name}", self._probe, node.connect)

    def _probe(self, conn) -> tuple[int, int | None, int, int | None, int | None]:
        blocks, io_reads = storage_reads(self.node, self.io, conn)
        # Full-page images written (pg_stat_wal.wal_fpi): after a checkpoint, the first change
        # of every page writes the whole page into WAL.
        fpi = conn.execute("SELECT wal_fpi FROM pg_stat_wal").fetchone()[0]
        device = self.groups.reads() if self.groups is not None else (None, None)
        return blocks, io_reads, int(fpi), *device

    def rates(self, origin: float, column: int = 0) -> list[tuple[float, float]]:
        """(seconds since origin, per second) between consecutive samples of one column:
        0 blks_read, 1 pg_stat_io reads (16+), 2 full-page images, 3 disk read requests,
        4 bytes read from the disk (the last two with the node's cgroups)."""
        samples = [(t, value[column]) for t, value in self.samples if value[column] is not None]
        return [(round(t1 - origin, 2), round((v1 - v0) / (t1 - t0), 1))
                for (t0, v0), (t1, v1) in zip(samples, samples[1:]) if t1 > t0]

    def at(self, moment: float, column: int) -> float | None:
        """A column's value at `moment` (time.monotonic()), interpolated between the samples
        around it; None if the samples do not reach it."""
        samples = [(t, value[column]) for t, value in self.samples if value[column] is not None]
        for (t0, v0), (t1, v1) in zip(samples, samples[1:]):
            if t0 <= moment <= t1:
                return v0 + (v1 - v0) * ((moment - t0) / (t1 - t0) if t1 > t0 else 1.0)
        return None

    def over(self, seconds: float, column: int) -> float | None:
        """A column's rise over the last `seconds` sampled (None with too few samples)."""
        if not self.samples:
            return None
        latest = self.samples[-1][0]
        if latest - self.samples[0][0] < seconds:
            return None
        earlier = self.at(latest - seconds, column)
        last = self.samples[-1][1][column]
        return None if earlier is None or last is None else last - earlier

    def io_rates(self, origin: float) -> list[tuple[float, float]]:
        return self.rates(origin, 1)

    def fpi_rates(self, origin: float) -> list[tuple[float, float]]:
        return self.rates(origin, 2)


# What the active client backends wait on; "CPU" is active without a wait event: running, or
# waiting for a CPU.
WAITS = ("SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU'), count(*)::int FROM pg_stat_activity "
         "WHERE backend_type = 'client backend' AND state = 'active' AND pid <> pg_backend_pid() GROUP BY 1")


class WaitSampler(Sampler):
    """The wait events of a node's active client backends, sampled every 0.2 s."""

    def __init__(self, node: Node):
        super().__init__(f"wait events on {node.name}", lambda conn: dict(conn.execute(WAITS).fetchall()), node.connect,
                         interval=0.2)

    def shares(self, start: float, end: float) -> dict[str, float]:
        """Each wait event's share of the backends seen active between two moments, most first."""
        totals: dict[str, int] = {}
        for at, counts in self.samples:
            if start <= at <= end:
                for event, count in counts.items():
                    totals[event] = totals.get(event, 0) + count
        seen = sum(totals.values())
        return {event: round(count / seen, 3) for event, count in sorted(totals.items(), key=lambda item: -item[1])} if seen else {}


def fmt_waits(shares: dict[str, float], top: int = 3) -> str:
    return ", ".join(f"{event} {share:.0%}" for event, share in list(shares.items())[:top]) or "-"


def agent_progress(agent: AgentProcess) -> tuple[float, int, int] | None:
    """The agent's coverage of the hot set at its last scan, the hot set's size (blocks) and
    the blocks it has loaded into standbys so far; None before its first cycle."""
    metrics = agent.metrics()
    if not metrics.get("ccm_agent_cycles_total"):
        return None
    loaded = sum(v for k, v in metrics.items() if k == "ccm_agent_blocks_loaded_total" or k.startswith("ccm_agent_blocks_loaded_total{"))
    return metrics.get("ccm_agent_coverage_ratio", 0.0), int(metrics.get("ccm_agent_hot_set_blocks", 0)), int(loaded)


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
    # With a memory group per node: the page cache charged to each node's group at the kill
    # (after the standby's was dropped, in the arms that drop it), and the agent's page-cache
    # tier's own figure of the standby's share of the primary's (extension 0.9.0).
    primary_page_cache_mb_at_failover: float | None = None
    standby_page_cache_mb_at_failover: float | None = None
    agent_os_cache_coverage: float | None = None
    # Each node's relation files (base/) in the page cache at the kill, as vmtouch counts them.
    primary_files_cached_mb: float | None = None
    standby_files_cached_mb: float | None = None
    # With a memory group per node, the standby's group every second from the measured
    # window to the end, seconds from promotion: [t, *MemorySampler.COLUMNS] in MB.
    standby_memory: list[list[float]] = field(default_factory=list)
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
    # The share of the old primary's own seconds in the pre-failover window at or above 90% of
    # their mean: the per-second noise that a "first second at 90%" figure is read against.
    pre_failover_seconds_at_90pct: float | None = None
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
    kill_wait_s: float = 0.0  # of kill_to_promoted_s: until the old primary's processes were gone
    # Separate budgets (demo/README.md, "Separate budgets"); None/empty without them.
    storage: str = "shared"  # "local", "cloud", or "shared": both nodes on the machine's CPUs and disk, as before
    clients: int = 0
    # The sweep's repetitions (bench/failover_sweep.py --rounds): this run's round, of `rounds`.
    round: int = 1
    rounds: int = 1
    pre_window_s: int = PRE_WINDOW  # the old primary's measured seconds before the kill
    seconds_to_95pct_first: float | None = None
    seconds_to_95pct_stay: float | None = None
    # Settling: from the workload's start on the primary to the first second at which its
    # storage reads per 1000 transactions (and the agent's loads) over --settle-window were at
    # most --settle-reads; None: not by --settle-timeout (the measured window ran anyway).
    settled_after_s: float | None = None
    settle_reads_per_1000: float | None = None  # the primary's, when it settled (or at the timeout)
    settle_agent_loads_per_1000: float | None = None
    prewarm_primary_s: float | None = None  # pg_prewarm of the primary before the workload
    warm_before_window_s: float | None = None  # the workload's seconds before the measured window
    # The old primary's reads in its measured window (pg_stat_io, or blks_read on 15) and
    # what its disk served (the blkio group: requests, bytes; page-cache hits not counted).
    old_primary_reads: int | None = None
    old_primary_device_reads: int | None = None
    old_primary_device_mb: float | None = None
    # The new primary's in its first READS_WINDOW s: pg_stat_io (sampled every second,
    # interpolated at the mark; its backends flush at most once a second) and the disk's.
    new_primary_reads_60s: int | None = None
    new_primary_device_reads_60s: int | None = None
    new_primary_device_mb_60s: float | None = None
    device_reads_after: list[list[float]] = field(default_factory=list)  # [sample time, requests/s, MB/s]
    device_reads_before: list[list[float]] = field(default_factory=list)
    peak_device_iops_after: float | None = None  # what the disk gave: the highest one-second rates
    peak_device_mbps_after: float | None = None
    # CPU used in the measured window before the kill, in cores (cpuacct of each group).
    cpu_cores_primary: float | None = None
    cpu_cores_standby: float | None = None
    cpu_cores_client: float | None = None
    cpu_cores_agent: float | None = None
    cpu_split: str = ""  # e.g. "primary 0, standby 1, client: the serving node's, agent 1"
    # The same in the new primary's first FIRST_WINDOW s (new primary, pgbench, agent).
    cpu_cores_after: list[float] = field(default_factory=list)
    # Fresh connections cost the same on any node: the TPS of the first second of the old
    # primary's measured window (pgbench had just connected), as % of the window's mean; the
    # new primary's first second starts from fresh connections too.
    fresh_connections_first_s_pct: float | None = None
    # What the active client backends waited on (WaitSampler): the old primary's measured
    # window, the new primary's first FIRST_WINDOW s; {wait event or "CPU": share}.
    waits_before: dict[str, float] = field(default_factory=dict)
    waits_after: dict[str, float] = field(default_factory=dict)
    # Where the reads came from (demo/README.md, "Diagnosis"): the blocks the primary cached
    # and the standby lacked at the kill, by relation and the primary's usage count
    # ({relation: [count with usage 0, 1, ..., 5]}), and the blocks the new primary cached by
    # the end of its run that the standby had not had: by relation, split into those the
    # old primary had cached (CCM could have sent them) and those it had not.
    lacked_at_kill: dict[str, list[int]] = field(default_factory=dict)
    loaded_after_cached_before: dict[str, int] = field(default_factory=dict)
    loaded_after_not_cached_before: dict[str, int] = field(default_factory=dict)
    # The same for the page cache (with a memory group per node), in MB by relation: the pages
    # of relation files the primary's page cache held and the standby's lacked at the kill,
    # and those the new primary's held at the end of its run that the standby's had not held
    # at the kill, split into those the old primary's had held and those it had not (new
    # pages the new primary wrote among them).
    os_lacked_at_kill: dict[str, float] = field(default_factory=dict)
    os_loaded_after_held_before: dict[str, float] = field(default_factory=dict)
    os_loaded_after_not_held_before: dict[str, float] = field(default_factory=dict)

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
    tail = before[-result.pre_window_s:]
    result.pre_failover_tps = statistics.mean(tail) if tail else 0.0
    if tail:
        result.pre_failover_seconds_at_90pct = round(
            100.0 * sum(tps >= 0.9 * result.pre_failover_tps for tps in tail) / len(tail), 1)
    # The first second at or above 90% (95%), and the first from which every later second stays there.
    for share, first_field, stay_field in ((0.9, "seconds_to_90pct_first", "seconds_to_90pct_stay"),
                                           (0.95, "seconds_to_95pct_first", "seconds_to_95pct_stay")):
        threshold = share * result.pre_failover_tps
        first, stay = first_and_kept(after_tps, lambda tps: tps >= threshold)
        setattr(result, first_field, round(offset + first, 2) if first is not None else None)
        setattr(result, stay_field, round(offset + stay, 2) if stay is not None else None)
    first10 = after_tps[:FIRST_WINDOW]
    if first10 and result.pre_failover_tps:
        result.first_10s_pct = 100.0 * statistics.mean(first10) / result.pre_failover_tps
    if before and result.pre_failover_tps:  # the workload's first second: pgbench had just connected
        result.fresh_connections_first_s_pct = round(100.0 * before[0] / result.pre_failover_tps, 1)
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
    pre = pooled(before, warm.seconds - result.pre_window_s + 1, warm.seconds)
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


BufferTag = tuple[int, int, int, int, int]  # tablespace, database, relfilenode, fork, block


def buffer_snapshot(node: Node) -> dict[BufferTag, int]:
    """Every buffer the node caches, with its usage count (one pg_buffercache scan)."""
    rows = node.sql("SELECT reltablespace::int8, reldatabase::int8, relfilenode::int8, relforknumber, relblocknumber, "
                    "usagecount FROM pg_buffercache WHERE relfilenode IS NOT NULL")
    return {row[:5]: row[5] for row in rows}


def cache_overlap(primary: dict[BufferTag, int], standby: dict[BufferTag, int]) -> tuple[tuple[float, int], tuple[float, int]]:
    """coverage() of the primary's hot buffers (usage count > HOT_THRESHOLD) and of every
    buffer it caches: (share on the standby, count) each, from both nodes' snapshots."""
    cached = set(primary)
    hot = {tag for tag, usage in primary.items() if usage > HOT_THRESHOLD}
    share = lambda blocks: (len(blocks & standby.keys()) / len(blocks) if blocks else 1.0, len(blocks))  # noqa: E731
    return share(hot), share(cached)


FORK_NAMES = {0: "", 1: " (fsm)", 2: " (vm)", 3: " (init)"}


def relation_names(node: Node) -> Callable[[BufferTag], str]:
    """Names the relation of a buffer tag (its fork too, if not the main one), from the
    node's catalog; a relation of another database, or gone, by its file node."""
    database = node.one("SELECT oid::int8 FROM pg_database WHERE datname = current_database()")
    names = {(0 if shared else database, filenode): name for filenode, name, shared in node.sql(
        "SELECT pg_relation_filenode(oid)::int8, relname, relisshared FROM pg_class "
        "WHERE pg_relation_filenode(oid) IS NOT NULL")}
    databases = dict(node.sql("SELECT oid::int8, datname FROM pg_database"))
    return lambda tag: names.get((tag[1], tag[2]), f"file node {tag[2]} of {databases.get(tag[1], f'database {tag[1]}')}") \
        + FORK_NAMES.get(tag[3], "")


def file_relation_names(node: Node) -> Callable[[str], str]:
    """Names the relation of a data file, "base/<database>/<file node>[_fork][.segment]"."""
    names = relation_names(node)

    def name(path: str) -> str:
        _, database, file = path.split("/")
        stem, _, fork = file.split(".")[0].partition("_")
        return names((0, int(database), int(stem), {"fsm": 1, "vm": 2, "init": 3}.get(fork, 0), 0))
    return name


def page_cache_gaps(primary: pagecache.Residency, standby: pagecache.Residency, new_primary: pagecache.Residency,
                    name: Callable[[str], str]) -> tuple[dict[str, float], dict[str, float]]:
    """The new primary's pages at the end that the standby lacked at the kill, in MB by
    relation: those the old primary held at the kill, and those it did not."""
    loaded = pagecache.only_in(new_primary, standby)
    return (pagecache.mb_by_relation(pagecache.in_both(loaded, primary), name),
            pagecache.mb_by_relation(pagecache.only_in(loaded, primary), name))


def lacked_by_relation(primary: dict[BufferTag, int], standby: dict[BufferTag, int],
                       name: Callable[[BufferTag], str]) -> dict[str, list[int]]:
    """The blocks the primary caches and the standby lacks, per relation, counted by the
    primary's usage count (0 to 5)."""
    lacked: dict[str, list[int]] = {}
    for tag, usage in primary.items():
        if tag not in standby:
            lacked.setdefault(name(tag), [0] * 6)[min(usage, 5)] += 1
    return dict(sorted(lacked.items(), key=lambda item: -sum(item[1])))


def loaded_after(new_primary: dict[BufferTag, int], standby_at_kill: dict[BufferTag, int], old_primary: dict[BufferTag, int],
                 name: Callable[[BufferTag], str]) -> tuple[dict[str, int], dict[str, int]]:
    """The blocks the new primary caches at the end of its run that it (the standby) did not
    cache at the kill, per relation: those the old primary cached at the kill (a cache
    transfer could have sent them), and those it did not (the workload's own new reads, and
    the pages new rows went into)."""
    cached_before: dict[str, int] = {}
    not_cached_before: dict[str, int] = {}
    for tag in new_primary.keys() - standby_at_kill.keys():
        into = cached_before if tag in old_primary else not_cached_before
        into[name(tag)] = into.get(name(tag), 0) + 1
    order = lambda counts: dict(sorted(counts.items(), key=lambda item: -item[1]))  # noqa: E731
    return order(cached_before), order(not_cached_before)


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


class RunBudgets:
    """Separate budgets for one run (demo/README.md, "Separate budgets"): the primary, the
    standby, the pgbench client of each and the agent, each in cgroups of its own, created
    with unique names and removed with the run. Each node gets a CPU set and a blkio group on
    the data directory's disk (throttled on cloud-like storage, counting only on the local
    disk); the client driving a node runs on that node's CPUs, so that the serving node and
    its client have the same share before and after the failover; the agent runs on the
    standby's CPUs, as a sidecar on the standby's host would."""

    def __init__(self, args: argparse.Namespace, storage: Storage, arm: Arm, base: Path, node_memory: str | None = None):
        device = data_device(base)
        if device is None:
            raise RuntimeError(f"{base} is not on a block device: separate budgets need one to throttle and count reads")
        primary_cpus, standby_cpus = args.node_cpus
        node = lambda cpus: Budget(cpus=cpus, read_iops=storage.read_iops, read_mbps=storage.read_mbps,  # noqa: E731
                                   memory=arm.node_memory or node_memory)
        self.groups: list[NodeCgroups] = []
        self.primary = self._add("pg_ccm-primary", node(primary_cpus), device)
        self.standby = self._add("pg_ccm-standby", node(standby_cpus), device)
        client = lambda cpus: Budget(cpus=args.client_cpus or cpus)  # noqa: E731
        self.client_of = {"primary": self._add("pg_ccm-client-p", client(primary_cpus), None),
                          "standby": self._add("pg_ccm-client-s", client(standby_cpus), None)}
        self.agent = self._add("pg_ccm-agent", Budget(cpus=args.agent_cpus or standby_cpus), None)
        self.split = (f"primary on CPU {primary_cpus}, standby on CPU {standby_cpus}, pgbench on "
                      f"{'CPU ' + args.client_cpus if args.client_cpus else 'the CPU of the node it drives'}, "
                      f"ccm-agent on CPU {args.agent_cpus or standby_cpus}")

    def _add(self, label: str, budget: Budget, device: str | None) -> NodeCgroups:
        try:
            group = NodeCgroups(label, budget, device)
        except BaseException:
            self.remove()
            raise
        self.groups.append(group)
        return group

    def cpu_seconds(self) -> dict[str, float]:
        return {"primary": self.primary.cpu_seconds(), "standby": self.standby.cpu_seconds(),
                "client": sum(g.cpu_seconds() for g in self.client_of.values()), "agent": self.agent.cpu_seconds()}

    def remove(self) -> None:
        for group in getattr(self, "groups", []):
            group.remove()


def files_cached_mb(node: Node, directory: str = "base") -> float:
    """MB of the node's files under `directory` (relation files: base/) in the OS page cache,
    as vmtouch counts them."""
    out = subprocess.run(["vmtouch", str(node.datadir / directory)], capture_output=True, text=True, check=True).stdout
    found = re.search(r"Resident Pages: (\d+)/", out)
    return int(found[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20 if found else 0.0


class MemorySampler(Sampler):
    """What fills a node's memory group, every second: memory.stat's page cache (`cache`:
    files and shared memory), its shared memory (shared_buffers), the file pages on the
    kernel's active and inactive lists, the pages uncharged so far (`pgpgout`: evicted or
    freed), and of the page cache the node's relation files (base/) and its WAL (pg_wal/),
    by vmtouch. So a run shows what was cached at the kill and what made room after it."""

    COLUMNS = ("cache", "shmem", "active_file", "inactive_file", "base", "pg_wal", "pgpgout")

    def __init__(self, node: Node, group: MemoryCgroup):
        self.node, self.group = node, group
        super().__init__(f"memory sampler on {node.name}", self._probe)

    def _probe(self, _handle: object) -> tuple[float, ...]:
        stat = self.group.stat()
        mb = lambda key: round(stat.get(key, 0) / 2**20, 1)  # noqa: E731
        return (mb("cache"), mb("shmem"), mb("active_file"), mb("inactive_file"), round(files_cached_mb(self.node), 1),
                round(files_cached_mb(self.node, "pg_wal"), 1), round(stat.get("pgpgout", 0) * 4096 / 2**20, 1))

    def series(self, origin: float) -> list[list[float]]:
        return [[round(at - origin, 2), *values] for at, values in self.samples]

    def near(self, moment: float) -> dict[str, float] | None:
        """The sample closest to `moment`, by column name."""
        if not self.samples:
            return None
        _, values = min(self.samples, key=lambda sample: abs(sample[0] - moment))
        return dict(zip(self.COLUMNS, values))


def prewarm_primary(primary: Node, page_cache: bool = False) -> float:
    """pg_prewarm of the pgbench relations, smallest first, as long as they fit in 90% of
    shared_buffers: the old primary starts near its steady state instead of warming from
    storage for minutes (a primary that has run for days caches its working set). With
    `page_cache`, the relations that did not fit are read into its page cache (pg_prewarm's
    'read' mode). Returns the seconds it took."""
    started = time.monotonic()
    primary.sql("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
    room = primary.one("SELECT setting::int8 * 9 / 10 FROM pg_settings WHERE name = 'shared_buffers'")
    relations = primary.sql("SELECT c.oid::regclass::text, pg_relation_size(c.oid) / 8192 FROM pg_class c "
                            "WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'i') "
                            "ORDER BY pg_relation_size(c.oid)")
    for relation, blocks in relations:
        if blocks > room:
            if page_cache:
                primary.sql("SELECT pg_prewarm(%s::regclass, 'read')", [relation])
                continue
            break
        primary.sql("SELECT pg_prewarm(%s::regclass)", [relation])
        room -= blocks
    return time.monotonic() - started


def settle(primary_reads: ReadSampler, warm: Workload, progress: Sampler | None, args: argparse.Namespace,
           result: RunResult, tag: str, least: float, device: bool = False) -> None:
    """Waits until the old primary is at its steady state: over the last --settle-window
    seconds its storage reads (pg_stat_io's; blks_read on 15; with `device`, the read requests
    its disk served, from its blkio group, when its page cache is part of its cache and
    PostgreSQL's counters count its hits as reads) were at most --settle-reads per 1000
    transactions, and so were the blocks the agent loaded into the standby (CCM arms; not with
    `device`: a working set larger than shared_buffers keeps the primary's buffers changing,
    and the agent follows them at a steady rate that never falls to zero), and the workload
    has run `least` seconds. Records when; gives up at --settle-timeout (the run
    goes on, and says so)."""
    window, limit = args.settle_window, args.settle_reads
    column = ReadSampler.IO_READS if primary_reads.io else ReadSampler.BLKS_READ
    if device:
        column = ReadSampler.DEVICE_READS

    def per_1000(value: float | None) -> float | None:
        transactions = sum(warm.tps[-window:])
        return None if value is None or len(warm.tps) < window or not transactions else 1000 * value / transactions

    def agent_loads() -> float | None:
        seen = [(at, sample[2]) for at, sample in progress.samples if sample is not None] if progress else []
        if not seen or seen[-1][0] - seen[0][0] < window:
            return None
        start = next(loaded for at, loaded in reversed(seen) if at <= seen[-1][0] - window)
        return seen[-1][1] - start

    def settled() -> bool:
        result.settle_reads_per_1000 = per_1000(primary_reads.over(window, column))
        result.settle_agent_loads_per_1000 = per_1000(agent_loads()) if progress else None
        if len(warm.tps) < least or result.settle_reads_per_1000 is None:
            return False
        agent_counts = progress is not None and not device
        if agent_counts and (result.settle_agent_loads_per_1000 is None or result.settle_agent_loads_per_1000 > limit):
            return False
        return result.settle_reads_per_1000 <= limit

    def abort() -> str | None:
        return f"pgbench on the primary exited: {warm.other_lines[-3:]}" if warm.process.poll() is not None else None

    try:
        wait_for("the old primary's steady state", settled, timeout=args.settle_timeout, interval=1.0, abort=abort)
        result.settled_after_s = round(time.monotonic() - warm.started, 1)
        say(f"{tag} steady state after {result.settled_after_s:.0f} s of workload: "
            f"{fmt_rate(result.settle_reads_per_1000)} reads per 1000 transactions over the last {window} s"
            + (f", agent {fmt_rate(result.settle_agent_loads_per_1000)} loads per 1000" if progress else ""))
    except TimeoutError:
        say(f"{tag} NOT settled within {args.settle_timeout} s ({fmt_rate(result.settle_reads_per_1000)} reads per "
            f"1000 transactions; agent {fmt_rate(result.settle_agent_loads_per_1000)}): measuring anyway")


def run_once(scenario: Scenario, template: Path, arm: Arm, args: argparse.Namespace, workdir: Path,
             storage: Storage | None = None, clients: int | None = None, warm_at_least: float = 0) -> RunResult:
    """One failover. With separate budgets (`storage` given: args.separate_budgets), every
    node and program runs in cgroups of its own, the primary is brought to its steady state
    before a measured window of --pre-seconds, and the reads are also counted at the disk.
    `warm_at_least`: seconds the workload runs before that window at least (the callers pass
    the longest of the arms compared before, so that no standby without CCM replays for less
    time than a CCM arm's did: a shorter warm-up would leave it colder)."""
    clients = clients or args.clients
    label = f"{scenario.name} / {arm.name}" + (f" / {storage.name} / {clients} clients" if storage else "")
    tag = f"[{label}]"
    result = RunResult(scenario=scenario.name, mode=arm.name, postgresql=pg_version_text(), fill_room=arm.fill_room,
                       storage=storage.name if storage else "shared", clients=clients,
                       pre_window_s=args.pre_seconds if storage else PRE_WINDOW)
    slug = arm.slug + (f"-{storage.name}-{clients}" if storage else "")
    cluster = Cluster(settings=scenario.settings(args), base=workdir / f"{scenario.name}-{slug}", keep=args.keep)
    budgets: RunBudgets | None = None
    agent: AgentProcess | None = None
    workloads: list[Workload] = []
    samplers: list[Sampler] = []
    try:
        if storage is not None:
            budgets = RunBudgets(args, storage, arm, cluster.base, scenario.node_memory)
            cluster.primary.wrapper, cluster.standby.wrapper = budgets.primary.wrapper, budgets.standby.wrapper
            result.cpu_split = budgets.split
            say(f"{tag} separate budgets: {budgets.split}; {storage.description}")
        client_on = lambda node: budgets.client_of[node].wrapper if budgets else None  # noqa: E731
        say(f"{tag} primary from the data set, streaming standby cloned from it (pg_basebackup)")
        cluster.create(template=template)
        primary, standby = cluster.primary, cluster.standby
        io = has_pg_stat_io(primary)
        say(f"{tag} standby made cold: restartpoint, restart, its files dropped from the OS page cache")
        cluster.make_standby_cold()
        if storage is not None:
            # The primary's files were just copied, so the OS caches them: drop them, so that
            # its reads until it settles are real reads of its own (throttled) disk.
            primary.drop_os_cache()
            if args.prewarm_primary:
                result.prewarm_primary_s = round(prewarm_primary(primary, page_cache=scenario.node_memory is not None), 1)
                say(f"{tag} primary prewarmed (pg_prewarm of the pgbench relations that fit) in {result.prewarm_primary_s:.0f} s")
        if arm.agent_args is not None:
            launcher = [*DIE_WITH_US, *(budgets.agent.wrapper if budgets else [])]
            agent = AgentProcess(cluster.both_nodes_conninfo("read-write"), cluster.both_nodes_conninfo("standby"), cluster.base,
                                 interval=args.agent_interval, extra=list(arm.agent_args), launcher=launcher)
            agent_started = time.monotonic()
            agent.start()
            samplers.append(progress := Sampler("ccm-agent metrics", lambda _: agent_progress(agent), interval=0.5))
            say(f"{tag} ccm-agent running (every {args.agent_interval}{''.join(' ' + a for a in arm.agent_args)}; "
                f"metrics on 127.0.0.1:{agent.metrics_port})")

        samplers.append(sampler := ReadSampler(primary, io, budgets.primary if budgets else None))
        if storage is not None:
            say(f"{tag} Aurora's CCM-test workload on the primary, {clients} clients, until its storage reads settle "
                f"(at most {args.settle_timeout} s)")
            workloads.append(settling := Workload(primary, scenario, clients, args.settle_timeout + args.warm_seconds,
                                                  "primary (settling)", launcher=client_on("primary")))
            settle(sampler, settling, progress if agent is not None else None, args, result, tag,
                   least=max(args.warm_seconds, warm_at_least), device=scenario.node_memory is not None)
            result.warm_before_window_s = round(time.monotonic() - settling.started, 1)
            settling.stop()
            say(f"{tag} measured window: the same workload for {args.pre_seconds} s")
            before_reads, before_device = storage_reads(primary, io), budgets.primary.reads()
            before_cpu = budgets.cpu_seconds()
            window_started = time.monotonic()
            samplers.append(waits_before := WaitSampler(primary))
            if budgets.standby.memory is not None:
                samplers.append(memory := MemorySampler(standby, budgets.standby.memory))
            workloads.append(warm := Workload(primary, scenario, clients, args.pre_seconds, "primary    ",
                                              log_dir=cluster.base / "pgbench-primary", launcher=client_on("primary")))
        else:
            say(f"{tag} Aurora's CCM-test workload on the primary for {args.warm_seconds} s, {clients} clients")
            workloads.append(warm := Workload(primary, scenario, clients, args.warm_seconds, "primary    ",
                                              log_dir=cluster.base / "pgbench-primary"))
        warm.wait()
        if budgets is not None:
            waits_before.stop()
            result.waits_before = waits_before.shares(window_started, time.monotonic())
            elapsed = time.monotonic() - window_started
            result.cpu_cores_primary, result.cpu_cores_standby, result.cpu_cores_client, result.cpu_cores_agent = (
                round((after - before_cpu[key]) / elapsed, 2) for key, after in budgets.cpu_seconds().items())
            device = budgets.primary.reads()
            result.old_primary_device_reads = device[0] - before_device[0]
            result.old_primary_device_mb = round((device[1] - before_device[1]) / 2**20, 1)
        sampler.stop()
        if agent is not None:
            progress.stop()  # "kept while the workload ran": later scans see a hot set that no longer grows

        snapshot_primary, snapshot_standby = buffer_snapshot(primary), buffer_snapshot(standby)
        name = relation_names(primary)
        (result.coverage_at_failover, result.hot_buffers_at_failover), \
            (result.cached_coverage_at_failover, result.cached_buffers_at_failover) = cache_overlap(snapshot_primary, snapshot_standby)
        result.lacked_at_kill = lacked_by_relation(snapshot_primary, snapshot_standby, name)
        if budgets is not None:
            # Read after the clients disconnected and the snapshots: every backend has flushed.
            blocks, io_reads = storage_reads(primary, io)
            result.old_primary_reads = (io_reads - before_reads[1]) if io_reads is not None else blocks - before_reads[0]
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

        if arm.drop_standby_page_cache:
            say(f"{tag} separate hosts: dropping the standby's files from the OS page cache (sync + vmtouch -e)")
            standby.drop_os_cache()
        if agent is not None:
            result.agent_os_cache_coverage = agent.metric("ccm_agent_os_cache_coverage_ratio", -1.0)
            if result.agent_os_cache_coverage < 0:
                result.agent_os_cache_coverage = None
        pages_primary = pages_standby = None
        if scenario.node_memory is not None:
            result.primary_files_cached_mb = files_cached_mb(primary)
            result.standby_files_cached_mb = files_cached_mb(standby)
            file_name = file_relation_names(primary)
            pages_primary = pagecache.snapshot(primary.datadir)
            pages_standby = pagecache.snapshot(standby.datadir)
            result.os_lacked_at_kill = pagecache.mb_by_relation(pagecache.only_in(pages_primary, pages_standby), file_name)
            say(f"{tag} relation-file pages the primary's page cache held and the standby's lacked at the kill: "
                f"{fmt_mb_relations(result.os_lacked_at_kill)}")
            say(f"{tag} relation files in the page cache at the kill (vmtouch base/): primary "
                f"{result.primary_files_cached_mb:.0f} MB, standby {result.standby_files_cached_mb:.0f} MB")
        if budgets is not None and budgets.standby.memory is not None and budgets.primary.memory is not None:
            result.primary_page_cache_mb_at_failover = round(budgets.primary.memory.page_cache_mb())
            result.standby_page_cache_mb_at_failover = round(budgets.standby.memory.page_cache_mb())
            say(f"{tag} page cache at the kill: primary {result.primary_page_cache_mb_at_failover} MB, standby "
                f"{result.standby_page_cache_mb_at_failover} MB (charged to each node's memory group)"
                + (f"; the agent's page-cache tier saw the standby hold {result.agent_os_cache_coverage:.1%} of the primary's"
                   if result.agent_os_cache_coverage is not None else ""))
        # Read before the kill, so that the workload starts right after the promotion: the kill
        # and the promotion add nothing (recovery's reads are counted in neither figure).
        blocks_at_promotion, io_reads_at_promotion = storage_reads(standby, io)
        device_at_promotion = budgets.standby.reads() if budgets else None
        say(f"{tag} FAILOVER: SIGKILL of the primary's postmaster, pg_ctl promote of the standby")
        killed = time.monotonic()
        primary.kill()
        # The harness waits until the old primary's processes are gone (a backend busy in a
        # query notices the postmaster's death only when it next waits); a real standby does not.
        result.kill_wait_s = round(time.monotonic() - killed, 3)
        standby.promote()
        promoted = time.monotonic()
        workloads.append(after := Workload(standby, scenario, clients, args.after_seconds, "new primary",
                                           log_dir=cluster.base / "pgbench-new-primary", launcher=client_on("standby")))
        samplers.append(sampler_after := ReadSampler(standby, io, budgets.standby if budgets else None))
        if budgets is not None:
            samplers.append(waits_after := WaitSampler(standby))
            cpu_at_promotion = budgets.cpu_seconds()
            cpu_after: dict[str, float] = {}
            cpu_timer = threading.Timer(promoted + FIRST_WINDOW - time.monotonic(), lambda: cpu_after.update(budgets.cpu_seconds()))
            cpu_timer.daemon = True
            cpu_timer.start()
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
        if budgets is not None and budgets.standby.memory is not None:
            memory.stop()
            result.standby_memory = memory.series(promoted)
            for label, moment in (("at the kill", killed), ("10 s after promotion", promoted + FIRST_WINDOW),
                                  ("at the end", time.monotonic())):
                if (sample := memory.near(moment)) is not None:
                    say(f"{tag} standby's memory group {label}: " + ", ".join(f"{k} {v:.0f} MB" for k, v in sample.items()))
        time.sleep(1.5)  # backends flush their statistics when they exit
        blocks_at_end, io_reads_at_end = storage_reads(standby, io)
        result.blocks_read_after = blocks_at_end - blocks_at_promotion
        if io_reads_at_end is not None and io_reads_at_promotion is not None:
            result.io_blocks_read_after = io_reads_at_end - io_reads_at_promotion
        result.blocks_read_window_s = args.after_seconds
        if storage is not None:
            cpu_timer.join()
            waits_after.stop()
            result.waits_after = waits_after.shares(promoted, promoted + FIRST_WINDOW)
            if cpu_after:
                result.cpu_cores_after = [round((cpu_after[key] - cpu_at_promotion[key]) / FIRST_WINDOW, 2)
                                          for key in ("standby", "client", "agent")]
            mark = promoted + READS_WINDOW
            column = ReadSampler.IO_READS if io else ReadSampler.BLKS_READ
            reads_60 = sampler_after.at(mark, column)
            requests, read_bytes = (sampler_after.at(mark, c) for c in (ReadSampler.DEVICE_READS, ReadSampler.DEVICE_BYTES))
            if reads_60 is None and args.after_seconds <= READS_WINDOW:
                # The workload ended before the samples reached the mark: the whole run is
                # inside the window, and the figures read after it are exact.
                reads_60 = io_reads_at_end if io else blocks_at_end
                requests, read_bytes = budgets.standby.reads()
            base = io_reads_at_promotion if io else blocks_at_promotion
            result.new_primary_reads_60s = round(reads_60 - base) if reads_60 is not None else None
            if requests is not None:
                result.new_primary_device_reads_60s = round(requests - device_at_promotion[0])
                result.new_primary_device_mb_60s = round((read_bytes - device_at_promotion[1]) / 2**20, 1)
            for target, reads in ((result.device_reads_before, sampler), (result.device_reads_after, sampler_after)):
                target += [[t, r, round(b / 2**20, 2)] for (t, r), (_, b) in
                           zip(reads.rates(promoted, ReadSampler.DEVICE_READS), reads.rates(promoted, ReadSampler.DEVICE_BYTES))]
            result.peak_device_iops_after = max((r for _, r, _ in result.device_reads_after), default=None)
            result.peak_device_mbps_after = max((m for _, _, m in result.device_reads_after), default=None)
        result.loaded_after_cached_before, result.loaded_after_not_cached_before = loaded_after(
            buffer_snapshot(standby), snapshot_standby, snapshot_primary, name)
        del snapshot_primary, snapshot_standby
        if pages_primary is not None:
            result.os_loaded_after_held_before, result.os_loaded_after_not_held_before = page_cache_gaps(
                pages_primary, pages_standby, pagecache.snapshot(standby.datadir), file_name)
            say(f"{tag} relation-file pages in the new primary's page cache at the end that the standby's lacked "
                f"at the kill: the old primary's held {fmt_mb_relations(result.os_loaded_after_held_before)}; "
                f"it did not {fmt_mb_relations(result.os_loaded_after_not_held_before)}")
            del pages_primary, pages_standby

        result.tps_before = [[round(warm.started + k - promoted, 2), tps] for k, tps in enumerate(warm.tps, 1)]
        result.tps_after = [[round(after.started + k - promoted, 2), tps] for k, tps in enumerate(after.tps, 1)]
        result.reads_before = [list(p) for p in sampler.rates(promoted)]
        result.reads_after = [list(p) for p in sampler_after.rates(promoted)]
        result.io_reads_before = [list(p) for p in sampler.io_rates(promoted)]
        result.io_reads_after = [list(p) for p in sampler_after.io_rates(promoted)]
        load_ended = result.tps_before[-1][0] if result.tps_before else result.kill_at
        result.fpi_before = [list(p) for p in sampler.fpi_rates(promoted)]
        result.fpi_after = [list(p) for p in sampler_after.fpi_rates(promoted)]
        window = result.pre_window_s
        result.pre_failover_reads_per_s = mean_rate(result.reads_before, load_ended - window, load_ended + 1)
        if io:
            result.pre_failover_io_reads_per_s = mean_rate(result.io_reads_before, load_ended - window, load_ended + 1)
        result.pre_failover_fpi_per_s = mean_rate(result.fpi_before, load_ended - window, load_ended + 1)
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
                rejoin(cluster, scenario, args, result, tag, slot, client_on("standby"), clients)
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
            if budgets is not None:
                budgets.remove()


def rejoin(cluster: Cluster, scenario: Scenario, args: argparse.Namespace, result: RunResult, tag: str, slot: str,
           launcher: list[str] | None, clients: int) -> None:
    """The killed primary comes back as a standby of the new one (pg_rewind); the agent,
    neither restarted nor reconfigured, finds it and warms it."""
    old_primary, new_primary = cluster.primary, cluster.standby
    say(f"{tag} epilogue: the old primary rejoins as a standby of the new one (pg_rewind); the running agent finds it")
    cluster.rejoin_as_standby(old_primary, new_primary, slot=slot)
    cluster.primary, cluster.standby = new_primary, old_primary
    cluster.wait_caught_up()
    load = Workload(new_primary, scenario, clients, REJOIN_TIMEOUT + 5, "new primary", launcher=launcher)
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


def fmt_lacked(lacked: dict[str, list[int]], top: int = 3) -> str:
    """"12,345: pgbench_accounts 12,000 (hot 300), ..." for the relations with the most."""
    total = sum(sum(counts) for counts in lacked.values())
    if not total:
        return "0"
    parts = [f"{name} {sum(counts):,} (hot {sum(counts[HOT_THRESHOLD + 1:]):,})" for name, counts in list(lacked.items())[:top]]
    return f"{total:,}: " + ", ".join(parts)


def fmt_mb_relations(mb: dict[str, float], top: int = 3) -> str:
    """"12.3 MB: pgbench_accounts 10.0, ..." for the relations with the most."""
    total = sum(mb.values())
    return f"{total:,.1f} MB" + (": " + ", ".join(f"{name} {n:,.1f}" for name, n in list(mb.items())[:top]) if total else "")


def fmt_relations(counts: dict[str, int], top: int = 3) -> str:
    total = sum(counts.values())
    return f"{total:,}" + (": " + ", ".join(f"{name} {n:,}" for name, n in list(counts.items())[:top]) if total else "")


def fair_rows(runs: list[RunResult]) -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    """The rows only runs with separate budgets have: how the old primary got to its steady
    state and what its disk served, and what the new primary's disk served."""
    window = runs[0].pre_window_s
    before = [
        ("  primary settled after (workload seconds; reads per 1000 transactions then)",
         [f"{r.settled_after_s:.0f} s ({fmt_rate(r.settle_reads_per_1000)})" if r.settled_after_s is not None
          else f"NOT settled ({fmt_rate(r.settle_reads_per_1000)})" for r in runs]),
        ("  workload on the primary before the measured window (at least the arms' before it), s",
         [fmt_count(r.warm_before_window_s) for r in runs]),
        ("  primary prewarmed first (pg_prewarm), s", [fmt_count(r.prewarm_primary_s) for r in runs]),
        (f"  old primary's storage reads in its last {window} s (pg_stat_io; blks_read on 15)", [fmt_count(r.old_primary_reads) for r in runs]),
        (f"  old primary's disk reads in its last {window} s (blkio: requests / MB)",
         [f"{fmt_count(r.old_primary_device_reads)} / {fmt_count(r.old_primary_device_mb)}" for r in runs]),
        ("  CPU cores used in those seconds: primary / standby / pgbench / agent",
         [f"{fmt_rate(r.cpu_cores_primary)} / {fmt_rate(r.cpu_cores_standby)} / {fmt_rate(r.cpu_cores_client)} / "
          f"{fmt_rate(r.cpu_cores_agent)}" for r in runs]),
        ("  TPS in the first second of those (pgbench just connected), % of their mean",
         [fmt_pct(r.fresh_connections_first_s_pct) for r in runs]),
        ("blocks the primary cached and the standby lacked at the kill (top relations; hot: usage > 3)",
         [fmt_lacked(r.lacked_at_kill) for r in runs]),
        ("relation-file pages the primary's page cache held and the standby's lacked at the kill",
         [fmt_mb_relations(r.os_lacked_at_kill) if r.os_lacked_at_kill or r.primary_files_cached_mb is not None else "-"
          for r in runs]),
    ]
    after = [
        (f"storage reads of the new primary, first {READS_WINDOW} s (pg_stat_io, sampled; blks_read on 15)",
         [fmt_count(r.new_primary_reads_60s) for r in runs]),
        (f"  disk reads of the new primary, first {READS_WINDOW} s (blkio: requests / MB)",
         [f"{fmt_count(r.new_primary_device_reads_60s)} / {fmt_count(r.new_primary_device_mb_60s)}" for r in runs]),
        ("  what the disk gave: highest one-second requests / MB per second after promotion",
         [f"{fmt_count(r.peak_device_iops_after)} / {fmt_count(r.peak_device_mbps_after)}" for r in runs]),
        (f"CPU cores used in the first {FIRST_WINDOW} s after promotion: new primary / pgbench / agent",
         [" / ".join(fmt_rate(c) for c in r.cpu_cores_after) or "-" for r in runs]),
        ("what active backends waited on: old primary, measured window (CPU: running or runnable)",
         [fmt_waits(r.waits_before) for r in runs]),
        (f"  ... new primary, first {FIRST_WINDOW} s", [fmt_waits(r.waits_after) for r in runs]),
    ]
    return before, after


def table_rows(runs: list[RunResult], args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    reads_before, reads_after = reads_rows(runs)
    fair = all(r.storage != "shared" for r in runs)
    fair_before, fair_after = fair_rows(runs) if fair else ([], [])
    agent = any(r.fill_room is not None for r in runs)
    window = runs[0].pre_window_s
    rows = [
        (f"pre-failover TPS (mean of the last {window} s before the kill)",
         [f"{r.pre_failover_tps:.0f}" for r in runs]),
        ("  latency p50 / p99 in those seconds, ms",
         [fmt_latency((r.pre_failover_p50_ms, r.pre_failover_p99_ms)) for r in runs]),
        *reads_before,
        *fair_before,
        (f"coverage at failover (primary's hot buffers, usage > {HOT_THRESHOLD}, on the standby)",
         [f"{r.coverage_at_failover:.1%}" for r in runs]),
        ("  hot buffers on the primary at failover", [f"{r.hot_buffers_at_failover}" for r in runs]),
        ("  share of all the buffers the primary caches (any usage count)", [f"{r.cached_coverage_at_failover:.1%}" for r in runs]),
        ("  buffers the primary caches at failover", [f"{r.cached_buffers_at_failover}" for r in runs]),
    ]
    if any(r.standby_page_cache_mb_at_failover is not None for r in runs):
        rows += [
            ("page cache at the kill, MB (primary / standby, each node's memory group)",
             [f"{fmt_count(r.primary_page_cache_mb_at_failover)} / {fmt_count(r.standby_page_cache_mb_at_failover)}"
              for r in runs]),
            ("  of it relation files (base/, vmtouch), MB (primary / standby)",
             [f"{fmt_count(r.primary_files_cached_mb)} / {fmt_count(r.standby_files_cached_mb)}" for r in runs]),
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
        ("  of which the harness waited for the old primary's processes to exit", [f"{r.kill_wait_s:.2f} s" for r in runs]),
        ("time from promotion to 90% of pre-failover TPS: first reached",
         [fmt_seconds(r.seconds_to_90pct_first, args.after_seconds) for r in runs]),
        ("time from promotion to 90% of pre-failover TPS: reached and kept",
         [fmt_seconds(r.seconds_to_90pct_stay, args.after_seconds) for r in runs]),
        ("  the old primary's own seconds at >= 90% of its pre-failover TPS (per-second noise)",
         [fmt_pct(r.pre_failover_seconds_at_90pct) for r in runs]),
    ]
    if fair:
        rows += [
            ("time from promotion to 95% of pre-failover TPS: first reached / reached and kept",
             [f"{fmt_seconds(r.seconds_to_95pct_first, args.after_seconds)} / {fmt_seconds(r.seconds_to_95pct_stay, args.after_seconds)}"
              for r in runs]),
        ]
    rows += [
        (f"TPS in the first {FIRST_WINDOW} s after promotion, % of pre-failover", [fmt_pct(r.first_10s_pct) for r in runs]),
        (f"latency p50 / p99 in the first {FIRST_WINDOW} s after promotion, ms",
         [fmt_latency((r.first_10s_p50_ms, r.first_10s_p99_ms)) for r in runs]),
        ("  worst one-second p99 after promotion, ms", [fmt_ms(r.worst_p99_after_ms) for r in runs]),
        (f"time from promotion to p99 <= {LATENCY_FACTOR:.0f}x pre-failover p99: first reached",
         [fmt_seconds(r.seconds_to_p99_2x_first, args.after_seconds) for r in runs]),
        (f"time from promotion to p99 <= {LATENCY_FACTOR:.0f}x pre-failover p99: reached and kept",
         [fmt_seconds(r.seconds_to_p99_2x_stay, args.after_seconds) for r in runs]),
        *fair_after,
        *reads_after,
        ("blocks the new primary cached by the end that the standby lacked: the old primary had cached them",
         [fmt_relations(r.loaded_after_cached_before) for r in runs]),
        ("  ... the old primary had not cached them (the workload's own new reads, and new pages)",
         [fmt_relations(r.loaded_after_not_cached_before) for r in runs]),
        ("relation-file pages in the new primary's page cache at the end that the standby's lacked at the kill: "
         "the old primary's page cache held them",
         [fmt_mb_relations(r.os_loaded_after_held_before) if r.primary_files_cached_mb is not None else "-" for r in runs]),
        ("  ... the old primary's did not (the workload's own new reads, and new pages)",
         [fmt_mb_relations(r.os_loaded_after_not_held_before) if r.primary_files_cached_mb is not None else "-"
          for r in runs]),
        (f"full-page images written per second: old primary, last {window} s", [fmt_count(r.pre_failover_fpi_per_s) for r in runs]),
        (f"full-page images written per second: new primary, first {FIRST_WINDOW} s", [fmt_count(r.first_10s_fpi_per_s) for r in runs]),
        (f"new primary's TPS, last {PRE_WINDOW} s of the run", [fmt_count(r.post_failover_steady_tps) for r in runs]),
    ]
    if any(r.rejoin_coverage is not None or r.rejoin_error for r in runs):
        rows.append(("epilogue: rejoined old primary's coverage of the new primary's hot set", [
            f"{r.rejoin_coverage:.1%} in {r.rejoin_seconds:.0f} s" if r.rejoin_coverage is not None
            else ("failed" if r.rejoin_error else "-") for r in runs]))
    return rows


# The targets of a comparison with separate budgets (issue 28), checked for every CCM run.
TARGET_FAIR_TPS, TARGET_FAIR_READS = 0.95, 0.01


def fair_targets(run: RunResult, checks: dict[str, object], args: argparse.Namespace) -> list[tuple[str, str, bool, str]]:
    """TPS >= 95% of the pre-failover figure from the first full second after promotion and
    kept; p99 within 2x the pre-failover p99 throughout; the new primary's storage reads in
    its first 60 s <= 1% of the run without CCM. Each names the cause when it is missed."""
    first_second = round(run.promotion_to_workload_s + 1, 2)
    kept = run.seconds_to_95pct_stay
    p99_kept = run.seconds_to_p99_2x_stay
    targets = [
        ("tps_95pct_from_first_second", f"TPS >= {TARGET_FAIR_TPS:.0%} of pre-failover from the first full second after "
         "promotion, and kept", kept is not None and kept <= first_second,
         f"kept from {fmt_seconds(kept, args.after_seconds)}" if kept is not None else f"not kept within {args.after_seconds} s"),
        ("p99_2x_throughout", f"p99 <= {LATENCY_FACTOR:.0f}x the pre-failover p99 in every second after promotion",
         p99_kept is not None and p99_kept <= first_second,
         (f"within from {fmt_seconds(p99_kept, args.after_seconds)}" if p99_kept is not None
          else f"not within for good in {args.after_seconds} s") + f"; worst {fmt_ms(run.worst_p99_after_ms)} ms "
         f"against {fmt_ms(run.pre_failover_p99_ms)} ms before"),
    ]
    if "storage_read_ratio_60s" in checks:
        ratio = float(checks["storage_read_ratio_60s"])  # type: ignore[arg-type]
        targets.append(("reads_1pct_60s", f"storage reads in the first {READS_WINDOW} s <= {TARGET_FAIR_READS:.0%} of the "
                        "run without CCM", ratio <= TARGET_FAIR_READS, f"{ratio:.2%}"))
    return targets


def cause(run: RunResult) -> str:
    """What the measurements say about a missed target: coverage, what the standby lacked,
    what the new primary read that the old one had and had not cached."""
    could = sum(run.loaded_after_cached_before.values())
    never = sum(run.loaded_after_not_cached_before.values())
    return (f"coverage at the kill {run.coverage_at_failover:.1%} of the hot set, {run.cached_coverage_at_failover:.1%} of "
            f"all {run.cached_buffers_at_failover:,} cached buffers; the standby lacked {fmt_lacked(run.lacked_at_kill)}; "
            f"after promotion the new primary cached {could:,} blocks the old primary had cached (a transfer could "
            f"have sent them) and {never:,} it had not; full-page images per second {fmt_count(run.first_10s_fpi_per_s)} "
            f"in the first {FIRST_WINDOW} s against {fmt_count(run.pre_failover_fpi_per_s)} before (promotion's checkpoint: "
            f"the first change of a page after it, and with checksums or wal_log_hints the first hint bit set on it, "
            f"writes the whole page to WAL); the old primary's own first second from fresh connections ran at "
            f"{fmt_pct(run.fresh_connections_first_s_pct)} of its mean (the new primary's clients connect afresh too); "
            f"CPU cores in the new primary's first {FIRST_WINDOW} s (node / pgbench / agent): "
            f"{' / '.join(fmt_rate(c) for c in run.cpu_cores_after) or '-'}; its active backends waited on "
            f"{fmt_waits(run.waits_after)} (the old primary's: {fmt_waits(run.waits_before)})")


def check_targets(run: RunResult, without: RunResult | None, args: argparse.Namespace, prefix: str) -> dict[str, object]:
    """Prints the read ratio against the run without CCM and the project's targets for one
    CCM run; returns them."""
    checks: dict[str, object] = {}
    if without is not None:
        read_ratios(run, without, checks)
        if run.new_primary_reads_60s is not None and without.new_primary_reads_60s:
            checks["storage_read_ratio_60s"] = run.new_primary_reads_60s / without.new_primary_reads_60s
            print(f"storage reads by the new primary in its first {READS_WINDOW} s, {run.mode} / {without.mode}: "
                  f"{run.new_primary_reads_60s} / {without.new_primary_reads_60s} = {checks['storage_read_ratio_60s']:.2%}")
        if run.new_primary_device_reads_60s is not None and without.new_primary_device_reads_60s:
            checks["device_read_ratio_60s"] = run.new_primary_device_reads_60s / without.new_primary_device_reads_60s
            print(f"disk read requests (blkio) of the new primary in its first {READS_WINDOW} s, {run.mode} / {without.mode}: "
                  f"{run.new_primary_device_reads_60s} / {without.new_primary_device_reads_60s} = {checks['device_read_ratio_60s']:.2%}")
    if run.storage != "shared":
        targets = fair_targets(run, checks, args)
        if run.blocks_read_window_s < READS_WINDOW:
            print(f"(the read figures cover the whole {run.blocks_read_window_s} s run, not {READS_WINDOW} s: --after-seconds)")
    else:
        first = run.seconds_to_90pct_first
        targets = [
            ("tps_90pct_within_2s", f"with CCM, >= 90% of pre-failover TPS within {TARGET_SECONDS:.0f} s of promotion",
             first is not None and round(first, 1) <= TARGET_SECONDS, fmt_seconds(first, args.after_seconds)),
        ]
    targets.append(("coverage_99pct", f"coverage at failover >= {TARGET_COVERAGE:.0%}",
                    run.coverage_at_failover >= TARGET_COVERAGE, f"{run.coverage_at_failover:.1%}"))
    if run.storage == "shared" and "storage_read_ratio" in checks:
        ratio = float(checks["storage_read_ratio"])  # type: ignore[arg-type]
        counted = " (pg_stat_io reads)" if run.io_blocks_read_after is not None else ""
        targets.append(("reads_5pct", f"storage reads{counted} in the first {READS_WINDOW} s <= {TARGET_READS:.0%} "
                        "of the run without CCM", ratio <= TARGET_READS, f"{ratio:.1%}"))
        if run.blocks_read_window_s != READS_WINDOW:
            print(f"(the read figures cover {run.blocks_read_window_s} s, not {READS_WINDOW} s: --after-seconds)")
    for key, label, met, measured in targets:
        checks[key] = {"met": met, "measured": measured}
        print(f"target {'met    ' if met else 'NOT met'}{prefix}: {label} (measured: {measured})")
    if not all(met for _, _, met, _ in targets):
        checks["cause"] = cause(run)
        print(f"  where the time and reads went{prefix}: {checks['cause']}")
    return checks


def group_key(run: RunResult) -> str:
    """The runs compared side by side: one scenario, and with separate budgets one storage
    setting and one concurrency."""
    key = run.scenario if run.storage == "shared" else f"{run.scenario}, {run.storage} storage, {run.clients} clients"
    return key + (f", round {run.round} of {run.rounds}" if run.rounds > 1 else "")


def validity(runs: list[RunResult]) -> dict[str, object] | None:
    """Separate budgets: the arms' pre-failover TPS must be within 5% of each other (the
    spread: highest over lowest, minus one), or the comparison is not valid."""
    if len(runs) < 2 or any(r.storage == "shared" for r in runs):
        return None
    figures = [r.pre_failover_tps for r in runs]
    spread = max(figures) / min(figures) - 1 if min(figures) > 0 else float("inf")
    return {"valid": spread <= VALID_SPREAD, "spread": round(spread, 4),
            "pre_failover_tps": {r.mode: round(r.pre_failover_tps) for r in runs}}


VALID_SPREAD = 0.05


def print_table(results: list[RunResult], args: argparse.Namespace) -> dict[str, dict[str, dict[str, object]]]:
    """Prints one table per group of runs compared (group_key); returns the target checks
    per group and CCM run, and the group's validity."""
    verdicts: dict[str, dict[str, dict[str, object]]] = {}
    for key in dict.fromkeys(group_key(r) for r in results):
        runs = [r for r in results if group_key(r) == key]
        rows = table_rows(runs, args)
        width = max(74, *(len(label) for label, _ in rows))
        columns = [max(16, len(r.mode), *(len(values[k]) for _, values in rows)) for k, r in enumerate(runs)]
        print()
        print(f"## {key} ({runs[0].postgresql})")
        print()
        if runs[0].cpu_split:
            print(f"Separate budgets: {runs[0].cpu_split}.")
            print()
        print(f"| {'':<{width}} |" + "".join(f" {r.mode:>{c}} |" for r, c in zip(runs, columns)))
        print(f"|{'-' * (width + 2)}|" + "".join(f"{'-' * (c + 1)}:|" for c in columns))
        for label, values in rows:
            print(f"| {label:<{width}} |" + "".join(f" {v:>{c}} |" for v, c in zip(values, columns)))

        with_agent = [r for r in runs if r.fill_room is not None]
        without = next((r for r in runs if r.fill_room is None), None)
        print()
        verdicts[key] = {run.mode: check_targets(run, without, args, f" [{run.mode}]" if len(with_agent) > 1 else "")
                         for run in with_agent}
        valid = validity(runs)
        if valid is not None:
            verdicts[key]["validity"] = valid
            figures = ", ".join(f"{mode} {tps}" for mode, tps in valid["pre_failover_tps"].items())  # type: ignore[union-attr]
            print(f"comparison {'valid' if valid['valid'] else 'NOT VALID'}: pre-failover TPS {figures}, "
                  f"spread {float(valid['spread']):.1%} (at most {VALID_SPREAD:.0%} allowed)")  # type: ignore[arg-type]
    return verdicts


EXPLANATION = """\
How to read this:
- Separate hosts are emulated: both nodes run on this machine, so just before the failover the
  standby's data files are dropped from the OS page cache (sync + vmtouch -e), in every run. The
  new primary then has only what its shared_buffers hold, as on its own host (and as on Aurora,
  which has no double buffering); everything else comes from storage.
- "pre-failover TPS" is the old primary's mean over the last {window} s before the kill. The 90% times
  run from the moment the promoted standby accepts writes (pgbench starts a few milliseconds
  later) to the end of the first pgbench -P 1 interval at or above 90% of it, shown and checked
  to 0.1 s ("reached and kept": every later second too, so a single slow second anywhere, e.g.
  a checkpoint, resets it). The old primary's own seconds are not all at 90% of their mean
  either: the row "the old primary's own seconds at >= 90%" gives the share that are, the noise
  those times are read against.
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
  ended in each one-second interval, and pooled over the old primary's last {window} s and the new
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
    return EXPLANATION.format(reads=IO_READS_EXPLANATION if io else BLKS_READ_EXPLANATION,
                              window=results[0].pre_window_s if results else PRE_WINDOW)


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

    names = list(dict.fromkeys(group_key(r) for r in results))
    figure, axes = plt.subplots(3, len(names), figsize=(8 * len(names), 12.5), squeeze=False, sharex="col")
    colors = {CCM.name: "tab:green", CCM_HOT_SET_ONLY.name: "tab:blue", CCM_PAGE_CACHE.name: "tab:orange",
              NO_CCM.name: "tab:red"}
    left = -min(30, max(r.pre_window_s for r in results) if results[0].storage != "shared" else args.warm_seconds)
    for column, scenario in enumerate(names):
        tps_axis, latency_axis, reads_axis = (axes[row][column] for row in range(3))
        for run in (r for r in results if group_key(r) == scenario):
            color = colors.get(run.mode)
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
            # What the disk served (the node's blkio group), dashed: the reads that missed the OS page cache too.
            disk_label = f"{run.mode}: disk read requests (blkio)" if run.device_reads_after else None
            for series, name in ((run.device_reads_before, None), (run.device_reads_after, disk_label)):
                points = [p for p in series if p[0] >= left]
                reads_axis.plot([p[0] for p in points], [p[1] for p in points], color=color, linewidth=0.8,
                                linestyle="--", label=name)
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
    budgets = f"; separate budgets: {results[0].cpu_split}" if results[0].cpu_split else ""
    which = ("every run but the one with both caches, whose nodes' page caches are their memory groups'"
             if any(r.mode == CCM_PAGE_CACHE.name for r in results) else "every run")
    subtitle = textwrap.fill(f"(separate hosts emulated: the standby's files are dropped from the OS page cache before the "
                             f"failover, in {which}{budgets})", width=int(14 * figure.get_figwidth()))
    figure.suptitle(f"pg_ccm failover demo on {results[0].postgresql}, with and without ccm-agent\n{subtitle}", fontsize=10)
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
                             "large and typical: only by name)")
    parser.add_argument("--only", choices=["ccm", "none", "both"], default="both",
                        help="run with ccm-agent (as many runs as --fill-room asks for), without CCM, or both")
    parser.add_argument("--arms", metavar="SLUGS",
                        help=f"instead of --only and --fill-room, these runs in this order, comma-separated, among "
                             f"{','.join(ARMS)}")
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
    parser.add_argument("--typical-scale", type=int, default=60, help="pgbench scale of the typical scenario")
    parser.add_argument("--typical-shared-buffers", type=memory, default="512MB",
                        help="shared_buffers of both nodes, typical scenario")
    parser.add_argument("--typical-node-memory", type=memory, default="2GB",
                        help="memory of each node (its memory group: processes and page cache), typical scenario")
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
    add_budget_arguments(parser)
    args = parser.parse_args(argv)
    if args.warm_seconds < PRE_WINDOW or args.after_seconds < 10:
        parser.error(f"--warm-seconds must be >= {PRE_WINDOW} and --after-seconds >= 10")
    if args.clients < 1:
        parser.error("--clients must be >= 1")
    if args.arms and (unknown := [slug for slug in args.arms.split(",") if slug not in ARMS]):
        parser.error(f"--arms: unknown {','.join(unknown)}; choose among {','.join(ARMS)}")
    resolve_budget_arguments(parser, args)
    return args


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a comparison with separate budgets (demo/README.md, "Separate budgets");
    bench/failover_sweep.py takes them too."""
    group = parser.add_argument_group("separate budgets (the default of --scenario large)")
    group.add_argument("--separate-budgets", choices=["on", "off"],
                       help="each node, its pgbench client and the agent in cgroups of their own (CPU sets, a blkio "
                            "group per node on the data disk), the old primary brought to its steady state before a "
                            "measured window of --pre-seconds (default: on for --scenario large, off for the others)")
    group.add_argument("--storage", choices=["local", "cloud", "both"],
                       help="with separate budgets: the local disk (reads counted per node), cloud-like storage (each "
                            "node's reads throttled to --cloud-iops and --cloud-mbps), or both, in turn (default: cloud)")
    group.add_argument("--cloud-iops", type=int, default=3000, help="read requests per second of each node on cloud-like storage")
    group.add_argument("--cloud-mbps", type=int, default=125, help="MB (MiB) per second each node reads on cloud-like storage")
    group.add_argument("--node-cpus", default="0:1", metavar="PRIMARY:STANDBY",
                       help="the CPU sets of the primary and of the standby (cpuset.cpus syntax, e.g. 0-1:2-3)")
    group.add_argument("--client-cpus", metavar="CPUS",
                       help="the CPU set of pgbench (default: the CPUs of the node it drives: the primary's before the "
                            "failover, the standby's after it)")
    group.add_argument("--agent-cpus", metavar="CPUS", help="the CPU set of ccm-agent (default: the standby's)")
    group.add_argument("--pre-seconds", type=int, default=60,
                       help="the measured window on the old primary once it settled (pre-failover TPS, latency and reads)")
    group.add_argument("--settle-reads", type=float, default=1.0,
                       help="the old primary has settled when, over --settle-window, its storage reads (and the blocks "
                            "the agent loaded) were at most this many per 1000 transactions")
    group.add_argument("--settle-window", type=int, default=15, help="seconds the settling rates are taken over")
    group.add_argument("--settle-timeout", type=int, default=900,
                       help="most seconds of workload before the measured window starts anyway (the run says so)")
    group.add_argument("--no-prewarm-primary", dest="prewarm_primary", action="store_false",
                       help="with separate budgets, do not pg_prewarm the primary before its workload (it then warms "
                            "from storage, which takes minutes on cloud-like storage)")


def resolve_budget_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Defaults that depend on the scenario, and the checks of the separate-budget options.
    Sets args.separate_budgets (bool), args.storages (list of Storage, empty without budgets)
    and args.node_cpus (primary, standby)."""
    if args.separate_budgets is None:
        args.separate_budgets = "on" if getattr(args, "scenario", "large") in BUDGETED else "off"
    args.separate_budgets = args.separate_budgets == "on"
    if args.storage and not args.separate_budgets:
        parser.error("--storage needs separate budgets (--separate-budgets on)")
    chosen = {"local": ["local"], "cloud": ["cloud"], "both": ["local", "cloud"]}[args.storage or "cloud"]
    args.storages = [storages(args)[name] for name in chosen] if args.separate_budgets else []
    primary, sep, standby = args.node_cpus.partition(":")
    if not sep or not all(re.fullmatch(r"[0-9,-]+", part) for part in (primary, standby)):
        parser.error(f"--node-cpus: expected PRIMARY:STANDBY CPU sets such as 0:1, got {args.node_cpus!r}")
    args.node_cpus = (primary, standby)
    if args.pre_seconds < 10 or args.settle_window < 5:
        parser.error("--pre-seconds must be >= 10 and --settle-window >= 5")


def json_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options as results.json records them (paths as text, arms and storages as dicts)."""
    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (Arm, Storage)):
            return asdict(value)
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value
    return {key: plain(value) for key, value in vars(args).items()}


def budget_problems(args: argparse.Namespace) -> list[str]:
    """What keeps separate budgets from working here."""
    if not args.separate_budgets:
        return []
    problems = []
    if os.geteuid() != 0:
        problems.append("separate budgets need root (cgroups); pass --separate-budgets off")
    missing = [name for name in ("cpuset", "cpuacct", "blkio") if not controller_available(name)]
    if missing:
        problems.append(f"separate budgets need the cgroup v1 controllers {', '.join(missing)} (/sys/fs/cgroup/NAME); "
                        "pass --separate-budgets off")
    cpus = os.cpu_count() or 1
    wanted = [args.node_cpus[0], args.node_cpus[1], args.client_cpus, args.agent_cpus]
    highest = max((int(n) for spec in wanted if spec for n in re.findall(r"\d+", spec)), default=0)
    if highest >= cpus:
        problems.append(f"CPU {highest} is named in --node-cpus/--client-cpus/--agent-cpus, but this machine has {cpus}")
    return problems


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
    return problems + environment_problems(args)


def environment_problems(args: argparse.Namespace, programs: tuple[str, ...] = ()) -> list[str]:
    """What the demo and the sweep need besides the agent: the PostgreSQL version (chosen
    and put in use here), the cgroups of separate budgets, programs, matplotlib."""
    problems = []
    try:
        (args.pg,) = resolve_pg_versions(args.pg)  # names scripts/install.sh --pg N if pg_ccm is missing
        use_pg_version(args.pg)
    except PgVersionError as error:
        problems.append(str(error))
    problems += budget_problems(args)
    for program in ("vmtouch", "setpriv", "sync", *programs):
        if shutil.which(program) is None:
            problems.append(f"{program} is missing (scripts/setup.sh installs it)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        problems.append("matplotlib is missing: pip install -r tests/requirements.txt")
    return problems


def ready(problems: list[str], program: str) -> bool:
    """Prints what keeps `program` from running; without problems, makes SIGTERM and SIGHUP
    unwind like Ctrl-C (clusters, agent and cgroups are removed) and says it may run."""
    for problem in problems:
        print(f"{program}: {problem}", file=sys.stderr)
    if problems:
        return False
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not ready(preflight(args), "failover_demo"):
        return 2

    args.output_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pg_ccm-demo-"))
    os.chmod(workdir, 0o755)  # the postgres user must reach the clusters inside
    chosen = scenarios(args, workdir)
    # With separate budgets the primary works until it settles (guessed: --warm-seconds and a
    # minute more) before its measured window; every storage setting runs every arm.
    per_run = 15 + args.warm_seconds + args.after_seconds + (60 + args.pre_seconds if args.separate_budgets else 0)
    # The data set once, then per run: a copy of it for each node, the workloads, the epilogue.
    estimate = sum(5 + s.scale / 8 + len(args.storages or [None]) * sum(
        per_run + s.scale / 10 + (REJOIN_TIMEOUT if args.rejoin and m.agent_args is not None else 0)
        for m in modes(args, s.name)) for s in chosen)
    started, started_wall = time.monotonic(), datetime.datetime.now().astimezone()
    runs = "; ".join(f"{s.name}: {', '.join(m.name for m in modes(args, s.name))}" for s in chosen)
    say(f"pg_ccm failover demo on {pg_version_text()} ({pg_bin()}), runs of {runs}; about {estimate / 60:.0f} minutes")
    say("separate hosts are emulated by dropping the standby's files from the OS page cache just before "
        "the failover, in every run but the one that mirrors the page cache (each node's memory group holds its own)")
    results: list[RunResult] = []
    try:
        for scenario in chosen:
            say(f"scenario {scenario.name}: {scenario.description}")
            template = build_template(scenario, args, workdir)
            for storage in args.storages or [None]:
                longest = 0.0  # the arms compared warm up at least as long as the ones before them
                for arm in modes(args, scenario.name):
                    results.append(run_once(scenario, template, arm, args, workdir, storage, warm_at_least=longest))
                    longest = max(longest, results[-1].warm_before_window_s or 0.0)
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
        "settings": json_settings(args),
        "targets": verdicts,
        "runs": [asdict(r) for r in results],
    }, indent=1))
    print(f"chart: {png}\nfigures and series: {figures}\nwhole demo: {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
