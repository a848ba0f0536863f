#!/usr/bin/env bash
# Builds the previous pg_ccm release's library into a copy of PostgreSQL MAJOR's installation,
# so that a test can run one node on it beside nodes on this checkout's library: the version
# skew of a rolling upgrade (tests/integration/test_upgrade_skew.py). Prints the copy's bin
# directory.
#
#   scripts/build-previous-release.sh MAJOR
#
# The previous release is the one the newest upgrade script in sql/ starts from
# (pg_ccm--A--B.sql, B this checkout's version): its code is the last commit whose Cargo.toml
# has version A, taken from this clone's history with `git archive`. A PostgreSQL installation
# is relocatable (it finds its lib and share directories relative to its programs), so the
# copy holds /usr/lib/postgresql/MAJOR, /usr/share/postgresql/MAJOR and
# /usr/include/postgresql/MAJOR under a root of its own, and the old library is installed
# there only. The library is built in the dev profile against the installed pg_config (the
# copy's headers are the same), in this checkout's target directory, so that it reuses the
# dependencies the test build compiled. Cached by commit and PostgreSQL version under
# $PG_CCM_CACHE (default /var/cache/pg_ccm/previous-release): a second run prints at once.
#
# Exit status 3: this major cannot be copied here (Debian's own packages are not relocatable:
# their programs look for the package's paths), or the history holds no earlier release.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib/pg-versions.sh"
MAJOR=${1:?usage: $0 MAJOR}
CACHE=${PG_CCM_CACHE:-/var/cache/pg_ccm/previous-release}
log() { printf '==> %s\n' "$*" >&2; }

CURRENT=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n 1)
PREVIOUS=$(cd "$ROOT/sql" && ls pg_ccm--*--"$CURRENT".sql 2>/dev/null | sed -E 's/^pg_ccm--(.*)--.*\.sql$/\1/' | sort -V | tail -n 1)
[ -n "$PREVIOUS" ] || { echo "no upgrade script to $CURRENT in sql/: no previous release" >&2; exit 3; }

# The last commit whose Cargo.toml says version $PREVIOUS: among the commits that touched that
# line, the first (newest) that has it, or the parent of the first that changed it away.
commit=""
pattern="^version = \"${PREVIOUS//./\\.}\""
for changed in $(git -C "$ROOT" log --format=%H -G"$pattern" -- Cargo.toml); do
    for candidate in "$changed" "$changed^"; do
        if git -C "$ROOT" show "$candidate:Cargo.toml" 2>/dev/null | grep -q "$pattern"; then
            commit=$(git -C "$ROOT" rev-parse "$candidate")
            break 2
        fi
    done
done
[ -n "$commit" ] || { echo "pg_ccm $PREVIOUS is not in this clone's history (a shallow clone?)" >&2; exit 3; }

[ -e "$PG_ROOT/$MAJOR/.pg_ccm-build" ] ||
    { echo "PostgreSQL $MAJOR here is a package's, which is not relocatable: no copy of it" >&2; exit 3; }

# Keyed by the release's commit and the PostgreSQL build it copies.
build=$(sha256sum < "$PG_ROOT/$MAJOR/.pg_ccm-build" | cut -c1-8)
copy=$CACHE/$PREVIOUS-${commit:0:12}-pg$MAJOR-$build
bindir=$copy/usr/lib/postgresql/$MAJOR/bin
mkdir -p "$CACHE"
exec 9> "$CACHE/.lock"
flock 9
if [ -s "$copy/.complete" ]; then
    echo "$bindir"
    exit 0
fi

log "building pg_ccm $PREVIOUS (${commit:0:12}) for a copy of PostgreSQL $MAJOR in $copy"
rm -rf "$copy" && mkdir -p "$copy"
for dir in lib share include; do
    mkdir -p "$copy/usr/$dir/postgresql"
    cp -a "/usr/$dir/postgresql/$MAJOR" "$copy/usr/$dir/postgresql/"
done
source_dir=$(mktemp -d)
trap 'rm -rf "$source_dir"' EXIT
git -C "$ROOT" archive "$commit" | tar -x -C "$source_dir"
stage=$source_dir/stage
# That release's lock file, its own pg_config setting of pgrx's init; this checkout's target
# directory for what both share.
(cd "$source_dir/extension" && CARGO_TARGET_DIR="$ROOT/target" cargo pgrx package --debug \
    --pg-config "$(pg_config_of "$MAJOR")" --no-default-features --features "pg$MAJOR" --out-dir "$stage" >/dev/null)
pkglibdir=$("$(pg_config_of "$MAJOR")" --pkglibdir)
sharedir=$("$(pg_config_of "$MAJOR")" --sharedir)
install -m 755 "$stage$pkglibdir/pg_ccm.so" "$copy$pkglibdir/pg_ccm.so"
install -m 644 "$stage$sharedir"/extension/pg_ccm* "$copy$sharedir/extension/"
install -m 644 "$source_dir"/sql/pg_ccm--*.sql "$copy$sharedir/extension/"
# The copy holds that release's catalog scripts only: the newer ones are this checkout's.
rm -f "$copy$sharedir/extension/pg_ccm--$CURRENT.sql" "$copy$sharedir"/extension/pg_ccm--*--"$CURRENT".sql
echo "$PREVIOUS $commit" > "$copy/.complete"
echo "$bindir"
