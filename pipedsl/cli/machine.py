"""This machine's measurements for its calibrated cluster: CPU devices, a GPU or a TPU.

The simulator cannot run JAX, so this module takes the measurements
(:class:`~pipedsl.simulator.calibration.machine.MachineMeasurements`) and
:func:`~pipedsl.simulator.calibration.machine.fit_machine` turns them into a
:class:`~pipedsl.simulator.Cluster` and its report. What is measured, on the devices JAX
runs on (its default platform):

- the executor's data-parallel training step of the model over every device at the
  shapes of :func:`~pipedsl.simulator.calibration.machine.compute_shapes`, each timed in
  rounds with the others (:class:`~pipedsl.cli.timed.TimedSteps`: a change in the
  machine's load while they run changes their ratios, which the fit rests on, less);
  such a step is one program (its one pipeline device runs nothing another waits for);
- the executor's cost per action: the one-layer step of several microbatches dispatched
  action by action (as pipeline devices of their own run), against it as one program;
- on CPU devices that share fewer cores than there are devices, the whole model's step
  on 1, 2, 4, ... devices while the others idle: how much of the node's rate fewer busy
  devices get;
- the whole model's step over every device 2- and 4-way tensor parallel: what a
  collective costs while the devices compute;
- the memory: an accelerator's allocator limit (``bytes_limit``), else the host's memory
  over the devices;
- the memory bandwidth (an elementwise update of 4 MB on every device at once; where that
  takes less than ten dispatches, as on an accelerator, the slope between it and larger
  ones), the all-reduces over groups of 2 and of every device (a small and a large
  buffer; none with one device), and the dispatch of a tiny program, one thread per
  device, all dispatching at once;
- on an accelerator (GPU, TPU), square matrix products of two sizes in bf16 and fp32 (the
  rate per dtype), each the slope between one product and a chain of them in one program.

On CPU devices the steps train the demo transformer in fp32; on an accelerator a small
Llama in bf16 sized to its memory (:func:`machine_workload`).

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
from typing import Any

import numpy as np

from pipedsl.cli.timed import STEP_ROUNDS, Step, TimedSteps, median_seconds
from pipedsl.cli.workload import DEMO, Workload, accelerator_workload
from pipedsl.simulator import Model
from pipedsl.simulator.calibration.machine import (
    APART_SHAPE,
    MachineCalibration,
    MachineMeasurements,
    busy_counts,
    compute_shapes,
    fit_machine,
    tensor_degrees,
)
from pipedsl.simulator.workers import available_cores

__all__ = [
    "MachineCalibration",
    "calibrate_machine",
    "calibration_steps",
    "recalibrated",
    "platform",
    "machine_workload",
]

_REPEATS = 3
"""Timed calls of the short measurements (memory bandwidth, all-reduces, products)."""
_DISPATCHES = 100
_SMALL, _LARGE = 1 << 12, 1 << 22
_MATMUL_SIZES = (1024, 8192)
"""Sides of the square products timed on an accelerator: one that falls short of the peak, one near it."""
_CHAIN_SECONDS = 0.01
"""Seconds a chain of products takes beyond one product's call, at least, to time a product."""
_MAX_CHAIN = 4096
"""Products in the longest chain (a bound on the measurement's time on a slow device)."""
_FIXED_SHARE = 10
"""An elementwise update is long enough to give the bandwidth alone once it takes this
many dispatches (or this many times the 4 MB one's time)."""
_UPDATE_MEMORY_SHARE = 16
"""The largest update's input takes at most this fraction (1/16) of a device's memory."""
_DTYPES = {2: "bfloat16", 4: "float32"}


def platform() -> tuple[str, str]:
    """(JAX's platform of its default devices, what they are): ``("cpu", "cpu")``,
    ``("gpu", "NVIDIA H200")``."""
    import jax

    device = jax.devices()[0]
    return device.platform, str(getattr(device, "device_kind", device.platform))


