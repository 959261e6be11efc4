#!/usr/bin/env bash
# A two-node "cluster" on one machine, made of two Linux network namespaces, for torchrun.
#
# Usage (as root; the namespaces share the filesystem, so a checkpoint root is shared):
#   DCKPT_NETNS_ID=<id> launch/netns_cluster.sh up
#       create namespaces dckpt-a-<id> and dckpt-b-<id>, joined by a veth pair
#       (node A 10.231.7.1/24 on veth-a, node B 10.231.7.2/24 on veth-b), lo up in both
#   DCKPT_NETNS_ID=<id> launch/netns_cluster.sh run-node A|B <rdzv-id> <train.py args...>
#       run `torchrun --nnodes 2 --nproc-per-node 1` of launch/train.py in that node's namespace,
#       c10d rendezvous hosted by node A (is_host=1) at 10.231.7.1:29400, gloo on the veth;
#       blocks until torchrun exits and returns its exit status
#   DCKPT_NETNS_ID=<id> launch/netns_cluster.sh kill-node A|B
#       SIGKILL every process of that node (a lost machine); returns once none is left
#   DCKPT_NETNS_ID=<id> launch/netns_cluster.sh link-down A|B
#       take that node's link down (its processes live on, cut off: a lost network)
#   DCKPT_NETNS_ID=<id> launch/netns_cluster.sh down
#       kill every process of both nodes and delete the namespaces (idempotent)
#   DCKPT_NETNS_ID=<id> launch/netns_cluster.sh status
#       list the namespaces and the processes in each
#   launch/netns_cluster.sh check
#       exit 0 when network namespaces can be created here (root, `ip netns add` permitted)
#
# DCKPT_NETNS_ID (default "dev"; letters, digits, '_' and '-', at most 20) keeps parallel runs
# apart: every run gets its own pair of namespaces. Addresses and device names live inside the
# namespaces (the veth is created in them directly), so they never collide between runs.
#
# Environment for run-node:
#   DCKPT_MAX_RESTARTS   torchrun --max-restarts (default 0: a lost peer fails the node's job)
#   DCKPT_TORCHRUN_ARGS  extra torchrun options, split on spaces
#   DCKPT_RDZV_PORT      rendezvous port on node A (default 29400)
#   DCKPT_JOIN_TIMEOUT   seconds a node waits for the other to join (default 60)
#   DCKPT_PYTHON         python to run (default: the repo's .venv/bin/python)
#
# Two ways back after a node is lost (both are tested by tests/test_two_node.py):
#   requeue   both nodes exit (node A's torchrun fails at once: gloo sees the peer gone); start
#             both again with a new rendezvous id, as a scheduler requeues the job.
#   in place  DCKPT_MAX_RESTARTS=1 on node A: its torchrun keeps the rendezvous (hosted on A)
#             and waits in a new round; start node B alone with the same rendezvous id. This
#             needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (set below): with torch's default, the
#             agent of group rank 0 reuses its first round's bootstrap store and never publishes
#             MASTER_ADDR/PORT for the new round, so the restarted node waits on it and node A
#             waits on `torchelastic/role_info` until the join timeout. A dead node leaves the
#             rendezvous after keep_alive_interval * keep_alive_max_attempt (1 s * 5 here, not
#             torch's 5 s * 3) without a heartbeat; the new round forms only then.
#             The node hosting the rendezvous (A) must be the one that survives.
#
# Example:
#   export DCKPT_NETNS_ID=demo
#   launch/netns_cluster.sh up
#   launch/netns_cluster.sh run-node A job1 --ckpt-dir /tmp/ck --steps 40 &
#   launch/netns_cluster.sh run-node B job1 --ckpt-dir /tmp/ck --steps 40 &
#   sleep 8; launch/netns_cluster.sh kill-node B; wait
#   launch/netns_cluster.sh run-node A job2 --ckpt-dir /tmp/ck --steps 40 &   # the requeue:
#   launch/netns_cluster.sh run-node B job2 --ckpt-dir /tmp/ck --steps 40 &   # a new rdzv id
#   wait; launch/netns_cluster.sh down
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ID="${DCKPT_NETNS_ID:-dev}"
if [[ ! "$ID" =~ ^[A-Za-z0-9_-]{1,20}$ ]]; then
    echo "netns_cluster: DCKPT_NETNS_ID must be 1-20 of [A-Za-z0-9_-], got '$ID'" >&2
    exit 2
fi
NS_A="dckpt-a-$ID"
NS_B="dckpt-b-$ID"
SUBNET="10.231.7"
IP_A="$SUBNET.1"
IP_B="$SUBNET.2"
DEV_A="veth-a"
DEV_B="veth-b"
PORT="${DCKPT_RDZV_PORT:-29400}"
JOIN_TIMEOUT="${DCKPT_JOIN_TIMEOUT:-60}"
PYTHON="${DCKPT_PYTHON:-$REPO/.venv/bin/python}"

die() {
    echo "netns_cluster: $*" >&2
    exit 2
}

ns_of() {
    case "$1" in
        A | a) echo "$NS_A" ;;
        B | b) echo "$NS_B" ;;
        *) die "node must be A or B, got '$1'" ;;
    esac
}

ns_exists() {
    [[ -e "/run/netns/$1" ]]
}

