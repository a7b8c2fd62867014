"""Syntax tree + parameters to :class:`~pipedsl.ir.Schedule`: a small, bounded interpreter.

The schedule's items run once, top to bottom, with concrete integers: parameters (defaults
or overrides), ``require`` checks, schedule-level bindings, ``def``, the declarations
``stages`` / ``devices`` / ``microbatches`` / ``place``, then the orders (an ``on device``
body or table rows). Expressions and ``on device`` bodies are compiled to Python closures
by :mod:`pipedsl.lang.compile`, which also states the scoping rules inside function and device
bodies and the bounds on an evaluation (``max_actions``, the work and compile budgets).

The orders come out as :class:`~pipedsl.ir.Action` objects (:func:`evaluate`) or, for a
caller that only validates and times the schedule, as int columns without them
(:func:`evaluate_arrays`); the two differ in nothing else, errors included.

Scoping at the schedule level, the rules a reader of a ``.sched`` file needs: parameters
first, then bindings in source order; a binding may be given a new value later
(``x = 1 ... x = x + 1``), a parameter may not. Names must be defined above their use; a
``def`` or an ``on device`` body sees the values as they stand where it is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from pipedsl.arrays import ActionArrays, ScheduleArrays, paused_collector
from pipedsl.errors import PipedslError, RequirementFailed, ScheduleEvalError, SourcePos, several
from pipedsl.ir import Action, Schedule
from pipedsl.lang import ast
from pipedsl.lang.arith import INT_MAX, INT_MIN, Frame, IntCode, fail, lift, overflow
from pipedsl.lang.budget import (
    COMPILE_BUDGET,
    RAISE_THE_LIMIT,
    WORK_PER_ACTION,
    Run,
    count,
    no_output,
    require_failed,
    suggest,
)
from pipedsl.lang.compile import ACTIONS, BUILTINS, Compiler
from pipedsl.lang.numbers import integer_value
from pipedsl.lang.orders import ActionCodes, ActionList, DeviceOutput, collected, most_microbatch
from pipedsl.lang.policy import PolicySpec, compile_policy
from pipedsl.lang.scope import Bindings, Env, Function, Local, names_used
from pipedsl.policy import Policy

__all__ = ["evaluate", "evaluate_arrays", "evaluate_layout", "MAX_ACTIONS", "WORK_PER_ACTION", "COMPILE_BUDGET"]

T = TypeVar("T")

#: Default bound on the number of actions one evaluation may emit.
MAX_ACTIONS = 4_000_000


def _coerce_param(name: str, value: object, pos: SourcePos) -> int:
    """An override as an int: integers (numpy's too), and text that spells one as the
    language does (as a command line gives)."""
    number = integer_value(value)
    if number is None:
        raise fail(f"parameter `{name}` must be a 64-bit integer, got {value!r}", pos)
    return number


class _Evaluator:
    """Runs a schedule's items in order and assembles the Schedule (or, with ``objects``
    False, its :class:`~pipedsl.arrays.ScheduleArrays`)."""

    def __init__(self, module: ast.Module, *, max_actions: int, name: str | None = None, objects: bool = True) -> None:
        self.sched = module.schedule
        self.label = name or module.schedule.name  # what messages call the schedule
        self.run = Run(max_actions)
        names = {f.name for f in module.functions}
        names.update(i.name for i in self.sched.items if isinstance(i, ast.FuncDef))
        self.compiler = Compiler(self.run, function_names=frozenset(names))
        self.max_actions = max_actions
        # Bindings, not dicts: a ``def`` keeps a snapshot of them, which must cost O(1).
        self.consts: Bindings[int] = Bindings()
        self.functions: Bindings[Function] = Bindings()
        self.param_names: set[str] = set()
        self.declared: dict[str, tuple[int, SourcePos]] = {}
        self.placement: tuple[int, ...] | None = None
        self.objects = objects
        self.outputs: list[DeviceOutput] | None = None
        self.rows: dict[int, tuple[Action, ...]] = {}
        self.rows_pos: SourcePos | None = None
        self.errors: list[PipedslError] = []
        self.failed: set[str] = set()  # names, and "<stages>" and the like, whose definition failed
        self.policy: PolicySpec | None = None

    # -- helpers --

    def _env(self) -> Env:
        return Env(self.consts, self.functions)

    def _value(self, node: ast.Expr) -> int:
        code = self.compiler.expr(node, self._env())
        value = code if isinstance(code, int) else code([])
        if not INT_MIN <= value <= INT_MAX:
            raise overflow(value, node.pos)
        return value

    def _truth(self, node: ast.Expr) -> bool:
        code = self.compiler.cond(node, self._env())
        return code if isinstance(code, bool) else code([])

    def _check_free(self, name: str, pos: SourcePos, what: str) -> None:
        if name in BUILTINS or name in ACTIONS:
            raise fail(f"`{name}` is a builtin and cannot name {what}", pos)
        if name in self.functions:
            raise fail(f"`{name}` is already a function and cannot name {what}", pos)

    # -- items --

    def define(self, node: ast.FuncDef) -> None:
        self._check_free(node.name, node.pos, "a function")
        if node.name in self.consts:
            raise fail(f"`{node.name}` is already a value and cannot name a function", node.pos)
        seen: set[str] = set()
        for param in node.params:
            if param in seen:
                raise fail(f"{node.name} names its argument `{param}` twice", node.pos)
            if param in BUILTINS or param in ACTIONS or param in self.functions:
                raise fail(f"`{param}` names a function or action and cannot be an argument", node.pos)
            seen.add(param)
        function = Function(node, self.consts.snapshot(), self.functions.snapshot())
        # Compile the body once now so a mistake in it is reported even if it is never called.
        placeholders: dict[str, IntCode] = {p: _placeholder for p in node.params}
        self.compiler.expr(node.body, Env(function.consts, function.functions, placeholders, [], node.name))
        self.functions[node.name] = function

    def parameters(self, overrides: Mapping[str, object]) -> tuple[tuple[str, int], ...]:
        sched = self.sched
        names = [p.name for p in sched.params]
        unknown = [n for n in overrides if n not in names]
        if unknown:
            listing = ", ".join(names) if names else "none"
            raise fail(
                f"unknown parameter `{unknown[0]}` for schedule {self.label}"
                f"{suggest(unknown[0], names)} (its parameters: {listing})",
                sched.pos,
            )
        values: list[tuple[str, int]] = []
        for param in sched.params:
            value = self.attempt(self._parameter, param, overrides)
            self.param_names.add(param.name)
            if value is not None:
                values.append((param.name, value))
        return tuple(values)

    def _parameter(self, param: ast.Param, overrides: Mapping[str, object]) -> int:
        self._check_free(param.name, param.pos, "a parameter")
        if param.name in self.consts or param.name in self.param_names:
            raise fail(f"parameter `{param.name}` is declared twice", param.pos)
        if param.name in overrides:
            value = _coerce_param(param.name, overrides[param.name], param.pos)
        else:
            value = self._value(param.default)
        self.consts[param.name] = value
        return value

    # -- several errors at once --

    def attempt(self, step: Callable[..., T], node: object, *args: object) -> T | None:
        """Run ``step(node, *args)``, recording its error and going on to the next item.

        An item that uses a name whose definition failed is skipped silently: its error
        would only echo the first. Returns None when the step failed or was skipped.
        """
        if self.failed and not self.failed.isdisjoint(_needs(node)):
            self.failed.update(_defines(node))
            return None
        try:
            result = step(node, *args)
        except ScheduleEvalError as err:
            self.errors.append(err)
            self.failed.update(_defines(node))
            return None
        self.failed.difference_update(_defines(node))
        return result

    def item(self, item: ast.Item) -> None:
        if isinstance(item, ast.Require):
            if not self._truth(item.cond):
                # What the condition read, then the parameters it did not.
                shown = [n for n in names_used(item.cond) if n in self.consts]
                shown += [p.name for p in self.sched.params if p.name not in shown and p.name in self.consts]
                raise require_failed(item, {n: self.consts[n] for n in shown})
        elif isinstance(item, ast.Assign):
            if item.target in self.param_names:
                raise fail(
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
        elif isinstance(item, ast.PolicyBlock):
            self.policy_block(item)
        else:
            self.table_row(item)

    def declare(self, item: ast.Declare) -> None:
        if item.what in self.declared:
            first = self.declared[item.what][1]
            raise fail(f"`{item.what}` is declared twice (first at line {first.line})", item.pos)
        if item.what in ("stages", "devices") and self.placement is not None:
            raise fail(f"declare `{item.what}` before `place`", item.pos)
        value = self._value(item.value)
        if value < 1:
            raise fail(f"{item.what} must be at least 1, got {value}", item.pos)
        if value > self.max_actions:
            raise fail(
                f"{item.what} = {value} is more than max_actions={self.max_actions} allows; {RAISE_THE_LIMIT}",
                item.pos,
            )
        self.declared[item.what] = (value, item.pos)

    def _need(self, what: str, pos: SourcePos, *names: str) -> tuple[int, ...]:
        missing = [n for n in names if n not in self.declared]
        if missing:
            raise fail(f"declare `{missing[0]}` before {what}", pos)
        return tuple(self.declared[n][0] for n in names)

    def _place_check(self, pos: SourcePos) -> tuple[int, int]:
        if self.placement is not None:
            raise fail("`place` is declared twice", pos)
        stages, devices = self._need("`place`", pos, "stages", "devices")
        return stages, devices

    def _on_device_in_range(self, stage: int, device: int, devices: int, pos: SourcePos) -> None:
        if not 0 <= device < devices:
            raise fail(
                f"place puts stage {stage} on device {device}, but the devices are 0 .. {devices - 1}",
                pos,
            )

    def place_list(self, item: ast.PlaceList) -> None:
        stages, devices = self._place_check(item.pos)
        if len(item.devices) != stages:
            raise fail(
                f"place lists {count(len(item.devices), 'device')}, one per stage, but there are {stages} stages",
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
        env.blocks.append({item.var: Local(0, "stage variable")})
        before = self.compiler.nodes
        code = lift(self.compiler.expr(item.value, env))
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
            raise fail("declare `place` before the device orders", pos)
        return self.placement

    def policy_block(self, item: ast.PolicyBlock) -> None:
        self._orders_pos_check(item.pos)
        if self.outputs is not None or self.rows or self.policy is not None:
            raise fail("a schedule has one `policy` block, or device orders, not both or several", item.pos)
        self._check_free(item.var, item.pos, "the device variable")
        devices = self.declared["devices"][0]
        self.policy = compile_policy(item, compiler=self.compiler, env=self._env(), devices=devices)

    def on_device(self, item: ast.OnDevice) -> None:
        placement = self._orders_pos_check(item.pos)
        if self.policy is not None:
            raise fail("a schedule has a `policy` block or device orders, not both", item.pos)
        if self.outputs is not None or self.rows:
            raise fail(
                "a schedule has one `on device` block, or table rows, not both or several",
                item.pos,
            )
        devices = self.declared["devices"][0]
        env = self._env()
        self._check_free(item.var, item.pos, "the device variable")
        self.compiler.check_new_name(item.var, item.pos, env, "the device variable")
        self.compiler.nslots = 0
        slot = self.compiler.new_slot()
        body, cost = self.compiler.block(item.body, env, {item.var: Local(slot, "device variable")})
        nslots = self.compiler.nslots
        held: list[list[int]] = [[] for _ in range(devices)]
        for stage, device in enumerate(placement):
            held[device].append(stage)
        run = self.run
        outputs: list[DeviceOutput] = []
        for device in range(devices):
            out = ActionList() if self.objects else ActionCodes()
            run.append, run.extend = out.append, out.extend
            run.device = device
            run.device_stages = tuple(held[device])
            run.sole_stage = held[device][0] if len(held[device]) == 1 else None
            run.charge(cost + 1, item.pos, f"running the body for device {device}")
            frame = [0] * nslots
            frame[slot] = device
            try:
                body(frame)
            except ScheduleEvalError as err:
                err.message = f"{err.message} (evaluating {item.var} = {device})"
                err.args = (str(err),)
                raise
            outputs.append(out)
        run.append = run.extend = no_output
        self.outputs = outputs

    def table_row(self, item: ast.TableRow) -> None:
        self._orders_pos_check(item.pos)
        if self.outputs is not None:
            raise fail("a schedule has one `on device` block, or table rows, not both", item.pos)
        if self.policy is not None:
            raise fail("a schedule has a `policy` block or device orders, not both", item.pos)
        devices = self.declared["devices"][0]
        if not 0 <= item.device < devices:
            raise fail(f"row for device {item.device}, but the devices are 0 .. {devices - 1}", item.pos)
        if item.device in self.rows:
            raise fail(f"device {item.device} has two rows", item.pos)
        self.run.actions_left -= len(item.cells)
        if self.run.actions_left < 0:
            raise self.run.too_many(item.pos)
        self.rows[item.device] = tuple(Action(c.kind, c.stage, c.microbatch, c.pos) for c in item.cells)
        self.rows_pos = self.rows_pos or item.pos

    def finish(
        self, params: tuple[tuple[str, int], ...], name: str | None, source: str | None
    ) -> Schedule | ScheduleArrays | Policy:
        sched = self.sched
        for what in ("stages", "devices"):
            if what not in self.declared:
                raise fail(f"schedule {self.label} never declares `{what}`", sched.pos)
        if self.placement is None:
            raise fail(f"schedule {self.label} never declares `place`, as in `place s -> s`", sched.pos)
        name, stages, devices = name or sched.name, self.declared["stages"][0], self.declared["devices"][0]
        if "microbatches" in self.declared:
            stated: int | None = self.declared["microbatches"][0]
        else:
            stated = self.consts["microbatches"] if "microbatches" in self.param_names else None
        if self.policy is not None:
            if stated is None:
                raise fail(
                    f"a policy schedule states how many microbatches it has: declare `microbatches` in {sched.name}",
                    sched.pos,
                )
            return self.policy.policy(
                name=name, num_stages=stages, num_devices=devices, num_microbatches=stated,
                placement=self.placement, params=params, source=source,
            )  # fmt: skip
        outputs = self.outputs if self.outputs is not None else self._table(devices)
        found = collected(outputs, objects=self.objects)
        microbatches = stated if stated is not None else 1 + most_microbatch(found)
        if isinstance(found, ActionArrays):
            return ScheduleArrays(name, stages, devices, microbatches, self.placement, found, params, source)
        return Schedule(name, stages, devices, microbatches, self.placement, found, params, source)

    def _table(self, devices: int) -> list[DeviceOutput]:
        """The table rows as every device's output."""
        if not self.rows:
            raise fail(f"schedule {self.label} has neither an `on device` block nor table rows", self.sched.pos)
        missing = [d for d in range(devices) if d not in self.rows]
        if missing:
            raise fail(
                f"the table has no row for device {missing[0]}; write `device {missing[0]}:` (a row may be empty)",
                self.rows_pos or self.sched.pos,
            )
        outputs: list[DeviceOutput] = []
        for d in range(devices):
            out = ActionList() if self.objects else ActionCodes()
            for action in self.rows[d]:
                out.append(action.kind, action.stage, action.microbatch, action.pos)
            outputs.append(out)
        return outputs


