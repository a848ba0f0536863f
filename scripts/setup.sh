#!/usr/bin/env bash
# Installs everything pg_ccm needs to build, test and demo on Debian 12, skipping what is
# already there (a second run takes seconds): PostgreSQL 15 server, headers and contrib,
# libclang for bindgen, sudo (cargo pgrx test --runas), vmtouch (page-cache eviction in
# the demo), cargo-pgrx 0.18.0, the pgrx init against the system pg_config, and the
# Python packages of the integration tests.
set -euo pipefail

PG_MAJOR=15
PG_CONFIG=/usr/lib/postgresql/${PG_MAJOR}/bin/pg_config
PGRX_VERSION=0.18.0
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { printf '==> %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_apt_packages() {
    local wanted=(postgresql-${PG_MAJOR} postgresql-server-dev-${PG_MAJOR} postgresql-contrib
                  libclang-dev clang pkg-config sudo vmtouch python3-pip)
    local missing=()
    for pkg in "${wanted[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing Debian packages: ${missing[*]}"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    # The Debian package may start its own cluster on 5432; ours use other ports, so leave it.
}

install_cargo_pgrx() {
    if ! cargo pgrx --version 2>/dev/null | grep -q " ${PGRX_VERSION}\$"; then
        log "installing cargo-pgrx ${PGRX_VERSION} (about 13 minutes on 2 cores)"
        cargo install cargo-pgrx --version "${PGRX_VERSION}" --locked --quiet
    fi
    if ! grep -qs "^pg${PG_MAJOR} = \"${PG_CONFIG}\"" "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
        log "cargo pgrx init --pg${PG_MAJOR} ${PG_CONFIG}"
        cargo pgrx init --pg${PG_MAJOR} "${PG_CONFIG}" >/dev/null
    fi
}

install_python_packages() {
    if ! python3 -c 'import psycopg, pytest, matplotlib' 2>/dev/null; then
        log "installing Python packages (tests/requirements.txt)"
        python3 -m pip install --quiet --disable-pip-version-check -r "${ROOT}/tests/requirements.txt"
    fi
}

install_apt_packages
install_cargo_pgrx
install_python_packages
