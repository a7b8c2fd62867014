"""Tasks: a device's consecutive computes dispatched as one program (pipedsl.tasks)."""

from __future__ import annotations

import numpy as np
import pytest

import pipedsl
from pipedsl.program import Compute, Recv, Send
from pipedsl.simulator import CostModel, simulate
from pipedsl.tasks import MAX_COMPUTES, device_tasks, task_starts

LIBRARY = [
    ("1f1b", {"pp": 4, "microbatches": 8}),
    ("gpipe", {"pp": 4, "microbatches": 8}),
    ("zb_h1", {"pp": 4, "microbatches": 8}),
    ("dualpipev", {"pp": 4, "microbatches": 8}),
    ("interleaved_1f1b", {"pp": 4, "vpp": 2, "microbatches": 8}),
    ("zbv", {"pp": 4, "microbatches": 8}),
    ("1f1b", {"pp": 1, "microbatches": 6}),
]


@pytest.mark.parametrize(("name", "params"), LIBRARY)
def test_tasks_hold_nothing_back_and_wait_for_nothing_more(name: str, params: dict[str, int]) -> None:
    program = pipedsl.lower(pipedsl.load(name, **params))
    starts = task_starts(program.arrays)
    bounds = program.arrays.actions.bounds
    for d, device in enumerate(program.devices):
        tasks = device_tasks(device)
        # The same cut read off the instructions as off the arrays, covering every instruction.
        assert len(tasks) == int(starts[bounds[d] : bounds[d + 1]].sum())
        assert tasks[0][0] == 0 and tasks[-1][1] == len(device.instructions)
        assert all(a[1] == b[0] for a, b in zip(tasks, tasks[1:], strict=False))
        for start, stop in tasks:
            kinds = [type(i) for i in device.instructions[start:stop]]
            computes = [k for k, kind in enumerate(kinds) if kind is Compute]
            assert 1 <= len(computes) <= MAX_COMPUTES
            # Receives only before the first compute, sends only after the last.
            assert Recv not in kinds[computes[0] :] and Send not in kinds[: computes[-1]]


def test_the_last_stage_fuses_each_microbatchs_forward_and_backward() -> None:
    program = pipedsl.lower(pipedsl.load("1f1b", pp=4, microbatches=8))
    last = program.devices[3]
    tasks = device_tasks(last)
    assert len(tasks) == 8
    for m, (start, stop) in enumerate(tasks):
        actions = [str(i.action) for i in last.instructions[start:stop] if isinstance(i, Compute)]
        assert actions == [f"3F{m}", f"3B{m}"]
    # Fewer tasks than actions in all, one compute each where every compute talks to a neighbour.
    assert [len(device_tasks(d)) for d in program.devices] == [12, 16, 16, 8]


def test_one_compute_a_task_when_asked_and_the_bound_is_checked() -> None:
    program = pipedsl.lower(pipedsl.load("1f1b", pp=2, microbatches=4))
    assert task_starts(program.arrays, max_computes=1).all()
    assert all(len(device_tasks(d, max_computes=1)) == 8 for d in program.devices)
    with pytest.raises(ValueError, match="max_computes must be at least 1"):
        task_starts(program.arrays, max_computes=0)


@pytest.mark.parametrize(("name", "params"), LIBRARY[:5])
def test_a_dispatch_per_task_adds_to_each_device_exactly_its_tasks(name: str, params: dict[str, int]) -> None:
    program = pipedsl.lower(pipedsl.load(name, **params))
    base = CostModel(forward=1.0, backward=2.0, latency=0.1)
    free, paid = (
        simulate(program, base),
        simulate(program, CostModel(forward=1.0, backward=2.0, latency=0.1, dispatch=0.25)),
    )
    tasks = np.bincount(program.arrays.actions.device, weights=task_starts(program.arrays))
    np.testing.assert_allclose(paid.timeline.busy() - free.timeline.busy(), 0.25 * tasks)
    # A dispatch may fill a device's idle time, never shorten the step.
    assert free.makespan < paid.makespan <= free.makespan + 0.25 * tasks.sum()
