# Sourced by scripts that fetch from Debian (docker/build-image.sh, scripts/build-postgres.sh):
# the mirror comes from this machine's own apt configuration, never from a name written here.
#
#   debian_mirror   prints the first URI of an enabled `deb` source for bookworm

# deb822 (.sources) or one-line (.list) style.
debian_mirror() {
    local file uri
    for file in /etc/apt/sources.list.d/*.sources; do
        [ -r "$file" ] || continue
        uri=$(awk 'BEGIN { RS = ""; FS = "\n" }
            {
                types = uris = suites = ""
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^#/) continue
                    split($i, kv, ":"); key = tolower(kv[1]); value = substr($i, length(kv[1]) + 2)
                    gsub(/^[ \t]+|[ \t]+$/, "", value)
                    if (key == "types") types = " " value " "
                    else if (key == "uris") uris = value
                    else if (key == "suites") suites = " " value " "
                    else if (key == "enabled" && value == "no") types = ""
                }
                if (types ~ / deb / && suites ~ / bookworm /) { split(uris, u, /[ \t]+/); print u[1]; exit }
            }' "$file")
        [ -n "$uri" ] && { echo "$uri"; return; }
    done
    for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$file" ] || continue
        uri=$(sed -E 's/\[[^]]*\]//' "$file" | awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }')
        [ -n "$uri" ] && { echo "$uri"; return; }
    done
    return 1
}
