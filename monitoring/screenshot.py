#!/usr/bin/env python3
"""Makes monitoring/dashboard.png, README's picture of the dashboard's data, from a real run.

A primary with two streaming standbys on loopback ports (pg_ccm preloaded, the installed
PostgreSQL of PG_BIN), a hot set of 2048 blocks, `ccm-agent run` warming both standbys and a
real Prometheus evaluating monitoring/ccm-agent.rules.yml as shipped. After a warm minute, one
standby is restarted cold and held cold for a minute (its replay paused behind more WAL than the
agent's max_replay_lag), then let go. Prometheus's own graph page, with the dashboard's coverage,
blocks-loaded and alerts queries, is rendered by headless Chromium.

Needs `chromium` (Debian's package: `apt-get install chromium`; scripts/setup.sh does not
install it), Prometheus (scripts/setup.sh) and pg_ccm installed (scripts/install.sh). About
three minutes:

    python3 monitoring/screenshot.py [--out monitoring/dashboard.png]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.agent import AgentProcess  # noqa: E402
from harness.cluster import Cluster, make_table, multi_host_conninfo, read  # noqa: E402
from harness.prometheus import RULES, Prometheus  # noqa: E402

# The dashboard's panels shown, one graph each (its threshold drawn as a series), and whether
# the graph stacks its series (the alerts, each at 1, would hide each other).
PANELS = [
    ("ccm_agent_standby_coverage_ratio or ccm:threshold:coverage_ratio", False),
    ("rate(ccm_agent_standby_blocks_loaded_total[10s])", False),
    ("increase(ccm_agent_replay_lag_pauses_total[2m])", False),
    ('ALERTS{alertname=~"Ccm.+"}', True),
]


def graph_url(base: str, minutes: int) -> str:
    params: dict[str, str] = {}
    for i, (expr, stacked) in enumerate(PANELS):
        params.update({f"g{i}.expr": expr, f"g{i}.tab": "0", f"g{i}.range_input": f"{minutes}m",
                       f"g{i}.stacked": str(int(stacked))})
    return f"{base}/graph?{urllib.parse.urlencode(params)}"


def shoot(chromium: str, url: str, out: Path) -> None:
    """A window tall enough for every graph (the page scrolls to its last one otherwise), then
    the blank bottom cut off."""
    from PIL import Image, ImageOps  # matplotlib's dependency (tests/requirements.txt)

    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size=1280,{700 * len(PANELS) + 200}", "--virtual-time-budget=20000",
                    f"--screenshot={out}", url], check=True, capture_output=True, timeout=120)
    image = Image.open(out).convert("RGB")
    box = ImageOps.invert(image).getbbox()
    image.crop((0, 0, image.width, min(image.height, box[3] + 20))).save(out, optimize=True)


def lag_bytes(standby) -> int:
    return standby.one("SELECT pg_wal_lsn_diff(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::int8")


def set_ccm_enabled(node, on: bool) -> None:
    node.sql(f"ALTER SYSTEM SET ccm.enabled = {'on' if on else 'off'}")
    node.sql("SELECT pg_reload_conf()")


def run(out: Path, phase: float) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("chromium is missing: apt-get install chromium")
    work = Path(tempfile.mkdtemp(prefix="pg_ccm-screenshot-"))
    started = time.time()
    with Cluster(settings={"shared_buffers": "'128MB'"}) as cluster:
        primary, standby = cluster.primary, cluster.standby
        other = cluster.add_standby("standby2")
        make_table(primary, "hot", 16)
        read(primary, "hot", times=5)
        cluster.wait_caught_up()
        cluster.wait_caught_up(standby=other)
        agent = AgentProcess(primary.conninfo(), multi_host_conninfo([standby, other]), work, interval="1s",
                             extra=["--batch-blocks", "8", "--fill-room", "false", "--max-replay-lag", "64kB"])
        with agent, Prometheus(work / "prometheus", [f"127.0.0.1:{agent.metrics_port}"], [RULES], interval="1s",
                               labels={"cluster": "demo"}) as prom:
            print(f"==> warm for {phase:.0f} s")
            time.sleep(phase)
            print(f"==> {other.name} restarted cold and held back by replay lag for {phase:.0f} s")
            set_ccm_enabled(primary, False)
            cluster.make_standby_cold(other)
            other.sql("SELECT pg_wal_replay_pause()")
            primary.sql("CREATE TABLE filler AS SELECT g, repeat('x', 500) AS pad FROM generate_series(1, 2000) g")
            other.wait_until(lambda: lag_bytes(other) > 64 << 10, "WAL received and not replayed")
            set_ccm_enabled(primary, True)
            time.sleep(phase)
            print(f"==> replay resumed; {phase:.0f} s more")
            other.sql("SELECT pg_wal_replay_resume()")
            time.sleep(phase)
            minutes = int((time.time() - started) // 60) + 1
            url = graph_url(prom.url, minutes)
            shoot(chromium, url, out)
    shutil.rmtree(work, ignore_errors=True)
    print(f"==> {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "monitoring" / "dashboard.png")
    parser.add_argument("--phase", type=float, default=60, help="seconds of each phase (warm, cold, warm again)")
    args = parser.parse_args()
    run(args.out.resolve(), args.phase)


if __name__ == "__main__":
    main()
