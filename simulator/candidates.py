"""The plans a search tries: every SPMD and pipeline plan for a model on N GPUs.

Enumeration, for ``gpus`` GPUs and a global batch B:

- tensor-parallel degrees: powers of two up to the GPUs per node (tensor parallelism
  stays on NVLink) that divide the heads and the feed-forward width;
- context-parallel degrees: ``cp_sizes``, by default :func:`default_cp_sizes` (powers of
  two that leave each rank at least :data:`MIN_CP_TOKENS` tokens of a sequence: 1 alone
  for GPT-3's 2,048, 1 and 2 at 8K, up to 32 at 131K);
- pipeline degrees: divisors of ``gpus`` from 2 up, with ``pp × vpp`` dividing the layers
  (with ``stage_split="ends"``, where it does not, the split whose first and last stage
  hold only the embedding and the head, :func:`~pipedsl.simulator.stages.ends_split`);
  with ``shared_pipelines``, also every ``pp`` from 2 up to the layers with all its
  pipeline devices on the same ``gpus`` GPUs (``Plan.shared_devices``: a pipeline on one
  chip);
- virtual stages: ``vpp_sizes`` (2, 3, 4, 6, 8) for schedules with a ``vpp``
  parameter (vpp = 1 is 1F1B's or GPipe's plan); what the schedule places otherwise;
- microbatch sizes: divisors of B/dp up to ``max_microbatch_size``;
- ZeRO: 0–3 for SPMD, 2 and 3 also with their gradients reduced once per step
  (``reduce_once``, Megatron's distributed optimizer and Llama 3's FSDP) where there is
  more than one microbatch, and 3 also keeping the gathered weights for the backward
  (``reshard_after_forward=False``); 0 and 1 for pipelines (ZeRO 2 and 3 communicate every
  microbatch, which a pipeline of many microbatches multiplies);
- shard groups (``Plan.fsdp``): each SPMD plan of ZeRO 1-3 also sharded only inside one
  TPU slice (with ``Cluster.slices`` above 1) or one GPU node, the slices or nodes replicas
  of one another (MaxText's ``ici_fsdp`` x ``dcn_data``, PyTorch's HSDP), :func:`shard_groups`;
- recomputation: none, selective, full (selective is left out with FlashAttention,
  where it is the same plan as none); SPMD plans also the named remat policies
  ``spmd_recompute`` (saving the products' outputs, or the QKV and output projections:
  what MaxText's published runs use), which cost no simulation.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedsl import library
from pipedsl.simulator.frameworks import default_framework
from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.plan import Plan, PlanError, Recompute
from pipedsl.simulator.stages import ends_split
from pipedsl.simulator.torus import slice_shape

__all__ = [
    "DEFAULT_TOKENS_PER_STEP",
    "MAX_GLOBAL_BATCH",
    "MAX_GPUS",
    "MIN_CP_TOKENS",
    "SearchedSchedule",
    "candidate_plans",
    "default_cp_sizes",
    "default_global_batch",
    "searched_schedules",
    "shard_groups",
]

MIN_CP_TOKENS = 4096
"""The fewest tokens of a sequence the default context-parallel degrees leave each rank:
below it the key/value exchange outweighs the attention it spreads."""

DEFAULT_TOKENS_PER_STEP = 2**22
"""Tokens per step when no global batch is given: 4 Mi tokens (GPT-3 used 3.1 M)."""


def default_global_batch(model: Model) -> int:
    """Sequences per step for about 4 Mi tokens: ``2**22 // seq_len`` (at least 1)."""
    return max(DEFAULT_TOKENS_PER_STEP // model.seq_len, 1)


def default_cp_sizes(model: Model) -> tuple[int, ...]:
    """Context-parallel degrees a search tries by default: 1, and each power of two ``c``
    with ``seq_len / c >= MIN_CP_TOKENS`` that splits the sequence into 2·c chunks."""
    sizes, c = [1], 2
    while model.seq_len // c >= MIN_CP_TOKENS and model.seq_len % (2 * c) == 0:
        sizes.append(c)
        c *= 2
    return tuple(sizes)


MAX_GPUS = 2**20
"""The most GPUs a search plans for (about a million, several times the largest clusters
built): past it a ``gpus`` is a mistake, refused before any work."""

MAX_GLOBAL_BATCH = 2**32
"""The most sequences per step a search plans for; past it a batch is a mistake."""


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` (>= 1), ascending, from its prime factors: about sqrt(n)
    steps for a prime ``n``, far fewer otherwise (never ``n`` steps)."""
    factors: list[tuple[int, int]] = []
    rest, p = n, 2
    while p * p <= rest:
        power = 0
        while rest % p == 0:
            rest //= p
            power += 1
        if power:
            factors.append((p, power))
        p += 1 if p == 2 else 2
    if rest > 1:
        factors.append((rest, 1))
    divisors = [1]
    for prime, power in factors:
        divisors = [d * prime**k for d in divisors for k in range(power + 1)]
    return sorted(divisors)


def _tp_sizes(model: Model, cluster: Cluster, gpus: int) -> list[int]:
    # Tensor parallelism stays on the fastest links: a node's NVLink, or one axis of a torus
    # slice, whose ICI reaches beyond a host.
    bound = max(slice_shape(gpus // cluster.slices, cluster)) if cluster.torus else cluster.gpus_per_node
    sizes = []
    t = 1
    while t <= min(bound, gpus):
        if gpus % t == 0 and model.heads % t == 0 and model.ffn_hidden % t == 0:
            sizes.append(t)
        t *= 2
    return sizes


@dataclass(frozen=True, slots=True)
class SearchedSchedule:
    """A schedule to try: how plans name it, and whether it takes a ``vpp`` parameter."""

    spec: str
    takes_vpp: bool


def searched_schedules(schedules: Sequence[str] | None, extra: Sequence[str | Path]) -> list[SearchedSchedule]:
    """The schedules to try. Library schedules without ``pp`` and ``microbatches``
    parameters (fixed tables) are left out; a named one without them is an error."""
    named = [str(p) for p in extra] + ([] if schedules is None else list(schedules))
    shipped = [] if schedules is not None else [n for n in library.library_schedules() if n not in named]
    found = []
    for spec in dict.fromkeys(shipped + named):
        params = library.parameters(spec)
        if "pp" not in params or "microbatches" not in params:
            if spec in shipped:
                continue
            takes = ", ".join(params) or "no parameters"
            raise PlanError(f"schedule {spec}: the search sets pp and microbatches, but it takes {takes}")
        found.append(SearchedSchedule(spec, "vpp" in params))
    return found


def candidate_plans(
    model: Model,
    cluster: Cluster,
    gpus: int,
    *,
    global_batch: int,
    schedules: Sequence[str] | None = None,
    extra_schedules: Sequence[str | Path] = (),
    max_microbatch_size: int = 16,
    vpp_sizes: Sequence[int] = (2, 3, 4, 6, 8),
    spmd_zero: Sequence[int] = (0, 1, 2, 3),
    pipeline_zero: Sequence[int] = (0, 1),
    recompute: Sequence[Recompute | str] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL),
    spmd_recompute: Sequence[Recompute | str] = (Recompute.SAVE_DOTS, Recompute.SAVE_QKV_PROJ),
    flash_attention: bool = True,
    dp_overlap: float = 1.0,
    reduce_bytes: int = 4,
    cp_sizes: Sequence[int] | None = None,
    stage_split: str = "even",
    tp_overlap: float = 1.0,
    framework: str | None = None,
    shared_pipelines: bool = False,
    schedule_params: Mapping[str, int] | None = None,
    update_barrier: bool = True,
    skipped: Counter[tuple[str, int]] | None = None,
) -> Iterator[Plan]:
    """Every plan the search tries (see the module docstring), SPMD plans first, then the
    pipelines, those whose pipeline devices share the GPUs (``shared_pipelines``) last.

    A schedule that takes no ``vpp`` is offered with ``vpp = 1``; the search asks the
    schedule itself how many stages it places per device (ZB-V places two). ``skipped``,
    when given, counts the combinations left out by (rule, the value that broke it).
    ``schedule_params`` (such as ``{"max_inflight": 16}``) go to every pipeline plan, and so
    to each schedule that declares them (``Plan.schedule_params``). ``update_barrier``
    (``Plan.update_barrier``): whether the optimizer step reads the whole model's gradients
    (a global-norm clip), or each pipeline plan is priced as a step in a long run.
    """
    skip: Counter[tuple[str, int]] = Counter() if skipped is None else skipped
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"search: gpus must be a whole number >= 1, got {gpus!r}")
    if gpus > MAX_GPUS:
        raise PlanError(f"search: gpus = {gpus:,} is past the {MAX_GPUS:,} GPUs a search plans for; check the number")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or not 1 <= global_batch <= MAX_GLOBAL_BATCH:
        raise PlanError(
            f"search: global_batch must be a whole number from 1 to {MAX_GLOBAL_BATCH:,}, got {global_batch!r}"
        )
    if stage_split not in ("even", "ends"):
        raise PlanError(f"search: stage_split must be even or ends, got {stage_split!r}")
    cps = default_cp_sizes(model) if cp_sizes is None else tuple(cp_sizes)
    if not cps or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in cps):
        raise PlanError(f"search: cp_sizes must be whole numbers >= 1, got {list(cps)}")
    modes = [Recompute(r) for r in recompute]
    if flash_attention:
        # FlashAttention never stores the scores selective recomputation would drop, so
        # selective is the same plan as none.
        modes = [r for r in modes if r is not Recompute.SELECTIVE] or [Recompute.NONE]
    spmd_modes = tuple(dict.fromkeys([*modes, *(Recompute(r) for r in spmd_recompute)]))
    common: dict[str, Any] = {
        "global_batch": global_batch,
        "flash_attention": flash_attention,
        "dp_overlap": dp_overlap,
        "reduce_bytes": reduce_bytes,
        "tp_overlap": tp_overlap,
        "framework": default_framework(cluster) if framework is None else framework,
        "update_barrier": update_barrier,
    }
    splits = _Splits(tuple(_tp_sizes(model, cluster, gpus)), _cp_sizes(model, cps, skip))
    space = _Space(splits.pairs(), tuple(modes), global_batch, max_microbatch_size, skip)
    yield from _spmd_plans(dataclasses.replace(space, modes=spmd_modes), cluster, gpus, spmd_zero, common)
    found = searched_schedules(schedules, extra_schedules)
    ends = stage_split == "ends"
    for name in schedule_params or {}:
        if not any(name in library.parameters(s.spec) for s in found):
            tried = ", ".join(s.spec for s in found) or "none"
            raise PlanError(f"search: no schedule tried takes a parameter {name!r} (schedules tried: {tried})")
    common = {**common, "schedule_params": tuple((schedule_params or {}).items())}
    yield from _pipeline_plans(space, model, gpus, found, vpp_sizes, pipeline_zero, common, ends=ends)
    if shared_pipelines:
        yield from _pipeline_plans(space, model, gpus, found, vpp_sizes, pipeline_zero, common, ends=ends, shared=True)


def _cp_sizes(model: Model, cps: Sequence[int], skip: Counter[tuple[str, int]]) -> tuple[int, ...]:
    """The context-parallel degrees of ``cps`` that split the sequence into 2·cp chunks."""
    kept = []
    for c in dict.fromkeys(cps):
        if c > 1 and model.seq_len % (2 * c):
            skip[f"cp does not split the {model.seq_len}-token sequence into 2·cp chunks", c] += 1
            continue
        kept.append(c)
    return tuple(kept)


@dataclass(frozen=True, slots=True)
class _Splits:
    """Tensor- and context-parallel degrees to try."""

    tps: tuple[int, ...]
    cps: tuple[int, ...]

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """Every (tp, cp), tp × cp the GPUs of one model replica's stage."""
        return tuple((t, c) for t in self.tps for c in self.cps)


@dataclass(frozen=True, slots=True)
class _Space:
    """What every part of the enumeration shares: the tensor-parallel sizes and
    recomputation modes to try, the batch and the largest microbatch, and the counter
    of combinations left out."""

    tps: tuple[tuple[int, int], ...]
    modes: tuple[Recompute, ...]
    global_batch: int
    max_microbatch_size: int
    skip: Counter[tuple[str, int]]

    def microbatch_sizes(self, dp: int) -> list[int]:
        """Microbatch sizes that split the batch evenly over ``dp`` replicas."""
        if self.global_batch % dp:
            self.skip[f"global batch {self.global_batch} is not a multiple of dp", dp] += 1
            return []
        return [b for b in _divisors(self.global_batch // dp) if b <= self.max_microbatch_size]


def shard_groups(cluster: Cluster, gpus: int, *, dp: int, tp: int, cp: int) -> tuple[int | None, ...]:
    """The ZeRO shard groups (``Plan.fsdp``) a search tries for ``dp`` data-parallel ranks
    of ``tp x cp`` devices each on ``gpus`` devices: None (all of dp), and the ranks of one
    TPU slice where the cluster has several, or of one GPU node, where that is a proper
    divisor of dp (a group of one rank shards nothing)."""
    per_group = gpus // cluster.slices if cluster.torus else cluster.gpus_per_node
    group = per_group // (tp * cp) if per_group % (tp * cp) == 0 else 0
    if cluster.torus and cluster.slices == 1:
        group = 0
    return (None, group) if 1 < group < dp and dp % group == 0 else (None,)


def _spmd_plans(
    space: _Space, cluster: Cluster, gpus: int, spmd_zero: Sequence[int], common: dict[str, Any]
) -> Iterator[Plan]:
    for tp, cp in space.tps:
        if gpus % (tp * cp):
            continue
        dp = gpus // (tp * cp)
        groups = shard_groups(cluster, gpus, dp=dp, tp=tp, cp=cp)
        for b in space.microbatch_sizes(dp):
            for zero in spmd_zero:
                for fsdp in groups if zero >= 1 else (None,):
                    for once, reshard in _sharding_modes(zero, several=space.global_batch > dp * b):
                        for mode in space.modes:
                            yield Plan(
                                dp=dp, fsdp=fsdp, tp=tp, cp=cp, pp=1, microbatch_size=b, zero=zero, reduce_once=once,
                                reshard_after_forward=reshard, recompute=mode, **common,
                            )  # fmt: skip


def _sharding_modes(zero: int, *, several: bool) -> tuple[tuple[bool, bool], ...]:
    """(reduce_once, reshard_after_forward) of the sharding modes of ZeRO ``zero``: its
    own; for 2 and 3 reduced once per step where there are ``several`` microbatches (with
    one, both modes reduce once); for 3 keeping the weights gathered for the backward."""
    onces = (False, True) if zero >= 2 and several else (False,)
    reshards = (True, False) if zero == 3 else (True,)
    return tuple((once, reshard) for once in onces for reshard in reshards)


def _no_split(model: Model, *, ends_would: bool) -> str:
    """Why a pp × vpp was left out: the layers do not split evenly over its stages, and
    whether they would with the embedding and the head on stages of their own."""
    if ends_would:
        return (
            f"{model.layers} layers split over pp × vpp only with the embedding and the head on stages of their"
            " own (stage_split='ends', --stage-layers ends)"
        )
    return f"{model.layers} layers do not split over pp × vpp"


def _pipeline_plans(
    space: _Space,
    model: Model,
    gpus: int,
    found: list[SearchedSchedule],
    vpp_sizes: Sequence[int],
    pipeline_zero: Sequence[int],
    common: dict[str, Any],
    *,
    ends: bool,
    shared: bool = False,
) -> Iterator[Plan]:
    """The pipeline plans over ``gpus`` GPUs; with ``shared``, those whose ``pp`` pipeline
    devices (2 up to the layers) each run on all of them."""
    for pp in range(2, model.layers + 1) if shared else _divisors(gpus)[1:]:
        if pp > model.layers:
            space.skip[f"pp exceeds the {model.layers} layers", pp] += 1
            break
        for tp, cp in space.tps:
            replica = tp * cp * (1 if shared else pp)  # the GPUs of one data-parallel replica
            if gpus % replica:
                continue
            dp = gpus // replica
            for b in space.microbatch_sizes(dp):
                for sched in found:
                    for vpp in vpp_sizes if sched.takes_vpp else (1,):
                        layers = None
                        if model.layers % (pp * vpp):
                            layers = ends_split(model.layers, pp * vpp)
                            if layers is None or not ends:
                                space.skip[_no_split(model, ends_would=layers is not None), pp * vpp] += 1
                                continue
                        for zero in pipeline_zero:
                            for mode in space.modes:
                                yield Plan(
                                    dp=dp, tp=tp, cp=cp, pp=pp, vpp=vpp, microbatch_size=b, zero=zero,
                                    recompute=mode, schedule=sched.spec, stage_layers=layers,
                                    shared_devices=shared, **common,
                                )  # fmt: skip
