#!/usr/bin/env bash
# up.sh: bring up everything sandcell needs on one Debian 12 machine (run as root).
#
# Installs what is missing and starts what is not running, without systemd:
#   apt      docker.io rabbitmq-server postgresql-15 debootstrap python3-venv (+ runsc if available)
#   docker   dockerd --bridge=none (no default bridge; sandboxes use network none),
#            runsc registered as a runtime with --network=none when installed
#   rabbitmq RabbitMQ on 127.0.0.1:5672, user `sandcell` (administrator, all on vhost /)
#   postgres cluster 15/main on 127.0.0.1:5432, role + database `sandcell`
#   garage   Garage 2.5.0 S3 on 127.0.0.1:3900 (admin 3903, rpc 3901), single-node
#            layout, key `sandcell`, bucket `sandcell-artifacts`
#   image    sandbox/build-image.sh
#   env      writes $STATE/sandcell.env (KEY=VALUE lines, no `export`)
# Every step is idempotent: on a ready machine the whole run takes a few seconds.
# Passwords and keys are generated once (hex only) and kept in $STATE/secrets.
#
# Usage: deploy/local/up.sh [step...]    (default: all steps in the order above)
#
# Environment (defaults):
#   SANDCELL_STATE_DIR  state: secrets, garage data, env file   (/var/lib/sandcell)
#   SANDCELL_LOG_DIR    logs of dockerd, garage, installs         (/var/log/sandcell)
#   GARAGE_VERSION      version for `cargo install garage`        (2.5.0)
set -euo pipefail

STATE=${SANDCELL_STATE_DIR:-/var/lib/sandcell}
LOG_DIR=${SANDCELL_LOG_DIR:-/var/log/sandcell}
GARAGE_VERSION=${GARAGE_VERSION:-2.5.0}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SECRETS=$STATE/secrets
GARAGE_DIR=$STATE/garage
GARAGE_CFG=$GARAGE_DIR/garage.toml
ENV_FILE=$STATE/sandcell.env
BUCKET=sandcell-artifacts
PG_VERSION=15
PG_CLUSTER=main

export PATH=$PATH:/usr/sbin:/sbin:${HOME:-/root}/.cargo/bin

