"""The estimator against measured training runs (data/published_runs.csv).

Each row is a published Megatron-LM run on A100-80GB nodes with its exact configuration.
Rows that report achieved TFLOP/s per GPU instead of a time are turned into iteration
times with the paper's own FLOP count (Narayanan et al. 2021, equation 3, which counts
the recomputed forward): time = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) / (GPUs × TFLOP/s).
The A100 preset's ``matmul_efficiency`` was calibrated once on all rows together (the
value in steps of 0.01 with the lowest mean error; see data/README.md); nothing is fitted
per row. Run with ``-s`` to see the per-row table.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from pipedsl.simulator.estimate import estimate
from pipedsl.simulator.hardware import Model, load_cluster
from pipedsl.simulator.pipelines import Pipelines
from pipedsl.simulator.plan import Plan

DATA = Path(__file__).resolve().parents[2] / "data"
_COUNTS = ("layers", "hidden", "ffn_hidden", "heads", "seq_len", "vocab", "gpus", "dp", "tp", "pp", "vpp",
           "microbatch_size", "global_batch")  # fmt: skip
MAPE_LIMIT = 0.06
ROW_LIMIT = 0.12


@dataclass(frozen=True, slots=True)
class Row:
    run: str
    source: str
    model: Model
    plan: Plan
    measured_s: float


def _rows() -> list[Row]:
    rows = []
    with (DATA / "published_runs.csv").open(newline="") as handle:
        for r in csv.DictReader(handle):
            n = {k: int(r[k]) for k in _COUNTS}
            model = Model(name=r["run"], layers=n["layers"], hidden=n["hidden"], ffn_hidden=n["ffn_hidden"],
                          heads=n["heads"], seq_len=n["seq_len"], vocab=n["vocab"])  # fmt: skip
            plan = Plan(
                dp=n["dp"],
                tp=n["tp"],
                pp=n["pp"],
                vpp=n["vpp"],
                microbatch_size=n["microbatch_size"],
                global_batch=n["global_batch"],
                recompute=r["recompute"],
                sequence_parallel=r["sequence_parallel"] == "true",
                flash_attention=r["flash_attention"] == "true",
                dp_overlap=float(r["dp_overlap"]),
                schedule=r["schedule"] or None,
            )
            assert plan.gpus == n["gpus"], r["run"]
            reported = float(r["reported"])
            if r["metric"] == "tflops_per_gpu":
                b, s, l, h, v = plan.global_batch, model.seq_len, model.layers, model.hidden, model.vocab
                flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
                measured = flops / (plan.gpus * reported * 1e12)
            else:
                assert r["metric"] == "iteration_time_s", r["metric"]
                measured = reported
            rows.append(Row(r["run"], r["source"], model, plan, measured))
    return rows


def test_every_source_is_cited() -> None:
    readme = (DATA / "README.md").read_text()
    for row in _rows():
        assert row.source in readme, f"{row.run}: source {row.source} is not described in data/README.md"


def test_published_runs_within_error() -> None:
    cluster = load_cluster("a100-80gb")
    pipelines = Pipelines(keep_simulations=False)
    errors = []
    lines = [f"{'run':28} {'source':24} {'GPUs':>5} {'measured s':>11} {'predicted s':>12} {'error':>7}"]
    for row in _rows():
        predicted = estimate(row.model, cluster, row.plan, pipelines=pipelines)
        assert predicted.fits, f"{row.run} ran, so it must fit: {predicted.memory}"
        error = (predicted.step_time_s - row.measured_s) / row.measured_s
        errors.append(error)
        lines.append(
            f"{row.run:28} {row.source:24} {row.plan.gpus:5d} {row.measured_s:11.3f} "
            f"{predicted.step_time_s:12.3f} {100 * error:+6.1f}%"
        )
    mape = sum(abs(e) for e in errors) / len(errors)
    lines.append(f"mean absolute percentage error over {len(errors)} runs: {100 * mape:.1f}%")
    print("\n" + "\n".join(lines))
    assert mape < MAPE_LIMIT
    worst = max(errors, key=abs)
    assert abs(worst) < ROW_LIMIT, f"worst row error {100 * worst:+.1f}%"
