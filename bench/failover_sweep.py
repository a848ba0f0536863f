#!/usr/bin/env python3
"""The failover benchmark's sweep (issue 28): every concurrency, every storage setting, every
arm, on one data set, with separate budgets per node.

    python3 bench/failover_sweep.py [--pg 18] [--scale 300] [--shared-buffers 5GB]
                                    [--clients 4,16,64] [--storage both] [--arms ccm,none] [--rounds 3]
    make bench ARGS='--only failover'                    # the same, through bench/ccm_bench.py

It builds the pgbench data set once (`pgbench -i`, a stopped template data directory) and,
for each storage setting (local disk; cloud-like: each node's reads throttled to 3000 IOPS and
125 MB/s), each concurrency and each arm (ARMS of demo/failover_demo.py: `ccm` = ccm-agent
with its defaults, `ccm-hot-set-only`, `none` = without CCM), runs one failover with
`demo/failover_demo.py`'s run_once: a primary copied from the template and a standby cloned
from it, each node in cgroups of its own (a CPU set, a blkio group on the data disk, CPU
accounting; the pgbench client on the CPU of the node it drives, the agent on the standby's),
the primary prewarmed and worked until its storage reads settle, a measured window of
--pre-seconds, SIGKILL, promotion, and --after-seconds of the same workload on the new
primary (Aurora's mix: -b tpcb-like@1 -b select-only@20 -M prepared).

Before the runs, fio measures what each storage setting gives a node (8 kB random reads at
queue depth 1 and 32, 1 MB sequential reads at depth 4, direct I/O, inside a blkio group
like a node's); every run also reports what the disk served its nodes (blkio counters).

Output: the tables (a summary of the sweep, then every comparison in full, with the targets
and, where one is missed, where the time and reads went) on stdout and in
OUTPUT_DIR/failover-sweep.md; every figure and series in OUTPUT_DIR/failover-sweep.json; a chart
per comparison, OUTPUT_DIR/failover-sweep-STORAGE-CLIENTS.png (the cloud-like 16-client one is
the headline chart). A comparison whose arms' pre-failover TPS differ by more than 5% is
marked NOT VALID.

One run per arm says little on a machine whose speed drifts: two arms run one after the other
here have differed by 9-13% in pre-failover TPS. With --rounds N every comparison runs N times,
the arms' order reversed every other round, each round a comparison (and a validity check) of
its own, and the summary adds each figure's median and range over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "demo"))

import failover_demo as demo  # noqa: E402  (demo/failover_demo.py)
from harness.agent import AGENT_BIN  # noqa: E402
from harness.cgroups import Budget, NodeCgroups, data_device  # noqa: E402
from harness.cluster import pg_bin, pg_version_text  # noqa: E402

say = demo.say


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=demo.HelpFormatter)
    parser.add_argument("--pg", type=int, metavar="N", help="PostgreSQL major version (default: the newest with pg_ccm)")
    parser.add_argument("--scale", type=int, default=300, help="pgbench scale of the data set (about 15 MB per unit)")
    parser.add_argument("--shared-buffers", type=demo.memory, default="5GB", help="shared_buffers of both nodes")
    parser.add_argument("--clients", default="4,16,64", help="the concurrencies, comma-separated")
    parser.add_argument("--arms", default="ccm,none", help=f"the arms, comma-separated, among {','.join(demo.ARMS)}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="each comparison this many times, the arms' order reversed every other round (A B, B A, "
                             "...), so that the machine's drift does not favour one arm; the summary then gives each "
                             "figure's median and range over the rounds")
    parser.add_argument("--warm-seconds", type=int, default=60,
                        help="least workload on the primary before the steady-state check may pass")
    parser.add_argument("--after-seconds", type=int, default=300,
                        help="workload on the new primary (minutes: without CCM on cloud-like storage the warm-up is long)")
    parser.add_argument("--agent-interval", default="1s", help="ccm-agent --interval")
    parser.add_argument("--usage-threshold", type=int, default=3, choices=range(0, 5), metavar="0-4",
                        help="pg_ccm's ccm.usage_threshold on both nodes")
    parser.add_argument("--set", action="append", default=[], type=demo.setting, metavar="NAME=VALUE",
                        help="extra postgresql.conf setting for every node, repeatable")
    parser.add_argument("--fio-seconds", type=int, default=8, help="length of each fio job (0: no fio)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "demo-output", help="where the tables, figures and charts go")
    parser.add_argument("--keep", action="store_true", help="keep the clusters' directories (the path is printed)")
    demo.add_budget_arguments(parser)
    parser.set_defaults(storage="both")
    args = parser.parse_args(argv)
    try:
        args.client_counts = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--clients: expected numbers such as 4,16,64, got {args.clients!r}")
    unknown = [a for a in args.arms.split(",") if a not in demo.ARMS]
    if unknown or not args.arms:
        parser.error(f"--arms: unknown {','.join(unknown)}; choose among {','.join(demo.ARMS)}")
    args.arm_list = [demo.ARMS[a] for a in args.arms.split(",")]
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    args.separate_budgets = "on"  # the point of the sweep
    args.scenario, args.rejoin, args.clients = "large", False, args.client_counts[0]
    demo.resolve_budget_arguments(parser, args)
    if args.after_seconds < demo.READS_WINDOW:
        parser.error(f"--after-seconds must be >= {demo.READS_WINDOW} (the read figures cover the first {demo.READS_WINDOW} s)")
    return args


def preflight(args: argparse.Namespace) -> list[str]:
    problems = []
    if any(arm.agent_args is not None for arm in args.arm_list) and not AGENT_BIN.exists():
        problems.append(f"{AGENT_BIN} is missing: run scripts/install.sh (make bench does)")
    return problems + demo.environment_problems(args, ("fio",) if args.fio_seconds else ())


# -- what the disk gives -------------------------------------------------------------------

FIO_JOBS = (  # name, block size, queue depth, pattern
    ("8 kB random reads, queue depth 1", "8k", 1, "randread"),
    ("8 kB random reads, queue depth 32", "8k", 32, "randread"),
    ("1 MB sequential reads, queue depth 4", "1M", 4, "read"),
)


def fio_probe(storage: demo.Storage, workdir: Path, seconds: int) -> list[dict]:
    """fio inside a blkio group with a node's limits: read requests per second, MB per
    second and mean latency of each FIO_JOBS job (direct I/O, so the page cache is not in
    the way), on a 1 GiB file in the benchmark's directory."""
    device = data_device(workdir)
    path = workdir / "fio-probe.bin"
    rows = []
    with NodeCgroups("pg_ccm-fio", Budget(read_iops=storage.read_iops, read_mbps=storage.read_mbps), device) as group:
        for label, block, depth, pattern in FIO_JOBS:
            argv = ["fio", "--name=probe", f"--filename={path}", "--size=1G", "--direct=1", "--ioengine=libaio",
                    f"--rw={pattern}", f"--bs={block}", f"--iodepth={depth}", "--time_based", f"--runtime={seconds}",
                    "--output-format=json"]
            out = subprocess.run([*group.wrapper, *argv], capture_output=True, text=True, check=True).stdout
            read = json.loads(out[out.index("{"):])["jobs"][0]["read"]
            rows.append({"storage": storage.name, "job": label, "iops": round(read["iops"]),
                         "mb_per_s": round(read["bw_bytes"] / 2**20, 1), "mean_latency_ms": round(read["clat_ns"]["mean"] / 1e6, 3)})
    path.unlink(missing_ok=True)
    return rows


