"""How a pipeline device's worker talks to the others: the :class:`Transport` interface.

A :class:`~pipedsl.executor.runtime.worker.Worker` sees one small interface per device:
hand a value to another device under a key (a buffer of the lowered program, or the
worker's own keys for gradient sums, finiteness flags and parameter hand-outs), and tell
every peer that this device failed so that none of them waits in vain. A device asks for a
value by yielding a :class:`~pipedsl.executor.runtime.scheduler.Receive`, which the
scheduler answers from the backend's :class:`~pipedsl.executor.runtime.scheduler.Mail`.
Each backend supplies both (the local backend's mailboxes,
:mod:`pipedsl.executor.local.exchange`; the Ray world's compiled collectives,
:mod:`pipedsl.executor.ray.transport`); this module also holds the words every backend's
receives share.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

__all__ = ["Transport", "describe_key"]


class Transport(Protocol):
    """One device's end of the links between pipeline devices."""

    def send(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        """Hand ``value`` (a pytree of arrays, computed by ``stage`` or by none) to device
        ``dst`` as ``key``.

        Returns at once unless ``wait``; then only once the value has arrived (used when
        timing, so that the transfer's end can be recorded).
        """
        ...

    def abort(self, error: BaseException) -> None:
        """Report that this device failed with ``error``; wakes every waiting peer."""
        ...


def describe_key(key: Hashable) -> str:
    """A transport key in words: a program buffer as the lowered program writes it, the
    worker's own keys for what they carry."""
    if isinstance(key, tuple) and key and key[0] == "grad":
        return f"the gradient of leaf {key[2]} from stage {key[1]}"
    if isinstance(key, tuple) and key and key[0] == "param":
        return f"the updated leaf {key[2]}"
    if isinstance(key, tuple) and key and key[0] == "done":
        return "the end of its program"
    if isinstance(key, tuple) and key and key[0] == "finite":
        return "whether its gradients and loss are finite"
    return str(key)
