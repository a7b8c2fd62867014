"""Saved timelines are read back exactly, and any other input fails with our error.

Each malformed field gives a :class:`ConversionError` naming it; a file declaring a
billion devices is refused before anything is allocated for them. The fuzz tests mutate
a saved timeline (its bytes, and its decoded fields) with a fixed seed and feed the
results to :meth:`Timeline.load`: every outcome is a Timeline or a ConversionError,
never another exception, and the memory used stays proportional to the input's size.
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipedsl.errors import ConversionError
from pipedsl.timeline import Event, EventKind, Timeline

SEED = 20261201
BYTE_MUTANTS = 1500
FIELD_MUTANTS = 1500


def _timeline() -> Timeline:
    """Two devices, two microbatches of 1F1B with the transfers between them."""
    events = []
    for mb in range(2):
        events.append(Event(0, EventKind.F, 0, mb, 2.0 * mb, 2.0 * mb + 1.0))
        events.append(Event(0, EventKind.SEND, 0, mb, 2.0 * mb + 1.0, 2.0 * mb + 1.2, peer=1, buffer="act"))
        events.append(Event(1, EventKind.F, 1, mb, 2.0 * mb + 1.2, 2.0 * mb + 2.2))
        events.append(Event(1, EventKind.B, 1, mb, 2.0 * mb + 2.2, 2.0 * mb + 3.0))
        events.append(Event(1, EventKind.SEND, 1, mb, 2.0 * mb + 3.0, 2.0 * mb + 3.1, peer=0, buffer="grad"))
        events.append(Event(0, EventKind.I, 0, mb, 2.0 * mb + 3.1, 2.0 * mb + 3.5))
        events.append(Event(0, EventKind.W, 0, mb, 2.0 * mb + 3.5, 2.0 * mb + 3.9))
    return Timeline.from_events(events, name="1f1b", num_devices=2, origin="simulated")


def test_a_saved_timeline_reads_back_exactly(tmp_path: Path) -> None:
    timeline = _timeline()
    timeline.save(tmp_path / "t.json")
    again = Timeline.load(tmp_path / "t.json")
    assert list(again.events()) == list(timeline.events())
    assert (again.name, again.num_devices, again.origin) == ("1f1b", 2, "simulated")
    empty = Timeline.from_events([], name="none", num_devices=3, origin="measured")
    assert len(Timeline.from_json(empty.to_json())) == 0


def _edited(edit: Any) -> dict[str, Any]:
    data = _timeline().to_json()
    edit(data)
    return data


def _set(column: str, row: int, value: Any) -> Any:
    return lambda d: d["columns"][column].__setitem__(row, value)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (
            lambda d: d.update(num_devices=1_000_000_000),
            "num_devices: 1000000000; expected a whole number from 1 to 66",
        ),
        (lambda d: d.update(num_devices=0), "num_devices: 0"),
        (lambda d: d.update(num_devices=-3), "num_devices: -3"),
        (lambda d: d.update(num_devices=2.0), "num_devices: 2.0"),
        (lambda d: d.update(num_devices=True), "num_devices: True"),
        (lambda d: d.pop("num_devices"), "num_devices: None"),
        (_set("device", 3, -1), "columns.device: row 3 is -1; expected from 0 to 1"),
        (_set("device", 3, 2), "columns.device: row 3 is 2"),
        (_set("device", 3, 10**30), "columns.device: every entry must be a whole number"),
        (_set("device", 3, 1.5), "columns.device: every entry must be a whole number"),
        (_set("device", 3, "1"), "columns.device: every entry must be a whole number"),
        (_set("device", 3, [1]), "columns.device: every entry must be a whole number"),
        (_set("peer", 1, 10**12), "columns.peer: row 1 is 1000000000000; expected a device from 0 to 1"),
        (_set("peer", 1, 5), "columns.peer: row 1 is 5; expected a device from 0 to 1 on a transfer"),
        (_set("peer", 1, -1), "columns.peer: row 1 is -1"),
        (_set("peer", 0, 1), "columns.peer: row 0 is 1; expected null on a compute event"),
        (_set("end", 2, float("nan")), "columns.end: row 2 is nan; times must be finite"),
        (_set("start", 2, float("inf")), "columns.start: row 2 is inf"),
        (_set("start", 2, 1e308), "columns.start: row 2 is 1e+308"),
        (_set("end", 2, None), "columns.end: every entry must be a number"),
        (_set("end", 2, 0.5), "columns.end: row 2 is 0.5; expected no earlier than the event's start"),
        (_set("stage", 0, -2), "columns.stage: row 0 is -2"),
        (_set("microbatch", 0, 2**40), "columns.microbatch: row 0 is 1099511627776"),
        (_set("kind", 0, "X"), "columns.kind: every entry must be one of"),
        (_set("kind", 0, ["F"]), "columns.kind"),
        (_set("buffer", 0, None), "columns.buffer"),
        (lambda d: d["columns"]["end"].pop(), "columns.end: 13 entries, but columns.device has 14"),
        (lambda d: d["columns"].update(stage=[]), "columns.stage: 0 entries"),
        (lambda d: d["columns"].pop("peer"), "columns.peer: missing or not a list"),
        (lambda d: d["columns"].update(kind="FFB"), "columns.kind: missing or not a list"),
        (lambda d: d.update(columns=[]), "columns: missing or not an object"),
        (lambda d: d.update(name=7), "name: missing or not a string"),
        (lambda d: d.update(version=2), "version: 2"),
    ],
)
def test_each_malformed_field_is_named(edit: Any, field: str) -> None:
    with pytest.raises(ConversionError, match="malformed timeline") as info:
        Timeline.from_json(_edited(edit), file="t.json")
    assert str(info.value).startswith("t.json: malformed timeline: ")
    assert field in str(info.value)


def test_a_billion_devices_in_3_kb_allocate_nothing(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_edited(lambda d: d.update(num_devices=1_000_000_000))))
    assert path.stat().st_size < 3000
    tracemalloc.start()
    try:
        with pytest.raises(ConversionError, match="num_devices"):
            Timeline.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


def test_unreadable_files_give_our_error(tmp_path: Path) -> None:
    cases = {
        "latin1.json": b'{"format": "pipedsl-timeline", "name": "\xe9"}',
        "deep.json": b"[" * 100_000,
        "truncated.json": json.dumps(_timeline().to_json()).encode()[:-10],
        "text.json": b"not json",
        "list.json": b"[1, 2]",
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ConversionError, match=name):
            Timeline.load(tmp_path / name)
    with pytest.raises(ConversionError, match="cannot read timeline"):
        Timeline.load(tmp_path / "missing.json")


# --- fuzzing ------------------------------------------------------------------------------


def _outcome(path: Path, content: bytes) -> str:
    """Load ``content`` as a timeline file; fail on anything but a Timeline or our error,
    and on memory out of proportion to the input."""
    path.write_bytes(content)
    tracemalloc.start()
    try:
        timeline = Timeline.load(path)
        outcome = "timeline"
        # What plot and trace do first with a timeline: neither may fail.
        timeline.busy(), timeline.bubble_ratio(), len(list(timeline.events()))
    except ConversionError as err:
        assert str(err).startswith(str(path)), err
        outcome = "error"
    except Exception as err:  # noqa: BLE001 - the point: name any foreign exception
        pytest.fail(f"{type(err).__name__}: {err}\n--- input ---\n{content[:2000]!r}")
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 200 * len(content) + 2_000_000, (peak, content[:500])
    return outcome


_BYTES = [
    b"0",
    b"-1",
    b"1e308",
    b"NaN",
    b"Infinity",
    b"-",
    b".",
    b",",
    b"[",
    b"]",
    b"{",
    b"}",
    b'"',
    b"null",
    b"\xff",
    b"9" * 30,
]


def test_mutated_bytes_give_a_timeline_or_our_error(tmp_path: Path) -> None:
    original = json.dumps(_timeline().to_json()).encode()
    rng = random.Random(SEED)
    outcomes: dict[str, int] = {}
    for _ in range(BYTE_MUTANTS):
        content = bytearray(original)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(content) + 1)
            choice = rng.randrange(4)
            if choice == 0:
                del content[at : at + rng.randint(1, 8)]
            elif choice == 1:
                content[at:at] = rng.choice(_BYTES)
            elif choice == 2 and at < len(content):
                content[at] = rng.randrange(256)
            else:
                content[at:at] = content[at : at + rng.randint(1, 40)]
        result = _outcome(tmp_path / "t.json", bytes(content))
        outcomes[result] = outcomes.get(result, 0) + 1
    assert outcomes.get("timeline", 0) > 0 and outcomes.get("error", 0) > 0, outcomes


_VALUES = [
    0, 1, -1, 2, 3, 10**9, 10**12, 2**63, 10**40, 0.5, -0.0, 1e308, float("nan"), float("inf"),
    "", "F", "send", "act", "x" * 100, None, True, [], [1], {}, {"a": 1},
]  # fmt: skip


def _mutate_fields(data: dict[str, Any], rng: random.Random) -> None:
    columns = data["columns"]
    choice = rng.randrange(6)
    if choice == 0:
        data[rng.choice(["num_devices", "name", "origin", "version", "format"])] = rng.choice(_VALUES)
    elif choice == 1:
        column = columns[rng.choice(sorted(columns))]
        if isinstance(column, list) and column:
            column[rng.randrange(len(column))] = rng.choice(_VALUES)
    elif choice == 2:
        column = columns[rng.choice(sorted(columns))]
        if isinstance(column, list) and column:
            del column[rng.randrange(len(column)) :]
    elif choice == 3:
        columns[rng.choice(sorted(columns))] = rng.choice(_VALUES)
    elif choice == 4:
        del columns[rng.choice(sorted(columns))]
    else:
        column = rng.choice(sorted(columns))
        if isinstance(columns[column], list):
            columns[column] = columns[column] * rng.randint(0, 3)


def test_mutated_fields_give_a_timeline_or_our_error(tmp_path: Path) -> None:
    original = _timeline().to_json()
    rng = random.Random(SEED + 1)
    outcomes: dict[str, int] = {}
    for _ in range(FIELD_MUTANTS):
        data = copy.deepcopy(original)
        for _ in range(rng.randint(1, 3)):
            if "columns" in data and isinstance(data["columns"], dict) and data["columns"]:
                _mutate_fields(data, rng)
        result = _outcome(tmp_path / "t.json", json.dumps(data).encode())
        outcomes[result] = outcomes.get(result, 0) + 1
    assert outcomes.get("timeline", 0) > 0 and outcomes.get("error", 0) > 0, outcomes


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {"format": st.just("pipedsl-timeline")},
        optional={
            "name": _json,
            "num_devices": _json,
            "origin": _json,
            "columns": st.dictionaries(
                st.sampled_from(["device", "kind", "stage", "microbatch", "start", "end", "peer", "buffer"]),
                _json,
            ),
        },
    )
)
def test_arbitrary_json_gives_a_timeline_or_our_error(data: dict[str, Any]) -> None:
    try:
        Timeline.from_json(data, file="h.json")
    except ConversionError:
        pass
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"{type(err).__name__}: {err}\n--- input ---\n{data!r}")


def test_a_large_timeline_reads_back_whole() -> None:
    # The checks run per column (numpy), so large timelines stay cheap; this one must
    # pass them all and come back whole.
    n = 200_000
    rng = np.random.default_rng(0)
    start = np.sort(rng.uniform(0, 10, n))
    data = Timeline(
        name="big",
        num_devices=4,
        origin="simulated",
        device=rng.integers(0, 4, n),
        kind=np.zeros(n, np.int8),
        stage=rng.integers(0, 8, n),
        microbatch=rng.integers(0, 100, n),
        start=start,
        end=start + 0.01,
        peer=np.full(n, -1),
        buffer=("",) * n,
    ).to_json()
    again = Timeline.from_json(data)
    assert len(again) == n and again.num_devices == 4
    np.testing.assert_array_equal(again.start, start)


def test_plot_and_trace_refuse_a_billion_devices_and_deep_nesting_at_once(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps(_edited(lambda d: d.update(num_devices=1_000_000_000))))
    for command in (
        ["plot", str(path), "-o", str(tmp_path / "x.png")],
        ["trace", str(path), "-o", str(tmp_path / "x")],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "pipedsl", *command], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
        assert done.returncode == 2, done.stderr
        assert "malformed timeline: num_devices: 1000000000" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "deep.json").write_text("[" * 100_000)
    done = subprocess.run(
        [sys.executable, "-m", "pipedsl", "plot", "deep.json", "-o", "x.png"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "nested too deeply" in done.stderr and "Traceback" not in done.stderr
