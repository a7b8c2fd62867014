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

The checks run on the schedule's int-coded actions (:mod:`pipedsl.arrays`), vectorised
where a rule allows; a broken rule is reported on the first offending action in device
order, with the action's own source position, as a walk over the objects would, and every
other violation is carried with it (``err.errors``, up to
:data:`~pipedsl.errors.MAX_REPORTED`, then a count): those of ranges, ownership and
duplicates together with those of completeness, or, once those hold, every misorder and
every deadlock.
What validation derives is kept as a :class:`Checked` for lowering and simulation.

Dependencies: ``F(m, s)`` needs ``F(m, s-1)``; ``B``/``I`` of ``(m, s)`` need ``F(m, s)``
and the backward (``B`` or ``I``) of ``(m, s+1)``; ``W(m, s)`` needs ``I(m, s)``.

In flight on a device: the (stage, microbatch) pairs whose ``F`` has run and whose ``B``
(or ``W``, when split) has not. Its peak is the number of activation sets held at once.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from pipedsl.analysis import peak_inflight
from pipedsl.arguments import schedule_argument
from pipedsl.arrays import ActionArrays, B, F, I, ScheduleArrays, W, paused_collector
from pipedsl.errors import MAX_REPORTED, PipedslError, ScheduleInvalid, several
from pipedsl.ir import Action, Kind, Schedule

__all__ = ["Report", "Checked", "validate", "checked", "kept_check", "dependencies", "peak_inflight"]

_Key = tuple[Kind, int, int]
_Subject = Schedule | ScheduleArrays
"""What the checks read: the shape of a schedule, and its actions as objects or columns."""


@dataclass(frozen=True, slots=True)
class Report:
    """What a successful validation learned about the schedule.

    ``peak_inflight[d]`` is the most (stage, microbatch) pairs in flight at once on device d.
    """

    num_actions: int
    peak_inflight: tuple[int, ...]


@dataclass(frozen=True, slots=True, eq=False)
class Checked:
    """A valid schedule's actions and the dependencies between them, as int arrays.

    Attributes:
      actions: the schedule's actions, device by device in execution order (N rows).
      local: per action, the row of what it needs on its own stage: ``F(s)`` for a
        backward (``B`` or ``I``) of stage s, ``I(s)`` for ``W(s)``; -1 for ``F``.
      upstream: per action, the row of what it needs from the neighbouring stage:
        ``F(s - 1)`` for ``F(s)``, the backward (``B`` or ``I``) of ``s + 1`` for a
        backward of ``s``; -1 for ``W`` and at the ends of the pipeline. The value it
        reads from there crosses devices where the two stages sit on different devices.
      peak_inflight: per device, the most (stage, microbatch) pairs in flight at once.
      order: every row once, each after every row it needs (int64, shape (N,)): an order
        the lowered program's computes can run in, as its devices' sends and receives
        allow.
    """

    actions: ActionArrays
    local: np.ndarray
    upstream: np.ndarray
    peak_inflight: tuple[int, ...]
    order: np.ndarray


def _fail(rule: str, message: str, action: Action | None = None) -> ScheduleInvalid:
    return ScheduleInvalid(
        message,
        rule=rule,
        action=None if action is None else str(action),
        pos=None if action is None else action.pos,
    )


def _check_shape(schedule: _Subject) -> None:
    s, d = schedule.num_stages, schedule.num_devices
    if s < 1 or d < 1 or schedule.num_microbatches < 1:
        raise _fail(
            "shape", f"need at least one stage, device and microbatch; got {s}, {d}, {schedule.num_microbatches}"
        )
    if len(schedule.placement) != s:
        raise _fail("shape", f"placement names {len(schedule.placement)} stages, the schedule has {s}")
    for stage, device in enumerate(schedule.placement):
        if not 0 <= device < d:
            raise _fail("shape", f"stage {stage} is placed on device {device}, outside 0..{d - 1}")
    orders = schedule.actions.num_devices if isinstance(schedule, ScheduleArrays) else len(schedule.orders)
    if orders != d:
        raise _fail("shape", f"there are orders for {orders} devices, the schedule has {d}")
    idle = sorted(set(range(d)) - set(schedule.placement))
    if idle:
        raise _fail("shape", f"device {idle[0]} owns no stage; place a stage on it or use fewer devices")


