"""The primary's view ccm_candidates (extension 0.8.0): the active agent's last report of every
failover candidate, for monitoring that speaks only SQL.

- A real agent warming a real standby writes it: the view shows the standby up and warm, with
  the coverage and missing blocks that `ccm-agent status` measures on its own; the standby
  stopped shows as down without figures; restarted, up again; the agent stopped, the report
  turns stale (three times the delay the agent announced for its next report: with an interval
  of 500 ms, 1.5 s for a cycle and the rest of the interval) and says when it was made.
- Only pg_monitor (and ccm_agent) read it, only ccm_agent writes it.
- A malformed report gets an ERROR with a SQLSTATE and leaves the last report as it was; a
  standby refuses to take one.
- Under a catalog before the view the agent sends nothing, and once the catalog is updated
  it writes the view without a new session.
"""

from __future__ import annotations

import psycopg
import pytest

from harness.agent import AgentProcess, run_agent_json
from harness.cluster import make_table, read, workspace_version
from harness.wait import wait_for

CURRENT = workspace_version()
VIEW = "SELECT member, state, coverage, missing_blocks, hot_blocks, stale FROM ccm_candidates ORDER BY member"
REPORT = "SELECT ccm_report_candidates(%s, %s, %s, %s, %s, %s, %s)"


def rows(node) -> list[tuple]:
    return node.sql(VIEW)


def test_the_view_shows_what_the_active_agent_sees_and_turns_stale_without_it(cluster, log_dir):
    primary, standby = cluster.primary, cluster.standby
    make_table(primary, "hot", 8)
    read(primary, "hot", times=6)
    cluster.wait_caught_up()
    assert rows(primary) == [], "no report before an agent writes one"
    member = f"127.0.0.1:{standby.port}"
    agent = AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="500ms").start()
    try:
        warm = wait_for("the standby warm in ccm_candidates",
                        lambda: [r for r in rows(primary) if r[1] == "up" and r[2] is not None and r[2] >= 0.99],
                        timeout=60, describe=agent.log)
        name, state, coverage, missing, hot, stale = warm[0]
        assert (name, stale) == (member, False)
        assert hot > 0 and missing == round(hot * (1 - coverage)), warm
        status = run_agent_json("status", "--primary", primary.conninfo(), "--standby", standby.conninfo())
        [seen] = [s for s in status["standbys"] if s["name"] == member]
        assert abs(seen["coverage"] - coverage) <= 0.01, (seen, warm)
        reported_by = primary.one("SELECT DISTINCT agent FROM ccm_candidates")
        assert reported_by.endswith(f":{agent.process.pid}"), reported_by
        assert standby.sql(VIEW) == [], "a standby keeps no report"

        standby.stop()
        wait_for("the stopped standby down in ccm_candidates",
                 lambda: rows(primary) == [(member, "down", None, None, None, False)],
                 timeout=30, describe=agent.log)
        standby.start()
        wait_for("the restarted standby up again",
                 lambda: [r for r in rows(primary) if r[1] == "up" and r[2] is not None and r[2] >= 0.99],
                 timeout=60, describe=agent.log)
    finally:
        agent.stop()
    # Stale after three times the announced 1 to 1.5 s; the rows stay, with their time.
    wait_for("the report stale once its agent stopped", lambda: all(r[5] for r in rows(primary)), timeout=15)
    age = primary.one("SELECT extract(epoch FROM now() - max(reported_at)) FROM ccm_candidates")
    assert 3 <= age < 15, age
    assert [r[:2] for r in rows(primary)] in ([(member, "up")], [(member, "warming")])


@pytest.mark.every_version
def test_only_monitoring_reads_it_and_only_the_agent_writes_it(cluster):
    primary = cluster.primary
    for role, grant in (("ccm_watcher", "pg_monitor"), ("ccm_writer", "ccm_agent"), ("ccm_nobody", None)):
        primary.sql(f"DROP ROLE IF EXISTS {role}")
        primary.sql(f"CREATE ROLE {role} LOGIN")
        if grant:
            primary.sql(f"GRANT {grant} TO {role}")
    report = ("a1:1", 600000, ["m1"], ["up"], [0.5], [10], [20])
    with primary.connect(user="ccm_writer") as conn:
        assert conn.execute(REPORT, report).fetchone() == (1,)
    with primary.connect(user="ccm_watcher") as conn:
        assert conn.execute(VIEW).fetchall() == [("m1", "up", 0.5, 10, 20, False)]
    for role, query, args in (("ccm_nobody", VIEW, None), ("ccm_watcher", REPORT, report),
                              ("ccm_nobody", REPORT, report)):
        with primary.connect(user=role) as conn:
            with pytest.raises(psycopg.Error) as raised:
                conn.execute(query, args)
            assert raised.value.sqlstate == "42501", (role, query, raised.value)