LOG_TAG=up
# shellcheck source=deploy/local/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# wait_for <seconds> <description> <command...>: poll once per second.
wait_for() {
    local secs=$1 what=$2 i
    shift 2
    for ((i = 0; i < secs; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    die "timed out after ${secs}s waiting for $what"
}

# Print the secret stored in $SECRETS/<name>, generating <bytes> random bytes
# as hex on first use (hex is safe inside URLs, TOML and SQL literals).
secret() {
    local file=$SECRETS/$1 bytes=${2:-16}
    if [ ! -s "$file" ]; then
        (umask 077 && od -An -N"$bytes" -tx1 /dev/urandom | tr -d ' \n' >"$file")
    fi
    cat "$file"
}

# write_if_changed <file> <mode>: replace <file> with stdin only when the content
# differs; returns 0 if the file changed (so callers know to restart a service).
write_if_changed() {
    local file=$1 mode=$2 tmp
    tmp=$(mktemp "$file.XXXXXX")
    cat >"$tmp"
    chmod "$mode" "$tmp"
    if [ -f "$file" ] && cmp -s "$tmp" "$file"; then
        rm -f "$tmp"
        return 1
    fi
    mv -f "$tmp" "$file"
    return 0
}

# Start a long-running daemon detached from this shell (own session, survives
# the script and Ctrl-C); its pid goes to <pidfile> when given.
spawn() {
    local logfile=$1 pidfile=$2
    shift 2
    setsid nohup "$@" >>"$logfile" 2>&1 </dev/null &
    if [ -n "$pidfile" ]; then echo $! >"$pidfile"; fi
}

# ---------------------------------------------------------------- apt
pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

garage_bin() { command -v garage 2>/dev/null || true; }

step_apt() {
    # python3-venv: the Python SDK's tests install it in a virtualenv.
    local want=(docker.io rabbitmq-server postgresql-15 debootstrap curl ca-certificates python3-venv)
    # Building garage from source needs a C toolchain (bundled sqlite, lmdb, libsodium, zstd).
    if [ -z "$(garage_bin)" ]; then want+=(gcc make pkg-config libc6-dev); fi
    local missing=() p
    for p in "${want[@]}"; do pkg_installed "$p" || missing+=("$p"); done
    local want_runsc=0
    pkg_installed runsc || want_runsc=1
    if [ ${#missing[@]} -eq 0 ] && [ $want_runsc -eq 0 ]; then
        log "apt: all packages present"
        return
    fi

    # Package scripts must not start services: we start them by hand below.
    # Only remove the policy file if we created it.
    local policy=/usr/sbin/policy-rc.d created_policy=0
    if [ ! -e $policy ]; then
        printf '#!/bin/sh\nexit 101\n' >$policy
        chmod 0755 $policy
        created_policy=1
        # Also on failure: a leftover policy would block service starts for good.
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    local alog=$LOG_DIR/apt-up.log
    log "apt: installing ${missing[*]:-} (log: $alog)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update >>"$alog" 2>&1 || die "apt-get update failed, see $alog"
    if [ ${#missing[@]} -gt 0 ]; then
        apt-get install -y --no-install-recommends "${missing[@]}" >>"$alog" 2>&1 \
            || die "apt-get install failed, see $alog"
    fi
    # gVisor is optional: sandboxes fall back to runc without it.
    if [ $want_runsc -eq 1 ]; then
        apt-get install -y --no-install-recommends runsc >>"$alog" 2>&1 \
            || log "apt: runsc not available, continuing without gVisor"
    fi
    if [ $created_policy -eq 1 ]; then
        rm -f $policy
        trap - EXIT
    fi
}

# ---------------------------------------------------------------- docker
step_docker() {
    local runtimes='' changed=0
    if command -v runsc >/dev/null; then
        # runsc must not build its own network stack: sandboxes have no network.
        runtimes=$(printf ',\n  "runtimes": {\n    "runsc": { "path": "%s", "runtimeArgs": ["--network=none"] }\n  }' \
            "$(command -v runsc)")
    fi
    mkdir -p /etc/docker
    # Flags on the command line below must not be repeated here (dockerd refuses duplicates).
    write_if_changed /etc/docker/daemon.json 0644 <<EOF && changed=1
{
  "log-driver": "json-file",
  "log-opts": { "max-size": "10m", "max-file": "2" }$runtimes
}
EOF
    if docker info >/dev/null 2>&1; then
        if [ $changed -eq 0 ]; then
            log "docker: running"
            return
        fi
        # A runtime installed since dockerd started (runsc) is only known after a restart.
        log "docker: daemon.json changed; restarting dockerd to apply it"
        stop_dockerd || die "dockerd did not stop"
    fi
    log "docker: starting dockerd (log: $LOG_DIR/dockerd.log)"
    start_dockerd "$LOG_DIR/dockerd.log" || die "timed out after 60s waiting for docker info (see $LOG_DIR/dockerd.log)"
    log "docker: ready"
}

# ---------------------------------------------------------------- rabbitmq
rabbit_config() {
    local changed=1
    # AMQP and the management API (sandcell-admin creates tenants' users through it) on
    # loopback only. The largest message is what the protocol allows: a 16 MiB submission
    # (SANDCELL_MAX_MESSAGE_BYTES) plus 1 MiB for the execution job's envelope; the broker
    # refuses anything larger before it reaches the scheduler.
    write_if_changed /etc/rabbitmq/rabbitmq.conf 0644 <<'EOF' && changed=0
# managed by sandcell deploy/local/up.sh
listeners.tcp.default = 127.0.0.1:5672
max_message_size = 17825792
management.tcp.ip = 127.0.0.1
management.tcp.port = 15672
EOF
    # The consistent-hash exchange spreads submissions over the intake's partitions by session
    # (scheduler/src/partitions.rs); it ships with RabbitMQ.
    write_if_changed /etc/rabbitmq/enabled_plugins 0644 <<'EOF' && changed=0
[rabbitmq_consistent_hash_exchange,rabbitmq_management].
EOF
    # Erlang distribution (epmd 4369, node 25672) on loopback only as well.
    write_if_changed /etc/rabbitmq/rabbitmq-env.conf 0644 <<'EOF' && changed=0
# managed by sandcell deploy/local/up.sh
export ERL_EPMD_ADDRESS=127.0.0.1
SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
    return $changed
}

step_rabbitmq() {
    local config_changed=0
    rabbit_config && config_changed=1
    if port_open 5672 && [ $config_changed -eq 1 ]; then
        log "rabbitmq: config changed, restarting"
        rabbitmqctl -q stop >/dev/null 2>&1 || true
        wait_for 60 "rabbitmq to stop" bash -c '! timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/5672"'
    fi
    if ! port_open 5672; then
        log "rabbitmq: starting (logs: /var/log/rabbitmq)"
        rabbitmq-server -detached
        wait_for 120 "rabbitmq on 127.0.0.1:5672 (see /var/log/rabbitmq)" port_open 5672
        rabbitmqctl -q await_startup >/dev/null
    fi
    local pw
    pw=$(secret rabbitmq.password)
    # One CLI call in the common case: the user exists with the stored password.
    if rabbitmqctl -q authenticate_user sandcell "$pw" >/dev/null 2>&1; then
        log "rabbitmq: ready, user sandcell ok"
        return
    fi
    log "rabbitmq: creating user sandcell"
    if ! rabbitmqctl -q add_user sandcell "$pw" >/dev/null 2>&1; then
        rabbitmqctl -q change_password sandcell "$pw" >/dev/null
    fi
    rabbitmqctl -q set_user_tags sandcell administrator >/dev/null
    rabbitmqctl -q set_permissions -p / sandcell '.*' '.*' '.*' >/dev/null
    # The default guest user is only reachable from localhost; drop it anyway.
    rabbitmqctl -q delete_user guest >/dev/null 2>&1 || true
}

# ---------------------------------------------------------------- postgres
pg_status() { pg_lsclusters -h | awk -v v=$PG_VERSION -v c=$PG_CLUSTER '$1 == v && $2 == c { print $4 }'; }

step_postgres() {
    if [ -z "$(pg_status)" ]; then
        log "postgres: creating cluster $PG_VERSION/$PG_CLUSTER"
        pg_createcluster --port 5432 $PG_VERSION $PG_CLUSTER >/dev/null
    fi
    local conf_changed=0
    write_if_changed /etc/postgresql/$PG_VERSION/$PG_CLUSTER/conf.d/sandcell.conf 0644 <<'EOF' && conf_changed=1
# managed by sandcell deploy/local/up.sh: loopback only
listen_addresses = '127.0.0.1'
port = 5432
# Room in the shared lock table (this × max_connections entries; 64 by default): a tenant's
# sessions may each lock every relation of the database (~500) within SANDCELL_TENANT_DB_HOLD_S,
# and a full table fails every new connection (docs/security.md, "Postgres, shared resources").
max_locks_per_transaction = 256
# A connection that has not authenticated holds a slot of max_connections until this passes
# (the role's connection limit only counts it once it has): 1 min by default.
authentication_timeout = 10s
EOF
    if [ "$(pg_status)" = online ]; then
        if [ $conf_changed -eq 1 ]; then
            log "postgres: config changed, restarting"
            pg_ctlcluster $PG_VERSION $PG_CLUSTER restart
        fi
    else
        log "postgres: starting cluster $PG_VERSION/$PG_CLUSTER"
        pg_ctlcluster $PG_VERSION $PG_CLUSTER start
    fi
    wait_for 60 "postgres on 127.0.0.1:5432" pg_isready -q -h 127.0.0.1 -p 5432

    local pw
    pw=$(secret postgres.password)
    # Password via stdin, not argv. CREATE DATABASE cannot run in a DO block, hence \gexec.
    runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -d postgres >/dev/null <<EOF
\set pw '$pw'
SELECT 'CREATE ROLE sandcell' WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'sandcell') \gexec
ALTER ROLE sandcell LOGIN CREATEROLE PASSWORD :'pw';
SELECT 'CREATE DATABASE sandcell OWNER sandcell' WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'sandcell') \gexec
EOF
    # Built-in functions no tenant login may execute (advisory locks, large objects): only a
    # superuser can revoke them, in each database (deploy/postgres/lockdown.sql says why).
    runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -d sandcell -f - >/dev/null <"$REPO/deploy/postgres/lockdown.sql"
    log "postgres: ready, role and database sandcell ok"
}

# ---------------------------------------------------------------- garage
garage_cli() { garage -c "$GARAGE_CFG" "$@"; }

garage_install() {
    [ -n "$(garage_bin)" ] && return
    local cargo
    cargo=$(command -v cargo || true)
    [ -n "$cargo" ] || die "garage is missing and cargo is not installed (install Rust with rustup, then rerun)"
    log "garage: cargo install garage $GARAGE_VERSION (~10 min on 2 cores; log: $LOG_DIR/garage-install.log)"
    "$cargo" install garage --version "$GARAGE_VERSION" --locked >>"$LOG_DIR/garage-install.log" 2>&1 \
        || die "cargo install garage failed, see $LOG_DIR/garage-install.log"
}

garage_config() {
    mkdir -p "$GARAGE_DIR/meta" "$GARAGE_DIR/data"
    chmod 0700 "$GARAGE_DIR"
    # lmdb is the default engine of a default-features build; garage refuses a
    # world-readable config because it holds rpc_secret, hence mode 0600.
    write_if_changed "$GARAGE_CFG" 0600 <<EOF
# managed by sandcell deploy/local/up.sh
metadata_dir = "$GARAGE_DIR/meta"
data_dir = "$GARAGE_DIR/data"
db_engine = "lmdb"
replication_factor = 1

rpc_bind_addr = "127.0.0.1:3901"
rpc_public_addr = "127.0.0.1:3901"
rpc_secret = "$(secret garage.rpc_secret 32)"

[s3_api]
api_bind_addr = "127.0.0.1:3900"
s3_region = "garage"

[admin]
api_bind_addr = "127.0.0.1:3903"
admin_token = "$(secret garage.admin_token 32)"
metrics_token = "$(secret garage.metrics_token 32)"
EOF
}

garage_start() {
    local config_changed=$1 pidfile=$GARAGE_DIR/garage.pid
    if port_open 3900 && [ "$config_changed" -eq 1 ] && [ -s "$pidfile" ]; then
        log "garage: config changed, restarting"
        kill "$(cat "$pidfile")" 2>/dev/null || true
        wait_for 30 "garage to stop" bash -c '! timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/3900"'
    fi
    if port_open 3900; then return; fi
    log "garage: starting (log: $LOG_DIR/garage.log)"
    NO_COLOR=1 spawn "$LOG_DIR/garage.log" "$pidfile" "$(garage_bin)" -c "$GARAGE_CFG" server
    wait_for 60 "garage S3 on 127.0.0.1:3900 (see $LOG_DIR/garage.log)" port_open 3900
    wait_for 30 "garage rpc" garage_cli status
}

garage_layout() {
    # A fresh node shows "NO ROLE ASSIGNED" in `garage status`.
    if ! garage_cli status 2>/dev/null | grep -q 'NO ROLE ASSIGNED'; then return; fi
    local node version
    node=$(garage_cli node id -q 2>/dev/null | cut -d@ -f1)
    log "garage: assigning single-node layout to ${node:0:16}"
    garage_cli layout assign -z dc1 -c 10GB "$node" >/dev/null
    version=$(garage_cli layout show | awk -F': *' '/Current cluster layout version/ { print $2 }')
    garage_cli layout apply --version $((version + 1)) >/dev/null
}

garage_key_and_bucket() {
    local key_id key_secret
    # Key material is generated here (not by garage) so it survives a wipe of garage's metadata.
    key_id=GK$(secret garage.key_id 12)
    key_secret=$(secret garage.key_secret 32)
    if ! garage_cli key info "$key_id" >/dev/null 2>&1; then
        log "garage: importing key sandcell"
        garage_cli key import --yes -n sandcell "$key_id" "$key_secret" >/dev/null
    fi
    if ! garage_cli bucket info "$BUCKET" >/dev/null 2>&1; then
        log "garage: creating bucket $BUCKET"
        garage_cli bucket create "$BUCKET" >/dev/null
    fi
    garage_cli bucket allow --read --write --owner "$BUCKET" --key "$key_id" >/dev/null
}

step_garage() {
    garage_install
    local changed=0
    garage_config && changed=1
    garage_start $changed
    garage_layout
    garage_key_and_bucket
    log "garage: ready, key sandcell and bucket $BUCKET ok"
}

# ---------------------------------------------------------------- image + env
step_image() {
    local tag
    tag=$("$REPO/sandbox/build-image.sh" | tail -n1)
    log "image: $tag"
}

# runc always; runsc only if dockerd knows it and a sandbox really starts under it.
docker_runtimes() {
    local image=$1 runtimes=runc
    if docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"' &&
        docker run --rm --network none --runtime runsc "$image" true >/dev/null 2>&1; then
        runtimes=runc,runsc
    fi
    echo "$runtimes"
}

step_env() {
    local image
    image=$("$REPO/sandbox/build-image.sh" --print-tag)
    docker image inspect "$image" >/dev/null 2>&1 || die "image $image missing: run the image step"
    write_if_changed "$ENV_FILE" 0600 <<EOF || true
SANDCELL_AMQP_URL=amqp://sandcell:$(secret rabbitmq.password)@127.0.0.1:5672/%2f
SANDCELL_RABBITMQ_MANAGEMENT_URL=http://127.0.0.1:15672
SANDCELL_DATABASE_URL=postgres://sandcell:$(secret postgres.password)@127.0.0.1:5432/sandcell
SANDCELL_S3_ENDPOINT=http://127.0.0.1:3900
SANDCELL_S3_REGION=garage
SANDCELL_S3_BUCKET=$BUCKET
SANDCELL_S3_ACCESS_KEY_ID=GK$(secret garage.key_id 12)
SANDCELL_S3_SECRET_ACCESS_KEY=$(secret garage.key_secret 32)
# Garage's LMDB metadata engine takes object keys of at most 479 bytes (S3 allows 1024).
SANDCELL_S3_MAX_KEY_BYTES=479
SANDCELL_SANDBOX_IMAGE=$image
SANDCELL_DOCKER_RUNTIMES=$(docker_runtimes "$image")
SANDCELL_GATEWAY_SECRET=$(secret gateway.secret 32)
EOF
    cat >&2 <<EOF

sandcell local stack is up
  rabbitmq   amqp://127.0.0.1:5672 (user sandcell)
  postgres   127.0.0.1:5432 (database sandcell, role sandcell)
  garage S3  http://127.0.0.1:3900 (region garage, bucket $BUCKET, path style); admin 127.0.0.1:3903
  docker     $(docker info --format '{{.ServerVersion}}') runtimes: $(grep ^SANDCELL_DOCKER_RUNTIMES= "$ENV_FILE" | cut -d= -f2)
  image      $image
  gateway    E2B_API_URL=E2B_SANDBOX_URL=http://${SANDCELL_GATEWAY_ADDR:-127.0.0.1:9480} once started (deploy/local/demo.sh, test.sh)
  env file   $ENV_FILE   (use: set -a; . $ENV_FILE; set +a)
EOF
}

main() {
    [ "$(id -u)" -eq 0 ] || die "run as root"
    mkdir -p "$STATE" "$SECRETS" "$LOG_DIR"
    chmod 0700 "$STATE" "$SECRETS"
    local steps=("$@") s
    [ ${#steps[@]} -gt 0 ] || steps=(apt docker rabbitmq postgres garage image env)
    for s in "${steps[@]}"; do
        case $s in
            apt | docker | rabbitmq | postgres | garage | image | env) "step_$s" ;;
            *) die "unknown step '$s' (steps: apt docker rabbitmq postgres garage image env)" ;;
        esac
    done
}

main "$@"