def _placeholder(fr: Frame) -> int:
    return 0


def evaluate(
    module: ast.Module,
    *,
    params: Mapping[str, object] | None = None,
    name: str | None = None,
    source: str | None = None,
    max_actions: int = MAX_ACTIONS,
) -> Schedule | Policy:
    """Evaluate a parsed schedule under ``params`` (overrides of its defaults).

    Args:
      module: the syntax tree from :func:`pipedsl.lang.parser.parse_source`.
      params: parameter overrides by name; values are ints or strings that spell one.
      name: the Schedule's name; defaults to the name written in the source.
      source: recorded as ``Schedule.source`` (the file path, or None).
      max_actions: the most actions the evaluation may emit, over all devices.

    Returns the Schedule without validating it (see :func:`pipedsl.validate`), or for a
    schedule with a ``policy`` block the :class:`~pipedsl.policy.Policy` it states (see
    :mod:`pipedsl.lang.policy`), which the simulator synthesises into a Schedule. Raises
    ScheduleEvalError, with the position of the offending node.
    """
    found = _run(_Evaluator(module, max_actions=max_actions, name=name), module, params, name, source)
    assert not isinstance(found, ScheduleArrays)  # an evaluator that makes objects
    return found


def evaluate_arrays(
    module: ast.Module,
    *,
    params: Mapping[str, object] | None = None,
    name: str | None = None,
    source: str | None = None,
    max_actions: int = MAX_ACTIONS,
    refusal_ends: bool = False,
) -> ScheduleArrays | Policy:
    """:func:`evaluate`, the actions made straight into int columns (no :class:`Action`,
    so no source position each), for a caller that only validates and times; the same errors.

    With ``refusal_ends``, a failed ``require`` that is the first error ends the evaluation
    at once, raised without the errors the items after it would add: the schedule refuses
    the parameters, which is all that a caller trying many of them (the plan search) asks.
    """
    evaluator = _Evaluator(module, max_actions=max_actions, name=name, objects=False)
    found = _run(evaluator, module, params, name, source, refusal_ends=refusal_ends)
    assert not isinstance(found, Schedule)  # an evaluator that makes columns
    return found


