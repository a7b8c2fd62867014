"""The shipped schedules: each validates over a grid of sizes, and the classic ones produce
exactly the textbook orders, computed here independently of the language."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from pipedsl import library
from pipedsl.errors import PipedslError, ScheduleEvalError
from pipedsl.ir import Kind, Schedule
from pipedsl.library import library_path, library_schedules, load
from pipedsl.policy import Policy
from pipedsl.validate import validate

Grid = list[list[str]]

# name -> (has vpp, smallest microbatches allowed for pp, microbatch step)
LIBRARY: dict[str, tuple[bool, Callable[[int], int], Callable[[int], int]]] = {
    "gpipe": (False, lambda pp: 1, lambda pp: 1),
    "1f1b": (False, lambda pp: pp, lambda pp: 1),
    "eager_1f1b": (False, lambda pp: 1, lambda pp: 1),
    "interleaved_1f1b": (True, lambda pp: pp, lambda pp: pp),
    "looped_bfs": (True, lambda pp: 1, lambda pp: 1),
    "zb_h1": (False, lambda pp: pp, lambda pp: 1),
    "zbv": (False, lambda pp: 2 * pp - 1, lambda pp: 1),
    "dualpipev": (False, lambda pp: 2 * pp, lambda pp: 1),
}


# Policy schedules: limits and priorities, synthesised against a cost model by the simulator,
# so their grid and closed forms are checked in tests/simulator/test_synthesis_library.py.
POLICIES = {"zb_auto", "zb_h2", "zbv_auto"}


def grid(schedule: Schedule) -> Grid:
    return [[str(a) for a in order] for order in schedule.orders]


def cases() -> list[tuple[str, dict[str, int]]]:
    out = []
    for name, (has_vpp, smallest, step) in LIBRARY.items():
        for pp in range(2, 9):
            for vpp in (1, 2, 3) if has_vpp else (None,):
                for m in range(smallest(pp), 4 * pp + 1, step(pp)):
                    params = {"pp": pp, "microbatches": m}
                    if vpp is not None:
                        params["vpp"] = vpp
                    out.append((name, params))
    return out


def test_the_library_is_what_this_file_covers() -> None:
    assert set(library_schedules()) == set(LIBRARY) | POLICIES | {"table_example"}
    assert library_path("1f1b") == library_path("1f1b.sched") == library_path() / "1f1b.sched"
    with pytest.raises(PipedslError, match="no schedule 'nope' in the library; it has 1f1b"):
        library_path("nope")


@pytest.mark.parametrize("name", sorted(library_schedules()))
def test_every_file_documents_itself_and_has_the_usual_defaults(name: str) -> None:
    text = library_path(name).read_text()
    assert text.startswith("# ")
    header = text[: text.index("\nschedule ")]
    assert "bubble:" in header and "in flight:" in header
    loaded = load(library_path(name))
    if name in POLICIES:
        assert isinstance(loaded, Policy)
        loaded.check()
    else:
        assert isinstance(loaded, Schedule)
        validate(loaded)
    defaults = dict(loaded.params)
    usual = {
        "pp": 4,
        "microbatches": 8,
        "vpp": 2,
        "max_inflight": defaults.get("pp", 0) * (2 if name == "zbv_auto" else 1),
    }
    assert {k: v for k, v in usual.items() if k in defaults} == defaults


def test_every_schedule_validates_over_the_grid() -> None:
    checked = 0
    for name, params in cases():
        schedule = load(library_path(name), **params)
        pp, m, vpp = params["pp"], params["microbatches"], params.get("vpp", 1)
        stages = 2 * pp if name in ("zbv", "dualpipev") else pp * vpp
        assert (schedule.num_stages, schedule.num_devices, schedule.num_microbatches) == (stages, pp, m)
        report = validate(schedule)
        assert report.num_actions == schedule.num_actions
        assert report.peak_inflight == expected_peak(name, pp, vpp, m), (name, params)
        checked += 1
    assert checked > 1000


def expected_peak(name: str, pp: int, vpp: int, m: int) -> tuple[int, ...]:
    """Peak (stage, microbatch) pairs in flight per device, as each file's header states."""
    if name == "gpipe":
        return (m,) * pp
    if name == "1f1b":
        return tuple(pp - d for d in range(pp))
    if name == "eager_1f1b":
        return tuple(min(2 * (pp - d) - 1, m) for d in range(pp))
    if name == "interleaved_1f1b":
        return tuple(min(2 * (pp - d - 1) + (vpp - 1) * pp + 1, m * vpp) for d in range(pp))
    if name == "looped_bfs":
        return (vpp * m,) * pp
    if name == "zb_h1":
        return (pp,) * pp
    if name == "zbv":
        return (2 * pp,) * pp  # pp microbatches through each of a device's two stages
    return (2 * pp + 1,) * pp  # dualpipev


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("1f1b", {"pp": 4, "microbatches": 3}, "1F1B needs at least as many microbatches as stages"),
        ("zb_h1", {"pp": 4, "microbatches": 3}, "ZB-H1 needs at least as many microbatches"),
        ("zbv", {"pp": 4, "microbatches": 6}, "ZB-V needs at least 2pp-1 microbatches"),
        ("dualpipev", {"pp": 4, "microbatches": 7}, "DualPipeV needs at least as many microbatches as stages"),
        ("interleaved_1f1b", {"pp": 4, "microbatches": 6}, "multiple of pp"),
        ("looped_bfs", {"vpp": 0}, "vpp (stages per device) must be at least 1"),
        ("gpipe", {"microbatches": 0}, "at least one microbatch"),
    ],
)
def test_constraints_are_require_lines(name: str, params: dict[str, int], message: str) -> None:
    with pytest.raises(ScheduleEvalError, match="requirement failed") as info:
        load(library_path(name), **params)
    assert message in info.value.message


