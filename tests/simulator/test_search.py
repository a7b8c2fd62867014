"""The plan search: what it keeps, what it drops, how it ranks, and its command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from processes import Lines, alive, wait_gone

from pipedsl import library
from pipedsl.cli import plan as plan_cli
from pipedsl.cli.planned import PlannedRun, read_plan
from pipedsl.errors import PipedslError, ScheduleInvalid
from pipedsl.library import library_path
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.estimate import estimate
from pipedsl.simulator.hardware import Model, load_cluster, load_model
from pipedsl.simulator.pipelines import Pipelines, ScheduleKey
from pipedsl.simulator.plan import Plan, PlanError
from pipedsl.simulator.ranked import describe
from pipedsl.simulator.search import BOUNDED_COLUMNS, COLUMNS, candidate_plans, search, search_plans, summarize
from pipedsl.simulator.search_work import MAX_PAIRS, MAX_PAIRS_PER_SCHEDULE, SearchWork, stages_per_device
from pipedsl.synthesize import synthesize

MODEL = Model(name="gpt-small", layers=8, hidden=1024, ffn_hidden=4096, heads=16, seq_len=1024, vocab=32000)
# A100 nodes with 4 GiB per GPU: tight enough that some plans do not fit.
CLUSTER = dataclasses.replace(load_cluster("a100-80gb"), memory_bytes=5 * 2**30, reserved_bytes=2**30)
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zbv")


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    return search(MODEL, CLUSTER, 16, global_batch=64, schedules=SCHEDULES, prune=None)


def test_columns_and_ranking(frame: pd.DataFrame) -> None:
    assert tuple(frame.columns) == COLUMNS
    assert list(frame["rank"]) == list(range(1, len(frame) + 1))
    assert frame["step_time_s"].is_monotonic_increasing
    assert set(frame["kind"]) == {"spmd", "pipeline"}
    assert set(frame["schedule"]) <= {"spmd", *SCHEDULES}


def test_drops_plans_that_do_not_fit(frame: pd.DataFrame) -> None:
    dropped = frame.attrs["dropped"]
    assert dropped["does not fit in memory"] > 0
    assert (frame["memory_bytes_per_gpu"] <= CLUSTER.usable_bytes).all()
    assert dropped["rejected by 1f1b's require (line 12): 1F1B needs at least as many microbatches as stages"] > 0
    assert frame.attrs["considered"] == len(frame) + sum(dropped.values())


def test_rows_agree_with_single_estimates(frame: pd.DataFrame) -> None:
    for row in frame.head(3).itertuples():
        plan = Plan(
            dp=row.dp,
            fsdp=row.fsdp,
            tp=row.tp,
            pp=row.pp,
            vpp=row.vpp,
            microbatch_size=row.microbatch_size,
            global_batch=64,
            zero=row.zero,
            reduce_once=row.reduce_once,
            reshard_after_forward=row.reshard_after_forward,
            recompute=row.recompute,
            schedule=None if row.kind == "spmd" else row.schedule,
        )
        assert estimate(MODEL, CLUSTER, plan).step_time_s == pytest.approx(row.step_time_s, rel=1e-12)


def test_pruning_keeps_the_top_exact(frame: pd.DataFrame) -> None:
    pruned = search(MODEL, CLUSTER, 16, global_batch=64, schedules=SCHEDULES, prune=1.2)
    assert len(pruned) < len(frame)
    best = frame["step_time_s"].iloc[0]
    within = frame[frame["step_time_s"] <= 1.2 * best]
    assert list(pruned["step_time_s"].head(len(within))) == pytest.approx(list(within["step_time_s"]))
    # Pruning is per schedule: every schedule's best plan survives it.
    best_of = frame.groupby("schedule")["step_time_s"].min()
    assert pruned.groupby("schedule")["step_time_s"].min().to_dict() == pytest.approx(best_of.to_dict())


@pytest.mark.parametrize("keep", [1, 3, 8])
@pytest.mark.parametrize("jobs", [1, 2])
def test_a_shortlist_is_the_full_rankings_best_and_each_schedules_best(keep: int, jobs: int) -> None:
    # The policy schedules too: their in-flight limits are ranked as plans of their own,
    # and they are ranked last, bounded by what the others found.
    schedules = (*SCHEDULES, "zb_auto", "zbv_auto")
    full = search(MODEL, CLUSTER, 16, global_batch=64, schedules=schedules, jobs=1)
    listed = search(MODEL, CLUSTER, 16, global_batch=64, schedules=schedules, shortlist=keep, jobs=jobs)
    key = ["schedule", "dp", "tp", "pp", "vpp", "microbatch_size", "zero", "recompute", "inflight_limit", "step_time_s"]
    # Rows that tie keep the full ranking's order.
    best = full[key].head(keep)
    each = full[key].drop_duplicates("schedule")
    wanted = full[key][full.index.isin(best.index.union(each.index))]
    assert listed[key].values.tolist() == wanted.values.tolist()
    assert listed.attrs["simulations"] < full.attrs["simulations"]
    # Every plan is ranked or counted off, whichever schedules came in first: plans whose
    # bound from the work alone is past the list are not even costed.
    dropped = dict(listed.attrs["dropped"])
    assert dropped.pop(f"not among the best {keep} nor its schedule's best") > 0
    assert len(listed) + sum(listed.attrs["dropped"].values()) == len(full) + sum(full.attrs["dropped"].values())
    for reason, count in dropped.items():
        assert reason.startswith("not costed") or count <= full.attrs["dropped"][reason]


def test_a_shortlist_bounds_the_same_plans_in_any_number_of_processes() -> None:
    # Each schedule is bounded by the SPMD plans, ranked first: not by whichever schedule
    # a worker happened to finish before, so the CSV's bounded rows are the same too.
    schedules = (*SCHEDULES, "zb_auto")
    one = search(MODEL, CLUSTER, 16, global_batch=64, schedules=schedules, shortlist=3, jobs=1)
    two = search(MODEL, CLUSTER, 16, global_batch=64, schedules=schedules, shortlist=3, jobs=2)
    assert two.attrs["processes"] == 2
    assert two.to_dict("records") == one.to_dict("records")
    assert two.attrs["dropped"] == one.attrs["dropped"]
    assert len(one.attrs["bounded"]) > 0
    assert two.attrs["bounded"].equals(one.attrs["bounded"])


def test_top_ranks_no_more_than_the_top_needs() -> None:
    full = search(MODEL, CLUSTER, 16, global_batch=64, schedules=SCHEDULES)
    top = search(MODEL, CLUSTER, 16, global_batch=64, schedules=SCHEDULES, top=5)
    assert top.drop(columns="rank").values.tolist() == full.drop(columns="rank").head(5).values.tolist()
    assert top.attrs["simulations"] < full.attrs["simulations"]
    plans = search_plans(MODEL, CLUSTER, 16, global_batch=64, schedules=SCHEDULES, top=5)
    assert [p.step_time_s for p in plans] == list(top["step_time_s"])


@pytest.mark.parametrize("name, value", [("shortlist", 0), ("top", -1), ("shortlist", 2.5), ("top", True)])
def test_top_and_shortlist_must_be_whole_numbers(name: str, value: object) -> None:
    with pytest.raises(PlanError, match=f"search: {name} must be a whole number >= 1"):
        search(MODEL, CLUSTER, 16, global_batch=64, schedules=["1f1b"], **{name: value})


def test_enumeration_respects_the_model() -> None:
    plans = list(candidate_plans(MODEL, CLUSTER, 16, global_batch=64, schedules=["interleaved_1f1b"]))
    assert all(p.gpus == 16 for p in plans)
    assert all(MODEL.layers % (p.pp * p.vpp) == 0 for p in plans)
    assert all(MODEL.heads % p.tp == 0 and p.tp <= 8 for p in plans)
    assert {p.zero for p in plans if p.pp == 1} == {0, 1, 2, 3}
    # FlashAttention makes selective recomputation the same plan as none; SPMD plans, which
    # cost no simulation, also try the named remat policies.
    assert {p.recompute.value for p in plans if p.pp > 1} == {"none", "full"}
    assert {p.recompute.value for p in plans if p.pp == 1} == {"none", "full", "save_dots", "save_qkv_proj"}
    # ZeRO sharded in the GPU nodes' groups, the nodes replicas of one another (HSDP).
    assert {p.fsdp for p in plans if p.pp == 1 and p.tp == 1 and p.zero >= 1} == {None, 8}


def test_extra_schedule_files(tmp_path: Path) -> None:
    mine = tmp_path / "mine.sched"
    shutil.copy(library_path("1f1b"), mine)  # it says `schedule one_f_one_b`
    result = search(MODEL, CLUSTER, 16, global_batch=64, schedules=["gpipe"], extra_schedules=[mine])
    assert "one_f_one_b" in set(result["schedule"])
    with pytest.raises(PlanError, match="sets pp and microbatches"):
        search(MODEL, CLUSTER, 16, global_batch=64, schedules=["table_example"])


def test_summary_states_the_speedup(frame: pd.DataFrame) -> None:
    summary = summarize(frame)
    spmd = frame[frame["kind"] == "spmd"]["step_time_s"].min()
    pipeline = frame[frame["kind"] == "pipeline"]["step_time_s"].min()
    assert summary.speedup == pytest.approx(spmd / pipeline)
    assert "the best SPMD plan" in summary.text()


# --- command line -------------------------------------------------------------------------


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pipedsl")
    plan_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.handler(args)


def test_worker_processes_rank_the_same(frame: pd.DataFrame, tmp_path: Path) -> None:
    """Schedules ranked in two worker processes give the ranking, drops and simulations
    of one process, and progress reaches every plan in both phases."""
    reported: dict[str, tuple[int, int]] = {}

    def progress(phase: str, done: int, total: int) -> None:
        reported[phase] = (done, total)

    parallel = search(MODEL, CLUSTER, 16, global_batch=64, schedules=SCHEDULES, prune=None, jobs=2, progress=progress)
    assert frame.attrs["processes"] == 1 and parallel.attrs["processes"] == 2
    assert parallel.to_dict("records") == frame.to_dict("records")
    for name in ("considered", "dropped", "simulations"):
        assert parallel.attrs[name] == frame.attrs[name]
    considered = frame.attrs["considered"]
    assert reported == {"costing": (considered, considered), "simulating": (considered, considered)}
    # A schedule file given by a path relative to the working folder reaches the workers.
    shutil.copy(library_path("zb_h1"), tmp_path / "mine.sched")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        alone = search(MODEL, CLUSTER, 16, global_batch=64, schedules=("1f1b",), extra_schedules=["mine.sched"])
        both = search(MODEL, CLUSTER, 16, global_batch=64, schedules=("1f1b",), extra_schedules=["mine.sched"], jobs=2)
    # The file says `schedule zb_h1`, a library schedule's name: the file's name tells them apart.
    assert "zb_h1 (mine.sched)" in set(alone["schedule"])
    assert both.to_dict("records") == alone.to_dict("records")


# `pipedsl search` with each worker process paused the moment it starts, before its
# interpreter has even imported pipedsl, and its pid printed: the search is then waiting
# on its worker in the middle of the ranking (its own thread ranks the rest), however fast
# the machine.
# Each worker paused as it starts, however it starts (forked, or an interpreter).
_PAUSED_WORKERS = (
    "import os, signal, subprocess, sys\n"
    "from pipedsl.simulator import workers\n"
    "def pausing(start):\n"
    "    def paused(*args, **kwargs):\n"
    "        process = start(*args, **kwargs)\n"
    "        os.kill(process.pid, signal.SIGSTOP)\n"
    "        print('worker', process.pid, file=sys.stderr, flush=True)\n"
    "        return process\n"
    "    return paused\n"
    "subprocess.Popen = pausing(subprocess.Popen)\n"
    "workers._Forked.start = staticmethod(pausing(workers._Forked.start))\n"
    "from pipedsl.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)

_SEARCH = ["search", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--gpus", "1024", "--global-batch", "1536",
           "--jobs", "2"]  # fmt: skip


def _stopped_by(signum: int, *, group: bool) -> tuple[int, str, list[int]]:
    """A search in two processes (its own thread and a worker) stopped by ``signum`` while
    its worker is paused (sent to its whole process group, as a terminal's Ctrl-C is, or to
    it alone, as ``kill`` sends TERM): its exit code, its standard error, and its worker's pid."""
    # In a session of its own, so that it has a process group of its own.
    run = subprocess.Popen(
        [sys.executable, "-c", _PAUSED_WORKERS, *_SEARCH], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines = Lines(run.stderr)  # type: ignore[arg-type]
    try:
        workers = [int(line.split()[1]) for line in lines.starting("worker ", 1)]
        assert len(workers) == 1, lines.read
        if group:
            os.killpg(run.pid, signum)
        else:
            os.kill(run.pid, signum)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    return run.returncode, lines.text(), workers


@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_stops_the_search_and_its_workers() -> None:
    code, err, workers = _stopped_by(signal.SIGINT, group=True)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == "pipedsl search: interrupted" and "Traceback" not in err, err
    assert not [pid for pid in workers if alive(pid)]


def test_term_stops_the_search_and_its_workers_with_one_line() -> None:
    code, err, workers = _stopped_by(signal.SIGTERM, group=False)
    assert code == 143, err
    assert err.strip().splitlines()[-1] == "pipedsl search: terminated" and "Traceback" not in err, err
    assert not [pid for pid in workers if alive(pid)]


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))


