#!/usr/bin/env python3
"""Steady-state cost of a warm standby per agent cycle (issue 14), for both exchanges: the change
feed of extension 0.5.0 (the default) and the full bloom-filter exchange (--change-feed false),
one after the other on the same cluster and load (--exchanges).

    python3 bench/steady.py --sizes 2GB,4GB,8GB --seconds 120 [--pg 15]
    python3 bench/ccm_bench.py --only steady ...      (the same, wired into the benchmark)

Each agent cycle builds a bloom filter of ALL the standby's buffers (ccm_buffer_filter), carries
it to the primary, scans ALL the primary's buffer headers against it (ccm_hot_blocks) and loads
what is missing (ccm_prewarm). With nothing to do, a cycle still costs that much, in proportion
to shared_buffers. For each size S of --sizes, on a fresh primary and streaming standby with
shared_buffers = S on both:

  1. a data set of about --fill x S (one table, int8 primary key and a 1 kB pad, fillfactor 85,
     built with INSERT ... SELECT generate_series on the primary before the standby is cloned),
     read into shared_buffers on both nodes with pg_prewarm; then a read-mostly load on the
     primary (pgbench, --clients clients at --rate transactions/s: random single-row SELECTs by
     primary key over the whole table, --write-percent of UPDATEs so that WAL flows) and the
     agent (interval 1 s) until the agent reports coverage >= 0.99 (and at least --warmup-seconds);
  2. --seconds of steady state with the load and the agent running, measuring
     - CPU: utime + stime (/proc/PID/stat) of the agent's sessions on each node (found in
       pg_stat_activity by application_name ccm-agent; ccm_prewarm's read-ahead threads are
       threads of its backend and count) and of the agent process itself;
     - bytes on the wire per node and direction: the agent's TCP sockets to each node as
       `ss -tinH` sees them (bytes_acked = agent to node, bytes_received = node to agent);
       without these fields, /proc/AGENT/io wchar/rchar, both nodes (and /metrics) together;
     - the agent's cycles, blocks sent and loaded, mean cycle duration, filter and list bytes;
     - hot -> cached delay: every --probe-interval s, --probe-blocks pages of a side table that
       the standby does not cache (checked with pg_buffercache there) are read 5 times on the
       primary (usage count 5, hot: above ccm.usage_threshold 3), and the standby's
       pg_buffercache is polled until they are all cached;
  3. a markdown table, and the costs extrapolated to 64 GB and 256 GB of shared_buffers;
  4. with --cold-restart N, under the same load: the standby restarted cold (CHECKPOINT on both,
     stopped, its files dropped from the page cache, started) 1 + 2N times. First without the
     agent, pg_prewarm reading the data set's table and index (not timed: it gives the disk
     reads after it the same footing, see cold_restart()). Then N rounds of: with the agent,
     the seconds from the standby's being ready until the end of the agent's last batch
     before pg_buffercache on both nodes shows 99% of the primary's hot set on the standby;
     without the agent, the seconds pg_prewarm takes to read the data set: the disk's time,
     scaled by hot set / data set blocks. The median of the rounds' ratios is reported.

Each size's cluster is destroyed before the next starts. Both nodes run on this host: 2 x S of
shared_buffers must fit in memory (a size that does not is refused).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import Sampler, percentile, say, server_settings  # noqa: E402  (bench/common.py, next to this file)
from harness.agent import AgentProcess  # noqa: E402
from harness.cluster import (Cluster, Node, PgVersionError, pg_bin, pg_version_text,  # noqa: E402
                             resolve_pg_versions, use_pg_version)

# -- options: the same definitions standalone (--sizes) and in ccm_bench (--steady-sizes) ------

STEADY_OPTIONS = (
    # name, type, default, help
    ("sizes", str, "2GB,4GB,8GB", "shared_buffers of both nodes, one cluster per size, in turn (default 2GB,4GB,8GB)"),
    ("seconds", int, 120, "length of the steady phase per size and exchange (default 120)"),
    ("exchanges", str, "feed,filter", "the agent's exchanges to measure on each cluster, in turn: feed (the change "
                                      "feed of extension 0.5.0, --change-feed true) and filter (the full bloom-filter "
                                      "exchange, --change-feed false) (default feed,filter)"),
    ("warmup-seconds", int, 30, "least warm-up with the load and the agent before measuring (default 30)"),
    ("warmup-timeout", int, 900, "longest wait for coverage >= 0.99; then measured anyway, with a note (default 900)"),
    ("agent-args", str, "", "extra flags for every ccm-agent run, space-separated (e.g. \"--fill-room false\")"),
    ("clients", int, 2, "pgbench clients of the read-mostly load (default 2)"),
    ("rate", int, 2000, "the load's transactions per second, all clients together (pgbench -R); 0: no limit, "
                        "which takes both CPUs of a 2-CPU machine (default 2000)"),
    ("write-percent", int, 1, "share of the load's transactions that UPDATE a row (default 1)"),
    ("fill", float, 0.95, "data set (table and index) as a share of shared_buffers (default 0.95)"),
    ("hot-passes", int, 1, "pg_prewarm passes over the data set on the primary before the load: 4 or more make "
                           "all of it hot (usage count above 3) from the start (default 1: the load makes it hot)"),
    ("probe-interval", float, 5.0, "seconds between hot -> cached probes (default 5)"),
    ("probe-blocks", int, 20, "pages made hot on the primary per probe (default 20)"),
    ("probe-timeout", float, 30.0, "longest wait for a probe's pages on the standby (default 30)"),
    ("cold-restart", int, 0, "N: after the exchanges, N rounds of: restart the standby cold (files dropped from the "
                             "page cache) with the agent (change feed) warming it, then again without the agent and "
                             "time pg_prewarm of the data set on it, the disk's own time for those blocks; the "
                             "median ratio is reported (default 0)"),
)


def add_steady_arguments(parser: argparse.ArgumentParser, prefix: str = "--steady-") -> None:
    """The options of this benchmark, as `prefix`NAME (dest steady_NAME): "--" standalone,
    "--steady-" (the default) in a parser that has options of its own."""
    for name, kind, default, text in STEADY_OPTIONS:
        parser.add_argument(prefix + name, dest="steady_" + name.replace("-", "_"), type=kind, default=default,
                            metavar=name.replace("-", "_").upper(),
                            help=text)


def option(args: argparse.Namespace, name: str):
    """args.steady_NAME, else the option's default (a caller that did not add the options)."""
    default = next(d for n, _, d, _ in STEADY_OPTIONS if n == name)
    return getattr(args, "steady_" + name.replace("-", "_"), default)


