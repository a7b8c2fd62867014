"""Ctrl-C taken at safe points, for the commands that run JAX (``run``, ``calibrate``, ``demo``).

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
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

__all__ = ["Interrupted", "held_interrupts", "take_interrupt", "end_process"]


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C taken at a safe point (:func:`take_interrupt`)."""


class _Hold:
    """The Ctrl-Cs recorded while a :func:`held_interrupts` block runs."""

    def __init__(self, line: str, code: int) -> None:
        self.line = line
        self.code = code
        self.pressed = 0

    def record(self, signum: int, frame: Any) -> None:
        self.pressed += 1
        if self.pressed > 1:
            # Unbuffered: the main thread may be inside a write to sys.stderr right now.
            os.write(sys.stderr.fileno(), f"{self.line}\n".encode())
            end_process(self.code)


_holds: list[_Hold] = []


@contextmanager
def held_interrupts(*, line: str, code: int) -> Iterator[None]:
    """Within the block, a Ctrl-C is recorded and taken at the next :func:`take_interrupt`;
    a second one prints ``line`` and ends the process with exit code ``code`` at once.
    Only in the main thread, and only while SIGINT has Python's default handler (a
    process that ignores SIGINT, as a shell's background job does, keeps ignoring it)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    hold = _Hold(line, code)
    _holds.append(hold)
    signal.signal(signal.SIGINT, hold.record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _holds.remove(hold)


def take_interrupt() -> None:
    """A safe point: raise :class:`Interrupted` if Ctrl-C was pressed since the innermost
    :func:`held_interrupts` block began (outside one, nothing)."""
    if _holds and _holds[-1].pressed:
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
