"""This machine as a calibrated cluster of forced CPU devices, measured once.

The plan search prices a plan from a :class:`~pipedsl.simulator.Cluster`. On forced CPU
devices every device shares this machine's cores, so each number is measured with every
device busy at once, and once, before the search, so that the search ranks with it and
every run's prediction comes from it (never from that run's own steps). The cluster
says how many cores its devices share (``shared_cores``, the cores this process may run
on), so that a pipeline's idle devices are priced as cores the busy ones get:

- *compute*: one training step of the executor's data-parallel plan of the model over
  every device (each microbatch's forward and backward, the gradients' all-reduce, Adam's
  update: the stage programs that runs execute, not one program of the whole step, which
  XLA runs at another speed), at six shapes: the model cut to one layer and whole, with
  one sequence per device and with the microbatch size, one microbatch; the one-layer,
  one-sequence step with four microbatches; and the whole model at twice the microbatch
  size. Four numbers of the cluster are fitted to the six steps (least squares of the log
  of priced over measured seconds): the ``peak_flops``, the ``step_overhead_s`` that a
  step costs once (the four-microbatch step tells it from what each microbatch costs),
  the ``kernel_launch_s`` that every kernel costs on top of its work (on shared cores a
  one-sequence step takes far more than a quarter of a four-sequence one) and the
  ``working_set_bytes`` at which a device's compute takes twice as long for the
  activations it keeps (the step's cost per sequence grows with them: the caches the
  devices share hold less of them; the largest step tells it).
  Elementwise work is priced at the measured memory bandwidth. A product benchmark
  overstates the rate about tenfold on CPU: the backward's transposed products, the
  attention's small ones and the elementwise work run far below it;
- *idle devices*: one training step of the whole model as a two-stage pipeline
  (``gpipe``, one microbatch, half the devices a stage's data axis, as many sequences as
  the largest compute step), whose devices are idle half the step: the ``idle_share`` of
  an idle device's time that the busy devices take up on the cores it leaves is fitted
  to it (1 prices a pipeline at its devices' mean busy time, 0 at its makespan; here
  65-100%); and the same step with ``tp=2`` stages, to which the ``tensor_idle_share``
  of pipelines with tensor-parallel stages is fitted (each collective waits for every
  device of its group, and busy groups contend for the cores);
- *a stage busy alone*: where the devices outnumber the cores, the same step as a
  pipeline of ``devices / cores`` stages (a device per core in the one busy stage): the
  ``alone_efficiency``, the fraction of its ideal speed-up (a core to itself) that a
  device busy alone reaches, is fitted to it where the idle share alone prices it too
  fast (on two cores, four stages: about 3.1 times the all-busy rate, not 4);
- *a split backward*: the last stage of the two-stage pipeline's model (its mesh half the
  devices), its backward on the residuals of one forward, as one program (``B``) and as
  the two that zero-bubble schedules run (``I`` then ``W``), in turns:
  ``split_backward_cost`` is what the halves cost over the fused backward (on this 2-core
  machine 1.16-1.33; a single device runs them at about the fused cost, a mesh of two or more
  about a quarter more, and that holds from 16 to 64 sequences, so the halves run slower
  rather than paying a fixed cost each);
- *memory bandwidth*: one elementwise update of a few MB on every device at once;
- *collectives*: all-reduces over groups of 2 and of every device, of a small and a
  large buffer, fitted to the ring formula ``2(n-1)·α + 2(n-1)/n · S/B`` (α and B are
  then also what a send between two devices costs);
- *collectives inside a program*: training steps of the executor's SPMD plan of the
  one-layer model at tp 2 and at tp 4 (the data axis the rest, the model's own
  ``param_specs``), each with the microbatch size and four times it per data rank, XLA's
  collectives inside their programs; what they take beyond what the numbers above price
  them at is fitted as a wait per tensor-parallel collective for each device of its group
  but one, partly fixed (``collective_sync_s``) and partly per token of the microbatch
  (``collective_sync_per_token_s``): on shared cores every device of a group must reach a
  collective before any goes on, so a group of four waits for three others' work, and
  that work grows with the microbatch. (Compiling those pipelines is the calibration's
  longest part.)
- *dispatch*: the seconds one device's thread spends per dispatched stage program while
  every device dispatches (``action_overhead_s``, what each scheduled action costs on top
  of its kernels).

The step measurements take turns (:class:`~pipedsl.cli.timed.TimedSteps`), so that a change
in the machine's load while they run changes their ratios, which the fits rest on, less.
On shared cores the machine's speed also moves over minutes (the largest step's median of
11 rounds read 151-225 ms over an hour here), so the demo times the same steps again in
turns with its runs and fits them again (:func:`recalibrated`): its predictions then rest
on the speed the runs saw, while the search ranked with the calibration before them.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipedsl.cli.machine_fit import (
    PIPELINE_STAGES,
    fit_alone,
    fit_compute,
    fit_idle_share,
    fit_ring,
    fit_split,
    fit_sync,
    pipeline_sequences,
)
from pipedsl.cli.timed import STEP_ROUNDS, Step, TimedSteps, median_seconds
from pipedsl.simulator import Cluster, Model
from pipedsl.simulator.workers import available_cores

__all__ = ["MachineCalibration", "calibrate_machine", "calibration_steps", "recalibrated"]

_REPEATS = 3
"""Timed calls of the short measurements (memory bandwidth, all-reduces)."""
_TENSORS = (2, 4)
"""The tensor axes of the steps that measure collectives inside a program (those that
divide the devices and the model's heads and vocabulary)."""
_PIPELINE_TENSOR = 2
"""The tensor axis of the pipeline step with tensor-parallel stages."""
_TENSOR_BATCHES = (1, 4)
"""The sequences per data rank of those steps, in microbatch sizes."""
_MICROBATCHES = 4
"""Microbatches of the compute step that tells a step's fixed cost from a microbatch's."""
_WORKING_SET_BATCH = 2
"""Sequences per device of the compute step that prices the working set, in microbatch
sizes: the whole model at twice the microbatch (the effect grows with the step: at 4 times
it is well beyond what the plans run)."""
_DISPATCHES = 100
_BACKWARD_ROUNDS = 15
"""Timed rounds of the fused and the split backward (a few tens of ms each)."""
_SMALL, _LARGE = 1 << 12, 1 << 22


@dataclass(frozen=True, slots=True)
class MachineCalibration:
    """The calibrated cluster and what was measured for it.

    Attributes:
      cluster: this machine as ``devices`` CPU devices in one node.
      step_s: measured seconds of one data-parallel training step over every device, by
        (layers the model is cut to, sequences per device, microbatches).
      tensor_step_s: measured seconds of one training step of the one-layer model split
        over a tensor axis (a data axis the rest), by (tensor axis, sequences per data rank).
      pipeline_step_s: measured seconds of the two-stage pipeline's training step, or None
        where the devices or the model's layers do not split in two (``idle_share`` then 1).
      microbatch_size: sequences per device (per data rank) in the larger compute steps
        and the smaller tensor-parallel steps.
      all_reduce_s: measured seconds by (group size, bytes).
      seconds: wall time of the whole calibration (0 for one fitted again to its steps
        timed later, :func:`recalibrated`).
      alone_step_s: measured seconds of the pipeline step whose busy stage has a device per
        core, or None where there is none (``alone_efficiency`` then 1).
      tensor_pipeline_step_s: measured seconds of the two-stage pipeline's step with
        tensor-parallel stages, or None where there is none (``tensor_idle_share`` then None).
      backward_s: measured seconds of a stage's backward fused and split (``I`` then
        ``W``; a short measurement, kept when fitted again), or None where there is no
        two-stage pipeline (``split_backward_cost`` then 1).
    """

    cluster: Cluster
    step_s: dict[tuple[int, int, int], float]
    tensor_step_s: dict[tuple[int, int], float]
    pipeline_step_s: float | None
    microbatch_size: int
    all_reduce_s: dict[tuple[int, int], float]
    seconds: float
    alone_step_s: float | None = None
    tensor_pipeline_step_s: float | None = None
    backward_s: tuple[float, float] | None = None

    @property
    def largest_step(self) -> tuple[int, int, int]:
        """The shape (as ``step_s``'s keys) of the largest one-microbatch compute step: the
        whole model at the microbatch size, the work that sets the compute rate."""
        return max(key for key in self.step_s if key[2] == 1 and key[1] == self.microbatch_size)

    def describe(self) -> str:
        """One line per measured quantity, with units."""
        c = self.cluster
        reduces = ", ".join(f"{n} devices {b / 1e6:.3g} MB {t * 1e3:.2f} ms" for (n, b), t in self.all_reduce_s.items())
        steps = ", ".join(
            f"{n} layer{'s' if n > 1 else ''} x {m}{f' x {k} microbatches' if k > 1 else ''} {t * 1e3:.1f} ms"
            for (n, m, k), t in self.step_s.items()
        )
        tensor = ", ".join(f"tp={t} x {m} {s * 1e3:.1f} ms" for (t, m), s in self.tensor_step_s.items()) or "none"
        idle = (
            f"busy devices take up {c.idle_share:.0%} of an idle one's time (fitted to a two-stage pipeline's "
            f"step, {self.pipeline_step_s * 1e3:.1f} ms)"
            if self.pipeline_step_s is not None
            else "idle devices not measured"
        )
        if self.tensor_pipeline_step_s is not None and c.tensor_idle_share is not None:
            idle += (
                f"; {c.tensor_idle_share:.0%} with tp={_PIPELINE_TENSOR} stages (fitted to such a step, "
                f"{self.tensor_pipeline_step_s * 1e3:.1f} ms)"
            )
        if self.alone_step_s is not None:
            idle += (
                f"; a device busy alone reaches {c.alone_efficiency:.0%} of its ideal speed-up (fitted to a "
                f"{_alone_stages(c.gpus_per_node, c.shared_cores)}-stage pipeline's step, {self.alone_step_s * 1e3:.1f} ms)"
            )
        if self.backward_s is not None:
            fused, split = self.backward_s
            idle += (
                f"; a backward split into I and W costs {c.split_backward_cost:.2f} times the fused one (the last "
                f"of {PIPELINE_STAGES} stages: B {fused * 1e3:.1f} ms, I then W {split * 1e3:.1f} ms)"
            )
        working_set = (
            f"twice as long at {c.working_set_bytes / 1e6:.1f} MB of activations kept per device"
            if c.working_set_bytes > 0
            else "no working-set cost"
        )
        return (
            f"compute {c.peak_flops / 1e9:.2f} GFLOP/s per device, {c.kernel_launch_s * 1e6:.0f} µs per kernel, "
            f"{c.step_overhead_s * 1e3:.1f} ms per step, {working_set} (fitted to training steps of so many layers x "
            f"sequences per device: {steps}); memory "
            f"{c.hbm_bandwidth / 1e9:.2f} GB/s; collectives α {c.intra_node_latency * 1e6:.0f} µs, "
            f"B {c.intra_node_bandwidth / 1e9:.2f} GB/s (all-reduce {reduces}); dispatch "
            f"{c.action_overhead_s * 1e6:.0f} µs per action; each tensor-parallel collective waits "
            f"{c.collective_sync_s * 1e3:.2f} ms + {c.collective_sync_per_token_s * 1e6:.2f} µs per token for each "
            f"device of its group but one (fitted to one-layer steps at tp x sequences per data rank: {tensor}); "
            f"{idle}" + (f"; calibrated in {self.seconds:.1f} s" if self.seconds > 0 else "")
        )


def _bandwidth(devices: int) -> float:
    """Bytes per second of an elementwise update (read and write) on every device at once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    x = jax.device_put(jnp.ones((devices, 1 << 20), jnp.float32), NamedSharding(mesh, PartitionSpec("data")))
    update = jax.jit(lambda v: v * 0.5 + 1.0)
    return 2 * x.nbytes / devices / median_seconds(lambda: update(x), repeats=_REPEATS)


def _all_reduce_seconds(devices: int, group: int, num_bytes: int) -> float:
    """An all-reduce of ``num_bytes`` per device over groups of ``group`` devices, every
    group at once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(devices // group, group), ("g", "r"))
    spec = PartitionSpec(("g", "r"))
    x = jax.device_put(jnp.ones((devices, num_bytes // 4), jnp.float32), NamedSharding(mesh, spec))
    program = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "r"), mesh=mesh, in_specs=spec, out_specs=spec))
    return median_seconds(lambda: program(x), repeats=_REPEATS)


def _dispatch_seconds(devices: int) -> float:
    """Seconds per dispatch of a tiny compiled program, one thread per device, every
    device dispatching at once (they share the interpreter, as the executor's workers do)."""
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda v: v + 1.0)
    starts = [jax.device_put(jnp.ones((8,), jnp.float32), d) for d in jax.devices()[:devices]]
    jax.block_until_ready([step(x) for x in starts])

    def work(x: jax.Array) -> None:
        for _ in range(_DISPATCHES):
            x = step(x)
        x.block_until_ready()

    threads = [threading.Thread(target=work, args=(x,)) for x in starts]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - start) / _DISPATCHES


