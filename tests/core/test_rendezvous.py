"""The exchange order of :mod:`pipedsl.rendezvous`, checked by running programs under rendezvous.

:func:`_rendezvous` plays every device of a lowered program where each transfer is a
collective that both partners must call (as the Ray backend's are): a device keeps what it
sends and, at each receive and at its program's end, makes its exchanges in the global order.
It returns the devices that wait forever, and checks that no value is sent before it is
computed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

import pipedsl
from helpers import library, valid_schedules
from pipedsl.program import DeviceProgram, Program, Recv, Send
from pipedsl.rendezvous import Exchange, exchange_groups, exchange_order, rendezvous_deadlock

# The library's fixed schedules (its policies are synthesised: random valid schedules stand for them).
_SCHEDULES = ["gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "dualpipev"]


def _rendezvous(program: Program, order: tuple[Exchange, ...]) -> list[int]:
    """The devices left waiting when ``program`` runs with rendezvous transfers made in
    ``order`` (see the module docstring)."""
    return _play(
        program, [[e for e in order if d in (e.src, e.dst)] for d in range(len(program.devices))], at_send=False
    )


def _play(program: Program, queues: list[list[Exchange]], *, at_send: bool) -> list[int]:
    """The devices left waiting when device d makes the exchanges ``queues[d]`` in order,
    each when both partners want it; a device wants its next one at a receive and at its
    program's end, and with ``at_send`` at a send too (transfers in program order)."""
    devices = program.devices
    stops = (Recv, Send) if at_send else (Recv,)
    position = [0] * len(devices)
    made = [0] * len(devices)
    computed: set[tuple[object, int]] = set()

    def wants(d: int) -> Exchange | None:
        """The exchange device d is blocked in, or None while it runs on."""
        instructions = devices[d].instructions
        at_end = position[d] >= len(instructions)
        if made[d] >= len(queues[d]):
            return None
        if not at_end and not isinstance(instructions[position[d]], stops):
            return None
        return queues[d][made[d]]

    progress = True
    while progress:
        progress = False
        for d, device in enumerate(devices):
            instructions = device.instructions
            while position[d] < len(instructions):
                instr = instructions[position[d]]
                if isinstance(instr, Send):
                    computed.add((instr.buffer, d))
                if isinstance(instr, stops):
                    break
                position[d] += 1
                progress = True
        for d in range(len(devices)):
            e = wants(d)
            if e is None:
                continue
            other = e.dst if d == e.src else e.src
            if wants(other) != e:
                continue
            assert (e.buffer, e.src) in computed, f"{e} is made before it is computed"
            made[e.src] += 1
            made[e.dst] += 1
            for side in (e.src, e.dst):
                instructions = devices[side].instructions
                if position[side] < len(instructions):
                    instr = instructions[position[side]]
                    mine = (instr.buffer, instr.peer) == ((e.buffer, e.src) if side == e.dst else (e.buffer, e.dst))
                    if isinstance(instr, (Recv, Send)) and isinstance(instr, stops) and mine:
                        position[side] += 1
            progress = True
    return [d for d in range(len(devices)) if position[d] < len(devices[d].instructions) or made[d] < len(queues[d])]


def _in_program_order(program: Program) -> tuple[list[Exchange], ...]:
    """Per device, its transfers in the order its program names them."""
    return tuple(
        [Exchange(i.buffer, d, i.peer) if isinstance(i, Send) else Exchange(i.buffer, i.peer, d)
         for i in device.instructions if isinstance(i, (Send, Recv))]
        for d, device in enumerate(program.devices)
    )  # fmt: skip


def test_every_library_schedule_runs_under_rendezvous() -> None:
    for name in _SCHEDULES:
        for pp, m in ((2, 4), (4, 8), (4, 5)):
            try:
                schedule = library(name, pp=pp, microbatches=m)
            except pipedsl.PipedslError:
                continue  # a shape this schedule does not take
            program = pipedsl.lower(schedule)
            order = exchange_order(program)
            sends = sum(isinstance(i, Send) for device in program.devices for i in device.instructions)
            assert len(order) == sends
            assert _rendezvous(program, order) == [], (name, pp, m)


@settings(max_examples=60, deadline=None)
@given(valid_schedules())
def test_any_valid_schedule_runs_under_rendezvous(schedule: pipedsl.ir.Schedule) -> None:
    program = pipedsl.lower(schedule)
    assert rendezvous_deadlock(program) == ()
    assert _rendezvous(program, exchange_order(program)) == []


def test_1f1b_in_program_order_would_deadlock_under_rendezvous() -> None:
    # Why the order exists: device 0 sends its second activation before it receives the
    # first gradient, device 1 sends that gradient before it receives the second activation.
    program = pipedsl.lower(library("1f1b", pp=2, microbatches=4))
    assert _play(program, list(_in_program_order(program)), at_send=True) == [0, 1]
    # GPipe's transfers meet in program order: all forwards' first, then all backwards'.
    gpipe = pipedsl.lower(library("gpipe", pp=2, microbatches=4))
    assert _play(gpipe, list(_in_program_order(gpipe)), at_send=True) == []


