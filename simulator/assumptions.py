"""What an estimate priced: the choices of a plan and of its collectives, in words.

Every :class:`~pipedsl.simulator.estimate.Estimate` lists them, so that a reader sees
which modelling choices (attention kernel, recomputation, overlap, the all-reduce
algorithm of each group) its numbers rest on.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedsl.simulator.collectives import all_reduce_choice, plan_group
from pipedsl.simulator.data_parallel import dp_group, replica_group
from pipedsl.simulator.frameworks import framework
from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.network import network_link, slice_wait_s, straggler_factor, straggler_units
from pipedsl.simulator.plan import ContextExchange, Plan, Recompute
from pipedsl.simulator.torus import TorusGroup, slice_shape
from pipedsl.words import number, plural

__all__ = ["Assumption", "assumptions"]


@dataclass(frozen=True, slots=True)
class Assumption:
    """One choice an estimate priced: ``name`` (a plan field or a collective), its
    ``value`` as priced, and what that means in words."""

    name: str
    value: str
    meaning: str


def assumptions(model: Model, cluster: Cluster, plan: Plan) -> tuple[Assumption, ...]:
    """What an estimate of ``plan`` prices: the plan's modelling switches, the
    collective algorithms chosen for its groups and how devices that share a host's cores
    share them (:func:`_shared_machine`)."""
    on = {True: "on", False: "off"}
    found = [
        Assumption("flash_attention", on[plan.flash_attention],
                   "attention runs fused and never stores its a×s×s scores" if plan.flash_attention
                   else "attention stores its scores (5·a·s/h bytes per value of b·s·h)"),
        Assumption("sequence_parallel", on[plan.sequence_parallel],
                   "norms and dropout split over the tensor-parallel ranks" if plan.sequence_parallel
                   else "norms and dropout replicated on every tensor-parallel rank"),
        Assumption("recompute", plan.recompute.value, _RECOMPUTE[plan.recompute]),
        Assumption("dp_overlap", f"{plan.dp_overlap:g}",
                   "fraction of the last backward (first forward) that hides once-per-step data-parallel traffic"),
        Assumption("tp_overlap", f"{plan.tp_overlap:g}",
                   "fraction of the products beside each tensor-parallel collective that hides it (decomposed into"
                   " tp steps under the product's)"),
        Assumption("reduce_dtype", "fp32" if plan.reduce_bytes == 4 else "bf16",
                   f"gradients reduced at {plan.reduce_bytes} bytes per value"),
        Assumption("sharding", plan.sharding, _sharding_meaning(plan)),
        _framework_assumption(plan),
    ]  # fmt: skip
    if plan.cp > 1:
        found.append(Assumption("cp_exchange", plan.cp_exchange.value, _EXCHANGE[plan.cp_exchange]))
    size = model.num_params / (plan.tp * plan.pp) * plan.reduce_bytes
    for name, group, num_bytes in (
        ("tp_collectives", plan_group(plan, ("tensor",), cluster), model.seq_len * plan.microbatch_size * model.hidden * 2),
        ("dp_collectives", dp_group(plan, cluster), size),
        ("replica_collectives", replica_group(plan, cluster), size / plan.shards),
        ("cp_collectives", plan_group(plan, ("context",), cluster), model.seq_len * plan.microbatch_size * model.kv_width),
    ):  # fmt: skip
        if group.ranks > 1:
            algorithm, _ = all_reduce_choice(num_bytes, group, cluster)
            if isinstance(group, TorusGroup):
                found.append(Assumption(name, algorithm.value, group.describe()))
                continue
            where = (
                f"{group.per_node} per node over {group.nodes} nodes ({network_link(group.nodes, cluster).tier.value})"
                if group.spans_nodes
                else "in one node"
            )
            found.append(Assumption(name, algorithm.value, f"{group.ranks} ranks, {where}"))
    found.append(_torus_assumption(model, cluster, plan) if cluster.torus else _network_assumption(cluster, plan))
    return (*found, *_shared_machine(cluster, plan))


def _network_assumption(cluster: Cluster, plan: Plan) -> Assumption:
    """The network tiers and the stragglers priced (:mod:`~pipedsl.simulator.network`)."""
    nodes = straggler_units(plan.gpus, cluster)
    tiers = _tiers(cluster) if cluster.leaf_nodes else "one flat network between nodes"
    wait = straggler_factor(nodes, cluster)
    stragglers = (
        f"stragglers (cv {number(cluster.straggler_cv)}) make the step over {plural(nodes, 'node')}"
        f" {number(wait, digits=4)} times as long"
        if nodes > 1
        else "one node: no node waits for another"
    )
    return Assumption("network", "tiers" if cluster.leaf_nodes else "flat", f"{tiers}; {stragglers}")


def _tiers(cluster: Cluster) -> str:
    """The leaf and spine tiers in words: how far a group stays under one leaf switch and
    what crossing the spine costs it."""
    latency = (
        f"{number(cluster.spine_latency_s * 1e6)} us more per message" if cluster.spine_latency_s else "no more latency"
    )
    share = (
        f"{number(100 * cluster.spine_efficiency)}% of the bandwidth"
        if cluster.spine_efficiency < 1
        else "the full bandwidth"
    )
    return (
        f"a group of up to {plural(cluster.leaf_nodes, 'node')} stays under one leaf switch; a larger one crosses"
        f" the spine at {latency} and {share}"
    )


def _torus_assumption(model: Model, cluster: Cluster, plan: Plan) -> Assumption:
    """The torus and DCN figures priced (:mod:`~pipedsl.simulator.torus`)."""
    shape = slice_shape(plan.gpus // cluster.slices, cluster)
    wraps = ", ".join(f"{n} {'wraps' if n % cluster.torus_wrap == 0 else 'no wraparound'}" for n in shape)
    link = cluster.intra_node_bandwidth * cluster.intra_node_efficiency
    text = (
        f"{'x'.join(map(str, shape))} torus per slice ({wraps}); ICI {number(link / 1e9)} GB/s per link per direction "
        f"achieved, {number(cluster.intra_node_latency * 1e6)} us per hop"
    )
    if cluster.slices > 1:
        layers = -(-model.layers // plan.pp)
        text += (
            f"; {cluster.slices} slices joined by DCN at {number(cluster.network_share / 1e9)} GB/s per chip, "
            f"{number(cluster.inter_node_latency * 1e6)} us per message; the step waits for the slowest slice at each "
            f"layer's crossing (spread {number(cluster.slice_jitter_s * 1e3)} ms): "
            f"{number(slice_wait_s(layers, cluster))} s over {plural(layers, 'layer')}"
        )
    return Assumption("network", "torus", text)


def _shared_machine(cluster: Cluster, plan: Plan) -> list[Assumption]:
    """On devices that share a host's cores (``Cluster.host_cores``): how they share them."""
    if cluster.host_cores is None:
        return []
    fastest = cluster.speedup(min(plan.tp * plan.dp, cluster.gpus_per_node))
    return [
        Assumption(
            "host_cores", f"{cluster.host_cores:g}",
            f"the {cluster.gpus_per_node} devices of a node share these cores ({_rates(cluster)}): a pipeline device "
            f"computes up to {fastest:.3g} times as fast as priced while the others idle",
        )
    ]  # fmt: skip


