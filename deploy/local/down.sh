#!/usr/bin/env bash
# down.sh: stop what deploy/local/up.sh started (dockerd, garage, RabbitMQ,
# PostgreSQL cluster 15/main). Data, config, secrets and images stay in place,
# so a later up.sh resumes where this left off. Safe to run when nothing runs.
#
# Usage: deploy/local/down.sh
#
# Environment (defaults, same as up.sh):
#   SANDCELL_STATE_DIR  /var/lib/sandcell   (garage pid file lives in $STATE/garage)
set -euo pipefail

STATE=${SANDCELL_STATE_DIR:-/var/lib/sandcell}
export PATH=$PATH:/usr/sbin:/sbin

LOG_TAG=down
# shellcheck source=deploy/local/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# pid of the process with the given name listening on 127.0.0.1:<port>, if any.
listener_pid() {
    local port=$1 name=$2 pid
    pid=$(ss -Hltnp "sport = :$port" 2>/dev/null | grep -o 'pid=[0-9]*' | head -n1 | cut -d= -f2 || true)
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then echo "$pid"; fi
}

# dockerd stops running containers (sandboxes) and its containerd itself.
stop_docker() { stop_dockerd; }

stop_garage() {
    local pid='' pidfile=$STATE/garage/garage.pid
    [ -s "$pidfile" ] && pid=$(cat "$pidfile")
    # Fall back to whoever serves S3 on 3900, in case the pid file is stale.
    if [ -z "$pid" ] || [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != garage ]; then
        pid=$(listener_pid 3900 garage)
    fi
    if [ -n "$pid" ]; then
        stop_pid "$pid" garage 30 && rm -f "$pidfile"
    else
        log "garage not running"
        rm -f "$pidfile"
    fi
}

stop_rabbitmq() {
    if command -v rabbitmqctl >/dev/null && rabbitmqctl -q ping >/dev/null 2>&1; then
        # `stop` returns once the Erlang node has exited.
        rabbitmqctl -q stop >/dev/null
        log "rabbitmq stopped"
    else
        log "rabbitmq not running"
    fi
    # epmd was started implicitly by the node; stop it when no node is left.
    if command -v epmd >/dev/null && port_open 4369 && [ -z "$(epmd -names 2>/dev/null | grep '^name ' || true)" ]; then
        epmd -kill >/dev/null 2>&1 || true
    fi
}

stop_postgres() {
    command -v pg_lsclusters >/dev/null || { log "postgres not installed"; return 0; }
    if [ "$(pg_lsclusters -h | awk '$1 == 15 && $2 == "main" { print $4 }')" = online ]; then
        pg_ctlcluster 15 main stop
        log "postgres stopped"
    else
        log "postgres not running"
    fi
}

main() {
    [ "$(id -u)" -eq 0 ] || { log "ERROR: run as root"; exit 1; }
    local rc=0
    # Sandboxes first, then the services the scheduler and workers talk to.
    stop_docker || rc=1
    stop_garage || rc=1
    stop_rabbitmq || rc=1
    stop_postgres || rc=1
    exit $rc
}

main "$@"
