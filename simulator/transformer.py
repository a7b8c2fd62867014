"""One transformer layer's work on one GPU: its matrix shapes, FLOPs, memory traffic and
kernels, priced by a size-dependent compute model.

Per microbatch of ``b`` sequences of ``s`` tokens (T = b·s/c tokens on each of the
c = cp context-parallel ranks; h hidden, f the feed-forward width, a heads of width d
(``Model.head_width``: h/a unless the model sets ``head_dim``), q = a·d the query width,
kv the key/value width, V vocabulary, t = tp):

- Matrix multiplications, forward, per layer: QKV ``T × h × (q + 2·kv)/t``, the output
  projection ``T × q/t × h``, the feed-forward ``T × h × g·f/t`` (g = 2 when gated) and
  ``T × f/t × h``; attention's core ``b·a/t`` products ``s/c × d × s`` and ``s/c × s × d``
  (each context-parallel rank's queries against every key; the exchange of keys and
  values is :mod:`~pipedsl.simulator.context_parallel`'s).
  With FlashAttention the core is one fused kernel that keeps the s×s scores on chip and
  computes only the causal half of the products (:data:`CAUSAL_SHARE`), so its roofline
  counts only the bytes of Q, K, V and the output (4·s·d per head). The backward runs each linear product twice
  (input gradient into ``I``, weight gradient into ``W``, same shape, same cost) and
  attention's core in ``I``: twice its forward when the scores are stored,
  :data:`FLASH_BACKWARD` times with FlashAttention, whose backward recomputes them. The logits ``T × h × V/t`` sit on the last stage.
- Each product of F FLOPs runs at ``min(peak, intensity × HBM) × matmul_efficiency ×
  F / (F + matmul_half_flops)`` (see :class:`~pipedsl.simulator.hardware.Cluster`), on a
  GPU with its ``matmul_units`` given times its shape's tile efficiency
  (:func:`tile_efficiency`: wave quantization and the contraction's fill). The backward's
  two products of a linear layer run by their own shapes: the input gradient
  ``T × n × k`` of a forward ``T × k × n``, the weight gradient ``k × T × n``.
- Elementwise work (norms, dropout, activations, softmax, the loss) is bound by memory
  bandwidth: each byte a layer stores for its backward costs two bytes of HBM traffic in
  the forward and four in the backward, times the cluster's ``elementwise_traffic`` (the
  share a compiler leaves unfused). What a layer stores follows its shape
  (:meth:`Shapes.layer_activation_bytes`; Korthikanti et al. 2022's s·b·h·(34 + 5·a·s/h)/t
  for GPT with sequence parallelism in 16 bits; values take the model's ``dtype_bytes``,
  so an fp32 model keeps about twice as many bytes; under the ``pipedsl`` framework
  what the executor compiles, :mod:`~pipedsl.simulator.activations`). FlashAttention never writes the a·s² scores.
- Every kernel costs ``kernel_launch_s`` more: per layer forward the products above and
  :data:`ELEMENTWISE_KERNELS` elementwise kernels (two more without FlashAttention:
  softmax and attention dropout); the backward twice the products, as many elementwise.
- Recomputation: ``full`` reruns each layer's forward (compute and tensor-parallel
  collectives) inside ``I`` and stores only the layer input (2·s·b·h/t in 16 bits);
  ``selective`` reruns attention's core (its FLOPs and score traffic) and stores 34·s·b·h/t;
  the named policies (``save_dots``, ``save_qkv_proj``, ``save_mlp_inputs``:
  :class:`~pipedsl.simulator.plan.Recompute`) rerun what the values they save do not
  give back (:meth:`Shapes._rerun`) and keep those values.
- Tensor parallelism: 2 all-reduces of b·s·h values in the forward and 2 in the backward
  per layer (:mod:`~pipedsl.simulator.collectives`);
  sequence parallelism turns each into a reduce-scatter plus an all-gather. Each runs
  decomposed under the product beside it (XLA's collective matmul, Transformer Engine's
  userbuffer overlap), hidden as far as the product's time (times the plan's
  ``tp_overlap``) covers it (:meth:`Shapes.tp_exposed`, :func:`pipelined_exposed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from pipedsl.simulator.activations import NORM_BYTES, compiled_layer_bytes, compiled_weight_layer_bytes
from pipedsl.simulator.collectives import Group, all_reduce_seconds, gather_seconds, plan_group
from pipedsl.simulator.context_parallel import exposed_exchange
from pipedsl.simulator.frameworks import framework
from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.plan import Plan, Recompute
from pipedsl.simulator.torus import TorusGroup

__all__ = [
    "Work",
    "Products",
    "Shapes",
    "gemm_seconds",
    "tile_efficiency",
    "GEMM_TILE",
    "pipelined_exposed",
    "ELEMENTWISE_KERNELS",
    "FLASH_BACKWARD",
    "CAUSAL_SHARE",
    "LOSS_BYTES",
]

Grad = Literal["none", "input", "weight"]
"""Which of a linear layer's three products: the forward (``none``), the backward's input
gradient or its weight gradient."""
_GRADS: tuple[Grad, ...] = ("none", "input", "weight")

ELEMENTWISE_KERNELS = 6
"""Elementwise kernels of one layer's forward with FlashAttention: two norms, two fused
bias-dropout-residual adds, the activation and the split of the fused QKV output."""
FLASH_BACKWARD = 2.5
"""FlashAttention's backward over its forward: five products of the forward's size (the
recomputed scores QKᵀ, then dV, dP, dQ and dK) against the forward's two (Dao 2023)."""
CAUSAL_SHARE = 0.5
"""The share of the query × key products a causal fused attention kernel computes: the
lower triangle, the masked blocks above the diagonal skipped."""
LOSS_BYTES = 4
"""Bytes per logit of the fp32 softmax the loss keeps for its backward."""


