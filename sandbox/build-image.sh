#!/usr/bin/env bash
# build-image.sh: build the sandcell sandbox image without any container registry.
#
#   1. base layer  sandcell-sandbox-base:<basehash>
#      debootstrap --variant=minbase trixie (SANDBOX_SUITE), then Debian packages from
#      sandbox/image/packages.txt, user `user` (1000:1000), then `docker import`.
#      basehash = sha256(packages.txt + BASE_RECIPE_VERSION + STUB_PACKAGES + SANDBOX_SUITE),
#      first 12 hex.
#   2. top layer   sandcell-sandbox:<version>
#      `docker build` (legacy builder, no pull) of sandbox/image/Dockerfile with
#      sandbox/driver/*.py copied to /opt/sandcell/.
#      version = sha256(basehash + Dockerfile + driver/*.py), first 12 hex.
# A layer whose tag already exists is skipped, so a second run takes about a second.
#
# Usage: sandbox/build-image.sh [--print-tag]
#   Progress goes to stderr; the last line on stdout is the final image tag.
#   --print-tag only computes and prints the tag (builds nothing).
#
# Environment (defaults):
#   SANDCELL_DEBIAN_MIRROR  Debian archive to debootstrap from (default: this machine's apt
#                           source for the suite, else the one for the machine's own suite:
#                           a Debian archive carries every suite)
#   SANDCELL_BUILD_DIR      scratch dir for the rootfs (/var/tmp/sandcell-image-build)
#   SANDCELL_LOG_DIR        where the debootstrap/apt log goes (/var/log/sandcell)
set -euo pipefail

# Bump when the base-building steps below change, to force a new base layer.
BASE_RECIPE_VERSION=4
# matplotlib's font list, built once in the base (sandcell_kernel.MPL_FONT_CACHE reads it).
MPL_FONT_CACHE=/usr/local/share/sandcell/matplotlib
# The engine image's suite (deploy/images/build.sh): that of the hosts it is built for.
SUITE=bookworm
# The sandbox's suite: Debian 13, for its Python 3.13. From 3.12 on, CPython leaves the
# reference counts of immortal objects unwritten, and the kernel makes the zygote's objects
# immortal before it forks jobs (sandcell_kernel.immortalize): a fresh job's process then
# no longer copies every page holding an object it only reads (ARCHITECTURE.md, one-off jobs).
SANDBOX_SUITE=trixie
# Debian's python3-scipy hard-depends on python3-pythran, a build-time compiler
# that drags gcc, g++, boost and BLAS headers (~530 MB) into the image. scipy
# never imports it at run time, so an empty stand-in package satisfies apt.
STUB_PACKAGES="python3-pythran"

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PACKAGES_FILE=$HERE/image/packages.txt
DOCKERFILE=$HERE/image/Dockerfile
DRIVER_DIR=$HERE/driver
BUILD_DIR=${SANDCELL_BUILD_DIR:-/var/tmp/sandcell-image-build}
LOG_DIR=${SANDCELL_LOG_DIR:-/var/log/sandcell}

