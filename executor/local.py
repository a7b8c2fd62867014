"""The local backend: every pipeline device is a JAX device of this process.

Pipeline device d runs on ``devices[d]``: the first N devices JAX reports (CPU devices
come from ``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set before JAX is
imported; GPUs are found as they are) or a list given explicitly. An explicit list may
name one JAX device several times: the pipeline then runs correctly but its devices
share that device's compute.

Each pipeline device runs its own program in its own thread. JAX dispatches work
asynchronously and releases the interpreter lock while it waits, so the threads only
queue work and the JAX devices execute it concurrently; a thread blocks only on a
``Recv`` whose value has not been sent yet (with a timeout) or, when the step is being
recorded, on each action's result. A failure on one device wakes every other device
at once, and the step raises the original error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from pipedsl.executor.backend import BackendStep
from pipedsl.executor.devices import xla_device_flag
from pipedsl.executor.errors import ExecutionError, PeerFailed
from pipedsl.executor.interpreter import DeviceRuntime, DeviceStep
from pipedsl.executor.stages import StageProgram
from pipedsl.executor.timing import Recorder, measured_timeline
from pipedsl.executor.transport import LocalExchange
from pipedsl.program import Program

__all__ = ["LocalBackend"]

Leaves = tuple[Any, ...]


class LocalBackend:
    """Runs a lowered :class:`Program` with one thread per pipeline device.

    ``recv_timeout`` bounds every wait for another device, in seconds.
    """

    def __init__(
        self,
        program: Program,
        *,
        devices: Sequence[jax.Device] | None = None,
        recv_timeout: float = 300.0,
    ) -> None:
        needed = program.schedule.num_devices
        if devices is None:
            available = jax.devices()
            if len(available) < needed:
                platform = available[0].platform
                raise ExecutionError(
                    f"schedule {program.schedule.name!r} needs {needed} devices but JAX has "
                    f"{len(available)} {platform} device(s); on CPU set "
                    f"XLA_FLAGS={xla_device_flag(needed)} before jax is imported (the "
                    "`pipedsl run` command does this itself), or pass devices=[...] to map "
                    "several pipeline devices onto one JAX device"
                )
            devices = available[:needed]
        elif len(devices) != needed:
            raise ExecutionError(
                f"schedule {program.schedule.name!r} has {needed} devices; {len(devices)} JAX devices were given"
            )
        self.program = program
        self.devices = tuple(devices)
        self.recv_timeout = recv_timeout

    def place(self, value: Any, device: int) -> Any:
        return jax.device_put(value, self.devices[device])

    def call(self, device: int, fn: Callable[..., Any], *args: Any) -> Any:
        # The arguments are already on the device, and jitted functions run where their
        # arguments are.
        return fn(*args)

    def run_step(
        self,
        stages: Mapping[int, StageProgram],
        params: Mapping[int, Leaves],
        inputs: Sequence[Leaves],
        targets: Sequence[Leaves],
        *,
        record: bool,
    ) -> BackendStep:
        schedule = self.program.schedule
        first, last = schedule.placement[0], schedule.placement[-1]
        runtimes = [
            DeviceRuntime(prog, stages, device=self.devices[d], recv_timeout=self.recv_timeout)
            for d, prog in enumerate(self.program.devices)
        ]
        exchange = LocalExchange(self.devices)
        origin = time.perf_counter()
        results: list[DeviceStep | None] = [None] * len(runtimes)
        errors: list[BaseException | None] = [None] * len(runtimes)

        def work(d: int) -> None:
            try:
                results[d] = runtimes[d].run_step(
                    exchange.endpoint(d),
                    {s: params[s] for s in runtimes[d].program.stages},
                    inputs if d == first else (),
                    targets if d == last else (),
                    recorder=Recorder(d, origin) if record else None,
                )
            except BaseException as err:  # reported to the caller below
                errors[d] = err

        threads = [
            threading.Thread(target=work, args=(d,), name=f"pipedsl-device-{d}", daemon=True)
            for d in range(len(runtimes))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        failed = [err for err in errors if err is not None]
        if failed:
            # Devices that gave up because of another's failure only echo it.
            raise next((err for err in failed if not isinstance(err, PeerFailed)), failed[0])
        done = tuple(r for r in results if r is not None)
        timeline = None
        if record:
            events = [r.events for r in done]
            timeline = measured_timeline(events, name=schedule.name, num_devices=schedule.num_devices)
        return BackendStep(devices=done, timeline=timeline)
