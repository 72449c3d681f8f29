#!/usr/bin/env bash
# E2B's JS SDK smoke test (smoke.mjs) against the gateway at SANDCELL_GATEWAY_URL (default
# http://127.0.0.1:9480): installs the pinned SDK from npm into target/e2b-js (no lock file, so
# no registry is recorded), makes a tenant and an API key with SANDCELL_ADMIN_BIN (default
# target/debug/sandcell-admin; the stack's settings must be in the environment), and runs it
# with the SDK configured by environment variables alone.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
dir="$repo/target/e2b-js"
admin=${SANDCELL_ADMIN_BIN:-$repo/target/debug/sandcell-admin}
url=${SANDCELL_GATEWAY_URL:-http://127.0.0.1:9480}
mkdir -p "$dir"
if ! cmp -s "$here/package.json" "$dir/package.json" || [ ! -d "$dir/node_modules/@e2b/code-interpreter" ]; then
    cp "$here/package.json" "$dir/package.json"
    (cd "$dir" && npm install --no-package-lock --no-audit --no-fund --loglevel=error >/dev/null)
fi
cp "$here/smoke.mjs" "$dir/smoke.mjs"
tenant="js$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')"
"$admin" tenant create "$tenant" >/dev/null
key=$("$admin" key create "$tenant" | sed -n 's/^E2B_API_KEY=//p')
cd "$dir"
E2B_API_KEY=$key E2B_API_URL=$url E2B_SANDBOX_URL=$url E2B_DOMAIN=sandcell.localhost node smoke.mjs
