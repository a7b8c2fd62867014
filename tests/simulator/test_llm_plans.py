"""Plans for today's LLMs: Llama shapes (grouped-query attention, SwiGLU, no dropout), context
parallelism, sharding modes, MFU conventions, uneven stages, and Llama 3 405B's published runs.

Hand counts use the Llama 3 8B preset (Dubey et al. 2024, Table 3): 32 layers, hidden 4096,
8 key/value heads of 128, SwiGLU feed-forward 14336, vocabulary 128,256, untied embeddings.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipedsl.cli.main import main
from pipedsl.simulator.candidates import candidate_plans, default_cp_sizes
from pipedsl.simulator.collectives import Group, all_reduce_seconds
from pipedsl.simulator.context_parallel import gathered_bytes
from pipedsl.simulator.estimate import estimate
from pipedsl.simulator.fit_published import DATA, HELD_OUT, evaluate, fit_framework, load_runs
from pipedsl.simulator.flops import FlopCount, step_flops
from pipedsl.simulator.frameworks import FRAMEWORKS, Framework
from pipedsl.simulator.hardware import Cluster, load_cluster, load_model
from pipedsl.simulator.network import Tier, expected_maximum, network_link, straggler_factor
from pipedsl.simulator.plan import Plan, PlanError, Recompute
from pipedsl.simulator.stages import ends_split
from pipedsl.simulator.transformer import CAUSAL_SHARE, FLASH_BACKWARD, Shapes

LLAMA_8B = load_model("llama-8b")

# 100 TFLOP/s achieved, elementwise traffic free, links 100 GB/s (NVLink) and 10 GB/s.
IDEAL = Cluster(
    name="ideal",
    gpu="test",
    peak_flops=200e12,
    matmul_efficiency=0.5,
    memory_bytes=80 * 2**30,
    hbm_bandwidth=1e30,
    gpus_per_node=8,
    intra_node_bandwidth=100e9,
    intra_node_latency=0.0,
    inter_node_bandwidth=10e9,
    inter_node_latency=0.0,
)


# --- Llama 3 8B by hand --------------------------------------------------------------------


def test_llama3_8b_parameters_by_hand() -> None:
    h, kv, f, v = 4096, 8 * 128, 14336, 128256
    layer = h * h + 2 * h * kv + h * h + 3 * h * f + 2 * h  # Q, K and V, output, gate/up/down, two RMSNorms
    total = 32 * layer + 2 * v * h + h  # untied embedding and logits, the final norm
    assert LLAMA_8B.layer_params == layer
    assert LLAMA_8B.num_params == total
    assert total == pytest.approx(8.03e9, rel=1e-3)


def test_llama3_8b_flops_by_hand() -> None:
    h, kv, f, s = 4096, 1024, 14336, 8192
    # Per token: 2 per matmul weight (GQA: K and V are h × 1024), attention's QKᵀ and AV 4·s·h.
    assert LLAMA_8B.layer_forward_flops_per_token == 2 * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * s * h
    plan = Plan(global_batch=1)
    tokens = s
    assert step_flops(LLAMA_8B, plan, FlopCount.SIX_N) == 6 * LLAMA_8B.num_params * tokens
    assert step_flops(LLAMA_8B, plan, FlopCount.PALM) == (6 * LLAMA_8B.num_params + 12 * 32 * h * s) * tokens
    one_gpu = estimate(LLAMA_8B, IDEAL, plan)
    # On a cluster where only the products cost: 3 passes of every layer's products and the
    # logits; attention's core (4·s·h per token) the causal half of its products, in its
    # forward and its backward (FLASH_BACKWARD forwards: it recomputes the scores).
    core = 4 * s * h
    layers = 32 * (3 * (LLAMA_8B.layer_forward_flops_per_token - core) + CAUSAL_SHARE * (1 + FLASH_BACKWARD) * core)
    expected = tokens * (layers + 3 * 2 * h * 128256) / 100e12
    assert one_gpu.step_time_s == pytest.approx(expected, rel=1e-9)


def test_llama3_8b_activation_bytes_by_hand() -> None:
    h, kv, f, s = 4096, 1024, 14336, 8192
    # Norm inputs 2·2h, QKV and gate/up inputs 2·2h; Q 2h, K and V 2·2kv, the output
    # projection's input 2h; gate and up 2·2f, SwiGLU's output 2f. No dropout masks.
    per_token = 4 * h + 4 * h + 2 * h + 4 * kv + 2 * h + 4 * f + 2 * f
    shapes = Shapes(LLAMA_8B, IDEAL, Plan(global_batch=1))
    assert shapes.layer_activation_bytes(Recompute.NONE) == s * per_token
    # tp = 4 with sequence parallelism splits everything; tp = 4 without it leaves the
    # norms' and the products' inputs whole.
    tp = Shapes(LLAMA_8B, IDEAL, Plan(tp=4, global_batch=1))
    assert tp.layer_activation_bytes(Recompute.NONE) == s * per_token / 4
    no_sp = Shapes(LLAMA_8B, IDEAL, Plan(tp=4, global_batch=1, sequence_parallel=False))
    assert no_sp.layer_activation_bytes(Recompute.NONE) == s * (8 * h + (per_token - 8 * h) / 4)


def test_gpt_activation_bytes_stay_korthikantis() -> None:
    gpt = load_model("gpt3-175b")
    shapes = Shapes(gpt, IDEAL, Plan(tp=8, global_batch=1, flash_attention=False))
    sbh = gpt.seq_len * gpt.hidden
    expected = sbh * (34 + 5 * gpt.heads * gpt.seq_len / gpt.hidden) / 8
    assert shapes.layer_activation_bytes(Recompute.NONE) == pytest.approx(expected, rel=1e-12)


# --- context parallelism ------------------------------------------------------------------


def test_context_parallel_splits_tokens_and_activations() -> None:
    base = Plan(dp=2, tp=2, global_batch=2)
    split = dataclasses.replace(base, dp=1, cp=2)
    one, two = Shapes(LLAMA_8B, IDEAL, base), Shapes(LLAMA_8B, IDEAL, split)
    assert two.tokens == one.tokens // 2
    assert two.layer_activation_bytes(Recompute.NONE) == one.layer_activation_bytes(Recompute.NONE) / 2
    # The same GPUs; the weights are replicated over cp as over dp and shard over both.
    assert split.gpus == base.gpus and split.shards == base.shards
    zero = estimate(LLAMA_8B, IDEAL, dataclasses.replace(split, zero=1)).memory
    # bf16: fp32 master weights and Adam's two moments, 12 bytes per parameter.
    assert zero.optimizer == round(12 * LLAMA_8B.num_params / 2 / 2)


def test_context_parallel_exchange_of_keys_and_values() -> None:
    assert gathered_bytes(Shapes(LLAMA_8B, IDEAL, Plan(cp=4, tp=2, global_batch=1))) == 8192 * 2 * 512 * 2
    plan = Plan(cp=8, global_batch=1, cp_exchange="all_gather")
    shapes = Shapes(LLAMA_8B, IDEAL, plan)
    # b·s·2·kv values of 2 bytes: the whole sequence's keys and values (of this tensor rank's heads).
    assert gathered_bytes(shapes) == 8192 * 2 * 1024 * 2
    gathered = estimate(LLAMA_8B, IDEAL, plan)
    ring = estimate(LLAMA_8B, IDEAL, dataclasses.replace(plan, cp_exchange="ring"))
    free = estimate(LLAMA_8B, dataclasses.replace(IDEAL, intra_node_bandwidth=1e30), plan)
    # cp = 8 GPUs on NVLink: the gather costs 7/8 of its bytes at 100 GB/s, forward once,
    # backward twice, per layer; the ring hides it behind attention, the gather does not.
    exchange = 7 / 8 * gathered_bytes(shapes) / 100e9
    # (The weights' gradients are reduced over the cp ranks too: compare the forward/backward part.)
    assert gathered.pipeline_time_s == pytest.approx(free.pipeline_time_s + 32 * 3 * exchange, rel=1e-9)
    assert free.pipeline_time_s <= ring.pipeline_time_s < gathered.pipeline_time_s
    assert gathered.dp_tail_s > 1e-6 > free.dp_tail_s


def test_context_parallel_checks_the_sequence() -> None:
    with pytest.raises(PlanError, match="2·cp"):
        estimate(LLAMA_8B, IDEAL, Plan(cp=3, global_batch=1))


def test_search_tries_context_parallel_degrees_for_long_sequences() -> None:
    assert default_cp_sizes(load_model("gpt3-175b")) == (1,)
    assert default_cp_sizes(LLAMA_8B) == (1, 2)
    long = dataclasses.replace(LLAMA_8B, seq_len=131072)
    assert default_cp_sizes(long) == (1, 2, 4, 8, 16, 32)
    plans = list(candidate_plans(long, load_cluster("h100-80gb"), 64, global_batch=8, schedules=["1f1b"]))
    assert {p.cp for p in plans} == {1, 2, 4, 8, 16, 32}
    assert all(p.gpus == 64 for p in plans)


# --- sharding modes -------------------------------------------------------------------------


def test_zero2_reduced_once_per_step_is_zero1() -> None:
    cluster = load_cluster("a100-80gb")
    base = Plan(dp=16, pp=2, global_batch=128, schedule="1f1b", dp_overlap=0.0)
    zero1 = estimate(LLAMA_8B, cluster, dataclasses.replace(base, zero=1))
    once = estimate(LLAMA_8B, cluster, dataclasses.replace(base, zero=2, reduce_once=True))
    every = estimate(LLAMA_8B, cluster, dataclasses.replace(base, zero=2))
    assert once.step_time_s == pytest.approx(zero1.step_time_s, rel=1e-12)
    assert once.memory == zero1.memory
    # Reduced every microbatch, the gradients are sharded, and the traffic is paid per microbatch.
    assert every.memory.gradients == round(once.memory.gradients / 16)
    assert every.step_time_s > once.step_time_s


def test_zero3_keeping_the_gathered_weights() -> None:
    cluster = load_cluster("a100-80gb")
    full = Plan(dp=16, global_batch=64, microbatch_size=1, zero=3, dp_overlap=0.0)
    keep = dataclasses.replace(full, reshard_after_forward=False)
    step = dataclasses.replace(keep, reduce_once=True)
    estimates = [estimate(LLAMA_8B, cluster, p) for p in (full, keep, step)]
    # One gather fewer per microbatch, then none per microbatch: each faster than the last.
    assert estimates[0].step_time_s > estimates[1].step_time_s > estimates[2].step_time_s
    # Kept weights are held whole; sharded ones are not.
    assert estimates[0].memory.weights == round(2 * LLAMA_8B.num_params / 16)
    assert estimates[1].memory.weights == 2 * LLAMA_8B.num_params
    assert "gathered once per step" in {a.name: a.meaning for a in estimates[2].assumptions}["sharding"]


# --- uneven stages ---------------------------------------------------------------------------


def test_ends_split_of_llama3_405b() -> None:
    layers = ends_split(126, 128)
    assert layers is not None and layers[0] == layers[-1] == 0 and set(layers[1:-1]) == {1} and sum(layers) == 126
    assert ends_split(126, 16) == (0, *(9,) * 14, 0)
    assert ends_split(126, 12) is None
    with pytest.raises(PlanError, match="pp × vpp"):
        Plan(pp=2, global_batch=2, schedule="1f1b", stage_layers=(1, 2, 3))


# --- the CLI --------------------------------------------------------------------------------


def test_cli_estimates_126_layers_on_16_stages_and_states_the_flop_count(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "llama-405b", "--cluster", "h100-80gb", "--dp", "64", "--tp", "8", "--pp", "16",
            "--vpp", "8", "--global-batch", "2048", "--zero", "2", "--reduce-once", "--stage-layers", "ends",
            "--schedule", "interleaved_1f1b"]  # fmt: skip
    main(argv)
    default = capsys.readouterr().out
    assert "6N FLOPs, the default" in default
    main([*argv, "--mfu-flops", "palm"])
    palm = capsys.readouterr().out
    assert "PaLM" in palm and "the default" not in palm
    assert "sharding = zero2 once" in palm


# --- Llama 3 405B, Table 4 (validation rows: nothing was fitted on them) -----------------------


def test_llama3_405b_8k_runs_within_five_percent() -> None:
    runs = [r for r in load_runs(DATA, HELD_OUT) if r.source == "dubey2024-table4" and r.model.seq_len == 8192]
    assert len(runs) == 2 and all(r.role == "validate" for r in runs)
    for result in evaluate(runs, {"h100-80gb": load_cluster("h100-80gb")}):
        assert abs(result.error) < 0.05, result.run.name


def test_causal_attention_is_priced_at_the_rates_of_published_fused_kernels() -> None:
    # The fused kernel computes the causal half of the s×s products, at the products'
    # efficiency: on an H100 at 131K tokens, head dimension 128, that rate lies between
    # cuDNN's and FlashAttention-3's published rates for causal attention at 16K tokens
    # (FlashAttention-3 paper, arXiv:2407.08608: forward 539 and 616 TFLOP/s, backward 516 and
    # 561), above FlashAttention-2's (335 forward, 322 backward).
    model = dataclasses.replace(load_model("llama-405b"), seq_len=131072)
    plan = Plan(dp=8, tp=8, pp=16, vpp=8, cp=16, global_batch=128, zero=2, reduce_once=True,
                cp_exchange="all_gather", schedule="interleaved_1f1b")  # fmt: skip
    shapes = Shapes(model, load_cluster("h100-80gb"), plan)
    forward, kernels = shapes.attention_seconds()
    causal_flops = CAUSAL_SHARE * 4 * shapes.local_seq * model.seq_len * model.head_width * (model.heads // plan.tp)
    assert kernels == 1
    assert 539e12 < causal_flops / forward < 616e12
    # The papers count the backward's FLOPs as 2.5 forwards; the estimator prices FLASH_BACKWARD of them.
    assert 335e12 < 2.5 * causal_flops / (FLASH_BACKWARD * forward) < 616e12


# --- framework profiles ----------------------------------------------------------------------


def test_the_deepspeed_profile_changes_deepspeed_rows_and_leaves_megatron_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = load_runs()
    clusters = {name: load_cluster(name) for name in {r.cluster for r in runs}}
    deepspeed = [r for r in runs if r.plan.framework == "deepspeed"]
    megatron = [r for r in runs if r.plan.framework == "megatron"][::4]
    assert deepspeed and megatron
    before = evaluate(deepspeed + megatron, clusters)
    # The same rows with DeepSpeed's profile at no cost at all.
    monkeypatch.setitem(FRAMEWORKS, "deepspeed", Framework(name="deepspeed"))
    bare = evaluate(deepspeed + megatron, clusters)
    n = len(deepspeed)
    assert all(a.predicted_s > b.predicted_s for a, b in zip(before[:n], bare[:n], strict=True))
    assert [r.predicted_s for r in before[n:]] == [r.predicted_s for r in bare[n:]]
    # Without it DeepSpeed's runs come out fast, the worst by over a fifth; with it every one
    # is within 10% (nothing was fitted on the validate rows).
    assert min(r.error for r in bare[:n]) < -0.2
    assert max(abs(r.error) for r in before[:n]) < 0.1


def test_fit_framework_finds_the_recorded_profile() -> None:
    runs = load_runs()
    clusters = {name: load_cluster(name) for name in {r.cluster for r in runs if r.plan.framework == "deepspeed"}}
    profile, error = fit_framework(runs, clusters, "deepspeed")
    assert profile.layer_s == FRAMEWORKS["deepspeed"].layer_s
    assert error < 0.05


# --- network tiers and stragglers -----------------------------------------------------------


def test_groups_beyond_a_leaf_cross_the_spine() -> None:
    flat = load_cluster("a100-80gb")
    tiered = dataclasses.replace(flat, spine_latency_s=1e-5, spine_efficiency=0.5)
    assert network_link(20, tiered).tier is Tier.LEAF and network_link(21, tiered).tier is Tier.SPINE
    assert network_link(21, tiered).latency == flat.inter_node_latency + 1e-5
    assert network_link(21, tiered).bandwidth == flat.network_share / 2
    # A gradient all-reduce over 32 nodes crosses the spine; over 16 it stays on the leaf tier.
    big, small = Group(ranks=32, nodes=32, per_node=1), Group(ranks=16, nodes=16, per_node=1)
    assert all_reduce_seconds(1e9, big, tiered) > all_reduce_seconds(1e9, big, flat)
    assert all_reduce_seconds(1e9, small, tiered) == all_reduce_seconds(1e9, small, flat)
    assert (
        "spine"
        in {a.name: a.meaning for a in estimate(LLAMA_8B, tiered, Plan(dp=256, global_batch=256)).assumptions}[
            "dp_collectives"
        ]
    )


def test_stragglers_slow_a_step_more_the_more_nodes_it_spans() -> None:
    cluster = dataclasses.replace(load_cluster("h100-80gb"), straggler_cv=0.01)
    assert straggler_factor(1, cluster) == 1.0
    assert straggler_factor(1024, cluster) == pytest.approx(1 + 0.01 * expected_maximum(1024))
    plan = Plan(dp=64, global_batch=64)
    slow, plain = estimate(LLAMA_8B, cluster, plan), estimate(LLAMA_8B, load_cluster("h100-80gb"), plan)
    assert slow.step_time_s == pytest.approx(plain.step_time_s * straggler_factor(8, cluster))


def test_the_expected_slowest_of_n_is_the_expected_maximum_of_n_normal_draws() -> None:
    # Exact values of E[max of n standard normals]: 1/sqrt(pi) for two, 2.0697 for 32, 3.4418 for 2,048.
    assert expected_maximum(1) == 0.0
    assert expected_maximum(2) == pytest.approx(0.5642, rel=0.05)
    assert expected_maximum(32) == pytest.approx(2.0697, rel=0.005)
    assert expected_maximum(2048) == pytest.approx(3.4418, rel=0.005)
