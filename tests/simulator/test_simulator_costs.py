"""The cost model: defaults, per-stage values, checks, TOML files and per-device shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import gpipe, one_f_one_b
from pipedsl.errors import PipedslError
from pipedsl.library import library_path, load
from pipedsl.simulator import CostError, CostModel
from pipedsl.stage_costs import UNIFORM, StageCosts


def test_defaults_backward_twice_forward_and_halves() -> None:
    costs = CostModel(forward=1.5).resolve(gpipe(3, 2))
    assert costs.forward == (1.5, 1.5, 1.5)
    assert costs.backward == (3.0, 3.0, 3.0)
    assert costs.input_grad == costs.weight_grad == (1.5, 1.5, 1.5)
    assert costs.activation_transfer == costs.gradient_transfer == (0.0, 0.0, 0.0)
    assert costs.residual_bytes == costs.weight_residual_bytes == (0, 0, 0)
    assert costs.overlap_sends


def test_the_default_cost_model_is_the_cores_uniform_costs() -> None:
    # The core synthesises a policy without costs under StageCosts.uniform; the simulator, the
    # executor and the command line say "the default cost model" of the same order.
    for schedule in (gpipe(3, 2), load(library_path("zbv"), pp=2, microbatches=4)):
        assert CostModel().resolve(schedule) == StageCosts.uniform(schedule)
    assert CostModel().describe() == UNIFORM


def test_backward_defaults_to_its_halves_when_both_given() -> None:
    costs = CostModel(forward=1, input_grad=(1, 2), weight_grad=0.5).resolve(gpipe(2, 1))
    assert costs.backward == (1.5, 2.5)
    assert costs.input_grad == (1.0, 2.0)
    assert costs.weight_grad == (0.5, 0.5)


def test_given_backward_sets_unset_halves() -> None:
    costs = CostModel(forward=1, backward=(4, 6), weight_grad=1).resolve(gpipe(2, 1))
    assert costs.input_grad == (2.0, 3.0)
    assert costs.weight_grad == (1.0, 1.0)


def test_transfers_follow_alpha_beta_per_boundary() -> None:
    # Three stages, two boundaries: 0.5 s latency + 500 or 1000 bytes at 1000 B/s.
    costs = CostModel(latency=0.5, bandwidth=1000, activation_bytes=(500, 1000)).resolve(gpipe(3, 1))
    # Stage s's activation crosses boundary s; the gradient of stage s's input crosses s-1.
    assert costs.activation_transfer == (1.0, 1.5, 0.0)
    assert costs.gradient_transfer == (0.0, 1.0, 1.5)
    grads = CostModel(latency=0, bandwidth=1000, activation_bytes=500, gradient_bytes=(2000, 0)).resolve(gpipe(3, 1))
    assert grads.activation_transfer == (0.5, 0.5, 0.0)
    assert grads.gradient_transfer == (0.0, 2.0, 0.0)


def test_bytes_cost_no_time_without_bandwidth() -> None:
    costs = CostModel(latency=0.25, activation_bytes=10**9).resolve(gpipe(2, 1))
    assert costs.activation_transfer == (0.25, 0.0)


def test_weight_residual_defaults_to_residual() -> None:
    costs = CostModel(residual_bytes=(100, 300)).resolve(gpipe(2, 1))
    assert costs.weight_residual_bytes == (100, 300)
    split = CostModel(residual_bytes=1.6e7, weight_residual_bytes=(4e6, 0)).resolve(gpipe(2, 1))
    assert split.residual_bytes == (16_000_000, 16_000_000)
    assert split.weight_residual_bytes == (4_000_000, 0)


def test_per_device_splits_compute_and_residuals_over_held_stages() -> None:
    schedule = load(library_path("interleaved_1f1b"), pp=2, vpp=2, microbatches=2)
    costs = CostModel(forward=(1, 2, 3, 4), residual_bytes=101, activation_bytes=64, latency=0.1, per_device=True)
    resolved = costs.resolve(schedule)
    assert resolved.forward == (0.5, 1.0, 1.5, 2.0)
    assert resolved.backward == (1.0, 2.0, 3.0, 4.0)
    assert resolved.residual_bytes == (50, 50, 50, 50)  # 50.5 rounds to even
    assert resolved.activation_transfer == (0.1, 0.1, 0.1, 0.0)  # bytes do not split


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forward": -1.0}, "forward must be a finite number >= 0, got -1.0"),
        ({"backward": (1.0, -2.0)}, "backward[1] must be a finite number >= 0"),
        ({"input_grad": float("nan")}, "input_grad must be a finite number"),
        ({"weight_grad": float("inf")}, "weight_grad must be a finite number"),
        ({"latency": -0.1}, "latency must be a finite number >= 0"),
        ({"bandwidth": 0}, "bandwidth must be > 0 bytes per second"),
        ({"forward": "1"}, "forward must be a number, got '1'"),
        ({"forward": True}, "forward must be a number, got True"),
        ({"forward": ()}, "forward is an empty list"),
        ({"activation_bytes": 0.5}, "activation_bytes must be a whole number of bytes, got 0.5"),
        ({"residual_bytes": (1, -1)}, "residual_bytes[1] must be a finite number >= 0"),
        ({"overlap_sends": 1}, "overlap_sends must be true or false"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(CostError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        CostModel(**kwargs)


def test_cost_error_is_a_pipedsl_error() -> None:
    assert issubclass(CostError, PipedslError)


def test_construction_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        CostModel(1.0)  # type: ignore[misc]
    costs = CostModel()
    with pytest.raises(AttributeError):
        costs.forward = 2.0  # type: ignore[misc]


def test_per_stage_lengths_must_fit_the_schedule() -> None:
    with pytest.raises(CostError, match="forward lists 3 values but the schedule has 4 stages"):
        CostModel(forward=(1, 2, 3)).resolve(one_f_one_b(4, 4))
    with pytest.raises(CostError, match="activation_bytes lists 4 values but the schedule has 3 stage boundaries"):
        CostModel(activation_bytes=(1, 2, 3, 4)).resolve(one_f_one_b(4, 4))


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "costs.toml"
    path.write_text(
        "forward = 1.0\nbackward = [2.0, 2.0, 3.0]\nlatency = 20e-6\nbandwidth = 25e9\n"
        "activation_bytes = 16777216\nresidual_bytes = 2.68435456e8\noverlap_sends = false\n"
    )
    costs = CostModel.from_toml(path)
    assert costs == CostModel(
        forward=1.0,
        backward=(2.0, 2.0, 3.0),
        latency=20e-6,
        bandwidth=25e9,
        activation_bytes=16777216,
        residual_bytes=268435456,
        overlap_sends=False,
    )
    assert costs.resolve(gpipe(3, 1)).activation_transfer[0] == pytest.approx(20e-6 + 16777216 / 25e9, rel=1e-15)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("forwrd = 1\n", "unknown cost key 'forwrd'; known keys are"),
        ("forward = -2\n", "forward must be a finite number >= 0, got -2"),
        ("forward = [1, 'x']\n", r"forward\[1\] must be a number"),
        ("forward = \n", "not valid TOML"),
    ],
)
def test_bad_toml_names_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(CostError, match=message) as info:
        CostModel.from_toml(path)
    assert str(path) in str(info.value)


def test_missing_toml_file(tmp_path: Path) -> None:
    with pytest.raises(CostError, match="cannot read cost file"):
        CostModel.from_toml(tmp_path / "none.toml")


def test_with_changes_checks_again() -> None:
    assert CostModel().with_changes(forward=2.0).forward == 2.0
    with pytest.raises(CostError):
        CostModel().with_changes(latency=-1.0)


def test_describe_and_json() -> None:
    costs = CostModel(forward=(1, 2), latency=0.1, overlap_sends=False)
    assert costs.describe() == "F=[1,2] B=2F I=B/2 W=B/2 comm=0.1s blocking-sends"
    data = costs.to_json()
    assert data["forward"] == [1.0, 2.0]
    assert data["backward"] is None
    assert data["overlap_sends"] is False
    assert CostModel.from_mapping(data) == costs


def test_simulate_names_costs_that_are_not_a_cost_model() -> None:
    from pipedsl.simulator import simulate

    with pytest.raises(PipedslError, match="simulate: costs must be a CostModel, .* got str"):
        simulate(one_f_one_b(2, 2), "uniform")  # type: ignore[arg-type]
