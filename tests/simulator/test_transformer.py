"""The size-dependent compute model against closed forms worked by hand
(simulator/transformer.py)."""

from __future__ import annotations

import dataclasses

import pytest

from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.plan import Plan, PlanError
from pipedsl.simulator.transformer import (
    CAUSAL_SHARE,
    ELEMENTWISE_KERNELS,
    GEMM_TILE,
    Shapes,
    gemm_seconds,
    pipelined_exposed,
    tile_efficiency,
)

# 100 TFLOP/s peak, 1 TB/s HBM; the largest products approach 0.8 of peak, a product of
# 1 GFLOP reaches half of that.
GPU = Cluster(
    name="gpu",
    gpu="test",
    peak_flops=100e12,
    matmul_efficiency=0.8,
    matmul_half_flops=1e9,
    memory_bytes=2**34,
    hbm_bandwidth=1e12,
    gpus_per_node=8,
    intra_node_bandwidth=100e9,
    intra_node_latency=0.0,
    inter_node_bandwidth=10e9,
    inter_node_latency=0.0,
)
GPT = Model(name="gpt", layers=2, hidden=1024, ffn_hidden=4096, heads=16, seq_len=512, vocab=1000)


def test_square_product_is_compute_bound() -> None:
    # 1000³: 2 GFLOP over 6 MB, intensity 333 FLOP/B above the ridge of 100; the curve
    # gives 0.8 × 2 / (2 + 1) of peak.
    assert gemm_seconds(1000, 1000, 1000, GPU, dtype_bytes=2) == pytest.approx(2e9 / (100e12 * 0.8 * 2 / 3))


def test_thin_product_is_bound_by_memory() -> None:
    # 1 × 4096 × 4096: 2·4096² FLOPs over 2·(4096 + 4096² + 4096) bytes, intensity ~1.
    flops = 2 * 4096**2
    intensity = flops / (2 * (4096 + 4096**2 + 4096))
    rate = intensity * 1e12 * 0.8 * flops / (flops + 1e9)
    assert gemm_seconds(1, 4096, 4096, GPU, dtype_bytes=2) == pytest.approx(flops / rate)


