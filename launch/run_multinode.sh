#!/usr/bin/env bash
# Train on several nodes: one torchrun agent per node, joined by a c10d rendezvous, each
# running NPROC_PER_NODE ranks of launch/train.py. Run this same script on every node.
#
# Usage:
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 RDZV_ID=job42 \
#       launch/run_multinode.sh --ckpt-dir /shared/ckpt/exp1 [train.py flags...]
#   launch/run_multinode.sh --help       this text, then train.py's flags
#
# Required environment:
#   NNODES           nodes in the job: a count (2), or MIN:MAX (2:3) for an elastic job;
#                    or set MIN_NODES and MAX_NODES instead
#   NPROC_PER_NODE   ranks on this node (one per GPU; on CPU, gloo, any number)
#   RDZV_ENDPOINT    host:port of the rendezvous store, the same on every node; the store is
#                    served by the node whose address that is (the "host" node)
#   RDZV_ID          job id, the same on every node; a fresh one for every new launch of the
#                    job (a scheduler's job id plus its restart count), so a relaunch never
#                    meets the closed rendezvous of the run before
# Optional environment:
#   NODE_ADDR        this node's address as the other nodes reach it (-> --local-addr)
#   RDZV_IS_HOST     1 on the node that serves the store, 0 elsewhere (-> --rdzv-conf is_host)
#   RDZV_JOIN_TIMEOUT  seconds to wait for the other nodes (torchrun's default: 600)
#   RDZV_KEEP_ALIVE_INTERVAL, RDZV_KEEP_ALIVE_MAX_ATTEMPT  a node without a heartbeat for
#                    interval * attempts seconds has left the rendezvous (torch: 5 s * 3)
#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE  default 1 here (see "Failures" below)
#   MAX_RESTARTS     times the agents restart the workers after a failure (default 3)
#   SHUTDOWN_TIMEOUT seconds a signalled worker gets for its final save before the agent
#                    kills it (default 130: above train.py's --preempt-deadline, 120 s)
#   SIGNALS_TO_HANDLE  signals the agent passes on to the workers
#                    (default SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1: Slurm's warning is USR1)
#   GLOO_SOCKET_IFNAME  the network interface gloo uses (passed through to the workers)
#   PYTHON           interpreter (default: the repository's .venv/bin/python, else python3)
#   OMP_NUM_THREADS  threads per rank (default 1)
#
# Why NODE_ADDR and RDZV_IS_HOST: torchrun decides whether it hosts the store by comparing the
# endpoint's host with this machine's hostname and addresses, and it tells the other nodes to
# reach its workers at this machine's hostname. Where a hostname does not resolve to the
# address the other nodes use (containers, network namespaces, multi-homed hosts), both
# guesses fail and the store and MASTER_ADDR time out after 60 s. Then set, on every node,
# NODE_ADDR to its reachable address and RDZV_IS_HOST=1 on the endpoint's node, 0 elsewhere
# (seen with torch 2.13 and gloo: ../shared/notes/multinode-on-one-machine.md).
#
# Failures: when a rank dies, the agents restart every worker in a new rendezvous round (up to
# MAX_RESTARTS times) and train.py resumes from the newest verified checkpoint. Relaunching
# every node with a new RDZV_ID (what a scheduler's requeue does) re-formed the world every time
# in our network-namespace tests. Re-forming in place after a node was lost hung there on
# `torchelastic/role_info` with torch's default: the agent of group rank 0 reuses its first
# round's bootstrap store and never publishes MASTER_ADDR/PORT for a new round;
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes every round publish its own, and that is this
# script's default (launch/netns_cluster.sh, tests/test_two_node.py). The node that serves the
# rendezvous store must survive: losing it needs the relaunch. On a signal (SIGTERM, or Slurm's SIGUSR1 warning) the agent passes it to
# the workers and waits SHUTDOWN_TIMEOUT seconds for them to save and exit; train.py agrees on
# a step across all ranks, saves it and exits 0 (the agent itself then exits non-zero: it was
# signalled). Without SIGUSR1 in SIGNALS_TO_HANDLE the agent would die of it, workers orphaned.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ME="run_multinode.sh"

usage() {
    # The comment block above, without the leading '# '.
    sed -n '2,/^set -euo pipefail/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"
}

die() {
    echo "$ME: error: $*" >&2
    echo "$ME: see '$0 --help'" >&2
    exit 2
}

# shellcheck source=launch/common.sh disable=SC1091
source "$REPO/launch/common.sh"
check_train_args run_multinode.sh "a directory every node sees: a shared file system" "$@"

# --- the rendezvous, from the environment ---------------------------------------------------
if [[ -n "${MIN_NODES:-}" || -n "${MAX_NODES:-}" ]]; then
    [[ -n "${MIN_NODES:-}" && -n "${MAX_NODES:-}" ]] ||
        die "MIN_NODES and MAX_NODES must be set together (or set NNODES=MIN:MAX)"
    [[ -z "${NNODES:-}" ]] || die "set NNODES or MIN_NODES/MAX_NODES, not both"
    nnodes="$MIN_NODES:$MAX_NODES"
