"""Devices that share compute: the simulator's passes for them.

Forced CPU devices share one host's cores, so how fast one computes depends on how many
compute at that moment. The cost model's ``speedup[n - 1]`` says how many times as fast as
its priced seconds a device computes while ``n`` devices compute at once
(:meth:`~pipedsl.simulator.hardware.Cluster.speedup` gives it for a cluster). Time
advances from event to event, a compute starting or ending: at each, every idle device
whose input has arrived starts its next compute, and every running one progresses at the
rate of the devices running. Each device keeps its program order, and a value arrives its
transfer's seconds after its compute ends, as in :mod:`~pipedsl.simulator.engine`'s pass,
which this one matches when every speed-up is 1. The pass visits every device at every
event: linear in computes times devices, and deterministic.

Where the devices' programs take turns instead (:func:`settle_serial`: XLA's CPU client
runs a program over several devices only after the one dispatched before it), the
computes run one at a time, in the order they were dispatched.
"""

from __future__ import annotations

import math

from pipedsl.program import NEVER_SENT, ProgramArrays

__all__ = ["settle_shared", "settle_serial"]

_UNSENT = float("inf")
"""A row's arrival until it sends, told apart by identity from a time that is infinite."""


def settle_shared(
    arrays: ProgramArrays, duration: list[float], sent: list[float], overlap: bool, speedup: tuple[float, ...]
) -> tuple[list[float], list[float], list[float], tuple[int, int] | None]:
    """Processor sharing (module docstring): (start, end, arrival, stuck) per compute row, where
    ``duration`` holds each row's priced seconds and ``sent`` its outgoing transfer's
    (0.0 where it sends nothing); while n devices compute, each runs ``speedup[n - 1]``
    times as fast as priced. A device starts its next compute at the first event at
    which it is free (its last compute ended, or with blocking sends its transfer
    arrived) and the value it receives has arrived."""
    count = len(duration)
    recv_from = arrays.recv_from.tolist()
    bounds = arrays.actions.bounds.tolist()
    num_devices = len(bounds) - 1
    start, end, arrival = [0.0] * count, [0.0] * count, [_UNSENT] * count
    pointer, free = bounds[:-1], [0.0] * num_devices
    running: dict[int, list[float]] = {}  # device -> [its row, priced seconds left]
    blocking, t = not overlap, 0.0
    while True:
        waiting = math.inf  # the earliest time an idle device whose input is sent becomes ready
        for d in range(num_devices):
            row = pointer[d]
            if d in running or row >= bounds[d + 1]:
                continue
            source, ready = recv_from[row], free[d]
            if source == NEVER_SENT or (source >= 0 and arrival[source] is _UNSENT):
                continue
            if source >= 0 and arrival[source] > ready:
                ready = arrival[source]
            if ready <= t:
                start[row] = t
                running[d] = [float(row), duration[row]]
            elif ready < waiting:
                waiting = ready
        if not running:
            if waiting == math.inf:
                break
            t = waiting
            continue
        rate = speedup[len(running) - 1]
        finish = {d: t + left / rate for d, (_, left) in running.items()}
        now = min(min(finish.values()), waiting)
        for d, job in list(running.items()):
            if finish[d] <= now:
                row = int(job[0])
                end[row] = now
                arrival[row] = now + sent[row]
                free[d] = arrival[row] if blocking else now
                pointer[d] += 1
                del running[d]
            else:
                job[1] -= (now - t) * rate
        t = now
    stuck = next(((d, pointer[d]) for d in range(num_devices) if pointer[d] < bounds[d + 1]), None)
    return start, end, arrival, stuck


def settle_serial(
    arrays: ProgramArrays, duration: list[float], sent: list[float], overlap: bool, speed: float, order: list[int]
) -> tuple[list[float], list[float], list[float], tuple[int, int] | None]:
    """Turns (module docstring): (start, end, arrival, stuck) per compute row, as
    :func:`settle_shared`. The rows run one at a time in ``order`` (the dispatch order,
    :func:`pipedsl.program.dispatch_order`, which puts every row after the row it
    receives from), each ``speed`` times as fast as priced: a row starts once the row
    before it in ``order`` has ended, its input has arrived and, with blocking sends, its
    device's previous transfer has arrived. Rows ``order`` leaves out never run (a
    device that waits for a value never sent): the first such row is ``stuck``."""
    count = len(duration)
    recv_from = arrays.recv_from.tolist()
    device = arrays.actions.device.tolist()
    bounds = arrays.actions.bounds.tolist()
    start, end, arrival = [0.0] * count, [0.0] * count, [_UNSENT] * count
    free = [0.0] * (len(bounds) - 1)
    blocking, t = not overlap, 0.0
    for row in order:
        d, source = device[row], recv_from[row]
        ready = t if t > free[d] else free[d]
        if source >= 0 and arrival[source] > ready:
            ready = arrival[source]
        start[row] = ready
        t = end[row] = ready + duration[row] / speed
        arrival[row] = t + sent[row]
        free[d] = arrival[row] if blocking else t
    ran = set(order)
    stuck = next(
        ((d, r) for d in range(len(bounds) - 1) for r in range(bounds[d], bounds[d + 1]) if r not in ran), None
    )
    return start, end, arrival, stuck
