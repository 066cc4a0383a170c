#!/usr/bin/env bash
# Start this node's tierstack services in the background:
#   start-node-services.sh head|worker NODE_IP [HEAD_IP]
#
# Called by deploy/cluster.yaml's start commands right after `ray start`. `tierstack
# ray-node` runs the node's tier manager (plus scheduler and dashboard on the head) and
# stops them when this node's Ray stops. Runs from a login shell over SSH: the
# supervisor is detached (setsid) with every standard stream redirected, or the SSH
# session would wait for it.
set -euo pipefail
role=${1:?usage: start-node-services.sh head|worker NODE_IP}
node_ip=${2:?usage: start-node-services.sh head|worker NODE_IP}
head_ip=${3:-$node_ip}
home=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
logs="/tmp/tierstack-$(id -u)"
# The cluster's token and TLS certificate (`tierstack ray-node --make-secrets deploy/secrets`
# before `ray up`; copied with the checkout): required by every server beyond loopback, used
# by every client. Without them a node on a real network refuses to start and says so.
if [ -z "${TIERSTACK_SECURITY_DIR:-}" ] && [ -d "$home/deploy/secrets" ]; then
    export TIERSTACK_SECURITY_DIR="$home/deploy/secrets"
fi
mkdir -p "$logs"
setsid "$home/.venv/bin/tierstack" ray-node --role "$role" --node-ip "$node_ip" --head-ip "$head_ip" \
    --config "${TIERSTACK_NODE_CONFIG:-$home/deploy/node.json}" \
    </dev/null >"$logs/ray-node-$role-$node_ip.log" 2>&1 &
# Wait until the tier manager answers, so `ray up` reports a node that is really ready.
"$home/.venv/bin/tierstack" ray-node --role "$role" --node-ip "$node_ip" --wait-ready 120 </dev/null