# -- the summary ---------------------------------------------------------------------------


def summary(results: list[demo.RunResult], verdicts: dict, args: argparse.Namespace) -> str:
    """One line per storage setting, concurrency and arm: the figures a reader compares."""
    after = args.after_seconds
    lines = [
        "| storage | clients | arm | pre-failover TPS | valid | to 90%: first / kept | to 95%: kept | first 10 s TPS | "
        "p99 before / first 10 s / worst, ms | new primary's reads, first 60 s: pg_stat_io / disk requests | "
        "old primary's reads, last 60 s: pg_stat_io / disk requests | coverage at the kill: hot / all | targets |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in results:
        key = demo.group_key(run)
        group = verdicts.get(key, {})
        valid = group.get("validity", {})
        checks = group.get(run.mode, {})
        targets = [name for name, check in checks.items() if isinstance(check, dict) and "met" in check]
        missed = [name for name in targets if not checks[name]["met"]]
        verdict = "-" if not targets else ("all met" if not missed else "missed: " + ", ".join(missed))
        lines.append(
            f"| {run.storage} | {run.clients} | {run.mode} | {run.pre_failover_tps:.0f} | "
            f"{'yes' if valid.get('valid') else 'NO' if valid else '-'} ({float(valid.get('spread', 0)):.1%}) | "
            f"{demo.fmt_seconds(run.seconds_to_90pct_first, after)} / {demo.fmt_seconds(run.seconds_to_90pct_stay, after)} | "
            f"{demo.fmt_seconds(run.seconds_to_95pct_stay, after)} | {demo.fmt_pct(run.first_10s_pct)} | "
            f"{demo.fmt_ms(run.pre_failover_p99_ms)} / {demo.fmt_ms(run.first_10s_p99_ms)} / {demo.fmt_ms(run.worst_p99_after_ms)} | "
            f"{demo.fmt_count(run.new_primary_reads_60s)} / {demo.fmt_count(run.new_primary_device_reads_60s)} | "
            f"{demo.fmt_count(run.old_primary_reads)} / {demo.fmt_count(run.old_primary_device_reads)} | "
            f"{run.coverage_at_failover:.1%} / {run.cached_coverage_at_failover:.1%} | {verdict} |")
    return "\n".join(lines)


def fio_table(rows: list[dict]) -> str:
    lines = ["| storage | fio job | read requests/s | MB/s | mean latency, ms |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['storage']} | {r['job']} | {r['iops']} | {r['mb_per_s']} | {r['mean_latency_ms']} |" for r in rows]
    return "\n".join(lines)


def write_outputs(results: list[demo.RunResult], fio: list[dict], args: argparse.Namespace, argv: list[str],
                  started: datetime.datetime, wall: float) -> None:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        verdicts = demo.print_table(results, args)
        print()
        print(demo.explanation(results))
    text = "\n\n".join([
        f"# Failover sweep on {pg_version_text()}, {started:%Y-%m-%d %H:%M}",
        f"```sh\npython3 bench/failover_sweep.py {' '.join(argv)}\n```",
        f"pgbench scale {args.scale} with shared_buffers {args.shared_buffers} on both nodes; Aurora's mix "
        f"(-b tpcb-like@1 -b select-only@20 -M prepared); {args.pre_seconds} s measured on the settled old primary, "
        f"{args.after_seconds} s on the new one; separate budgets: {results[0].cpu_split if results else '-'}. "
        f"Whole sweep: {wall / 60:.0f} min.",
        "## What the disk gave (fio, inside a node's blkio group)", fio_table(fio) if fio else "(fio not run)",
        "## Summary", summary(results, verdicts, args),
        *(["## Over the rounds: median [lowest-highest]", table] if (table := rounds_table(results, verdicts)) else []),
        buffer.getvalue(),
    ])
    print(text)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "failover-sweep.md").write_text(text + "\n")
    (args.output_dir / "failover-sweep.json").write_text(json.dumps({
        "command": f"bench/failover_sweep.py {' '.join(argv)}", "started": started.isoformat(timespec="seconds"),
        "wall_seconds": round(wall), "postgresql": {"major": args.pg, "version": pg_version_text(), "bin": str(pg_bin())},
        "settings": demo.json_settings(args),
        "fio": fio, "verdicts": verdicts, "runs": [asdict(r) for r in results],
    }, indent=1))
    for key in dict.fromkeys(demo.group_key(r) for r in results):
        runs = [r for r in results if demo.group_key(r) == key]
        suffix = f"-round{runs[0].round}" if runs[0].rounds > 1 else ""
        demo.chart(runs, args.output_dir / f"failover-sweep-{runs[0].storage}-{runs[0].clients}{suffix}.png", args)
    say(f"tables: {args.output_dir / 'failover-sweep.md'}; figures: {args.output_dir / 'failover-sweep.json'}; "
        f"charts: {args.output_dir}/failover-sweep-*.png")


