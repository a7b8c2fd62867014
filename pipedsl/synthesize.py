"""Synthesis: a :class:`~pipedsl.policy.Policy` and its costs to a concrete Schedule.

The front end's last step for a policy file: the order the policy leaves open is found
against costs (:class:`~pipedsl.stage_costs.StageCosts`, or any
:class:`~pipedsl.stage_costs.CostSource` such as the simulator's ``CostModel``; by default
the uniform costs of :meth:`~pipedsl.stage_costs.StageCosts.uniform`), and what comes out
is validated, lowered, simulated and run like any other Schedule.

A timed list scheduler. Every device keeps a clock; the device that can act earliest
(ties: the higher device first, so that a backward's news travels before the device
upstream decides) picks, among the actions whose inputs have arrived, the first kind in
the policy's priority order that its limits allow. The chosen action's start and end
follow the rules the simulator applies to the lowered program (start = max(device free,
inputs arrived); a transfer between devices takes the costs' time; a blocking send
keeps the sender until it arrives), so the makespan of each order tried is known exactly
without simulating it, and the fastest is kept. A device may choose later than it could
start (a guarded ``W`` waits to see what arrives first); what it then chooses still
starts when the device was free and its input there, as in the simulator, whose
program runs no waits.

Choices the policy leaves open are tried as a few :class:`Variant`\\ s (as the zero-bubble
paper's scheduler tries its flags):

- *ahead*: how many forwards a device keeps ahead of its backwards. Below that count a
  ready forward comes first (the device fills the pipe); at it no forward runs. The
  policy's ``warmup`` fixes it; else the synthesiser tries 1F1B's count (S - s on a device
  whose first stage is s), eager 1F1B's (2(S - s) - 1), the count that fits before the
  first backward can return under the costs, and none (the limits alone bound the
  forwards, and the priority order decides);
- *strict*: with a count, whether a backward waits until the device is that far ahead
  (1F1B's strict alternation);
- *guard*: whether a ``W`` waits for an action above it known to arrive before the ``W``
  would end (``W only in idle time`` always guards). A ``W`` that frees the room a ready
  forward needs runs first, guard or not.

The variants are tried in order and the first of the fastest kept. A pass that cannot beat
the best so far stops early, and once an order takes no longer than every order must (a
device starts when microbatch 0 first reaches it, then runs its actions one at a time),
the variants left are not tried: they could at most tie it.

The library's own orders are a floor: every explicit schedule of the library
(:func:`pipedsl.library.library_schedules`) evaluated at the policy's devices, microbatches
and stages per device, with its stages, microbatches and placement, that keeps its limits
(in-flight pairs, activation bytes, a stated warm-up) is timed the same way, and kept where
it is strictly faster than every variant: the order returned is never slower than a
library order written for this layout (``zbv`` for the V placement; ``1f1b``,
``eager_1f1b``, ``gpipe``, ``zb_h1`` for the flat one). A ``B`` of a written order becomes
its ``I`` then its ``W`` for a split policy. Times include the host's dispatch per task
(:mod:`pipedsl.tasks`) as the simulator charges it; shared compute (``speedup``) is not
modelled here.

Limits: a forward is admitted only if the device's in-flight count and activation bytes
stay within the policy's limits, counting for a microbatch entering a device every stage of
that device it will still pass through (so a V placement cannot fill a device with first
halves whose second halves then find no room). A backward frees nothing until its ``W``
(or ``B``). Per stage, forwards, backwards and weight gradients each take the microbatches
in order. Deterministic: no randomness, no clocks.
"""

from __future__ import annotations

import functools
import heapq
from collections import deque
from dataclasses import dataclass

from pipedsl.arguments import costs_argument, policy_argument
from pipedsl.arrays import ActionArrays, B, F, I, ScheduleArrays, W, make_actions
from pipedsl.errors import PipedslError
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.library import library_schedules, schedule_file
from pipedsl.policy import Policy
from pipedsl.stage_costs import CostSource, StageCosts
from pipedsl.tasks import MAX_COMPUTES

__all__ = [
    "AHEAD",
    "SynthesisError",
    "Variant",
    "synthesize",
    "synthesized_order",
    "synthesized_steps",
    "variants",
]

_INF = float("inf")
_F, _BWD, _W = 0, 1, 2  # kind codes; _BWD is I when split, B otherwise
_ROUNDING = 1e-9
"""A relative margin far above the rounding of a pass's running sums of seconds (about
the actions per device times 2**-53), so that stopping a pass early is never a rounding
step wrong."""


# -- the choices a policy leaves open --------------------------------------------------

AHEAD = ("1f1b", "eager", "timed", "limits")
"""The ahead counts a :class:`Variant` can name."""