# ---- textbook orders, written from the definitions -------------------------------------


def gpipe_expected(pp: int, m: int) -> Grid:
    """GPipe: every forward, then every backward."""
    return [[f"{d}F{i}" for i in range(m)] + [f"{d}B{i}" for i in range(m)] for d in range(pp)]


def one_f_one_b_expected(pp: int, m: int) -> Grid:
    """PipeDream-Flush: stage d keeps pp - d microbatches in flight; after the warm-up each
    backward frees a slot that the next forward takes."""
    out = []
    for d in range(pp):
        order: list[str] = []
        forwards = backwards = 0
        while backwards < m:
            in_flight = forwards - backwards
            if forwards < m and in_flight < pp - d:
                order.append(f"{d}F{forwards}")
                forwards += 1
            else:
                order.append(f"{d}B{backwards}")
                backwards += 1
        out.append(order)
    return out


def megatron_expected(pp: int, vpp: int, m: int) -> Grid:
    """Megatron-LM's forward_backward_pipelining_with_interleaving, reduced to its order.

    Chunk of the k-th forward: (k mod pp*vpp) div pp; of the k-th backward: the same from
    the last chunk down. Each chunk takes its microbatches in arrival order, so a forward's
    microbatch is the count of earlier forwards of its chunk (Megatron's per-chunk queues).
    """
    total = m * vpp
    out = []
    for d in range(pp):
        warmup = min((pp - d - 1) * 2 + (vpp - 1) * pp, total)

        def chunk(k: int, forward: bool) -> int:
            c = (k % (pp * vpp)) // pp
            return c if forward else vpp - 1 - c

        seen_f = [0] * vpp
        seen_b = [0] * vpp
        order: list[str] = []

        def forward(k: int) -> None:
            c = chunk(k, True)
            order.append(f"{c * pp + d}F{seen_f[c]}")
            seen_f[c] += 1

        def backward(k: int) -> None:
            c = chunk(k, False)
            order.append(f"{c * pp + d}B{seen_b[c]}")
            seen_b[c] += 1

        for k in range(warmup):
            forward(k)
        for k in range(total - warmup):
            forward(warmup + k)
            backward(k)
        for k in range(total - warmup, total):
            backward(k)
        out.append(order)
    return out


def zb_h1_expected(pp: int, m: int) -> Grid:
    """ZB-H1 as a list scheduler would state it: 1F1B's forwards and input gradients, and
    each weight gradient issued once device d has d newer input gradients behind it (at the
    end, whatever is left)."""
    out = []
    for d in range(pp):
        order: list[str] = []
        pending: list[int] = []
        forwards = 0
        for i in range(m):
            while forwards < m and forwards - i < pp - d:
                order.append(f"{d}F{forwards}")
                forwards += 1
            order.append(f"{d}I{i}")
            pending.append(i)
            if len(pending) > d:
                order.append(f"{d}W{pending.pop(0)}")
        order.extend(f"{d}W{j}" for j in pending)
        out.append(order)
    return out


