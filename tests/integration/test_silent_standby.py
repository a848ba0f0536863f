"""A standby that goes silent costs the other standbys nothing.

Silent: a partition, a frozen VM. Here its postmaster and every child are stopped with
SIGSTOP: the kernel still accepts its connections and acknowledges what is sent on them,
but nothing ever answers, so every call the agent makes to it runs into a timeout. The agent
runs with a 1 s interval, statement_timeout 25 s and connect_timeout 10 s (a call's deadline
35 s, as with the defaults, 30 s and 5 s; the longer connect timeout sets what a reconnect
would cost the others well apart from what a loaded machine does to a cycle), and warms three
standbys; the one in the middle of the standby string goes silent.
What must hold for each of the two others, in two 20 s windows, the first from the moment
the standby goes silent and the second once it has been reported down (its retries):

- cadence: the agent serves it at least once per 1.5 intervals on average, and never makes
  it wait more than 7 intervals (less than a connect timeout);
- a table that becomes hot on the primary at the window's start is in its cache within 5 s;
- it holds >= 99% of the primary's hot set throughout, but for a dip that lasts one sample
  (the primary's hot set grows in bursts, 140 blocks in one second seen here, and the agent
  sends a burst in its next cycle: a sample taken between the two sees the lag);

and the silent one is reported down (ccm_agent_standby_up 0, a warning in the log that names
it and says why) within one call's deadline, then warmed again once it answers.

Cadence is the agent's own evidence of serving a standby: ccm_agent_bytes_total{node=...},
the bytes its session with that standby carried, as the agent counts them once per cycle; a
rise is one cycle that talked to that standby. It is sampled every 0.1 s through the window;
the served count must be at least window / (1.5 x interval), and the longest time without a
rise at most 7 intervals. Hot blocks and coverage are measured with pg_buffercache on the
nodes. The same measurements are first taken with no standby silenced (the control), so that
a failure in the silent window is the silent standby's doing, not the machine's.

The agent that visits the standbys one after another fails this: its call to the silent
standby stalls the whole cycle for statement_timeout + connect_timeout (the first window),
and every retry of it costs a connect timeout (the second).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from harness.agent import AgentProcess
from harness.cluster import Node, multi_host_conninfo
from harness.wait import wait_for

from test_multi_standby import name, settle_hint_bits, standby_metric, wait_warm
from test_warmup import warm_primary
import pytest

# The agent's own behaviour: the same whatever the server (scripts/test.sh: newest only).
pytestmark = pytest.mark.agent_only

INTERVAL = 1.0  # seconds, the agent's --interval
WINDOW = 20.0  # seconds with one standby silent
CONTROL_WINDOW = 10.0  # seconds with none silent
CADENCE = 1.5  # the most intervals per cycle, on average, a healthy standby may wait
# The most intervals a healthy standby may wait for any one cycle: a batch read from a busy
# disk lengthens its cycle (3.5 s seen in a control window while the rest of the suite ran, and
# 5.0 s once in CI's second window, its cause not recorded), a connect timeout (10 s here) is
# what the old agent made every cycle pay.
LONGEST_GAP = 7.0
HOT_WITHIN = 5.0  # seconds from hot on the primary to cached on a healthy standby
STATEMENT_TIMEOUT, CONNECT_TIMEOUT = 25, 10  # seconds: a call's deadline 35 s, as the defaults' (30, 5)


# -- silencing -------------------------------------------------------------------------------

def _state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return ""


@contextmanager
def silenced(node: Node) -> Iterator[list[int]]:
    """SIGSTOPs the node's postmaster, then every child of it (the WAL receiver, the startup
    process, the backends serving the agent); SIGCONTs them all on the way out, whatever
    happened. Yields the stopped pids."""
    postmaster = node.postmaster_pid()
    assert postmaster is not None and node.is_running(), f"{node.name} is not running"
    stopped = [postmaster]
    os.kill(postmaster, signal.SIGSTOP)  # first: it forks no more children
    try:
        for child in node.child_pids():
            try:
                os.kill(child, signal.SIGSTOP)
                stopped.append(child)
            except ProcessLookupError:
                pass
        assert len(stopped) >= 4, f"{node.name}: only {stopped} to stop"
        wait_for(f"{node.name}'s processes to stop", lambda: all(_state(p) in ("T", "") for p in stopped),
                 timeout=10, interval=0.05)
        yield stopped
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


# -- measuring -------------------------------------------------------------------------------

class Sampling:
    """Calls `sample()` every `interval` s for `seconds` on a thread of its own (through
    wait_for), keeping (time, value) pairs; `result()` waits for the end and returns them,
    or raises what `sample` raised."""

    def __init__(self, what: str, sample: Callable[[], Any], seconds: float, interval: float):
        self.started = time.monotonic()
        self.end = self.started + seconds
        self.samples: list[tuple[float, Any]] = []
        self.error: BaseException | None = None

        def probe() -> bool:
            self.samples.append((time.monotonic(), sample()))
            return time.monotonic() >= self.end

        def run() -> None:
            try:
                wait_for(what, probe, timeout=seconds + 60, interval=interval)
            except BaseException as error:  # noqa: BLE001 - handed to the test's thread
                self.error = error

        self.thread = threading.Thread(target=run, name=what, daemon=True)
        self.thread.start()

    def result(self) -> list[tuple[float, Any]]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.samples


def served_bytes(metrics: dict[str, float], node: Node) -> float:
    """ccm_agent_bytes_total of the agent's session with `node`, both directions."""
    label = f'node="{name(node)}"'
    return sum(v for k, v in metrics.items() if k.startswith("ccm_agent_bytes_total{") and label in k)


