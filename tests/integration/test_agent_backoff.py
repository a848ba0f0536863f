"""A standby that refuses the agent's login is tried rarely and told once; a restarted one is
warmed again at once.

A wrong password, a pg_hba.conf refusal, a certificate that does not verify or a missing
extension does not clear by itself, and each attempt is a failed login in the server's log
(with LDAP or PAM authentication, a step toward a locked service account). The agent backs
off from such a failure up to max_backoff and then tries once per max_backoff, with one WARN
line for the whole episode and one INFO line when it ends. A refused connection (a standby
restarting) stays fast: the standby is cold, and an attempt costs it nothing.

The attempts are counted where an operator would: in the standby's server log.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from harness.agent import AgentProcess
from harness.cluster import Cluster, Node, multi_host_conninfo
import pytest

# The agent's own behaviour: the same whatever the server (scripts/test.sh: newest only).
pytestmark = pytest.mark.agent_only

ROLE = "ccm_locked"
MAX_BACKOFF = 8  # seconds, given to the agent
WINDOW = 48  # seconds the agent runs against the wrong password
# Attempts before the backoff reaches max_backoff: the first, then after 250 ms, 500 ms,
# 1 s, 2 s and 4 s (each drawn from half to all of it).
RAMP = 6
REFUSED = "password authentication failed"


def lock_out_the_agent(cluster: Cluster, node: Node) -> None:
    """A role with a password, and a pg_hba.conf line on `node` (before the harness's trust
    line) that makes it give the password: the agent's, "wrong", is refused there."""
    cluster.primary.sql(f"CREATE ROLE {ROLE} LOGIN SUPERUSER PASSWORD 'right'")
    cluster.wait_caught_up(standby=node)
    hba = node.datadir / "pg_hba.conf"
    hba.write_text(f"host all {ROLE} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    node.sql("SELECT pg_reload_conf()")


def agent_lines(agent: AgentProcess, level: str, needle: str) -> list[str]:
    return [line for line in agent.log().splitlines() if re.search(rf"Z\s+{level} ", line) and needle in line]


def agent_with_backoff(primary: str, standby: str, log_dir: Path) -> AgentProcess:
    agent = AgentProcess(primary, standby, log_dir, interval="200ms")
    agent.args[agent.args.index("--max-backoff") + 1] = f"{MAX_BACKOFF}s"
    return agent


def count_refusals(agent: AgentProcess, node: Node, offset: int) -> tuple[int, int, float]:
    """Runs the agent for WINDOW seconds: the refused logins in `node`'s log, the bound they
    must keep to, and the seconds counted."""
    started = time.monotonic()
    # A window to count in, not a wait for something to happen.
    time.sleep(WINDOW)
    assert agent.alive(), agent.log()[-3000:]
    ran = time.monotonic() - started
    attempts = len(node.log_lines_since(offset, REFUSED))
    bound = RAMP + int(ran // MAX_BACKOFF) + 1
    print(f"\n{node.name}: {attempts} refused logins in {ran:.0f} s with max_backoff {MAX_BACKOFF} s "
          f"(bound {bound})")
    return attempts, bound, ran


def test_a_wrong_password_is_tried_once_per_max_backoff_and_told_once(cluster, log_dir):
    lock_out_the_agent(cluster, cluster.standby)
    offset = cluster.standby.log_size()
    standby = cluster.standby.conninfo(user=ROLE, password="wrong")
    with agent_with_backoff(cluster.primary.conninfo(), standby, log_dir) as agent:
        attempts, bound, ran = count_refusals(agent, cluster.standby, offset)
        warned = agent_lines(agent, "WARN", REFUSED)
        assert 2 <= attempts <= bound and len(warned) == 1, (
            f"{attempts} refused logins in {ran:.0f} s (at most {bound} expected) and {len(warned)} "
            f"WARN lines about them (1 expected):\n" + "\n".join(warned[:5]))

        # The agent's password becomes the right one: the episode ends, with one INFO line.
        cluster.primary.sql(f"ALTER ROLE {ROLE} PASSWORD 'wrong'")
        agent.wait_for(lambda: agent_lines(agent, "INFO", "syncing again, after"), "the agent to sync again",
                       timeout=MAX_BACKOFF + 10)
        time.sleep(1)
        assert len(agent_lines(agent, "INFO", "syncing again, after")) == 1
        assert len(agent_lines(agent, "WARN", REFUSED)) == 1


def test_a_standby_that_refuses_the_login_is_tried_rarely_while_the_other_is_warmed(cluster, log_dir):
    second = cluster.add_standby("standby2")
    lock_out_the_agent(cluster, second)
    offset = second.log_size()
    # One string for both standbys: the first trusts the role, the second wants its password.
    standbys = multi_host_conninfo([cluster.standby, second], user=ROLE, password="wrong")
    with agent_with_backoff(cluster.primary.conninfo(), standbys, log_dir) as agent:
        attempts, bound, ran = count_refusals(agent, second, offset)
        warned = agent_lines(agent, "WARN", REFUSED)
        assert 2 <= attempts <= bound and len(warned) == 1, (
            f"{attempts} refused logins in {ran:.0f} s (at most {bound} expected) and {len(warned)} "
            f"WARN lines about them (1 expected):\n" + "\n".join(warned[:5]))
        assert agent.metric("ccm_agent_cycles_total") > 0, "the first standby is warmed meanwhile"

        cluster.primary.sql(f"ALTER ROLE {ROLE} PASSWORD 'wrong'")
        again = f"warming the standby 127.0.0.1:{second.port} again, after"
        agent.wait_for(lambda: agent_lines(agent, "INFO", again), "standby2 to be warmed again",
                       timeout=MAX_BACKOFF + 10)


def test_a_restarted_standby_is_connected_again_within_seconds_and_told_once(cluster, log_dir):
    with AgentProcess(cluster.primary.conninfo(), cluster.standby.conninfo(), log_dir, interval="200ms") as agent:
        agent.wait_for(lambda: agent.metric("ccm_agent_cycles_total") >= 3, "cycles")
        cluster.standby.stop()
        # Down for a while: the agent's attempts are refused, several times.
        agent.wait_for(lambda: agent.log().count("Connection refused") >= 4, "refused attempts", timeout=20)
        connected = agent.log().count("connected to the standby")
        cluster.standby.start()
        back = time.monotonic()
        agent.wait_for(lambda: agent.log().count("connected to the standby") > connected,
                       "the agent to connect to the standby again", timeout=15)
        took = time.monotonic() - back
        print(f"\nreconnected {took:.1f} s after the standby accepted connections")
        assert took <= 3, f"reconnected {took:.1f} s after the standby was back"
        refused = agent_lines(agent, "WARN", "Connection refused")
        assert len(refused) == 1, "\n".join(refused)
        agent.wait_for(lambda: agent_lines(agent, "INFO", "syncing again, after"), "the end of the episode")
