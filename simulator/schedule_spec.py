"""What the simulator's functions take as a schedule: a :class:`~pipedsl.ir.Schedule`,
a library name or a path, or a :class:`~pipedsl.policy.Policy` (synthesised against the
costs given), as the command line takes them."""

from __future__ import annotations

import os
import warnings
from typing import Any

from pipedsl import library
from pipedsl.errors import PipedslError
from pipedsl.ir import Schedule
from pipedsl.policy import Policy
from pipedsl.simulator.costs import CostModel
from pipedsl.synthesize import synthesize

__all__ = ["schedule_of"]


def schedule_of(spec: Any, costs: CostModel | None) -> Schedule:
    """What the simulator's API takes as a schedule, made one: a Schedule as it is; a
    library name or path loaded with its defaults; a policy synthesised against ``costs``,
    or against the default ``CostModel()`` with a warning that says so (the order then
    follows costs the caller did not give). Anything else is refused, naming it."""
    if isinstance(spec, (str, os.PathLike)):
        spec = library.load(spec)
    if isinstance(spec, Policy):
        if costs is None:
            costs = CostModel()
            warnings.warn(
                f"{spec.name} is a policy, synthesised against the default cost model ({costs.describe()});"
                " pass costs to synthesise it against yours",
                stacklevel=3,
            )
        return synthesize(spec, costs)
    if not isinstance(spec, Schedule):
        raise PipedslError(
            f"a schedule is a Schedule, a Policy, a library name such as '1f1b' or a .sched path; got {type(spec).__name__}"
        )
    return spec
