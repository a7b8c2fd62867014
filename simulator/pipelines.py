"""The pipeline schedules a plan runs, evaluated, validated and lowered once per shape.

A plan with ``pp > 1`` runs a schedule (a library name such as ``1f1b`` or a ``.sched``
file) evaluated with the plan's ``pp``, ``microbatches`` and (when it takes one) ``vpp``:
a *shape* (:class:`ScheduleKey`). :class:`Pipelines` evaluates each shape once, straight
into int columns (:func:`pipedsl.library.load_arrays`: no object per action, unless a
broken rule needs its place in the file), validates those once (and lowers them once, the
first time the shape is timed), and answers every question a plan asks of it from
those arrays: peak memory and a lower bound on the time (:mod:`pipedsl.analysis`), once
per distinct residual bytes and stage seconds, and the time itself under each cost model
(:func:`pipedsl.simulator.engine.step_timing`), once per distinct cost model. A policy
schedule's shape is evaluated once too (:meth:`Pipelines.policy`): its layout, its order
at the default cost model (synthesised straight into arrays, :func:`synthesized_arrays`)
and the limits the search tries all read that one policy. A
search over thousands of plans so does each piece of work once, and keeps only compact
arrays per shape, not one object per action.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import NamedTuple

import numpy as np

from pipedsl import library
from pipedsl.analysis import chain_lower_bound, peak_held
from pipedsl.arrays import ActionArrays, B, F, I, ScheduleArrays, W
from pipedsl.errors import PipedslError, ScheduleInvalid
from pipedsl.ir import Schedule
from pipedsl.lang.ast import PolicyBlock
from pipedsl.policy import Policy
from pipedsl.program import Program, ProgramArrays, program_arrays
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.engine import Simulation, simulate, step_timing, steps_timing
from pipedsl.simulator.plan import Plan, PlanError
from pipedsl.synthesize import synthesize, synthesized_steps
from pipedsl.validate import Checked, checked

__all__ = ["Pipelines", "ScheduleKey", "Timing", "load_pipeline", "synthesized_arrays", "synthesized_program"]


def load_pipeline(
    spec: str, *, pp: int, vpp: int, microbatches: int, params: tuple[tuple[str, int], ...] = ()
) -> Schedule:
    """Evaluate schedule ``spec`` with ``pp``, ``microbatches``, if it takes one, ``vpp``, and
    its own ``params`` (``(name, value)`` pairs such as ``max_inflight``); a policy schedule
    is synthesised against the default cost model (B = 2F, I = W = B/2).

    Each file is parsed once per version (:mod:`pipedsl.library`); evaluation runs every call.
    """
    file = library.schedule_file(spec)
    loaded = _load_source(file, pp=pp, vpp=vpp, microbatches=microbatches, params=params)
    return loaded if isinstance(loaded, Schedule) else synthesize(loaded, CostModel())


def _params(
    file: library.ScheduleFile, *, pp: int, vpp: int, microbatches: int, params: tuple[tuple[str, int], ...] = ()
) -> dict[str, int]:
    """The parameters a pipeline plan gives ``file``: ``pp``, ``microbatches``, if it
    takes one, ``vpp``, and the schedule's own ``params``. Raises PlanError for a schedule
    without the first two."""
    names = file.parameters
    for needed in ("pp", "microbatches"):
        if needed not in names:
            raise PlanError(
                f"{file.path}: a pipeline plan sets parameters pp and microbatches, but the schedule has no {needed!r}"
            )
    given = {"pp": pp, "microbatches": microbatches, **dict(params)}
    if "vpp" in names:
        given["vpp"] = vpp
    return given


def _load_source(
    file: library.ScheduleFile, *, pp: int, vpp: int, microbatches: int, params: tuple[tuple[str, int], ...] = ()
) -> Schedule | Policy:
    """``file`` evaluated as :func:`load_pipeline` does, a policy left unsynthesised."""
    return file.load(**_params(file, pp=pp, vpp=vpp, microbatches=microbatches, params=params))


def _load_arrays(file: library.ScheduleFile, key: ScheduleKey, *, refusal_ends: bool) -> ScheduleArrays:
    """The order ``key``'s file states (not a policy), evaluated as :func:`_load_source`
    does but straight into int columns; ``refusal_ends`` as :func:`pipedsl.library.load_arrays` takes it."""
    params = _params(file, pp=key.pp, vpp=max(key.vpp, 1), microbatches=key.microbatches, params=key.params)
    loaded = file.load_arrays(refusal_ends=refusal_ends, **params)
    assert isinstance(loaded, ScheduleArrays)  # the caller asked is_policy first
    return loaded


def _checked_with_position(arrays: ScheduleArrays, objects: Callable[[], Schedule]) -> Checked:
    """``checked(arrays)``; when it breaks a rule, the same check of the schedule's
    objects (``objects()``) raises the error with the action's place in the file."""
    try:
        return checked(arrays)
    except ScheduleInvalid as err:
        checked(objects())
        raise err from None


