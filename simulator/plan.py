"""A parallel plan, and the pipeline schedule it runs.

A :class:`Plan` says how a model is trained on a cluster: data-parallel ``dp``,
tensor-parallel ``tp``, context-parallel ``cp`` and pipeline-parallel ``pp`` degrees, ``vpp``
stages per pipeline device, the microbatch size, the global batch, the sharding mode (ZeRO
stage, when gradients are reduced, whether gathered weights are dropped after the forward),
the recomputation mode and,
for ``pp > 1``, the schedule: a library name (``1f1b``) or a ``.sched`` file, evaluated
with the plan's ``pp``, ``microbatches`` and (when it takes one) ``vpp``
(:mod:`pipedsl.simulator.pipelines` evaluates and times it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pipedsl import library
from pipedsl.errors import PipedslError
from pipedsl.run_options import RecomputeMode, RunOptions, RunOptionsError, check_sharding
from pipedsl.simulator.frameworks import DEFAULT_FRAMEWORK, FRAMEWORKS, Framework
from pipedsl.simulator.hardware import Model

__all__ = ["Recompute", "ContextExchange", "PlanError", "Plan", "schedule_name", "sharding_words"]


class Recompute(enum.Enum):
    """Which activations the backward recomputes instead of storing: a remat policy.

    ``none`` keeps everything; ``selective`` recomputes attention's core (Megatron-LM's
    ``--recompute-granularity selective``); ``full`` keeps only each layer's input and
    reruns its forward (Megatron-LM's full recomputation, MaxText's ``full``: save
    nothing). The named policies rerun each layer from its input and what they save:
    ``save_dots`` the output of every product with a weight (Q, K, V, the attention's
    output projection, the feed-forward's input products: MaxText's ``minimal``, JAX's
    ``checkpoint_dots_with_no_batch_dims``), ``save_qkv_proj`` the Q, K and V
    projections and the attention's output projection (MaxText's ``save_qkv_proj`` with
    ``save_out_proj``), ``save_mlp_inputs`` the feed-forward block's input (Megatron-LM's
    ``--recompute-modules mlp``: the block's products rerun from it). A saved value is
    kept only where the backward (with its recomputation) reads it.
    """

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    SAVE_DOTS = "save_dots"
    SAVE_QKV_PROJ = "save_qkv_proj"
    SAVE_MLP_INPUTS = "save_mlp_inputs"

    @property
    def per_layer(self) -> bool:
        """Whether each layer reruns its forward from its input and what the policy saves
        (``full`` and the named policies)."""
        return self not in (Recompute.NONE, Recompute.SELECTIVE)


class ContextExchange(enum.Enum):
    """How context-parallel ranks exchange keys and values: a ``ring`` passes each rank's
    chunk around while attention runs on the chunk it holds (the exchange hides behind
    that compute); ``all_gather`` gathers every chunk first, then attends (Llama 3's
    choice: simple, exposed, cheap when grouped-query attention keeps K and V small)."""

    RING = "ring"
    ALL_GATHER = "all_gather"


class PlanError(PipedslError):
    """A plan is malformed or does not fit the model or the cluster (a division that is
    not whole, a schedule that is missing or places stages differently)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """How to train: the parallel degrees, batch split, sharding and recomputation.

    Attributes:
      dp, tp, pp: data-, tensor- and pipeline-parallel degrees; GPUs = dp·tp·cp·pp.
      fsdp: the ZeRO shard group: of the ``dp`` data-parallel ranks, groups of ``fsdp``
        shard the ZeRO state among themselves and the ``dp / fsdp`` groups are replicas of
        one another, whose gradient shards are all-reduced across them once per step
        (FSDP inside a TPU slice or a group of GPU nodes and data parallelism across them:
        MaxText's ``ici_fsdp`` x ``dcn_data``, PyTorch's HSDP). None: one group of all
        ``dp``.
      cp: context-parallel degree: each sequence's tokens split over ``cp`` ranks, which
        exchange keys and values for attention (``cp_exchange``) and hold the same weights
        (their gradients are reduced over dp·cp ranks, as Megatron-LM does).
      cp_exchange: how the context-parallel ranks exchange keys and values
        (a :class:`ContextExchange` or its name).
      vpp: model stages per pipeline device (virtual pipeline stages).
      microbatch_size: sequences per microbatch b.
      global_batch: sequences per step; must be a multiple of dp·b.
      zero: ZeRO stage 0–3 (sharding over the dp·cp ranks): 1 the optimizer state, 2 also
        the gradients, 3 also the weights.
      reduce_once: for ZeRO 2 and 3, accumulate each microbatch's gradients locally (fp32,
        unsharded) and reduce-scatter them once per step, as Megatron-LM's distributed
        optimizer and Llama 3's FSDP do; False reduce-scatters every microbatch's
        gradients (what shards their memory). ZeRO 0 and 1 always reduce once per step.
      reshard_after_forward: for ZeRO 3, drop the gathered weights after each forward and
        gather them again for the backward (FSDP's ``FULL_SHARD``); False keeps them
        gathered until the backward (FSDP's ``SHARD_GRAD_OP``), and with ``reduce_once``
        for the whole step: one gather per step.
      recompute: ``none``, ``selective`` or ``full`` (a :class:`Recompute` or its name).
      schedule: for pp > 1, a library schedule's name (``1f1b``) or a ``.sched`` path;
        None for an SPMD plan (pp = 1).
      sequence_parallel: whether tensor-parallel ranks also split norms and dropout
        along the sequence (Korthikanti et al.).
      flash_attention: whether attention runs fused without storing the a·s² scores.
      fp32_scores: without FlashAttention, whether attention keeps its masked scores in
        fp32 whatever the compute dtype, as ``jax.nn.dot_product_attention``'s XLA
        implementation does (the executor's fused attention off a GPU); the executor's
        written-out attention keeps them in the compute dtype. Only the ``pipedsl``
        framework's count of a layer's bytes reads it
        (:func:`~pipedsl.simulator.activations.compiled_layer_bytes`).
      dp_overlap: fraction in [0, 1] of the covering computation that can hide
        data-parallel traffic (see :mod:`pipedsl.simulator.estimate`).
      tp_overlap: fraction in [0, 1] of the time of the matrix multiplications next to
        each tensor-parallel collective that can hide it, the collective decomposed into
        ``tp`` steps that run under the product's steps (XLA's collective matmul on TPUs,
        Transformer Engine's userbuffer overlap, NeMo's ``ub_tp_comm_overlap``): what
        is hidden follows from the product's time against the collective's
        (:func:`~pipedsl.simulator.transformer.pipelined_exposed`); 0 runs them between
        the products, as Megatron-LM does without that option.
      reduce_bytes: bytes per gradient value in data-parallel reductions: 4 (fp32, as
        Megatron-LM reduces) or 2 (bf16, as mixed-precision FSDP often does).
      framework: the framework that runs the plan, whose fixed costs are priced on top
        (:mod:`~pipedsl.simulator.frameworks`: ``megatron``, ``deepspeed``, ``pipedsl``, or
        a :class:`~pipedsl.simulator.frameworks.Framework` of one's own).
      stage_layers: the layers of each of the pp × vpp stages, or None for an even split
        (:func:`~pipedsl.simulator.stages.split_layers`); Llama 3 405B runs 126 layers on
        16 × 8 stages whose first and last hold none (:func:`~pipedsl.simulator.stages.ends_split`).
      shared_devices: for pp > 1, whether every pipeline device runs on the same dp·tp·cp
        GPUs (the stages of a pipeline on one chip): the executor then runs a step as one
        program, a loop over the microbatches, each through every stage
        (:mod:`~pipedsl.simulator.estimate` prices it so), and
        the plan uses dp·tp·cp GPUs, not dp·tp·cp·pp.
      update_barrier: whether the optimizer step reads the whole model's gradients (a
        global-norm gradient clip, a finiteness check over the model, as Megatron-LM's
        default ``clip_grad`` does): a step is then its pipeline, tail and update end to
        end. False: each pipeline device reduces and updates its own gradients once its last
        backward is done and starts the next step after that, so a step is priced as one
        in a long run (:func:`~pipedsl.simulator.engine.steps_timing`).
      schedule_params: ``(name, value)`` pairs of the schedule's own parameters (not pp,
        vpp or microbatches, which the plan sets), such as ``(("max_inflight", 16),)``;
        a search passes each to the schedules that declare it.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    fsdp: int | None = None
    vpp: int = 1
    microbatch_size: int = 1
    global_batch: int
    zero: int = 0
    reduce_once: bool = False
    reshard_after_forward: bool = True
    recompute: Recompute = Recompute.NONE
    schedule: str | None = None
    sequence_parallel: bool = True
    flash_attention: bool = True
    fp32_scores: bool = False
    dp_overlap: float = 1.0
    tp_overlap: float = 1.0
    reduce_bytes: int = 4
    cp_exchange: ContextExchange = ContextExchange.RING
    stage_layers: tuple[int, ...] | None = None
    framework: str | Framework = DEFAULT_FRAMEWORK
    shared_devices: bool = False
    schedule_params: tuple[tuple[str, int], ...] = ()
    update_barrier: bool = True

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "vpp", "microbatch_size", "global_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"plan: {name} must be a whole number >= 1, got {value!r}")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise PlanError(f"plan: zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.recompute, Recompute):
            try:
                object.__setattr__(self, "recompute", Recompute(self.recompute))
            except ValueError:
                choices = ", ".join(r.value for r in Recompute)
                raise PlanError(f"plan: recompute must be one of {choices}, got {self.recompute!r}") from None
        if not isinstance(self.cp_exchange, ContextExchange):
            try:
                object.__setattr__(self, "cp_exchange", ContextExchange(self.cp_exchange))
            except ValueError:
                choices = ", ".join(c.value for c in ContextExchange)
                raise PlanError(f"plan: cp_exchange must be one of {choices}, got {self.cp_exchange!r}") from None
        for name in (
            "sequence_parallel", "flash_attention", "fp32_scores", "reduce_once", "reshard_after_forward",
            "shared_devices", "update_barrier",
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"plan: {name} must be true or false, got {getattr(self, name)!r}")
        try:
            fsdp = check_sharding(
                dp=self.dp,
                fsdp=self.fsdp,
                zero=self.zero,
                reduce_once=self.reduce_once,
                keep_weights=not self.reshard_after_forward,
            )
        except RunOptionsError as err:
            name = "reshard_after_forward = false" if err.argument == "keep_weights" else err.argument
            raise PlanError(f"plan: {name} {err.rule}") from None
        object.__setattr__(self, "fsdp", fsdp)
        for name in ("dp_overlap", "tp_overlap"):
            overlap = getattr(self, name)
            if isinstance(overlap, bool) or not isinstance(overlap, int | float) or not 0.0 <= overlap <= 1.0:
                raise PlanError(f"plan: {name} must be a fraction in [0, 1], got {overlap!r}")
        if isinstance(self.reduce_bytes, bool) or self.reduce_bytes not in (2, 4):
            raise PlanError(f"plan: reduce_bytes must be 2 (bf16) or 4 (fp32), got {self.reduce_bytes!r}")
        per_step = self.dp * self.microbatch_size
        if self.global_batch % per_step:
            raise PlanError(
                f"plan: global batch {self.global_batch} is not a multiple of dp × microbatch size = "
                f"{self.dp} × {self.microbatch_size} = {per_step}; every data-parallel rank needs whole microbatches"
            )
        if not isinstance(self.framework, Framework) and self.framework not in FRAMEWORKS:
            raise PlanError(f"plan: framework must be one of {', '.join(FRAMEWORKS)}, got {self.framework!r}")
        if self.stage_layers is not None:
            layers = tuple(self.stage_layers)
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in layers):
                raise PlanError(f"plan: stage_layers must be whole numbers >= 0, got {list(layers)}")
            if len(layers) != self.pp * self.vpp:
                raise PlanError(
                    f"plan: stage_layers gives {len(layers)} stages, but pp × vpp = {self.pp} × {self.vpp} = "
                    f"{self.pp * self.vpp}"
                )
            object.__setattr__(self, "stage_layers", layers)
        if self.pp == 1 and self.schedule is not None:
            raise PlanError(
                f"plan: pp = 1 is an SPMD plan and runs no pipeline schedule; drop schedule {self.schedule!r}"
            )
        if self.pp == 1 and self.vpp != 1:
            raise PlanError(f"plan: vpp = {self.vpp} needs a pipeline (pp > 1)")
        if self.pp == 1 and self.shared_devices:
            raise PlanError("plan: shared_devices puts the pipeline devices of a pipeline (pp > 1) on the same GPUs")
        if self.pp > 1 and self.schedule is None:
            raise PlanError(f"plan: pp = {self.pp} needs a schedule (a library name such as 1f1b, or a .sched file)")
        self._check_schedule_params()

    def _check_schedule_params(self) -> None:
        given = self.schedule_params
        pairs = tuple(given.items()) if isinstance(given, dict) else tuple(given)
        for pair in pairs:
            if (
                not isinstance(pair, tuple)
                or len(pair) != 2
                or not isinstance(pair[0], str)
                or not pair[0].isidentifier()
            ):
                raise PlanError(f"plan: schedule_params are (name, value) pairs, got {pair!r}")
            name, value = pair
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlanError(f"plan: schedule parameter {name} needs a whole number, got {value!r}")
            if name in ("pp", "vpp", "microbatches"):
                raise PlanError(
                    f"plan: {name} is the plan's own (pp, vpp, and microbatches from the global batch);"
                    " set it there, not as a schedule parameter"
                )
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise PlanError(f"plan: schedule parameters name {sorted(n for n in names if names.count(n) > 1)[0]} twice")
        if pairs and self.schedule is None:
            raise PlanError(f"plan: schedule parameters {', '.join(names)} need a pipeline schedule (pp > 1)")
        object.__setattr__(self, "schedule_params", pairs)

    @property
    def shard_group(self) -> int:
        """Data-parallel ranks that shard the ZeRO state among themselves: ``fsdp``, or ``dp``."""
        return self.dp if self.fsdp is None else self.fsdp

    @property
    def replicas(self) -> int:
        """Data-parallel groups that are replicas of one another: dp / fsdp (1 without ``fsdp``)."""
        return self.dp // self.shard_group

    @property
    def gpus(self) -> int:
        """GPUs the plan uses: dp·tp·cp per pipeline device, times pp unless they share them."""
        return self.dp * self.tp * self.cp * (1 if self.shared_devices else self.pp)

    @property
    def shards(self) -> int:
        """Ranks that share ZeRO shards of the same weights: dp·cp, or fsdp·cp in groups."""
        return self.shard_group * self.cp

    @property
    def reduces_once(self) -> bool:
        """Whether gradients are reduced once per step (accumulated locally until then):
        always for ZeRO 0 and 1, for 2 and 3 when ``reduce_once`` says so."""
        return self.zero < 2 or self.reduce_once

    @property
    def sharding(self) -> str:
        """The sharding mode in words users know: ``zero2 once``, ``zero3 keep``, ..."""
        return "zero" + sharding_words(
            self.zero, reduce_once=self.reduce_once, reshard_after_forward=self.reshard_after_forward
        )

    @property
    def microbatches(self) -> int:
        """Microbatches per data-parallel rank per step: global batch / (dp · b)."""
        return self.global_batch // (self.dp * self.microbatch_size)

    @property
    def label(self) -> str:
        """A short description such as ``1f1b dp8 tp8 pp16 mb1 zero1 selective``."""
        kind = "spmd" if self.schedule is None else schedule_name(self.schedule)
        kind += "".join(f" {name}={value}" for name, value in self.schedule_params)
        vpp = f" vpp{self.vpp}" if self.vpp > 1 else ""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        shared = " shared" if self.shared_devices else ""
        fsdp = f" fsdp{self.fsdp}" if self.fsdp is not None else ""
        return (
            f"{kind} dp{self.dp}{fsdp} tp{self.tp}{cp} pp{self.pp}{vpp}{shared} mb{self.microbatch_size} "
            f"{self.sharding} {self.recompute.value}"
        )

    def run_options(self, model: Model) -> RunOptions:
        """How the executor runs this plan of ``model`` as it is priced: its degrees, ZeRO
        stage and reduction, recomputation, sequence parallelism (with ``tp > 1``, where it
        splits something) and the precision of ``model``'s values (:attr:`Model.precision`).
        Refuses a plan the executor runs otherwise than priced (ZeRO 3 keeping the gathered
        weights for the backward), naming the field."""
        if self.zero == 3 and not self.reshard_after_forward:
            raise PlanError(
                "plan: reshard_after_forward = false (ZeRO 3 keeping the forward's gathered weights for the"
                " backward) is priced but not run: the executor gathers them again in the backward"
            )
        return RunOptions.as_priced(
            dp=self.dp,
            fsdp=self.shard_group,
            tp=self.tp,
            cp=self.cp,
            zero=self.zero,
            reduce_once=self.reduce_once,
            recompute=cast(RecomputeMode, self.recompute.value),  # Recompute's values are the modes
            precision=model.precision,
            sequence_parallel=self.sequence_parallel,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "dp": self.dp,
            "fsdp": self.fsdp,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "cp_exchange": self.cp_exchange.value,
            "vpp": self.vpp,
            "microbatch_size": self.microbatch_size,
            "global_batch": self.global_batch,
            "microbatches": self.microbatches,
            "zero": self.zero,
            "reduce_once": self.reduce_once,
            "reshard_after_forward": self.reshard_after_forward,
            "recompute": self.recompute.value,
            "schedule": self.schedule,
            "sequence_parallel": self.sequence_parallel,
            "flash_attention": self.flash_attention,
            "dp_overlap": self.dp_overlap,
            "tp_overlap": self.tp_overlap,
            "reduce_bytes": self.reduce_bytes,
            "framework": self.framework if isinstance(self.framework, str) else self.framework.name,
            "stage_layers": None if self.stage_layers is None else list(self.stage_layers),
            "shared_devices": self.shared_devices,
            "schedule_params": dict(self.schedule_params),
        }


def schedule_name(spec: str) -> str:
    """What tables and labels call the schedule ``spec`` (a library name or a path), as
    ``simulate`` does: a library schedule by its library name; any other ``.sched`` file by
    the name its ``schedule`` line gives (``schedule my_1f1b`` is ``my_1f1b``, whatever the
    file is called), followed by the file's name where that is a library schedule's name; a
    CSV or JSON file, or a file that does not parse, by its file name without ``.sched``."""
    file = spec.replace("\\", "/").rsplit("/", 1)[-1]
    stem = file.removesuffix(".sched")
    if file == stem:
        return stem  # a library name, or a CSV or JSON file
    shipped = library.library_schedules()
    if stem in shipped and shipped[stem].resolve() == Path(spec).resolve():
        return stem
    try:
        name = library.parsed(spec).schedule.name
    except PipedslError:
        return stem
    return f"{name} ({file})" if name in shipped else name


def sharding_words(zero: int, *, reduce_once: bool, reshard_after_forward: bool) -> str:
    """ZeRO stage ``zero`` with its sharding mode in words: ``1``, ``2 once``, ``3 once keep``
    (``once``: gradients reduced once per step, for ZeRO 2 and 3; ``keep``: ZeRO 3 keeping the
    forward's gathered weights for the backward)."""
    once = " once" if zero >= 2 and reduce_once else ""
    keep = " keep" if zero == 3 and not reshard_after_forward else ""
    return f"{zero}{once}{keep}"
