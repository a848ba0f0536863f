#!/bin/bash
# HEALTHCHECK of the pg_ccm image (docker/Dockerfile), by what the container runs:
#   ccm-agent  GET /healthz on its metrics address: $CCM_HEALTHCHECK_ADDR, else
#              $CCM_METRICS_LISTEN, else metrics_listen of the file $CCM_CONFIG, else the
#              agent's default 127.0.0.1:9935 (a wildcard address is asked on loopback;
#              "off": only that the process runs)
#   postgres   pg_isready over TCP on 127.0.0.1 (not the socket: the primary's first start
#              runs a temporary server without TCP)
#   prometheus GET /-/ready on 127.0.0.1:9090 (the entry point's role `prometheus`)
#   patroni    (pg_ccm-patroni image) without a running PostgreSQL yet: unhealthy
#   etcd       (pg_ccm-patroni image) `etcdctl endpoint health` on 127.0.0.1:2379
#   the entry point still initializing (pg_basebackup, initdb): unhealthy
#   else       healthy (nothing to check, e.g. a client container sleeping)
# The image has no curl, python or wget: the HTTP request goes through bash's /dev/tcp.
set -u

running() {  # running NAME: a process of that name runs in the container
    local comm f
    for f in /proc/[0-9]*/comm; do
        read -r comm < "$f" 2>/dev/null && [ "$comm" = "$1" ] && return 0
    done
    return 1
}

initializing() {  # the entry point runs (it execs postgres or the agent once ready)
    local f
    for f in /proc/[0-9]*/cmdline; do
        case $(tr '\0' ' ' < "$f" 2>/dev/null) in *pg-ccm-entrypoint*) return 0 ;; esac
    done
    return 1
}

agent_addr() {
    local addr=${CCM_HEALTHCHECK_ADDR:-${CCM_METRICS_LISTEN:-}}
    if [ -z "$addr" ] && [ -r "${CCM_CONFIG:-}" ]; then
        addr=$(sed -nE 's/^[[:space:]]*metrics_listen[[:space:]]*=[[:space:]]*"([^"]*)".*/\1/p' "$CCM_CONFIG")
    fi
    echo "${addr:-127.0.0.1:9935}"
}

http_ok() {  # http_ok NAME HOST:PORT PATH: GET PATH answers 200
    local name=$1 host=${2%:*} port=${2##*:} path=$3 status
    host=${host#[}; host=${host%]}
    case $host in
        ''|0.0.0.0) host=127.0.0.1 ;;
        ::) host=::1 ;;
    esac
    exec 3<>"/dev/tcp/$host/$port" || { echo "$name: nothing listens on $host:$port"; return 1; }
    printf 'GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n' "$path" "$2" >&3
    IFS=$' \t\r' read -r -t 4 _ status _ <&3 || { echo "$name: no answer from $host:$port"; return 1; }
    exec 3<&-
    [ "$status" = 200 ] && return 0
    echo "$name: $path answered $status"
    return 1
}

if running ccm-agent; then
    addr=$(agent_addr)
    [ "$addr" = off ] && exit 0
    http_ok ccm-agent "$addr" /healthz || exit 1
elif running prometheus; then
    http_ok prometheus 127.0.0.1:9090 /-/ready || exit 1
elif running postgres; then
    exec pg_isready -q -h 127.0.0.1 -p "${PGPORT:-5432}" -U postgres
elif running patroni; then
    echo "patroni: PostgreSQL is not running (yet)"
    exit 1
elif running etcd; then
    exec etcdctl --endpoints=127.0.0.1:2379 --command-timeout=3s endpoint health
elif initializing; then
    echo "initializing"
    exit 1
fi
exit 0
