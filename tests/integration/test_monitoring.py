"""monitoring/: the Prometheus alert rules and the Grafana dashboard, checked with Debian's real
Prometheus 2.42 and promtool.

- `promtool check rules` accepts the rules; `promtool test rules` passes the unit tests of every
  alert (tests/monitoring/ccm-agent.rules.test.yml), and fails them when an alert's rule is
  wrong: its expression replaced by one that never fires, or by a plausible mistake.
- The dashboard has the shape Grafana imports, its datasource is a variable, and it draws every
  threshold of the rules.
- A real Prometheus scraping a real agent that warms a real standby: the standby made cold (and
  kept cold: its replay paused behind more WAL than max_replay_lag) shows as a coverage drop, the
  cold-candidate alert goes pending, then firing after its `for:` (shortened the documented way,
  on a copy), the replay-lag alert goes pending; every PromQL expression of the dashboard returns
  data; once replay resumes the standby is warm again and the alert resolves.
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from harness.agent import AgentProcess
from harness.cluster import make_table, read
from harness.prometheus import (RULES, Prometheus, alerts_of, dashboard_queries, instantiate,
                                label_values_query, load_dashboard, load_rules, promtool, rules_of, tune_rules,
                                write_rules)

# The rules, the dashboard and the agent's series are the same whatever the server's version:
# scripts/test.sh runs them on the newest version only.
pytestmark = pytest.mark.agent_only

ROOT = Path(__file__).resolve().parents[2]
UNIT_TESTS = ROOT / "tests" / "monitoring" / "ccm-agent.rules.test.yml"

# For each alert, a plausible mistake in its expression (old text, new text) that its unit tests
# must catch.
MISTAKES = {
    "CcmFailoverCandidateCold": ("unless on (job, instance) ccm:agent_active == 0", ""),
    "CcmNoActiveAgent": ("sum by (cluster) (ccm:agent_active)", "sum by (cluster) (ccm_agent_active)"),
    "CcmSeveralActiveAgents": ("ccm:agent_active", "ccm_agent_active"),
    "CcmAgentNotReady": (") unless on (job, instance) ccm:agent_active == 0", ")"),
    "CcmStandbyDown": (" unless on (job, instance) ccm:agent_active == 0", ""),
    "CcmWarmingPausedByReplayLag": ("[2m]", "[20m]"),
    "CcmCycleErrorsRising": ("rate(", "increase("),
    "CcmFeedResetsRising": ("[15m]", "[5m]"),
    "CcmAgentRestarting": ("resets(", "changes("),
    "CcmAgentMemoryHigh": ("(process_resident_memory_bytes and on (job, instance) ccm_agent_build_info)",
                           "process_resident_memory_bytes"),
}

# Metrics the dashboard shows before the agent exports them (their panels may be empty until
# then); none now. Every other expression must return data.
NOT_YET_EXPORTED: set[str] = set()


def run_unit_tests(directory: Path, document: dict, alert: str | None = None) -> subprocess.CompletedProcess:
    """promtool test rules of the unit tests (those of `alert` only, if given) against
    `document` with its summary annotations only."""
    directory.mkdir(parents=True, exist_ok=True)
    write_rules(tune_rules(document, annotations=["summary"]), directory / "ccm-agent.rules.yml")
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    if alert is not None:
        tests["tests"] = [test for test in tests["tests"]
                          if any(case["alertname"] == alert for case in test["alert_rule_test"])]
    (directory / UNIT_TESTS.name).write_text(yaml.safe_dump(tests))
    return promtool("test", "rules", UNIT_TESTS.name, cwd=directory)


@pytest.mark.smoke
def test_promtool_checks_the_rules_and_passes_their_unit_tests(tmp_path):
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(list(rules_of(load_rules())))} rules found" in checked.stdout, checked.stdout
    tested = run_unit_tests(tmp_path, load_rules())
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout, tested.stdout


def test_every_alert_has_unit_tests_that_catch_a_wrong_rule(tmp_path):
    document = load_rules()
    assert set(MISTAKES) == set(alerts_of(document)), "every alert needs a mistake its unit tests catch"
    wrong_rules = []  # (alert, what is wrong, the rules with it)
    for name, (old, new) in MISTAKES.items():
        for kind, expr in (("never fires", "vector(1) == 0"),
                           (f"{old!r} -> {new!r}", alerts_of(document)[name]["expr"].replace(old, new))):
            wrong = tune_rules(document)
            assert expr != alerts_of(wrong)[name]["expr"], f"{name}: {old!r} is not in its expression"
            alerts_of(wrong)[name]["expr"] = expr
            wrong_rules.append((name, kind, wrong))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = pool.map(lambda job: run_unit_tests(tmp_path / str(job[0]), job[1][2], alert=job[1][0]),
                           enumerate(wrong_rules))
        for (name, kind, _), result in zip(wrong_rules, results):
            assert result.returncode != 0, f"{name} {kind}: the unit tests still pass:\n{result.stdout}"
            assert f"alertname: {name}" in result.stderr + result.stdout, result.stderr + result.stdout


def test_the_dashboard_imports_with_a_datasource_variable_and_draws_every_threshold():
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36 and dashboard.get("id") is None
    ids, cells = set(), set()
    for panel in dashboard["panels"]:
        assert panel["id"] not in ids, f"panel id {panel['id']} twice"
        ids.add(panel["id"])
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert not area & cells, f"{panel['title']!r} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        sources = [panel["datasource"], *(t["datasource"] for t in panel["targets"])]
        assert all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    drawn = {expr for _, expr in dashboard_queries(dashboard) if expr.startswith("ccm:threshold:")}
    records = {rule["record"] for rule in load_rules()["groups"][0]["rules"] if rule.get("record", "").startswith("ccm:threshold:")}
    assert drawn == records


def lag_bytes(standby) -> int:
    return standby.one("SELECT pg_wal_lsn_diff(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::int8")


def set_ccm_enabled(node, on: bool) -> None:
    node.sql(f"ALTER SYSTEM SET ccm.enabled = {'on' if on else 'off'}")
    node.sql("SELECT pg_reload_conf()")


def states(prom: Prometheus, alert: str) -> list[str]:
    return sorted(a["state"] for a in prom.alerts(alert))


def test_prometheus_sees_a_cold_candidate_and_alerts(cluster, log_dir, tmp_path):
    primary, standby = cluster.primary, cluster.standby
    # A hot set of 2048 blocks (five scans: usage count 5), which replay also cached on the standby.
    make_table(primary, "hot", 16)
    read(primary, "hot", times=5)
    cluster.wait_caught_up()
    cold_for = 3
    rules = write_rules(tune_rules(load_rules(), durations={"CcmFailoverCandidateCold": f"{cold_for}s"}),
                        tmp_path / "rules.yml")
    # Small batches: while replay is behind, a batch per cycle (8 blocks per 500 ms) keeps the
    # standby cold for minutes.
    agent = AgentProcess(primary.conninfo(), standby.conninfo(), log_dir, interval="500ms",
                         extra=["--batch-blocks", "8", "--fill-room", "false", "--max-replay-lag", "64kB"])
    with agent, Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{agent.metrics_port}"], [rules],
                           labels={"cluster": "test"}) as prom:
        def coverage() -> list[float]:
            return list(prom.values("ccm_agent_standby_coverage_ratio", "node").values())

        prom.wait_for(lambda: coverage() and min(coverage()) >= 0.99
                      and prom.values("ccm_agent_hot_set_blocks", "cluster").get("test", 0) >= 2048,
                      "the standby's coverage of the hot set (2048 blocks) at 99%")
        assert prom.alerts("CcmFailoverCandidateCold") == []

        # The standby made cold and kept cold: CCM off on the primary while the standby restarts
        # with an empty cache (the agent idles and says it is not ready), then its replay paused
        # behind more WAL than max_replay_lag, and CCM on again.
        set_ccm_enabled(primary, False)
        prom.wait_for(lambda: [a["labels"]["reason"] for a in prom.alerts("CcmAgentNotReady")]
                      == ["ccm.enabled is off on a node"], "CcmAgentNotReady pending while CCM is off")
        cluster.make_standby_cold()
        standby.sql("SELECT pg_wal_replay_pause()")
        try:
            primary.sql("CREATE TABLE filler AS SELECT g, repeat('x', 500) AS pad FROM generate_series(1, 2000) g")
            standby.wait_until(lambda: lag_bytes(standby) > 64 << 10, "64 kB of WAL received and not replayed")
            set_ccm_enabled(primary, True)
            prom.wait_for(lambda: max(coverage()) < 0.5, "the coverage series to drop")
            prom.wait_for(lambda: states(prom, "CcmFailoverCandidateCold") == ["firing"],
                          "CcmFailoverCandidateCold firing", timeout=30)
            # It was pending first, for the `for:` of the tuned copy.
            now = time.time()
            history = {sample["metric"]["alertstate"]: [float(t) for t, _ in sample["values"]] for sample in
                       prom.query_range('ALERTS{alertname="CcmFailoverCandidateCold"}', now - 60, now, 0.5)}
            assert history["firing"][0] - history["pending"][0] >= cold_for - 0.5, history
            assert states(prom, "CcmWarmingPausedByReplayLag") == ["pending"]
            assert prom.values("ccm_agent_replay_lag_pauses_total", "cluster")["test"] > 0
            assert prom.alerts("CcmAgentNotReady") == []
            check_every_dashboard_query(prom)
        finally:
            standby.sql("SELECT pg_wal_replay_resume()")
        prom.wait_for(lambda: min(coverage()) >= 0.99 and prom.alerts("CcmFailoverCandidateCold") == [],
                      "the standby warm again and the alert resolved")


def check_every_dashboard_query(prom: Prometheus) -> None:
    """Every PromQL expression of the dashboard, with Grafana's variables set as its "All"
    values, returns data from the server (the variables' label_values() through the series
    API, as Grafana asks)."""
    exported = {series["__name__"] for series in prom.series('{job="ccm-agent"}')}
    variables = {"cluster": ".*", "instance": ".*", "__rate_interval": "5s"}
    empty = []
    for where, expr in dashboard_queries(load_dashboard()):
        selector = label_values_query(expr)
        query = instantiate(selector if selector is not None else expr, variables)
        result = prom.series(query) if selector is not None else prom.query(query)
        pending = {name for name in NOT_YET_EXPORTED if name in query and name not in exported}
        if not result and not pending:
            empty.append(f"{where}: {query}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
