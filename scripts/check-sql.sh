#!/usr/bin/env bash
# Fails when sql/pg_ccm--<version>.sql differs from what pgrx generates from the code.
# Released install scripts are never edited: a change to the SQL surface needs a new
# version and an upgrade script. Run with --write to regenerate the current version.
#
#   scripts/check-sql.sh [--pg N] [--write]
#   scripts/check-sql.sh [--pg N] --installed
#
# The script is the same for every PostgreSQL version (nothing in the SQL surface depends on
# it), so each version's generated schema is checked against the one file; N defaults to 15.
# --installed checks the schema that scripts/install.sh's last build for N generated (`cargo
# pgrx package` writes it beside the library, in install.sh's staging directory
# target/install-pgN) instead of building the extension once more for `cargo pgrx schema`:
# scripts/test.sh checks its test build's, whose failpoints feature adds no SQL.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PG_MAJOR=15
WRITE=0
INSTALLED=0
while [ $# -gt 0 ]; do
    case "$1" in
        --pg) PG_MAJOR=${2:?--pg needs a version}; shift 2 ;;
        --write) WRITE=1; shift ;;
        --installed) INSTALLED=1; shift ;;
        *) echo "usage: $0 [--pg N] [--write | --installed]" >&2; exit 2 ;;
    esac
done
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n1)
CHECKED_IN="$ROOT/sql/pg_ccm--${VERSION}.sql"
GENERATED=$(mktemp)
trap 'rm -f "$GENERATED"' EXIT
if [ "$INSTALLED" = 1 ]; then
    . "$ROOT/scripts/lib/pg-versions.sh"
    built="$ROOT/target/install-pg$PG_MAJOR$("$(pg_config_of "$PG_MAJOR")" --sharedir)/extension/pg_ccm--${VERSION}.sql"
    [ -s "$built" ] || { echo "$built: no generated schema there: run scripts/install.sh --pg $PG_MAJOR first" >&2; exit 1; }
    cp "$built" "$GENERATED"
else
    (cd "$ROOT/extension" && cargo pgrx schema "pg$PG_MAJOR" --out "$GENERATED" >/dev/null 2>&1) \
        || (cd "$ROOT/extension" && cargo pgrx schema "pg$PG_MAJOR" --out "$GENERATED")
fi
# pgrx stamps source locations; they move with every edit and say nothing about the schema.
normalize() { sed -E 's#^(/\*|--) ?[a-z_/]+\.rs:[0-9]+.*$#\1 (location)#' "$1"; }
if [ "$WRITE" = 1 ]; then
    cp "$GENERATED" "$CHECKED_IN"
    echo "wrote $CHECKED_IN"
    exit 0
fi
if ! diff -u <(normalize "$CHECKED_IN") <(normalize "$GENERATED"); then
    echo "sql/pg_ccm--${VERSION}.sql differs from what PostgreSQL $PG_MAJOR's build generates: run scripts/check-sql.sh --pg $PG_MAJOR --write, and if only this version differs, explain why in the README" >&2
    exit 1
fi
echo "sql/pg_ccm--${VERSION}.sql matches the code (PostgreSQL $PG_MAJOR)"
