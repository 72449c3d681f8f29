# shellcheck shell=bash
# Sourced by demo.sh and test.sh: start and stop the sandcell binaries against the local stack.
#
# bring_up_stack                  runs up.sh and exports the env file's settings.
# start_sandcell BIN_DIR LOG_DIR  starts $SANDCELL_SCHEDULERS schedulers and $SANDCELL_WORKERS
# workers (default 1 each), and $SANDCELL_GATEWAYS E2B-compatible gateways (default 1; on
# SANDCELL_GATEWAY_ADDR, default 127.0.0.1:9480), in the background and waits until every
# /healthz answers 200.
# stop_sandcell                   stops them (SIGTERM, then SIGKILL after 5 s). Both are idempotent.
#
# A fleet on one box: instance k (1-based) of a binary is named `scheduler` / `worker` for k = 1
# and `scheduler-k` / `worker-k` after; its metrics port is the configured one (9464 scheduler,
# 9465 worker) plus 10·(k-1), and worker k > 1 has the id `<SANDCELL_WORKER_ID or hostname>-k`.
# Each instance gets, in $SANDCELL_RUN_DIR, `<name>.cmd` (its launcher: the instance's own
# settings, then the binary, logging to LOG_DIR/<name>.log) and `<name>.pid`; a supervisor — or a
# test — restarts an instance by running its launcher again.

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
    local f pid pids=()
    # Every instance at once (a worker drains for up to its grace), then whatever is left.
    for f in "$SANDCELL_RUN_DIR"/scheduler*.pid "$SANDCELL_RUN_DIR"/worker*.pid "$SANDCELL_RUN_DIR"/gateway*.pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
        rm -f "$f" "${f%.pid}.cmd"
    done
    for _ in $(seq 50); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 1 ] || break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
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

# The metrics address of instance k: the base address's port plus 10·(k-1).
instance_addr() {
    local base=$1 k=$2
    echo "${base%:*}:$((${base##*:} + 10 * (k - 1)))"
}

# Write instance k of `kind` (scheduler|worker|gateway)'s launcher and start it; prints "name addr".
start_instance() {
    local kind=$1 k=$2 bin_dir=$3 log_dir=$4 name=$1 addr id
    [ "$k" = 1 ] || name="$kind-$k"
    local cmd="$SANDCELL_RUN_DIR/$name.cmd" log="$log_dir/$name.log"
    {
        echo "#!/usr/bin/env bash"
        echo "# sandcell $name: written by deploy/local/services.sh start_sandcell"
        if [ "$kind" = scheduler ]; then
            addr=$(instance_addr "${SANDCELL_SCHEDULER_METRICS_ADDR:-127.0.0.1:9464}" "$k")
            echo "export SANDCELL_SCHEDULER_METRICS_ADDR=$addr"
        elif [ "$kind" = gateway ]; then
            addr=$(instance_addr "${SANDCELL_GATEWAY_ADDR:-127.0.0.1:9480}" "$k")
            echo "export SANDCELL_GATEWAY_ADDR=$addr"
        else
            addr=$(instance_addr "${SANDCELL_WORKER_METRICS_ADDR:-127.0.0.1:9465}" "$k")
            echo "export SANDCELL_WORKER_METRICS_ADDR=$addr"
            if [ "$k" != 1 ]; then
                id="${SANDCELL_WORKER_ID:-$(hostname)}-$k"
                echo "export SANDCELL_WORKER_ID=$id"
            fi
        fi
        echo "exec $(printf '%q' "$bin_dir/sandcell-$kind") >>$(printf '%q' "$log") 2>&1"
    } >"$cmd"
    : >"$log"
    nohup bash "$cmd" >/dev/null 2>&1 &
    echo $! >"$SANDCELL_RUN_DIR/$name.pid"
    echo "$name $addr"
}

start_sandcell() {
    local bin_dir=$1 log_dir=$2 k name addr started=()
    mkdir -p "$SANDCELL_RUN_DIR" "$log_dir"
    stop_sandcell
    for k in $(seq "${SANDCELL_SCHEDULERS:-1}"); do started+=("$(start_instance scheduler "$k" "$bin_dir" "$log_dir")"); done
    for k in $(seq "${SANDCELL_WORKERS:-1}"); do started+=("$(start_instance worker "$k" "$bin_dir" "$log_dir")"); done
    for k in $(seq "${SANDCELL_GATEWAYS:-1}"); do started+=("$(start_instance gateway "$k" "$bin_dir" "$log_dir")"); done
    for k in "${started[@]}"; do
        read -r name addr <<<"$k"
        wait_healthy "$name" "$addr" "$log_dir/$name.log"
    done
}
