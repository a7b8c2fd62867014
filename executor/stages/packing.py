"""Values that cross a stage program's boundary in a few buffers instead of one each.

A stage's forward keeps tens of residuals for its backward (a transformer layer keeps
about forty: each projection's input, the attention probabilities, the norms' statistics),
and the ``I`` half of a split backward hands about as many to ``W``. Every one is a buffer
the host handles twice, as a result of one program and an argument of the next: a TPU v5e
host pays about 120 us per dispatch plus 5-7 us per buffer, so a stage action passing a
hundred buffers spends most of its host time on them rather than on the dispatch.

Packed, the values travel as one buffer per dtype and last axis: the producing program
writes each value, reshaped to ``[rows, last]``, into consecutive rows of its group's
buffer (a concatenation), and the consuming program reads it back as a slice of rows.
Grouping by the last axis keeps the reshapes free on accelerators, whose layouts tile the
two minor axes: merging the leading axes into rows moves no data, where flattening
everything to one axis would re-lay out every value twice. The cost is one copy of the
packed bytes in the producer, against the host time of every buffer saved. Large values
(attention probabilities, an MLP's activations) are packed too: on the TPU v5e, leaving
values over 1 MiB their own buffers made the check model's zb_h1 and interleaved 1F1B
steps 15-33% slower and its 1f1b and gpipe steps 2-4% faster
(``bench/results/bench_against_jit.jsonl``, dispatch ``"off"``). On CPU devices the copy
runs on the cores that compute, and values travel apart unless asked
(``RunOptions.pack_residuals``).

Values whose dtype is not an array of numbers (PRNG keys) and values alone in their group
pass through as they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["Packing"]


@dataclass(frozen=True, slots=True)
class Packing:
    """How values of fixed shapes and dtypes travel as a few buffers.

    Attributes:
      shapes: each value's shape, in the order the values come.
      groups: per buffer, the positions of the values it holds, in order; a group of one
        value is that value itself, unreshaped.
    """

    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(avals: Sequence[Any]) -> Packing:
        """The packing of values shaped as ``avals`` (anything with ``shape`` and ``dtype``):
        one buffer per dtype and last axis, in the order each group is first met."""
        groups: dict[Any, list[int]] = {}
        for i, aval in enumerate(avals):
            dtype, shape = aval.dtype, tuple(aval.shape)
            key: Any = ("alone", i)
            if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
                key = (jnp.dtype(dtype), shape[-1] if shape else 1)
            groups.setdefault(key, []).append(i)
        return Packing(
            shapes=tuple(tuple(a.shape) for a in avals),
            groups=tuple(tuple(positions) for positions in groups.values()),
        )

    def __len__(self) -> int:
        """How many buffers the values travel as."""
        return len(self.groups)

    def pack(self, values: Sequence[Any]) -> tuple[Any, ...]:
        """The buffers holding ``values`` (inside a traced program; one per group)."""
        if len(values) != len(self.shapes):
            raise ValueError(f"{len(values)} values given to a packing of {len(self.shapes)}")
        return tuple(
            values[group[0]] if len(group) == 1 else jnp.concatenate([self._rows(values[i], i) for i in group])
            for group in self.groups
        )

    def unpack(self, buffers: Sequence[Any]) -> tuple[Any, ...]:
        """The values ``pack`` put in ``buffers``, in their order and shapes."""
        if len(buffers) != len(self.groups):
            raise ValueError(f"{len(buffers)} buffers given to a packing into {len(self.groups)}")
        values: list[Any] = [None] * len(self.shapes)
        for buffer, group in zip(buffers, self.groups, strict=True):
            if len(group) == 1:
                values[group[0]] = buffer
                continue
            start = 0
            for i in group:
                rows = self._num_rows(i)
                values[i] = jax.lax.slice_in_dim(buffer, start, start + rows).reshape(self.shapes[i])
                start += rows
        return tuple(values)

    def _num_rows(self, i: int) -> int:
        shape = self.shapes[i]
        return math.prod(shape[:-1]) if shape else 1

    def _rows(self, value: Any, i: int) -> Any:
        """Value ``i`` as ``[rows, last]``: its leading axes merged."""
        shape = self.shapes[i]
        return value.reshape(self._num_rows(i), shape[-1] if shape else 1)
