"""What an estimate priced: the choices of a plan and of its collectives, in words.

Every :class:`~pipedsl.simulator.estimate.Estimate` lists them, so that a reader sees
which modelling choices (attention kernel, recomputation, overlap, the all-reduce
algorithm of each group) its numbers rest on.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedsl.simulator.collectives import all_reduce_choice, group_of
from pipedsl.simulator.data_parallel import dp_group
from pipedsl.simulator.frameworks import framework
from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.network import network_link, straggler_factor
from pipedsl.simulator.plan import ContextExchange, Plan, Recompute

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
    collective algorithms chosen for its groups and what devices that share a machine
    cost beyond their work (:func:`_shared_machine`)."""
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
        Assumption("tp_overlap", f"{plan.tp_overlap:g}", "fraction of tensor-parallel collectives hidden by matmuls"),
        Assumption("reduce_dtype", "fp32" if plan.reduce_bytes == 4 else "bf16",
                   f"gradients reduced at {plan.reduce_bytes} bytes per value"),
        Assumption("sharding", plan.sharding, _sharding_meaning(plan)),
        _framework_assumption(plan),
    ]  # fmt: skip
    if plan.cp > 1:
        found.append(Assumption("cp_exchange", plan.cp_exchange.value, _EXCHANGE[plan.cp_exchange]))
    size = model.num_params / (plan.tp * plan.pp) * plan.reduce_bytes
    for name, group, num_bytes in (
        ("tp_collectives", group_of(plan.tp, 1, cluster), model.seq_len * plan.microbatch_size * model.hidden * 2),
        ("dp_collectives", dp_group(plan, cluster), size),
        ("cp_collectives", group_of(plan.cp, plan.tp, cluster), model.seq_len * plan.microbatch_size * model.kv_width),
    ):
        if group.ranks > 1:
            algorithm, _ = all_reduce_choice(num_bytes, group, cluster)
            where = (
                f"{group.per_node} per node over {group.nodes} nodes ({network_link(group.nodes, cluster).tier.value})"
                if group.spans_nodes
                else "in one node"
            )
            found.append(Assumption(name, algorithm.value, f"{group.ranks} ranks, {where}"))
    found.append(_network_assumption(cluster, plan))
    return (*found, *_shared_machine(model, cluster, plan))


def _network_assumption(cluster: Cluster, plan: Plan) -> Assumption:
    """The network tiers and the stragglers priced (:mod:`~pipedsl.simulator.network`)."""
    nodes = -(-plan.gpus // cluster.gpus_per_node)
    tiers = (
        f"leaf tier of {cluster.leaf_nodes} nodes, the spine {cluster.spine_latency_s * 1e6:g} us more per message "
        f"at {cluster.spine_efficiency:g} of the bandwidth"
        if cluster.leaf_nodes
        else "one flat network between nodes"
    )
    wait = straggler_factor(nodes, cluster)
    return Assumption(
        "network", "tiers" if cluster.leaf_nodes else "flat",
        f"{tiers}; stragglers (cv {cluster.straggler_cv:g}) make the step over {nodes} nodes {wait:.4g} times as long",
    )  # fmt: skip


def _shared_machine(model: Model, cluster: Cluster, plan: Plan) -> list[Assumption]:
    """On devices that share a machine: the wait of each collective inside a stage program
    (``Cluster.collective_sync``), how a device's working set slows its compute
    (``Cluster.working_set_bytes``), and for a pipeline how much of its idle devices' time
    the busy ones take up (``Cluster.idle_share``), how fast a device busy alone runs
    (``Cluster.alone_efficiency``) and what a split backward costs
    (``Cluster.split_backward_cost``)."""
    found: list[Assumption] = []
    tokens = plan.microbatch_size * model.seq_len
    # ZeRO 2/3 alone wait at data-parallel collectives inside a stage program.
    for axis, n in (("tensor", plan.tp), ("data", plan.dp if plan.zero >= 2 else 1)):
        wait = cluster.collective_sync(n, tokens)
        if wait > 0:
            found.append(Assumption(
                f"{axis}_collective_sync", f"{wait * 1e3:.3g} ms",
                f"each collective of the {n} {axis}-parallel devices waits this on shared cores "
                "until every one of them reaches it",
            ))  # fmt: skip
    if plan.pp > 1 and cluster.core_share(plan.gpus) < 1:
        found.append(Assumption(
            "idle_share", f"{cluster.idle_share_at(plan.tp):.3g}",
            "fraction of an idle pipeline device's time that the busy devices' work takes up on the cores it leaves",
        ))  # fmt: skip
        if cluster.alone_efficiency < 1:
            found.append(Assumption(
                "alone_efficiency", f"{cluster.alone_efficiency:.3g}",
                "fraction of the ideal speed-up (a core to itself) that a pipeline device busy alone reaches",
            ))  # fmt: skip
    if cluster.working_set_bytes > 0:
        found.append(Assumption(
            "working_set_bytes", f"{cluster.working_set_bytes / 1e6:.3g} MB",
            "a device's compute takes 1 + kept / this times its priced seconds, kept the most activation "
            "bytes it keeps at once",
        ))  # fmt: skip
    if plan.pp > 1 and cluster.split_backward_cost > 1:
        found.append(Assumption(
            "split_backward_cost", f"{cluster.split_backward_cost:.3g}",
            "what a backward split into I and W (where the schedule splits it) costs over the fused one",
        ))  # fmt: skip
    return found


_RECOMPUTE = {
    Recompute.NONE: "every layer stores its activations",
    Recompute.SELECTIVE: "attention's core is recomputed in the backward",
    Recompute.FULL: "each layer's forward is rerun in the backward; only its input is stored",
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
    when = "accumulated whole, reduce-scattered once per step" if plan.reduces_once else "reduce-scattered every microbatch"
    text = f"{', '.join(parts)} sharded over {plan.shards} ranks; gradients {when}"
    if plan.zero == 3:
        text += "; weights gathered for each forward and again for each backward" if plan.reshard_after_forward else (
            "; weights gathered once per step and kept" if plan.reduce_once else
            "; weights gathered for each forward and kept for its backward")  # fmt: skip
    return text


def _framework_assumption(plan: Plan) -> Assumption:
    """The framework profile priced, with its fixed costs."""
    profile = framework(plan.framework)
    costs = (
        f"{profile.microbatch_s * 1e3:g} ms per stage and microbatch, {profile.layer_s * 1e3:g} ms per layer and "
        f"microbatch, {profile.action_s * 1e3:g} ms per action beyond the work"
    )
    return Assumption("framework", profile.name, f"{costs} ({profile.source})" if profile.source else costs)
