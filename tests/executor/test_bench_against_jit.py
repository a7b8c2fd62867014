"""``bench/bench_against_jit.py``'s first step in a new process, as ``--cache`` takes it on
an accelerator: the pipelined plan and the accumulating jit, each with an empty persistent
compilation cache and then with the one it filled, their seconds told apart by phase."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import BENCH, bench_script

bench = bench_script("bench_against_jit")


def _first_step(name: str, cache: Path) -> dict[str, float]:
    env = dict(os.environ, PIPEDSL_COMPILATION_CACHE=str(cache), JAX_PLATFORMS="cpu")
    command = [sys.executable, str(BENCH / "bench_against_jit.py"), "--first-step-of", name, "--size", "toy"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["1f1b-pp2", bench.JIT])
def test_a_new_process_reads_its_first_step_from_the_cache_the_one_before_filled(name: str, tmp_path: Path) -> None:
    cold, warm = _first_step(name, tmp_path), _first_step(name, tmp_path)
    for run in (cold, warm):
        assert set(run) == {"first_step_s", "trace_s", "lower_s", "compile_s", "cache_hits", "cache_misses"}
        assert run["trace_s"] > 0 and run["lower_s"] > 0
        assert 0 < run["compile_s"] < run["first_step_s"]
    # Every program of the second process's first step came from the cache the first filled.
    assert warm["cache_misses"] == 0 and warm["cache_hits"] >= 1
    assert cold["cache_misses"] >= 1