def watch_cadence(agent: AgentProcess, standbys: list[Node], seconds: float) -> Sampling:
    def sample() -> dict[str, float]:
        metrics = agent.metrics()
        return {"cycles": metrics.get("ccm_agent_cycles_total", 0.0),
                **{s.name: served_bytes(metrics, s) for s in standbys}}

    return Sampling("the agent's per-standby traffic", sample, seconds, interval=0.1)


def cadence(samples: list[tuple[float, dict[str, float]]], standby: Node) -> dict[str, Any]:
    """The cycles that served `standby` in the sampled window (rises of its byte counter),
    the mean time per cycle, and the longest time without one (the window's ends count), with
    when it was in wall-clock time (the agent's log is in UTC), to find what the agent did then."""
    start, end = samples[0][0], samples[-1][0]
    rises = [t for (_, before), (t, after) in zip(samples, samples[1:]) if after[standby.name] > before[standby.name]]
    marks = [start, *rises, end]
    window = end - start
    gap_start, gap_end = max(zip(marks, marks[1:]), key=lambda pair: pair[1] - pair[0])
    to_wall = time.time() - time.monotonic()
    return {"served": len(rises), "window": round(window, 1),
            "seconds_per_cycle": round(window / len(rises), 2) if rises else float("inf"),
            "longest_gap": round(gap_end - gap_start, 1),
            "longest_gap_utc": (gap_start + to_wall, gap_end + to_wall)}


def log_between(agent: AgentProcess, span: tuple[float, float], margin: float = 1.0) -> list[str]:
    """The agent's log lines stamped within `span` (wall-clock seconds), `margin` s either side."""
    lines = []
    for line in agent.log().splitlines():
        stamp = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z", line)
        if stamp:
            at = datetime.fromisoformat(stamp.group(1)).replace(tzinfo=timezone.utc).timestamp()
            if span[0] - margin <= at <= span[1] + margin:
                lines.append(line)
    return lines


def relfilenode(node: Node, table: str) -> int:
    return node.one("SELECT pg_relation_filenode(%s::regclass)::int8", [table])


def cached_blocks_of(node: Node, rel: int) -> set[int]:
    return {row[0] for row in node.sql(
        "SELECT relblocknumber FROM pg_buffercache WHERE relfilenode = %s AND relforknumber = 0 "
        "AND reldatabase = (SELECT oid FROM pg_database WHERE datname = current_database())", [rel])}


def make_hot(primary: Node, table: str) -> set[int]:
    """Reads `table` five times on the primary (usage count 5), returns its hot blocks."""
    with primary.connect() as conn:
        for _ in range(5):
            conn.execute(f"SELECT count(*) FROM {table}")
    rel = relfilenode(primary, table)
    hot = {b[4] for b in primary.cached_blocks(min_usage=4) if b[2] == rel and b[3] == 0}
    assert len(hot) > 400, f"{table}: {len(hot)} hot blocks on the primary"
    return hot


