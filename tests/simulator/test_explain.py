"""Empty and impossible results explained; the assumptions every estimate prints."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pipedsl.cli import plan as plan_cli
from pipedsl.simulator.estimate import estimate
from pipedsl.simulator.explain import Explanation, fit_advice, misfit_text
from pipedsl.simulator.hardware import Model, load_cluster
from pipedsl.simulator.plan import Plan, Recompute
from pipedsl.simulator.search import search

MODEL = Model(name="gpt-small", layers=8, hidden=1024, ffn_hidden=4096, heads=16, seq_len=1024, vocab=32000)
A100 = load_cluster("a100-80gb")


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pipedsl")
    plan_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.handler(args)


def test_empty_search_names_the_rules() -> None:
    # 12 GPUs: dp 3, 6 or 12 does not divide a batch of 64; pp 3 and 6 do not divide the
    # 8 layers, and pp 12 exceeds them.
    frame = search(MODEL, A100, 12, global_batch=64, schedules=("1f1b",))
    assert len(frame) == 0
    explanation = frame.attrs["explanation"]
    assert isinstance(explanation, Explanation)
    rules = {rule: values for rule, values, _ in explanation.skipped}
    assert rules["global batch 64 is not a multiple of dp"] == (3, 6, 12)
    # With the embedding and the head on stages of their own, 8 layers split over 3 and 6.
    ends = "8 layers split over pp × vpp only with the embedding and the head on stages of their own"
    assert set(rules[f"{ends} (stage_split='ends', --stage-layers ends)"]) == {3, 6}
    assert rules["pp exceeds the 8 layers"] == (12,)
    assert explanation.schedules_without_plan == ("1f1b",)
    assert "nothing fits" in explanation.lines()[-1]


def test_cli_search_with_no_plan_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["search", "--model", "llama-8b", "--cluster", "a100-80gb", "--gpus", "12", "--schedules", "1f1b"]
    argv += ["--stage-layers", "even"]  # with the ends split, pp 3 and 6 would fit
    assert _run(argv) == 1
    out = capsys.readouterr().out
    assert "global batch 512 is not a multiple of dp (3, 6, 12)" in out
    assert "32 layers do not split over pp × vpp (12)" in out  # 12 - 2 stages do not split them either


def test_search_counts_dropped_plans_in_the_explanation() -> None:
    small = dataclasses.replace(A100, memory_bytes=5 * 2**30, reserved_bytes=2**30)
    frame = search(MODEL, small, 16, global_batch=64, schedules=("1f1b",), prune=None)
    explanation = frame.attrs["explanation"]
    assert dict(explanation.dropped) == frame.attrs["dropped"]
    assert explanation.ranked == len(frame) > 0
    assert explanation.schedules_without_plan == ()


def test_advice_for_a_plan_that_does_not_fit() -> None:
    tight = dataclasses.replace(A100, memory_bytes=6 * 2**30, reserved_bytes=2**30)
    plan = Plan(dp=8, global_batch=64, microbatch_size=8, flash_attention=False)
    result = estimate(MODEL, tight, plan)
    assert not result.fits and result.memory.excess == result.memory.total - result.memory.usable
    advice = fit_advice(MODEL, tight, plan)
    assert advice, "recomputation or ZeRO should make a 0.4B model fit in 5 GiB"
    for a in advice:
        assert a.memory.fits and estimate(MODEL, tight, a.plan).fits
    assert [a.memory.total for a in advice] == sorted(a.memory.total for a in advice)
    lines = misfit_text(result.memory, advice)
    assert "GiB too much" in lines[0] and all("fits with" in line for line in lines[1:])


def test_cli_estimate_that_does_not_fit_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--tp", "8", "--global-batch", "8"]
    assert _run(argv) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "GiB too much" in out
    argv.append("--json")
    assert _run(argv) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["excess_bytes"] > 0


def test_assumptions_are_listed() -> None:
    plan = Plan(dp=32, tp=8, global_batch=64, recompute="full", flash_attention=False, reduce_bytes=2)
    result = estimate(dataclasses.replace(MODEL, layers=4), A100, plan)
    found = {a.name: a.value for a in result.assumptions}
    assert found["flash_attention"] == "off"
    assert found["sequence_parallel"] == "on"
    assert found["recompute"] == Recompute.FULL.value
    assert found["reduce_dtype"] == "bf16"
    assert found["dp_overlap"] == "1"
    assert found["tp_collectives"] == "ring"  # inside one node
    assert found["dp_collectives"] in ("ring", "hierarchical")
    assert set(result.to_json()["assumptions"]) == set(found)


def test_cli_estimate_prints_assumptions(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "llama-8b", "--cluster", "h100-80gb", "--dp", "8", "--global-batch", "64",
            "--zero", "1", "--recompute", "full"]  # fmt: skip
    assert _run(argv) == 0
    out = capsys.readouterr().out
    assert "assumes" in out and "flash_attention" in out and "dp_collectives" in out
