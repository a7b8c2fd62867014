"""Validation: the rules a schedule must keep before anything simulates or runs it.

Rules, each named in the :class:`~pipedsl.errors.ScheduleInvalid` it raises:

- ``shape`` — placement has one device per stage, in range; one order per device; every
  device owns at least one stage;
- ``stage-range`` / ``microbatch-range`` — indices within 0..S-1 and 0..M-1;
- ``wrong-device`` — an action runs on the device that owns its stage;
- ``duplicate-action`` — no (kind, stage, microbatch) appears twice;
- ``mixed-backward`` — a (stage, microbatch) uses either ``B`` or the ``I``/``W`` pair;
- ``missing-action`` — every (stage, microbatch) has its ``F`` and its backward;
- ``dependency-order`` — on one device, an action never comes before one it needs;
- ``deadlock`` — the device orders plus the data dependencies admit an execution;
  otherwise the error names the cycle of devices and what each waits for;
- ``max-inflight`` — the peak in-flight count on each device is within a given limit.

Dependencies: ``F(m, s)`` needs ``F(m, s-1)``; ``B``/``I`` of ``(m, s)`` need ``F(m, s)``
and the backward (``B`` or ``I``) of ``(m, s+1)``; ``W(m, s)`` needs ``I(m, s)``.

In flight on a device: the (stage, microbatch) pairs whose ``F`` has run and whose ``B``
(or ``W``, when split) has not. Its peak is the number of activation sets held at once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from pipedsl.errors import PipedslError, ScheduleInvalid
from pipedsl.ir import Action, Kind, Schedule

__all__ = ["Report", "validate", "dependencies", "peak_inflight"]

_Key = tuple[Kind, int, int]


@dataclass(frozen=True, slots=True)
class Report:
    """What a successful validation learned about the schedule.

    ``peak_inflight[d]`` is the most (stage, microbatch) pairs in flight at once on device d.
    """

    num_actions: int
    peak_inflight: tuple[int, ...]


def _fail(rule: str, message: str, action: Action | None = None) -> ScheduleInvalid:
    return ScheduleInvalid(
        message,
        rule=rule,
        action=None if action is None else str(action),
        pos=None if action is None else action.pos,
    )


def _check_shape(schedule: Schedule) -> None:
    s, d = schedule.num_stages, schedule.num_devices
    if s < 1 or d < 1 or schedule.num_microbatches < 1:
        raise _fail("shape", f"need at least one stage, device and microbatch; got {s}, {d}, {schedule.num_microbatches}")
    if len(schedule.placement) != s:
        raise _fail("shape", f"placement names {len(schedule.placement)} stages, the schedule has {s}")
    for stage, device in enumerate(schedule.placement):
        if not 0 <= device < d:
            raise _fail("shape", f"stage {stage} is placed on device {device}, outside 0..{d - 1}")
    if len(schedule.orders) != d:
        raise _fail("shape", f"there are orders for {len(schedule.orders)} devices, the schedule has {d}")
    idle = sorted(set(range(d)) - set(schedule.placement))
    if idle:
        raise _fail("shape", f"device {idle[0]} owns no stage; place a stage on it or use fewer devices")


def _check_actions(schedule: Schedule) -> dict[_Key, Action]:
    """Ranges, ownership, duplicates; returns every action by its key."""
    seen: dict[_Key, Action] = {}
    num_stages, num_mb, placement = schedule.num_stages, schedule.num_microbatches, schedule.placement
    for device, order in enumerate(schedule.orders):
        for action in order:
            if not 0 <= action.stage < num_stages:
                raise _fail("stage-range", f"action {action} names stage {action.stage}, outside 0..{num_stages - 1}", action)
            if not 0 <= action.microbatch < num_mb:
                raise _fail(
                    "microbatch-range",
                    f"action {action} names microbatch {action.microbatch}, outside 0..{num_mb - 1}",
                    action,
                )
            owner = placement[action.stage]
            if owner != device:
                raise _fail(
                    "wrong-device",
                    f"action {action} is on device {device} but stage {action.stage} is placed on device {owner}",
                    action,
                )
            key = action.key
            if key in seen:
                raise _fail("duplicate-action", f"action {action} appears twice", action)
            seen[key] = action
    return seen


def _check_complete(schedule: Schedule, seen: dict[_Key, Action]) -> None:
    for stage in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            f = seen.get((Kind.F, stage, mb))
            b = seen.get((Kind.B, stage, mb))
            i = seen.get((Kind.I, stage, mb))
            w = seen.get((Kind.W, stage, mb))
            where = f"stage {stage}, microbatch {mb}"
            if b is not None and (i is not None or w is not None):
                raise _fail("mixed-backward", f"{where} has both B and I/W; use one or the other", i or w)
            if f is None:
                raise _fail("missing-action", f"{where} has no forward ({stage}F{mb})", b or i or w)
            if b is None and i is None and w is None:
                raise _fail("missing-action", f"{where} has no backward ({stage}B{mb}, or {stage}I{mb} and {stage}W{mb})", f)
            if b is None and (i is None or w is None):
                have, lacking = (i, f"{stage}W{mb}") if w is None else (w, f"{stage}I{mb}")
                raise _fail("missing-action", f"{where} splits its backward but has no {lacking}", have)


def dependencies(action: Action, *, num_stages: int, split: set[tuple[int, int]]) -> tuple[_Key, ...]:
    """The keys of the actions ``action`` needs; ``split`` holds the (stage, microbatch)
    pairs whose backward is split into ``I`` and ``W``."""
    s, m = action.stage, action.microbatch
    if action.kind is Kind.F:
        return ((Kind.F, s - 1, m),) if s > 0 else ()
    if action.kind is Kind.W:
        return ((Kind.I, s, m),)
    deps: tuple[_Key, ...] = ((Kind.F, s, m),)
    if s + 1 < num_stages:
        deps += ((Kind.I if (s + 1, m) in split else Kind.B, s + 1, m),)
    return deps


def _fmt(key: _Key) -> str:
    kind, stage, mb = key
    return f"{stage}{kind.value}{mb}"


def _check_execution(schedule: Schedule, seen: dict[_Key, Action]) -> None:
    """Run the orders with unit steps; report a same-device misorder or a cross-device cycle."""
    split = {(s, m) for (k, s, m) in seen if k is Kind.I}
    orders = schedule.orders
    position = {a.key: (d, i) for d, order in enumerate(orders) for i, a in enumerate(order)}
    pointer = [0] * len(orders)
    done: set[_Key] = set()
    waiting: dict[_Key, list[int]] = defaultdict(list)
    blocked_on: dict[int, _Key] = {}
    ready = list(range(len(orders)))
    while ready:
        device = ready.pop()
        order = orders[device]
        while pointer[device] < len(order):
            action = order[pointer[device]]
            missing = next(
                (k for k in dependencies(action, num_stages=schedule.num_stages, split=split) if k not in done), None
            )
            if missing is not None:
                dep_device, _ = position[missing]
                if dep_device == device:
                    raise _fail(
                        "dependency-order",
                        f"action {action} on device {device} comes before {_fmt(missing)}, which it needs",
                        action,
                    )
                waiting[missing].append(device)
                blocked_on[device] = missing
                break
            done.add(action.key)
            pointer[device] += 1
            woken = waiting.pop(action.key, None)
            if woken:
                for other in woken:
                    del blocked_on[other]
                ready.extend(woken)
    if blocked_on:
        raise _deadlock(schedule, blocked_on, pointer, position)


def _deadlock(
    schedule: Schedule,
    blocked_on: dict[int, _Key],
    pointer: list[int],
    position: dict[_Key, tuple[int, int]],
) -> ScheduleInvalid:
    # Every blocked device waits on exactly one other blocked device, so walking the
    # wait-for edges from any of them must enter a cycle.
    device = min(blocked_on)
    visited: list[int] = []
    while device not in visited:
        visited.append(device)
        device = position[blocked_on[device]][0]
    cycle = visited[visited.index(device):]
    steps = []
    for d in cycle:
        at = schedule.orders[d][pointer[d]]
        want = blocked_on[d]
        steps.append(f"device {d} waits at {at} for {_fmt(want)} on device {position[want][0]}")
    first = schedule.orders[cycle[0]][pointer[cycle[0]]]
    return _fail("deadlock", "the device orders wait on each other: " + "; ".join(steps), first)


def peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per device, the most (stage, microbatch) pairs held between F and B (or W)."""
    peaks = []
    for order in schedule.orders:
        live = peak = 0
        for action in order:
            if action.kind is Kind.F:
                live += 1
                peak = max(peak, live)
            elif action.kind is not Kind.I:
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


def validate(schedule: Schedule, *, max_inflight: int | None = None) -> Report:
    """Check every rule; raise :class:`ScheduleInvalid` naming the first one broken.

    ``max_inflight`` must be a whole number >= 0 (PipedslError otherwise).
    """
    if max_inflight is not None and (type(max_inflight) is not int or max_inflight < 0):
        raise PipedslError(f"max_inflight must be a whole number >= 0 (or None), got {max_inflight!r}")
    _check_shape(schedule)
    seen = _check_actions(schedule)
    _check_complete(schedule, seen)
    _check_execution(schedule, seen)
    peaks = peak_inflight(schedule)
    if max_inflight is not None:
        for device, peak in enumerate(peaks):
            if peak > max_inflight:
                raise _fail(
                    "max-inflight",
                    f"device {device} holds {peak} microbatches in flight at its peak, above the limit of {max_inflight}",
                )
    return Report(num_actions=len(seen), peak_inflight=peaks)
