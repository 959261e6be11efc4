#!/usr/bin/env bash
# The GPU checks in one go, for a machine with one CUDA GPU and its own python + torch (no
# network, no install: dckpt runs from this checkout). It runs the CUDA tests (device staging,
# the snapshot guarantee, NCCL and cpu:gloo,cuda:nccl groups, DDP and FSDP2 crash/resume loss
# for loss), then bench/gpu.py, and prints one summary line. Everything lands in $OUT
# (default build/gpu): tests.log, bench.log, gpu.json, gpu.md.
#
#   OUT=/tmp/out bash bench/gpu_checks.sh        # about 5 minutes on one H200
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-build/gpu}"
py="${PYTHON:-python3}"
mkdir -p "$out"

"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
    | tee "$out/env.txt"
timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_world.py \
    2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 420 "$py" bench/gpu.py --out "$out" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu checks: tests exit $tests_rc ($(tail -n 1 "$out/tests.log")), bench exit $bench_rc;" \
    "results in $out"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
