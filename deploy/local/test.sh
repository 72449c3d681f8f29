#!/usr/bin/env bash
# The test command: bring the local stack up (installing what is missing), build, start a
# scheduler and a worker, and run every test against the real services:
#   - Rust unit tests (pure logic) and end-to-end tests (tests/) with `cargo test --workspace`;
#   - the in-sandbox driver's tests, inside the real sandbox image;
#   - the Python SDK (clients/python): installed with pip from the package index the machine is
#     configured for, type-checked with mypy --strict, and its pytest suite run against the stack;
#   - the E2B-compatible gateway (gateway/): E2B's own Python SDK, pinned, run against it, and a
#     smoke test of its JS SDK (npm, pinned);
#   - style: `cargo fmt --check` and `cargo clippy -D warnings` (a failure fails the run), and
#     the client library's dependencies (no S3 SDK, no metrics server).
# The fleet suite (tests/fleet.rs, and tests/chaos.rs again) runs once, under runc, against 2
# schedulers and 3 workers. The Kubernetes deployment (deploy/kubernetes) is validated offline
# once, with the metrics it names checked against a live scrape of the binaries, and its
# scheduler and worker pods run on the local Docker as the manifests describe (pod fidelity).
# Every test runs under runc; the sandbox tests (driver and end-to-end, but chaos, capacity,
# fairness and egress) run again under runsc when gVisor is installed. Exits non-zero when anything fails.
# Logs of the binaries: target/test-logs/<runtime>/.
# Env: SANDCELL_STATE_DIR (default /var/lib/sandcell); CARGO_TEST_ARGS (extra args, e.g. a
# filter); SANDCELL_TEST_RUNTIMES (default: the stack's SANDCELL_DOCKER_RUNTIMES, e.g. runc,runsc);
# SANDCELL_TEST_DATABASE (default sandcell_test): the database the run creates afresh and uses.
set -euo pipefail
# shellcheck source=deploy/local/services.sh
. "$(dirname "$0")/services.sh"
repo=$(repo_root)
cd "$repo"
bring_up_stack