def arrival(primary: Node, standbys: list[Node], table: str, timeout: float) -> dict[str, float | None]:
    """Makes `table` hot on the primary, then polls each standby until it caches 99% of the
    table's hot blocks; the seconds that took for each (None: not within `timeout`, which is
    longer than the bound asserted, so that a slow agent's real figure is seen)."""
    hot = make_hot(primary, table)
    rel = relfilenode(primary, table)
    started = time.monotonic()
    arrived: dict[str, float] = {}

    def everywhere() -> bool:
        for standby in standbys:
            if standby.name not in arrived and len(hot & cached_blocks_of(standby, rel)) >= 0.99 * len(hot):
                arrived[standby.name] = round(time.monotonic() - started, 1)
        return len(arrived) == len(standbys)

    try:
        wait_for(f"the hot blocks of {table} on {', '.join(s.name for s in standbys)}", everywhere,
                 timeout=timeout, interval=0.1)
    except TimeoutError:
        pass
    return {s.name: arrived.get(s.name) for s in standbys}


def watch_coverage(primary: Node, standbys: list[Node], leave_out: list[int], seconds: float) -> Sampling:
    """Each standby's share of the primary's hot set (pg_buffercache), the tables made hot
    on purpose left out (their arrival is measured on its own), every second."""
    def sample() -> dict[str, float]:
        hot = {b for b in primary.cached_blocks(min_usage=4) if b[2] not in leave_out}
        return {s.name: len(hot & s.cached_blocks()) / max(len(hot), 1) for s in standbys}

    return Sampling("the standbys' coverage", sample, seconds, interval=1.0)


def lowest(samples: list[tuple[float, dict[str, float]]], standby: Node) -> float:
    """The lowest coverage that lasted past one sample: the better of each two neighbours."""
    values = [figures[standby.name] for _, figures in samples]
    return round(min(max(pair) for pair in zip(values, values[1:] or values)), 4)


def lowest_sample(samples: list[tuple[float, dict[str, float]]], standby: Node) -> float:
    return round(min(figures[standby.name] for _, figures in samples), 4)


def measure(agent: AgentProcess, primary: Node, healthy: list[Node], table: str, leave_out: list[int],
            seconds: float) -> dict[str, Any]:
    """One window: cadence and coverage sampled throughout, `table` made hot at its start."""
    traffic = watch_cadence(agent, healthy, seconds)
    covered = watch_coverage(primary, healthy, leave_out, seconds)
    arrived = arrival(primary, healthy, table, timeout=max(seconds, 45))
    traffic_samples, coverage_samples = traffic.result(), covered.result()
    return {
        "cycles_total": traffic_samples[-1][1]["cycles"] - traffic_samples[0][1]["cycles"],
        **{s.name: {**cadence(traffic_samples, s), "hot_table_arrived_s": arrived[s.name],
                    "lowest_coverage": lowest(coverage_samples, s),
                    "lowest_coverage_sample": lowest_sample(coverage_samples, s)} for s in healthy},
    }


def failures(figures: dict[str, Any], healthy: list[Node]) -> list[str]:
    """What a window's figures break of the bounds."""
    least = int(figures[healthy[0].name]["window"] / (CADENCE * INTERVAL))
    found = []
    for standby in healthy:
        seen = figures[standby.name]
        if seen["served"] < least:
            found.append(f"{standby.name} served {seen['served']} times in {seen['window']} s, "
                         f"at least {least} expected (one per {CADENCE * INTERVAL:g} s)")
        # The average alone would let a connect timeout paid now and then pass.
        if seen["longest_gap"] > LONGEST_GAP * INTERVAL:
            found.append(f"{standby.name} waited {seen['longest_gap']} s for a cycle, at most "
                         f"{LONGEST_GAP * INTERVAL:g} s expected")
        if seen["hot_table_arrived_s"] is None or seen["hot_table_arrived_s"] > HOT_WITHIN:
            found.append(f"{standby.name}: the new hot table arrived after {seen['hot_table_arrived_s']} s "
                         f"(None: not at all), within {HOT_WITHIN:g} s expected")
        if seen["lowest_coverage"] < 0.99:
            found.append(f"{standby.name}: coverage fell to {seen['lowest_coverage']:.2%}")
    return found


def gap_log(agent: AgentProcess, windows: list[dict[str, Any]], healthy: list[Node]) -> str:
    """What the agent logged around each longest gap that broke the bound: the evidence of
    what held the healthy standbys up."""
    spans = sorted({w[s.name]["longest_gap_utc"] for w in windows for s in healthy
                    if w[s.name]["longest_gap"] > LONGEST_GAP * INTERVAL})
    lines = [line for span in spans for line in log_between(agent, span)]
    return "\nthe agent's log around the gap:\n" + "\n".join(dict.fromkeys(lines)) if lines else ""


# -- the test --------------------------------------------------------------------------------

