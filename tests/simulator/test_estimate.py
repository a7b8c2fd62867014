"""The plan estimator against closed forms worked by hand, and the descriptions it reads.

Hand-worked cases use a cluster whose memory bandwidth is so high that elementwise work
costs nothing, so a step on one GPU is exactly its matmul FLOPs over the achieved FLOP/s.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from pipedsl import library
from pipedsl.errors import PipedslError, ScheduleEvalError
from pipedsl.library import library_schedules
from pipedsl.program import dispatch_order, lower
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.engine import simulate
from pipedsl.simulator.estimate import (
    GRAD_BYTES,
    DoesNotFit,
    estimate,
    prepare,
    ring_all_reduce_seconds,
    ring_gather_seconds,
)
from pipedsl.simulator.hardware import (
    Cluster,
    DescriptionError,
    Model,
    cluster_presets,
    load_cluster,
    load_model,
    model_presets,
)
from pipedsl.simulator.pipelines import Pipelines, ScheduleKey
from pipedsl.simulator.plan import Plan, PlanError, Recompute
from pipedsl.simulator.transformer import CAUSAL_SHARE, FLASH_BACKWARD, Shapes

GPT = Model(name="gpt-tiny", layers=4, hidden=256, ffn_hidden=1024, heads=4, seq_len=128, vocab=1000)

# 100 TFLOP/s achieved (efficiency 0.5 of 200), elementwise traffic free, links 100 GB/s.
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


# --- descriptions -------------------------------------------------------------------------


def test_gpt3_parameters_match_megatrons_formula() -> None:
    m = load_model("gpt3-175b")
    l, h, v, s = m.layers, m.hidden, m.vocab, m.seq_len
    megatron = 12 * l * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    # Megatron's count leaves out the final LayerNorm (2h).
    assert m.num_params == round(megatron) + 2 * h
    assert m.num_params == pytest.approx(174.6e9, rel=1e-3)


def test_llama_parameters() -> None:
    assert load_model("llama-8b").num_params == pytest.approx(8.03e9, rel=2e-3)
    assert load_model("llama-70b").num_params == pytest.approx(70.55e9, rel=2e-3)


def test_layer_flops_per_token_are_24h2_plus_4sh() -> None:
    h, s = GPT.hidden, GPT.seq_len
    assert GPT.layer_forward_flops_per_token == 24 * h * h + 4 * s * h
    assert GPT.logit_forward_flops_per_token == 2 * h * GPT.vocab


def test_presets_all_load() -> None:
    assert {"gpt3-175b", "llama-8b", "llama-70b", "demo-small"} <= set(model_presets())
    assert {"a100-80gb", "h100-80gb", "h200"} <= set(cluster_presets())
    for name in cluster_presets():
        cluster = load_cluster(name)
        assert cluster.name == name
        # DGX A100/H100/H200 nodes, DGX-2; TPU hosts of 4 (v5p) or 8 (v5e) chips.
        assert cluster.gpus_per_node in ((4, 8) if cluster.torus else (8, 16))
        assert cluster.adapters_per_node <= cluster.gpus_per_node


def test_model_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('[model]\nname = "mine"\nlayers = 2\nhidden = 64\nffn_hidden = 256\nheads = 4\n'
                    "seq_len = 32\nvocab = 100\n")  # fmt: skip
    model = load_model(path)
    assert model == Model(name="mine", layers=2, hidden=64, ffn_hidden=256, heads=4, seq_len=32, vocab=100)


_SHAPE = 'name="x"\nlayers=2\nhidden=64\nffn_hidden=8\nseq_len=8\nvocab=8\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[model]\nname = "x"\nlayers = 2\n', "lacks hidden"),
        ('[cluster]\nname = "x"\n', r"has no \[model\] table"),
        ("[model]\n" + _SHAPE + "heads=5\n", "not a multiple of heads"),
        ("[model]\n" + _SHAPE + "heads=4\nwidth=3\n", "unknown key 'width'"),
        ("[model]\n" + _SHAPE.replace("layers=2", "layers=2.5") + "heads=4\n", "whole number"),
        ("[model\n", "not valid TOML"),
    ],
)
def test_bad_model_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(DescriptionError, match=message):
        load_model(path)


def test_cluster_checks_its_fields() -> None:
    with pytest.raises(DescriptionError, match="matmul_efficiency must be in"):
        dataclasses.replace(IDEAL, matmul_efficiency=1.5)
    with pytest.raises(DescriptionError, match="unknown cluster"):
        load_cluster("tpu-v9")


# --- collectives --------------------------------------------------------------------------


def test_ring_collectives() -> None:
    # 2(n-1)α + 2(n-1)/n · S/B and (n-1)α + (n-1)/n · S/B.
    assert ring_all_reduce_seconds(1e9, 8, bandwidth=100e9, latency=1e-5) == pytest.approx(14e-5 + 0.0175)
    assert ring_gather_seconds(1e9, 8, bandwidth=100e9, latency=1e-5) == pytest.approx(7e-5 + 0.00875)
    assert ring_all_reduce_seconds(1e9, 1, bandwidth=100e9, latency=1e-5) == 0.0


# --- compute ------------------------------------------------------------------------------


def _flops_per_sequence(model: Model, *, layer_passes: int, flash: bool = True) -> float:
    """Matmul FLOPs per sequence: each layer's forward ``layer_passes`` times, logits 3 times;
    with FlashAttention attention's core (4·s·h per token) computes its causal half, in its
    forward, its backward (FLASH_BACKWARD forwards: it recomputes the scores) and any rerun."""
    s = model.seq_len
    core = 4 * s * model.hidden
    if not flash:
        return s * (
            layer_passes * model.layers * model.layer_forward_flops_per_token + 3 * model.logit_forward_flops_per_token
        )
    core_passes = 1 + FLASH_BACKWARD + (layer_passes - 3)
    layers = model.layers * (
        layer_passes * (model.layer_forward_flops_per_token - core) + CAUSAL_SHARE * core_passes * core
    )
    return s * (layers + 3 * model.logit_forward_flops_per_token)


@pytest.mark.parametrize(("recompute", "passes"), [("none", 3), ("selective", 3), ("full", 4)])
def test_single_gpu_step_is_flops_over_achieved_rate(recompute: str, passes: int) -> None:
    plan = Plan(global_batch=8, microbatch_size=2, recompute=recompute)
    result = estimate(GPT, IDEAL, plan)
    expected = 8 * _flops_per_sequence(GPT, layer_passes=passes) / 100e12
    assert result.step_time_s == pytest.approx(expected, rel=1e-9)
    assert result.bubble == 0.0
    tokens = 8 * GPT.seq_len
    assert result.tokens_per_s == pytest.approx(tokens / expected)
    assert result.mfu == pytest.approx(6 * GPT.num_params * tokens / (200e12 * expected))


def test_tensor_parallel_adds_four_all_reduces_per_layer() -> None:
    single = estimate(GPT, IDEAL, Plan(global_batch=2, microbatch_size=2))
    split = estimate(GPT, IDEAL, Plan(tp=4, global_batch=2, microbatch_size=2, tp_overlap=0.0))
    all_reduce = ring_all_reduce_seconds(2 * GPT.seq_len * GPT.hidden * 2, 4, bandwidth=100e9, latency=0.0)
    assert split.step_time_s == pytest.approx(single.step_time_s / 4 + 4 * GPT.layers * all_reduce, rel=1e-9)


def test_data_parallel_tail_is_the_gradient_all_reduce() -> None:
    # dp = 16 spans two nodes with 8 members each: the ring crosses each node boundary on
    # 8 adapters of 10 GB/s (80 GB/s, below NVLink's 100); nothing hides it.
    plan = Plan(dp=16, global_batch=16, dp_overlap=0.0)
    result = estimate(GPT, IDEAL, plan)
    assert result.dp_tail_s == pytest.approx(
        ring_all_reduce_seconds(GPT.num_params * GRAD_BYTES, 16, bandwidth=80e9, latency=0.0)
    )
    # One adapter per node (1.25 GB/s per GPU): the hierarchical all-reduce (NVLink
    # reduce-scatter and all-gather, each GPU's eighth across the two nodes) wins.
    one_adapter = estimate(GPT, dataclasses.replace(IDEAL, nics_per_node=1), plan)
    size = GPT.num_params * GRAD_BYTES
    assert one_adapter.dp_tail_s == pytest.approx(2 * 7 / 8 * size / 100e9 + 2 * 1 / 2 * (size / 8) / 1.25e9)
    hidden = estimate(GPT, IDEAL, dataclasses.replace(plan, dp_overlap=1.0))
    assert hidden.dp_tail_s < result.dp_tail_s
    bf16 = estimate(GPT, IDEAL, dataclasses.replace(plan, reduce_bytes=2))
    assert bf16.dp_tail_s == pytest.approx(result.dp_tail_s / 2)


# --- memory -------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize(("dtype_bytes", "optimizer"), [(2, 12), (4, 8)], ids=["bf16", "fp32"])
def test_memory_by_zero_stage(zero: int, dtype_bytes: int, optimizer: int) -> None:
    # As the executor keeps them: bf16 weights beside fp32 master weights and Adam moments
    # (12 bytes), or fp32 weights that are their own master (Adam's moments, 8 bytes).
    model = dataclasses.replace(GPT, dtype_bytes=dtype_bytes)
    n = model.num_params
    memory = estimate(model, IDEAL, Plan(dp=4, global_batch=4, zero=zero)).memory
    assert memory.weights == round(dtype_bytes * n / (4 if zero >= 3 else 1))
    assert memory.gradients == round(GRAD_BYTES * n / (4 if zero >= 2 else 1))
    assert memory.optimizer == round(optimizer * n / (4 if zero >= 1 else 1))


@pytest.mark.parametrize("recompute", list(Recompute))
def test_an_fp32_model_keeps_4_byte_activations(recompute: Recompute) -> None:
    # The executor keeps fp32 activations for an fp32 model: every value doubles against
    # 16 bits, the 1-byte dropout masks (two per token of h, one per score) do not.
    # Scores stored (no FlashAttention), masks outside the tensor-parallel split.
    plan = Plan(tp=2, global_batch=2, sequence_parallel=False, flash_attention=False)
    half = Shapes(GPT, IDEAL, plan)
    full = Shapes(dataclasses.replace(GPT, dtype_bytes=4), IDEAL, plan)
    masks = 0.0
    if not recompute.per_layer:
        scores = 0 if recompute is Recompute.SELECTIVE else GPT.heads * GPT.seq_len / plan.tp
        masks = half.tokens * (2 * GPT.hidden + scores)
    values = half.layer_activation_bytes(recompute) - masks
    assert values > 0
    assert full.layer_activation_bytes(recompute) == pytest.approx(2 * values + masks)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_memory_by_recompute_mode(recompute: str) -> None:
    m, b, t = GPT, 2, 2
    s, h, a = m.seq_len, m.hidden, m.heads
    plan = Plan(tp=t, global_batch=b, microbatch_size=b, recompute=recompute, flash_attention=False)
    sbh = s * b * h
    layer = {  # Korthikanti et al. 2022, with sequence parallelism
        "none": sbh * (34 + 5 * a * s / h) / t,
        "selective": sbh * 34 / t,
        "full": 2 * sbh / t,
    }[recompute]
    embedding = sbh / t  # the dropout mask, a byte per value
    head = s * b * (4 * m.vocab + 2 * h) / t  # fp32 softmax of the loss, the final norm's input
    working = sbh * (34 + 5 * a * s / h) / t if recompute == "full" else 0  # one layer rebuilt
    memory = estimate(m, IDEAL, plan).memory
    expected = round(m.layers * layer) + round(embedding) + round(head) + working
    assert memory.activations == pytest.approx(expected, abs=2)


def test_plan_that_does_not_fit() -> None:
    small = dataclasses.replace(IDEAL, memory_bytes=2**20)
    assert not estimate(GPT, small, Plan(global_batch=1)).fits
    with pytest.raises(DoesNotFit, match="GiB per GPU"):
        estimate(GPT, small, Plan(global_batch=1), fits_first=True)


# --- pipelines ----------------------------------------------------------------------------


def test_pipeline_with_even_stages_has_1f1b_bubble() -> None:
    # Four stages of one layer each; the head and embedding are negligible next to them,
    # and so are sends on an unbounded link.
    model = dataclasses.replace(GPT, vocab=8)
    cluster = dataclasses.replace(IDEAL, intra_node_bandwidth=1e30)
    plan = Plan(pp=4, global_batch=8, schedule="1f1b")
    result = estimate(model, cluster, plan)
    assert result.bubble == pytest.approx(3 / (8 + 3), abs=0.01)
    assert prepare(model, cluster, plan).lower_bound_s <= result.step_time_s


def test_busy_devices_share_the_rate_their_node_reaches_at_their_count() -> None:
    shared = dataclasses.replace(IDEAL, host_cores=2.0)
    # Eight devices on two cores: priced with all eight busy (a quarter core each); without
    # measured rates each busy device gets its share of the cores, at most one.
    assert [shared.speedup(n) for n in (8, 4, 2, 1)] == [1.0, 2.0, 4.0, 4.0]
    # Measured rates: with 4 busy the node reaches 0.7 of its rate with all 8, so each of
    # the 4 computes 0.7 * 8 / 4 = 1.4 times as fast as priced.
    rates = (0.29, 0.43, 0.57, 0.7, 0.79, 0.87, 0.94, 1.0)
    measured = dataclasses.replace(shared, busy_rates=rates)
    assert measured.speedup(4) == pytest.approx(1.4) and measured.speedup(1) == pytest.approx(2.32)
    assert measured.speedup(8) == 1.0 and measured.speedup(20) == 1.0
    # A core per device, or devices with compute of their own: nothing to share.
    assert dataclasses.replace(IDEAL, host_cores=8.0).speedup(1) == 1.0 and IDEAL.speedup(1) == 1.0
    for bad in (0.0, -1.0, True):
        with pytest.raises(DescriptionError, match="host_cores must be"):
            dataclasses.replace(IDEAL, host_cores=bad)
        with pytest.raises(DescriptionError, match="busy_rates"):
            dataclasses.replace(shared, busy_rates=(bad,) * IDEAL.gpus_per_node)
    with pytest.raises(DescriptionError, match="busy_rates has 2 entries; it needs one per device of the node"):
        dataclasses.replace(shared, busy_rates=(0.5, 1.0))


@pytest.mark.parametrize("spec", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv"])
def test_processor_sharing_at_one_speed_is_the_plain_pass_and_conserves_work(spec: str) -> None:
    schedule = library.load(spec, pp=4, microbatches=8)
    forward = tuple(1.0 + 0.5 * (s % 3) for s in range(schedule.num_stages))  # uneven stages
    costs = CostModel(forward=forward, backward=tuple(2 * f + 0.5 for f in forward), latency=0.25, overlap_sends=False)
    devices = schedule.num_devices
    plain = simulate(schedule, costs)
    same = simulate(schedule, costs.with_changes(speedup=(1.0,) * devices))
    assert same.makespan == pytest.approx(plain.makespan, rel=1e-12)
    assert same.critical_path and same.busy == pytest.approx(plain.busy, rel=1e-12)
    # Cores that do the same work whoever computes (speed-up devices / n): never faster
    # than the work over every device, nor slower than the plain pass.
    shared = simulate(schedule, costs.with_changes(speedup=tuple(devices / n for n in range(1, devices + 1))))
    assert plain.busy / devices * (1 - 1e-12) <= shared.makespan <= plain.makespan * (1 + 1e-12)
    with pytest.raises(PipedslError, match="speedup lists 2 values but the schedule has 4 devices"):
        simulate(schedule, costs.with_changes(speedup=(2.0, 1.0)))


@pytest.mark.parametrize("spec", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv"])
def test_devices_that_take_turns_run_one_compute_at_a_time_in_dispatch_order(spec: str) -> None:
    schedule = library.load(spec, pp=4, microbatches=8)
    forward = tuple(1.0 + 0.5 * (s % 3) for s in range(schedule.num_stages))
    costs = CostModel(forward=forward, latency=0.25, speedup=(2.0,) + (1.0,) * (schedule.num_devices - 1))
    turns = simulate(schedule, costs.with_changes(serial=True))
    computes = sorted((e for e in turns.timeline.events() if e.kind.is_compute), key=lambda e: e.start)
    # One at a time, at speedup[0], never overlapping: the busy time is the makespan's
    # but for the waits on transfers.
    for before, after in zip(computes, computes[1:]):
        assert after.start >= before.end - 1e-12
    assert sum(e.end - e.start for e in computes) == pytest.approx(turns.busy, rel=1e-12)
    assert turns.busy == pytest.approx(simulate(schedule, costs.with_changes(speedup=None)).busy / 2, rel=1e-12)
    # In the order one host thread dispatches the devices' programs.
    arrays = lower(schedule).arrays
    actions = arrays.actions
    expected = [
        (int(actions.device[r]), int(actions.stage[r]), int(actions.microbatch[r])) for r in dispatch_order(arrays)
    ]
    assert [(e.device, e.stage, e.microbatch) for e in computes] == expected
    with pytest.raises(PipedslError, match="serial says how devices that share compute take turns"):
        CostModel(serial=True)


def test_pipeline_devices_of_several_cpu_devices_take_turns() -> None:
    # Meshes of two CPU devices on a host of two cores: each compute runs alone, at the
    # rate of one mesh busy, the data-parallel reductions and updates of both devices in turn.
    model = dataclasses.replace(GPT, vocab=8, layers=8)
    shared = dataclasses.replace(IDEAL, intra_node_bandwidth=1e30, host_cores=2.0)
    plan = Plan(pp=2, dp=2, global_batch=8, schedule="1f1b")
    prepared = prepare(model, shared, plan)
    assert prepared.serial and not prepare(model, shared, dataclasses.replace(plan, dp=1)).serial
    assert not prepare(model, dataclasses.replace(shared, host_cores=None), plan).serial
    costs = prepared.cost_model()
    assert costs.serial and costs.speedup is not None
    schedule = library.load("1f1b", pp=2, microbatches=plan.microbatches)
    resolved = costs.resolve(schedule)
    busy = plan.microbatches * (sum(resolved.forward) + sum(resolved.backward)) / costs.speedup[0]
    # With free transfers, back to back; the estimate waits for its transfers besides.
    assert simulate(schedule, costs.with_changes(latency=0.0, bandwidth=None)).makespan == pytest.approx(
        busy, rel=1e-12
    )
    assert estimate(model, shared, plan).pipeline_time_s >= busy * (1 - 1e-12)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_the_executors_fixed_cost_of_a_step_is_paid_once_per_step(pp: int) -> None:
    # Pipeline devices that take turns update one after another, but the executor starts
    # a step, hands out its batch and gathers its losses once, however many there are.
    model = dataclasses.replace(GPT, vocab=8, layers=8)
    shared = dataclasses.replace(IDEAL, host_cores=2.0)
    plan = Plan(pp=pp, dp=2, global_batch=8, schedule="1f1b" if pp > 1 else None)
    assert pp == 1 or prepare(model, shared, plan).serial
    fixed = dataclasses.replace(shared, step_overhead_s=0.25)
    assert estimate(model, fixed, plan).step_time_s - estimate(model, shared, plan).step_time_s == pytest.approx(0.25)


def test_devices_that_share_cores_share_them_among_the_busy_ones() -> None:
    # Processor sharing in the simulator: a one-microbatch pipeline of four stages of two
    # devices has two devices busy at a time, each with a core, 4x their priced rate.
    model = dataclasses.replace(GPT, vocab=8, layers=8)
    alone = dataclasses.replace(IDEAL, intra_node_bandwidth=1e30)
    shared = dataclasses.replace(alone, host_cores=2.0)
    one = Plan(pp=4, dp=2, global_batch=2, schedule="gpipe")
    assert estimate(model, shared, one).pipeline_time_s == pytest.approx(
        estimate(model, alone, one).pipeline_time_s / 4
    )
    # Where the node reaches 0.3 of its all-busy rate with two devices busy, each of them
    # computes 0.3 * 8 / 2 = 1.2 times as fast as priced.
    rates = tuple(min(1.0, 0.15 * n) if n < 8 else 1.0 for n in range(1, 9))
    slower = dataclasses.replace(shared, busy_rates=rates)
    assert estimate(model, slower, one).pipeline_time_s == pytest.approx(
        estimate(model, alone, one).pipeline_time_s / 1.2
    )
    # With many microbatches the cores are busy most of the step: no faster than the
    # devices' mean busy time (the cores do the same work), and faster than the makespan.
    for plan in (
        Plan(pp=4, dp=2, global_batch=16, schedule="1f1b"),
        Plan(pp=4, dp=2, global_batch=16, schedule="zb_h1"),
    ):
        apart, together = estimate(model, alone, plan), estimate(model, shared, plan)
        assert (
            apart.pipeline_time_s * (1 - apart.bubble) * (1 - 1e-9) <= together.pipeline_time_s < apart.pipeline_time_s
        )
        assert prepare(model, shared, plan).lower_bound_s <= together.step_time_s * (1 + 1e-12)
        assert any(a.name == "host_cores" and a.value == "2" for a in together.assumptions)
        assert not any(a.name == "host_cores" for a in apart.assumptions)
    # SPMD over every device keeps every one busy: as priced; over two devices, 4x.
    spmd = Plan(dp=8, global_batch=8)
    assert estimate(model, shared, spmd).step_time_s == estimate(model, alone, spmd).step_time_s
    pair = Plan(dp=2, global_batch=8)
    assert estimate(model, shared, pair).pipeline_time_s == pytest.approx(
        estimate(model, alone, pair).pipeline_time_s / 4
    )


def test_a_split_backward_costs_its_halves_as_the_executor_divides_them() -> None:
    # The first stage takes token ids: its I has no input cotangent to compute, so it is no
    # work and its W the fused backward. Elsewhere I and W cost their shares of the fused
    # backward. The dispatch is the simulation's, once per task (pipedsl.tasks).
    model = dataclasses.replace(GPT, vocab=8, layers=8)
    overhead = 1e-4
    base = dataclasses.replace(IDEAL, action_overhead_s=overhead)
    zb = Plan(pp=4, dp=2, global_batch=16, schedule="zb_h1")
    plain = prepare(model, base, zb)
    costs = plain.cost_model()
    work = plain.work
    assert costs.dispatch == overhead
    assert costs.input_grad[0] == 0.0
    assert costs.weight_grad[0] == pytest.approx(work[0].backward)
    assert costs.input_grad[1:] == tuple(w.input_grad for w in work[1:])
    assert costs.weight_grad[1:] == tuple(w.weight_grad for w in work[1:])
    for s in range(1, 4):
        assert costs.input_grad[s] + costs.weight_grad[s] == pytest.approx(costs.backward[s])


@pytest.mark.parametrize(
    ("spec", "vpp"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)]
)
def test_memory_walk_matches_the_simulator(spec: str, vpp: int) -> None:
    pipelines = Pipelines()
    key = ScheduleKey(spec, 4, vpp if spec == "interleaved_1f1b" else 0, 8)
    schedule = pipelines.schedule(key)
    residual = tuple(100 + 7 * s for s in range(schedule.num_stages))
    # What I leaves for W differs from what F kept (more on some stages, less on others).
    weight_residual = tuple(60 + 31 * s for s in range(schedule.num_stages))
    simulated = simulate(lower(schedule), CostModel(residual_bytes=residual, weight_residual_bytes=weight_residual))
    assert pipelines.peak_residual_bytes(key, residual, weight_residual) == tuple(
        d.peak_activation_bytes for d in simulated.devices
    )


PIPELINE_SCHEDULES = [
    name for name, path in library_schedules().items() if {"pp", "microbatches"} <= set(library.parameters(path))
]


@pytest.mark.parametrize("spec", PIPELINE_SCHEDULES)
def test_lower_bound_never_exceeds_the_step(spec: str) -> None:
    model = load_model("gpt3-175b")
    cluster = load_cluster("a100-80gb")
    pipelines = Pipelines()
    probe = Plan(pp=8, global_batch=32, schedule=spec)
    placed = pipelines.schedule(pipelines.key(probe))
    vpp = 2 if "vpp" in library.parameters(spec) else placed.num_stages // placed.num_devices
    for recompute in Recompute:
        plan = Plan(dp=2, tp=8, pp=8, vpp=vpp, global_batch=32, recompute=recompute, zero=1, schedule=spec)
        prepared = prepare(model, cluster, plan, pipelines=pipelines)
        assert prepared.lower_bound_s <= prepared.finish().step_time_s * (1 + 1e-12)


def test_inter_node_pipeline_sends_cost_more() -> None:
    # pp = 2 with one GPU per stage stays in a node; with 8-way tensor parallelism each
    # stage fills a node and the send crosses to the next one.
    plan = Plan(pp=2, global_batch=4, schedule="1f1b")
    near = estimate(GPT, IDEAL, plan)
    cluster = dataclasses.replace(IDEAL, gpus_per_node=1)
    far = estimate(GPT, cluster, plan)
    assert far.step_time_s > near.step_time_s


def test_plan_errors() -> None:
    with pytest.raises(PlanError, match="not a multiple of dp"):
        Plan(dp=3, global_batch=8)
    with pytest.raises(PlanError, match="needs a schedule"):
        Plan(pp=2, global_batch=8)
    with pytest.raises(PlanError, match="recompute must be one of"):
        Plan(global_batch=8, recompute="some")
    with pytest.raises(PlanError, match="do not split evenly"):
        estimate(GPT, IDEAL, Plan(pp=3, global_batch=3, schedule="1f1b"))
    with pytest.raises(PlanError, match="needs vpp = 2"):
        estimate(GPT, IDEAL, Plan(pp=2, global_batch=4, schedule="zbv"))
    # The one schedule loader's message, as every command gives it.
    with pytest.raises(PipedslError, match="no schedule 'nope' in the library"):
        estimate(GPT, IDEAL, Plan(pp=2, global_batch=4, schedule="nope"))
    with pytest.raises(ScheduleEvalError, match="at least as many microbatches"):
        estimate(GPT, IDEAL, Plan(pp=4, global_batch=2, schedule="1f1b"))


def test_estimate_json_has_the_promised_keys() -> None:
    data = estimate(GPT, IDEAL, Plan(pp=2, global_batch=4, schedule="1f1b")).to_json()
    for key in ("step_time_s", "mfu", "memory_bytes_per_gpu", "fits", "tokens_per_s"):
        assert key in data
    assert math.isfinite(data["step_time_s"])
