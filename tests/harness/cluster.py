"""A local primary and streaming standby on loopback ports, for tests, benchmarks and the demo.

Real PostgreSQL servers from the system installation (PG_BIN: the environment's, else
PostgreSQL 15's; the demo and the benchmarks pick a version with `use_pg_version`), started
as the unprivileged ``postgres`` OS user when we run as root (PostgreSQL refuses to run as
root). Every node lives in its own directory under one base directory, listens on 127.0.0.1
and keeps its Unix socket in the base directory.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import psycopg

from .wait import wait_for

# Laid out as Debian lays out its packages, /usr/lib/postgresql/N/bin (scripts/lib/pg-versions.sh);
# PG_ROOT names a relocated copy of that directory instead.
PG_ROOT = Path(os.environ.get("PG_ROOT", "/usr/lib/postgresql"))


def workspace_version() -> str:
    """This checkout's pg_ccm version ([workspace.package] of Cargo.toml): the extension's
    default version and the agent's."""
    text = (Path(__file__).resolve().parents[2] / "Cargo.toml").read_text()
    section = text[text.index("[workspace.package]"):]
    return re.search(r'^version\s*=\s*"([^"]+)"', section, re.M).group(1)
PG_BIN = Path(os.environ.get("PG_BIN", str(PG_ROOT / "15" / "bin")))
OS_USER = "postgres"

# -- PostgreSQL versions -------------------------------------------------------------------
PG_VERSIONS = (15, 16, 17, 18)


class PgVersionError(Exception):
    """A PostgreSQL version that cannot run here; the message says what to install."""


def pg_bindir(version: int) -> Path:
    return PG_ROOT / str(version) / "bin"


def installed_pg_versions() -> list[int]:
    """The supported versions whose pg_config is installed, oldest first."""
    return [v for v in PG_VERSIONS if os.access(pg_bindir(v) / "pg_config", os.X_OK)]


def pg_ccm_library(version: int) -> Path | None:
    """pg_ccm.so in the version's `pg_config --pkglibdir`, None if it is not installed there."""
    pkglibdir = subprocess.run([str(pg_bindir(version) / "pg_config"), "--pkglibdir"],
                               capture_output=True, text=True).stdout.strip()
    library = Path(pkglibdir) / "pg_ccm.so"
    return library if pkglibdir and library.exists() else None


def resolve_pg_versions(spec: str | int | None) -> list[int]:
    """The versions a `--pg` argument names: "N", "N,M,..." or "all" (every installed version),
    or, for None, the newest installed version that has pg_ccm. Raises PgVersionError, naming
    the command that installs what is missing, unless each of them has pg_ccm installed."""
    installed = installed_pg_versions()
    if not installed:
        raise PgVersionError(f"no PostgreSQL {PG_VERSIONS[0]} to {PG_VERSIONS[-1]} is installed under "
                             f"{PG_ROOT}: run scripts/setup.sh")
    if spec is None:
        with_ccm = [v for v in installed if pg_ccm_library(v)]
        if not with_ccm:
            raise PgVersionError(f"pg_ccm is not installed for any PostgreSQL here (installed: "
                                 f"{', '.join(map(str, installed))}): run scripts/install.sh --pg {installed[-1]}")
        return [with_ccm[-1]]
    spec = str(spec)
    if spec.strip() == "all":
        versions = installed
    else:
        try:
            versions = sorted({int(part) for part in spec.split(",") if part.strip()})
        except ValueError:
            raise PgVersionError(f"--pg {spec}: expected N, N,M,... or all") from None
    if not versions:
        raise PgVersionError(f"--pg {spec}: expected N, N,M,... or all")
    for version in versions:
        if version not in PG_VERSIONS:
            raise PgVersionError(f"PostgreSQL {version} is not supported ({PG_VERSIONS[0]} to {PG_VERSIONS[-1]} are)")
        if version not in installed:
            raise PgVersionError(f"PostgreSQL {version} is not installed (no {pg_bindir(version)}/pg_config): "
                                 f"run PG_VERSIONS={version} scripts/setup.sh, then scripts/install.sh --pg {version}")
    missing = [v for v in versions if not pg_ccm_library(v)]
    if missing:
        raise PgVersionError(f"pg_ccm is not installed for PostgreSQL {' and '.join(map(str, missing))} (no pg_ccm.so "
                             f"in pg_config --pkglibdir): run " + " && ".join(f"scripts/install.sh --pg {v}" for v in missing))
    return versions


