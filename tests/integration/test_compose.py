"""The docker-compose cluster: it comes up, the agent runs unprivileged and healthy, Prometheus
evaluates pg_ccm's rules and scrapes the agent, the standby gets warm, a failover works.

Skipped only where no Docker engine answers. The image is built offline by
docker/build-image.sh (skipped when it is up to date).
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from harness.docker import ComposeProject, build_images, docker_engine_runs
from harness.prometheus import PrometheusAPI, load_rules, rules_of
from harness.wait import wait_for as poll

ROOT = Path(__file__).resolve().parents[2]


# The images hold Debian 12's PostgreSQL 15: scripts/test.sh runs these with 15 only.
pytestmark = [
    pytest.mark.container,
    # The module shares one cluster: one worker.
    pytest.mark.xdist_group("compose"),
    pytest.mark.skipif(not docker_engine_runs(), reason="no Docker engine runs on this machine"),
]


class Compose(ComposeProject):
    def __init__(self) -> None:
        super().__init__(f"pgccm{uuid.uuid4().hex[:8]}", ROOT / "docker-compose.yml")

    def sql(self, host: str, query: str) -> str:
        return self.exec("pgbench", "psql", "-h", host, "-U", "postgres", "-Atq", "-c", query).stdout.strip()

    def blocks(self, host: str, min_usage: int) -> set[str]:
        out = self.sql(host, "SELECT concat_ws('/', reltablespace, reldatabase, relfilenode, relforknumber, relblocknumber) "
                             f"FROM pg_buffercache WHERE relfilenode IS NOT NULL AND usagecount >= {min_usage}")
        return set(out.splitlines())

    def wait(self, predicate, what: str, timeout: float = 120) -> None:
        poll(what, predicate, timeout=timeout, interval=1, retry_on=(RuntimeError, subprocess.TimeoutExpired),
             describe=lambda: self.run("logs", "--tail", "30", check=False).stdout)


def docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def compose():
    build_images("build-image.sh", timeout=900)
    cluster = Compose()
    try:
        cluster.run("up", "-d")
        yield cluster
    finally:
        cluster.run("down", "-v", "--remove-orphans", check=False, timeout=120)


def test_agent_runs_as_an_unprivileged_user_and_is_healthy(compose):
    agent = compose.container("ccm-agent")
    # The entry point execs the agent: it is the container's PID 1, no root uid, no capability.
    assert docker("exec", agent, "cat", "/proc/1/comm").stdout.strip() == "ccm-agent"
    status = dict(line.split(":", 1) for line in docker("exec", agent, "cat", "/proc/1/status").stdout.splitlines())
    uids = [int(uid) for uid in status["Uid"].split()]  # real, effective, saved, filesystem
    assert len(uids) == 4 and 0 not in uids, status["Uid"]
    assert int(status["CapEff"], 16) == 0, status["CapEff"]
    assert docker("exec", agent, "getent", "passwd", str(uids[0])).stdout.startswith("ccm-agent:")

    def health(container: str) -> str:
        return docker("inspect", "-f", "{{.State.Health.Status}}", container).stdout.strip()

    # The image's HEALTHCHECK asks the agent's /healthz; pointed elsewhere it fails.
    compose.wait(lambda: health(agent) == "healthy", "the agent's healthcheck to pass", timeout=60)
    assert docker("exec", agent, "pg-ccm-healthcheck").returncode == 0
    failed = docker("exec", "-e", "CCM_HEALTHCHECK_ADDR=127.0.0.1:1", agent, "pg-ccm-healthcheck")
    assert failed.returncode == 1, failed
    # On the PostgreSQL nodes the same HEALTHCHECK is pg_isready.
    standby = compose.container("standby")
    compose.wait(lambda: health(standby) == "healthy", "the standby's healthcheck to pass", timeout=120)


def test_compose_prometheus_evaluates_the_rules_and_scrapes_the_agent(compose):
    """Prometheus in the demo: healthy, on the host port `docker compose port` names, with every
    rule of monitoring/ccm-agent.rules.yml loaded and healthy, scraping the agent (its
    `cluster` label from monitoring/prometheus.yml) and its standby's coverage."""
    container = compose.container("prometheus")
    compose.wait(lambda: docker("inspect", "-f", "{{.State.Health.Status}}", container).stdout.strip() == "healthy",
                 "Prometheus's healthcheck to pass", timeout=60)
    host, _, port = compose.run("port", "prometheus", "9090").stdout.strip().rpartition(":")
    prometheus = PrometheusAPI(f"http://{host}:{port}")
    shipped = list(rules_of(load_rules()))
    loaded = prometheus.rules()
    assert [r["name"] for r in loaded] == [r.get("alert") or r["record"] for r in shipped]
    assert {r["health"] for r in loaded} == {"ok"}, [r for r in loaded if r["health"] != "ok"]
    compose.wait(lambda: prometheus.values('ccm:agent_up{cluster="demo"}', "instance") == {"ccm-agent:9935": 1.0},
                 "Prometheus to scrape the agent", timeout=60)
    compose.wait(lambda: len(prometheus.query('ccm_agent_standby_coverage_ratio{cluster="demo"}')) == 1,
                 "the standby's coverage series", timeout=120)


def test_compose_cluster_warms_the_standby_and_survives_a_failover(compose):
    compose.wait(lambda: compose.sql("standby", "SELECT pg_is_in_recovery()") == "t", "the standby to stream")
    compose.exec("pgbench", "pgbench", "-h", "primary", "-U", "postgres", "-i", "-s", "5", "-q", "postgres")
    compose.exec("pgbench", "pgbench", "-h", "primary", "-U", "postgres", "-n", "-S", "-c", "2", "-T", "8", "postgres")

    def covered() -> bool:
        hot = compose.blocks("primary", 4)
        return len(hot) > 500 and len(hot & compose.blocks("standby", 0)) >= 0.99 * len(hot)

    compose.wait(covered, "the standby to cache 99% of the primary's hot buffers", timeout=30)

    # Failover: kill the primary, promote the standby, run the workload against it.
    compose.run("kill", "-s", "SIGKILL", "primary")
    compose.exec("standby", "pg_ctl", "-D", "/var/lib/postgresql/data", "-w", "promote", user="postgres")
    assert compose.sql("standby", "SELECT pg_is_in_recovery()") == "f"
    out = compose.exec("pgbench", "pgbench", "-h", "standby", "-U", "postgres", "-n", "-S", "-c", "2", "-T", "3", "postgres").stdout
    assert "number of failed transactions: 0 " in out, out
    # The agent is still up and has noticed the promotion.
    running = compose.container("ccm-agent")
    assert subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", running], capture_output=True, text=True).stdout.strip() == "true"
    def agent_log() -> str:
        logs = compose.run("logs", "ccm-agent")
        return logs.stdout + logs.stderr

    compose.wait(lambda: "promoted" in agent_log(), "the agent to log the promotion", timeout=30)
