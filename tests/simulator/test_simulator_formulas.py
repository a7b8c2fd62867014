"""The simulator against closed forms from the literature and against hand-worked cases.

Closed forms (uniform costs, free communication): GPipe and 1F1B have bubble ratio
(p-1)/(m+p-1), interleaved 1F1B (p-1)/(v·m+p-1) (Narayanan et al. 2021); ZB-H1 idles
(p-1)(F+I-W) per device (Qi et al. 2023; the DualPipe README writes it (p-1)(F+B-2W)
with B = I + W the full backward), a third of 1F1B's (p-1)(F+I+W) when F = I = W.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from helpers import gpipe, one_f_one_b
from pipedsl.ir import Schedule
from pipedsl.library import library_path, load
from pipedsl.simulator import CostModel, Simulation, simulate
from pipedsl.timeline import EventKind
from pipedsl.validate import peak_inflight

UNIT = CostModel(forward=1, backward=2)
SPLIT_UNIT = CostModel(forward=1, input_grad=1, weight_grad=1)


def library(name: str, **params: int) -> Schedule:
    return load(library_path(name), **params)


def exact_bubble(sim: Simulation) -> Fraction:
    """The bubble ratio in exact arithmetic (integer costs give integer-valued floats)."""
    busy = sum(Fraction(d.busy) for d in sim.devices)
    return 1 - busy / (sim.schedule.num_devices * Fraction(sim.makespan))


def events(sim: Simulation) -> list[tuple[int, str, int, int, float, float]]:
    """(device, kind, stage, microbatch, start, end) per event, computes then transfers."""
    return [(e.device, e.kind.value, e.stage, e.microbatch, e.start, e.end) for e in sim.timeline.events()]


# --- closed forms ------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12])
def test_gpipe_and_1f1b_bubble(p: int, m: int) -> None:
    expected = Fraction(p - 1, m + p - 1)
    schedules = [gpipe(p, m), one_f_one_b(p, m), library("gpipe", pp=p, microbatches=m)]
    if m >= p:  # the library's 1F1B requires it
        schedules.append(library("1f1b", pp=p, microbatches=m))
    for schedule in schedules:
        sim = simulate(schedule, UNIT)
        assert exact_bubble(sim) == expected, schedule.name
        assert abs(sim.bubble_ratio - float(expected)) < 1e-12
        assert sim.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_bubble(p: int, v: int, rounds: int) -> None:
    m = rounds * p  # the classic form needs a multiple of pp
    sim = simulate(library("interleaved_1f1b", pp=p, vpp=v, microbatches=m), UNIT)
    expected = Fraction(p - 1, v * m + p - 1)
    assert exact_bubble(sim) == expected
    assert abs(sim.bubble_ratio - float(expected)) < 1e-12


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_zb_h1_idles_a_third_of_1f1b(p: int, extra: int) -> None:
    m = p + extra
    zb = simulate(library("zb_h1", pp=p, microbatches=m), SPLIT_UNIT)
    base = simulate(library("1f1b", pp=p, microbatches=m), SPLIT_UNIT)
    for z, b in zip(zb.devices, base.devices, strict=True):
        assert z.busy == b.busy == 3 * m
        assert z.bubble == p - 1  # (p-1)(F+I-W)
        assert b.bubble == 3 * (p - 1)  # (p-1)(F+I+W)
        assert Fraction(z.bubble) / Fraction(b.bubble) == Fraction(1, 3)


@pytest.mark.parametrize(("f", "i", "w"), [(2, 1, 1), (1, 2, 1), (1, 1, 0.5), (3, 2, 2)])
def test_zb_h1_bubble_when_w_is_not_the_longest(f: float, i: float, w: float) -> None:
    # The closed form holds while W fits the gaps it fills (W <= F and W <= I).
    p, m = 4, 8
    sim = simulate(library("zb_h1", pp=p, microbatches=m), CostModel(forward=f, input_grad=i, weight_grad=w))
    assert sim.makespan == m * (f + i + w) + (p - 1) * (f + i - w)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("extra", [-1, 0, 4])
def test_zbv_idles_only_the_forward_fill(p: int, extra: int) -> None:
    # The last device cannot start before p-1 forwards have run; ZB-V idles exactly that
    # long and no more when F = I = W, so per device its idle time is half of ZB-H1's
    # once both model the same work (a ZB-V stage is half a device's share).
    m = 2 * p + extra
    zbv = simulate(library("zbv", pp=p, microbatches=m), SPLIT_UNIT)
    assert all(d.bubble == p - 1 for d in zbv.devices)
    same_model = SPLIT_UNIT.with_changes(per_device=True)
    zbv_share = simulate(library("zbv", pp=p, microbatches=m), same_model)
    zb_h1 = simulate(library("zb_h1", pp=p, microbatches=m), same_model)
    assert all(2 * a.bubble == b.bubble for a, b in zip(zbv_share.devices, zb_h1.devices, strict=True))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("extra", [0, 3])
def test_dualpipev_idles_only_the_forward_fill(p: int, extra: int) -> None:
    # Run as plain actions (no F&B overlap) with F = I = W, DualPipeV idles (p-1)F per
    # device as ZB-V does, and holds 2p+1 stage activation sets (its README: p+1).
    m = 2 * p + extra
    sim = simulate(library("dualpipev", pp=p, microbatches=m), SPLIT_UNIT)
    assert all(d.bubble == p - 1 for d in sim.devices)
    assert all(d.peak_inflight == 2 * p + 1 for d in sim.devices)


@pytest.mark.parametrize("p", [1, 2, 4, 5])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_peak_inflight_known_values(p: int, m: int) -> None:
    assert [d.peak_inflight for d in simulate(gpipe(p, m)).devices] == [m] * p
    assert [d.peak_inflight for d in simulate(one_f_one_b(p, m)).devices] == [min(p - d, m) for d in range(p)]
    eager = simulate(library("eager_1f1b", pp=p, microbatches=m))
    assert [d.peak_inflight for d in eager.devices] == [min(2 * (p - d) - 1, m) for d in range(p)]
    if m >= p:
        assert [d.peak_inflight for d in simulate(library("zb_h1", pp=p, microbatches=m)).devices] == [p] * p
    if m >= 2 * p - 1:
        zbv = simulate(library("zbv", pp=p, microbatches=m))
        assert [d.peak_inflight for d in zbv.devices] == [2 * p] * p
        assert [d.peak_inflight_microbatches for d in zbv.devices] == [p] * p


@pytest.mark.parametrize(("p", "v", "m"), [(4, 2, 8), (4, 3, 8), (2, 2, 4), (3, 2, 3)])
def test_interleaved_peak_inflight(p: int, v: int, m: int) -> None:
    sim = simulate(library("interleaved_1f1b", pp=p, vpp=v, microbatches=m))
    expected = [min(2 * (p - d - 1) + (v - 1) * p + 1, v * m) for d in range(p)]
    assert [d.peak_inflight for d in sim.devices] == expected
    # Megatron's estimate for device 0, in microbatch-equivalents: p + (p-1)/v (when the
    # warm-up is not cut short by running out of microbatches).
    if expected[0] < v * m:
        assert sim.devices[0].peak_inflight_microbatches == pytest.approx(p + (p - 1) / v)


def test_peak_inflight_agrees_with_validation_on_the_library() -> None:
    for name, params in [
        ("gpipe", {}),
        ("1f1b", {}),
        ("eager_1f1b", {}),
        ("interleaved_1f1b", {"vpp": 3}),
        ("looped_bfs", {}),
        ("zb_h1", {}),
        ("zbv", {}),
        ("dualpipev", {}),
    ]:
        schedule = library(name, pp=4, microbatches=8, **params)
        assert tuple(d.peak_inflight for d in simulate(schedule).devices) == peak_inflight(schedule), name


# --- hand-worked cases ---------------------------------------------------------------------


def test_hand_1f1b_two_devices_with_latency() -> None:
    # 1F1B, p=2, m=2, F=1, B=2, every transfer 0.5 s.
    # device 0: F0 F1 B0 B1; device 1: F0 B0 F1 B1.
    #   d0 F0 [0,1], send act0 [1,1.5]; d0 F1 [1,2], send act1 [2,2.5]
    #   d1 F0 waits for act0: [1.5,2.5]; B0 [2.5,4.5], send grad0 [4.5,5]
    #   d1 F1 (act1 came at 2.5) [4.5,5.5]; B1 [5.5,7.5], send grad1 [7.5,8]
    #   d0 B0 waits for grad0: [5,7]; B1 waits for grad1: [8,10]
    # makespan 10; busy 6 per device; bubble 1 - 12/20 = 0.4.
    sim = simulate(one_f_one_b(2, 2), CostModel(forward=1, latency=0.5))
    assert events(sim) == [
        (0, "F", 0, 0, 0.0, 1.0),
        (0, "F", 0, 1, 1.0, 2.0),
        (0, "B", 0, 0, 5.0, 7.0),
        (0, "B", 0, 1, 8.0, 10.0),
        (1, "F", 1, 0, 1.5, 2.5),
        (1, "B", 1, 0, 2.5, 4.5),
        (1, "F", 1, 1, 4.5, 5.5),
        (1, "B", 1, 1, 5.5, 7.5),
        (0, "send", 0, 0, 1.0, 1.5),
        (0, "send", 0, 1, 2.0, 2.5),
        (1, "send", 1, 0, 4.5, 5.0),
        (1, "send", 1, 1, 7.5, 8.0),
    ]
    assert sim.makespan == 10.0
    assert sim.bubble_ratio == 0.4
    # Critical path: d0 F0, act0, d1 F0 B0 F1 B1, grad1, d0 B1 (1+.5+1+2+1+2+.5+2 = 10).
    path = [(e.device, e.kind.value, e.microbatch) for e in sim.critical_events()]
    assert path == [
        (0, "F", 0),
        (0, "send", 0),
        (1, "F", 0),
        (1, "B", 0),
        (1, "F", 1),
        (1, "B", 1),
        (1, "send", 1),
        (0, "B", 1),
    ]


def test_hand_gpipe_uneven_stages_alpha_beta() -> None:
    # GPipe, 3 stages, m=2. F = (1, 2, 1) s per stage, B = 2F = (2, 4, 2).
    # Transfers: 0.5 s + bytes / 1000 B/s with 500 B across boundary 0 and 1000 B across
    # boundary 1: 1.0 s over boundary 0, 1.5 s over boundary 1, both ways.
    #   d0 F0 [0,1] act->[1,2]; F1 [1,2] act->[2,3]
    #   d1 F0 [2,4] act->[4,5.5]; F1 [4,6] act->[6,7.5]
    #   d2 F0 [5.5,6.5]; F1 [7.5,8.5]; B0 [8.5,10.5] grad->[10.5,12]; B1 [10.5,12.5] grad->[12.5,14]
    #   d1 B0 [12,16] grad->[16,17]; B1 (grad came at 14, device free at 16) [16,20] grad->[20,21]
    #   d0 B0 [17,19]; B1 [21,23]
    # makespan 23; busy 6, 12, 6; bubble 1 - 24/69 = 15/23.
    costs = CostModel(forward=(1, 2, 1), latency=0.5, bandwidth=1000, activation_bytes=(500, 1000))
    sim = simulate(gpipe(3, 2), costs)
    computes = [e for e in events(sim) if e[1] != "send"]
    assert computes == [
        (0, "F", 0, 0, 0.0, 1.0),
        (0, "F", 0, 1, 1.0, 2.0),
        (0, "B", 0, 0, 17.0, 19.0),
        (0, "B", 0, 1, 21.0, 23.0),
        (1, "F", 1, 0, 2.0, 4.0),
        (1, "F", 1, 1, 4.0, 6.0),
        (1, "B", 1, 0, 12.0, 16.0),
        (1, "B", 1, 1, 16.0, 20.0),
        (2, "F", 2, 0, 5.5, 6.5),
        (2, "F", 2, 1, 7.5, 8.5),
        (2, "B", 2, 0, 8.5, 10.5),
        (2, "B", 2, 1, 10.5, 12.5),
    ]
    sends = sorted((e[0], e[4], e[5]) for e in events(sim) if e[1] == "send")
    assert sends == [
        (0, 1.0, 2.0), (0, 2.0, 3.0),
        (1, 4.0, 5.5), (1, 6.0, 7.5), (1, 16.0, 17.0), (1, 20.0, 21.0),
        (2, 10.5, 12.0), (2, 12.5, 14.0),
    ]  # fmt: skip
    assert [d.busy for d in sim.devices] == [6.0, 12.0, 6.0]
    assert sim.makespan == 23.0
    assert exact_bubble(sim) == Fraction(15, 23)
    # Critical path: d0 F0, act (1), d1 F0 F1, act (1.5), d2 F1 B0, grad (1.5), d1 B0 B1,
    # grad (1), d0 B1: 1+1+2+2+1.5+1+2+1.5+4+4+1+2 = 23.
    path = [(e.device, e.kind.value, e.microbatch) for e in sim.critical_events()]
    assert path == [
        (0, "F", 0), (0, "send", 0), (1, "F", 0), (1, "F", 1), (1, "send", 1), (2, "F", 1),
        (2, "B", 0), (2, "send", 0), (1, "B", 0), (1, "B", 1), (1, "send", 1), (0, "B", 1),
    ]  # fmt: skip


def test_hand_blocking_sends() -> None:
    # As the first case, but a sender waits for its transfer to arrive.
    #   d0 F0 [0,1], act0 [1,1.5] (d0 blocked to 1.5); F1 [1.5,2.5], act1 [2.5,3] (to 3)
    #   d1 F0 [1.5,2.5]; B0 [2.5,4.5], grad0 [4.5,5] (to 5); F1 [5,6]; B1 [6,8], grad1 [8,8.5]
    #   d0 B0 [5,7]; B1 [8.5,10.5]
    # makespan 10.5; busy 6 each; bubble 1 - 12/21 = 3/7.
    sim = simulate(one_f_one_b(2, 2), CostModel(forward=1, latency=0.5, overlap_sends=False))
    starts = {(e[0], e[1], e[3]): (e[4], e[5]) for e in events(sim) if e[1] != "send"}
    assert starts == {
        (0, "F", 0): (0.0, 1.0),
        (0, "F", 1): (1.5, 2.5),
        (0, "B", 0): (5.0, 7.0),
        (0, "B", 1): (8.5, 10.5),
        (1, "F", 0): (1.5, 2.5),
        (1, "B", 0): (2.5, 4.5),
        (1, "F", 1): (5.0, 6.0),
        (1, "B", 1): (6.0, 8.0),
    }
    assert sim.makespan == 10.5
    assert exact_bubble(sim) == Fraction(3, 7)
    # Blocked time is bubble, not busy time.
    assert [d.busy for d in sim.devices] == [6.0, 6.0]


def test_hand_zb_h1_split_backward_with_latency_and_memory() -> None:
    # ZB-H1, p=2, m=3, F = I = W = 1, transfers 0.5 s.
    # Orders: d0 F0 F1 I0 W0 F2 I1 W1 I2 W2; d1 F0 I0 F1 I1 W0 F2 I2 W1 W2.
    #   d0 F0 [0,1] act->[1,1.5]; F1 [1,2] act->[2,2.5]
    #   d1 F0 [1.5,2.5]; I0 [2.5,3.5] grad->[3.5,4]; F1 [3.5,4.5]; I1 [4.5,5.5] grad->[5.5,6]; W0 [5.5,6.5]
    #   d0 I0 [4,5]; W0 [5,6]; F2 [6,7] act->[7,7.5]; I1 [7,8]; W1 [8,9]
    #   d1 F2 [7.5,8.5]; I2 [8.5,9.5] grad->[9.5,10]; W1 [9.5,10.5]; W2 [10.5,11.5]
    #   d0 I2 [10,11]; W2 [11,12]
    # makespan 12; busy 9 each; bubble 1 - 18/24 = 1/4.
    # Memory, residual (100, 300) bytes and weight residual (40, 120) bytes per stage,
    # after each compute (I swaps a residual for a weight residual):
    #   d0: 100 200 140 100 200 140 100 40 0  -> peak 200, 2 in flight
    #   d1: 300 120 420 240 120 420 240 120 0 -> peak 420, 2 in flight
    costs = CostModel(
        forward=1, input_grad=1, weight_grad=1, latency=0.5, residual_bytes=(100, 300), weight_residual_bytes=(40, 120)
    )
    sim = simulate(library("zb_h1", pp=2, microbatches=3), costs)
    spans = {(e[0], e[1], e[3]): (e[4], e[5]) for e in events(sim) if e[1] != "send"}
    assert spans == {
        (0, "F", 0): (0.0, 1.0), (0, "F", 1): (1.0, 2.0), (0, "I", 0): (4.0, 5.0), (0, "W", 0): (5.0, 6.0),
        (0, "F", 2): (6.0, 7.0), (0, "I", 1): (7.0, 8.0), (0, "W", 1): (8.0, 9.0), (0, "I", 2): (10.0, 11.0),
        (0, "W", 2): (11.0, 12.0),
        (1, "F", 0): (1.5, 2.5), (1, "I", 0): (2.5, 3.5), (1, "F", 1): (3.5, 4.5), (1, "I", 1): (4.5, 5.5),
        (1, "W", 0): (5.5, 6.5), (1, "F", 2): (7.5, 8.5), (1, "I", 2): (8.5, 9.5), (1, "W", 1): (9.5, 10.5),
        (1, "W", 2): (10.5, 11.5),
    }  # fmt: skip
    assert sim.makespan == 12.0
    assert sim.bubble_ratio == 0.25
    assert [(d.peak_inflight, d.peak_activation_bytes) for d in sim.devices] == [(2, 200), (2, 420)]


def test_hand_interleaved_memory_bytes_per_stage() -> None:
    # Interleaved, p=2, v=2, m=2: device 0 holds stages 0 and 2, device 1 stages 1 and 3.
    # Device 0 warms up with 2(p-d-1) + (v-1)p = 4 forwards (0F0 0F1 2F0 2F1), so it
    # holds two residuals of stage 0 and two of stage 2 at once: 2·10 + 2·1000 bytes.
    # Device 1 warms up with 2: 1F0 1F1, then 3F0 3B0 3F1 3B1 ... peak 1F0 1F1 3F0 held
    # together: 2·100 + 10000.
    sim = simulate(
        library("interleaved_1f1b", pp=2, vpp=2, microbatches=2), CostModel(residual_bytes=(10, 100, 1000, 10000))
    )
    assert [(d.peak_inflight, d.peak_activation_bytes) for d in sim.devices] == [(4, 2020), (3, 10200)]


def test_zero_cost_actions_and_empty_sends() -> None:
    # Free forwards: everything waits only on backwards. Makespan = (m+p-1)·B for 1F1B.
    sim = simulate(one_f_one_b(3, 4), CostModel(forward=0, backward=2))
    assert sim.makespan == 2 * (4 + 3 - 1)
    kinds = {e.kind for e in sim.critical_events()}
    assert EventKind.B in kinds