@dataclass(frozen=True, slots=True)
class Variant:
    """One setting of the choices a policy leaves to the synthesiser.

    Attributes:
      ahead: forwards a device keeps ahead of its backwards when the policy states no
        warm-up: ``"1f1b"`` (S - s for a device whose first stage is s), ``"eager"``
        (2(S - s) - 1), ``"timed"`` (the forwards that fit before the first backward can
        arrive under the costs: eager's count for B = 2F and free transfers, more for a
        dearer backward or transfer) or ``"limits"`` (no count: the limits and priorities
        decide).
      strict: with an ahead count, a backward runs only when the device is that many
        forwards ahead (or can run no more forwards): 1F1B's strict alternation, which keeps
        the devices in step; without it a ready backward may run earlier.
      guard_w: a ready ``W`` waits for a backward or admissible forward known to arrive
        before the ``W`` would end, when the delay it would cause is more than
        ``(1 - guard_w)`` × its cost (0: never waits; 1: waits rather than delay at all).
        ``W only in idle time`` fixes it at 1.
    """

    ahead: str
    strict: bool = False
    guard_w: float = 0.0

    def __post_init__(self) -> None:
        if self.ahead not in AHEAD:
            raise ValueError(f"ahead must be one of {', '.join(AHEAD)}, got {self.ahead!r}")
        if not 0.0 <= self.guard_w <= 1.0:
            raise ValueError(f"guard_w is a fraction in [0, 1], got {self.guard_w!r}")


#: The variants tried without stated warm-up counts. Chosen on the comparison grid of
#: ``bench/bench_synthesis.py`` (depths 2-8, 1-4 microbatches per stage, unequal F/I/W,
#: communication from a tenth of F to F, memory limits pp .. 2pp): each is the fastest
#: somewhere, and together they are never slower there than the zero-bubble paper's
#: scheduler with the best of its settings. The last three came from small communication
#: (a tenth to a quarter of F), where a ``W`` that waits for part of its cost, or a
#: warm-up timed to the backward's return, hides the hops that the first four leave open.
_DEFAULT_VARIANTS = (
    Variant("eager"),
    Variant("1f1b", strict=True, guard_w=1.0),
    Variant("limits"),
    Variant("1f1b"),
    Variant("eager", guard_w=0.5),
    Variant("timed", guard_w=0.25),
    Variant("eager", guard_w=0.75),
)


def variants(policy: Policy) -> tuple[Variant, ...]:
    """The variants :func:`synthesize` tries for ``policy``, in a fixed order (the first
    of equally fast orders wins)."""
    if policy.warmup is None:
        return _DEFAULT_VARIANTS
    # Stated warm-up counts fix the ahead count; "limits" here just means "as stated".
    return (Variant("limits", strict=True, guard_w=1.0), Variant("limits"))


# -- synthesis ----------------------------------------------------------------------


class SynthesisError(PipedslError):
    """The policy's limits leave no order that finishes (a deadlock under the limits)."""


def synthesize(
    policy: Policy,
    costs: CostSource | None = None,
    *,
    tries: tuple[Variant, ...] | None = None,
    library: bool = True,
) -> Schedule:
    """The fastest order found for ``policy`` under ``costs``.

    Args:
      policy: what to synthesise; checked first (:meth:`Policy.check`).
      costs: what the orders are timed against, including communication: a
        :class:`~pipedsl.stage_costs.CostSource` (the simulator's ``CostModel``, or
        :class:`~pipedsl.stage_costs.StageCosts` for the policy's stages); None, the
        uniform costs of :meth:`StageCosts.uniform` (:data:`~pipedsl.stage_costs.UNIFORM`).
      tries: the variants to try (default: :func:`variants`); the first fastest wins.
      library: also time the library's explicit orders for the policy's layout that keep
        its limits (the same stages, devices, microbatches and placement), and keep one
        where it is strictly faster than every variant's: the order returned is never
        slower than any of them (see the module docstring).

    Returns an unvalidated Schedule named and parameterised like the policy.

    Raises:
      ScheduleInvalid: a limit no order can keep (rule ``unsatisfiable-policy``), at the
        limit's source position.
      SynthesisError: every variant deadlocks under the limits.
      PipedslError: ``policy`` is not a Policy, or ``costs`` not a cost source.
    """
    policy = policy_argument(policy, function="synthesize")
    costs = costs_argument(costs, function="synthesize")
    kinds = (Kind.F, Kind.I if policy.split_backward else Kind.B, Kind.W)
    orders = []
    for order in synthesized_order(policy, costs, tries, library=library):
        codes, stages, microbatches = zip(*order) if order else ((), (), ())
        made = make_actions(list(map(kinds.__getitem__, codes)), stages, microbatches, [None] * len(order))
        orders.append(tuple(made))
    return _skeleton(policy, tuple(orders))


