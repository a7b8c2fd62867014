#!/usr/bin/env bash
# The hybrid demo on this machine's GPUs, in under 5 minutes: calibrate the machine once,
# search the demo transformer's SPMD, pipeline and hybrid plans over every GPU, run the best
# few on the local backend (every pipeline device a dp x tp mesh of GPUs) and print the
# predicted against measured table. With GPU_CHECK_RAY=1 it runs them again on Ray actors
# (each reserves its GPUs: num_gpus per actor).
#
# Without two or more GPUs it says so and runs the CPU fallback instead: the same demo on 8
# forced CPU devices with fewer plans and steps, so that the path is exercised anywhere.
#
#     bash bench/gpu_check.sh [OUT]        # OUT defaults to out/gpu_check
set -euo pipefail
cd "$(dirname "$0")/.."
PIPEDSL=${PIPEDSL:-.venv/bin/pipedsl}
PY=${PY:-.venv/bin/python}
OUT=${1:-out/gpu_check}
LIMIT=${GPU_CHECK_LIMIT:-280}

if [[ ! -x "$PIPEDSL" ]]; then
    echo "gpu_check: $PIPEDSL not found; run 'make install' (or set PIPEDSL and PY)" >&2
    exit 2
fi

# GPUs that JAX sees (0 when its build has no GPU support or the machine has no GPU).
gpus=$(timeout 120 "$PY" -c 'import jax; print(sum(d.platform == "gpu" for d in jax.devices()))' 2>/dev/null || echo 0)
echo "gpu_check: JAX sees ${gpus} GPU(s)"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi

if (( gpus >= 2 )); then
    echo "gpu_check: the hybrid demo over ${gpus} GPUs (local backend)"
    time timeout "$LIMIT" "$PIPEDSL" demo --devices "$gpus" --top 3 --steps 5 --out "$OUT/local"
    if [[ "${GPU_CHECK_RAY:-0}" == 1 ]]; then
        echo "gpu_check: again on Ray actors"
        time timeout "$LIMIT" "$PIPEDSL" demo --devices "$gpus" --top 2 --steps 3 --backend ray --out "$OUT/ray"
    fi
else
    if (( gpus == 1 )); then
        echo "gpu_check: one GPU cannot hold a dp x tp x pp plan of two or more devices;" >&2
    else
        echo "gpu_check: no GPU that JAX can use (a CUDA build of jaxlib and a GPU are needed);" >&2
    fi
    echo "gpu_check: running the CPU fallback: the demo on 8 forced CPU devices, 2 plans, 3 steps" >&2
    time JAX_PLATFORMS=cpu timeout "$LIMIT" "$PIPEDSL" demo --devices 8 --top 2 --steps 3 --out "$OUT/cpu"
fi
