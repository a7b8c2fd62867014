"""How a pipeline device's worker talks to the others: the :class:`Transport` interface.

A :class:`~pipedsl.executor.runtime.worker.Worker` sees one small interface per device:
hand a value to another device under a key (a buffer of the lowered program, or the
worker's own keys for gradient sums, finiteness flags and parameter hand-outs), wait for
one from another device (always with a timeout), and tell every peer that this device
failed so that none of them waits in vain. Each backend supplies the implementation (the
local backend's mailboxes, :mod:`pipedsl.executor.local.exchange`; the Ray world's
compiled collectives, :mod:`pipedsl.executor.ray.transport`); this module also holds the
words and errors every backend's receives share.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

from pipedsl.executor.errors import ExecutionError, PeerFailed

__all__ = ["Transport", "describe_key", "never_sent", "stopped_waiting"]


class Transport(Protocol):
    """One device's end of the links between pipeline devices."""

    def send(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        """Hand ``value`` (a pytree of arrays, computed by ``stage`` or by none) to device
        ``dst`` as ``key``.

        Returns at once unless ``wait``; then only once the value has arrived (used when
        timing, so that the transfer's end can be recorded).
        """
        ...

    def recv(self, key: Hashable, src: int, *, timeout: float) -> Any:
        """Wait at most ``timeout`` seconds for ``key`` from device ``src``.

        Raises :class:`ExecutionError` on timeout and :class:`PeerFailed` as soon as any
        device has reported a failure.
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


def never_sent(me: int, key: Hashable, src: int, timeout: float) -> ExecutionError:
    """The error of a receive that waited its whole timeout."""
    return ExecutionError(
        f"device {me} waited {timeout:g} s for {describe_key(key)} from device {src}, which never sent "
        "it; raise recv_timeout if stages really take that long",
        device=me,
    )


def stopped_waiting(me: int, key: Hashable, src: int, why: str) -> PeerFailed:
    """The error of a receive ended by a failure elsewhere (``why``)."""
    return PeerFailed(f"device {me} stopped waiting for {describe_key(key)} from device {src}: {why}", device=me)
