"""The Docker engine and compose command of the container tests (test_compose, test_packages,
test_patroni): whether an engine answers here, and which compose command this machine has."""

from __future__ import annotations

import shutil
import subprocess

import pytest


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