def states_policy(spec: str) -> bool:
    """Whether ``spec`` is a ``.sched`` file that states a policy (a ``policy`` block)
    rather than an order; raises what parsing it raises. ``library.parsed`` caches per
    version of the file, so an edited file is seen."""
    return any(isinstance(item, PolicyBlock) for item in library.parsed(spec).schedule.items)


def _is_policy(spec: str) -> bool:
    """:func:`states_policy`, False where ``spec`` cannot be parsed (evaluating it
    reports why)."""
    try:
        return states_policy(spec)
    except PipedslError:
        return False


@dataclass(frozen=True, slots=True)
class Timing:
    """What a plan needs from one pipeline simulation.

    ``makespan`` in seconds; ``bubble_ratio`` the idle fraction of devices × makespan;
    ``simulation`` the whole result, when the :class:`Pipelines` keeps them.
    """

    makespan: float
    bubble_ratio: float
    simulation: Simulation | None


class ScheduleKey(NamedTuple):
    """Which evaluated schedule a plan runs: ``vpp`` is 0 for a schedule without a
    ``vpp`` parameter, so that plans differing only there share one evaluation; ``params``
    the schedule's own parameters the plan sets (``Plan.schedule_params``, those the
    schedule declares)."""

    spec: str
    pp: int
    vpp: int
    microbatches: int
    params: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a shape's stages sit: what a cost model needs to resolve for it."""

    num_stages: int
    num_devices: int
    placement: tuple[int, ...]


class _Shape:
    """One validated shape: its layout, its actions, the order validation ran their
    computes in (which every timing of the shape walks) and its program's arrays, lowered
    when first asked for (most shapes of a search are only asked their memory and bound)."""

    __slots__ = ("layout", "actions", "order", "_lowered", "_lower")

    def __init__(
        self, layout: _Layout, actions: ActionArrays, order: np.ndarray, lower: Callable[[], ProgramArrays]
    ) -> None:
        self.layout = layout
        self.actions = actions
        self.order = order
        self._lower: Callable[[], ProgramArrays] | None = lower
        self._lowered: ProgramArrays | None = None

    @property
    def arrays(self) -> ProgramArrays:
        """The lowered program's arrays (:func:`~pipedsl.program.program_arrays`)."""
        if self._lowered is None:
            assert self._lower is not None
            self._lowered, self._lower = self._lower(), None
        return self._lowered


