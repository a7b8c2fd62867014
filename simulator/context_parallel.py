"""Context parallelism: the exchange of keys and values between the ranks that split a
sequence.

With ``cp`` context-parallel ranks each holds s/cp of every sequence's tokens (a causal
model balances the work by giving each rank two opposite chunks, as Megatron-LM and
Llama 3 do). Every token's query attends to every earlier key, so each rank needs the
whole sequence's keys and values of its heads: per layer and microbatch, ``S = b·s·2·kv_t``
values (``kv_t`` the key/value width on one tensor-parallel rank, at least one head when
tp exceeds the key/value heads). The forward moves them as a ring all-gather over the
context-parallel group (``(cp−1)/cp · S`` bytes per rank, :mod:`~pipedsl.simulator.collectives`);
the backward moves them again and reduce-scatters their gradients (twice the forward's).

How it is exchanged (:class:`~pipedsl.simulator.plan.ContextExchange`):

- ``ring``: each rank passes its chunk on while attention runs on the chunk it holds,
  so the exchange hides behind all but one chunk's share of attention's core,
  ``(cp−1)/cp`` of it; only what is left over is priced;
- ``all_gather``: the chunks are gathered before attention runs, nothing hides them.

Memory: a rank keeps only its own chunk's K and V for the backward (in
:meth:`~pipedsl.simulator.transformer.Shapes.layer_activation_bytes`); the gathered keys
and values of the layer running are working memory (:func:`gathered_bytes`).
"""

from __future__ import annotations

from typing import Protocol

from pipedsl.simulator.collectives import Group, gather_seconds
from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.plan import ContextExchange, Plan
from pipedsl.simulator.torus import TorusGroup

__all__ = ["gathered_bytes", "exchange_seconds", "exposed_exchange"]


class Shapes(Protocol):
    """What the pricing here reads of a plan's shapes
    (:class:`pipedsl.simulator.transformer.Shapes`, which prices its layers with it)."""

    @property
    def model(self) -> Model: ...
    @property
    def cluster(self) -> Cluster: ...
    @property
    def plan(self) -> Plan: ...
    @property
    def cp_group(self) -> Group | TorusGroup: ...


def gathered_bytes(shapes: Shapes) -> float:
    """Bytes of one layer's keys and values for the whole sequence on one GPU,
    ``b·s·2·kv_t`` values (0 without context parallelism)."""
    plan, model = shapes.plan, shapes.model
    if plan.cp == 1:
        return 0.0
    width = model.head_width
    kv_per_rank = max(model.num_kv_heads // plan.tp, 1) * width
    return plan.microbatch_size * model.seq_len * 2 * kv_per_rank * model.dtype_bytes


def exchange_seconds(shapes: Shapes) -> float:
    """Seconds of one layer's forward exchange of keys and values: a ring all-gather of
    :func:`gathered_bytes` over the context-parallel group."""
    if shapes.plan.cp == 1:
        return 0.0
    return gather_seconds(gathered_bytes(shapes), shapes.cp_group, shapes.cluster)


def exposed_exchange(shapes: Shapes, attention_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's key/value exchange that its
    computation does not hide, given attention's core forward of ``attention_s`` seconds
    (the backward runs it twice and moves twice the bytes)."""
    plan = shapes.plan
    forward = exchange_seconds(shapes)
    if forward == 0.0:
        return 0.0, 0.0
    if plan.cp_exchange is ContextExchange.ALL_GATHER:
        return forward, 2 * forward
    hidden = (plan.cp - 1) / plan.cp * attention_s
    return max(0.0, forward - hidden), max(0.0, 2 * forward - 2 * hidden)
