"""A measured machine as a :class:`~pipedsl.simulator.Cluster`: what ``pipedsl calibrate``
measured there (:class:`MachineMeasurements`, seconds taken by the CLI, which alone runs
JAX), fitted by the calibration's one fitter (:mod:`~pipedsl.simulator.calibration.fitter`)
and reported with the measurement behind every number
(:mod:`~pipedsl.simulator.calibration.report`).

Every field of the cluster is measured by one step, or is a count the machine reports:

- ``memory_bytes``: an accelerator's own limit (its allocator's); on CPU the host's memory
  over the devices;
- ``hbm_bandwidth``: an elementwise update on every device at once (on an accelerator the
  slope between updates of two sizes, the call's fixed cost left out);
- ``intra_node_latency``, ``intra_node_bandwidth`` (and the same between nodes: one node
  is measured): all-reduces over groups of 2 and of every device, of a small and a large
  buffer, fitted to the ring formula ``2(n-1)·α + 2(n-1)/n · S/B`` (:func:`fit_ring`);
- ``action_overhead_s``: the executor's cost per dispatched task: the one-layer step of
  :data:`APART_SHAPE` dispatched task by task (as pipeline devices of their own run,
  :mod:`pipedsl.tasks`) less the same step as one program (as every compute step runs), over
  its tasks; where that step is not timed, the dispatch of a tiny program, every device
  dispatching at once;
- ``peak_flops`` and ``matmul_half_flops`` on an accelerator (GPU, TPU): matrix products
  of two sizes in the model's dtype, each timed as a chain in one program (the call's
  fixed cost left out), ``1/rate = 1/peak + half / (peak·F)`` through both (every dtype's rate
  is reported); on CPU the rate the executor's training steps achieve, fitted with the
  two fixed costs below (a product benchmark overstates it about tenfold there: the
  backward's transposed products, attention's small ones and the elementwise work run
  far below it);
- ``kernel_launch_s`` and ``step_overhead_s``: fitted with the rate (on GPU alone) to the
  executor's data-parallel training steps over every device (:func:`compute_shapes`):
  what every kernel costs on top of its work, and what a step costs once (the step of
  four microbatches tells it from what each microbatch costs);
- ``collective_latency_s``: fitted with them to the whole model's tensor-parallel steps
  over every device (:func:`tensor_degrees`), whose collectives run while the devices
  compute: what one collective costs whatever its size (its launch and the rendezvous of
  its devices; on shared cores far more than the idle all-reduces show);
- ``host_cores``: the cores this process may run on, where the devices are CPU devices
  (None on GPU), and ``busy_rates``, how much of the node's rate fewer busy devices get:
  the whole model's step on 1, 2, 4, ... devices while the others idle
  (:func:`busy_counts`), each one's throughput over the same step's on every device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from pipedsl.ir import Schedule
from pipedsl.library import load
from pipedsl.program import lower
from pipedsl.simulator.calibration.fitter import Fitted, Parameter, Step, least_squares
from pipedsl.simulator.calibration.report import Measured, Report, reproduced
from pipedsl.simulator.estimate import estimate
from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.plan import Plan
from pipedsl.tasks import task_starts

__all__ = [
    "APART_SHAPE", "apart_tasks", "MachineMeasurements", "MachineCalibration", "fit_machine", "fit_ring", "fit_matmul",
    "compute_shapes", "busy_counts", "tensor_degrees", "step_plan", "priced_step", "cluster_toml",
]  # fmt: skip

MICROBATCHES = 4
"""Microbatches of the compute step that tells a step's fixed cost from a microbatch's."""
APART_SHAPE = (1, 1, MICROBATCHES)
"""(layers, sequences per device, microbatches) of the compute step that is also timed
dispatched task by task: the difference over its tasks is the executor's cost per task."""


def apart_tasks(microbatches: int) -> int:
    """The tasks (:mod:`pipedsl.tasks`) the step of one pipeline device (the SPMD schedule,
    ``1f1b`` at pp = 1) dispatches over ``microbatches`` microbatches."""
    schedule = cast(Schedule, load("1f1b", pp=1, microbatches=microbatches))  # an order, not a policy
    return int(task_starts(lower(schedule).arrays).sum())


LARGE_BATCH = 2
"""Sequences per device of the largest compute step, in microbatch sizes."""