def synthesized_order(
    policy: Policy, costs: CostSource | None = None, tries: tuple[Variant, ...] | None = None, *, library: bool = True
) -> Order:
    """The order :func:`synthesize` finds, as per-device (kind code, stage, microbatch)
    triples (codes 0 F, 1 the backward, 2 W): the fastest variant's, the first of equally
    fast ones. Raises as :func:`synthesize`."""
    order: Order = [[] for _ in range(policy.num_devices)]
    for d, kind, stage, microbatch in synthesized_steps(policy, costs, tries, library=library):
        order[d].append((kind, stage, microbatch))
    return order


def synthesized_steps(
    policy: Policy, costs: CostSource | None = None, tries: tuple[Variant, ...] | None = None, *, library: bool = True
) -> Steps:
    """:func:`synthesized_order`'s actions as (device, kind code, stage, microbatch), in the
    order its pass took them: each after every action it needs, so the order a timing
    pass can run the lowered program's computes in. Raises as :func:`synthesize`."""
    policy.check()
    layout = _skeleton(policy, ())
    stage_costs = StageCosts.uniform(layout) if costs is None else costs.resolve(layout)
    _check_bytes(policy, stage_costs)
    plan = _Plan(policy, stage_costs)
    best: tuple[float, Steps] | None = None
    failure: SynthesisError | None = None
    for variant in tries if tries is not None else variants(policy):
        try:
            # A pass that cannot beat the best so far stops early (see _run's ``beat``).
            found = _run(plan, variant, beat=_INF if best is None else best[0])
        except SynthesisError as err:
            failure = failure or err
            continue
        if found is not None and (best is None or found[0] < best[0]):
            best = found
            # No order finishes before the plan's bound: the variants left can at most tie.
            if best[0] <= plan.bound * (1.0 + _ROUNDING):
                break
    if library and (best is None or best[0] > plan.bound * (1.0 + _ROUNDING)):
        # The library's own orders for this layout, where they keep the limits: the
        # synthesised order is never slower than one of them written by hand.
        for order in _library_orders(policy.num_stages, policy.num_devices, policy.num_microbatches,
                                     policy.placement, policy.split_backward):  # fmt: skip
            if not _keeps_limits(plan, order):
                continue
            found = _replay(plan, order, beat=_INF if best is None else best[0])
            if found is not None and (best is None or found[0] < best[0]):
                best = found
    if best is None:
        assert failure is not None
        raise failure
    return best[1]


def _skeleton(policy: Policy, orders: tuple[tuple[Action, ...], ...]) -> Schedule:
    return Schedule(
        name=policy.name,
        num_stages=policy.num_stages,
        num_devices=policy.num_devices,
        num_microbatches=policy.num_microbatches,
        placement=policy.placement,
        orders=orders or tuple(() for _ in range(policy.num_devices)),
        params=policy.params,
        source=policy.source,
    )


def _min_bytes(policy: Policy, costs: StageCosts, device: int) -> int:
    """The fewest activation bytes any order holds on ``device`` at its peak: one microbatch
    through each of its stages, its weight gradients run as soon as they can."""
    stages = policy.stages_on(device)
    res, wres = costs.residual_bytes, costs.weight_residual_bytes
    held = sum(res[s] for s in stages)
    peak = held
    for s in reversed(stages):
        if policy.split_backward:
            held += wres[s] - res[s]
            peak = max(peak, held)
            held -= wres[s]
        else:
            held -= res[s]
    return peak


def _check_bytes(policy: Policy, costs: StageCosts) -> None:
    if policy.max_activation_bytes is None:
        return
    for device, limit in enumerate(policy.max_activation_bytes):
        need = _min_bytes(policy, costs, device)
        if need > limit:
            raise policy.unsatisfiable(
                "activations",
                f"device {device} may hold {limit} activation bytes, but one microbatch through its"
                f" stages {', '.join(map(str, policy.stages_on(device)))} needs {need} under these costs:"
                " no order keeps this limit",
            )