GEMM_TILE = (128, 256)
"""Rows × columns of the output tile one streaming multiprocessor computes at a time in the
largest 16-bit GEMM kernels of an A100 or H100 (cuBLAS's and CUTLASS's 128 × 256 tiles)."""


def tile_efficiency(m: float, k: float, n: float, cluster: Cluster, *, batch: int = 1, reserved: int = 0) -> float:
    """The share of a GPU's matrix units that ``batch`` products ``(m × k) · (k × n)`` keep
    busy, by shape: their output tiles (:data:`GEMM_TILE`) run in waves of
    ``cluster.matmul_units`` tiles, the last wave's idle units and the tiles' padding past
    m and n wasted, and each tile's fixed work (``cluster.matmul_k_fill``, in units of k)
    added to its k-long contraction. ``reserved`` units run something else (communication
    kernels): the tiles run in waves over the others, and the reserved ones count as idle.
    1 where the cluster gives no ``matmul_units`` (TPU chips, CPU devices)."""
    units = cluster.matmul_units
    if units <= 0:
        return 1.0
    if reserved:
        free = units - reserved
        return free / units * tile_efficiency(m, k, n, replace(cluster, matmul_units=free), batch=batch)
    rows, cols = math.ceil(m / GEMM_TILE[0]), math.ceil(n / GEMM_TILE[1])
    waves = math.ceil(batch * rows * cols / units)
    busy = batch * m * n / (waves * units * GEMM_TILE[0] * GEMM_TILE[1])
    return busy * k / (k + cluster.matmul_k_fill)


def gemm_seconds(
    m: float, k: float, n: float, cluster: Cluster, *, dtype_bytes: int, batch: int = 1, reserved: int = 0
) -> float:
    """Seconds of ``batch`` products ``(m × k) · (k × n)`` run as one kernel, launch excluded.

    The roofline bound uses one product's intensity 2mkn / (bytes of its three
    matrices); the efficiency curve the FLOPs of the whole kernel; the tile efficiency
    (:func:`tile_efficiency`) its shape, on the units ``reserved`` leaves it.
    """
    seconds = _kernel_seconds(2.0 * m * k * n, dtype_bytes * (m * k + k * n + m * n), batch, cluster)
    return seconds / tile_efficiency(m, k, n, cluster, batch=batch, reserved=reserved)


