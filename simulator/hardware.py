"""What is trained and on what: a transformer by its shape, a cluster by its GPUs and links.

Both are frozen, keyword-only dataclasses checked on construction, so a description that
exists is a sound one. Built-in presets live as TOML files in
:mod:`pipedsl.simulator.presets`; a user's own description is a TOML file of the same
form, a ``[model]`` or a ``[cluster]`` table whose keys are the field names::

    [model]
    name = "gpt3-175b"
    layers = 96
    hidden = 12288
    ffn_hidden = 49152
    heads = 96
    seq_len = 2048
    vocab = 51200

:func:`load_model` and :func:`load_cluster` take either a preset name or a path.

Units: bytes, seconds, FLOP/s and bytes per second throughout. A FLOP is one
floating-point operation, whatever its precision (a multiply-add is two).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from pipedsl.errors import PipedslError
from pipedsl.run_options import Precision
from pipedsl.simulator.tomlfile import read_toml

__all__ = [
    "ACTIVATIONS",
    "DescriptionError",
    "Model",
    "Cluster",
    "load_model",
    "load_cluster",
    "model_presets",
    "cluster_presets",
]

_PRESETS = "pipedsl.simulator.presets"

ACTIVATIONS = ("gelu", "relu", "squared_relu", "silu")
"""The feed-forward nonlinearities a :class:`Model` names (``Model.activation``)."""


class DescriptionError(PipedslError):
    """A model or cluster description is malformed, out of range, or cannot be found."""


def _check_int(owner: str, name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DescriptionError(f"{owner}: {name} must be a whole number, got {value!r}")
    if value < minimum:
        raise DescriptionError(f"{owner}: {name} must be >= {minimum}, got {value}")


def _check_float(owner: str, name: str, value: object, *, low: float = 0.0, high: float = math.inf) -> None:
    """Check ``low < value <= high`` for a finite number (``high`` may be infinite)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DescriptionError(f"{owner}: {name} must be a number, got {value!r}")
    if not math.isfinite(value) or not low < value <= high:
        bound = f"in ({low:g}, {high:g}]" if math.isfinite(high) else f"> {low:g}"
        raise DescriptionError(f"{owner}: {name} must be {bound}, got {value!r}")