UNITS = {"kb": 2**10, "mb": 2**20, "gb": 2**30, "tb": 2**40}
HEADROOM = 3 * 2**30  # memory left to the OS, the clients and the agent besides both nodes' shared_buffers


def memory_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def parse_sizes(text: str) -> list[tuple[str, int]]:
    """"2GB,4GB" -> [("2GB", 2 << 30), ...]; raises ValueError for a malformed size or one whose
    two nodes' shared_buffers do not fit in this machine's memory."""
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        match = re.fullmatch(r"(\d+)\s*(kB|MB|GB|TB)", part, re.IGNORECASE)
        if not match:
            raise ValueError(f"--sizes: {part!r} is not a size such as 256MB or 8GB")
        sizes.append((f"{match[1]}{match[2].upper().replace('KB', 'kB')}", int(match[1]) * UNITS[match[2].lower()]))
    if not sizes:
        raise ValueError("--sizes: no size given")
    total = memory_bytes()
    for label, size in sizes:
        if 2 * size + HEADROOM > total:
            raise ValueError(f"--sizes: {label} on both nodes ({2 * size / 2**30:.0f} GB) plus {HEADROOM >> 30} GB "
                             f"for the rest does not fit in this machine's {total / 2**30:.0f} GB")
    return sizes


# -- the data set --------------------------------------------------------------------------

DATA, PROBE = "steady_data", "steady_probe"
PAD = 1000  # bytes of pad per row: 6 rows per page at fillfactor 85 (room for a HOT update), 7 at 100
ROWS_PER_PAGE = 6
INDEX_SHARE = 0.017  # the int8 primary key's pages per heap page (about 370 entries per leaf)
HOT_READS = 5  # reads of a probe page: usage count 5, above ccm.usage_threshold (3)


def build_data(node: Node, shared_bytes: int, fill: float, probe_pages: int) -> int:
    """The data table (about `fill` x shared_buffers with its index) and the probe table, on
    the primary alone; returns the data table's rows. VACUUM right after the load, before any
    checkpoint, sets hint bits and the visibility map without full-page images, so that the
    load's reads dirty nothing later."""
    pages = int(shared_bytes / 8192 * fill / (1 + INDEX_SHARE))
    rows = pages * ROWS_PER_PAGE
    with node.connect() as conn:
        conn.execute("SET maintenance_work_mem = '1GB'")
        conn.execute(f"CREATE TABLE {DATA} WITH (fillfactor = 85) AS "
                     f"SELECT g::int8 AS id, 0 AS n, repeat('x', {PAD}) AS pad FROM generate_series(1, {rows}) g")
        conn.execute(f"VACUUM (ANALYZE) {DATA}")
        conn.execute(f"ALTER TABLE {DATA} ADD PRIMARY KEY (id)")
        conn.execute(f"CREATE TABLE {PROBE} WITH (autovacuum_enabled = off) AS "
                     f"SELECT g::int8 AS id, repeat('y', {PAD}) AS pad FROM generate_series(1, {probe_pages * 7}) g")
        conn.execute(f"VACUUM (ANALYZE) {PROBE}")
        conn.execute("CHECKPOINT")
    return rows


def prewarm(node: Node, passes: int = 1) -> None:
    for _ in range(passes):
        for relation in (DATA, f"{DATA}_pkey"):
            node.sql("SELECT pg_prewarm(%s)", [relation])


def start_load(node: Node, rows: int, clients: int, rate: int, write_percent: int, seconds: int,
               base: Path) -> subprocess.Popen:
    """pgbench in the background: random primary-key SELECTs over the whole table, and
    `write_percent` of UPDATEs; stopped by the caller (`seconds` is only its upper bound)."""
    read, write = base / "steady_read.sql", base / "steady_write.sql"
    read.write_text(f"\\set id random(1, {rows})\nSELECT length(pad) FROM {DATA} WHERE id = :id;\n")
    write.write_text(f"\\set id random(1, {rows})\nUPDATE {DATA} SET n = n + 1 WHERE id = :id;\n")
    scripts = [part for path, weight in ((read, 100 - write_percent), (write, write_percent)) if weight > 0
               for part in ("-f", f"{path}@{weight}")]
    argv = [str(pg_bin() / "pgbench"), "-h", "127.0.0.1", "-p", str(node.port), "-U", "postgres", "-n",
            "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 2)), "-T", str(seconds),
            *(["-R", str(rate)] if rate > 0 else []), *scripts, "postgres"]
    log = open(base / "steady_pgbench.log", "ab")
    try:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