def _step_shapes(model: Model, microbatch_size: int) -> tuple[tuple[int, int, int], ...]:
    """(layers, sequences per device, microbatches) of the compute steps measured: the
    model cut to one layer and whole, at one sequence and at ``microbatch_size``, one
    microbatch; the one-layer, one-sequence step with :data:`_MICROBATCHES` of them,
    which tells what a step costs once from what each microbatch costs; and the whole
    model at :data:`_WORKING_SET_BATCH` times the microbatch, whose working set (its
    activations kept) tells what that costs."""
    corners = tuple((n, m, 1) for n in sorted({1, model.layers}) for m in sorted({1, microbatch_size}))
    return (*corners, (1, 1, _MICROBATCHES), (model.layers, _WORKING_SET_BATCH * microbatch_size, 1))


def _alone_stages(devices: int, cores: float) -> int:
    """Stages of the pipeline step whose one busy stage has a device per core: ``devices /
    cores`` (0 where the cores do not divide the devices)."""
    whole = int(cores)
    return devices // whole if whole >= 1 and whole == cores and devices % whole == 0 else 0


def _tensor_shapes(model: Model, devices: int, microbatch_size: int) -> tuple[tuple[int, int], ...]:
    """(tensor axis, sequences per data rank) of the steps that measure collectives inside
    a program: the axes of :data:`_TENSORS` that the devices and ``model`` split into."""
    axes = [t for t in _TENSORS if devices % t == 0 and model.heads % t == 0 and model.vocab % t == 0]
    return tuple((t, k * microbatch_size) for t in axes for k in _TENSOR_BATCHES)


