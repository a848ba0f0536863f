"""`ccm-agent wait` looks at the nodes over sessions it keeps, at most every 5 s.

A switchover runbook may wait for minutes. Each look sweeps the buffer headers of the primary
(twice) and of every standby, so `wait` looks every --interval but at least 5 s apart, and
keeps one session per node from look to look instead of starting a backend (and a TLS and
SCRAM handshake) on every node each time. What the nodes see is measured here in
pg_stat_activity: the backends named ccm-agent, and the statements they ran.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time

from harness.agent import agent_command
from harness.cluster import Node

from test_warmup import warm_primary
import pytest

# The agent's own behaviour: the same whatever the server (scripts/test.sh: newest only).
pytestmark = pytest.mark.agent_only

# The statement that ends each look on the primary: the standby's missing hot buffers.
LAST_OF_A_LOOK = "ccm_hot_buffers($1"


class Watcher:
    """Samples the ccm-agent backends of some nodes every 0.1 s, in a thread: which backends
    there were, and when each of them started the statement that ends a look."""

    def __init__(self, nodes: dict[str, Node]):
        self.nodes = nodes
        self.pids: dict[str, set[int]] = {name: set() for name in nodes}
        self.looks: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, node in self.nodes.items():
                try:
                    rows = node.sql("SELECT pid, query, query_start FROM pg_stat_activity "
                                    "WHERE application_name = 'ccm-agent'")
                except Exception:  # a node restarting
                    continue
                for pid, query, started in rows:
                    self.pids[name].add(pid)
                    if name == "primary" and LAST_OF_A_LOOK in (query or ""):
                        self.looks.add(started)
            time.sleep(0.1)

    def __enter__(self) -> "Watcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def start_wait(cluster, timeout: str) -> subprocess.Popen:
    """`wait` for the cold standby, asked to look every 200 ms."""
    return subprocess.Popen(agent_command("wait", "--min-coverage", "99", "--timeout", timeout, "--interval", "200ms",
                                          "--primary", cluster.primary.conninfo(), "--standby", cluster.standby.conninfo()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def timed_out_on_coverage(stderr: str, standby: Node, timeout: str) -> bool:
    return re.search(rf"^ccm-agent: timed out after {timeout}: 127\.0\.0\.1:{standby.port} holds \d+\.\d% "
                     rf"of the hot set \(needs 99\.0%\)$", stderr, re.MULTILINE) is not None


def test_wait_keeps_one_session_per_node_and_looks_every_5_seconds(cluster, load_factory):
    cluster.make_standby_cold()
    warm_primary(load_factory, cluster).stop()
    nodes = {"primary": cluster.primary, "standby": cluster.standby}
    with Watcher(nodes) as watcher:
        waiting = start_wait(cluster, "20s")
        _, err = waiting.communicate(timeout=90)
    assert waiting.returncode == 1, err
    assert timed_out_on_coverage(err, cluster.standby, "20s"), err
    # Before: a new backend on every node per look, five looks a second with this interval.
    assert {name: len(pids) for name, pids in watcher.pids.items()} == {"primary": 1, "standby": 1}, watcher.pids
    looks = sorted(watcher.looks)
    gaps = [(b - a).total_seconds() for a, b in zip(looks, looks[1:])]
    assert 3 <= len(looks) <= 5, looks
    # Looks start 5 s apart; what is sampled is when each look's last statement started, which
    # moves with how long the look's first statements took (on a loaded CI machine one gap was
    # 4.4 s between gaps of 5.1 and 5.2 s). So: never two looks within 3 s, and 5 s apart on
    # average (against 0.2 s before).
    assert all(gap >= 3.0 for gap in gaps), gaps
    assert sum(gaps) / len(gaps) >= 4.5, gaps


def test_wait_makes_a_new_session_only_for_the_node_that_restarted(cluster, load_factory):
    cluster.make_standby_cold()
    warm_primary(load_factory, cluster).stop()
    nodes = {"primary": cluster.primary, "standby": cluster.standby}
    with Watcher(nodes) as watcher:
        waiting = start_wait(cluster, "25s")
        try:
            deadline = time.monotonic() + 30
            while not watcher.looks and time.monotonic() < deadline:
                time.sleep(0.1)
            assert watcher.looks, "wait should have looked once"
            cluster.standby.restart()  # a rolling restart's step: the kept session ends
        finally:
            _, err = waiting.communicate(timeout=90)
    assert waiting.returncode == 1, err
    # After the restart it measured the standby again, over a new session.
    assert timed_out_on_coverage(err, cluster.standby, "25s"), err
    assert {name: len(pids) for name, pids in watcher.pids.items()} == {"primary": 1, "standby": 2}, watcher.pids
