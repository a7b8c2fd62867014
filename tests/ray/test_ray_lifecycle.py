"""The Ray backend's lifecycle, each check in a fresh process of its own.

Every test runs pipedsl in a subprocess, as a user's script or the CLI would: addresses
where no cluster answers fail within ``start_timeout``; several pipelines live at once on
the local instance pipedsl starts, and each releases its processes when closed, when its
``with`` block ends, when it is collected, and when compiling times out; Ctrl-C during a
run (also during Ray's start-up) prints one line and leaves no Ray process of ours alive.
"Ours" is found by an environment variable that the subprocess and every process it (and
its Ray instance) starts inherit; no other process is looked at, let alone stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).parents[2]
MARK = "PIPEDSL_TEST_RAY_MARK"


def _env(mark: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({MARK: mark, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, **extra)
    return env


def _marked(mark: str) -> list[int]:
    """Pids of the processes that carry ``mark`` in their environment."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if f"{MARK}={mark}".encode() in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def _none_left(mark: str, within: float) -> list[int]:
    """Wait up to ``within`` seconds for every marked process to exit; the survivors."""
    deadline = time.monotonic() + within
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def _run_cli(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pipedsl", "run", "schedules/1f1b.sched", "-p", "pp=2", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT, check=False)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield server.getsockname()[1]


# -- addresses where no cluster answers ------------------------------------------------


@pytest.mark.parametrize("how", ["option", "environment"])
def test_unreachable_address_fails_at_once_with_our_message(how: str) -> None:
    mark = uuid.uuid4().hex
    args, env = ["--backend", "ray"], _env(mark)
    if how == "option":
        args += ["--address", "127.0.0.1:1"]
    else:
        env["RAY_ADDRESS"] = "127.0.0.1:1"
    start = time.monotonic()
    done = _run_cli(args, env, timeout=60)
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    assert "cannot connect to the Ray cluster at 127.0.0.1:1: nothing answers" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    # Imports take most of it; the default start_timeout is 30 s.
    assert elapsed < 30
    assert _none_left(mark, within=5) == []


def test_silent_address_fails_within_start_timeout_and_the_process_exits(silent_port: int) -> None:
    script = f"""
        import time
        from pipedsl.executor import ExecutionError
        from pipedsl.executor.ray.cluster import RayConfig, RayWorld
        start = time.monotonic()
        try:
            RayWorld.start(2, config=RayConfig(address="127.0.0.1:{silent_port}", start_timeout=3), label="silent")
        except ExecutionError as err:
            print(round(time.monotonic() - start, 1), err)
    """
    mark = uuid.uuid4().hex
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=_env(mark),
        timeout=90,
        check=False,
    )
    total = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    waited, message = done.stdout.split(" ", 1)
    assert 3 <= float(waited) < 6
    assert (
        f"cannot connect to the Ray cluster at 127.0.0.1:{silent_port}: no answer within 3 s (start_timeout)" in message
    )
    # Ray's connection attempt is abandoned: nothing keeps the process from exiting.
    assert total < 45
    assert _none_left(mark, within=5) == []


# -- several pipelines, and releasing their actors --------------------------------------

LIFECYCLE = """
    import gc, json, os, time
    import jax
    import jax.numpy as jnp
    from pipedsl.executor import ExecutionError, Pipeline, RayConfig
    from pipedsl.executor.ray.cluster import connect, disconnect
    from pipedsl.library import library_path, load

    DRIVER = os.getpid()

    def dense(p, x):
        return jnp.tanh(x @ p)

    def slow_to_trace(p, x):
        if os.getpid() != DRIVER:  # only in the processes, while they compile
            time.sleep(20)
        return dense(p, x)

    def mse(y, t):
        return jnp.mean((y - t) ** 2)

    def groups():
        # Per schedule, the states of the placement groups its pipelines made.
        from ray.util.placement_group import placement_group_table
        states = {{}}
        for info in placement_group_table().values():
            states.setdefault(info["name"].split()[1], set()).add(info["state"])
        return states

    def released(name, within=10.0):
        deadline = time.monotonic() + within
        while groups()[name] != {{"REMOVED"}} and time.monotonic() < deadline:
            time.sleep(0.1)
        return sorted(groups()[name])

    key = jax.random.PRNGKey(0)
    params = [jax.random.normal(k, (8, 8)) / 8**0.5 for k in jax.random.split(key, 2)]
    x = jax.random.normal(key, (8, 8))
    batch = (x, jnp.sin(x))
    schedules = {{n: load(library_path(n), pp=2, microbatches=4) for n in ("1f1b", "gpipe", "zb_h1")}}
    expected = float(Pipeline([dense, dense], loss=mse, schedule=schedules["gpipe"]).value_and_grad(params, batch)[0])
    names = {{n: repr(s.name) for n, s in schedules.items()}}  # as the placement groups name them
    out = {{"expected": expected, "names": list(names.values())}}
    connect()  # holds the local instance, to look at it between pipelines
    with Pipeline([dense, dense], loss=mse, schedule=schedules["1f1b"], backend="ray") as first:
        second = Pipeline([dense, dense], loss=mse, schedule=schedules["gpipe"], backend="ray")
        third = Pipeline([dense, dense], loss=mse, schedule=schedules["zb_h1"], backend="ray")
        out["losses"] = [float(p.value_and_grad(params, batch)[0]) for p in (first, second, third)]
        out["alive"] = {{name: sorted(states) for name, states in groups().items()}}
    out["after_with"] = released(names["1f1b"])
    del second
    gc.collect()
    out["after_gc"] = released(names["gpipe"])
    third.close()
    out["after_close"] = released(names["zb_h1"])
    slow = Pipeline([dense, slow_to_trace], loss=mse, schedule=schedules["gpipe"], backend=RayConfig(step_timeout={timeout}))
    start = time.monotonic()
    try:
        slow.value_and_grad(params, batch)
    except ExecutionError as err:
        out["timeout"] = [round(time.monotonic() - start, 1), str(err)]
    out["after_timeout"] = released(names["gpipe"])
    disconnect()
    print(json.dumps(out))
"""