def calibration_steps(devices: int, model: Model, build: Callable[[int, int], Any], *, microbatch_size: int) -> TimedSteps:
    """The training steps the calibration times (module docstring) for ``model`` (its
    simulator description) over ``devices`` CPU devices, built and compiled:
    ``build(layers, stages)`` gives the same model as the executor builds it, cut to
    ``layers`` layers split evenly over ``stages``. Keyed ``("compute", layers, sequences
    per device, microbatches)``, ``("tensor", tensor axis, sequences per data rank)``,
    ``("pipeline", tensor axis)`` (two stages) and ``("alone", stages)``; and the last
    stage's backward of the two-stage model, fused and split (:meth:`TimedSteps.backward_seconds`)."""
    pipeline: dict[Any, Step] = {}
    backward = None
    if devices % PIPELINE_STAGES == 0 and model.layers % PIPELINE_STAGES == 0:
        two = build(model.layers, PIPELINE_STAGES)
        split = {t for t, _ in _tensor_shapes(model, devices, microbatch_size)}
        for tensor in (1, *({_PIPELINE_TENSOR} & split)):
            if devices % (PIPELINE_STAGES * tensor) == 0:
                sequences = pipeline_sequences(PIPELINE_STAGES, microbatch_size, tensor)
                pipeline[("pipeline", tensor)] = Step(two, sequences, tensor)
        backward = (two, pipeline_sequences(PIPELINE_STAGES, microbatch_size))
        alone = _alone_stages(devices, available_cores())
        if alone > PIPELINE_STAGES and model.layers % alone == 0:
            pipeline[("alone", alone)] = Step(build(model.layers, alone), pipeline_sequences(alone, microbatch_size))
    return TimedSteps(
        {("compute", n, m, k): Step(build(n, 1), m, microbatches=k) for n, m, k in _step_shapes(model, microbatch_size)}
        | {("tensor", t, m): Step(build(1, 1), m, t) for t, m in _tensor_shapes(model, devices, microbatch_size)}
        | pipeline,
        devices,
        backward=backward,
    )


