#!/bin/sh
# Entry point of the pg_ccm image:
#   primary          initializes (first start) and runs a primary with pg_ccm preloaded
#   standby          clones $PRIMARY_HOST with pg_basebackup (first start) and runs it as a
#                    streaming standby
#   agent [ARGS...]  runs `ccm-agent ARGS...` (default: `ccm-agent run`) as the unprivileged
#                    user ccm-agent; `ccm-agent ARGS...` does the same
#   prometheus [ARGS...]
#                    runs Prometheus as the user prometheus on port 9090 with
#                    $PROMETHEUS_CONFIG (default /etc/pg_ccm/monitoring/prometheus.yml: the
#                    compose demo mounts the repository's monitoring/ there), storage in
#                    /var/lib/prometheus/metrics2, then ARGS
#   anything else    is executed as given
# PostgreSQL runs as the postgres user. Started as a non-root user (`docker run --user`,
# compose's `user:`), only the agent roles and other commands work.
#
# Authentication is `trust` on the compose network: this is a demo, not a deployment.
set -eu

PGBIN=/usr/lib/postgresql/15/bin
PGDATA=${PGDATA:-/var/lib/postgresql/data}
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"; }

settings() {
    cat <<CONF
listen_addresses = '*'
shared_preload_libraries = 'pg_ccm'
shared_buffers = '${SHARED_BUFFERS:-256MB}'
wal_level = replica
max_wal_senders = 10
hot_standby = on
hot_standby_feedback = on
wal_log_hints = on
CONF
}

init_primary() {
    install -d -o postgres -g postgres -m 700 "$PGDATA"
    as_postgres "$PGBIN/initdb" -D "$PGDATA" -U postgres --auth=trust -E UTF8 --locale=C >/dev/null
    settings >> "$PGDATA/postgresql.conf"
    printf 'host all all all trust\nhost replication all all trust\n' >> "$PGDATA/pg_hba.conf"
    as_postgres "$PGBIN/pg_ctl" -D "$PGDATA" -w -o "-c listen_addresses=''" start >/dev/null
    as_postgres "$PGBIN/psql" -q -U postgres -h /var/run/postgresql -c "CREATE EXTENSION pg_ccm" \
        -c "CREATE EXTENSION pg_buffercache" -c "CREATE ROLE ccm LOGIN IN ROLE ccm_agent, pg_monitor"
    as_postgres "$PGBIN/pg_ctl" -D "$PGDATA" -w stop >/dev/null
}

init_standby() {
    until as_postgres "$PGBIN/pg_isready" -q -h "$PRIMARY_HOST" -U postgres; do sleep 1; done
    install -d -o postgres -g postgres -m 700 "$PGDATA"
    as_postgres "$PGBIN/pg_basebackup" -h "$PRIMARY_HOST" -U postgres -D "$PGDATA" -R -X stream -c fast
}

case "${1:-primary}" in
    agent|ccm-agent)
        shift
        [ $# -gt 0 ] || set -- run
        if [ "$(id -u)" = 0 ]; then
            exec setpriv --reuid=ccm-agent --regid=ccm-agent --init-groups -- /usr/local/bin/ccm-agent "$@"
        fi
        exec /usr/local/bin/ccm-agent "$@"
        ;;
    prometheus)
        shift
        exec setpriv --reuid=prometheus --regid=prometheus --init-groups -- /usr/bin/prometheus \
            --config.file="${PROMETHEUS_CONFIG:-/etc/pg_ccm/monitoring/prometheus.yml}" \
            --storage.tsdb.path=/var/lib/prometheus/metrics2 --web.listen-address=0.0.0.0:9090 "$@"
        ;;
    primary|standby)
        install -d -o postgres -g postgres /var/run/postgresql
        if [ ! -s "$PGDATA/PG_VERSION" ]; then
            if [ "${1:-primary}" = primary ]; then init_primary; else init_standby; fi
        fi
        exec setpriv --reuid=postgres --regid=postgres --init-groups -- "$PGBIN/postgres" -D "$PGDATA"
        ;;
    *) exec "$@" ;;
esac