def evaluate_layout(
    module: ast.Module, *, params: Mapping[str, object] | None = None, max_actions: int = MAX_ACTIONS
) -> tuple[int, int, tuple[int, ...]]:
    """The stages, devices and placement a parsed schedule declares under ``params``: its
    items evaluated up to its orders (``place`` comes before them), which are not made.
    Raises as :func:`evaluate` does for those items, and ScheduleEvalError for a schedule
    that declares no stages, devices or placement before its orders."""
    evaluator = _Evaluator(module, max_actions=max_actions, objects=False)
    _items(evaluator, module, params, refusal_ends=True, until_orders=True)
    if evaluator.placement is None or "stages" not in evaluator.declared or "devices" not in evaluator.declared:
        raise fail(f"schedule {evaluator.label} declares no placement before its orders", module.schedule.pos)
    return evaluator.declared["stages"][0], evaluator.declared["devices"][0], evaluator.placement


_ORDERS = (ast.OnDevice, ast.TableRow, ast.PolicyBlock)
"""The items that state a schedule's orders, which come after its placement."""


def _run(evaluator: _Evaluator, module: ast.Module, params: Mapping[str, object] | None, name: str | None,
         source: str | None, *, refusal_ends: bool = False) -> Schedule | ScheduleArrays | Policy:  # fmt: skip
    values = _items(evaluator, module, params, refusal_ends=refusal_ends, until_orders=False)
    return evaluator.finish(values, name, source)


