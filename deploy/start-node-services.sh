#!/usr/bin/env bash
# Start this node's tierstack services in the background:
#   start-node-services.sh head|worker NODE_IP RAY_ADDRESS
#
# Called by deploy/cluster.yaml's start commands right after `ray start`; RAY_ADDRESS is
# the cluster's Ray (GCS) address, HEAD_IP:PORT, which names the cluster on this host.
# `tierstack ray-node` runs the node's tier manager (plus scheduler and dashboard on the
# head) and stops them when this node's raylet of this cluster stops. Runs from a login
# shell over SSH: the supervisor is detached (setsid) with every standard stream
# redirected, or the SSH session would wait for it.
set -euo pipefail
usage="usage: start-node-services.sh head|worker NODE_IP RAY_ADDRESS"
role=${1:?$usage}
node_ip=${2:?$usage}
ray_address=${3:?$usage}
home=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
logs="/tmp/tierstack-$(id -u)"
# The cluster's token and TLS certificate (`tierstack ray-node --make-secrets deploy/secrets`
# before `ray up`; copied with the checkout): required by every server beyond loopback, used
# by every client. Without them a node on a real network refuses to start and says so.
if [ -z "${TIERSTACK_SECURITY_DIR:-}" ] && [ -d "$home/deploy/secrets" ]; then
    export TIERSTACK_SECURITY_DIR="$home/deploy/secrets"
fi
mkdir -p "$logs"
# One log per node and cluster: another cluster's node on this host keeps its own.
log="$logs/ray-node-$role-$node_ip-for-$ray_address.log"
setsid "$home/.venv/bin/tierstack" ray-node --role "$role" --node-ip "$node_ip" \
    --ray-address "$ray_address" --config "${TIERSTACK_NODE_CONFIG:-$home/deploy/node.json}" \
    </dev/null >"$log" 2>&1 &
# Wait until the tier manager answers, so `ray up` reports a node that is really ready.
"$home/.venv/bin/tierstack" ray-node --role "$role" --node-ip "$node_ip" \
    --ray-address "$ray_address" --wait-ready 120 </dev/null || { echo "supervisor's log: $log" >&2; exit 1; }
