"""One active agent per cluster: three `ccm-agent run` on one primary and standby (a sidecar
per member, a blue/green upgrade, a forgotten test agent) elect one through a session-level
advisory lock on the primary. The others stand by: /readyz 503 naming the holder,
ccm_agent_active 0, and no call that would reset a node's change feed. Killing the active
agent hands the lock to another within two intervals and a margin, and warming goes on. A
failover moves the election to the new primary. An agent cut off from the primary (its packets
dropped, nothing closed) loses the lock when the primary's keepalives give up on its session,
and another takes over.

Without the election every agent's feed call resets every node's feed (another subscriber),
so the reset counters climb every cycle: the storm this test must not see."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import uuid

from harness.agent import AgentProcess, agent_command, run_agent, run_agent_json
from harness.cluster import coverage, multi_host_conninfo
from harness.wait import wait_for

from test_warmup import warm_primary
import pytest

# The agent's own behaviour: the same whatever the server (scripts/test.sh: newest only).
pytestmark = pytest.mark.agent_only

INTERVAL = 0.5
# Two intervals, as the goal says, plus time for the killed agent's backend to exit and for
# a busy CI machine.
TAKEOVER_LIMIT = 2 * INTERVAL + 2.0
NAMES = ("ccm-agent-a", "ccm-agent-b", "ccm-agent-c")


def start_agents(cluster, log_dir) -> dict[str, AgentProcess]:
    """Three agents on the cluster, told apart on the primary by their application_name."""
    agents = {}
    for name in NAMES:
        agents[name] = AgentProcess(cluster.primary.conninfo(application_name=name),
                                    cluster.standby.conninfo(application_name=name),
                                    log_dir, interval=f"{int(INTERVAL * 1000)}ms").start()
    return agents


def active(agent: AgentProcess) -> float | None:
    """ccm_agent_active, None when the agent does not export it."""
    return agent.metrics().get("ccm_agent_active")


def figures(agents: dict[str, AgentProcess]) -> dict[str, dict[str, float | None]]:
    """What each live agent's metrics say: for the waits' messages and the report."""
    return {name: {"active": active(a), "feed_resets": a.metric("ccm_agent_feed_resets_total"),
                   "loaded": a.metric("ccm_agent_blocks_loaded_total")}
            for name, a in agents.items() if a.alive()}


def the_active_one(agents: dict[str, AgentProcess]) -> str | None:
    """The one agent with ccm_agent_active 1 while every other says 0, else None."""
    roles = {name: active(a) for name, a in agents.items() if a.alive()}
    winners = [name for name, value in roles.items() if value == 1]
    if len(winners) == 1 and all(value == 0 for name, value in roles.items() if name != winners[0]):
        return winners[0]
    return None


def wait_one_active(agents: dict[str, AgentProcess], timeout: float) -> str:
    return wait_for("exactly one active agent", lambda: the_active_one(agents), timeout=timeout,
                    interval=0.05, describe=lambda: f"agents: {figures(agents)}")


def total_resets(agents: dict[str, AgentProcess]) -> float:
    return sum(a.metric("ccm_agent_feed_resets_total") for a in agents.values() if a.alive())


def wait_standby_warm(cluster, agents, timeout: float = 30) -> float:
    seen = []

    def warm() -> bool:
        seen.append(coverage(cluster.primary, cluster.standby)[0])
        return seen[-1] >= 0.99

    wait_for("the standby to hold 99% of the hot set", warm, timeout=timeout, interval=0.25,
             describe=lambda: f"coverage {seen[-1:]}, agents: {figures(agents)}")
    return seen[-1]


def assert_standing_by(agent: AgentProcess, holder: str) -> None:
    status, body = agent.readiness()
    assert status == 503 and body["standby"] and not body["active"], body
    assert body["reasons"][0].startswith("standby: ") and holder in body["reasons"][0], body
    assert holder in body["active_agent"], body
    assert agent.metric("ccm_agent_blocks_loaded_total") == 0
    assert agent.metric("ccm_agent_feed_resets_total") == 0
    assert agent.metric("ccm_agent_cycles_total") == 0


def test_three_agents_one_active_no_reset_storm_and_a_takeover(cluster, load_factory, log_dir):
    cluster.make_standby_cold()
    warm_primary(load_factory, cluster)
    assert coverage(cluster.primary, cluster.standby)[0] < 0.5, "the standby should start cold"

    agents = start_agents(cluster, log_dir)
    try:
        # Exactly one is active within a few intervals; the others stand by and say who holds it.
        winner = wait_one_active(agents, timeout=6 * INTERVAL + 2)
        standbys = [name for name in NAMES if name != winner]
        for name in standbys:
            # 503 alone is also an agent that has not tried the lock yet: wait for "standby".
            agents[name].wait_for(lambda: agents[name].readiness()[1].get("standby"), "/readyz to say standby")
            assert_standing_by(agents[name], winner)
        agents[winner].wait_for(lambda: agents[winner].readiness()[0] == 200, "/readyz of the active agent")
        wait_standby_warm(cluster, agents)

        # No storm: over ten seconds (twenty intervals) no node's feed starts over again.
        initial = total_resets(agents)
        assert initial <= 2, f"the active agent's first calls reset each node's feed once: {figures(agents)}"
        time.sleep(10)
        after = total_resets(agents)
        assert after == initial, f"feed resets went from {initial} to {after}: {figures(agents)}"
        for name in standbys:
            assert_standing_by(agents[name], winner)
            log = agents[name].log()
            assert log.count("standing by (warming nothing") == 1, log[-3000:]

        # `ccm-agent status` names the holder on the primary.
        args = ["--primary", cluster.primary.conninfo(), "--standby", cluster.standby.conninfo()]
        status = run_agent_json("status", *args)
        assert status["active_agent"]["application_name"] == winner, status["active_agent"]

        # Kill the active agent: its primary session ends, and another takes the lock.
        killed_at = time.monotonic()
        agents[winner].stop(signal.SIGKILL)
        survivors = {name: agents[name] for name in standbys}
        new_winner = wait_one_active(survivors, timeout=TAKEOVER_LIMIT + 5)
        takeover = time.monotonic() - killed_at
        print(f"takeover after {takeover:.2f} s (interval {INTERVAL} s, limit {TAKEOVER_LIMIT} s)")
        assert takeover <= TAKEOVER_LIMIT, f"takeover took {takeover:.2f} s"
        (still_standing,) = [name for name in standbys if name != new_winner]
        agents[still_standing].wait_for(lambda: winner not in agents[still_standing].readiness()[1]["active_agent"],
                                        "/readyz to name the new holder", timeout=10 * INTERVAL + 5)
        assert_standing_by(agents[still_standing], new_winner)
        assert "took the ccm-agent lock" in agents[new_winner].log()

        # The new agent's first calls reset each node's feed once (a new subscriber), then no more.
        agents[new_winner].wait_for(lambda: agents[new_winner].metric("ccm_agent_cycles_total") >= 3,
                                    "cycles of the new active agent")
        resets = total_resets(survivors)
        assert resets <= 2, figures(survivors)
        time.sleep(5)
        assert total_resets(survivors) == resets, figures(survivors)

        # Warming goes on: a standby restarted cold is warmed again by the new active agent.
        loaded = agents[new_winner].metric("ccm_agent_blocks_loaded_total")
        cluster.make_standby_cold()
        wait_standby_warm(cluster, survivors)
        assert agents[new_winner].metric("ccm_agent_blocks_loaded_total") > loaded
        assert agents[still_standing].metric("ccm_agent_blocks_loaded_total") == 0

        status = run_agent_json("status", *args)
        assert status["active_agent"]["application_name"] == new_winner, status["active_agent"]
        text = run_agent("status", *args).stdout
        assert f"agent    active: pid {status['active_agent']['pid']}, application_name {new_winner}" in text, text

        # `sync --once` runs beside the active agent (its filter exchange resets no feed) and
        # says which agent is active.
        once = run_agent("sync", "--once", *args)
        assert once.returncode == 0, once.stderr
        assert f"a ccm-agent run is active on this cluster (pid {status['active_agent']['pid']}" in once.stdout, once.stdout

        # With every agent gone, `status` says so.
        for agent in survivors.values():
            agent.stop()
        wait_for("the lock to be released", lambda: run_agent_json("status", *args)["active_agent"] is None,
                 timeout=10)
        assert "agent    active: none" in run_agent("status", *args).stdout
    finally:
        for agent in agents.values():
            agent.stop()


def lock_holder_on(node) -> str | None:
    """The application_name of the session holding pg_ccm's advisory lock on `node`, as an
    operator finds it in pg_locks (README: one agent per cluster)."""
    return node.one("SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                    "WHERE l.locktype = 'advisory' AND l.classid = 1885822819 AND l.objid = 1668087809 "
                    "AND l.objsubid = 1 AND l.granted")


def test_a_failover_moves_the_election_to_the_new_primary(cluster, log_dir):
    old_primary, old_standby = cluster.primary, cluster.standby
    agents = {}
    for name in NAMES[:2]:
        nodes = [old_primary, old_standby]
        agents[name] = AgentProcess(
            multi_host_conninfo(nodes, connect_timeout=2, target_session_attrs="read-write", application_name=name),
            multi_host_conninfo(nodes, connect_timeout=2, target_session_attrs="standby", application_name=name),
            log_dir, interval=f"{int(INTERVAL * 1000)}ms").start()
    try:
        winner = wait_one_active(agents, timeout=6 * INTERVAL + 2)
        assert lock_holder_on(old_primary) == winner

        # The primary dies and the standby is promoted: both agents lose their primary
        # session, and with it the lock; they compete again on the new primary.
        old_primary.kill()
        old_standby.promote()
        wait_for("the lock on the new primary", lambda: lock_holder_on(old_standby), timeout=30,
                 describe=lambda: f"agents: {figures(agents)}")
        new_winner = wait_one_active(agents, timeout=10)
        assert lock_holder_on(old_standby) == new_winner
        (other,) = [name for name in agents if name != new_winner]
        agents[other].wait_for(lambda: agents[other].readiness()[0] == 503 and agents[other].readiness()[1]["standby"],
                               "the other agent to stand by on the new primary")
        # No standby is left to warm, so `status` reports a problem, and still names the holder.
        text = run_agent("status", "--primary", old_standby.conninfo(), "--standby", old_standby.conninfo()).stdout
        assert f"application_name {new_winner}" in text, text
    finally:
        for agent in agents.values():
            agent.stop()


# The primary ends a silent agent's session after the keepalives election.rs sets: 10 s idle,
# then 3 probes 5 s apart (or 25 s of unacknowledged data).
KEEPALIVE_LIMIT = 10 + 3 * 5
NOBODY_UID = 65534  # the cut-off agent's user: the cut drops this user's packets only


class Cut:
    """Drops every packet that processes of `uid` send to 127.0.0.1:`port` (iptables, owner
    match): the agent running as that user is cut off from the primary, the way a host that
    drops off the network is, with nothing closed; its acknowledgements of the primary's
    keepalive probes are dropped too, so only the primary's keepalives can end its session."""

    def __init__(self, uid: int, port: int):
        self.rule = ["OUTPUT", "-o", "lo", "-p", "tcp", "-d", "127.0.0.1", "--dport", str(port), "-m", "owner",
                     "--uid-owner", str(uid), "-m", "comment", "--comment", f"pg_ccm-test-{uuid.uuid4().hex[:8]}",
                     "-j", "DROP"]
        self.active = False

    def __enter__(self) -> "Cut":
        subprocess.run(["iptables", "-I", *self.rule], check=True, capture_output=True)
        self.active = True
        return self

    def heal(self) -> None:
        if self.active:
            subprocess.run(["iptables", "-D", *self.rule], check=True, capture_output=True)
            self.active = False

    def __exit__(self, *exc) -> None:
        self.heal()


