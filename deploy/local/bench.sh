#!/usr/bin/env bash
# The benchmark command (not a test): bring the local stack up, build release binaries, start
# a scheduler and a worker, and run sandcell-bench, which prints the figures and writes
# docs/benchmarks/{latest.json,README.md,latency.png}. Arguments are passed to sandcell-bench
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