# -- what the agent costs: CPU, bytes, metrics -------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")
APPLICATION_NAME = "ccm-agent"  # agent/src/node.rs APPLICATION_NAME


def agent_sessions(node: Node) -> dict[int, int]:
    """The agent's sessions on `node`: backend pid -> the agent's (client) TCP port."""
    rows = node.sql("SELECT pid, client_port FROM pg_stat_activity WHERE application_name = %s "
                    "AND client_port IS NOT NULL", [APPLICATION_NAME])
    return dict(rows)


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, all its threads (dead ones too), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def socket_bytes() -> tuple[bool, dict[tuple[int, int], tuple[int, int]]]:
    """Every TCP socket `ss -tinH` lists: (local port, peer port) -> (bytes_acked,
    bytes_received); and whether this kernel reports those fields at all (ss omits a field
    that is 0, so a missing one counts as 0 when others report it)."""
    out = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, check=True).stdout
    sockets: dict[tuple[int, int], tuple[int, int]] = {}
    key = None
    for line in out.splitlines():
        if line[:1].isspace():
            if key is not None:
                acked = re.search(r"\bbytes_acked:(\d+)", line)
                received = re.search(r"\bbytes_received:(\d+)", line)
                sockets[key] = (int(acked[1]) if acked else 0, int(received[1]) if received else 0)
            key = None
        else:
            ends = [token for token in line.split() if re.fullmatch(r"\S+:\d+", token)]
            key = (int(ends[0].rsplit(":", 1)[1]), int(ends[1].rsplit(":", 1)[1])) if len(ends) >= 2 else None
    return "bytes_acked:" in out and "bytes_received:" in out, sockets


def agent_memory_mb(pid: int) -> tuple[float | None, float | None]:
    """The agent's resident memory now and at its peak (VmRSS, VmHWM), in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    kb = (lambda name: int(fields[name].split()[0]) / 1024 if name in fields else None)  # noqa: E731
    return kb("VmRSS"), kb("VmHWM")


def process_io(pid: int) -> tuple[int, int]:
    """(wchar, rchar) of a process: the fallback when ss reports no byte counts."""
    counts = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(counts["wchar"]), int(counts["rchar"])


COUNTERS = ("ccm_agent_cycles_total", "ccm_agent_blocks_sent_total", "ccm_agent_blocks_loaded_total")


class Snapshot:
    """Everything counted at one moment: CPU of the agent's sessions per node and of the agent,
    the bytes of its sockets per node, its counters, the primary's commits."""

    def __init__(self, cluster: Cluster, agent: AgentProcess, sessions: dict[str, dict[int, int]]):
        self.time = time.monotonic()
        self.cpu = {side: [cpu_seconds(pid) for pid in pids] for side, pids in sessions.items()}
        self.agent_cpu = cpu_seconds(agent.process.pid)
        self.ss_ok, found = socket_bytes()
        nodes = {"primary": cluster.primary, "standby": cluster.standby}
        self.wire = {side: [found.get((port, nodes[side].port)) for port in sessions[side].values()]
                     for side in sessions}
        self.agent_io = process_io(agent.process.pid)
        metrics = agent.metrics()
        self.counters = {name: metrics.get(name, 0.0) for name in COUNTERS}
        self.commits = cluster.primary.one("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")


class CycleSampler(Sampler):
    """The agent's per-cycle gauges (duration, filter and list bytes), read from /metrics every
    `interval` seconds in a thread and kept once per cycle (a new last-cycle timestamp)."""

    what = "sampling the agent's metrics"

    def __init__(self, agent: AgentProcess, interval: float = 0.25):
        super().__init__(interval)
        self.agent = agent
        self.cycles: list[dict[str, float]] = []
        self._seen: float | None = None

    def sample(self) -> None:
        metrics = self.agent.metrics()
        stamp = metrics.get("ccm_agent_last_cycle_timestamp_seconds")
        if stamp and stamp != self._seen:
            self._seen = stamp
            self.cycles.append({"duration": metrics.get("ccm_agent_last_cycle_duration_seconds", 0.0),
                                "filter_bytes": metrics.get("ccm_agent_filter_bytes", 0.0),
                                "list_bytes": metrics.get("ccm_agent_block_list_bytes", 0.0)})

    def mean(self, key: str) -> float | None:
        # The first sample may be the cycle running before the phase began: it counts too.
        return statistics.mean(c[key] for c in self.cycles) if self.cycles else None


# -- polling and the hot -> cached probes ---------------------------------------------------------

def poll(check, timeout: float, interval: float) -> tuple[bool, float]:
    """Calls check() every `interval` seconds until it returns true or `timeout` seconds have
    passed; returns whether it did, and the seconds from the call until the check that did
    returned (or until giving up)."""
    started = time.monotonic()
    while True:
        if check():
            return True, time.monotonic() - started
        if time.monotonic() - started > timeout:
            return False, time.monotonic() - started
        time.sleep(interval)


