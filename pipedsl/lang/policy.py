"""A ``policy`` block to the fields of a :class:`~pipedsl.policy.Policy`.

:mod:`pipedsl.lang.evaluate` hands this module the block once the placement is known.
Each statement is checked here (once per kind, kinds that exist, values in range) and its
expressions run once per device, with the block's device variable bound as in an
``on device`` body; the schedule-level names are visible as constants.

    policy on device d {
      split backward                  # I and W instead of B
      limit inflight <= pp - d        # peak (stage, microbatch) pairs held per device
      limit activations <= 2 * gib    # peak residual bytes per device (from the cost model)
      prefer I > F > W                # the order among ready actions
      W only in idle time             # W never delays an F or I known to be arriving
      warmup pp - d                   # forwards kept ahead of the backwards (1F1B's count)
    }
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedsl.errors import SourcePos
from pipedsl.ir import Kind
from pipedsl.lang import ast
from pipedsl.lang.arith import INT_MAX, INT_MIN, fail, lift, overflow
from pipedsl.lang.compile import Compiler
from pipedsl.lang.scope import Env, Local
from pipedsl.policy import Policy

__all__ = ["PolicySpec", "compile_policy"]


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """The evaluated statements of a policy block; per-device values have length D."""

    split_backward: bool
    max_inflight: tuple[int, ...] | None
    max_activation_bytes: tuple[int, ...] | None
    priority: tuple[Kind, ...] | None
    idle_w: bool
    warmup: tuple[int, ...] | None
    positions: tuple[tuple[str, SourcePos], ...]

    def policy(
        self,
        *,
        name: str,
        num_stages: int,
        num_devices: int,
        num_microbatches: int,
        placement: tuple[int, ...],
        params: tuple[tuple[str, int], ...],
        source: str | None,
    ) -> Policy:
        """The :class:`Policy` these statements state for a schedule of this shape."""
        return Policy(
            name=name,
            num_stages=num_stages,
            num_devices=num_devices,
            num_microbatches=num_microbatches,
            placement=placement,
            split_backward=self.split_backward,
            max_inflight=self.max_inflight,
            max_activation_bytes=self.max_activation_bytes,
            priority=self.priority,
            idle_w=self.idle_w,
            warmup=self.warmup,
            params=params,
            source=source,
            positions=self.positions,
        )


def compile_policy(block: ast.PolicyBlock, *, compiler: Compiler, env: Env, devices: int) -> PolicySpec:
    """Evaluate ``block`` for ``devices`` devices under the names of ``env``.

    Raises ScheduleEvalError at the statement or expression at fault: a statement given
    twice, a kind that the backward form does not have, ``W only in idle time`` without the
    split, a per-device value outside the 64-bit range.
    """
    seen: dict[str, ast.PolicyStmt] = {}
    for stmt in block.body:
        if stmt.what in seen:
            first = seen[stmt.what].pos
            raise fail(f"{_describe(stmt)} is stated twice in this policy (first at line {first.line})", stmt.pos)
        seen[stmt.what] = stmt
    split = "split" in seen
    compiler.check_new_name(block.var, block.pos, env, "the device variable")

    def per_device(what: str) -> tuple[int, ...] | None:
        stmt = seen.get(what)
        if stmt is None or stmt.value is None:
            return None
        return _per_device(stmt, block.var, compiler=compiler, env=env, devices=devices)

    return PolicySpec(
        split_backward=split,
        max_inflight=per_device("inflight"),
        max_activation_bytes=per_device("activations"),
        priority=_priority(seen.get("prefer"), split=split),
        idle_w=_idle_w(seen.get("idle_w"), split=split),
        warmup=per_device("warmup"),
        positions=tuple((what, stmt.pos) for what, stmt in seen.items()),
    )


def _describe(stmt: ast.PolicyStmt) -> str:
    return {
        "split": "`split backward`",
        "inflight": "`limit inflight`",
        "activations": "`limit activations`",
        "prefer": "`prefer`",
        "idle_w": "`W only in idle time`",
        "warmup": "`warmup`",
    }[stmt.what]


def _per_device(stmt: ast.PolicyStmt, var: str, *, compiler: Compiler, env: Env, devices: int) -> tuple[int, ...]:
    assert stmt.value is not None
    compiler.nslots = 0
    slot = compiler.new_slot()
    env.blocks.append({var: Local(slot, "device variable")})
    try:
        code = lift(compiler.expr(stmt.value, env))
    finally:
        env.blocks.pop()
    frame = [0] * compiler.nslots
    values = []
    for device in range(devices):
        frame[slot] = device
        value = code(frame)
        if not INT_MIN <= value <= INT_MAX:
            raise overflow(value, stmt.value.pos)
        values.append(value)
    return tuple(values)


def _priority(stmt: ast.PolicyStmt | None, *, split: bool) -> tuple[Kind, ...] | None:
    if stmt is None:
        return None
    kinds = tuple(Kind(k) for k in stmt.kinds)
    wanted = {Kind.F, Kind.I, Kind.W} if split else {Kind.F, Kind.B}
    if len(set(kinds)) != len(kinds) or set(kinds) != wanted:
        example = "prefer I > F > W" if split else "prefer B > F"
        form = "a split backward (`split backward`)" if split else "a full backward (no `split backward`)"
        raise fail(
            f"`prefer` must name each of {', '.join(sorted(k.value for k in wanted))} once for {form},"
            f" as in `{example}`; got {' > '.join(stmt.kinds)}",
            stmt.pos,
        )
    return kinds


def _idle_w(stmt: ast.PolicyStmt | None, *, split: bool) -> bool:
    if stmt is None:
        return False
    if stmt.kinds != ("W",):
        raise fail(f"only W can be kept to idle time; write `W only in idle time`, not `{stmt.kinds[0]} ...`", stmt.pos)
    if not split:
        raise fail("`W only in idle time` needs `split backward`: without the split there is no W", stmt.pos)
    return True
