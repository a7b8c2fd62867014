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


@pytest.fixture(scope="module")
def four_stages() -> tuple[object, ...]:
    """The toy Llama block in fp32 cut into four stages, compiled once for every schedule."""
    case = bench.Case("llama", "fp32", "none", False)
    return case, bench.compiled_stages(bench.TOY, case, jax.devices()[0], bench.SCHEDULE_STAGES)


@pytest.mark.parametrize(("schedule", "pp", "vpp"), bench.SCHEDULES, ids=[s[0] for s in bench.SCHEDULES])
def test_planned_peak_per_device_is_what_the_executor_holds_under_each_schedule(
    four_stages: tuple[object, ...], schedule: str, pp: int, vpp: int
) -> None:
    case, programs = four_stages
    compiled = bench.compiled_schedule_peaks(programs, schedule, pp, vpp)
    planned = bench.planned_schedule_peaks(bench.TOY, case, schedule, pp, vpp)
    assert len(compiled) == len(planned) == pp
    for held, priced in zip(compiled, planned, strict=True):
        assert abs(priced / held - 1) <= bench.TOLERANCE
