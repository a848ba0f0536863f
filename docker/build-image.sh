#!/usr/bin/env bash
# Builds the images of the compose demo and of the package test without a registry:
#
#   pg_ccm-base:local  Debian 12: `debootstrap --variant=minbase bookworm` with postgresql-15 and
#                      prometheus (the compose demo's monitoring), nothing of pg_ccm
#                      (tests/integration/test_packages.py installs the .debs in it). The root
#                      filesystem is cached under ~/.cache/pg_ccm, then `docker import`ed.
#   pg_ccm:local       docker/Dockerfile on top of it: the installed extension (scripts/install.sh),
#                      target/release/ccm-agent, the entry point, the healthcheck, the user
#                      ccm-agent. Users with a registry build the same Dockerfile on the official
#                      postgres image instead (see its header).
#
# Each image is skipped when it is up to date (labels with the digests of what went in).
#
#   docker/build-image.sh [--base-only]
#
# PG_CCM_IMAGE and PG_CCM_BASE_IMAGE name the images; PG_CCM_BASE_PACKAGES adds Debian packages
# to the root filesystem (its own cached tar: docker/build-patroni-image.sh adds etcd and
# python3-venv this way); DEBIAN_MIRROR is debootstrap's mirror (default: the mirror this
# machine's apt sources use for bookworm).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${PG_CCM_IMAGE:-pg_ccm:local}
BASE_IMAGE=${PG_CCM_BASE_IMAGE:-pg_ccm-base:local}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pg_ccm
# Sorted and deduplicated, so that one set of packages is one cached tar.
EXTRA_PACKAGES=$(printf '%s\n' ${PG_CCM_BASE_PACKAGES:-} | LC_ALL=C sort -u | paste -sd ' ')
BASE_TAR=$CACHE/rootfs-bookworm-postgresql15-prometheus${EXTRA_PACKAGES:++${EXTRA_PACKAGES// /+}}.tar
BASE_ONLY=0
case "${1:-}" in
    --base-only) BASE_ONLY=1 ;;
    "") ;;
    *) echo "usage: $0 [--base-only]" >&2; exit 2 ;;
esac

. "$ROOT/scripts/lib/docker-image.sh"
. "$ROOT/scripts/lib/debian-mirror.sh"
. "$ROOT/scripts/lib/apt-packages.sh"

# --- pg_ccm-base:local -------------------------------------------------------------------------
if [ ! -s "$BASE_TAR" ]; then
    command -v debootstrap >/dev/null || install_debian_packages "debootstrap" debootstrap
    mirror=${DEBIAN_MIRROR:-$(debian_mirror)} ||
        { echo "no bookworm source in /etc/apt: set DEBIAN_MIRROR to a Debian mirror" >&2; exit 1; }
    mkdir -p "$CACHE"
    rootfs=$(mktemp -d)
    packages=postgresql-15,prometheus${EXTRA_PACKAGES:+,${EXTRA_PACKAGES// /,}}
    echo "==> debootstrap bookworm with $packages (once; cached in $BASE_TAR)"
    debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" >/dev/null
    # The package's own cluster is not used: the entry point (or the test) makes its own.
    # Prometheus's web pages load moment-timezone-with-data.min.js only, not the 210 MB of
    # per-zone files beside it (libjs-moment-timezone).
    rm -rf "$rootfs"/var/lib/postgresql/15 "$rootfs"/etc/postgresql/15 "$rootfs"/var/cache/apt/archives/*.deb \
        "$rootfs"/usr/share/javascript/moment-timezone/data
    tar -C "$rootfs" -cf "$BASE_TAR.tmp" .
    rm -rf "$rootfs"
    sha256sum < "$BASE_TAR.tmp" | cut -c1-16 > "$BASE_TAR.id"
    mv "$BASE_TAR.tmp" "$BASE_TAR"
fi
[ -s "$BASE_TAR.id" ] || sha256sum < "$BASE_TAR" | cut -c1-16 > "$BASE_TAR.id"
base_id=$(cat "$BASE_TAR.id")
if [ "$(label "$BASE_IMAGE" pg_ccm.rootfs)" = "$base_id" ]; then
    echo "$BASE_IMAGE is up to date ($base_id)"
else
    echo "==> docker import $BASE_IMAGE"
    docker import \
        --change 'ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' \
        --change "LABEL pg_ccm.rootfs=$base_id" \
        "$BASE_TAR" "$BASE_IMAGE" >/dev/null
    echo "$BASE_IMAGE built ($base_id)"
fi
[ "$BASE_ONLY" = 1 ] && exit 0

# --- pg_ccm:local ------------------------------------------------------------------------------
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
"$ROOT/docker/stage-artifacts.sh" "$stage" >/dev/null
build_on_change "$IMAGE" pg_ccm.artifacts "$BASE_IMAGE" "$base_id" "$ROOT/docker/Dockerfile" "$stage"
