"""The order in which a lowered program's sends and receives meet, when each is a rendezvous.

A lowered program's ``Send`` does not wait: it hands the value to a transport that buffers it.
Between processes the executor moves a value with a compiled collective that both devices must
call, and a collective waits until its partner calls it too (a rendezvous). Run in program order,
rendezvous deadlocks where buffered sends do not: in ``1f1b`` the first device sends its
second activation before it receives the first gradient, while the second device sends that
gradient before it receives the second activation, and each waits for the other.

:func:`exchange_order` orders every transfer of a program once, for every device alike: it runs
the program with buffered sends, one instruction at a time in a fixed round robin over the
devices, and numbers each transfer when its receive is taken. A device then keeps each value
it sends until its partner needs it: before a receive it makes the exchanges numbered before
that receive in which it is the sender, and at the end of its program the rest. Every device
meets its exchanges in one global order and nothing it computes before an exchange waits for a
later one, so the lowest exchange not yet made always has both partners ready for it: the
program runs to its end. :func:`rendezvous_deadlock` says where a program's transfers cannot be
so ordered (a receive that nothing sends before it, on every interleaving), at the line of the
action that waits.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedsl.program import Buffer, Compute, Program, Recv, Send

__all__ = ["Exchange", "Stuck", "exchange_order", "rendezvous_deadlock"]


@dataclass(frozen=True, slots=True)
class Exchange:
    """One transfer: ``buffer`` from device ``src`` to device ``dst``."""

    buffer: Buffer
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Stuck:
    """A device that waits forever: its receive of ``buffer`` from ``peer``, which the
    compute ``reader`` (the action that reads it, None if none does) needs."""

    device: int
    buffer: Buffer
    peer: int
    reader: Compute | None


def _run(program: Program) -> tuple[list[Exchange], list[Stuck]]:
    """Run ``program`` with buffered sends in a fixed round robin: the transfers in the
    order their receives are taken, and the receives that were never satisfied."""
    devices = program.devices
    position = [0] * len(devices)
    sent: set[tuple[Buffer, int, int]] = set()
    order: list[Exchange] = []
    progress = True
    while progress:
        progress = False
        for d, device in enumerate(devices):
            instructions = device.instructions
            at = position[d]
            while at < len(instructions):
                instr = instructions[at]
                if isinstance(instr, Recv):
                    slot = (instr.buffer, instr.peer, d)
                    if slot not in sent:
                        break
                    sent.discard(slot)
                    order.append(Exchange(instr.buffer, instr.peer, d))
                elif isinstance(instr, Send):
                    sent.add((instr.buffer, d, instr.peer))
                at += 1
            if at != position[d]:
                position[d] = at
                progress = True
    stuck = []
    for d, device in enumerate(devices):
        instructions = device.instructions
        if position[d] < len(instructions):
            instr = instructions[position[d]]
            assert isinstance(instr, Recv)  # only a receive stops a device
            reader = next(
                (i for i in instructions[position[d] :] if isinstance(i, Compute) and instr.buffer in i.reads), None
            )
            stuck.append(Stuck(d, instr.buffer, instr.peer, reader))
    return order, stuck


def exchange_order(program: Program) -> tuple[Exchange, ...]:
    """Every transfer of ``program`` in the one order all devices make them (module
    docstring). Raises ``ValueError`` when the program cannot run to its end (see
    :func:`rendezvous_deadlock`)."""
    order, stuck = _run(program)
    if stuck:
        raise ValueError("; ".join(_describe(s) for s in stuck))
    return tuple(order)


def rendezvous_deadlock(program: Program) -> tuple[Stuck, ...]:
    """The devices that would wait forever under rendezvous transfers ordered by
    :func:`exchange_order` (empty when the program runs to its end)."""
    return tuple(_run(program)[1])


def _describe(stuck: Stuck) -> str:
    what = f" (needed by {stuck.reader.action})" if stuck.reader is not None else ""
    return f"device {stuck.device} waits forever to receive {stuck.buffer}{what} from device {stuck.peer}"
