"""A plan that ``pipedsl search`` ranked, as something to run.

A search row says how to train (``dp``, ``tp``, ``cp``, ``pp``, ``vpp``, microbatches and their
size, ZeRO stage, recomputation) and which schedule the pipeline runs. :class:`PlannedRun`
holds exactly that; :func:`read_plan` takes one from a ``plans.csv`` written by
``search --csv`` or ``demo``, :meth:`PlannedRun.schedule` loads the schedule it runs (an
SPMD plan is one stage over the whole mesh: ``1f1b`` with ``pp = 1``, which accumulates
gradients over the microbatches, each microbatch's backward right after its forward),
:meth:`PlannedRun.run_options` how the executor runs it (the :class:`~pipedsl.RunOptions` the
simulator's plan gives), and :meth:`PlannedRun.command` is the ``pipedsl run`` line that runs it.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pipedsl import library
from pipedsl.cli.common import load_schedule
from pipedsl.errors import PipedslError
from pipedsl.ir import Schedule
from pipedsl.run_options import RecomputeMode, RunOptions
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.hardware import Model
from pipedsl.simulator.plan import sharding_words
from pipedsl.validate import validate

__all__ = ["PlannedRun", "read_plan", "SPMD_SCHEDULE"]

SPMD_SCHEDULE = "1f1b"
"""What an SPMD plan runs: one stage, each microbatch's forward and at once its backward,
so that one microbatch's activations are kept at a time, as the simulator prices SPMD
plans (``gpipe`` with ``pp = 1`` would keep every microbatch's)."""

_INTS = ("dp", "tp", "pp", "vpp", "microbatch_size", "microbatches", "zero")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedRun:
    """One ranked plan, ready to run.

    Attributes:
      schedule: the library name or ``.sched`` path the pipeline runs (``1f1b`` for SPMD).
      kind: ``"spmd"`` (``pp = 1``), ``"pipeline"`` (``dp = tp = 1``) or ``"hybrid"``.
      dp, tp, pp, vpp: data, tensor and pipeline degrees; stages per pipeline device.
      fsdp: the ZeRO shard group, of the dp ranks (None: all of them; fewer: groups of one
        slice or node, replicas of one another; a row's ``fsdp`` column).
      cp: the context-parallel degree (1 for rows of searches before it was searched).
      microbatches, microbatch_size: per data-parallel replica and step; sequences each.
      zero: the ZeRO stage (0 to 3) over the data-parallel axis.
      reduce_once: ZeRO 2 or 3 with the gradients accumulated unreduced and reduced once
        per step; keep_weights: ZeRO 3 keeping the forward's gathered weights for the
        backward (a priced mode the executor does not run). False for rows without them.
      recompute: ``"none"``, ``"selective"`` or ``"full"``.
      planned_s: the search's estimate of the step time in seconds, when known.
      rank: the plan's rank in its search, when known.
      inflight_limit: the ``max_inflight`` the search chose for a policy schedule; 0 for
        none (the schedule's own default).
      synthesis_costs: the cost model the search synthesised a policy schedule against (a
        row's ``synthesis_costs`` column), so that the order run is the order priced; None for
        none (rows of schedules that state their order, or of older searches: then the
        default cost model).
      model: the name of the model the search priced (a preset such as ``llama-8b``), when
        the row says; None for rows of older searches (the demo transformer).
      sequence_parallel, flash_attention: the plan's (True, as the planner assumes, when
        the row does not say).
      shared_devices: every pipeline device on the same ``dp x cp x tp`` devices (a
        pipeline on one chip); False for rows without it.
    """

    schedule: str
    kind: str
    dp: int
    tp: int
    pp: int
    vpp: int
    microbatches: int
    microbatch_size: int
    zero: int
    recompute: str = "none"
    planned_s: float | None = None
    rank: int | None = None
    inflight_limit: int = 0
    model: str | None = None
    sequence_parallel: bool = True
    flash_attention: bool = True
    cp: int = 1
    reduce_once: bool = False
    keep_weights: bool = False
    synthesis_costs: CostModel | None = None
    shared_devices: bool = False
    fsdp: int | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any], *, where: str = "plan") -> PlannedRun:
        """A plan from a search row (a ``plans.csv`` line or a result row), checked."""
        missing = [k for k in ("kind", "schedule", *_INTS) if k not in row]
        if missing:
            raise PipedslError(f"{where}: no column {missing[0]!r}; is this a plans.csv written by pipedsl search?")
        values = {k: _whole(row[k], k, where) for k in _INTS}
        if min(values[k] for k in ("dp", "tp", "pp", "vpp", "microbatch_size", "microbatches")) < 1:
            raise PipedslError(f"{where}: dp, tp, pp, vpp and the microbatch count and size must be at least 1")
        if not 0 <= values["zero"] <= 3:
            raise PipedslError(f"{where}: zero must be 0 to 3, not {values['zero']}")
        cp = 1 if row.get("cp") in (None, "") else _positive(row["cp"], "cp", where)
        fsdp = None if row.get("fsdp") in (None, "") else _positive(row["fsdp"], "fsdp", where)
        if fsdp is not None and values["dp"] % fsdp:
            raise PipedslError(f"{where}: fsdp {fsdp} does not divide dp {values['dp']}")
        spmd = str(row["kind"]) == "spmd"
        kind = "spmd" if spmd else "pipeline" if values["dp"] == values["tp"] == cp == 1 else "hybrid"
        planned = row.get("step_time_s")
        rank = row.get("rank")
        limit = row.get("inflight_limit")
        model = row.get("model")
        costs = row.get("synthesis_costs")
        empty = costs in (None, "") or (isinstance(costs, float) and math.isnan(costs))
        return cls(
            # A user's file is named in tables by its schedule line; it is loaded from its source.
            schedule=SPMD_SCHEDULE if spmd else str(row.get("source") or row["schedule"]),
            kind=kind,
            recompute=str(row.get("recompute", "none")),
            planned_s=None if planned is None or planned == "" else float(planned),
            rank=None if rank in (None, "") else _whole(rank, "rank", where),
            inflight_limit=0 if limit in (None, "") else _whole(limit, "inflight_limit", where),
            model=None if model in (None, "") else str(model),
            sequence_parallel=_flag(row.get("sequence_parallel"), "sequence_parallel", where),
            flash_attention=_flag(row.get("flash_attention"), "flash_attention", where),
            cp=cp,
            reduce_once=_flag(row.get("reduce_once"), "reduce_once", where, absent=False),
            keep_weights=not _flag(row.get("reshard_after_forward"), "reshard_after_forward", where),
            synthesis_costs=None if empty else _costs_of(str(costs), where),
            shared_devices=_flag(row.get("shared_devices"), "shared_devices", where, absent=False),
            fsdp=None if fsdp == values["dp"] else fsdp,
            **values,
        )

    @property
    def devices(self) -> int:
        """JAX devices the plan needs: ``pp x dp x cp x tp``, or ``dp x cp x tp`` where the
        pipeline devices share them."""
        return (1 if self.shared_devices else self.pp) * self.dp * self.cp * self.tp

    @property
    def global_batch(self) -> int:
        """Sequences per step over every replica."""
        return self.dp * self.microbatches * self.microbatch_size

    def params(self) -> dict[str, int]:
        """The schedule's parameters: ``pp``, ``microbatches``, and ``vpp`` and
        ``max_inflight`` (the search's limit) if it takes them."""
        params = {"pp": self.pp, "microbatches": self.microbatches}
        takes = library.parameters(self.schedule)
        if "vpp" in takes:
            params["vpp"] = self.vpp
        if self.inflight_limit and "max_inflight" in takes:
            params["max_inflight"] = self.inflight_limit
        return params

    def schedule_of(self) -> Schedule:
        """The schedule this plan runs, evaluated and validated: a policy schedule
        synthesised against the costs the search synthesised it against."""
        schedule = load_schedule(self.schedule, self.params(), costs=self.synthesis_costs)
        validate(schedule)
        return schedule

    def label(self) -> str:
        """``zbv dp=2 tp=1 pp=2 vpp=2 mb=4 x8 zero=1 recompute=none`` or ``SPMD dp=8 tp=1
        mb=4 x8 zero=1 recompute=full``, with ``fsdp=N`` for shard groups, ``cp=C`` when ``cp > 1``, ``shared`` after the
        pipeline degrees where the pipeline devices share their devices, ``once`` and ``keep``
        after the ZeRO stage for its sharding mode, ``sequence-parallel`` when ``tp > 1`` and
        ``no-flash-attention`` when the plan has none."""
        name = "SPMD" if self.kind == "spmd" else self.schedule
        pp = f" fsdp={self.fsdp}" if self.fsdp is not None else ""
        pp += f" cp={self.cp}" if self.cp > 1 else ""
        pp += "" if self.kind == "spmd" else f" pp={self.pp}" + (f" vpp={self.vpp}" if self.vpp > 1 else "")
        pp += " shared" if self.shared_devices else ""
        options = " sequence-parallel" if self.sequence_parallel and self.tp > 1 else ""
        options += "" if self.flash_attention else " no-flash-attention"
        zero = sharding_words(self.zero, reduce_once=self.reduce_once, reshard_after_forward=not self.keep_weights)
        return (
            f"{name} dp={self.dp} tp={self.tp}{pp} mb={self.microbatch_size} x{self.microbatches} "
            f"zero={zero} recompute={self.recompute}{options}"
        )

    def run_options(self, model: Model) -> RunOptions:
        """How ``pipedsl run --plan`` runs this plan of ``model`` (the priced model, which
        :attr:`model` names): as :meth:`Plan.run_options <pipedsl.simulator.plan.Plan.run_options>`
        runs the plan the row was priced from. Refuses a plan the executor does not run as
        priced (:attr:`not_run`)."""
        if self.not_run is not None:
            raise PipedslError(f"plan {self.label()} {self.not_run}")
        return RunOptions.as_priced(
            dp=self.dp,
            fsdp=self.fsdp,
            tp=self.tp,
            cp=self.cp,
            zero=self.zero,
            reduce_once=self.reduce_once,
            recompute=cast(RecomputeMode, self.recompute),  # a mode RunOptions checks
            precision=model.precision,
            sequence_parallel=self.sequence_parallel,
        )

    @property
    def not_run(self) -> str | None:
        """Why the executor does not run this plan as it was priced, or None when it does."""
        if self.keep_weights:
            return (
                "keeps ZeRO 3's weights gathered from the forward for the backward (reshard_after_forward"
                " = false, 'keep' in its label), which the executor does not do: it gathers them again in the"
                " backward"
            )
        return None

    def command(self) -> str:
        """The ``pipedsl run`` command line that runs this plan's layout on the built-in
        transformer: ``pipedsl run --spmd -p microbatches=M ...`` for an SPMD plan."""
        if self.kind == "spmd":
            params = f"--spmd -p microbatches={self.microbatches}"
        else:
            params = f"{self.schedule} " + " ".join(f"-p {k}={v}" for k, v in self.params().items())
        options = f" --fsdp {self.fsdp}" if self.fsdp is not None else ""
        options += " --reduce-once" if self.reduce_once else ""
        options += f" --recompute {self.recompute}" if self.recompute != "none" else ""
        options += " --sequence-parallel" if self.sequence_parallel and self.tp > 1 else ""
        options += " --fused-attention" if self.flash_attention else ""
        options += " --shared-devices" if self.shared_devices else ""
        return (
            f"pipedsl run {params} --model transformer --dp {self.dp} --tp {self.tp}"
            f"{f' --cp {self.cp}' if self.cp > 1 else ''} "
            f"--zero {self.zero} --microbatch-size {self.microbatch_size}{options}"
        )


