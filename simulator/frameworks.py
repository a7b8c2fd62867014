"""Framework profiles: what the training framework costs beyond the work it runs.

The same plan runs at different speeds under different frameworks: a pipeline engine that
interprets its schedule in Python, synchronises its sends or gathers tied weights per
microbatch pays a fixed cost that the kernels do not show. A :class:`Framework` prices it
with two numbers, on top of the estimate's work:

- ``microbatch_s``: seconds each stage spends per microbatch (charged to its forward);
- ``layer_s``: seconds per layer per microbatch (its forward, recomputation and backward
  together, charged to the forward): a framework that drives every layer from Python
  (DeepSpeed's pipeline module and its per-layer activation checkpointing) pays it;
- ``action_s``: seconds per scheduled action (each ``F`` and each ``B``; a split backward
  charges it to ``I``).

A profile also says how many of a GPU's streaming multiprocessors its overlapped
tensor-parallel collectives keep from the products (``overlap_reserved_units``): Transformer
Engine's userbuffer overlap (Megatron-LM and NeMo with ``tp_comm_overlap``) runs the
reduce-scatter after the attention's output projection by its "pipeline" method, whose
communication kernels take ``num_sm`` SMs while the GEMM is launched on the rest
(``set_sm_margin``); NeMo's H100 overlap configurations (``userbuffers.py`` of its
``tp_overlap_configs``: GPT-3 175B at tp 4, Llama 3.1 70B at tp 4, 405B at tp 8) all set 24
for that GEMM (``proj_fprop``). The other overlapped GEMMs reserve nothing (the ring
exchanges move data with the copy engines) or differ from configuration to configuration,
and are priced on every SM. XLA's collective matmul and this project's executor reserve
none; a GPU without ``matmul_units`` prices none
(:attr:`~pipedsl.simulator.transformer.Shapes.overlap_reserved_units`).

A profile also says how the framework recomputes a layer under full recomputation
(``traced_remat``): Megatron-LM and DeepSpeed rerun the layer's forward function as it is
(PyTorch's checkpointing), every product of it; a JAX program (MaxText, this project's
executor) reruns what ``jax.checkpoint`` traced and XLA kept after dead-code elimination:
only the values the backward reads, so the products whose outputs only join the residual
sum (the feed-forward's last product; in a parallel block the attention's output
projection too) are not rerun (:meth:`~pipedsl.simulator.transformer.Shapes.layer_work`).

Profiles (:data:`FRAMEWORKS`): ``megatron`` costs nothing more (the GPU presets' compute
model was fitted on Megatron-LM runs, so their fixed costs are in it); ``deepspeed``'s
``layer_s`` is fitted on the ``calibrate`` rows of DeepSpeed-pipeline runs in ``data/``
(``python -m pipedsl.simulator.fit_published``, :data:`LAYER_GRID`), never on its
``validate`` rows: a cost per stage and microbatch alone could not match both of its
configurations (7 and 13 layers per stage), one per layer can;
``maxtext`` costs nothing more on TPUs (the TPU presets' compute model was fitted on MaxText
runs); ``pipedsl`` is this project's executor on GPUs, whose dispatch is queued ahead of the
kernels (0 until measured on a GPU; on forced CPU devices the cluster's own
``action_overhead_s`` prices it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipedsl.errors import PipedslError

if TYPE_CHECKING:
    from pipedsl.simulator.hardware import Cluster

__all__ = ["Framework", "FRAMEWORKS", "LAYER_GRID", "DEFAULT_FRAMEWORK", "default_framework", "framework"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Framework:
    """A framework's fixed costs (see the module docstring), in seconds."""

    name: str
    microbatch_s: float = 0.0
    layer_s: float = 0.0
    action_s: float = 0.0
    traced_remat: bool = False
    overlap_reserved_units: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        units = self.overlap_reserved_units
        if isinstance(units, bool) or not isinstance(units, int) or units < 0:
            raise PipedslError(f"framework {self.name}: overlap_reserved_units must be an integer >= 0, got {units!r}")
        for name in ("microbatch_s", "layer_s", "action_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise PipedslError(f"framework {self.name}: {name} must be a number >= 0, got {value!r}")


FRAMEWORKS = {
    "megatron": Framework(
        name="megatron",
        overlap_reserved_units=24,
        source="Megatron-LM and NeMo: the compute model was fitted on their runs; Transformer Engine's userbuffer "
        "overlap keeps 24 SMs from the output projection's forward GEMM (NeMo's H100 overlap configurations)",
    ),
    "deepspeed": Framework(
        name="deepspeed",
        layer_s=0.016,
        source="Megatron-DeepSpeed's pipeline engine: fitted on the calibrate rows of data/published_runs_deepspeed.csv",
    ),
    "maxtext": Framework(
        name="maxtext", traced_remat=True, source="MaxText on TPUs: the compute model was fitted on its runs"
    ),
    "pipedsl": Framework(
        name="pipedsl", traced_remat=True, source="pipedsl's executor: kernels queued ahead of the dispatch on GPUs"
    ),
}
"""The known profiles by name."""

LAYER_GRID = tuple(round(0.002 * i, 3) for i in range(16))
"""The values of ``layer_s`` (seconds) the fit tries: 0 to 30 ms."""

DEFAULT_FRAMEWORK = "megatron"
"""The profile a :class:`~pipedsl.simulator.plan.Plan` is priced with unless it names
another; ``estimate`` and ``search`` take :func:`default_framework` of their cluster."""


def default_framework(cluster: Cluster) -> str:
    """The framework a plan on ``cluster`` is taken to run under: ``maxtext`` on TPU
    chips (a cluster with a torus), :data:`DEFAULT_FRAMEWORK` on GPUs."""
    return "maxtext" if cluster.torus else DEFAULT_FRAMEWORK


def framework(name: str | Framework) -> Framework:
    """The profile called ``name`` (a profile is itself); a clear error for an unknown one."""
    if isinstance(name, Framework):
        return name
    found = FRAMEWORKS.get(name)
    if found is None:
        raise PipedslError(f"unknown framework {name!r}; known: {', '.join(FRAMEWORKS)}")
    return found
