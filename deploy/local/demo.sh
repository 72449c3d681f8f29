#!/usr/bin/env bash
# The main job end to end on the local stack: bring the stack up (installing what is missing),
# build, start a scheduler and a worker, submit the example (examples/spend_by_category.py on
# examples/transactions.csv: pandas group-by-sum and a matplotlib bar chart saved as PNG),
# then print the result and the chart's download URL. The binaries are stopped at the end.
# Env: SANDCELL_STATE_DIR (default /var/lib/sandcell), SANDCELL_TENANT (default demo).
set -euo pipefail
# shellcheck source=deploy/local/services.sh
. "$(dirname "$0")/services.sh"
repo=$(repo_root)
cd "$repo"
bring_up_stack

echo "== building"
cargo build --workspace --bins
trap stop_sandcell EXIT
start_sandcell "$repo/target/debug" "$repo/target/demo-logs"

tenant=${SANDCELL_TENANT:-demo}
job_id="demo-$(date +%s)-$$"
echo "== submitting job $job_id for tenant $tenant"
status=0
"$repo/target/debug/sandcell" run --tenant "$tenant" --job-id "$job_id" \
    --code-file examples/spend_by_category.py --file examples/transactions.csv \
    >"$repo/target/demo-result.json" || status=$?
cat "$repo/target/demo-result.json"
echo
echo "== chart download URL (valid until the artifact expires):"
"$repo/target/debug/sandcell" artifact-url --tenant "$tenant" "$job_id" spend_by_category.png
exit "$status"
