"""Syntax tree + parameters to :class:`~pipedsl.ir.Schedule`: a small, bounded interpreter.

The schedule's items run once, top to bottom, with concrete integers: parameters (defaults
or overrides), ``require`` checks, schedule-level bindings, ``def``, the declarations
``stages`` / ``devices`` / ``microbatches`` / ``place``, then the orders (an ``on device``
body or table rows). An ``on device`` body is compiled once into Python closures, with
every schedule-level name folded in as a constant and every local given a fixed slot in a
frame list, then run once per device. Function calls are inlined at compile time, so a
call costs nothing at run time and recursion cannot even be written (a function sees only
the functions defined above it). No Python source is ever evaluated.

Scoping, the rules a reader of a ``.sched`` file needs:

* Schedule level: parameters first, then bindings in source order; a binding may be given
  a new value later (``x = 1 ... x = x + 1``), a parameter may not. Names must be defined
  above their use; a ``def`` or an ``on device`` body sees the values as they stand where
  it is written.
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
``*`` or an assignment) are an error rather than a bignum.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pipedsl import ast
from pipedsl.errors import ScheduleEvalError, SourcePos
from pipedsl.ir import Action, Kind, Schedule

__all__ = ["evaluate", "MAX_ACTIONS", "WORK_PER_ACTION", "COMPILE_BUDGET"]

#: Default bound on the number of actions one evaluation may emit.
MAX_ACTIONS = 4_000_000
#: Loop work allowed per allowed action: room for bodies that loop without emitting.
WORK_PER_ACTION = 25
#: Bound on expression nodes compiled for one schedule, counting inlined function bodies.
COMPILE_BUDGET = 1_000_000

_INT_MAX = 2**63 - 1
_INT_MIN = -(2**63)
_BUILTINS = frozenset({"min", "max"})
_ACTIONS = frozenset(kind.value for kind in Kind)

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


def _fail(message: str, pos: SourcePos) -> ScheduleEvalError:
    return ScheduleEvalError(message, pos=pos)


def _lift(code: IntCode) -> IntFn:
    if isinstance(code, int):
        return lambda fr: code
    return code


def _nothing(fr: Frame) -> None:
    return None


def _overflow(value: int, pos: SourcePos) -> ScheduleEvalError:
    return _fail(f"integer overflow: {value} is outside the 64-bit range", pos)


# ---- arithmetic ----------------------------------------------------------------------


def _fold_arith(op: str, a: int, b: int, pos: SourcePos) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        value = a * b
        if _INT_MIN <= value <= _INT_MAX:
            return value
        raise _overflow(value, pos)
    if b == 0:
        raise _fail(f"division by zero: {a} {op} 0", pos)
    return a // b if op == "/" else a % b


def _arith(op: str, left: IntCode, right: IntCode, pos: SourcePos) -> IntCode:
    """Compile ``left op right``, folding constants and specialising a constant right side."""
    if isinstance(left, int) and isinstance(right, int):
        try:
            return _fold_arith(op, left, right, pos)
        except ScheduleEvalError:
            pass  # an operation that fails is an error only if it is ever executed
    lf = _lift(left)
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
    rf = _lift(right)
    if op == "+":
        return lambda fr: lf(fr) + rf(fr)
    if op == "-":
        return lambda fr: lf(fr) - rf(fr)
    if op == "*":

        def mul(fr: Frame) -> int:
            value = lf(fr) * rf(fr)
            if _INT_MIN <= value <= _INT_MAX:
                return value
            raise _overflow(value, pos)

        return mul

    def div_or_mod(fr: Frame) -> int:
        a = lf(fr)
        b = rf(fr)
        if b == 0:
            raise _fail(f"division by zero: {a} {op} 0", pos)
        return a // b if op == "/" else a % b

    return div_or_mod


def _min_max(name: str, args: list[IntCode]) -> IntCode:
    pick = min if name == "min" else max
    if all(isinstance(a, int) for a in args):
        return pick(args)  # type: ignore[type-var]
    fns = [_lift(a) for a in args]
    if len(fns) == 2:
        f, g = fns
        if name == "min":
            return lambda fr: x if (x := f(fr)) <= (y := g(fr)) else y
        return lambda fr: x if (x := f(fr)) >= (y := g(fr)) else y
    return lambda fr: pick([f(fr) for f in fns])


# ---- compile-time state --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Function:
    """A ``def`` with the names it closes over, frozen where it was written."""

    node: ast.FuncDef
    consts: Mapping[str, int]
    functions: Mapping[str, _Function]


@dataclass(frozen=True, slots=True)
class _Local:
    """A body local: its frame slot and what it is (only ``"local"`` may be reassigned)."""

    slot: int
    role: str


@dataclass(slots=True)
class _Env:
    """The names visible to the code being compiled."""

    consts: Mapping[str, int]
    functions: Mapping[str, _Function]
    args: Mapping[str, IntCode] = field(default_factory=dict)
    blocks: list[dict[str, _Local]] = field(default_factory=list)
    inside: str | None = None  # the function whose body this is, for recursion messages

    def local(self, name: str) -> _Local | None:
        for block in reversed(self.blocks):
            if name in block:
                return block[name]
        return None

    def visible(self) -> list[str]:
        names = [*self.args, *self.consts, *self.functions]
        for block in self.blocks:
            names.extend(block)
        return names


class _Run:
    """Mutable state of one evaluation, read by the compiled closures."""

    __slots__ = ("append", "actions_left", "work_left", "sole_stage", "device", "device_stages", "max_actions")

    def __init__(self, max_actions: int) -> None:
        self.append: Callable[[Action], None] = _no_output
        self.actions_left = max_actions
        self.work_left = WORK_PER_ACTION * max_actions
        self.sole_stage: int | None = None
        self.device = 0
        self.device_stages: tuple[int, ...] = ()
        self.max_actions = max_actions

    def charge(self, work: int, pos: SourcePos, what: str) -> None:
        self.work_left -= work
        if self.work_left < 0:
            raise _fail(
                f"runaway expansion: {what} goes past the evaluation budget of"
                f" {WORK_PER_ACTION * self.max_actions} steps ({WORK_PER_ACTION} per allowed"
                f" action, max_actions={self.max_actions}); raise max_actions if the schedule"
                " really is this large",
                pos,
            )

    def too_many(self, pos: SourcePos) -> ScheduleEvalError:
        return _fail(
            f"runaway expansion: more than max_actions={self.max_actions} actions;"
            " raise max_actions if the schedule really is this large",
            pos,
        )

    def stage_needed(self, kind: Kind, microbatch: int, pos: SourcePos) -> ScheduleEvalError:
        call = f"{kind.value}({microbatch})"
        if not self.device_stages:
            held = "holds no stage"
        else:
            held = "holds stages " + ", ".join(map(str, self.device_stages))
        return _fail(
            f"{call} leaves out the stage, but device {self.device} {held};"
            f" write {kind.value}({microbatch}, stage)",
            pos,
        )


def _no_output(action: Action) -> None:
    # Actions are statements, and statements exist only in device bodies, which set the
    # real sink before they run; this stands in between bodies so a misrouted action is
    # loud rather than lost.
    raise RuntimeError("internal error: an action was emitted outside a device body")


class _Compiler:
    """Compiles expressions and statements to closures over a frame list."""

    def __init__(self, run: _Run, *, function_names: frozenset[str]) -> None:
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
            raise _fail(
                f"the schedule's expressions expand to more than {COMPILE_BUDGET} operations"
                " once function calls are inlined; simplify the functions",
                pos,
            )

    # -- expressions --

    def expr(self, node: ast.Expr, env: _Env) -> IntCode:
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
        raise _fail(
            "this is a condition, but a number is needed here; conditions (comparisons,"
            " `and`, `or`, `not`) belong in `if` and `require`",
            node.pos,
        )

    def cond(self, node: ast.Expr, env: _Env) -> BoolCode:
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
        raise _fail(
            "a condition is needed here, such as `x > 0` or `a == b and c < d`;"
            " numbers are not true or false",
            node.pos,
        )

    def _compare(self, node: ast.Compare, env: _Env) -> BoolCode:
        test = _COMPARE[node.op]
        left = self.expr(node.left, env)
        right = self.expr(node.right, env)
        if isinstance(left, int) and isinstance(right, int):
            return test(left, right)
        lf = _lift(left)
        if isinstance(right, int):
            c = right
            return lambda fr: test(lf(fr), c)
        rf = right
        return lambda fr: test(lf(fr), rf(fr))

    def _bool_op(self, node: ast.BoolOp, env: _Env) -> BoolCode:
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

    def _name(self, node: ast.Name, env: _Env) -> IntCode:
        name = node.ident
        if name in env.args:
            return env.args[name]
        local = env.local(name)
        if local is not None:
            return operator.itemgetter(local.slot)
        if name in env.consts:
            return env.consts[name]
        if name in env.functions or name in _BUILTINS:
            raise _fail(f"`{name}` is a function: call it, as in {name}(...)", node.pos)
        if name in _ACTIONS:
            raise _fail(f"`{name}` is an action: it can only stand as a statement, {name}(mb)", node.pos)
        raise _fail(f"unknown name `{name}`{_suggest(name, env.visible())}", node.pos)

    def _call(self, node: ast.Call, env: _Env) -> IntCode:
        name = node.func
        function = env.functions.get(name)
        if function is None:
            if name in _BUILTINS:
                args = [self.expr(a, env) for a in node.args]
                if not args:
                    raise _fail(f"{name}() needs at least one argument", node.pos)
                return _min_max(name, args)
            raise self._not_callable(node, env)
        params = function.node.params
        if len(node.args) != len(params):
            raise _fail(
                f"{name} takes {_count(len(params), 'argument')} ({', '.join(params)}),"
                f" but this call passes {len(node.args)}",
                node.pos,
            )
        args = {p: self.expr(a, env) for p, a in zip(params, node.args)}
        inner = _Env(function.consts, function.functions, args, [], inside=name)
        return self.expr(function.node.body, inner)

    def _not_callable(self, node: ast.Call, env: _Env) -> ScheduleEvalError:
        name = node.func
        if name == env.inside:
            return _fail(f"`{name}` calls itself: recursion is not allowed", node.pos)
        if name in _ACTIONS:
            return _fail(
                f"`{name}(...)` is an action: it can only stand as a statement, not inside an expression",
                node.pos,
            )
        if name in env.args or env.local(name) is not None or name in env.consts:
            return _fail(f"`{name}` is a number, not a function", node.pos)
        if name in self._function_names:
            return _fail(
                f"`{name}` is not defined above this point: a function can call only"
                " functions defined above it (which also rules out recursion)",
                node.pos,
            )
        known = [*env.functions, *_BUILTINS]
        return _fail(f"unknown function `{name}`{_suggest(name, known)}", node.pos)

    # -- statements --

    def block(self, stmts: ast.Block, env: _Env, scope: dict[str, _Local]) -> tuple[StmtFn, int]:
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

    def stmt(self, node: ast.Stmt, env: _Env) -> tuple[StmtFn, int]:
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

    def _emit(self, node: ast.Emit, env: _Env) -> StmtFn:
        kind = node.kind
        pos = node.pos
        if len(node.args) not in (1, 2):
            raise _fail(
                f"{kind.value} takes a microbatch and, optionally, a stage: {kind.value}(mb) or"
                f" {kind.value}(mb, stage); this call passes {len(node.args)}",
                pos,
            )
        mb = _lift(self.expr(node.args[0], env))
        run = self.run
        if len(node.args) == 2:
            stage = _lift(self.expr(node.args[1], env))

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

    def _assign(self, node: ast.Assign, env: _Env) -> StmtFn:
        value = self.expr(node.value, env)
        local = env.local(node.target)
        if local is None:
            self.check_new_name(node.target, node.pos, env, "a binding")
            local = _Local(self.new_slot(), "local")
            env.blocks[-1][node.target] = local
        elif local.role != "local":
            raise _fail(f"`{node.target}` is the {local.role} and cannot be assigned", node.pos)
        slot = local.slot
        pos = node.pos
        if isinstance(value, int):
            if not _INT_MIN <= value <= _INT_MAX:
                return _raiser(_overflow(value, pos))
            c = value

            def store_constant(fr: Frame) -> None:
                fr[slot] = c

            return store_constant
        fn = value

        def store(fr: Frame) -> None:
            v = fn(fr)
            if not _INT_MIN <= v <= _INT_MAX:
                raise _overflow(v, pos)
            fr[slot] = v

        return store

    def _for(self, node: ast.For, env: _Env) -> tuple[StmtFn, int]:
        before = self.nodes
        start = _lift(self.expr(node.start, env))
        stop = _lift(self.expr(node.stop, env))
        header_cost = self.nodes - before + 1
        if env.local(node.var) is not None:
            raise _fail(
                f"`{node.var}` is already a local here; give the loop variable another name",
                node.pos,
            )
        self.check_new_name(node.var, node.pos, env, "a loop variable")
        slot = self.new_slot()
        body, body_cost = self.block(node.body, env, {node.var: _Local(slot, "loop variable")})
        per_iteration = body_cost + 1
        run = self.run
        pos = node.pos

        def loop(fr: Frame) -> None:
            a = start(fr)
            b = stop(fr)
            if b <= a:
                if b < a:
                    raise _fail(
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

    def _if(self, node: ast.If, env: _Env) -> tuple[StmtFn, int]:
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

    def _require(self, node: ast.Require, env: _Env) -> StmtFn:
        test = self.cond(node.cond, env)
        if test is True:
            return _nothing
        error = _require_failed(node)
        if test is False:
            return _raiser(error)
        check = test

        def require(fr: Frame) -> None:
            if not check(fr):
                raise _require_failed(node)

        return require

    def check_new_name(self, name: str, pos: SourcePos, env: _Env, what: str) -> None:
        """Refuse to bind ``name`` in a body or place expression where it would shadow."""
        if name in env.consts:
            raise _fail(
                f"`{name}` is a schedule-level name and cannot be {what} here; choose another name",
                pos,
            )
        if name in env.functions or name in _BUILTINS or name in _ACTIONS:
            raise _fail(f"`{name}` names a function or action and cannot be {what}", pos)


def _lift_bool(code: BoolCode) -> BoolFn:
    if isinstance(code, bool):
        return lambda fr: code
    return code


def _raiser(error: ScheduleEvalError) -> StmtFn:
    def fail(fr: Frame) -> None:
        raise error

    return fail


def _require_failed(node: ast.Require) -> ScheduleEvalError:
    """The error a failed ``require`` raises: its message, at the ``require``."""
    message = "requirement failed"
    if node.message:
        message += f": {node.message}"
    return _fail(message, node.pos)


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# ---- the schedule level --------------------------------------------------------------


def _coerce_param(name: str, value: object, pos: SourcePos) -> int:
    """An override as an int: ints, and strings that spell one (as a command line gives)."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        text = value.strip()
        digits = text.lstrip("+-")
        # Length first: Python's int() refuses very long digit strings with its own error.
        if digits.isascii() and digits.isdigit() and len(digits) <= 19 and len(text) - len(digits) <= 1:
            number = int(text)
    if number is None or not _INT_MIN <= number <= _INT_MAX:
        raise _fail(f"parameter `{name}` must be a 64-bit integer, got {value!r}", pos)
    return number


