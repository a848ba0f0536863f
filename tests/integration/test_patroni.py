"""pg_ccm under Patroni (docker/patroni-compose.yml): real etcd, real Patroni 4.1.5, three
PostgreSQL 15 nodes with pg_ccm, `ccm-agent run --patroni`, real pgbench.

Coverage is measured with pg_buffercache on the nodes themselves (a replica's buffer tags
against the leader's hot set, usage count > 3), not only with the agent's counters. Failovers
are Patroni's own: the leader's container is killed (`docker kill`) and Patroni elects a new one.

Skipped only where no Docker engine answers. docker/build-patroni-image.sh builds the image
offline (skipped when it is up to date). The tests share one cluster (module fixture, about 40 s
to bootstrap and load) and each leaves it healthy: a leader, two streaming replicas, the agent up.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from harness.docker import ComposeProject, build_images, docker_engine_runs
from harness.wait import wait_for as poll

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker" / "patroni-compose.yml"
MEMBERS = ("patroni1", "patroni2", "patroni3")
SCALE = 10  # pgbench_accounts: about 16,400 blocks; shared_buffers is 256MB (32,768) per node
WORKLOAD = ("-n", "-M", "prepared", "-b", "tpcb-like@1", "-b", "select-only@20", "-c", "4", "-j", "2")
HOT_USAGE = 4  # the leader's hot set: usage count > 3 (ccm.usage_threshold)
HOT_SET_LEAST = 1000  # blocks: a leader's hot set smaller than this measures nothing
# The agent's per-member series (label node="<Patroni member name>").
COVERAGE_METRIC = "ccm_agent_standby_coverage_ratio"
UP_METRICS = ("ccm_agent_node_up", "ccm_agent_standby_up")
LOADED_METRIC = "ccm_agent_standby_blocks_loaded_total"


# The image holds Debian 12's PostgreSQL 15: scripts/test.sh runs these with 15 only.
pytestmark = [
    pytest.mark.container,
    # The module shares one cluster: one worker.
    pytest.mark.xdist_group("patroni"),
    pytest.mark.skipif(not docker_engine_runs(), reason="no Docker engine runs on this machine"),
]


def wait_for(what: str, probe, timeout: float, interval: float = 1.0):
    """The harness's polling helper, where a failing command (RuntimeError, a subprocess
    timeout) or a series not there yet counts as "not yet"."""
    return poll(what, probe, timeout=timeout, interval=interval,
                retry_on=(RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError))


def docker(*args: str, timeout: float = 60, check: bool = True) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {result.stdout}\n{result.stderr}")
    return result.stdout


class Cluster(ComposeProject):
    def __init__(self) -> None:
        super().__init__(f"pgccmpat{uuid.uuid4().hex[:8]}", COMPOSE_FILE)
        self.network = ""

    def sql(self, host: str, query: str, timeout: float = 60) -> str:
        return self.exec("pgbench", "psql", "-h", host, "-U", "postgres", "-Atq", "-c", query, timeout=timeout).stdout.strip()

    def pgbench(self, host: str, *args: str, timeout: float = 300) -> str:
        out = self.exec("pgbench", "pgbench", "-h", host, "-U", "postgres", *args, "postgres", timeout=timeout).stdout
        assert "-i" in args or re.search(r"number of failed transactions: 0 ", out), out
        return out

    def load(self, host: str, seconds: int) -> subprocess.Popen:
        return self.background("pgbench", "pgbench", "-h", host, "-U", "postgres", *WORKLOAD, "-T", str(seconds), "postgres")

    # --- Patroni -------------------------------------------------------------------------------
    def members(self) -> dict[str, dict]:
        """Patroni's view (patronictl list, through etcd): name -> {Role, State, Tags, ...}."""
        out = self.exec("pgbench", "patronictl", "list", "-f", "json", timeout=30).stdout
        return {m["Member"]: m for m in json.loads(out)}

    def leader(self) -> str | None:
        leaders = [n for n, m in self.members().items() if m["Role"] == "Leader" and m["State"] == "running"]
        return leaders[0] if len(leaders) == 1 else None

    def replicas(self) -> list[str]:
        return sorted(n for n, m in self.members().items() if m["Role"] != "Leader" and m["State"] == "streaming")

    def healthy(self) -> str | None:
        """The leader's name once there is one and the two others stream from it."""
        members = self.members()
        leader = [n for n, m in members.items() if m["Role"] == "Leader" and m["State"] == "running"]
        streaming = [n for n, m in members.items() if m["Role"] != "Leader" and m["State"] == "streaming"]
        return leader[0] if len(leader) == 1 and len(streaming) == 2 else None

    def wait_healthy(self, timeout: float = 180) -> str:
        return wait_for("a leader and two streaming replicas", self.healthy, timeout)

    def set_nofailover(self, member: str, value: bool) -> None:
        """Changes the member's nofailover tag at run time: its configuration file, then a reload."""
        flag = "true" if value else "false"
        self.exec(member, "sed", "-i", f"s/^  nofailover: .*/  nofailover: {flag}/", "/etc/patroni/patroni.yml")
        self.exec("pgbench", "patronictl", "reload", "pg_ccm", member, "--force")
        wait_for(f"{member}'s tag nofailover: {flag}",
                 lambda: self.members()[member].get("Tags", {}).get("nofailover", False) is value, 30)

    def restartpoint(self, leader: str, replica: str) -> None:
        """A checkpoint on the leader, replayed, then a restartpoint on the replica: its next start
        replays (and caches) next to nothing."""
        self.sql(leader, "CHECKPOINT")
        lsn = self.sql(leader, "SELECT pg_current_wal_lsn()")
        wait_for(f"{replica} to replay {lsn}",
                 lambda: self.sql(replica, f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'") == "t", 60)
        self.sql(replica, "CHECKPOINT")

    def make_cold(self, leader: str, replicas: list[str]) -> None:
        """Empties the replicas' shared_buffers: a restartpoint, then Patroni restarts PostgreSQL."""
        for replica in replicas:
            self.restartpoint(leader, replica)
            self.exec("pgbench", "patronictl", "restart", "pg_ccm", replica, "--force")
        self.wait_healthy()

    # --- buffers -------------------------------------------------------------------------------
    def blocks(self, host: str, min_usage: int = 0) -> set[str]:
        out = self.sql(host, "SELECT concat_ws('/', reltablespace, reldatabase, relfilenode, relforknumber, relblocknumber) "
                             f"FROM pg_buffercache WHERE relfilenode IS NOT NULL AND usagecount >= {min_usage}")
        return set(out.splitlines())

    def coverage(self, leader: str, replica: str) -> float:
        """Share of the leader's hot set (usage count > 3) that the replica's shared_buffers hold."""
        hot = self.blocks(leader, HOT_USAGE)
        if len(hot) < HOT_SET_LEAST:
            raise ValueError(f"the leader's hot set is only {len(hot)} blocks")
        return len(hot & self.blocks(replica)) / len(hot)

    def relation_buffers(self, host: str, relation: str) -> int:
        return int(self.sql(host, "SELECT count(*) FROM pg_buffercache b JOIN pg_class c ON b.relfilenode = "
                                  f"pg_relation_filenode(c.oid) WHERE c.relname = '{relation}' "
                                  "AND b.reldatabase = (SELECT oid FROM pg_database WHERE datname = current_database())"))

    def blks_read(self, host: str) -> int:
        return int(self.sql(host, "SELECT sum(blks_read) FROM pg_stat_database"))

    # --- the agent -----------------------------------------------------------------------------
    def metrics(self) -> dict[tuple[str, str], float]:
        """The agent's metrics, asked inside its container (also when it is cut off the network):
        (name, node label or "") -> value."""
        out = self.exec("ccm-agent", "python3", "-c",
                        "import urllib.request; print(urllib.request.urlopen("
                        "'http://127.0.0.1:9935/metrics', timeout=5).read().decode())", timeout=30).stdout
        values = {}
        for line in out.splitlines():
            match = re.match(r'^(\w+)(?:\{(.*)\})?\s+(\S+)', line)
            if match and not line.startswith("#"):
                node = re.search(r'node="([^"]*)"', match.group(2) or "")
                values[(match.group(1), node.group(1) if node else "")] = float(match.group(3))
        return values

    def node_up(self, node: str) -> float | None:
        """The agent's ccm_agent_node_up for the node (None: no such series)."""
        metrics = self.metrics()
        return next((metrics[(name, node)] for name in UP_METRICS if (name, node) in metrics), None)

    def agent_coverage(self, node: str) -> float | None:
        return self.metrics().get((COVERAGE_METRIC, node))

    def warm(self, leader: str, replicas: list[str]) -> float:
        """Both measures of every replica's coverage: pg_buffercache, and the agent's own."""
        worst = 1.0
        for replica in replicas:
            measured, reported = self.coverage(leader, replica), self.agent_coverage(replica)
            if measured < 0.99 or reported is None or reported < 0.99:
                return 0.0
            worst = min(worst, measured)
        return worst

    # --- network -------------------------------------------------------------------------------
    def disconnect(self, service: str) -> None:
        docker("network", "disconnect", self.network, self.container(service))

    def connect(self, service: str) -> None:
        # The service name is the alias other containers resolve; a plain connect would drop it.
        docker("network", "connect", "--alias", service, self.network, self.container(service))


@pytest.fixture(scope="module")
def cluster():
    build_images("build-patroni-image.sh", timeout=1800)
    built = Cluster()
    try:
        built.run("up", "-d", timeout=600)
        leader = built.wait_healthy(timeout=240)
        built.network = next(iter(json.loads(docker("inspect", "-f", "{{json .NetworkSettings.Networks}}",
                                                    built.container("etcd")))))
        built.pgbench(leader, "-i", "-s", str(SCALE), "-q")
        yield built
    finally:
        built.run("down", "-v", "--remove-orphans", check=False, timeout=300)


@pytest.fixture
def leader(cluster):
    """A healthy cluster before and after the test: its leader's name."""
    name = cluster.wait_healthy()
    yield name
    cluster.wait_healthy()


def test_every_replica_holds_the_leaders_hot_set(cluster, leader):
    # A number of transactions, not of seconds: the hot set then has the same size however fast
    # the machine is (100,000 transactions read each accounts block about 6 times, enough for a
    # usage count of 4 in most; 15 s of load on a busy CI machine made a hot set of 4,793).
    cluster.pgbench(leader, *WORKLOAD, "-t", "25000")
    replicas = cluster.replicas()
    assert len(replicas) == 2
    worst = wait_for("both replicas to hold 99% of the leader's hot set (pg_buffercache and the agent's metric)",
                     lambda: cluster.warm(leader, replicas), 90)
    hot = len(cluster.blocks(leader, HOT_USAGE))
    print(f"hot set {hot} blocks on {leader}; lowest coverage {worst:.2%}")
    assert hot > 10_000  # the accounts table, about 16,400 blocks, is most of it


def test_patroni_failover_new_leader_reads_a_tenth_of_the_blocks(cluster, leader, record_property):
    """Patroni fails over after `docker kill` of the leader; the new leader's blocks read from
    storage in its first 30 s (pg_stat_database.blks_read) under Aurora's CCM-test workload, with
    the agent against the agent stopped. Before the kill the leader's hot set is made by reads
    only (pgbench -S after a VACUUM, so no WAL): with writes, replay alone would cache the
    written blocks on the replicas, and how many depends on the machine's speed (75 to 85% of
    the hot set here), which would make the comparison depend on it too."""
    agent = cluster.container("ccm-agent")

    def failover(with_agent: bool) -> dict:
        old = cluster.wait_healthy()
        candidates = cluster.replicas()
        cluster.sql(old, "VACUUM pgbench_accounts")
        cluster.make_cold(old, candidates)
        cluster.pgbench(old, "-n", "-M", "prepared", "-S", "-c", "4", "-j", "2", "-T", "10")
        if with_agent:
            wait_for("the candidates to be warm", lambda: cluster.warm(old, candidates), 60)
        coverage = {r: round(cluster.coverage(old, r), 3) for r in candidates}

        def new_leader() -> str | None:
            name = cluster.leader()
            return name if name != old else None

        start = time.monotonic()
        docker("kill", cluster.container(old))
        new = wait_for("Patroni to elect a new leader", new_leader, 90, interval=0.5)
        elapsed = time.monotonic() - start
        before = cluster.blks_read(new)
        out = cluster.pgbench(new, *WORKLOAD, "-T", "30")
        time.sleep(1.5)  # backends flush their statistics when they exit
        result = {"coverage": coverage, "failover_s": round(elapsed, 1), "new_leader": new,
                  "blocks_read": cluster.blks_read(new) - before,
                  "tps": float(re.search(r"^tps = ([\d.]+)", out, re.M).group(1))}
        docker("start", cluster.container(old))
        cluster.wait_healthy()
        return result

    docker("stop", agent)
    try:
        without = failover(with_agent=False)
    finally:
        docker("start", agent)
    with_agent = failover(with_agent=True)
    print(f"with the agent: {with_agent}\nagent stopped: {without}")
    record_property("with_agent", with_agent)
    record_property("agent_stopped", without)
    assert without["blocks_read"] > 10_000, without  # the cold case really was cold
    assert with_agent["blocks_read"] <= 0.10 * without["blocks_read"], (with_agent, without)


def test_wait_for_coverage_then_switchover(cluster, leader, record_property):
    cluster.pgbench(leader, *WORKLOAD, "-T", "10")
    candidate = cluster.replicas()[0]
    start = time.monotonic()
    every = cluster.exec("ccm-agent", "ccm-agent", "wait", "--min-coverage", "99", "--timeout", "2m", check=False, timeout=180)
    assert every.returncode == 0, every
    one = cluster.exec("ccm-agent", "ccm-agent", "wait", "--min-coverage", "99", "--timeout", "2m", "--member", candidate,
                       check=False, timeout=180)
    assert one.returncode == 0, one
    record_property("wait_s", round(time.monotonic() - start, 1))
    assert cluster.coverage(leader, candidate) >= 0.99
    switchover = cluster.exec("pgbench", "patronictl", "switchover", "--candidate", candidate, "--force", check=False)
    assert switchover.returncode == 0, switchover
    wait_for(f"{candidate} to lead", lambda: cluster.leader() == candidate, 60)
    cluster.pgbench(candidate, "-n", "-S", "-c", "2", "-T", "3")


def test_wait_times_out_while_the_candidate_is_cold(cluster, leader):
    """The other side of `ccm-agent wait`: exit code 1 when the coverage is not reached in time
    (the agent stopped, a replica restarted cold; `wait` runs in a one-off container)."""
    agent = cluster.container("ccm-agent")
    replica = cluster.replicas()[0]
    docker("stop", agent)
    try:
        cluster.make_cold(leader, [replica])
        cluster.pgbench(leader, "-n", "-S", "-c", "2", "-T", "5")
        out = cluster.run("run", "--rm", "--no-deps", "ccm-agent", "agent", "wait", "--min-coverage", "99",
                          "--timeout", "5s", "--member", replica, check=False, timeout=120)
        assert out.returncode == 1 and "timed out" in out.stdout + out.stderr, out
    finally:
        docker("start", agent)


def test_cold_restarted_replica_is_warm_again(cluster, leader, record_property):
    """`docker restart` of a replica (its page cache cannot be dropped in a container, its
    shared_buffers are empty after the restart): the time until it holds the hot set again."""
    cluster.pgbench(leader, *WORKLOAD, "-T", "10")
    replica = cluster.replicas()[0]
    wait_for("the replicas to be warm", lambda: cluster.warm(leader, cluster.replicas()), 60)
    hot = len(cluster.blocks(leader, HOT_USAGE))
    loaded = cluster.metrics().get((LOADED_METRIC, replica), 0)
    cluster.restartpoint(leader, replica)
    start = time.monotonic()
    docker("restart", cluster.container(replica), timeout=120)
    wait_for(f"{replica} to accept connections", lambda: cluster.sql(replica, "SELECT pg_is_in_recovery()", timeout=10) == "t",
             120, interval=0.5)
    up = time.monotonic() - start
    wait_for(f"{replica} to be warm again", lambda: cluster.warm(leader, [replica]), 120, interval=0.5)
    warm = time.monotonic() - start
    reloaded = cluster.metrics()[(LOADED_METRIC, replica)] - loaded
    print(f"{replica}: accepts connections {up:.1f} s after docker restart, warm (99% of {hot} hot blocks) "
          f"after {warm:.1f} s; the agent loaded {reloaded:.0f} blocks into it")
    record_property("accepting_connections_s", round(up, 1))
    record_property("warm_s", round(warm, 1))
    # It really was cold: the agent, not replay, brought most of the hot set back.
    assert reloaded >= 0.5 * hot


def test_network_partitions_of_a_replica_and_of_the_agent(cluster, leader):
    replica, other = cluster.replicas()
    cluster.pgbench(leader, *WORKLOAD, "-T", "10")
    wait_for("the replicas to be warm", lambda: cluster.warm(leader, [replica, other]), 60)
    assert cluster.node_up(replica) == 1 and cluster.node_up(other) == 1

    # A replica cut off: the agent reports it down and keeps warming the other; the leader serves.
    cluster.disconnect(replica)
    try:
        wait_for(f"the agent to report {replica} down", lambda: cluster.node_up(replica) in (0, None), 45)
        cluster.pgbench(leader, *WORKLOAD, "-T", "5")
        assert cluster.node_up(other) == 1
        assert cluster.leader() == leader
    finally:
        cluster.connect(replica)
    wait_for(f"{replica} to stream and be warm again", lambda: replica in cluster.replicas()
             and cluster.node_up(replica) == 1 and cluster.warm(leader, [replica]), 120)

    # The agent cut off: every node is down for it and nothing else notices; a replica restarted
    # cold meanwhile is warm again once the agent is back.
    cluster.disconnect("ccm-agent")
    try:
        wait_for("the agent to report both replicas down",
                 lambda: all(cluster.node_up(r) in (0, None) for r in (replica, other)), 45)
        cluster.make_cold(leader, [other])
        cluster.pgbench(leader, *WORKLOAD, "-T", "5")
        assert cluster.coverage(leader, other) < 0.9
        assert cluster.exec("ccm-agent", "pg-ccm-healthcheck", check=False).returncode == 0  # it lives
    finally:
        cluster.connect("ccm-agent")
    wait_for(f"{other} to be warm again", lambda: cluster.node_up(other) == 1 and cluster.warm(leader, [replica, other]), 120)
    assert cluster.leader() == leader


def test_nofailover_member_is_left_alone(cluster, leader):
    bystander, candidate = cluster.replicas()
    cluster.set_nofailover(bystander, True)
    try:
        # Pruned and hinted now, so that the reads below write no WAL (replay would bring blocks
        # of pgbench_accounts into the replicas' buffers).
        cluster.sql(leader, "VACUUM pgbench_accounts")
        cluster.make_cold(leader, [bystander, candidate])

        # Select-only reads until the leader has a hot set: how many 15 s make depends on
        # this machine's speed (once, 15 s left 206 blocks at usage 4 or more).
        def heated() -> bool:
            cluster.pgbench(leader, "-n", "-M", "prepared", "-S", "-c", "4", "-j", "2", "-T", "15")
            return len(cluster.blocks(leader, HOT_USAGE)) >= HOT_SET_LEAST
        wait_for("a hot set on the leader", heated, 120)
        wait_for(f"{candidate} to be warm", lambda: cluster.warm(leader, [candidate]), 60)
        cycles = cluster.metrics()[("ccm_agent_cycles_total", "")]
        wait_for("a few more of the agent's cycles",
                 lambda: cluster.metrics()[("ccm_agent_cycles_total", "")] >= cycles + 3, 30)
        on_leader = cluster.relation_buffers(leader, "pgbench_accounts")
        on_candidate = cluster.relation_buffers(candidate, "pgbench_accounts")
        on_bystander = cluster.relation_buffers(bystander, "pgbench_accounts")
        print(f"pgbench_accounts buffers: leader {on_leader}, candidate {candidate} {on_candidate}, "
              f"nofailover {bystander} {on_bystander}")
        assert on_candidate >= 0.95 * on_leader
        assert on_bystander <= 0.10 * on_candidate
        assert cluster.coverage(leader, bystander) < 0.5
        assert cluster.agent_coverage(bystander) is None  # not one of the agent's standbys
    finally:
        cluster.set_nofailover(bystander, False)
