"""ccm-agent as a service: SIGHUP reloads its configuration file, /readyz says whether it
does its job, /metrics carries its version. Real servers, the real agent process."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from harness.agent import AGENT_BIN, ROOT, AgentProcess, run_agent
from harness.cluster import Cluster

from test_warmup import wait_for_coverage, warm_primary

# Readiness, systemd notify, signals and the unit are the agent's own behaviour: the same on
# every PostgreSQL version, so scripts/test.sh runs them with the newest only.
pytestmark = pytest.mark.agent_only


def write_config(path: Path, **keys: str) -> None:
    path.write_text("".join(f'{key} = "{value}"\n' for key, value in keys.items()))


def test_sighup_reloads_the_file_and_survives_a_bad_one(cluster, load_factory, log_dir, tmp_path):
    config = tmp_path / "ccm-agent.toml"
    with Cluster() as other:
        # The agent starts pointed at another cluster's standby: the safety check refuses it.
        write_config(config, primary=cluster.primary.conninfo(), standby=other.standby.conninfo(), interval="300ms")
        with AgentProcess(None, None, log_dir, interval=None, extra=["--config", str(config)]) as agent:
            agent.wait_for(lambda: "system identifier mismatch" in agent.log(), "the safety check to refuse")
            status, body = agent.readiness()
            assert status == 503 and not body["ready"], body

            # SIGHUP with the right standby: the agent reconnects, warms it and is ready.
            warm_primary(load_factory, cluster)
            write_config(config, primary=cluster.primary.conninfo(), standby=cluster.standby.conninfo(),
                         interval="200ms", log_level="info,ccm_agent=debug")
            agent.process.send_signal(signal.SIGHUP)
            agent.wait_for(lambda: "standby: " in agent.log() and "interval: " in agent.log(), "the reload to be logged")
            fraction, _, hot = wait_for_coverage(cluster, 0.99, timeout=20)
            assert fraction >= 0.99, f"{fraction:.1%} of {hot} after the reload\n{agent.log()[-3000:]}"
            agent.wait_for(lambda: agent.readiness()[0] == 200, "/readyz to say ready")
            assert agent.readiness()[1]["reasons"] == []

            # A broken file: an error in the log, the agent keeps running on what it has.
            config.write_text("interval = \n")
            agent.process.send_signal(signal.SIGHUP)
            agent.wait_for(lambda: "configuration reload failed" in agent.log(), "the failed reload to be logged")
            cycles = agent.metric("ccm_agent_cycles_total")
            agent.wait_for(lambda: agent.metric("ccm_agent_cycles_total") >= cycles + 3, "cycles after the bad reload")
            assert agent.alive()

            # A key that needs a restart is reported and not applied (the log stays text).
            write_config(config, primary=cluster.primary.conninfo(), standby=cluster.standby.conninfo(),
                         interval="200ms", log_level="info,ccm_agent=debug", log_format="json")
            agent.process.send_signal(signal.SIGHUP)
            agent.wait_for(lambda: "log_format changes only with a restart" in agent.log(), "the restart-only key")
            time.sleep(0.5)
            assert not agent.log().rstrip().splitlines()[-1].startswith("{")
            assert agent.readiness()[0] == 200
        assert agent.process.returncode == 0, agent.log()[-2000:]
    assert "password" not in agent.log().lower() or "***" in agent.log()


def test_readyz_follows_the_nodes_and_build_info_is_served(cluster, log_dir):
    with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval="200ms",
                      extra=["--connect-timeout", "1s"]) as agent:
        agent.wait_for(lambda: agent.readiness()[0] == 200, "/readyz to say ready")
        version = run_agent("--version").stdout.split()[-1]
        assert agent.metric(f'ccm_agent_build_info{{version="{version}"}}') == 1
        cluster.primary.stop()
        agent.wait_for(lambda: agent.readiness()[0] == 503, "/readyz to notice the primary is gone")
        status, body = agent.readiness()
        assert not body["primary_connected"] and "no connection to a primary" in body["reasons"], body
        cluster.primary.start()
        agent.wait_for(lambda: agent.readiness()[0] == 200, "/readyz to recover", timeout=60)


def test_systemd_notify_ready_watchdog_stopping(cluster, log_dir, tmp_path):
    """Type=notify: READY=1 once serving, WATCHDOG=1 while the loop lives, a STATUS line after
    cycles, STOPPING=1 on SIGTERM, on the socket systemd names in NOTIFY_SOCKET."""
    path = tmp_path / "notify.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.settimeout(10)
    env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"}
    messages: list[str] = []
    with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, env=env) as agent:
        deadline = time.monotonic() + 10
        while not ({"READY=1", "WATCHDOG=1"} <= set(messages) and any(m.startswith("STATUS=coverage") for m in messages)):
            assert time.monotonic() < deadline, messages
            messages.append(receiver.recv(256).decode())
        assert messages[0] == "READY=1", messages
    while not messages[-1] == "STOPPING=1":
        messages.append(receiver.recv(256).decode())
    assert agent.process.returncode == 0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_systemd_unit_is_valid(tmp_path):
    unit = (ROOT / "packaging" / "ccm-agent.service").read_text()
    # verify checks that ExecStart's binary exists: point it at the one just built.
    (tmp_path / "ccm-agent.service").write_text(unit.replace("/usr/bin/ccm-agent", str(AGENT_BIN)))
    result = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "ccm-agent.service")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
