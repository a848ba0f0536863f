# Sourced by docker/build-image.sh and docker/build-patroni-image.sh: local images rebuilt only
# when what goes into them changed, told by a label that holds the digest of their inputs.

# label IMAGE KEY: the value of a label of a local image, empty without one.
label() {
    docker image inspect -f "{{ index .Config.Labels \"$2\" }}" "$1" 2>/dev/null || true
}

# build_on_change IMAGE KEY BASE BASE_ID DOCKERFILE CONTEXT: `docker build` of DOCKERFILE on
# BASE (its --build-arg BASE) with CONTEXT, labelled KEY=digest, unless IMAGE already carries
# the digest of BASE_ID, CONTEXT's files (names, modes, contents) and DOCKERFILE.
build_on_change() {
    local image=$1 key=$2 base=$3 base_id=$4 dockerfile=$5 context=$6 digest log
    digest=$( (echo "$base_id"; cd "$context" && find . -type f -printf '%m %p\n' | LC_ALL=C sort &&
              find . -type f -print0 | LC_ALL=C sort -z | xargs -0 cat; cat "$dockerfile") |
             sha256sum | cut -c1-16)
    if [ "$(label "$image" "$key")" = "$digest" ]; then
        echo "$image is up to date ($digest)"
        return 0
    fi
    echo "==> docker build $image (${dockerfile#"$ROOT/"} on $base)"
    if ! log=$(docker build --build-arg "BASE=$base" --label "$key=$digest" \
            -f "$dockerfile" -t "$image" "$context" 2>&1); then
        echo "$log" >&2
        return 1
    fi
    echo "$image built ($digest)"
}
