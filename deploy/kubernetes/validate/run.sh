#!/usr/bin/env bash
# Validate deploy/kubernetes offline (validate.py says what is checked). The validators are set
# up once under target/k8s-validate: kubernetes-validate (PyPI, pinned), the CRD schemas of KEDA
# and the Prometheus operator (npm, pinned in package.json; no lock file, so no registry is
# recorded), and promtool unpacked from Debian's prometheus package (the server is not installed).
# Arguments go to validate.py, e.g. --scrape scheduler.prom worker.prom.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
dir="$repo/target/k8s-validate"
mkdir -p "$dir"
if ! "$dir/venv/bin/python" -c "import kubernetes_validate, yaml" 2>/dev/null; then
    python3 -m venv "$dir/venv"
    "$dir/venv/bin/pip" install -q --disable-pip-version-check kubernetes-validate==1.37.0 PyYAML==6.0.2
fi
if ! cmp -s "$here/package.json" "$dir/package.json" || [ ! -d "$dir/node_modules/@kubernetes-models/keda" ]; then
    cp "$here/package.json" "$dir/package.json"
    (cd "$dir" && npm install --no-package-lock --no-audit --no-fund --loglevel=error >/dev/null)
fi
if [ ! -x "$dir/prometheus/usr/bin/promtool" ]; then
    # apt's download user must be able to write where the package lands.
    deb=$(mktemp -d)
    chmod 0777 "$deb"
    (cd "$deb" && apt-get download prometheus >/dev/null && dpkg-deb -x prometheus_*.deb "$dir/prometheus")
    rm -rf "$deb"
fi
SANDCELL_CRD_NODE_MODULES="$dir/node_modules" exec "$dir/venv/bin/python" "$here/validate.py" --promtool "$dir/prometheus/usr/bin/promtool" "$@"