def test_a_silent_standby_does_not_slow_the_others(cluster, load_factory, log_dir):
    primary = cluster.primary
    standbys = [cluster.standby, cluster.add_standby("standby2"), cluster.add_standby("standby3")]
    silent = standbys[1]  # in the middle: one healthy standby comes before it, one after
    healthy = [s for s in standbys if s is not silent]

    # Three tables to make hot later, one per window. Their hint bits and statistics are set
    # now, and autovacuum leaves them alone, so that reading them later writes no WAL (the
    # standbys would cache the pages by replaying it, warm without the agent). The primary
    # restarts with an empty cache so that none is cached anywhere until read: fill_room
    # would otherwise send them early, as colder blocks.
    tables = ("hot_in_control", "hot_while_silent", "hot_while_down")
    for table in tables:
        primary.sql(f"CREATE TABLE {table} WITH (autovacuum_enabled = off) AS "
                    "SELECT g, repeat('h', 1000) AS pad FROM generate_series(1, 4000) g")
    settle_hint_bits(primary, *tables)
    primary.sql(f"ANALYZE {', '.join(tables)}")
    primary.restart()
    for standby in standbys:
        cluster.make_standby_cold(standby)
    warm_primary(load_factory, cluster)
    rels = [relfilenode(primary, t) for t in tables]
    for node in (primary, *standbys):
        assert not any(cached_blocks_of(node, rel) for rel in rels), f"{node.name} caches a table before it is read"

    extra = ["--statement-timeout", f"{STATEMENT_TIMEOUT}s", "--connect-timeout", f"{CONNECT_TIMEOUT}s"]
    with AgentProcess(primary.conninfo(), multi_host_conninfo(standbys), log_dir, interval=f"{INTERVAL:g}s",
                      extra=extra) as agent:
        wait_warm(agent, primary, standbys, timeout=60)
        # Settled: the warm-up's last blocks are in, so that the windows start from the
        # steady state (99% is reached with the last batches still on their way).
        wait_warm(agent, primary, standbys, target=0.999, timeout=30)

        # The control: nothing silenced, the same measurements.
        control = measure(agent, primary, healthy, tables[0], rels, CONTROL_WINDOW)
        print(f"control (no standby silenced): {control}")
        assert not failures(control, healthy), f"{failures(control, healthy)}\n{control}{gap_log(agent, [control], healthy)}"

        with silenced(silent):
            silenced_at = time.monotonic()
            figures: dict[str, Any] = {"first": measure(agent, primary, healthy, tables[1], rels, WINDOW)}
            # Reported down: at the latest once a call's whole deadline has passed.
            deadline = STATEMENT_TIMEOUT + CONNECT_TIMEOUT + 10
            try:
                agent.wait_for(lambda: standby_metric(agent, "ccm_agent_standby_up", silent) == 0,
                               f"{silent.name} to be reported down",
                               timeout=max(1.0, deadline - (time.monotonic() - silenced_at)))
                figures["reported_down_after_s"] = round(time.monotonic() - silenced_at, 1)
            except TimeoutError:
                figures["reported_down_after_s"] = None
            # And while it stays silent, known to be down: its retries must cost nothing.
            figures["later"] = measure(agent, primary, healthy, tables[2], rels, WINDOW)
            said = [line for line in agent.log().splitlines()
                    if re.search(r"Z\s+(WARN|ERROR) ", line) and name(silent) in line]
            figures["log"] = said[:1]
            print(f"{silent.name} silent: {figures}")
            found = [f"{window} window: {failure}" for window in ("first", "later")
                     for failure in failures(figures[window], healthy)]
            if figures["reported_down_after_s"] is None:
                found.append(f"{silent.name} was not reported down within {deadline} s")
            if not any(re.search(r"timed out|time ?out|no answer|not answer|unresponsive|deadline", line, re.I)
                       for line in said):
                found.append(f"no warning names {name(silent)} with a reason: {said[:3]}")
            assert not found, ("\n".join(found) + f"\nfigures: {figures}\ncontrol: {control}"
                               + gap_log(agent, [figures["first"], figures["later"]], healthy))

        # It answers again: the same agent warms it, the table made hot meanwhile included.
        agent.wait_for(lambda: standby_metric(agent, "ccm_agent_standby_up", silent) == 1,
                       f"{silent.name} to be connected again", timeout=60)
        wait_warm(agent, primary, standbys, timeout=60)
        for table, rel in zip(tables[1:], rels[1:]):
            hot = {b[4] for b in primary.cached_blocks(min_usage=4) if b[2] == rel and b[3] == 0}
            assert len(hot & cached_blocks_of(silent, rel)) >= 0.99 * len(hot), f"{table}, made hot while it was silent"
        assert agent.alive()