def use_pg_version(version: int) -> Path:
    """Runs every later server and client program from PostgreSQL `version` and returns its
    bin directory. Harness modules that imported PG_BIN by name (harness.logical) follow, and
    so do child processes that read the PG_BIN environment variable."""
    global PG_BIN
    PG_BIN = pg_bindir(version)
    os.environ["PG_BIN"] = str(PG_BIN)
    for name, module in list(sys.modules.items()):
        if name.startswith("harness.") and name != __name__ and isinstance(getattr(module, "PG_BIN", None), Path):
            module.PG_BIN = PG_BIN
    return PG_BIN


def pg_bin() -> Path:
    """The bin directory in use (PG_BIN as `use_pg_version` last set it)."""
    return PG_BIN


def pg_version_text() -> str:
    """`pg_config --version` of the PostgreSQL in use, e.g. "PostgreSQL 18.6"."""
    return subprocess.run([str(PG_BIN / "pg_config"), "--version"], capture_output=True, text=True).stdout.strip()


# Settings every node gets; callers add or override per cluster.
BASE_SETTINGS: dict[str, Any] = {
    "listen_addresses": "'127.0.0.1'",
    "shared_preload_libraries": "'pg_ccm'",
    "shared_buffers": "'128MB'",
    "wal_level": "replica",
    "max_wal_senders": 10,
    "max_replication_slots": 10,
    "hot_standby": "on",
    "hot_standby_feedback": "on",
    "wal_log_hints": "on",  # pg_rewind
    "wal_keep_size": "'512MB'",  # pg_rewind reads the old primary's WAL back to the divergence
    "fsync": "off",  # tests and demos measure reads, not durability
    "synchronous_commit": "off",
    "max_connections": 100,
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] %q%a '",
}


# Servers run without RUST_BACKTRACE, as in production: with it, every ERROR raised through
# pgrx captures and symbolizes a backtrace, which slows error recovery by milliseconds (long
# enough for replay to repeat a recovery-conflict signal into the idle session).
SERVER_ENV = {key: value for key, value in os.environ.items() if key not in ("RUST_BACKTRACE", "RUST_LIB_BACKTRACE")}


def _running_as_root() -> bool:
    return os.geteuid() == 0


def _as_postgres(argv: Sequence[str]) -> list[str]:
    return ["runuser", "-u", OS_USER, "--", *argv] if _running_as_root() else list(argv)


def run_pg(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """Runs a PostgreSQL program as the unprivileged user; raises with its output on failure."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("env", SERVER_ENV)
    result = subprocess.run(_as_postgres(argv), **kwargs)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def _chown_to_postgres(path: Path) -> None:
    if _running_as_root():
        entry = pwd.getpwnam(OS_USER)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _alive(pid: int) -> bool:
    if not _exists(pid):
        return False
    # A zombie still answers kill(0); it holds nothing.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


# Ports for nodes, agents and other servers: below the kernel's ephemeral ports, in the range
# PG_CCM_PORTS ("FIRST:COUNT", default 20000:12000; scripts/test.sh gives runs that go on side
# by side ranges of their own), split between pytest-xdist's workers. Each process takes the
# ports of its block in turn, so that two tests running side by side never pick the same port
# between its check and its use.
_next_port: dict[str, int] = {}


def _port_block() -> tuple[int, int]:
    first, count = (int(part) for part in os.environ.get("PG_CCM_PORTS", "20000:12000").split(":"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = count // max(workers, 1)
    return first + (index % max(workers, 1)) * size, size


def free_port() -> int:
    """A loopback port nobody listens on, from this process's block."""
    import socket

    first, size = _port_block()
    for _ in range(size):
        offset = _next_port.get("offset", (os.getpid() * 7) % size)
        _next_port["offset"] = (offset + 1) % size
        port = first + offset
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}..{first + size - 1}")


