"""``RunOptions``: its defaults, what it keeps, and every bad argument refused with our own
error that names it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from pipedsl import PipedslError, RunOptions, RunOptionsError
from pipedsl.run_options import check_sharding


def test_the_defaults_run_one_device_per_pipeline_device_in_fp32() -> None:
    options = RunOptions()
    assert (options.dp, options.tp, options.cp, options.zero, options.mesh_size) == (1, 1, 1, 0, 1)
    assert (options.recompute, options.precision, options.sequence_parallel) == ("none", "fp32", False)
    assert options.fuse == "loop" and not options.ticks and not options.reduce_once and options.recv_timeout == 300.0


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
        ({"reduce_once": True, "zero": 1}, "reduce_once", "applies to zero 2 and 3 (zero 1 reduces"),
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
        ({"fuse": None}, "fuse", "must be one of 'loop', 'unrolled', 'ticks', 'off', got None"),
        ({"fuse": True}, "fuse", "must be one of 'loop', 'unrolled', 'ticks', 'off', got True"),
        ({"ticks": None}, "ticks", "must be True or False, got None"),
        ({"pack_residuals": 1}, "pack_residuals", "must be True, False or None, got 1"),
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


_SHARDINGS = [
    {"fsdp": fsdp, "zero": zero, "reduce_once": once, "keep_weights": keep}
    for fsdp in (None, 2, 3)
    for zero in (0, 1, 2, 3)
    for once in (False, True)
    for keep in (False, True)
]


def _refusal(make: Any) -> str | None:
    try:
        make()
    except PipedslError as err:
        return str(err)
    return None


@pytest.mark.parametrize("sharding", _SHARDINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_run_options_plans_estimate_and_run_take_the_same_sharding_combinations(
    sharding: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from pipedsl.cli.main import main
    from pipedsl.simulator.plan import Plan

    fsdp, zero, once, keep = sharding.values()
    rule = _refusal(lambda: check_sharding(dp=4, **sharding))
    assert (
        _refusal(
            lambda: Plan(dp=4, global_batch=8, fsdp=fsdp, zero=zero, reduce_once=once, reshard_after_forward=not keep)
        )
        is None
    ) == (rule is None)
    if not keep:  # the executor does not keep gathered weights: RunOptions has no such option
        assert _refusal(lambda: RunOptions(dp=4, fsdp=fsdp, zero=zero, reduce_once=once)) == rule
    flags = [*(["--fsdp", str(fsdp)] if fsdp else []), "--zero", str(zero)]
    flags += ["--reduce-once"] * once + ["--keep-weights"] * keep
    code = main(
        ["estimate", "--model", "llama-8b", "--cluster", "h100-80gb", "--dp", "4", "--global-batch", "8", *flags]
    )
    err = capsys.readouterr().err
    if rule is None:
        assert code in (0, 1), err
        return
    # The same rule, in one line naming the option that breaks it.
    with pytest.raises(RunOptionsError) as caught:
        check_sharding(dp=4, **sharding)
    assert code == 2 and err == f"--{caught.value.argument.replace('_', '-')} {caught.value.rule}\n", err
    if not keep:
        assert main(["run", "1f1b", "-p", "pp=2", "--dp", "4", *flags]) == 2
        assert capsys.readouterr().err.endswith(err)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            [
                "estimate",
                "--model",
                "llama-8b",
                "--cluster",
                "h100-80gb",
                "--tp",
                "8",
                "--global-batch",
                "8",
                "--tp",
                "2",
            ],
            "--tp 8 and --tp 2 set the same thing: give one",
        ),
        (
            ["search", "--model", "llama-8b", "--cluster", "h100-80gb", "--gpus", "1024", "--devices", "512"],
            "--gpus 1024 and --devices 512 set the same thing: give one",
        ),
        (["check", "1f1b", "-p", "pp=2", "-p", "pp=4"], "parameter pp is given twice: pp=2 and pp=4; keep one"),
        (["run", "1f1b", "--remat", "--remat"], "--remat is given twice: give it once"),
        (
            ["estimate", "--model", "llama-8b", "--cluster", "h100-80gb", "--global-batch", "8", "--keep-weights"],
            "--keep-weights keeps the weights ZeRO 3 gathers for the forward, and zero 0 gathers none",
        ),
    ],
)
def test_repeated_or_contradictory_options_are_refused_in_one_line_naming_both(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipedsl.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
