"""Collectives on a TPU torus against hand counts from the presets' figures (simulator/torus.py).

tpu-v5e: ICI 50 GB/s per link per direction at 0.9 (45 GB/s achieved), 1 us per hop; 8 chips per
host sharing one 25 GB/s DCN adapter at 0.9, 10 us per message; a 16 x 16 slice, both axes whole
(wraparound). tpu-v5p: ICI 100 GB/s per link per direction at 0.9 (90 GB/s), the same hop and DCN;
1024 chips are an 8 x 8 x 16 slice of whole 4 x 4 x 4 cubes (wraparound on every axis).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipedsl.cli.main import main
from pipedsl.simulator.collectives import Algorithm, all_reduce_choice, gather_seconds, plan_group
from pipedsl.simulator.estimate import check_divides, estimate
from pipedsl.simulator.hardware import DescriptionError, load_cluster, load_model
from pipedsl.simulator.plan import Plan, PlanError
from pipedsl.simulator.search import search
from pipedsl.simulator.torus import Ring, TorusGroup, mesh_layout, slice_shape, torus_group

V5E = load_cluster("tpu-v5e")
V5P = load_cluster("tpu-v5p")
GB = 1e9
S = 1e9  # bytes gathered or reduced
HOP = 1e-6


def test_presets_carry_the_published_figures() -> None:
    assert (V5E.peak_flops, V5E.hbm_bandwidth, V5E.memory_bytes) == (197e12, 819e9, 16 * 2**30)
    assert (V5P.peak_flops, V5P.hbm_bandwidth, V5P.memory_bytes) == (459e12, 2765e9, 95 * 2**30)
    # 1,600 Gbps per v5e chip over 4 links; 1,200 GB/s bidirectional per v5p chip over 6 links.
    assert V5E.intra_node_bandwidth == 1600e9 / 8 / 4
    assert V5P.intra_node_bandwidth == 1200e9 / 2 / 6
    # DCN: 6.4 Tbps per 32-host v5e pod; 50 Gbps per v5p chip, 4 chips per host.
    assert V5E.inter_node_bandwidth * V5E.nics_per_node == 6.4e12 / 8 / 32
    assert V5P.inter_node_bandwidth * V5P.nics_per_node == 50e9 / 8 * 4
    assert (V5E.torus, V5P.torus) == ((16, 16), (16, 16, 24))


def test_slice_shapes_are_googles() -> None:
    assert slice_shape(256, V5E) == (16, 16)
    assert slice_shape(128, V5E) == (8, 16)
    assert slice_shape(1024, V5P) == (8, 8, 16)
    assert slice_shape(6144, V5P) == (16, 16, 24)
    with pytest.raises(PlanError, match="no slice") as refused:
        slice_shape(512, V5E)
    assert "ask for 2 slices of 256" in str(refused.value) and "--slices 2" in str(refused.value)
    with pytest.raises(PlanError, match="give a chip count it can shape"):
        slice_shape(96, V5E)


def test_mesh_layout_follows_create_device_mesh() -> None:
    # The busiest axis first, on the most whole physical axes whose lengths multiply to its size.
    assert mesh_layout((4, 4, 16), (1, 16, 16)) == ((1, 1, 4), (1, 1, 4), (1, 16, 1))
    # 8 chips fit no whole axis of 16 x 16: the axes are split.
    assert mesh_layout((16, 16), (1, 32, 8)) == ((1, 2, 8), (1, 16, 1))


def test_full_axis_with_wraparound() -> None:
    plan = Plan(dp=16, tp=16, global_batch=16)
    group = torus_group(plan, ("tensor",), V5E)
    assert group == TorusGroup((Ring(16, True),))
    # A bidirectional ring over 16 chips: both directions of each link, 2 x 45 GB/s.
    hand = 15 * HOP + 15 / 16 * S / (2 * 45 * GB)
    assert gather_seconds(S, group, V5E) == pytest.approx(hand)
    assert all_reduce_choice(S, group, V5E) == (Algorithm.TORUS, pytest.approx(2 * hand))


def test_partial_axis_is_a_line() -> None:
    plan = Plan(dp=32, tp=8, global_batch=32)
    group = torus_group(plan, ("tensor",), V5E)
    assert group == TorusGroup((Ring(8, False),))
    # 8 of a 16-chip axis: no wraparound, a line at one direction's 45 GB/s.
    hand = 7 * HOP + 7 / 8 * S / (45 * GB)
    assert gather_seconds(S, group, V5E) == pytest.approx(hand)


def test_group_spanning_two_axes_runs_per_axis_phases_on_both_axes_at_once() -> None:
    plan = Plan(dp=64, tp=16, global_batch=64)
    # 1024 chips on 8 x 8 x 16: tensor takes the 16-axis, data the two 8-axes.
    group = plan_group(plan, ("data", "fsdp", "context"), V5P)
    assert group == TorusGroup((Ring(8, True), Ring(8, True)))
    # Half the bytes reduce-scatter along x then y, half along y then x, each ring at 2 x 90 GB/s:
    # each axis carries one half's first phase and the other's second, both axes at once.
    one_order = 7 / 8 * S / (2 * 90 * GB) + 7 / 8 * (S / 8) / (2 * 90 * GB)
    hand = 14 * HOP + one_order / 2
    assert gather_seconds(S, group, V5P) == pytest.approx(hand)


def test_unequal_axes_are_priced_by_the_busier() -> None:
    # 512 chips on 8 x 8 x 8 with tp 16: an 8-chip ring with wraparound, then a 2-chip line.
    plan = Plan(dp=32, tp=16, global_batch=32)
    group = plan_group(plan, ("tensor",), V5P)
    assert group == TorusGroup((Ring(8, True), Ring(2, False)))
    ring, line = 2 * 90 * GB, 90 * GB
    on_ring = 7 / 8 * (S / 2) / ring + 7 / 8 * (S / 2 / 2) / ring
    on_line = 1 / 2 * (S / 2) / line + 1 / 2 * (S / 2 / 8) / line
    assert gather_seconds(S, group, V5P) == pytest.approx(8 * HOP + max(on_ring, on_line))


def test_group_across_slices_crosses_dcn() -> None:
    four = dataclasses.replace(V5E, slices=4)
    plan = Plan(dp=64, tp=16, global_batch=64)
    group = plan_group(plan, ("data", "fsdp", "context"), four)
    assert group == TorusGroup((Ring(16, True),), slices=4)
    # In each slice a 16-chip ring over S; then each chip's S/16 over DCN among 4 slices, at its
    # share of the host's adapter: 25 GB/s x 0.9 / 8 chips.
    dcn = 25 * GB * 0.9 / 8
    hand = (15 * HOP + 15 / 16 * S / (2 * 45 * GB)) + (3 * 10e-6 + 3 / 4 * (S / 16) / dcn)
    assert gather_seconds(S, group, four) == pytest.approx(hand)


def test_pipeline_spans_slices_before_data() -> None:
    four = dataclasses.replace(V5E, slices=4)
    data = ("data", "fsdp", "context")
    assert plan_group(Plan(dp=64, tp=4, pp=4, global_batch=64, schedule="1f1b"), data, four).slices == 1
    assert plan_group(Plan(dp=128, tp=4, pp=2, global_batch=128, schedule="1f1b"), data, four).slices == 2
    with pytest.raises(PlanError, match="cannot span 4 slices"):
        check_divides(load_model("llama-70b"), four, Plan(dp=1, tp=16, cp=32, pp=2, global_batch=8, schedule="1f1b"))


def test_estimate_prints_torus_assumptions() -> None:
    four = dataclasses.replace(V5E, slices=4)
    plan = Plan(dp=64, tp=16, global_batch=512, zero=3, recompute="full")
    found = {a.name: a for a in estimate(load_model("llama-70b"), four, plan).assumptions}
    assert found["network"].value == "torus"
    assert "16x16 torus" in found["network"].meaning and "4 slices joined by DCN" in found["network"].meaning
    assert found["tp_collectives"].value == "torus"


def test_slices_need_a_torus() -> None:
    with pytest.raises(DescriptionError, match="needs a torus"):
        dataclasses.replace(load_cluster("h100-80gb"), slices=2)


def test_cli_search_over_slices_speaks_of_chips(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["search", "--model", "llama-8b", "--cluster", "tpu-v5e", "--slices", "2", "--devices", "64",
            "--global-batch", "64", "--schedules", "1f1b", "--top", "3", "--jobs", "1"]  # fmt: skip
    assert main(argv) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long sentences
    assert "on 64 chips of tpu-v5e" in printed and "GiB/chip" in printed and "GPU" not in printed
    assert "network = torus: 4x8 torus per slice" in printed and "2 slices joined by DCN" in printed


def test_cli_slices_need_a_tpu_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["search", "--model", "llama-8b", "--cluster", "h100-80gb", "--slices", "2", "--gpus", "64"]
    assert main(argv) != 0
    assert "--slices 2 needs a TPU cluster" in capsys.readouterr().err


def test_cli_search_on_one_calibrated_tpu_chip_speaks_of_a_chip(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = Path(__file__).resolve().parents[2] / "bench" / "clusters" / "tpu-v5-lite.toml"
    # Llama-8B's state does not fit one chip: the search says so (status 1), in chips.
    assert main(["search", "--model", "llama-8b", "--cluster", str(cluster), "--devices", "1", "--jobs", "1"]) == 1
    printed = " ".join(capsys.readouterr().out.split())
    assert "on 1 chip of this machine" in printed
    assert "more chips, recomputation or ZeRO may help" in printed and "GPU" not in printed


def test_pipeline_devices_that_share_a_chip_lay_out_on_it() -> None:
    # Four pipeline devices on one chip: the pipeline axis spans no chips of the torus.
    found = search("demo-small", "tpu-v5e", 1, global_batch=32, shared_pipelines=True)
    shared = found[found.kind != "spmd"]
    assert len(shared) and (shared.pp > 1).any() and (shared.step_time_s > 0).all()
