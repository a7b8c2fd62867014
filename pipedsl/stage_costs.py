"""What one schedule's actions cost, stage by stage: the cost description the core's policy
synthesiser (:mod:`pipedsl.synthesize`) times its orders against.

A person writes costs once, as the simulator's :class:`~pipedsl.simulator.costs.CostModel`
(uniform or per-stage numbers, link latency and bandwidth, defaults by rules of thumb), and
resolves it against one schedule into :class:`StageCosts`: plain per-stage tuples, no
defaults left. Anything with that ``resolve`` method is a :class:`CostSource`, and so is a
:class:`StageCosts` itself, for the schedule it was resolved for. Without costs, the core
takes :meth:`StageCosts.uniform`: the rules of thumb a default ``CostModel()`` resolves to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipedsl.errors import PipedslError

__all__ = ["UNIFORM", "CostSource", "Layout", "StageCosts"]

UNIFORM = "F=1 B=2F I=B/2 W=B/2 comm=0s"
"""How :meth:`StageCosts.uniform` reads in the simulator's one-line cost summaries."""


class Layout(Protocol):
    """Where a schedule's stages sit (a :class:`~pipedsl.ir.Schedule` and a
    :class:`~pipedsl.policy.Policy` are one)."""

    @property
    def num_stages(self) -> int: ...

    @property
    def num_devices(self) -> int: ...

    @property
    def placement(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Costs resolved for one schedule with S stages: plain tuples, no defaults left.

    Attributes:
      forward, backward, input_grad, weight_grad: seconds per ``F``, ``B``, ``I``, ``W``
        action, shape (S,).
      activation_transfer: seconds to move stage s's output activation to stage s+1,
        shape (S,); index S-1 is 0 (the last stage sends no activation).
      gradient_transfer: seconds to move the gradient of stage s's input to stage s-1,
        shape (S,); index 0 is 0 (the first stage sends no gradient).
      residual_bytes: bytes ``F`` keeps on its device until ``B`` or ``I``, shape (S,).
      weight_residual_bytes: bytes ``I`` keeps on its device until ``W``, shape (S,).
      overlap_sends: whether a send runs beside the sender's computation (True) or keeps
        the sender from computing until the transfer has arrived (False).
      speedup: how many times as fast as priced a device computes while n devices
        compute at once, at index n - 1, shape (D,); None: every device has its own compute.
      serial: with ``speedup``, whether the computes run one at a time in the order one
        host thread dispatches them (:func:`pipedsl.program.dispatch_order`) instead of
        sharing the compute.
      dispatch: seconds of the host's dispatch of each task (:mod:`pipedsl.tasks`), charged
        at the start of the task's first compute.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]
    activation_transfer: tuple[float, ...]
    gradient_transfer: tuple[float, ...]
    residual_bytes: tuple[int, ...]
    weight_residual_bytes: tuple[int, ...]
    overlap_sends: bool
    speedup: tuple[float, ...] | None = None
    serial: bool = False
    dispatch: float = 0.0

    @classmethod
    def uniform(cls, layout: Layout) -> StageCosts:
        """The default costs (:data:`UNIFORM`): a forward takes 1 s on every stage, a
        backward 2 s and each of its halves 1 s; transfers are free and hold no bytes."""
        S = layout.num_stages
        return cls(
            forward=(1.0,) * S,
            backward=(2.0,) * S,
            input_grad=(1.0,) * S,
            weight_grad=(1.0,) * S,
            activation_transfer=(0.0,) * S,
            gradient_transfer=(0.0,) * S,
            residual_bytes=(0,) * S,
            weight_residual_bytes=(0,) * S,
            overlap_sends=True,
        )

    def resolve(self, layout: Layout) -> StageCosts:
        """These costs, for a schedule of as many stages (a :class:`CostSource` as it is)."""
        if len(self.forward) != layout.num_stages:
            raise PipedslError(
                f"these stage costs are for {len(self.forward)} stages but the schedule has"
                f" {layout.num_stages}; resolve a cost model against this schedule"
            )
        return self


class CostSource(Protocol):
    """Anything that resolves to :class:`StageCosts` for a schedule: the simulator's
    :class:`~pipedsl.simulator.costs.CostModel`, or :class:`StageCosts` itself."""

    def resolve(self, layout: Layout) -> StageCosts: ...
