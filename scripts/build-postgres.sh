#!/usr/bin/env bash
# Builds and installs PostgreSQL MAJOR from Debian's source package, for the majors Debian 12
# does not package (17 from trixie, 18 from sid), laid out as Debian lays out its packages:
# programs and pg_config in /usr/lib/postgresql/MAJOR/bin, modules in .../MAJOR/lib (also the
# build's own libpq, so the system's libpq5 is not touched), extensions' files in
# /usr/share/postgresql/MAJOR, server headers in /usr/include/postgresql/MAJOR/server, contrib
# included, the Unix socket in /var/run/postgresql. So an extension package built against it
# (scripts/build-debs.sh) puts its files where Debian's and PGDG's postgresql-MAJOR look. A
# second run finds the build and returns at once.
#
#   scripts/build-postgres.sh MAJOR
#
# The sources come from the Debian mirror this machine's apt already uses, through a private
# deb-src list and private package lists: the system's apt sources are not touched. apt checks
# the tarball against the archive's signed Sources index. Upstream's tarball is built (the
# .orig.tar of the source package), not Debian's patched tree: Debian's patches are packaging
# and paths, and nothing pg_ccm depends on.
#
# A mirror's package pool can lag its index (seen 2026-11-23: trixie's Sources named 17.12,
# whose files the mirror did not have yet). Then the earlier Debian versions listed in
# EARLIER_VERSIONS are tried: their .dsc is checked with gpgv against Debian's keyring (the
# debian-keyring package) and the tarball against the .dsc's SHA-256; a signature that does
# not check fails the build (it is not taken for a missing source).
#
# Exit status 0: installed; 3: this major cannot be had here (no source package in the
# mirror's trixie or sid), with one line saying so; anything else: a failed build.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib/debian-mirror.sh"
. "$ROOT/scripts/lib/apt-packages.sh"

MAJOR=${1:?usage: $0 MAJOR}
PREFIX=/usr/lib/postgresql/$MAJOR
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pg_ccm/postgresql
SHAREDIR=/usr/share/postgresql/$MAJOR
INCLUDEDIR=/usr/include/postgresql/$MAJOR
STAMP=$PREFIX/.pg_ccm-build
# The middle version of the test matrix is built with assertions (--enable-cassert, which also
# clobbers freed memory), as PostgreSQL's buildfarm and pgrx's CI test extensions: silent memory
# errors become deterministic failures. The oldest (Debian's package) and the newest (what the
# demo and the benchmarks measure) are production builds. ASSERTS=yes|no overrides.
ASSERT_MAJORS="17"
case " $ASSERT_MAJORS " in *" $MAJOR "*) ASSERTS=${ASSERTS:-yes} ;; *) ASSERTS=${ASSERTS:-no} ;; esac
# Bumped when the layout or the options change: an older build of ours is then replaced.
BUILD_ID="layout=debian-2 cassert=$ASSERTS"

log() { printf '==> %s\n' "$*" >&2; }

declare -A EARLIER_VERSIONS=([17]="17.11-0+deb13u1" [18]="18.6-3")

if [ -s "$STAMP" ] && grep -qx "$BUILD_ID" "$STAMP" && "$PREFIX/bin/pg_config" --version 2>/dev/null | grep -q "^PostgreSQL $MAJOR\."; then
    exit 0
fi
if [ -x "$PREFIX/bin/pg_config" ] && [ ! -e "$STAMP" ]; then
    # Debian's own package (bookworm has 15): never build over it.
    log "PostgreSQL $MAJOR is installed from a package in $PREFIX; nothing to build"
    exit 0
fi

install_build_dependencies() {
    install_debian_packages "build dependencies" build-essential bison flex pkg-config bzip2 curl gpgv \
        libreadline-dev zlib1g-dev libssl-dev liblz4-dev libzstd-dev libicu-dev liburing-dev tzdata
}

# Downloads postgresql-MAJOR's upstream tarball into $CACHE (once) and prints its path.
fetch_source() {
    local existing
    existing=$(ls "$CACHE"/postgresql-"$MAJOR"_*.orig.tar.* 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -n "$existing" ]; then
        echo "$existing"
        return
    fi
    local mirror apt_dir
    mirror=$(debian_mirror) || { echo "no Debian source in /etc/apt to take the mirror from" >&2; return 1; }
    apt_dir=$(mktemp -d)
    mkdir -p "$apt_dir/lists/partial" "$CACHE"
    # apt downloads as the user _apt where it exists.
    chmod 755 "$apt_dir"
    if getent passwd _apt >/dev/null; then chown -R _apt "$apt_dir/lists"; fi
    cat > "$apt_dir/sources.list.sources" <<EOF
Types: deb-src
URIs: $mirror
Suites: trixie sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    local apt_options=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list.sources" -o Dir::Etc::sourceparts=/dev/null
                       -o "Dir::State::Lists=$apt_dir/lists" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=)
    log "fetching the source package postgresql-$MAJOR (Debian trixie/sid)"
    apt-get "${apt_options[@]}" update -qq >/dev/null
    local pool=""
    if ! (cd "$CACHE" && apt-get "${apt_options[@]}" source --download-only -qq "postgresql-$MAJOR" >/dev/null 2>&1); then
        # Where the index puts the package, for the earlier versions.
        pool=$(apt-cache "${apt_options[@]}" showsrc "postgresql-$MAJOR" 2>/dev/null | sed -n 's/^Directory: //p' | head -n 1)
    fi
    rm -rf "$apt_dir"
    if [ -z "$pool" ] && ls "$CACHE"/postgresql-"$MAJOR"_*.orig.tar.* >/dev/null 2>&1; then
        ls "$CACHE"/postgresql-"$MAJOR"_*.orig.tar.* | sort -V | tail -n 1
        return
    fi
    local version
    for version in ${pool:+${EARLIER_VERSIONS[$MAJOR]:-}}; do
        fetch_verified "$mirror/$pool" "$version" && return
        # A signature that does not check is an error, not a source that is missing.
        [ $? -ne 4 ] || return 1
    done
    echo "PostgreSQL $MAJOR: no source package postgresql-$MAJOR could be downloaded from Debian trixie or sid" >&2
    return 3
}

