"""Schedule expressions and ``on device`` bodies to Python closures: the compiler.

:mod:`pipedsl.lang.evaluate` runs a schedule's items and hands this module every expression
and every ``on device`` body. An expression compiles to an int when its value is known at
compile time, or else to a closure over a frame list; a body is compiled once, with every
schedule-level name folded in as a constant and every local given a fixed slot in the
frame, then run once per device. Function calls are inlined at compile time, so a call
costs nothing at run time and recursion cannot even be written (a function sees only the
functions defined above it). No Python source is ever evaluated. A loop whose body holds only
actions (and conditionals of actions) also gets a whole-range form from :mod:`pipedsl.lang.vector`,
which emits the same actions as numpy columns and leaves every error to the closures.

Scoping inside compiled code:

* A function body sees its arguments, the schedule-level names above the ``def`` and the
  functions defined above it; nothing else.
* In an ``on device`` body every ``{ }`` opens a block. ``x = e`` gives a new value to a
  local ``x`` visible from an enclosing block, or else creates ``x`` in the current block;
  a local ends with its block. The device variable and loop variables are read-only, and a
  body cannot rebind a schedule-level name or a function (pick another name).

The bounds on an evaluation are :mod:`pipedsl.lang.budget`'s, the integer arithmetic is
:mod:`pipedsl.lang.arith`'s and the names in scope are :mod:`pipedsl.lang.scope`'s.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from pipedsl.errors import ScheduleEvalError, SourcePos
from pipedsl.ir import Kind
from pipedsl.lang import ast
from pipedsl.lang.arith import (
    INT_MAX,
    INT_MIN,
    BoolCode,
    BoolFn,
    Frame,
    IntCode,
    StmtFn,
    arith,
    fail,
    lift,
    min_max,
    overflow,
)
from pipedsl.lang.budget import COMPILE_BUDGET, Run, count, require_failed, suggest
from pipedsl.lang.scope import Env, Local, names_used
from pipedsl.lang.vector import compile_loop

__all__ = ["ACTIONS", "BUILTINS", "Compiler"]

BUILTINS = frozenset({"min", "max"})
ACTIONS = frozenset(kind.value for kind in Kind)

_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _nothing(fr: Frame) -> None:
    return None


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
            return arith(node.op, self.expr(node.left, env), self.expr(node.right, env), node.pos)
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
            "a condition is needed here, such as `x > 0` or `a == b and c < d`; numbers are not true or false",
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
                return min_max(name, args)
            raise self._not_callable(node, env)
        params = function.node.params
        if len(node.args) != len(params):
            raise fail(
                f"{name} takes {count(len(params), 'argument')} ({', '.join(params)}),"
                f" but this call passes {len(node.args)}",
                node.pos,
            )
        bound = {p: self.expr(a, env) for p, a in zip(params, node.args)}
        inner = Env(function.consts, function.functions, bound, [], inside=name)
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
                run.append(kind, stage(fr), mb(fr), pos)
                run.actions_left -= 1
                if run.actions_left < 0:
                    raise run.too_many(pos)

            return emit

        def emit_on_sole_stage(fr: Frame) -> None:
            sole = run.sole_stage
            if sole is None:
                raise run.stage_needed(kind, mb(fr), pos)
            run.append(kind, sole, mb(fr), pos)
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
        env.blocks.append({node.var: Local(slot, "loop variable")})
        try:
            whole = compile_loop(node.body, env, slot, run)
        finally:
            env.blocks.pop()

        def loop(fr: Frame) -> None:
            a = start(fr)
            b = stop(fr)
            if b <= a:
                if b < a:
                    raise fail(
                        f"negative range {a} .. {b}: the start is past the end (an empty range is written `a .. a`)",
                        pos,
                    )
                return
            run.charge((b - a) * per_iteration, pos, f"this loop of {b - a} iterations")
            if whole is not None and whole(fr, a, b):
                return
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