def _items(
    evaluator: _Evaluator,
    module: ast.Module,
    params: Mapping[str, object] | None,
    *,
    refusal_ends: bool,
    until_orders: bool,
) -> tuple[tuple[str, int], ...]:
    """Run the schedule's functions, parameters and items (with ``until_orders``, those
    before its first order), raising every error found; the parameters' values."""
    values: tuple[tuple[str, int], ...] = ()
    try:
        for function in module.functions:
            evaluator.attempt(evaluator.define, function)
        values = evaluator.parameters(params or {})
        with paused_collector():  # device bodies make many small objects
            for item in module.schedule.items:
                if until_orders and isinstance(item, _ORDERS):
                    break
                evaluator.attempt(evaluator.item, item)
                if refusal_ends and evaluator.errors and isinstance(evaluator.errors[0], RequirementFailed):
                    break
    except RecursionError:
        nested = "the schedule nests too deeply to evaluate; split long expressions with local bindings"
        evaluator.errors.append(fail(nested, module.schedule.pos))
    if evaluator.errors:
        raise several(evaluator.errors)
    return values


# The declarations items rely on, as the names ``attempt`` records when they fail.
_STRUCTURE = {
    ast.Place: ("<stages>", "<devices>"),
    ast.PlaceList: ("<stages>", "<devices>"),
    ast.OnDevice: ("<stages>", "<devices>", "<place>"),
    ast.TableRow: ("<stages>", "<devices>", "<place>"),
    ast.PolicyBlock: ("<stages>", "<devices>", "<place>"),
}


def _needs(node: object) -> set[str]:
    """The names, and the declarations, that evaluating ``node`` relies on."""
    return {*names_used(node), *_STRUCTURE.get(type(node), ())}


def _defines(node: object) -> tuple[str, ...]:
    """What ``node`` defines for the items after it (which a failure of it leaves undefined)."""
    if isinstance(node, ast.Assign):
        return (node.target,)
    if isinstance(node, (ast.FuncDef, ast.Param)):
        return (node.name,)
    if isinstance(node, ast.Declare):
        return (f"<{node.what}>",)
    if isinstance(node, (ast.Place, ast.PlaceList)):
        return ("<place>",)
    return ()
