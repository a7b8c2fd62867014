"""Moving buffers between pipeline devices.

The interpreter (:mod:`pipedsl.executor.interpreter`) sees one small interface per
device, :class:`Transport`: hand a buffer's value to another device, wait for one from
another device (always with a timeout), and tell every peer that this device failed so
that none of them waits in vain. A backend supplies the implementation; this module
holds the one for the local backend, where every pipeline device is a JAX device of the
same process and a transfer is a ``jax.device_put``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import jax

from pipedsl.executor.errors import ExecutionError, PeerFailed
from pipedsl.program import Buffer

__all__ = ["Transport", "LocalExchange", "LocalTransport"]


class Transport(Protocol):
    """One device's end of the links between pipeline devices."""

    def send(self, buffer: Buffer, value: Any, dst: int, *, wait: bool = False) -> None:
        """Hand ``value`` (a tuple of arrays) to device ``dst`` as ``buffer``.

        Returns at once unless ``wait``; then only once the value has arrived (used when
        timing, so that the transfer's end can be recorded).
        """
        ...

    def recv(self, buffer: Buffer, src: int, *, timeout: float) -> Any:
        """Wait at most ``timeout`` seconds for ``buffer`` from device ``src``.

        Raises :class:`ExecutionError` on timeout and :class:`PeerFailed` as soon as any
        device has reported a failure.
        """
        ...

    def abort(self, error: BaseException) -> None:
        """Report that this device failed with ``error``; wakes every waiting peer."""
        ...


class LocalExchange:
    """The mailboxes shared by the local devices for one step.

    ``devices[d]`` is the JAX device that pipeline device ``d`` runs on. A value sent
    to ``d`` is put on ``devices[d]`` (asynchronously: ``device_put`` returns before the
    copy is done, and a computation that reads it waits for it).
    """

    def __init__(self, devices: Sequence[jax.Device]) -> None:
        self.devices = tuple(devices)
        self._lock = threading.Condition()
        self._mail: dict[tuple[Buffer, int], Any] = {}
        self._failed: int | None = None  # the first device that reported a failure

    def endpoint(self, device: int) -> LocalTransport:
        """Device ``device``'s :class:`Transport`."""
        return LocalTransport(self, device)

    def _put(self, key: tuple[Buffer, int], value: Any) -> None:
        with self._lock:
            self._mail[key] = value
            self._lock.notify_all()

    def _take(self, key: tuple[Buffer, int], me: int, src: int, timeout: float) -> Any:
        with self._lock:
            arrived = self._lock.wait_for(lambda: key in self._mail or self._failed is not None, timeout=timeout)
            if key in self._mail:
                return self._mail.pop(key)
            buffer = key[0]
            if not arrived:
                raise ExecutionError(
                    f"device {me} waited {timeout:g} s for {buffer} from device {src}, which never "
                    "sent it; raise recv_timeout if stages really take that long",
                    device=me,
                )
            raise PeerFailed(
                f"device {me} stopped waiting for {buffer} from device {src}: device {self._failed} failed",
                device=me,
            )

    def _abort(self, device: int) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = device
            self._lock.notify_all()


class LocalTransport:
    """Device ``device``'s end of a :class:`LocalExchange` (implements :class:`Transport`)."""

    __slots__ = ("_exchange", "_device")

    def __init__(self, exchange: LocalExchange, device: int) -> None:
        self._exchange = exchange
        self._device = device

    def send(self, buffer: Buffer, value: Any, dst: int, *, wait: bool = False) -> None:
        moved = jax.device_put(value, self._exchange.devices[dst])
        if wait:
            jax.block_until_ready(moved)
        self._exchange._put((buffer, dst), moved)

    def recv(self, buffer: Buffer, src: int, *, timeout: float) -> Any:
        return self._exchange._take((buffer, self._device), self._device, src, timeout)

    def abort(self, error: BaseException) -> None:
        # The error itself reaches the caller through the failing device's thread.
        self._exchange._abort(self._device)
