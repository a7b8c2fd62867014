"""A schedule evaluated straight into int columns (``library.load_arrays``), as the plan
search reads its shapes, against the same schedule evaluated into objects: the same
columns and the same errors."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from test_fuzz import MUTATIONS, SEED

from pipedsl import interop
from pipedsl.arrays import ActionArrays, ScheduleArrays
from pipedsl.errors import PipedslError, ScheduleInvalid
from pipedsl.ir import Schedule
from pipedsl.lang import evaluate, evaluate_arrays, parse_source
from pipedsl.library import library_schedules, load, load_arrays
from pipedsl.validate import checked

_COLUMNS = ("kind", "stage", "microbatch", "device", "position", "bounds")
_HEADER = ("name", "num_stages", "num_devices", "num_microbatches", "placement", "params", "source")


def _same(schedule: Schedule, arrays: ScheduleArrays) -> None:
    expected = ActionArrays.of(schedule)
    for column in _COLUMNS:
        got, want = getattr(arrays.actions, column), getattr(expected, column)
        assert got.dtype == want.dtype and np.array_equal(got, want), column
    assert all(getattr(arrays, f) == getattr(schedule, f) for f in _HEADER)


@pytest.mark.parametrize("name", sorted(library_schedules()))
@pytest.mark.parametrize("params", [{}, {"pp": 3, "microbatches": 7}, {"pp": 8, "microbatches": 24}])
def test_library_columns_equal_the_objects_columns(name: str, params: dict[str, int]) -> None:
    try:
        schedule = load(name, **params)
    except PipedslError as err:
        with pytest.raises(type(err), match="."):
            load_arrays(name, **params)
        return
    arrays = load_arrays(name, **params)
    if not isinstance(schedule, Schedule):
        assert not isinstance(arrays, ScheduleArrays)  # a policy is a policy either way
        return
    assert isinstance(arrays, ScheduleArrays)
    _same(schedule, arrays)
    assert np.array_equal(checked(arrays).order, checked(schedule).order)


def test_csv_and_json_files_come_as_their_columns(tmp_path: Path) -> None:
    schedule = load("zb_h1", pp=3, microbatches=5)
    assert isinstance(schedule, Schedule)
    (tmp_path / "z.json").write_text(interop.to_json(schedule))
    (tmp_path / "z.csv").write_text(interop.to_csv(schedule))
    for path, params in ((tmp_path / "z.json", {}), (tmp_path / "z.csv", {"microbatches": 5})):
        objects, arrays = load(path, **params), load_arrays(path, **params)
        assert isinstance(objects, Schedule) and isinstance(arrays, ScheduleArrays)
        _same(objects, arrays)


def _outcome(text: str, *, objects: bool) -> tuple[str, str, str | None]:
    """(how evaluating and checking ``text`` ended, the message, the rule broken)."""
    try:
        module = parse_source(text, file="mutant")
        loaded = evaluate(module, max_actions=20_000) if objects else evaluate_arrays(module, max_actions=20_000)
        if isinstance(loaded, Schedule | ScheduleArrays):
            checked(loaded)
    except ScheduleInvalid as err:
        return type(err).__name__, err.message, err.rule
    except PipedslError as err:
        return type(err).__name__, str(err), None
    return "valid", "", None


@pytest.mark.parametrize("name", sorted(library_schedules()))
def test_mutants_fail_alike_either_way(name: str) -> None:
    """Mutated library files: evaluation errors are the same word for word; a broken rule
    is the same rule with the same message (the columns' error has no position)."""
    original = library_schedules()[name].read_text()
    rng = random.Random(f"{SEED}-arrays-{name}")
    ended: set[str] = set()
    for _ in range(120):
        text = original
        for _ in range(rng.randint(1, 3)):
            text = rng.choice(MUTATIONS)(text, rng)
        outcome = _outcome(text, objects=True)
        assert _outcome(text, objects=False) == outcome, text
        ended.add(outcome[0])
    assert "valid" in ended or "ScheduleInvalid" in ended or "ScheduleEvalError" in ended
