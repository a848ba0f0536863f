#!/usr/bin/env bash
# Failover demo on the Patroni cluster of docker/patroni-compose.yml: Patroni itself fails over
# when the leader's container is killed (`docker kill`, SIGKILL). Runs it twice, with ccm-agent
# keeping the failover candidates warm and with the agent stopped, each from cold replicas
# (their PostgreSQL restarted after a restartpoint, so shared_buffers hold only what replay
# touches), and prints both side by side: the candidates' coverage of the leader's hot set at
# the kill, how long Patroni took, the blocks the new leader read from storage in its first
# AFTER seconds (pg_stat_database.blks_read), and its TPS.
#
#   docker/build-patroni-image.sh && docker-compose -f docker/patroni-compose.yml up -d
#   docker/patroni-demo.sh
#   docker-compose -f docker/patroni-compose.yml down -v
#
# SCALE (pgbench scale, default 10), WARM (seconds of workload before the kill, 10), AFTER
# (seconds measured on the new leader, 30), CLIENTS (4); COMPOSE_PROJECT names the compose project.
# Without the agent, replay alone caches on the replicas the blocks the workload writes (the
# coverage line shows how much of the hot set that is); blks_read also counts the blocks
# pgbench_history grows by (a few hundred, in both runs).
# Containers share the host's page cache: a block "read from storage" is one read outside
# shared_buffers (what the agent fills), which the host may still serve from its cache; the
# local demo (demo/failover_demo.py) also empties the page cache and measures the difference.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
COMPOSE+=(${COMPOSE_PROJECT:+-p "$COMPOSE_PROJECT"} -f docker/patroni-compose.yml)
SCALE=${SCALE:-10} WARM=${WARM:-10} AFTER=${AFTER:-30} CLIENTS=${CLIENTS:-4}
WORKLOAD=(-n -M prepared -b tpcb-like@1 -b select-only@20 -c "$CLIENTS" -j 2)

on() { "${COMPOSE[@]}" exec -T "$@"; }
sql() { on pgbench psql -h "$1" -U postgres -Atq -c "$2"; }
container() { "${COMPOSE[@]}" ps -q "$1"; }
members() {  # one line per member, "name role state": Patroni's REST API, asked inside the network
    on pgbench python3 - <<'PY'
import json, urllib.request
for host in ("patroni1", "patroni2", "patroni3"):
    try:
        cluster = json.load(urllib.request.urlopen(f"http://{host}:8008/cluster", timeout=2))
    except Exception:
        continue
    for m in cluster["members"]:
        print(m["name"], m["role"], m["state"])
    break
PY
}
leader() { members | awk '$2 == "leader" && $3 == "running" { print $1 }'; }
replicas() { members | awk '$2 != "leader" && $3 == "streaming" { print $1 }'; }
wait_for() {  # wait_for WHAT SECONDS COMMAND...: until the command succeeds
    local what=$1 deadline=$((SECONDS + $2))
    shift 2
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || { echo "timed out waiting for $what" >&2; exit 1; }
        sleep 1
    done
}
healthy() { [ -n "$(leader)" ] && [ "$(replicas | wc -l)" -eq 2 ]; }
blocks() {  # buffer tags on a node, one per line; $2: minimum usage count
    sql "$1" "SELECT concat_ws('/', reltablespace, reldatabase, relfilenode, relforknumber, relblocknumber) FROM pg_buffercache WHERE relfilenode IS NOT NULL AND usagecount >= $2" | sort
}
coverage() {  # coverage LEADER REPLICA: % of the leader's hot buffers (usage count > 3) cached
    local hot cached both total
    hot=$(mktemp) cached=$(mktemp)
    blocks "$1" 4 > "$hot"; blocks "$2" 0 > "$cached"
    both=$(comm -12 "$hot" "$cached" | wc -l) total=$(wc -l < "$hot")
    rm -f "$hot" "$cached"
    awk -v b="$both" -v t="$total" 'BEGIN { printf "%.1f%%", t ? 100 * b / t : 0 }'
}
blks_read() { sql "$1" 'SELECT sum(blks_read) FROM pg_stat_database'; }
caught_up() {  # every replica has replayed the leader's current WAL position
    local lsn r
    lsn=$(sql "$1" 'SELECT pg_current_wal_lsn()')
    for r in $(replicas); do
        [ "$(sql "$r" "SELECT pg_last_wal_replay_lsn() >= '$lsn'")" = t ] || return 1
    done
}