# Free disk, printed at each stage: a run that fills the disk fails everywhere at once (builds,
# pip, Docker), and this line says when and where the space went. Under ~8 GB free at the start
# the run is likely to run out (target/ grows to ~4 GB with the checks' virtualenvs, the stack
# and the images take ~3 GB).
docker_root=$(docker info --format '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)
disk_report() {
    local fs
    fs=$(df -h --output=target,avail "$repo" "$docker_root" 2>/dev/null | tail -n +2 | sort -u | awk '{ printf "%s %s free; ", $1, $2 }') || true
    echo "== disk ($1): ${fs}target/ $(du -sh "$repo/target" 2>/dev/null | cut -f1)"
}
# What earlier runs' image builds (the pod-fidelity check's) left untagged, ~0.9 GB a run.
bash deploy/images/build.sh --prune
disk_report start
if [ "$(df -k --output=avail "$repo" | tail -n1)" -lt $((8 * 1024 * 1024)) ]; then
    echo "== WARNING: under 8 GB free on $repo's filesystem: the run may run out of disk" >&2
fi

# A database of the run's own, dropped and created afresh: the stack's database may have been
# migrated by another checkout (a branch's newer migrations make this checkout's binaries refuse
# to start, by design), and no run should read an earlier run's rows. Roles are the cluster's,
# shared; the migrations create what they need in the new database.
test_db=${SANDCELL_TEST_DATABASE:-sandcell_test}
echo "== a fresh database for the run: $test_db"
runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -d postgres \
    -c "DROP DATABASE IF EXISTS \"$test_db\" WITH (FORCE)" -c "CREATE DATABASE \"$test_db\" OWNER sandcell"
# What no tenant login may execute there (deploy/postgres/lockdown.sql), as up.sh does in the
# stack's database: a superuser's step, per database.
runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -d "$test_db" -f - >/dev/null <"$repo/deploy/postgres/lockdown.sql"
export SANDCELL_DATABASE_URL="${SANDCELL_DATABASE_URL%/*}/$test_db"

# Test-friendly settings: a fast sweeper so TTL expiry is observable in seconds.
export SANDCELL_SWEEP_INTERVAL_S=1
export SANDCELL_WORKER_ID=test-worker
export SANDCELL_WORKER_SLOTS=${SANDCELL_WORKER_SLOTS:-4}
export SANDCELL_WORKER_BIN="$repo/target/debug/sandcell-worker"
export SANDCELL_LOG=${SANDCELL_LOG:-info,sandcell=debug}

# Egress by allowlist (tests/egress.rs): two tenants granted egress, each on a network of its
# own, through the proxy, which lets through only the index that test serves.
export SANDCELL_EGRESS_TEST_TENANTS=egress-a,egress-b
echo "== egress proxy for $SANDCELL_EGRESS_TEST_TENANTS"
SANDCELL_EGRESS_TENANTS=$SANDCELL_EGRESS_TEST_TENANTS SANDCELL_EGRESS_ALLOW=sandcell-test-index \
    bash deploy/local/egress.sh up
while IFS= read -r line; do export "${line?}"; done < <(SANDCELL_EGRESS_TENANTS=$SANDCELL_EGRESS_TEST_TENANTS bash deploy/local/egress.sh env)

failed=()
# Style is checked, not hoped for: rustfmt.toml's formatting, and clippy with warnings as errors.
echo "== style: cargo fmt --check, cargo clippy -D warnings"
cargo fmt --all -- --check || failed+=("cargo fmt --check (run cargo fmt --all)")
cargo clippy --workspace --all-targets --all-features -- -D warnings || failed+=("cargo clippy")
# The client library reads and publishes: it must not pull in the S3 SDK, the metrics server
# or the stores' write paths (sandcell-core without its `services` feature).
if cargo tree -p sandcell-client -e normal --prefix none | grep -E '^(aws-sdk-s3|prometheus|hyper) '; then
    failed+=("sandcell-client depends on a service-side crate (above)")
fi

echo "== building"
cargo build --workspace --bins --tests --features sandcell-tests/e2e
disk_report built

# The Python SDK as a user installs it (a fresh virtualenv each run), and its type check.
echo "== Python SDK: pip install ./clients/python[test], mypy --strict"
py_ok=1
rm -rf "$repo/target/py"
if python3 -m venv "$repo/target/py" && "$repo/target/py/bin/pip" install -q --disable-pip-version-check "$repo/clients/python[test]"; then
    (cd "$repo/clients/python" && "$repo/target/py/bin/mypy") || failed+=("mypy --strict on the Python SDK")
else
    py_ok=0
    failed+=("installing the Python SDK")
fi

# E2B's own SDK, unmodified and pinned, as an agent built on it installs it: the client of the
# gateway's tests (gateway/tests/e2b).
echo "== E2B SDK: pip install -r gateway/tests/e2b/requirements.txt"
e2b_ok=1
rm -rf "$repo/target/e2b-py"
if ! { python3 -m venv "$repo/target/e2b-py" &&
    "$repo/target/e2b-py/bin/pip" install -q --disable-pip-version-check -r "$repo/gateway/tests/e2b/requirements.txt"; }; then
    e2b_ok=0
    failed+=("installing the E2B SDK")
fi

trap stop_sandcell EXIT

# One pass: the worker (and the driver tests) under one OCI runtime. The first pass runs every
# test of the workspace; later passes only what touches a sandbox (driver and end-to-end tests).
run_pass() {
    local runtime=$1 scope=$2
    export SANDCELL_DOCKER_RUNTIME=$runtime
    # The chaos test kills and restarts the binaries: it finds their pid files and logs here.
    export SANDCELL_RUN_DIR SANDCELL_TEST_LOG_DIR="$repo/target/test-logs/$runtime"
    start_sandcell "$repo/target/debug" "$SANDCELL_TEST_LOG_DIR"
    echo "== [$runtime] scheduler and worker are up"

    echo "== [$runtime] driver tests inside $SANDCELL_SANDBOX_IMAGE"
    # As the worker starts a sandbox: root with only CAP_SETUID/CAP_SETGID (the driver's), its
    # seccomp profile, the workspace the sandbox user's alone, an init that reaps orphans and a bound on processes
    # (a test's cloning loop leaves an orphan per clone: unreaped, they once took every pid of
    # this machine, and a build running beside the tests failed to start threads).
    docker run --rm -i --init --pids-limit 4096 --runtime "$runtime" --network none --read-only --user 0:0 \
        --cap-drop ALL --cap-add SETUID --cap-add SETGID --security-opt no-new-privileges \
        --security-opt "seccomp=$repo/worker/src/sandbox/seccomp.json" \
        --tmpfs /tmp:rw,exec,size=256m,mode=1777 --tmpfs /home/user:rw,exec,size=256m,uid=1000,gid=1000,mode=0700 \
        -v "$repo/sandbox/driver/tests:/tests:ro" \
        -e SANDCELL_DRIVER=/opt/sandcell/driver.py "$SANDCELL_SANDBOX_IMAGE" \
        python3 -m unittest discover -s /tests -v || failed+=("driver tests under $runtime")

    echo "== [$runtime] cargo test ($scope)"
    # Always the whole workspace, with a later pass's tests picked by --test: a narrower
    # selection (`-p sandcell-tests`) unifies the dependencies' features differently, and cargo
    # would build tokio, sqlx and the rest a second time (~1 GB of target/, minutes of the run).
    local packages=(--workspace) t
    if [ "$scope" != all ]; then
        # Every end-to-end test again, but chaos, capacity, fairness and fleet: they prove the
        # fleet's recovery, placement and dispatch order, which do not depend on the OCI runtime
        # (and take minutes; fleet needs a fleet of its own, started once, under runc); and
        # egress: the local stack registers runsc with --network=none, so a gVisor sandbox has no
        # network even when its tenant is granted one.
        for t in tests/*.rs; do
            case "$(basename "$t" .rs)" in build | chaos | capacity | fairness | egress | fleet) ;; *) packages+=(--test "$(basename "$t" .rs)") ;; esac
        done
    fi
    # shellcheck disable=SC2086
    cargo test "${packages[@]}" --features sandcell-tests/e2e --no-fail-fast ${CARGO_TEST_ARGS:-} || failed+=("cargo tests under $runtime")
    # The SDK is a client: what it proves does not depend on the OCI runtime.
    if [ "$scope" = all ] && [ "$py_ok" = 1 ]; then
        echo "== [$runtime] Python SDK tests (pytest clients/python)"
        (cd "$repo/clients/python" && SANDCELL_ADMIN_BIN="$repo/target/debug/sandcell-admin" "$repo/target/py/bin/pytest" -q) \
            || failed+=("Python SDK tests under $runtime")
    fi
    # The E2B-compatible gateway, driven by E2B's SDK through environment variables alone. A
    # client too: what it proves does not depend on the OCI runtime.
    if [ "$scope" = all ] && [ "$e2b_ok" = 1 ]; then
        echo "== [$runtime] E2B SDK against the gateway (pytest gateway/tests/e2b)"
        (cd "$repo/gateway/tests/e2b" && SANDCELL_ADMIN_BIN="$repo/target/debug/sandcell-admin" \
            SANDCELL_GATEWAY_URL="http://${SANDCELL_GATEWAY_ADDR:-127.0.0.1:9480}" "$repo/target/e2b-py/bin/pytest" -q) \
            || failed+=("E2B SDK tests under $runtime")
    fi
    if [ "$scope" = all ]; then
        echo "== [$runtime] E2B JS SDK smoke test against the gateway (gateway/tests/e2b-js)"
        SANDCELL_ADMIN_BIN="$repo/target/debug/sandcell-admin" SANDCELL_GATEWAY_URL="http://${SANDCELL_GATEWAY_ADDR:-127.0.0.1:9480}" \
            bash gateway/tests/e2b-js/run.sh || failed+=("E2B JS SDK smoke test under $runtime")
    fi
    # The Kubernetes deployment, validated offline, and every metric its alerts, dashboard and
    # autoscaler name found in a live scrape of the binaries that just ran the suite.
    if [ "$scope" = all ]; then
        echo "== Kubernetes manifests: schemas, CRDs, promtool, live metric names"
        local scrapes="$repo/target/k8s-validate/scrapes"
        mkdir -p "$scrapes"
        if curl -fsS http://127.0.0.1:9464/metrics >"$scrapes/scheduler.prom" && curl -fsS http://127.0.0.1:9465/metrics >"$scrapes/worker.prom"; then
            bash deploy/kubernetes/validate/run.sh --scrape "$scrapes/scheduler.prom" "$scrapes/worker.prom" || failed+=("Kubernetes manifests")
        else
            failed+=("scraping the binaries' /metrics for the Kubernetes manifests' check")
        fi
    fi
    stop_sandcell
    # Pod fidelity (deploy/kubernetes/validate/pod.py): the images built (the binaries just built,
    # debug, to spare a release build), then the scheduler and worker pods of the manifests run on
    # the local Docker as they describe: a job through them, and a SIGTERM that drains.
    if [ "$scope" = all ]; then
        echo "== Kubernetes pod fidelity: images, then the scheduler and worker pods as the manifests say"
        if [ "$py_ok" = 1 ] && bash deploy/images/build.sh --profile debug &&
            "$repo/target/py/bin/pip" install -q --disable-pip-version-check PyYAML==6.0.2; then
            SANDCELL_ADMIN_BIN="$repo/target/debug/sandcell-admin" "$repo/target/py/bin/python" deploy/kubernetes/validate/pod.py \
                || failed+=("Kubernetes pod fidelity")
        else
            failed+=("building the images (or the SDK) for the pod-fidelity check")
        fi
    fi
    # The fleet: 2 schedulers and 3 workers at once (what it proves does not depend on the OCI runtime).
    if [ "$scope" = all ]; then
        echo "== [$runtime] fleet tests: 2 schedulers, 3 workers"
        # A killed worker's sessions move once it has been silent this long (default 30 s).
        SANDCELL_WORKER_DEAD_AFTER_S=12 SANDCELL_SCHEDULERS=2 SANDCELL_WORKERS=3 start_sandcell "$repo/target/debug" "$SANDCELL_TEST_LOG_DIR/fleet"
        # shellcheck disable=SC2086
        # The chaos run again, now over the fleet: a worker, a scheduler, a sandbox killed, the
        # broker and the database restarted, while sessions move.
        SANDCELL_WORKER_DEAD_AFTER_S=12 cargo test --workspace --features sandcell-tests/e2e,sandcell-tests/fleet --test fleet --test chaos --no-fail-fast ${CARGO_TEST_ARGS:-} -- --test-threads=1 || failed+=("fleet tests under $runtime")
        stop_sandcell
    fi
}

# SANDCELL_TEST_RUNTIMES: which runtimes to test (default: every one the stack registered, i.e.
# runc, plus runsc when gVisor is installed).
runtimes=${SANDCELL_TEST_RUNTIMES:-${SANDCELL_DOCKER_RUNTIMES:-runc}}
scope=all
for runtime in ${runtimes//,/ }; do
    run_pass "$runtime" "$scope"
    disk_report "after the $runtime pass"
    scope=sandbox
done

if [ ${#failed[@]} -gt 0 ]; then
    printf '== FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "== all tests passed under: $runtimes"