def zbv_expected(pp: int, m: int) -> Grid:
    """ZB-V's published order (the paper's section 6, as PyTorch's ScheduleZBVZeroBubble
    generates it), with per-stage counters: warm-up, steady rounds, drain."""
    out = []
    for d in range(pp):
        down, up = d, 2 * pp - 1 - d
        order: list[str] = []
        count = {(k, s): 0 for k in "FIW" for s in (down, up)}

        def act(kind: str, stage: int) -> None:
            order.append(f"{stage}{kind}{count[kind, stage]}")
            count[kind, stage] += 1

        for _ in range(2 * (pp - d) - 1):
            act("F", down)
        for _ in range(d):
            act("F", up)
            act("F", down)
        for _ in range(pp - d):
            act("F", up)
            act("I", up)
            act("W", up)
        while count["F", up] < count["F", down] or count["F", down] < m:
            if count["F", down] < m:
                act("F", down)
            act("I", down)
            act("W", down)
            act("F", up)
            act("I", up)
            act("W", up)
        for _ in range(d):
            act("I", down)
            act("I", up)
        for _ in range(pp - d):
            act("I", down)
            act("W", down)
        while count["W", up] < m:
            act("W", up)
        while count["W", down] < m:
            act("W", down)
        out.append(order)
    return out


def dualpipev_expected(pp: int, m: int) -> Grid:
    """DualPipeV's order as PyTorch's ScheduleDualPipeV generates it: per-stage counters
    (a full B advances the I and W counters together), a FIFO of Is whose Ws are still due,
    and each overlapped forward-backward pair written as its two actions."""
    out = []
    for d in range(pp):
        down, up = d, 2 * pp - 1 - d
        order: list[str] = []
        count: dict[tuple[int, str], int] = {}
        due: list[tuple[int, int]] = []

        def act(kind: str, stage: int) -> None:
            key = (stage, "I" if kind == "B" else kind)
            mb = count.get(key, 0)
            order.append(f"{stage}{kind}{mb}")
            count[key] = mb + 1
            if kind == "B":
                count[stage, "W"] = count.get((stage, "W"), 0) + 1
            elif kind == "I":
                due.append((stage, mb))

        def weight() -> None:
            if due:
                stage, mb = due.pop(0)
                order.append(f"{stage}W{mb}")

        for _ in range(2 * (pp - d - 1)):
            act("F", down)
        for _ in range(d + 1):
            act("F", down)
            act("F", up)
        for _ in range(pp - d - 1):
            act("I", up)
            weight()
            act("F", up)
        for _ in range(m - 2 * pp + d + 1):
            act("F", down)
            act("B", up)
            act("F", up)
            act("B", down)
        for _ in range(pp - d - 1):
            act("B", up)
            act("F", up)
            act("B", down)
        split = False
        for i in range(d + 1):
            if i == (d + 1) // 2 and d % 2 == 1:
                split = True
            act("I" if split else "B", up)
            if i == (d + 1) // 2 and d % 2 == 0:
                split = True
            act("I" if split else "B", down)
        for _ in range(pp - d - 1):
            weight()
            act("I", down)
        for _ in range(d + 1):
            weight()
        out.append(order)
    return out


@pytest.mark.parametrize("pp", range(1, 9))
def test_zero_bubble_orders_follow_their_algorithms(pp: int) -> None:
    for m in range(pp, 4 * pp + 1):
        assert grid(load(library_path("zb_h1"), pp=pp, microbatches=m)) == zb_h1_expected(pp, m)
    for m in range(2 * pp - 1, 4 * pp + 1):
        assert grid(load(library_path("zbv"), pp=pp, microbatches=m)) == zbv_expected(pp, m)
    for m in range(2 * pp, 5 * pp + 1):
        assert grid(load(library_path("dualpipev"), pp=pp, microbatches=m)) == dualpipev_expected(pp, m)


@pytest.mark.parametrize("pp", range(1, 9))
def test_gpipe_and_1f1b_are_the_textbook_orders(pp: int) -> None:
    for m in range(1, 4 * pp + 1):
        assert grid(load(library_path("gpipe"), pp=pp, microbatches=m)) == gpipe_expected(pp, m)
        if m >= pp:
            assert grid(load(library_path("1f1b"), pp=pp, microbatches=m)) == one_f_one_b_expected(pp, m)


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("vpp", [1, 2, 3, 4])
def test_interleaved_is_megatrons_order(pp: int, vpp: int) -> None:
    for m in range(pp, 4 * pp + 1, pp):
        schedule = load(library_path("interleaved_1f1b"), pp=pp, vpp=vpp, microbatches=m)
        assert grid(schedule) == megatron_expected(pp, vpp, m)
        assert schedule.placement == tuple(s % pp for s in range(pp * vpp))


def test_literal_orders_for_small_cases() -> None:
    assert grid(load(library_path("1f1b"), pp=4, microbatches=8)) == [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7".split(),
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7".split(),
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7".split(),
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7".split(),
    ]
    assert grid(load(library_path("gpipe"), pp=2, microbatches=3)) == [
        "0F0 0F1 0F2 0B0 0B1 0B2".split(),
        "1F0 1F1 1F2 1B0 1B1 1B2".split(),
    ]
    assert grid(load(library_path("interleaved_1f1b"), pp=2, vpp=2, microbatches=4)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3".split(),
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3".split(),
    ]
    assert grid(load(library_path("zb_h1"), pp=3, microbatches=4)) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3".split(),
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3".split(),
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3".split(),
    ]
    assert grid(load(library_path("zbv"), pp=2, microbatches=3)) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2".split(),
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2".split(),
    ]


