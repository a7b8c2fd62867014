#!/usr/bin/env bash
# `pipedsl demo --devices 1` on this machine's one accelerator (a GPU or a TPU chip), every
# pipeline device sharing it, in one process (only one process may hold a TPU chip):
#
# 1. the demo calibrates the chip as a cluster of one device (the training steps of a small
#    Llama in bf16, matrix products per dtype and size, memory bandwidth, dispatch and the
#    executor's cost per action, the device's memory) and writes OUT/cluster.toml, searches
#    the plans that fit the chip, runs the best ones and prints predicted against measured;
#    it appends its line, platform and device kind included, to RESULTS/demo.jsonl;
# 2. `pipedsl search --cluster OUT/cluster.toml` reads that calibrated cluster back, and
#    its fitted figures with the platform and device kind go to RESULTS/accel_calibrate.jsonl.
#
# Everything printed is kept in OUT/demo.txt and OUT/search.txt. Needs the pipedsl package,
# lark, optax, rich, pandas, matplotlib and JAX with its plugin for the accelerator; not Ray.
# Arguments after RESULTS go to the demo (--top, --steps). See docs/accelerators.md ("The
# demo on one accelerator").
#
#     bash bench/accel_demo.sh [OUT] [RESULTS] [--top 3]   # defaults: out/accel_demo, bench/results
#     PY=python3 bash bench/accel_demo.sh                  # another interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-out/accel_demo}
RESULTS=${2:-bench/results}
shift $(( $# > 1 ? 2 : $# ))
LIMIT=${ACCEL_DEMO_LIMIT:-1500}

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "accel_demo: $PY not found; run 'make install' (or set PY)" >&2
    exit 2
fi
# As in bench/accel_check.sh: an empty PYTHONPATH entry would make this checkout's
# pipedsl/ folder (a package only as installed: its simulator and executor live beside it)
# shadow the installed package; so would the working directory, which `python -m` and a
# script on stdin put first on sys.path: -P leaves it out.
PYTHONPATH=$(printf '%s' "${PYTHONPATH:-}" | tr -s ':' | sed 's/^://; s/:$//')
if [[ -n "$PYTHONPATH" ]]; then export PYTHONPATH; else unset PYTHONPATH; fi
mkdir -p "$OUT" "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)

PIPEDSL_RESULTS_DIR="$RESULTS" timeout "$LIMIT" "$PY" -P -m pipedsl demo --devices 1 --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/demo.txt"
status=${PIPESTATUS[0]}
if (( status == 124 )); then
    echo "accel_demo: the demo stopped after ${LIMIT} s (ACCEL_DEMO_LIMIT)" >&2
fi
if [[ ! -f "$OUT/cluster.toml" ]]; then
    echo "accel_demo: the demo wrote no $OUT/cluster.toml" >&2
    exit $(( status != 0 ? status : 1 ))
fi
"$PY" -P -m pipedsl search --model llama-8b --cluster "$OUT/cluster.toml" --gpus 1 --top 3 2>&1 | tee "$OUT/search.txt"
"$PY" -P - "$OUT/cluster.toml" "$RESULTS" <<'EOF'
"""Append the calibrated cluster, its platform and device kind (the file's second line) to accel_calibrate.jsonl."""
import sys
from pathlib import Path

from pipedsl.results import append_result
from pipedsl.simulator import load_cluster

path, folder = Path(sys.argv[1]), sys.argv[2]
said = path.read_text().splitlines()[1].removeprefix("# ")  # "platform: tpu; device kind: TPU v5 lite"
platform, kind = (part.split(": ", 1)[1] for part in said.split("; "))
cluster = load_cluster(path)
figures = {"platform": platform, "device_kind": kind}
for name in ("peak_flops", "matmul_half_flops", "hbm_bandwidth", "memory_bytes", "action_overhead_s",
             "kernel_launch_s", "step_overhead_s", "elementwise_traffic"):
    figures[name] = getattr(cluster, name)
print(append_result("accel_calibrate", figures, command=f"pipedsl demo --devices 1 --out {path.parent}", folder=folder))
EOF
exit "$status"
