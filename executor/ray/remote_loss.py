"""A training step's loss on the Ray backend: kept by the process that computed it, fetched when read.

A Ray training step returns once every process of the world has dispatched its share of
the step; the loss stays on the last stage's devices, under the step's number
(:meth:`pipedsl.executor.ray.actor.WorldProcess.loss`). :class:`RemoteLoss` stands for it on
the driver, as a scalar array does: ``float(loss)``, ``np.asarray(loss)``, ``loss.item()``
and ``jax.block_until_ready(loss)`` fetch it (once; a process answers its calls in the order
they were made, so the read waits for that step, not for later ones), ``loss.is_ready()``
asks without waiting. A computation of the step that failed is raised where the loss is
read, named by stage. A loss dropped unread is forgotten by its process with the next step;
one still held when its pipeline closes is fetched then (:meth:`RemoteLoss.settle`), so
that it can be read after.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import numpy as np

__all__ = ["LossSource", "RemoteLoss"]


class LossSource(Protocol):
    """Where kept losses are read: the Ray backend's driver side."""

    def fetch_loss(self, step: int) -> np.ndarray:
        """Step ``step``'s loss, waited for, as a numpy scalar (raises its step's error)."""
        ...

    def loss_ready(self, step: int) -> bool:
        """Whether step ``step``'s loss is computed; waits for nothing."""
        ...

    def forget_loss(self, step: int) -> None:
        """Nobody will read step ``step``'s loss."""
        ...


class RemoteLoss:
    """Step ``step``'s mean loss over microbatches, kept where it was computed (module docstring)."""

    __slots__ = ("_source", "step", "_value", "_error", "__weakref__")

    shape: tuple[int, ...] = ()
    ndim = 0

    def __init__(self, source: LossSource, step: int) -> None:
        self._source = source
        self.step = step
        self._value: np.ndarray | None = None
        self._error: BaseException | None = None
        weakref.finalize(self, _forget, weakref.ref(source), step)

    def value(self) -> np.ndarray:
        """The loss as a numpy scalar, fetched once (waiting for its step)."""
        if self._error is not None:
            raise self._error
        if self._value is None:
            self._value = self._source.fetch_loss(self.step)
        return self._value

    def settle(self) -> None:
        """Fetch the value now (its source is about to close), keeping a failure to raise
        where the loss is read."""
        try:
            self.value()
        except Exception as err:  # the step's own error, raised when the loss is read
            self._error = err

    @property
    def fetched(self) -> bool:
        """Whether the value has been copied to this process."""
        return self._value is not None

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.value().dtype

    def is_ready(self) -> bool:
        """Whether the loss is computed (fetched or not); waits for nothing."""
        return self._value is not None or self._error is not None or self._source.loss_ready(self.step)

    def block_until_ready(self) -> RemoteLoss:
        """Wait until the loss is computed, fetching it (as ``jax.block_until_ready`` does)."""
        self.value()
        return self

    def item(self) -> float:
        return float(self.value())

    def __float__(self) -> float:
        return float(self.value())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        value = self.value()
        return value if dtype is None else value.astype(dtype)

    def __repr__(self) -> str:
        if self._value is None:
            return f"RemoteLoss(step={self.step}, not fetched)"
        return f"RemoteLoss(step={self.step}, {float(self._value)!r})"


def _forget(source: weakref.ref[LossSource], step: int) -> None:
    # The source may be gone first (a closed pipeline): then so are its kept losses.
    alive = source()
    if alive is not None:
        alive.forget_loss(step)
