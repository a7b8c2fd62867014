"""What the simulator hands out: the result object, JSON, DataFrames, traces, pictures, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from helpers import gpipe, interleaved, one_f_one_b, one_f_one_b_split, v_shape
from pipedsl.cli import main
from pipedsl.errors import PipedslError
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.library import library_path, load, load_arrays
from pipedsl.program import Compute, DeviceProgram, Program, Recv, lower
from pipedsl.simulator import CostModel, simulate
from pipedsl.simulator.plot import Panel, plot_timelines, save_figure
from pipedsl.simulator.trace import chrome_trace, write_trace
from pipedsl.timeline import Timeline

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LIB = library_path()


@pytest.mark.parametrize(
    ("name", "params"), [("interleaved_1f1b", {"pp": 4, "vpp": 2, "microbatches": 8}), ("zb_h1", {"pp": 4})]
)
@pytest.mark.parametrize("overlap_sends", [True, False])
def test_a_schedule_simulated_from_its_columns_is_simulated_as_from_its_objects(
    name: str, params: dict[str, int], overlap_sends: bool
) -> None:
    costs = CostModel(forward=1.0, latency=0.25, overlap_sends=overlap_sends, residual_bytes=100)
    from_objects = simulate(load(library_path(name), **params), costs)
    from_columns = simulate(load_arrays(library_path(name), **params), costs)
    assert from_columns.to_json() == from_objects.to_json()
    for column in ("device", "kind", "stage", "microbatch", "start", "end", "peer"):
        assert np.array_equal(getattr(from_columns.timeline, column), getattr(from_objects.timeline, column))
    assert from_columns.critical_path == from_objects.critical_path


def test_json_summary_is_stable_and_complete() -> None:
    sim = simulate(one_f_one_b(4, 8), CostModel(forward=1, latency=0.5, residual_bytes=1000))
    data = sim.to_json()
    assert json.loads(json.dumps(data)) == data
    assert data["format"] == "pipedsl-simulation"
    assert data["version"] == 1
    assert data["schedule"] == "1f1b"
    assert data["params"] == {"pp": 4, "microbatches": 8}
    assert data["num_actions"] == 64
    assert data["makespan"] == sim.makespan
    assert data["bubble_ratio"] == sim.bubble_ratio
    assert data["costs"]["latency"] == 0.5
    assert [d["device"] for d in data["devices"]] == [0, 1, 2, 3]
    for entry, stats in zip(data["devices"], sim.devices, strict=True):
        assert set(entry) >= {"busy", "bubble", "bubble_ratio", "peak_inflight", "peak_activation_bytes"}
        assert entry["peak_activation_bytes"] == 1000 * stats.peak_inflight
    assert data["peak_inflight"] == 4
    path = data["critical_path"]
    assert path[0]["start"] == 0.0 and path[-1]["end"] == sim.makespan


def test_dataframe_one_row_per_action_and_transfer() -> None:
    schedule = one_f_one_b_split(3, 4)
    sim = simulate(schedule, CostModel(latency=0.25))
    frame = sim.to_dataframe()
    # 3 stages × 4 microbatches × (F, I, W) computes; 2 boundaries × 4 × 2 directions sends.
    assert len(frame) == 36 + 16
    assert list(frame.columns) == [
        "device", "kind", "stage", "microbatch", "start", "end", "duration", "peer", "buffer", "critical",
    ]  # fmt: skip
    assert frame["critical"].sum() == len(sim.critical_path)
    assert (frame.loc[frame["kind"] == "send", "duration"] == 0.25).all()
    assert set(frame.loc[frame["kind"] != "send", "kind"]) == {"F", "I", "W"}
    assert frame["peer"].isna().sum() == 36


def test_timeline_round_trips_through_json(tmp_path: Path) -> None:
    sim = simulate(gpipe(3, 3), CostModel(latency=0.1))
    path = tmp_path / "timeline.json"
    sim.timeline.save(path)
    loaded = Timeline.load(path)
    assert loaded.origin == "simulated"
    for column in ("device", "kind", "stage", "microbatch", "start", "end", "peer"):
        assert np.array_equal(getattr(loaded, column), getattr(sim.timeline, column))
    assert loaded.bubble_ratio() == sim.bubble_ratio


@pytest.mark.parametrize(
    "costs",
    [
        CostModel(forward=(1.0, 1.5, 0.5, 2.0, 1.0, 1.0, 0.75, 1.25), latency=0.3, bandwidth=1e3, activation_bytes=70),
        CostModel(forward=0.7, latency=0.2, overlap_sends=False),
        CostModel(forward=1.0, latency=0.1, speedup=(1.0, 1.6, 2.1, 2.5)),
        CostModel(forward=1.0, latency=0.1, speedup=(1.0, 1.0, 1.0, 1.0), serial=True),
    ],
)
def test_a_simulations_times_are_its_timelines_to_the_last_bit(costs: CostModel) -> None:
    # The simulation sums busy and transfer times from its own pass, not from the
    # timeline: both must give the same floats.
    sim = simulate(load_arrays(library_path("interleaved_1f1b"), pp=4, vpp=2, microbatches=8), costs)
    timeline = sim.timeline
    assert [d.busy for d in sim.devices] == timeline.busy().tolist()
    assert [d.transfer for d in sim.devices] == timeline.transfer_time().tolist()
    assert any(d.transfer > 0 for d in sim.devices)
    assert sim.makespan == timeline.makespan and sim.bubble_ratio == timeline.bubble_ratio()
    assert [e.peer for e in timeline.events()] == timeline.peers()
    assert {e.buffer for e in timeline.events()} == {None, "act", "grad"}


def test_simulate_accepts_a_schedule_or_a_program() -> None:
    schedule = one_f_one_b(3, 5)
    assert simulate(schedule).to_json() == simulate(lower(schedule)).to_json()
    assert simulate(schedule).costs == CostModel()


def test_a_program_that_cannot_finish_is_reported() -> None:
    # Device 1 waits for an activation that device 0 never sends.
    schedule = one_f_one_b(2, 1)
    program = lower(schedule)
    starved = DeviceProgram(0, (0,), tuple(i for i in program.devices[0].instructions if isinstance(i, Compute)))
    broken = Program(schedule, (starved, program.devices[1]))
    assert isinstance(broken.devices[1].instructions[0], Recv)
    with pytest.raises(PipedslError, match="device 1 waits for the activation of stage 0, microbatch 0"):
        simulate(broken)


def test_chrome_trace_has_a_compute_track_and_send_tracks_per_device() -> None:
    # Transfers of 3 s after 1 s forwards overlap on device 0: they need three lanes.
    sim = simulate(gpipe(2, 3), CostModel(forward=1, latency=3))
    trace = chrome_trace(sim.timeline)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(sim.timeline)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[(0, 0)] == "compute" and names[(1, 0)] == "compute"
    assert {names[(0, t)] for t in (1, 2, 3)} == {"sends", "sends 2", "sends 3"}
    for key in {(e["pid"], e["tid"]) for e in complete}:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in complete if (e["pid"], e["tid"]) == key)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    first = next(e for e in complete if e["pid"] == 0 and e["tid"] == 0)
    assert first["name"] == "0F0" and first["ts"] == 0.0 and first["dur"] == 1e6
    send = next(e for e in complete if e["cat"] == "send")
    assert send["name"] == "act 0→1 mb0"
    assert trace["otherData"]["schedule"] == "gpipe"


def test_write_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    write_trace(simulate(one_f_one_b(2, 2)).timeline, path)
    assert json.loads(path.read_text())["traceEvents"]
    with pytest.raises(PipedslError, match="cannot write trace"):
        write_trace(simulate(one_f_one_b(2, 2)).timeline, tmp_path / "missing" / "trace.json")


def _measured(sim_timeline: Timeline, *, scale: float = 1.1) -> Timeline:
    """A stand-in for an executor's record: the same events, ``scale`` times as long
    (10% slower by default), marked measured."""
    return Timeline(
        name=sim_timeline.name,
        num_devices=sim_timeline.num_devices,
        origin="measured",
        device=sim_timeline.device,
        kind=sim_timeline.kind,
        stage=sim_timeline.stage,
        microbatch=sim_timeline.microbatch,
        start=sim_timeline.start * scale,
        end=sim_timeline.end * scale,
        peer=sim_timeline.peer,
        buffer=sim_timeline.buffer,
    )


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_writes_pictures(tmp_path: Path, suffix: str) -> None:
    sim = simulate(one_f_one_b_split(3, 4), CostModel(latency=0.2))
    panels = [
        Panel(timeline=sim.timeline, title="1f1b split", critical=sim.critical_path),
        Panel(timeline=_measured(sim.timeline)),
    ]
    path = tmp_path / f"timeline{suffix}"
    save_figure(plot_timelines(panels), path)
    assert path.stat().st_size > 1000
    if suffix == ".svg":
        text = path.read_text()
        assert "1f1b split" in text and "[measured]" in text


def _bars_fill(figure: Figure) -> list[float]:
    """Per panel, how far along its time axis its bars reach (1.0: to the axis's end)."""
    reach = []
    for ax in figure.axes:
        ends = [float(np.max(path.vertices[:, 0])) for c in ax.collections for path in c.get_paths()]
        low, high = ax.get_xlim()
        reach.append((max(ends, default=0.0) - low) / (high - low))
    return reach


def test_a_measured_step_beside_a_simulated_one_is_drawn_on_its_own_time() -> None:
    # The tour's overlay: a 15-unit simulated step beside a measured one of a few milliseconds.
    sim = simulate(one_f_one_b(2, 4)).timeline
    measured = _measured(sim, scale=2.5e-3 / sim.makespan)
    mixed = plot_timelines([Panel(timeline=sim), Panel(timeline=measured)])
    assert all(reach > 0.9 for reach in _bars_fill(mixed)), _bars_fill(mixed)
    # One origin shares the axis: the slower run fills it, the faster one does not.
    slow = _measured(sim, scale=2.0)
    same = _bars_fill(plot_timelines([Panel(timeline=measured), Panel(timeline=slow)]))
    assert same[0] < 0.01 and same[1] > 0.9
    assert all(r > 0.9 for r in _bars_fill(plot_timelines([Panel(timeline=sim)] * 2, share_time=False)))


def test_plot_rejects_nothing_and_unknown_formats(tmp_path: Path) -> None:
    with pytest.raises(PipedslError, match="nothing to plot"):
        plot_timelines([])
    figure = plot_timelines([Panel(timeline=simulate(gpipe(2, 2)).timeline)])
    with pytest.raises(PipedslError, match="end the name in .png, .svg, .pdf"):
        save_figure(figure, tmp_path / "timeline.gif")


# --- the command line ----------------------------------------------------------------------


def _lib(name: str) -> str:
    return str(LIB / f"{name}.sched")


def test_cli_simulate_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", _lib("1f1b"), "-p", "pp=4", "-p", "microbatches=8", "--comm", "0.5"])
    out = capsys.readouterr().out
    assert code == 0
    assert "1f1b(pp=4, microbatches=8)" in out
    assert "comm=0.5s" in out
    expected = simulate(load(_lib("1f1b"), pp=4, microbatches=8), CostModel(latency=0.5))
    assert f"makespan {expected.makespan:.6g} s" in out
    assert f"bubble {expected.bubble_ratio:.2%}" in out


def test_cli_simulate_json_one_and_many(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", _lib("zb_h1"), "--f", "1", "--i", "1", "--w", "1", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["schedule"] == "zb_h1" and one["makespan"] == 27.0  # 3·8 + (4-1)
    assert main(["simulate", _lib("1f1b"), _lib("zb_h1"), _lib("gpipe"), "--json", "--f", "1", "--b", "3"]) == 0
    many = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in many] == ["zb_h1", "1f1b", "gpipe"]  # by makespan, then file name
    assert [r["makespan"] for r in many] == sorted(r["makespan"] for r in many)


def test_cli_simulate_ranks_several_files(capsys: pytest.CaptureFixture[str]) -> None:
    files = [_lib(n) for n in ("gpipe", "interleaved_1f1b", "zbv")]
    assert main(["simulate", *files, "-p", "pp=4", "-p", "microbatches=8"]) == 0
    out = capsys.readouterr().out
    assert "ranked by makespan" in out
    assert "--per-device" in out  # different stages per device, per-stage costs: a note
    assert main(["simulate", *files, "-p", "pp=4", "-p", "microbatches=8", "--per-device"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [row[1] for row in rows] == ["zbv", "interleaved_1f1b", "gpipe"]
    assert "11 (5.5)" in out


def test_cli_costs_file_and_per_stage_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    costs = tmp_path / "costs.toml"
    costs.write_text("forward = 2.0\nlatency = 0.25\nresidual_bytes = 1048576\n")
    assert main(["simulate", _lib("gpipe"), "-p", "pp=2", "-p", "microbatches=2", "--costs", str(costs), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["costs"]["forward"] == 2.0 and data["costs"]["latency"] == 0.25
    assert data["peak_activation_bytes"] == 2 * 1048576
    args = ["simulate", _lib("gpipe"), "-p", "pp=2", "-p", "microbatches=2", "--costs", str(costs), "--f", "1,3"]
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["costs"]["forward"] == [1.0, 3.0]
    assert main(args) == 0
    assert "2 MiB" in capsys.readouterr().out


def test_cli_errors_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "deadlock.csv"
    bad.write_text("0B0,0F0\n1F0,1B0\n")
    assert main(["simulate", str(bad)]) == 1
    assert "deadlock.csv" in capsys.readouterr().err
    assert main(["simulate", _lib("1f1b"), "--f", "-1"]) == 2
    assert "forward must be a finite number >= 0, got -1.0" in capsys.readouterr().err
    assert main(["simulate", _lib("1f1b"), "--f", "fast"]) == 2
    assert "expected seconds" in capsys.readouterr().err
    assert main(["simulate", _lib("1f1b"), "--costs", str(tmp_path / "none.toml")]) == 2
    assert "cannot read cost file" in capsys.readouterr().err
    # One bad file among good ones: the good ones still print, the exit code is the worst.
    assert main(["simulate", _lib("gpipe"), str(bad), _lib("1f1b")]) == 1
    captured = capsys.readouterr()
    assert "ranked by makespan" in captured.out and "deadlock.csv" in captured.err


def test_cli_plot_schedules_beside_a_measured_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    measured = tmp_path / "measured.json"
    _measured(simulate(load(_lib("1f1b"), pp=2, microbatches=4)).timeline).save(measured)
    out = tmp_path / "cmp.svg"
    args = ["plot", _lib("1f1b"), str(measured), "-p", "pp=2", "-p", "microbatches=4", "--critical", "-o", str(out)]
    assert main(args) == 0
    assert "2 panels" in capsys.readouterr().out
    text = out.read_text()
    assert "[measured]" in text and "critical path" in text
    assert main(["plot", _lib("1f1b"), "-o", str(tmp_path / "x.bmp")]) == 2
    assert "end the name in" in capsys.readouterr().err


def test_cli_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace.json"
    assert main(["trace", _lib("zbv"), "-p", "pp=2", "-p", "microbatches=3", "--comm", "0.1", "-o", str(out)]) == 0
    assert "ui.perfetto.dev" in capsys.readouterr().out
    trace = json.loads(out.read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    # A saved timeline traces as well.
    saved = tmp_path / "timeline.json"
    simulate(gpipe(2, 2)).timeline.save(saved)
    assert main(["trace", str(saved), "-o", str(tmp_path / "t2.json")]) == 0


def test_schedules_with_one_device_and_one_stage() -> None:
    single = Schedule(
        name="one",
        num_stages=1,
        num_devices=1,
        num_microbatches=2,
        placement=(0,),
        orders=((Action(Kind.F, 0, 0), Action(Kind.F, 0, 1), Action(Kind.B, 0, 0), Action(Kind.B, 0, 1)),),
    )
    sim = simulate(single, CostModel(latency=5))
    assert sim.makespan == 6.0 and sim.bubble_ratio == 0.0
    assert len(sim.timeline) == 4


def test_simulator_imports_neither_jax_nor_ray_nor_the_executor() -> None:
    # The import rule of docs/design.md: the simulator sees the core only, and plots pull in
    # matplotlib only when drawn.
    code = (
        "import sys, pkgutil, importlib, pipedsl.simulator; "
        "[importlib.import_module(m.name) for m in pkgutil.iter_modules(pipedsl.simulator.__path__, 'pipedsl.simulator.')]; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'ray', 'matplotlib') "
        "or m.startswith('pipedsl.executor')); print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_compute_has_no_peer_and_old_files_still_load(tmp_path: Path) -> None:
    timeline = simulate(one_f_one_b(2, 2), CostModel(latency=0.5)).timeline
    data = timeline.to_json()
    peers = data["columns"]["peer"]
    kinds = data["columns"]["kind"]
    assert all((p is None) == (k != "send") for p, k in zip(peers, kinds, strict=True))
    assert timeline.peers() == peers
    assert [e.peer for e in timeline.events()] == peers
    # Files written before computes had a null peer used -1.
    data["columns"]["peer"] = [-1 if p is None else p for p in peers]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    loaded = Timeline.load(path)
    assert loaded.peers() == peers
    assert loaded.to_json() == timeline.to_json()


def test_a_program_given_by_instructions_simulates_as_its_lowering() -> None:
    for schedule in (one_f_one_b(3, 5), interleaved(2, 2, 4), v_shape(3, 4, split=True)):
        lowered = lower(schedule)
        by_hand = Program(schedule, lowered.devices)
        costs = CostModel(latency=0.25, overlap_sends=False)
        assert simulate(by_hand, costs).to_json() == simulate(lowered, costs).to_json()
        assert by_hand.num_instructions == lowered.num_instructions


def test_a_program_the_simulator_cannot_read_is_reported() -> None:
    schedule = one_f_one_b(2, 1)
    program = lower(schedule)
    first = program.devices[1].instructions[0]
    doubled = DeviceProgram(1, (1,), (first, *program.devices[1].instructions))
    with pytest.raises(PipedslError, match="a second receive before one compute"):
        simulate(Program(schedule, (program.devices[0], doubled)))