class _Plan:
    """What every variant of one synthesis shares: per-stage costs, transfers and limits."""

    def __init__(self, policy: Policy, costs: StageCosts) -> None:
        S, D = policy.num_stages, policy.num_devices
        self.policy = policy
        self.S, self.D, self.M = S, D, policy.num_microbatches
        self.split = policy.split_backward
        owner = policy.placement
        self.owner = owner
        self.cost = (costs.forward, costs.input_grad if self.split else costs.backward, costs.weight_grad)
        cross_f = [s + 1 < S and owner[s + 1] != owner[s] for s in range(S)]
        cross_b = [s > 0 and owner[s - 1] != owner[s] for s in range(S)]
        self.x_f = [costs.activation_transfer[s] if cross_f[s] else 0.0 for s in range(S)]
        self.x_b = [costs.gradient_transfer[s] if cross_b[s] else 0.0 for s in range(S)]
        # A blocking send keeps the sender until the value has arrived.
        blocking = not costs.overlap_sends
        self.after_f = [self.x_f[s] if blocking else 0.0 for s in range(S)]
        self.after_b = [self.x_b[s] if blocking else 0.0 for s in range(S)]
        # Whether a stage's forward and its backward receive from, or send to, another
        # device: what decides where a task starts (pipedsl.tasks), and so where a
        # dispatch is charged, as the simulator charges it.
        self.cross_f, self.cross_b = cross_f, cross_b
        self.dispatch = costs.dispatch
        # Deeper stages first: their outputs are what other devices wait for soonest.
        self.stages = [tuple(sorted(policy.stages_on(d), reverse=True)) for d in range(D)]
        self.first = [min(st) for st in self.stages]
        self.entry = [s == self.first[owner[s]] for s in range(S)]
        self.later = [sum(1 for t in self.stages[owner[s]] if t > s) for s in range(S)]
        self.res = costs.residual_bytes
        self.wres = costs.weight_residual_bytes if self.split else costs.residual_bytes
        self.later_bytes = [sum(self.res[t] for t in self.stages[owner[s]] if t > s) for s in range(S)]
        self.max_n = policy.max_inflight or (S * self.M,) * D
        self.max_bytes = policy.max_activation_bytes
        codes = {Kind.F: _F, Kind.I: _BWD, Kind.B: _BWD, Kind.W: _W}
        self.codes = tuple(codes[k] for k in policy.priority or ())
        # Per device, the seconds of all its actions.
        f_cost, bwd, w_cost = self.cost
        per_microbatch = [f_cost[s] + bwd[s] + (w_cost[s] if self.split else 0.0) for s in range(S)]
        self.work = tuple(self.M * sum(per_microbatch[s] for s in self.stages[d]) for d in range(D))
        self.bound = self._bound()

    def _bound(self) -> float:
        """Seconds every order takes at least: a device starts no earlier than microbatch
        0 reaches its first stage (every forward and transfer before it), and then runs
        each of its actions, one at a time; the most over the devices."""
        f_cost = self.cost[_F]
        reach = [0.0] * self.S
        for s in range(1, self.S):
            reach[s] = reach[s - 1] + f_cost[s - 1] + self.x_f[s - 1]
        return max(reach[self.first[d]] + self.work[d] for d in range(self.D))

    def ahead(self, variant: Variant) -> list[int] | None:
        if self.policy.warmup is not None:
            return list(self.policy.warmup)
        S = self.S
        if variant.ahead == "1f1b":
            return [S - f for f in self.first]
        if variant.ahead == "eager":
            return [2 * (S - f) - 1 for f in self.first]
        if variant.ahead == "timed":
            return [self._timed_ahead(f) for f in self.first]
        return None

    def _timed_ahead(self, first: int) -> int:
        """The forwards of stage ``first`` that fit, back to back from its first, before
        that microbatch's backward can arrive there under the costs: its forward to the
        last stage and its backward back, with every hop's transfer (at least one).
        With free transfers and B = 2F this is eager 1F1B's 2(S - s) - 1; a dearer
        backward or transfer leaves room for more."""
        f_cost, bwd = self.cost[_F], self.cost[_BWD]
        trip = sum(f_cost[t] for t in range(first, self.S))
        trip += sum(self.x_f[t] for t in range(first, self.S - 1))
        trip += sum(bwd[t] + self.x_b[t] for t in range(first + 1, self.S))
        if f_cost[first] <= 0:
            return self.M
        return max(int(trip / f_cost[first] * (1 + _ROUNDING)), 1)


Order = list[list[tuple[int, int, int]]]
"""Per device, the actions chosen as (kind code, stage, microbatch) triples."""
Steps = list[tuple[int, int, int, int]]
"""The actions chosen as (device, kind code, stage, microbatch), in the order chosen."""


class _State:
    """What one pass of the list scheduler changes as it goes, per stage or per device."""

    __slots__ = (
        "clock", "nf", "nb", "arr_f", "arr_b", "wq", "live", "reserved", "held", "reserved_bytes",
        "ahead_now", "hold", "due", "version", "steps", "heap",
    )  # fmt: skip

    def __init__(self, S: int, D: int, M: int) -> None:
        self.clock = [0.0] * D  # when each device is next free
        self.nf = [0] * S  # forwards, then backwards, run per stage
        self.nb = [0] * S
        self.arr_f = [0.0 if s == 0 else _INF for s in range(S) for _ in range(M)]  # inputs' arrivals
        self.arr_b = [_INF] * (S * M)
        self.wq: list[deque[tuple[int, int]]] = [deque() for _ in range(D)]  # W waiting per device
        self.live = [0] * D  # microbatches held, and held for later stages, per device
        self.reserved = [0] * D
        self.held = [0] * D  # the same in bytes
        self.reserved_bytes = [0] * D
        self.ahead_now = [0] * D  # forwards ahead of backwards
        self.hold = [0.0] * D  # a guarded W's wait
        self.due = [0.0] * D  # the time of a device's live heap entry; _INF when parked
        self.version = [0] * D
        self.steps: Steps = []
        self.heap = [(0.0, -d, 0) for d in range(D)]
        heapq.heapify(self.heap)