def compute_shapes(model: Model, microbatch_size: int) -> tuple[tuple[int, int, int], ...]:
    """(layers, sequences per device, microbatches) of the compute steps: the model cut
    to one layer and whole, at one sequence and at ``microbatch_size``, one microbatch;
    the one-layer, one-sequence step with :data:`MICROBATCHES` of them; and the whole
    model at :data:`LARGE_BATCH` times the microbatch (the plans run up to that)."""
    corners = tuple((n, m, 1) for n in sorted({1, model.layers}) for m in sorted({1, microbatch_size}))
    return (*corners, (1, 1, MICROBATCHES), (model.layers, LARGE_BATCH * microbatch_size, 1))


def busy_counts(devices: int, cores: float | None) -> tuple[int, ...]:
    """The counts of busy devices at which the node's rate is measured, besides all
    ``devices``: the powers of two below it, where the devices share fewer ``cores``
    than they are; none where each device has compute of its own."""
    if cores is None or cores >= devices:
        return ()
    return tuple(1 << k for k in range(devices.bit_length()) if 1 << k < devices)


def tensor_degrees(model: Model, devices: int) -> tuple[int, ...]:
    """The tensor-parallel degrees of the calibration's tensor-parallel steps: 2 and 4,
    where they divide the devices, the model's heads and its vocabulary."""
    return tuple(t for t in (2, 4) if devices % t == 0 and model.heads % t == 0 and model.vocab % t == 0)


def step_plan(devices: int, microbatch_size: int, microbatches: int = 1, *, tp: int = 1) -> Plan:
    """The plan a calibration step runs: the SPMD plan over ``devices`` devices, ``tp``-way
    tensor parallel (with sequence parallelism) inside ``devices / tp`` data-parallel
    groups, ``microbatches`` of ``microbatch_size`` sequences per device (a group's
    microbatch is ``tp`` times that, so every device has the same work at each ``tp``), as
    the executor runs it (plain attention, fp32 gradients, nothing overlapped)."""
    return Plan(
        dp=devices // tp, tp=tp, microbatch_size=tp * microbatch_size,
        global_batch=devices * microbatch_size * microbatches, flash_attention=False, dp_overlap=0.0, tp_overlap=0.0,
        reduce_bytes=4,
    )  # fmt: skip


def priced_step(
    model: Model, cluster: Cluster, devices: int, microbatch_size: int, microbatches: int = 1, *, tp: int = 1
) -> float:
    """The simulator's seconds of a training step over ``devices`` devices
    (:func:`step_plan`): each microbatch's forward and backward, the gradients'
    all-reduce, the optimizer's update and the executor's fixed cost of a step."""
    return estimate(model, cluster, step_plan(devices, microbatch_size, microbatches, tp=tp)).step_time_s


def fit_ring(times: dict[tuple[int, int], float]) -> tuple[float, float]:
    """(α seconds, B bytes per second) of ``2(n-1)·α + 2(n-1)/n · S/B`` by least squares
    of the relative error over the measured all-reduces (so that the small ones, which
    set α, weigh as much as the large ones; both kept positive)."""
    measured = np.array(list(times.values()))
    rows = np.array([[2 * (n - 1), 2 * (n - 1) / n * s] for n, s in times]) / measured[:, None]
    alpha, inverse = np.linalg.lstsq(rows, np.ones(len(measured)), rcond=None)[0]
    return max(float(alpha), 1e-6), 1.0 / max(float(inverse), 1e-12)


def fit_matmul(times: dict[int, float]) -> tuple[float, float]:
    """(peak FLOP/s, half FLOPs) of square products timed at two sizes or more (``n`` to
    seconds): ``1/rate = 1/peak + half / (peak · F)`` for a product of F = 2n³ FLOPs, by
    least squares of the relative error; half at least 0."""
    flops = np.array([2.0 * n**3 for n in times])
    inverse_rate = np.array(list(times.values())) / flops
    rows = np.column_stack([np.ones(len(flops)), 1.0 / flops]) / inverse_rate[:, None]
    a, b = np.linalg.lstsq(rows, np.ones(len(flops)), rcond=None)[0]
    if a <= 0:  # the larger product ran no faster: price every one at its rate
        return float(flops.max() / (inverse_rate[flops.argmax()] * flops.max())), 0.0
    return 1.0 / float(a), max(float(b) / float(a), 0.0)


