"""Fitting the cluster's numbers to what the machine calibration measured
(:mod:`pipedsl.cli.machine`): each fit finds the value at which the simulator prices the
calibration's measurements as measured.

- :func:`fit_compute`: the compute rate, the fixed cost of a kernel and of a step, to the
  data-parallel training steps (least squares of the log of priced over measured seconds);
- :func:`fit_sync`: the wait of a collective inside a program, fixed and per token, to
  the tensor-parallel steps;
- :func:`fit_idle_share`: the share of an idle device's time that busy ones take up, to a
  two-stage pipeline's step (with tensor-parallel stages or without);
- :func:`fit_alone`: how fast a device busy alone runs, to a pipeline step whose busy stage
  has a device per core;
- :func:`fit_ring`: the ring all-reduce's latency and bandwidth, to the all-reduces;
- :func:`fit_split`: what a backward split in two programs costs, to one stage's backward
  timed fused and split.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipedsl.cli.timed import PIPELINE_STEP_SCHEDULE
from pipedsl.simulator import Cluster, Model, Plan, estimate, prepare

__all__ = [
    "PIPELINE_STAGES", "fit_alone", "fit_compute", "fit_idle_share", "fit_ring", "fit_split", "fit_sync",
    "pipeline_sequences", "priced_step", "step_plan",
]  # fmt: skip

_FIT_ROUNDS = 60
"""Most damped Gauss-Newton rounds of the compute fit (from its start it settles within about forty)."""
PIPELINE_STAGES = 2
"""Stages of the pipeline step that measures idle devices (one busy at a time, so half
the devices idle)."""
_ALONE_LOW = 0.05  # the least alone_efficiency the fit tries


def fit_ring(times: dict[tuple[int, int], float]) -> tuple[float, float]:
    """(α seconds, B bytes per second) of ``2(n-1)·α + 2(n-1)/n · S/B`` by least squares
    of the relative error over the measured all-reduces (so that the small ones, which
    set α, weigh as much as the large ones; both kept positive)."""
    measured = np.array(list(times.values()))
    rows = np.array([[2 * (n - 1), 2 * (n - 1) / n * s] for n, s in times]) / measured[:, None]
    alpha, inverse = np.linalg.lstsq(rows, np.ones(len(measured)), rcond=None)[0]
    return max(float(alpha), 1e-6), 1.0 / max(float(inverse), 1e-12)


def step_plan(dp: int, tp: int, microbatch_size: int, microbatches: int = 1, *, pp: int = 1) -> Plan:
    """The plan a calibration step runs: ``pp`` stages (beyond one, a
    :data:`~pipedsl.cli.timed.PIPELINE_STEP_SCHEDULE` pipeline), each over ``dp x tp``
    devices, ``microbatches`` per data rank."""
    return Plan(
        dp=dp, tp=tp, pp=pp, microbatch_size=microbatch_size, global_batch=dp * microbatch_size * microbatches,
        schedule=PIPELINE_STEP_SCHEDULE if pp > 1 else None, flash_attention=False, dp_overlap=0.0, reduce_bytes=4,
    )  # fmt: skip


def priced_step(model: Model, cluster: Cluster, devices: int, microbatch_size: int, microbatches: int = 1) -> float:
    """The simulator's seconds of what :func:`~pipedsl.cli.timed.training_step` runs without a tensor axis:
    each data-parallel microbatch's forward and backward, the gradients' all-reduce, the
    optimizer's update and the runtime's fixed cost of a step."""
    return estimate(model, cluster, step_plan(devices, 1, microbatch_size, microbatches)).step_time_s


def _with_compute(base: Cluster, x: np.ndarray) -> Cluster:
    """``base`` at ``x`` = log (``peak_flops``, ``kernel_launch_s``, ``step_overhead_s``,
    ``working_set_bytes``)."""
    flops, launch, step, working_set = np.exp(x)
    return dataclasses.replace(
        base, peak_flops=float(flops), kernel_launch_s=float(launch), step_overhead_s=float(step),
        working_set_bytes=float(working_set),
    )  # fmt: skip


# The box the fit searches, in the coordinates of :func:`_with_compute`. A launch or a
# step's cost within a factor ten of its lower bound (10 ns, 1 µs), or a working set
# within a factor ten of its upper bound (10 TB), stands for none: where a term changes
# nothing the fit drifts towards the bound without reaching it.
_LOW = np.log([1e6, 1e-9, 1e-7, 1e3])
_HIGH = np.log([1e15, 1.0, 10.0, 1e13])


def fit_compute(model: Model, base: Cluster, devices: int, measured: dict[tuple[int, int, int], float]) -> Cluster:
    """``base`` with the ``peak_flops``, ``kernel_launch_s``, ``step_overhead_s`` and
    ``working_set_bytes`` at which the simulator prices the steps of ``measured``
    ((layers, sequences per device, microbatches) to seconds) closest to as measured:
    least squares of the log of priced over measured seconds, by damped Gauss-Newton
    within a box. A term the steps do not call for ends near its bound and is 0."""
    shapes, seconds = list(measured), np.log(list(measured.values()))

    def priced(cluster: Cluster, shape: tuple[int, int, int]) -> float:
        layers, sequences, microbatches = shape
        return priced_step(dataclasses.replace(model, layers=layers), cluster, devices, sequences, microbatches)

    def residuals(x: np.ndarray) -> np.ndarray:
        cluster = _with_compute(base, x)
        return np.log([priced(cluster, shape) for shape in shapes]) - seconds

    # Start from the rate that prices the largest step alone, nothing else slowing it,
    # and a working set that would slow it by a quarter.
    largest = max(shapes, key=lambda shape: shape[0] * shape[1] * shape[2])
    plain = dataclasses.replace(base, working_set_bytes=0.0)
    start = priced(plain, largest) / measured[largest]
    kept = _kept_bytes(dataclasses.replace(model, layers=largest[0]), plain, devices, largest[1])
    x = np.clip(np.log([base.peak_flops * start, 1e-4, 1e-3, 4 * kept]), _LOW, _HIGH)
    r, damping = residuals(x), 1e-2
    for _ in range(_FIT_ROUNDS):
        jacobian = np.column_stack([(residuals(x + 1e-4 * unit) - r) / 1e-4 for unit in np.eye(len(x))])
        normal = jacobian.T @ jacobian
        step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -jacobian.T @ r)
        trial = np.clip(x + step, _LOW, _HIGH)
        tried = residuals(trial)
        if tried @ tried < r @ r:
            done = r @ r - tried @ tried < 1e-12
            x, r, damping = trial, tried, damping / 3
            if done:
                break
        else:
            damping *= 4
    cluster = _with_compute(base, x)
    return dataclasses.replace(
        cluster,
        kernel_launch_s=0.0 if x[1] < _LOW[1] + np.log(10) else cluster.kernel_launch_s,
        step_overhead_s=0.0 if x[2] < _LOW[2] + np.log(10) else cluster.step_overhead_s,
        working_set_bytes=0.0 if x[3] > _HIGH[3] - np.log(10) else cluster.working_set_bytes,
    )


def _kept_bytes(model: Model, cluster: Cluster, devices: int, microbatch_size: int) -> float:
    """Activation bytes one microbatch keeps on each device in the data-parallel step of
    ``model`` over ``devices`` devices at ``microbatch_size`` sequences per device."""
    return float(sum(prepare(model, cluster, step_plan(devices, 1, microbatch_size)).residual))


def fit_idle_share(
    model: Model, cluster: Cluster, devices: int, microbatch_size: int, measured: float, *, tensor: int = 1
) -> Cluster:
    """``cluster`` with the share in [0, 1] at which the simulator prices the pipeline step
    (:data:`PIPELINE_STAGES` stages of ``tensor``-way tensor parallel stages, one
    microbatch of :func:`pipeline_sequences` per data rank) as ``measured`` seconds, or
    the nearer end where none does (the priced step shrinks as the share grows): the
    ``idle_share``, or for ``tensor`` beyond 1 the ``tensor_idle_share``."""
    stages = PIPELINE_STAGES
    plan = step_plan(devices // (stages * tensor), tensor, pipeline_sequences(stages, microbatch_size, tensor), pp=stages)

    def at(share: float) -> Cluster:
        if tensor == 1:
            return dataclasses.replace(cluster, idle_share=share)
        return dataclasses.replace(cluster, tensor_idle_share=share)

    def priced(share: float) -> float:
        return estimate(model, at(share), plan).step_time_s

    low, high = 0.0, 1.0
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if priced(middle) > measured else (low, middle)
    return at((low + high) / 2)


def pipeline_sequences(stages: int, microbatch_size: int, tensor: int = 1) -> int:
    """Sequences per data rank of a pipeline step of ``stages`` stages, each ``tensor``-way
    tensor parallel, over every device: as many as the largest compute step's (the idle
    share falls with the work: on two cores 100% at half as many, which priced
    one-microbatch plans 17-28% fast; 81% here)."""
    return microbatch_size * stages * tensor


def fit_alone(model: Model, cluster: Cluster, stages: int, microbatch_size: int, measured: float) -> Cluster:
    """``cluster`` with the ``alone_efficiency`` in [:data:`_ALONE_LOW`, 1] at which the
    simulator prices the pipeline step of ``stages`` stages (one microbatch; see
    :func:`pipeline_sequences`) as ``measured`` seconds, or the nearer end where none does
    (1 where the idle share already prices it as slow or slower: the priced step grows as
    the efficiency falls)."""
    devices = cluster.gpus_per_node
    plan = step_plan(devices // stages, 1, pipeline_sequences(stages, microbatch_size), pp=stages)

    def priced(efficiency: float) -> float:
        return estimate(model, dataclasses.replace(cluster, alone_efficiency=efficiency), plan).step_time_s

    low, high = _ALONE_LOW, 1.0
    if priced(high) >= measured:
        return cluster
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if priced(middle) > measured else (low, middle)
    return dataclasses.replace(cluster, alone_efficiency=(low + high) / 2)


def fit_sync(model: Model, cluster: Cluster, devices: int, measured: dict[tuple[int, int], float]) -> Cluster:
    """``cluster`` with the ``collective_sync_s`` and ``collective_sync_per_token_s`` at
    which the simulator prices the executor's tensor-parallel training steps
    (:func:`~pipedsl.cli.timed.training_step`, ``measured`` seconds by (tensor axis, sequences per data
    rank)) closest to as measured (least squares, both at least 0)."""

    def priced(sync: float, per_token: float, shape: tuple[int, int]) -> float:
        waits = dataclasses.replace(cluster, collective_sync_s=sync, collective_sync_per_token_s=per_token)
        tensor, sequences = shape
        return estimate(model, waits, step_plan(devices // tensor, tensor, sequences)).step_time_s

    # A step's seconds grow by one wait per collective, linear in both terms.
    shapes = list(measured)
    without = np.array([priced(0.0, 0.0, shape) for shape in shapes])
    rows = np.array([[priced(1.0, 0.0, shape), priced(0.0, 1.0, shape)] for shape in shapes]) - without[:, None]
    sync, per_token = _least_squares_at_least_zero(rows, np.array(list(measured.values())) - without)
    return dataclasses.replace(cluster, collective_sync_s=sync, collective_sync_per_token_s=per_token)


def _least_squares_at_least_zero(rows: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """The (a, b) >= 0 that minimise ``|rows @ (a, b) - values|``: the unconstrained
    solution where it has no negative part, else the best with one or both at 0."""
    candidates = [np.linalg.lstsq(rows, values, rcond=None)[0]]
    for column in (0, 1):
        alone = rows[:, column]
        weight = max(float(alone @ values) / float(alone @ alone), 0.0) if alone @ alone > 0 else 0.0
        candidates.append(np.array([weight, 0.0] if column == 0 else [0.0, weight]))
    feasible = [c for c in candidates if (c >= 0).all()]
    best = min(feasible, key=lambda c: float(np.sum((rows @ c - values) ** 2)))
    return float(best[0]), float(best[1])


def fit_split(cluster: Cluster, fused_s: float, split_s: float) -> Cluster:
    """``cluster`` with the ``split_backward_cost`` of a stage whose fused backward took
    ``fused_s`` seconds and whose ``I`` then ``W`` took ``split_s``: the simulator prices
    them ``c + o`` and ``k·c + 2·o`` (``c`` the backward's work, ``o`` an action's
    overhead), so ``k = (split_s - 2·o) / (fused_s - o)``; at least 1, since the halves
    run the fused backward's equations once each."""
    overhead = cluster.action_overhead_s
    work = max(fused_s - overhead, 1e-12)
    return dataclasses.replace(cluster, split_backward_cost=max((split_s - 2 * overhead) / work, 1.0))