# SIGKILL everything in namespace $1 until nothing is left (a dying torchrun may still fork).
kill_ns() {
    local ns="$1" pids tries=0
    ns_exists "$ns" || return 0
    while true; do
        pids="$(ip netns pids "$ns" 2>/dev/null || true)"
        [[ -z "$pids" ]] && return 0
        # shellcheck disable=SC2086  # one pid a word
        kill -9 $pids 2>/dev/null || true
        tries=$((tries + 1))
        if ((tries > 100)); then
            echo "netns_cluster: processes left in $ns after 10 s: $pids" >&2
            return 1
        fi
        sleep 0.1
    done
}

cmd_check() {
    [[ "$(id -u)" == 0 ]] || die "not root: network namespaces need CAP_SYS_ADMIN"
    command -v ip >/dev/null || die "iproute2 'ip' not found"
    local probe="dckpt-probe-$ID-$$"
    ip netns add "$probe" || die "'ip netns add' is not permitted here"
    ip netns del "$probe"
}

cmd_up() {
    if ns_exists "$NS_A" || ns_exists "$NS_B"; then
        die "namespaces for id '$ID' exist already (run 'down' first)"
    fi
    # Undo a half-made cluster if any step fails.
    trap 'cmd_down >/dev/null 2>&1 || true' ERR
    ip netns add "$NS_A"
    ip netns add "$NS_B"
    # Both ends are created inside their namespaces: no device name ever exists on the host.
    ip link add "$DEV_A" netns "$NS_A" type veth peer name "$DEV_B" netns "$NS_B"
    ip -n "$NS_A" addr add "$IP_A/24" dev "$DEV_A"
    ip -n "$NS_B" addr add "$IP_B/24" dev "$DEV_B"
    local ns
    for ns in "$NS_A" "$NS_B"; do
        ip -n "$ns" link set lo up
    done
    ip -n "$NS_A" link set "$DEV_A" up
    ip -n "$NS_B" link set "$DEV_B" up
    trap - ERR
    echo "netns_cluster: up: $NS_A ($IP_A on $DEV_A) <-> $NS_B ($IP_B on $DEV_B)"
}

cmd_run_node() {
    (($# >= 2)) || die "usage: run-node A|B <rdzv-id> <train.py args...>"
    local node="$1" rdzv_id="$2"
    shift 2
    local ns ip dev is_host
    ns="$(ns_of "$node")"
    ns_exists "$ns" || die "namespace $ns does not exist (run 'up' first)"
    case "$node" in
        A | a) ip="$IP_A" dev="$DEV_A" is_host=1 ;;
        *) ip="$IP_B" dev="$DEV_B" is_host=0 ;;
    esac
    local -a extra=()
    if [[ -n "${DCKPT_TORCHRUN_ARGS:-}" ]]; then
        read -r -a extra <<<"$DCKPT_TORCHRUN_ARGS"
    fi
    local conf="is_host=$is_host,join_timeout=$JOIN_TIMEOUT"
    conf+=",keep_alive_interval=1,keep_alive_max_attempt=5"
    conf+=",read_timeout=${DCKPT_RDZV_READ_TIMEOUT:-60}"
    # The hostname does not resolve to the namespace's address: the rendezvous host and every
    # node's address are given explicitly, and gloo is pinned to the veth.
    exec ip netns exec "$ns" env \
        GLOO_SOCKET_IFNAME="$dev" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 \
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
        "$PYTHON" -m torch.distributed.run \
        --nnodes 2 --nproc-per-node 1 --max-restarts "${DCKPT_MAX_RESTARTS:-0}" \
        --rdzv-backend c10d --rdzv-endpoint "$IP_A:$PORT" --rdzv-id "$rdzv_id" \
        --rdzv-conf "$conf" --local-addr "$ip" \
        "${extra[@]}" \
        "$REPO/launch/train.py" "$@"
}

cmd_kill_node() {
    (($# == 1)) || die "usage: kill-node A|B"
    kill_ns "$(ns_of "$1")"
}

cmd_link_down() {
    (($# == 1)) || die "usage: link-down A|B"
    local ns dev
    ns="$(ns_of "$1")"
    case "$1" in
        A | a) dev="$DEV_A" ;;
        *) dev="$DEV_B" ;;
    esac
    ip -n "$ns" link set dev "$dev" down
}

cmd_down() {
    local ns rc=0
    for ns in "$NS_A" "$NS_B"; do
        kill_ns "$ns" || rc=1
        if ns_exists "$ns"; then
            ip netns del "$ns" || rc=1
        fi
    done
    return "$rc"
}

cmd_status() {
    local ns
    for ns in "$NS_A" "$NS_B"; do
        if ns_exists "$ns"; then
            echo "$ns: pids $(ip netns pids "$ns" | tr '\n' ' ')"
        else
            echo "$ns: absent"
        fi
    done
}

(($# >= 1)) || die "usage: $0 up|run-node|kill-node|link-down|down|status|check ..."
sub="$1"
shift
case "$sub" in
    up) cmd_up "$@" ;;
    run-node) cmd_run_node "$@" ;;
    kill-node) cmd_kill_node "$@" ;;
    link-down) cmd_link_down "$@" ;;
    down) cmd_down "$@" ;;
    status) cmd_status "$@" ;;
    check) cmd_check "$@" ;;
    *) die "unknown subcommand '$sub' (up, run-node, kill-node, link-down, down, status, check)" ;;
esac
