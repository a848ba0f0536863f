#!/usr/bin/env bash
# Builds and installs the extension into the system PostgreSQL 15 and builds ccm-agent
# (target/release/ccm-agent). Used by the tests and the demo.
#
#   --test-build   build the extension with the `failpoints` feature (fault injection for
#                  the race tests, extension/src/failpoints.rs); scripts/test.sh uses it.
#                  Never deploy such a build.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
FEATURES=()
case "${1:-}" in
    --test-build) FEATURES=(--features failpoints) ;;
    "") ;;
    *) echo "usage: $0 [--test-build]" >&2; exit 2 ;;
esac
(cd extension && cargo pgrx install --release --pg-config "$PG_CONFIG" "${FEATURES[@]}" >/dev/null)
# Install scripts of earlier releases too, so that `CREATE EXTENSION pg_ccm VERSION ...` and
# `ALTER EXTENSION pg_ccm UPDATE` from any release work (pgrx copies only the upgrade scripts).
install -m 644 sql/pg_ccm--*.sql "$("$PG_CONFIG" --sharedir)/extension/"
cargo build --locked --release -p ccm-agent

# Where systemd runs, install the agent as a service (not enabled: it needs its connection
# strings first). The Debian package (scripts/build-debs.sh) does the same under /usr/bin.
if [ -d /run/systemd/system ] && [ "$(id -u)" -eq 0 ]; then
    install -m 755 target/release/ccm-agent /usr/local/bin/ccm-agent
    sed 's#/usr/bin/ccm-agent#/usr/local/bin/ccm-agent#' packaging/ccm-agent.service > /etc/systemd/system/ccm-agent.service
    getent passwd ccm-agent >/dev/null || useradd --system --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin ccm-agent
    install -d -m 750 -o root -g ccm-agent /etc/ccm-agent
    [ -e /etc/ccm-agent/ccm-agent.toml ] || install -m 640 -o root -g ccm-agent agent/ccm-agent.example.toml /etc/ccm-agent/ccm-agent.toml
    systemctl daemon-reload
    echo "installed the ccm-agent service: edit /etc/ccm-agent/ccm-agent.toml, then systemctl enable --now ccm-agent" >&2
fi
