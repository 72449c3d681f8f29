#!/usr/bin/env bash
# Egress by allowlist for named tenants (off unless this runs): each tenant's sandboxes get an
# internal Docker network of their own whose only other member is a filtering proxy (tinyproxy,
# from Debian's packages, in the sandbox image), and the proxy lets through requests to the
# allowed host names only. No sandbox has a route anywhere else: the networks are internal and
# the host has no address on them.
#
#   egress.sh up     create the networks and (re)start the proxy with the current allowlist
#   egress.sh down   remove the proxy and the networks
#   egress.sh env    print the worker settings that match (KEY=VALUE lines)
#
# Env:
#   SANDCELL_EGRESS_TENANTS   comma-separated tenants granted egress (required for up)
#   SANDCELL_EGRESS_ALLOW     comma-separated host names the proxy lets through, exactly
#                             (e.g. pypi.org,files.pythonhosted.org); empty: nothing
#   SANDCELL_EGRESS_UPSTREAM  the Docker network the proxy reaches the allowed hosts through
#                             (default sandcell-egress-out, created here as a network without a
#                             host address: on this machine only project containers are there;
#                             an operator points it at a network with a route out)
#   SANDCELL_SANDBOX_IMAGE    the sandbox image (has tinyproxy); default: the env file's
#   SANDCELL_STATE_DIR        where the proxy's configuration is written (/var/lib/sandcell)
set -euo pipefail
LOG_TAG=egress
# shellcheck source=deploy/local/lib.sh
. "$(dirname "$0")/lib.sh"
# shellcheck source=deploy/local/services.sh
. "$(dirname "$0")/services.sh"

PROXY=sandcell-egress-proxy
PORT=8888
UPSTREAM=${SANDCELL_EGRESS_UPSTREAM:-sandcell-egress-out}
NET_PREFIX=sandcell-egress-
CONF_DIR=${SANDCELL_STATE_DIR:-/var/lib/sandcell}/egress


split() { tr ',' '\n' <<<"${1:-}" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//' | grep -v '^$' || true; }

network_exists() { docker network inspect "$1" >/dev/null 2>&1; }

# An internal bridge without a host address: its members reach each other and nothing else.
create_network() {
    local name=$1 internal=$2
    network_exists "$name" && return 0
    # shellcheck disable=SC2086
    docker network create --driver bridge $internal \
        --opt com.docker.network.bridge.inhibit_ipv4=true \
        --label org.sandcell.egress=1 "$name" >/dev/null
    log "created network $name"
}

write_config() {
    mkdir -p "$CONF_DIR"
    local host allow=$CONF_DIR/allow
    : >"$allow.new"
    while IFS= read -r host; do
        [[ $host =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$ ]] || die "not a host name: $host"
        # Exact host names: dots escaped, anchored at both ends.
        printf '^%s$\n' "${host//./\\.}" >>"$allow.new"
    done < <(split "${SANDCELL_EGRESS_ALLOW:-}")
    mv "$allow.new" "$allow"
    cat >"$CONF_DIR/tinyproxy.conf" <<EOF
# Written by deploy/local/egress.sh; rewritten on every "up".
Port $PORT
Timeout 60
MaxClients 64
LogLevel Info
DisableViaHeader Yes
# Only the allowlist's hosts, by name (an address is not a name in the list); CONNECT (HTTPS)
# only to port 443.
FilterDefaultDeny Yes
FilterType ere
FilterURLs Off
Filter "/etc/sandcell-egress/allow"
ConnectPort 443
EOF
    chmod 0644 "$CONF_DIR/tinyproxy.conf" "$allow"
}

up() {
    local tenants tenant image
    tenants=$(split "${SANDCELL_EGRESS_TENANTS:-}")
    [ -n "$tenants" ] || die "SANDCELL_EGRESS_TENANTS is empty: nothing to grant"
    image=${SANDCELL_SANDBOX_IMAGE:-}
    if [ -z "$image" ]; then load_sandcell_env; image=$SANDCELL_SANDBOX_IMAGE; fi
    write_config
    [ "$UPSTREAM" = sandcell-egress-out ] && create_network "$UPSTREAM" ""
    network_exists "$UPSTREAM" || die "no network $UPSTREAM"
    docker rm -f "$PROXY" >/dev/null 2>&1 || true
    # Unprivileged, read-only, on the upstream network first; then on each tenant's network.
    docker run -d --name "$PROXY" --restart unless-stopped --network "$UPSTREAM" \
        --user 1000:1000 --read-only --cap-drop ALL --security-opt no-new-privileges \
        --memory 128m --pids-limit 64 --log-opt max-size=1m \
        --label org.sandcell.egress=1 \
        -v "$CONF_DIR:/etc/sandcell-egress:ro" \
        "$image" tinyproxy -d -c /etc/sandcell-egress/tinyproxy.conf >/dev/null
    while IFS= read -r tenant; do
        [[ $tenant =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] || die "tenant $tenant cannot name a Docker network"
        create_network "$NET_PREFIX$tenant" --internal
        docker network connect "$NET_PREFIX$tenant" "$PROXY"
    done <<<"$tenants"
    log "proxy $PROXY up for: $(tr '\n' ' ' <<<"$tenants"); allowed: ${SANDCELL_EGRESS_ALLOW:-nothing}"
}

down() {
    docker rm -f "$PROXY" >/dev/null 2>&1 || true
    local net
    for net in $(docker network ls --filter label=org.sandcell.egress=1 --format '{{.Name}}'); do
        docker network rm "$net" >/dev/null 2>&1 || log "network $net still in use; left"
    done
}

env_lines() {
    echo "SANDCELL_EGRESS_TENANTS=${SANDCELL_EGRESS_TENANTS:-}"
    echo "SANDCELL_EGRESS_NETWORK=${NET_PREFIX}{tenant}"
    echo "SANDCELL_EGRESS_PROXY=http://$PROXY:$PORT"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    env) env_lines ;;
    *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
