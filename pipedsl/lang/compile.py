"""Schedule expressions and ``on device`` bodies to Python closures: the compiler.

:mod:`pipedsl.lang.evaluate` runs a schedule's items and hands this module every expression
and every ``on device`` body. An expression compiles to an int when its value is known at
compile time, or else to a closure over a frame list; a body is compiled once, with every
schedule-level name folded in as a constant and every local given a fixed slot in the
frame, then run once per device. Function calls are inlined at compile time, so a call
costs nothing at run time and recursion cannot even be written (a function sees only the
functions defined above it). No Python source is ever evaluated.

Scoping inside compiled code:

* A function body sees its arguments, the schedule-level names above the ``def`` and the
  functions defined above it; nothing else.
* In an ``on device`` body every ``{ }`` opens a block. ``x = e`` gives a new value to a
  local ``x`` visible from an enclosing block, or else creates ``x`` in the current block;
  a local ends with its block. The device variable and loop variables are read-only, and a
  body cannot rebind a schedule-level name or a function (pick another name).

Bounds, so no input can hang or exhaust memory: at most ``max_actions`` actions; a work
budget of ``WORK_PER_ACTION * max_actions`` steps charged by loops (iterations times the
size of their body) before they start, so an empty loop cannot spin; at most
``COMPILE_BUDGET`` expression nodes after inlining; integers past the 64-bit range (from
``*`` or an assignment) are an error rather than a bignum. :class:`Run` holds the counters
of one evaluation.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pipedsl.errors import ScheduleEvalError, SourcePos
from pipedsl.ir import Action, Kind
from pipedsl.lang import ast
from pipedsl.lang.scope import names_used

__all__ = [
    "ACTIONS",
    "BUILTINS",
    "COMPILE_BUDGET",
    "INT_MAX",
    "INT_MIN",
    "RAISE_THE_LIMIT",
    "WORK_PER_ACTION",
    "Compiler",
    "Env",
    "Frame",
    "Function",
    "IntCode",
    "Local",
    "Run",
    "count",
    "fail",
    "lift",
    "no_output",
    "overflow",
    "require_failed",
    "suggest",
]

#: Loop work allowed per allowed action: room for bodies that loop without emitting.
WORK_PER_ACTION = 25
#: Bound on expression nodes compiled for one schedule, counting inlined function bodies.
COMPILE_BUDGET = 1_000_000

#: How an error about the bound on actions says to lift it, in both the places it is set.
RAISE_THE_LIMIT = (
    "if the schedule really is this large, raise the limit"
    " (--max-actions N on the command line, max_actions=N in Python)"
)

INT_MAX = 2**63 - 1
INT_MIN = -(2**63)
BUILTINS = frozenset({"min", "max"})
ACTIONS = frozenset(kind.value for kind in Kind)

Frame = list[int]
IntFn = Callable[[Frame], int]
BoolFn = Callable[[Frame], bool]
#: Compiled integer expression: an int when its value is known at compile time.
IntCode = int | IntFn
#: Compiled condition: a bool when its value is known at compile time.
BoolCode = bool | BoolFn
StmtFn = Callable[[Frame], None]

_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def fail(message: str, pos: SourcePos) -> ScheduleEvalError:
    return ScheduleEvalError(message, pos=pos)


def lift(code: IntCode) -> IntFn:
    if isinstance(code, int):
        return lambda fr: code
    return code


def _nothing(fr: Frame) -> None:
    return None


def overflow(value: int, pos: SourcePos) -> ScheduleEvalError:
    return fail(f"integer overflow: {value} is outside the 64-bit range", pos)


# ---- arithmetic ----------------------------------------------------------------------


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


def _arith(op: str, left: IntCode, right: IntCode, pos: SourcePos) -> IntCode:
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


def _min_max(name: str, args: list[IntCode]) -> IntCode:
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


# ---- compile-time state --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Function:
    """A ``def`` with the names it closes over, frozen where it was written."""

    node: ast.FuncDef
    consts: Mapping[str, int]
    functions: Mapping[str, Function]


@dataclass(frozen=True, slots=True)
class Local:
    """A body local: its frame slot and what it is (only ``"local"`` may be reassigned)."""

    slot: int
    role: str


@dataclass(slots=True)
class Env:
    """The names visible to the code being compiled."""

    consts: Mapping[str, int]
    functions: Mapping[str, Function]
    args: Mapping[str, IntCode] = field(default_factory=dict)
    blocks: list[dict[str, Local]] = field(default_factory=list)
    inside: str | None = None  # the function whose body this is, for recursion messages

    def local(self, name: str) -> Local | None:
        for block in reversed(self.blocks):
            if name in block:
                return block[name]
        return None

    def visible(self) -> list[str]:
        names = [*self.args, *self.consts, *self.functions]
        for block in self.blocks:
            names.extend(block)
        return names


class Run:
    """Mutable state of one evaluation, read by the compiled closures."""

    __slots__ = ("append", "actions_left", "work_left", "sole_stage", "device", "device_stages", "max_actions")

    def __init__(self, max_actions: int) -> None:
        self.append: Callable[[Action], None] = no_output
        self.actions_left = max_actions
        self.work_left = WORK_PER_ACTION * max_actions
        self.sole_stage: int | None = None
        self.device = 0
        self.device_stages: tuple[int, ...] = ()
        self.max_actions = max_actions

    def charge(self, work: int, pos: SourcePos, what: str) -> None:
        self.work_left -= work
        if self.work_left < 0:
            raise fail(
                f"runaway expansion: {what} goes past the evaluation budget of"
                f" {WORK_PER_ACTION * self.max_actions} steps ({WORK_PER_ACTION} per allowed"
                f" action, max_actions={self.max_actions}); {RAISE_THE_LIMIT}",
                pos,
            )

    def too_many(self, pos: SourcePos) -> ScheduleEvalError:
        return fail(
            f"runaway expansion: more than max_actions={self.max_actions} actions; {RAISE_THE_LIMIT}",
            pos,
        )

    def stage_needed(self, kind: Kind, microbatch: int, pos: SourcePos) -> ScheduleEvalError:
        call = f"{kind.value}({microbatch})"
        if not self.device_stages:
            held = "holds no stage"
        else:
            held = "holds stages " + ", ".join(map(str, self.device_stages))
        return fail(
            f"{call} leaves out the stage, but device {self.device} {held};"
            f" write {kind.value}({microbatch}, stage)",
            pos,
        )


def no_output(action: Action) -> None:
    # Actions are statements, and statements exist only in device bodies, which set the
    # real sink before they run; this stands in between bodies so a misrouted action is
    # loud rather than lost.
    raise RuntimeError("internal error: an action was emitted outside a device body")


class Compiler:
    """Compiles expressions and statements to closures over a frame list."""

    def __init__(self, run: Run, *, function_names: frozenset[str]) -> None:
        self.run = run
        self.nodes = 0
        self.nslots = 0
        self._function_names = function_names

    def new_slot(self) -> int:
        self.nslots += 1
        return self.nslots - 1

    def _spend(self, pos: SourcePos) -> None:
        self.nodes += 1
        if self.nodes > COMPILE_BUDGET:
            raise fail(
                f"the schedule's expressions expand to more than {COMPILE_BUDGET} operations"
                " once function calls are inlined; simplify the functions",
                pos,
            )

    # -- expressions --

    def expr(self, node: ast.Expr, env: Env) -> IntCode:
        """Compile an integer expression."""
        self._spend(node.pos)
        if isinstance(node, ast.IntLit):
            return node.value
        if isinstance(node, ast.Name):
            return self._name(node, env)
        if isinstance(node, ast.BinOp):
            return _arith(node.op, self.expr(node.left, env), self.expr(node.right, env), node.pos)
        if isinstance(node, ast.Neg):
            operand = self.expr(node.operand, env)
            if isinstance(operand, int):
                return -operand
            return lambda fr: -operand(fr)
        if isinstance(node, ast.Call):
            return self._call(node, env)
        raise fail(
            "this is a condition, but a number is needed here; conditions (comparisons,"
            " `and`, `or`, `not`) belong in `if` and `require`",
            node.pos,
        )

    def cond(self, node: ast.Expr, env: Env) -> BoolCode:
        """Compile a condition."""
        self._spend(node.pos)
        if isinstance(node, ast.Compare):
            return self._compare(node, env)
        if isinstance(node, ast.Not):
            operand = self.cond(node.operand, env)
            if isinstance(operand, bool):
                return not operand
            return lambda fr: not operand(fr)
        if isinstance(node, ast.BoolOp):
            return self._bool_op(node, env)
        raise fail(
            "a condition is needed here, such as `x > 0` or `a == b and c < d`;"
            " numbers are not true or false",
            node.pos,
        )

    def _compare(self, node: ast.Compare, env: Env) -> BoolCode:
        test = _COMPARE[node.op]
        left = self.expr(node.left, env)
        right = self.expr(node.right, env)
        if isinstance(left, int) and isinstance(right, int):
            return test(left, right)
        lf = lift(left)
        if isinstance(right, int):
            c = right
            return lambda fr: test(lf(fr), c)
        rf = right
        return lambda fr: test(lf(fr), rf(fr))

    def _bool_op(self, node: ast.BoolOp, env: Env) -> BoolCode:
        left = self.cond(node.left, env)
        right = self.cond(node.right, env)
        if node.op == "and":
            if isinstance(left, bool):
                return right if left else False
            if right is True:
                return left
            rf = _lift_bool(right)
            return lambda fr: left(fr) and rf(fr)
        if isinstance(left, bool):
            return True if left else right
        if right is False:
            return left
        rf = _lift_bool(right)
        return lambda fr: left(fr) or rf(fr)

    def _name(self, node: ast.Name, env: Env) -> IntCode:
        name = node.ident
        if name in env.args:
            return env.args[name]
        local = env.local(name)
        if local is not None:
            return operator.itemgetter(local.slot)
        if name in env.consts:
            return env.consts[name]
        if name in env.functions or name in BUILTINS:
            raise fail(f"`{name}` is a function: call it, as in {name}(...)", node.pos)
        if name in ACTIONS:
            raise fail(f"`{name}` is an action: it can only stand as a statement, {name}(mb)", node.pos)
        raise fail(f"unknown name `{name}`{suggest(name, env.visible())}", node.pos)

    def _call(self, node: ast.Call, env: Env) -> IntCode:
        name = node.func
        function = env.functions.get(name)
        if function is None:
            if name in BUILTINS:
                args = [self.expr(a, env) for a in node.args]
                if not args:
                    raise fail(f"{name}() needs at least one argument", node.pos)
                return _min_max(name, args)
            raise self._not_callable(node, env)
        params = function.node.params
        if len(node.args) != len(params):
            raise fail(
                f"{name} takes {count(len(params), 'argument')} ({', '.join(params)}),"
                f" but this call passes {len(node.args)}",
                node.pos,
            )
        args = {p: self.expr(a, env) for p, a in zip(params, node.args)}
        inner = Env(function.consts, function.functions, args, [], inside=name)
        return self.expr(function.node.body, inner)

    def _not_callable(self, node: ast.Call, env: Env) -> ScheduleEvalError:
        name = node.func
        if name == env.inside:
            return fail(f"`{name}` calls itself: recursion is not allowed", node.pos)
        if name in ACTIONS:
            return fail(
                f"`{name}(...)` is an action: it can only stand as a statement, not inside an expression",
                node.pos,
            )
        if name in env.args or env.local(name) is not None or name in env.consts:
            return fail(f"`{name}` is a number, not a function", node.pos)
        if name in self._function_names:
            return fail(
                f"`{name}` is not defined above this point: a function can call only"
                " functions defined above it (which also rules out recursion)",
                node.pos,
            )
        known = [*env.functions, *BUILTINS]
        return fail(f"unknown function `{name}`{suggest(name, known)}", node.pos)

    # -- statements --

    def block(self, stmts: ast.Block, env: Env, scope: dict[str, Local]) -> tuple[StmtFn, int]:
        """Compile a block in a new scope; returns its code and its cost per run (in nodes)."""
        env.blocks.append(scope)
        try:
            compiled = [self.stmt(s, env) for s in stmts]
        finally:
            env.blocks.pop()
        fns = [fn for fn, _ in compiled if fn is not _nothing]
        cost = sum(c for _, c in compiled)
        if not fns:
            return _nothing, cost
        if len(fns) == 1:
            return fns[0], cost
        if len(fns) == 2:
            first, second = fns

            def pair(fr: Frame) -> None:
                first(fr)
                second(fr)

            return pair, cost
        seq = tuple(fns)

        def sequence(fr: Frame) -> None:
            for fn in seq:
                fn(fr)

        return sequence, cost

    def stmt(self, node: ast.Stmt, env: Env) -> tuple[StmtFn, int]:
        start = self.nodes
        if isinstance(node, ast.Emit):
            fn = self._emit(node, env)
        elif isinstance(node, ast.Assign):
            fn = self._assign(node, env)
        elif isinstance(node, ast.For):
            return self._for(node, env)
        elif isinstance(node, ast.If):
            return self._if(node, env)
        else:
            fn = self._require(node, env)
        return fn, self.nodes - start + 1

    def _emit(self, node: ast.Emit, env: Env) -> StmtFn:
        kind = node.kind
        pos = node.pos
        if len(node.args) not in (1, 2):
            raise fail(
                f"{kind.value} takes a microbatch and, optionally, a stage: {kind.value}(mb) or"
                f" {kind.value}(mb, stage); this call passes {len(node.args)}",
                pos,
            )
        mb = lift(self.expr(node.args[0], env))
        run = self.run
        if len(node.args) == 2:
            stage = lift(self.expr(node.args[1], env))

            def emit(fr: Frame) -> None:
                run.append(Action(kind, stage(fr), mb(fr), pos))
                run.actions_left -= 1
                if run.actions_left < 0:
                    raise run.too_many(pos)

            return emit

        def emit_on_sole_stage(fr: Frame) -> None:
            sole = run.sole_stage
            if sole is None:
                raise run.stage_needed(kind, mb(fr), pos)
            run.append(Action(kind, sole, mb(fr), pos))
            run.actions_left -= 1
            if run.actions_left < 0:
                raise run.too_many(pos)

        return emit_on_sole_stage

    def _assign(self, node: ast.Assign, env: Env) -> StmtFn:
        value = self.expr(node.value, env)
        local = env.local(node.target)
        if local is None:
            self.check_new_name(node.target, node.pos, env, "a binding")
            local = Local(self.new_slot(), "local")
            env.blocks[-1][node.target] = local
        elif local.role != "local":
            raise fail(f"`{node.target}` is the {local.role} and cannot be assigned", node.pos)
        slot = local.slot
        pos = node.pos
        if isinstance(value, int):
            if not INT_MIN <= value <= INT_MAX:
                return _raiser(overflow(value, pos))
            c = value

            def store_constant(fr: Frame) -> None:
                fr[slot] = c

            return store_constant
        fn = value

        def store(fr: Frame) -> None:
            v = fn(fr)
            if not INT_MIN <= v <= INT_MAX:
                raise overflow(v, pos)
            fr[slot] = v

        return store

    def _for(self, node: ast.For, env: Env) -> tuple[StmtFn, int]:
        before = self.nodes
        start = lift(self.expr(node.start, env))
        stop = lift(self.expr(node.stop, env))
        header_cost = self.nodes - before + 1
        if env.local(node.var) is not None:
            raise fail(
                f"`{node.var}` is already a local here; give the loop variable another name",
                node.pos,
            )
        self.check_new_name(node.var, node.pos, env, "a loop variable")
        slot = self.new_slot()
        body, body_cost = self.block(node.body, env, {node.var: Local(slot, "loop variable")})
        per_iteration = body_cost + 1
        run = self.run
        pos = node.pos

        def loop(fr: Frame) -> None:
            a = start(fr)
            b = stop(fr)
            if b <= a:
                if b < a:
                    raise fail(
                        f"negative range {a} .. {b}: the start is past the end"
                        " (an empty range is written `a .. a`)",
                        pos,
                    )
                return
            run.charge((b - a) * per_iteration, pos, f"this loop of {b - a} iterations")
            for i in range(a, b):
                fr[slot] = i
                body(fr)

        return loop, header_cost

    def _if(self, node: ast.If, env: Env) -> tuple[StmtFn, int]:
        cost = 1
        arms: list[tuple[BoolFn, StmtFn]] = []
        orelse: StmtFn | None = None
        decided = False
        for branch in node.branches:
            before = self.nodes
            test = self.cond(branch.cond, env)
            cost += self.nodes - before
            body, body_cost = self.block(branch.body, env, {})
            cost += body_cost
            if decided or test is False:
                continue  # compiled for its errors, but it can never run
            if test is True:
                orelse, decided = body, True
                continue
            arms.append((test, body))
        if node.orelse is not None:
            body, body_cost = self.block(node.orelse, env, {})
            cost += body_cost
            if not decided:
                orelse = body
        if not arms:
            return (orelse or _nothing), cost
        if len(arms) == 1:
            test, then = arms[0]
            if orelse is None:

                def if_then(fr: Frame) -> None:
                    if test(fr):
                        then(fr)

                return if_then, cost
            otherwise = orelse

            def if_then_else(fr: Frame) -> None:
                if test(fr):
                    then(fr)
                else:
                    otherwise(fr)

            return if_then_else, cost
        chain = tuple(arms)
        last = orelse or _nothing

        def if_chain(fr: Frame) -> None:
            for test, then in chain:
                if test(fr):
                    then(fr)
                    return
            last(fr)

        return if_chain, cost

    def _require(self, node: ast.Require, env: Env) -> StmtFn:
        test = self.cond(node.cond, env)
        if test is True:
            return _nothing
        # The values a failed require shows: the names its condition reads, but not the
        # device variable, which the error names already.
        slots: dict[str, int] = {}
        known: dict[str, int] = {}
        for name in names_used(node.cond):
            local = env.local(name)
            if local is not None and local.role != "device variable":
                slots[name] = local.slot
            elif local is None and name in env.consts:
                known[name] = env.consts[name]
        if test is False:
            return _raiser(require_failed(node, known))
        check = test

        def require(fr: Frame) -> None:
            if not check(fr):
                values = {name: fr[slot] for name, slot in slots.items()}
                raise require_failed(node, {**values, **known})

        return require

    def check_new_name(self, name: str, pos: SourcePos, env: Env, what: str) -> None:
        """Refuse to bind ``name`` in a body or place expression where it would shadow."""
        if name in env.consts:
            raise fail(
                f"`{name}` is a schedule-level name and cannot be {what} here; choose another name",
                pos,
            )
        if name in env.functions or name in BUILTINS or name in ACTIONS:
            raise fail(f"`{name}` names a function or action and cannot be {what}", pos)


def _lift_bool(code: BoolCode) -> BoolFn:
    if isinstance(code, bool):
        return lambda fr: code
    return code


def _raiser(error: ScheduleEvalError) -> StmtFn:
    def fail(fr: Frame) -> None:
        raise error

    return fail


def require_failed(node: ast.Require, values: Mapping[str, int]) -> ScheduleEvalError:
    """The error a failed ``require`` raises: its message and ``values`` (what the
    condition read), at the ``require``."""
    message = "requirement failed"
    if node.message:
        message += f": {node.message}"
    if values:
        message += " (" + ", ".join(f"{name} = {value}" for name, value in values.items()) + ")"
    return fail(message, node.pos)


def suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
