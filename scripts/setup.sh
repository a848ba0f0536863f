#!/usr/bin/env bash
# Installs everything pg_ccm needs to build, test and demo on Debian 12, skipping what is
# already there (a second run takes seconds): PostgreSQL 15 server, headers and contrib from
# Debian, PostgreSQL 17 and 18 built from Debian's source packages (scripts/build-postgres.sh),
# libclang for bindgen, sudo (cargo pgrx test --runas), vmtouch (page-cache eviction in the
# demo), fio (what the disk gives, in the failover benchmark), debootstrap (the container
# images' root file systems), Prometheus and promtool (the monitoring tests), cargo-pgrx
# 0.18.0, the pgrx init against every installed pg_config, and the Python packages of the
# integration tests.
#
# PG_VERSIONS="15 18" limits the versions (default: all supported, scripts/lib/pg-versions.sh).
# A version that cannot be had on this machine is reported in one line and left out.
#
#   scripts/setup.sh                  everything
#   scripts/setup.sh --packages-only  Debian's packages and the Python packages only (what
#                                     scripts/test.sh needs before it starts the container
#                                     images' base layers beside the PostgreSQL builds)
set -euo pipefail
PACKAGES_ONLY=0
case "${1:-}" in
    "") ;;
    --packages-only) PACKAGES_ONLY=1 ;;
    *) echo "usage: $0 [--packages-only]" >&2; exit 2 ;;
esac

PGRX_VERSION=0.18.0
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib/pg-versions.sh"
. "$ROOT/scripts/lib/apt-packages.sh"

log() { printf '==> %s\n' "$*" >&2; }

install_apt_packages() {
    # 15 always: Debian's package also makes the `postgres` user every server runs as.
    # The package may start its own cluster on 5432; ours use other ports, so leave it.
    install_debian_packages "Debian packages" postgresql-15 postgresql-server-dev-15 postgresql-contrib \
        libclang-dev clang pkg-config sudo vmtouch fio python3-pip debootstrap
}

# Debian's prometheus package, for its `prometheus` and `promtool`: the tests start their own
# servers on free loopback ports. The package's own service (on port 9090, started by the package
# where systemd or an init script runs services) is stopped and disabled when this script
# installs it; one that was installed before is left as it is.
install_prometheus() {
    dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q 'install ok installed' && return 0
    install_debian_packages "Prometheus (monitoring tests)" prometheus
    local sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    if [ -d /run/systemd/system ]; then
        "${sudo[@]}" systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    else
        "${sudo[@]}" update-rc.d prometheus disable >/dev/null 2>&1 || true
        "${sudo[@]}" /etc/init.d/prometheus stop >/dev/null 2>&1 || true
    fi
}

install_cargo_pgrx() {
    if ! cargo pgrx --version 2>/dev/null | grep -q " ${PGRX_VERSION}\$"; then
        # The debug profile: cargo-pgrx only drives builds, and its release build (LTO, opt-level
        # 3) took 7 to 13 minutes of a fresh machine's set-up on 2 cores.
        log "installing cargo-pgrx ${PGRX_VERSION} (debug profile)"
        cargo install cargo-pgrx --version "${PGRX_VERSION}" --locked --quiet --debug
    fi
    # One init names every version: it rewrites pgrx's config.toml.
    local version init=() missing=0
    for version in $(available_pg_versions); do
        init+=("--pg$version" "$(pg_config_of "$version")")
        grep -qs "^pg$version = \"$(pg_config_of "$version")\"" "${PGRX_HOME:-$HOME/.pgrx}/config.toml" || missing=1
    done
    if [ "$missing" = 1 ]; then
        log "cargo pgrx init ${init[*]}"
        cargo pgrx init "${init[@]}" >/dev/null
    fi
}

# PostgreSQL versions other than Debian 12's 15, from Debian's source packages.
build_other_versions() {
    local version status
    for version in $(wanted_pg_versions); do
        [ "$version" = 15 ] && continue
        status=0
        "$ROOT/scripts/build-postgres.sh" "$version" || status=$?
        case "$status" in
            0) ;;
            3) log "PostgreSQL $version cannot be had on this machine: its builds and tests are skipped" ;;
            *) log "building PostgreSQL $version failed"; return "$status" ;;
        esac
    done
}

install_python_packages() {
    if ! python3 -c 'import psycopg, pytest, xdist, matplotlib, yaml' 2>/dev/null; then
        log "installing Python packages (tests/requirements.txt)"
        python3 -m pip install --quiet --disable-pip-version-check -r "${ROOT}/tests/requirements.txt"
    fi
}

install_apt_packages
install_prometheus
install_python_packages
[ "$PACKAGES_ONLY" = 1 ] && exit 0
build_other_versions
install_cargo_pgrx
