"""Measure the ways to move an array from one Ray actor to another, on this machine's CPU.

Two actors on a local Ray instance (all on 127.0.0.1) bounce a float32 array of 4 B,
256 KB and 4 MB back and forth; the table gives the median one-way hop (half a round
trip) of each transport, in milliseconds:

- ``direct``: actor A calls ``B.echo(x)`` and waits for the result (an argument over Ray's
  inline limit, 100 KB by default, goes through the object store);
- ``direct+inline``: the same on an instance started with
  ``_system_config={"max_direct_call_object_size": ...}`` above the largest payload, so
  every argument travels inside the call;
- ``graph``: a Ray compiled graph (``experimental_compile``) of a chain of hops
  A -> B -> A -> ...; the hop is the slope of the time per execution over the chain's
  length, so the driver's own two hops drop out;
- ``jax``: ``jax.experimental.transfer``, a transfer server per actor; A offers the
  array with ``await_pull`` under an id both sides know (the programs are static, so a
  receiver knows what comes next and no message announces it) and B pulls it, then back.

These are the transports the Ray backend used before its processes formed one
``jax.distributed`` world; ``bench/bench_world.py`` measures the collective that replaced them
the same way (median one-way hop), for the comparison.

Direct calls and JAX transfers run in the same actors, in turn, so load drifts hit both
alike; the raised inline limit and the compiled graphs each get an instance of their own
(see ``_measure``). The machine's load is printed with the results.

    python bench/bench_transports.py [--repeat 30]
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
_INLINE = 8 * 1024 * 1024  # bytes: above the largest payload
_CHAIN = (1, 5)  # hops per compiled graph, for the slope
_GRAPH_TIMEOUT = 60.0  # seconds


class Peer:
    """One end: echoes direct calls, and moves arrays with a JAX transfer server."""

    def __init__(self) -> None:
        import jax
        from jax.experimental import transfer

        self.device = jax.devices()[0]
        self.server = transfer.start_transfer_server(self.device.client, "127.0.0.1:0", ["127.0.0.1:0"])
        self.connection: Any = None
        self.other: Any = None

    def address(self) -> str:
        return self.server.address()

    def meet(self, other: Any, address: str) -> None:
        self.other = other
        self.connection = self.server.connect(address)

    def echo(self, x: Any) -> Any:
        return x

    def hop(self, x: Any) -> Any:
        """One edge of a compiled graph (the array goes on unchanged)."""
        return x

    def direct(self, elements: int, rounds: int) -> list[float]:
        """Round trips of ``elements`` float32 values through ``other.echo``, in seconds."""
        import numpy as np
        import ray

        x = np.ones(elements, np.float32)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            ray.get(self.other.echo.remote(x))
            times.append(time.perf_counter() - start)
        return times

    def jax_round_trips(self, elements: int, rounds: int, first: bool, base: int) -> list[float]:
        """Round trips through the transfer servers: the first end offers then pulls,
        the other pulls then offers; ids ``base + 2i`` (there) and ``base + 2i + 1`` (back)."""
        import jax
        import jax.numpy as jnp

        x = jax.device_put(jnp.ones(elements, jnp.float32), self.device)
        spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(self.device))
        times = []
        for i in range(rounds):
            there, back = base + 2 * i, base + 2 * i + 1
            start = time.perf_counter()
            if first:
                self.server.await_pull(there, [x])
                x = self.connection.pull(back, [spec])[0].block_until_ready()
            else:
                x = self.connection.pull(there, [spec])[0].block_until_ready()
                self.server.await_pull(back, [x])
            times.append(time.perf_counter() - start)
        return times


def _half_median(times: list[float]) -> float:
    return statistics.median(times) / 2


def _graph_hop(remote: Any, elements: int, rounds: int) -> float:
    """One hop of a compiled graph, in seconds: the slope over chains of ``_CHAIN`` hops.

    Every graph gets two fresh actors and kills them at teardown: in Ray 2.60 on this
    machine, tearing a graph down may otherwise hang, and a later graph on the same
    instance with it.
    """
    import numpy as np
    import ray
    from ray.dag import InputNode

    x = np.ones(elements, np.float32)
    per: list[float] = []
    for hops in _CHAIN:
        a, b = remote.remote(), remote.remote()
        with InputNode() as node:
            out = node
            for k in range(hops + 1):  # the first bind only receives x from the driver
                out = (a if k % 2 == 0 else b).hop.bind(out)
        graph = out.experimental_compile()
        try:
            ray.get(graph.execute(x), timeout=_GRAPH_TIMEOUT)
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                ray.get(graph.execute(x), timeout=_GRAPH_TIMEOUT)
                times.append(time.perf_counter() - start)
        finally:
            graph.teardown(kill_actors=True)
        per.append(statistics.median(times))
    return (per[1] - per[0]) / (_CHAIN[1] - _CHAIN[0])


def _measure(rounds: int, *, phase: str) -> dict[str, dict[str, float]]:
    """Seconds per hop by size for one phase, on a fresh local instance: ``plain``
    (direct calls and JAX transfers), ``inline`` (direct calls, raised inline limit) or
    ``graph`` (compiled graphs; NaN where a graph did not finish within a minute)."""
    import ray

    options: dict[str, Any] = {"address": "local", "num_cpus": 2, "include_dashboard": False}
    options["_node_ip_address"] = "127.0.0.1"
    if phase == "inline":
        options["_system_config"] = {"max_direct_call_object_size": _INLINE}
    ray.init(**options)
    try:
        remote = ray.remote(num_cpus=0, max_concurrency=2)(Peer)
        a, b = remote.remote(), remote.remote()
        ray.get([a.meet.remote(b, ray.get(b.address.remote())), b.meet.remote(a, ray.get(a.address.remote()))])
        results: dict[str, dict[str, float]] = {}
        # Largest first: in Ray 2.60 a compiled graph of 4 MB arrays hangs after one of
        # 256 KB ran on the same instance (even on other actors); the other way works.
        for label, elements in sorted(SIZES.items(), key=lambda item: -item[1]):
            if phase == "graph":
                try:
                    results[label] = {"graph": _graph_hop(remote, elements, rounds)}
                except ray.exceptions.RayError:
                    results[label] = {"graph": float("nan")}
            else:
                ray.get(a.direct.remote(elements, 3))
                results[label] = {
                    ("direct" if phase == "plain" else "direct+inline"): _half_median(
                        ray.get(a.direct.remote(elements, rounds))
                    )
                }
            if phase == "plain":
                base = 1000 * (1 + list(SIZES).index(label)) * rounds
                there = a.jax_round_trips.remote(elements, rounds, True, base)
                back = b.jax_round_trips.remote(elements, rounds, False, base)
                results[label]["jax"] = _half_median(ray.get(there))
                ray.get(back)
            print(f"   measured {phase} {label}", file=sys.stderr, flush=True)
        return results
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=30, help="round trips per measurement (default 30)")
    args = parser.parse_args()
    # Loopback throughout (see pipedsl.executor.ray.connection); read when ray is imported.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import jax
    import ray

    print(
        f"ray {ray.__version__}, jax {jax.__version__}, {os.cpu_count()} cores: one-way hop between two actors, median ms"
    )
    figures: dict[str, float] = {}
    for phase in ("plain", "inline", "graph"):
        results = _measure(args.repeat, phase=phase)
        for label in SIZES:
            cells = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in results[label].items())
            print(f"   {label:<7} {cells}   (load average {os.getloadavg()[0]:.1f})", flush=True)
            figures |= {
                f"{name}_{label.replace(' ', '')}_ms": seconds * 1e3 for name, seconds in results[label].items()
            }
    record("bench_transports", figures)


if __name__ == "__main__":
    main()
