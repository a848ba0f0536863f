"""Runs ccm-agent as a real process and reads its Prometheus metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .cluster import free_port
from .wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
AGENT_BIN = Path(os.environ.get("CCM_AGENT_BIN", ROOT / "target" / "release" / "ccm-agent"))


def agent_command(*args: str) -> list[str]:
    return [str(AGENT_BIN), *args]


def run_agent(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs a one-shot agent command (sync --once, status, check-config)."""
    return subprocess.run(
        agent_command(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def run_agent_json(*args: str, timeout: float = 120) -> dict[str, Any]:
    result = run_agent(*args, "--output", "json", timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"ccm-agent {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout)


class AgentProcess:
    """`ccm-agent run` in the background, with its log in a file."""

    def __init__(self, primary: str | None, standby: str | None, log_dir: Path, interval: str | None = "200ms",
                 extra: list[str] | None = None, launcher: list[str] | None = None, env: dict[str, str] | None = None):
        """`primary`, `standby` or `interval` None: not given as flags (a --config file in
        `extra` sets them)."""
        # A command the agent is started under (the demo's makes it die with the demo).
        self.launcher = launcher or []
        self.env = {**os.environ, **(env or {})}
        self.metrics_port = free_port()
        self.log_path = Path(log_dir) / f"ccm-agent-{self.metrics_port}.log"
        flags = {"--primary": primary, "--standby": standby, "--interval": interval}
        self.args = [
            "run",
            *(part for flag, value in flags.items() if value is not None for part in (flag, value)),
            "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
            "--max-backoff", "2s",
            "--log-level", "info,ccm_agent=debug",
            *(extra or []),
        ]
        self.process: subprocess.Popen | None = None

    def start(self) -> "AgentProcess":
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen([*self.launcher, *agent_command(*self.args)], stdout=self._log,
                                        stderr=subprocess.STDOUT, env=self.env)
        try:
            wait_for("ccm-agent to serve its metrics", self.metrics, timeout=30, interval=0.1, retry_on=(OSError,),
                     abort=self._exited)
        except TimeoutError as error:
            self.stop()
            raise RuntimeError(f"{error}:\n{self.log()[-3000:]}") from None
        except RuntimeError as error:
            self._log.close()
            raise RuntimeError(f"{error}:\n{self.log()[-3000:]}") from None
        return self

    def _exited(self) -> str | None:
        code = self.process.poll() if self.process is not None else None
        return None if code is None else f"ccm-agent exited with {code}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> "AgentProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def metrics(self) -> dict[str, float]:
        """Parses /metrics into {'name{labels}': value}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                continue
        return values

    def readiness(self) -> tuple[int, dict[str, Any]]:
        """GET /readyz: the HTTP status and the JSON body."""
        url = f"http://127.0.0.1:{self.metrics_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def wire_bytes(self, ports: set[int]) -> int:
        """Bytes on the agent's TCP connections to the nodes listening on `ports`, both
        directions, as the kernel counts them (`ss -tinp`: bytes_acked + bytes_received),
        TLS and protocol framing included. Sockets closed meanwhile are not counted."""
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
        total, ours = 0, False
        for line in out.splitlines():
            if not line[:1].isspace():
                ends = [token for token in line.split() if re.fullmatch(r"\S+:\d+", token)]
                peer = int(ends[1].rsplit(":", 1)[1]) if len(ends) >= 2 else None
                ours = peer in ports and f"pid={self.process.pid}," in line
                continue
            if ours:
                for field in ("bytes_acked", "bytes_received"):
                    found = re.search(rf"\b{field}:(\d+)", line)
                    total += int(found[1]) if found else 0
                ours = False
        return total

    def metric(self, name: str, default: float = 0.0) -> float:
        """A metric's value, summed over its label sets (and _total suffixes)."""
        found = [v for k, v in self.metrics().items() if k == name or k.startswith(name + "{")]
        return sum(found) if found else default

    def wait_for(self, predicate, what: str, timeout: float = 30, interval: float = 0.2) -> Any:
        """Polls `predicate` while the agent runs; a timeout or the agent's death shows its log."""
        try:
            return wait_for(what, predicate, timeout=timeout, interval=interval, abort=self._exited,
                            describe=lambda: f"agent log:\n{self.log()[-4000:]}")
        except RuntimeError as error:
            raise RuntimeError(f"{error}:\n{self.log()}") from None