def test_pipelines_share_the_local_instance_and_release_their_actors() -> None:
    mark = uuid.uuid4().hex
    timeout = 2
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LIFECYCLE.format(timeout=timeout))],
        capture_output=True,
        text=True,
        env=_env(mark),
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # Three pipelines alive at once, each with its own actors, all computing the same loss.
    assert out["losses"] == pytest.approx([out["expected"]] * 3, rel=1e-5)
    assert out["alive"] == {name: ["CREATED"] for name in out["names"]}
    assert out["after_with"] == out["after_gc"] == out["after_close"] == ["REMOVED"]
    waited, message = out["timeout"]
    assert waited < timeout + 5
    assert f"did not finish within {timeout} s (step_timeout)" in message and "world has been torn down" in message
    assert out["after_timeout"] == ["REMOVED"]
    # The last user gone, the local instance pipedsl started was shut down.
    assert _none_left(mark, within=10) == []


# -- Ctrl-C ----------------------------------------------------------------------------


def _interrupt(mark: str, when: str) -> tuple[subprocess.Popen[str], str, str]:
    command = [sys.executable, "-m", "pipedsl", "run", "schedules/1f1b.sched", "-p", "pp=2", "--backend", "ray"]
    command += ["--steps", "100000", "--width", "8", "--layers-per-stage", "1"]
    # In a session of its own, so that the signal goes to its whole process group, as a
    # terminal's Ctrl-C does, and to nothing else.
    run = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(mark),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        if when == "start-up":
            # The moment Ray's first process of the instance exists, it is starting.
            while not any(_is_ray_server(pid) for pid in _marked(mark)) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            assert run.stdout is not None
            while time.monotonic() < deadline and "(includes tracing and compilation)" not in run.stdout.readline():
                pass
        state = _signal_state(run.pid)
        os.killpg(run.pid, signal.SIGINT)
        try:
            out, err = run.communicate(timeout=60)
        except subprocess.TimeoutExpired as late:
            out, err = (_text(late.stdout)[-1500:], _text(late.stderr)[-3000:])
            pytest.fail(
                f"the run did not exit within 60 s of its Ctrl-C; its signals then: {state}\nstdout: {out}\nstderr: {err}"
            )
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    return run, out, err


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _signal_state(pid: int) -> str:
    """Process ``pid``'s ignored and caught signals and each thread's blocked ones (as
    /proc writes them), to say why a Ctrl-C went unheard."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        threads = [Path(t, "status").read_text() for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError as err:
        return f"unreadable ({err})"

    def field(text: str, name: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(name + ":")), "?")

    blocked = sorted({field(t, "SigBlk") for t in threads})
    return f"ignored {field(status, 'SigIgn')}, caught {field(status, 'SigCgt')}, blocked by thread {blocked}"


def _is_ray_server(pid: int) -> bool:
    try:
        return b"gcs_server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.parametrize("when", ["start-up", "steps"])
@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_prints_one_line_and_leaves_no_ray_process(when: str) -> None:
    mark = uuid.uuid4().hex
    run, _, err = _interrupt(mark, when)
    assert run.returncode == 130, err
    lines = [line for line in err.strip().splitlines() if "pipedsl" in line]
    assert lines == ["pipedsl run: interrupted"], err
    assert "Traceback" not in err
    assert _none_left(mark, within=15) == []
