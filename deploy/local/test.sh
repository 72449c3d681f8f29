#!/usr/bin/env bash
# The test command: bring the local stack up (installing what is missing), build, start a
# scheduler and a worker, and run every test against the real services:
#   - Rust unit tests (pure logic) and end-to-end tests (tests/) with `cargo test --workspace`;
#   - the in-sandbox driver's tests, inside the real sandbox image.
# Exits non-zero when anything fails. Logs of the binaries: target/test-logs/.
# Env: SANDCELL_STATE_DIR (default /var/lib/sandcell); CARGO_TEST_ARGS (extra args, e.g. a filter).
set -euo pipefail
# shellcheck source=deploy/local/services.sh
. "$(dirname "$0")/services.sh"
repo=$(repo_root)
cd "$repo"
bring_up_stack

# Test-friendly settings: a fast sweeper so TTL expiry is observable in seconds.
export SANDCELL_SWEEP_INTERVAL_S=1
export SANDCELL_WORKER_ID=test-worker
export SANDCELL_WORKER_SLOTS=${SANDCELL_WORKER_SLOTS:-4}
export SANDCELL_WORKER_BIN="$repo/target/debug/sandcell-worker"
export SANDCELL_LOG=${SANDCELL_LOG:-info,sandcell=debug}

echo "== building"
cargo build --workspace --bins --tests

trap stop_sandcell EXIT
start_sandcell "$repo/target/debug" "$repo/target/test-logs"
echo "== scheduler and worker are up"

echo "== driver tests inside $SANDCELL_SANDBOX_IMAGE"
docker run --rm -i --network none --read-only --user 1000:1000 \
    --tmpfs /tmp:rw,exec,size=256m --tmpfs /home/user:rw,exec,size=256m,uid=1000,gid=1000 \
    -e SANDCELL_DRIVER=/opt/sandcell/driver.py "$SANDCELL_SANDBOX_IMAGE" \
    python3 - <sandbox/driver/test_driver.py

echo "== cargo test"
# shellcheck disable=SC2086
cargo test --workspace --no-fail-fast ${CARGO_TEST_ARGS:-}