def _picks(order: tuple[int, ...]) -> tuple[int, ...]:
    """For each set of ready kinds (bit 1 the backward, 2 F, 4 W), the first of ``order``
    among them, -1 for none: the choice a device makes, looked up in one step."""
    bits = {_BWD: 1, _F: 2, _W: 4}
    return tuple(next((k for k in order if ready & bits[k]), -1) for ready in range(8))


@dataclass(frozen=True, slots=True)
class _Rules:
    """What a variant fixes for a whole pass: the ahead counts, and the kind a device
    picks among the ready ones (:func:`_picks`) ordinarily and when memory forces a W."""

    cap: list[int]
    strict: bool
    picks: tuple[int, ...]
    forced_picks: tuple[int, ...]
    forced_ok: bool
    guard_w: float
    guard_b: bool
    guard_f: bool

    @classmethod
    def of(cls, plan: _Plan, variant: Variant) -> _Rules:
        if plan.policy.warmup is not None and variant.ahead != "limits":
            raise ValueError("a policy with warm-up counts takes only ahead='limits' variants")
        ahead = plan.ahead(variant)
        capped = ahead is not None
        codes = plan.codes
        rank = {k: i for i, k in enumerate(codes)}
        # With a ready forward, a capped device fills: F first.
        fill = _picks((_F, *(k for k in codes if k != _F)) if capped else codes)
        plain = _picks(codes)
        # The kinds above W in the priority order: what its guard looks out for.
        above_w = codes[: rank[_W]] if plan.split else ()
        return cls(
            cap=ahead if ahead is not None else [plan.S * plan.M] * plan.D,
            strict=capped and variant.strict,
            picks=tuple(fill[r] if r & 2 else plain[r] for r in range(8)),
            forced_picks=_picks((_W, *(k for k in codes if k != _W)) if capped else (*codes[: rank[_F]], _W)),
            forced_ok=capped or (_W in rank and rank[_F] < rank[_W]),
            guard_w=1.0 if plan.policy.idle_w else variant.guard_w,
            guard_b=_BWD in above_w,
            guard_f=_F in above_w,
        )