def _fused_attention_seconds(q: int, k: int, d: int, heads: int, cluster: Cluster, *, dtype_bytes: int) -> float:
    """Seconds of FlashAttention's causal forward over ``heads`` heads of ``q`` queries
    against ``k`` keys of width ``d``: of the 4·q·k·d FLOPs per head of the whole q × k
    block, the kernel computes the blocks on and below the diagonal, :data:`CAUSAL_SHARE`
    of them (it skips the masked blocks, as FlashAttention-2, cuDNN's fused attention and
    the TPU's Pallas kernel do; a context-parallel rank's two chunks, one from each end,
    keep its share at a half too), priced as one product whose HBM traffic is Q, K, V and
    the output ((2q + 2k)·d values per head), the scores never leaving the chip: the whole
    block's kernel scaled to its causal share, its arithmetic and the key and value blocks it
    streams in alike (the intensity of the whole block)."""
    share = CAUSAL_SHARE
    return _kernel_seconds(share * 4.0 * q * k * d, share * dtype_bytes * (2 * q + 2 * k) * d, heads, cluster)


def _kernel_seconds(flops: float, num_bytes: float, count: int, cluster: Cluster) -> float:
    """Seconds of ``count`` products of ``flops`` FLOPs and ``num_bytes`` of HBM traffic
    each, run as one kernel: ``min(peak, intensity × HBM) × matmul_efficiency``, scaled
    by the efficiency curve of the kernel's total FLOPs."""
    total = count * flops
    roof = min(cluster.peak_flops, flops / num_bytes * cluster.hbm_bandwidth)
    return total / (roof * cluster.matmul_efficiency * total / (total + cluster.matmul_half_flops))


def pipelined_exposed(comm: float, compute: float, steps: int, *, tail: bool = False) -> float:
    """Seconds of a collective of ``comm`` seconds that ``compute`` seconds of work beside
    it do not hide, both cut into ``steps`` steps that run one under the other (a
    collective matmul's ring steps; a gradient reduction layer by layer):
    ``max(0, comm - compute·(steps - 1)/steps)``, one step of the work running without
    communication. With ``tail``, each step's communication can only follow its step of
    work (a layer's gradients are reduced once its backward is done), so the last step's
    is exposed whatever the work: at least ``comm / steps``."""
    if comm <= 0.0:
        return 0.0
    steps = max(steps, 1)
    exposed = max(0.0, comm - compute * (steps - 1) / steps)
    return max(exposed, comm / steps) if tail else exposed


@dataclass(frozen=True, slots=True)
class Products:
    """Seconds of one layer's four linear products, forward, on one GPU: the QKV
    projection and the feed-forward's input products (column-split over tp), the
    attention's output projection and the feed-forward's last product (row-split)."""

    qkv: float
    out: float
    ffn_in: float
    ffn_out: float

    @property
    def total(self) -> float:
        return self.qkv + self.out + self.ffn_in + self.ffn_out


@dataclass(frozen=True, slots=True)
class Work:
    """Seconds of one block for one microbatch: forward, input-gradient and weight-gradient
    halves of the backward (``B = I + W``)."""

    forward: float = 0.0
    input_grad: float = 0.0
    weight_grad: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(
            self.forward + other.forward, self.input_grad + other.input_grad, self.weight_grad + other.weight_grad
        )

    def __mul__(self, factor: float) -> Work:
        return Work(self.forward * factor, self.input_grad * factor, self.weight_grad * factor)

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


