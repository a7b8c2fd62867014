"""Waiting on other processes in tests, on events rather than the clock: the lines a
process prints as they come, and the end of processes this one did not start.

A deadline here only guards against a hang; nothing waits for time to pass.
"""

from __future__ import annotations

import os
import queue
import select
import threading
import time
from pathlib import Path
from typing import IO

__all__ = ["Lines", "alive", "wait_gone"]


class Lines:
    """The lines of ``stream`` (a text pipe from another process), read on a thread of
    their own as they come, until its end."""

    def __init__(self, stream: IO[str]) -> None:
        self.read: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._follow, args=(stream,), daemon=True)
        self._thread.start()

    def _follow(self, stream: IO[str]) -> None:
        for line in stream:
            self.read.append(line)
            self._new.put(line)
        self._new.put(None)

    def starting(self, prefix: str, count: int, *, timeout_s: float = 60.0) -> list[str]:
        """The first ``count`` lines that start with ``prefix``, as soon as they are in;
        fewer when the stream ends first or ``timeout_s`` (a guard against a hang) passes."""
        found: list[str] = []
        deadline = time.monotonic() + timeout_s
        while len(found) < count:
            try:
                line = self._new.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith(prefix):
                found.append(line)
        return found

    def text(self) -> str:
        """Everything the stream held, once it has ended (its process has exited)."""
        self._thread.join()
        return "".join(self.read)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, exited but not yet
    reaped by its parent, is not alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], *, timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` (processes that need not be this one's children) is
    alive, or ``timeout_s`` has passed; the ones still alive. A pidfd (Linux) becomes
    readable the moment its process exits, so this wakes on the exits themselves."""
    deadline = time.monotonic() + timeout_s
    fds = {}
    try:
        for pid in pids:
            try:
                fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                continue
        while fds:
            ready, _, _ = select.select(list(fds), [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                break
            for fd in ready:
                del fds[fd]
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return [pid for pid in pids if alive(pid)]