def _action_fault(schedule: _Subject, actions: ActionArrays, row: int) -> ScheduleInvalid:
    """The first rule action ``row`` breaks among ranges, ownership and duplicates."""
    action = actions.action(schedule, row)
    device = int(actions.device[row])
    num_stages, num_mb = schedule.num_stages, schedule.num_microbatches
    if not 0 <= action.stage < num_stages:
        return _fail("stage-range", f"action {action} names stage {action.stage}, outside 0..{num_stages - 1}", action)
    if not 0 <= action.microbatch < num_mb:
        return _fail(
            "microbatch-range", f"action {action} names microbatch {action.microbatch}, outside 0..{num_mb - 1}", action
        )
    owner = schedule.placement[action.stage]
    if owner != device:
        return _fail(
            "wrong-device",
            f"action {action} is on device {device} but stage {action.stage} is placed on device {owner}",
            action,
        )
    return _fail("duplicate-action", f"action {action} appears twice", action)


@dataclass(frozen=True, slots=True, eq=False)
class _Faults:
    """The violations one family of rules found: the first
    :data:`~pipedsl.errors.MAX_REPORTED`, and how many there are in all."""

    faults: list[ScheduleInvalid]
    found: int


def _check_actions(schedule: _Subject, actions: ActionArrays) -> tuple[_Faults, np.ndarray | None, np.ndarray]:
    """Ranges, ownership, duplicates: every action (in device order) that breaks one.
    Returns those, how many actions there are of each (stage, microbatch, kind), shape
    (S * M, 4), kinds in code order (None when there are too few actions for every pair
    to have its two or more: a table that size could dwarf the schedule), and which
    actions name a stage and microbatch in range (bool, shape (N,))."""
    num_stages, num_mb = schedule.num_stages, schedule.num_microbatches
    kind, stage, mb = actions.kind, actions.stage, actions.microbatch
    bad_stage = (stage < 0) | (stage >= num_stages)
    in_range = ~bad_stage & (mb >= 0) & (mb < num_mb)
    owner = np.asarray(schedule.placement, dtype=np.int64)[np.where(bad_stage, 0, stage)]
    bad = ~in_range | (owner != actions.device)
    counts = None
    if 2 * num_stages * num_mb <= len(actions):
        # Each action in range as one index, pair-major; those out of range share one more.
        slots = 4 * num_stages * num_mb
        key = np.where(in_range, (stage * num_mb + mb) * 4 + kind, slots)
        counts = np.bincount(key, minlength=slots + 1)[:slots].reshape(num_stages * num_mb, 4)
        repeated = bool(counts.max(initial=0) > 1)
        order = np.argsort(key, kind="stable") if repeated else None
    else:
        order = np.lexsort((kind, mb, stage))
    if order is not None:
        # A stable sort keeps equal actions in device order: every one after the first is a duplicate.
        k, s, m = kind[order], stage[order], mb[order]
        bad[order[1:][(k[1:] == k[:-1]) & (s[1:] == s[:-1]) & (m[1:] == m[:-1])]] = True
    rows = np.flatnonzero(bad)
    faults = [_action_fault(schedule, actions, int(r)) for r in rows[:MAX_REPORTED]]
    return _Faults(faults, len(rows)), counts, in_range


def _pair_fault(schedule: _Subject, actions: ActionArrays, stage: int, mb: int, rows: list[int]) -> ScheduleInvalid:
    """What is wrong with the actions ``rows`` of (stage, microbatch): mixed or missing."""
    found = {int(actions.kind[r]): actions.action(schedule, r) for r in rows}
    f, b, i, w = (found.get(code) for code in (F, B, I, W))
    where = f"stage {stage}, microbatch {mb}"
    if b is not None and (i is not None or w is not None):
        return _fail("mixed-backward", f"{where} has both B and I/W; use one or the other", i or w)
    if f is None:
        return _fail("missing-action", f"{where} has no forward ({stage}F{mb})", b or i or w)
    if b is None and i is None and w is None:
        return _fail("missing-action", f"{where} has no backward ({stage}B{mb}, or {stage}I{mb} and {stage}W{mb})", f)
    have, lacking = (i, f"{stage}W{mb}") if w is None else (w, f"{stage}I{mb}")
    return _fail("missing-action", f"{where} splits its backward but has no {lacking}", have)


