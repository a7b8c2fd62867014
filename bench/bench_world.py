"""Measure the Ray backend's jax.distributed world on this machine's CPU.

Three measurements, on a local Ray instance started here (all on 127.0.0.1):

1. one inter-process hop: two processes of one world move a float32 array of 4 B, 256 KB
   and 4 MB back and forth, the median one-way hop (half a round trip), three ways in the
   same two processes, in turn:

   - ``collective``: the backend's own compiled point-to-point program
     (:class:`pipedsl.executor.ray.transport.Hops`), everything it does per transfer;
   - ``bare``: the floor under it, a jitted ``ppermute`` under ``shard_map`` of an array
     made once (no placement, no reassembly), the least one gloo collective costs here;
   - ``transfer``: ``jax.experimental.transfer`` servers, the primitive of the transfer
     path the backend used before its processes formed one world;

   and a call of no work from the driver to both processes at once, waited for: the
   least Ray adds to every step (the driver's one call per process);
2. the executor's own cost per action: 1F1B over 2 processes (one stage each), 16
   microbatches of a one-row, 4-wide, one-layer MLP (compute negligible): the median step
   over its F and B actions (64), every fixed per-step cost included (in a fresh process,
   as 3.), next to the collectives the step takes and what Ray and gloo alone put under
   it (1.'s call of no work and a bare hop per collective); then the same with the
   processes left unbound (``bind_cores=False``, :mod:`pipedsl.executor.ray.cores`);
3. a 4-process 1F1B step (pp = 4, 8 microbatches of 8 rows) of a ``--width``-wide MLP,
   median, run in a fresh process by this checkout's interpreter (its processes bound to
   cores, then unbound) and, with ``--baseline PYTHON``, by another checkout's in turn,
   with the ratio. The transfer path itself is
   gone from this checkout; the last one that has it is the commit before 8918358
   (``git worktree add ../transfer-path 8918358^``, ``make .venv/.installed`` there, then
   ``--baseline ../transfer-path/.venv/bin/python``): the same pipeline on the same
   machine in the same run, one actor per pipeline device moving values through transfer
   servers, against this checkout's world of processes moving them by collectives.

    python bench/bench_world.py [--repeat 10] [--width 256] [--only hops|steps] [--baseline PYTHON]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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

    def nothing(self) -> None:
        """A call of no work."""

    def round_trips(self, elements: int, rounds: int) -> list[float]:
        """Round trips of ``elements`` float32 values through the backend's hops, in s."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from pipedsl.executor.ray.transport import Hops
        from pipedsl.executor.stages.mesh import DATA, TENSOR

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

    def bare_round_trips(self, elements: int, rounds: int) -> list[float]:
        """Round trips of two bare jitted ppermutes (there, then back) of an array made
        once over both processes' devices, in s."""
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        devices = sorted(jax.devices(), key=lambda d: d.process_index)
        mesh = Mesh(np.array(devices), ("pair",))
        spec = PartitionSpec("pair")
        mine = [jax.device_put(np.ones(elements, np.float32), d) for d in devices if d.process_index == self.rank]
        x = jax.make_array_from_single_device_arrays((2 * elements,), NamedSharding(mesh, spec), mine)

        def hop(perm: list[tuple[int, int]]) -> Any:
            permute = jax.shard_map(
                lambda v: jax.lax.ppermute(v, "pair", perm), mesh=mesh, in_specs=spec, out_specs=spec
            )
            return jax.jit(permute)

        there, back = hop([(0, 1)]), hop([(1, 0)])
        times = []
        for _ in range(rounds + 2):
            start = time.perf_counter()
            x = back(there(x)).block_until_ready()
            times.append(time.perf_counter() - start)
        return times[2:]

    def transfer_address(self) -> str:
        """Start this process's ``jax.experimental.transfer`` server; its address."""
        import jax
        from jax.experimental import transfer

        self.device = jax.local_devices()[0]
        self.server = transfer.start_transfer_server(self.device.client, "127.0.0.1:0", ["127.0.0.1:0"])
        return str(self.server.address())

    def transfer_connect(self, address: str) -> None:
        self.connection = self.server.connect(address)

    def transfer_round_trips(self, elements: int, rounds: int, base: int) -> list[float]:
        """Round trips through the transfer servers (rank 0 offers then pulls, rank 1
        pulls then offers; ids ``base + 2i`` there and ``base + 2i + 1`` back), in s."""
        import jax
        import jax.numpy as jnp

        x = jax.device_put(jnp.ones(elements, jnp.float32), self.device)
        spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(self.device))
        times = []
        for i in range(rounds + 2):
            there, back = base + 2 * i, base + 2 * i + 1
            start = time.perf_counter()
            if self.rank == 0:
                self.server.await_pull(there, [x])
                x = self.connection.pull(back, [spec])[0].block_until_ready()
            else:
                x = self.connection.pull(there, [spec])[0].block_until_ready()
                self.server.await_pull(back, [x])
            times.append(time.perf_counter() - start)
        return times[2:]