@dataclass(frozen=True, slots=True)
class MachineMeasurements:
    """What ``pipedsl calibrate`` measured on a machine, in seconds unless said.

    Attributes:
      platform: ``cpu``, ``gpu`` or ``tpu`` (JAX's platform of the devices).
      device_kind: what the devices are (``cpu``, ``NVIDIA H200``, ``TPU v5 lite``).
      devices: devices measured, all in one node.
      host_cores: cores the devices share (CPU devices), None where each has its own.
      memory_bytes: memory per device; ``memory_source`` says where it came from.
      bandwidth: bytes per second of an elementwise update (read and write) per device,
        every device at once; ``bandwidth_source`` says how it was measured.
      all_reduce_s: seconds by (group size, bytes per device), every group at once.
      dispatch_s: seconds per dispatched tiny program, every device dispatching.
      apart_s: seconds of the compute step of :data:`APART_SHAPE` dispatched action by
        action, as pipeline devices of their own run it (the compute steps are each one
        program); None where not taken: ``dispatch_s`` is then the cost per action.
      matmul_s: seconds of a square product by (dtype name, n); empty on CPU.
      bandwidth_source: the measurement behind ``bandwidth``, in words.
      step_s: seconds of the data-parallel training step over every device by
        (layers, sequences per device, microbatches) (:func:`compute_shapes`).
      busy_s: seconds of the whole model's step at the microbatch size on n devices
        while the others idle, by n (:func:`busy_counts`); empty where not taken.
      tensor_s: seconds of the whole model's step at the microbatch size per device on
        every device, t-way tensor parallel, by t (:func:`tensor_degrees`); empty where
        not taken.
      microbatch_size: sequences per device of the compute steps that use it.
      dtype: the model's dtype name, whose product rate sets ``peak_flops`` on GPU.
      seconds: wall time of the measurements (0 for steps timed again later).
    """

    platform: str
    device_kind: str
    devices: int
    host_cores: float | None
    memory_bytes: int
    memory_source: str
    bandwidth: float
    all_reduce_s: dict[tuple[int, int], float]
    dispatch_s: float
    step_s: dict[tuple[int, int, int], float]
    microbatch_size: int
    dtype: str
    matmul_s: dict[tuple[str, int], float] = field(default_factory=dict)
    apart_s: float | None = None
    busy_s: dict[int, float] = field(default_factory=dict)
    tensor_s: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    bandwidth_source: str = "an elementwise update of 4 MB per device, every device at once"

    @property
    def largest_step(self) -> tuple[int, int, int]:
        """The shape (as ``step_s``'s keys) of the whole model's one-microbatch step at the
        microbatch size: the work that sets the compute rate."""
        return max(key for key in self.step_s if key[2] == 1 and key[1] == self.microbatch_size)


@dataclass(frozen=True, slots=True)
class MachineCalibration:
    """A machine's ``cluster`` fitted to its ``measurements``, and the ``report`` of it."""

    cluster: Cluster
    measurements: MachineMeasurements
    report: Report

    @property
    def step_s(self) -> dict[tuple[int, int, int], float]:
        return self.measurements.step_s

    @property
    def largest_step(self) -> tuple[int, int, int]:
        return self.measurements.largest_step

    def describe(self) -> str:
        return self.report.text()


