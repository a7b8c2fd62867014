"""The Python API's checks of what it is given: a schedule, a policy, costs.

A public function called with something it cannot work on (None, a library name where a
loaded schedule is wanted, a policy where an order is) says so with pipedsl's own error,
naming the function, the argument and what to pass instead, rather than failing later on
a missing attribute.
"""

from __future__ import annotations

import os

from pipedsl.errors import PipedslError
from pipedsl.ir import Schedule
from pipedsl.policy import Policy
from pipedsl.stage_costs import CostSource

__all__ = ["costs_argument", "policy_argument", "schedule_argument"]


def _given(value: object) -> str:
    """How a message names a value: its type, and the value itself where it is short."""
    shown = repr(value)
    return f"{type(value).__name__} {shown}" if len(shown) <= 40 else type(value).__name__


def schedule_argument(value: object, *, function: str, argument: str = "schedule") -> Schedule:
    """``value`` when it is a :class:`~pipedsl.ir.Schedule`; else a :class:`PipedslError`
    saying what ``function`` takes as ``argument`` and how to make one of what was given."""
    if isinstance(value, Schedule):
        return value
    if isinstance(value, Policy):
        raise PipedslError(
            f"{function}: {argument} {value.name} is a policy, not an order; synthesise its order first: "
            "pipedsl.synthesize(policy, costs)"
        )
    if isinstance(value, (str, os.PathLike)):
        raise PipedslError(
            f"{function}: {argument} is a loaded Schedule, not the name {os.fspath(value)!r}; "
            f"load it first: pipedsl.load({os.fspath(value)!r})"
        )
    raise PipedslError(f"{function}: {argument} must be a Schedule (from pipedsl.load or parse), got {_given(value)}")


def policy_argument(value: object, *, function: str, argument: str = "policy") -> Policy:
    """``value`` when it is a :class:`~pipedsl.policy.Policy`; else a :class:`PipedslError`
    naming ``function``'s ``argument``."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, Schedule):
        raise PipedslError(f"{function}: {argument} {value.name} is an order already; it needs no synthesis")
    raise PipedslError(
        f"{function}: {argument} must be a Policy (a .sched file with a policy block, from pipedsl.load), "
        f"got {_given(value)}"
    )


def costs_argument(value: object, *, function: str, argument: str = "costs") -> CostSource | None:
    """``value`` when it is None or resolves to stage costs (a cost model, or
    :class:`~pipedsl.stage_costs.StageCosts`); else a :class:`PipedslError` naming
    ``function``'s ``argument``."""
    if value is None or callable(getattr(value, "resolve", None)):
        return value  # type: ignore[return-value]  # CostSource is a protocol: its method is what is checked
    raise PipedslError(
        f"{function}: {argument} must be a cost model (pipedsl.simulator.CostModel, pipedsl.StageCosts) "
        f"or left out for uniform costs, got {_given(value)}"
    )