class Pipelines:
    """Evaluates, validates, lowers and times schedules, remembering results.

    One instance shared across many estimates (as :mod:`pipedsl.simulator.search` does)
    evaluates, validates and lowers each (schedule, pp, vpp, microbatches) once, and
    times each distinct cost model once per shape.

    Args:
      keep_simulations: keep each simulation whole (its timeline too); otherwise keep
        only makespan and bubble, as a search of hundreds of simulations needs.
      max_schedules: keep at most this many evaluated :class:`Schedule` objects (one
        object per action), dropping the least recently used; None keeps all. The
        lowered arrays of every shape are kept whatever this says, so a dropped schedule
        is evaluated again only if someone asks for the schedule itself.
      refusals_end: a shape whose first error is a failed ``require`` raises that alone,
        its evaluation ended there (``refusal_ends`` of :func:`pipedsl.library.load_arrays`):
        a search asks only whether the schedule takes the shape, not what else is wrong.
    """

    def __init__(
        self, *, keep_simulations: bool = True, max_schedules: int | None = None, refusals_end: bool = False
    ) -> None:
        self._keep = keep_simulations
        self._max = max_schedules
        self._refusals_end = refusals_end
        self._schedules: OrderedDict[ScheduleKey, Schedule] = OrderedDict()
        self._shapes: dict[ScheduleKey, _Shape] = {}
        self._errors: dict[ScheduleKey, PipedslError] = {}
        self._timings: dict[tuple[ScheduleKey, CostModel], Timing] = {}
        self._steady: dict[tuple[ScheduleKey, CostModel], float] = {}
        self._parameters: dict[str, tuple[str, ...]] = {}
        self._policies: dict[ScheduleKey, Policy] = {}
        self._peaks: dict[tuple[ScheduleKey, tuple[int, ...], tuple[int, ...]], tuple[int, ...]] = {}
        self._bounds: dict[tuple[object, ...], float] = {}
        self._policy: dict[str, bool] = {}
        self._files: dict[str, library.ScheduleFile] = {}

    def key(self, plan: Plan) -> ScheduleKey:
        """The schedule ``plan`` runs (a pipeline plan: ``plan.schedule`` is set)."""
        spec = plan.schedule
        if spec is None:
            raise PlanError(f"{plan.label} is an SPMD plan and runs no schedule")
        declared = self.parameters(spec)
        own = tuple((name, value) for name, value in plan.schedule_params if name in declared)
        return ScheduleKey(spec, plan.pp, plan.vpp if "vpp" in declared else 0, plan.microbatches, own)

    def parameters(self, spec: str) -> tuple[str, ...]:
        """The parameters schedule ``spec`` takes (:func:`pipedsl.library.parameters`),
        read once per instance: a search asks again for every plan."""
        found = self._parameters.get(spec)
        if found is None:
            found = self._parameters[spec] = tuple(library.parameters(spec))
        return found

    def file(self, spec: str) -> library.ScheduleFile:
        """Schedule ``spec``'s file, found and parsed once per instance: each shape of it
        is evaluated from what was read then. Raises what reading it raises."""
        found = self._files.get(spec)
        if found is None:
            found = self._files[spec] = library.schedule_file(spec)
        return found

    def is_policy(self, spec: str) -> bool:
        """Whether ``spec`` is a ``.sched`` file that states a policy rather than an
        order, read once per instance."""
        found = self._policy.get(spec)
        if found is None:
            found = self._policy[spec] = _is_policy(spec)
        return found

    def _evaluate(self, key: ScheduleKey) -> Schedule:
        """``key``'s schedule as objects: a policy synthesised against the default cost
        model, as :func:`load_pipeline` does; kept while it is among the most recent."""
        error = self._errors.get(key)
        if error is not None:
            raise error
        try:
            if self.is_policy(key.spec):
                # The policy evaluated once (layout() may have read it already).
                schedule = synthesize(self.policy(key), CostModel())
            else:
                schedule = load_pipeline(
                    key.spec, pp=key.pp, vpp=max(key.vpp, 1), microbatches=key.microbatches, params=key.params
                )
        except PipedslError as err:
            self._errors[key] = err
            raise
        self._schedules[key] = schedule
        if self._max is not None and len(self._schedules) > self._max:
            self._schedules.popitem(last=False)
        return schedule

    def policy(self, key: ScheduleKey) -> Policy:
        """The policy ``key``'s schedule states (``spec`` is a policy schedule, see
        :meth:`is_policy`), evaluated once per instance. Raises what evaluation raised."""
        found = self._policies.get(key)
        if found is not None:
            return found
        error = self._errors.get(key)
        if error is not None:
            raise error
        try:
            loaded = _load_source(
                self.file(key.spec), pp=key.pp, vpp=max(key.vpp, 1), microbatches=key.microbatches, params=key.params
            )
        except PipedslError as err:
            self._errors[key] = err
            raise
        if not isinstance(loaded, Policy):
            raise PlanError(f"{key.spec} states an order, not a policy")
        self._policies[key] = loaded
        return loaded

    def layout(self, key: ScheduleKey) -> _Layout:
        """Where the stages of ``key``'s schedule sit; for a policy schedule, the policy's
        own placement, without synthesising an order. Raises what evaluation raised."""
        shape = self._shapes.get(key)
        if shape is not None:
            return shape.layout
        if not self.is_policy(key.spec):
            return self._shape(key).layout
        policy = self.policy(key)
        return _Layout(policy.num_stages, policy.num_devices, policy.placement)

    def schedule(self, key: ScheduleKey) -> Schedule:
        """The schedule evaluated for ``key`` (validated); raises what evaluation or
        validation raised."""
        schedule = self._schedules.get(key)
        if schedule is None:
            return self._evaluate(key)
        self._schedules.move_to_end(key)
        return schedule

    def _shape(self, key: ScheduleKey) -> _Shape:
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self._validated(key)
        return shape

    def _validated(self, key: ScheduleKey) -> _Shape:
        """``key``'s schedule validated (lowered when first timed), with no object per action.
        An order a file states is evaluated straight into int columns (and again as
        objects only when it breaks a rule, for the error's place in the file); a policy
        is synthesised against the default cost model, as :func:`load_pipeline` does,
        straight into arrays (:func:`synthesized_arrays`)."""
        error = self._errors.get(key)
        if error is not None:
            raise error
        try:
            if self.is_policy(key.spec):
                policy = self.policy(key)
                arrays, order = synthesized_arrays(policy, CostModel())
                layout = _Layout(policy.num_stages, policy.num_devices, policy.placement)
                return _Shape(layout, arrays.actions, order, lambda: arrays)
            schedule = _load_arrays(self.file(key.spec), key, refusal_ends=self._refusals_end)
            found = _checked_with_position(schedule, lambda: self.schedule(key))
        except PipedslError as err:
            self._errors[key] = err
            raise
        layout = _Layout(schedule.num_stages, schedule.num_devices, schedule.placement)
        # Only what lowering reads is kept for it.
        lower = partial(program_arrays, found.actions, found.upstream, layout.placement)
        return _Shape(layout, found.actions, found.order, lower)

    def peak_residual_bytes(
        self, key: ScheduleKey, residual: tuple[int, ...], weight_residual: tuple[int, ...]
    ) -> tuple[int, ...]:
        """Per device, the most activation bytes held at once, shape (D,), when one
        microbatch's ``F`` on stage s keeps ``residual[s]`` bytes until its ``B`` or ``I``,
        and a split backward's ``I`` leaves ``weight_residual[s]`` until its ``W``; once
        per distinct pair (plans that differ in ZeRO 0 or 1 keep the same bytes)."""
        memo = (key, residual, weight_residual)
        found = self._peaks.get(memo)
        if found is None:
            actions = self._shape(key).actions
            found = self._peaks[memo] = tuple(int(p) for p in peak_held(actions, residual, weight_residual))
        return found

    def lower_bound_s(self, key: ScheduleKey, seconds: np.ndarray) -> float:
        """Seconds the schedule of ``key`` takes at least, without simulating it, when
        ``seconds[k, s]`` is the duration of kind k (F, B, I, W) on stage s (shape
        (4, S)): :func:`pipedsl.analysis.chain_lower_bound`, once per distinct ``seconds``."""
        memo = (key, seconds.shape, seconds.dtype.str, seconds.tobytes())
        found = self._bounds.get(memo)
        if found is None:
            found = self._bounds[memo] = chain_lower_bound(self._shape(key).actions, seconds)
        return found

    @property
    def num_simulations(self) -> int:
        """Distinct simulations run so far."""
        return len(self._timings)

    def timing(self, key: ScheduleKey, costs: CostModel) -> Timing:
        """Time the schedule of ``key`` under ``costs``, once per distinct costs."""
        found = self._timings.get((key, costs))
        if found is None:
            shape = self._shape(key)
            if self._keep:
                result = simulate(Program(self.schedule(key), arrays=shape.arrays), costs)
                found = Timing(result.makespan, result.bubble_ratio, result)
            else:
                makespan, bubble = step_timing(shape.arrays, costs.resolve(shape.layout), order=shape.order)
                found = Timing(makespan, bubble, None)
            self._timings[(key, costs)] = found
        return found

    def steady_s(self, key: ScheduleKey, costs: CostModel) -> float:
        """Seconds of a step of ``key``'s schedule in a long run under ``costs`` (its
        ``update`` per stage between steps, without a barrier): the third of three
        consecutive steps (:func:`~pipedsl.simulator.engine.steps_timing`), once per
        distinct costs."""
        found = self._steady.get((key, costs))
        if found is None:
            shape = self._shape(key)
            updates = costs.device_updates(shape.layout)
            ends = steps_timing(shape.arrays, costs.resolve(shape.layout), updates, steps=3, barrier=False)
            found = self._steady[(key, costs)] = ends[-1] - ends[-2]
        return found