def _check_within(owner: str, name: str, value: object, bound: str, within: Callable[[float], bool]) -> None:
    """Check that ``value`` is a finite number for which ``within`` holds; else say it must
    be a number ``bound`` (``">= 0"``, ``"in [0, 1]"``, ...)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not within(value):
        raise DescriptionError(f"{owner}: {name} must be a number {bound}, got {value!r}")


def _check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise DescriptionError(f"{owner}: {name} must be true or false, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Model:
    """A decoder-only transformer, by its shape.

    Attributes:
      name: what to call it in tables.
      layers: number of transformer layers L.
      hidden: hidden size h (the width of the residual stream).
      ffn_hidden: inner width f of the feed-forward block (4h for GPT).
      heads: attention heads a; ``hidden`` must be a multiple of it.
      kv_heads: key/value heads for grouped-query attention; None means ``heads``.
      seq_len: tokens per sequence s.
      vocab: vocabulary size V (as padded for the embedding table).
      dtype_bytes: bytes per weight and activation value (2 for bf16/fp16).
      gated_ffn: True for a gated feed-forward block (SwiGLU: three h×f matrices), False
        for the two-matrix GPT block.
      biases: True when linear layers have biases and norms are LayerNorm (weight and
        bias); False for bias-free layers with RMSNorm (weight only).
      learned_positions: True for a learned position-embedding table (s×h), False for
        rotary or other parameter-free positions.
      tied_embeddings: True when the logit layer reuses the input embedding matrix.
      dropout: whether attention and the feed-forward block end in dropout (GPT; not Llama).
      head_dim: width of one attention head; None means ``hidden / heads`` (which must then
        divide). Many models set it apart: MaxText's 2023 default decoder has heads of 256
        whatever its width, Gemma 256 at hidden 3072 with 16 heads.
      parallel_block: True where attention and the feed-forward block both read one norm's
        output and add their sums to the residual together (GPT-J, PaLM, MaxText's 2023
        decoder); False for the sequential pre-norm block (a norm before each).
      activation: the feed-forward block's nonlinearity (:data:`ACTIVATIONS`): ``gelu``
        (GPT), ``silu`` (SwiGLU with ``gated_ffn``: Llama), ``relu`` (MaxText's 2023
        decoder), ``squared_relu`` (Nemotron-4).
      fp32_logits: whether the logits and their softmax are kept in fp32 for the loss's
        backward (Megatron-LM, MaxText); False keeps them in ``dtype_bytes``.
      param_bytes: bytes per stored parameter; None means ``dtype_bytes``. A 16-bit model
        (``dtype_bytes = 2``) with ``param_bytes = 2`` keeps 16-bit weights beside an fp32
        master copy in the optimizer state (Megatron-LM's mixed precision); with
        ``param_bytes = 4`` it keeps fp32 parameters only and computes in bf16, casting
        each weight where it is used (MaxText, Flax's default), with no separate master.
    """

    name: str
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int | None = None
    seq_len: int
    vocab: int
    dtype_bytes: int = 2
    gated_ffn: bool = False
    biases: bool = True
    learned_positions: bool = True
    tied_embeddings: bool = True
    dropout: bool = True
    head_dim: int | None = None
    parallel_block: bool = False
    activation: str = "gelu"
    fp32_logits: bool = True
    param_bytes: int | None = None

    def __post_init__(self) -> None:
        owner = f"model {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise DescriptionError(f"model name must be a non-empty string, got {self.name!r}")
        for name in ("layers", "hidden", "ffn_hidden", "heads", "seq_len", "vocab", "dtype_bytes"):
            _check_int(owner, name, getattr(self, name))
        for name in ("kv_heads", "head_dim", "param_bytes"):
            if getattr(self, name) is not None:
                _check_int(owner, name, getattr(self, name))
        for name in ("gated_ffn", "biases", "learned_positions", "tied_embeddings", "dropout", "parallel_block",
                     "fp32_logits"):  # fmt: skip
            _check_bool(owner, name, getattr(self, name))
        if self.activation not in ACTIVATIONS:
            raise DescriptionError(
                f"{owner}: activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}"
            )
        if self.param_bytes is not None and (self.param_bytes not in (2, 4) or self.param_bytes < self.dtype_bytes):
            raise DescriptionError(
                f"{owner}: param_bytes must be 2 or 4 and at least dtype_bytes {self.dtype_bytes} (parameters are"
                f" stored at least as wide as they are computed with), got {self.param_bytes!r}"
            )
        if self.head_dim is None and self.hidden % self.heads:
            raise DescriptionError(
                f"{owner}: hidden {self.hidden} is not a multiple of heads {self.heads}; "
                "each head needs the same width hidden/heads, or give head_dim"
            )
        if self.heads % self.num_kv_heads:
            raise DescriptionError(
                f"{owner}: heads {self.heads} is not a multiple of kv_heads {self.num_kv_heads}; "
                "grouped-query attention shares each key/value head among the same number of query heads"
            )

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def precision(self) -> Precision:
        """The executor's precision that trains this model as it is priced: ``"fp32"`` for
        4-byte values, else ``"bf16"`` (bf16 compute and activations over fp32 master
        weights, as :mod:`~pipedsl.simulator.memory` prices a model of 2-byte values)."""
        return "fp32" if self.dtype_bytes == 4 else "bf16"

    @property
    def head_width(self) -> int:
        """Width of one attention head: ``head_dim``, or hidden/heads."""
        return self.hidden // self.heads if self.head_dim is None else self.head_dim

    @property
    def q_width(self) -> int:
        """Width of the query projection (and of the attention's output): heads × head width."""
        return self.heads * self.head_width

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: kv_heads × head width."""
        return self.num_kv_heads * self.head_width

    @property
    def stored_bytes(self) -> int:
        """Bytes per stored parameter: ``param_bytes``, or ``dtype_bytes``."""
        return self.dtype_bytes if self.param_bytes is None else self.param_bytes

    @property
    def norms(self) -> int:
        """Norms per layer: one before attention and the feed-forward block together in a
        parallel block, one before each otherwise."""
        return 1 if self.parallel_block else 2

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matrix multiplications: Q, K, V, output and feed-forward."""
        h, f = self.hidden, self.ffn_hidden
        attention = 2 * h * self.q_width + 2 * h * self.kv_width
        ffn = (3 if self.gated_ffn else 2) * h * f
        return attention + ffn

    @property
    def layer_params(self) -> int:
        """All parameters of one layer: matmul weights, their biases and its norms."""
        h, f = self.hidden, self.ffn_hidden
        if self.biases:
            bias = self.q_width + 2 * self.kv_width + h + (2 if self.gated_ffn else 1) * f + h
            return self.layer_matmul_params + bias + self.norms * 2 * h
        return self.layer_matmul_params + self.norms * h

    @property
    def embedding_params(self) -> int:
        """The input token embedding (V×h) plus learned positions (s×h) if any."""
        positions = self.seq_len * self.hidden if self.learned_positions else 0
        return self.vocab * self.hidden + positions

    @property
    def head_params(self) -> int:
        """The final norm plus the logit matrix when it is not tied to the embedding."""
        norm = (2 if self.biases else 1) * self.hidden
        return norm + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def num_params(self) -> int:
        """N, every trainable parameter (a tied embedding counted once)."""
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    @property
    def layer_forward_flops_per_token(self) -> int:
        """Forward FLOPs of one layer per token: 2 per matmul weight plus attention's 4·s·h.

        The attention term counts QKᵀ and the attention-weighted values over the full
        sequence (2·s·heads·head width each: 2·s·h where heads × head width is h), as
        Megatron-LM's accounting does.
        """
        return 2 * self.layer_matmul_params + 4 * self.seq_len * self.q_width

    @property
    def logit_forward_flops_per_token(self) -> int:
        """Forward FLOPs of the logit layer per token: 2·h·V."""
        return 2 * self.hidden * self.vocab


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """A cluster of identical GPUs in nodes, with a fast link inside a node and network
    adapters between nodes; or of TPU chips in a torus (``torus`` set), in one slice or in
    several joined by the data-center network.

    Bandwidths are per direction, as data sheets give them: per GPU inside a node, per
    adapter between nodes; the efficiency fields say which fraction of them collectives
    achieve. Latencies are the fixed cost of one message (one step of a ring).

    Matrix multiplications run at ``min(peak, intensity × HBM bandwidth)`` (a roofline;
    intensity is the product's FLOPs over the bytes of its three matrices) times
    ``matmul_efficiency × F / (F + matmul_half_flops)`` for a product of F FLOPs: large
    products approach ``matmul_efficiency``, small ones fall off. On a GPU whose
    ``matmul_units`` (streaming multiprocessors) are given, a product's output is computed in
    tiles spread over them in waves, so its shape costs it too: the last wave's idle units and
    each tile's ``matmul_k_fill`` (:func:`~pipedsl.simulator.transformer.gemm_seconds`). Every kernel costs
    ``kernel_launch_s`` more. These and ``elementwise_traffic`` are fitted once per GPU
    type or TPU chip from published runs (``python -m pipedsl.simulator.fit_published``, see
    data/README.md).

    Attributes:
      name: what to call it in tables.
      gpu: the GPU's name.
      peak_flops: dense 16-bit matrix FLOP/s of one GPU.
      matmul_efficiency: fraction of ``peak_flops`` that the largest matrix
        multiplications approach in training.
      matmul_half_flops: FLOPs of a matrix multiplication that reaches half of
        ``matmul_efficiency``; 0 prices every product at ``matmul_efficiency``.
      matmul_units: streaming multiprocessors of one GPU (132 on an H100 SXM, 108 on an
        A100), over which a product's output tiles run in waves; 0 (TPU chips, CPU devices)
        prices no wave quantization.
      matmul_k_fill: where ``matmul_units`` is set, the fixed work of one output tile (its
        pipeline's fill and drain, its epilogue) in units of the contraction's length: a
        product of contraction k runs at ``k / (k + matmul_k_fill)`` of its tiles' rate.
      kernel_launch_s: fixed seconds per kernel (launch and tail), on top of its work;
        for CPU devices measured by ``pipedsl calibrate``.
      action_overhead_s: fixed seconds per program the executor dispatches for a stage's
        actions on pipeline devices of their own, on top of its kernels: one per task
        (:mod:`pipedsl.tasks`: an action, or a device's consecutive actions with nothing sent
        or received between them). 0 for a GPU cluster whose kernels are queued ahead;
        measured by ``pipedsl calibrate`` for CPU devices, where the host's dispatch shows.
      step_overhead_s: fixed seconds per training step on top of its actions and its
        update: the executor's own work to start a step, hand the batch out and gather
        the losses. 0 for the GPU presets (their published runs include no such cost);
        measured by ``pipedsl calibrate`` (a step of four microbatches against one).
      host_cores: CPU cores that the devices of one node share, for devices without
        compute of their own (forced CPU devices); None for GPUs. The rates above are
        then those of a device while every device of its node computes, and a device
        that computes while fewer do gets more of the cores (:meth:`speedup`).
      busy_rates: where ``host_cores`` is set, the node's compute rate while n of its
        devices compute, as a fraction of its rate while all of them do, at index n - 1:
        one entry per device of the node (``gpus_per_node``), the last 1. A device's
        stream of small kernels leaves gaps, so fewer busy devices use less of the cores
        than their share. Measured by ``pipedsl calibrate`` (the same step on 1, 2, 4, ...
        devices while the others idle); empty: each busy device gets its share of
        ``host_cores``, at most one core.
      memory_bytes: memory of one GPU in bytes.
      reserved_bytes: bytes of it not available to the model: CUDA context, collective
        buffers, allocator fragmentation.
      hbm_bandwidth: memory bandwidth of one GPU in bytes per second; bounds the
        elementwise work (norms, softmax, activations, the optimizer update).
      elementwise_traffic: the share of a layer's elementwise HBM traffic, as unfused
        kernels move it (:mod:`~pipedsl.simulator.transformer`), that its programs
        move: below 1 where a compiler or fused kernels take elementwise work into the
        products around it, as XLA on a TPU and Transformer Engine on an H100 do; fitted
        with the compute model on each preset's published runs, ``pipedsl calibrate``
        fits it on an accelerator.
      gpus_per_node: GPUs in one node, joined by the intra-node link.
      intra_node_bandwidth: bytes per second per GPU per direction inside a node (NVLink).
      intra_node_efficiency: fraction of it that collectives and sends achieve.
      intra_node_latency: seconds per message inside a node.
      collective_latency_s: fixed seconds of one collective (all-reduce, all-gather,
        reduce-scatter) whatever its size and group, on top of its messages: its launch
        and the rendezvous of its devices, which on devices that share a host's cores
        waits for each of them to be scheduled. 0 in the GPU presets (within their
        fitted per-message latency); ``pipedsl calibrate`` fits it to tensor-parallel
        training steps, whose collectives run while the devices compute.
      nics_per_node: network adapters per node; None means one per GPU.
      inter_node_bandwidth: bytes per second per direction of one network adapter.
      inter_node_efficiency: fraction of it achieved.
      inter_node_latency: seconds per message between nodes.
      leaf_nodes, spine_latency_s, spine_efficiency, straggler_cv: :mod:`~pipedsl.simulator.network`
        (``straggler_cv`` the spread of the nodes' step times, a fraction; 0 on a torus, whose
        slices wait for each other per layer: ``slice_jitter_s``).
      slice_jitter_s: on a torus, the spread (standard deviation, seconds) of a slice's time
        between two meetings of the slices, each layer's traffic across them over DCN
        (:func:`~pipedsl.simulator.network.slice_wait_s`); 0 for GPUs.
      torus: for a TPU cluster, the longest slice it offers, chips per torus axis (v5e
        ``[16, 16]``, v5p ``[16, 16, 24]``); empty for GPUs. Its chips are then joined by ICI
        links along each axis: ``intra_node_*`` describe one link (bytes per second per
        direction, seconds per hop), ``gpus_per_node`` is the chips per host and the
        ``inter_node_*`` and ``nics_per_node`` fields a host's DCN adapters
        (:mod:`~pipedsl.simulator.torus`).
      torus_wrap: a torus axis has wraparound links where its length is a multiple of this
        (16 for v5e: a whole pod axis; 4 for v5p: whole 4 x 4 x 4 cubes).
      slices: slices of the torus joined by DCN (``pipedsl search --slices``); 1 but for a torus.
    """

    name: str
    gpu: str
    peak_flops: float
    matmul_efficiency: float
    matmul_half_flops: float = 0.0
    matmul_units: int = 0
    matmul_k_fill: float = 0.0
    kernel_launch_s: float = 0.0
    action_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    host_cores: float | None = None
    busy_rates: tuple[float, ...] = ()
    memory_bytes: int
    reserved_bytes: int = 0
    hbm_bandwidth: float
    elementwise_traffic: float = 1.0
    gpus_per_node: int
    intra_node_bandwidth: float
    intra_node_efficiency: float = 1.0
    intra_node_latency: float
    collective_latency_s: float = 0.0
    nics_per_node: int | None = None
    inter_node_bandwidth: float
    inter_node_efficiency: float = 1.0
    inter_node_latency: float
    leaf_nodes: int = 0
    spine_latency_s: float = 0.0
    spine_efficiency: float = 1.0
    straggler_cv: float = 0.0
    slice_jitter_s: float = 0.0
    torus: tuple[int, ...] = ()
    torus_wrap: int = 1
    slices: int = 1

    def __post_init__(self) -> None:
        owner = f"cluster {self.name!r}"
        _check_int(owner, "leaf_nodes", self.leaf_nodes, minimum=0)
        _check_int(owner, "matmul_units", self.matmul_units, minimum=0)
        for name in ("name", "gpu"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise DescriptionError(f"{owner}: {name} must be a non-empty string, got {value!r}")
        for name in (
            "peak_flops",
            "hbm_bandwidth",
            "elementwise_traffic",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
        ):
            _check_float(owner, name, getattr(self, name))
        for name in ("matmul_efficiency", "intra_node_efficiency", "inter_node_efficiency", "spine_efficiency"):
            _check_float(owner, name, getattr(self, name), high=1.0)
        for name in (
            "intra_node_latency", "inter_node_latency", "matmul_half_flops", "matmul_k_fill", "kernel_launch_s",
            "action_overhead_s",
            "step_overhead_s", "collective_latency_s", "spine_latency_s", "straggler_cv", "slice_jitter_s",
        ):  # fmt: skip
            _check_within(owner, name, getattr(self, name), ">= 0", lambda v: v >= 0)
        if self.host_cores is not None:
            _check_float(owner, "host_cores", self.host_cores)
        self._check_busy_rates(owner)
        _check_int(owner, "memory_bytes", self.memory_bytes)
        _check_int(owner, "reserved_bytes", self.reserved_bytes, minimum=0)
        _check_int(owner, "gpus_per_node", self.gpus_per_node)
        if self.nics_per_node is not None:
            _check_int(owner, "nics_per_node", self.nics_per_node)
        self._check_torus(owner)
        if self.reserved_bytes >= self.memory_bytes:
            raise DescriptionError(
                f"{owner}: reserved_bytes {self.reserved_bytes} leaves nothing of memory_bytes {self.memory_bytes}"
            )

    def _check_torus(self, owner: str) -> None:
        if isinstance(self.torus, str) or not isinstance(self.torus, tuple | list):
            raise DescriptionError(f"{owner}: torus must be a list of chips per axis, got {self.torus!r}")
        # A TOML array arrives as a list: kept as a tuple, so that the cluster stays hashable.
        object.__setattr__(self, "torus", tuple(self.torus))
        if self.torus and len(self.torus) not in (2, 3):
            raise DescriptionError(f"{owner}: torus needs 2 or 3 axes (a 2D or 3D torus), got {list(self.torus)}")
        for n in self.torus:
            _check_int(owner, "each torus axis", n)
        _check_int(owner, "torus_wrap", self.torus_wrap)
        _check_int(owner, "slices", self.slices)
        if self.torus and self.straggler_cv > 0:
            raise DescriptionError(
                f"{owner}: straggler_cv = {self.straggler_cv} is the spread of GPU nodes' step times; a torus's"
                " slices wait for each other at every layer's crossing: give slice_jitter_s (seconds) instead"
            )
        if self.slice_jitter_s > 0 and not self.torus:
            raise DescriptionError(
                f"{owner}: slice_jitter_s = {self.slice_jitter_s} needs a torus (TPU slices joined by DCN); the"
                " nodes of a GPU cluster spread by straggler_cv"
            )
        if self.slices > 1 and not self.torus:
            raise DescriptionError(
                f"{owner}: slices = {self.slices} needs a torus; slices joined by DCN are a TPU cluster's"
            )

    @property
    def devices_word(self) -> str:
        """What its devices are called in output: ``chips`` for TPUs (a torus, or a cluster
        ``pipedsl calibrate`` measured on a TPU, whose device kind JAX names ``TPU ...``),
        else ``GPUs``."""
        return "chips" if self.torus or self.gpu.startswith("TPU") else "GPUs"

    def _check_busy_rates(self, owner: str) -> None:
        if isinstance(self.busy_rates, str) or not isinstance(self.busy_rates, tuple | list):
            raise DescriptionError(f"{owner}: busy_rates must be a list of numbers, got {self.busy_rates!r}")
        # A TOML array arrives as a list: kept as a tuple, so that the cluster stays hashable.
        object.__setattr__(self, "busy_rates", tuple(self.busy_rates))
        if not self.busy_rates:
            return
        if len(self.busy_rates) != self.gpus_per_node:
            raise DescriptionError(
                f"{owner}: busy_rates has {len(self.busy_rates)} entries; it needs one per device of the node"
                f" (gpus_per_node = {self.gpus_per_node})"
            )
        for n, rate in enumerate(self.busy_rates, start=1):
            _check_float(owner, f"busy_rates (at {n} busy)", rate)

    @property
    def usable_bytes(self) -> int:
        """Memory per GPU the model may use: ``memory_bytes - reserved_bytes``."""
        return self.memory_bytes - self.reserved_bytes

    def speedup(self, busy: int) -> float:
        """How many times as fast as priced a device computes while ``busy`` devices of its
        node compute at once: the busy devices share the node's rate at that count
        (``busy_rates``; without it each gets its share of ``host_cores``, at most one
        core), and the priced rates are those a device gets while every device of the node
        computes. 1 for devices with compute of their own (``host_cores`` None)."""
        if self.host_cores is None:
            return 1.0
        every, busy = self.gpus_per_node, min(max(busy, 1), self.gpus_per_node)
        if self.busy_rates:
            return self.busy_rates[busy - 1] / busy / (self.busy_rates[-1] / every)
        cores = self.host_cores
        return min(1.0, cores / busy) / min(1.0, cores / every)

    @property
    def adapters_per_node(self) -> int:
        """Network adapters per node (one per GPU unless ``nics_per_node`` says otherwise)."""
        return self.gpus_per_node if self.nics_per_node is None else self.nics_per_node

    @property
    def network_share(self) -> float:
        """Achieved bytes per second between nodes of one GPU while every GPU of its node
        communicates: the node's adapters shared evenly."""
        adapters = self.adapters_per_node * self.inter_node_bandwidth * self.inter_node_efficiency
        return adapters / self.gpus_per_node

    def link(self, *, inter_node: bool) -> tuple[float, float]:
        """(achieved bytes per second, seconds per message) of one GPU's NVLink, or of one
        network adapter."""
        if inter_node:
            return self.inter_node_bandwidth * self.inter_node_efficiency, self.inter_node_latency
        return self.intra_node_bandwidth * self.intra_node_efficiency, self.intra_node_latency


# --- reading descriptions -------------------------------------------------------------

_INT_FIELDS = {"layers", "hidden", "ffn_hidden", "heads", "kv_heads", "seq_len", "vocab", "dtype_bytes", "head_dim",
               "param_bytes",
               "memory_bytes", "reserved_bytes", "gpus_per_node", "nics_per_node", "leaf_nodes", "matmul_units",
               "torus_wrap", "slices"}  # fmt: skip


def _coerce(table: str, key: str, value: Any, source: str) -> Any:
    """TOML writes ``80e9`` as a float; a whole-valued float is fine where a count is wanted."""
    if key in _INT_FIELDS and isinstance(value, float) and value.is_integer():
        return int(value)
    if key in _INT_FIELDS and isinstance(value, float):
        raise DescriptionError(f"{source}: [{table}] {key} must be a whole number, got {value!r}")
    return value


def _from_table(cls: type[Model] | type[Cluster], table: str, data: dict[str, Any], source: str) -> Any:
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise DescriptionError(f"{source}: unknown key {unknown[0]!r} in [{table}]; known keys are {', '.join(known)}")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise DescriptionError(f"{source}: [{table}] lacks {', '.join(missing)}")
    values = {key: _coerce(table, key, value, source) for key, value in data.items()}
    try:
        return cls(**values)
    except DescriptionError as err:
        raise DescriptionError(f"{source}: {err.message}") from None


def _read_toml(path: Path, table: str, cls: type[Model] | type[Cluster]) -> Any:
    data = read_toml(path, what=table, error=DescriptionError)
    if table not in data:
        other = ", ".join(f"[{k}]" for k in data if isinstance(data[k], dict)) or "no tables"
        raise DescriptionError(
            f"{path}: has no [{table}] table (found {other}); write the {table}'s keys under [{table}]"
        )
    extra = sorted(k for k in data if k != table)
    if extra:
        raise DescriptionError(f"{path}: unexpected top-level key {extra[0]!r}; a {table} file holds only [{table}]")
    return _from_table(cls, table, data[table], str(path))


def _preset_files() -> dict[str, Any]:
    folder = resources.files(_PRESETS)
    return {entry.name.removesuffix(".toml"): entry for entry in folder.iterdir() if entry.name.endswith(".toml")}


def _presets_of(table: str) -> tuple[str, ...]:
    names = []
    for name, entry in sorted(_preset_files().items()):
        with entry.open("rb") as handle:
            if table in tomllib.load(handle):
                names.append(name)
    return tuple(names)


def model_presets() -> tuple[str, ...]:
    """Names of the built-in models, for example ``gpt3-175b``."""
    return _presets_of("model")


def cluster_presets() -> tuple[str, ...]:
    """Names of the built-in clusters, for example ``a100-80gb``."""
    return _presets_of("cluster")


def _load(spec: str | Path, table: str, cls: type[Model] | type[Cluster], presets: tuple[str, ...]) -> Any:
    if isinstance(spec, str) and spec in presets:
        with resources.as_file(_preset_files()[spec]) as path:
            return _read_toml(Path(path), table, cls)
    path = Path(spec)
    if path.suffix == ".toml" or path.exists():
        return _read_toml(path, table, cls)
    raise DescriptionError(f"unknown {table} {str(spec)!r}; give a preset ({', '.join(presets)}) or a .toml file")


def load_model(spec: str | Path | Model) -> Model:
    """A model from a preset name (``gpt3-175b``) or a TOML file with a ``[model]`` table."""
    if isinstance(spec, Model):
        return spec
    return _load(spec, "model", Model, model_presets())


def load_cluster(spec: str | Path | Cluster) -> Cluster:
    """A cluster from a preset name (``a100-80gb``) or a TOML file with a ``[cluster]`` table."""
    if isinstance(spec, Cluster):
        return spec
    return _load(spec, "cluster", Cluster, cluster_presets())
