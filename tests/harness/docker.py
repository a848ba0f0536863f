"""The Docker engine and compose command of the container tests (test_compose, test_packages,
test_patroni): whether an engine answers here, which compose command this machine has, and the
image builds they share."""

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
