# Sourced by scripts/run and scripts/test: runs a slow step in the background
# (its output in target/steps/NAME.log) and waits for it later, failing with
# its log when it failed.
mkdir -p target/steps
declare -A background_pids=()
declare -A background_began=()
# A step still running when the script ends early (a failed build) ends too.
trap 'for pid in "${background_pids[@]}"; do kill "$pid" 2>/dev/null || true; done' EXIT

# background NAME COMMAND...: starts COMMAND.
background() {
    local name="$1"
    shift
    echo "$name: started in the background (target/steps/$name.log)"
    "$@" >"target/steps/$name.log" 2>&1 &
    background_pids[$name]=$!
    background_began[$name]=$SECONDS
}

# background_idle NAME COMMAND...: starts COMMAND at idle priority
# (SCHED_IDLE, inherited by what it runs): it takes only CPU time that
# nothing else wants, so a step beside it runs as fast as alone.
background_idle() {
    local name="$1"
    shift
    background "$name" chrt --idle 0 "$@"
}

# timed NAME COMMAND...: runs COMMAND and says how long it took.
timed() {
    local name="$1" began=$SECONDS
    shift
    "$@"
    echo "$name: took $((SECONDS - began)) s"
}

# wait_for NAME: waits for it; on failure prints its log and exits.
wait_for() {
    local name="$1"
    if ! wait "${background_pids[$name]}"; then
        echo "$name failed:" >&2
        cat "target/steps/$name.log" >&2
        exit 1
    fi
    echo "$name: done, $((SECONDS - background_began[$name])) s after it started"
}
