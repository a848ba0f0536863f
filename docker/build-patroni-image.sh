#!/usr/bin/env bash
# Builds the image of docker/patroni-compose.yml without a registry:
#
#   pg_ccm-ha-base:local   docker/build-image.sh's Debian 12 root filesystem (debootstrap) with
#                          etcd-server, etcd-client and python3-venv added: its own cached tar
#                          under ~/.cache/pg_ccm, then `docker import`ed
#   pg_ccm-ha:local        docker/Dockerfile on it (pg_ccm, ccm-agent), built by build-image.sh
#   pg_ccm-patroni:local   docker/Dockerfile.patroni on it: Patroni (docker/patroni-requirements.txt)
#                          in a venv, the Patroni entry point and post_init
#
# Patroni comes as wheels made on this machine by `pip wheel`, so pip reads this machine's own
# configuration (index, find-links, certificates); they are cached under ~/.cache/pg_ccm and
# the image installs them with `pip --no-index`. Each image is skipped when it is up to date
# (labels with the digests of what went in).
#
#   docker/build-patroni-image.sh               build the three images
#   docker/build-patroni-image.sh --base-only   only what needs nothing of this checkout's build:
#                                               Patroni's wheels and both base images (scripts/test.sh
#                                               makes them while it builds and tests the rest)
#   docker/build-patroni-image.sh --stage DIR   only write Dockerfile.patroni's build context to DIR
#                                               (to build it on another base: see its header)
#
# PG_CCM_PATRONI_IMAGE names the image; PYTHON is the Python 3.11 (Debian 12's, the image's)
# whose pip makes the wheels (default python3).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${PG_CCM_PATRONI_IMAGE:-pg_ccm-patroni:local}
HA_IMAGE=pg_ccm-ha:local
HA_BASE_IMAGE=pg_ccm-ha-base:local
HA_PACKAGES="etcd-server etcd-client python3-venv"
PYTHON=${PYTHON:-python3}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pg_ccm
REQUIREMENTS=$ROOT/docker/patroni-requirements.txt
STAGE_ONLY=
BASE_ONLY=0
case "${1:-}" in
    --stage) [ -n "${2:-}" ] || { echo "usage: $0 [--base-only | --stage DIR]" >&2; exit 2; }; STAGE_ONLY=$2 ;;
    --base-only) BASE_ONLY=1 ;;
    "") ;;
    *) echo "usage: $0 [--base-only | --stage DIR]" >&2; exit 2 ;;
esac

. "$ROOT/scripts/lib/docker-image.sh"

# --- Patroni's wheels, once per requirements file ----------------------------------------------
# Compiled wheels (psycopg2-binary, psutil, PyYAML) must match the image's Python: Debian 12's 3.11.
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
    { echo "$PYTHON is not Python 3.11 (the image's): set PYTHON to one" >&2; exit 1; }
wheels=$CACHE/patroni-wheels-$(sha256sum < "$REQUIREMENTS" | cut -c1-16)
if [ ! -s "$wheels/requirements.txt" ]; then
    echo "==> pip wheel Patroni ($(grep -v '^#' "$REQUIREMENTS" | xargs); once, cached in $wheels)"
    rm -rf "$wheels.tmp" && mkdir -p "$wheels.tmp"
    if ! log=$("$PYTHON" -m pip wheel --disable-pip-version-check -q -w "$wheels.tmp" -r "$REQUIREMENTS" 2>&1); then
        echo "$log" >&2
        exit 1
    fi
    cp "$REQUIREMENTS" "$wheels.tmp/requirements.txt"
    rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
fi

stage() {  # stage DIR: Dockerfile.patroni's build context
    rm -rf "$1" && mkdir -p "$1/wheels"
    cp "$wheels"/* "$1/wheels/"
    install -m 755 "$ROOT/docker/patroni-entrypoint.sh" "$ROOT/docker/patroni-post-init.sh" "$1/"
}
if [ -n "$STAGE_ONLY" ]; then
    stage "$STAGE_ONLY"
    echo "staged in $STAGE_ONLY"
    exit 0
fi

if [ "$BASE_ONLY" = 1 ]; then
    # pg_ccm-base:local (the compose demo's and the package test's) and pg_ccm-ha-base:local.
    "$ROOT/docker/build-image.sh" --base-only
    PG_CCM_BASE_IMAGE=$HA_BASE_IMAGE PG_CCM_BASE_PACKAGES=$HA_PACKAGES "$ROOT/docker/build-image.sh" --base-only
    exit 0
fi

# --- pg_ccm-ha-base:local and pg_ccm-ha:local: build-image.sh with more packages ---------------
PG_CCM_BASE_IMAGE=$HA_BASE_IMAGE PG_CCM_IMAGE=$HA_IMAGE PG_CCM_BASE_PACKAGES=$HA_PACKAGES \
    "$ROOT/docker/build-image.sh"

# --- pg_ccm-patroni:local ----------------------------------------------------------------------
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
stage "$context"
build_on_change "$IMAGE" pg_ccm.patroni "$HA_IMAGE" "$(docker image inspect -f '{{.Id}}' "$HA_IMAGE")" \
    "$ROOT/docker/Dockerfile.patroni" "$context"