declare -A RESULT
run() {  # run KEY: one failover, figures into RESULT[KEY,...]
    local key=$1 old new r start before out
    old=$(leader)
    echo "==> [$key] cold replicas: restartpoint, then restart PostgreSQL on $(replicas | xargs)"
    sql "$old" CHECKPOINT
    wait_for "the replicas to replay the checkpoint" 60 caught_up "$old"
    for r in $(replicas); do
        sql "$r" CHECKPOINT
        on pgbench patronictl restart pg_ccm "$r" --force >/dev/null
    done
    wait_for "both replicas to stream" 120 healthy
    echo "==> [$key] workload on the leader $old for ${WARM}s"
    on pgbench pgbench -h "$old" -U postgres "${WORKLOAD[@]}" -T "$WARM" -P 10 postgres 2>&1 | grep -E '^progress|^tps'
    RESULT[$key,coverage]=$(for r in $(replicas); do printf '%s %s  ' "$r" "$(coverage "$old" "$r")"; done)
    echo "==> [$key] coverage of $old's hot set: ${RESULT[$key,coverage]}"
    echo "==> [$key] FAILOVER: docker kill $old; Patroni elects a new leader"
    start=$SECONDS
    docker kill "$(container "$old")" >/dev/null
    until new=$(leader) && [ -n "$new" ] && [ "$new" != "$old" ]; do
        [ $((SECONDS - start)) -lt 120 ] || { echo "no new leader after 120 s" >&2; exit 1; }
        sleep 0.5
    done
    RESULT[$key,failover]="$((SECONDS - start)) s ($new)"
    echo "==> [$key] $new leads after $((SECONDS - start)) s; workload on it for ${AFTER}s"
    before=$(blks_read "$new")
    out=$(on pgbench pgbench -h "$new" -U postgres "${WORKLOAD[@]}" -T "$AFTER" -P 1 postgres 2>&1)
    echo "$out" | grep -E '^progress|^tps'
    sleep 1.5  # statistics are flushed when the clients exit
    RESULT[$key,read]=$(( $(blks_read "$new") - before ))
    RESULT[$key,tps10]=$(echo "$out" | awk '/^progress/ && $2 <= 10 { s += $4; n++ } END { printf "%.0f", n ? s / n : 0 }')
    RESULT[$key,tps]=$(echo "$out" | awk '/^tps/ { printf "%.0f", $3 }')
    echo "==> [$key] the old leader $old rejoins"
    docker start "$(container "$old")" >/dev/null
    wait_for "$old to rejoin as a replica" 180 healthy
}

echo "==> waiting for Patroni: a leader and two streaming replicas"
wait_for "the cluster" 180 healthy
if [ "$(sql "$(leader)" "SELECT to_regclass('pgbench_accounts') IS NOT NULL")" != t ]; then
    echo "==> pgbench -i -s $SCALE on the leader $(leader)"
    on pgbench pgbench -h "$(leader)" -U postgres -i -s "$SCALE" -q postgres 2>&1 | tail -1
fi
"${COMPOSE[@]}" start ccm-agent >/dev/null
run agent
"${COMPOSE[@]}" stop ccm-agent >/dev/null
run none
"${COMPOSE[@]}" start ccm-agent >/dev/null

printf '\n%-48s %-30s %s\n' "" "with ccm-agent" "agent stopped"
printf '%-48s %-30s %s\n' "replicas' coverage of the hot set at the kill" "${RESULT[agent,coverage]}" "${RESULT[none,coverage]}"
printf '%-48s %-30s %s\n' "failover (docker kill to new leader)" "${RESULT[agent,failover]}" "${RESULT[none,failover]}"
printf '%-48s %-30s %s\n' "blocks the new leader read, first ${AFTER} s" "${RESULT[agent,read]}" "${RESULT[none,read]}"
printf '%-48s %-30s %s\n' "TPS, first 10 s" "${RESULT[agent,tps10]}" "${RESULT[none,tps10]}"
printf '%-48s %-30s %s\n' "TPS, ${AFTER} s" "${RESULT[agent,tps]}" "${RESULT[none,tps]}"
