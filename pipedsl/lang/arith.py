"""Integers in compiled schedule code: the frame and code types, and 64-bit arithmetic.

An expression compiles to an int when its value is known at compile time, or else to a
closure over a frame (a list of ints, one slot per local). :func:`arith` folds constants
and specialises a constant right side; integers past the 64-bit range (from ``*``) are
an error rather than a bignum, and so is a division by zero, when it is executed.
"""

from __future__ import annotations

from collections.abc import Callable

from pipedsl.errors import ScheduleEvalError, SourcePos

__all__ = [
    "INT_MAX",
    "INT_MIN",
    "BoolCode",
    "BoolFn",
    "Frame",
    "IntCode",
    "IntFn",
    "StmtFn",
    "arith",
    "fail",
    "lift",
    "min_max",
    "overflow",
]

INT_MAX = 2**63 - 1
INT_MIN = -(2**63)

Frame = list[int]
IntFn = Callable[[Frame], int]
BoolFn = Callable[[Frame], bool]
#: Compiled integer expression: an int when its value is known at compile time.
IntCode = int | IntFn
#: Compiled condition: a bool when its value is known at compile time.
BoolCode = bool | BoolFn
StmtFn = Callable[[Frame], None]


def fail(message: str, pos: SourcePos) -> ScheduleEvalError:
    return ScheduleEvalError(message, pos=pos)


def lift(code: IntCode) -> IntFn:
    if isinstance(code, int):
        return lambda fr: code
    return code


def overflow(value: int, pos: SourcePos) -> ScheduleEvalError:
    return fail(f"integer overflow: {value} is outside the 64-bit range", pos)


def _fold_arith(op: str, a: int, b: int, pos: SourcePos) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        value = a * b
        if INT_MIN <= value <= INT_MAX:
            return value
        raise overflow(value, pos)
    if b == 0:
        raise fail(f"division by zero: {a} {op} 0", pos)
    return a // b if op == "/" else a % b


def arith(op: str, left: IntCode, right: IntCode, pos: SourcePos) -> IntCode:
    """Compile ``left op right``, folding constants and specialising a constant right side."""
    if isinstance(left, int) and isinstance(right, int):
        try:
            return _fold_arith(op, left, right, pos)
        except ScheduleEvalError:
            pass  # an operation that fails is an error only if it is ever executed
    lf = lift(left)
    if isinstance(right, int):
        c = right
        if op == "+":
            return lambda fr: lf(fr) + c
        if op == "-":
            return lambda fr: lf(fr) - c
        if op == "/" and c != 0:
            return lambda fr: lf(fr) // c
        if op == "%" and c != 0:
            return lambda fr: lf(fr) % c
    rf = lift(right)
    if op == "+":
        return lambda fr: lf(fr) + rf(fr)
    if op == "-":
        return lambda fr: lf(fr) - rf(fr)
    if op == "*":

        def mul(fr: Frame) -> int:
            value = lf(fr) * rf(fr)
            if INT_MIN <= value <= INT_MAX:
                return value
            raise overflow(value, pos)

        return mul

    def div_or_mod(fr: Frame) -> int:
        a = lf(fr)
        b = rf(fr)
        if b == 0:
            raise fail(f"division by zero: {a} {op} 0", pos)
        return a // b if op == "/" else a % b

    return div_or_mod


def min_max(name: str, args: list[IntCode]) -> IntCode:
    pick = min if name == "min" else max
    if all(isinstance(a, int) for a in args):
        return pick(args)  # type: ignore[type-var]
    fns = [lift(a) for a in args]
    if len(fns) == 2:
        f, g = fns
        if name == "min":
            return lambda fr: x if (x := f(fr)) <= (y := g(fr)) else y
        return lambda fr: x if (x := f(fr)) >= (y := g(fr)) else y
    return lambda fr: pick([f(fr) for f in fns])
