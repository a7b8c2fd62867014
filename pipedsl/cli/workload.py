"""What the machine calibration and the demo train: a model as the simulator prices it, run
as the executor's built-in model of its family (:class:`Workload`): on CPU devices the demo
transformer in fp32 (:data:`DEMO`), on an accelerator a small Llama in bf16 sized to the
device's memory (:func:`accelerator_workload`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipedsl.errors import PipedslError
from pipedsl.run_options import Precision
from pipedsl.simulator import Model

__all__ = ["DEMO_MODEL", "DEMO", "Workload", "accelerator_workload", "check_splits"]

DEMO_MODEL = Model(
    name="demo-cpu",
    layers=4,
    hidden=128,
    ffn_hidden=512,
    heads=4,
    seq_len=64,
    vocab=512,
    dtype_bytes=4,
    learned_positions=True,
    tied_embeddings=False,
    dropout=False,
)
"""The transformer calibrated and run on CPU devices: the executor's built-in one at this
shape (its layers split evenly over the schedule's stages; no dropout, as it has none)."""


@dataclass(frozen=True, slots=True)
class Workload:
    """What the machine calibration and the demo train: a model as the simulator prices it,
    run as the executor's built-in model of its family at its shape.

    Attributes:
      model: the simulator's description; a gated (SwiGLU) model runs as
        :func:`~pipedsl.executor.models.llama`, any other as
        :func:`~pipedsl.executor.models.transformer`, in the precision its values' size
        says (:attr:`precision`).
    """

    model: Model

    @property
    def precision(self) -> Precision:
        """``"fp32"`` for a model of 4-byte values, else ``"bf16"`` (bf16 compute and
        activations over fp32 master weights, optimizer state and gradients: the executor's
        mixed precision), as the model is priced."""
        return self.model.precision

    def build(self, num_stages: int, *, what: str = "the schedule", layers: int | None = None) -> Any:
        """The executor's model (a :class:`~pipedsl.executor.models.BuiltinModel`) with the
        model's layers (or ``layers``) split evenly over ``num_stages`` stages; ``what``
        names the caller's schedule in the error where they do not split."""
        from pipedsl.executor.models import llama, transformer

        m = self.model
        layers = m.layers if layers is None else layers
        check_splits(num_stages, what=what, layers=layers, model=m.name)
        if m.gated_ffn:
            return llama(
                num_stages=num_stages, hidden=m.hidden, ffn_hidden=m.ffn_hidden, heads=m.heads,
                kv_heads=m.num_kv_heads, seq_len=m.seq_len, vocab=m.vocab, layers_per_stage=layers // num_stages,
            )  # fmt: skip
        return transformer(
            num_stages=num_stages, vocab=m.vocab, dim=m.hidden, heads=m.heads, seq=m.seq_len,
            layers_per_stage=layers // num_stages,
        )  # fmt: skip

    def cut(self, layers: int) -> Any:
        """The model cut to ``layers`` layers, one stage: what the machine calibration's
        training steps train."""
        return self.build(1, layers=layers)


DEMO = Workload(DEMO_MODEL)
"""The demo transformer in fp32: what the calibration and the demo train on CPU devices."""

_LLAMA_WIDTHS = (256, 512, 1024)
"""Widths of the Llama an accelerator trains, the widest whose state fits taken."""
_STATE_BYTES = 18
"""Bytes a parameter keeps under the executor's mixed precision with Adam: an fp32 master,
a bf16 copy, an fp32 gradient and Adam's two fp32 moments."""
_STATE_SHARE = 8
"""The model's state takes at most this fraction (1/8) of a device's memory, leaving the
rest for the activations of every plan searched, all stages on one device included."""


def accelerator_workload(memory_bytes: int) -> Workload:
    """The Llama that the calibration and the demo train in bf16 on a GPU or TPU of
    ``memory_bytes`` bytes: 4 layers (so that pipelines of 2 and 4 stages split it), a
    head width of 64, 4 query heads per key/value head, a feed-forward 11/4 as wide as the
    model, sequences of 512 tokens, a vocabulary of 8192; as wide as
    :data:`_LLAMA_WIDTHS` allows with every parameter's state (:data:`_STATE_BYTES`) in
    1/:data:`_STATE_SHARE` of the memory."""

    def llama(hidden: int) -> Model:
        heads = hidden // 64
        return Model(
            name=f"demo-llama-{hidden}", layers=4, hidden=hidden, ffn_hidden=11 * hidden // 4, heads=heads,
            kv_heads=heads // 4, seq_len=512, vocab=8192, dtype_bytes=2, gated_ffn=True, biases=False,
            learned_positions=False, tied_embeddings=False, dropout=False,
        )  # fmt: skip

    fitting = [w for w in _LLAMA_WIDTHS if llama(w).num_params * _STATE_BYTES * _STATE_SHARE <= memory_bytes]
    return Workload(llama(max(fitting, default=_LLAMA_WIDTHS[0])))


def check_splits(num_stages: int, *, what: str, layers: int = DEMO_MODEL.layers, model: str = DEMO_MODEL.name) -> None:
    """Raise our error where ``layers`` layers of ``model`` (a name) do not split evenly over
    ``num_stages`` stages; ``what`` names what has that many stages."""
    if num_stages < 1 or layers % num_stages:
        raise PipedslError(
            f"{what} has {num_stages} stages; the {layers} layers of {model} "
            "split evenly only over a number of stages that divides them"
        )
