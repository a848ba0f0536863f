#!/usr/bin/env bash
# Builds the image `pg_ccm:local` (PostgreSQL 15 + pg_ccm + ccm-agent) without a registry:
# a Debian bookworm root filesystem from debootstrap (cached under ~/.cache/pg_ccm), our
# installed artifacts copied in, then `docker import`. Skips the build when an image with
# the same artifacts exists. Users with a registry can use docker/Dockerfile instead.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${PG_CCM_IMAGE:-pg_ccm:local}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pg_ccm
BASE_TAR=$CACHE/rootfs-bookworm-postgresql15.tar
PKGLIB=$(/usr/lib/postgresql/15/bin/pg_config --pkglibdir)
SHAREDIR=$(/usr/lib/postgresql/15/bin/pg_config --sharedir)
AGENT=$ROOT/target/release/ccm-agent

artifacts=("$PKGLIB/pg_ccm.so" "$SHAREDIR"/extension/pg_ccm* "$AGENT" "$ROOT/docker/entrypoint.sh")
for file in "${artifacts[@]}"; do
    [ -e "$file" ] || { echo "missing $file: run scripts/install.sh first" >&2; exit 1; }
done
digest=$(cat "${artifacts[@]}" | sha256sum | cut -c1-16)
if [ "$(docker image inspect -f '{{ index .Config.Labels "pg_ccm.artifacts" }}' "$IMAGE" 2>/dev/null)" = "$digest" ]; then
    echo "$IMAGE is up to date ($digest)"
    exit 0
fi

if [ ! -s "$BASE_TAR" ]; then
    command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
    mkdir -p "$CACHE"
    rootfs=$(mktemp -d)
    echo "==> debootstrap bookworm with postgresql-15 (once; cached in $BASE_TAR)"
    debootstrap --variant=minbase --include=postgresql-15 bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
    # The package's own cluster is not used: the entry point makes its own.
    rm -rf "$rootfs"/var/lib/postgresql/15 "$rootfs"/etc/postgresql/15 "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -cf "$BASE_TAR.tmp" .
    mv "$BASE_TAR.tmp" "$BASE_TAR"
    rm -rf "$rootfs"
fi

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
tar -C "$staging" -xf "$BASE_TAR"
install -m 755 "$PKGLIB/pg_ccm.so" "$staging/usr/lib/postgresql/15/lib/pg_ccm.so"
install -m 644 "$SHAREDIR"/extension/pg_ccm* "$staging/usr/share/postgresql/15/extension/"
install -m 755 "$AGENT" "$staging/usr/local/bin/ccm-agent"
install -m 755 "$ROOT/docker/entrypoint.sh" "$staging/usr/local/bin/docker-entrypoint.sh"
echo "==> docker import $IMAGE"
tar -C "$staging" -c . | docker import \
    --change 'ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]' \
    --change 'CMD ["primary"]' \
    --change 'ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "LABEL pg_ccm.artifacts=$digest" \
    - "$IMAGE" >/dev/null
echo "$IMAGE built ($digest)"
