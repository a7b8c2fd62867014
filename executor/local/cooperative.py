"""Every local pipeline device's step on one thread.

The local backend's devices are JAX devices of one process, and JAX dispatches work
asynchronously: a device's program only queues computations and copies. So one thread
can run every device's step (:meth:`pipedsl.executor.runtime.worker.Worker.steps`), switching to
another device where one has to wait (a receive whose value is not sent yet), and the
JAX devices still compute at once. Threads per device cost more: each hand-off of the
interpreter lock between them is a wake-up of the other thread, and a step's host work
is made of many short calls into JAX that each release and take the lock (a pipeline of
two CPU devices spent 1.2-1.5x the host time per action on threads, measured here).

:func:`run_together` runs the steps on a helper thread (kept between steps) and watches
it from the calling thread: a step that makes no progress for the receive timeout (a
stage program that does not return, a wait inside JAX) is reported as stalled, naming the
device and what it was doing, instead of hanging the caller. A receive whose value no
device will send is found at once (every device waits), not after a timeout.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.local.exchange import Handoff, LocalExchange
from pipedsl.executor.runtime.interpreter import Computed, Receive, Steps
from pipedsl.executor.runtime.transport import describe_key
from pipedsl.executor.runtime.waits import finished, helper

__all__ = ["Outcome", "run_together"]

# Per device, its step's result or the error it raised (None: it was stopped first).
Outcome = tuple[list[Any], list[BaseException | None]]

# How often the calling thread looks at the step's progress, in seconds.
_LOOK = 0.05


def run_together(
    steps: Sequence[Steps[Any]],
    exchange: LocalExchange,
    *,
    timeout: float,
    doing: Callable[[int], str],
    progress: Callable[[], Any],
) -> Outcome:
    """Run device d's ``steps[d]`` for every d on one helper thread (module docstring),
    kept between steps.

    ``exchange`` carries what the devices send each other; ``timeout`` (seconds) bounds
    each wait for a computation and the time the step may go without a device moving on
    (``progress()`` is what the devices are running); ``doing(d)`` says what device d is
    doing, for the error of a stall.
    The first device to fail stops the others. Raises :class:`ExecutionError` when the
    step stalls; the helper thread is then left to end on its own.
    """
    runner = _Runner(steps, exchange, timeout)
    # On a kept helper thread: starting a thread per step cost about 0.1 ms of its host time.
    inbox = helper()
    inbox.put(runner.run)
    inbox.put(None)
    try:
        seen, since = (runner.resumes, progress()), time.monotonic()
        while not runner.done.wait(_LOOK):
            now, current = time.monotonic(), (runner.resumes, progress())
            if current != seen:
                seen, since = current, now
            elif now - since > timeout and not runner.done.is_set():
                d = runner.running
                raise ExecutionError(
                    f"device {d} is stalled: still {doing(d)} after {timeout:g} s without progress (recv_timeout)",
                    device=d,
                )
    finally:
        runner.stopped = True  # the thread, once it is back from JAX, runs nothing more
    if runner.broken is not None:
        raise runner.broken
    return runner.results, runner.errors


class _Runner:
    """The helper thread's loop: resume each device whose request can be answered."""

    def __init__(self, steps: Sequence[Steps[Any]], exchange: LocalExchange, timeout: float) -> None:
        self.steps = list(steps)
        self.exchange = exchange
        self.timeout = timeout
        self.results: list[Any] = [None] * len(steps)
        self.errors: list[BaseException | None] = [None] * len(steps)
        self.running = 0
        self.resumes = 0
        self.stopped = False
        self.broken: BaseException | None = None  # what ended the loop itself, if anything
        self.done = threading.Event()  # set once the loop has ended

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # raised in the calling thread by run_together
            self.broken = err
        finally:
            self.done.set()

    def _loop(self) -> None:
        # Devices whose request is answered, with the answer; devices waiting for a value
        # (by the key it is sent under); devices waiting for computations (their own, or
        # a value's that was sent before it was computed), which wait only once no other
        # device can go on: each with the wait that gives its answer.
        ready: deque[tuple[int, Any]] = deque((d, None) for d in range(len(self.steps)))
        parked: dict[Any, tuple[int, Receive]] = {}
        finishing: deque[tuple[int, Callable[[], Any]]] = deque()
        exchange = self.exchange

        def answer_with(d: int, value: Any) -> None:
            if isinstance(value, Handoff):
                finishing.append((d, partial(value.take, self.timeout)))
            else:
                ready.append((d, value))

        while (ready or finishing) and not self.stopped:
            if ready:
                d, answer = ready.popleft()
            else:
                d, wait = finishing.popleft()
                answer = wait()
            request = self._resume(d, answer)
            if request is None:
                if self.errors[d] is not None:
                    self._stop_all(d)
                    return
            elif isinstance(request, Computed):
                finishing.append((d, partial(finished, request.value, self.timeout)))
            elif isinstance(request, Handoff):
                finishing.append((d, partial(request.take, self.timeout)))
            else:
                parked[(request.key, d)] = (d, request)
            for slot in exchange.arrivals():
                waiting = parked.pop(slot, None)
                if waiting is not None:
                    answer_with(waiting[0], exchange.poll(slot))
        if parked and not self.stopped:
            d, request = next(iter(parked.values()))
            self.errors[d] = ExecutionError(
                f"device {d} waits for {describe_key(request.key)} from device {request.src}, which never "
                "sends it: every device of the step is waiting (the devices' programs do not agree on "
                "what they exchange)",
                device=d,
            )
            self._stop_all(d)

    def _resume(self, d: int, answer: Any) -> Receive | Computed | Handoff | None:
        """Device ``d``'s next request that has to wait (a value sent but still being
        computed: its :class:`Handoff`), or None once its step has ended (or failed); a
        value sent and computed before it was asked for is taken at once."""
        self.running = d
        steps = self.steps[d]
        while not self.stopped:
            self.resumes += 1
            try:
                request = steps.send(answer)
            except StopIteration as done:
                self.results[d] = done.value
                return None
            except BaseException as err:  # reported to the caller by run_together
                self.errors[d] = err
                return None
            if not isinstance(request, Receive):
                return request
            answer = self.exchange.poll((request.key, d))
            if answer is _NOTHING:
                return request
            if isinstance(answer, Handoff):
                return answer
        return None

    def _stop_all(self, failed: int) -> None:
        """Tell every device that ``failed`` did, and end the other steps."""
        self.exchange.fail(failed)
        for d, steps in enumerate(self.steps):
            if d != failed:
                steps.close()


_NOTHING = LocalExchange.NOTHING
