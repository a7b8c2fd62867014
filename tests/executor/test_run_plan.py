"""``pipedsl run --plan N``: a searched plan with selective recomputation, sequence
parallelism and tp = 2, run on the scaled-down model of its family, prints the configuration
it runs, which matches the plan's row; a plan, its search row and the command that runs it
give the same :class:`~pipedsl.RunOptions`."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import fresh_process_env
from pipedsl import PipedslError, RunOptions
from pipedsl.cli import main
from pipedsl.cli.planned import PlannedRun
from pipedsl.cli.workload import DEMO_MODEL
from pipedsl.simulator.hardware import Model, load_model
from pipedsl.simulator.plan import Plan, PlanError
from pipedsl.simulator.search import search

LLAMA = load_model("llama-8b")

PLANS = [
    # (plan, model, the options it runs with)
    (
        Plan(tp=2, pp=2, global_batch=4, schedule="1f1b", recompute="selective"),
        LLAMA,
        RunOptions(tp=2, recompute="selective", precision="bf16", sequence_parallel=True),
    ),
    (
        Plan(dp=2, pp=2, cp=2, global_batch=8, schedule="zbv", vpp=2, zero=2, reduce_once=True),
        DEMO_MODEL,
        RunOptions(dp=2, cp=2, zero=2, reduce_once=True),
    ),
    (
        # sequence parallelism without tensor parallelism changes nothing the planner
        # prices: the options leave it out.
        Plan(dp=4, global_batch=8, zero=1, recompute="full"),
        LLAMA,
        RunOptions(dp=4, zero=1, recompute="full", precision="bf16"),
    ),
]


def _row(plan: Plan, model: Model) -> dict[str, Any]:
    """``plan`` as a search writes it in ``plans.csv``."""
    kind = "spmd" if plan.pp == 1 else "pipeline" if plan.dp == plan.tp == plan.cp == 1 else "hybrid"
    return {"rank": 1, "kind": kind, **plan.to_json(), "model": model.name, "step_time_s": 1.0}


@pytest.mark.parametrize(("plan", "model", "options"), PLANS, ids=["pipeline", "hybrid", "spmd"])
def test_a_plan_and_its_search_row_run_with_the_same_options(plan: Plan, model: Model, options: RunOptions) -> None:
    assert plan.run_options(model) == options
    assert PlannedRun.from_row(_row(plan, model)).run_options(model) == options


def test_a_plan_run_otherwise_than_priced_gives_no_options() -> None:
    keep = Plan(dp=2, global_batch=2, zero=3, reshard_after_forward=False)
    with pytest.raises(PlanError, match="reshard_after_forward = false"):
        keep.run_options(LLAMA)
    with pytest.raises(PipedslError, match="which the executor does not do"):
        PlannedRun.from_row(_row(keep, LLAMA)).run_options(LLAMA)


def test_run_plan_builds_the_options_of_its_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan, model, options = PLANS[0]
    plans = tmp_path / "plans.csv"
    row = _row(plan, model)
    with plans.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    code = main(["run", "--plan", "1", "--plans", str(plans), "--steps", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    (configuration,) = [line for line in out.splitlines() if line.startswith("configuration:")]
    fields = dict(item.split("=") for item in configuration.removeprefix("configuration: ").split())
    ran = RunOptions(
        dp=int(fields["dp"]), tp=int(fields["tp"]), cp=int(fields["cp"]), zero=int(fields["zero"]),
        reduce_once=fields["reduce_once"] == "true", recompute=fields["recompute"],  # type: ignore[arg-type]
        precision=fields["precision"], sequence_parallel=fields["sequence_parallel"] == "true",  # type: ignore[arg-type]
    )  # fmt: skip
    assert ran == options


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_searched_llama_plan_runs_as_ranked(tmp_path: Path) -> None:
    frame = search(
        "llama-8b", "h200", 8, global_batch=8, schedules=["1f1b"], recompute=["selective"], flash_attention=False,
        prune=None,
    )  # fmt: skip
    csv = tmp_path / "plans.csv"
    frame.to_csv(csv, index=False)
    rows = frame[(frame.tp == 2) & (frame.pp == 2) & (frame.kind == "pipeline")]
    row = rows.iloc[0]
    assert row.recompute == "selective" and bool(row.sequence_parallel) and not bool(row.flash_attention)
    # A fresh process without the device count: the command gives JAX its devices itself.
    env = fresh_process_env()
    out = subprocess.run(
        [sys.executable, "-m", "pipedsl", "run", "--plan", str(row["rank"]), "--plans", str(csv), "--steps", "2"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("scaled down: llama-8b (32 layers, hidden 4096, ffn 14336, 32 heads / 8 kv")
    assert "runs as llama (2 layers, hidden 64" in lines[1] and "8 heads / 2 kv" in lines[1]
    (configuration,) = [line for line in lines if line.startswith("configuration:")]
    fields = dict(item.split("=") for item in configuration.removeprefix("configuration: ").split())
    assert fields == {
        "schedule": "1f1b",
        "dp": str(row.dp),
        "tp": "2",
        "cp": str(row.cp),
        "pp": "2",
        "vpp": str(row.vpp),
        "microbatches": str(row.microbatches),
        "zero": str(row.zero),
        "reduce_once": "false",
        "recompute": "selective",
        "sequence_parallel": "true",
        "flash_attention": "false",
        "precision": "bf16",
    }
    losses = [float(line.split()[1]) for line in lines if line.split() and line.split()[0] in ("1", "2")]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
