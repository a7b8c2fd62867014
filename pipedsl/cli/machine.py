"""This machine's measurements for its calibrated cluster, CPU or GPU.

The simulator cannot run JAX, so this module takes the measurements
(:class:`~pipedsl.simulator.calibration.machine.MachineMeasurements`) and
:func:`~pipedsl.simulator.calibration.machine.fit_machine` turns them into a
:class:`~pipedsl.simulator.Cluster` and its report. What is measured, on the devices JAX
runs on (its default platform):

- the executor's data-parallel training step of the model over every device at the
  shapes of :func:`~pipedsl.simulator.calibration.machine.compute_shapes`, each timed in
  rounds with the others (:class:`~pipedsl.cli.timed.TimedSteps`: a change in the
  machine's load while they run changes their ratios, which the fit rests on, less);
- on CPU devices that share fewer cores than there are devices, the whole model's step
  on 1, 2, 4, ... devices while the others idle: how much of the node's rate fewer busy
  devices get;
- the whole model's step over every device 2- and 4-way tensor parallel: what a
  collective costs while the devices compute;
- the memory: a GPU's allocator limit (``bytes_limit``), else the host's memory over the
  devices;
- the memory bandwidth (one elementwise update of 4 MB on every device at once), the
  all-reduces over groups of 2 and of every device (a small and a large buffer), and the
  dispatch of a tiny program, one thread per device, all dispatching at once;
- on GPU, square matrix products of two sizes in bf16 and fp32 (the rate per dtype).

The measurements are taken once, before a search, so that every prediction comes from
them and never from the run it predicts. The demo times the same steps again in turns
with its runs and fits them again (:func:`recalibrated`): on shared cores the machine's
speed moves over minutes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pipedsl.cli.timed import STEP_ROUNDS, Step, TimedSteps, median_seconds
from pipedsl.simulator import Model
from pipedsl.simulator.calibration.machine import (
    MachineCalibration,
    MachineMeasurements,
    busy_counts,
    compute_shapes,
    fit_machine,
    tensor_degrees,
)
from pipedsl.simulator.workers import available_cores

__all__ = ["MachineCalibration", "calibrate_machine", "calibration_steps", "recalibrated", "platform"]

_REPEATS = 3
"""Timed calls of the short measurements (memory bandwidth, all-reduces, products)."""
_DISPATCHES = 100
_SMALL, _LARGE = 1 << 12, 1 << 22
_MATMUL_SIZES = (1024, 8192)
"""Sides of the square products timed on GPU: one that falls short of the peak, one near it."""
_DTYPES = {2: "bfloat16", 4: "float32"}


def platform() -> tuple[str, str]:
    """(JAX's platform of its default devices, what they are): ``("cpu", "cpu")``,
    ``("gpu", "NVIDIA H200")``."""
    import jax

    device = jax.devices()[0]
    return device.platform, str(getattr(device, "device_kind", device.platform))


def _host_cores(kind: str) -> float | None:
    """The cores CPU devices share (the ones this process may run on); None on GPU."""
    return float(available_cores()) if kind == "cpu" else None


def calibration_steps(devices: int, model: Model, build: Callable[[int], Any], *, microbatch_size: int) -> TimedSteps:
    """The training steps the calibration times for ``model`` (its simulator description)
    over ``devices`` devices, built and compiled: ``build(layers)`` gives the executor's
    model of one stage cut to ``layers`` layers. Keyed ``("compute", layers, sequences per
    device, microbatches)``, ``("busy", n)`` for the whole model's step on n devices
    while the others idle (:func:`~pipedsl.simulator.calibration.machine.busy_counts`),
    and ``("tensor", t)`` for it over every device t-way tensor parallel
    (:func:`~pipedsl.simulator.calibration.machine.tensor_degrees`)."""
    steps: dict[tuple[Any, ...], Step] = {
        ("compute", n, m, k): Step(build(n), m, microbatches=k) for n, m, k in compute_shapes(model, microbatch_size)
    }
    for n in busy_counts(devices, _host_cores(platform()[0])):
        steps[("busy", n)] = Step(build(model.layers), microbatch_size, devices=n)
    for t in tensor_degrees(model, devices):
        steps[("tensor", t)] = Step(build(model.layers), microbatch_size, tp=t)
    return TimedSteps(steps, devices)


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


def _matmul_seconds() -> dict[tuple[str, int], float]:
    """Seconds of a square product on the first device by (dtype name, side)."""
    import jax
    import jax.numpy as jnp

    product = jax.jit(lambda a, b: a @ b)
    found = {}
    for name in _DTYPES.values():
        for n in _MATMUL_SIZES:
            a = jnp.ones((n, n), getattr(jnp, name))
            found[(name, n)] = median_seconds(functools.partial(product, a, a), repeats=_REPEATS)
    return found


def _memory(kind: str, devices: int) -> tuple[int, str]:
    """(bytes per device, where that came from)."""
    if kind != "cpu":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit:
            return int(limit), "the device allocator's limit (memory_stats bytes_limit)"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // max(devices, 1)), f"the host's memory over the {devices} devices"


def calibrate_machine(
    steps: TimedSteps, model: Model, *, microbatch_size: int, rounds: int = STEP_ROUNDS
) -> MachineCalibration:
    """Measure this machine once (module docstring) as the devices of ``steps``
    (:func:`calibration_steps` of ``model`` at ``microbatch_size``): their medians over
    ``rounds`` rounds, then the short measurements, then the fit."""
    started = time.perf_counter()
    for _ in range(rounds):
        steps.timed_round()
    measured = steps.take()
    devices = steps.devices
    kind, device_kind = platform()
    memory, memory_source = _memory(kind, devices)
    groups = sorted({2, devices}) if devices > 1 else []
    measurements = MachineMeasurements(
        platform=kind,
        device_kind=device_kind,
        devices=devices,
        host_cores=_host_cores(kind),
        memory_bytes=memory,
        memory_source=memory_source,
        bandwidth=_bandwidth(devices),
        all_reduce_s={(n, s): _all_reduce_seconds(devices, n, s) for n in groups for s in (_SMALL, _LARGE)},
        dispatch_s=_dispatch_seconds(devices),
        step_s=_compute(measured),
        busy_s=_keyed(measured, "busy"),
        tensor_s=_keyed(measured, "tensor"),
        microbatch_size=microbatch_size,
        dtype=_DTYPES.get(model.dtype_bytes, "float32"),
        matmul_s=_matmul_seconds() if kind != "cpu" else {},
    )
    seconds = time.perf_counter() - started
    return fit_machine(model, dataclasses.replace(measurements, seconds=seconds))


def _compute(measured: dict[Any, float]) -> dict[tuple[int, int, int], float]:
    return {key[1:]: seconds for key, seconds in measured.items() if key[0] == "compute"}


def _keyed(measured: dict[Any, float], kind: str) -> dict[int, float]:
    """The seconds of the steps keyed ``(kind, n)``, by n."""
    return {key[1]: seconds for key, seconds in measured.items() if key[0] == kind}


def recalibrated(calibration: MachineCalibration, model: Model, measured: dict[Any, float]) -> MachineCalibration:
    """``calibration`` fitted again to ``measured``, its steps' seconds timed again later
    (:meth:`~pipedsl.cli.timed.TimedSteps.take` of the same :func:`calibration_steps`):
    the demo times them in turns with its runs, so that its predictions rest on the
    machine's speed while they ran. The short measurements (memory, bandwidth,
    collectives, dispatch, products) are kept."""
    again = dataclasses.replace(
        calibration.measurements,
        step_s=_compute(measured),
        busy_s=_keyed(measured, "busy"),
        tensor_s=_keyed(measured, "tensor"),
        seconds=0.0,
    )
    return fit_machine(model, again)