def round_orders(arms: list[demo.Arm], rounds: int) -> list[list[demo.Arm]]:
    """The arms' order in each round: as given, then reversed, alternately (A B, B A, A B ...),
    so that a machine that speeds up or slows down over the sweep favours no arm."""
    return [list(arms) if number % 2 == 0 else list(reversed(arms)) for number in range(rounds)]


ROUND_FIGURES = (  # label, RunResult attribute, format
    ("pre-failover TPS", "pre_failover_tps", demo.fmt_count),
    ("first 10 s TPS, % of pre-failover", "first_10s_pct", demo.fmt_pct),
    ("to 90%: first, s", "seconds_to_90pct_first", lambda v: "-" if v is None else f"{v:.1f}"),
    ("to 90%: kept, s", "seconds_to_90pct_stay", lambda v: "-" if v is None else f"{v:.1f}"),
    ("p99 in the first 10 s, ms", "first_10s_p99_ms", demo.fmt_ms),
    ("new primary's disk requests, first 60 s", "new_primary_device_reads_60s", demo.fmt_count),
)


def spread_cell(values: list, fmt) -> str:
    """Median [lowest-highest] of a figure over the rounds; a round without the figure (not
    reached within the run, say) is shown apart."""
    known = sorted(v for v in values if v is not None)
    if not known:
        return "-"
    missing = len(values) - len(known)
    cell = fmt(statistics.median(known)) + (f" [{fmt(known[0])}-{fmt(known[-1])}]" if len(known) > 1 else "")
    return cell + (f" ({missing} of {len(values)} not reached)" if missing else "")