log() { echo "build-image: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

sha12() { sha256sum | cut -c1-12; }

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

base_hash() {
    {
        cat "$PACKAGES_FILE"
        echo "BASE_RECIPE_VERSION=$BASE_RECIPE_VERSION"
        echo "STUB_PACKAGES=$STUB_PACKAGES"
        echo "SANDBOX_SUITE=$SANDBOX_SUITE"
    } | sha12
}

driver_files() {
    # Sorted so the hash does not depend on directory order.
    find "$DRIVER_DIR" -maxdepth 1 -type f -name '*.py' | LC_ALL=C sort
}

image_version() {
    local f files
    mapfile -t files < <(driver_files)
    {
        echo "base=$1"
        cat "$DOCKERFILE"
        for f in "${files[@]}"; do echo "== ${f##*/}"; cat "$f"; done
    } | sha12
}

# First URI of an enabled deb822 or one-line apt source carrying $1 as suite.
mirror_for_suite() {
    local suite=$1 m
    m=$(awk -v s="$suite" 'BEGIN { RS = "" }
            /(^|\n)Enabled: *no/ { next }
            { uri = ""; ok = 0
              n = split($0, L, "\n")
              for (i = 1; i <= n; i++) {
                  if (L[i] ~ /^URIs:/)   { split(L[i], f, " "); uri = f[2] }
                  if (L[i] ~ /^Suites:/) { k = split(L[i], f, " "); for (j = 2; j <= k; j++) if (f[j] == s) ok = 1 }
              }
              if (ok && uri != "") { print uri; exit } }' \
        /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    if [ -z "$m" ]; then
        m=$(awk -v s="$suite" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:/ && $(i + 1) == s) { print $i; exit } }' \
            /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n1 || true)
    fi
    echo "$m"
}

# This machine's own Debian suite (its /etc/os-release), e.g. bookworm.
host_suite() {
    (. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
}

# The archive URI for suite $1: this machine's source for it, else its source for the suite
# of the same kind (main or -security) of the machine's own release. A Debian archive
# carries every suite, so the host's configured archive serves another release too.
archive_for_suite() {
    local suite=$1 m host kind=""
    m=$(mirror_for_suite "$suite")
    if [ -z "$m" ]; then
        host=$(host_suite)
        case $suite in *-security) kind=-security ;; esac
        [ -n "$host" ] && m=$(mirror_for_suite "$host$kind")
    fi
    echo "$m"
}

# Run a command inside the rootfs with a clean environment (the host's PATH and
# Python variables must not leak into package scripts).
in_root() {
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 \
        DEBIAN_FRONTEND=noninteractive chroot "$ROOT" "$@"
}

# Install an empty package named $1 (see STUB_PACKAGES) and hold it.
install_stub() {
    local p=$1 d=$ROOT/tmp/stub-$1
    mkdir -p "$d/DEBIAN"
    cat >"$d/DEBIAN/control" <<EOF
Package: $p
Version: 0~sandcell1
Architecture: all
Maintainer: sandcell <root@localhost>
Description: empty stand-in for $p (not needed at run time in the sandbox)
EOF
    in_root dpkg-deb --build "/tmp/stub-$p" "/tmp/stub-$p.deb"
    in_root dpkg -i "/tmp/stub-$p.deb"
    in_root apt-mark hold "$p"
}

cleanup_mounts() {
    if [ -n "${ROOT:-}" ] && mountpoint -q "$ROOT/proc"; then umount "$ROOT/proc" || true; fi
}

# A Debian root filesystem of suite $2 (default $SUITE) in directory $1 (set as ROOT), from
# this machine's own apt sources, ready for in_root: /proc mounted, docs excluded, no service
# may start. Used for the sandbox's base and for the worker pod's engine image
# (deploy/images/build.sh).
debian_rootfs() {
    local mirror security suite=${2:-$SUITE}
    # Package sources are the machine's own (its apt configuration), never a host named here.
    mirror=${SANDCELL_DEBIAN_MIRROR:-$(archive_for_suite "$suite")}
    [ -n "$mirror" ] || die "no Debian archive in this machine's apt configuration; set SANDCELL_DEBIAN_MIRROR"
    security=$(archive_for_suite "$suite-security")
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"

    ROOT=$1
    trap cleanup_mounts EXIT
    cleanup_mounts
    # A leftover rootfs is from an interrupted build: start over.
    rm -rf "$ROOT"
    mkdir -p "$ROOT" "$LOG_DIR"
    BUILD_LOG=$LOG_DIR/image-build.log
    log "debootstrap $suite from $mirror into $ROOT (log: $BUILD_LOG)"
    debootstrap --variant=minbase "$suite" "$ROOT" "$mirror" >>"$BUILD_LOG" 2>&1 \
        || die "debootstrap failed, see $BUILD_LOG"

    # Updates and security fixes, from the same mirrors the host uses.
    {
        echo "deb $mirror $suite main"
        echo "deb $mirror $suite-updates main"
        if [ -n "$security" ]; then echo "deb $security $suite-security main"; fi
    } >"$ROOT/etc/apt/sources.list"
    [ -n "$security" ] || log "no $suite-security source in this machine's apt configuration: the image gets no security updates"
    # Keep docs and man pages out of the image (they are never read in a container).
    cat >"$ROOT/etc/dpkg/dpkg.cfg.d/01-sandcell-nodoc" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
EOF
    # No service may start inside the chroot.
    printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
    chmod 0755 "$ROOT/usr/sbin/policy-rc.d"
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    mount -t proc proc "$ROOT/proc"
}

# Bring ROOT's packages up to date, install the stand-ins named in $1 (STUB_PACKAGES), then the
# packages given after it.
debian_install() {
    local stubs=$1 p
    shift
    log "installing in rootfs: $*"
    {
        in_root apt-get update
        in_root apt-get -y --no-install-recommends dist-upgrade
        for p in $stubs; do install_stub "$p"; done
        in_root apt-get install -y --no-install-recommends "$@"
    } >>"$BUILD_LOG" 2>&1 || die "apt-get in rootfs failed, see $BUILD_LOG"
}

# Trim ROOT of what an image never needs, then import it as image $1 (commit message $2).
import_rootfs() {
    local tag=$1 message=$2
    in_root apt-get clean
    rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin \
        "$ROOT"/var/cache/debconf/*-old "$ROOT"/var/log/*.log "$ROOT"/var/log/apt/* \
        "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* "$ROOT"/tmp/* \
        "$ROOT/usr/sbin/policy-rc.d"
    find "$ROOT/usr/share/doc" -mindepth 1 ! -name copyright ! -type d -delete 2>/dev/null || true
    : >"$ROOT/etc/resolv.conf"
    cleanup_mounts
    trap - EXIT

    log "importing rootfs as $tag"
    # /dev, /proc and /sys are provided by the runtime; do not ship their content.
    tar -C "$ROOT" --numeric-owner --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* -c . \
        | docker import --message "$message" - "$tag" >/dev/null
    rm -rf "$ROOT"
}

build_base() {
    local tag=$1
    debian_rootfs "$BUILD_DIR/rootfs" "$SANDBOX_SUITE"

    local pkgs
    pkgs=$(grep -Ev '^[[:space:]]*(#|$)' "$PACKAGES_FILE" | tr '\n' ' ')
    # shellcheck disable=SC2086
    debian_install "$STUB_PACKAGES" $pkgs

    in_root groupadd --gid 1000 user
    in_root useradd --uid 1000 --gid 1000 --create-home --home-dir /home/user --shell /bin/bash user

    # Smoke test: every library imports (fails the build early, not at first use). It leaves
    # matplotlib's font list in $MPL_FONT_CACHE, which the kernel copies into its own (empty)
    # MPLCONFIGDIR at start: without it, every sandbox's first matplotlib import scans the
    # image's ~360 font files (reportlab brings the URW base 35), 250-440 ms on a 2-core VM.
    in_root env MPLCONFIGDIR="$MPL_FONT_CACHE" MPLBACKEND=Agg python3 -c \
        'import IPython, numpy, pandas, scipy.optimize, matplotlib.pyplot, reportlab, openpyxl' \
        >>"$BUILD_LOG" 2>&1 || die "import smoke test failed, see $BUILD_LOG"
    in_root sh -c "ls $MPL_FONT_CACHE/fontlist-*.json >/dev/null && chmod -R a+rX $MPL_FONT_CACHE" \
        || die "matplotlib left no font list in $MPL_FONT_CACHE"

    import_rootfs "$tag" "sandcell base $SANDBOX_SUITE recipe $BASE_RECIPE_VERSION"
}

build_top() {
    local basehash=$1 tag=$2 ctx f files
    mapfile -t files < <(driver_files)
    ctx=$(mktemp -d)
    # Small private build context: never send the repository (target/ is huge).
    mkdir "$ctx/driver"
    cp "$DOCKERFILE" "$ctx/Dockerfile"
    for f in "${files[@]}"; do install -m 0644 "$f" "$ctx/driver/"; done
    log "building $tag"
    if ! DOCKER_BUILDKIT=0 docker build --quiet --build-arg "BASE_TAG=$basehash" \
        --label "org.sandcell.base=$basehash" -t "$tag" "$ctx" >&2; then
        rm -rf "$ctx"
        die "docker build failed"
    fi
    rm -rf "$ctx"
}

main() {
    [ -f "$PACKAGES_FILE" ] || die "missing $PACKAGES_FILE"
    [ -f "$DRIVER_DIR/driver.py" ] || die "missing $DRIVER_DIR/driver.py"
    local basehash version base_tag tag
    basehash=$(base_hash)
    version=$(image_version "$basehash")
    base_tag=sandcell-sandbox-base:$basehash
    tag=sandcell-sandbox:$version
    if [ "${1:-}" = "--print-tag" ]; then echo "$tag"; return; fi

    docker info >/dev/null 2>&1 || die "docker daemon not reachable"
    if image_exists "$tag"; then
        log "$tag exists, nothing to do"
    else
        if image_exists "$base_tag"; then
            log "$base_tag exists, skipping base build"
        else
            build_base "$base_tag"
        fi
        build_top "$basehash" "$tag"
    fi
    echo "$tag"
}

# Sourced (deploy/images/build.sh reuses debian_rootfs and import_rootfs): define, do not run.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
