#!/usr/bin/env bash
# Builds and installs the extension into PostgreSQL N (/usr/lib/postgresql/N) and builds
# ccm-agent (target/release/ccm-agent). Used by the tests, the demo and the benchmarks.
#
#   --pg N         the major version to install into (default: the newest one installed
#                  among PG_VERSIONS, scripts/lib/pg-versions.sh)
#   --test-build   build the extension with the `failpoints` feature (fault injection for
#                  the race tests, extension/src/failpoints.rs) in the dev profile (debug
#                  assertions and overflow checks on; it reuses what `cargo pgrx test` built
#                  and takes seconds instead of minutes); scripts/test.sh uses it.
#                  Never deploy such a build.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
. "$ROOT/scripts/lib/pg-versions.sh"
usage() { echo "usage: $0 [--pg N] [--test-build]" >&2; exit 2; }
PG_MAJOR=""
EXTRA_FEATURES=()
PROFILE=()
while [ $# -gt 0 ]; do
    case "$1" in
        --pg) [ $# -ge 2 ] || usage; PG_MAJOR=$2; shift 2 ;;
        --test-build) EXTRA_FEATURES=(failpoints); PROFILE=(--debug); shift ;;
        *) usage ;;
    esac
done
PG_MAJOR=${PG_MAJOR:-$(newest_pg_version)}
PG_CONFIG=$(pg_config_of "$PG_MAJOR")
[ -x "$PG_CONFIG" ] || { echo "PostgreSQL $PG_MAJOR is not installed ($PG_CONFIG): run scripts/setup.sh" >&2; exit 1; }
# The pgN feature picks the bindings; the default feature is pg15.
FEATURES=$(IFS=,; echo "pg$PG_MAJOR${EXTRA_FEATURES[*]:+,${EXTRA_FEATURES[*]}}")
echo "==> installing pg_ccm into PostgreSQL $PG_MAJOR (features $FEATURES)" >&2
# Built into a staging directory, then every file put in place by a rename, as dpkg does: a
# running server keeps the library it has mapped and loads the new one in new backends.
# (`cargo pgrx install` rewrites pg_ccm.so in place, which crashes every process that has it
# loaded, and with it the whole server.)
STAGE="$ROOT/target/install-pg$PG_MAJOR"
rm -rf "$STAGE"
(cd extension && cargo pgrx package --pg-config "$PG_CONFIG" "${PROFILE[@]}" --no-default-features \
    --features "$FEATURES" --out-dir "$STAGE" >/dev/null)
(cd "$STAGE" && find . -type f) | while read -r file; do
    target="/${file#./}"
    case "$target" in *.so) mode=755 ;; *) mode=644 ;; esac
    install -d "$(dirname "$target")"
    install -m "$mode" "$STAGE/$file" "$target.new.$$"
    mv -f "$target.new.$$" "$target"
done
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
