"""The order in which a lowered program's sends and receives meet, when each is a rendezvous.

A lowered program's ``Send`` does not wait: it hands the value to a transport that buffers it.
Between processes the executor moves a value with a compiled collective that both devices must
call, and a collective waits until its partner calls it too (a rendezvous). Run in program order,
rendezvous deadlocks where buffered sends do not: in ``1f1b`` the first device sends its
second activation before it receives the first gradient, while the second device sends that
gradient before it receives the second activation, and each waits for the other.

:func:`exchange_order` orders every transfer of a program once, for every device alike: it runs
the program with buffered sends, one instruction at a time in a fixed round robin over the
devices, and numbers each transfer when its receive is taken. Every device makes its
exchanges in that one order: as the sender once it has computed the value, as the receiver
at its receive at the latest. Nothing a device computes before an exchange waits for a later
one, so the lowest exchange not yet made always has both partners ready for it: the program
runs to its end. :func:`rendezvous_deadlock` says where a program's transfers cannot be
so ordered (a receive that nothing sends before it, on every interleaving), at the line of the
action that waits.

That is exactly where the program deadlocks with buffered sends too (the order *is* a run with
buffered sends), and a lowered program deadlocks with buffered sends only where its schedule
fails validation's deadlock rule: so every schedule that validates runs under rendezvous, and
:func:`rendezvous_deadlock` finds nothing that validation has not already reported at its line.

:func:`exchange_groups` cuts the order into the exchanges made as one collective each, and says
when each device makes them: a device makes its next group as soon as it has computed every
value it sends in it (right after the last such send), or, when it sends nothing in it, at its
receive of the group's first value (or its program's end). So a value goes as soon as it is
computed and the receiver is ready for it, as a buffered send would let it: a device that kept
its values until its next receive would hold back everything it computes in between, and the
devices of a pipeline would take turns instead of computing at once. A group is a run of
consecutive exchanges between the same two devices, in either direction, whose values each
sender has computed by the point at which it makes the group (the sender of the first exchange
right after sending it, the receiver at its receive of it). The argument above still holds: the
lowest group not yet made involves two devices each of which reaches the point where it makes
it, because everything either computes before that point needs only receives of earlier groups,
and a device makes its groups in order, so it never waits on a later one first. In ``1f1b`` over
two devices each group but the first and the last carries one microbatch's activation one way
and an earlier microbatch's gradient the other (as Megatron-LM's send-forward-receive-backward
does), and both devices compute between two collectives.
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
    sent_at: dict[tuple[Buffer, int, int], int] = {}
    received_at: dict[tuple[Buffer, int, int], int] = {}
    for d, device in enumerate(program.devices):
        for at, instr in enumerate(device.instructions):
            if isinstance(instr, Send):
                sent_at[(instr.buffer, d, instr.peer)] = at
            elif isinstance(instr, Recv):
                received_at[(instr.buffer, instr.peer, d)] = at
    groups: list[tuple[Exchange, ...]] = []
    i = 0
    while i < len(order):
        first = order[i]
        key = (first.buffer, first.src, first.dst)
        # Where each side makes the group: the sender right after sending the first
        # value, the receiver at its receive of it (or earlier, once its own values of
        # the group are all sent: never later).
        makes_at = {first.src: sent_at[key] + 1, first.dst: received_at[key]}
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