def _check_complete(
    schedule: _Subject, actions: ActionArrays, counts: np.ndarray | None, in_range: np.ndarray
) -> _Faults:
    """Every (stage, microbatch) has its F and one form of backward: every pair
    (stage-major) that does not, among the actions in range (those out of range are
    :func:`_check_actions`'s, as are ``counts`` and ``in_range``)."""
    num_mb = schedule.num_microbatches
    stage, mb = actions.stage, actions.microbatch
    if counts is None:
        return _sparse_pair_faults(schedule, actions, in_range)
    f, b, i, w = (counts > 0).T
    # A pair with no action at all lacks its F too.
    broken = (b & (i | w)) | ~f | (~b & ~(i & w))
    pairs = np.flatnonzero(broken)
    faults = []
    for pair in pairs[:MAX_REPORTED].tolist():
        at_stage, at_mb = divmod(pair, num_mb)
        rows = np.flatnonzero((stage == at_stage) & (mb == at_mb)).tolist()
        faults.append(_pair_fault(schedule, actions, at_stage, at_mb, rows))
    return _Faults(faults, len(pairs))


def _index(schedule: _Subject, actions: ActionArrays) -> np.ndarray:
    """The row of each (kind, stage, microbatch) of a complete schedule, flat index
    ``(kind * S + stage) * M + microbatch``, -1 where there is none."""
    num_stages, num_mb = schedule.num_stages, schedule.num_microbatches
    index = np.full(4 * num_stages * num_mb, -1, dtype=np.int64)
    key = (actions.kind.astype(np.int64) * num_stages + actions.stage) * num_mb + actions.microbatch
    index[key] = np.arange(len(actions), dtype=np.int64)
    return index


