"""The local backend dispatches the stage programs in :func:`pipedsl.program.dispatch_order`
where every pipeline device is a mesh of several JAX devices (sends are asynchronous copies,
so no receive waits for a computation): the order the simulator runs such devices' programs
in, one at a time, as XLA's CPU client does (``bench/bench_host_sharing.py``). A task of
several computes (:mod:`pipedsl.tasks`) dispatches them as one program, in their order."""

from __future__ import annotations

from typing import Any

import jax
import pytest

import pipedsl
from helpers import HYBRID_ADAM, hybrid, hybrid_problem, hybrid_schedule
from pipedsl.arrays import KIND_CODE, B, F, I, W
from pipedsl.executor.runtime.interpreter import DeviceRuntime
from pipedsl.executor.stages.stage_program import StageProgram
from pipedsl.program import Compute, dispatch_order

_KINDS = {"forward": F, "backward": B, "backward_input": I, "backward_weight": W}


@pytest.mark.parametrize(("name", "pp", "vpp"), [("1f1b", 2, 1), ("zb_h1", 2, 1), ("interleaved_1f1b", 2, 2)])
def test_the_local_backend_dispatches_in_dispatch_order(
    name: str, pp: int, vpp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    schedule = hybrid_schedule(name, pp, vpp)
    dispatched: list[tuple[int, int]] = []
    fused: list[bool] = []  # inside a task's program: its stage programs are called while it is traced

    def logged(method: str) -> Any:
        original = getattr(StageProgram, method)

        def call(self: StageProgram, *args: Any) -> Any:
            if not fused:
                dispatched.append((_KINDS[method], self.stage))
            return original(self, *args)

        return call

    def logged_task(self: DeviceRuntime, start: int, stop: int, slots: Any) -> Any:
        run = task(self, start, stop, slots)
        computes = [
            (KIND_CODE[i.action.kind], i.action.stage)
            for i in self.program.instructions[start:stop]
            if isinstance(i, Compute)
        ]

        def logged_run(state: Any) -> None:
            dispatched.extend(computes)
            fused.append(True)
            try:
                run(state)
            finally:
                fused.pop()

        return logged_run

    for method in _KINDS:
        monkeypatch.setattr(StageProgram, method, logged(method))
    task = DeviceRuntime._task
    monkeypatch.setattr(DeviceRuntime, "_task", logged_task)
    _, params, batch, _, _ = hybrid_problem("explicit", schedule.num_stages, 2)
    with hybrid("explicit", schedule, dp=2, tp=1, zero=0) as pipe:
        pipe.train_step(params, None, batch, optimizer=HYBRID_ADAM)  # compiles
        dispatched.clear()
        jax.block_until_ready(pipe.train_step(params, None, batch, optimizer=HYBRID_ADAM))
    arrays = pipedsl.lower(schedule).arrays
    expected = [(int(arrays.actions.kind[r]), int(arrays.actions.stage[r])) for r in dispatch_order(arrays)]
    assert dispatched == expected