def calibrate_machine(steps: TimedSteps, model: Model, *, microbatch_size: int) -> MachineCalibration:
    """Measure this machine once (module docstring) as the devices of ``steps``
    (:func:`calibration_steps` of ``model`` at ``microbatch_size``): their medians over
    :data:`~pipedsl.cli.timed.STEP_ROUNDS` rounds, then the short measurements, then the fits."""
    started = time.perf_counter()
    for _ in range(STEP_ROUNDS):
        steps.timed_round()
    measured = steps.take()
    devices = steps.devices
    bandwidth = _bandwidth(devices)
    reduces = {(n, s): _all_reduce_seconds(devices, n, s) for n in sorted({2, devices}) for s in (_SMALL, _LARGE)}
    alpha, link = fit_ring(reduces)
    dispatch = _dispatch_seconds(devices)
    backward = steps.backward_seconds(repeats=_BACKWARD_ROUNDS)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(devices, 1)
    base = Cluster(
        name="this machine",
        gpu="CPU device",
        peak_flops=1e9,
        matmul_efficiency=1.0,
        shared_cores=available_cores(),
        memory_bytes=int(memory),
        hbm_bandwidth=bandwidth,
        gpus_per_node=devices,
        intra_node_bandwidth=link,
        intra_node_latency=alpha,
        inter_node_bandwidth=link,
        inter_node_latency=alpha,
        action_overhead_s=dispatch,
    )
    if backward is not None:
        base = fit_split(base, *backward)
    return _fitted(
        model, base, measured, microbatch_size=microbatch_size, all_reduce_s=reduces, backward_s=backward, started=started
    )


