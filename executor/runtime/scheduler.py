"""The one scheduler of the devices' steps.

A device's step (:meth:`pipedsl.executor.runtime.worker.Worker.steps`) is a generator that
dispatches its programs and yields what it has to wait for: a :class:`Receive` of a value
another device sends, or a :class:`Computed` wait (a recorded step times every action).
This module runs such generators, every backend the same way: :func:`run_steps` resumes
each device whose request can be answered and parks the others, on one thread, so the
host dispatches the devices' programs in wavefront order (each device as far as it can go,
then the next one a value was sent to). Where the step code may wait, and for what, is
stated once here:

- a receive waits only until the value is *sent* (handed to the :class:`Mail`), never until
  it is computed: a sent value is a device array its receiver's programs queue behind
  (on CPU devices a value sent before it is computed may be a :class:`Pending` hand-over
  through host memory, which is waited for only once no other device can go on);
- a :class:`Computed` wait (recording) is made only once no other device can go on;
- nothing else waits: programs, copies and the optimizer update are dispatched and the
  step returns while the devices compute.

A thread per device, each blocking on its own receives, is the alternative a host serving
several chips might take; ``bench/bench_dispatch_threads.py`` measures it against this one
thread on the same workers and programs (its results are in ``bench/results/``).

The mail decides what a receive means: between the local backend's devices, a mailbox
(:mod:`pipedsl.executor.local.exchange`); inside a step traced into one program, the values
as they were handed over; on a Ray process, a compiled collective with the sender, which
the transport dispatches when asked (:mod:`pipedsl.executor.ray.transport`).
"""

from __future__ import annotations

import abc
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.runtime.transport import describe_key
from pipedsl.executor.runtime.waits import finished, helper

