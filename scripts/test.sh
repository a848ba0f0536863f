#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up, the PostgreSQL-free unit tests once, then for
# each PostgreSQL version: the SQL install-script check, the #[pg_test]s inside a real server
# and the integration tests on a real primary and streaming standby of that version.
#
#   PG_VERSIONS="15 18" scripts/test.sh [pytest arguments]
#
# Every version runs the whole integration suite but for two kinds of tests marked in
# tests/integration/conftest.py: `container` tests (the Debian 12 image and packages, which
# hold Debian's PostgreSQL 15) run once, with 15; and `oldest_newest` tests, the slow ones
# whose code paths do not depend on the version, run with the oldest and the newest version
# only. A version that cannot be had on this machine is reported in one line and skipped.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
. "$ROOT/scripts/lib/pg-versions.sh"

"$ROOT/scripts/setup.sh"

versions=$(available_pg_versions)
for version in $(wanted_pg_versions); do
    case " $(echo $versions) " in
        *" $version "*) ;;
        *) echo "==> SKIPPED: PostgreSQL $version is not installed on this machine (scripts/setup.sh could not build it)" ;;
    esac
done
[ -n "$versions" ] || { echo "no PostgreSQL version to test" >&2; exit 1; }
oldest=$(echo "$versions" | head -n 1)
newest=$(echo "$versions" | tail -n 1)

echo "==> unit tests (codec, walcache, agent)"
cargo test --locked -p ccm-codec -p ccm-walcache -p ccm-agent

PGRX_TEST_DIR=/tmp/pg_ccm-pgrx-test
for version in $versions; do
    echo "==> PostgreSQL $version: install script matches the code"
    "$ROOT/scripts/check-sql.sh" --pg "$version"

    echo "==> PostgreSQL $version: #[pg_test]s (pgrx)"
    rm -rf "$PGRX_TEST_DIR" && install -d -o postgres -g postgres "$PGRX_TEST_DIR"
    (cd extension && cargo pgrx test "pg$version" --runas postgres --pgdata "$PGRX_TEST_DIR/data")

    echo "==> PostgreSQL $version: integration tests (primary + streaming standby)"
    "$ROOT/scripts/install.sh" --pg "$version" --test-build
    scope=()
    [ "$version" = 15 ] || scope+=(-m "not container")
    if [ "$version" != "$oldest" ] && [ "$version" != "$newest" ]; then
        scope=(-m "not container and not oldest_newest")
    fi
    PG_BIN=$(pg_bindir "$version") python3 -m pytest -p no:cacheprovider -v --durations=10 "${scope[@]}" tests/integration "$@"
done
