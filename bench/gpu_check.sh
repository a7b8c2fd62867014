#!/usr/bin/env bash
# The executor's checks on this machine's GPUs, in under 5 minutes on one GPU: stages sharing
# the GPU against jax.value_and_grad (fp32 and bf16), step time against one jax.jit, each
# recompute mode, fused attention (cuDNN), peak device memory against the compiled analysis
# and the planner, and with 2+ GPUs a hybrid dp x tp x pp plan. One table, and a JSON line of
# results in OUT/results.json. See bench/gpu_check.py and docs/gpu.md.
#
# Without a GPU it says so and runs the same checks at toy sizes on 8 forced CPU devices.
# Needs the pipedsl package and JAX (with its CUDA plugin for GPUs); not Ray.
#
#     bash bench/gpu_check.sh [OUT] [--checks fp32,bf16,...]   # OUT defaults to out/gpu_check
#     PY=python3 bash bench/gpu_check.sh                        # another interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-out/gpu_check}
shift $(( $# > 0 ? 1 : 0 ))
LIMIT=${GPU_CHECK_LIMIT:-290}

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: $PY not found; run 'make install' (or set PY)" >&2
    exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
mkdir -p "$OUT"
timeout "$LIMIT" "$PY" bench/gpu_check.py --out "$OUT/results.json" "$@"
status=$?
if (( status == 124 )); then
    echo "gpu_check: stopped after ${LIMIT} s (GPU_CHECK_LIMIT)" >&2
fi
exit "$status"
