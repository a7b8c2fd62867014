"""pipedsl: write, check, simulate and run pipeline-parallel training schedules.

    >>> import pipedsl
    >>> sched = pipedsl.load("1f1b", pp=4, microbatches=8)   # a library name or a path
    >>> sched.validate().peak_inflight
    (4, 3, 2, 1)
    >>> program = sched.lower()          # per-device compute/send/recv/free lists

A ``.sched`` file with a ``policy`` block loads as a :class:`Policy` (limits and
priorities); ``pipedsl.simulator.synthesize.synthesize(policy, costs)`` gives its Schedule.

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
from pipedsl.program import Program
from pipedsl.timeline import Timeline

__all__ = [
    "Action",
    "ConversionError",
    "Kind",
    "PipedslError",
    "Policy",
    "Program",
    "Schedule",
    "ScheduleEvalError",
    "ScheduleInvalid",
    "ScheduleSyntaxError",
    "SourcePos",
    "Timeline",
    "library_path",
    "library_schedules",
    "load",
    "parse",
]

__version__ = "0.1.0"
