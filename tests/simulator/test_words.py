"""Numbers as people write them, and assumption lines a user can act on."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from pipedsl.cli import main
from pipedsl.simulator import CostModel, load_cluster, load_model
from pipedsl.simulator.assumptions import assumptions
from pipedsl.simulator.explain import Explanation
from pipedsl.simulator.plan import Plan
from pipedsl.words import byte_size, number, plural


def test_numbers_sizes_and_counts() -> None:
    assert number(33.300000000000004) == "33.3"
    assert number(16000000016.0) == "16,000,000,016"
    assert number(0.00125) == "0.00125"
    assert number(1.0) == "1" and number(0) == "0" and number(-2.5) == "-2.5"
    assert byte_size(16000000016e9) == "16 EB"
    assert byte_size(1.5e9) == "1.5 GB" and byte_size(512) == "512 B"
    assert plural(1, "combination") == "1 combination" and plural(1024, "chip") == "1,024 chips"
    assert plural(3, "microbatch") == "3 microbatches"


def test_one_combination_left_out_is_singular() -> None:
    explained = Explanation.of(
        considered=3, ranked=2, skipped=Counter({("tp does not divide the heads", 3): 1}), dropped={},
        schedules=[], ranked_schedules=[],
    )  # fmt: skip
    assert explained.lines()[0] == "left out 1 combination: tp does not divide the heads (3)"


def test_the_network_tiers_in_words() -> None:
    model, cluster = load_model("gpt3-175b"), load_cluster("a100-80gb")
    plan = Plan(dp=32, tp=8, pp=4, global_batch=1536, schedule="1f1b")
    (network,) = [a for a in assumptions(model, cluster, plan) if a.name == "network"]
    assert " 0 us" not in network.meaning and "at 1 of" not in network.meaning
    assert network.meaning.startswith(f"a group of up to {cluster.leaf_nodes} nodes stays under one leaf switch")


def test_costs_without_a_split_backward_leave_out_i_and_w() -> None:
    assert CostModel(latency=0.1).describe(split=False) == "F=1 B=2F comm=0.1s"
    assert "I=B/2 W=B/2" in CostModel(latency=0.1).describe()


def test_tpu_estimates_speak_of_chips_and_maxtext(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama-8b", "--cluster", "tpu-v5e", "--dp", "256", "--global-batch", "1024", "--zero", "3"]
    assert main(["estimate", *argv, "--recompute", "full"]) == 0
    out = capsys.readouterr().out
    assert "memory per chip" in out and "per GPU" not in out
    assert "framework = maxtext" in out and "megatron" not in out


def test_a_huge_batch_is_refused_without_advising_an_option_estimate_lacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--model", "gpt3-175b", "--cluster", "a100-80gb", "--dp", "16", "--tp", "8", "--pp", "8"]
    assert main(["estimate", *argv, "--global-batch", "1000000000", "--schedule", "1f1b"]) != 0
    err = capsys.readouterr().err
    assert "--global-batch" in err and "--max-actions" not in err


def test_a_gpipe_header_names_no_i_or_w(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "gpipe", "-p", "pp=4"]) == 0
    assert "costs: F=1 B=2F comm=0s\n" in capsys.readouterr().out


def test_run_says_sizes_as_people_write_them(capsys: pytest.CaptureFixture[str]) -> None:
    # Refused by arithmetic, before any model is built.
    assert main(["run", "1f1b", "-p", "pp=2", "--model", "llama", "--width", "1000000000"]) == 2
    err = capsys.readouterr().err
    assert " EB of parameters" in err and not re.search(r"\d{5,}\.\d GB|e\+\d", err)
