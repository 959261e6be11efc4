#!/usr/bin/env bash
# Train on one node: torchrun --standalone with NPROC ranks running launch/train.py.
#
# Usage:
#   launch/run_local.sh --ckpt-dir DIR [train.py flags...]
#   NPROC=4 launch/run_local.sh --ckpt-dir runs/exp1 --steps 100 --save-every 10 --keep-last 3
#   launch/run_local.sh --help          this text, then train.py's flags
#
# Every argument goes to launch/train.py unchanged; --ckpt-dir is required (no default: a run
# resumes from the newest verified checkpoint in that directory, so the choice is yours).
#
# Environment:
#   NPROC            ranks on this machine (default 2); one per GPU with CUDA, gloo on CPU
#   PYTHON           interpreter (default: the repository's .venv/bin/python, else python3)
#   OMP_NUM_THREADS  threads per rank (default 1, so N ranks do not oversubscribe the cores)
#
# SIGTERM, SIGINT or SIGUSR1 to this launcher goes on to every rank: train.py then agrees on a
# step, saves it and exits 0; the launcher waits up to SHUTDOWN_TIMEOUT seconds (default 130,
# above train.py's --preempt-deadline) before it kills the ranks.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
    # The comment block above, without the leading '# '.
    sed -n '2,/^set -euo pipefail/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"
}

# shellcheck source=launch/common.sh disable=SC1091
source "$REPO/launch/common.sh"
check_train_args run_local.sh "the run's checkpoint root" "$@"

NPROC="${NPROC:-2}"
if [[ ! "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_local.sh: error: NPROC must be a positive integer, got '$NPROC'" >&2
    exit 2
fi
SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-130}"
if [[ ! "$SHUTDOWN_TIMEOUT" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_local.sh: error: SHUTDOWN_TIMEOUT must be seconds, got '$SHUTDOWN_TIMEOUT'" >&2
    exit 2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
    "$REPO/launch/train.py" "$@"