def test_a_receive_nothing_sends_first_is_reported() -> None:
    program = pipedsl.lower(library("1f1b", pp=2, microbatches=2))
    d0 = program.devices[0]
    receive = next(i for i in d0.instructions if isinstance(i, Recv))
    # Device 0 now waits for the gradient of microbatch 0 before it sends any activation.
    moved = (receive, *(i for i in d0.instructions if i is not receive))
    broken = Program(program.schedule, (DeviceProgram(0, d0.stages, moved), program.devices[1]))
    stuck = rendezvous_deadlock(broken)
    assert {s.device for s in stuck} == {0, 1}
    assert any(s.device == 0 and s.buffer == receive.buffer for s in stuck)
    try:
        exchange_order(broken)
    except ValueError as err:
        assert f"device 0 waits forever to receive {receive.buffer}" in str(err)
    else:
        raise AssertionError("exchange_order accepted a program that cannot run")


def _rendezvous_groups(program: Program, groups: tuple[tuple[Exchange, ...], ...]) -> list[int]:
    """The devices left waiting when ``program`` runs with each of ``groups`` made as one
    collective of its two devices, as the Ray transport makes them: a device wants its next
    group as soon as it has computed every value it sends in it (at least one), at a receive
    whose value has not come yet, and at its program's end, and waits there; a group is made
    when both want it, and every value it sends must have been computed by then."""
    devices = program.devices
    queues = [[g for g in groups if d in (g[0].src, g[0].dst)] for d in range(len(devices))]
    position = [0] * len(devices)
    made = [0] * len(devices)
    computed: set[tuple[object, int]] = set()
    arrived: set[tuple[object, int, int]] = set()

    def wants(d: int) -> tuple[Exchange, ...] | None:
        instructions = devices[d].instructions
        if made[d] >= len(queues[d]):
            return None
        group = queues[d][made[d]]
        if position[d] >= len(instructions):
            return group
        instr = instructions[position[d]]
        if isinstance(instr, Recv) and (instr.buffer, instr.peer, d) not in arrived:
            return group
        sends = [(e.buffer, d) for e in group if e.src == d]
        return group if sends and all(s in computed for s in sends) else None

    progress = True
    while progress:
        progress = False
        for d, device in enumerate(devices):
            instructions = device.instructions
            while position[d] < len(instructions) and wants(d) is None:
                instr = instructions[position[d]]
                if isinstance(instr, Recv):
                    arrived.discard((instr.buffer, instr.peer, d))
                elif isinstance(instr, Send):
                    computed.add((instr.buffer, d))
                position[d] += 1
                progress = True
        for d in range(len(devices)):
            group = wants(d)
            if group is None:
                continue
            other = group[0].dst if d == group[0].src else group[0].src
            if wants(other) != group:
                continue
            for e in group:
                assert {e.src, e.dst} == {d, other}, f"{group} is not between two devices"
                assert (e.buffer, e.src) in computed, f"{e} is made before it is computed"
                arrived.add((e.buffer, e.src, e.dst))
            made[d] += 1
            made[other] += 1
            progress = True
    return [d for d in range(len(devices)) if position[d] < len(devices[d].instructions) or made[d] < len(queues[d])]


def test_1f1b_sends_one_way_and_receives_the_other_in_each_collective() -> None:
    program = pipedsl.lower(library("1f1b", pp=2, microbatches=16))
    groups = exchange_groups(program)
    assert tuple(e for g in groups for e in g) == exchange_order(program)
    # Each collective but the first and the last carries one activation forward and one
    # gradient back, so that both devices compute between two collectives.
    assert [len(g) for g in groups] == [1] + [2] * 15 + [1]
    assert all({(e.src, e.dst) for e in g} == {(0, 1), (1, 0)} for g in groups[1:-1])
    assert _rendezvous_groups(program, groups) == []


def test_a_value_goes_as_soon_as_it_is_computed() -> None:
    # GPipe's forwards: each activation its own collective, made right after its forward,
    # so that the second device computes while the first goes on to its next forward.
    program = pipedsl.lower(library("gpipe", pp=2, microbatches=4))
    groups = exchange_groups(program)
    assert [len(g) for g in groups] == [1] * 8


def test_every_library_schedule_runs_in_groups() -> None:
    for name in _SCHEDULES:
        for pp, m in ((2, 4), (4, 8), (4, 5)):
            try:
                schedule = library(name, pp=pp, microbatches=m)
            except pipedsl.PipedslError:
                continue  # a shape this schedule does not take
            program = pipedsl.lower(schedule)
            groups = exchange_groups(program)
            assert tuple(e for g in groups for e in g) == exchange_order(program)
            assert _rendezvous_groups(program, groups) == [], (name, pp, m)


@settings(max_examples=60, deadline=None)
@given(valid_schedules())
def test_any_valid_schedule_runs_in_groups(schedule: pipedsl.ir.Schedule) -> None:
    program = pipedsl.lower(schedule)
    groups = exchange_groups(program)
    assert tuple(e for g in groups for e in g) == exchange_order(program)
    assert _rendezvous_groups(program, groups) == []


def test_a_group_never_waits_for_a_value_computed_after_it() -> None:
    # Grouping a run regardless of when its values are computed would make a device send
    # a value it computes only after a receive of the same group: the player catches it.
    program = pipedsl.lower(library("1f1b", pp=2, microbatches=4))
    order = exchange_order(program)
    greedy = tuple(tuple(order[i : i + 4]) for i in range(0, len(order), 4))
    with pytest.raises(AssertionError, match="made before it is computed"):
        _rendezvous_groups(program, greedy)
