"""Bounded waits for computations, on kept helper threads.

JAX's own wait for an array (``jax.block_until_ready``) has no bound. A wait that must
also notice other things (a failure elsewhere, its own deadline) runs JAX's wait on a
helper thread and waits for that thread's event in slices: :func:`finished` and
:func:`watch`. The helper threads are kept between uses (:func:`helper`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import jax

__all__ = ["finished", "watch", "helper", "Inbox"]


def finished(value: Any, timeout: float) -> bool:
    """Whether every array of ``value`` is computed (or failed) within ``timeout``
    seconds: the wait happens on a helper thread, as JAX's own wait has no bound. Arrays
    computed already need no wait (XLA's CPU client runs small programs as they are
    dispatched: a step's last gradients often are)."""
    try:
        if all(x.is_ready() for x in jax.tree_util.tree_leaves(value) if hasattr(x, "is_ready")):
            return True
    except Exception:  # noqa: S110  # a deleted array: the helper's wait reports it as failed
        pass
    return watch(value).wait(timeout)


def watch(value: Any) -> threading.Event:
    """An event set once every array of ``value`` is computed (or failed), by a helper
    thread: a waiter that must also notice other things (a failure elsewhere, its own
    deadline) waits on the event in slices instead of polling the arrays, which would
    take CPU from the computation it waits for."""
    done = threading.Event()
    inbox = helper()
    inbox.put(partial(_wait, value, done))
    inbox.put(None)
    return done


Inbox = queue.SimpleQueue[Callable[[], None] | None]
"""A lent helper thread's work: the calls it is to make, in order; None gives it back."""


def helper() -> Inbox:
    """A helper thread, lent until None is put in its inbox: it makes the calls put there
    in order, then goes back to the idle helpers. Helpers are kept between uses: a thread
    started per use cost 0.1 to 1 ms of the step (more on a loaded machine), and every
    device waits or sends several times per step (a Ray step of a tiny model took 0.5-1.3
    ms less of its 10-16 ms once each actor's sender was a kept helper). A helper whose
    call never returns is never given back; the next use gets another."""
    with _IDLE_LOCK:
        inbox = _IDLE.pop() if _IDLE else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name="pipedsl-helper", daemon=True).start()
    return inbox


_IDLE_LOCK = threading.Lock()
_IDLE: list[Inbox] = []


def _serve(inbox: Inbox) -> None:
    while True:
        while (call := inbox.get()) is not None:
            call()
            del call  # keeps no value alive while idle
        with _IDLE_LOCK:
            _IDLE.append(inbox)


def _wait(value: Any, done: threading.Event) -> None:
    try:
        jax.block_until_ready(value)
    except Exception:  # noqa: S110  # the caller's own wait reports it, blamed on its stage
        pass
    finally:
        done.set()
