"""What the plan search does with the inputs that trip users up: a cluster size past any
real one is refused before any work, the work follows the number's factors (not its
size), a fault in the user's own schedule file stops the search with its place, and a
library schedule's refusal names the schedule and its rule."""

from __future__ import annotations

import pickle
import re
import time
from pathlib import Path

import pytest

from pipedsl.cli import main
from pipedsl.errors import RequirementFailed, ScheduleEvalError, ScheduleInvalid
from pipedsl.simulator.candidates import MAX_GPUS, _divisors, candidate_plans
from pipedsl.simulator.hardware import load_cluster, load_model
from pipedsl.simulator.plan import PlanError
from pipedsl.simulator.search import search

MODEL, CLUSTER = load_model("llama-8b"), load_cluster("h100-80gb")

BODY = """\
schedule {name}(pp = 4, microbatches = 8) {{
  stages pp
  devices pp
  place s -> s
  on device d {{
{body}
  }}
}}
"""


def _write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.sched"
    path.write_text(BODY.format(name=name, body=body), encoding="utf-8")
    return path


def test_divisors_come_from_the_factors() -> None:
    for n in range(1, 400):
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    # A trillion has 169 divisors; finding them takes about a million steps, not a trillion.
    assert len(_divisors(10**12)) == 169
    assert _divisors(1_000_003) == [1, 1_000_003]


def test_a_huge_cluster_is_refused_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    code = main(["search", "--model", "llama-8b", "--cluster", "h100-80gb", "--gpus", "1000000000000"])
    # A generous bound: the old enumeration took 90 s here; the refusal does no enumeration.
    assert time.perf_counter() - started < 10
    assert code == 2
    assert f"past the {MAX_GPUS:,} GPUs a search plans for" in capsys.readouterr().err
    with pytest.raises(PlanError, match="past the"):
        next(candidate_plans(MODEL, CLUSTER, MAX_GPUS + 1, global_batch=512))


def test_the_largest_cluster_takes_little_work() -> None:
    # Work follows the divisors: a million GPUs (2**20) gives a handful of plans, fast.
    frame = search(MODEL, CLUSTER, MAX_GPUS, global_batch=MAX_GPUS, schedules=["1f1b"])
    assert frame.attrs["considered"] < 5000


@pytest.mark.parametrize(
    ("body", "kind", "where"),
    [
        ("    x = 1 / (d - d)\n    for i in 0 .. microbatches { F(i) B(i) }", ScheduleEvalError, ":6:"),
        (
            "    for i in 0 .. microbatches { F(i) }\n    for i in 0 .. microbatches - 1 { B(i) }",
            ScheduleInvalid,
            ":6:",
        ),
    ],
    ids=["division-by-zero", "missing-backward"],
)
def test_a_fault_in_the_users_file_stops_the_search(tmp_path: Path, body: str, kind: type, where: str) -> None:
    mine = _write(tmp_path, "mine", body)
    with pytest.raises(kind) as caught:
        search(MODEL, CLUSTER, 64, global_batch=512, schedules=["1f1b"], extra_schedules=[mine])
    text = str(caught.value)
    assert f"{mine}{where}" in text and "^" in text
    assert any("the search stopped at plan" in note for note in caught.value.__notes__)
    # The error crosses a worker process whole: class, place and rule.
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is kind and str(again) == text and again.pos == caught.value.pos


def test_the_cli_exits_non_zero_on_the_users_fault(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = _write(tmp_path, "mine", "    for i in 0 .. microbatches { F(i) }")
    code = main(
        ["search", "--model", "llama-8b", "--cluster", "h100-80gb", "--gpus", "64", "--schedules", "1f1b", str(mine)]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "[missing-action]" in err and f"{mine}:" in err and "the search stopped at plan" in err


def test_a_require_drops_the_plan_and_names_the_rule(tmp_path: Path) -> None:
    mine = _write(tmp_path, "mine", "    for i in 0 .. microbatches { F(i) B(i) }")
    text = mine.read_text().replace(
        "  stages pp", '  require microbatches >= 2 * pp, "needs 2pp microbatches"\n  stages pp'
    )
    mine.write_text(text)
    frame = search(MODEL, CLUSTER, 64, global_batch=512, schedules=["1f1b"], extra_schedules=[mine])
    dropped = frame.attrs["dropped"]
    assert dropped["rejected by mine's require (line 2): needs 2pp microbatches"] > 0
    assert dropped["rejected by 1f1b's require (line 12): 1F1B needs at least as many microbatches as stages"] > 0
    assert not any(reason.startswith(("invalid schedule", "rejected by the schedule")) for reason in dropped)


def test_a_failed_require_is_its_own_kind_of_error() -> None:
    from pipedsl import parse

    with pytest.raises(RequirementFailed) as caught:
        parse("schedule t(pp = 2) {\n  require pp > 3\n  stages 1 devices 1 place s -> 0 device 0: 0F0 0B0\n}")
    assert caught.value.requirement == "pp > 3"


def test_one_ratio_convention_in_words() -> None:
    from pipedsl.simulator.speed import relative_speed

    assert relative_speed(1.0, 1.06) == "1.06x faster"
    assert relative_speed(1.06, 1.0) == "1.06x slower"
    assert relative_speed(1.0, 1.004) == "as fast"


def test_simulate_and_search_say_slower_in_words(capsys: pytest.CaptureFixture[str]) -> None:
    # 1F1B takes 33 s, ZB-H1 27 s at the default costs: 1F1B is 33 / 27 = 1.22x slower.
    assert main(["simulate", "1f1b", "zb_h1", "-p", "pp=4", "-p", "microbatches=8"]) == 0
    out = capsys.readouterr().out
    assert "1.22x slower" in out and "best" in out
    # No ratio without its direction in words.
    assert re.findall(r"\d+\.\d+x(?! faster| slower)", out) == []


def test_estimate_refuses_a_plan_past_any_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    big = str(10**12)
    code = main(["estimate", "--model", "llama-8b", "--cluster", "h100-80gb", "--dp", big, "--global-batch", big])
    assert code == 2 and "the estimator plans for at most 1,048,576 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("prune", ["0.5", "nan", "x"])
def test_a_prune_factor_below_one_is_a_usage_error_in_the_cli_words(
    prune: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["search", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--gpus", "64", "--global-batch", "64"]
    assert main([*args, "--prune", prune]) == 2
    err = capsys.readouterr().err
    assert "argument --prune" in err and "factor >= 1" in err and "None" not in err
