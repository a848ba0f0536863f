#!/usr/bin/env bash
# Copies the installed extension (scripts/install.sh), ccm-agent, the entry point and the
# healthcheck into DIR (default docker/stage; emptied first), the build context of
# docker/Dockerfile.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAGE=${1:-$ROOT/docker/stage}
PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
PKGLIB=$("$PG_CONFIG" --pkglibdir)
SHAREDIR=$("$PG_CONFIG" --sharedir)
for file in "$PKGLIB/pg_ccm.so" "$SHAREDIR/extension/pg_ccm.control" "$ROOT/target/release/ccm-agent"; do
    [ -e "$file" ] || { echo "missing $file: run scripts/install.sh first" >&2; exit 1; }
done
rm -rf "$STAGE" && mkdir -p "$STAGE/extension"
install -m 755 "$PKGLIB/pg_ccm.so" "$ROOT/target/release/ccm-agent" "$STAGE/"
install -m 644 "$SHAREDIR"/extension/pg_ccm.control "$SHAREDIR"/extension/pg_ccm--*.sql "$STAGE/extension/"
install -m 755 "$ROOT/docker/entrypoint.sh" "$ROOT/docker/healthcheck.sh" "$STAGE/"
echo "staged in $STAGE"