def machine_workload(devices: int) -> Workload:
    """What this machine's calibration and the demo train on its first ``devices``
    devices: the demo transformer in fp32 on CPU devices (bf16 has no matrix units
    there); on an accelerator a small Llama in bf16 sized to a device's memory
    (:func:`~pipedsl.cli.workload.accelerator_workload`)."""
    kind, _ = platform()
    return DEMO if kind == "cpu" else accelerator_workload(_memory(kind, devices)[0])


def _host_cores(kind: str) -> float | None:
    """The cores CPU devices share (the ones this process may run on); None on GPU."""
    return float(available_cores()) if kind == "cpu" else None


def calibration_steps(devices: int, workload: Workload, *, microbatch_size: int) -> TimedSteps:
    """The training steps the calibration times for ``workload`` over ``devices`` devices,
    in its precision, built and compiled (its model cut to so many layers, one stage).
    Keyed ``("compute", layers, sequences per device, microbatches)``, ``("busy", n)`` for the whole model's step on n devices
    while the others idle (:func:`~pipedsl.simulator.calibration.machine.busy_counts`),
    ``("tensor", t)`` for it over every device t-way tensor parallel
    (:func:`~pipedsl.simulator.calibration.machine.tensor_degrees`), and ``("apart",
    *APART_SHAPE)`` for the step of that shape dispatched action by action."""
    model, build, precision = workload.model, workload.cut, workload.precision
    steps: dict[tuple[Any, ...], Step] = {
        ("compute", n, m, k): Step(build(n), m, microbatches=k, precision=precision)
        for n, m, k in compute_shapes(model, microbatch_size)
    }
    layers, sequences, microbatches = APART_SHAPE
    steps[("apart", *APART_SHAPE)] = Step(
        build(layers), sequences, microbatches=microbatches, precision=precision, fuse="off"
    )
    for n in busy_counts(devices, _host_cores(platform()[0])):
        steps[("busy", n)] = Step(build(model.layers), microbatch_size, devices=n, precision=precision)
    for t in tensor_degrees(model, devices):
        steps[("tensor", t)] = Step(build(model.layers), microbatch_size, tp=t, precision=precision)
    return TimedSteps(steps, devices)


