#!/usr/bin/env bash
# Stages the build context of docker/Dockerfile in DIR (default docker/stage; emptied first):
# a release build of the extension for Debian 12's PostgreSQL 15 (`cargo pgrx package`, never
# the test build that scripts/install.sh --test-build may have installed), ccm-agent, the entry
# point and the healthcheck.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAGE=${1:-$ROOT/docker/stage}
PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
PKGLIB=$("$PG_CONFIG" --pkglibdir)
SHAREDIR=$("$PG_CONFIG" --sharedir)
PACKAGE=$ROOT/target/release/pg_ccm-pg15
if ! log=$(cd "$ROOT/extension" && cargo pgrx package --pg-config "$PG_CONFIG" --no-default-features --features pg15 --out-dir "$PACKAGE" 2>&1); then
    echo "$log" >&2
    exit 1
fi
(cd "$ROOT" && cargo build --locked --release -p ccm-agent --quiet)
for file in "$PACKAGE$PKGLIB/pg_ccm.so" "$PACKAGE$SHAREDIR/extension/pg_ccm.control" "$ROOT/target/release/ccm-agent"; do
    [ -e "$file" ] || { echo "missing $file" >&2; exit 1; }
done
if grep -qa 'ccm\.test_prewarm_delay_ms' "$PACKAGE$PKGLIB/pg_ccm.so"; then
    echo "$PACKAGE$PKGLIB/pg_ccm.so is a test build (failpoints feature): not staged" >&2
    exit 1
fi
rm -rf "$STAGE" && mkdir -p "$STAGE/extension"
install -m 755 "$PACKAGE$PKGLIB/pg_ccm.so" "$ROOT/target/release/ccm-agent" "$STAGE/"
# The install scripts of every release (sql/), as scripts/install.sh installs them.
install -m 644 "$PACKAGE$SHAREDIR"/extension/pg_ccm.control "$ROOT"/sql/pg_ccm--*.sql "$STAGE/extension/"
install -m 755 "$ROOT/docker/entrypoint.sh" "$ROOT/docker/healthcheck.sh" "$STAGE/"
echo "staged in $STAGE"
