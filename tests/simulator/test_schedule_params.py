"""A schedule's own parameters in plans: ``estimate`` and ``search`` with ``-p NAME=VALUE``,
and the stages per device a schedule fixes (``zbv``) taken without ``--vpp``."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipedsl.cli.main import main
from pipedsl.simulator.candidates import candidate_plans
from pipedsl.simulator.estimate import estimate
from pipedsl.simulator.hardware import load_cluster, load_model
from pipedsl.simulator.plan import Plan, PlanError

ESTIMATE = ["estimate", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--dp", "16", "--tp", "8", "--pp", "8",
            "--global-batch", "1536", "--recompute", "selective", "--zero", "1", "--json"]  # fmt: skip


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*ESTIMATE, *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_prices_a_policy_at_the_limit_it_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    default = run_json(capsys, "--schedule", "zb_auto")
    wider = run_json(capsys, "--schedule", "zb_auto", "-p", "max_inflight=16")
    assert wider["plan"]["schedule_params"] == {"max_inflight": 16}
    # More microbatches in flight: more activation memory, no longer a step.
    assert wider["memory"]["activations"] > default["memory"]["activations"]
    assert wider["step_time_s"] <= default["step_time_s"] * (1 + 1e-9)


def test_estimate_takes_zbvs_two_stages_per_device_without_vpp(capsys: pytest.CaptureFixture[str]) -> None:
    placed = run_json(capsys, "--schedule", "zbv")
    assert placed["plan"]["vpp"] == 2
    layers = run_json(capsys, "--schedule", "zbv", "--stage-layers", ",".join(["6"] * 16))
    assert layers["plan"]["stage_layers"] == [6] * 16
    assert main([*ESTIMATE, "--schedule", "zbv", "--vpp", "1"]) != 0
    assert "this schedule needs vpp = 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "zb_auto", "-p", "max_inflight=16", "-p", "max_inflight=8"],
         "parameter max_inflight is given twice: max_inflight=16 and max_inflight=8"),
        (["--schedule", "zb_h1", "-p", "max_inflight=16"], "schedule zb_h1 has no parameter 'max_inflight'"),
        (["--schedule", "zb_auto", "-p", "pp=4"], "pp is the plan's own"),
    ],
)  # fmt: skip
def test_estimate_refuses_schedule_parameters_it_cannot_use(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main([*ESTIMATE, *argv]) != 0
    err = capsys.readouterr().err
    assert message in err
    # One line of ours (after argparse's usage lines, for a usage error), no traceback.
    assert "Traceback" not in err and [line for line in err.splitlines() if message in line] == [err.splitlines()[-1]]


def test_search_passes_a_parameter_to_the_schedules_that_declare_it() -> None:
    model, cluster = load_model("gpt3-175b"), load_cluster("a100-80gb")
    plans = list(
        candidate_plans(model, cluster, 1024, global_batch=1536, schedules=["zb_auto", "1f1b"],
                        schedule_params={"max_inflight": 12})
    )  # fmt: skip
    pipeline = [p for p in plans if p.schedule is not None]
    assert pipeline and all(p.schedule_params == (("max_inflight", 12),) for p in pipeline)
    assert all(p.schedule_params == () for p in plans if p.schedule is None)
    # The policy is then ranked at that limit only; 1F1B takes no such parameter and ignores it.
    one = next(p for p in pipeline if p.schedule == "zb_auto" and p.pp == 8 and p.tp == 8 and p.zero == 1)
    assert estimate(model, cluster, one).plan.schedule_params == (("max_inflight", 12),)
    with pytest.raises(PlanError, match="no schedule tried takes a parameter 'nothing'"):
        list(candidate_plans(model, cluster, 64, global_batch=64, schedules=["1f1b"], schedule_params={"nothing": 1}))


def test_search_ranks_a_policys_limits_and_one_given_limit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["search", "--model", "llama-8b", "--cluster", "h100-80gb", "--gpus", "8", "--global-batch", "64",
            "--schedules", "zbv_auto", "--no-prune", "--csv"]  # fmt: skip
    limits = {}
    for extra in ([], ["-p", "max_inflight=4"]):
        out = tmp_path / f"plans{len(extra)}.csv"
        assert main([*argv, str(out), *extra]) == 0
        frame = pd.read_csv(out)
        capsys.readouterr()
        # --no-prune ranks every plan that fits (else the rows past the tables are bounded only).
        limits[bool(extra)] = set(frame.loc[frame["schedule"] == "zbv_auto", "inflight_limit"])
    assert len(limits[False]) > 1  # several limits ranked, each a plan of its own
    assert limits[True] == {4}


def test_plan_checks_schedule_params() -> None:
    with pytest.raises(PlanError, match="need a pipeline schedule"):
        Plan(global_batch=8, schedule_params=(("max_inflight", 4),))
    with pytest.raises(PlanError, match="needs a whole number"):
        Plan(global_batch=8, pp=2, schedule="zb_auto", schedule_params=(("max_inflight", "4"),))  # type: ignore[arg-type]
