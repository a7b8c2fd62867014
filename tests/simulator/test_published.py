"""The estimator against measured training runs (data/published_runs*.csv).

Each row is a published run with its exact configuration, marked ``calibrate`` (each
GPU type's compute parameters were fitted on these rows alone, by
``python -m pipedsl.simulator.fit_published``) or ``validate`` (only reported). Nothing
is fitted per row. Run with ``-s`` to see the per-row table; data/ACCURACY.md has the
tables by source and regime.
"""

from __future__ import annotations

import csv
import dataclasses

import pytest

from pipedsl.simulator.fit_published import (
    DATA,
    GRID,
    HELD_OUT_GPU,
    K_FILL_GRID,
    TORUS_NETWORK_GRID,
    TPU_RUNS,
    Result,
    evaluate,
    fit,
    gpu_type,
    load_runs,
)
from pipedsl.simulator.hardware import load_cluster

SOURCE_LIMIT = 0.05
"""Mean absolute error allowed per source."""
OVERALL_LIMIT = 0.08
ROW_LIMIT = 0.25
ORIGINAL_LIMIT = 0.04
"""Mean absolute error allowed over the 19 runs of published_runs.csv."""


@pytest.fixture(scope="module")
def results() -> list[Result]:
    runs = load_runs()
    clusters = {name: load_cluster(name) for name in {r.cluster for r in runs}}
    found = evaluate(runs, clusters)
    lines = [f"{'run':28} {'source':24} {'role':9} {'GPUs':>5} {'measured s':>11} {'predicted s':>12} {'error':>7}"]
    for r in found:
        lines.append(
            f"{r.run.name:28} {r.run.source:24} {r.run.role:9} {r.run.plan.gpus:5d} {r.run.measured_s:11.3f} "
            f"{r.predicted_s:12.3f} {100 * r.error:+6.1f}%"
        )
    print("\n" + "\n".join(lines))
    return found


def _mape(results: list[Result]) -> float:
    return sum(abs(r.error) for r in results) / len(results)


def test_every_source_is_cited() -> None:
    readme = (DATA / "README.md").read_text()
    for run in load_runs():
        assert run.source in readme, f"{run.name}: source {run.source} is not described in data/README.md"


def test_both_roles_and_several_sources() -> None:
    runs = load_runs()
    assert {r.role for r in runs} == {"calibrate", "validate"}
    assert len({r.source for r in runs}) >= 4


def test_each_gpu_type_has_calibration_and_validation_rows() -> None:
    roles: dict[str, set[str]] = {}
    for run in load_runs():
        roles.setdefault(gpu_type(load_cluster(run.cluster)), set()).add(run.role)
    assert len(roles) >= 2
    for kind, found in roles.items():
        assert found == {"calibrate", "validate"}, f"{kind}: {found}"


def test_presets_of_one_gpu_type_share_one_fit() -> None:
    fitted: dict[str, set[tuple[float, float, float]]] = {}
    for name in {r.cluster for r in load_runs()}:
        c = load_cluster(name)
        fitted.setdefault(gpu_type(c), set()).add((c.matmul_efficiency, c.matmul_half_flops, c.kernel_launch_s))
    assert gpu_type(load_cluster("a100-40gb")) == gpu_type(load_cluster("a100-80gb")) == "A100"
    for kind, points in fitted.items():
        assert len(points) == 1, f"{kind} presets disagree: {points}"


def test_v100_fit_reproduces_its_preset() -> None:
    # The whole fit (python -m pipedsl.simulator.fit_published) takes minutes; the V100's
    # two calibration rows are priced without a pipeline and fit in about a second.
    preset = load_cluster("v100-dgx2")
    fitted, error = fit(load_runs(), {preset.name: preset})
    assert fitted[preset.name] == preset
    assert error < 0.05


def test_fit_takes_one_gpu_type_at_a_time() -> None:
    clusters = {name: load_cluster(name) for name in ("a100-80gb", "v100-dgx2")}
    with pytest.raises(ValueError, match="one GPU type"):
        fit(load_runs(), clusters)


def test_every_run_fits(results: list[Result]) -> None:
    for r in results:
        assert r.fits, f"{r.run.name} ran, so it must fit"


def test_error_per_source_and_overall(results: list[Result]) -> None:
    by_source: dict[str, list[Result]] = {}
    for r in results:
        by_source.setdefault(r.run.source, []).append(r)
    for source, group in by_source.items():
        assert _mape(group) < SOURCE_LIMIT, f"{source}: {100 * _mape(group):.1f}%"
    assert _mape(results) < OVERALL_LIMIT
    worst = max(results, key=lambda r: abs(r.error))
    assert abs(worst.error) < ROW_LIMIT, f"{worst.run.name}: {100 * worst.error:+.1f}%"


def test_original_runs_stay_within_four_percent(results: list[Result]) -> None:
    with (DATA / "published_runs.csv").open(newline="") as handle:
        names = {row["run"] for row in csv.DictReader(handle)}
    original = [r for r in results if r.run.name in names]
    assert len(original) == 19
    assert _mape(original) < ORIGINAL_LIMIT


