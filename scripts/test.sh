#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up, the PostgreSQL-free unit tests once, then for
# each PostgreSQL version: the SQL install-script check, the #[pg_test]s inside a real server
# and the integration tests on a real primary and streaming standby of that version. At the end
# (also after a failure) it prints a table of its phases with their wall times.
#
#   scripts/test.sh [pytest arguments]           the whole suite (what CI runs)
#   scripts/test.sh --quick [pytest arguments]   the developers' loop: the unit tests and the
#                                                integration tests marked `smoke`, on the
#                                                newest version only (README: "Quick loop")
#   PG_VERSIONS="15 18" scripts/test.sh          a narrower matrix
#
# Which integration tests run on which version (markers in tests/conftest.py):
#   - every test runs on the newest version installed;
#   - the other versions (15; 17, built with assertions: scripts/build-postgres.sh) run the
#     tests marked `every_version`, those that go through version-specific code (compat.rs:
#     buffer tags, read streams, asynchronous I/O, the prewarm workers) or that exercise the
#     extension's memory handling, which the assertion-enabled server checks;
#   - `container` tests (the Debian 12 image and packages, which hold Debian's PostgreSQL 15:
#     compose and Patroni clusters that warm, fail over and rejoin) run once, with 15.
# The integration tests of a version run in PYTEST_WORKERS parallel pytest-xdist workers (most
# of them wait on replication and the agent's timers); tests that share a module's cluster stay
# on one worker (xdist_group). Each version's integration tests run in the background from the
# moment that version is installed, beside the next versions' builds (oldest first: the
# newest runs the most tests, and they would slow the other versions' builds); the container
# tests from the set-up on. Their output is printed as each ends. A version that cannot
# be had on this machine is reported in one line and skipped.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
. "$ROOT/scripts/lib/pg-versions.sh"
. "$ROOT/scripts/lib/phases.sh"

QUICK=0
if [ "${1:-}" = --quick ]; then
    QUICK=1
    shift
fi
PYTEST_WORKERS=${PYTEST_WORKERS:-4}
trap 'phase_stop_background; phase_table' EXIT

phase "set-up: packages (scripts/setup.sh --packages-only)" "$ROOT/scripts/setup.sh" --packages-only
# The container images' parts that need nothing of this build (Debian root file systems,
# Patroni's wheels) are made beside the PostgreSQL and cargo-pgrx builds; the tests add pg_ccm
# to them. (Decided on the wanted versions: the container tests run with 15.)
# (Image builds take a lock that the tests' own builds take too: tests/harness/docker.py.)
DOCKER_LOCK=${TMPDIR:-/tmp}/pg_ccm-docker-build.lock
containers=0 base_layers=0
if [ "$QUICK" = 0 ] && [ "$(wanted_pg_versions | head -n 1)" = 15 ] && docker info >/dev/null 2>&1; then
    containers=1 base_layers=1
    phase_start "container images: base layers" flock "$DOCKER_LOCK" "$ROOT/docker/build-patroni-image.sh" --base-only
fi
phase "set-up: PostgreSQL builds, cargo-pgrx (scripts/setup.sh)" "$ROOT/scripts/setup.sh"

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
[ "$QUICK" = 1 ] && versions=$newest

[ "$oldest" = 15 ] || containers=0
# The container tests need Debian's PostgreSQL 15, the base layers and a release build of the
# extension and ccm-agent (docker/stage-artifacts.sh), none of this checkout's test builds: they
# start right after the set-up, in the background, compile that release build beside the unit
# tests and the first version's builds (cargo locks each profile's build directory: the
# dev-profile builds go on meanwhile), wait for the base layers, then run. Docker's compose
# stacks, Patroni and the packages mostly wait for containers, in ports of their own (at most 4
# versions take 3,000 ports each from 20000).
CONTAINER_TESTS="PostgreSQL 15: container tests (release build, images, compose, Patroni, packages)"
container_tests() {
    "$ROOT/docker/stage-artifacts.sh" "$ROOT/target/container-stage" &&
        flock "$DOCKER_LOCK" "$ROOT/docker/build-patroni-image.sh" --base-only &&
        env PG_BIN="$(pg_bindir 15)" PG_CCM_PORTS=29000:3000 python3 -m pytest -p no:cacheprovider -v \
            --durations=15 -n 3 --dist loadgroup -m container tests/integration "$@"
}
if [ "$containers" = 1 ]; then
    phase_start "$CONTAINER_TESTS" container_tests "$@"
fi

phase "unit tests (codec, walcache, agent)" cargo test --locked -p ccm-codec -p ccm-walcache -p ccm-agent

PGRX_TEST_DIR=/tmp/pg_ccm-pgrx-test
started=()
pytest_scope() {  # VERSION: the -m expression of its integration tests (containers apart)
    local version=$1 scope=("not container")
    [ "$version" = "$newest" ] || scope+=("every_version" "not agent_only")
    [ "$QUICK" = 0 ] || scope+=("smoke")
    local joined="" term
    for term in "${scope[@]}"; do joined="${joined:+$joined and }$term"; done
    echo "$joined"
}

for version in $versions; do
    if [ "$QUICK" = 0 ]; then
        rm -rf "$PGRX_TEST_DIR" && install -d -o postgres -g postgres "$PGRX_TEST_DIR"
        # One test at a time: several tests compare two scans of the one buffer pool, which a
        # concurrent test's reads would change.
        phase "PostgreSQL $version: #[pg_test]s (pgrx)" \
            bash -c "cd extension && RUST_TEST_THREADS=1 cargo pgrx test pg$version --runas postgres --pgdata $PGRX_TEST_DIR/data"
    fi
    phase "PostgreSQL $version: build and install (test build)" "$ROOT/scripts/install.sh" --pg "$version" --test-build
    if [ "$QUICK" = 0 ] && { [ "$version" = "$oldest" ] || [ "$version" = "$newest" ]; }; then
        # The install script is one file for every version, and the SQL surface depends on
        # none: checked against the schema the oldest and the newest version's builds generate
        # (the test build's, which install.sh leaves in target/install-pgN).
        phase "PostgreSQL $version: install script matches the code" "$ROOT/scripts/check-sql.sh" --pg "$version" --installed
    fi
    scope=$(pytest_scope "$version")
    # In the background too: the next version's builds go on meanwhile (they compute, these
    # tests mostly wait); each version has ports of its own.
    ports=$(( 20000 + 3000 * $(echo $versions | tr ' ' '\n' | grep -n "^$version\$" | cut -d: -f1) - 3000 ))
    phase_start "PostgreSQL $version: integration tests ($scope)" \
        env PG_BIN="$(pg_bindir "$version")" PG_CCM_PORTS="$ports:3000" python3 -m pytest -p no:cacheprovider -v \
        --durations=15 -n "$PYTEST_WORKERS" --dist loadgroup -m "$scope" tests/integration "$@"
    started+=("PostgreSQL $version: integration tests ($scope)")
done
[ "$base_layers" = 0 ] || started+=("container images: base layers")
[ "$containers" = 0 ] || started+=("$CONTAINER_TESTS")
status=0
for name in "${started[@]}"; do
    phase_wait "$name" || status=$?
done
exit "$status"