def bench_hops(repeat: int) -> dict[str, float]:
    """Measurement 1: the median one-way hop per size and way, in ms."""
    import ray

    from pipedsl.executor.devices import xla_device_flag

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        env = {"env_vars": {"XLA_FLAGS": xla_device_flag(1), "JAX_PLATFORMS": "cpu", "NPROC": "1"}}
        remote = ray.remote(num_cpus=0, runtime_env=env)(HopPeer)
        peers = [remote.remote(), remote.remote()]
        address = ray.get(peers[0].coordinator.remote())
        ray.get([p.join.remote(address, r) for r, p in enumerate(peers)])
        servers = ray.get([p.transfer_address.remote() for p in peers])
        ray.get([peers[0].transfer_connect.remote(servers[1]), peers[1].transfer_connect.remote(servers[0])])
        print("1. one inter-process hop (median ms, one way)")
        figures: dict[str, float] = {}
        for k, (label, elements) in enumerate(SIZES.items()):
            ways = {
                "collective": [p.round_trips.remote(elements, repeat) for p in peers],
                "bare": [p.bare_round_trips.remote(elements, repeat) for p in peers],
                "transfer": [p.transfer_round_trips.remote(elements, repeat, 10_000 * (k + 1)) for p in peers],
            }
            cells = []
            for way, refs in ways.items():
                times = ray.get(refs)[0]
                ms = statistics.median(times) / 2 * 1e3
                figures[f"{way}_hop_{label.replace(' ', '').lower()}_ms"] = ms
                cells.append(f"{way} {ms:.2f} ms")
            print(f"   {label:<7} {', '.join(cells)}   (load average {os.getloadavg()[0]:.1f})", flush=True)
        calls = []
        for _ in range(20 * repeat + 2):
            start = time.perf_counter()
            ray.get([p.nothing.remote() for p in peers])
            calls.append(time.perf_counter() - start)
        figures["ray_call_ms"] = statistics.median(calls[2:]) * 1e3
        print(f"   a call of no work to both processes, waited for: {figures['ray_call_ms']:.2f} ms", flush=True)
        return figures
    finally:
        ray.shutdown()


# One Ray step timed as any checkout runs it, in a fresh process: only API both the
# transfer path and the world have. Arguments: width, repeat, pp, microbatches, rows.
_STEP = """
import json, os, statistics, sys, time
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import jax
from pipedsl.executor import Pipeline, RayConfig
from pipedsl.executor.models import mlp
from pipedsl.library import library_path, load
width, repeat, pp, microbatches, rows = map(int, sys.argv[1:6])
options = {"bind_cores": False} if sys.argv[6:] == ["unbound"] else {}
key = jax.random.PRNGKey(0)
model = mlp(num_stages=pp, width=width, layers_per_stage=1)
schedule = load(library_path("1f1b"), pp=pp, microbatches=microbatches)
params, batch = model.init_stages(key), model.batch(key, rows)
with Pipeline(model.stages, loss=model.loss, schedule=schedule, backend=RayConfig(step_timeout=300, start_timeout=120, **options)) as pipe:
    pipe.value_and_grad(params, batch)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        loss, _ = pipe.value_and_grad(params, batch)
        float(loss)
        times.append(time.perf_counter() - start)
print(json.dumps({"step_s": statistics.median(times), "fastest_s": min(times)}))
"""


def _step(
    python: str, *, width: int, repeat: int, pp: int, microbatches: int, rows: int, unbound: bool = False
) -> dict[str, float]:
    """{"step_s": median, "fastest_s": fastest} seconds of a 1F1B step over ``pp`` Ray
    processes, run by ``python`` in a fresh process (from a neutral folder: ``-c`` puts the
    working folder first on the import path); ``unbound``: with ``bind_cores=False``."""
    argv = [python, "-c", _STEP, *map(str, (width, repeat, pp, microbatches, rows)), *(["unbound"] if unbound else [])]
    done = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(done.stdout.splitlines()[-1])


