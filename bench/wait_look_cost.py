"""What one look of `ccm-agent wait`/`status` costs the servers: each statement's CPU time in
its backend (/proc/<pid>/schedstat, ns on CPU), with shared_buffers full of hot pages on the
primary and full on the standby. Then the real `wait` end to end: CPU of its backends per look.

    python3 bench/wait_look_cost.py PG_VERSION SHARED_BUFFERS_MB [AGENT_BIN]

(README, "Running with Patroni", and agent/src/wait.rs quote its figures at 1024 and 2048 MB on
PostgreSQL 15 and 18; WAIT_S sets how long the real `wait` runs, 32 s by default.)
"""

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from harness.cluster import Cluster, make_table, read, use_pg_version  # noqa: E402

version, sb_mb = int(sys.argv[1]), int(sys.argv[2])
agent = sys.argv[3] if len(sys.argv) > 3 else os.path.join(ROOT, "target", "release", "ccm-agent")
use_pg_version(version)


def cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e6


def timed(conn, sql, params=None, n=7):
    pid = conn.info.backend_pid
    conn.execute(sql, params, prepare=True).fetchall()  # prepared once, as the agent does
    cpu, wall = [], []
    result = None
    for _ in range(n):
        c0, t0 = cpu_ms(pid), time.perf_counter()
        result = conn.execute(sql, params, prepare=True).fetchall()
        t1 = time.perf_counter()
        time.sleep(0.05)  # the backend finishes sending before its clock is read
        cpu.append(cpu_ms(pid) - c0)
        wall.append((t1 - t0) * 1e3)
    return statistics.median(cpu), statistics.median(wall), result


out = {"pg": version, "shared_buffers_mb": sb_mb}
tables = 4
table_mb = int(sb_mb * 0.23)
with Cluster(settings={"shared_buffers": f"'{sb_mb}MB'", "max_wal_size": "'4GB'"}) as cluster:
    p, s = cluster.primary, cluster.standby
    t0 = time.time()
    for i in range(tables):
        make_table(p, f"t{i}", table_mb)
    p.sql("CHECKPOINT")
    for i in range(tables):
        p.sql(f"VACUUM t{i}")
        read(p, f"t{i}", 5)
    cluster.wait_caught_up(timeout=600)
    for i in range(tables):
        read(s, f"t{i}", 1)
    out["fill_s"] = round(time.time() - t0, 1)
    out["buffers"] = p.one("SELECT setting::int FROM pg_settings WHERE name='shared_buffers'")
    out["primary_used"] = p.one("SELECT count(*) FROM pg_buffercache WHERE relfilenode IS NOT NULL")
    out["standby_used"] = s.one("SELECT count(*) FROM pg_buffercache WHERE relfilenode IS NOT NULL")
    with p.connect() as pc, s.connect() as sc:
        stmts = {}
        stmts["primary aurora_ccm_status()"] = timed(pc, "SELECT buffers_sent_last_minute, buffers_found_last_minute, "
                                                     "buffers_sent_last_scan, buffers_found_last_scan, buffers_sent_current_scan, "
                                                     "buffers_found_current_scan, current_scan_progress FROM aurora_ccm_status()")
        stmts["primary wal cache status"] = timed(pc, "SELECT mode, size_blocks, held_blocks, locked_blocks, oldest_ptr::text, "
                                                  "newest_ptr::text FROM ccm_logical_wal_cache_status()")
        stmts["primary wal cache slots"] = timed(pc, "SELECT name, active_pid, cache_hit, cache_miss, blks_read, hit_rate "
                                                 "FROM aurora_stat_logical_wal_cache() ORDER BY name")
        stmts["primary count(*) ccm_hot_buffers()"] = timed(pc, "SELECT count(*) FROM ccm_hot_buffers()")
        stmts["standby ccm_buffer_filter(0.001)"] = timed(sc, "SELECT pg_is_in_recovery(), ccm_buffer_filter(%s::float8)", [0.001])
        filt = stmts["standby ccm_buffer_filter(0.001)"][2][0][1]
        out["filter_bytes"] = len(filt)
        stmts["primary count(*) ccm_hot_buffers(filter)"] = timed(pc, "SELECT count(*) FROM ccm_hot_buffers(%s::bytea)", [filt])
        out["hot"] = stmts["primary count(*) ccm_hot_buffers()"][2][0][0]
        out["missing"] = stmts["primary count(*) ccm_hot_buffers(filter)"][2][0][0]
        out["statements"] = {k: {"cpu_ms": round(v[0], 2), "wall_ms": round(v[1], 2)} for k, v in stmts.items()}

    # A session's start: backend fork, setup and the facts query (plain TCP, trust: no TLS or
    # SCRAM here, which only add to it).
    starts = []
    for _ in range(5):
        with p.connect() as c:
            c.execute("SELECT set_config('statement_timeout', '60000ms', false)")
            c.execute("SELECT pg_is_in_recovery(), (SELECT system_identifier FROM pg_control_system())::text, "
                      "(SELECT setting::int8 FROM pg_settings WHERE name = 'shared_buffers'), current_database()::text, "
                      "(SELECT extversion FROM pg_extension WHERE extname = 'pg_ccm')::text, "
                      "split_part(current_setting('server_version'), ' ', 1), current_setting('ccm.library_version', true)").fetchall()
            starts.append(cpu_ms(c.info.backend_pid))
    out["session_start_cpu_ms"] = round(statistics.median(starts), 2)

    # The real `wait`, end to end: CPU of its backends on each node, per look.
    seen = {}  # (node, pid) -> last cpu ms
    stop = threading.Event()

    def sample():
        with p.connect() as pc, s.connect() as sc:
            while not stop.is_set():
                for name, c in (("primary", pc), ("standby", sc)):
                    for (pid,) in c.execute("SELECT pid FROM pg_stat_activity WHERE application_name = 'ccm-agent'").fetchall():
                        try:
                            seen[(name, pid)] = cpu_ms(pid)
                        except FileNotFoundError:
                            pass
                time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    duration = int(os.environ.get("WAIT_S", "32"))
    started = time.time()
    result = subprocess.run([agent, "wait", "--min-coverage", "100", "--member", "nobody", "--timeout", f"{duration}s",
                             "--log-level", "info,ccm_agent=debug",
                             "--primary", p.conninfo(), "--standby", s.conninfo()], capture_output=True, text=True)
    elapsed = time.time() - started
    stop.set()
    sampler.join()
    looks = len(re.findall(r"looked;", result.stderr)) or None
    out["wait"] = {
        "agent": agent, "elapsed_s": round(elapsed, 1), "looks": looks,
        "sessions": {n: len([k for k in seen if k[0] == n]) for n in ("primary", "standby")},
        "cpu_ms": {n: round(sum(v for k, v in seen.items() if k[0] == n), 1) for n in ("primary", "standby")},
        "tail": result.stderr.strip().splitlines()[-1:],
    }
print(json.dumps(out, indent=1))
