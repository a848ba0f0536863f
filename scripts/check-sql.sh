#!/usr/bin/env bash
# Fails when sql/pg_ccm--<version>.sql differs from what pgrx generates from the code.
# Released install scripts are never edited: a change to the SQL surface needs a new
# version and an upgrade script. Run with --write to regenerate the current version.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n1)
CHECKED_IN="$ROOT/sql/pg_ccm--${VERSION}.sql"
GENERATED=$(mktemp)
trap 'rm -f "$GENERATED"' EXIT
(cd "$ROOT/extension" && cargo pgrx schema pg15 --out "$GENERATED" >/dev/null 2>&1) \
    || (cd "$ROOT/extension" && cargo pgrx schema pg15 --out "$GENERATED")
# pgrx stamps source locations; they move with every edit and say nothing about the schema.
normalize() { sed -E 's#^(/\*|--) ?[a-z_/]+\.rs:[0-9]+.*$#\1 (location)#' "$1"; }
if [ "${1:-}" = "--write" ]; then
    cp "$GENERATED" "$CHECKED_IN"
    echo "wrote $CHECKED_IN"
    exit 0
fi
if ! diff -u <(normalize "$CHECKED_IN") <(normalize "$GENERATED"); then
    echo "sql/pg_ccm--${VERSION}.sql is out of date: run scripts/check-sql.sh --write" >&2
    exit 1
fi
echo "sql/pg_ccm--${VERSION}.sql matches the code"
