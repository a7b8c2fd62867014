"""The planner's activation bytes per layer under the ``pipedsl`` framework against what the
compiled stage programs keep, for the built-in GPT and Llama blocks, in fp32 and bf16, per
recompute mode, with written-out and fused attention: ``bench/activation_bytes.py`` at its
toy size (on an accelerator it runs at the accelerator check's size)."""

from __future__ import annotations

import jax
import pytest
from bench_scripts import bench_script

bench = bench_script("activation_bytes")


@pytest.mark.parametrize("case", bench.CASES, ids=lambda c: c.name)
def test_planned_layer_bytes_are_what_the_compiled_middle_stage_keeps(case: object) -> None:
    size = bench.TOY
    compiled = bench.compiled_layer_bytes(size, case, jax.devices()[0])
    planned = bench.planned_layer_bytes(size, case)
    if case.recompute == "full":  # type: ignore[attr-defined]
        # One checkpoint around the whole stage: its forward keeps nothing it computes, only
        # the stage's input (by reference), which is what the planner counts per layer.
        assert compiled == 0
    assert abs(bench.error(compiled, planned, case, size)) <= bench.TOLERANCE
