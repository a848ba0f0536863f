# Sourced by the scripts that build, install and test per PostgreSQL major version.
#
# The versions pg_ccm is built and tested for: PG_VERSIONS (space-separated majors) when set,
# else all of SUPPORTED_PG_VERSIONS. Version N is found the way Debian lays out its packages:
# /usr/lib/postgresql/N/bin/pg_config (Debian's package for 15, scripts/build-postgres.sh for
# the others).

SUPPORTED_PG_VERSIONS="15 17 18"

# PG_ROOT moves the whole lookup to a copy of the installations (a PostgreSQL installation is
# relocatable: it finds its lib and share directories relative to its programs), for example
# PG_ROOT=/srv/pg/usr/lib/postgresql with /srv/pg/usr/{lib,share,include}/postgresql/N copied
# from /usr, so that two checkouts can install and test different builds side by side.
PG_ROOT=${PG_ROOT:-/usr/lib/postgresql}

pg_bindir() { echo "$PG_ROOT/$1/bin"; }
pg_config_of() { echo "$PG_ROOT/$1/bin/pg_config"; }

# The wanted versions, checked against what compat.rs supports (16 builds too: see README).
wanted_pg_versions() {
    local version
    for version in ${PG_VERSIONS:-$SUPPORTED_PG_VERSIONS}; do
        case "$version" in
            15|16|17|18) echo "$version" ;;
            *) echo "PG_VERSIONS: PostgreSQL $version is not supported (15 to 18 are)" >&2; return 2 ;;
        esac
    done
}

# The wanted versions that are installed here, oldest first.
available_pg_versions() {
    local version
    for version in $(wanted_pg_versions); do
        [ -x "$(pg_config_of "$version")" ] && echo "$version"
    done
    return 0
}

# The newest installed version among the wanted ones (the demo's and benchmarks' default).
newest_pg_version() {
    available_pg_versions | tail -n 1
}
