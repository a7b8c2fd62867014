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


def interleaved(pp: int, vpp: int, m: int) -> Schedule:
    """Megatron's interleaved 1F1B: stage s on device s % pp, written from its definition."""
    num_stages = pp * vpp
    total = m * vpp
    orders = []
    for d in range(pp):
        warmup = min(2 * (pp - d - 1) + (vpp - 1) * pp, total)

        def forward(k: int, d: int = d) -> Action:
            return Action(Kind.F, ((k // pp) % vpp) * pp + d, (k // (pp * vpp)) * pp + k % pp)

        def backward(k: int, d: int = d) -> Action:
            return Action(Kind.B, (vpp - 1 - (k // pp) % vpp) * pp + d, (k // (pp * vpp)) * pp + k % pp)

        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        orders.append(tuple(order))
    return Schedule(
        name="interleaved",
        num_stages=num_stages,
        num_devices=pp,
        num_microbatches=m,
        placement=tuple(s % pp for s in range(num_stages)),
        orders=tuple(orders),
    )


def v_shape(pp: int, m: int, *, split: bool) -> Schedule:
    """V placement (device d holds stages d and 2pp-1-d) in a GPipe-like order: all
    forwards by microbatch then stage, all backwards in reverse; projected per device."""
    num_stages = 2 * pp
    placement = tuple(s if s < pp else num_stages - 1 - s for s in range(num_stages))
    order: list[Action] = [Action(Kind.F, s, mb) for mb in range(m) for s in range(num_stages)]
    for mb in range(m):
        for s in reversed(range(num_stages)):
            order += [Action(Kind.I, s, mb), Action(Kind.W, s, mb)] if split else [Action(Kind.B, s, mb)]
    orders = tuple(tuple(a for a in order if placement[a.stage] == d) for d in range(pp))
    return Schedule("v", num_stages, pp, m, placement, orders)
