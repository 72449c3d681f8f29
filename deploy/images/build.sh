#!/usr/bin/env bash
# Build sandcell's images without a registry, from release binaries:
#   sandcell-scheduler:<version>      sandcell-scheduler and sandcell-admin
#   sandcell-worker:<version>         sandcell-worker
#   sandcell-sandbox-bundle:<version> the sandbox image as a tarball (/bundle/sandbox.tar) and a
#                                     static cp, for the worker pod's init container
#   sandcell-engine:<version>         the worker pod's Docker engine: Debian's docker.io and
#                                     runsc, and deploy/images/engine/sandcell-engine
# Each service image holds its binaries, the C libraries they link (glibc, libgcc), the CA
# certificates and a passwd entry for uid 10001: nothing else (no shell, no package manager).
# The engine's Debian base is built once per package list (debootstrap from this machine's apt
# sources, sandbox/build-image.sh's debian_rootfs) and kept as sandcell-engine-base:<hash>.
#
# Usage: deploy/images/build.sh [--save DIR] [--profile release|debug] | --prune
#   --save DIR   also `docker save` each image to DIR/<name>-<version>.tar.gz
#   --profile    the cargo profile of the binaries (release; the test command's pod-fidelity
#                check uses debug, the binaries it has just built, to spare a release build)
#   --prune      only remove what earlier builds left untagged (prune_replaced below), and
#                exit; every build does it at its end too
# Env: SANDCELL_IMAGE_VERSION (default: the workspace's version from Cargo.toml).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

# The images earlier builds left untagged: each build imports every image anew under the same
# tag, and the one it replaces stays on disk, nameless (the bundle alone is ~750 MB: every run
# of the test command left ~0.9 GB behind, until a machine that ran it often had no disk left).
# Only sandcell's own (by the title label each carries); one a container still uses stays.
prune_replaced() {
    local name
    for name in sandcell-scheduler sandcell-worker sandcell-sandbox-bundle sandcell-engine; do
        docker image prune --force --filter "label=org.opencontainers.image.title=$name" >/dev/null ||
            echo "images: could not remove the untagged $name images of earlier builds" >&2
    done
}

save=""
profile=release
while [ $# -gt 0 ]; do
    case "$1" in
    --save) save=${2:?--save needs a directory}; shift 2 ;;
    --profile) profile=${2:?--profile needs release or debug}; shift 2 ;;
    --prune) prune_replaced; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (--save DIR, --profile release|debug, --prune)" >&2; exit 2 ;;
    esac
done
case "$profile" in release | debug) ;; *) echo "build.sh: --profile is release or debug, not $profile" >&2; exit 2 ;; esac
# debian_rootfs, import_rootfs, in_root, image_exists, sha12 and SUITE (defines only, runs nothing).
# shellcheck source=sandbox/build-image.sh
. "$repo/sandbox/build-image.sh"
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
    report_size "$tag"
}

report_size() { log "$1: $(docker image inspect --format '{{.Size}}' "$1" | awk '{ printf "%.1f MB", $1 / 1e6 }')"; }

work=$(mktemp -d)
# apt's download user must reach the package it fetches (busybox below).
chmod 0755 "$work"
trap 'rm -rf "$work"' EXIT

log "$profile binaries"
if [ "$profile" = release ]; then
    (cd "$repo" && cargo build --release --bins -p sandcell-scheduler -p sandcell-worker -p sandcell-admin)
else
    (cd "$repo" && cargo build --bins -p sandcell-scheduler -p sandcell-worker -p sandcell-admin)
fi
bin=$repo/target/$profile

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

# The engine: its Debian base, then the entrypoint on top with the legacy builder (no pull). The
# base is cached by the hash of everything that makes it (its package list, this recipe, the
# rootfs functions) and of the month: a privileged dockerd gets Debian's security updates at
# least monthly.
ENGINE_RECIPE_VERSION=1
engine_packages=$(grep -Ev '^[[:space:]]*(#|$)' "$here/engine/packages.txt" | tr '\n' ' ')
engine_base=$({
    echo "$engine_packages recipe=$ENGINE_RECIPE_VERSION suite=$SUITE month=$(date -u +%Y-%m)"
    declare -f debian_rootfs debian_install import_rootfs
} | sha12)
if image_exists "sandcell-engine-base:$engine_base"; then
    log "sandcell-engine-base:$engine_base exists"
else
    # In a subshell: debian_rootfs and import_rootfs set and clear their own exit trap, which
    # must not replace this script's (the removal of $work).
    (
        debian_rootfs "$BUILD_DIR/engine-rootfs"
        # shellcheck disable=SC2086
        debian_install "" $engine_packages
        import_rootfs "sandcell-engine-base:$engine_base" "sandcell engine base $SUITE recipe $ENGINE_RECIPE_VERSION"
    )
fi
mkdir -p "$work/engine"
cp "$here/engine/Dockerfile" "$work/engine/Dockerfile"
install -m 0755 "$here/engine/sandcell-engine" "$work/engine/sandcell-engine"
DOCKER_BUILDKIT=0 docker build --quiet --build-arg "BASE_TAG=$engine_base" \
    --label "org.opencontainers.image.version=$version" --label "org.opencontainers.image.title=sandcell-engine" \
    -t "sandcell-engine:$version" "$work/engine" >/dev/null
report_size "sandcell-engine:$version"
prune_replaced

if [ -n "$save" ]; then
    mkdir -p "$save"
    for name in sandcell-scheduler sandcell-worker sandcell-sandbox-bundle sandcell-engine; do
        docker save "$name:$version" | gzip -1 >"$save/$name-$version.tar.gz"
        log "saved $save/$name-$version.tar.gz ($(du -h "$save/$name-$version.tar.gz" | cut -f1))"
    done
fi
