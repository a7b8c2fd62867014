"""Interop: CSV, JSON and .sched round trips, PyTorch's own CSV, and malformed input."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import gpipe, interleaved, one_f_one_b, one_f_one_b_split, v_shape
from pipedsl import library
from pipedsl.errors import ConversionError, PipedslError, ScheduleInvalid
from pipedsl.interop import (
    from_csv,
    from_json,
    to_csv,
    to_json,
    to_sched_text,
)
from pipedsl.ir import Schedule
from pipedsl.validate import validate


def same_schedule(a: Schedule, b: Schedule) -> bool:
    """Equal as schedules: shape, placement and every order (positions aside)."""
    return (a.num_stages, a.num_devices, a.num_microbatches, a.placement, a.orders) == (
        b.num_stages,
        b.num_devices,
        b.num_microbatches,
        b.placement,
        b.orders,
    )


BUILT = [
    gpipe(1, 2),
    gpipe(4, 6),
    one_f_one_b(4, 8),
    one_f_one_b_split(3, 5),
    interleaved(2, 3, 4),
    v_shape(4, 3, split=True),
]


def _id(schedule: Schedule) -> str:
    return f"{schedule.name}-{schedule.num_devices}x{schedule.num_stages}x{schedule.num_microbatches}"


def check_round_trips(schedule: Schedule) -> None:
    validate(schedule)
    via_csv = from_csv(to_csv(schedule))
    assert same_schedule(via_csv, schedule)
    via_json = from_json(to_json(schedule))
    assert same_schedule(via_json, schedule)
    assert (via_json.name, via_json.params) == (schedule.name, schedule.params)
    via_sched = library.parse(to_sched_text(schedule), file="exported.sched")
    assert same_schedule(via_sched, schedule)
    # Through every form in a row: IR -> CSV -> IR -> .sched -> IR.
    assert same_schedule(library.parse(to_sched_text(via_csv)), schedule)


@pytest.mark.parametrize("schedule", BUILT, ids=_id)
def test_round_trips_of_built_schedules(schedule: Schedule) -> None:
    check_round_trips(schedule)


# Policy schedules have no order until the simulator synthesises one; their synthesised
# orders round-trip in tests/simulator/test_synthesis_library.py.
ORDERS = sorted(n for n, path in library.library_schedules().items() if isinstance(library.load(path), Schedule))


@pytest.mark.parametrize("name", ORDERS)
def test_round_trips_of_the_library(name: str) -> None:
    check_round_trips(library.load(library.library_path(name)))  # type: ignore[arg-type]


def test_library_is_loaded() -> None:
    assert {"gpipe", "1f1b"} <= set(library.library_schedules())


def test_placement_formulas() -> None:
    odd = Schedule("odd", 3, 2, 1, (1, 0, 1), ((), ()))
    text = to_sched_text(odd)
    assert "  place [1, 0, 1]\n" in text
    assert library.parse(text).placement == (1, 0, 1)
    assert "place s -> s / 2" in to_sched_text(Schedule("blocks", 4, 2, 1, (0, 0, 1, 1), ((), ())))
    assert "place s -> min(s, 5 - s)" in to_sched_text(v_shape(3, 1, split=False))
    assert "place s -> s % 2" in to_sched_text(interleaved(2, 2, 2))


def test_sched_text_names_and_wrapping() -> None:
    text = to_sched_text(gpipe(2, 20))
    assert text.startswith("# gpipe evaluated with pp=2, microbatches=20, as a table.\nschedule gpipe {")
    # 40 actions per device wrap into lines of 16 aligned cells.
    assert "  device 0:  0F0  0F1" in text
    assert library.parse(text).orders == gpipe(2, 20).orders
    # Names the grammar would not accept are made into identifiers.
    assert "schedule s_1f1b {" in to_sched_text(one_f_one_b(2, 2))
    assert "schedule torch_run_2 {" in to_sched_text(from_csv("0F0,0B0\n", file="torch-run.2.csv", name="torch-run.2"))


# --- PyTorch's CSV ---------------------------------------------------------------------


def torch_visualiser_1f1b(pp: int, m: int) -> str:
    """The compute-only CSV PyTorch's schedule visualiser shows for its 1F1B.

    Rank r idles r slots, runs pp-1-r warm-up forwards and idles 2(pp-1-r) slots; then,
    in its steady state, it counts forwards on from the last warm-up microbatch, which on
    the last rank (no warm-up) starts at 1 instead of 0 and ends at m, out of range.
    """
    rows = []
    for rank in range(pp):
        cells = [""] * rank
        warmup = pp - 1 - rank
        cells += [f"{rank}F{i}" for i in range(warmup)]
        cells += [""] * (2 * warmup)
        forward, backward = max(warmup - 1, 0), 0
        for _ in range(m - warmup):
            forward += 1
            cells += [f"{rank}F{forward}", f"{rank}B{backward}"]
            backward += 1
        while backward < m:
            cells += ["", f"{rank}B{backward}"]
            backward += 1
        rows.append(",".join(cells))
    return "\n".join(rows) + "\n"


def test_torch_visualiser_out_of_range_microbatch() -> None:
    text = torch_visualiser_1f1b(4, 8)
    last_row = text.splitlines()[3]
    assert last_row.startswith(",,,3F1,3B0,") and "3F8" in last_row
    schedule = from_csv(text, file="torch_1f1b.csv", num_microbatches=8)
    with pytest.raises(ScheduleInvalid) as info:
        validate(schedule)
    err = info.value
    assert err.rule == "microbatch-range" and err.action == "3F8"
    assert err.pos is not None
    assert (err.pos.file, err.pos.line, err.pos.column) == ("torch_1f1b.csv", 4, last_row.index("3F8") + 1)
    assert str(err).splitlines()[1].strip() == last_row
    # Without the microbatch count the CSV implies 9 microbatches, and 3F0 is missing.
    with pytest.raises(ScheduleInvalid) as info:
        validate(from_csv(text))
    assert info.value.rule == "missing-action"


def test_csv_reading_details() -> None:
    text = '\ufeff0F0, 0F1 ,"1F0",,0B0\n1B0,2F0,2B0\n\n\n'
    schedule = from_csv(text, file="odd.csv")
    assert schedule.name == "odd" and schedule.source == "odd.csv"
    assert [str(a) for a in schedule.orders[0]] == ["0F0", "0F1", "1F0", "0B0"]
    assert schedule.orders[0][1].pos is not None and schedule.orders[0][1].pos.column == 6
    # Stage 1 is first seen on row 1, so device 0 owns it, and 1B0 opening row 2 is the
    # first action on a device that does not own its stage. The blank lines at the end
    # are no ranks.
    assert schedule.placement == (0, 0, 1) and schedule.num_devices == 2
    with pytest.raises(ScheduleInvalid) as info:
        validate(schedule)
    err = info.value
    assert err.rule == "wrong-device" and err.action == "1B0"
    assert err.pos is not None and (err.pos.line, err.pos.column) == (2, 1)


@pytest.mark.parametrize(
    ("text", "line", "column", "words"),
    [
        ("0F0,0B0\n1F0,1SEND_F0,1B0\n", 2, 5, "communication"),
        ("0F0,0UNSHARD,0B0\n", 1, 5, "communication"),
        ("0F0, 0X1 ,0B0\n", 1, 6, "not an action"),
        ("0F0,F0\n", 1, 5, "not an action"),
        ("0F0,0B0,(0F1;0B0)OVERLAP_F_B\n", 1, 9, "communication"),
    ],
)
def test_bad_csv_cells_are_located(text: str, line: int, column: int, words: str) -> None:
    with pytest.raises(ConversionError) as info:
        from_csv(text, file="bad.csv")
    err = info.value
    assert err.pos is not None and (err.pos.file, err.pos.line, err.pos.column) == ("bad.csv", line, column)
    assert words in err.message
    assert str(err).startswith(f"bad.csv:{line}:{column}: ")
    assert str(err).splitlines()[-1] == "    " + " " * (column - 1) + "^"


@pytest.mark.parametrize(
    ("text", "words"),
    [("", "no actions"), ("\n,,\n", "no actions"), ("0F0,0B0\n2F0,2B0\n", "stage 1 appears in no row")],
)
def test_csv_without_a_usable_schedule(text: str, words: str) -> None:
    with pytest.raises(ConversionError, match=words):
        from_csv(text)


# --- JSON ------------------------------------------------------------------------------


def test_json_is_readable() -> None:
    text = to_json(one_f_one_b(2, 2))
    assert text.splitlines()[1:3] == ['  "format": "pipedsl-schedule",', '  "version": 1,']
    assert '    ["0F0", "0F1", "0B0", "0B1"],' in text


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"format": "other", "version": 1}', "'other'"),
        ('{"format": "pipedsl-schedule", "version": 2}', "version 2"),
        ('{"format": "pipedsl-schedule", "version": 1}', "'placement' is missing"),
    ],
)
def test_malformed_json_headers(text: str, words: str) -> None:
    with pytest.raises(ConversionError, match=words):
        from_json(text, file="s.json")


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("num_stages", '"2"', "'num_stages' should be an integer"),
        ("num_devices", "true", "'num_devices' should be an integer"),
        ("placement", '[0, "x"]', "one device number per stage"),
        ("params", '{"pp": 1.5}', "map names to integers"),
        ("orders", '[["0F0", "0Q0"], []]', 'orders\\[0\\]\\[1\\] is "0Q0"'),
        ("orders", '["0F0"]', "orders\\[0\\] should be a list"),
        ("name", "3", "'name' should be a string"),
    ],
)
def test_mistyped_json_fields(key: str, value: str, words: str) -> None:
    good = to_json(one_f_one_b(2, 2))
    start = good.index(f'"{key}": ') + len(f'"{key}": ')
    end = good.index("\n", start) if key != "orders" else good.rindex("]", 0, good.rindex("}")) + 1
    text = good[:start] + value + ("," if key != "orders" else "") + good[end:]
    with pytest.raises(ConversionError, match=words):
        from_json(text, file="s.json")


def test_json_syntax_error_has_a_position() -> None:
    text = to_json(gpipe(2, 2)).replace('"num_devices": 2,', '"num_devices": 2')
    with pytest.raises(ConversionError) as info:
        from_json(text, file="s.json")
    err = info.value
    assert err.pos is not None and (err.pos.file, err.pos.line) == ("s.json", 7)
    assert "not valid JSON" in err.message and err.pos.line_text == '  "num_microbatches": 2,'


# --- files -----------------------------------------------------------------------------


def test_load_dispatches_on_the_extension(tmp_path: Path) -> None:
    schedule = one_f_one_b(3, 4)
    for suffix, text in [(".csv", to_csv(schedule)), (".json", to_json(schedule)), (".sched", to_sched_text(schedule))]:
        path = tmp_path / f"s{suffix}"
        path.write_text(text)
        loaded = library.load(path)
        assert same_schedule(loaded, schedule) and loaded.source == str(path)
    assert library.load(tmp_path / "s.csv", microbatches=4).num_microbatches == 4
    assert same_schedule(library.load("1f1b", pp=3, microbatches=4), schedule)


@pytest.mark.parametrize(
    ("name", "params", "words"),
    [
        ("s.csv", {"pp": 4}, "no parameter 'pp'"),
        ("s.json", {"microbatches": 4}, "takes no parameters"),
        ("s.txt", {}, "unknown kind of file '.txt'"),
        ("missing.csv", {}, "no such file"),
        ("no_such_library_schedule", {}, "no schedule 'no_such_library_schedule' in the library"),
    ],
)
def test_load_refuses(tmp_path: Path, name: str, params: dict[str, int], words: str) -> None:
    for suffix, text in [(".csv", to_csv(gpipe(2, 2))), (".json", to_json(gpipe(2, 2))), (".txt", "")]:
        (tmp_path / f"s{suffix}").write_text(text)
    target = tmp_path / name if "." in name else Path(name)
    with pytest.raises(PipedslError, match=words):
        library.load(target, **params)
