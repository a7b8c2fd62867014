"""What a schedule's order alone says: peak memory held on each device, and a lower bound
on the step's time. Validation, the simulator and the planner all ask this module.

Memory does not depend on time: it follows each device's order. One microbatch's ``F``
on stage s keeps ``residual[s]`` bytes until its ``B``; a split backward's ``I`` turns
them into ``weight_residual[s]`` bytes (what ``W`` needs), freed by ``W``. The count of
residual sets held (``residual = weight_residual = 1``) is the *in-flight* count: the
(stage, microbatch) pairs whose ``F`` has run and whose ``B`` (or ``W``, when split)
has not. Peaks are taken after each action, so the residual an ``I`` consumes and the
weight residual it produces are not counted together.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipedsl.arrays import ActionArrays, B, F, I
from pipedsl.ir import Schedule

__all__ = ["peak_held", "peak_inflight", "chain_lower_bound"]


def _segment_max(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Per segment ``bounds[d]:bounds[d + 1]`` of ``values``, its maximum, or 0 when the
    segment is empty or holds only negatives; shape (D,)."""
    starts, stops = bounds[:-1], bounds[1:]
    out = np.zeros(starts.shape[0], dtype=values.dtype)
    full = stops > starts
    if values.shape[0] and full.any():
        out[full] = np.maximum.reduceat(values, starts[full])
    return np.maximum(out, 0)


def peak_held(
    arrays: ActionArrays, residual: Sequence[int] | np.ndarray, weight_residual: Sequence[int] | np.ndarray
) -> np.ndarray:
    """Per device, the most bytes held at once, int64 shape (D,) (see the module docstring).

    ``residual[s]`` and ``weight_residual[s]`` are bytes per microbatch on stage s, shape (S,).
    """
    res = np.asarray(residual, dtype=np.int64)
    wres = np.asarray(weight_residual, dtype=np.int64)
    # Per kind and stage, the change in bytes held: F +res, B -res, I wres - res, W -wres.
    change = np.stack([res, -res, wres - res, -wres])
    held = np.cumsum(change[arrays.kind, arrays.stage])
    # A device's running total starts from what the devices before it left.
    carried = np.concatenate([[0], held])[arrays.bounds[:-1]]
    return _segment_max(held - np.repeat(carried, np.diff(arrays.bounds)), arrays.bounds)


def peak_inflight(schedule: Schedule | ActionArrays) -> tuple[int, ...]:
    """Per device, the most (stage, microbatch) pairs held between ``F`` and ``B`` (or ``W``)."""
    arrays = ActionArrays.of(schedule) if isinstance(schedule, Schedule) else schedule
    stages = int(arrays.stage.max()) + 1 if len(arrays) else 1
    ones = np.ones(stages, dtype=np.int64)
    return tuple(int(p) for p in peak_held(arrays, ones, ones))


def chain_lower_bound(arrays: ActionArrays, seconds: np.ndarray) -> float:
    """Seconds the schedule takes at least when ``seconds[k, s]`` is the duration of kind k
    (F, B, I, W) on stage s (shape (4, S)) and transfers are free.

    Each action starts no earlier than its own microbatch's chain of dependencies allows
    when nothing else waits: F on stage s after the forwards of stages before s; a
    backward (B or I) on stage s after every forward and the backwards of the stages
    after s; W after that and its own I. A device runs its actions in order, so it ends
    no earlier than, for every k, the k-th action's earliest start plus the durations of
    it and of everything after it on the device.
    """
    kinds, stages = arrays.kind, arrays.stage
    split = bool(np.any(kinds == I))
    forward = seconds[F]
    backward = seconds[I] if split else seconds[B]
    before = np.concatenate([[0.0], np.cumsum(forward)[:-1]])
    after = np.concatenate([np.cumsum(backward[::-1])[::-1][1:], [0.0]])
    total_forward = float(forward.sum())
    stage_chain = np.stack([before, total_forward + after, total_forward + after, total_forward + after + seconds[I]])
    earliest = stage_chain[kinds, stages]
    duration = seconds[kinds, stages]
    lengths = np.diff(arrays.bounds)
    if len(lengths) and lengths[0] > 0 and bool((lengths == lengths[0]).all()):
        # Devices of equal length: one row each, summed along the row (cumsum adds a
        # row's numbers one by one, in the same order as the loop below would).
        rows = (-1, int(lengths[0]))
        remaining = np.cumsum(duration.reshape(rows)[:, ::-1], axis=1)[:, ::-1]
        return max(0.0, float((earliest.reshape(rows) + remaining).max()))
    bound = 0.0
    bounds = arrays.bounds.tolist()
    # Per device, so that each remaining-time sum adds the same numbers in the same order
    # whatever the other devices hold.
    for start, stop in zip(bounds, bounds[1:]):
        if stop > start:
            remaining = np.cumsum(duration[start:stop][::-1])[::-1]
            bound = max(bound, float((earliest[start:stop] + remaining).max()))
    return bound