@pytest.mark.every_version
def test_a_malformed_report_is_refused_and_the_last_one_kept(cluster):
    primary, standby = cluster.primary, cluster.standby
    good = ("a1:1", 600000, ["m1", "m2"], ["up", "down"], [1.0, None], [0, None], [50, None])
    assert primary.one(REPORT, good) == 2
    kept = rows(primary)
    assert kept == [("m1", "up", 1.0, 0, 50, False), ("m2", "down", None, None, None, False)]
    many = [f"m{i}" for i in range(65)]
    bad = {
        "arrays of different lengths": (("a", 1000, ["m1"], [], [1.0], [0], [1]), "22023"),
        "65 candidates": (("a", 1000, many, ["up"] * 65, [1.0] * 65, [0] * 65, [1] * 65), "54000"),
        "a member name of 64 bytes": (("a", 1000, ["m" * 64], ["up"], [1.0], [0], [1]), "22001"),
        "an agent name of 64 bytes": (("a" * 64, 1000, ["m1"], ["up"], [1.0], [0], [1]), "22001"),
        "an empty member name": (("a", 1000, [""], ["up"], [1.0], [0], [1]), "22023"),
        "a NULL member name": (("a", 1000, [None], ["up"], [1.0], [0], [1]), "22023"),
        "a coverage above 1": (("a", 1000, ["m1"], ["up"], [1.5], [0], [1]), "22023"),
        "a negative count": (("a", 1000, ["m1"], ["up"], [1.0], [-1], [1]), "22023"),
        "a next report due in 0 ms": (("a", 0, ["m1"], ["up"], [1.0], [0], [1]), "22023"),
    }
    for what, (args, sqlstate) in bad.items():
        with pytest.raises(psycopg.Error) as raised:
            primary.one(REPORT, args)
        assert raised.value.sqlstate == sqlstate, (what, raised.value)
    assert rows(primary) == kept, "a refused report changes nothing"
    with pytest.raises(psycopg.Error) as raised:
        standby.one(REPORT, good)
    assert raised.value.sqlstate == "55000", raised.value
    assert raised.value.diag.message_primary == "recovery is in progress"
    assert primary.one("SELECT 1") == 1 and standby.one("SELECT 1") == 1


def test_the_agent_writes_the_view_once_the_catalog_is_updated_without_a_new_session(cluster, log_dir):
    """The last step of an upgrade is ALTER EXTENSION pg_ccm UPDATE on the primary, under a
    running agent that keeps its sessions: under the 0.7.0 catalog it sends no report (there is
    no view), then reads the catalog's version again (every 60 unsent reports) and writes it."""
    primary, standby = cluster.primary, cluster.standby
    primary.sql("DROP EXTENSION pg_ccm")
    primary.sql("CREATE EXTENSION pg_ccm VERSION '0.7.0'")
    make_table(primary, "hot", 8)
    read(primary, "hot", times=6)
    cluster.wait_caught_up()
    agent = AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="200ms").start()
    try:
        wait_for("the agent warming under the 0.7.0 catalog",
                 lambda: agent.metric("ccm_agent_blocks_loaded_total") > 0, timeout=60, describe=agent.log)
        sessions = primary.one("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ccm-agent'")
        primary.sql("ALTER EXTENSION pg_ccm UPDATE")
        wait_for("the report in the updated catalog's view",
                 lambda: [r for r in rows(primary) if r[1] == "up"], timeout=60, describe=agent.log)
        assert f"the extension's catalog is now {CURRENT}" in agent.log()
        assert primary.one("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ccm-agent'") == sessions
    finally:
        agent.stop()
