"""The policy IR: limits and priorities from which a schedule is synthesised.

A :class:`Policy` is what a ``.sched`` file with a ``policy`` block evaluates to, in place
of a :class:`~pipedsl.ir.Schedule`: the shape (stages, devices, microbatches, placement),
whether the backward is split into ``I`` and ``W``, per-device limits (peak in-flight
microbatches, peak activation bytes), the priority order among ready actions, whether
``W`` only fills idle time, and optional warm-up counts. The list scheduler in
:mod:`pipedsl.synthesize` turns it into an ordinary Schedule against costs
(:class:`~pipedsl.stage_costs.StageCosts`, which the simulator's cost model resolves to);
it checks here what it can know without costs.

Every stated item keeps its :class:`~pipedsl.errors.SourcePos`, so an unsatisfiable limit
is reported where it was written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipedsl.errors import ScheduleInvalid, SourcePos
from pipedsl.ir import Kind

__all__ = ["Policy", "PolicyItem", "UNSATISFIABLE"]

#: The rule named by a :class:`ScheduleInvalid` for a policy no order can keep.
UNSATISFIABLE = "unsatisfiable-policy"

#: The items a policy states, by the name :meth:`Policy.position` takes.
PolicyItem = str
_ITEMS = ("split", "inflight", "activations", "prefer", "idle_w", "warmup")


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """A schedule stated as limits and priorities, not as an order.

    Attributes:
      name: the schedule's name.
      num_stages, num_devices, num_microbatches: S, D and M, as in a Schedule.
      placement: ``placement[s]`` is the device that owns stage ``s`` (length S).
      split_backward: True when every backward is an ``I`` then a ``W``; False for ``B``.
      max_inflight: per device (length D), the most (stage, microbatch) pairs held between
        ``F`` and ``B`` (or ``W``) at once; None for no limit.
      max_activation_bytes: per device (length D), the most residual bytes held at once,
        as the cost model prices them (``residual_bytes``, ``weight_residual_bytes``);
        None for no limit.
      priority: the kinds in the order a device prefers them when several are ready,
        ``(I, F, W)`` by default (``(B, F)`` without the split).
      idle_w: True when a ``W`` may start only where it delays no ``F`` or ``I`` whose
        input is known to arrive before the ``W`` would end (unless memory forces it);
        False leaves the choice to the synthesiser, which tries both.
      warmup: per device (length D), how many forwards it keeps ahead of its backwards
        (1F1B's warm-up count): below it a ready forward comes first, and a microbatch
        enters the device only while fewer are ahead; None to let the synthesiser choose.
      params: the parameters the policy was evaluated with, in source order.
      source: the file the policy came from, or None.
      positions: ``(item, where)`` pairs for each stated item (see :data:`PolicyItem`:
        ``split``, ``inflight``, ``activations``, ``prefer``, ``idle_w``, ``warmup``).
    """

    name: str
    num_stages: int
    num_devices: int
    num_microbatches: int
    placement: tuple[int, ...]
    split_backward: bool = True
    max_inflight: tuple[int, ...] | None = None
    max_activation_bytes: tuple[int, ...] | None = None
    priority: tuple[Kind, ...] | None = None
    idle_w: bool = False
    warmup: tuple[int, ...] | None = None
    params: tuple[tuple[str, int], ...] = ()
    source: str | None = None
    positions: tuple[tuple[PolicyItem, SourcePos], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.priority is None:
            default = (Kind.I, Kind.F, Kind.W) if self.split_backward else (Kind.B, Kind.F)
            object.__setattr__(self, "priority", default)

    @property
    def parameters(self) -> dict[str, int]:
        return dict(self.params)

    @property
    def label(self) -> str:
        """The name with its parameters, e.g. ``zb_auto(pp=4, microbatches=8)``."""
        params = ", ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.name}({params})" if params else self.name

    def position(self, item: PolicyItem) -> SourcePos | None:
        """Where ``item`` was stated, or None (not stated, or not from text)."""
        return dict(self.positions).get(item)

    def stages_on(self, device: int) -> tuple[int, ...]:
        """The stages device ``device`` owns, in increasing order."""
        return tuple(s for s, d in enumerate(self.placement) if d == device)

    def describe(self) -> str:
        """One line: the split, the limits, the priorities, e.g. for ``pipedsl show``."""
        parts = ["split backward" if self.split_backward else "full backward"]
        if self.max_inflight is not None:
            parts.append("in flight <= " + _per_device(self.max_inflight))
        if self.max_activation_bytes is not None:
            parts.append("activation bytes <= " + _per_device(self.max_activation_bytes))
        parts.append("prefer " + " > ".join(k.value for k in self.priority or ()))
        if self.idle_w:
            parts.append("W only in idle time")
        if self.warmup is not None:
            parts.append("warm-up " + _per_device(self.warmup))
        return "; ".join(parts)

    def check(self) -> None:
        """Check what needs no cost model; raise ScheduleInvalid at the item to blame.

        Rules: the shape (as for a Schedule); the priority names each kind the policy runs
        exactly once; an in-flight limit of at least the number of stages on the device
        (one microbatch is held on all of them at once before its first backward there);
        activation limits and warm-up counts of at least 0 and 1 per stage on the device.
        """
        self._check_shape()
        kinds = {Kind.F, Kind.I, Kind.W} if self.split_backward else {Kind.F, Kind.B}
        priority = self.priority or ()
        if len(set(priority)) != len(priority) or set(priority) != kinds:
            wanted = " > ".join(k.value for k in sorted(kinds, key=lambda k: "IBFW".index(k.value)))
            raise self._fail(
                "prefer",
                f"the priority must name each of {', '.join(sorted(k.value for k in kinds))} once"
                f" ({'split' if self.split_backward else 'full'} backward), as in `prefer {wanted}`;"
                f" got {' > '.join(k.value for k in priority)}",
            )
        for device in range(self.num_devices):
            held = len(self.stages_on(device))
            if self.max_inflight is not None and self.max_inflight[device] < held:
                raise self._fail(
                    "inflight",
                    f"device {device} may hold at most {self.max_inflight[device]} microbatches in flight,"
                    f" but it owns {held} stage{'s' if held != 1 else ''} and a microbatch is held on"
                    f" each at once: no order keeps this limit; allow at least {held}",
                )
            if self.max_activation_bytes is not None and self.max_activation_bytes[device] < 0:
                raise self._fail(
                    "activations",
                    f"device {device}'s activation limit is {self.max_activation_bytes[device]} bytes;"
                    " a limit is at least 0",
                )
            if self.warmup is not None and self.warmup[device] < held:
                raise self._fail(
                    "warmup",
                    f"device {device} may run {self.warmup[device]} forwards before its first backward,"
                    f" but its first backward needs {held} (one per stage it owns)",
                )

    def _check_shape(self) -> None:
        s, d, m = self.num_stages, self.num_devices, self.num_microbatches
        if s < 1 or d < 1 or m < 1:
            raise ScheduleInvalid(f"need at least one stage, device and microbatch; got {s}, {d}, {m}", rule="shape")
        if len(self.placement) != s or any(not 0 <= p < d for p in self.placement):
            raise ScheduleInvalid(
                f"placement {self.placement} does not map {s} stages onto devices 0..{d - 1}", rule="shape"
            )
        idle = sorted(set(range(d)) - set(self.placement))
        if idle:
            raise ScheduleInvalid(
                f"device {idle[0]} owns no stage; place a stage on it or use fewer devices", rule="shape"
            )
        for name in ("max_inflight", "max_activation_bytes", "warmup"):
            values = getattr(self, name)
            if values is not None and len(values) != d:
                raise ScheduleInvalid(f"{name} has {len(values)} values for {d} devices", rule="shape")

    def _fail(self, item: PolicyItem, message: str) -> ScheduleInvalid:
        return ScheduleInvalid(message, rule=UNSATISFIABLE, pos=self.position(item))

    def unsatisfiable(self, item: PolicyItem, message: str) -> ScheduleInvalid:
        """The error for ``item`` when synthesis finds that no order keeps it."""
        if item not in _ITEMS:
            raise ValueError(f"unknown policy item {item!r}")
        return self._fail(item, message)


def _per_device(values: tuple[int, ...]) -> str:
    if len(set(values)) == 1:
        return str(values[0])
    return "[" + ", ".join(map(str, values)) + "]"