elif [[ -n "${NNODES:-}" ]]; then
    nnodes="$NNODES"
else
    die "NNODES is not set (a count such as 2, or MIN:MAX such as 2:3 for an elastic job)"
fi
[[ "$nnodes" =~ ^([1-9][0-9]*)(:([1-9][0-9]*))?$ ]] ||
    die "NNODES must be N or MIN:MAX with positive integers, got '$nnodes'"
if [[ -n "${BASH_REMATCH[3]}" ]] && ((BASH_REMATCH[1] > BASH_REMATCH[3])); then
    die "NNODES MIN:MAX has MIN > MAX: '$nnodes'"
fi

[[ -n "${NPROC_PER_NODE:-}" ]] || die "NPROC_PER_NODE is not set (ranks on this node, e.g. 8)"
[[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] ||
    die "NPROC_PER_NODE must be a positive integer, got '$NPROC_PER_NODE'"

[[ -n "${RDZV_ENDPOINT:-}" ]] ||
    die "RDZV_ENDPOINT is not set (host:port of the rendezvous store, the same on every node, e.g. node0:29400)"
[[ "$RDZV_ENDPOINT" =~ ^(\[[0-9a-fA-F:]+\]|[^:/[:space:]]+):[0-9]{1,5}$ ]] ||
    die "RDZV_ENDPOINT must be host:port, got '$RDZV_ENDPOINT'"

[[ -n "${RDZV_ID:-}" ]] ||
    die "RDZV_ID is not set (the job id, the same on every node and new for every launch)"

rdzv_conf=()
if [[ -n "${RDZV_IS_HOST:-}" ]]; then
    case "$RDZV_IS_HOST" in
        1 | 0) rdzv_conf+=("is_host=$RDZV_IS_HOST") ;;
        *) die "RDZV_IS_HOST must be 1 (this node serves the store) or 0, got '$RDZV_IS_HOST'" ;;
    esac
fi
if [[ -n "${RDZV_JOIN_TIMEOUT:-}" ]]; then
    [[ "$RDZV_JOIN_TIMEOUT" =~ ^[1-9][0-9]*$ ]] ||
        die "RDZV_JOIN_TIMEOUT must be seconds, got '$RDZV_JOIN_TIMEOUT'"
    rdzv_conf+=("join_timeout=$RDZV_JOIN_TIMEOUT")
fi

for var in RDZV_KEEP_ALIVE_INTERVAL RDZV_KEEP_ALIVE_MAX_ATTEMPT; do
    if [[ -n "${!var:-}" ]]; then
        [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || die "$var must be a positive integer, got '${!var}'"
        conf_key="${var#RDZV_}"
        rdzv_conf+=("${conf_key,,}=${!var}")
    fi
done

MAX_RESTARTS="${MAX_RESTARTS:-3}"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be an integer >= 0, got '$MAX_RESTARTS'"
SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-130}"
[[ "$SHUTDOWN_TIMEOUT" =~ ^[1-9][0-9]*$ ]] ||
    die "SHUTDOWN_TIMEOUT must be seconds, got '$SHUTDOWN_TIMEOUT'"

torchrun_args=(
    --nnodes "$nnodes"
    --nproc-per-node "$NPROC_PER_NODE"
    --rdzv-backend c10d
    --rdzv-endpoint "$RDZV_ENDPOINT"
    --rdzv-id "$RDZV_ID"
    --max-restarts "$MAX_RESTARTS"
    --signals-to-handle "${SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
    --shutdown-timeout "$SHUTDOWN_TIMEOUT"
)
if [[ -n "${NODE_ADDR:-}" ]]; then
    torchrun_args+=(--local-addr "$NODE_ADDR")
fi
if ((${#rdzv_conf[@]})); then
    torchrun_args+=(--rdzv-conf "$(IFS=,; echo "${rdzv_conf[*]}")")
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
if [[ -n "${GLOO_SOCKET_IFNAME:-}" ]]; then
    export GLOO_SOCKET_IFNAME
fi

echo "$ME: ${HOSTNAME:-?} nnodes=$nnodes nproc_per_node=$NPROC_PER_NODE" \
    "endpoint=$RDZV_ENDPOINT id=$RDZV_ID node_addr=${NODE_ADDR:-<hostname>}" \
    "is_host=${RDZV_IS_HOST:-<guess>} max_restarts=$MAX_RESTARTS" \
    "gloo_ifname=${GLOO_SOCKET_IFNAME:-<auto>}" "rdzv_conf=$(IFS=,; echo "${rdzv_conf[*]:-}")" >&2

exec "$PYTHON" -m torch.distributed.run "${torchrun_args[@]}" "$REPO/launch/train.py" "$@"
