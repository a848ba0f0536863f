#!/usr/bin/env bash
# Builds the Debian packages of pg_ccm into target/debian/, with dpkg-deb only (no debhelper,
# no network):
#
#   postgresql-<major>-pg-ccm_<version>_<arch>.deb   the extension, for the PostgreSQL of
#       --pg-config: pg_ccm.so in `pg_config --pkglibdir`; pg_ccm.control and every
#       pg_ccm--*.sql (install scripts of all releases, upgrade scripts) in
#       `pg_config --sharedir`/extension. Depends: postgresql-<major>.
#   ccm-agent_<version>_<arch>.deb   /usr/bin/ccm-agent, /etc/ccm-agent/ccm-agent.toml (a
#       conffile, from agent/ccm-agent.example.toml), the systemd unit
#       packaging/ccm-agent.service (when the repository has it) in /lib/systemd/system; the
#       system user ccm-agent is created by postinst (packaging/debian/ccm-agent/).
#
# The extension is built with `cargo pgrx package` (a release build without the test-only
# `failpoints` feature, whatever scripts/install.sh --test-build last installed), the agent with
# `cargo build --release` as scripts/install.sh does. <version> is the workspace version of
# Cargo.toml. A package whose content is unchanged is not rebuilt.
#
#   scripts/build-debs.sh [--pg-config PATH] [--no-build]
#       --pg-config  default /usr/lib/postgresql/15/bin/pg_config
#       --no-build   package what target/ already holds (no cargo)
#   Maintainer: "$DEBFULLNAME <$DEBEMAIL>" when set.
#
# Install on Debian 12: apt install ./target/debian/postgresql-15-pg-ccm_*.deb ./target/debian/ccm-agent_*.deb
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
BUILD=1
while [ $# -gt 0 ]; do
    case "$1" in
        --pg-config) PG_CONFIG=$2; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        *) echo "usage: $0 [--pg-config PATH] [--no-build]" >&2; exit 2 ;;
    esac
done
for tool in dpkg-deb dpkg readelf; do
    command -v "$tool" >/dev/null || { echo "$tool is needed (dpkg, binutils)" >&2; exit 1; }
done
umask 022

