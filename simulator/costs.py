"""The cost model: how long each action and transfer takes, and what memory each holds.

A :class:`CostModel` is written once by a person (on the command line, in a TOML file or
in Python) and then :meth:`CostModel.resolve`\\ d against one schedule into the core's
:class:`~pipedsl.stage_costs.StageCosts`, plain per-stage tuples that the simulator's
inner loop and the policy synthesiser (:mod:`pipedsl.synthesize`) index: a cost model is
the :class:`~pipedsl.stage_costs.CostSource` the synthesiser takes.

Every number is either uniform (one value for every stage) or a tuple with one value per
stage (per stage boundary for the bytes that cross boundaries), so uneven stages (a
heavier first stage with the embedding, a last stage with the logits) are expressed
directly. Defaults follow the usual rules of thumb: a backward costs twice its forward,
and a split backward's two halves (``I`` and ``W``) cost half a backward each.

Devices that share compute (forced CPU devices on one host's cores) are priced by
processor sharing: ``speedup[n - 1]`` says how many times as fast as its priced seconds a
device computes while ``n`` devices compute at once (the simulator,
:mod:`~pipedsl.simulator.engine`, follows how many do). Without it every device has
compute of its own.

Communication uses the alpha-beta link model: one transfer of ``n`` bytes takes
``latency + n / bandwidth`` seconds. Transfers between different pairs of devices, and
successive transfers on one link, do not slow each other down.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from pipedsl.errors import PipedslError
from pipedsl.simulator.tomlfile import read_toml
from pipedsl.stage_costs import Layout, StageCosts

__all__ = ["CostError", "CostModel"]

PerStage = float | tuple[float, ...]
"""Seconds: one number for every stage, or a tuple with one number per stage."""
PerStageBytes = int | tuple[int, ...]
"""Bytes: one whole number for every stage (or boundary), or a tuple with one for each."""


class CostError(PipedslError):
    """A cost model input is malformed, negative, or does not fit the schedule."""


def _number(field: str, value: object, *, where: str = "") -> float:
    # bool is an int subclass; ``forward = true`` in TOML is a mistake, not 1 second.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CostError(f"{field}{where} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise CostError(f"{field}{where} must be a finite number >= 0, got {value!r}")
    return number


def _per_stage(field: str, value: object) -> PerStage:
    """Check a uniform-or-per-stage input; lists become tuples of floats."""
    if isinstance(value, list | tuple):
        if not value:
            raise CostError(f"{field} is an empty list; give one number, or one per stage")
        return tuple(_number(field, v, where=f"[{i}]") for i, v in enumerate(value))
    return _number(field, value)


def _bytes(field: str, value: PerStage) -> PerStageBytes:
    """Bytes are whole numbers; ``1.6e7`` from TOML is fine, ``0.5`` is not."""
    values = value if isinstance(value, tuple) else (value,)
    for i, v in enumerate(values):
        if v != int(v):
            where = f"[{i}]" if isinstance(value, tuple) else ""
            raise CostError(f"{field}{where} must be a whole number of bytes, got {v!r}")
    return tuple(int(v) for v in value) if isinstance(value, tuple) else int(value)


def _expand(field: str, value: PerStage | PerStageBytes, count: int, units: str) -> tuple[float, ...]:
    """``value`` as exactly ``count`` numbers, one per stage (or boundary: ``units``)."""
    if not isinstance(value, tuple):
        return (value,) * count
    if len(value) != count:
        raise CostError(
            f"{field} lists {len(value)} values but the schedule has {count} {units}; "
            f"give one number for all, or exactly {count}"
        )
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """How long actions and transfers take and how much memory a microbatch holds.

    Each per-stage field takes one number for every stage or a tuple of one per stage.

    Attributes:
      forward: seconds per ``F``.
      backward: seconds per ``B``; default ``input_grad + weight_grad`` when both are
        given, else ``2 × forward``.
      input_grad: seconds per ``I``; default ``backward / 2``.
      weight_grad: seconds per ``W``; default ``backward / 2``.
      latency: seconds every transfer takes regardless of size (alpha).
      bandwidth: bytes per second of a link (1/beta); None means bytes cost no time.
      activation_bytes: bytes of one microbatch's activation crossing each stage
        boundary, uniform or a tuple of S-1 (boundary b lies between stages b and b+1).
      gradient_bytes: bytes of the gradient crossing each boundary backwards; default
        ``activation_bytes`` (a gradient has its activation's shape).
      residual_bytes: bytes per microbatch that ``F`` keeps for the backward, per stage;
        held until ``B`` (or ``I``) runs.
      weight_residual_bytes: bytes per microbatch that ``I`` keeps for ``W``, per stage;
        default ``residual_bytes`` (``I`` frees nothing until ``W`` runs). When ``I`` runs,
        the held memory of that microbatch goes from ``residual_bytes`` to this.
      overlap_sends: True (the default) when a send runs beside computation; False when
        the sender cannot compute until its transfer has arrived.
      per_device: False (the default) when the times and residual bytes are per stage;
        True when they describe one device's whole share of the model, so that a device
        holding k stages (interleaved, V placements) spends 1/k of them on each stage.
        This compares schedules with different stages per device on the same model.
        Transfer bytes do not split: a boundary's activation has the same size.
      speedup: for devices that share compute (a host's cores), how many times as fast
        as its priced seconds a device computes while n devices compute at once, at index
        n - 1, one value per device count from 1 to the schedule's devices (processor
        sharing; :meth:`~pipedsl.simulator.hardware.Cluster.speedup` gives them for a
        cluster); None (the default) when every device has compute of its own.
      serial: with ``speedup``, whether the devices' computes run one at a time, in the
        order one host thread dispatches them (:func:`pipedsl.program.dispatch_order`),
        each at ``speedup[0]``: XLA's CPU client runs a program that spans several devices
        only after the one dispatched before it (``bench/bench_host_sharing.py``), so
        pipeline devices that are meshes of several CPU devices take turns. False (the
        default): processor sharing.
      dispatch: seconds the executor's host spends dispatching each program of a stage's
        actions, charged on the device at the start of each task (:mod:`pipedsl.tasks`: one
        action, or a device's consecutive actions with nothing sent or received between
        them, dispatched as one program); 0 (the default) where dispatch is hidden.
      update: seconds of the optimizer update of a stage's parameters (what a device does
        between its last compute of a step and its first of the next: its stages' updates
        one after another, as one program); priced only over consecutive steps
        (:func:`~pipedsl.simulator.engine.steps_timing`). Default 0.
      update_barrier: whether the update reads the whole model's gradients (a global-norm
        gradient clip, a finiteness check over the model), so that every device waits for
        every other one's gradients before it updates and consecutive steps do not
        overlap; False (the default): each device updates once its own gradients are
        done, and its next step follows its update.
    """

    forward: PerStage = 1.0
    backward: PerStage | None = None
    input_grad: PerStage | None = None
    weight_grad: PerStage | None = None
    latency: float = 0.0
    bandwidth: float | None = None
    activation_bytes: PerStageBytes = 0
    gradient_bytes: PerStageBytes | None = None
    residual_bytes: PerStageBytes = 0
    weight_residual_bytes: PerStageBytes | None = None
    overlap_sends: bool = True
    per_device: bool = False
    speedup: tuple[float, ...] | None = None
    serial: bool = False
    dispatch: float = 0.0
    update: PerStage = 0.0
    update_barrier: bool = False

    def __post_init__(self) -> None:
        for name in ("forward", "activation_bytes", "residual_bytes", "update"):
            object.__setattr__(self, name, _per_stage(name, getattr(self, name)))
        for name in ("backward", "input_grad", "weight_grad", "gradient_bytes", "weight_residual_bytes"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _per_stage(name, value))
        for name in ("activation_bytes", "gradient_bytes", "residual_bytes", "weight_residual_bytes"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _bytes(name, value))
        object.__setattr__(self, "latency", _number("latency", self.latency))
        object.__setattr__(self, "dispatch", _number("dispatch", self.dispatch))
        if self.bandwidth is not None:
            bandwidth = _number("bandwidth", self.bandwidth)
            if bandwidth == 0:
                raise CostError("bandwidth must be > 0 bytes per second; leave it out to make bytes cost no time")
            object.__setattr__(self, "bandwidth", bandwidth)
        for name in ("overlap_sends", "per_device", "serial", "update_barrier"):
            if not isinstance(getattr(self, name), bool):
                raise CostError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.speedup is not None:
            if not isinstance(self.speedup, list | tuple) or not self.speedup:
                raise CostError(
                    f"speedup must be a list of numbers > 0, one per count of busy devices, got {self.speedup!r}"
                )
            speedup = tuple(_number("speedup", v, where=f"[{i}]") for i, v in enumerate(self.speedup))
            if min(speedup) <= 0:
                raise CostError(f"speedup values must be > 0, got {list(speedup)}")
            object.__setattr__(self, "speedup", speedup)
        if self.serial and self.speedup is None:
            raise CostError("serial says how devices that share compute take turns: give their speedup too")

    # -- reading ---------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "<costs>") -> CostModel:
        """Build from a mapping with this class's field names as keys (a TOML table)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CostError(f"{source}: unknown cost key {unknown[0]!r}; known keys are {', '.join(sorted(known))}")
        try:
            return cls(**dict(data))
        except CostError as err:
            raise CostError(f"{source}: {err.message}") from None

    @classmethod
    def from_toml(cls, path: str | Path) -> CostModel:
        """Read a TOML file whose top-level keys are this class's fields, for example::

        forward = 1.0                 # seconds per F, every stage
        backward = [2.0, 2.0, 2.0, 3.0]
        latency = 20e-6               # seconds per transfer
        bandwidth = 25e9              # bytes per second
        activation_bytes = 16777216   # per stage boundary
        residual_bytes = 268435456    # per microbatch per stage
        """
        path = Path(path)
        return cls.from_mapping(read_toml(path, what="cost", error=CostError), source=str(path))

    def to_toml(self) -> str:
        """The fields that are set, as a TOML text :meth:`from_toml` reads back."""

        def value(v: Any) -> str:
            if isinstance(v, bool):
                return "true" if v else "false"
            if isinstance(v, tuple):
                return "[" + ", ".join(value(x) for x in v) + "]"
            return repr(v)

        return "".join(
            f"{f.name} = {value(getattr(self, f.name))}\n" for f in fields(self) if getattr(self, f.name) is not None
        )

    def with_changes(self, **changes: Any) -> CostModel:
        """A copy with the given fields replaced (and checked again)."""
        return replace(self, **changes)

    # -- resolving -------------------------------------------------------------------

    def resolve(self, schedule: Layout) -> StageCosts:
        """Expand every field to the schedule's S stages, then fill in the defaults."""
        stages = schedule.num_stages
        boundaries = max(stages - 1, 0)

        def seconds(name: str) -> tuple[float, ...] | None:
            value = getattr(self, name)
            return None if value is None else _expand(name, value, stages, "stages")

        forward = _expand("forward", self.forward, stages, "stages")
        backward, input_grad, weight_grad = seconds("backward"), seconds("input_grad"), seconds("weight_grad")
        if backward is None:
            if input_grad is not None and weight_grad is not None:
                backward = tuple(i + w for i, w in zip(input_grad, weight_grad, strict=True))
            else:
                backward = tuple(2.0 * f for f in forward)
        input_grad = input_grad if input_grad is not None else tuple(b / 2 for b in backward)
        weight_grad = weight_grad if weight_grad is not None else tuple(b / 2 for b in backward)
        act_bytes = _expand("activation_bytes", self.activation_bytes, boundaries, "stage boundaries")
        grad_bytes = (
            act_bytes
            if self.gradient_bytes is None
            else _expand("gradient_bytes", self.gradient_bytes, boundaries, "stage boundaries")
        )
        res = _expand("residual_bytes", self.residual_bytes, stages, "stages")
        wres = (
            res
            if self.weight_residual_bytes is None
            else _expand("weight_residual_bytes", self.weight_residual_bytes, stages, "stages")
        )
        if self.per_device:
            held = [schedule.placement.count(device) for device in range(schedule.num_devices)]
            share = tuple(held[device] for device in schedule.placement)

            def split(values: tuple[float, ...]) -> tuple[float, ...]:
                return tuple(v / k for v, k in zip(values, share, strict=True))

            forward, backward, input_grad, weight_grad = map(split, (forward, backward, input_grad, weight_grad))
            res, wres = split(res), split(wres)
        return StageCosts(
            forward=forward,
            backward=backward,
            input_grad=input_grad,
            weight_grad=weight_grad,
            activation_transfer=tuple(self.transfer_seconds(b) for b in act_bytes) + (0.0,),
            gradient_transfer=(0.0,) + tuple(self.transfer_seconds(b) for b in grad_bytes),
            # Whole bytes: a share of an odd size rounds to the nearest byte.
            residual_bytes=tuple(round(b) for b in res),
            weight_residual_bytes=tuple(round(b) for b in wres),
            overlap_sends=self.overlap_sends,
            speedup=self._speedup_for(schedule.num_devices),
            serial=self.serial,
            dispatch=self.dispatch,
        )

    def device_updates(self, schedule: Layout) -> tuple[float, ...]:
        """Seconds of each device's optimizer update, shape (D,): the updates of the
        stages it holds, summed (with ``per_device``, ``update`` is already a device's)."""
        stages = _expand("update", self.update, schedule.num_stages, "stages")
        totals = [0.0] * schedule.num_devices
        held = [schedule.placement.count(device) for device in range(schedule.num_devices)]
        for seconds, device in zip(stages, schedule.placement, strict=True):
            totals[device] += seconds / held[device] if self.per_device else seconds
        return tuple(totals)

    def _speedup_for(self, devices: int) -> tuple[float, ...] | None:
        if self.speedup is None:
            return None
        if len(self.speedup) < devices:
            raise CostError(
                f"speedup lists {len(self.speedup)} values but the schedule has {devices} devices; "
                "give one per count of busy devices, 1 to the devices"
            )
        return self.speedup[:devices]

    def transfer_seconds(self, num_bytes: float) -> float:
        """Seconds one transfer of ``num_bytes`` bytes takes: latency + bytes / bandwidth."""
        if self.bandwidth is None:
            return self.latency
        return self.latency + num_bytes / self.bandwidth

    # -- writing ---------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (tuples become lists; unset defaults stay None)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def describe(self, *, split: bool = True) -> str:
        """A one-line summary for tables and titles, e.g. ``F=1 B=2F I=B/2 W=B/2 comm=0.1s``;
        ``split`` False, for schedules with no ``I`` or ``W``, leaves those two out
        (``F=1 B=2F comm=0.1s``)."""

        def fmt(value: PerStage | None, default: str) -> str:
            if value is None:
                return default
            if isinstance(value, tuple):
                return "[" + ",".join(f"{v:g}" for v in value) + "]"
            return f"{value:g}"

        both_halves = self.input_grad is not None and self.weight_grad is not None
        parts = [
            f"F={fmt(self.forward, '')}",
            f"B={fmt(self.backward, 'I+W' if both_halves else '2F')}",
        ]
        if split:
            parts += [f"I={fmt(self.input_grad, 'B/2')}", f"W={fmt(self.weight_grad, 'B/2')}"]
        comm = f"comm={self.latency:g}s"
        if self.bandwidth is not None:
            comm += f"+bytes/({self.bandwidth:g}B/s)"
        parts.append(comm)
        if not self.overlap_sends:
            parts.append("blocking-sends")
        if self.per_device:
            parts.append("per-device")
        if self.speedup is not None:
            parts.append("shared-compute")
        if self.update != 0.0:
            parts.append(f"update={fmt(self.update, '')}")
        if self.update_barrier:
            parts.append("update-barrier")
        return " ".join(parts)