@dataclass(frozen=True, slots=True)
class Shapes:
    """The numbers every formula needs, for one plan: b, s, h, a, t and friends."""

    model: Model
    cluster: Cluster
    plan: Plan

    @property
    def action_overhead_s(self) -> float:
        """Seconds of the executor's dispatch per task (:mod:`pipedsl.tasks`): the cluster's,
        or none where the step is one program: the pipeline devices share their GPUs
        (``Plan.shared_devices``) or there is one (pp = 1)."""
        return 0.0 if self.plan.shared_devices or self.plan.pp == 1 else self.cluster.action_overhead_s

    @property
    def local_seq(self) -> int:
        """Tokens of each sequence on one context-parallel rank: s/cp."""
        return self.model.seq_len // self.plan.cp

    @property
    def tokens(self) -> int:
        """Tokens per microbatch on one GPU: b·s/cp."""
        return self.plan.microbatch_size * self.local_seq

    @property
    def tp_group(self) -> Group | TorusGroup:
        return plan_group(self.plan, ("tensor",), self.cluster)

    @property
    def cp_group(self) -> Group | TorusGroup:
        """The context-parallel group of one tensor rank (ranks tensor-parallel innermost,
        then context-parallel: stride tp)."""
        return plan_group(self.plan, ("context",), self.cluster)

    def traffic_seconds(self, num_bytes: float) -> float:
        return num_bytes / self.cluster.hbm_bandwidth

    def _gemm(self, m: float, k: float, n: float, batch: int = 1, reserved: int = 0) -> float:
        return gemm_seconds(m, k, n, self.cluster, dtype_bytes=self.model.dtype_bytes, batch=batch, reserved=reserved)

    @property
    def overlap_reserved_units(self) -> int:
        """Units of the GPU that the forward output projection's overlapped reduce-scatter
        keeps for its communication kernels (``Framework.overlap_reserved_units``), where
        the plan overlaps its tensor-parallel collectives (tp > 1, ``tp_overlap`` > 0) on a
        GPU whose ``matmul_units`` are given; none otherwise."""
        plan, units = self.plan, self.cluster.matmul_units
        if units <= 0 or plan.tp == 1 or plan.tp_overlap <= 0:
            return 0
        return min(framework(plan.framework).overlap_reserved_units, units - 1)

    def products(self, *, grad: Grad = "none") -> Products:
        """Seconds of each of one layer's four linear products on one GPU: forward, or with
        ``grad`` their backward's input-gradient or weight-gradient products (:func:`_grad_gemm`).
        The forward output projection runs on the units its overlapped reduce-scatter leaves
        it (:attr:`overlap_reserved_units`)."""
        m, t, tokens = self.model, self.plan.tp, self.tokens
        gated = 2 if m.gated_ffn else 1
        reserved = self.overlap_reserved_units if grad == "none" else 0
        return Products(
            qkv=self._grad_gemm(tokens, m.hidden, (m.q_width + 2 * m.kv_width) // t, grad),
            out=self._grad_gemm(tokens, m.q_width // t, m.hidden, grad, reserved),
            ffn_in=self._grad_gemm(tokens, m.hidden, gated * m.ffn_hidden // t, grad),
            ffn_out=self._grad_gemm(tokens, m.ffn_hidden // t, m.hidden, grad),
        )

    def _grad_gemm(self, m: float, k: float, n: float, grad: Grad, reserved: int = 0) -> float:
        """Seconds of the forward product ``(m × k) · (k × n)`` (m tokens), or of its
        input gradient ``(m × n) · (n × k)`` or weight gradient ``(k × m) · (m × n)``: the
        same FLOPs and bytes, a different output tiling; ``reserved`` units kept from it."""
        if grad == "input":
            return self._gemm(m, n, k, reserved=reserved)
        if grad == "weight":
            return self._gemm(k, m, n, reserved=reserved)
        return self._gemm(m, k, n, reserved=reserved)

    def _backward_products(self, forward: Products) -> tuple[Products, Products]:
        """The input-gradient and weight-gradient products of a layer whose forward
        products are ``forward``: priced by their shapes where the cluster tiles its
        products over units, else the forward's own (the same FLOPs and bytes)."""
        if self.cluster.matmul_units <= 0:
            return forward, forward
        return self.products(grad="input"), self.products(grad="weight")

    def linear_seconds(self) -> tuple[float, int]:
        """(seconds, kernels) of one layer's four linear products, forward."""
        return self.products().total, 4

    def attention_seconds(self) -> tuple[float, int]:
        """(seconds, kernels) of attention's core, forward: 4·b·(s/cp)·s·heads·d/t FLOPs."""
        m, plan = self.model, self.plan
        heads = plan.microbatch_size * m.heads // plan.tp
        width, q, k = m.head_width, self.local_seq, m.seq_len
        if plan.flash_attention:
            return _fused_attention_seconds(q, k, width, heads, self.cluster, dtype_bytes=m.dtype_bytes), 1
        seconds = self._gemm(q, width, k, heads) + self._gemm(q, k, width, heads)
        return seconds, 2

    def tp_all_reduce(self) -> float:
        """One tensor-parallel all-reduce of b·s·h values (with sequence parallelism a
        reduce-scatter plus an all-gather), in seconds."""
        if self.plan.tp == 1:
            return 0.0
        size = self.tokens * self.model.hidden * self.model.dtype_bytes
        if self.plan.sequence_parallel:
            return 2 * gather_seconds(size, self.tp_group, self.cluster)
        return all_reduce_seconds(size, self.tp_group, self.cluster)

    def tp_exposed(self, products: Products) -> float:
        """Seconds of one layer's forward tensor-parallel collectives that the products next
        to them do not hide (the backward's mirror them: the same collectives beside
        products of the same shapes): the sum of :meth:`tp_exposed_by_product`."""
        return self.tp_exposed_by_product(products).total

    def tp_exposed_by_product(self, products: Products) -> Products:
        """Seconds of each forward tensor-parallel collective that its product does not
        hide, by the product it runs beside. With sequence parallelism each block gathers
        its input before its column-split product and reduce-scatters after its row-split
        one; without, it all-reduces after its row-split product. Each collective runs
        decomposed into tp steps under the product's (:func:`pipelined_exposed`), the
        plan's ``tp_overlap`` of the product's time hiding it."""
        plan = self.plan
        if plan.tp == 1:
            return Products(0.0, 0.0, 0.0, 0.0)
        hide = plan.tp_overlap
        both = self.tp_all_reduce()
        half = both / 2 if plan.sequence_parallel else 0.0
        row = half if plan.sequence_parallel else both

        def exposed(comm: float, compute: float) -> float:
            return pipelined_exposed(comm, hide * compute, plan.tp)

        return Products(
            qkv=exposed(half, products.qkv),
            out=exposed(row, products.out),
            ffn_in=exposed(half, products.ffn_in),
            ffn_out=exposed(row, products.ffn_out),
        )

    def layer_activation_bytes(self, recompute: Recompute) -> float:
        """Bytes one layer keeps per microbatch for its backward: under this project's
        executor (the ``pipedsl`` framework) what its compiled stage programs keep
        (:func:`~pipedsl.simulator.activations.compiled_layer_bytes`), under Megatron-LM and
        DeepSpeed :meth:`megatron_activation_bytes`."""
        plan = self.plan
        if framework(plan.framework).name == "pipedsl":
            return compiled_layer_bytes(
                self.model, tokens=self.tokens, recompute=recompute, tp=plan.tp,
                sequence_parallel=plan.sequence_parallel, flash_attention=plan.flash_attention,
                fp32_scores=plan.fp32_scores,
            )  # fmt: skip
        return self.megatron_activation_bytes(recompute)

    def megatron_activation_bytes(self, recompute: Recompute) -> float:
        """Bytes one layer keeps per microbatch for its backward in Megatron-LM (and XLA's
        compiled programs under the same remat policy), by its shape (values of the
        model's ``dtype_bytes`` e, as the executor keeps them: 2 in bf16, 4 in fp32;
        1-byte dropout masks; Korthikanti et al. 2022's accounting, which for GPT in 16
        bits is s·b·h·(10 + 24/t + 5·a·s/(h·t))), per token of the microbatch on this GPU:

        - outside the tensor-parallel split (split too with sequence parallelism): the
          norms' inputs e·h each (one norm in a parallel block, two otherwise), the inputs
          of the QKV and first feed-forward products e·h each (one shared input in a
          parallel block), and with dropout its two masks 2·h·1;
        - split over t: Q e·q (q = heads × head width), K and V e·kv each, the output
          projection's input e·q, the feed-forward's g·f outputs (g = 2 gated: gate and
          up) e·g·f and the activation's output e·f (for GPT's 4h GELU block in 16 bits:
          8h + 8h);
        - without FlashAttention or selective recomputation, the scores and softmax 2·e·a·s
          and the dropout mask a·s, per query token (against all s keys).

        A remat policy that reruns each layer (``Recompute.per_layer``) keeps the layer's
        input e·h and what it saves that the backward reads (:meth:`Recompute`): Q, K and V
        e·(q + 2·kv)/t, the feed-forward's input products e·g·f/t, the attention's output
        projection e·h (which rebuilds the feed-forward's input in a sequential block; a
        parallel block's backward reads none of its products' sums), the feed-forward's
        input e·h.
        """
        m, t = self.model, self.plan.tp
        h, q, kv, f, e = m.hidden, m.q_width, m.kv_width, m.ffn_hidden, m.dtype_bytes
        tokens = self.tokens
        shared = t if self.plan.sequence_parallel else 1
        gated = 2 if m.gated_ffn else 1
        if recompute.per_layer:
            kept = e * h / shared
            residual = 0.0 if m.parallel_block else e * h / shared
            if recompute is Recompute.SAVE_DOTS:
                kept += e * (q + 2 * kv + gated * f) / t + residual
            elif recompute is Recompute.SAVE_QKV_PROJ:
                kept += e * (q + 2 * kv) / t + residual
            elif recompute is Recompute.SAVE_MLP_INPUTS:
                kept += e * h / shared
            return tokens * kept
        inputs = (m.norms + (1 if m.parallel_block else 2)) * e * h
        replicated = inputs + (2 * h if m.dropout else 0)
        split = e * (2 * q + 2 * kv + gated * f + f)
        scores = (
            0.0 if self.plan.flash_attention or recompute is Recompute.SELECTIVE else (2 * e + 1) * m.heads * m.seq_len
        )
        return tokens * (replicated / shared + (split + scores) / t)

    def layer_weight_residual_bytes(self) -> float:
        """Bytes one layer keeps per microbatch from its input-gradient pass (``I``) to its
        weight-gradient pass (``W``) where a schedule splits the backward: what ``W`` still
        needs, the inputs of the weight products and the cotangents of their outputs,
        whatever the recompute mode. Under this project's executor what its split programs
        hand over (:func:`~pipedsl.simulator.activations.compiled_weight_layer_bytes`);
        under Megatron-LM and DeepSpeed what the zero-bubble implementation's store of
        deferred weight gradients holds per linear layer (its input and its output's
        cotangent; the norms' weights take their gradients in ``I``), per token, in the
        compute dtype e: the inputs e·h of the QKV and first feed-forward products (whole,
        or split t ways under sequence parallelism), e·q of the output projection and e·f
        of the down projection (split over t); the cotangents e·(q + 2·kv) of QKV and
        e·g·f of the feed-forward's input products (split over t), e·h of the output and
        down projections (whole, or split under sequence parallelism)."""
        m, plan = self.model, self.plan
        if framework(plan.framework).name == "pipedsl":
            return compiled_weight_layer_bytes(
                m, tokens=self.tokens, tp=plan.tp, sequence_parallel=plan.sequence_parallel
            )
        t = plan.tp
        h, q, kv, f, e = m.hidden, m.q_width, m.kv_width, m.ffn_hidden, m.dtype_bytes
        shared = t if plan.sequence_parallel else 1
        gated = 2 if m.gated_ffn else 1
        replicated = e * h * (2 + 2)
        split = e * (q + f) + e * (q + 2 * kv + gated * f)
        return self.tokens * (replicated / shared + split / t)

    def head_weight_residual_bytes(self) -> float:
        """What the logits' weight gradient needs per microbatch from ``I`` to ``W``: its
        input e·h and the logits' cotangent e·V (split over t), and under this project's
        executor the final norm's normalised value and cotangent in fp32."""
        m, plan = self.model, self.plan
        e = m.dtype_bytes
        norm = 2 * NORM_BYTES * m.hidden if framework(plan.framework).name == "pipedsl" else 0
        return self.tokens * (norm + e * m.hidden + e * m.vocab) / plan.tp

    def embedding_weight_residual_bytes(self) -> float:
        """What the embedding's weight gradient needs per microbatch from ``I`` to ``W``:
        its output's cotangent e·h (split over t)."""
        return self.tokens * self.model.dtype_bytes * self.model.hidden / self.plan.tp

    def layer_work(self) -> Work:
        """One transformer layer for one microbatch on one GPU."""
        m, plan, launch = self.model, self.plan, self.cluster.kernel_launch_s
        products = self.products()
        linear, linear_kernels = products.total, 4
        input_products, weight_products = self._backward_products(products)
        attention, attention_kernels = self.attention_seconds()
        score_bytes = (
            0.0 if plan.flash_attention else self.tokens * (2 * m.dtype_bytes + 1) * m.heads * m.seq_len / plan.tp
        )
        elementwise_kernels = ELEMENTWISE_KERNELS + (0 if plan.flash_attention else 2)
        # The compute model was fitted on Megatron-LM's runs, so its traffic is Megatron's,
        # less what a compiler fuses into the products around it.
        elementwise = self.cluster.elementwise_traffic * self.traffic_seconds(
            2 * self.megatron_activation_bytes(Recompute.NONE)
        )
        exposed = self.tp_exposed_by_product(products)
        collectives = exposed.total
        exchange_forward, exchange_backward = exposed_exchange(self, attention)
        forward = (
            linear + attention + elementwise + collectives + exchange_forward
            + launch * (linear_kernels + attention_kernels + elementwise_kernels)
        )  # fmt: skip
        # I carries everything on the activation-gradient path: the input-gradient matmuls,
        # attention's core, the elementwise backward and the backward collectives.
        input_grad = (
            input_products.total + (FLASH_BACKWARD if plan.flash_attention else 2) * attention + 2 * elementwise
            + collectives + exchange_backward
            + launch * (linear_kernels + 2 * attention_kernels + elementwise_kernels)
        )  # fmt: skip
        if plan.recompute is Recompute.FULL:
            input_grad += forward - self._not_rerun(products, exposed)
        elif plan.recompute is Recompute.SELECTIVE and not plan.flash_attention:
            input_grad += attention + self.traffic_seconds(2 * score_bytes) + launch * (attention_kernels + 2)
        elif plan.recompute.per_layer:
            input_grad += self._rerun(products, attention, elementwise, collectives, exchange_forward)
        return Work(forward, input_grad, weight_products.total + launch * linear_kernels)

    def _not_rerun(self, products: Products, exposed: Products) -> float:
        """Seconds of a layer's forward that full recomputation does not rerun: none where
        the framework reruns the forward function as it is; under a traced remat
        (``Framework.traced_remat``: ``jax.checkpoint``, whose rerun XLA prunes to what
        the backward reads) the products whose outputs only join the residual sum, with
        their collectives and launches: the feed-forward's last product, and in a parallel
        block the attention's output projection too (a sequential block's backward reads
        it: it rebuilds the feed-forward's norm input)."""
        if not framework(self.plan.framework).traced_remat:
            return 0.0
        launch = self.cluster.kernel_launch_s
        skipped = products.ffn_out + exposed.ffn_out + launch
        if self.model.parallel_block:
            skipped += products.out + exposed.out + launch
        return skipped

    def _rerun(
        self, products: Products, attention: float, elementwise: float, collectives: float, exchange: float
    ) -> float:
        """Seconds the backward reruns of a layer's forward under a named remat policy:
        what rebuilds the values the backward reads from the layer's input and what the
        policy saved (:class:`~pipedsl.simulator.plan.Recompute`). Every policy reruns the
        norms and activations (the elementwise work) and attention's core; saving the
        projections spares their products, saving the feed-forward's input spares only
        the feed-forward's last product (and its collective)."""
        launch, recompute = self.cluster.kernel_launch_s, self.plan.recompute
        rerun = attention + elementwise + launch * (1 + ELEMENTWISE_KERNELS)
        if recompute is Recompute.SAVE_QKV_PROJ:
            rerun += products.ffn_in + collectives / 4 + launch
        elif recompute is Recompute.SAVE_MLP_INPUTS:
            rerun += products.qkv + products.out + products.ffn_in + 3 * collectives / 4 + exchange + 3 * launch
        return rerun

    def embedding_work(self) -> Work:
        """Token (and position) lookup, its dropout, and the scatter-add of its gradient."""
        size = self.tokens * self.model.hidden * self.model.dtype_bytes / self.plan.tp
        seconds = self.traffic_seconds(2 * size) + self.cluster.kernel_launch_s
        return Work(seconds, 0.0, 2 * seconds)

    def head_work(self) -> Work:
        """Final norm, logits (2·b·s·h·V/t FLOPs) and the vocabulary-parallel loss."""
        m, t, launch = self.model, self.plan.tp, self.cluster.kernel_launch_s
        logits = [self._grad_gemm(self.tokens, m.hidden, m.vocab / t, g) + launch for g in _GRADS]
        loss = self.traffic_seconds(2 * self.head_activation_bytes()) + 2 * launch
        return Work(logits[0] + loss, logits[1] + 2 * loss, logits[2])

    def head_activation_bytes(self) -> float:
        """The loss's softmax (fp32, or in ``dtype_bytes`` without ``Model.fp32_logits``)
        plus the final norm's input, per microbatch."""
        m, t = self.model, self.plan.tp
        logit_bytes = LOSS_BYTES if m.fp32_logits else m.dtype_bytes
        return self.tokens * (m.vocab * logit_bytes + m.hidden * m.dtype_bytes) / t

    def embedding_activation_bytes(self) -> float:
        """The embedding dropout's mask, one byte per value (nothing without dropout)."""
        return self.tokens * self.model.hidden / self.plan.tp if self.model.dropout else 0.0