@dataclass
class Node:
    """One PostgreSQL server."""

    name: str
    port: int
    base: Path
    settings: dict[str, Any] = field(default_factory=dict)
    # RLIMIT_MEMLOCK for the server in bytes (prlimit --memlock); None inherits ours.
    memlock: str | None = None
    # A command the server is started under (for example one that enters a cgroup).
    wrapper: list[str] = field(default_factory=list)
    # Start the server with the CAP_IPC_LOCK capability (as systemd's AmbientCapabilities
    # would), so that mlock() is not bound by RLIMIT_MEMLOCK.
    ipc_lock: bool = False
    # Environment variables the server is started with, over SERVER_ENV.
    environment: dict[str, str] = field(default_factory=dict)
    # The installation the server runs from (another build of the same version, for example
    # an earlier pg_ccm release's: scripts/build-previous-release.sh); None: PG_BIN.
    bindir: Path | None = None

    @property
    def bin(self) -> Path:
        return self.bindir or PG_BIN

    @property
    def datadir(self) -> Path:
        return self.base / self.name

    @property
    def logfile(self) -> Path:
        return self.base / f"{self.name}.log"

    def log_size(self) -> int:
        """Where the server log ends now: an offset for `log_lines_since`."""
        return self.logfile.stat().st_size if self.logfile.exists() else 0

    def log_lines_since(self, offset: int, needle: str) -> list[str]:
        """The server log's lines after `offset` (from `log_size`) that contain `needle`."""
        with open(self.logfile, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        return [line for line in text.splitlines() if needle in line]

    def conninfo(self, dbname: str = "postgres", user: str = "postgres", **extra: Any) -> str:
        parts = {"host": "127.0.0.1", "port": self.port, "dbname": dbname, "user": user, **extra}
        return " ".join(f"{key}={value}" for key, value in parts.items())

    # -- lifecycle -------------------------------------------------------------------

    def write_settings(self, settings: dict[str, Any]) -> None:
        lines = [f"{key} = {value}" for key, value in settings.items()]
        with open(self.datadir / "postgresql.conf", "a") as conf:
            conf.write("\n# pg_ccm harness\n" + "\n".join(lines) + "\n")

    def start(self, wait: bool = True) -> None:
        argv = [str(self.bin / "pg_ctl"), "-D", str(self.datadir), "-l", str(self.logfile), "-w" if wait else "-W", "-t", "120", "start"]
        if self.memlock is not None or self.wrapper or self.ipc_lock:
            if self.ipc_lock and _running_as_root():
                argv = ["setpriv", f"--reuid={OS_USER}", f"--regid={OS_USER}", "--init-groups",
                        "--inh-caps=+ipc_lock", "--ambient-caps=+ipc_lock", "--", *argv]
            else:
                argv = _as_postgres(argv)
            if self.memlock is not None:
                # Set by us (root) for the server.
                argv = ["prlimit", f"--memlock={self.memlock}", "--", *argv]
            argv = [*self.wrapper, *argv]
            result = subprocess.run(argv, capture_output=True, text=True, env={**SERVER_ENV, **self.environment})
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}")
        else:
            run_pg(argv, env={**SERVER_ENV, **self.environment})
        if wait:
            self.wait_ready()

    def stop(self, mode: str = "fast", timeout: int = 120) -> None:
        if self.is_running():
            try:
                run_pg([str(self.bin / "pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "-t", str(timeout), "stop"])
            except RuntimeError as failure:
                raise RuntimeError(f"{failure}\n{self.stuck_processes()}") from None

    def stuck_processes(self) -> str:
        """What a server that did not shut down is still running: its processes (their titles
        say what each is), where each waits in the kernel and in PostgreSQL (a gdb backtrace),
        and the end of its log; a shutdown that hangs once in a hundred runs is read from this."""
        pid = self.postmaster_pid()
        if pid is None:
            return "(no postmaster.pid)"
        children = [str(child) for child in self.child_pids()]
        lines = [subprocess.run(["ps", "-o", "pid,stat,wchan:30,etime,args", "-p", ",".join([str(pid), *children])],
                                capture_output=True, text=True).stdout]
        for child in children[:12]:
            trace = subprocess.run(["timeout", "30", "gdb", "-p", child, "-batch", "-ex", "bt 25"],
                                   capture_output=True, text=True)
            lines.append(f"-- backtrace of {child}:\n" + "\n".join(
                line for line in trace.stdout.splitlines() if line.startswith("#")))
        try:
            lines.append("-- end of the server log:\n" + "\n".join(self.logfile.read_text().splitlines()[-40:]))
        except OSError as error:
            lines.append(f"-- no server log: {error}")
        return "\n".join(lines)

    def finish_crash_recovery(self) -> None:
        """Replays a crashed (stopped, not shut down) node's WAL and shuts it down cleanly,
        keeping every WAL segment, as Patroni does before pg_rewind.

        pg_rewind would run this recovery itself, but its end-of-recovery checkpoint recycles
        the segments before it, and pg_rewind then reads the old primary's WAL backwards from
        the divergence to the last checkpoint before it: after a write burst longer than
        wal_keep_size that checkpoint's segment is gone. With archive_mode on and an
        archive_command that fails, no unarchived segment is recycled.
        """
        self.wait_until_reaped()
        run_pg([str(self.bin / "postgres"), "--single", "-F", "-D", str(self.datadir),
                "-c", "archive_mode=on", "-c", "archive_command=false", "postgres"],
               stdin=subprocess.DEVNULL)

    def restart(self) -> None:
        self.stop()
        self.start()

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.datadir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (FileNotFoundError, ValueError):
            return None

    def is_running(self) -> bool:
        pid = self.postmaster_pid()
        return pid is not None and _alive(pid)

    def child_pids(self) -> list[int]:
        """The pids of the postmaster's children (its server processes), none without one."""
        pid = self.postmaster_pid()
        if pid is None:
            return []
        listed = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        return [int(child) for child in listed.split()]

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crash would, and wait until its children are gone
        (they notice the postmaster's death on their own, as after a real crash)."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        processes = [pid, *self.child_pids()]
        os.kill(pid, signal.SIGKILL)
        wait_for(f"{self.name}'s processes to end after SIGKILL", lambda: not any(_alive(p) for p in processes),
                 timeout=30, interval=0.1)

    def wait_until_reaped(self, timeout: float = 30) -> None:
        """Waits until a killed postmaster's zombie is reaped (by init, after a second or two
        here): until then it still answers kill(pid, 0), and PostgreSQL's own lock-file check
        refuses to start in its data directory."""
        pid = self.postmaster_pid()
        if pid is not None:
            wait_for(f"{self.name}'s postmaster {pid} to be reaped", lambda: not _exists(pid), timeout=timeout, interval=0.1)

    def wait_ready(self, timeout: float = 60) -> None:
        def answers() -> bool:
            with self.connect(connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True

        wait_for(f"{self.name} to accept connections", answers, timeout=timeout, interval=0.1,
                 retry_on=(psycopg.OperationalError,))

    def promote(self) -> None:
        run_pg([str(self.bin / "pg_ctl"), "-D", str(self.datadir), "-w", "-t", "120", "promote"])
        self.wait_until(lambda: not self.in_recovery(), "promotion")

    # -- SQL -------------------------------------------------------------------------

    def connect(self, dbname: str = "postgres", user: str = "postgres", **kwargs: Any) -> psycopg.Connection:
        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.conninfo(dbname=dbname, user=user), **kwargs)

    def sql(self, query: str, params: Sequence[Any] | None = None, dbname: str = "postgres") -> list[tuple]:
        with self.connect(dbname=dbname) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

    def one(self, query: str, params: Sequence[Any] | None = None, dbname: str = "postgres") -> Any:
        rows = self.sql(query, params, dbname=dbname)
        return rows[0][0] if rows else None

    def in_recovery(self) -> bool:
        return bool(self.one("SELECT pg_is_in_recovery()"))

    def wait_until(self, predicate, what: str, timeout: float = 60, interval: float = 0.1,
                   describe: Callable[[], str] | None = None) -> Any:
        return wait_for(f"{self.name}: {what}", predicate, timeout=timeout, interval=interval, describe=describe)

    # -- caches ----------------------------------------------------------------------

    def cached_blocks(self, min_usage: int = 0) -> set[tuple[int, int, int, int, int]]:
        """Buffer tags in shared_buffers (pg_buffercache), with usage count >= min_usage."""
        rows = self.sql(
            "SELECT reltablespace::int8, reldatabase::int8, relfilenode::int8, relforknumber, relblocknumber "
            "FROM pg_buffercache WHERE relfilenode IS NOT NULL AND usagecount >= %s",
            [min_usage],
        )
        return set(rows)

    def drop_os_cache(self) -> None:
        """Evicts the node's data files from the OS page cache, as if it ran on its own host."""
        subprocess.run(["sync"], check=True)
        subprocess.run(["vmtouch", "-q", "-e", str(self.datadir)], check=True)


def coverage(primary: Node, standby: Node, threshold: int = 3) -> tuple[float, int]:
    """Fraction of the primary's hot buffers (usage count > threshold) cached on the standby,
    measured with pg_buffercache on both nodes, and the hot set's size."""
    hot = primary.cached_blocks(min_usage=threshold + 1)
    if not hot:
        return 1.0, 0
    cached = standby.cached_blocks()
    return len(hot & cached) / len(hot), len(hot)


def make_table(node: Node, name: str, megabytes: int) -> None:
    """A table of about `megabytes` MB (36 rows of 200 bytes per 8 kB page)."""
    rows = megabytes * 128 * 36
    node.sql(f"CREATE TABLE {name} AS SELECT g AS id, repeat('x', 200) AS pad FROM generate_series(1, {rows}) g")


def read(node: Node, table: str, times: int = 1) -> None:
    """Sequential scans of `table`: a table under a quarter of shared_buffers is cached in
    ordinary buffers (one usage count per scan), a larger one only in a 256 kB ring."""
    for _ in range(times):
        node.sql(f"SELECT count(*) FROM {table}")


def multi_host_conninfo(nodes: Sequence[Node], **extra: Any) -> str:
    """Several nodes in one libpq multi-host string, in the order given (user postgres,
    dbname postgres, then `extra`, e.g. target_session_attrs)."""
    parts = {"host": ",".join("127.0.0.1" for _ in nodes), "port": ",".join(str(n.port) for n in nodes),
             "user": "postgres", "dbname": "postgres", **extra}
    return " ".join(f"{key}={value}" for key, value in parts.items())


class Cluster:
    """A primary and a streaming standby (tier-0) built from it with pg_basebackup; more
    standbys with `add_standby`."""

    def __init__(
        self,
        settings: dict[str, Any] | None = None,
        base: Path | None = None,
        keep: bool = False,
        standby_settings: dict[str, Any] | None = None,
    ):
        self.base = Path(base or tempfile.mkdtemp(prefix="pg_ccm-"))
        self.base.mkdir(parents=True, exist_ok=True)
        _chown_to_postgres(self.base)
        os.chmod(self.base, 0o755)
        self.settings = {**BASE_SETTINGS, "unix_socket_directories": f"'{self.base}'", **(settings or {})}
        self.standby_settings = standby_settings or {}
        self.keep = keep
        self.primary = Node("primary", free_port(), self.base)
        self.standby = Node("standby", free_port(), self.base)
        # Standbys beyond the first (add_standby), stopped by destroy() like the others.
        self.extra_standbys: list[Node] = []

    def __enter__(self) -> "Cluster":
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self, extensions: Iterable[str] = ("pg_ccm", "pg_buffercache"), template: Path | None = None, standby: bool = True) -> None:
        """Starts the primary (from `template`, a stopped data directory, if given; it is
        copied, not used) and clones the standby from it (unless `standby` is false)."""
        if template is None:
            self.init_primary(self.primary)
        else:
            self.copy_primary(self.primary, template)
        self.primary.start()
        for extension in extensions:
            self.primary.sql(f"CREATE EXTENSION IF NOT EXISTS {extension}")
        if not standby:
            return
        self.clone_standby(self.standby, self.primary)
        self.standby.start()
        self.wait_caught_up()

    def init_primary(self, node: Node) -> None:
        run_pg([str(PG_BIN / "initdb"), "-D", str(node.datadir), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"])
        with open(node.datadir / "pg_hba.conf", "a") as hba:
            hba.write("host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n")
        node.write_settings({**self.settings, "port": node.port})

    def copy_primary(self, node: Node, template: Path) -> None:
        subprocess.run(["cp", "-a", str(template), str(node.datadir)], check=True)
        if _running_as_root():
            subprocess.run(["chown", "-R", f"{OS_USER}:{OS_USER}", str(node.datadir)], check=True)
        (node.datadir / "postmaster.pid").unlink(missing_ok=True)
        node.write_settings({**self.settings, "port": node.port})

    def clone_standby(self, node: Node, source: Node, tablespaces: dict[Path, Path] | None = None,
                      settings: dict[str, Any] | None = None) -> None:
        """pg_basebackup of `source`; `tablespaces` maps the source's tablespace directories
        to the clone's (both nodes share one host, so they cannot share the paths).
        `settings` replace the cluster's standby_settings for this node."""
        mapping = []
        for old, new in (tablespaces or {}).items():
            Path(new).mkdir(parents=True, exist_ok=True)
            _chown_to_postgres(Path(new))
            mapping.append(f"--tablespace-mapping={old}={new}")
        run_pg([str(PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(source.port), "-U", "postgres", "-D", str(node.datadir), "-R", "-X", "stream", "-c", "fast", "--no-sync", *mapping])
        node.write_settings({**(self.standby_settings if settings is None else settings), "port": node.port})

    def add_standby(self, name: str, settings: dict[str, Any] | None = None) -> Node:
        """One more streaming standby of the primary, cloned, started and caught up.
        `settings` (default: the cluster's standby_settings) are this node's own."""
        node = Node(name, free_port(), self.base)
        self.extra_standbys.append(node)
        self.clone_standby(node, self.primary, settings=settings)
        node.start()
        self.wait_caught_up(standby=node)
        return node

    def wait_caught_up(self, timeout: float = 120, standby: Node | None = None) -> None:
        """Waits until the standby (or `standby`) has replayed everything the primary has
        written so far.

        The insert position, not pg_current_wal_lsn() (the write position): with
        synchronous_commit off a commit record may still sit in WAL buffers beyond the
        latter, and the standby would be "caught up" without the last commits."""
        standby = standby or self.standby
        target = self.primary.one("SELECT pg_current_wal_insert_lsn()::text")
        standby.wait_until(
            lambda: standby.one("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", [target]),
            f"replay of {target}",
            timeout=timeout,
        )

    def make_standby_cold(self, standby: Node | None = None) -> None:
        """Restarts the standby (or `standby`) with an empty cache.

        A restarted standby replays from its last restartpoint and caches what it replays,
        so first make that restartpoint current: CHECKPOINT on the primary, wait for the
        standby to replay it, CHECKPOINT on the standby (a restartpoint), then restart.
        """
        standby = standby or self.standby
        self.primary.sql("CHECKPOINT")
        self.wait_caught_up(standby=standby)
        standby.sql("CHECKPOINT")
        standby.stop()
        standby.drop_os_cache()
        standby.start()
        self.wait_caught_up(standby=standby)

    def both_nodes_conninfo(self, target_session_attrs: str) -> str:
        """Both nodes in one libpq multi-host string, as Patroni users write them: whoever
        connects picks a side by role, so it follows a failover and finds a rejoined node."""
        return multi_host_conninfo([self.primary, self.standby], connect_timeout=2,
                                   target_session_attrs=target_session_attrs)

    def reserve_wal_for_rejoin(self, new_primary: Node, slot: str = "rejoin") -> str:
        """Creates a physical slot on the new primary right after promotion, as Patroni keeps
        one per member, so the WAL the old primary needs to catch up is not recycled."""
        new_primary.sql("SELECT pg_create_physical_replication_slot(%s, true)", [slot])
        return slot

    def rejoin_as_standby(self, old_primary: Node, new_primary: Node, slot: str | None = None) -> None:
        """pg_rewind the old primary onto the new one and start it as its standby.

        pg_rewind copies the source's configuration files, so the node's own port and the
        new primary_conninfo are written back afterwards.
        """
        if old_primary.is_running():
            old_primary.stop("immediate")
        old_primary.finish_crash_recovery()
        # A just-promoted server's control file names its new timeline only after its first
        # checkpoint; before that, pg_rewind sees one timeline and rewinds nothing.
        new_primary.sql("CHECKPOINT")
        run_pg([str(PG_BIN / "pg_rewind"), "-D", str(old_primary.datadir), f"--source-server={new_primary.conninfo()}"])
        (old_primary.datadir / "standby.signal").touch()
        _chown_to_postgres(old_primary.datadir / "standby.signal")
        old_primary.write_settings({"port": old_primary.port})
        # postgresql.auto.conf is read last; the copied one points at the node itself.
        with open(old_primary.datadir / "postgresql.auto.conf", "a") as conf:
            conf.write(f"primary_conninfo = 'host=127.0.0.1 port={new_primary.port} user=postgres'\n")
            if slot:
                conf.write(f"primary_slot_name = '{slot}'\n")
        old_primary.start()

    def follow(self, standby: Node, new_primary: Node) -> None:
        """Points a standby's WAL receiver at `new_primary` (primary_conninfo; a running
        standby reloads it, PostgreSQL 13 and later), as Patroni does with the other
        replicas after a failover. The standby must not have received WAL past the point
        where `new_primary` left the old timeline (no rewind here); recovery_target_timeline
        'latest', the default, makes it follow the new timeline."""
        with open(standby.datadir / "postgresql.auto.conf", "a") as conf:
            conf.write(f"primary_conninfo = 'host=127.0.0.1 port={new_primary.port} user=postgres'\n")
        if standby.is_running():
            standby.sql("SELECT pg_reload_conf()")

    def destroy(self) -> None:
        for node in (*self.extra_standbys, self.standby, self.primary):
            try:
                node.stop("immediate")
            except Exception:
                pass
        if not self.keep:
            shutil.rmtree(self.base, ignore_errors=True)


def pgbench(node: Node, *args: str, dbname: str = "postgres", check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess:
    """Runs pgbench against a node (as any user: it is only a client)."""
    argv = [str(PG_BIN / "pgbench"), "-h", "127.0.0.1", "-p", str(node.port), "-U", "postgres", *args, dbname]
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    result = subprocess.run(argv, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"pgbench {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result
