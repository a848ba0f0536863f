#!/usr/bin/env bash
# Failover demo inside the compose cluster (docker-compose.yml): loads pgbench data, runs
# Aurora's CCM-test workload on the primary while ccm-agent warms the standby, shows the
# standby's coverage of the primary's hot set, kills the primary (SIGKILL), promotes the
# standby and runs the workload against it, printing TPS per second.
#
# Containers share the host's page cache, so unlike demo/failover_demo.py this does not
# emulate separate hosts' caches; it shows the mechanics (and the agent following the
# failover), the local demo measures the difference.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
COMPOSE+=(${COMPOSE_PROJECT:+-p "$COMPOSE_PROJECT"})
SCALE=${SCALE:-10} WARM=${WARM:-30} AFTER=${AFTER:-20} CLIENTS=${CLIENTS:-4}

on() { "${COMPOSE[@]}" exec -T "$@"; }
sql() { on pgbench psql -h "$1" -U postgres -Atq -c "$2"; }
blocks() {  # buffer tags on a node, one per line; $2: minimum usage count
    sql "$1" "SELECT concat_ws('/', reltablespace, reldatabase, relfilenode, relforknumber, relblocknumber) FROM pg_buffercache WHERE relfilenode IS NOT NULL AND usagecount >= $2" | sort
}
coverage() {
    local hot cached both
    hot=$(mktemp) cached=$(mktemp)
    blocks "$1" 4 > "$hot"; blocks "$2" 0 > "$cached"
    both=$(comm -12 "$hot" "$cached" | wc -l)
    echo "$both of $(wc -l < "$hot") hot buffers of $1 are cached on $2"
    rm -f "$hot" "$cached"
}

echo "==> waiting for the standby to stream"
until [ "$(sql standby 'SELECT pg_is_in_recovery()' 2>/dev/null)" = t ]; do sleep 1; done
echo "==> pgbench -i -s $SCALE on the primary"
on pgbench pgbench -h primary -U postgres -i -s "$SCALE" -q postgres
echo "==> workload on the primary for ${WARM}s (ccm-agent warms the standby meanwhile)"
on pgbench pgbench -h primary -U postgres -n -M prepared -b tpcb-like@1 -b select-only@20 -c "$CLIENTS" -j 2 -T "$WARM" -P 5 postgres 2>&1 | grep -E '^progress|^tps'
echo "==> coverage at failover: $(coverage primary standby)"
echo "==> FAILOVER: SIGKILL the primary, promote the standby"
"${COMPOSE[@]}" kill -s SIGKILL primary >/dev/null
on -u postgres standby pg_ctl -D /var/lib/postgresql/data -w promote
before=$(sql standby 'SELECT sum(blks_read) FROM pg_stat_database')
echo "==> workload on the new primary for ${AFTER}s"
on pgbench pgbench -h standby -U postgres -n -M prepared -b tpcb-like@1 -b select-only@20 -c "$CLIENTS" -j 2 -T "$AFTER" -P 1 postgres 2>&1 | grep -E '^progress|^tps'
sleep 1.5
echo "==> blocks the new primary read from storage: $(( $(sql standby 'SELECT sum(blks_read) FROM pg_stat_database') - before ))"
echo "==> ccm-agent after the failover:"
"${COMPOSE[@]}" logs --tail 5 ccm-agent
