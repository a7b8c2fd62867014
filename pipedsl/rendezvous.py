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

That is exactly where the program deadlocks with buffered sends too (the order *is* a run with
buffered sends), and a lowered program deadlocks with buffered sends only where its schedule
fails validation's deadlock rule: so every schedule that validates runs under rendezvous, and
:func:`rendezvous_deadlock` finds nothing that validation has not already reported at its line.

:func:`exchange_groups` cuts the order into the exchanges made as one collective each: a run
of consecutive exchanges between the same two devices, in either direction, where each of the
two has computed every value it sends in the run before the point at which it makes the run
(its first receive at or after the run's first exchange, or its program's end). A device then
makes a whole group where it would have made the group's first exchange, and receives values
of the group before its program asks for them. The argument above still holds: the lowest
group not yet made involves two devices each of which reaches the point where it makes it,
because everything either computes before that point needs only receives of earlier groups.
In ``1f1b`` over two devices every group carries two microbatches' activations (or
gradients), so a step takes half as many collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedsl.program import Buffer, Compute, Program, Recv, Send

__all__ = ["Exchange", "Stuck", "exchange_order", "exchange_groups", "rendezvous_deadlock"]


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


def exchange_groups(program: Program) -> tuple[tuple[Exchange, ...], ...]:
    """:func:`exchange_order` cut into groups, each made as one collective by the two
    devices it is between (module docstring): the groups in order, each in order.
    Raises ``ValueError`` where :func:`exchange_order` does."""
    order = exchange_order(program)
    devices = program.devices
    sent_at: dict[tuple[Buffer, int, int], int] = {}
    received_at: dict[tuple[Buffer, int, int], int] = {}
    for d, device in enumerate(devices):
        for at, instr in enumerate(device.instructions):
            if isinstance(instr, Send):
                sent_at[(instr.buffer, d, instr.peer)] = at
            elif isinstance(instr, Recv):
                received_at[(instr.buffer, instr.peer, d)] = at
    # Per exchange, where its sender and its receiver would make it: each side's first
    # receive at or after it in the order (its program's end when there is none).
    point: list[tuple[int, int]] = [(0, 0)] * len(order)
    next_receive = [len(device.instructions) for device in devices]
    for i in range(len(order) - 1, -1, -1):
        e = order[i]
        next_receive[e.dst] = received_at[(e.buffer, e.src, e.dst)]
        point[i] = (next_receive[e.src], next_receive[e.dst])
    groups: list[tuple[Exchange, ...]] = []
    i = 0
    while i < len(order):
        first = order[i]
        makes_at = {first.src: point[i][0], first.dst: point[i][1]}
        j = i + 1
        while j < len(order):
            e = order[j]
            if e.src not in makes_at or e.dst not in makes_at or sent_at[(e.buffer, e.src, e.dst)] >= makes_at[e.src]:
                break
            j += 1
        groups.append(order[i:j])
        i = j
    return tuple(groups)


def rendezvous_deadlock(program: Program) -> tuple[Stuck, ...]:
    """The devices that would wait forever under rendezvous transfers ordered by
    :func:`exchange_order` (empty when the program runs to its end)."""
    return tuple(_run(program)[1])


def _describe(stuck: Stuck) -> str:
    what = f" (needed by {stuck.reader.action})" if stuck.reader is not None else ""
    return f"device {stuck.device} waits forever to receive {stuck.buffer}{what} from device {stuck.peer}"