class _Evaluator:
    """Runs a schedule's items in order and assembles the Schedule."""

    def __init__(self, module: ast.Module, *, max_actions: int) -> None:
        self.sched = module.schedule
        self.run = _Run(max_actions)
        names = {f.name for f in module.functions}
        names.update(i.name for i in self.sched.items if isinstance(i, ast.FuncDef))
        self.compiler = _Compiler(self.run, function_names=frozenset(names))
        self.max_actions = max_actions
        self.consts: dict[str, int] = {}
        self.functions: dict[str, _Function] = {}
        self.param_names: set[str] = set()
        self.declared: dict[str, tuple[int, SourcePos]] = {}
        self.placement: tuple[int, ...] | None = None
        self.orders: list[tuple[Action, ...]] | None = None
        self.rows: dict[int, tuple[Action, ...]] = {}
        self.rows_pos: SourcePos | None = None

    # -- helpers --

    def _env(self) -> _Env:
        return _Env(self.consts, self.functions)

    def _value(self, node: ast.Expr) -> int:
        code = self.compiler.expr(node, self._env())
        value = code if isinstance(code, int) else code([])
        if not _INT_MIN <= value <= _INT_MAX:
            raise _overflow(value, node.pos)
        return value

    def _truth(self, node: ast.Expr) -> bool:
        code = self.compiler.cond(node, self._env())
        return code if isinstance(code, bool) else code([])

    def _check_free(self, name: str, pos: SourcePos, what: str) -> None:
        if name in _BUILTINS or name in _ACTIONS:
            raise _fail(f"`{name}` is a builtin and cannot name {what}", pos)
        if name in self.functions:
            raise _fail(f"`{name}` is already a function and cannot name {what}", pos)

    # -- items --

    def define(self, node: ast.FuncDef) -> None:
        self._check_free(node.name, node.pos, "a function")
        if node.name in self.consts:
            raise _fail(f"`{node.name}` is already a value and cannot name a function", node.pos)
        seen: set[str] = set()
        for param in node.params:
            if param in seen:
                raise _fail(f"{node.name} names its argument `{param}` twice", node.pos)
            if param in _BUILTINS or param in _ACTIONS or param in self.functions:
                raise _fail(f"`{param}` names a function or action and cannot be an argument", node.pos)
            seen.add(param)
        function = _Function(node, dict(self.consts), dict(self.functions))
        # Compile the body once now so a mistake in it is reported even if it is never called.
        placeholders: dict[str, IntCode] = {p: _placeholder for p in node.params}
        self.compiler.expr(node.body, _Env(function.consts, function.functions, placeholders, [], node.name))
        self.functions[node.name] = function

    def parameters(self, overrides: Mapping[str, object]) -> tuple[tuple[str, int], ...]:
        sched = self.sched
        names = [p.name for p in sched.params]
        unknown = [n for n in overrides if n not in names]
        if unknown:
            listing = ", ".join(names) if names else "none"
            raise _fail(
                f"unknown parameter `{unknown[0]}` for schedule {sched.name}"
                f"{_suggest(unknown[0], names)} (its parameters: {listing})",
                sched.pos,
            )
        values: list[tuple[str, int]] = []
        for param in sched.params:
            self._check_free(param.name, param.pos, "a parameter")
            if param.name in self.consts:
                raise _fail(f"parameter `{param.name}` is declared twice", param.pos)
            if param.name in overrides:
                value = _coerce_param(param.name, overrides[param.name], param.pos)
            else:
                value = self._value(param.default)
            self.consts[param.name] = value
            self.param_names.add(param.name)
            values.append((param.name, value))
        return tuple(values)

    def item(self, item: ast.Item) -> None:
        if isinstance(item, ast.Require):
            if not self._truth(item.cond):
                raise _require_failed(item)
        elif isinstance(item, ast.Assign):
            if item.target in self.param_names:
                raise _fail(
                    f"`{item.target}` is a parameter and cannot be rebound; choose another name",
                    item.pos,
                )
            self._check_free(item.target, item.pos, "a value")
            self.consts[item.target] = self._value(item.value)
        elif isinstance(item, ast.FuncDef):
            self.define(item)
        elif isinstance(item, ast.Declare):
            self.declare(item)
        elif isinstance(item, ast.Place):
            self.place(item)
        elif isinstance(item, ast.PlaceList):
            self.place_list(item)
        elif isinstance(item, ast.OnDevice):
            self.on_device(item)
        else:
            self.table_row(item)

    def declare(self, item: ast.Declare) -> None:
        if item.what in self.declared:
            first = self.declared[item.what][1]
            raise _fail(f"`{item.what}` is declared twice (first at line {first.line})", item.pos)
        if item.what in ("stages", "devices") and self.placement is not None:
            raise _fail(f"declare `{item.what}` before `place`", item.pos)
        value = self._value(item.value)
        if value < 1:
            raise _fail(f"{item.what} must be at least 1, got {value}", item.pos)
        if value > self.max_actions:
            raise _fail(
                f"{item.what} = {value} is more than max_actions={self.max_actions} allows",
                item.pos,
            )
        self.declared[item.what] = (value, item.pos)

    def _need(self, what: str, pos: SourcePos, *names: str) -> tuple[int, ...]:
        missing = [n for n in names if n not in self.declared]
        if missing:
            raise _fail(f"declare `{missing[0]}` before {what}", pos)
        return tuple(self.declared[n][0] for n in names)

    def _place_check(self, pos: SourcePos) -> tuple[int, int]:
        if self.placement is not None:
            raise _fail("`place` is declared twice", pos)
        stages, devices = self._need("`place`", pos, "stages", "devices")
        return stages, devices

    def _on_device_in_range(self, stage: int, device: int, devices: int, pos: SourcePos) -> None:
        if not 0 <= device < devices:
            raise _fail(
                f"place puts stage {stage} on device {device}, but the devices are 0 .. {devices - 1}",
                pos,
            )

    def place_list(self, item: ast.PlaceList) -> None:
        stages, devices = self._place_check(item.pos)
        if len(item.devices) != stages:
            raise _fail(
                f"place lists {_count(len(item.devices), 'device')}, one per stage, but there"
                f" are {stages} stages",
                item.pos,
            )
        placement = []
        for stage, node in enumerate(item.devices):
            device = self._value(node)
            self._on_device_in_range(stage, device, devices, node.pos)
            placement.append(device)
        self.placement = tuple(placement)

    def place(self, item: ast.Place) -> None:
        stages, devices = self._place_check(item.pos)
        env = self._env()
        self._check_free(item.var, item.pos, "the stage variable")
        self.compiler.check_new_name(item.var, item.pos, env, "the stage variable")
        env.blocks.append({item.var: _Local(0, "stage variable")})
        before = self.compiler.nodes
        code = _lift(self.compiler.expr(item.value, env))
        self.run.charge(stages * (self.compiler.nodes - before + 1), item.pos, f"placing {stages} stages")
        frame = [0]
        placement = []
        for stage in range(stages):
            frame[0] = stage
            device = code(frame)
            self._on_device_in_range(stage, device, devices, item.value.pos)
            placement.append(device)
        self.placement = tuple(placement)

    def _orders_pos_check(self, pos: SourcePos) -> tuple[int, ...]:
        if self.placement is None:
            self._need("the device orders", pos, "stages", "devices")
            raise _fail("declare `place` before the device orders", pos)
        return self.placement

    def on_device(self, item: ast.OnDevice) -> None:
        placement = self._orders_pos_check(item.pos)
        if self.orders is not None or self.rows:
            raise _fail(
                "a schedule has one `on device` block, or table rows, not both or several",
                item.pos,
            )
        devices = self.declared["devices"][0]
        env = self._env()
        self._check_free(item.var, item.pos, "the device variable")
        self.compiler.check_new_name(item.var, item.pos, env, "the device variable")
        self.compiler.nslots = 0
        slot = self.compiler.new_slot()
        body, cost = self.compiler.block(item.body, env, {item.var: _Local(slot, "device variable")})
        nslots = self.compiler.nslots
        held: list[list[int]] = [[] for _ in range(devices)]
        for stage, device in enumerate(placement):
            held[device].append(stage)
        run = self.run
        orders = []
        for device in range(devices):
            out: list[Action] = []
            run.append = out.append
            run.device = device
            run.device_stages = tuple(held[device])
            run.sole_stage = held[device][0] if len(held[device]) == 1 else None
            run.charge(cost + 1, item.pos, f"running the body for device {device}")
            frame = [0] * nslots
            frame[slot] = device
            try:
                body(frame)
            except ScheduleEvalError as err:
                raise ScheduleEvalError(
                    f"{err.message} (evaluating {item.var} = {device})", pos=err.pos
                ) from None
            orders.append(tuple(out))
        run.append = _no_output
        self.orders = orders

    def table_row(self, item: ast.TableRow) -> None:
        self._orders_pos_check(item.pos)
        if self.orders is not None:
            raise _fail("a schedule has one `on device` block, or table rows, not both", item.pos)
        devices = self.declared["devices"][0]
        if not 0 <= item.device < devices:
            raise _fail(
                f"row for device {item.device}, but the devices are 0 .. {devices - 1}", item.pos
            )
        if item.device in self.rows:
            raise _fail(f"device {item.device} has two rows", item.pos)
        self.run.actions_left -= len(item.cells)
        if self.run.actions_left < 0:
            raise self.run.too_many(item.pos)
        self.rows[item.device] = tuple(Action(c.kind, c.stage, c.microbatch, c.pos) for c in item.cells)
        self.rows_pos = self.rows_pos or item.pos

    def finish(self, params: tuple[tuple[str, int], ...], name: str | None, source: str | None) -> Schedule:
        sched = self.sched
        for what in ("stages", "devices"):
            if what not in self.declared:
                raise _fail(f"schedule {sched.name} never declares `{what}`", sched.pos)
        if self.placement is None:
            raise _fail(f"schedule {sched.name} never declares `place`, as in `place s -> s`", sched.pos)
        devices = self.declared["devices"][0]
        if self.orders is None:
            if not self.rows:
                raise _fail(
                    f"schedule {sched.name} has neither an `on device` block nor table rows",
                    sched.pos,
                )
            missing = [d for d in range(devices) if d not in self.rows]
            if missing:
                raise _fail(
                    f"the table has no row for device {missing[0]}; write `device {missing[0]}:`"
                    " (a row may be empty)",
                    self.rows_pos or sched.pos,
                )
            self.orders = [self.rows[d] for d in range(devices)]
        if "microbatches" in self.declared:
            microbatches = self.declared["microbatches"][0]
        elif "microbatches" in self.param_names:
            microbatches = self.consts["microbatches"]
        else:
            microbatches = 1 + max((a.microbatch for order in self.orders for a in order), default=-1)
        return Schedule(
            name=name or sched.name,
            num_stages=self.declared["stages"][0],
            num_devices=devices,
            num_microbatches=microbatches,
            placement=self.placement,
            orders=tuple(self.orders),
            params=params,
            source=source,
        )


def _placeholder(fr: Frame) -> int:
    return 0


def evaluate(
    module: ast.Module,
    *,
    params: Mapping[str, object] | None = None,
    name: str | None = None,
    source: str | None = None,
    max_actions: int = MAX_ACTIONS,
) -> Schedule:
    """Evaluate a parsed schedule under ``params`` (overrides of its defaults).

    Args:
      module: the syntax tree from :func:`pipedsl.parser.parse_source`.
      params: parameter overrides by name; values are ints or strings that spell one.
      name: the Schedule's name; defaults to the name written in the source.
      source: recorded as ``Schedule.source`` (the file path, or None).
      max_actions: the most actions the evaluation may emit, over all devices.

    Returns the Schedule without validating it (see ``Schedule.validate``). Raises
    ScheduleEvalError, with the position of the offending node.
    """
    evaluator = _Evaluator(module, max_actions=max_actions)
    try:
        for function in module.functions:
            evaluator.define(function)
        values = evaluator.parameters(params or {})
        for item in module.schedule.items:
            evaluator.item(item)
    except RecursionError:
        raise _fail(
            "the schedule nests too deeply to evaluate; split long expressions with local bindings",
            module.schedule.pos,
        ) from None
    return evaluator.finish(values, name, source)