def bench_steps(repeat: int, bare_ms: float | None, call_ms: float | None) -> dict[str, float]:
    """Measurement 2: the cost per action in us; ``bare_ms`` and ``call_ms`` are
    measurement 1's bare 4 B collective and call of no work, when it ran."""
    import pipedsl
    from pipedsl.library import library_path, load
    from pipedsl.rendezvous import exchange_groups, exchange_order

    schedule = load(library_path("1f1b"), pp=2, microbatches=16)
    timed = _step(sys.executable, width=4, repeat=repeat, pp=2, microbatches=16, rows=16)
    step, fastest = timed["step_s"], timed["fastest_s"]
    actions = schedule.num_actions
    program = pipedsl.lower(schedule)
    transfers, collectives = len(exchange_order(program)), len(exchange_groups(program))
    print(
        "2. the executor's cost per action on Ray (2 processes, 1F1B, 16 microbatches, compute-free; every F and B of both stages)"
    )
    print(f"   step {step * 1e3:.2f} ms (fastest {fastest * 1e3:.2f}) over {actions} F and B actions: "
          f"{step / actions * 1e6:.0f} us per action (fastest {fastest / actions * 1e6:.0f})"
          f"   (load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    figures = {"per_action_us": step / actions * 1e6, "per_action_fastest_us": fastest / actions * 1e6}
    floor = ""
    if bare_ms and call_ms:
        figures["floor_per_action_us"] = (collectives * bare_ms + call_ms) * 1e3 / actions
        floor = (
            f"; under them, Ray and gloo alone (the call of no work, {call_ms:.2f} ms, and {collectives} bare "
            f"collectives, {bare_ms * 1e3:.0f} us each): {figures['floor_per_action_us']:.0f} us per action"
        )
    print(f"   {transfers} transfers in {collectives} collectives per step{floor}", flush=True)
    figures["collectives_per_step"] = collectives
    unbound = _step(sys.executable, width=4, repeat=repeat, pp=2, microbatches=16, rows=16, unbound=True)["step_s"]
    figures["per_action_unbound_us"] = unbound / actions * 1e6
    print(f"   the processes left unbound (bind_cores=False): {unbound / actions * 1e6:.0f} us per action, "
          f"{unbound / step:.2f}x the bound ones'   (load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    return figures


def bench_step_pp4(repeat: int, width: int, baseline: str | None) -> dict[str, float]:
    """Measurement 3, by this checkout's interpreter and ``baseline``'s (when given), each
    in a fresh process."""
    steps = {}
    for name, python in (("step_1f1b_pp4_ms", sys.executable), ("baseline_step_1f1b_pp4_ms", baseline)):
        if python is not None:
            steps[name] = _step(python, width=width, repeat=repeat, pp=4, microbatches=8, rows=8 * 8)["step_s"] * 1e3
    print(f"3. a 4-process 1F1B step (pp 4, 8 microbatches of 8 rows, width {width}): {steps['step_1f1b_pp4_ms']:.1f} ms"
          f"   (load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    unbound = _step(sys.executable, width=width, repeat=repeat, pp=4, microbatches=8, rows=8 * 8, unbound=True)
    steps["step_1f1b_pp4_unbound_ms"] = unbound["step_s"] * 1e3
    print(
        f"   the processes left unbound (bind_cores=False): {steps['step_1f1b_pp4_unbound_ms']:.1f} ms, "
        f"{steps['step_1f1b_pp4_unbound_ms'] / steps['step_1f1b_pp4_ms']:.2f}x the bound ones'",
        flush=True,
    )
    if baseline is not None:
        ratio = steps["baseline_step_1f1b_pp4_ms"] / steps["step_1f1b_pp4_ms"]
        print(f"   {baseline}: {steps['baseline_step_1f1b_pp4_ms']:.1f} ms ({ratio:.2f}x this checkout's)", flush=True)
        steps["baseline_ratio"] = ratio
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10, help="timed repetitions per measurement (default 10)")
    parser.add_argument("--width", type=int, default=256, help="layer width of measurement 3 (default 256)")
    parser.add_argument("--only", choices=("hops", "steps"), help="run measurement 1 only, or 2 and 3")
    parser.add_argument("--baseline", metavar="PYTHON", help="another checkout's python to run measurement 3 with too")
    args = parser.parse_args()
    # Loopback throughout (see pipedsl.executor.ray.connection); read when ray is imported.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import jax
    import ray

    print(f"ray {ray.__version__}, jax {jax.__version__}, {os.cpu_count()} cores", file=sys.stderr)
    figures: dict[str, float] = {}
    if args.only != "steps":
        figures |= bench_hops(args.repeat)
    if args.only != "hops":
        figures |= bench_steps(args.repeat, figures.get("bare_hop_4b_ms"), figures.get("ray_call_ms"))
        figures |= bench_step_pp4(args.repeat, args.width, args.baseline)
    record("bench_world", figures)


if __name__ == "__main__":
    main()
