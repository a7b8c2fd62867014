"""Measure the Ray backend's jax.distributed world on this machine's CPU.

Three measurements, on a local Ray instance started here (all on 127.0.0.1):

1. one inter-process hop on the collective path: two processes of one world move a float32
   array of 4 B, 256 KB and 4 MB back and forth with the backend's own compiled
   point-to-point program (:class:`pipedsl.executor.ray_transport.Hops`); the median
   one-way hop (half a round trip). ``bench/bench_transports.py`` measures the transfer
   servers the backend used before (``jax``) the same way;
2. the executor's own cost per action: 1F1B over 2 processes (one stage each), 16
   microbatches of a one-row, 4-wide, one-layer MLP (compute negligible): the median step
   over its F and B actions (32), every fixed per-step cost included;
3. a 4-process 1F1B step (pp = 4, 8 microbatches) of a ``--width``-wide MLP, median.

    python bench/bench_world.py [--repeat 10] [--width 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from timing import record

SIZES = {"4 B": 1, "256 KB": 64 * 1024, "4 MB": 1024 * 1024}  # float32 elements


class HopPeer:
    """One process of a two-process world that bounces arrays with the backend's hops."""

    def coordinator(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{s.getsockname()[1]}"

    def join(self, address: str, rank: int) -> None:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(address, num_processes=2, process_id=rank)
        self.rank = rank

    def round_trips(self, elements: int, rounds: int) -> list[float]:
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from pipedsl.executor.mesh import DATA, TENSOR
        from pipedsl.executor.ray_transport import Hops

        devices = sorted(jax.devices(), key=lambda d: d.process_index)
        meshes = [Mesh(np.array([d]).reshape(1, 1), (DATA, TENSOR)) for d in devices]
        hops = Hops(meshes)
        signature = (((elements,), np.dtype(np.float32), PartitionSpec(DATA)),)
        x = jax.device_put(jnp.ones(elements, jnp.float32), NamedSharding(meshes[self.rank], PartitionSpec(DATA)))
        times = []
        for _ in range(rounds + 2):
            start = time.perf_counter()
            if self.rank == 0:
                hops.move(0, 1, signature, (x,))
                (x,) = hops.move(1, 0, signature, None)  # type: ignore[misc]
            else:
                (x,) = hops.move(0, 1, signature, None)  # type: ignore[misc]
                hops.move(1, 0, signature, (x,))
            jax.block_until_ready(x)
            times.append(time.perf_counter() - start)
        return times[2:]  # the first round trips compile


def bench_hops(repeat: int) -> dict[str, float]:
    """Measurement 1: the median one-way hop per size, in ms."""
    import ray

    from pipedsl.executor.devices import xla_device_flag

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        env = {"env_vars": {"XLA_FLAGS": xla_device_flag(1), "JAX_PLATFORMS": "cpu", "NPROC": "1"}}
        remote = ray.remote(num_cpus=0, runtime_env=env)(HopPeer)
        peers = [remote.remote(), remote.remote()]
        address = ray.get(peers[0].coordinator.remote())
        ray.get([p.join.remote(address, r) for r, p in enumerate(peers)])
        print("1. one inter-process hop, collective path (median ms, one way)")
        figures: dict[str, float] = {}
        for label, elements in SIZES.items():
            there, back = (p.round_trips.remote(elements, repeat) for p in peers)
            times = ray.get(there)
            ray.get(back)
            figures[f"hop_{label.replace(' ', '').lower()}_ms"] = statistics.median(times) / 2 * 1e3
            print(
                f"   {label:<7} {statistics.median(times) / 2 * 1e3:.2f} ms   (load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        return figures
    finally:
        ray.shutdown()


def _median_step(pipe: Any, params: Any, batch: Any, repeat: int) -> float:
    pipe.value_and_grad(params, batch)  # compiles
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        loss, _ = pipe.value_and_grad(params, batch)
        float(loss)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_steps(repeat: int, width: int) -> dict[str, float]:
    """Measurements 2 and 3: the cost per action in us and the 4-process step in ms."""
    import jax

    from pipedsl.executor import Pipeline, RayConfig
    from pipedsl.executor.models import mlp
    from pipedsl.library import library_path, load

    key = jax.random.PRNGKey(0)
    config = RayConfig(step_timeout=300, start_timeout=120)
    tiny = mlp(num_stages=2, width=4, layers_per_stage=1)
    schedule = load(library_path("1f1b"), pp=2, microbatches=16)
    with Pipeline(tiny.stages, loss=tiny.loss, schedule=schedule, backend=config) as pipe:
        step = _median_step(pipe, tiny.init_stages(key), tiny.batch(key, 16), repeat)
    actions = schedule.num_actions
    print(
        "2. the executor's cost per action on Ray (2 processes, 1F1B, 16 microbatches, compute-free; every F and B of both stages)"
    )
    print(f"   step {step * 1e3:.2f} ms over {actions} F and B actions: {step / actions * 1e6:.0f} us per action"
          f"   (load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    figures = {"per_action_us": step / actions * 1e6}
    model = mlp(num_stages=4, width=width, layers_per_stage=1)
    schedule = load(library_path("1f1b"), pp=4, microbatches=8)
    with Pipeline(model.stages, loss=model.loss, schedule=schedule, backend=config) as pipe:
        step = _median_step(pipe, model.init_stages(key), model.batch(key, 8 * 8), repeat)
    print(f"3. a 4-process 1F1B step (pp 4, 8 microbatches of 8 rows, width {width}): {step * 1e3:.1f} ms"
          f"   (load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    return figures | {"step_1f1b_pp4_ms": step * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10, help="timed repetitions per measurement (default 10)")
    parser.add_argument("--width", type=int, default=256, help="layer width of measurement 3 (default 256)")
    parser.add_argument("--only", choices=("hops", "steps"), help="run one measurement")
    args = parser.parse_args()
    # Loopback throughout (see pipedsl.executor.ray_connection); read when ray is imported.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import jax
    import ray

    print(f"ray {ray.__version__}, jax {jax.__version__}, {os.cpu_count()} cores", file=sys.stderr)
    figures: dict[str, float] = {}
    if args.only != "steps":
        figures |= bench_hops(args.repeat)
    if args.only != "hops":
        figures |= bench_steps(args.repeat, args.width)
    record("bench_world", figures)


if __name__ == "__main__":
    main()
