"""Tasks: a device's consecutive computes dispatched as one program.

On pipeline devices of their own, the executor dispatches every compute of a step from
the host, and each dispatch costs host time whatever the compute's size (on a TPU v5e
host about 125 us, plus a few microseconds per argument and result buffer: a stage's
forward returns dozens of residual buffers). A *task* is a run of one device's computes
that the executor dispatches as one program, so that the values passed between them
(a forward's residuals, a backward's input to the next forward) never leave the device
program and the host dispatches once.

A compute joins the task of the compute before it on its device when

- that compute sends nothing to another device (no device waits for a value the task
  would hold back until its end), and
- it receives nothing from another device (its inputs are the device's own, so the
  task need not wait for a value before its first compute could start), and
- the task holds fewer than :data:`MAX_COMPUTES` computes.

Under these rules a task runs exactly when its computes would run one after another on
the device (a device runs its computes in order anyway): fusing changes no time but the
host's. Typical tasks: the last stage's ``F`` and ``B`` of a microbatch (``F`` sends
nothing there, ``B`` receives nothing), the first stage's ``B`` and the ``F`` after it,
a ``W`` and what follows it when that receives nothing.

The executor dispatches tasks (``executor/runtime/interpreter.py``) and the simulator
charges each task one dispatch (:class:`pipedsl.simulator.CostModel`'s ``dispatch``), both
from this one rule. A recorded step, which times every compute, dispatches one compute a
task (``max_computes=1``).
"""

from __future__ import annotations

import numpy as np

from pipedsl.program import Compute, DeviceProgram, ProgramArrays, Recv, Send

__all__ = ["MAX_COMPUTES", "task_starts", "device_tasks"]

MAX_COMPUTES = 2
"""The most computes one task holds. Tasks of the same computes on other microbatches share
one compiled program, so the programs a step compiles grow with this bound, while the
dispatches it saves shrink: the common tasks (``F`` then ``B`` of the last stage, ``B`` then
``F`` of the first) hold two."""


def task_starts(arrays: ProgramArrays, *, max_computes: int = MAX_COMPUTES) -> np.ndarray:
    """Per compute row of ``arrays`` (device by device, in program order), whether it starts
    a task (the module docstring's rule). Shape (rows,), bool."""
    if max_computes < 1:
        raise ValueError(f"max_computes must be at least 1, got {max_computes}")
    rows = len(arrays.recv_from)
    starts = np.ones(rows, dtype=bool)
    if rows == 0 or max_computes == 1:
        return starts
    previous_sends = np.concatenate([[True], arrays.send_to[:-1] >= 0])
    starts = previous_sends | (arrays.recv_from != -1)
    starts[arrays.actions.bounds[:-1][arrays.actions.bounds[:-1] < rows]] = True
    # Within a run of computes that could fuse, start a task every max_computes computes.
    run = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    position = np.arange(rows) - first[run]
    return position % max_computes == 0


def device_tasks(program: DeviceProgram, *, max_computes: int = MAX_COMPUTES) -> tuple[tuple[int, int], ...]:
    """``program``'s instructions cut into tasks, as ``(start, stop)`` index ranges that
    cover the instructions in order: a task's receives come first, then its computes with
    the frees after each, then its sends (with their frees). The same rule as
    :func:`task_starts`, read off the instructions."""
    if max_computes < 1:
        raise ValueError(f"max_computes must be at least 1, got {max_computes}")
    instructions = program.instructions
    cuts: list[int] = []
    computes = 0  # computes in the current task
    sent = True  # whether the current task's last compute sends, or there is no task yet
    pending: int | None = None  # where the receives before the next compute begin
    for index, ins in enumerate(instructions):
        if isinstance(ins, Recv):
            if pending is None:
                pending = index
        elif isinstance(ins, Compute):
            received = pending is not None
            if sent or received or computes == max_computes:
                cuts.append(index if pending is None else pending)
                computes = 0
            computes += 1
            sent = False
            pending = None
        elif isinstance(ins, Send):
            sent = True
    # The first compute always starts a task, at the first instruction (itself or its receive).
    bounds = [*cuts, len(instructions)]
    return tuple(zip(bounds[:-1], bounds[1:], strict=True))
