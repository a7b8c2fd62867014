"""pipedsl: write, check, simulate and run pipeline-parallel training schedules.

    >>> import pipedsl
    >>> sched = pipedsl.load("1f1b", pp=4, microbatches=8)   # a library name or a path
    >>> pipedsl.validate(sched).peak_inflight
    (4, 3, 2, 1)
    >>> program = pipedsl.lower(sched)   # per-device compute/send/recv/free lists

A :class:`Schedule` is plain data; :func:`validate` checks it and :func:`lower` (which
validates first) turns it into a :class:`Program`.

A ``.sched`` file with a ``policy`` block loads as a :class:`Policy` (limits and
priorities); :func:`synthesize` gives its Schedule against costs (the simulator's
``CostModel``, :class:`StageCosts`, or by default uniform ones).

A :class:`RunOptions` says how a pipeline runs (mesh degrees, ZeRO stage, recomputation,
precision): the executor's ``Pipeline`` takes it, ``pipedsl run`` makes it from its flags and
the planner's plans make their own.

The simulator is :mod:`pipedsl.simulator`; the executor is :mod:`pipedsl.executor`
(imported on demand, since it brings in JAX).
"""

from pipedsl.errors import (
    ConversionError,
    PipedslError,
    ScheduleEvalError,
    ScheduleInvalid,
    ScheduleSyntaxError,
    SourcePos,
)
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.library import library_path, library_schedules, load, parse
from pipedsl.policy import Policy
from pipedsl.program import Program, lower
from pipedsl.run_options import RunOptions, RunOptionsError
from pipedsl.stage_costs import StageCosts
from pipedsl.synthesize import synthesize
from pipedsl.timeline import Timeline
from pipedsl.validate import Report, validate

__all__ = [
    "Action",
    "ConversionError",
    "Kind",
    "PipedslError",
    "Policy",
    "Program",
    "Report",
    "RunOptions",
    "RunOptionsError",
    "Schedule",
    "StageCosts",
    "ScheduleEvalError",
    "ScheduleInvalid",
    "ScheduleSyntaxError",
    "SourcePos",
    "Timeline",
    "library_path",
    "library_schedules",
    "load",
    "lower",
    "parse",
    "synthesize",
    "validate",
]

__version__ = "0.1.0"