def test_table_example_is_zb_h1_for_two_devices() -> None:
    table = load(library_path("table_example"))
    assert grid(table) == grid(load(library_path("zb_h1"), pp=2, microbatches=4))
    assert table.params == ()


def test_zbv_uses_the_v_placement() -> None:
    schedule = load(library_path("zbv"), pp=4, microbatches=8)
    assert schedule.placement == (0, 1, 2, 3, 3, 2, 1, 0)


# ---- the bubbles the headers claim, with unit costs and free communication -------------


def idle_per_device(schedule: Schedule, cost: dict[Kind, int]) -> list[int]:
    """Run the orders with the given cost per action kind; return each device's idle time."""
    finished: dict[tuple[str, int, int], int] = {}
    position = [0] * schedule.num_devices
    free = [0] * schedule.num_devices
    busy = [0] * schedule.num_devices
    last = schedule.num_stages - 1
    moved = True
    while moved:
        moved = False
        for d, order in enumerate(schedule.orders):
            while position[d] < len(order):
                a = order[position[d]]
                if a.kind is Kind.F:
                    needs = [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
                elif a.kind is Kind.W:
                    needs = [("I", a.stage, a.microbatch)]
                else:
                    needs = [("F", a.stage, a.microbatch)]
                    if a.stage < last:
                        needs.append(("back", a.stage + 1, a.microbatch))
                if any(n not in finished for n in needs):
                    break
                end = max([free[d], *(finished[n] for n in needs)]) + cost[a.kind]
                free[d] = end
                busy[d] += cost[a.kind]
                finished[(a.kind.value, a.stage, a.microbatch)] = end
                if a.kind in (Kind.B, Kind.I):
                    finished[("back", a.stage, a.microbatch)] = end
                position[d] += 1
                moved = True
    makespan = max(free)
    return [makespan - b for b in busy]


@pytest.mark.parametrize(("f", "i", "w"), [(1, 1, 1), (2, 2, 1), (3, 2, 1), (2, 3, 2)])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (6, 24)])
def test_zb_h1_idles_pp_minus_one_times_f_plus_i_minus_w(f: int, i: int, w: int, pp: int, m: int) -> None:
    cost = {Kind.F: f, Kind.I: i, Kind.W: w, Kind.B: i + w}
    assert idle_per_device(load(library_path("zb_h1"), pp=pp, microbatches=m), cost) == [(pp - 1) * (f + i - w)] * pp
    for name in ("1f1b", "gpipe", "eager_1f1b"):
        one = idle_per_device(load(library_path(name), pp=pp, microbatches=m), cost)
        assert one == [(pp - 1) * (f + i + w)] * pp


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_v_schedules_idle_only_for_the_staggered_start(name: str, pp: int, m: int) -> None:
    cost = {Kind.F: 1, Kind.I: 1, Kind.W: 1, Kind.B: 2}
    assert idle_per_device(load(library_path(name), pp=pp, microbatches=m), cost) == [pp - 1] * pp


def test_the_library_listing_follows_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library, "_library_folder", lambda: tmp_path)
    (tmp_path / "a.sched").write_text("")
    first = library_schedules()
    assert list(first) == ["a"]
    first["b"] = tmp_path / "b.sched"
    assert list(library_schedules()) == ["a"]
    (tmp_path / "b.sched").write_text("")
    (tmp_path / "notes.txt").write_text("")
    # Coarse file-system clocks may give both changes one mtime; the listing follows the mtime.
    stamp = (tmp_path / "a.sched").stat().st_mtime_ns
    os.utime(tmp_path, ns=(stamp, stamp + 10**9))
    assert library_schedules() == {"a": tmp_path / "a.sched", "b": tmp_path / "b.sched"}
    assert library_path("b") == tmp_path / "b.sched"


@pytest.mark.parametrize("name", sorted(library_schedules()))
def test_a_files_layout_is_its_schedules_without_making_the_orders(name: str) -> None:
    file = library.schedule_file(name)
    given = {k: v for k, v in {"pp": 4, "vpp": 2, "microbatches": 8}.items() if k in file.parameters}
    loaded = file.load(**given)
    assert file.layout(**given) == (loaded.num_stages, loaded.num_devices, loaded.placement)


def test_a_layout_is_refused_as_the_schedule_is() -> None:
    file = library.schedule_file("1f1b")
    with pytest.raises(PipedslError, match="at least as many microbatches as stages"):
        file.layout(pp=4, microbatches=2)
