"""Loops of actions run as whole columns: the compiler's fast path for ``for`` bodies.

A ``for`` whose body holds only actions and ``if``\\ s of actions (the shape of every
library schedule's inner loops) emits, per iteration, one action per action statement
whose conditions hold. :func:`compile_loop` compiles such a body a second time, to
numpy over the loop variable's whole range: every expression becomes a column of
int64, every condition a column of bools, and the actions of all iterations are made
in one pass, iteration by iteration and in statement order, as the closures of
:mod:`pipedsl.lang.compile` would make them one by one.

The fast path never decides an error. Anything it cannot prove harmless (a division by
zero anywhere in a column, even where a condition would skip it; a value that may leave
the 64-bit range; more actions than the budget has left; an action without a stage on a
device of several stages) makes it give up before it has emitted anything, and the loop
runs on the closures, which raise the error with its message and position. Values are
kept within ±2**62, so a sum of two never wraps in int64.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipedsl.errors import SourcePos
from pipedsl.ir import Kind
from pipedsl.lang import ast
from pipedsl.lang.arith import Frame
from pipedsl.lang.budget import Columns, Run
from pipedsl.lang.scope import Env

__all__ = ["MIN_ITERATIONS", "VectorLoop", "compile_loop"]

#: Loops shorter than this run on the closures: numpy's fixed cost per call is larger.
MIN_ITERATIONS = 16
_LIMIT = 1 << 62

Value = int | bool | np.ndarray
VecFn = Callable[[Frame, np.ndarray], Value]
#: A compiled column: a Python int or bool when known at compile time.
Code = int | bool | VecFn


class _NotVector(Exception):
    """Compile time: this body has a statement or expression the fast path does not take."""


class _Fallback(Exception):
    """Run time: this run of the loop goes to the closures."""


def _bounded(value: Value) -> Value:
    if isinstance(value, np.ndarray):
        if value.size and int(np.abs(value).max()) >= _LIMIT:
            raise _Fallback
    elif not -_LIMIT < value < _LIMIT:
        raise _Fallback
    return value


def _magnitude(value: Value) -> int:
    if isinstance(value, np.ndarray):
        return int(np.abs(value).max()) if value.size else 0
    return abs(int(value))


def _nonzero(value: Value) -> Value:
    zero = not value.all() if isinstance(value, np.ndarray) else value == 0
    if zero:
        raise _Fallback
    return value


def _add(a: Value, b: Value) -> Value:
    return _bounded(a + b)


def _sub(a: Value, b: Value) -> Value:
    return _bounded(a - b)


def _mul(a: Value, b: Value) -> Value:
    if _magnitude(a) * _magnitude(b) >= _LIMIT:
        raise _Fallback
    return a * b


def _div(a: Value, b: Value) -> Value:
    return a // _nonzero(b)


def _mod(a: Value, b: Value) -> Value:
    return a % _nonzero(b)


_ARITH: dict[str, Callable[[Value, Value], Value]] = {"+": _add, "-": _sub, "*": _mul, "/": _div, "%": _mod}
_COMPARE: dict[str, Callable[[Value, Value], Value]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
_LOGIC: dict[str, Callable[[Value, Value], Value]] = {"and": np.logical_and, "or": np.logical_or}


def _lift(code: Code) -> VecFn:
    if isinstance(code, (int, bool)):
        return lambda fr, iv: code
    return code


def _combine(fn: Callable[[Value, Value], Value], left: Code, right: Code) -> Code:
    if isinstance(left, (int, bool)) and isinstance(right, (int, bool)):
        try:
            folded = fn(left, right)
        except _Fallback:
            raise _NotVector from None  # an error if it runs: the closures' business
        # numpy's functions fold two Python values to a numpy scalar.
        return folded.item() if isinstance(folded, np.generic) else folded  # type: ignore[return-value]
    lf, rf = _lift(left), _lift(right)
    return lambda fr, iv: fn(lf(fr, iv), rf(fr, iv))


class _Columns:
    """Compiles a body's expressions to columns over the loop variable in ``slot``."""

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def expr(self, node: ast.Expr, env: Env, args: dict[str, Code]) -> Code:
        if isinstance(node, ast.IntLit):
            return _constant(node.value)
        if isinstance(node, ast.Name):
            return self._name(node.ident, env, args)
        if isinstance(node, ast.BinOp):
            return _combine(_ARITH[node.op], self.expr(node.left, env, args), self.expr(node.right, env, args))
        if isinstance(node, ast.Neg):
            return _combine(_sub, 0, self.expr(node.operand, env, args))
        if isinstance(node, ast.Call):
            return self._call(node, env, args)
        raise _NotVector

    def cond(self, node: ast.Expr, env: Env, args: dict[str, Code]) -> Code:
        if isinstance(node, ast.Compare):
            return _combine(_COMPARE[node.op], self.expr(node.left, env, args), self.expr(node.right, env, args))
        if isinstance(node, ast.BoolOp):
            return _combine(_LOGIC[node.op], self.cond(node.left, env, args), self.cond(node.right, env, args))
        if isinstance(node, ast.Not):
            return _combine(np.logical_xor, True, self.cond(node.operand, env, args))
        raise _NotVector

    def _name(self, name: str, env: Env, args: dict[str, Code]) -> Code:
        if name in args:
            return args[name]
        local = env.local(name)
        if local is not None:
            if local.slot == self.slot:
                return lambda fr, iv: iv
            slot = local.slot
            return lambda fr, iv: _bounded(fr[slot])
        if name in env.consts:
            return _constant(env.consts[name])
        raise _NotVector

    def _call(self, node: ast.Call, env: Env, args: dict[str, Code]) -> Code:
        values = [self.expr(a, env, args) for a in node.args]
        function = env.functions.get(node.func)
        if function is None:
            if node.func not in ("min", "max") or not values:
                raise _NotVector
            pick = np.minimum if node.func == "min" else np.maximum
            result = values[0]
            for value in values[1:]:
                result = _combine(pick, result, value)
            return result
        params = function.node.params
        if len(params) != len(values):
            raise _NotVector
        inner = Env(function.consts, function.functions, {}, [], inside=node.func)
        return self.expr(function.node.body, inner, dict(zip(params, values)))