# The list scheduler's hot loop keeps its state in local names (see the docstring).
def _run(plan: _Plan, variant: Variant, *, beat: float = _INF) -> tuple[float, Steps] | None:
    """One pass of the list scheduler: the makespan (seconds) and the actions in the order
    taken; None once the pass provably cannot finish in under ``beat`` seconds.

    That proof: a device's remaining actions start no earlier than it is next free and do
    not overlap, so the makespan is at least its clock plus its remaining work. The clock
    is the simulator's (an action starts when the device is free and its input has arrived,
    not when the device chose it), so the makespan is the one the simulator reports for the
    order, and ties between passes are ties there too. The pass
    stops when that exceeds ``beat`` by more than the rounding of the running sums
    (:data:`_ROUNDING`), so a pass that stops would have lost to ``beat`` (strictly
    slower), and :func:`synthesize` keeps the same order as with every pass finished.

    The hot loop stays one function on purpose: it runs once per action and per wait, and
    keeping all its state in local names is what makes a pass cheap enough to try several
    (see ``bench/bench_synthesis.py``; split into closures, a pass took about 20% longer).
    What is fixed for the pass comes from :class:`_Rules`, the state from :class:`_State`.
    """
    S, D, M = plan.S, plan.D, plan.M
    split = plan.split
    owner, stages, entry, later = plan.owner, plan.stages, plan.entry, plan.later
    cost_f, cost_b, cost_w = plan.cost
    x_f, x_b, after_f, after_b = plan.x_f, plan.x_b, plan.after_f, plan.after_b
    res, wres, later_bytes, max_n, first = plan.res, plan.wres, plan.later_bytes, plan.max_n, plan.first
    limit_bytes = plan.max_bytes is not None
    max_bytes = plan.max_bytes if plan.max_bytes is not None else (0,) * D
    rules = _Rules.of(plan, variant)
    cap, strict, picks, forced_picks, forced_ok = (
        rules.cap,
        rules.strict,
        rules.picks,
        rules.forced_picks,
        rules.forced_ok,
    )
    guard_w, guard_b, guard_f = rules.guard_w, rules.guard_b, rules.guard_f
    # A compute that starts a task (pipedsl.tasks) takes the task's dispatch too, added as
    # the simulator adds it (one sum per kind and stage), so that the times match exactly.
    dispatch = plan.dispatch
    cross_f, cross_b = plan.cross_f, plan.cross_b
    with_f, with_b, with_w = ([c + dispatch for c in costs] for costs in plan.cost)
    task_sent = [True] * D  # whether a device's last compute sent (or it has none yet)
    task_run = [0] * D  # computes in a device's current task

    def took(d: int, received: bool, cost: float, with_dispatch: float) -> float:
        """Seconds device ``d``'s next compute takes: with the dispatch where it starts a task
        (asked only where there is a dispatch: without one, a compute takes its cost)."""
        if dispatch and (task_sent[d] or received or task_run[d] >= MAX_COMPUTES):
            task_run[d] = 1
            return with_dispatch
        task_run[d] += 1
        return cost

    state = _State(S, D, M)
    clock, nf, nb, arr_f, arr_b, wq = state.clock, state.nf, state.nb, state.arr_f, state.arr_b, state.wq
    live, reserved, held, reserved_bytes = state.live, state.reserved, state.held, state.reserved_bytes
    ahead_now, hold, due, version, heap = state.ahead_now, state.hold, state.due, state.version, state.heap
    take = state.steps.append
    makespan = 0.0
    total = S * M * (3 if split else 2)
    pop, push, pushpop = heapq.heappop, heapq.heappush, heapq.heappushpop
    # Per device, the seconds of work it has still to run, and the bound a pass must stay under.
    work = list(plan.work)
    stop = beat * (1.0 + _ROUNDING)

    # A device's next entry goes in with the next one taken out (heappushpop): when it is
    # the earliest, as after most actions, the heap is not touched at all.
    due_next: tuple[float, int, int] | None = pop(heap)
    while due_next is not None:
        t, nd, ver = due_next
        d = -nd
        if ver != version[d]:
            due_next = pop(heap) if heap else None
            continue
        b_s = f_s = -1
        b_wait = f_wait = _INF
        f_full = f_limited = False
        for s in stages[d]:
            mf = nf[s]
            # The ahead count holds back only microbatches entering the device.
            if mf < M and (ahead_now[d] < cap[d] or not entry[s]):
                r = arr_f[s * M + mf]
                if r < hold[d]:
                    r = hold[d]
                if entry[s] and (
                    live[d] + reserved[d] + 1 + later[s] > max_n[d]
                    or (limit_bytes and held[d] + reserved_bytes[d] + res[s] + later_bytes[s] > max_bytes[d])
                ):
                    f_limited = True
                    if r <= t:
                        f_full = True
                elif r <= t:
                    if f_s < 0:
                        f_s = s
                elif r < f_wait:
                    f_wait = r
        # Strict alternation: a backward only once the device is its full count ahead.
        if not strict or ahead_now[d] >= cap[d] or f_limited or nf[first[d]] == M:
            for s in stages[d]:
                mb = nb[s]
                if mb < nf[s] and (
                    not limit_bytes or not split or held[d] + reserved_bytes[d] + wres[s] - res[s] <= max_bytes[d]
                ):
                    r = arr_b[s * M + mb]
                    if r <= t:
                        if b_s < 0:
                            b_s = s
                    elif r < b_wait:
                        b_wait = r
        w_ready = bool(wq[d]) and t >= hold[d]
        # A ready forward that only memory holds back makes its W urgent: it frees the room.
        forced = f_full and f_s < 0 and w_ready and forced_ok
        kind = (forced_picks if forced else picks)[(b_s >= 0) + 2 * (f_s >= 0) + 4 * w_ready]
        # The guard: going ahead would delay the awaited action by ``t + c - soon``.
        if kind == _W and guard_w > 0.0 and not forced:
            soon = min(b_wait if guard_b else _INF, f_wait if guard_f else _INF)
            c = cost_w[wq[d][0][0]]
            if soon < t + c and t + c - soon > (1.0 - guard_w) * c:
                kind = -2
        if kind == -2:
            hold[d] = soon
            version[d] += 1
            due[d] = soon
            due_next = pushpop(heap, (soon, nd, version[d]))
            continue
        if kind < 0:
            nxt = min(b_wait, f_wait, max(t, hold[d]) if wq[d] else _INF)
            version[d] += 1
            due[d] = nxt
            if nxt < _INF:
                due_next = pushpop(heap, (nxt, nd, version[d]))
            else:
                due_next = pop(heap) if heap else None
            continue

        notify = -1
        arrival = 0.0
        # The simulator's clock: an action starts once the device is free and its input has
        # arrived, which may be before ``t``, the time the device chose it (after a guard's
        # wait that ended in the W it held, or a forward it held back with it).
        start = clock[d]
        if kind == _F:
            s = f_s
            m = nf[s]
            nf[s] = m + 1
            r = arr_f[s * M + m]
            if r > start:
                start = r
            end = start + (took(d, cross_b[s], cost_f[s], with_f[s]) if dispatch else cost_f[s])
            task_sent[d] = cross_f[s]
            work[d] -= cost_f[s]
            if entry[s]:
                reserved[d] += later[s]
                reserved_bytes[d] += later_bytes[s]
            else:
                reserved[d] -= 1
                reserved_bytes[d] -= res[s]
            live[d] += 1
            held[d] += res[s]
            ahead_now[d] += 1
            if s + 1 < S:
                arrival = end + x_f[s]
                arr_f[(s + 1) * M + m] = arrival
                notify = owner[s + 1]
            else:
                arr_b[s * M + m] = end
            free = end + after_f[s]
        elif kind == _BWD:
            s = b_s
            m = nb[s]
            nb[s] = m + 1
            r = arr_b[s * M + m]
            if r > start:
                start = r
            end = start + (took(d, cross_f[s], cost_b[s], with_b[s]) if dispatch else cost_b[s])
            task_sent[d] = cross_b[s]
            work[d] -= cost_b[s]
            ahead_now[d] -= 1
            if split:
                wq[d].append((s, m))
                held[d] += wres[s] - res[s]
            else:
                live[d] -= 1
                held[d] -= res[s]
            if s > 0:
                arrival = end + x_b[s]
                arr_b[(s - 1) * M + m] = arrival
                notify = owner[s - 1]
            free = end + after_b[s]
        else:
            s, m = wq[d].popleft()
            end = start + (took(d, False, cost_w[s], with_w[s]) if dispatch else cost_w[s])
            task_sent[d] = False
            live[d] -= 1
            held[d] -= wres[s]
            free = end
            work[d] -= cost_w[s]
        if free + work[d] > stop:
            return None
        clock[d] = free
        take((d, kind, s, m))
        if end > makespan:
            makespan = end
        if notify >= 0 and notify != d:
            wake = clock[notify] if clock[notify] > arrival else arrival
            if wake < due[notify]:
                version[notify] += 1
                due[notify] = wake
                push(heap, (wake, -notify, version[notify]))
        ver += 1
        version[d] = ver
        due[d] = free
        due_next = pushpop(heap, (free, nd, ver))
    if len(state.steps) < total:
        raise _deadlock(plan, state.steps, live, held)
    return makespan, state.steps