# The search runs in a child process (fork then exec, which is safe): JAX, imported by the
# test worker for another file, warns of any fork.
@pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")
def test_a_search_past_the_bound_is_refused_at_once_and_small() -> None:
    # GPT-3 on 1,024 GPUs at a batch of a million sequences: schedules of 547 M (stage,
    # microbatch) pairs, which once took minutes and 16 GB.
    command = [sys.executable, "-m", "pipedsl", "search", "--model", "gpt3-175b", "--cluster", "a100-80gb",
               "--gpus", "1024", "--global-batch", "1000000", "--top", "3"]  # fmt: skip
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_limit_memory)
    try:
        assert wait_gone([run.pid], timeout_s=10) == [], "the search still runs after 10 s"
        # This child's own peak (kibibytes on Linux), not that of every child the test's
        # process has waited for, which another test's may set.
        _, status, usage = os.wait4(run.pid, 0)
        run.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if run.returncode is None:
            run.kill()
            run.wait()
    assert run.stdout is not None and run.stderr is not None
    err = run.stderr.read()
    run.stdout.close()
    run.stderr.close()
    assert run.returncode == 2, err
    assert "547,125,000 (stage, microbatch) pairs" in err and "a smaller global" in err, err
    assert "Traceback" not in err
    assert usage.ru_maxrss < 2 * 2**20