def synthesized_program(policy: Policy, costs: CostModel | None = None) -> ProgramArrays:
    """The order :func:`~pipedsl.synthesize.synthesize` finds, lowered straight to
    int arrays: the arrays ``lower(synthesize(policy, costs))`` has, without an object per
    action.

    The synthesiser builds only complete orders in which every action runs after what it
    needs has run (its pass takes an action once its inputs have arrived), so the order
    needs no validation; a search that times hundreds of synthesised orders asks only
    for these arrays. Raises as ``synthesize``.
    """
    return synthesized_arrays(policy, costs)[0]


def synthesized_arrays(policy: Policy, costs: CostModel | None) -> tuple[ProgramArrays, np.ndarray]:
    """:func:`synthesized_program`, and the rows of its computes in the order the
    synthesiser's pass took them: an order their dependencies allow, which a timing pass
    walks without looking for one (``step_timing(..., order=...)``)."""
    steps = synthesized_steps(policy, costs)
    S, M, D = policy.num_stages, policy.num_microbatches, policy.num_devices
    taken = np.fromiter(chain.from_iterable(steps), dtype=np.int64, count=4 * len(steps)).reshape(-1, 4)
    # Device by device, each device's actions in the order it runs them (a stable sort).
    rows = np.argsort(taken[:, 0], kind="stable")
    flat = taken[rows]
    order = np.empty(len(rows), dtype=np.int64)
    order[rows] = np.arange(len(rows), dtype=np.int64)
    # The pass's kind codes (0 F, 1 the backward, 2 W) as the arrays' (F, B or I, W).
    pass_kind = flat[:, 1]
    codes = np.array([F, I if policy.split_backward else B, W], dtype=np.int8)
    kind, stage, microbatch, device = codes[pass_kind], flat[:, 2], flat[:, 3], flat[:, 0]
    lengths = np.bincount(device, minlength=D)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    position = np.arange(len(flat), dtype=np.int64) - np.repeat(bounds[:-1], lengths)
    actions = ActionArrays(kind, stage, microbatch, device, position, bounds)
    # Row of each (pass kind, stage, microbatch); every one is there exactly once.
    row = np.empty(3 * S * M, dtype=np.int64)
    row[(pass_kind * S + stage) * M + microbatch] = np.arange(len(flat), dtype=np.int64)
    # What each compute reads from the neighbouring stage: F(s - 1) for F(s), the
    # backward of s + 1 for a backward of s (as pipedsl.validate links them).
    forward, backward = pass_kind == 0, pass_kind == 1
    upstream = np.full(len(flat), -1, dtype=np.int64)
    has = forward & (stage > 0)
    upstream[has] = row[(stage[has] - 1) * M + microbatch[has]]
    has = backward & (stage < S - 1)
    upstream[has] = row[(S + stage[has] + 1) * M + microbatch[has]]
    return program_arrays(actions, upstream, policy.placement), order
