"""Lowering: the per-device programs move every value exactly where it is needed.

Invariants checked on textbook schedules, on interleaved and V placements (where some
values stay on one device) and on random valid schedules; then each program is run by a
small interpreter with buffered sends, which must finish without deadlock and without a
buffer left behind.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, given, settings

import pipedsl
from helpers import gpipe, interleaved, one_f_one_b, one_f_one_b_split, v_shape, valid_schedules
from pipedsl.errors import ScheduleInvalid
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.program import (
    Buffer,
    BufferKind,
    Compute,
    Free,
    Program,
    Recv,
    Send,
    compute_io,
    lower,
)
from pipedsl.validate import validate

# --- schedules with more than one stage per device -------------------------------------


SCHEDULES = [
    gpipe(1, 3),
    gpipe(4, 6),
    one_f_one_b(4, 8),
    one_f_one_b_split(3, 5),
    interleaved(2, 2, 4),
    interleaved(4, 2, 8),
    interleaved(3, 3, 6),
    v_shape(1, 2, split=False),
    v_shape(4, 4, split=False),
    v_shape(3, 4, split=True),
]


# --- invariants --------------------------------------------------------------------------


def _reader_stage(buf: Buffer) -> int:
    return {BufferKind.ACTIVATION: buf.stage + 1, BufferKind.GRADIENT: buf.stage - 1}.get(buf.kind, buf.stage)


def check_invariants(program: Program) -> None:
    schedule = program.schedule
    placement = schedule.placement
    sends: Counter[tuple[int, int, Buffer]] = Counter()
    recvs: Counter[tuple[int, int, Buffer]] = Counter()
    for prog in program.devices:
        assert prog.stages == schedule.stages_on(prog.device)
        # The computes are the schedule's order, untouched.
        assert tuple(c.action for c in prog.computes) == schedule.orders[prog.device]
        # Per buffer on this device: the events in order, each "write", "read" or "free".
        events: dict[Buffer, list[str]] = defaultdict(list)
        for instr in prog.instructions:
            if isinstance(instr, Compute):
                assert (instr.reads, instr.writes) == compute_io(instr.action, schedule.num_stages)
                for buf in instr.reads:
                    events[buf].append("read")
                for buf in instr.writes:
                    events[buf].append("write")
            elif isinstance(instr, Send):
                sends[(prog.device, instr.peer, instr.buffer)] += 1
                events[instr.buffer].append("read")
            elif isinstance(instr, Recv):
                recvs[(instr.peer, prog.device, instr.buffer)] += 1
                events[instr.buffer].append("write")
            else:
                assert isinstance(instr, Free)
                events[instr.buffer].append("free")
        for buf, seq in events.items():
            assert seq == ["write", "read", "free"], (prog.device, str(buf), seq)
    # Every receive has exactly one matching send on its peer, and the other way round.
    assert sends == recvs
    assert all(n == 1 for n in sends.values())
    for src, dst, buf in sends:
        assert src != dst
        assert placement[buf.stage] == src and placement[_reader_stage(buf)] == dst
    # A value whose producer and consumer share a device never moves.
    moved = {buf for _, _, buf in sends}
    for _, action in schedule.actions():
        _, writes = compute_io(action, schedule.num_stages)
        for buf in writes:
            crosses = placement[buf.stage] != placement[_reader_stage(buf)]
            assert (buf in moved) == crosses, str(buf)


def run_program(program: Program) -> None:
    """Interpret every device program with buffered sends; fail on a stall or a leak."""
    stores: list[set[Buffer]] = [set() for _ in program.devices]
    in_transit: dict[tuple[int, int], set[Buffer]] = defaultdict(set)
    pointers = [0] * len(program.devices)
    progress = True
    while progress:
        progress = False
        for prog in program.devices:
            d, store = prog.device, stores[prog.device]
            while pointers[d] < len(prog.instructions):
                instr = prog.instructions[pointers[d]]
                if isinstance(instr, Recv):
                    channel = in_transit[(instr.peer, d)]
                    if instr.buffer not in channel:
                        break
                    channel.remove(instr.buffer)
                    assert instr.buffer not in store
                    store.add(instr.buffer)
                elif isinstance(instr, Compute):
                    missing = [b for b in instr.reads if b not in store]
                    assert not missing, f"device {d} runs {instr.action} without {missing}"
                    assert not any(b in store for b in instr.writes)
                    store.update(instr.writes)
                elif isinstance(instr, Send):
                    assert instr.buffer in store
                    in_transit[(d, instr.peer)].add(instr.buffer)
                else:
                    store.remove(instr.buffer)
                pointers[d] += 1
                progress = True
    stalled = [p.device for p in program.devices if pointers[p.device] < len(p.instructions)]
    assert not stalled, f"devices {stalled} never finish"
    assert all(not s for s in stores), "buffers left unfreed"
    assert all(not c for c in in_transit.values()), "values sent but never received"


def _id(schedule: Schedule) -> str:
    return f"{schedule.name}-{schedule.num_devices}x{schedule.num_stages}x{schedule.num_microbatches}"


@pytest.mark.parametrize("schedule", SCHEDULES, ids=_id)
def test_lowering_invariants(schedule: Schedule) -> None:
    program = lower(schedule)
    check_invariants(program)
    run_program(program)


def test_same_device_values_do_not_move() -> None:
    # With V placement the turn (stage pp-1 -> stage pp) is on the last device; with
    # interleaving every device holds vpp stages but consecutive stages never share one.
    program = lower(v_shape(3, 2, split=False))
    last = program.devices[2]
    turn_activation = Buffer(BufferKind.ACTIVATION, 2, 0)
    assert not any(isinstance(i, (Send, Recv)) and i.buffer == turn_activation for i in last.instructions)
    next_forward = next(c for c in last.computes if c.action == Action(Kind.F, 3, 0))
    assert next_forward.reads == (turn_activation,)
    # Single device: nothing moves at all.
    assert not any(isinstance(i, (Send, Recv)) for p in lower(gpipe(1, 3)).devices for i in p.instructions)


def test_transfer_counts() -> None:
    # A p-device 1F1B moves an activation and a gradient across each of p-1 links per microbatch.
    program = lower(one_f_one_b(4, 8))
    sends = [i for p in program.devices for i in p.instructions if isinstance(i, Send)]
    assert len(sends) == 2 * 3 * 8
    # Interleaved: all pp*vpp-1 stage boundaries cross devices.
    program = lower(interleaved(2, 2, 4))
    assert sum(isinstance(i, Send) for p in program.devices for i in p.instructions) == 2 * 3 * 4


def test_lower_validates_first() -> None:
    broken = gpipe(2, 2)
    broken = Schedule(broken.name, 2, 2, 2, broken.placement, (broken.orders[0][1:], broken.orders[1]))
    with pytest.raises(ScheduleInvalid):
        lower(broken)


def test_the_package_validates_and_lowers_plain_data() -> None:
    # A Schedule carries no validate/lower methods: the free functions are the one way in,
    # and they are the modules' own, so both paths give the same result.
    schedule = one_f_one_b(4, 8)
    assert not hasattr(Schedule, "validate") and not hasattr(Schedule, "lower")
    assert pipedsl.validate is validate and pipedsl.lower is lower
    assert pipedsl.validate(schedule).peak_inflight == (4, 3, 2, 1)
    assert pipedsl.lower(schedule).num_instructions == lower(schedule).num_instructions > schedule.num_actions


def test_format_lists_every_instruction() -> None:
    program = lower(one_f_one_b(2, 2))
    text = program.format()
    assert text.splitlines()[0] == "device 0 (stages 0):"
    assert len(text.splitlines()) == len(program.devices) + program.num_instructions
    assert "send act(0,0) -> device 1" in text and "recv act(0,0) <- device 0" in text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_schedules())
def test_random_valid_schedules_lower_and_run(schedule: Schedule) -> None:
    program = lower(schedule)
    check_invariants(program)
    run_program(program)
