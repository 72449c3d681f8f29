# shellcheck shell=bash
# Sourced by demo.sh and test.sh: start and stop the sandcell binaries against the local stack.
#
# bring_up_stack                  runs up.sh and exports the env file's settings.
# start_sandcell BIN_DIR LOG_DIR  starts sandcell-scheduler and sandcell-worker in the
# background (pids in $SANDCELL_RUN_DIR) and waits until both /healthz answer 200.
# stop_sandcell                   stops them. Both are idempotent.

# cargo and garage live in ~/.cargo/bin (rustup); CI may start with a bare PATH.
export PATH="$PATH:${HOME:-/root}/.cargo/bin:/usr/sbin:/sbin"

SANDCELL_RUN_DIR=${SANDCELL_RUN_DIR:-${SANDCELL_STATE_DIR:-/var/lib/sandcell}/run}

# The repository root (this file lives in deploy/local/).
repo_root() { (cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd); }

# Install/start the local stack and export its connection settings.
bring_up_stack() {
    bash "$(repo_root)/deploy/local/up.sh"
    load_sandcell_env
}

load_sandcell_env() {
    local env_file="${SANDCELL_STATE_DIR:-/var/lib/sandcell}/sandcell.env"
    [ -f "$env_file" ] || { echo "missing $env_file: run deploy/local/up.sh" >&2; return 1; }
    set -a
    # shellcheck disable=SC1090
    . "$env_file"
    set +a
}

stop_sandcell() {
    local name pid
    for name in scheduler worker; do
        [ -f "$SANDCELL_RUN_DIR/$name.pid" ] || continue
        pid=$(cat "$SANDCELL_RUN_DIR/$name.pid")
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$SANDCELL_RUN_DIR/$name.pid"
    done
}

wait_healthy() {
    local name=$1 addr=$2 log=$3
    for _ in $(seq 300); do
        if curl -fsS "http://$addr/healthz" >/dev/null 2>&1; then return 0; fi
        if ! kill -0 "$(cat "$SANDCELL_RUN_DIR/$name.pid")" 2>/dev/null; then
            echo "sandcell-$name exited; last log lines:" >&2; tail -n 30 "$log" >&2; return 1
        fi
        sleep 0.2
    done
    echo "sandcell-$name did not become healthy on $addr; last log lines:" >&2
    tail -n 30 "$log" >&2
    return 1
}

start_sandcell() {
    local bin_dir=$1 log_dir=$2 name
    mkdir -p "$SANDCELL_RUN_DIR" "$log_dir"
    stop_sandcell
    for name in scheduler worker; do
        nohup "$bin_dir/sandcell-$name" >"$log_dir/$name.log" 2>&1 &
        echo $! >"$SANDCELL_RUN_DIR/$name.pid"
    done
    wait_healthy scheduler "${SANDCELL_SCHEDULER_METRICS_ADDR:-127.0.0.1:9464}" "$log_dir/scheduler.log"
    wait_healthy worker "${SANDCELL_WORKER_METRICS_ADDR:-127.0.0.1:9465}" "$log_dir/worker.log"
}