def test_tiles_run_in_waves_over_the_units() -> None:
    # 4 units of 128 × 256 tiles, a tile's fill worth 256 of the contraction.
    tiled = dataclasses.replace(GPU, matmul_units=4, matmul_k_fill=256.0)
    rows, cols = GEMM_TILE
    fill = 1024 / (1024 + 256)
    # Four whole tiles: one full wave.
    assert tile_efficiency(2 * rows, 1024, 2 * cols, tiled) == pytest.approx(fill)
    # A fifth tile runs alone in a second wave: 5 of 8 tile slots busy.
    assert tile_efficiency(5 * rows, 1024, cols, tiled) == pytest.approx(5 / 8 * fill)
    # Half a tile's rows: the tile is padded, and 3 of 4 units idle.
    assert tile_efficiency(rows // 2, 1024, cols, tiled) == pytest.approx(1 / 8 * fill)
    # A batch of products shares the waves.
    assert tile_efficiency(rows, 1024, cols, tiled, batch=4) == pytest.approx(fill)
    assert gemm_seconds(5 * rows, 1024, cols, tiled, dtype_bytes=2) == pytest.approx(
        gemm_seconds(5 * rows, 1024, cols, GPU, dtype_bytes=2) / (5 / 8 * fill)
    )
    # Without units (TPU chips, CPU devices) shape costs nothing.
    assert tile_efficiency(5 * rows, 1024, cols, GPU) == 1.0


def test_reserved_units_leave_the_tiles_the_others() -> None:
    # 4 units, 1 kept for communication: four tiles run in two waves over the other 3,
    # 4 of 6 slots busy, on 3 of the 4 units.
    tiled = dataclasses.replace(GPU, matmul_units=4, matmul_k_fill=256.0)
    rows, cols = GEMM_TILE
    fill = 1024 / (1024 + 256)
    assert tile_efficiency(2 * rows, 1024, 2 * cols, tiled, reserved=1) == pytest.approx(3 / 4 * 4 / 6 * fill)


def test_overlapped_output_projection_runs_on_the_units_left() -> None:
    # Megatron's userbuffer overlap keeps 24 of 132 SMs from the forward output projection
    # only: the other products, its backward, a plan without the overlap and XLA's plans
    # (maxtext) are priced on every SM. 8192 tokens: 64 × 4 output tiles, two waves over
    # 132 SMs, three over 108.
    h100 = dataclasses.replace(GPU, matmul_units=132, matmul_k_fill=512.0)
    plan = Plan(dp=1, tp=4, pp=1, microbatch_size=16, global_batch=16, sequence_parallel=True, tp_overlap=1.0)
    overlapped = Shapes(GPT, h100, plan)
    plain = Shapes(GPT, h100, dataclasses.replace(plan, tp_overlap=0.0))
    xla = Shapes(GPT, h100, dataclasses.replace(plan, framework="maxtext"))
    assert overlapped.overlap_reserved_units == 24
    assert plain.overlap_reserved_units == xla.overlap_reserved_units == 0
    assert Shapes(GPT, GPU, plan).overlap_reserved_units == 0
    tokens, out = overlapped.tokens, GPT.hidden // 4
    assert overlapped.products().out == pytest.approx(
        gemm_seconds(tokens, out, GPT.hidden, h100, dtype_bytes=GPT.dtype_bytes, reserved=24)
    )
    assert overlapped.products().out > plain.products().out == xla.products().out
    assert overlapped.products().qkv == plain.products().qkv
    assert overlapped.products(grad="input") == plain.products(grad="input")


def test_backward_products_run_by_their_own_shapes() -> None:
    plan = Plan(dp=1, tp=1, pp=1, microbatch_size=1, global_batch=1)
    flat = Shapes(GPT, GPU, plan)
    # Without units the three products of a layer cost the same: same FLOPs, same bytes.
    work = flat.layer_work()
    assert flat.products(grad="weight").total == pytest.approx(flat.products().total)
    assert work.weight_grad == pytest.approx(flat.products().total + 4 * GPU.kernel_launch_s)
    # With units the weight gradient (output h × n, contraction over the 512 tokens) tiles
    # differently from the forward (output 512 × n): its own tile efficiency.
    tiled = Shapes(GPT, dataclasses.replace(GPU, matmul_units=132, matmul_k_fill=256.0), plan)
    weight = tiled.products(grad="weight")
    expected = gemm_seconds(1024, 512, 4096, tiled.cluster, dtype_bytes=2)
    assert weight.ffn_in == pytest.approx(expected)
    assert tiled.layer_work().weight_grad == pytest.approx(weight.total)
    assert weight.total != pytest.approx(tiled.products().total)


def test_efficiency_rises_with_size() -> None:
    rates = [2 * n**3 / gemm_seconds(n, n, n, GPU, dtype_bytes=2) for n in (256, 1024, 4096, 16384)]
    assert rates == sorted(rates)
    assert rates[-1] == pytest.approx(0.8 * 100e12, rel=0.01)
    flat = dataclasses.replace(GPU, matmul_half_flops=0.0)
    assert 2 * 512**3 / gemm_seconds(512, 512, 512, flat, dtype_bytes=2) == pytest.approx(0.8 * 100e12)


def test_batched_attention_products_count_the_whole_kernel() -> None:
    one = gemm_seconds(512, 64, 512, GPU, dtype_bytes=2)
    eight = gemm_seconds(512, 64, 512, GPU, dtype_bytes=2, batch=8)
    assert eight < 8 * one  # the curve sees 8 products' FLOPs


@pytest.mark.parametrize(
    ("flash", "forward_kernels"), [(True, 4 + 1 + ELEMENTWISE_KERNELS), (False, 4 + 2 + ELEMENTWISE_KERNELS + 2)]
)
def test_each_kernel_costs_the_launch(flash: bool, forward_kernels: int) -> None:
    plan = Plan(global_batch=1, flash_attention=flash)
    launch = 1e-5
    slow = Shapes(GPT, dataclasses.replace(GPU, kernel_launch_s=launch), plan).layer_work()
    fast = Shapes(GPT, GPU, plan).layer_work()
    assert slow.forward - fast.forward == pytest.approx(launch * forward_kernels)
    assert slow.weight_grad - fast.weight_grad == pytest.approx(launch * 4)


def test_linear_products_sum_to_the_layer_flops() -> None:
    # With a flat curve and a compute-bound roofline, seconds are FLOPs over 80 TFLOP/s.
    flat = dataclasses.replace(GPU, matmul_half_flops=0.0, hbm_bandwidth=1e30)
    shapes = Shapes(GPT, flat, Plan(global_batch=2, microbatch_size=2))
    seconds, kernels = shapes.linear_seconds()
    assert kernels == 4
    assert seconds == pytest.approx(2 * 2 * GPT.seq_len * GPT.layer_matmul_params / 80e12)


def test_fused_attention_is_priced_without_the_scores() -> None:
    # GPT's 16 heads of width 64 over s = 512: 4·512²·64 FLOPs per head, reading and
    # writing Q, K, V and the output (4·512·64 values of 2 bytes): intensity 256 FLOP/B,
    # above the ridge of 100, so the kernel runs at 0.8 of peak times the curve. The
    # unfused products write the 512×512 scores: intensity ~ 51, bound by memory.
    # The fused kernel computes the causal half of the products (CAUSAL_SHARE), streaming half
    # the key and value blocks: the whole block's intensity, above the ridge.
    flops = CAUSAL_SHARE * 16 * 4 * 512**2 * 64
    fused, kernels = Shapes(GPT, GPU, Plan(global_batch=1, flash_attention=True)).attention_seconds()
    assert kernels == 1
    assert fused == pytest.approx(flops / (100e12 * 0.8 * flops / (flops + 1e9)))
    unfused, _ = Shapes(GPT, GPU, Plan(global_batch=1, flash_attention=False)).attention_seconds()
    assert unfused > 1.5 * fused


def test_tp_overlap_hides_collectives_behind_the_products_beside_them() -> None:
    plan = Plan(tp=4, global_batch=1, flash_attention=True, tp_overlap=0.0)
    shapes = Shapes(GPT, GPU, plan)
    exposed = shapes.layer_work()
    products = shapes.products()
    # Two collectives (each a reduce-scatter plus an all-gather) in the forward, two in I.
    collectives = 2 * shapes.tp_all_reduce()
    assert collectives > 0
    assert shapes.tp_exposed(products) == pytest.approx(collectives)
    for overlap in (0.5, 1.0):
        overlapped = Shapes(GPT, GPU, dataclasses.replace(plan, tp_overlap=overlap))
        # Each half collective runs in tp steps under the product beside it, all but one step of
        # which hides it (the column products' gathers, the row products' reduce-scatters).
        half = shapes.tp_all_reduce() / 2
        pairs = (products.qkv, products.out, products.ffn_in, products.ffn_out)
        hidden_by = [max(0.0, half - overlap * p * 3 / 4) for p in pairs]
        assert overlapped.tp_exposed(products) == pytest.approx(sum(hidden_by))
        work = overlapped.layer_work()
        assert exposed.forward - work.forward == pytest.approx(collectives - sum(hidden_by))
        assert exposed.input_grad - work.input_grad == pytest.approx(collectives - sum(hidden_by))
        assert exposed.weight_grad == work.weight_grad


def test_pipelined_exposure_leaves_a_step_or_the_excess() -> None:
    # Four steps of 1 s of communication each under 4 s of work: all but one step hides it.
    assert pipelined_exposed(4.0, 4.0, 4) == pytest.approx(1.0)
    assert pipelined_exposed(4.0, 8.0, 4) == 0.0
    # Each step following its step of work (a layer's gradients): the last is exposed.
    assert pipelined_exposed(4.0, 8.0, 4, tail=True) == pytest.approx(1.0)
    assert pipelined_exposed(10.0, 4.0, 4, tail=True) == pytest.approx(7.0)
    assert pipelined_exposed(0.0, 4.0, 4, tail=True) == 0.0


@pytest.mark.parametrize("value", [-0.1, 1.5, True])
def test_tp_overlap_must_be_a_fraction(value: object) -> None:
    with pytest.raises(PlanError, match="tp_overlap must be a fraction"):
        Plan(global_batch=1, tp_overlap=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("parallel_block", [False, True])
def test_traced_full_remat_reruns_only_what_the_backward_reads(parallel_block: bool) -> None:
    # Megatron reruns the whole forward; a JAX program (maxtext) skips the products whose
    # outputs only join the residual sum: the last MLP product, and in a parallel block the
    # attention's output projection too.
    model = dataclasses.replace(GPT, parallel_block=parallel_block)
    plan = Plan(dp=1, tp=1, pp=1, microbatch_size=2, global_batch=2, recompute="full")
    megatron = Shapes(model, GPU, dataclasses.replace(plan, framework="megatron"))
    maxtext = Shapes(model, GPU, dataclasses.replace(plan, framework="maxtext"))
    products = megatron.products()
    skipped = products.ffn_out + GPU.kernel_launch_s
    if parallel_block:
        skipped += products.out + GPU.kernel_launch_s
    assert megatron.layer_work().input_grad - maxtext.layer_work().input_grad == pytest.approx(skipped)
    assert maxtext.layer_work().forward == pytest.approx(megatron.layer_work().forward)