class Prober:
    """Makes `blocks` pages of the probe table hot on the primary (HOT_READS reads each) and
    measures how long until the standby caches them all (pg_buffercache on the standby, polled).
    Pages are taken in order, never twice, skipping those the standby already caches."""

    def __init__(self, cluster: Cluster, blocks: int, timeout: float):
        self.blocks, self.timeout = blocks, timeout
        self.primary = cluster.primary.connect()
        self.standby = cluster.standby.connect()
        self.tag = self.primary.execute(
            "SELECT pg_relation_filenode(%s::regclass)::int8, (SELECT oid FROM pg_database "
            "WHERE datname = current_database())::int8, pg_relation_size(%s::regclass) / 8192", [PROBE, PROBE]).fetchone()
        self.next_block = 0
        self.poll_seconds: list[float] = []  # how long one pg_buffercache query on the standby takes

    def close(self) -> None:
        self.primary.close()
        self.standby.close()

    def cached(self, blocks: list[int] | None = None) -> set[int]:
        """Which of the probe table's pages (of `blocks`, if given) the standby caches."""
        relfilenode, database, _ = self.tag
        started = time.monotonic()
        rows = self.standby.execute(
            "SELECT relblocknumber FROM pg_buffercache WHERE relfilenode = %s AND reldatabase = %s "
            "AND relforknumber = 0 AND (%s::int8[] IS NULL OR relblocknumber = ANY(%s::int8[]))",
            [relfilenode, database, blocks, blocks]).fetchall()
        self.poll_seconds.append(time.monotonic() - started)
        return {row[0] for row in rows}

    def pick(self) -> list[int]:
        """The next `blocks` pages the standby does not cache; fewer when the table runs out."""
        cached, picked = self.cached(), []
        while len(picked) < self.blocks and self.next_block < self.tag[2]:
            if self.next_block not in cached:
                picked.append(self.next_block)
            self.next_block += 1
        return picked

    def probe(self) -> float | None:
        """One probe: seconds from the pages turning hot on the primary until the standby has
        them all (an upper bound: the end of the successful poll), None on timeout."""
        blocks = self.pick()
        if len(blocks) < self.blocks:
            raise RuntimeError(f"the probe table ({self.tag[2]} pages) has no {self.blocks} uncached pages left")
        self.primary.execute(f"SELECT sum(pg_prewarm('{PROBE}', 'buffer', 'main', b, b)) "
                             "FROM unnest(%s::int8[]) b CROSS JOIN generate_series(1, %s)", [blocks, HOT_READS])
        done, seconds = poll(lambda: len(self.cached(blocks)) == len(blocks), self.timeout, 0.05)
        return seconds if done else None


def run_probes(prober: Prober, seconds: float, interval: float, check_alive) -> list[float | None]:
    """Probes every `interval` seconds for `seconds`; the delays (None: timed out)."""
    delays: list[float | None] = []
    started = time.monotonic()
    next_at = started + interval / 2
    while next_at < started + seconds:
        time.sleep(max(0.0, next_at - time.monotonic()))
        check_alive()
        delays.append(prober.probe())
        next_at = max(next_at + interval, time.monotonic())
    time.sleep(max(0.0, started + seconds - time.monotonic()))
    return delays


# -- one size --------------------------------------------------------------------------------

def steady_size(label: str, size: int, args: argparse.Namespace) -> list[dict]:
    """Builds and warms one cluster with shared_buffers = `size`, then measures each exchange
    of --exchanges on it in turn (a fresh agent each); returns one row per exchange. The
    cluster is destroyed on the way out."""
    seconds, interval = option(args, "seconds"), option(args, "probe-interval")
    probe_pages = max(1000, option(args, "probe-blocks") * (math.ceil(seconds / interval) + 10))
    settings = {"shared_buffers": f"'{label}'", "max_wal_size": f"'{max(8, 3 * size >> 30)}GB'",
                "checkpoint_timeout": "'1h'", **getattr(args, "set", {})}
    cluster = Cluster(settings=settings)
    load: subprocess.Popen | None = None
    agent: AgentProcess | None = None
    try:
        primary, standby = cluster.primary, cluster.standby
        cluster.create(extensions=("pg_ccm", "pg_buffercache", "pg_prewarm"), standby=False)
        nbuffers = primary.one("SELECT setting::int8 FROM pg_settings WHERE name = 'shared_buffers'")
        say(f"### shared_buffers {label} ({nbuffers} buffers)")
        started = time.monotonic()
        rows = build_data(primary, size, option(args, "fill"), probe_pages)
        data_mb = primary.one(f"SELECT (pg_table_size('{DATA}') + pg_indexes_size('{DATA}')) / 1048576")
        say(f"data set: {rows} rows, {data_mb} MB = {data_mb * 2**20 / size:.2f} x shared_buffers, built in "
            f"{time.monotonic() - started:.0f} s; cloning the standby ...")
        primary.restart()  # an empty cache: nothing of the build (the probe table) is cached anywhere
        cluster.clone_standby(standby, primary)
        standby.start()
        cluster.wait_caught_up(timeout=1800)
        started = time.monotonic()
        prewarm(primary, option(args, "hot-passes"))
        prewarm(standby)
        say(f"pg_prewarm on both nodes: {time.monotonic() - started:.0f} s")

        exchanges = [e.strip() for e in option(args, "exchanges").split(",") if e.strip()]
        total = (option(args, "warmup-timeout") + seconds + 600) * len(exchanges)
        load = start_load(primary, rows, option(args, "clients"), option(args, "rate"), option(args, "write-percent"),
                          total, cluster.base)
        results = []
        for exchange in exchanges:
            feed = {"feed": "true", "filter": "false"}[exchange]
            agent = AgentProcess(primary.conninfo(), standby.conninfo(), cluster.base, interval="1s",
                                 extra=["--change-feed", feed, *option(args, "agent-args").split()]).start()
            results.append(measure(f"{label} {exchange}", size, nbuffers, data_mb, cluster, agent, load, args))
            agent.stop()
            agent = None
        if option(args, "cold-restart"):
            agent = AgentProcess(primary.conninfo(), standby.conninfo(), cluster.base, interval="1s",
                                 extra=["--change-feed", "true", *option(args, "agent-args").split()]).start()
            cold_restart(label, cluster, agent, args)
            agent = None
        return results
    finally:
        if agent is not None:
            agent.stop()
        if load is not None and load.poll() is None:
            load.terminate()
            load.wait()
        cluster.destroy()


