"""Schedules built straight from their textbook definitions, in Python.

Tests use these as expectations written independently of the language evaluator.
"""

from __future__ import annotations

from pipedsl.ir import Action, Kind, Schedule


def _schedule(name: str, pp: int, m: int, orders: list[list[Action]], placement: tuple[int, ...] | None = None) -> Schedule:
    placement = placement if placement is not None else tuple(range(pp))
    return Schedule(
        name=name,
        num_stages=len(placement),
        num_devices=pp,
        num_microbatches=m,
        placement=placement,
        orders=tuple(tuple(o) for o in orders),
        params=(("pp", pp), ("microbatches", m)),
    )


def gpipe(pp: int, m: int) -> Schedule:
    """All forwards, then all backwards, in microbatch order."""
    orders = [
        [Action(Kind.F, d, i) for i in range(m)] + [Action(Kind.B, d, i) for i in range(m)] for d in range(pp)
    ]
    return _schedule("gpipe", pp, m, orders)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """PipeDream-Flush: pp-1-d warm-up forwards, then F/B pairs, then the remaining backwards."""
    orders = []
    for d in range(pp):
        warmup = min(pp - 1 - d, m)
        order = [Action(Kind.F, d, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(Kind.F, d, warmup + i), Action(Kind.B, d, i)]
        order += [Action(Kind.B, d, i) for i in range(m - warmup, m)]
        orders.append(order)
    return _schedule("1f1b", pp, m, orders)


def one_f_one_b_split(pp: int, m: int) -> Schedule:
    """1F1B with every backward split into I immediately followed by W."""
    base = one_f_one_b(pp, m)
    orders = []
    for order in base.orders:
        new: list[Action] = []
        for a in order:
            if a.kind is Kind.B:
                new += [Action(Kind.I, a.stage, a.microbatch), Action(Kind.W, a.stage, a.microbatch)]
            else:
                new.append(a)
        orders.append(new)
    return _schedule("1f1b_split", pp, m, orders)