@functools.lru_cache(maxsize=32)
def _library_orders(
    num_stages: int, num_devices: int, num_microbatches: int, placement: tuple[int, ...], split: bool
) -> tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...]:
    """The explicit orders of the schedule library (:func:`pipedsl.library.library_schedules`)
    evaluated at this layout, as per-device (kind code, stage, microbatch) triples: each
    library schedule evaluated with ``pp`` the devices, ``microbatches`` and ``vpp`` the
    stages per device (those of them it declares), kept when it has these stages,
    microbatches and placement. With ``split``, a ``B`` becomes its ``I`` then its ``W``;
    without it, an order with ``I`` and ``W`` does not fit and is left out. A schedule
    whose ``require`` lines refuse the layout is left out too."""
    found = []
    for path in library_schedules().values():
        file = schedule_file(path)
        params = {"pp": num_devices, "microbatches": num_microbatches, "vpp": num_stages // num_devices}
        given = {k: v for k, v in params.items() if k in file.parameters}
        try:
            # Its layout first (its orders are not made for that): most schedules place
            # their stages otherwise, and need not be evaluated.
            if file.layout(**given) not in (None, (num_stages, num_devices, placement)):
                continue
            # Evaluated straight into int columns: only its order's codes are wanted.
            loaded = file.load_arrays(refusal_ends=False, **given)
        except PipedslError:
            continue
        if (
            not isinstance(loaded, ScheduleArrays)
            or (loaded.num_stages, loaded.num_devices, loaded.num_microbatches) != (num_stages, num_devices,
                                                                                      num_microbatches)
            or loaded.placement != placement
        ):  # fmt: skip
            continue
        order = _order_codes(loaded.actions, split)
        if order is not None:
            found.append(order)
    return tuple(found)


def _order_codes(actions: ActionArrays, split: bool) -> tuple[tuple[tuple[int, int, int], ...], ...] | None:
    """A schedule's orders (its ``actions``, device by device) as kind-code triples for a
    split (or fused) backward; None when it splits a backward that ``split`` says is fused."""
    kinds = actions.kind.tolist()
    if not split and any(k in (I, W) for k in kinds):
        return None
    # F stays F; B is the backward, followed by its W where split; I is the backward.
    codes = {F: (_F,), B: (_BWD, _W) if split else (_BWD,), I: (_BWD,), W: (_W,)}
    stages, microbatches, bounds = actions.stage.tolist(), actions.microbatch.tolist(), actions.bounds.tolist()
    return tuple(
        tuple((code, stages[r], microbatches[r]) for r in range(start, stop) for code in codes[kinds[r]])
        for start, stop in zip(bounds, bounds[1:], strict=False)
    )


def _keeps_limits(plan: _Plan, order: tuple[tuple[tuple[int, int, int], ...], ...]) -> bool:
    """Whether a fixed order keeps the policy's limits on every device: the (stage,
    microbatch) pairs and the activation bytes held between a forward and its ``W`` (or
    ``B``), and a stated warm-up (a microbatch enters a device only while fewer forwards
    than the count are ahead of its backwards)."""
    policy, split = plan.policy, plan.split
    warmup = policy.warmup
    for d, actions in enumerate(order):
        held = live = ahead = 0
        for kind, s, _ in actions:
            if kind == _F:
                if warmup is not None and plan.entry[s] and ahead >= warmup[d]:
                    return False
                live += 1
                ahead += 1
                held += plan.res[s]
            elif kind == _BWD:
                ahead -= 1
                if split:
                    held += plan.wres[s] - plan.res[s]
                else:
                    live -= 1
                    held -= plan.res[s]
            else:
                live -= 1
                held -= plan.wres[s]
            if live > plan.max_n[d] or (plan.max_bytes is not None and held > plan.max_bytes[d]):
                return False
    return True


def _replay(
    plan: _Plan, order: tuple[tuple[tuple[int, int, int], ...], ...], *, beat: float = _INF
) -> tuple[float, Steps] | None:
    """A fixed order timed as the simulator times it (start = max(device free, input
    arrived); transfers, blocking sends and each task's dispatch as in :func:`_run`): the
    makespan and the actions in an order their dependencies allow; None when the order
    cannot finish (it waits for an action that never runs) or provably not in under
    ``beat`` seconds (see :func:`_run`)."""
    S, D, M = plan.S, plan.D, plan.M
    owner = plan.owner
    cost_f, cost_b, cost_w = plan.cost
    dispatch = plan.dispatch
    with_f, with_b, with_w = ([c + dispatch for c in costs] for costs in plan.cost)
    arr_f = [0.0 if s == 0 else _INF for s in range(S) for _ in range(M)]
    arr_b = [_INF] * (S * M)
    backward_done = [False] * (S * M)
    clock = [0.0] * D
    at = [0] * D
    task_sent = [True] * D
    task_run = [0] * D
    work = list(plan.work)
    stop = beat * (1.0 + _ROUNDING)
    steps: Steps = []
    makespan = 0.0
    queued = [True] * D
    waiting = list(range(D - 1, -1, -1))
    while waiting:
        d = waiting.pop()
        queued[d] = False
        actions = order[d]
        while at[d] < len(actions):
            kind, s, m = actions[at[d]]
            key = s * M + m
            r = arr_f[key] if kind == _F else arr_b[key] if kind == _BWD else (0.0 if backward_done[key] else _INF)
            if r == _INF:
                break
            start = clock[d] if clock[d] > r else r
            if kind == _F:
                fresh = task_sent[d] or plan.cross_b[s]
                sends, seconds, dispatched = plan.cross_f[s], cost_f[s], with_f[s]
            elif kind == _BWD:
                fresh = task_sent[d] or plan.cross_f[s]
                sends, seconds, dispatched = plan.cross_b[s], cost_b[s], with_b[s]
            else:
                fresh = task_sent[d]
                sends, seconds, dispatched = False, cost_w[s], with_w[s]
            if dispatch and (fresh or task_run[d] >= MAX_COMPUTES):
                end = start + dispatched
                task_run[d] = 1
            else:
                end = start + seconds
                task_run[d] += 1
            task_sent[d] = sends
            work[d] -= seconds
            free = end
            notify = -1
            if kind == _F:
                if s + 1 < S:
                    arr_f[key + M] = end + plan.x_f[s]
                    notify = owner[s + 1]
                else:
                    arr_b[key] = end
                free = end + plan.after_f[s]
            elif kind == _BWD:
                backward_done[key] = True
                if s > 0:
                    arr_b[key - M] = end + plan.x_b[s]
                    notify = owner[s - 1]
                free = end + plan.after_b[s]
            if free + work[d] > stop:
                return None
            clock[d] = free
            makespan = max(makespan, end)
            steps.append((d, kind, s, m))
            at[d] += 1
            if notify >= 0 and notify != d and not queued[notify]:
                queued[notify] = True
                waiting.append(notify)
    if any(at[d] < len(order[d]) for d in range(D)):
        return None
    return makespan, steps


def _deadlock(plan: _Plan, steps: Steps, live: list[int], held: list[int]) -> SynthesisError:
    per_stage = 3 if plan.split else 2
    done = [0] * plan.D
    for step in steps:
        done[step[0]] += 1
    d = next(d for d in range(plan.D) if done[d] < len(plan.stages[d]) * plan.M * per_stage)
    policy = plan.policy
    where = policy.position("inflight") or policy.position("activations") or policy.position("warmup")
    return SynthesisError(
        f"the policy's limits leave device {d} nothing it may run after {done[d]} actions"
        f" (in flight {live[d]}, activation bytes {held[d]}): no order within these limits"
        " finishes; raise the limits",
        pos=where,
    )
