"""This machine as a calibrated cluster of forced CPU devices, measured once.

The plan search prices a plan from a :class:`~pipedsl.simulator.Cluster`. On forced CPU
devices every device shares this machine's cores, so each number is measured with every
device busy at once, and once, before the search, so that the search ranks with it and
every run's prediction comes from it (never from that run's own steps). The cluster
says how many cores its devices share (``shared_cores``, the cores this process may run
on), so that a pipeline's idle devices are priced as cores the busy ones get:

- *compute*: one data-parallel forward and backward of the model (cut to one layer, so
  that it compiles quickly), a microbatch on every device at once, without any reduction
  between them; the rate is the ``peak_flops`` at which the simulator's cost of that same
  work equals the measured time (elementwise work priced at the measured memory
  bandwidth). A product benchmark overstates this rate about tenfold on CPU: the
  backward's transposed products, the attention's small ones and the elementwise work
  run far below it;
- *memory bandwidth*: one elementwise update of a few MB on every device at once;
- *collectives*: all-reduces over groups of 2 and of every device, of a small and a
  large buffer, fitted to the ring formula ``2(n-1)·α + 2(n-1)/n · S/B`` (α and B are
  then also what a send between two devices costs);
- *dispatch*: the seconds one device's thread spends per dispatched stage program while
  every device dispatches (``action_overhead_s``, what each scheduled action costs on top
  of its kernels).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipedsl.simulator import Cluster, Model, Plan, estimate

__all__ = ["MachineCalibration", "calibrate_machine"]

_REPEATS = 3
_DISPATCHES = 100
_SMALL, _LARGE = 1 << 12, 1 << 22


@dataclass(frozen=True, slots=True)
class MachineCalibration:
    """The calibrated cluster and what was measured for it.

    Attributes:
      cluster: this machine as ``devices`` CPU devices in one node.
      compute_s: measured seconds of one microbatch's forward and backward on every device.
      microbatch_size: sequences per device in that measurement.
      all_reduce_s: measured seconds by (group size, bytes).
      seconds: wall time of the whole calibration.
    """

    cluster: Cluster
    compute_s: float
    microbatch_size: int
    all_reduce_s: dict[tuple[int, int], float]
    seconds: float

    def describe(self) -> str:
        """One line per measured quantity, with units."""
        c = self.cluster
        reduces = ", ".join(f"{n} devices {b / 1e6:.3g} MB {t * 1e3:.2f} ms" for (n, b), t in self.all_reduce_s.items())
        return (
            f"compute {c.peak_flops / 1e9:.2f} GFLOP/s per device (fitted to a forward and backward of "
            f"{self.microbatch_size} sequences per device: {self.compute_s * 1e3:.1f} ms); memory "
            f"{c.hbm_bandwidth / 1e9:.2f} GB/s; collectives α {c.intra_node_latency * 1e6:.0f} µs, "
            f"B {c.intra_node_bandwidth / 1e9:.2f} GB/s (all-reduce {reduces}); dispatch "
            f"{c.action_overhead_s * 1e6:.0f} µs per action; calibrated in {self.seconds:.1f} s"
        )


def _median_seconds(run: Callable[[], Any], repeats: int = _REPEATS) -> float:
    """Median wall seconds of ``run()`` (its result blocked on), after one warm-up call."""
    import jax

    jax.block_until_ready(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compute_seconds(model: Any, devices: int, microbatch_size: int) -> float:
    """One forward and backward of ``microbatch_size`` sequences on each of ``devices``,
    all at once, nothing reduced between them."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)[0]
    tokens, targets = model.batch(jax.random.fold_in(key, 1), devices * microbatch_size)
    split = NamedSharding(mesh, PartitionSpec("data"))

    def local(p: Any, x: jax.Array, t: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(lambda q: model.loss(model.stages[0](q, x), t))(p)
        # Each device's own gradients, stacked: no reduction between devices.
        return loss[None], jax.tree.map(lambda g: g[None], grads)

    program = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("data"), PartitionSpec("data")),
            out_specs=PartitionSpec("data"), check_vma=False,
        )
    )  # fmt: skip
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    tokens, targets = jax.device_put(tokens, split), jax.device_put(targets, split)
    return _median_seconds(lambda: program(params, tokens, targets))


def _bandwidth(devices: int) -> float:
    """Bytes per second of an elementwise update (read and write) on every device at once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    x = jax.device_put(jnp.ones((devices, 1 << 20), jnp.float32), NamedSharding(mesh, PartitionSpec("data")))
    update = jax.jit(lambda v: v * 0.5 + 1.0)
    return 2 * x.nbytes / devices / _median_seconds(lambda: update(x))


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
    return _median_seconds(lambda: program(x))


def _fit_ring(times: dict[tuple[int, int], float]) -> tuple[float, float]:
    """(α seconds, B bytes per second) of ``2(n-1)·α + 2(n-1)/n · S/B`` by least squares
    of the relative error over the measured all-reduces (so that the small ones, which
    set α, weigh as much as the large ones; both kept positive)."""
    measured = np.array(list(times.values()))
    rows = np.array([[2 * (n - 1), 2 * (n - 1) / n * s] for n, s in times]) / measured[:, None]
    alpha, inverse = np.linalg.lstsq(rows, np.ones(len(measured)), rcond=None)[0]
    return max(float(alpha), 1e-6), 1.0 / max(float(inverse), 1e-12)


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


def _fit_flops(model: Model, base: Cluster, devices: int, microbatch_size: int, measured: float) -> float:
    """The ``peak_flops`` at which the simulator prices one data-parallel microbatch's
    forward and backward at ``measured`` seconds (bisection on a log scale)."""
    plan = Plan(dp=devices, microbatch_size=microbatch_size, global_batch=devices * microbatch_size, flash_attention=False)

    def priced(flops: float) -> float:
        return estimate(model, dataclasses.replace(base, peak_flops=flops), plan).pipeline_time_s

    low, high = 1e6, 1e15
    for _ in range(60):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if priced(middle) > measured else (low, middle)
    return (low * high) ** 0.5


def calibrate_machine(
    devices: int, model: Model, build: Callable[[int], Any], *, microbatch_size: int
) -> MachineCalibration:
    """Measure this machine once (module docstring) as ``devices`` CPU devices running
    ``model`` (its simulator description); ``build(layers)`` gives the same model as the
    executor builds it, one stage of ``layers`` layers."""
    started = time.perf_counter()
    compute = _compute_seconds(build(1), devices, microbatch_size)
    bandwidth = _bandwidth(devices)
    reduces = {(n, s): _all_reduce_seconds(devices, n, s) for n in sorted({2, devices}) for s in (_SMALL, _LARGE)}
    alpha, link = _fit_ring(reduces)
    dispatch = _dispatch_seconds(devices)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(devices, 1)
    base = Cluster(
        name="this machine",
        gpu="CPU device",
        peak_flops=1e9,
        matmul_efficiency=1.0,
        shared_cores=len(os.sched_getaffinity(0)),
        memory_bytes=int(memory),
        hbm_bandwidth=bandwidth,
        gpus_per_node=devices,
        intra_node_bandwidth=link,
        intra_node_latency=alpha,
        inter_node_bandwidth=link,
        inter_node_latency=alpha,
    )
    flops = _fit_flops(dataclasses.replace(model, layers=1), base, devices, microbatch_size, compute)
    cluster = dataclasses.replace(base, peak_flops=flops, action_overhead_s=dispatch)
    return MachineCalibration(
        cluster=cluster,
        compute_s=compute,
        microbatch_size=microbatch_size,
        all_reduce_s=reduces,
        seconds=time.perf_counter() - started,
    )
