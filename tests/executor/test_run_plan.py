"""``pipedsl run --plan N``: a searched plan with selective recomputation, sequence
parallelism and tp = 2, run on the scaled-down model of its family, prints the configuration
it runs, which matches the plan's row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import fresh_process_env
from pipedsl.simulator.search import search

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
