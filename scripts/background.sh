# Sourced by scripts/run and scripts/test: runs a slow step in the background
# (its output in target/steps/NAME.log) and waits for it later, failing with
# its log when it failed.
mkdir -p target/steps
declare -A background_pids=()
# A step still running when the script ends early (a failed build) ends too.
trap 'for pid in "${background_pids[@]}"; do kill "$pid" 2>/dev/null || true; done' EXIT

# background NAME COMMAND...: starts COMMAND.
background() {
    local name="$1"
    shift
    echo "$name: started in the background (target/steps/$name.log)"
    "$@" >"target/steps/$name.log" 2>&1 &
    background_pids[$name]=$!
}

# wait_for NAME: waits for it; on failure prints its log and exits.
wait_for() {
    local name="$1"
    if ! wait "${background_pids[$name]}"; then
        echo "$name failed:" >&2
        cat "target/steps/$name.log" >&2
        exit 1
    fi
    echo "$name: done"
}
