# Sourced by the scripts that build, install and test per PostgreSQL major version.
#
# The versions pg_ccm is built and tested for: PG_VERSIONS (space-separated majors) when set,
# else all of SUPPORTED_PG_VERSIONS. Version N is found the way Debian lays out its packages:
# /usr/lib/postgresql/N/bin/pg_config (Debian's package for 15, scripts/build-postgres.sh for
# the others).

SUPPORTED_PG_VERSIONS="15 17 18"

pg_bindir() { echo "/usr/lib/postgresql/$1/bin"; }
pg_config_of() { echo "/usr/lib/postgresql/$1/bin/pg_config"; }

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
