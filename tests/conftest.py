"""Makes the harness importable as `harness` from every test directory."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "container: runs Docker images built on Debian 12's PostgreSQL 15 (scripts/test.sh: with 15 only)")
    config.addinivalue_line(
        "markers", "every_version: goes through version-specific code or the extension's memory handling "
                   "(scripts/test.sh: on every version; the others run on the newest only)")
    config.addinivalue_line(
        "markers", "smoke: the quick loop's subset (scripts/test.sh --quick)")
    config.addinivalue_line(
        "markers", "agent_only: the agent's own behaviour (its tasks, retries, election, polling), the same "
                   "whatever the server's version (scripts/test.sh: on the newest version only)")


# Modules whose tests take longest, started first so that parallel workers do not end on a long
# tail; their tests share a module-scoped cluster, so each module stays on one worker.
LONG_MODULES = ("test_patroni", "test_compose", "test_packages", "test_wal_cache", "test_churn", "test_silent_standby", "test_agent_tls")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        module = item.module.__name__.rsplit(".", 1)[-1]
        return LONG_MODULES.index(module) if module in LONG_MODULES else len(LONG_MODULES)

    items.sort(key=rank)  # stable: the order inside a module is kept