def read_plan(path: str | Path, rank: int) -> PlannedRun:
    """The plan of rank ``rank`` in a ``plans.csv`` (``search --csv``, ``demo``)."""
    where = str(path)
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            rows = list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError) as err:
        raise PipedslError(f"{where}: cannot read the plans: {getattr(err, 'strerror', None) or err}") from None
    # A row without a rank was not simulated (search --csv lists it with a lower bound).
    ranks = [str(index + 1) if row.get("rank") is None else row["rank"].strip() for index, row in enumerate(rows)]
    for row_rank, row in zip(ranks, rows, strict=True):
        if row_rank == str(rank):
            return PlannedRun.from_row(row, where=f"{where}, rank {rank}")
    ranked = sum(1 for r in ranks if r)
    raise PipedslError(f"{where}: no plan of rank {rank}; it ranks {ranked} plans (1 .. {ranked})")


def _flag(value: Any, name: str, where: str, *, absent: bool = True) -> bool:
    """A true/false column (``True``/``False`` as pandas writes them); ``absent`` when absent."""
    if value in (None, ""):
        return absent
    text = str(value).strip().lower()
    if text not in ("true", "false", "1", "0"):
        raise PipedslError(f"{where}: {name} should be true or false, not {value!r}")
    return text in ("true", "1")


def _positive(value: Any, name: str, where: str) -> int:
    number = _whole(value, name, where)
    if number < 1:
        raise PipedslError(f"{where}: {name} must be at least 1, not {number}")
    return number


def _whole(value: Any, name: str, where: str) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PipedslError(f"{where}: {name} should be a whole number, not {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise PipedslError(f"{where}: {name} should be a whole number, not {value!r}")
    return int(number)


def _costs_of(text: str, where: str) -> CostModel:
    """A row's ``synthesis_costs`` (JSON of :meth:`CostModel.to_json`), or our error naming ``where``."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise PipedslError(f"{where}: synthesis_costs is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise PipedslError(f"{where}: synthesis_costs is not a JSON object of cost fields")
    return CostModel.from_mapping(data, source=f"{where}: synthesis_costs")