def test_h100_preset_is_the_best_of_its_grid_neighbours() -> None:
    # The whole H100 fit takes about ten seconds; its preset must at least beat every
    # neighbouring grid point on the H100 calibration rows (an exact refit is
    # python -m pipedsl.simulator.fit_published).
    preset = load_cluster("h100-80gb")
    runs = [r for r in load_runs() if r.cluster == preset.name and r.role == "calibrate"]
    assert len(runs) >= 6

    def error(efficiency: float, half: float, fill: float) -> float:
        # The fit's objective: the mean over sources of each source's mean error.
        cluster = dataclasses.replace(preset, matmul_efficiency=efficiency, matmul_half_flops=half, matmul_k_fill=fill)
        by_source: dict[str, list[Result]] = {}
        for r in evaluate(runs, {preset.name: cluster}):
            by_source.setdefault(r.run.source, []).append(r)
        return sum(_mape(group) for group in by_source.values()) / len(by_source)

    assert preset.matmul_units == 132
    best = error(preset.matmul_efficiency, preset.matmul_half_flops, preset.matmul_k_fill)
    assert best < 0.03
    axes = (GRID["matmul_efficiency"], GRID["matmul_half_flops"], K_FILL_GRID["matmul_k_fill"])
    at = [axis.index(v) for axis, v in zip(axes, (preset.matmul_efficiency, preset.matmul_half_flops,
                                                  preset.matmul_k_fill), strict=True)]  # fmt: skip
    for axis in range(3):
        for step in (-1, 1):
            moved = list(at)
            moved[axis] += step
            if 0 <= moved[axis] < len(axes[axis]):
                assert best <= error(*(values[i] for values, i in zip(axes, moved, strict=True)))


# --- TPU runs and GPU runs held out of every fit ------------------------------------------

HELD_OUT_MEAN_LIMIT = 0.05
"""Mean absolute error allowed over each held-out set (the GPU runs of data/heldout_runs*.csv,
the validate rows of data/tpu_runs*.csv)."""
HELD_OUT_GPU_ROW_LIMIT = 0.15
HELD_OUT_TPU_ROW_LIMIT = 0.15


@pytest.fixture(scope="module")
def held_out() -> dict[str, list[Result]]:
    gpu = load_runs(DATA, HELD_OUT_GPU)
    tpu = load_runs(DATA, TPU_RUNS)
    clusters = {name: load_cluster(name) for name in {r.cluster for r in [*gpu, *tpu]}}
    return {"gpu": evaluate(gpu, clusters), "tpu": evaluate(tpu, clusters)}


def test_tpu_and_held_out_runs_are_cited_and_split() -> None:
    readme = (DATA / "README.md").read_text()
    tpu, gpu = load_runs(DATA, TPU_RUNS), load_runs(DATA, HELD_OUT_GPU)
    for run in [*tpu, *gpu]:
        assert run.source in readme, f"{run.name}: source {run.source} is not described in data/README.md"
    assert {r.role for r in gpu} == {"validate"} and len(gpu) >= 20
    assert sum(r.role == "validate" for r in tpu) >= 20 and {r.role for r in tpu} == {"calibrate", "validate"}
    assert {r.slices for r in tpu} == {1, 2, 4, 8, 16, 32}


def test_every_held_out_and_tpu_run_fits(held_out: dict[str, list[Result]]) -> None:
    for r in [*held_out["gpu"], *held_out["tpu"]]:
        assert r.fits, f"{r.run.name} ran, so it must fit"


def test_held_out_errors(held_out: dict[str, list[Result]]) -> None:
    validate = [r for r in held_out["tpu"] if r.run.role == "validate"]
    for results, row_limit in ((held_out["gpu"], HELD_OUT_GPU_ROW_LIMIT), (validate, HELD_OUT_TPU_ROW_LIMIT)):
        assert _mape(results) < HELD_OUT_MEAN_LIMIT
        worst = max(results, key=lambda r: abs(r.error))
        assert abs(worst.error) < row_limit, f"{worst.run.name}: {100 * worst.error:+.1f}%"


def test_more_slices_are_predicted_slower_as_they_ran(held_out: dict[str, list[Result]]) -> None:
    # The same work per chip on 1 to 32 slices of v5e: each model's runs slow down with the
    # slices, and so do the predictions.
    by_model: dict[str, list[Result]] = {}
    for r in held_out["tpu"]:
        if r.run.cluster == "tpu-v5e":
            by_model.setdefault(r.run.name.split("-v5e")[0], []).append(r)
    assert len(by_model) == 4
    for results in by_model.values():
        ordered = sorted(results, key=lambda r: r.run.slices)
        predicted = [r.predicted_s for r in ordered]
        assert predicted == sorted(predicted) and predicted[-1] > 1.05 * predicted[0]
        assert ordered[-1].run.measured_s > ordered[0].run.measured_s


def test_tpu_presets_are_the_best_of_their_grid_neighbours() -> None:
    runs = [r for r in load_runs(DATA, TPU_RUNS) if r.role == "calibrate"]
    for name in ("tpu-v5e", "tpu-v5p"):
        preset = load_cluster(name)
        mine = [r for r in runs if r.cluster == name]

        def error(**changes: float) -> float:
            return _mape(evaluate(mine, {name: dataclasses.replace(preset, **changes)}))

        best = error()
        efficiencies = GRID["matmul_efficiency"]
        e = efficiencies.index(preset.matmul_efficiency)
        jitters = TORUS_NETWORK_GRID["slice_jitter_s"]
        j = jitters.index(preset.slice_jitter_s)
        for step in (-1, 1):
            if 0 <= e + step < len(efficiencies):
                assert best <= error(matmul_efficiency=efficiencies[e + step]) + 1e-12
            if 0 <= j + step < len(jitters):
                assert best <= error(slice_jitter_s=jitters[j + step]) + 1e-12
