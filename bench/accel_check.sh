#!/usr/bin/env bash
# The executor's checks on this machine's accelerator (one GPU or one TPU chip), in under 5
# minutes: stages sharing the device against jax.value_and_grad (fp32 and bf16), step time
# against one jax.jit, each recompute mode, fused attention, peak device memory against the
# compiled analysis and the planner, and with 2+ devices a hybrid dp x tp x pp plan. One
# table with each check's seconds, and a JSON line of results (platform and device kind
# included) in OUT/results.json. See bench/accel_check.py and docs/accelerators.md.
#
# Without a GPU or TPU it says so and runs the same checks at toy sizes on 8 forced CPU
# devices. Needs the pipedsl package, lark and JAX (with its plugin for the accelerator);
# not Ray. Arguments after OUT go to the script (--checks, --results, --compile-threads).
#
#     bash bench/accel_check.sh [OUT] [--checks fp32,bf16,...]   # OUT defaults to out/accel_check
#     bash bench/accel_check.sh out/accel_check --results bench/results   # also append the run there
#     PY=python3 bash bench/accel_check.sh                          # another interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-out/accel_check}
shift $(( $# > 0 ? 1 : 0 ))
LIMIT=${ACCEL_CHECK_LIMIT:-290}

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "accel_check: $PY not found; run 'make install' (or set PY)" >&2
    exit 2
fi
# A GPU's name and driver; on a TPU the script prints the device kind JAX reports.
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
# `export PYTHONPATH=$PYTHONPATH:/tmp/site` with PYTHONPATH unset leaves an empty entry, which
# Python reads as the working directory: this checkout's pipedsl/ folder (a package only as
# installed) would then shadow the installed one.
PYTHONPATH=$(printf '%s' "${PYTHONPATH:-}" | tr -s ':' | sed 's/^://; s/:$//')
if [[ -n "$PYTHONPATH" ]]; then export PYTHONPATH; else unset PYTHONPATH; fi
mkdir -p "$OUT"
timeout "$LIMIT" "$PY" bench/accel_check.py --out "$OUT/results.json" "$@"
status=$?
if (( status == 124 )); then
    echo "accel_check: stopped after ${LIMIT} s (ACCEL_CHECK_LIMIT)" >&2
fi
exit "$status"
