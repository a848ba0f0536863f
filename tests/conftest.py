"""Makes the harness importable as `harness` from every test directory."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "container: runs Docker images built on Debian 12's PostgreSQL 15 (scripts/test.sh: with 15 only)")
    config.addinivalue_line(
        "markers", "oldest_newest: slow and independent of the PostgreSQL version (scripts/test.sh: with the oldest and newest version only)")