def _step_name(layers: int, sequences: int, microbatches: int, devices: int, tp: int = 1) -> str:
    batches = f" x {microbatches} microbatches" if microbatches > 1 else ""
    tensor = f", tp={tp}" if tp > 1 else ""
    return (
        f"train step: {_count(layers, 'layer')} x {sequences} seq/device{batches}, {_count(devices, 'device')}{tensor}"
    )


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, with an s unless ``n`` is one."""
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _compute_steps(model: Model, m: MachineMeasurements) -> list[Step]:
    def priced_at(layers: int, sequences: int, microbatches: int) -> Step:
        cut = dataclasses.replace(model, layers=layers)
        return Step(
            _step_name(layers, sequences, microbatches, m.devices),
            m.step_s[(layers, sequences, microbatches)],
            lambda c: priced_step(cut, c, m.devices, sequences, microbatches),
        )

    layers, sequences, _ = m.largest_step
    whole = dataclasses.replace(model, layers=layers)
    tensor = [
        Step(
            _step_name(layers, sequences, 1, m.devices, tp),
            seconds,
            functools.partial(_priced_on, whole, devices=m.devices, sequences=sequences, tp=tp),
        )
        for tp, seconds in sorted(m.tensor_s.items())
    ]
    return [priced_at(*shape) for shape in m.step_s] + tensor


def _base(m: MachineMeasurements, model: Model) -> tuple[Cluster, list[Measured]]:
    """The cluster of the direct measurements (the fitted fields at a start), and their lines."""
    reduces = {k: v for k, v in m.all_reduce_s.items() if k[0] > 1}
    if reduces:
        alpha, link = fit_ring(reduces)
        told = ", ".join(f"{n} devices x {b / 1e6:.3g} MB {t * 1e3:.2f} ms" for (n, b), t in reduces.items())
        link_source = f"ring fit to all-reduces ({told})"
    else:
        alpha, link = 0.0, m.bandwidth
        link_source = "one device: no link to measure (the memory bandwidth, zero latency; no plan of one device sends)"
    per_action, per_action_source = m.dispatch_s, "dispatch of a tiny program, one thread per device, all at once"
    if m.apart_s is not None and APART_SHAPE in m.step_s:
        layers, sequences, microbatches = APART_SHAPE
        fused = m.step_s[APART_SHAPE]
        tasks = apart_tasks(microbatches)
        per_action = max(m.apart_s - fused, 0.0) / tasks
        per_action_source = (
            f"the step of {layers} layer x {sequences} seq/device x {microbatches} microbatches dispatched task by "
            f"task ({m.apart_s * 1e3:.2f} ms) against as one program ({fused * 1e3:.2f} ms), over its {tasks} tasks"
        )
    peak, half, rates = 1e9, 0.0, ""
    if m.matmul_s:
        sizes = {n: s for (dtype, n), s in m.matmul_s.items() if dtype == m.dtype}
        peak, half = fit_matmul(sizes)
        rates = "; ".join(
            f"{dtype} {n}³ {2.0 * n**3 / s / 1e12:.3g} TFLOP/s" for (dtype, n), s in sorted(m.matmul_s.items())
        )
    cluster = Cluster(
        name="this machine",
        gpu=m.device_kind,
        peak_flops=peak,
        matmul_efficiency=1.0,
        matmul_half_flops=half,
        host_cores=m.host_cores,
        memory_bytes=m.memory_bytes,
        hbm_bandwidth=m.bandwidth,
        gpus_per_node=m.devices,
        intra_node_bandwidth=link,
        intra_node_latency=alpha,
        inter_node_bandwidth=link,
        inter_node_latency=alpha,
        action_overhead_s=per_action,
    )
    lines = [
        Measured("gpus_per_node", m.devices, "devices", f"{m.platform} devices JAX sees ({m.device_kind})"),
        Measured("memory_bytes", m.memory_bytes, "B", m.memory_source),
        Measured("hbm_bandwidth", m.bandwidth, "B/s", m.bandwidth_source),
        Measured("intra_node_latency", alpha, "s", link_source),
        Measured("intra_node_bandwidth", link, "B/s", link_source),
        Measured("action_overhead_s", per_action, "s", per_action_source),
    ]
    if m.matmul_s:
        told = f"products of the model's dtype ({m.dtype}) fitted to 1/rate = 1/peak + half/(peak·F); {rates}"
        lines += [Measured("peak_flops", peak, "FLOP/s", told), Measured("matmul_half_flops", half, "FLOP", told)]
    if m.host_cores is not None:
        lines.append(Measured("host_cores", m.host_cores, "cores", "the cores this process may run on"))
    return cluster, lines


def fit_machine(model: Model, m: MachineMeasurements) -> MachineCalibration:
    """The cluster of ``m`` (module docstring), ``model`` being what its training steps
    trained (the simulator's description of the executor's model, at every layer count
    the steps cut it to)."""
    base, lines = _base(m, model)
    steps = _compute_steps(model, m)
    largest = m.largest_step
    fitted = [
        Parameter("kernel_launch_s", "s", 1e-9, 1.0, 1e-4, fixed_cost=True),
        Parameter("step_overhead_s", "s", 1e-7, 10.0, 1e-3, fixed_cost=True),
    ]
    if m.tensor_s:
        fitted.append(Parameter("collective_latency_s", "s", 1e-8, 1.0, 1e-4, fixed_cost=True))
    if m.matmul_s:
        # The products are measured; what the compiler leaves of the elementwise traffic is not.
        fitted.append(Parameter("elementwise_traffic", "", 1e-3, 4.0, 1.0))
    else:
        # Start from the rate that prices the largest step alone, nothing else slowing it.
        start = base.peak_flops * priced_step(
            dataclasses.replace(model, layers=largest[0]), base, m.devices, largest[1]
        )
        fitted.insert(0, Parameter("peak_flops", "FLOP/s", 1e6, 1e16, start / m.step_s[largest]))
    compute = least_squares(base, fitted, steps)
    told = f"fitted to the {len(steps)} training steps below (least squares of log priced / measured)"
    lines += [Measured(p.name, getattr(compute.cluster, p.name), p.unit, told) for p in fitted]
    cluster, results = compute.cluster, list(reproduced(compute))
    if m.busy_s and m.host_cores is not None:
        cluster, busy = _busy_rates(cluster, model, m)
        lines += [
            Measured(
                f"busy_rates[{n - 1}]",
                cluster.busy_rates[n - 1],
                "",
                f"the step below on {n} of the {m.devices} devices: its throughput over the same step's on all"
                + ("; counts between, linear" if n == max(m.busy_s) else ""),
            )
            for n in sorted(m.busy_s)
        ]
        results += list(reproduced(Fitted(cluster, busy, tuple(s.priced(cluster) for s in busy), ())))
    said = "" if m.seconds <= 0 else f", measured in {m.seconds:.0f} s"
    report = Report(
        f"{_count(m.devices, m.platform + ' device')} ({m.device_kind}){said}",
        m.platform,
        tuple(lines),
        tuple(results),
    )
    return MachineCalibration(cluster, m, report)


def _busy_rates(cluster: Cluster, model: Model, m: MachineMeasurements) -> tuple[Cluster, tuple[Step, ...]]:
    """``cluster`` with ``busy_rates`` from ``m.busy_s``: at each count n measured, the
    throughput of the largest step on n devices (n over its seconds) over that step's on
    every device; between the counts, linear. Also those steps as calibration steps, to
    report how the model reproduces them."""
    layers, sequences, _ = m.largest_step
    cut = dataclasses.replace(model, layers=layers)
    every = m.step_s[m.largest_step]
    measured = {n: n / seconds / (m.devices / every) for n, seconds in m.busy_s.items()} | {m.devices: 1.0}
    known = sorted(measured)
    rates = tuple(float(np.interp(n, known, [measured[k] for k in known])) for n in range(1, m.devices + 1))
    steps = tuple(
        Step(
            _step_name(layers, sequences, 1, n) + f" (the other {m.devices - n} idle)",
            m.busy_s[n],
            functools.partial(_priced_on, cut, devices=n, sequences=sequences),
        )
        for n in sorted(m.busy_s)
    )
    return dataclasses.replace(cluster, busy_rates=rates), steps


def _priced_on(model: Model, cluster: Cluster, *, devices: int, sequences: int, tp: int = 1) -> float:
    return priced_step(model, cluster, devices, sequences, tp=tp)


def cluster_toml(calibration: MachineCalibration) -> str:
    """The calibrated cluster as a ``[cluster]`` TOML file
    (:func:`~pipedsl.simulator.load_cluster` reads it), each parameter with the
    measurement behind it as a comment."""
    sources: dict[str, list[str]] = {}
    for p in calibration.report.parameters:
        # An entry of a list field (``busy_rates[0]``) comments the list.
        sources.setdefault(p.name.split("[")[0], []).append(p.source if "[" not in p.name else f"{p.name}: {p.source}")
    m = calibration.measurements
    lines = [
        f"# {calibration.report.title}: calibrated by pipedsl calibrate",
        f"# platform: {m.platform}; device kind: {m.device_kind}",
        "[cluster]",
    ]
    for f in dataclasses.fields(calibration.cluster):
        value = getattr(calibration.cluster, f.name)
        if value is None:
            continue
        lines += [f"# {source}" for source in sources.get(f.name, [])]
        if isinstance(value, str):
            lines.append(f"{f.name} = {_toml_string(value)}")
        elif isinstance(value, tuple):
            if value:
                lines.append(f"{f.name} = [{', '.join(repr(v) for v in value)}]")
        elif isinstance(value, float) and not math.isfinite(value):
            continue
        else:
            lines.append(f"{f.name} = {value!r}")
    return "\n".join(lines) + "\n"


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
