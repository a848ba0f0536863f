"""A real Prometheus server (Debian's package, scripts/setup.sh) for tests, the monitoring rules
and dashboard of monitoring/, and promtool.

The server gets its own configuration and storage in a directory of the caller's, a free
loopback port and short scrape and evaluation intervals; its HTTP API answers the queries.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterable

import yaml

from .cluster import free_port
from .wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
RULES = MONITORING / "ccm-agent.rules.yml"
DASHBOARD = MONITORING / "ccm-agent.dashboard.json"
# The job name the rules expect (ccm:agent_up).
JOB = "ccm-agent"


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is missing: scripts/setup.sh installs Debian's prometheus package")
    return found


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


# -- the rules, tuned the documented way -----------------------------------------------------

def load_rules(path: Path = RULES) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def rules_of(document: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for group in document["groups"]:
        yield from group["rules"]


def alerts_of(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules_of(document) if "alert" in rule}


def tune_rules(document: dict[str, Any], *, thresholds: dict[str, float] | None = None,
               durations: dict[str, str] | None = None, annotations: Iterable[str] | None = None) -> dict[str, Any]:
    """The edits the rules file's header documents, on a copy: `thresholds` sets the number of
    ccm:threshold:NAME, `durations` an alert's `for:`; `annotations`, if given, are the only
    annotations kept. Expressions are left as they are."""
    document = json.loads(json.dumps(document))
    thresholds, durations = dict(thresholds or {}), dict(durations or {})
    for rule in rules_of(document):
        name = rule.get("record", "").removeprefix("ccm:threshold:")
        if "record" in rule and name in thresholds:
            rule["expr"] = f"vector({thresholds.pop(name)!r})"
        if rule.get("alert") in durations:
            rule["for"] = durations.pop(rule["alert"])
        if "alert" in rule and annotations is not None:
            rule["annotations"] = {k: v for k, v in rule["annotations"].items() if k in annotations}
    unknown = [*thresholds, *durations]
    if unknown:
        raise KeyError(f"no such threshold or alert in the rules: {unknown}")
    return document


def write_rules(document: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False, width=1000))
    return path


# -- the dashboard ---------------------------------------------------------------------------

def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """Every PromQL expression of the dashboard, as (where, expression): the panels' targets
    (rows' nested panels too), the template variables' and the annotations' queries."""
    found: list[tuple[str, str]] = []

    def panels(items: list[dict[str, Any]]) -> Iterable[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            found.append((f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            found.append((f"annotation {annotation['name']!r}", annotation["expr"]))
    return found


def label_values_query(query: str) -> str | None:
    """label_values(SELECTOR, LABEL) of a template variable: the selector, which Grafana
    evaluates through the series API (None: not a label_values query)."""
    found = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", query, re.S)
    return found[1] if found else None


def instantiate(expr: str, variables: dict[str, str]) -> str:
    """Substitutes Grafana's variables ($name and ${name}) as Grafana would."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m[1] or m[2]], expr)


# -- the server ------------------------------------------------------------------------------

class PrometheusAPI:
    """Prometheus's HTTP API at `url` (http://host:port)."""

    def __init__(self, url: str):
        self.url = url

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/PATH; the `data` of a successful answer, else RuntimeError."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:
            body = json.loads(error.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (a vector: [{'metric': {...}, 'value': [t, 'v']}])."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"metric": {}, "value": data["result"]}]

    def values(self, expr: str, label: str) -> dict[str, float]:
        """An instant query's values by one label's value."""
        return {sample["metric"].get(label, ""): float(sample["value"][1]) for sample in self.query(expr)}

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def series(self, selector: str) -> list[dict[str, str]]:
        return self.api("series", **{"match[]": selector})

    def rules(self) -> list[dict[str, Any]]:
        """Every rule the server evaluates, with its group's name as `group`."""
        return [{**rule, "group": group["name"]} for group in self.api("rules")["groups"] for rule in group["rules"]]

    def alerts(self, name: str) -> list[dict[str, Any]]:
        """The alerts of rule `name` now (pending or firing), from /api/v1/alerts."""
        return [alert for alert in self.api("alerts")["alerts"] if alert["labels"]["alertname"] == name]


class Prometheus(PrometheusAPI):
    """`prometheus` in the background, scraping `targets` (host:port) in the job the rules
    expect, each with the target labels `labels`, and evaluating `rule_files`."""

    def __init__(self, directory: Path, targets: list[str], rule_files: list[Path], interval: str = "500ms",
                 labels: dict[str, str] | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.config = self.directory / "prometheus.yml"
        self.config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "rule_files": [str(Path(path).resolve()) for path in rule_files],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets, "labels": labels or {}}]}],
        }))
        self.log_path = self.directory / "prometheus.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> "Prometheus":
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [binary("prometheus"), f"--config.file={self.config}", f"--storage.tsdb.path={self.directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self.wait_for(self._ready, "prometheus to be ready", interval=0.1)
        except (TimeoutError, RuntimeError):
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
            return response.status == 200

    def _exited(self) -> str | None:
        if self.process is None or self.process.poll() is not None:
            return f"prometheus exited:\n{self.log()[-3000:]}"
        return None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if hasattr(self, "_log"):
            self._log.close()

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for(self, predicate, what: str, timeout: float = 30, interval: float = 0.2) -> Any:
        """Polls `predicate` while the server runs (a refused connection is "not yet"); a
        timeout or the server's exit shows its log."""
        return wait_for(what, predicate, timeout=timeout, interval=interval, retry_on=(OSError,),
                        abort=self._exited, describe=lambda: f"prometheus log:\n{self.log()[-3000:]}")
