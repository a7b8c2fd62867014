"""The CPU dry run of bench/accel_check.sh: without a GPU or TPU it runs its checks at toy
sizes on forced CPU devices, prints one table with each check's seconds, writes one JSON
line (and appends the run to a results folder when asked), and never imports Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import fresh_process_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_accel_check_runs_its_checks_on_the_cpu(tmp_path: Path) -> None:
    env = fresh_process_env()
    env["PY"] = sys.executable
    checks = "fp32,recompute-selective,hybrid,no-such-check"
    bad = subprocess.run(
        ["bash", "bench/accel_check.sh", str(tmp_path), "--checks", checks], capture_output=True, text=True, cwd=ROOT,
        env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "unknown checks ['no-such-check']" in bad.stderr
    folder = tmp_path / "results"
    out = subprocess.run(
        ["bash", "bench/accel_check.sh", str(tmp_path), "--checks", checks.rsplit(",", 1)[0], "--results", str(folder)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    table = out.stdout[out.stdout.index("check ") :]
    for name in ("setup", "compile-ahead", "fp32", "recompute-selective", "hybrid"):
        assert any(line.split()[:2] == [name, "ok"] for line in table.splitlines() if line.strip())
    (line,) = (tmp_path / "results.json").read_text().splitlines()
    results = json.loads(line)
    assert results["platform"] == "cpu" and results["device_kind"] == "cpu" and results["devices"] == 8
    assert results["checks"] == {"fp32": "ok", "recompute-selective": "ok", "hybrid": "ok"}
    # A check whose programs ran ahead may take no measurable time.
    assert all(0 <= t["compile_s"] and 0 <= t["seconds"] < results["seconds"] for t in results["times"].values())
    assert results["ray_imported"] is False
    assert results["results"]["fp32"]["grad_rel_error"] < 1e-5
    assert results["results"]["recompute_selective"]["grad_rel_error"] < 1e-5
    assert results["results"]["hybrid"] == {**results["results"]["hybrid"], "dp": 2, "tp": 2, "pp": 2}
    (run,) = (folder / "accel_check.jsonl").read_text().splitlines()
    figures = json.loads(run)["figures"]
    assert figures["platform"] == "cpu" and figures["fp32"] == "ok" and figures["fp32_s"] >= 0
    assert figures["hybrid_grad_rel_error"] == results["results"]["hybrid"]["grad_rel_error"]