def test_the_bound_counts_pairs_before_any_work() -> None:
    plans = list(candidate_plans(load_model("gpt3-175b"), load_cluster("a100-80gb"), 1024, global_batch=1536))
    work = SearchWork.of(plans)
    # Each distinct shape once: pp × stages per device × microbatches.
    shapes = {
        (p.schedule, p.pp, p.vpp, p.microbatches): p.pp * max(p.vpp, stages_per_device(p.schedule)) * p.microbatches
        for p in plans
        if p.schedule is not None
    }
    assert work.total == sum(shapes.values()) < MAX_PAIRS
    work.check(what="GPT-3 at its own batch")
    with pytest.raises(PlanError, match=r"interleaved_1f1b's plans alone 8,388,609\); a search evaluates at most"):
        SearchWork(Counter({"interleaved_1f1b": MAX_PAIRS_PER_SCHEDULE + 1})).check(what="these plans")


def test_a_large_search_uses_a_process_per_core_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # The module, not the function of the same name that pipedsl.simulator exports.
    search_module = importlib.import_module("pipedsl.simulator.search")
    monkeypatch.setattr(search_module, "available_cores", lambda: 4)
    spmd = [Plan(dp=8, tp=1, pp=1, microbatch_size=1, global_batch=8)]
    pipeline = Plan(dp=2, tp=1, pp=4, microbatch_size=1, global_batch=8, schedule="1f1b")
    small = [spmd, [pipeline] * (search_module.PARALLEL_FROM - 1)]
    large = [spmd, [pipeline] * (search_module.PARALLEL_FROM // 2), [pipeline] * (search_module.PARALLEL_FROM // 2)]
    assert search_module._processes(None, small) == 1
    # No more processes than parts, however many cores.
    assert search_module._processes(None, large) == 3
    assert search_module._processes(2, large) == 2
    assert search_module._processes(8, small) == 2


def test_policy_schedules_go_out_by_the_actions_they_synthesise(tmp_path: Path) -> None:
    # The search module, not the function of the same name that pipedsl.simulator exports.
    search_module = importlib.import_module("pipedsl.simulator.search")

    def size(schedule: str) -> int:
        # 8 and 16 microbatches of one sequence per data-parallel rank.
        plans = [Plan(dp=2, tp=1, pp=4, microbatch_size=1, global_batch=2 * m, schedule=schedule) for m in (8, 16)]
        return search_module._synthesis_size(plans)

    # zbv_auto holds two stages per device, zb_auto one: twice the actions for the same plans.
    assert size("zbv_auto") == 2 * size("zb_auto") == 2 * (4 * 8 + 4 * 16)
    # A policy whose defaults its own `require` refuses counts one stage per device.
    refused = tmp_path / "refused.sched"
    spec = library.resolve("zbv_auto").read_text().replace("pp >= 1,", "pp >= 5,")
    refused.write_text(spec)
    assert size(str(refused)) == size("zb_auto")


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_jobs_must_be_a_whole_number(jobs: object) -> None:
    with pytest.raises(PlanError, match="jobs must be a whole number"):
        search(MODEL, CLUSTER, 16, global_batch=64, schedules=SCHEDULES, jobs=jobs)  # type: ignore[arg-type]


def test_cli_estimate_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--dp", "16", "--tp", "8", "--pp", "8",
            "--vpp", "3", "--global-batch", "1536", "--recompute", "selective", "--zero", "1",
            "--schedule", "interleaved_1f1b", "--json"]  # fmt: skip
    assert _run(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True
    assert 0.3 < data["mfu"] < 0.7
    assert data["memory_bytes_per_gpu"] < 80 * 2**30


def test_cli_search_writes_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plans.csv"
    argv = ["search", "--model", "demo-small", "--cluster", "a100-80gb", "--gpus", "8", "--global-batch", "64",
            "--schedules", "1f1b,zbv", "--top", "5", "--csv", str(out), "--jobs", "2"]  # fmt: skip
    assert _run(argv) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long sentences
    assert "best 5 plans" in printed and "SPMD plan" in printed and "(2 processes)" in printed
    written = pd.read_csv(out)
    assert tuple(written.columns) == (*COLUMNS, "step_time_bound_s")
    ranked = written[written["rank"].notna()]
    bounded = written[written["rank"].isna()]
    assert len(ranked) > 5 and len(bounded) > 0
    assert bounded["step_time_s"].isna().all() and (bounded["step_time_bound_s"] > 0).all()
    # Each bounded row's bound is at most its step time, as the whole ranking (--no-prune) prices it.
    assert _run([*argv, "--no-prune", "--csv", str(tmp_path / "all.csv")]) == 0
    full = pd.read_csv(tmp_path / "all.csv")
    assert full["rank"].notna().all()
    key = [c for c in BOUNDED_COLUMNS if c not in ("memory_bytes_per_gpu", "step_time_bound_s")]
    both = bounded.fillna({"source": ""}).merge(full.fillna({"source": ""}), on=key, suffixes=("", "_full"))
    assert (both["step_time_bound_s"] <= both["step_time_s_full"] * (1 + 1e-9)).all()
    # A costed row (its memory known) fits, so the whole ranking has it; an uncosted one may not fit.
    assert len(both) >= bounded["memory_bytes_per_gpu"].notna().sum() > 0


@pytest.mark.parametrize(("schedules", "uncosted"), [("1f1b,zbv", True), ("zbv_auto", False)])
def test_cli_search_csv_is_the_search_table_as_pandas_writes_it(tmp_path: Path, schedules: str, uncosted: bool) -> None:
    # The command writes its CSV without pandas; a table of the same rows writes the same
    # text, the memory of a plan left uncosted (none) making that column's figures fractions.
    out = tmp_path / "plans.csv"
    argv = ["search", "--model", "demo-small", "--cluster", "a100-80gb", "--gpus", "8", "--global-batch", "64",
            "--schedules", schedules, "--top", "3", "--csv", str(out), "--jobs", "1"]  # fmt: skip
    assert _run(argv) == 0
    frame = search("demo-small", "a100-80gb", 8, global_batch=64, schedules=schedules.split(","), shortlist=3, jobs=1)
    bounded = frame.attrs["bounded"].assign(model=frame.attrs["model"])
    assert bounded["memory_bytes_per_gpu"].isna().any() == uncosted and bounded["memory_bytes_per_gpu"].notna().any()
    ranked = frame.assign(step_time_bound_s=frame["step_time_s"])
    ranked.attrs = {}  # a table is written, not the search's record
    ranked = ranked.astype({"rank": "Int64", "inflight_limit": "Int64"})
    table = pd.concat([ranked, bounded], ignore_index=True)[ranked.columns]
    assert out.read_text() == table.to_csv(index=False)


def test_cli_search_names_and_runs_a_context_parallel_best_plan(capsys: pytest.CaptureFixture[str]) -> None:
    # Only context-parallel plans: the best plan's degree is in each table and in the
    # command that runs it (`pipedsl run --cp`).
    # Llama 3 405B's 126 layers split over pp 16 only with the embedding and the head on
    # stages of their own: the search tries that split unasked and says so.
    argv = ["search", "--model", "llama-405b", "--cluster", "h100-80gb", "--gpus", "16384", "--global-batch", "2048",
            "--schedules", "1f1b", "--cp", "2", "--top", "3", "--jobs", "1"]  # fmt: skip
    assert _run(argv) == 0
    printed = capsys.readouterr().out
    assert any(line.split()[:4] == ["1f1b", "dp64", "tp8", "cp2"] for line in printed.splitlines())
    assert "pipedsl run 1f1b " in printed and " --cp 2 " in printed
    assert "does not divide the 126 layers, the first and the last stage hold only" in " ".join(printed.split())
    assert _run([*argv, "--stage-layers", "even"]) == 0  # SPMD plans only: none of 1F1B splits them evenly
    assert "no feasible plan for schedule(s): 1f1b" in " ".join(capsys.readouterr().out.split())


def test_a_policy_row_runs_the_order_the_search_priced(tmp_path: Path) -> None:
    # zbv_auto is synthesised against each plan's own costs; on this search most of its
    # orders differ from the default cost model's. The row carries those costs, through the
    # CSV too, so that `pipedsl run --plan` runs the order that was priced.
    frame = search("demo-small", "a100-80gb", 8, global_batch=64, schedules=["zbv_auto"], jobs=1)
    frame.to_csv(tmp_path / "plans.csv", index=False)
    rows = frame[frame["schedule"] == "zbv_auto"].to_dict("records")
    differing = 0
    for row in rows:
        priced = CostModel.from_mapping(json.loads(row["synthesis_costs"]))
        assert json.dumps(priced.to_json()) == row["synthesis_costs"]  # read back exactly
        planned = read_plan(tmp_path / "plans.csv", int(row["rank"]))
        policy = library.load(planned.schedule, **planned.params())
        assert planned.schedule_of().orders == synthesize(policy, priced).orders
        differing += synthesize(policy, CostModel()).orders != synthesize(policy, priced).orders
    assert differing >= len(rows) // 2
    broken = dict(rows[0], synthesis_costs="{not json")
    with pytest.raises(PipedslError, match="synthesis_costs is not JSON"):
        PlannedRun.from_row(broken)


def test_search_tables_name_a_users_schedule_by_its_schedule_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # As simulate names it: `schedule my_1f1b` in my1f1b.sched is my_1f1b in the tables,
    # the plan labels and the reasons a plan was dropped, never the file's name.
    text = library_path("1f1b").read_text().replace("schedule one_f_one_b(", "schedule my_1f1b(")
    mine = tmp_path / "my1f1b.sched"
    mine.write_text(text.replace("  stages pp", '  require microbatches >= 2 * pp, "wants 2pp"\n  stages pp'))
    argv = ["search", "--model", "demo-small", "--cluster", "a100-80gb", "--gpus", "8", "--global-batch", "64",
            "--schedules", "gpipe", "--top", "200", "--jobs", "1", str(mine)]  # fmt: skip
    assert _run(argv) == 0
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines()]
    assert any(row[1:2] == ["my_1f1b"] for row in rows)  # a row of the best plans
    assert any(row[:1] == ["my_1f1b"] for row in rows)  # its best plan
    assert "rejected by my_1f1b's require (line 13): wants 2pp" in printed
    assert "my1f1b" not in printed
    frame = search("demo-small", "a100-80gb", 8, global_batch=64, schedules=["gpipe"], extra_schedules=[mine])
    assert set(frame["schedule"]) == {"spmd", "gpipe", "my_1f1b"}
    # What `pipedsl run --plan` loads is the file the plan was priced with, not its table name.
    row = frame[frame["schedule"] == "my_1f1b"].iloc[0].to_dict()
    assert row["source"] == str(mine)
    assert PlannedRun.from_row(row).schedule_of().name == "my_1f1b"


# The best 20 plans of this search: (schedule, dp, shard group, tp, pp, vpp, microbatch size,
# zero, reduce once, reshard after forward, recompute, step time in seconds). First recorded from the object-per-action
# implementation before the search moved to int-coded arrays; recorded again from the
# array search when the cost model changed (collectives by adapter, size-dependent
# matrix efficiency; FlashAttention priced as one kernel whose scores stay on chip),
# which moves the step times and so the ranking; and when FlashAttention's backward was
# priced as its five products, when the A100 presets priced stragglers, and when an fp32
# model's activations, weights and optimizer state were priced in fp32, as the executor keeps them,
# and when the demo model lost the dropout the executor's transformer does not have; and
# when the search tried ZeRO 3 keeping its gathered weights (its rows join the ranking; the
# others keep their order and prices); and when the search tried SPMD plans sharded in shard
# groups of a node and the named remat policies, the fused attention computed its causal half,
# and data-parallel traffic was overlapped layer by layer, its last layer's exposed; and when the
# slowest of the nodes was priced by the expected maximum of normal draws (the same order).
RECORDED_TOP = Path(__file__).parent / "data" / "search_demo_small_top20.json"


def test_ranking_matches_the_recorded_one() -> None:
    # The order schedules the ranking was recorded with (policy schedules came later).
    orders = ["gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "dualpipev"]
    ranked = search_plans("demo-small", "a100-80gb", 16, global_batch=64, top=20, schedules=orders)
    found = [
        [
            p.schedule, p.dp, p.fsdp, p.tp, p.pp, p.vpp, p.microbatch_size, p.zero, p.reduce_once,
            p.reshard_after_forward, p.recompute, p.step_time_s,
        ]
        for p in ranked
    ]  # fmt: skip
    assert found == json.loads(RECORDED_TOP.read_text())


def test_search_plans_are_the_rows_of_the_search(frame: pd.DataFrame) -> None:
    ranked = search_plans(MODEL, CLUSTER, 16, global_batch=64, schedules=SCHEDULES, prune=None)
    assert [p.row() for p in ranked] == frame.to_dict("records")
    assert all(dataclasses.is_dataclass(p) and p.plan.dp == p.dp for p in ranked)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ranked[0].rank = 2  # type: ignore[misc]


_BROKEN = """\
schedule broken(pp = 2, microbatches = 2) {
  stages pp
  devices pp
  microbatches microbatches
  place s -> s
  on device d {
    for m in 0 .. microbatches {
      if d == 1 { B(m) }
      F(m)
      if d == 0 { B(m) }
    }
  }
}
"""


def test_a_search_shape_that_breaks_a_rule_names_its_place_in_the_file(tmp_path: Path) -> None:
    """The search reads a shape's order as int columns; a broken rule is reported from
    the objects, with the action's line."""
    path = tmp_path / "broken.sched"
    path.write_text(_BROKEN)
    pipelines = Pipelines(keep_simulations=False)
    key = ScheduleKey(str(path), 2, 0, 2)
    with pytest.raises(ScheduleInvalid) as caught:
        pipelines.layout(key)
    assert caught.value.pos is not None and caught.value.pos.file == str(path) and caught.value.pos.line == 8
    # The error is kept: asking again raises the same one.
    with pytest.raises(ScheduleInvalid) as again:
        pipelines.layout(key)
    assert again.value is caught.value


def test_the_search_tries_every_sharding_mode_and_prices_each_as_estimate_does() -> None:
    frame = search("demo-small", "a100-80gb", 8, global_batch=64, schedules=["1f1b"], prune=None)
    spmd = frame[(frame.kind == "spmd") & (frame.tp == 1) & (frame.microbatch_size == 1)]
    modes = {(z, o, r) for z, o, r in zip(spmd.zero, spmd.reduce_once, spmd.reshard_after_forward, strict=True)}
    # Several microbatches: ZeRO 2 and 3 reduced every microbatch or once per step, 3 also
    # keeping the weights it gathered for the backward; 0 and 1 reduce once already.
    assert modes == {
        (0, False, True), (1, False, True), (2, False, True), (2, True, True),
        (3, False, True), (3, True, True), (3, False, False), (3, True, False),
    }  # fmt: skip
    pipelines = frame[frame.kind == "pipeline"]
    assert not pipelines.reduce_once.any() and pipelines.reshard_after_forward.all()
    # A row's price is the estimate of its plan, mode included; the mode is in its words.
    for _, row in spmd[spmd.zero == 3].iterrows():
        plan = Plan(
            dp=8, microbatch_size=1, global_batch=64, zero=3, reduce_once=bool(row.reduce_once),
            reshard_after_forward=bool(row.reshard_after_forward), recompute=row.recompute,
        )  # fmt: skip
        priced = estimate(load_model("demo-small"), load_cluster("a100-80gb"), plan)
        assert row.step_time_s == pytest.approx(priced.step_time_s)
    once = spmd[(spmd.zero == 2) & spmd.reduce_once].iloc[0].to_dict()
    assert "zero=2 once " in describe(once) and PlannedRun.from_row(once).reduce_once


def test_the_best_plans_command_says_what_it_is_and_whether_it_runs_here(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipedsl.cli import main

    # A machine of 4 cores, whatever this one has.
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    search = ["search", "--cluster", "h100-80gb", "--top", "1", "--jobs", "1"]
    assert main([*search, "--model", "llama-8b", "--gpus", "1024", "--global-batch", "1024"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # wrapped at the output's width
    assert (
        "the best plan, SPMD (pp = 1: data and tensor parallel, no pipeline), needs 1,024 devices, more than this"
        " machine's 4 CPU cores: run it on a cluster of that size" in out
    )
    assert "pipedsl run --spmd -p microbatches=" in out
    assert main([*search, "--model", "demo-small", "--gpus", "2", "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "runs here on 2 devices with the built-in transformer:\n  pipedsl run " in out