def _constant(value: int) -> int:
    if not -_LIMIT < value < _LIMIT:
        raise _NotVector
    return value


@dataclass(frozen=True, slots=True)
class _Column:
    """One action statement: its kind, stage (None: the device's sole stage), microbatch,
    the condition under which it runs (None: always) and its position."""

    kind: Kind
    stage: Code | None
    microbatch: Code
    when: Code | None
    pos: SourcePos


def _and(mask: Code | None, test: Code) -> Code:
    return test if mask is None else _combine(np.logical_and, mask, test)


def _not(test: Code) -> Code:
    return _combine(np.logical_xor, True, test)


def _columns(stmts: ast.Block, env: Env, columns: _Columns, when: Code | None, out: list[_Column]) -> None:
    for stmt in stmts:
        if isinstance(stmt, ast.Emit):
            if len(stmt.args) not in (1, 2):
                raise _NotVector
            mb = columns.expr(stmt.args[0], env, {})
            stage = columns.expr(stmt.args[1], env, {}) if len(stmt.args) == 2 else None
            out.append(_Column(stmt.kind, stage, mb, when, stmt.pos))
        elif isinstance(stmt, ast.If):
            taken: Code = False
            for branch in stmt.branches:
                test = columns.cond(branch.cond, env, {})
                _columns(branch.body, env, columns, _and(_and(when, _not(taken)), test), out)
                taken = _combine(np.logical_or, taken, test)
            if stmt.orelse is not None:
                _columns(stmt.orelse, env, columns, _and(when, _not(taken)), out)
        else:
            raise _NotVector


class VectorLoop:
    """A loop body compiled to columns; :meth:`__call__` runs one whole loop."""

    __slots__ = ("_columns", "_run", "_kinds", "_poses", "_masked")

    def __init__(self, columns: list[_Column], run: Run) -> None:
        self._columns = columns
        self._run = run
        self._kinds = tuple(c.kind for c in columns)
        self._poses = tuple(c.pos for c in columns)
        self._masked = any(c.when is not None for c in columns)

    def __call__(self, fr: Frame, start: int, stop: int) -> bool:
        """Emit the actions of iterations ``start .. stop``; False (having emitted
        nothing) when the closures must run them instead."""
        n = stop - start
        if n < MIN_ITERATIONS or not -_LIMIT < start <= stop < _LIMIT:
            return False
        run = self._run
        iv = np.arange(start, stop, dtype=np.int64)
        k = len(self._columns)
        # Row i * k + c is column c's action in iteration i: the closures' order.
        stages = np.empty((n, k), dtype=np.int64)
        mbs = np.empty((n, k), dtype=np.int64)
        keep = np.ones((n, k), dtype=bool) if self._masked else None
        try:
            for c, column in enumerate(self._columns):
                if column.stage is None:
                    if run.sole_stage is None:
                        raise _Fallback
                    stages[:, c] = run.sole_stage
                else:
                    stages[:, c] = _lift(column.stage)(fr, iv)
                mbs[:, c] = _lift(column.microbatch)(fr, iv)
                if keep is not None and column.when is not None:
                    keep[:, c] = _lift(column.when)(fr, iv)
        except _Fallback:
            return False
        chosen = None if keep is None else keep.ravel()
        count = n * k if chosen is None else int(np.count_nonzero(chosen))
        if count > run.actions_left:
            return False
        run.extend(Columns(self._kinds, self._poses, stages.ravel(), mbs.ravel(), chosen))
        run.actions_left -= count
        return True


def compile_loop(body: ast.Block, env: Env, slot: int, run: Run) -> VectorLoop | None:
    """The fast path for a loop whose variable is in frame ``slot`` and whose body is
    ``body`` (compiled in ``env`` with the loop variable in scope), or None when the
    body holds anything but actions and ``if``\\ s of actions."""
    out: list[_Column] = []
    try:
        _columns(body, env, _Columns(slot), None, out)
    except _NotVector:
        return None
    return VectorLoop(out, run) if out else None