AS_NOBODY = ["setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups"]


def can_cut() -> bool:
    """Root with iptables and its owner match (a probe rule added and deleted), and an agent
    binary that `nobody` may run (a checkout under a private home directory is not)."""
    if shutil.which("iptables") is None or shutil.which("setpriv") is None:
        return False
    try:
        with Cut(NOBODY_UID, 1):
            pass
        subprocess.run([*AS_NOBODY, *agent_command("--version")], check=True, capture_output=True, timeout=30)
    except (subprocess.CalledProcessError, PermissionError, OSError):
        return False
    return True


def test_an_agent_cut_off_from_the_primary_loses_the_lock_to_another(cluster, log_dir):
    """The active agent runs as `nobody`; its packets to the primary are dropped. The
    primary's keepalives end its session within KEEPALIVE_LIMIT, the lock goes with it, and the
    other agent takes over. Healed, the cut-off agent stands by. (Without the keepalives the
    session, and the lock, would stay for the kernel's default two hours.)"""
    if not can_cut():
        pytest.skip("needs root, iptables with the owner match, setpriv, and an agent binary that nobody may run")
    cut_name, other_name = NAMES[:2]
    agents = {
        cut_name: AgentProcess(cluster.primary.conninfo(application_name=cut_name, connect_timeout=2),
                               cluster.standby.conninfo(application_name=cut_name, connect_timeout=2),
                               log_dir, interval=f"{int(INTERVAL * 1000)}ms",
                               launcher=AS_NOBODY, env={"HOME": "/nonexistent"}).start(),
    }
    try:
        wait_one_active(agents, timeout=6 * INTERVAL + 2)
        agents[other_name] = AgentProcess(cluster.primary.conninfo(application_name=other_name),
                                          cluster.standby.conninfo(application_name=other_name),
                                          log_dir, interval=f"{int(INTERVAL * 1000)}ms").start()
        agents[other_name].wait_for(lambda: agents[other_name].readiness()[0] == 503, "/readyz to say standby")
        assert lock_holder_on(cluster.primary) == cut_name

        with Cut(NOBODY_UID, cluster.primary.port) as cut:
            cut_at = time.monotonic()
            wait_for("the lock to leave the cut-off agent's session", lambda: lock_holder_on(cluster.primary) != cut_name,
                     timeout=KEEPALIVE_LIMIT + 30, interval=0.25, describe=lambda: f"agents: {figures(agents)}")
            agents[other_name].wait_for(lambda: active(agents[other_name]) == 1, "the other agent to take over",
                                        timeout=10)
            takeover = time.monotonic() - cut_at
            print(f"takeover {takeover:.1f} s after the cut (keepalives {KEEPALIVE_LIMIT} s, interval {INTERVAL} s)")
            assert takeover <= KEEPALIVE_LIMIT + 2 * INTERVAL + 5, f"takeover took {takeover:.1f} s"
            assert lock_holder_on(cluster.primary) == other_name
            # The cut-off agent finds out by itself: its session times out, it reconnects in vain.
            agents[cut_name].wait_for(lambda: active(agents[cut_name]) == 0, "the cut-off agent to stop being active",
                                      timeout=60)
            cut.heal()

        # Healed, it reconnects and stands by behind the new holder; exactly one stays active.
        def standing_by_behind(agent: AgentProcess, holder: str) -> bool:
            status, body = agent.readiness()
            return status == 503 and bool(body.get("standby")) and holder in (body.get("active_agent") or "")

        agents[cut_name].wait_for(lambda: standing_by_behind(agents[cut_name], other_name),
                                  "the healed agent to stand by behind the new holder", timeout=60)
        assert the_active_one(agents) == other_name, figures(agents)
        resets = agents[other_name].metric("ccm_agent_feed_resets_total")
        time.sleep(3)
        assert agents[other_name].metric("ccm_agent_feed_resets_total") == resets, figures(agents)
    finally:
        for agent in agents.values():
            agent.stop()