# fetch_verified URL VERSION: downloads postgresql-MAJOR_VERSION.dsc from URL, checks its
# signature against Debian's keyring, then the upstream tarball it names against its SHA-256.
fetch_verified() {
    local url=$1 version=$2 dsc orig sum
    dsc="postgresql-${MAJOR}_${version}.dsc"
    log "the mirror lacks the newest postgresql-$MAJOR; trying $version, checked with Debian's keyring"
    install_debian_packages "Debian's keyring (to check the .dsc)" debian-keyring || return 4
    (cd "$CACHE" && curl -fsS -o "$dsc.part" "$url/$dsc") || return 1
    if ! gpgv --keyring /usr/share/keyrings/debian-keyring.gpg "$CACHE/$dsc.part" 2>/dev/null; then
        echo "$dsc: bad or unknown signature" >&2
        rm -f "$CACHE/$dsc.part"
        return 4
    fi
    read -r sum _ orig < <(sed -n '/^Checksums-Sha256:/,/^[^ ]/p' "$CACHE/$dsc.part" | grep -E ' postgresql-[0-9]+_[^ ]+\.orig\.tar\.[a-z0-9]+$')
    [ -n "${orig:-}" ] || return 1
    (cd "$CACHE" && curl -fsS -o "$orig.part" "$url/$orig") || return 1
    if ! echo "$sum  $CACHE/$orig.part" | sha256sum -c --quiet -; then
        rm -f "$CACHE/$orig.part"
        return 1
    fi
    mv "$CACHE/$dsc.part" "$CACHE/$dsc"
    mv "$CACHE/$orig.part" "$CACHE/$orig"
    echo "$CACHE/$orig"
}

build() {
    local tarball=$1 build_dir
    build_dir=$(mktemp -d)
    trap 'rm -rf "$build_dir"' RETURN
    tar -C "$build_dir" -xf "$tarball"
    cd "$build_dir"/postgresql-*
    # Debian's servers put their socket in /var/run/postgresql; so do these, so that a
    # client (or ccm-agent's default host) finds every version the same way.
    sed -i 's|^#define DEFAULT_PGSOCKET_DIR .*|#define DEFAULT_PGSOCKET_DIR  "/var/run/postgresql"|' src/include/pg_config_manual.h
    local options=(--prefix="$PREFIX" --datadir="$SHAREDIR" --includedir="$INCLUDEDIR" --with-openssl --with-lz4 --with-zstd --with-icu
                   --with-system-tzdata=/usr/share/zoneinfo --enable-debug)
    # 18 reads through io_uring when io_method = io_uring (a configure option from 18 on).
    [ "$MAJOR" -ge 18 ] && options+=(--with-liburing)
    [ "$ASSERTS" = yes ] && options+=(--enable-cassert)
    log "building PostgreSQL $(basename "$PWD") into $PREFIX (assertions: $ASSERTS; about 2.5 minutes on 2 cores)"
    ./configure "${options[@]}" CFLAGS="-O2 -g" > "$build_dir/configure.log" 2>&1 ||
        { tail -n 30 "$build_dir/configure.log" >&2; return 1; }
    make -s -j"$(nproc)" world-bin > "$build_dir/make.log" 2>&1 || { tail -n 50 "$build_dir/make.log" >&2; return 1; }
    # An older build of ours (never a package's files: those have no stamp) goes first.
    if [ -e "$STAMP" ]; then rm -rf "$PREFIX" "$SHAREDIR" "$INCLUDEDIR"; fi
    make -s install-world-bin > "$build_dir/install.log" 2>&1 || { tail -n 30 "$build_dir/install.log" >&2; return 1; }
    printf '%s\n%s\n' "$(basename "$tarball")" "$BUILD_ID" > "$STAMP"
}

install_build_dependencies
tarball=$(fetch_source) || exit $?
build "$tarball"
log "PostgreSQL $("$PREFIX/bin/pg_config" --version | cut -d' ' -f2) installed in $PREFIX"
