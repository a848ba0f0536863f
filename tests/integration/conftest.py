"""Fixtures: real primary + streaming standby clusters, pgbench data and load."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.agent import AGENT_BIN
from harness.cluster import PG_BIN, Cluster, Node, pgbench


def pytest_sessionstart(session: pytest.Session) -> None:
    if not AGENT_BIN.exists():
        raise pytest.UsageError(f"{AGENT_BIN} is missing: run scripts/install.sh first")


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A fresh primary and standby with pg_ccm, 128 MB shared_buffers each, pgbench scale 5."""
    with Cluster(settings={"shared_buffers": "'128MB'"}) as built:
        pgbench(built.primary, "-i", "-s", "5", "-q")
        built.wait_caught_up()
        yield built


class Load:
    """A pgbench select-only workload in the background; `rate` limits it to that many
    transactions per second (pgbench -R), None runs it as fast as it goes."""

    def __init__(self, node: Node, seconds: int, clients: int = 2, script: str = "select-only",
                 rate: int | None = None):
        argv = [str(PG_BIN / "pgbench"), "-h", "127.0.0.1", "-p", str(node.port), "-U", "postgres",
                "-b", script, "-c", str(clients), "-j", "1", "-T", str(seconds), "-n",
                *(["-R", str(rate)] if rate else []), "postgres"]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.process.communicate(timeout=30)


@pytest.fixture
def load_factory():
    loads: list[Load] = []

    def start(node: Node, seconds: int = 60, **kwargs) -> Load:
        load = Load(node, seconds, **kwargs)
        loads.append(load)
        return load

    yield start
    for load in loads:
        load.stop()


def agent_conninfo(node: Node, **extra) -> str:
    return node.conninfo(**extra)


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path
