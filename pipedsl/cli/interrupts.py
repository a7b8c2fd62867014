"""Ctrl-C and TERM taken at safe points, for the commands that run JAX (``run``, ``calibrate``, ``demo``).

Python raises ``KeyboardInterrupt`` in the main thread between any two bytecodes. In a
command that runs JAX that may be while another thread is inside XLA (the local backend
runs a step on a helper thread, and the first step compiles the stage programs there) or
inside a Python callback that XLA called: the exception unwinds the main thread, and the
interpreter's exit then tears the process down under a thread that is still in XLA, which
aborts it (exit 134, ``terminate called after throwing an instance of ''``).

So within :func:`held_interrupts` a Ctrl-C is only recorded. The command takes it at its
safe points, :func:`take_interrupt`, where every result it started has been waited for
(between training steps, between measurements), as :class:`Interrupted`; the caller then
prints one line and ends the process with :func:`end_process`, without the interpreter's
teardown (a helper thread may still be on its way back out of XLA). A second Ctrl-C does
not wait for a safe point: it prints the line and ends the process at once, which is as
safe, since nothing is torn down.

A TERM (how a job scheduler stops a job) is held the same way and taken at the same safe
points, as :class:`TerminatedAtSafePoint`: a run then ends with exit code 143 and one line,
its last checkpoint whole (a save in progress is finished first, and nothing of a later one
is begun).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from pipedsl.cli.common import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated

__all__ = ["Interrupted", "TerminatedAtSafePoint", "held_interrupts", "take_interrupt", "end_process"]


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C taken at a safe point (:func:`take_interrupt`)."""


class TerminatedAtSafePoint(Terminated):
    """A TERM taken at a safe point (:func:`take_interrupt`)."""


class _Hold:
    """The signals (SIGINT, SIGTERM) recorded while a :func:`held_interrupts` block runs:
    the first one is taken at a safe point; a second one ends the process at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.first: int | None = None

    def record(self, signum: int, frame: Any) -> None:
        if self.first is None:
            self.first = signum
            return
        # Unbuffered: the main thread may be inside a write to sys.stderr right now.
        stopped, code = _WAYS[signum]
        os.write(sys.stderr.fileno(), f"{self.name}: {stopped}\n".encode())
        end_process(code)


_WAYS: dict[int, tuple[str, int]] = {
    signal.SIGINT: ("interrupted", EXIT_INTERRUPTED),
    signal.SIGTERM: ("terminated", EXIT_TERMINATED),
}
"""What a command stopped by each signal says, and its exit code."""


_holds: list[_Hold] = []


@contextmanager
def held_interrupts(*, name: str) -> Iterator[None]:
    """Within the block, a Ctrl-C or a TERM is recorded and taken at the next
    :func:`take_interrupt`; a second one prints ``NAME: interrupted`` (or ``terminated``)
    and ends the process with exit code 130 (143) at once. Only in the main thread, and
    for each signal only while it has Python's default handler (a process that ignores
    SIGINT, as a shell's background job does, keeps ignoring it)."""
    defaults: dict[int, Callable[[int, Any], Any] | int] = {
        signal.SIGINT: signal.default_int_handler,
        signal.SIGTERM: signal.SIG_DFL,
    }
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = [signum for signum, default in defaults.items() if signal.getsignal(signum) is default]
    hold = _Hold(name)
    _holds.append(hold)
    for signum in held:
        signal.signal(signum, hold.record)
    try:
        yield
    finally:
        for signum in held:
            signal.signal(signum, defaults[signum])
        _holds.remove(hold)


def take_interrupt() -> None:
    """A safe point: raise :class:`Interrupted` if Ctrl-C was pressed since the innermost
    :func:`held_interrupts` block began, :class:`TerminatedAtSafePoint` if a TERM came
    (outside one, nothing)."""
    if _holds and _holds[-1].first is not None:
        if _holds[-1].first == signal.SIGTERM:
            raise TerminatedAtSafePoint
        raise Interrupted


def end_process(code: int) -> NoReturn:
    """Flush what was printed and end the process with ``code`` at once, without the
    interpreter's teardown, which would run while helper threads may still be in XLA."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            # A reader that went away, or a stream already closed: nothing more to write.
            continue
    os._exit(code)