__all__ = ["Receive", "Computed", "Steps", "Mail", "Pending", "NOTHING", "Outcome", "run_steps", "run_watched"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Receive:
    """A device's request for ``key`` from device ``src``, answered with the value."""

    key: Hashable
    src: int


@dataclass(frozen=True, slots=True)
class Computed:
    """A device's request to wait until every array of ``value`` is computed (or has
    failed), answered with whether it was within the receive timeout."""

    value: Any


# A device's step as it runs: it yields what it waits for and returns its result.
Steps = Generator[Receive | Computed, Any, T]

NOTHING: Any = object()
"""What :meth:`Mail.take` returns for a value not sent yet."""


class Pending(abc.ABC):
    """A value sent before it was computed that its receiver takes through host memory
    (CPU devices): taken once computed, or after ``timeout`` seconds as a device copy."""

    __slots__ = ()

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether every array of the value is computed (or has failed)."""

    @abc.abstractmethod
    def take(self, timeout: float) -> Any:
        """The value for the receiver, waiting at most ``timeout`` seconds for it."""


class Mail(Protocol):
    """How a device's receives are answered (see the module docstring)."""

    def take(self, request: Receive, device: int) -> Any:
        """The value ``device`` asks for, taken (a :class:`Pending` one as it is), or
        :data:`NOTHING` if it is not sent yet; raises where the wait itself failed."""
        ...

    def arrivals(self) -> list[tuple[Hashable, int]]:
        """The (key, receiver) slots sent since the last call."""
        ...

    def fail(self, device: int) -> None:
        """Report that ``device`` failed: every other device stops waiting for it."""
        ...


# Per device, its step's result or the error it raised (None: it was stopped first).
Outcome = tuple[list[Any], list[BaseException | None]]


def run_steps(steps: Sequence[Steps[Any]], mail: Mail, *, timeout: float) -> Outcome:
    """Device ``d``'s ``steps[d]`` for every ``d``, run on the calling thread (module
    docstring); ``timeout`` (seconds) bounds each wait for a computation. The first device
    to fail stops the others."""
    run = _Run(steps, mail, timeout)
    run.run()
    if run.broken is not None:
        raise run.broken
    return run.results, run.errors


def run_watched(
    steps: Sequence[Steps[Any]],
    mail: Mail,
    *,
    timeout: float,
    doing: Callable[[int], str],
    progress: Callable[[], Any],
) -> Outcome:
    """:func:`run_steps` on a kept helper thread, watched from the calling thread: a step
    that makes no progress for ``timeout`` seconds (a stage program that does not return, a
    wait inside JAX) is reported as stalled, naming the device and what it was doing
    (``doing(d)``; ``progress()`` is what the devices are running), instead of hanging the
    caller; the helper thread is then left to end on its own."""
    run = _Run(steps, mail, timeout)
    inbox = helper()
    inbox.put(run.run)
    inbox.put(None)
    try:
        seen, since = (run.resumes, progress()), time.monotonic()
        while not run.done.wait(_LOOK):
            now, current = time.monotonic(), (run.resumes, progress())
            if current != seen:
                seen, since = current, now
            elif now - since > timeout and not run.done.is_set():
                d = run.running
                raise ExecutionError(
                    f"device {d} is stalled: still {doing(d)} after {timeout:g} s without progress (recv_timeout)",
                    device=d,
                )
    finally:
        run.stopped = True  # the thread, once it is back from JAX, runs nothing more
    if run.broken is not None:
        raise run.broken
    return run.results, run.errors


# How often the watching thread looks at the step's progress, in seconds.
_LOOK = 0.05


class _Run:
    """One run of the devices' steps (see :func:`run_steps`)."""

    def __init__(self, steps: Sequence[Steps[Any]], mail: Mail, timeout: float) -> None:
        self.steps = list(steps)
        self.mail = mail
        self.timeout = timeout
        self.results: list[Any] = [None] * len(steps)
        self.errors: list[BaseException | None] = [None] * len(steps)
        self.running = 0
        self.resumes = 0
        self.stopped = False
        self.broken: BaseException | None = None  # what ended the loop itself, if anything
        self.done = threading.Event()  # set once the loop has ended

    def run(self) -> None:
        """Run every device's step to its end (or the first failure)."""
        try:
            self._loop()
        except BaseException as err:  # raised to the caller
            self.broken = err
        finally:
            self.done.set()

    def _loop(self) -> None:
        # Devices whose request is answered, with the answer; devices waiting for a value
        # (by the slot it is sent to); devices waiting for computations (their own, or a
        # value's sent before it was computed), which wait only once no other device can
        # go on: each with the wait that gives its answer.
        ready: deque[tuple[int, Any]] = deque((d, None) for d in range(len(self.steps)))
        parked: dict[tuple[Hashable, int], tuple[int, Receive]] = {}
        finishing: deque[tuple[int, Callable[[], Any]]] = deque()
        mail = self.mail
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
            elif isinstance(request, Receive):
                parked[(request.key, d)] = (d, request)
            else:
                finishing.append((d, partial(request.take, self.timeout)))
            for slot in mail.arrivals():
                waiting = parked.pop(slot, None)
                if waiting is None:
                    continue
                value = mail.take(waiting[1], waiting[0])
                if isinstance(value, Pending):
                    finishing.append((waiting[0], partial(value.take, self.timeout)))
                else:
                    ready.append((waiting[0], value))
        if parked and not self.stopped:
            d, request = next(iter(parked.values()))
            self.errors[d] = ExecutionError(
                f"device {d} waits for {describe_key(request.key)} from device {request.src}, which never "
                "sends it: every device of the step is waiting (the devices' programs do not agree on "
                "what they exchange)",
                device=d,
            )
            self._stop_all(d)

    def _resume(self, d: int, answer: Any) -> Receive | Computed | Pending | None:
        """Device ``d``'s next request that has to wait (a receive not sent yet, a
        :class:`Pending` value, a :class:`Computed` wait), or None once its step has ended
        (or failed); a value already sent is taken at once."""
        self.running = d
        steps = self.steps[d]
        throw: BaseException | None = None
        while not self.stopped:
            self.resumes += 1
            try:
                request = steps.send(answer) if throw is None else steps.throw(throw)
            except StopIteration as done:
                self.results[d] = done.value
                return None
            except BaseException as err:  # reported to the caller
                self.errors[d] = err
                return None
            if not isinstance(request, Receive):
                return request
            throw = None
            try:
                answer = self.mail.take(request, d)
            except BaseException as err:  # a failed wait is raised inside the step, which tells its peers
                throw = err
                continue
            if answer is NOTHING:
                return request
            if isinstance(answer, Pending):
                return answer
        return None

    def _stop_all(self, failed: int) -> None:
        """Tell every device that ``failed`` did, and end the other steps."""
        self.mail.fail(failed)
        for d, steps in enumerate(self.steps):
            if d != failed:
                steps.close()
