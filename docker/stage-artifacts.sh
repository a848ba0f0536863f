#!/usr/bin/env bash
# Copies the installed extension, ccm-agent and the entry point into docker/stage, the build
# context of docker/Dockerfile (the registry path).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAGE=$ROOT/docker/stage
rm -rf "$STAGE" && mkdir -p "$STAGE/extension"
cp "$(/usr/lib/postgresql/15/bin/pg_config --pkglibdir)/pg_ccm.so" "$STAGE/"
cp "$(/usr/lib/postgresql/15/bin/pg_config --sharedir)"/extension/pg_ccm* "$STAGE/extension/"
cp "$ROOT/target/release/ccm-agent" "$ROOT/docker/entrypoint.sh" "$STAGE/"
echo "staged in $STAGE"
