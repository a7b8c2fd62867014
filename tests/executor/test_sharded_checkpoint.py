"""Pipeline.save and Pipeline.restore on the local backend: one orbax checkpoint per
pipeline device, read back onto the same plan's meshes or another plan's, refused for
another model. (The Ray world's, each process writing its own shards, is tested in
tests/ray/test_ray_world_state.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import HYBRID_ADAM, assert_relative_close, assert_saved_params, hybrid, hybrid_problem, hybrid_schedule
from pipedsl.executor import ExecutionError
from pipedsl.executor.backend import Resident


def test_a_hybrid_plan_resumes_from_its_sharded_checkpoint_on_any_plan_of_its_model(tmp_path: Path) -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", 2, 2)
    with hybrid("explicit", schedule, dp=2, tp=2, zero=1) as pipe:
        with pytest.raises(ExecutionError, match="nothing to save yet"):
            pipe.save(str(tmp_path), step=0)
        held, state, _ = pipe.train_step(params, None, batch, optimizer=HYBRID_ADAM)
        version = pipe.save(str(tmp_path), step=1)
        saved_params = pipe.gather(held)
        held, state, _ = pipe.train_step(held, state, batch, optimizer=HYBRID_ADAM)
        pipe.save(str(tmp_path), step=2)
        saved_step_2 = pipe.gather(held)
        held, state, expected_loss = pipe.train_step(held, state, batch, optimizer=HYBRID_ADAM)
        expected = pipe.gather(held)
    assert sorted(p.name for p in Path(version).iterdir()) == ["device-0", "device-1", "plan.json"]
    # Orbax alone reads each device's part back, as numpy on one device.
    assert_saved_params(version, saved_params)
    # The latest version, on the same plan: the run goes on as if never stopped.
    with hybrid("explicit", schedule, dp=2, tp=2, zero=1) as again:
        held, state, step = again.restore(str(tmp_path), like_params=params, batch=batch, optimizer=HYBRID_ADAM)
        assert step == 2 and isinstance(state, Resident)
        held, state, loss = again.train_step(held, state, batch, optimizer=HYBRID_ADAM)
        assert_relative_close(loss, expected_loss)
        assert_relative_close(again.gather(held), expected)
        with pytest.raises(ExecutionError, match="already holds a saved step 2"):
            again.save(str(tmp_path), step=2)
    # The parameters alone, for a step with a fresh optimizer state.
    with hybrid("explicit", schedule, dp=2, tp=2, zero=1) as fresh:
        held, state, step = fresh.restore(str(tmp_path), like_params=params, batch=batch)
        assert step == 2 and state is None
        assert_relative_close(fresh.gather(held), saved_step_2)
    # Another schedule, placement and mesh: both stages on one device of two data-parallel
    # ranks, without ZeRO, reading from both saved devices.
    with hybrid("explicit", hybrid_schedule("interleaved_1f1b", 1, 2), dp=2, tp=1, zero=0) as other:
        held, state, step = other.restore(str(tmp_path), like_params=params, batch=batch, optimizer=HYBRID_ADAM)
        assert step == 2
        held, state, loss = other.train_step(held, state, batch, optimizer=HYBRID_ADAM)
        assert_relative_close(loss, expected_loss)
        assert_relative_close(other.gather(held), expected)
    _, marked_params, *_ = hybrid_problem("marked", 2, 2)
    with hybrid("marked", schedule, dp=2, tp=2, zero=1) as other_model:
        with pytest.raises(ExecutionError, match=r"step-2 holds another model's parameters \(parameters: "):
            other_model.restore(str(tmp_path), like_params=marked_params, batch=batch, optimizer=HYBRID_ADAM)
    shutil.rmtree(tmp_path / "step-2" / "device-1")
    with hybrid("explicit", schedule, dp=2, tp=2, zero=1) as broken:
        with pytest.raises(ExecutionError, match=r"device 1 could not read .*step-2/device-1: FileNotFoundError"):
            broken.restore(str(tmp_path), like_params=params, batch=batch, optimizer=HYBRID_ADAM)
