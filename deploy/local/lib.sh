# shellcheck shell=bash
# Helpers shared by up.sh, down.sh and services.sh (sourced, never run). Set LOG_TAG before
# sourcing to name the script in its messages.

LOG_TAG=${LOG_TAG:-sandcell}

log() { echo "[$LOG_TAG $(date +%T)] $*" >&2; }
die() { echo "[$LOG_TAG] ERROR: $*" >&2; exit 1; }

# True when something accepts TCP connections on 127.0.0.1:$1.
port_open() { timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# stop_pid <pid> <name> <seconds>: SIGTERM, then wait for a clean exit.
# No SIGKILL: these daemons hold data, a hung shutdown needs a human.
stop_pid() {
    local pid=$1 name=$2 secs=$3 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < secs; i++)); do
        kill -0 "$pid" 2>/dev/null || { log "$name stopped"; return 0; }
        sleep 1
    done
    log "ERROR: $name (pid $pid) still running after ${secs}s"
    return 1
}

# Start dockerd detached (its log appended to $1) and wait up to 60 s for it to answer.
# --bridge=none: no docker0, sandboxes only get network mode none.
# --iptables/--ip-forward=false: nothing to NAT without a bridge; leave host firewall and sysctls alone.
start_dockerd() {
    local log_file=$1 i
    setsid nohup dockerd --bridge=none --iptables=false --ip-forward=false >>"$log_file" 2>&1 </dev/null &
    for ((i = 0; i < 60; i++)); do
        docker info >/dev/null 2>&1 && return 0
        sleep 1
    done
    return 1
}

# Stop the dockerd this machine runs (it stops its containers first); 0 if none runs.
stop_dockerd() {
    local pid=''
    [ -s /var/run/docker.pid ] && pid=$(cat /var/run/docker.pid)
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ]; then
        stop_pid "$pid" dockerd 60
    else
        log "dockerd not running"
    fi
}