def _sparse_pair_faults(schedule: _Subject, actions: ActionArrays, in_range: np.ndarray) -> _Faults:
    """Every pair (stage-major, the first :data:`~pipedsl.errors.MAX_REPORTED`) that is
    broken or has no action, among more pairs than the actions could fill, found from the
    pairs present alone (the work follows the actions, not the pairs)."""
    num_mb = schedule.num_microbatches
    kind, stage, mb = actions.kind, actions.stage, actions.microbatch
    order = np.lexsort((mb, stage))
    order = order[in_range[order]]
    s, m = stage[order], mb[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (s[1:] != s[:-1]) | (m[1:] != m[:-1])
    group = np.cumsum(first) - 1
    pairs = int(first.sum())
    have = np.zeros((pairs, 4), dtype=bool)
    have[group, kind[order]] = True
    f, b, i, w = have.T
    broken = (b & (i | w)) | ~f | (~b & ~(i & w))
    present = (s[first] * num_mb + m[first]).tolist()
    broken_at = set(np.flatnonzero(broken).tolist())
    # Walk the pairs in stage-major order: a present pair that is broken, or a gap before
    # the next present one (a pair with no action at all), until enough are found.
    faults: list[ScheduleInvalid] = []
    expected = 0
    for k, code in enumerate([*present, schedule.num_stages * num_mb]):
        while expected < code and len(faults) < MAX_REPORTED:
            faults.append(_pair_fault(schedule, actions, expected // num_mb, expected % num_mb, []))
            expected += 1
        if len(faults) >= MAX_REPORTED:
            break
        expected = code + 1
        if k in broken_at:
            rows = order[group == k].tolist()
            faults.append(_pair_fault(schedule, actions, code // num_mb, code % num_mb, rows))
    total = len(broken_at) + schedule.num_stages * num_mb - pairs
    return _Faults(faults, total)


def _links(schedule: _Subject, actions: ActionArrays, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(local, upstream) of every action, as :class:`Checked` describes them."""
    num_stages, num_mb = schedule.num_stages, schedule.num_microbatches
    per_kind = num_stages * num_mb
    kind, stage = actions.kind, actions.stage
    pair = stage * num_mb + actions.microbatch
    local = np.full(len(actions), -1, dtype=np.int64)
    upstream = np.full(len(actions), -1, dtype=np.int64)
    forward = (kind == F) & (stage > 0)
    upstream[forward] = index[F * per_kind + pair[forward] - num_mb]
    weight = kind == W
    local[weight] = index[I * per_kind + pair[weight]]
    backward = (kind == B) | (kind == I)
    local[backward] = index[F * per_kind + pair[backward]]
    inner = backward & (stage < num_stages - 1)
    after = pair[inner] + num_mb
    split = index[I * per_kind + after]
    upstream[inner] = np.where(split >= 0, split, index[B * per_kind + after])
    return local, upstream


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


@dataclass(frozen=True, slots=True, eq=False)
class _Execution:
    """A run of per-device orders in which an action waits until the one it needs has run.

    Attributes:
      order: the rows that ran, int64, each after every row it needs: stretches of one
        device's order, in the order they ran.
      pointer: per device, the first row it did not run (its end bound when it finished).
      blocked_on: per device that did not finish, the row it waits for, in the order
        the devices began to wait.
    """

    order: np.ndarray
    pointer: list[int]
    blocked_on: dict[int, int]


def _execute(bounds: np.ndarray, stops: np.ndarray, needs: np.ndarray, owners: np.ndarray) -> _Execution:
    """Run device d's rows ``bounds[d]:bounds[d + 1]`` in order, each device until a row
    needs one not yet run, waking it once that one has run.

    ``stops`` are the rows, increasing, that need row ``needs[k]`` of device ``owners[k]``
    (a need at or past the end of that device's rows is never met); every other row needs
    only rows before it on its own device. A device runs as far as it can, then the one
    woken last; devices are woken in the order the rows they wait for ran.
    """
    cuts = np.searchsorted(stops, bounds).tolist()
    # Per device, an iterator over its stops, resumed where the device last stopped: a
    # device is woken only once the row it waits for has run, so that stop is passed.
    rest = [
        zip(needs[a:b].tolist(), owners[a:b].tolist(), stops[a:b].tolist())
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    ends = bounds.tolist()[1:]
    pointer = bounds.tolist()[:-1]
    waiters: list[list[tuple[int, int]]] = [[] for _ in pointer]
    # Per device, the row it waited for last and the visit it waited in (lists, not a
    # dict of the devices waiting now: one store per wait, none per wake).
    wanted, waited_in = [0] * len(pointer), [0] * len(pointer)
    began: list[int] = []
    ended: list[int] = []
    ready = list(range(len(pointer)))
    while ready:
        d = ready.pop()
        for need, owner, row in rest[d]:
            if pointer[owner] <= need:
                heapq.heappush(waiters[owner], (need, d))
                wanted[d], waited_in[d] = need, len(began)
                done = row
                break
        else:
            done = ends[d]
        began.append(pointer[d])
        ended.append(done)
        pointer[d] = done
        # Wake whoever waits for a row this device has now run past, first run first.
        waiting = waiters[d]
        while waiting and waiting[0][0] < done:
            ready.append(heapq.heappop(waiting)[1])
    # The devices that did not finish, in the order they waited for the last time.
    stuck = sorted((waited_in[d], d) for d, at in enumerate(pointer) if at < ends[d])
    return _Execution(_stretches(began, ended), pointer, {d: wanted[d] for _, d in stuck})


def _stretches(began: list[int], ended: list[int]) -> np.ndarray:
    """The rows ``began[k]:ended[k]`` for every k in turn, int64."""
    first, stop = np.array(began, dtype=np.int64), np.array(ended, dtype=np.int64)
    lengths = stop - first
    # Each row is its stretch's first row plus its offset within the stretch.
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(first - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _check_execution(schedule: _Subject, actions: ActionArrays, local: np.ndarray, upstream: np.ndarray) -> np.ndarray:
    """Run the orders with unit steps; report every same-device misorder and every
    cross-device cycle. Returns the rows in the order they ran (:attr:`_Execution.order`).

    A device runs until an action needs one not yet done; it then waits, and is woken
    when that one is done. What remains blocked at the end waits in a cycle.

    An action is done once its device has run past it, and a need met earlier on the
    same device always is, so a device can stop only at its *stops*: actions that need
    one from another device, or one that comes later on their own (a misorder). The
    loop visits only those; devices are woken in the order the actions they wait for
    were done, as a walk over every action would. A misordered action waits on its own
    device, which never gets there; the first device to wait so is the first misorder
    a walk would meet, and it is reported first, before any cycle (a run that blocks
    before any misorder reports its cycle first). Every other misorder follows in device
    order, and the cycles that the run meets once each misorder and each cycle found so
    far is let through (:func:`_cycles`), up to :data:`~pipedsl.errors.MAX_REPORTED`.
    """
    rows = np.arange(len(actions), dtype=np.int64)
    device = actions.device
    cross = (upstream >= 0) & (device[np.maximum(upstream, 0)] != device)
    misordered = (local > rows) | (~cross & (upstream > rows))
    stops = np.flatnonzero(cross | misordered)
    needs = np.where(local > rows, local, upstream)[stops]
    owners = device[np.maximum(needs, 0)]
    run = _execute(actions.bounds, stops, needs, owners)
    if not run.blocked_on:
        return run.order
    # The misorder a walk meets first, if it meets one before the devices block.
    first = next((run.pointer[d] for d, need in run.blocked_on.items() if int(device[need]) == d), None)
    wrong = np.flatnonzero(misordered)
    if first is not None:
        wrong = np.concatenate([[first], wrong[wrong != first]])
    need_of = np.where(local > rows, local, upstream)
    misorders = [_misorder(schedule, actions, int(r), int(need_of[r])) for r in wrong[:MAX_REPORTED].tolist()]
    cycles, cycles_found = _cycles(schedule, actions, stops, needs, owners, released=wrong, room=MAX_REPORTED)
    faults = misorders + cycles if first is not None else cycles + misorders
    raise several(faults, found=len(wrong) + cycles_found)


def _misorder(schedule: _Subject, actions: ActionArrays, row: int, need: int) -> ScheduleInvalid:
    action = actions.action(schedule, row)
    return _fail(
        "dependency-order",
        f"action {action} on device {int(actions.device[row])} comes before {actions.text(need)}, which it needs",
        action,
    )


def _cycles(
    schedule: _Subject,
    actions: ActionArrays,
    stops: np.ndarray,
    needs: np.ndarray,
    owners: np.ndarray,
    *,
    released: np.ndarray,
    room: int,
) -> tuple[list[ScheduleInvalid], int]:
    """The deadlocks of the orders, at most ``room`` of them, and how many were found.

    The run is repeated with the ``released`` stops let through (the misorders), and with
    the waits of each cycle found let through too, so that a cycle further down the
    orders is found as well; each run lets at least one more stop through, and the runs
    stop once ``room`` cycles are found (the cycles of the last run are all counted)."""
    faults: list[ScheduleInvalid] = []
    found = 0
    let_through = released
    while len(faults) < room:
        keep = ~np.isin(stops, let_through)
        run = _execute(actions.bounds, stops[keep], needs[keep], owners[keep])
        if not run.blocked_on:
            break
        waits = _wait_cycles(actions, run.blocked_on)
        found += len(waits)
        faults += [_deadlock(schedule, actions, cycle, run.blocked_on, run.pointer) for cycle in waits]
        waiting = [run.pointer[d] for cycle in waits for d in cycle]
        let_through = np.concatenate([let_through, np.asarray(waiting, dtype=np.int64)])
    return faults[:room], found


def _wait_cycles(actions: ActionArrays, blocked_on: dict[int, int]) -> list[list[int]]:
    """Every cycle of the wait-for graph of the blocked devices, each as the devices in
    the order a walk from the lowest device not yet seen meets them."""
    # Every blocked device waits on exactly one other blocked device, so walking the
    # wait-for edges from any of them must enter a cycle.
    seen: set[int] = set()
    cycles = []
    for start in sorted(blocked_on):
        if start in seen:
            continue
        visited: list[int] = []
        device = start
        while device not in visited and device not in seen:
            visited.append(device)
            device = int(actions.device[blocked_on[device]])
        seen.update(visited)
        if device in visited:
            cycles.append(visited[visited.index(device) :])
    return cycles


def _deadlock(
    schedule: _Subject, actions: ActionArrays, cycle: list[int], blocked_on: dict[int, int], pointer: list[int]
) -> ScheduleInvalid:
    steps = []
    for d in cycle:
        at, want = actions.text(pointer[d]), blocked_on[d]
        steps.append(f"device {d} waits at {at} for {actions.text(want)} on device {int(actions.device[want])}")
    first = actions.action(schedule, pointer[cycle[0]])
    return _fail("deadlock", "the device orders wait on each other: " + "; ".join(steps), first)


def checked(schedule: Schedule | ScheduleArrays) -> Checked:
    """Check every rule but the in-flight limit; raise :class:`ScheduleInvalid` naming the
    first action that breaks one, carrying every other violation found (``err.errors``),
    up to :data:`~pipedsl.errors.MAX_REPORTED` and then a count: those of ranges,
    ownership and duplicates with those of completeness; once those hold, every misorder
    and every deadlock (ordering needs each action once, where it belongs). The result is kept on a Schedule, so a second call is free; a
    :class:`~pipedsl.arrays.ScheduleArrays` is checked on its columns as they are, and an
    error names its action without a source position."""
    if isinstance(schedule, Schedule) and isinstance(schedule._checked, Checked):
        return schedule._checked
    _check_shape(schedule)
    with paused_collector():
        actions = schedule.actions if isinstance(schedule, ScheduleArrays) else ActionArrays.of(schedule)
        wrong, counts, in_range = _check_actions(schedule, actions)
        # Completeness is read off the actions in range whatever else is wrong with them;
        # the order is checked only once every action is where it belongs, once each.
        missing = _check_complete(schedule, actions, counts, in_range)
        del counts, in_range
        if wrong.found or missing.found:
            raise several(wrong.faults + missing.faults, found=wrong.found + missing.found)
        index = _index(schedule, actions)
        local, upstream = _links(schedule, actions, index)
        del index
        order = _check_execution(schedule, actions, local, upstream)
    found = Checked(actions, local, upstream, peak_inflight(actions), order)
    if isinstance(schedule, Schedule):
        object.__setattr__(schedule, "_checked", found)
    return found


def _over_limit(over: dict[int, int], limit: int, *, devices: int) -> ScheduleInvalid:
    """One error for every device whose peak in-flight count (``over``, device to peak) is
    past ``limit``: the devices named once, as ranges, with the highest peak."""
    ranges: list[list[int]] = []
    for device in sorted(over):
        if ranges and ranges[-1][1] == device - 1:
            ranges[-1][1] = device
        else:
            ranges.append([device, device])
    names = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
    peaks = set(over.values())
    most = max(peaks)
    if len(over) == 1:
        said = f"device {names} holds {most} microbatches in flight at its peak"
    else:
        which = f"all {devices} devices" if len(over) == devices else f"devices {names}"
        said = f"{which} hold {'' if len(peaks) == 1 else 'up to '}{most} microbatches in flight at their peaks"
    return _fail("max-inflight", f"{said}, above the limit of {limit}")


def kept_check(schedule: Schedule) -> Checked | None:
    """What :func:`checked` kept on ``schedule``, or None when it has not run (this checks nothing)."""
    return schedule._checked if isinstance(schedule._checked, Checked) else None


def validate(schedule: Schedule, *, max_inflight: int | None = None) -> Report:
    """Check every rule; raise :class:`ScheduleInvalid` naming the first violation, with
    every other one found in ``err.errors`` (up to :data:`~pipedsl.errors.MAX_REPORTED`;
    ``err.omitted`` counts those past it), as :func:`checked` describes; printed, it lists
    each at its line with a caret.

    ``max_inflight`` must be a whole number >= 0 (PipedslError otherwise).
    """
    schedule = schedule_argument(schedule, function="validate")
    if max_inflight is not None and (type(max_inflight) is not int or max_inflight < 0):
        raise PipedslError(f"validate: max_inflight must be a whole number >= 0, or left out, got {max_inflight!r}")
    found = checked(schedule)
    if max_inflight is not None:
        over = {device: peak for device, peak in enumerate(found.peak_inflight) if peak > max_inflight}
        if over:
            raise _over_limit(over, max_inflight, devices=len(found.peak_inflight))
    return Report(num_actions=len(found.actions), peak_inflight=found.peak_inflight)
