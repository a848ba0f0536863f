# Sourced by scripts/test.sh: named phases with their wall times, and the table of them that the
# test command prints at its end (also when it fails), so that every run measures itself.
#
#   phase NAME COMMAND...      runs COMMAND in the foreground as phase NAME
#   phase_start NAME COMMAND...  runs COMMAND in the background as phase NAME (its output in a
#                              file, printed when it is awaited)
#   phase_wait NAME            waits for a background phase; its status is returned
#   phase_stop_background      ends background phases still running (after a failure), noting them
#   phase_table                prints every phase: start (seconds since the first), wall time, status

PHASES_T0=${PHASES_T0:-$(date +%s)}
PHASES_ROWS=()
declare -A PHASES_PID=() PHASES_LOG=() PHASES_BEGIN=()

_phase_row() {  # NAME BEGIN STATUS [NOTE [END]]
    PHASES_ROWS+=("$1|$(( $2 - PHASES_T0 ))|$(( ${5:-$(date +%s)} - $2 ))|$3|${4:-}")
}

phase() {
    local name=$1 begin status=0
    shift
    begin=$(date +%s)
    printf '\n==> %s\n' "$name"
    "$@" || status=$?
    _phase_row "$name" "$begin" "$status"
    return "$status"
}

phase_start() {
    local name=$1 log
    shift
    log=$(mktemp "${TMPDIR:-/tmp}/phase.XXXXXX")
    printf '\n==> %s (in the background)\n' "$name"
    PHASES_BEGIN[$name]=$(date +%s)
    PHASES_LOG[$name]=$log
    # Its end is noted when it ends, not when it is awaited.
    ( status=0; "$@" || status=$?; date +%s > "$log.end"; exit "$status" ) > "$log" 2>&1 &
    PHASES_PID[$name]=$!
}

phase_wait() {
    local name=$1 status=0
    [ -n "${PHASES_PID[$name]:-}" ] || return 0
    wait "${PHASES_PID[$name]}" || status=$?
    printf '\n==> %s (background, finished)\n' "$name"
    cat "${PHASES_LOG[$name]}"
    _phase_row "$name" "${PHASES_BEGIN[$name]}" "$status" "background" \
        "$(cat "${PHASES_LOG[$name]}.end" 2>/dev/null || date +%s)"
    rm -f "${PHASES_LOG[$name]}" "${PHASES_LOG[$name]}.end"
    unset "PHASES_PID[$name]"
    return "$status"
}

phase_stop_background() {
    local name
    for name in "${!PHASES_PID[@]}"; do
        pkill -TERM -P "${PHASES_PID[$name]}" 2>/dev/null || true
        kill -TERM "${PHASES_PID[$name]}" 2>/dev/null || true
        wait "${PHASES_PID[$name]}" 2>/dev/null || true
        _phase_row "$name" "${PHASES_BEGIN[$name]}" "stopped" "background, stopped after a failure"
        rm -f "${PHASES_LOG[$name]}" "${PHASES_LOG[$name]}.end"
    done
}

phase_table() {
    local row name start wall status note total
    total=$(( $(date +%s) - PHASES_T0 ))
    printf '\n==> phases (wall times; background phases overlap the others)\n'
    printf '%-72s %8s %8s  %s\n' "phase" "start" "wall" "status"
    for row in "${PHASES_ROWS[@]}"; do
        IFS='|' read -r name start wall status note <<< "$row"
        printf '%-72s %7ss %4dm%02ds  %s%s\n' "$name" "$start" $(( wall / 60 )) $(( wall % 60 )) \
            "$(case "$status" in 0) echo ok ;; stopped) echo stopped ;; *) echo "FAILED ($status)" ;; esac)" "${note:+ ($note)}"
    done
    printf '%-72s %8s %4dm%02ds\n' "total" "" $(( total / 60 )) $(( total % 60 ))
}
