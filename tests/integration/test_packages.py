"""The Debian packages (scripts/build-debs.sh) on a fresh Debian 12.

Builds postgresql-15-pg-ccm and ccm-agent, installs both with `apt-get install ./...deb` in a
container of pg_ccm-base:local (Debian 12 minbase + postgresql-15, nothing of ours; made offline
by `docker/build-image.sh --base-only`) that has no network at all (`--network none`: apt could
not download a missing dependency; its `--no-download` cannot be used, apt 2.6 then fails on
local .deb files with "Pathname to install is not absolute"), then checks the
installed files, the agent and its user, a server with pg_ccm preloaded, and removal and purge.

Skipped only where no Docker engine answers. With the images and packages already built it takes
about 15 s; the first run builds the base image (debootstrap: about a minute; docker import: about
half a minute) and the release builds if target/ has none.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from pathlib import Path

import pytest

from harness.cluster import workspace_version
from harness.docker import build_images, docker_engine_runs

ROOT = Path(__file__).resolve().parents[2]
DEB_DIR = ROOT / "target" / "debian"
BASE_IMAGE = "pg_ccm-base:local"
PG_MAJOR = "15"
EXT_PKG = f"postgresql-{PG_MAJOR}-pg-ccm"
PKGLIBDIR = f"/usr/lib/postgresql/{PG_MAJOR}/lib"
EXTDIR = f"/usr/share/postgresql/{PG_MAJOR}/extension"
SQL_SCRIPTS = sorted(path.name for path in (ROOT / "sql").glob("pg_ccm--*.sql"))
UNIT = ROOT / "packaging" / "ccm-agent.service"


# The images hold Debian 12's PostgreSQL 15: scripts/test.sh runs these with 15 only.
pytestmark = [
    pytest.mark.container,
    pytest.mark.xdist_group("packages"),  # the module shares one container
    pytest.mark.skipif(not docker_engine_runs(), reason="no Docker engine runs on this machine"),
]


VERSION = workspace_version()
DEB_VERSION = VERSION.replace("-", "~", 1)


class Container:
    def __init__(self, name: str) -> None:
        self.name = name

    def sh(self, script: str, user: str | None = None, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        command = ["docker", "exec", *(["-u", user] if user else []), self.name, "bash", "-euo", "pipefail", "-c", script]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{script}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}")
        return result

    def exists(self, path: str) -> bool:
        return self.sh(f"test -e {path}", check=False).returncode == 0


@pytest.fixture(scope="module")
def debs() -> dict[str, Path]:
    subprocess.run([str(ROOT / "scripts" / "build-debs.sh")], check=True, timeout=1800)
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    built = {pkg: DEB_DIR / f"{pkg}_{DEB_VERSION}_{arch}.deb" for pkg in (EXT_PKG, "ccm-agent")}
    for deb in built.values():
        assert deb.is_file(), f"{deb} was not built"
    return built


@pytest.fixture(scope="module")
def container(debs):
    build_images("build-image.sh", "--base-only", timeout=900)
    name = f"pgccm-packages-{uuid.uuid4().hex[:8]}"
    # No network: every dependency must already be in the image.
    subprocess.run(["docker", "run", "-d", "--name", name, "--network", "none", BASE_IMAGE, "sleep", "infinity"],
                   check=True, capture_output=True, timeout=60)
    try:
        box = Container(name)
        box.sh("mkdir -p /tmp/debs")
        for deb in debs.values():
            subprocess.run(["docker", "cp", str(deb), f"{name}:/tmp/debs/"], check=True, timeout=60)
        box.sh("chmod -R a+rX /tmp/debs")
        yield box
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


def test_control_fields_and_contents(debs):
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()

    def field(deb: Path, name: str) -> str:
        return subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True, check=True).stdout.strip()

    def contents(deb: Path) -> set[str]:
        out = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
        return {line.split()[-1].removeprefix(".") for line in out.splitlines() if not line.startswith("d")}

    for pkg, deb in debs.items():
        assert field(deb, "Package") == pkg
        assert field(deb, "Version") == DEB_VERSION
        assert field(deb, "Architecture") == arch
        assert re.fullmatch(r".+ <[^ ]+@[^ ]+>", field(deb, "Maintainer"))
        assert re.search(r"\blibc6 \(>= 2\.\d+\)", field(deb, "Depends"))
        assert field(deb, "Description")
    assert field(debs[EXT_PKG], "Depends").startswith(f"postgresql-{PG_MAJOR},")

    ext = contents(debs[EXT_PKG])
    assert f"{PKGLIBDIR}/pg_ccm.so" in ext
    assert {f"{EXTDIR}/pg_ccm.control", *(f"{EXTDIR}/{name}" for name in SQL_SCRIPTS)} <= ext
    assert f"{EXTDIR}/pg_ccm--{VERSION}.sql" in ext

    agent = contents(debs["ccm-agent"])
    assert {"/usr/bin/ccm-agent", "/etc/ccm-agent/ccm-agent.toml"} <= agent
    assert ("/lib/systemd/system/ccm-agent.service" in agent) == UNIT.exists()
    conffiles = subprocess.run(["dpkg-deb", "--ctrl-tarfile", str(debs["ccm-agent"])], capture_output=True, check=True).stdout
    listing = subprocess.run(["tar", "-xO", "./conffiles"], input=conffiles, capture_output=True, check=True).stdout.decode()
    assert listing.split() == ["/etc/ccm-agent/ccm-agent.toml"]


def test_apt_installs_both_packages_without_the_network(container):
    out = container.sh("DEBIAN_FRONTEND=noninteractive apt-get install -y /tmp/debs/*.deb", timeout=300)
    assert "2 newly installed" in out.stdout, out.stdout
    fetched = [line for line in out.stdout.splitlines() if line.startswith("Get:") and "/tmp/debs/" not in line]
    assert not fetched, out.stdout
    for pkg in (EXT_PKG, "ccm-agent"):
        state = container.sh(f"dpkg-query -W -f='${{Status}} ${{Version}}' {pkg}").stdout
        assert state == f"install ok installed {DEB_VERSION}"
    # Every file as shipped (md5sums), conffile included.
    verify = container.sh(f"dpkg --verify {EXT_PKG} ccm-agent", check=False)
    assert verify.returncode == 0 and not verify.stdout.strip(), verify.stdout


def test_agent_binary_user_configuration_and_unit(container):
    assert container.sh("ccm-agent --version").stdout.strip() == f"ccm-agent {VERSION}"
    assert container.sh("command -v ccm-agent").stdout.strip() == "/usr/bin/ccm-agent"
    user = container.sh("getent passwd ccm-agent").stdout.strip().split(":")
    assert 0 < int(user[2]) < 1000, user  # a system user
    assert user[6] in ("/usr/sbin/nologin", "/bin/false"), user
    assert container.sh("getent group ccm-agent").returncode == 0
    # The configuration may hold passwords: root and the agent's group only.
    assert container.sh("stat -c '%U:%G %a' /etc/ccm-agent /etc/ccm-agent/ccm-agent.toml").stdout.split("\n")[:2] == [
        "root:ccm-agent 750", "root:ccm-agent 640"]
    assert "/etc/ccm-agent/ccm-agent.toml" in container.sh("dpkg-query -W -f='${Conffiles}' ccm-agent").stdout
    # The agent's user reads the packaged configuration, and the example in it is valid.
    checked = container.sh("setpriv --reuid=ccm-agent --regid=ccm-agent --init-groups -- "
                           "ccm-agent --config /etc/ccm-agent/ccm-agent.toml check-config")
    assert "db1" in checked.stdout, checked.stdout
    if UNIT.exists():
        installed = container.sh("cat /lib/systemd/system/ccm-agent.service").stdout
        assert installed == UNIT.read_text()
    else:
        assert not container.exists("/lib/systemd/system/ccm-agent.service")


def test_server_preloads_pg_ccm_and_creates_the_extension(container):
    assert container.exists(f"{PKGLIBDIR}/pg_ccm.so")
    for name in ["pg_ccm.control", *SQL_SCRIPTS]:
        assert container.exists(f"{EXTDIR}/{name}"), name
    container.sh("install -d -o postgres -g postgres /tmp/pg")
    as_postgres = "setpriv --reuid=postgres --regid=postgres --init-groups --"
    container.sh(f"{as_postgres} initdb -D /tmp/pg/data -U postgres --auth=trust -E UTF8 --locale=C >/dev/null")
    container.sh(f"{as_postgres} pg_ctl -D /tmp/pg/data -l /tmp/pg/log -w "
                 "-o \"-c shared_preload_libraries=pg_ccm -c listen_addresses='' -c unix_socket_directories=/tmp/pg\" start")
    try:
        def psql(sql: str, db: str = "postgres") -> str:
            return container.sh(f"{as_postgres} psql -h /tmp/pg -U postgres -d {db} -v ON_ERROR_STOP=1 -Atq -c \"{sql}\"").stdout.strip()

        assert psql("SHOW shared_preload_libraries") == "pg_ccm"
        psql("CREATE EXTENSION pg_ccm")
        assert psql("SELECT extversion FROM pg_extension WHERE extname = 'pg_ccm'") == VERSION
        assert psql("SELECT count(*) > 0 FROM aurora_ccm_status()") == "t"
        # A release build: the test builds' failpoint parameter does not exist.
        unknown = container.sh(f"{as_postgres} psql -h /tmp/pg -U postgres -Atq -c 'SET ccm.test_prewarm_delay_ms = 1'",
                               check=False)
        assert unknown.returncode != 0 and "ccm.test_prewarm_delay_ms" in unknown.stderr, unknown
        # The scripts of earlier releases are there too: install the first one and update.
        oldest = min(re.fullmatch(r"pg_ccm--([\d.]+)\.sql", name).group(1) for name in SQL_SCRIPTS
                     if re.fullmatch(r"pg_ccm--[\d.]+\.sql", name))
        psql("CREATE DATABASE upgrade")
        psql(f"CREATE EXTENSION pg_ccm VERSION '{oldest}'", db="upgrade")
        psql("ALTER EXTENSION pg_ccm UPDATE", db="upgrade")
        assert psql("SELECT extversion FROM pg_extension WHERE extname = 'pg_ccm'", db="upgrade") == VERSION
    except AssertionError:
        print(container.sh("cat /tmp/pg/log", check=False).stdout)
        raise
    finally:
        container.sh(f"{as_postgres} pg_ctl -D /tmp/pg/data -w -m fast stop", check=False)


def test_remove_and_purge_leave_nothing_behind(container):
    files = [f"{PKGLIBDIR}/pg_ccm.so", *(f"{EXTDIR}/{name}" for name in ["pg_ccm.control", *SQL_SCRIPTS]),
             "/usr/bin/ccm-agent", "/lib/systemd/system/ccm-agent.service",
             f"/usr/share/doc/{EXT_PKG}", "/usr/share/doc/ccm-agent"]
    removed = container.sh(f"dpkg -r ccm-agent {EXT_PKG} 2>&1")
    assert "warning" not in removed.stdout.lower(), removed.stdout
    left = [path for path in files if container.exists(path)]
    assert not left, left
    # `remove` keeps the agent's configuration, `purge` takes it (the extension has none: it is
    # gone already).
    assert container.exists("/etc/ccm-agent/ccm-agent.toml")
    assert container.sh("dpkg-query -W -f='${Status}' ccm-agent").stdout == "deinstall ok config-files"
    purged = container.sh("dpkg -P ccm-agent 2>&1")
    assert "warning" not in purged.stdout.lower(), purged.stdout
    assert not container.exists("/etc/ccm-agent")
    for pkg in (EXT_PKG, "ccm-agent"):
        assert container.sh(f"dpkg-query -W -f='${{Status}}' {pkg}", check=False).stdout.strip() in ("", "unknown ok not-installed")
    # What they depended on stays installed.
    assert container.sh(f"dpkg-query -W -f='${{Status}}' postgresql-{PG_MAJOR}").stdout == "install ok installed"