def _update_seconds(devices: int, num_bytes: int) -> float:
    """Seconds of an elementwise update of ``num_bytes`` per device (fp32), every device at once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    x = jax.device_put(jnp.ones((devices, num_bytes // 4), jnp.float32), NamedSharding(mesh, PartitionSpec("data")))
    update = jax.jit(lambda v: v * 0.5 + 1.0)
    return median_seconds(lambda: update(x), repeats=_REPEATS)


def _bandwidth(devices: int, *, dispatch_s: float, memory_bytes: int) -> tuple[float, str]:
    """(bytes per second of an elementwise update, read and write, per device with every
    device at once; the measurement in words). Of 4 MB per device where that takes
    :data:`_FIXED_SHARE` dispatches or more (CPU devices); else, where the call's fixed
    cost (dispatch, the host's wait for the result) is most of it, as on an accelerator,
    the slope between it and an update four times larger each time, until one takes
    :data:`_FIXED_SHARE` times as long or reaches 1/:data:`_UPDATE_MEMORY_SHARE` of the
    memory."""
    base = _LARGE
    first = _update_seconds(devices, base)
    if first >= _FIXED_SHARE * dispatch_s:
        return 2 * base / first, "an elementwise update of 4 MB per device, every device at once"
    size, seconds = base, first
    while seconds < _FIXED_SHARE * first and 4 * size <= memory_bytes // _UPDATE_MEMORY_SHARE:
        size *= 4
        seconds = _update_seconds(devices, size)
    if size == base or seconds <= first:
        return (
            2 * base / first,
            "an elementwise update of 4 MB per device (its fixed cost included: no larger one fits)",
        )
    told = f"elementwise updates of 4 MB and {size >> 20} MB per device, every device at once: the slope between them"
    return 2 * (size - base) / (seconds - first), told


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
    """Seconds of a square product on the first device by (dtype name, side): a chain of
    k products in one program less one product's program, over the k - 1 products
    between, so that a call's fixed cost (dispatch, the host's wait for the result, about
    half a millisecond on a TPU) drops out. k grows fourfold from 4 until the chain's
    products take :data:`_CHAIN_SECONDS` and as long as the call's fixed cost (a 1024³
    product takes about 13 us on a TPU v5e, far inside that cost), at most
    :data:`_MAX_CHAIN`; the chain's length is an argument, so each size compiles once."""
    import jax
    import jax.numpy as jnp

    # Each product feeds the next, so none is left out; b (every entry 1/n) keeps the values at 1.
    chain = jax.jit(lambda a, b, k: jax.lax.fori_loop(0, k, lambda _, x: x @ b, a))
    found = {}
    for name in _DTYPES.values():
        for n in _MATMUL_SIZES:
            a, b = jnp.ones((n, n), getattr(jnp, name)), jnp.full((n, n), 1.0 / n, getattr(jnp, name))

            def timed(k: int, a: Any = a, b: Any = b) -> float:
                return median_seconds(functools.partial(chain, a, b, jnp.int32(k)), repeats=_REPEATS)

            single, k = timed(1), 4
            chained = timed(k)
            while chained - single < max(_CHAIN_SECONDS, single) and k < _MAX_CHAIN:
                k *= 4
                chained = timed(k)
            # A chain no slower than one product (noise): its average.
            found[(name, n)] = (chained - single) / (k - 1) if chained > single else chained / k
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
    dispatch = _dispatch_seconds(devices)
    bandwidth, bandwidth_source = _bandwidth(devices, dispatch_s=dispatch, memory_bytes=memory)
    groups = sorted({2, devices}) if devices > 1 else []
    measurements = MachineMeasurements(
        platform=kind,
        device_kind=device_kind,
        devices=devices,
        host_cores=_host_cores(kind),
        memory_bytes=memory,
        memory_source=memory_source,
        bandwidth=bandwidth,
        bandwidth_source=bandwidth_source,
        all_reduce_s={(n, s): _all_reduce_seconds(devices, n, s) for n in groups for s in (_SMALL, _LARGE)},
        dispatch_s=dispatch,
        **_timed_steps(measured),
        microbatch_size=microbatch_size,
        dtype=_DTYPES.get(model.dtype_bytes, "float32"),
        matmul_s=_matmul_seconds() if kind != "cpu" else {},
    )
    seconds = time.perf_counter() - started
    return fit_machine(model, dataclasses.replace(measurements, seconds=seconds))


def _timed_steps(measured: dict[Any, float]) -> dict[str, Any]:
    """The :class:`MachineMeasurements` fields of the :func:`calibration_steps` timed as
    ``measured`` (:meth:`~pipedsl.cli.timed.TimedSteps.take`)."""

    def keyed(kind: str) -> dict[int, float]:
        return {key[1]: seconds for key, seconds in measured.items() if key[0] == kind}

    return {
        "step_s": {key[1:]: seconds for key, seconds in measured.items() if key[0] == "compute"},
        "apart_s": measured.get(("apart", *APART_SHAPE)),
        "busy_s": keyed("busy"),
        "tensor_s": keyed("tensor"),
    }


def recalibrated(calibration: MachineCalibration, model: Model, measured: dict[Any, float]) -> MachineCalibration:
    """``calibration`` fitted again to ``measured``, its steps' seconds timed again later
    (:meth:`~pipedsl.cli.timed.TimedSteps.take` of the same :func:`calibration_steps`):
    the demo times them in turns with its runs, so that its predictions rest on the
    machine's speed while they ran (the step dispatched action by action too). The short
    measurements (memory, bandwidth, collectives, dispatch, products) are kept."""
    again = dataclasses.replace(calibration.measurements, **_timed_steps(measured), seconds=0.0)
    return fit_machine(model, again)
