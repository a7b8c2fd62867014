"""How a pipeline runs, apart from its model and schedule: one frozen, checked options object.

A :class:`RunOptions` says what the executor does with every pipeline device (its mesh's
data-, tensor- and context-parallel degrees, ZeRO stage and when gradients are reduced),
with every stage (recomputation, precision, sequence parallelism) and with every step (one
program where stages share devices, how long a device waits for another). It is plain data
with no JAX in it, so that the three places that decide how a plan runs hand over the same
object: ``Pipeline(..., options=RunOptions(dp=2, zero=1))`` in Python, ``pipedsl run``
from its command line, and the planner (``Plan.run_options``, ``PlannedRun.run_options``)
from the plan it priced, so that ``pipedsl run --plan N`` runs what was priced.

Every argument is checked once, here; a bad one raises :class:`RunOptionsError`, which names
it (``argument``) and the rule it broke (``rule``).

    >>> RunOptions(dp=2, zero=2, reduce_once=True).mesh_size
    2
    >>> RunOptions(recompute=("full", "none")).stage_recompute(2)
    ('full', 'none')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from pipedsl.errors import PipedslError

__all__ = [
    "FUSE_MODES",
    "Fuse",
    "PRECISIONS",
    "RECOMPUTE_MODES",
    "ZERO_STAGES",
    "Precision",
    "RecomputeMode",
    "RunOptions",
    "RunOptionsError",
    "check_sharding",
]

RecomputeMode = Literal["none", "selective", "full", "save_dots", "save_qkv_proj", "save_mlp_inputs"]
Precision = Literal["fp32", "bf16"]
Fuse = Literal["loop", "unrolled", "ticks", "off"]
"""How a step of pipeline devices sharing their devices runs (:attr:`RunOptions.fuse`)."""
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = get_args(RecomputeMode)
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
FUSE_MODES: tuple[Fuse, ...] = get_args(Fuse)
ZERO_STAGES = (0, 1, 2, 3)


class RunOptionsError(PipedslError):
    """A :class:`RunOptions` argument that cannot run: ``argument`` is its name, ``rule``
    what it broke (with the value given and what to give instead); the message is both."""

    def __init__(self, argument: str, rule: str) -> None:
        self.argument = argument
        self.rule = rule
        super().__init__(f"{argument} {rule}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """How a pipeline runs (module docstring). Every pipeline device is a mesh of
    ``dp x cp x tp`` devices; ``pp`` (the schedule's devices) multiplies them.

    Attributes:
      dp: data-parallel devices per pipeline device (mesh axis ``"data"``): each microbatch
        is split over them (its examples must divide by ``dp``) and the gradients are
        reduced over them inside the stage programs.
      fsdp: the ZeRO shard group: the ``dp`` devices form ``dp / fsdp`` groups of
        ``fsdp`` (mesh axes ``"replica"`` of size dp / fsdp and ``"data"`` of size
        ``fsdp``); each group shards the ZeRO state among its devices and the groups are
        replicas of one another, each device's gradient shard all-reduced over
        ``"replica"`` (FSDP inside a TPU slice or a GPU node and data parallelism across
        them: MaxText's ``ici_fsdp`` x ``dcn_data``, PyTorch's HSDP). None (or ``dp``):
        one group of all ``dp``, one ``"data"`` axis. Needs ``zero`` of 1 or more.
      tp: tensor-parallel devices per pipeline device (mesh axis ``"tensor"``), splitting
        the parameters as the model's ``param_specs`` say.
      cp: context-parallel devices per pipeline device (mesh axis ``"context"``): every
        sequence (axis 1 of the inputs and activations) is split over them.
      zero: ZeRO stage over ``"data"``: 0 shards nothing, 1 the optimizer state, 2 also the
        accumulated gradients, 3 also the parameters (gathered where they are used).
      reduce_once: with ``zero`` 2 or 3, accumulate the gradients unreduced and reduce them
        once per step (one reduce-scatter), as FSDP without per-microbatch sync and
        Megatron-LM's distributed optimizer do; ZeRO 0 and 1 always reduce once per step.
      recompute: what each stage's backward recomputes instead of keeping, as the planner
        prices it: ``"none"``, ``"selective"`` (the attention core), ``"full"``
        (everything but the stage's inputs) or a named remat policy that reruns each
        block from its input and what the policy saves (``"save_dots"``: the outputs of
        the products with weights; ``"save_qkv_proj"``: Q, K, V and the attention's
        output projection; ``"save_mlp_inputs"``: the feed-forward block's input; see
        :mod:`pipedsl.executor.stages.stage_options`); one mode for every stage, or a
        tuple of one per stage (a list is taken as the tuple).
      precision: ``"fp32"``, or ``"bf16"``: bf16 compute and activations with fp32 master
        weights, optimizer state and gradient accumulation (Megatron-LM's mixed precision).
      sequence_parallel: with ``tp > 1``, split the activations around norms and dropout
        along the sequence over ``"tensor"`` (Korthikanti et al.); refused with ``tp = 1``,
        where there is nothing to split.
      fuse: where every pipeline device runs on the same devices (stages sharing one chip,
        or one pipeline device: pp = 1; local backend), how each unrecorded step runs:
        ``"loop"``, one program that loops over the microbatches, each through every stage
        (it compiles about as long as one ``jax.jit`` of the step that accumulates the
        microbatches, and keeps one microbatch's activations at a time); ``"unrolled"``, one program of every
        action of the schedule (it compiles several times longer, and lets XLA overlap the
        microbatches as their data dependencies allow); ``"ticks"``, the one program that
        ``ticks`` runs over devices of their own, with each pipeline device's part of every
        tick run in turn (where that program takes the plan, else as ``"off"``): what that
        program costs beyond the work, measured on one chip; ``"off"``, every action
        dispatched apart, as on devices of their own.
      host_transfers: between pipeline devices that are one CPU device each (local backend),
        a value sent once it is computed goes through host memory, as a view the
        receiving program reads (JAX's copy between CPU devices costs about 100 us of host
        time whatever the size); a receive then waits for the value to be computed. False
        copies every value between the devices, as on accelerators (where values are always
        copied), so that the host never waits inside a step and steps run ahead of the devices.
      ticks: where every pipeline device is one JAX device of its own (either backend;
        ``dp = cp = tp = 1``, no parameter leaf used by two stages), how each unrecorded step
        runs: True, one SPMD program over the pipeline devices that runs the schedule's tick
        table (:mod:`pipedsl.ticks`; one dispatch per step, values moved between devices by
        collective permutes); False (the default), every task dispatched apart
        (:mod:`pipedsl.tasks`), as every other plan on devices of their own runs. The one
        program is not the faster on either platform measured. On CPU devices XLA runs the
        tasks apart faster than the one program, whose ticks keep the devices in step (the
        demo transformer at pp=4, 1F1B over 8 microbatches: the one program's step 1.2-1.4x
        the tasks apart's in fp32, 1.1-1.2x in bf16; ``bench/bench_executor.py --only
        one-program``). On a TPU v5e, with the pipeline devices kept apart on its one chip,
        the check model's step at pp=4 was 2.2-3.7x the accumulating jit with the one
        program (``bench/bench_against_jit.py --fuse ticks``) and 1.5-1.9x with the tasks
        apart, their residuals packed (``--fuse off``), faster for every schedule measured
        (1f1b, gpipe, zb_h1, interleaved 1F1B).
      pack_residuals: where a stage's mesh has no tensor or context axis, whether the
        residuals its forward keeps and the hand-over from ``I`` to ``W`` travel packed, one
        buffer per dtype and last axis instead of one per value
        (:mod:`pipedsl.executor.stages.packing`): fewer buffers for the host to handle at
        every dispatch, for one copy of the packed bytes on the device. None (the
        default): on accelerators, whose hosts pay several microseconds per buffer of a
        dispatch; not on CPU devices, where the copy runs on the cores that compute and the
        demo's data-parallel pipelines ran slower packed (``bench/results/demo.jsonl``).
      recv_timeout: seconds any device waits for a value from another before giving up.
    """

    dp: int = 1
    fsdp: int | None = None
    tp: int = 1
    cp: int = 1
    zero: int = 0
    reduce_once: bool = False
    recompute: RecomputeMode | tuple[RecomputeMode, ...] = "none"
    precision: Precision = "fp32"
    sequence_parallel: bool = False
    fuse: Fuse = "loop"
    host_transfers: bool = True
    ticks: bool = False
    pack_residuals: bool | None = None
    recv_timeout: float = 300.0

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RunOptionsError(name, f"must be a whole number >= 1, got {value!r}")
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise RunOptionsError("zero", f"must be a ZeRO stage, one of 0, 1, 2, 3; got {self.zero!r}")
        object.__setattr__(
            self, "fsdp", check_sharding(dp=self.dp, fsdp=self.fsdp, zero=self.zero, reduce_once=self.reduce_once)
        )
        if not isinstance(self.fuse, str) or self.fuse not in FUSE_MODES:
            raise RunOptionsError("fuse", f"must be one of {', '.join(map(repr, FUSE_MODES))}, got {self.fuse!r}")
        for name in ("reduce_once", "sequence_parallel", "host_transfers"):
            if not isinstance(getattr(self, name), bool):
                raise RunOptionsError(name, f"must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.ticks, bool):
            raise RunOptionsError("ticks", f"must be True or False, got {self.ticks!r}")
        if self.pack_residuals is not None and not isinstance(self.pack_residuals, bool):
            raise RunOptionsError("pack_residuals", f"must be True, False or None, got {self.pack_residuals!r}")
        if self.sequence_parallel and self.tp == 1:
            raise RunOptionsError(
                "sequence_parallel", "splits what tensor parallelism leaves whole: give it with tp above 1"
            )
        object.__setattr__(self, "recompute", _recompute(self.recompute))
        if self.precision not in PRECISIONS:
            raise RunOptionsError("precision", f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        timeout = self.recv_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise RunOptionsError("recv_timeout", f"must be a finite number of seconds above 0, got {timeout!r}")

    @property
    def replicas(self) -> int:
        """Shard groups that are replicas of one another: ``dp / fsdp`` (1 without ``fsdp``)."""
        return 1 if self.fsdp is None else self.dp // self.fsdp

    @classmethod
    def as_priced(
        cls,
        *,
        dp: int,
        fsdp: int | None = None,
        tp: int,
        cp: int,
        zero: int,
        reduce_once: bool,
        recompute: RecomputeMode,
        precision: Precision,
        sequence_parallel: bool,
    ) -> RunOptions:
        """The options that run a plan the planner priced with these fields. The planner's
        plans say ``sequence_parallel`` where it changes nothing (``tp = 1`` has nothing to
        split), which :class:`RunOptions` refuses as meaningless: it is dropped there. Their
        sharding follows the same rule as these options (:func:`check_sharding`)."""
        return cls(
            dp=dp,
            fsdp=fsdp,
            tp=tp,
            cp=cp,
            zero=zero,
            reduce_once=reduce_once,
            recompute=recompute,
            precision=precision,
            sequence_parallel=sequence_parallel and tp > 1,
        )

    @property
    def mesh_size(self) -> int:
        """Devices in every pipeline device's mesh: ``dp * cp * tp``."""
        return self.dp * self.cp * self.tp

    def stage_recompute(self, num_stages: int) -> tuple[RecomputeMode, ...]:
        """The recompute mode of each of ``num_stages`` stages; refuses a tuple of another length."""
        if isinstance(self.recompute, str):
            return (self.recompute,) * num_stages
        if len(self.recompute) != num_stages:
            raise RunOptionsError(
                "recompute",
                f"gives {len(self.recompute)} modes but the schedule has {num_stages} stages: give one mode for"
                " every stage, or one per stage",
            )
        return self.recompute


def check_sharding(
    *, dp: int, fsdp: int | None, zero: int, reduce_once: bool, keep_weights: bool = False
) -> int | None:
    """The one rule of which sharding options go together, whoever gives them:
    :class:`RunOptions`, the planner's ``Plan`` (``estimate``, ``search``) and the command
    line (``run``, ``estimate``, through the options' names). Returns ``fsdp`` as kept:
    None where it is ``dp`` (one group of all). ``dp`` and ``zero`` are checked already.

    Raises:
      RunOptionsError: ``fsdp`` that does not divide ``dp``, or with ``zero`` 0 (nothing
        to shard); ``reduce_once`` with ``zero`` 0 or 1 (they reduce once per step
        already); ``keep_weights`` (keeping the forward's gathered weights for the
        backward, the planner's ``reshard_after_forward = false``) with a ``zero``
        other than 3 (only ZeRO 3 gathers weights).
    """
    if fsdp is not None:
        if isinstance(fsdp, bool) or not isinstance(fsdp, int) or fsdp < 1 or dp % fsdp:
            raise RunOptionsError(
                "fsdp", f"must be a whole number dividing dp={dp} (the devices of one shard group), got {fsdp!r}"
            )
        if fsdp == dp:
            fsdp = None
        elif zero == 0:
            raise RunOptionsError(
                "fsdp", f"{fsdp} groups the devices that share ZeRO shards, but zero=0 shards nothing: give zero 1-3"
            )
    if reduce_once and zero < 2:
        raise RunOptionsError(
            "reduce_once", f"applies to zero 2 and 3 (zero {zero} reduces the gradients once per step already); drop it"
        )
    if keep_weights and zero != 3:
        raise RunOptionsError(
            "keep_weights",
            f"keeps the weights ZeRO 3 gathers for the forward, and zero {zero} gathers none: drop it, or give zero 3",
        )
    return fsdp


def _recompute(value: Any) -> RecomputeMode | tuple[RecomputeMode, ...]:
    """``value`` as :class:`RunOptions` keeps it: a mode, or a non-empty tuple of modes."""
    if isinstance(value, str):
        if value not in RECOMPUTE_MODES:
            raise RunOptionsError("recompute", f"must be one of {', '.join(RECOMPUTE_MODES)}, got {value!r}")
        return cast(RecomputeMode, value)
    if not isinstance(value, Sequence) or not value:
        raise RunOptionsError(
            "recompute", f"must be a mode ({', '.join(RECOMPUTE_MODES)}) or one per stage, got {value!r}"
        )
    bad = [mode for mode in value if mode not in RECOMPUTE_MODES]
    if bad:
        raise RunOptionsError(
            "recompute", f"gives {bad[0]!r} for a stage; each mode must be one of {', '.join(RECOMPUTE_MODES)}"
        )
    return tuple(value)
