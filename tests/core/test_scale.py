"""Work and memory bounded by the input: a file of many small items evaluates in space
linear in its size (a ``def`` keeps a snapshot of the names above it, not a copy)."""

from __future__ import annotations

import tracemalloc

from pipedsl.lang.evaluate import evaluate
from pipedsl.lang.parser import parse_source
from pipedsl.lang.scope import Bindings


def _many_defs(n: int) -> str:
    lines = "\n".join(f"  a{i} = {i}\n  def g{i}(x) = x + a{i}" for i in range(n))
    return (
        "schedule s() {\n" + lines + "\n  stages 1 devices 1 place s -> 0\n"
        f"  on device d {{ F(g{n - 1}(0) - a{n - 1}) B(0) }}\n}}\n"
    )


def _peak_evaluating(n: int) -> int:
    module = parse_source(_many_defs(n))
    tracemalloc.start()
    try:
        schedule = evaluate(module)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert [str(a) for a in schedule.orders[0]] == ["0F0", "0B0"]
    return peak


def test_many_defs_take_memory_linear_in_their_number() -> None:
    # 1,500 bindings and 1,500 defs: copying the names into each def, as a dict per def
    # would, holds about 1,500 * 1,500 entries (near 60 MiB); snapshots need about 1 MiB.
    peak = _peak_evaluating(1500)
    assert peak < 8 * 2**20, f"evaluating 3,000 items peaked at {peak / 2**20:.1f} MiB"


def test_a_snapshot_sees_the_values_where_it_was_taken() -> None:
    names: Bindings[int] = Bindings()
    names["x"] = 1
    first = names.snapshot()
    names["x"] = 2
    names["y"] = 3
    second = names.snapshot()
    assert (first["x"], "y" in first, list(first), len(first)) == (1, False, ["x"], 1)
    assert (second["x"], second["y"], dict(second)) == (2, 3, {"x": 2, "y": 3})
    assert (names["x"], first.get("y")) == (2, None)
