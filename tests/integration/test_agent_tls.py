"""ccm-agent over TLS, as libpq would connect: a cluster whose pg_hba.conf lets the agent's
roles in only over TLS (`hostssl`), with certificates this test makes with the openssl CLI.

One primary and streaming standby for the module, both with ssl=on and the same server
certificate (CN=localhost, subjectAltName DNS:localhost and IP:127.0.0.1, signed by a test
CA). pg_hba.conf, prepended on both nodes: `pwuser` only by `hostssl ... scram-sha-256`,
`certuser` only by `hostssl ... cert`; the harness's own `postgres` role keeps its trust
lines (plain or TLS), so replication and the harness's SQL are unchanged.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest
from psycopg import sql

from harness.agent import AgentProcess, run_agent
from harness.cluster import OS_USER, Cluster, pgbench

from test_warmup import wait_for_coverage, warm_primary

# TLS, certificates and password files are the agent's side of the connection (rustls, its
# password file, its client certificate): the same on every PostgreSQL version, so
# scripts/test.sh runs them with the newest only.
pytestmark = [pytest.mark.xdist_group("tls"),  # the module shares one TLS cluster
              pytest.mark.agent_only]

# A password that needs the password file's escapes (`\:` and `\\`).
SECRET = "pw:se\\cret#1"

HBA_LINES = (
    "# test_agent_tls: TLS-only roles (first match wins)\n"
    "hostnossl all pwuser,certuser 127.0.0.1/32 reject\n"
    "hostssl all pwuser 127.0.0.1/32 scram-sha-256\n"
    "hostssl all certuser 127.0.0.1/32 cert\n"
)


def openssl(cwd: Path, *args: str) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}:\n{result.stderr}")


def make_ca(directory: Path, name: str) -> Path:
    openssl(directory, "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}")
    return directory / f"{name}.crt"


def issue(directory: Path, ca: str, name: str, common_name: str, alt_names: str | None = None) -> tuple[Path, Path]:
    """A key and a certificate signed by the CA `ca` (files ca.crt and ca.key in `directory`)."""
    openssl(directory, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={common_name}")
    extra: list[str] = []
    if alt_names:
        (directory / f"{name}.ext").write_text(f"subjectAltName={alt_names}\n")
        extra = ["-extfile", f"{name}.ext"]
    openssl(directory, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-sha256", "-out", f"{name}.crt", *extra)
    key = directory / f"{name}.key"
    os.chmod(key, 0o600)
    return directory / f"{name}.crt", key


def chown_to_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        entry = pwd.getpwnam(OS_USER)
        os.chown(path, entry.pw_uid, entry.pw_gid)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory):
    client = tmp_path_factory.mktemp("client")  # the agent's files: ours (root), 0600 keys
    ca = make_ca(client, "ca")
    client_crt, client_key = issue(client, "ca", "certuser", "certuser")
    other_ca = make_ca(client, "otherca")

    # The servers' files live under the cluster's base directory, which the postgres user
    # can reach (pytest's tmp directories are 0700 root).
    base = Path(tempfile.mkdtemp(prefix="pg_ccm-tls-"))
    server_dir = base / "tls"
    server_dir.mkdir()
    shutil.copy(client / "ca.crt", server_dir / "ca.crt")
    shutil.copy(client / "ca.key", server_dir / "ca.key")
    server_crt, server_key = issue(server_dir, "ca", "server", "localhost", "DNS:localhost,IP:127.0.0.1")
    (server_dir / "ca.key").unlink()
    for path in (server_dir, *server_dir.iterdir()):
        chown_to_postgres(path)
    os.chmod(server_dir, 0o755)

    settings = {
        "ssl": "on",
        "ssl_cert_file": f"'{server_crt}'",
        "ssl_key_file": f"'{server_key}'",
        "ssl_ca_file": f"'{server_dir / 'ca.crt'}'",
    }
    with Cluster(settings=settings, base=base) as cluster:
        primary, standby = cluster.primary, cluster.standby
        pgbench(primary, "-i", "-s", "5", "-q")
        with primary.connect() as conn:
            conn.execute(sql.SQL("CREATE ROLE pwuser LOGIN PASSWORD {} IN ROLE ccm_agent, pg_monitor")
                         .format(sql.Literal(SECRET)))
            conn.execute("CREATE ROLE certuser LOGIN IN ROLE ccm_agent, pg_monitor")
        cluster.wait_caught_up()
        # The standby is a pg_basebackup copy made before these lines: both get them.
        for node in (primary, standby):
            hba = node.datadir / "pg_hba.conf"
            hba.write_text(HBA_LINES + hba.read_text())
            node.sql("SELECT pg_reload_conf()")
        yield SimpleNamespace(cluster=cluster, ca=ca, other_ca=other_ca, client_crt=client_crt,
                              client_key=client_key)


def pgpass_line(host: str, port: int, user: str = "pwuser") -> str:
    escaped = SECRET.replace("\\", "\\\\").replace(":", "\\:")
    return f"{host}:{port}:postgres:{user}:{escaped}\n"


def check_config(primary: str, standby: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    """`ccm-agent check-config --connect` with HOME pointing away from any ~/.postgresql."""
    return run_agent("check-config", "--connect", "--connect-timeout", "5s", "--primary", primary,
                     "--standby", standby, env={"HOME": str(home), **env}, timeout=60)


def test_verify_full_with_a_password_file_warms_the_standby(tls, load_factory, log_dir, tmp_path):
    """Both nodes in one multi-host string on both sides, verify-full against the test CA
    (host name `localhost` for the primary, IP address 127.0.0.1 for the standby), scram
    with the password from a 0600 password file given by passfile=."""
    cluster = tls.cluster
    primary, standby = cluster.primary, cluster.standby
    pgpass = tmp_path / "pgpass"
    pgpass.write_text("# ccm-agent's password file\n" + pgpass_line("localhost", primary.port)
                      + pgpass_line("127.0.0.1", standby.port))
    os.chmod(pgpass, 0o600)
    both = (f"host=localhost,127.0.0.1 port={primary.port},{standby.port} user=pwuser dbname=postgres "
            f"sslmode=verify-full sslrootcert={tls.ca} passfile={pgpass} connect_timeout=2")

    cluster.make_standby_cold()
    warm_primary(load_factory, cluster)
    with AgentProcess(both + " target_session_attrs=read-write", both + " target_session_attrs=standby",
                      log_dir, interval="500ms") as agent:
        fraction, elapsed, hot = wait_for_coverage(cluster, 0.99, timeout=20)
        assert fraction >= 0.99, f"coverage {fraction:.2%} of {hot} hot buffers after {elapsed:.1f}s\n{agent.log()[-3000:]}"
        # The agent's sessions on both nodes are TLS sessions of pwuser (hostssl only anyway).
        for node in (primary, standby):
            rows = node.sql("SELECT a.usename, s.ssl, s.version FROM pg_stat_activity a "
                            "JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = 'ccm-agent'")
            assert rows and all(user == "pwuser" and ssl for user, ssl, _ in rows), rows
        metrics = str(agent.metrics())
    log = agent.log()
    for secret in (SECRET, SECRET.replace("\\", "\\\\")):
        assert secret not in log and secret not in metrics


def test_cancel_requests_go_over_tls(tls, log_dir, tmp_path):
    """A call that gets no answer (its backend stopped) is cancelled at the client-side
    deadline with a cancel request made with the session's TLS settings (verify-full)."""
    cluster = tls.cluster
    primary, standby = cluster.primary, cluster.standby
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(pgpass_line("127.0.0.1", primary.port) + pgpass_line("127.0.0.1", standby.port))
    os.chmod(pgpass, 0o600)

    def conninfo(node) -> str:
        return (f"host=127.0.0.1 port={node.port} user=pwuser dbname=postgres sslmode=verify-full "
                f"sslrootcert={tls.ca} passfile={pgpass}")

    query = ("SELECT pid FROM pg_stat_activity WHERE application_name = 'ccm-agent' "
             "AND backend_type = 'client backend' AND usename = 'pwuser'")
    with AgentProcess(conninfo(primary), conninfo(standby), log_dir, interval="200ms",
                      extra=["--statement-timeout", "1s", "--connect-timeout", "1s"]) as agent:
        agent.wait_for(lambda: standby.one(query) is not None, "the agent's standby session")
        pid = standby.one(query)
        os.kill(pid, signal.SIGSTOP)
        try:
            agent.wait_for(lambda: "cancelled the running statement" in agent.log()
                           or "cancel request" in agent.log(), "the client-side deadline's cancel", timeout=20)
        finally:
            os.kill(pid, signal.SIGCONT)
        log = agent.log()
        assert "cancelled the running statement" in log and "cancel request failed" not in log, log[-3000:]
        assert "cancel request timed out" not in log, log[-3000:]


