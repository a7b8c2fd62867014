"""Model shapes beyond GPT's and Llama's: a head width apart from hidden / heads, parallel
blocks, the feed-forward's nonlinearity, fp32 logits and fp32 parameters computed in bf16;
and what each remat policy keeps, by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipedsl.simulator.hardware import DescriptionError, Model, load_cluster, load_model
from pipedsl.simulator.memory import optimizer_bytes
from pipedsl.simulator.plan import Plan, Recompute
from pipedsl.simulator.transformer import Shapes

# MaxText's 2023 default decoder at global_parameter_scale 16: 32 layers of width 5120, 32 heads
# of 256, a 32768-wide ReLU block, one norm before attention and the feed-forward in parallel,
# a tied 32768-token embedding, fp32 parameters computed in bf16.
MAXTEXT_16B = Model(
    name="maxtext-16b", layers=32, hidden=5120, ffn_hidden=32768, heads=32, head_dim=256, seq_len=2048, vocab=32768,
    biases=False, learned_positions=False, tied_embeddings=True, dropout=False, parallel_block=True,
    activation="relu", param_bytes=4,
)  # fmt: skip


def test_head_width_apart_from_hidden_over_heads() -> None:
    h, q, f = 5120, 32 * 256, 32768
    assert MAXTEXT_16B.head_width == 256 and MAXTEXT_16B.q_width == q == MAXTEXT_16B.kv_width
    # Q, K, V and the output projection h × q each, two h × f matrices, one norm of h.
    assert MAXTEXT_16B.layer_params == 4 * h * q + 2 * h * f + h
    # Its "16B": 16.3 billion.
    assert MAXTEXT_16B.num_params == 32 * (4 * h * q + 2 * h * f + h) + 32768 * h + h
    assert 16.2e9 < MAXTEXT_16B.num_params < 16.3e9
    assert MAXTEXT_16B.layer_forward_flops_per_token == 2 * (4 * h * q + 2 * h * f) + 4 * 2048 * q
    with pytest.raises(DescriptionError, match="or give head_dim"):
        Model(name="m", layers=1, hidden=100, ffn_hidden=4, heads=3, seq_len=8, vocab=8)


def test_fp32_parameters_are_their_own_master() -> None:
    plan = Plan(dp=256, global_batch=256, zero=3)
    memory = Shapes(MAXTEXT_16B, load_cluster("tpu-v5e"), plan)
    assert MAXTEXT_16B.stored_bytes == 4 and optimizer_bytes(4) == 8 and optimizer_bytes(2) == 12
    bf16 = Model(name="b", layers=2, hidden=64, ffn_hidden=128, heads=4, seq_len=8, vocab=16)
    assert bf16.stored_bytes == 2 and bf16.precision == "bf16"
    assert memory.model.precision == "bf16"
    with pytest.raises(DescriptionError, match="param_bytes must be 2 or 4"):
        Model(name="m", layers=1, hidden=8, ffn_hidden=8, heads=2, seq_len=8, vocab=8, dtype_bytes=4, param_bytes=2)


@pytest.mark.parametrize(
    ("recompute", "per_token"),
    [
        # The layer's input h, then what the policy saves that the backward reads: Q, K, V
        # (3q), the ReLU block's input product f. A parallel block's backward reads neither
        # product's sum, so the output projection is not kept.
        (Recompute.SAVE_DOTS, 5120 + 3 * 8192 + 32768),
        (Recompute.SAVE_QKV_PROJ, 5120 + 3 * 8192),
        (Recompute.SAVE_MLP_INPUTS, 5120 + 5120),
        (Recompute.FULL, 5120),
    ],
)
def test_what_each_remat_policy_keeps(recompute: Recompute, per_token: int) -> None:
    plan = Plan(dp=16, tp=4, global_batch=32, microbatch_size=2, zero=3, recompute=recompute)
    shapes = Shapes(MAXTEXT_16B, load_cluster("tpu-v5p"), plan)
    # Everything split over the 4 tensor-parallel ranks (the residual too: sequence parallel).
    assert shapes.layer_activation_bytes(recompute) == pytest.approx(2 * 2 * 2048 * per_token / 4)
    # A sequential block's backward rebuilds the feed-forward's input from the output projection.
    sequential = Shapes(load_model("llama-8b"), load_cluster("h100-80gb"), Plan(global_batch=1, recompute=recompute))
    extra = 4096 if recompute in (Recompute.SAVE_DOTS, Recompute.SAVE_QKV_PROJ) else 0
    dots = {Recompute.SAVE_DOTS: 4096 + 2 * 1024 + 2 * 14336, Recompute.SAVE_QKV_PROJ: 4096 + 2 * 1024}
    expected = 4096 + extra + dots.get(recompute, 4096 if recompute is Recompute.SAVE_MLP_INPUTS else 0)
    assert sequential.layer_activation_bytes(recompute) == pytest.approx(2 * 8192 * expected)


def test_a_policy_reruns_less_than_full_recomputation() -> None:
    cluster = load_cluster("tpu-v5p")
    times = {
        r: Shapes(MAXTEXT_16B, cluster, Plan(dp=16, tp=4, global_batch=16, zero=3, recompute=r)).layer_work()
        for r in (
            Recompute.NONE,
            Recompute.SAVE_DOTS,
            Recompute.SAVE_QKV_PROJ,
            Recompute.SAVE_MLP_INPUTS,
            Recompute.FULL,
        )
    }
    backward = [times[r].input_grad for r in times]
    assert backward == sorted(backward)
    assert all(times[r].forward == times[Recompute.NONE].forward for r in times)


def test_shapes_come_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text(
        '[model]\nname = "m"\nlayers = 2\nhidden = 96\nffn_hidden = 256\nheads = 4\nhead_dim = 32\nseq_len = 64\n'
        'vocab = 128\nparallel_block = true\nactivation = "squared_relu"\nfp32_logits = false\nparam_bytes = 4\n'
        "gated_ffn = false\n"
    )
    model = load_model(path)
    assert (model.head_width, model.parallel_block, model.activation, model.fp32_logits, model.param_bytes) == (
        32, True, "squared_relu", False, 4,
    )  # fmt: skip
    path.write_text('[model]\nname = "m"\nlayers = 2\nhidden = 96\nffn_hidden = 256\nheads = 4\nseq_len = 64\n'
                    'vocab = 128\nactivation = "swish"\n')  # fmt: skip
    with pytest.raises(DescriptionError, match="activation must be one of gelu, relu, squared_relu, silu"):
        load_model(path)
    # fp32 logits keep the loss's softmax in 4 bytes, else in the compute dtype.
    shapes = Shapes(load_model("llama-8b"), load_cluster("h100-80gb"), Plan(global_batch=1))
    narrow = Shapes(
        Model(**{**{f: getattr(shapes.model, f) for f in ("name", "layers", "hidden", "ffn_hidden", "heads",
                                                             "kv_heads", "seq_len", "vocab")}, "fp32_logits": False}),
        load_cluster("h100-80gb"), Plan(global_batch=1),
    )  # fmt: skip
    assert shapes.head_activation_bytes() - narrow.head_activation_bytes() == 8192 * 128256 * 2