def rounds_table(results: list[demo.RunResult], verdicts: dict) -> str:
    """With --rounds > 1: per storage setting, concurrency and arm, each figure's median and
    range over the rounds, and how many rounds' comparisons were valid."""
    if not results or results[0].rounds < 2:
        return ""
    lines = ["| storage | clients | arm | valid rounds | " + " | ".join(label for label, _, _ in ROUND_FIGURES) + " |",
             "|---|---:|---|---:|" + "---:|" * len(ROUND_FIGURES)]
    for storage, clients, mode in dict.fromkeys((r.storage, r.clients, r.mode) for r in results):
        runs = [r for r in results if (r.storage, r.clients, r.mode) == (storage, clients, mode)]
        valid = sum(1 for r in runs if verdicts.get(demo.group_key(r), {}).get("validity", {}).get("valid"))
        cells = [spread_cell([getattr(r, attribute) for r in runs], fmt) for _, attribute, fmt in ROUND_FIGURES]
        lines.append(f"| {storage} | {clients} | {mode} | {valid} of {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def estimate_minutes(args: argparse.Namespace) -> float:
    """Set-up per run (two copies of the data set, a cold standby, the primary prewarmed),
    settling (guessed: a minute past --warm-seconds), the two windows, snapshots and the
    latency logs; the data set once; fio."""
    per_run = 60 + args.scale / 4 + args.warm_seconds + 60 + args.pre_seconds + args.after_seconds + 30
    runs = len(args.storages) * len(args.client_counts) * len(args.arm_list) * args.rounds
    return (args.scale * 0.8 + runs * per_run + len(args.storages) * len(FIO_JOBS) * args.fio_seconds) / 60


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not demo.ready(preflight(args), "failover_sweep"):
        return 2
    started, started_wall = time.monotonic(), datetime.datetime.now().astimezone()
    workdir = Path(tempfile.mkdtemp(prefix="pg_ccm-sweep-"))
    workdir.chmod(0o755)
    scenario = demo.Scenario("large", args.scale, args.shared_buffers, demo.AURORA_MIX,
                             f"pgbench scale {args.scale} (about {15 * args.scale} MB), shared_buffers {args.shared_buffers} "
                             "on both nodes, uniform access")
    say(f"failover sweep on {pg_version_text()} ({pg_bin()}): storage {', '.join(s.name for s in args.storages)}; "
        f"clients {', '.join(map(str, args.client_counts))}; arms {', '.join(a.name for a in args.arm_list)}; "
        f"about {estimate_minutes(args):.0f} minutes")
    results: list[demo.RunResult] = []
    fio: list[dict] = []
    try:
        if args.fio_seconds:
            for storage in args.storages:
                say(f"fio: what {storage.name} storage gives a node ({storage.description})")
                fio += fio_probe(storage, workdir, args.fio_seconds)
            print(fio_table(fio), flush=True)
        template = demo.build_template(scenario, args, workdir)
        for storage in args.storages:
            for clients in args.client_counts:
                for number, arms in enumerate(round_orders(args.arm_list, args.rounds), 1):
                    longest = 0.0  # the arms compared warm up at least as long as the ones before them
                    for arm in arms:
                        results.append(run := demo.run_once(scenario, template, arm, args, workdir, storage, clients, longest))
                        run.round, run.rounds = number, args.rounds
                        longest = max(longest, run.warm_before_window_s or 0.0)
    except KeyboardInterrupt as stop:
        say(f"interrupted ({stop or 'Ctrl-C'}): clusters, agent and cgroups removed")
        if results:  # hours of runs are not thrown away: the tables of those that ended
            say(f"the {len(results)} run(s) that ended before the interruption:")
            write_outputs(results, fio, args, argv, started_wall, time.monotonic() - started)
        return 130
    finally:
        with demo.shielded():
            if args.keep:
                say(f"kept the clusters' directories in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    write_outputs(results, fio, args, argv, started_wall, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