def test_client_certificate_authentication(tls, tmp_path):
    cluster = tls.cluster

    def conninfo(node, key: Path = tls.client_key) -> str:
        return (f"host=localhost port={node.port} user=certuser dbname=postgres sslmode=verify-full "
                f"sslrootcert={tls.ca} sslcert={tls.client_crt} sslkey={key}")

    result = check_config(conninfo(cluster.primary), conninfo(cluster.standby), tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"primary: localhost:{cluster.primary.port} ok" in result.stderr
    assert f"standby: localhost:{cluster.standby.port} ok" in result.stderr

    # libpq refuses a key that group or others may read, before any connection.
    loose = tmp_path / "loose.key"
    shutil.copy(tls.client_key, loose)
    os.chmod(loose, 0o644)
    result = check_config(conninfo(cluster.primary, loose), conninfo(cluster.standby, loose), tmp_path)
    assert result.returncode != 0
    assert f'localhost:{cluster.primary.port}: TLS: private key file "{loose}" has group or world access' in result.stderr

    # Without a client certificate the cert-only role is turned away by the server.
    plain = f"host=localhost port={cluster.primary.port} user=certuser dbname=postgres sslmode=verify-full sslrootcert={tls.ca}"
    result = check_config(plain, plain, tmp_path)
    assert result.returncode != 0 and "valid client certificate" in result.stderr, result.stderr


def test_wrong_ca_is_refused_with_host_and_reason(tls, tmp_path):
    port = tls.cluster.primary.port
    for mode in ("verify-ca", "verify-full", "require"):
        # `require` verifies too once a root certificate is given (libpq's compatibility rule).
        conninfo = f"host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode={mode} sslrootcert={tls.other_ca}"
        result = check_config(conninfo, conninfo, tmp_path)
        assert result.returncode != 0
        expected = f"127.0.0.1:{port}: TLS: certificate verify failed: certificate is not signed by the CA in {tls.other_ca}"
        assert expected in result.stderr, (mode, result.stderr)

    # `prefer` falls back to a plain session when the handshake fails, as libpq does: the
    # harness's postgres role may connect without TLS, pwuser may not.
    conninfo = f"host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=prefer sslrootcert={tls.other_ca}"
    result = check_config(conninfo, conninfo, tmp_path)
    assert f"primary: 127.0.0.1:{port} ok" in result.stderr, result.stderr
    conninfo = f"host=127.0.0.1 port={port} user=pwuser password=x dbname=postgres sslmode=prefer sslrootcert={tls.other_ca}"
    result = check_config(conninfo, conninfo, tmp_path)
    assert "certificate is not signed by the CA" in result.stderr and "then without TLS (sslmode=prefer)" in result.stderr
    assert "pg_hba.conf rejects connection" in result.stderr, result.stderr


def test_host_name_mismatch_is_refused_by_verify_full_only(tls, tmp_path):
    port = tls.cluster.primary.port
    # hostaddr says where to connect; the name verified is host's, as in libpq.
    base = f"host=db9.invalid hostaddr=127.0.0.1 port={port} user=postgres dbname=postgres sslrootcert={tls.ca}"
    result = check_config(base + " sslmode=verify-full", base + " sslmode=verify-full", tmp_path)
    assert result.returncode != 0
    expected = (f'db9.invalid:{port}: TLS: certificate verify failed: host name "db9.invalid" does not match '
                f"the certificate (names: localhost, 127.0.0.1)")
    assert expected in result.stderr, result.stderr
    result = check_config(base + " sslmode=verify-ca", base + " sslmode=verify-ca", tmp_path)
    assert f"primary: db9.invalid:{port} ok" in result.stderr, result.stderr


def test_server_without_ssl(tls, tmp_path):
    plain = Cluster()
    try:
        plain.init_primary(plain.primary)
        plain.primary.start()
        plain.primary.sql("CREATE EXTENSION pg_ccm")
        port = plain.primary.port
        for mode in ("require", "verify-ca", "verify-full"):
            conninfo = plain.primary.conninfo(sslmode=mode, sslrootcert=str(tls.ca))
            result = check_config(conninfo, conninfo, tmp_path)
            assert result.returncode != 0
            expected = f"127.0.0.1:{port}: TLS: server does not support SSL, but SSL was required"
            assert expected in result.stderr, (mode, result.stderr)
        # verify-* without a root certificate fails before connecting, naming the file.
        conninfo = plain.primary.conninfo(sslmode="verify-ca", sslrootcert=str(tmp_path / "absent.crt"))
        result = check_config(conninfo, conninfo, tmp_path)
        assert f'root certificate file "{tmp_path / "absent.crt"}" does not exist' in result.stderr, result.stderr
        # prefer and allow connect without TLS.
        for mode in ("prefer", "allow"):
            conninfo = plain.primary.conninfo(sslmode=mode)
            result = check_config(conninfo, conninfo, tmp_path)
            assert f"primary: 127.0.0.1:{port} ok" in result.stderr, (mode, result.stderr)
    finally:
        plain.destroy()


def test_password_file_permissions_and_environment(tls, tmp_path):
    """PGPASSFILE names the file; libpq ignores it, with a warning, while others may read it."""
    cluster = tls.cluster
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(pgpass_line("127.0.0.1", cluster.primary.port) + pgpass_line("127.0.0.1", cluster.standby.port))
    os.chmod(pgpass, 0o644)

    def conninfo(node) -> str:
        return f"host=127.0.0.1 port={node.port} user=pwuser dbname=postgres sslmode=verify-full sslrootcert={tls.ca}"

    result = check_config(conninfo(cluster.primary), conninfo(cluster.standby), tmp_path, PGPASSFILE=str(pgpass))
    assert result.returncode != 0
    assert f'password file "{pgpass}" has group or world access' in result.stderr, result.stderr
    assert "password missing" in result.stderr, result.stderr

    os.chmod(pgpass, 0o600)
    result = check_config(conninfo(cluster.primary), conninfo(cluster.standby), tmp_path, PGPASSFILE=str(pgpass))
    assert result.returncode == 0, result.stderr
    # The password file is named in the effective configuration only when the string names
    # it; its contents never are.
    for secret in (SECRET, SECRET.replace("\\", "\\\\"), "se\\\\cret"):
        assert secret not in result.stdout and secret not in result.stderr

    # allow: plain first, and TLS once the server refuses the plain session (hostnossl
    # reject), as libpq does; disable: plain only, refused.
    for mode, ok in (("allow", True), ("disable", False)):
        primary, standby = (f"host=127.0.0.1 port={node.port} user=pwuser dbname=postgres sslmode={mode}"
                            for node in (cluster.primary, cluster.standby))
        result = check_config(primary, standby, tmp_path, PGPASSFILE=str(pgpass))
        assert (result.returncode == 0) == ok, (mode, result.stderr)
        if not ok:
            assert "pg_hba.conf rejects connection" in result.stderr, result.stderr

    # A wrong password from the file: libpq's hint names the file.
    pgpass.write_text("*:*:postgres:pwuser:wrong\n")
    result = check_config(conninfo(cluster.primary), conninfo(cluster.standby), tmp_path, PGPASSFILE=str(pgpass))
    assert result.returncode != 0
    assert f'(password retrieved from file "{pgpass}")' in result.stderr, result.stderr


def test_harness_sessions_still_work_next_to_tls_only_roles(tls):
    """The harness's own plain sessions and replication are untouched by the hostssl lines."""
    cluster = tls.cluster
    with psycopg.connect(cluster.primary.conninfo(sslmode="disable"), autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    cluster.wait_caught_up()
