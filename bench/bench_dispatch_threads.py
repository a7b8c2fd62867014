"""One host thread against a thread per pipeline device, dispatching a step apart.

The local backend dispatches every pipeline device's step from one thread, in wavefront
order (:mod:`pipedsl.executor.runtime.scheduler`). This benchmark measures the alternative
that a host serving several chips might take: each device's step code on a thread of its
own, a receive blocking that thread until the value is sent. Both run the same workers,
programs and copies (``RunOptions(fuse="off")``: the pipeline devices kept apart, as on
devices of their own) over the plans of ``bench/bench_against_jit.py``, on this machine's
first device; per plan and way, the host's seconds per step (medians of ``--rounds``) and
the step's seconds in a loop of ``--steps``, in turns so that drift hits both alike.

    python bench/bench_dispatch_threads.py [--plans 1f1b-pp4,zb_h1-pp4] [--steps 10] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

# The sibling benchmarks import from this folder, also under `python -P` (as the
# accelerator scripts run, so that the checkout's pipedsl/ never shadows the installed one).
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_against_jit as against  # noqa: E402
from timing import record  # noqa: E402


def _threaded(pipe: Any, step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` with the local backend's scheduler replaced by a thread per pipeline device."""
    from pipedsl.executor.local import backend as local
    from pipedsl.executor.local.exchange import Handoff, LocalExchange
    from pipedsl.executor.runtime.scheduler import NOTHING, Receive
    from pipedsl.executor.runtime.waits import finished

    class Exchange(LocalExchange):
        """The mailboxes, with a receive that blocks its thread until the value is sent."""

        def __init__(self, movers: Any) -> None:
            super().__init__(movers)
            self.sent = threading.Condition()

        def put(self, key: tuple[Hashable, int], value: Any) -> None:
            super().put(key, value)
            with self.sent:
                self.sent.notify_all()

        def wait(self, request: Receive, device: int, timeout: float) -> Any:
            deadline = time.monotonic() + timeout
            with self.sent:
                while (value := self.take(request, device)) is NOTHING:
                    if not self.sent.wait(max(deadline - time.monotonic(), 0.0)):
                        raise TimeoutError(f"device {device} waited {timeout} s for {request.key}")
            return value.take(timeout) if isinstance(value, Handoff) else value

    def run_threads(steps: Any, exchange: Any, *, timeout: float, doing: Any, progress: Any) -> Any:
        results: list[Any] = [None] * len(steps)
        errors: list[BaseException | None] = [None] * len(steps)

        def one(d: int) -> None:
            gen = steps[d]
            try:
                request = next(gen)
                while True:
                    if isinstance(request, Receive):
                        answer = exchange.wait(request, d, timeout)
                    else:
                        answer = finished(request.value, timeout)
                    request = gen.send(answer)
            except StopIteration as done:
                results[d] = done.value
            except BaseException as err:  # the first error is raised by the backend
                errors[d] = err

        threads = [threading.Thread(target=one, args=(d,)) for d in range(len(steps))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results, errors

    def threaded() -> Any:
        scheduler, exchange = local.run_watched, local.LocalExchange
        local.run_watched, local.LocalExchange = run_threads, Exchange  # type: ignore[assignment]
        try:
            return step()
        finally:
            local.run_watched, local.LocalExchange = scheduler, exchange

    return threaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", default="1f1b-pp4,zb_h1-pp4", help=f"comma-separated, of {', '.join(against.PLANS)}")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed loop (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="timed loops per figure (default 5)")
    args = parser.parse_args()
    import jax
    import optax

    device = jax.devices()[0]
    size = against.TOY if device.platform == "cpu" else against.REAL
    print(f"jax {jax.__version__}, {device.platform} ({getattr(device, 'device_kind', '')}), {size}")
    print(f"\n{'plan':<26} {'way':<8} {'host/step':>10} {'step':>9}")
    figures: dict[str, Any] = {"platform": device.platform, "device_kind": str(getattr(device, "device_kind", ""))}
    for name in (p.strip() for p in args.plans.split(",") if p.strip()):
        pipe, step = against._pipeline_step(size, against.PLANS[name], device, optax.adam(1e-4), fuse="off")
        ways = {"one": step, "threads": _threaded(pipe, step)}
        for way in ways.values():
            jax.block_until_ready(way())
        hosts: dict[str, list[float]] = {way: [] for way in ways}
        loops: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, call in ways.items():
                pipe.block_until_ready()
                hosts[way].append(against._host_time(call))
                loops[way].append(against._loop(call, args.steps, done=pipe.block_until_ready))
        pipe.close()
        for way in ways:
            host, per = statistics.median(hosts[way]), statistics.median(loops[way])
            figures |= {f"{name}_{way}_host_ms": host * 1e3, f"{name}_{way}_step_ms": per * 1e3}
            print(f"{name:<26} {way:<8} {host * 1e3:8.2f}ms {per * 1e3:7.2f}ms")
        figures[f"{name}_threads_over_one_host"] = figures[f"{name}_threads_host_ms"] / figures[f"{name}_one_host_ms"]
    record("bench_dispatch_threads", figures)


if __name__ == "__main__":
    main()
