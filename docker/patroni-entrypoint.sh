#!/bin/bash
# Entry point of the pg_ccm-patroni image (docker/Dockerfile.patroni):
#   patroni          writes /etc/patroni/patroni.yml from the environment (at every start) and
#                    runs Patroni as postgres: a PostgreSQL 15 node with pg_ccm preloaded, its
#                    cluster bootstrapped by the first member to take the leader key in etcd
#   etcd             runs etcd as the unprivileged user etcd (configured by ETCD_* variables)
#   client           writes /etc/patroni/patroni.yml (for patronictl) and sleeps: the pgbench
#                    container
#   anything else    pg_ccm's entry point (docker/entrypoint.sh): `agent [ARGS...]`, a command
#
# Environment of `patroni` and `client`:
#   PATRONI_NAME        member name (default: the container's host name); it is also the host
#                       name other containers reach it by (compose service name)
#   PATRONI_SCOPE       cluster name (default pg_ccm)
#   ETCD_HOSTS          etcd's client addresses (default etcd:2379)
#   SHARED_BUFFERS      (default 256MB)
#   NOFAILOVER          Patroni tag nofailover (default false)
#   FAILOVER_PRIORITY   Patroni tag failover_priority (default 1)
#   PATRONI_TTL, PATRONI_LOOP_WAIT, PATRONI_RETRY_TIMEOUT
#                       the cluster's timing when it is bootstrapped (default 20, 2, 5: short,
#                       for tests and the demo; Patroni's defaults are 30, 10, 10, and it
#                       raises a ttl below 20 to 20)
# Tags can be changed at run time: edit /etc/patroni/patroni.yml, then `patronictl reload`
# (or SIGHUP to Patroni); the next start rewrites the file from the environment.
#
# Authentication is `trust` on the compose network: this is a demo, not a deployment.
set -euo pipefail

CONFIG=/etc/patroni/patroni.yml
DATA=/var/lib/postgresql/data
NAME=${PATRONI_NAME:-$(hostname)}

write_config() {
    install -d -o postgres -g postgres /etc/patroni
    cat > "$CONFIG.tmp" <<YAML
scope: ${PATRONI_SCOPE:-pg_ccm}
name: $NAME
log:
  level: INFO
restapi:
  listen: 0.0.0.0:8008
  connect_address: $NAME:8008
etcd3:
  hosts: ${ETCD_HOSTS:-etcd:2379}
bootstrap:
  dcs:
    ttl: ${PATRONI_TTL:-20}
    loop_wait: ${PATRONI_LOOP_WAIT:-2}
    retry_timeout: ${PATRONI_RETRY_TIMEOUT:-5}
    maximum_lag_on_failover: 16777216
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        shared_preload_libraries: pg_ccm
        wal_level: replica
        hot_standby: "on"
        hot_standby_feedback: "on"
        wal_log_hints: "on"
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 256MB
  initdb:
    - encoding: UTF8
    - locale: C
  # CREATE EXTENSION pg_ccm, pg_buffercache; the agent's role ccm
  post_init: /usr/local/bin/pg-ccm-patroni-post-init
postgresql:
  listen: 0.0.0.0:5432
  connect_address: $NAME:5432
  # A directory below the volume, so that Patroni can remove and re-create it (reinit).
  data_dir: $DATA/pg15
  bin_dir: /usr/lib/postgresql/15/bin
  pgpass: /tmp/pgpass
  authentication:
    superuser:
      username: postgres
      password: postgres
    replication:
      username: replicator
      password: replicator
    rewind:
      username: postgres
      password: postgres
  parameters:
    unix_socket_directories: /var/run/postgresql
    shared_buffers: ${SHARED_BUFFERS:-256MB}
  pg_hba:
    - local all all trust
    - host all all all trust
    - host replication all all trust
tags:
  nofailover: ${NOFAILOVER:-false}
  failover_priority: ${FAILOVER_PRIORITY:-1}
YAML
    chown postgres:postgres "$CONFIG.tmp"
    mv "$CONFIG.tmp" "$CONFIG"
}

case "${1:-patroni}" in
    patroni)
        write_config
        install -d -o postgres -g postgres -m 700 "$DATA"
        install -d -o postgres -g postgres /var/run/postgresql
        cd "$DATA"
        export HOME=/var/lib/postgresql
        exec setpriv --reuid=postgres --regid=postgres --init-groups -- /usr/local/bin/patroni "$CONFIG"
        ;;
    client)
        write_config
        trap 'exit 0' TERM INT
        sleep infinity & wait
        ;;
    etcd)
        shift
        install -d -o etcd -g etcd -m 700 "${ETCD_DATA_DIR:-/var/lib/etcd/default}"
        exec setpriv --reuid=etcd --regid=etcd --init-groups -- /usr/bin/etcd "$@"
        ;;
    *) exec /usr/local/bin/pg-ccm-entrypoint.sh "$@" ;;
esac
