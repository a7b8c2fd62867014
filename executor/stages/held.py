"""The activation memory a pipeline device holds under a lowered program: the residuals of
its (stage, microbatch) pairs, in bytes per JAX device, from what the compiled stage
programs keep.

A ``RESIDUAL`` buffer holds what ``F`` keeps for the backward
(:meth:`~pipedsl.executor.stages.stage_program.StageProgram.kept`), a ``WEIGHT_RESIDUAL``
buffer what ``I`` leaves for ``W``
(:meth:`~pipedsl.executor.stages.stage_program.StageProgram.weight_kept`); each is held
from the compute that writes it to its ``Free`` in the device's program, as the
interpreter holds it. The count is taken between a device's actions, once the frees that
follow a compute have run: while ``I`` runs, its inputs and outputs are live at once (its
working memory, like any program's scratch), and the residuals ``W`` reads by reference
are counted once, in the ``WEIGHT_RESIDUAL`` buffer, once ``I``'s ``RESIDUAL`` is freed.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipedsl.executor.stages.stage_program import StageProgram
from pipedsl.program import BufferKind, Compute, Free, Program, Recv

__all__ = ["peak_held_bytes"]


def peak_held_bytes(program: Program, stages: Mapping[int, StageProgram]) -> tuple[int, ...]:
    """Per device of ``program``, the most residual bytes per JAX device it holds at once
    between its actions, shape (D,); ``stages`` maps every stage to its compiled program."""
    kept = {s: prog.kept() for s, prog in stages.items()}
    split = any(
        isinstance(instr, Compute) and any(b.kind is BufferKind.WEIGHT_RESIDUAL for b in instr.writes)
        for device in program.devices
        for instr in device.instructions
    )
    weight_kept = {s: prog.weight_kept() for s, prog in stages.items()} if split else {}
    sizes = {BufferKind.RESIDUAL: kept, BufferKind.WEIGHT_RESIDUAL: weight_kept}
    peaks = []
    for device in program.devices:
        held = peak = 0
        # A compute's writes are counted with the sends and frees that follow it, up to
        # the device's next compute or receive.
        for instr in device.instructions:
            if isinstance(instr, (Compute, Recv)):
                peak = max(peak, held)
            if isinstance(instr, Compute):
                held += sum(sizes[b.kind][b.stage] for b in instr.writes if b.kind in sizes)
            elif isinstance(instr, Free) and instr.buffer.kind in sizes:
                held -= sizes[instr.buffer.kind][instr.buffer.stage]
        peaks.append(max(peak, held))
    return tuple(peaks)
