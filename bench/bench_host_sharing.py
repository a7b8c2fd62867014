"""How two stage programs on disjoint meshes of one CPU host share its cores.

The simulator prices devices that share a host's cores by processor sharing
(:mod:`pipedsl.simulator.sharing`): programs that run at once each progress at their share
of the cores. This measures what XLA's CPU client does, in the case a pipeline step makes
all the time: stage ``b``'s program (one device's weight gradients, say) is dispatched, then
stage ``a``'s (the other device's input gradient) on a disjoint mesh of the same width.
For each mesh width (JAX devices per mesh; 8 forced host devices):

- ``long`` and ``short``: each program alone, median seconds;
- ``short_after_long``: when ``short`` is ready, counted from the dispatch of both (``long``
  first, then ``short``), median seconds;
- ``waited``: ``(short_after_long - short) / long``: about 0 when the two run at once
  without slowing each other (enough cores), the share of ``long``'s time that ``short``
  is slowed by under processor sharing (``short / long`` or so), and about 1 when ``short``
  starts only once ``long`` is done: one program at a time, in the order dispatched.

    python bench/bench_host_sharing.py [--repeat 5] [--size 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from timing import record

WIDTHS = (1, 2, 4)
"""JAX devices per mesh: two meshes of each width, on 8 forced host devices."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions per figure (default 5)")
    parser.add_argument("--size", type=int, default=256, help="rows and columns per device (default 256)")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    def program(rounds: int) -> object:
        # Row-sharded matrix products: every device computes on its own rows, no collective.
        def run(x: jax.Array) -> jax.Array:
            weight = jnp.full((args.size, args.size), 1.0 / args.size)
            for _ in range(rounds):
                x = jnp.tanh(x @ weight)
            return x

        return jax.jit(run)

    short, long = program(8), program(64)
    devices = jax.devices()
    print(f"jax {jax.__version__}, {os.cpu_count()} cores, {len(devices)} host devices")
    print(f"{'width':>5}  {'long (ms)':>9}  {'short (ms)':>10}  {'short after long (ms)':>21}  {'waited':>6}")
    figures: dict[str, float] = {}
    for width in WIDTHS:
        meshes = [Mesh(np.array(devices[i * width : (i + 1) * width]), ("data",)) for i in (0, 1)]
        a, b = (
            jax.device_put(jnp.ones((width * args.size, args.size)), NamedSharding(m, PartitionSpec("data")))
            for m in meshes
        )
        for fn in (short, long):
            jax.block_until_ready((fn(a), fn(b)))

        def timed(make: object) -> float:
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                jax.block_until_ready(make())
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        alone_long, alone_short = timed(lambda: long(b)), timed(lambda: short(a))
        after = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            first = long(b)
            jax.block_until_ready(short(a))
            after.append(time.perf_counter() - start)
            jax.block_until_ready(first)
        short_after = statistics.median(after)
        waited = (short_after - alone_short) / alone_long
        print(
            f"{width:>5}  {alone_long * 1e3:9.1f}  {alone_short * 1e3:10.1f}  {short_after * 1e3:21.1f}  {waited:6.2f}"
        )
        figures |= {
            f"long_w{width}_ms": alone_long * 1e3,
            f"short_w{width}_ms": alone_short * 1e3,
            f"short_after_long_w{width}_ms": short_after * 1e3,
            f"waited_w{width}": waited,
        }
    record("bench_host_sharing", figures)


if __name__ == "__main__":
    main()
