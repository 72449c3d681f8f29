#!/usr/bin/env bash
# Build sandcell's service images without a registry, from release binaries:
#   sandcell-scheduler:<version>      sandcell-scheduler and sandcell-admin
#   sandcell-worker:<version>         sandcell-worker
#   sandcell-sandbox-bundle:<version> the sandbox image as a tarball (/bundle/sandbox.tar) and a
#                                     static cp, for the worker pod's init container
# Each service image holds its binaries, the C libraries they link (glibc, libgcc), the CA
# certificates and a passwd entry for uid 10001: nothing else (no shell, no package manager).
# The worker pod's engine image is not built yet (docs/operations.md, "Status").
#
# Usage: deploy/images/build.sh [--save DIR]   (--save: also `docker save` each to DIR/<name>-<version>.tar)
# Env: SANDCELL_IMAGE_VERSION (default: the workspace's version from Cargo.toml).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
save=""
if [ "${1:-}" = "--save" ]; then save=${2:?--save needs a directory}; fi
version=${SANDCELL_IMAGE_VERSION:-$(awk -F'"' '/^\[workspace.package\]/ { p = 1 } p && /^version/ { print $2; exit }' "$repo/Cargo.toml")}
[ -n "$version" ] || { echo "build.sh: no version in Cargo.toml's [workspace.package]; set SANDCELL_IMAGE_VERSION" >&2; exit 1; }
log() { echo "images: $*" >&2; }

# A root filesystem with `binaries` in /usr/local/bin and what they need to run.
rootfs() {
    local root=$1 lib b
    shift
    mkdir -p "$root/usr/local/bin" "$root/etc/ssl/certs" "$root/tmp"
    chmod 1777 "$root/tmp"
    for b in "$@"; do
        install -m 0755 "$b" "$root/usr/local/bin/"
        # The shared libraries it links, at the paths the dynamic loader looks for them.
        for lib in $(ldd "$b" | awk '/=> \// { print $3 } /^[[:space:]]*\/[^ ]*ld-linux/ { print $1 }'); do
            cp -L --parents "$lib" "$root/"
        done
    done
    cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
    echo "sandcell:x:10001:10001:sandcell:/nonexistent:/nonexistent" >"$root/etc/passwd"
    echo "sandcell:x:10001:" >"$root/etc/group"
}

# Import `root` as image `tag`, running `entrypoint` as uid 10001.
import() {
    local root=$1 tag=$2 entrypoint=$3
    tar -C "$root" --numeric-owner --owner=0 --group=0 -c . | docker import \
        --change "USER 10001:10001" \
        --change "ENTRYPOINT [\"$entrypoint\"]" \
        --change "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" \
        --change "LABEL org.opencontainers.image.version=$version org.opencontainers.image.title=${tag%%:*}" \
        --message "sandcell ${tag%%:*} $version" - "$tag" >/dev/null
    log "$tag: $(docker image inspect --format '{{.Size}}' "$tag" | awk '{ printf "%.1f MB", $1 / 1e6 }')"
}

work=$(mktemp -d)
# apt's download user must reach the package it fetches (busybox below).
chmod 0755 "$work"
trap 'rm -rf "$work"' EXIT

log "release binaries"
(cd "$repo" && cargo build --release --bins -p sandcell-scheduler -p sandcell-worker -p sandcell-admin)
bin=$repo/target/release

rootfs "$work/scheduler" "$bin/sandcell-scheduler" "$bin/sandcell-admin"
import "$work/scheduler" "sandcell-scheduler:$version" /usr/local/bin/sandcell-scheduler
rootfs "$work/worker" "$bin/sandcell-worker"
import "$work/worker" "sandcell-worker:$version" /usr/local/bin/sandcell-worker

# The bundle: the sandbox image the stack built, tagged with this version, saved as a tarball,
# and busybox (Debian's static build) as /bin/cp to copy it out.
sandbox=$("$repo/sandbox/build-image.sh" | tail -n1)
docker tag "$sandbox" "sandcell-sandbox:$version"
mkdir -p "$work/bundle/bundle" "$work/bundle/bin" "$work/deb"
docker save "sandcell-sandbox:$version" -o "$work/bundle/bundle/sandbox.tar"
chmod 0644 "$work/bundle/bundle/sandbox.tar"
chmod 0777 "$work/deb"
(cd "$work/deb" && apt-get download busybox-static >/dev/null && dpkg-deb -x busybox-static_*.deb "$work/deb/x")
install -m 0755 "$work/deb/x/bin/busybox" "$work/bundle/bin/busybox"
ln -s busybox "$work/bundle/bin/cp"
import "$work/bundle" "sandcell-sandbox-bundle:$version" /bin/cp

if [ -n "$save" ]; then
    mkdir -p "$save"
    for name in sandcell-scheduler sandcell-worker sandcell-sandbox-bundle; do
        docker save "$name:$version" | gzip -1 >"$save/$name-$version.tar.gz"
        log "saved $save/$name-$version.tar.gz ($(du -h "$save/$name-$version.tar.gz" | cut -f1))"
    done
fi
