"""``RunOptions``: its defaults, what it keeps, and every bad argument refused with our own
error that names it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from pipedsl import PipedslError, RunOptions, RunOptionsError


def test_the_defaults_run_one_device_per_pipeline_device_in_fp32() -> None:
    options = RunOptions()
    assert (options.dp, options.tp, options.cp, options.zero, options.mesh_size) == (1, 1, 1, 0, 1)
    assert (options.recompute, options.precision, options.sequence_parallel) == ("none", "fp32", False)
    assert options.fuse == "loop" and not options.reduce_once and options.recv_timeout == 300.0


def test_options_are_frozen_keyword_only_and_compare_by_value() -> None:
    options = RunOptions(dp=2, tp=2, cp=2, zero=2, reduce_once=True, recompute=["full", "none"])
    assert options.mesh_size == 8
    assert options.recompute == ("full", "none")  # a list is kept as the tuple
    assert options == RunOptions(dp=2, tp=2, cp=2, zero=2, reduce_once=True, recompute=("full", "none"))
    assert hash(options) == hash(dataclasses.replace(options))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dp = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        RunOptions(2)  # type: ignore[misc]
    assert not hasattr(options, "__dict__")  # slotted
    # A change is checked as a new object is.
    with pytest.raises(RunOptionsError, match="reduce_once applies to zero 2 and 3"):
        dataclasses.replace(options, zero=1)


def test_one_mode_or_one_per_stage() -> None:
    assert RunOptions(recompute="selective").stage_recompute(3) == ("selective",) * 3
    assert RunOptions(recompute=("full", "none")).stage_recompute(2) == ("full", "none")
    with pytest.raises(RunOptionsError, match="recompute gives 2 modes but the schedule has 4 stages") as caught:
        RunOptions(recompute=("full", "none")).stage_recompute(4)
    assert caught.value.argument == "recompute"


@pytest.mark.parametrize(
    ("arguments", "argument", "rule"),
    [
        ({"dp": 0}, "dp", "must be a whole number >= 1, got 0"),
        ({"tp": 1.5}, "tp", "must be a whole number >= 1, got 1.5"),
        ({"cp": True}, "cp", "must be a whole number >= 1, got True"),
        ({"zero": 4}, "zero", "must be a ZeRO stage, one of 0, 1, 2, 3; got 4"),
        ({"zero": False}, "zero", "must be a ZeRO stage"),
        ({"reduce_once": 1, "zero": 2}, "reduce_once", "must be True or False, got 1"),
        ({"reduce_once": True, "zero": 1}, "reduce_once", "applies to zero 2 and 3 (ZeRO 1 reduces"),
        (
            {"recompute": "some"},
            "recompute",
            "must be one of none, selective, full, save_dots, save_qkv_proj, save_mlp_inputs, got 'some'",
        ),
        (
            {"recompute": ()},
            "recompute",
            "must be a mode (none, selective, full, save_dots, save_qkv_proj, save_mlp_inputs) or one per stage, got ()",
        ),
        (
            {"recompute": 3},
            "recompute",
            "must be a mode (none, selective, full, save_dots, save_qkv_proj, save_mlp_inputs) or one per stage, got 3",
        ),
        ({"recompute": ("full", "half")}, "recompute", "gives 'half' for a stage"),
        ({"precision": "fp16"}, "precision", "must be one of fp32, bf16, got 'fp16'"),
        ({"sequence_parallel": "yes", "tp": 2}, "sequence_parallel", "must be True or False, got 'yes'"),
        ({"sequence_parallel": True}, "sequence_parallel", "give it with tp above 1"),
        ({"fuse": None}, "fuse", "must be one of 'loop', 'unrolled', 'off', got None"),
        ({"fuse": True}, "fuse", "must be one of 'loop', 'unrolled', 'off', got True"),
        ({"recv_timeout": 0}, "recv_timeout", "must be a finite number of seconds above 0, got 0"),
        ({"recv_timeout": math.inf}, "recv_timeout", "must be a finite number of seconds above 0, got inf"),
        ({"recv_timeout": "60"}, "recv_timeout", "must be a finite number of seconds above 0, got '60'"),
    ],
)
def test_each_bad_argument_is_refused_by_name(arguments: dict[str, Any], argument: str, rule: str) -> None:
    with pytest.raises(RunOptionsError) as caught:
        RunOptions(**arguments)
    error = caught.value
    assert isinstance(error, PipedslError)
    assert error.argument == argument and rule in error.rule
    assert str(error).startswith(f"{argument} {error.rule}")