def recalibrated(calibration: MachineCalibration, model: Model, measured: dict[Any, float]) -> MachineCalibration:
    """``calibration`` fitted again to ``measured``, its steps' seconds timed again later
    (:meth:`~pipedsl.cli.timed.TimedSteps.take` of the same :func:`calibration_steps`):
    the demo times them in turns with its runs, so that its predictions rest on the
    machine's speed while they ran. The short measurements (memory bandwidth,
    collectives, dispatch, the split backward) are kept; the fits start afresh, as the
    calibration's did."""
    return _fitted(
        model, calibration.cluster, measured, microbatch_size=calibration.microbatch_size, all_reduce_s=calibration.all_reduce_s,
        backward_s=calibration.backward_s, started=None,
    )  # fmt: skip


def _fitted(
    model: Model, measured_cluster: Cluster, measured: dict[Any, float], *, microbatch_size: int,
    all_reduce_s: dict[tuple[int, int], float], backward_s: tuple[float, float] | None, started: float | None,
) -> MachineCalibration:  # fmt: skip
    """``measured_cluster`` (its short measurements; whatever it holds of the fitted
    numbers is set aside) fitted to the training steps' ``measured`` seconds (keyed as by
    :func:`calibration_steps`): compute, then the tensor-parallel waits, then the idle
    share, then how fast a device busy alone runs."""
    base = dataclasses.replace(
        measured_cluster, peak_flops=1e9, kernel_launch_s=0.0, step_overhead_s=0.0, idle_share=1.0,
        tensor_idle_share=None, alone_efficiency=1.0, collective_sync_s=0.0, collective_sync_per_token_s=0.0,
        working_set_bytes=0.0,
    )  # fmt: skip
    devices = base.gpus_per_node
    steps = {key[1:]: seconds for key, seconds in measured.items() if key[0] == "compute"}
    tensor = {key[1:]: seconds for key, seconds in measured.items() if key[0] == "tensor"}
    pipeline_s = measured.get(("pipeline", 1))
    tensor_pipeline_s = measured.get(("pipeline", _PIPELINE_TENSOR))
    cluster = fit_compute(model, base, devices, steps)
    if tensor:
        cluster = fit_sync(dataclasses.replace(model, layers=1), cluster, devices, tensor)
    if pipeline_s is not None:
        cluster = fit_idle_share(model, cluster, devices, microbatch_size, pipeline_s)
    if tensor_pipeline_s is not None:
        cluster = fit_idle_share(model, cluster, devices, microbatch_size, tensor_pipeline_s, tensor=_PIPELINE_TENSOR)
    alone = {key[1]: seconds for key, seconds in measured.items() if key[0] == "alone"}
    for stages, seconds in alone.items():
        cluster = fit_alone(model, cluster, stages, microbatch_size, seconds)
    return MachineCalibration(
        cluster=cluster,
        step_s=steps,
        tensor_step_s=tensor,
        pipeline_step_s=pipeline_s,
        tensor_pipeline_step_s=tensor_pipeline_s,
        microbatch_size=microbatch_size,
        all_reduce_s=all_reduce_s,
        seconds=0.0 if started is None else time.perf_counter() - started,
        alone_step_s=next(iter(alone.values()), None),
        backward_s=backward_s,
    )