def _rates(cluster: Cluster) -> str:
    """How the node's rate follows its busy devices, in words."""
    if not cluster.busy_rates:
        return "each busy device its share, at most one core"
    told = ", ".join(f"{n} {r:.2g}" for n, r in enumerate(cluster.busy_rates, start=1))
    return f"the node's rate at n busy devices over its rate at all: {told}"


_RECOMPUTE = {
    Recompute.NONE: "every layer stores its activations",
    Recompute.SELECTIVE: "attention's core is recomputed in the backward",
    Recompute.FULL: "each layer's forward is rerun in the backward; only its input is stored",
    Recompute.SAVE_DOTS: "each layer is rerun from its input and the outputs of its products with weights, which"
    " it stores (Q, K, V, the output projection, the feed-forward's input products)",
    Recompute.SAVE_QKV_PROJ: "each layer is rerun from its input, its Q, K and V projections and its attention's"
    " output projection, which it stores",
    Recompute.SAVE_MLP_INPUTS: "each layer is rerun from its input and its feed-forward block's input, which it stores",
}


_EXCHANGE = {
    ContextExchange.RING: "keys and values pass around the context-parallel ring behind attention's compute",
    ContextExchange.ALL_GATHER: "keys and values are all-gathered before attention runs, exposed",
}


def _sharding_meaning(plan: Plan) -> str:
    """The sharding mode in words: what is sharded over the dp·cp ranks, and when
    gradients are reduced and weights gathered."""
    parts = ["optimizer state"]
    if plan.zero >= 2 and not plan.reduce_once:
        parts.append("gradients")
    if plan.zero == 3 and plan.reshard_after_forward:
        parts.append("weights")
    if plan.zero == 0:
        return "nothing sharded; gradients all-reduced once per step"
    when = (
        "accumulated whole, reduce-scattered once per step"
        if plan.reduces_once
        else "reduce-scattered every microbatch"
    )
    text = f"{', '.join(parts)} sharded over {plan.shards} ranks; gradients {when}"
    if plan.replicas > 1:
        text += f"; {plan.replicas} replicas of the shard groups, their gradient shards all-reduced across them"
    if plan.zero == 3:
        text += "; weights gathered for each forward and again for each backward" if plan.reshard_after_forward else (
            "; weights gathered once per step and kept" if plan.reduce_once else
            "; weights gathered for each forward and kept for its backward")  # fmt: skip
    return text


def _framework_assumption(plan: Plan) -> Assumption:
    """The framework profile priced, with its fixed costs."""
    profile = framework(plan.framework)
    costs = ", ".join(
        f"{number(seconds * 1e3)} ms per {what}"
        for seconds, what in (
            (profile.microbatch_s, "stage and microbatch"),
            (profile.layer_s, "layer and microbatch"),
            (profile.action_s, "action"),
        )
        if seconds
    )
    costs = f"{costs} beyond the work" if costs else "no fixed cost beyond the work"
    return Assumption("framework", profile.name, f"{costs} ({profile.source})" if profile.source else costs)
