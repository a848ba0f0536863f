"""The Docker engine and compose command of the container tests (test_compose, test_packages,
test_patroni): whether an engine answers here, which compose command this machine has, the
image builds they share, and a compose project's commands."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def docker_engine_runs() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def compose_command() -> list[str]:
    """`docker compose` (the plugin) or `docker-compose`; skips the test when neither exists."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("no docker compose command (neither the plugin nor docker-compose) is installed")


def build_images(script: str, *args: str, timeout: float = 1800) -> None:
    """Runs docker/SCRIPT (build-image.sh, build-patroni-image.sh), one build at a time on this
    machine: the container tests' modules may run in parallel workers, and the scripts share
    their cached root file systems and image tags. A build that is up to date returns at once."""
    with open(Path(tempfile.gettempdir()) / "pg_ccm-docker-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([str(ROOT / "docker" / script), *args], check=True, timeout=timeout)


class ComposeProject:
    """A compose project: the compose command for what only it knows (up, down, ps, logs,
    port), `docker exec` on the service's container for every command run inside one. The
    tests poll with hundreds of such commands, and Compose v1 (`docker-compose`, Python) costs
    about 1.3 CPU-seconds and, on a busy machine, 10 s per call, against 30 ms for `docker exec`.
    Container ids are looked up once per service: `docker kill`, `start`, `restart` and network
    changes keep them; a container that is gone is looked up again."""

    def __init__(self, project: str, compose_file: Path) -> None:
        self.project = project
        self.base = [*compose_command(), "-p", project, "-f", str(compose_file)]
        self._ids: dict[str, str] = {}

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """The compose command with ARGS."""
        result = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {result.stdout}\n{result.stderr}")
        return result

    def container(self, service: str) -> str:
        """The id of SERVICE's container."""
        if service not in self._ids:
            cid = self.run("ps", "-q", service).stdout.strip()
            if not cid:
                raise RuntimeError(f"no container for {service}")
            self._ids[service] = cid
        return self._ids[service]

    def _exec_argv(self, service: str, command: tuple[str, ...], user: str | None) -> list[str]:
        return ["docker", "exec", *(["-u", user] if user else []), self.container(service), *command]

    def exec(self, service: str, *command: str, user: str | None = None, timeout: float = 300,
             check: bool = True) -> subprocess.CompletedProcess:
        """COMMAND in SERVICE's container (as `compose exec -T` runs it)."""
        result = subprocess.run(self._exec_argv(service, command, user), capture_output=True, text=True,
                                timeout=timeout, cwd=ROOT)
        if result.returncode != 0 and "No such container" in result.stderr:
            self._ids.pop(service, None)
            result = subprocess.run(self._exec_argv(service, command, user), capture_output=True, text=True,
                                    timeout=timeout, cwd=ROOT)
        if check and result.returncode != 0:
            raise RuntimeError(f"exec {service} {' '.join(command)}: {result.stdout}\n{result.stderr}")
        return result

    def background(self, service: str, *command: str) -> subprocess.Popen:
        """COMMAND in SERVICE's container, in the background (stdout and stderr together)."""
        return subprocess.Popen(self._exec_argv(service, command, None), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