def measure(label: str, size: int, nbuffers: int, data_mb: int, cluster: Cluster, agent: AgentProcess,
            load: subprocess.Popen, args: argparse.Namespace) -> dict:
    """Warm-up and steady phase of one agent on a loaded cluster; its row."""
    primary, standby = cluster.primary, cluster.standby
    seconds, interval = option(args, "seconds"), option(args, "probe-interval")

    def check_alive() -> None:
        if load.poll() is not None:
            raise RuntimeError(f"pgbench exited with {load.returncode}:\n"
                               f"{(cluster.base / 'steady_pgbench.log').read_text()[-3000:]}")
        if not agent.alive():
            raise RuntimeError(f"ccm-agent died:\n{agent.log()[-3000:]}")

    warm, waited = warm_up(agent, option(args, "warmup-seconds"), option(args, "warmup-timeout"), check_alive)
    coverage = agent.metric("ccm_agent_coverage_ratio")
    say(f"{label}: warm-up {waited:.0f} s, coverage {coverage:.4f}, hot set {agent.metric('ccm_agent_hot_set_blocks'):.0f} "
        f"blocks" + ("" if warm else f" (coverage still below {WARM} after the timeout; measuring anyway)"))
    sessions = {"primary": agent_sessions(primary), "standby": agent_sessions(standby)}
    if not all(sessions.values()):
        raise RuntimeError(f"no session named {APPLICATION_NAME} in pg_stat_activity on "
                           + " and ".join(side for side, pids in sessions.items() if not pids))
    prober = Prober(cluster, option(args, "probe-blocks"), option(args, "probe-timeout"))
    try:
        before = Snapshot(cluster, agent, sessions)
        with CycleSampler(agent) as sampler:
            delays = run_probes(prober, seconds, interval, check_alive)
        after = Snapshot(cluster, agent, sessions)
    finally:
        prober.close()
    changed = any(agent_sessions(node) != sessions[side]
                  for side, node in (("primary", primary), ("standby", standby)))
    row = steady_row(label, size, nbuffers, data_mb, before, after, sampler, delays, prober, agent, changed)
    row["warm"] = warm
    row["exchange"] = label.split()[-1]
    row["agent_rss_mb"], row["agent_peak_mb"] = agent_memory_mb(agent.process.pid)
    say(steady_line(row))
    say()
    return row


WARM = 0.99


def restart_standby_cold(cluster: Cluster) -> tuple[float, float]:
    """Cluster.make_standby_cold() up to the start: returns the times (monotonic) the standby
    was started and was ready (pg_ctl -w returned: it accepts read-only connections), so that
    what follows (replay, the agent) is timed from there."""
    primary, standby = cluster.primary, cluster.standby
    primary.sql("CHECKPOINT")
    cluster.wait_caught_up()
    standby.sql("CHECKPOINT")
    standby.stop()
    standby.drop_os_cache()
    started = time.monotonic()
    standby.start()
    return started, time.monotonic()


# The agent's loading is taken as over once its standby's loaded counter has not moved for
# this long (its calls take about 0.1 s each); only then is pg_buffercache asked, as often as
# CHECK_EVERY at most: on 2 x 1 M buffers a poll takes a core for about a second, which
# would slow the loading it measures.
LOAD_QUIET = 0.8
CHECK_EVERY = 2.0


def prewarm_cold(cluster: Cluster) -> tuple[int, float, float]:
    """The standby restarted cold without the agent, then pg_prewarm of the data set's table
    and index on it: the blocks read, the seconds that took, and the seconds from its being
    ready to the start of the reads (catching up with the primary)."""
    standby = cluster.standby
    _, ready = restart_standby_cold(cluster)
    cluster.wait_caught_up()
    began = time.monotonic()
    read = sum(standby.one("SELECT pg_prewarm(%s)", [relation]) for relation in (DATA, f"{DATA}_pkey"))
    return read, time.monotonic() - began, began - ready


