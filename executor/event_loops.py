"""Event loops that close only once their tasks are done, for orbax's checkpoint reads and writes.

Orbax runs each read or write of a checkpoint on a fresh asyncio loop and closes the loop
as soon as its coroutine ends. When one array of several fails (a damaged file), the
coroutine ends at that failure while tensorstore is still reading or writing the others;
each of those, on finishing, hands its result to the closed loop, and tensorstore prints
that loop's ``RuntimeError: Event loop is closed`` with a traceback, a dozen of them
around (and sometimes inside) the one line that says what is wrong.

Within :func:`draining`, the loops the calling thread creates run their unfinished tasks
to the end, keeping their results and errors, before they close. Other threads, and the
same thread outside the block, get their loops as before: the policy this module installs
hands every other request to the one it replaced.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["draining"]

_scope = threading.local()
_install_lock = threading.Lock()


class _DrainingLoop(asyncio.SelectorEventLoop):
    """A loop whose ``close`` first runs its unfinished tasks to the end."""

    def close(self) -> None:
        pending = [task for task in asyncio.all_tasks(self) if not task.done()]
        if pending and not self.is_running() and not self.is_closed():
            # Errors kept in the gathered results: the failure that ended the coroutine is reported already.
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


class _Policy(asyncio.AbstractEventLoopPolicy):
    """The policy it replaced, except that a thread within :func:`draining` gets draining loops."""

    def __init__(self, previous: asyncio.AbstractEventLoopPolicy) -> None:
        self._previous = previous

    def get_event_loop(self) -> asyncio.AbstractEventLoop:
        return self._previous.get_event_loop()

    def set_event_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._previous.set_event_loop(loop)

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        if getattr(_scope, "depth", 0):
            return _DrainingLoop()
        return self._previous.new_event_loop()

    def get_child_watcher(self) -> Any:
        # Asyncio's subprocesses ask the policy for it before Python 3.12.
        return self._previous.get_child_watcher()

    def set_child_watcher(self, watcher: Any) -> None:
        self._previous.set_child_watcher(watcher)


def _install() -> None:
    with _install_lock:
        current = asyncio.get_event_loop_policy()
        if not isinstance(current, _Policy):
            asyncio.set_event_loop_policy(_Policy(current))


@contextmanager
def draining() -> Iterator[None]:
    """Within the block, the event loops this thread creates close only once their tasks are done."""
    _install()
    _scope.depth = getattr(_scope, "depth", 0) + 1
    try:
        yield
    finally:
        _scope.depth -= 1
