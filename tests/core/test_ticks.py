"""Ticks: a schedule run as one program over every pipeline device (pipedsl.ticks)."""

from __future__ import annotations

import pytest

import pipedsl
from pipedsl.ir import Kind
from pipedsl.ticks import tick_table

LIBRARY = [
    ("1f1b", {"pp": 4, "microbatches": 8}),
    ("gpipe", {"pp": 4, "microbatches": 8}),
    ("zb_h1", {"pp": 4, "microbatches": 8}),
    ("interleaved_1f1b", {"pp": 4, "vpp": 2, "microbatches": 8}),
    ("dualpipev", {"pp": 4, "microbatches": 8}),
]


@pytest.mark.parametrize(("name", "params"), LIBRARY)
def test_ticks_keep_each_order_and_move_values_one_tick_late(name: str, params: dict[str, int]) -> None:
    schedule = pipedsl.load(name, **params)
    table = tick_table(schedule)
    tick = {a.key: t for t, row in enumerate(table.actions) for a in row if a is not None}
    device = {a.key: d for d, order in enumerate(schedule.orders) for a in order}
    # Every action runs once, on its own device, each device's in its order.
    assert len(tick) == schedule.num_actions
    for d, order in enumerate(schedule.orders):
        ticks = [tick[a.key] for a in order]
        assert ticks == list(table.tick_of[d]) and ticks == sorted(set(ticks))
        assert all(table.actions[t][d] == a for a, t in zip(order, ticks, strict=True))
    moved = set()
    for t, transfers in enumerate(table.transfers):
        for move in transfers:
            # A value moves at the end of its producer's tick, to a consumer on another device after it.
            assert tick[move.producer.key] == t < tick[move.consumer.key]
            assert (device[move.producer.key], device[move.consumer.key]) == (
                move.src,
                move.dst,
            ) and move.src != move.dst
            moved.add((move.producer.key, move.consumer.key))
    # Every dependency is respected, and every one across devices is a transfer.
    split = {(a.stage, a.microbatch) for _, a in schedule.actions() if a.kind is Kind.I}
    for d, order in enumerate(schedule.orders):
        for a in order:
            s, m = a.stage, a.microbatch
            needs = []
            if a.kind is Kind.F and s > 0:
                needs.append((Kind.F, s - 1, m))
            if a.kind is Kind.W:
                needs.append((Kind.I, s, m))
            if a.kind in (Kind.B, Kind.I):
                needs.append((Kind.F, s, m))
                if s + 1 < schedule.num_stages:
                    needs.append((Kind.I if (s + 1, m) in split else Kind.B, s + 1, m))
            for key in needs:
                assert tick[key] < tick[a.key]
                assert (device[key] == d) or ((key, a.key) in moved)
    assert len(moved) == sum(len(m) for m in table.transfers)


def test_uniform_1f1b_ticks_as_the_textbook_draws_it() -> None:
    # 1F1B on 4 devices, 8 microbatches: 2 * (8 + 4 - 1) ticks, the last device busy from tick 3 on.
    table = tick_table(pipedsl.load("1f1b", pp=4, microbatches=8))
    assert table.num_ticks == 2 * (8 + 4 - 1)
    assert [str(a) for a in table.actions[3] if a is not None] == ["0F3", "1F2", "2F1", "3F0"]
    assert table.pairs(3) == ((0, 1), (1, 2), (2, 3))
    assert table.actions[4][3] is not None and table.actions[4][3].kind is Kind.B
