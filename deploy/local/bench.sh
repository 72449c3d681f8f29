#!/usr/bin/env bash
# The benchmark command (not a test): bring the local stack up, build release binaries, start
# a scheduler and a worker, and run sandcell-bench, which prints the figures and writes
# docs/benchmarks/{latest.json,README.md,latency.png}; then the fleet figures with 2 schedulers
# and 1, 2 and 3 workers (docs/benchmarks/fleet.{json,md}). Arguments are passed to sandcell-bench
# (e.g. --in-session-jobs 200). The binaries are stopped at the end.
# Env: SANDCELL_STATE_DIR (default /var/lib/sandcell); SANDCELL_LOG (default warn: per-job info
# logging is part of what is measured otherwise).
set -euo pipefail
# shellcheck source=deploy/local/services.sh
. "$(dirname "$0")/services.sh"
repo=$(repo_root)
cd "$repo"
bring_up_stack

echo "== building release binaries"
cargo build --release --bins

# The Python SDK's figures: the SDK installed as a user installs it (into target/py-bench).
echo "== installing the Python SDK for its figures"
if python3 -m venv "$repo/target/py-bench" && "$repo/target/py-bench/bin/pip" install -q --disable-pip-version-check "$repo/clients/python"; then
    export SANDCELL_BENCH_PYTHON="$repo/target/py-bench/bin/python"
else
    echo "bench.sh: the Python SDK could not be installed; its figures are left out" >&2
fi

export SANDCELL_LOG=${SANDCELL_LOG:-warn}
export SANDCELL_WORKER_ID=${SANDCELL_WORKER_ID:-bench-worker}
trap stop_sandcell EXIT
start_sandcell "$repo/target/release" "$repo/target/bench-logs"
SANDCELL_SCHEDULER_PID=$(cat "$SANDCELL_RUN_DIR/scheduler.pid")
SANDCELL_WORKER_PID=$(cat "$SANDCELL_RUN_DIR/worker.pid")
SANDCELL_GIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
SANDCELL_MACHINE="$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(. /etc/os-release && echo "$PRETTY_NAME"), docker $(docker version --format '{{.Server.Version}}')"
export SANDCELL_SCHEDULER_PID SANDCELL_WORKER_PID SANDCELL_GIT_COMMIT SANDCELL_MACHINE
echo "== running sandcell-bench"
"$repo/target/release/sandcell-bench" "$@"

# The fleet figures (docs/benchmarks/fleet.md): 2 schedulers and 1, 2, then 3 workers, one after
# another on this box. SANDCELL_BENCH_FLEET=0 leaves them out.
if [ "${SANDCELL_BENCH_FLEET:-1}" != 0 ]; then
    rm -f "$repo/docs/benchmarks/fleet.json"
    # Room for the burst of 50 new sessions on one worker too.
    export SANDCELL_WORKER_MAX_SESSIONS=${SANDCELL_WORKER_MAX_SESSIONS:-64}
    for workers in 1 2 3; do
        echo "== fleet: 2 schedulers, $workers worker(s)"
        SANDCELL_SCHEDULERS=2 SANDCELL_WORKERS=$workers start_sandcell "$repo/target/release" "$repo/target/bench-logs/fleet-$workers"
        "$repo/target/release/sandcell-bench" --fleet "$workers" --fleet-schedulers 2
    done
fi
