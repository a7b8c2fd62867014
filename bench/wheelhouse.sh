#!/usr/bin/env bash
# A wheelhouse for a machine that has JAX but no package index (an accelerator machine's
# image): pipedsl's own wheel and the packages it needs beyond what such an image has (JAX
# with its plugin, NumPy, SciPy), built on a connected machine into DIR (default .whl, which
# git ignores), at the versions this checkout's venv runs:
# - pure Python: lark (the schedule language), optax with absl-py (the optimizers), and rich
#   with markdown-it-py, mdurl and pygments (the CLI's tables): all that bench/accel_check.sh needs;
# - for the search and the demo (bench/accel_demo.sh): pandas and matplotlib with their
#   dependencies, binary wheels for this machine's Python and platform (build it where they
#   match the target's: python3 -c 'import sys, platform; print(sys.version, platform.machine())'),
#   never NumPy: the image's JAX keeps its own.
# Carry DIR over and install it there without an index, keeping the machine's JAX:
#
#     python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl
#     export PYTHONPATH=$PYTHONPATH:/tmp/site
#
# Build it from the checkout the machine will run: the check imports pipedsl from the wheel.
# See docs/accelerators.md ("Offline install").
#
#     bash bench/wheelhouse.sh [DIR]
#     PY=python3 bash bench/wheelhouse.sh .whl-tpu   # versions from another interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DIR=${1:-.whl}
PACKAGES=(lark optax absl-py rich markdown-it-py mdurl pygments
    pandas python-dateutil tzdata matplotlib contourpy cycler fonttools kiwisolver packaging pillow pyparsing)

# The versions the venv's tests ran with, not whatever the index has today.
pins=$("$PY" -c 'import importlib.metadata as m, sys; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
    "${PACKAGES[@]}")
mkdir -p "$DIR"
rm -f "$DIR"/pipedsl-*.whl
"$PY" -m pip wheel --quiet --no-deps --wheel-dir "$DIR" .
# shellcheck disable=SC2086  # one argument per pin
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DIR" $pins
ls -1 "$DIR"
