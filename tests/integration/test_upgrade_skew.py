"""A rolling upgrade's version skew, on real servers with two builds of the library.

Catalogs replicate and libraries do not: after ALTER EXTENSION pg_ccm UPDATE on the primary,
a standby not yet restarted runs the previous release's library under this release's catalog
(built by scripts/build-previous-release.sh into a copy of the PostgreSQL installation, the
standby started from it). Nothing may crash: a function the old library lacks (new in this
release, or bound to a new symbol because its shape changed) fails with "could not find
function" and the server goes on; ccm-agent tells what to do and does not call that node;
restarted on the new library, the node serves the catalog.
The converse (this library under an older catalog) needs one build: the shape the library
still serves is served, the one it does not is refused with a clear ERROR.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import psycopg
import pytest

from harness.agent import run_agent
from harness.cluster import Cluster, make_table, pg_bin, read, workspace_version

ROOT = Path(__file__).resolve().parents[2]
CURRENT = workspace_version()
FEED_CALL = "SELECT seq FROM ccm_buffer_changes(1, 0)"
# A function of this release that the previous library does not have (0.9.0: the page-cache
# tier's walk of the node's page cache; one row).
NEWEST_CALL = "SELECT count(*) FROM ccm_os_cached_blocks(0, 0, 0, -1, 1, 1)"


@pytest.fixture(scope="module")
def previous_release() -> tuple[str, Path]:
    """(version, bin directory) of the previous release's library in a copy of this version's
    installation."""
    version = pg_bin().parent.name
    result = subprocess.run([str(ROOT / "scripts" / "build-previous-release.sh"), version],
                            capture_output=True, text=True)
    if result.returncode == 3:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stderr
    bindir = Path(result.stdout.strip().splitlines()[-1])
    released = (ROOT / "sql").glob(f"pg_ccm--*--{CURRENT}.sql")
    previous = max((p.name.split("--")[1] for p in released), key=lambda v: tuple(map(int, v.split("."))))
    return previous, bindir


def agent_says(*args: str) -> tuple[int, str]:
    result = run_agent(*args, timeout=60)
    return result.returncode, result.stdout + result.stderr


def test_a_standby_on_the_previous_library_fails_the_new_catalog_cleanly(previous_release):
    previous, old_bin = previous_release
    with Cluster(settings={"shared_buffers": "'64MB'"}) as cluster:
        primary, standby = cluster.primary, cluster.standby
        primary.sql("DROP EXTENSION pg_ccm")
        primary.sql(f"CREATE EXTENSION pg_ccm VERSION '{previous}'")
        make_table(primary, "hot", 8)
        read(primary, "hot", times=6)
        cluster.wait_caught_up()
        standby.stop()
        standby.bindir = old_bin
        standby.start()
        # The previous release under its own catalog: as before.
        assert standby.one("SELECT current_setting('ccm.library_version', true)") == previous
        assert standby.one(FEED_CALL) > 0

        primary.sql("ALTER EXTENSION pg_ccm UPDATE")
        cluster.wait_caught_up()
        postmaster = standby.postmaster_pid()
        for _ in range(3):
            with pytest.raises(psycopg.Error) as raised:
                standby.one(NEWEST_CALL)
            assert raised.value.sqlstate == "42883", raised.value
            assert "could not find function" in raised.value.diag.message_primary
        assert standby.postmaster_pid() == postmaster
        assert standby.one("SELECT 1") == 1

        sides = ["--primary", primary.conninfo(), "--standby", standby.conninfo()]
        told = f"is older than the extension's catalog ({CURRENT}); install pg_ccm {CURRENT} on this node and restart it"
        code, said = agent_says("status", *sides)
        assert told in said, said
        code, said = agent_says("sync", "--once", *sides)
        assert code != 0 and told in said, said
        assert standby.postmaster_pid() == postmaster

        # Restarted on this checkout's library, it serves the catalog.
        standby.stop()
        standby.bindir = None
        standby.start()
        assert standby.one("SELECT ccm_library_version()") == CURRENT
        assert standby.one(FEED_CALL) > 0
        assert standby.one(NEWEST_CALL) == 1, "one slice of its page cache"
        code, said = agent_says("sync", "--once", *sides)
        assert code == 0 and told not in said, said
        assert "TRAP" not in standby.logfile.read_text(errors="replace")


def test_this_library_serves_the_catalog_shapes_it_can_and_refuses_the_others():
    """The library first, the catalog last (README, "Upgrading"): under an older catalog
    (0.6.0) whose ccm_buffer_changes has this library's shape, the feed goes on; under 0.5.0's (five
    arguments, ten columns) the call is refused instead of forming a tuple of the wrong shape."""
    with Cluster() as cluster:
        primary = cluster.primary
        primary.sql("DROP EXTENSION pg_ccm")
        primary.sql("CREATE EXTENSION pg_ccm VERSION '0.6.0'")
        assert primary.one(FEED_CALL) > 0
        assert primary.one("SELECT current_setting('ccm.library_version')") == CURRENT

        primary.sql("DROP EXTENSION pg_ccm")
        primary.sql("CREATE EXTENSION pg_ccm VERSION '0.5.0'")
        with pytest.raises(psycopg.Error) as raised:
            primary.one(FEED_CALL)
        error = raised.value
        assert error.sqlstate == "55000"
        assert error.diag.message_primary == \
            "function ccm_buffer_changes of the pg_ccm catalog does not match the loaded pg_ccm library"
        assert error.diag.message_detail == \
            f"The catalog declares 5 arguments and 10 result columns; library {CURRENT} has 6 and 12."
        assert "ALTER EXTENSION pg_ccm UPDATE" in error.diag.message_hint
        assert primary.one("SELECT 1") == 1
