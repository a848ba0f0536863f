# Sourced by the set-up scripts.
#
#   install_debian_packages WHAT PACKAGE...   installs the packages that are not installed yet
#                                             (apt-get update first), saying "installing WHAT"
#
# The set-up's steps can overlap (scripts/test.sh builds container images beside PostgreSQL),
# so apt waits for another apt's or dpkg's lock instead of failing at once.
APT_LOCK_WAIT=(-o DPkg::Lock::Timeout=600)

install_debian_packages() {
    local what=$1 pkg missing=()
    shift
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    printf '==> installing %s: %s\n' "$what" "${missing[*]}" >&2
    local sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    "${sudo[@]}" apt-get "${APT_LOCK_WAIT[@]}" update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get "${APT_LOCK_WAIT[@]}" install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
}