def cold_restart(label: str, cluster: Cluster, agent: AgentProcess, args: argparse.Namespace) -> None:
    """Step 4 of the module's description; `agent` (running) is stopped on the way.

    The data set is read from disk after a cold restart of the standby, first by pg_prewarm
    (not timed for the ratio: on a VM the host's own cache keeps what was read recently, so
    the first read of a file runs at the storage's speed and later ones faster, and this one
    puts the timed reads on the same footing), then --cold-restart times in turn by the
    agent and by pg_prewarm (the disk's time). Single reads vary by up to 4x on this VM
    (mostly the kernel zeroing the new server's shared memory as the reads first touch it,
    BENCHMARKS.md), hence rounds and a median. For the agent, three times from the
    standby's start: ready (it accepts connections, so that anyone could read from then
    on), the end of the agent's last ccm_prewarm batch before pg_buffercache on both nodes
    first found 99% of the primary's hot set cached on the standby (the agent's per-standby
    counter of loaded blocks, polled every 0.1 s, says when each batch ended), and the end
    of that pg_buffercache poll. A round's ratio compares the agent's time from ready to its
    last batch with the pg_prewarm read after it, scaled to the hot set's size."""
    agent.stop()
    _, first_disk, _ = prewarm_cold(cluster)
    say(f"{label} cold restart, untimed first read: pg_prewarm read the data set in {first_disk:.1f} s")
    ratios = []
    for round_ in range(1, option(args, "cold-restart") + 1):
        done, agent_seconds, confirmed, hot = agent_cold(f"{label} round {round_}", cluster, agent, args)
        read, disk, waited = prewarm_cold(cluster)
        scaled = disk * hot / read if read else None
        if done and scaled:
            ratios.append(agent_seconds / scaled)
        say(f"{label} round {round_} without the agent: pg_prewarm read the data set's {read:,} blocks in {disk:.1f} s "
            f"({read * 8192 / 2**20 / disk:.0f} MB/s), starting {waited:.1f} s after ready; for the hot set's "
            f"{hot:,} blocks that is {fmt(scaled, 1)} s"
            + (f"; the agent took {agent_seconds / scaled:.2f} x that from ready "
               f"({confirmed / scaled:.2f} x to pg_buffercache's confirmation)" if done and scaled else ""))
    if ratios:
        say(f"{label} cold restart: the agent's time over the disk's, median of {len(ratios)} rounds: "
            f"{statistics.median(ratios):.2f} x (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    say()


def agent_cold(label: str, cluster: Cluster, agent: AgentProcess, args: argparse.Namespace) -> tuple[bool, float, float, int]:
    """One cold restart with the agent warming the standby (see cold_restart): whether 99%
    was reached, the seconds from ready to the agent's last batch and to pg_buffercache's
    confirmation, and the hot set's size."""
    from harness.cluster import coverage

    primary = cluster.primary
    counter = "ccm_agent_standby_blocks_loaded_total"
    agent.start()
    try:
        warm_up(agent, 0, option(args, "warmup-timeout"), lambda: None)
        loaded_before = agent.metric(counter)
        started, ready = restart_standby_cold(cluster)
        timeout = option(args, "warmup-timeout")
        last, moved_at, checked_at = loaded_before, None, 0.0
        hot = 0

        def cached() -> bool:
            nonlocal last, moved_at, checked_at, hot
            loaded = agent.metric(counter)
            now = time.monotonic()
            if loaded != last:
                last, moved_at = loaded, now
                return False
            quiet = now - (moved_at or ready)
            if quiet < (LOAD_QUIET if moved_at else 5.0) or now - checked_at < CHECK_EVERY:
                return False
            ratio, hot = coverage(primary, cluster.standby)
            checked_at = time.monotonic()
            return ratio >= WARM

        done, _ = poll(cached, timeout, 0.1)
        confirmed = time.monotonic()
        loaded = agent.metric(counter) - loaded_before
    finally:
        agent.stop()
    agent_seconds = (moved_at or confirmed) - ready
    say(f"{label} with the agent: the standby was ready {ready - started:.1f} s after its start; "
        + (f"{WARM:.0%} of the hot set ({hot:,} blocks) cached when the agent's last batch ended, "
           f"{agent_seconds:.1f} s after ready, confirmed by pg_buffercache on both nodes {confirmed - ready:.1f} s "
           f"after ready" if done else f"{WARM:.0%} of the hot set not cached within {confirmed - ready:.0f} s")
        + f" ({loaded:,.0f} blocks loaded by the agent)")
    return done, agent_seconds, confirmed - ready, hot


def warm_up(agent: AgentProcess, least: float, timeout: float, check_alive) -> tuple[bool, float]:
    """Waits at least `least` seconds, then until the agent's coverage is >= WARM after two
    cycles or more; returns whether it got there within `timeout`, and the seconds waited."""
    started = time.monotonic()

    def warm() -> bool:
        check_alive()
        return (time.monotonic() - started >= least and agent.metric("ccm_agent_cycles_total") >= 2
                and agent.metric("ccm_agent_coverage_ratio") >= WARM)

    return poll(warm, timeout, 1.0)


def steady_row(label: str, size: int, nbuffers: int, data_mb: int, before: Snapshot, after: Snapshot,
               sampler: CycleSampler, delays: list[float | None], prober: Prober, agent: AgentProcess,
               sessions_changed: bool) -> dict:
    elapsed = after.time - before.time
    counted = {name: after.counters[name] - before.counters[name] for name in COUNTERS}
    cycles = counted["ccm_agent_cycles_total"]
    per_cycle = (lambda value: value / cycles if cycles else None)  # noqa: E731

    def cpu(side: str) -> float:
        # Sessions that ended during the phase (a reconnect) count up to the last reading only.
        return sum(b - a for a, b in zip(before.cpu[side], after.cpu[side]) if a is not None and b is not None)

    row = {
        "postgresql": pg_version_text().removeprefix("PostgreSQL "), "size": label, "shared_buffers_bytes": size,
        "nbuffers": nbuffers, "data_mb": data_mb, "seconds": elapsed, "cycles": cycles,
        "cycles_per_s": cycles / elapsed, "cycle_ms_mean": none_or(sampler.mean("duration"), 1000),
        "hot_set_blocks": agent.metric("ccm_agent_hot_set_blocks"),
        "filter_bytes": sampler.mean("filter_bytes"), "list_bytes_mean": sampler.mean("list_bytes"),
        "blocks_sent": counted["ccm_agent_blocks_sent_total"], "blocks_loaded": counted["ccm_agent_blocks_loaded_total"],
        "blocks_sent_per_s": counted["ccm_agent_blocks_sent_total"] / elapsed,
        "blocks_loaded_per_s": counted["ccm_agent_blocks_loaded_total"] / elapsed,
        "load_tps": (after.commits - before.commits) / elapsed, "sessions_changed": sessions_changed,
    }
    for side in ("primary", "standby"):
        row[f"cpu_{side}_s"] = cpu(side)
    row["cpu_agent_s"] = (after.agent_cpu or 0.0) - (before.agent_cpu or 0.0)
    for who in ("primary", "standby", "agent"):
        seconds = row[f"cpu_{who}_s"]
        row[f"cpu_{who}_ms_per_cycle"] = none_or(per_cycle(seconds), 1000)
        row[f"cpu_{who}_pct"] = 100 * seconds / elapsed
    sockets_seen = all(x is not None for s in (before, after) for side in s.wire.values() for x in side)
    if before.ss_ok and after.ss_ok and sockets_seen and all(before.wire.values()):
        row["wire_source"] = "ss"
        for side in ("primary", "standby"):
            out = sum(b[0] - a[0] for a, b in zip(before.wire[side], after.wire[side]))
            back = sum(b[1] - a[1] for a, b in zip(before.wire[side], after.wire[side]))
            row[f"agent_to_{side}_bps"], row[f"{side}_to_agent_bps"] = out / elapsed, back / elapsed
    else:
        row["wire_source"] = "/proc/io (both nodes and /metrics together)"
        row["agent_out_bps"] = (after.agent_io[0] - before.agent_io[0]) / elapsed
        row["agent_in_bps"] = (after.agent_io[1] - before.agent_io[1]) / elapsed
    measured = [d * 1000 for d in delays if d is not None]
    row.update(probes=len(delays), probes_lost=sum(1 for d in delays if d is None),
               hot_to_cached_p50_ms=percentile(measured, 50), hot_to_cached_p99_ms=percentile(measured, 99),
               hot_to_cached_max_ms=max(measured, default=None),
               poll_ms=none_or(statistics.median(prober.poll_seconds) if prober.poll_seconds else None, 1000))
    return row


def none_or(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


# -- output ----------------------------------------------------------------------------------

def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("kB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def cpu_cell(row: dict, who: str) -> str:
    return f"{fmt(row[f'cpu_{who}_ms_per_cycle'], 1)} ({row[f'cpu_{who}_pct']:.2f}%)"


def wire_cells(row: dict) -> str:
    if row["wire_source"] == "ss":
        return " | ".join(f"{fmt_bytes(row[f'agent_to_{s}_bps'])}/s / {fmt_bytes(row[f'{s}_to_agent_bps'])}/s"
                          for s in ("primary", "standby"))
    return f"agent out {fmt_bytes(row['agent_out_bps'])}/s, in {fmt_bytes(row['agent_in_bps'])}/s (both nodes) | -"


def steady_line(row: dict) -> str:
    return (f"{row['size']}: {row['cycles']:.0f} cycles in {row['seconds']:.0f} s, CPU per cycle primary "
            f"{cpu_cell(row, 'primary')}, standby {cpu_cell(row, 'standby')}, agent {cpu_cell(row, 'agent')}; "
            f"wire agent->/<-primary | agent->/<-standby: {wire_cells(row)}; hot->cached p50 "
            f"{fmt(row['hot_to_cached_p50_ms'])} ms over {row['probes']} probes; agent RSS "
            f"{fmt(row['agent_rss_mb'])} MB (peak {fmt(row['agent_peak_mb'])} MB)"
            + (f"; WARNING: the agent's sessions changed during the phase, CPU and bytes are partial"
               if row["sessions_changed"] else ""))


STEADY_HEADER = (
    "| shared_buffers | buffers | hot set blocks | cycles/s | mean cycle ms "
    "| CPU per cycle, primary ms (% of a core) | standby ms (% of a core) | agent process ms (% of a core) "
    "| agent -> primary / primary -> agent | agent -> standby / standby -> agent | filter bytes "
    "| blocks sent/s | blocks loaded/s | hot -> cached p50 / p99 / max ms (probes) | load TPS |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def steady_table(rows: list[dict]) -> None:
    say(STEADY_HEADER)
    for r in rows:
        lost = f", {r['probes_lost']} timed out" if r["probes_lost"] else ""
        say(f"| {r['size']} | {r['nbuffers']:,} | {fmt(r['hot_set_blocks'])} | {r['cycles_per_s']:.2f} "
            f"| {fmt(r['cycle_ms_mean'], 1)} | {cpu_cell(r, 'primary')} | {cpu_cell(r, 'standby')} "
            f"| {cpu_cell(r, 'agent')} | {wire_cells(r)} | {fmt_bytes(r['filter_bytes'])} "
            f"| {r['blocks_sent_per_s']:.1f} | {r['blocks_loaded_per_s']:.1f} "
            f"| {fmt(r['hot_to_cached_p50_ms'])} / {fmt(r['hot_to_cached_p99_ms'])} / {fmt(r['hot_to_cached_max_ms'])} "
            f"({r['probes']}{lost}) | {r['load_tps']:.0f} |")
    say()
    say("CPU: utime + stime of the agent's sessions on each node (/proc/PID/stat; ccm_buffer_filter on the standby, "
        "ccm_hot_blocks on the primary, ccm_prewarm and its read-ahead threads on the standby, and the rest of "
        "the cycle's calls) and of the ccm-agent process, per cycle and as a share of one core over the phase. "
        "Bytes: the agent's TCP sockets to each node (ss: bytes_acked out, bytes_received in), per second. "
        "Blocks sent include the probes' pages. Hot -> cached: from the end of the probe's reads on the primary "
        "to the end of the pg_buffercache poll on the standby that found all its pages (an upper bound; one poll "
        + ", ".join(f"{r['size']} {fmt(r['poll_ms'])} ms" for r in rows) + ").")
    say("Per buffer and cycle: " + "; ".join(
        f"{r['size']} primary {fmt(per_buffer_ns(r, 'primary'))} ns, standby {fmt(per_buffer_ns(r, 'standby'))} ns"
        for r in rows) + " (linear growth keeps these constant).")
    say()


def per_buffer_ns(row: dict, who: str) -> float | None:
    ms = row[f"cpu_{who}_ms_per_cycle"]
    return None if ms is None else ms * 1e6 / row["nbuffers"]


EXTRAPOLATE = (("64GB", 64 * 2**30), ("256GB", 256 * 2**30))


def extrapolation(rows: list[dict], interval: float = 1.0) -> list[dict]:
    """Costs at EXTRAPOLATE's sizes, assuming every cost grows linearly with the number of
    buffers, from the largest measured size's cost per buffer."""
    base = max((r for r in rows if r["cycles"]), key=lambda r: r["nbuffers"], default=None)
    if base is None:
        return []
    say(f"### Extrapolated from {base['size']} ({base['nbuffers']:,} buffers), assuming each cost grows linearly "
        f"with shared_buffers (the filter covers every cached buffer and the scan every header) at one cycle per "
        f"{interval:g} s")
    ss = base["wire_source"] == "ss"
    say("| shared_buffers | buffers | CPU per cycle, primary ms (% of a core) | standby ms (% of a core) "
        + ("| agent -> primary / primary -> agent | agent -> standby / standby -> agent |" if ss else "| agent out / in |"))
    say("|---|---:|---:|---:|" + ("---:|---:|" if ss else "---:|"))
    out = []
    for label, size in EXTRAPOLATE:
        nbuffers = size // 8192
        scale = nbuffers / base["nbuffers"]
        row = {"size": label, "nbuffers": nbuffers, "extrapolated_from": base["size"]}
        cells = []
        for who in ("primary", "standby"):
            ms = base[f"cpu_{who}_ms_per_cycle"] * scale
            row[f"cpu_{who}_ms_per_cycle"] = ms
            row[f"cpu_{who}_pct"] = 100 * ms / 1000 / interval
            late = " (longer than the interval)" if ms > interval * 1000 else ""
            cells.append(f"{ms:,.0f} ({row[f'cpu_{who}_pct']:.1f}%){late}")
        keys = ([f"agent_to_{s}_bps" for s in ("primary", "standby")] + [f"{s}_to_agent_bps" for s in ("primary", "standby")]
                if ss else ["agent_out_bps", "agent_in_bps"])
        for key in keys:
            # Per second at the measured cycle rate, scaled to one cycle per interval.
            row[key] = base[key] * scale / base["cycles_per_s"] / interval
        if ss:
            cells += [f"{fmt_bytes(row[f'agent_to_{s}_bps'])}/s / {fmt_bytes(row[f'{s}_to_agent_bps'])}/s"
                      for s in ("primary", "standby")]
        else:
            cells.append(f"{fmt_bytes(row['agent_out_bps'])}/s / {fmt_bytes(row['agent_in_bps'])}/s")
        say(f"| {label} | {nbuffers:,} | " + " | ".join(cells) + " |")
        out.append(row)
    say()
    say("% of a core at one cycle per second: a cycle longer than the interval cannot keep that rate (the "
        "agent then runs cycles back to back). The blocks sent and loaded, and so part of the standby's CPU and "
        "the lists' bytes, depend on what changed rather than on the size; scaling them too overstates them.")
    say()
    return out


# -- entry points ----------------------------------------------------------------------------

def bench_steady(args: argparse.Namespace) -> list[dict]:
    """Every size of the steady options on the PostgreSQL in use (the caller picked it); prints
    the tables and returns one row per size (extrapolated rows not included)."""
    sizes = parse_sizes(option(args, "sizes"))
    say(f"## Steady-state cost of a warm standby per agent cycle (issue 14): {option(args, 'seconds')} s per size, "
        f"pgbench {option(args, 'clients')} clients at "
        f"{option(args, 'rate') or 'unlimited'} TPS ({option(args, 'write-percent')}% UPDATEs), agent interval 1 s")
    say()
    rows = [row for label, size in sizes for row in steady_size(label, size, args)]
    steady_table(rows)
    for exchange in dict.fromkeys(row["exchange"] for row in rows):
        say(f"#### {exchange}")
        extrapolation([row for row in rows if row["exchange"] == exchange])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", metavar="N|N,M,...|all",
                        help="PostgreSQL major version(s) to run (default: the newest installed one that has pg_ccm)")
    add_steady_arguments(parser, prefix="--")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a server setting for both nodes (repeatable)")
    args = parser.parse_args()
    args.set = server_settings(parser, args.set)
    try:
        parse_sizes(args.steady_sizes)
        versions = resolve_pg_versions(args.pg)
    except (ValueError, PgVersionError) as error:
        parser.error(str(error))
    say(f"# pg_ccm steady-state benchmark — {time.strftime('%Y-%m-%d %H:%M')} — `{' '.join(sys.argv)}`")
    say()
    for version in versions:
        use_pg_version(version)
        say(f"# {pg_version_text()} ({pg_bin()})")
        say()
        bench_steady(args)


if __name__ == "__main__":
    main()