OUT=$ROOT/target/debian
WORK=$OUT/build
ARCH=$(dpkg --print-architecture)
PG_MAJOR=$("$PG_CONFIG" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
PKGLIBDIR=$("$PG_CONFIG" --pkglibdir)
SHAREDIR=$("$PG_CONFIG" --sharedir)
# [workspace.package] version; a semver pre-release (0.4.0-rc.1) sorts before its release in
# Debian only with a tilde (0.4.0~rc.1).
VERSION=$(awk '/^\[/ { section = $0 } section == "[workspace.package]" && $1 == "version" { gsub(/"/, "", $3); print $3; exit }' Cargo.toml)
[ -n "$VERSION" ] || { echo "no version in [workspace.package] of Cargo.toml" >&2; exit 1; }
DEB_VERSION=${VERSION/-/\~}
MAINTAINER="${DEBFULLNAME:-pg_ccm maintainers} <${DEBEMAIL:-pg-ccm@localhost}>"
EXT_PKG=postgresql-$PG_MAJOR-pg-ccm
PGRX_OUT=$ROOT/target/release/pg_ccm-pg$PG_MAJOR
AGENT=$ROOT/target/release/ccm-agent

if [ "$BUILD" = 1 ]; then
    echo "==> cargo pgrx package (PostgreSQL $PG_MAJOR, release)"
    if ! log=$(cd extension && cargo pgrx package --pg-config "$PG_CONFIG" --no-default-features --features "pg$PG_MAJOR" --out-dir "$PGRX_OUT" 2>&1); then
        echo "$log" >&2
        exit 1
    fi
    echo "==> cargo build --release -p ccm-agent"
    cargo build --locked --release -p ccm-agent
fi
[ -f "$PGRX_OUT$PKGLIBDIR/pg_ccm.so" ] || { echo "missing $PGRX_OUT$PKGLIBDIR/pg_ccm.so (run without --no-build)" >&2; exit 1; }
[ -x "$AGENT" ] || { echo "missing $AGENT (run without --no-build)" >&2; exit 1; }
# Never a test build (scripts/install.sh --test-build): it registers ccm.test_prewarm_delay_ms.
if grep -qa 'ccm\.test_prewarm_delay_ms' "$PGRX_OUT$PKGLIBDIR/pg_ccm.so"; then
    echo "$PGRX_OUT$PKGLIBDIR/pg_ccm.so is a test build (failpoints feature): not packaged" >&2
    exit 1
fi

# Depends of the shared libraries an ELF file needs, as dpkg-shlibdeps would compute them from
# the shlibs files of the packages that own those libraries on this machine (e.g. libc6 (>= 2.36),
# libgcc-s1).
shlib_depends() {
    local soname name ver pkg dep
    for soname in $(readelf -d "$@" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u); do
        name=${soname%%.so.*} ver=${soname##*.so.}
        pkg=$(dpkg -S "*/$soname" 2>/dev/null |
              awk -F': ' -v arch=":$ARCH" '$2 !~ /\/debug\// && ($1 !~ /:/ || substr($1, length($1) - length(arch) + 1) == arch) { print $1; exit }') ||
            true
        [ -n "$pkg" ] || { echo "no package owns $soname (needed by $*)" >&2; return 1; }
        dep=$(cat /var/lib/dpkg/info/"${pkg}".shlibs /var/lib/dpkg/info/"${pkg%%:*}".shlibs 2>/dev/null |
              awk -v n="$name" -v v="$ver" '$1 == n && $2 == v { $1 = ""; $2 = ""; sub(/^ +/, ""); print; exit }')
        [ -n "$dep" ] || { echo "no shlibs entry for $soname in ${pkg}" >&2; return 1; }
        echo "$dep"
    done | sort -u | paste -sd, | sed 's/,/, /g'
}

# dh_strip's flags: no symbol tables or .comment in the packages (.dynsym stays: the server
# finds pg_ccm's functions through it).
strip_into() {  # strip_into SRC DEST MODE [--strip-unneeded (shared libraries)]
    install -D -m "$3" "$1" "$2"
    if command -v strip >/dev/null; then
        strip --remove-section=.comment --remove-section=.note ${4:-} "$2"
    fi
}

# Builds target/debian/<pkg>_<version>_<arch>.deb from $WORK/<pkg>/ (the tree, DEBIAN/control
# without Installed-Size); skipped when the tree is what the existing package was built from.
build_deb() {
    local pkg=$1 root=$WORK/$1 deb=$OUT/${1}_${DEB_VERSION}_$ARCH.deb digest
    (cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z | xargs -0r md5sum) \
        > "$root/DEBIAN/md5sums"
    [ -s "$root/DEBIAN/md5sums" ] || rm "$root/DEBIAN/md5sums"
    echo "Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)" >> "$root/DEBIAN/control"
    digest=$(cd "$root" && find . -printf '%M %P\n' | LC_ALL=C sort | cat - DEBIAN/* | sha256sum | cut -c1-32)
    if [ -f "$deb" ] && [ "$(cat "$OUT/.$pkg.digest" 2>/dev/null)" = "$digest" ]; then
        echo "$deb is up to date"
        return
    fi
    rm -f "$OUT/${pkg}"_*.deb
    SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)} \
        dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
    echo "$digest" > "$OUT/.$pkg.digest"
    echo "built $deb"
}

copyright() {  # copyright PKG: /usr/share/doc/PKG/copyright
    install -d "$WORK/$1/usr/share/doc/$1"
    cat > "$WORK/$1/usr/share/doc/$1/copyright" <<EOF
$1 is built from pg_ccm $VERSION.

Copyright: the pg_ccm maintainers
License: PostgreSQL (the PostgreSQL License, as PostgreSQL itself)
EOF
}

rm -rf "$WORK"
mkdir -p "$OUT"

# --- the extension -----------------------------------------------------------------------
root=$WORK/$EXT_PKG
strip_into "$PGRX_OUT$PKGLIBDIR/pg_ccm.so" "$root$PKGLIBDIR/pg_ccm.so" 644 --strip-unneeded
install -d "$root$SHAREDIR/extension"
install -m 644 "$PGRX_OUT$SHAREDIR/extension/pg_ccm.control" "$PGRX_OUT$SHAREDIR"/extension/pg_ccm--*.sql \
    "$root$SHAREDIR/extension/"
# The checked-in scripts of every release and upgrade (scripts/check-sql.sh keeps the current
# one equal to what pgrx generates), as scripts/install.sh installs them.
install -m 644 sql/pg_ccm--*.sql "$root$SHAREDIR/extension/"
copyright "$EXT_PKG"
mkdir -p "$root/DEBIAN"
cat > "$root/DEBIAN/control" <<EOF
Package: $EXT_PKG
Version: $DEB_VERSION
Architecture: $ARCH
Maintainer: $MAINTAINER
Depends: postgresql-$PG_MAJOR, $(shlib_depends "$root$PKGLIBDIR/pg_ccm.so")
Section: database
Priority: optional
Description: cluster cache management for PostgreSQL $PG_MAJOR streaming replicas
 pg_ccm keeps a tier-0 standby's shared_buffers warm with the primary's hot set,
 so that a failover finds a warm cache. Load it with
 shared_preload_libraries = 'pg_ccm' and run CREATE EXTENSION pg_ccm on the
 primary; the ccm-agent package moves the hot set.
EOF
build_deb "$EXT_PKG"

# --- the agent ---------------------------------------------------------------------------
root=$WORK/ccm-agent
strip_into "$AGENT" "$root/usr/bin/ccm-agent" 755
install -D -m 644 agent/ccm-agent.example.toml "$root/etc/ccm-agent/ccm-agent.toml"
if [ -f packaging/ccm-agent.service ]; then
    install -D -m 644 packaging/ccm-agent.service "$root/lib/systemd/system/ccm-agent.service"
fi
copyright ccm-agent
install -d "$root/DEBIAN"
install -m 755 packaging/debian/ccm-agent/postinst packaging/debian/ccm-agent/prerm \
    packaging/debian/ccm-agent/postrm "$root/DEBIAN/"
echo /etc/ccm-agent/ccm-agent.toml > "$root/DEBIAN/conffiles"
cat > "$root/DEBIAN/control" <<EOF
Package: ccm-agent
Version: $DEB_VERSION
Architecture: $ARCH
Maintainer: $MAINTAINER
Depends: $(shlib_depends "$root/usr/bin/ccm-agent"), adduser | passwd
Suggests: $EXT_PKG
Section: database
Priority: optional
Description: pg_ccm agent: keeps a PostgreSQL standby's cache warm
 ccm-agent is the sidecar of the pg_ccm extension. Each cycle it asks the
 standby for a bloom filter of the buffers it caches, asks the primary for its
 hot blocks missing from that filter, and has the standby read them in, so
 that a failover to the standby finds a warm cache. It serves /metrics,
 /healthz and /readyz. Configuration: /etc/ccm-agent/ccm-agent.toml; the
 package creates the system user ccm-agent to run it as.
EOF
build_deb ccm-agent
