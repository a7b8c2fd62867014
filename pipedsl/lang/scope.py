"""Schedule-level names with their history, so that a snapshot costs one integer.

A ``def`` sees the schedule-level values as they stand where it is written, and a
binding may be given a new value later (``x = 1 ... x = x + 1``). Copying every binding
into every ``def`` would make a file of n one-line ``def``\\ s take time and memory
quadratic in n; instead :class:`Bindings` keeps, for each name, the list of its values
with the tick at which each was bound, and a :class:`Snapshot` is the bindings plus a
tick: a lookup finds the last value bound at or before it by bisection. Memory is
linear in the number of bindings, a snapshot is O(1) and a lookup O(log k) for a name
bound k times.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pipedsl.lang import ast
from pipedsl.lang.arith import IntCode

__all__ = ["Bindings", "Env", "Function", "Local", "Snapshot", "names_used"]

V = TypeVar("V")


class Bindings(Mapping[str, V], Generic[V]):
    """Names to their current values, remembering earlier values for snapshots.

    As a mapping it shows the current value of every name bound so far.
    """

    __slots__ = ("_ticks", "_values", "_tick")

    def __init__(self) -> None:
        self._ticks: dict[str, list[int]] = {}
        self._values: dict[str, list[V]] = {}
        self._tick = 0

    def __setitem__(self, name: str, value: V) -> None:
        self._tick += 1
        if name in self._values:
            self._ticks[name].append(self._tick)
            self._values[name].append(value)
        else:
            self._ticks[name] = [self._tick]
            self._values[name] = [value]

    def __getitem__(self, name: str) -> V:
        return self._values[name][-1]

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def snapshot(self) -> Snapshot[V]:
        """The names and values as they stand now, unaffected by later bindings."""
        return Snapshot(self, self._tick)

    def at(self, name: str, tick: int) -> V:
        """The value ``name`` had at ``tick``; KeyError if it was not bound yet."""
        ticks = self._ticks.get(name)
        if ticks is None or ticks[0] > tick:
            raise KeyError(name)
        return self._values[name][bisect.bisect_right(ticks, tick) - 1]

    def born(self, name: str) -> int | None:
        """The tick at which ``name`` was first bound, or None."""
        ticks = self._ticks.get(name)
        return None if ticks is None else ticks[0]


class Snapshot(Mapping[str, V], Generic[V]):
    """A read-only view of :class:`Bindings` as they stood at one tick."""

    __slots__ = ("_bindings", "_tick")

    def __init__(self, bindings: Bindings[V], tick: int) -> None:
        self._bindings = bindings
        self._tick = tick

    def __getitem__(self, name: str) -> V:
        return self._bindings.at(name, self._tick)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        born = self._bindings.born(name)
        return born is not None and born <= self._tick

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._bindings if name in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def names_used(node: object) -> dict[str, None]:
    """The names a piece of syntax reads or calls, in the order they first appear.

    Walks any node of :mod:`pipedsl.lang.ast` (and tuples of them) without recursion, so
    a deeply nested expression cannot exhaust Python's stack.
    """
    found: dict[str, None] = {}
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, ast.Name):
            found[current.ident] = None
        elif isinstance(current, ast.Call):
            found[current.func] = None
        if isinstance(current, tuple):
            stack.extend(reversed(current))
        elif dataclasses.is_dataclass(current) and not isinstance(current, type):
            children = [getattr(current, f.name) for f in dataclasses.fields(current) if f.name != "pos"]
            stack.extend(reversed(children))
    return found


@dataclass(frozen=True, slots=True)
class Function:
    """A ``def`` with the names it closes over, frozen where it was written."""

    node: ast.FuncDef
    consts: Mapping[str, int]
    functions: Mapping[str, Function]


@dataclass(frozen=True, slots=True)
class Local:
    """A body local: its frame slot and what it is (only ``"local"`` may be reassigned)."""

    slot: int
    role: str


@dataclass(slots=True)
class Env:
    """The names visible to the code being compiled."""

    consts: Mapping[str, int]
    functions: Mapping[str, Function]
    args: Mapping[str, IntCode] = field(default_factory=dict)
    blocks: list[dict[str, Local]] = field(default_factory=list)
    inside: str | None = None  # the function whose body this is, for recursion messages

    def local(self, name: str) -> Local | None:
        for block in reversed(self.blocks):
            if name in block:
                return block[name]
        return None

    def visible(self) -> list[str]:
        names = [*self.args, *self.consts, *self.functions]
        for block in self.blocks:
            names.extend(block)
        return names
