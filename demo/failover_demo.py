#!/usr/bin/env python3
"""pg_ccm failover demo: what a warm standby is worth when the primary dies.

Runs the same real failover twice, once with ccm-agent keeping the tier-0 standby's
shared_buffers warm and once without CCM, and prints the two side by side:

  1. a primary and a streaming standby on loopback ports, pg_ccm preloaded on both,
     made from one pgbench data set (built once, copied for each run);
  2. Aurora's CCM-test workload on the primary until it is warm:
     pgbench -b tpcb-like@1 -b select-only@20 -M prepared -P 1;
  3. the standby's data files are dropped from the OS page cache (sync, then
     POSIX_FADV_DONTNEED): on one machine both nodes would otherwise share the kernel's
     cache, while on separate hosts (and on Aurora, which has no double buffering) the new
     primary has only its shared_buffers. This is done in both runs;
  4. the primary is killed with SIGKILL, the standby promoted, and the same workload runs
     against the new primary, with TPS and storage reads (pg_stat_database.blks_read)
     recorded every second.

Writes demo-output/failover.png (TPS and reads per second around the failover, both runs)
and demo-output/results.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.agent import AGENT_BIN, AgentProcess  # noqa: E402
from harness.cluster import PG_BIN, Cluster, Node, coverage, pgbench  # noqa: E402

PROGRESS = re.compile(r"progress: ([\d.]+) s, ([\d.]+) tps")


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Scenario:
    name: str
    scale: int
    shared_buffers: str
    # pgbench arguments selecting the workload (after -M prepared -P 1 -c -j -T).
    workload: list[str]
    description: str


def scenarios(args: argparse.Namespace, workdir: Path) -> list[Scenario]:
    uniform = Scenario(
        "uniform",
        args.scale,
        args.shared_buffers,
        ["-b", "tpcb-like@1", "-b", "select-only@20"],
        f"pgbench scale {args.scale}, shared_buffers {args.shared_buffers}: the data fits in the cache",
    )
    skewed_script = workdir / "select-skewed.sql"
    skewed_script.write_text(
        "\\set aid random_exponential(1, 100000 * :scale, 8)\n"
        "SELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n"
    )
    skewed_script.chmod(0o644)
    skewed = Scenario(
        "skewed",
        args.skewed_scale,
        args.skewed_shared_buffers,
        ["-b", "tpcb-like@1", "-f", f"{skewed_script}@20"],
        f"pgbench scale {args.skewed_scale} (about 3x shared_buffers {args.skewed_shared_buffers}), "
        "exponential access to pgbench_accounts: the hot set is a subset",
    )
    chosen = {"uniform": [uniform], "skewed": [skewed], "all": [uniform, skewed]}[args.scenario]
    return chosen


class Workload:
    """pgbench with per-second progress, parsed live from its stderr."""

    def __init__(self, node: Node, scenario: Scenario, clients: int, seconds: int, label: str):
        self.tps: list[float] = []
        self.label = label
        argv = [str(PG_BIN / "pgbench"), "-h", "127.0.0.1", "-p", str(node.port), "-U", "postgres",
                "-n", "-M", "prepared", "-P", "1", "-c", str(clients), "-j", "2", "-T", str(seconds),
                *scenario.workload, "postgres"]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            match = PROGRESS.search(line)
            if match:
                self.tps.append(float(match.group(2)))
                print(f"\r    {self.label}: {float(match.group(1)):5.0f} s  {float(match.group(2)):9.0f} tps   ", end="", flush=True)

    def wait(self) -> None:
        self.process.wait()
        self.reader.join()
        print(flush=True)


class ReadSampler:
    """Samples sum(blks_read) of pg_stat_database every second."""

    def __init__(self, node: Node):
        self.node = node
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()
        self.thread.start()

    def _run(self) -> None:
        try:
            with self.node.connect() as conn:
                while not self.stop.is_set():
                    value = conn.execute("SELECT sum(blks_read)::int8 FROM pg_stat_database").fetchone()[0]
                    self.samples.append((time.monotonic() - self.started, int(value)))
                    conn.execute("SELECT pg_stat_clear_snapshot()")
                    self.stop.wait(1.0)
        except Exception as error:  # the series just ends; the totals are read separately
            say(f"read sampler stopped: {error}")

    def per_second(self) -> list[float]:
        return [b[1] - a[1] for a, b in zip(self.samples, self.samples[1:])]

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()


@dataclass
class RunResult:
    mode: str
    scenario: str
    pre_failover_tps: float = 0.0
    seconds_to_90pct_first: float | None = None
    seconds_to_90pct_stay: float | None = None
    first_10s_pct: float = 0.0
    blocks_read_first_60s: int = 0
    coverage_at_failover: float = 0.0
    hot_buffers_at_failover: int = 0
    promote_seconds: float = 0.0
    rejoin_coverage: float | None = None
    rejoin_seconds: float | None = None
    tps_before: list[float] = field(default_factory=list)
    tps_after: list[float] = field(default_factory=list)
    reads_after: list[float] = field(default_factory=list)


def first_reaching(series: list[float], threshold: float) -> float | None:
    for second, value in enumerate(series):
        if value >= threshold:
            return float(second + 1)
    return None


def reaching_and_staying(series: list[float], threshold: float) -> float | None:
    for second in range(len(series)):
        if all(value >= threshold for value in series[second:]):
            return float(second + 1)
    return None


def build_template(scenario: Scenario, workdir: Path) -> Path:
    """One primary data directory with the pgbench data, stopped, to copy for each run."""
    say(f"[{scenario.name}] building the data set once: pgbench -i -s {scenario.scale}")
    cluster = Cluster(settings={"shared_buffers": f"'{scenario.shared_buffers}'"}, base=workdir / f"template-{scenario.name}")
    node = cluster.primary
    cluster.init_primary(node)
    node.start()
    node.sql("CREATE EXTENSION pg_ccm")
    node.sql("CREATE EXTENSION pg_buffercache")
    started = time.monotonic()
    pgbench(node, "-i", "-s", str(scenario.scale), "-q")
    node.sql("VACUUM ANALYZE")
    node.sql("CHECKPOINT")
    node.stop()
    say(f"[{scenario.name}] data set ready in {time.monotonic() - started:.0f} s "
        f"({node.datadir} , {subprocess.run(['du', '-sh', str(node.datadir)], capture_output=True, text=True).stdout.split()[0]})")
    return node.datadir


def run_once(scenario: Scenario, template: Path, with_ccm: bool, args: argparse.Namespace, workdir: Path) -> RunResult:
    mode = "with ccm-agent" if with_ccm else "without CCM"
    result = RunResult(mode=mode, scenario=scenario.name)
    base = Path(tempfile.mkdtemp(prefix=f"run-{scenario.name}-{'ccm' if with_ccm else 'none'}-", dir=workdir))
    cluster = Cluster(settings={"shared_buffers": f"'{scenario.shared_buffers}'"}, base=base, keep=args.keep)
    agent = None
    try:
        say(f"[{scenario.name} / {mode}] primary and standby from the data set")
        cluster.create(template=template)
        say(f"[{scenario.name} / {mode}] standby made cold (restartpoint, restart, page cache dropped)")
        cluster.make_standby_cold()
        if with_ccm:
            # Both strings name both nodes, as Patroni users write them: the agent picks each
            # side by role, so it follows the failover without being told.
            agent = AgentProcess(both_nodes(cluster, "read-write"), both_nodes(cluster, "standby"), base, interval="1s").start()
            say(f"[{scenario.name} / {mode}] ccm-agent running (metrics on 127.0.0.1:{agent.metrics_port})")

        say(f"[{scenario.name} / {mode}] warming the primary for {args.warm_seconds} s")
        warm = Workload(cluster.primary, scenario, args.clients, args.warm_seconds, "primary")
        warm.wait()
        result.tps_before = warm.tps
        tail = warm.tps[-20:] if len(warm.tps) >= 20 else warm.tps
        result.pre_failover_tps = statistics.mean(tail) if tail else 0.0

        result.coverage_at_failover, result.hot_buffers_at_failover = coverage(cluster.primary, cluster.standby)
        say(f"[{scenario.name} / {mode}] coverage at failover: {result.coverage_at_failover:.1%} of "
            f"{result.hot_buffers_at_failover} hot buffers (pg_buffercache on both nodes)")

        say(f"[{scenario.name} / {mode}] dropping the standby's files from the OS page cache (separate-host emulation)")
        cluster.standby.drop_os_cache()
        say(f"[{scenario.name} / {mode}] FAILOVER: SIGKILL the primary, promote the standby")
        cluster.primary.kill()
        started = time.monotonic()
        cluster.standby.promote()
        result.promote_seconds = time.monotonic() - started
        slot = cluster.reserve_wal_for_rejoin(cluster.standby) if with_ccm else None

        reads_at_promotion = int(cluster.standby.one("SELECT sum(blks_read)::int8 FROM pg_stat_database"))
        sampler = ReadSampler(cluster.standby)
        after = Workload(cluster.standby, scenario, args.clients, args.after_seconds, "new primary")
        after.wait()
        sampler.finish()
        time.sleep(1.5)  # backends flush their statistics when they exit
        reads_after = int(cluster.standby.one("SELECT sum(blks_read)::int8 FROM pg_stat_database"))
        result.blocks_read_first_60s = reads_after - reads_at_promotion
        result.tps_after = after.tps
        result.reads_after = sampler.per_second()

        threshold = 0.9 * result.pre_failover_tps
        result.seconds_to_90pct_first = first_reaching(after.tps, threshold)
        result.seconds_to_90pct_stay = reaching_and_staying(after.tps, threshold)
        first10 = after.tps[:10]
        result.first_10s_pct = 100.0 * statistics.mean(first10) / result.pre_failover_tps if first10 and result.pre_failover_tps else 0.0
        if agent is not None:
            try:
                rejoin(cluster, scenario, args, result, slot)
            except Exception as error:  # the failover figures stand on their own
                say(f"[{scenario.name} / {mode}] rejoining the old primary failed: {error}")
        return result
    finally:
        if agent is not None:
            agent.stop()
        cluster.destroy()


def both_nodes(cluster: Cluster, target_session_attrs: str) -> str:
    a, b = cluster.primary, cluster.standby
    return (f"host=127.0.0.1,127.0.0.1 port={a.port},{b.port} user=postgres dbname=postgres "
            f"connect_timeout=2 target_session_attrs={target_session_attrs}")


def rejoin(cluster: Cluster, scenario: Scenario, args: argparse.Namespace, result: RunResult, slot: str | None) -> None:
    """The old primary comes back as a standby of the new one; the running agent warms it."""
    old_primary, new_primary = cluster.primary, cluster.standby
    say(f"[{scenario.name} / {result.mode}] rejoining the old primary as a standby of the new one (pg_rewind); "
        "the agent is neither restarted nor reconfigured")
    cluster.rejoin_as_standby(old_primary, new_primary, slot=slot)
    cluster.primary, cluster.standby = new_primary, old_primary
    cluster.wait_caught_up()
    load = Workload(new_primary, scenario, args.clients, 30, "new primary")
    started = time.monotonic()
    while time.monotonic() - started < 30:
        fraction, _ = coverage(new_primary, old_primary)
        if fraction >= 0.99:
            break
        time.sleep(0.5)
    result.rejoin_coverage, result.rejoin_seconds = fraction, time.monotonic() - started
    load.process.terminate()
    load.wait()
    say(f"[{scenario.name} / {result.mode}] rejoined old primary holds {fraction:.1%} of the new primary's hot set "
        f"after {result.rejoin_seconds:.0f} s")


def fmt_seconds(value: float | None, limit: int) -> str:
    return f"{value:.0f} s" if value is not None else f"> {limit} s"


def print_table(results: list[RunResult], args: argparse.Namespace) -> None:
    for scenario in dict.fromkeys(r.scenario for r in results):
        runs = [r for r in results if r.scenario == scenario]
        print()
        print(f"## {scenario}")
        width = 60
        print(f"| {'figure':<{width}} |" + "".join(f" {r.mode:>18} |" for r in runs))
        print("|" + "-" * (width + 2) + "|" + "".join("-" * 20 + "|" for _ in runs))
        rows = [
            ("pre-failover TPS (mean of the last 20 s)", [f"{r.pre_failover_tps:.0f}" for r in runs]),
            ("coverage at failover (hot buffers cached on the standby)", [f"{r.coverage_at_failover:.1%}" for r in runs]),
            ("promotion took", [f"{r.promote_seconds:.1f} s" for r in runs]),
            ("time to 90% of pre-failover TPS (first reached)", [fmt_seconds(r.seconds_to_90pct_first, args.after_seconds) for r in runs]),
            ("time to 90% of pre-failover TPS (and staying there)", [fmt_seconds(r.seconds_to_90pct_stay, args.after_seconds) for r in runs]),
            ("TPS in the first 10 s after promotion, % of pre-failover", [f"{r.first_10s_pct:.0f}%" for r in runs]),
            (f"blocks read from storage, first {args.after_seconds} s", [f"{r.blocks_read_first_60s}" for r in runs]),
            ("rejoined old primary: coverage of the new primary's hot set", [
                f"{r.rejoin_coverage:.1%} in {r.rejoin_seconds:.0f} s" if r.rejoin_coverage is not None else "-" for r in runs]),
        ]
        for label, values in rows:
            print(f"| {label:<{width}} |" + "".join(f" {v:>18} |" for v in values))
        with_ccm = next((r for r in runs if r.mode == "with ccm-agent"), None)
        without = next((r for r in runs if r.mode == "without CCM"), None)
        if with_ccm and without and without.blocks_read_first_60s:
            ratio = with_ccm.blocks_read_first_60s / without.blocks_read_first_60s
            print(f"\nstorage reads with CCM: {ratio:.1%} of the run without CCM")
        if with_ccm:
            checks = [
                ("≥ 90% of pre-failover TPS within 2 s of promotion", with_ccm.seconds_to_90pct_first is not None and with_ccm.seconds_to_90pct_first <= 2),
                ("coverage at failover ≥ 99%", with_ccm.coverage_at_failover >= 0.99),
            ]
            if without and without.blocks_read_first_60s:
                checks.append(("storage reads in the first 60 s ≤ 5% of the run without CCM",
                               with_ccm.blocks_read_first_60s <= 0.05 * without.blocks_read_first_60s))
            for label, met in checks:
                print(f"target {'met' if met else 'NOT met'}: {label}")


def chart(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenario_names = list(dict.fromkeys(r.scenario for r in results))
    figure, axes = plt.subplots(2, len(scenario_names), figsize=(7 * len(scenario_names), 8), squeeze=False)
    colors = {"with ccm-agent": "tab:green", "without CCM": "tab:red"}
    for column, scenario in enumerate(scenario_names):
        tps_axis, reads_axis = axes[0][column], axes[1][column]
        for run in (r for r in results if r.scenario == scenario):
            before = run.tps_before[-30:]
            xs = list(range(-len(before), 0)) + list(range(1, len(run.tps_after) + 1))
            tps_axis.plot(xs, before + run.tps_after, label=run.mode, color=colors[run.mode])
            reads_axis.plot(range(1, len(run.reads_after) + 1), run.reads_after, label=run.mode, color=colors[run.mode])
        for axis in (tps_axis, reads_axis):
            axis.axvline(0, color="black", linestyle="--", linewidth=1)
            axis.legend()
            axis.grid(alpha=0.3)
        tps_axis.set_title(f"{scenario}: TPS around the failover (promotion at 0)")
        tps_axis.set_ylabel("transactions per second")
        reads_axis.set_title(f"{scenario}: new primary's storage reads (blks_read per second)")
        reads_axis.set_xlabel("seconds after promotion")
        reads_axis.set_ylabel("blocks read per second")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=50, help="pgbench scale of the uniform scenario (default: %(default)s, about 750 MB)")
    parser.add_argument("--shared-buffers", default="1GB", help="shared_buffers of both nodes, uniform scenario (default: %(default)s)")
    parser.add_argument("--skewed-scale", type=int, default=50, help="pgbench scale of the skewed scenario (default: %(default)s)")
    parser.add_argument("--skewed-shared-buffers", default="256MB", help="shared_buffers, skewed scenario (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=4, help="pgbench clients (default: %(default)s)")
    parser.add_argument("--warm-seconds", type=int, default=60, help="workload on the primary before the failover (default: %(default)s)")
    parser.add_argument("--after-seconds", type=int, default=60, help="workload on the new primary (default: %(default)s)")
    parser.add_argument("--scenario", choices=["uniform", "skewed", "all"], default="uniform", help="(default: %(default)s)")
    parser.add_argument("--only", choices=["ccm", "none", "both"], default="both", help="which runs (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "demo-output", help="(default: %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the clusters' directories")
    args = parser.parse_args()

    if not AGENT_BIN.exists():
        print(f"{AGENT_BIN} is missing: run scripts/install.sh (make demo does)", file=sys.stderr)
        return 1
    args.output_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pg_ccm-demo-"))
    subprocess.run(["chmod", "755", str(workdir)], check=True)
    started = time.monotonic()
    results: list[RunResult] = []
    try:
        for scenario in scenarios(args, workdir):
            say(f"scenario {scenario.name}: {scenario.description}")
            template = build_template(scenario, workdir)
            modes = {"ccm": [True], "none": [False], "both": [True, False]}[args.only]
            for with_ccm in modes:
                results.append(run_once(scenario, template, with_ccm, args, workdir))
    except KeyboardInterrupt:
        say("interrupted; clusters stopped")
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    print_table(results, args)
    (args.output_dir / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    chart(results, args.output_dir / "failover.png")
    print(f"\nchart: {args.output_dir / 'failover.png'}   figures: {args.output_dir / 'results.json'}")
    print(f"whole demo: {time.monotonic() - started:.0f} s")
    print("Separate hosts are emulated by dropping the standby's files from the OS page cache just before\n"
          "the failover, in both runs: the new primary starts with only what its shared_buffers hold.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
