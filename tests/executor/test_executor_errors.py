"""The executor's errors: clear, raised before anything runs when they can be, never a hang."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

import pipedsl
from pipedsl.errors import PipedslError
from pipedsl.executor import ExecutionError, Pipeline, RayConfig, RayWorld, RunOptions, stage_boundary
from pipedsl.executor.local.exchange import LocalExchange, resharder
from pipedsl.executor.local.fused import FusedStep
from pipedsl.executor.runtime.interpreter import DeviceRuntime
from pipedsl.executor.runtime.scheduler import Steps, run_watched
from pipedsl.ir import Schedule

WIDTH = 4


def one_f_one_b(pp: int = 2, microbatches: int = 4) -> Schedule:
    return pipedsl.load(pipedsl.library_path("1f1b"), pp=pp, microbatches=microbatches)


def dense(p: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p)


def mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y - t) ** 2)


def batch(size: int = 8, width: int = WIDTH) -> tuple[jax.Array, jax.Array]:
    return jnp.ones((size, width)), jnp.zeros((size, width))


def params(count: int = 2) -> list[jax.Array]:
    return [jnp.eye(WIDTH) * 0.5 for _ in range(count)]


def test_errors_belong_to_the_hierarchy() -> None:
    assert issubclass(ExecutionError, PipedslError)


def test_stage_count_must_match_the_schedule() -> None:
    with pytest.raises(ExecutionError, match="3 stages but schedule '1f1b' has 2"):
        Pipeline([dense] * 3, loss=mse, schedule=one_f_one_b())


def test_marker_count_must_match_the_schedule() -> None:
    def model_fn(p: list[jax.Array], x: jax.Array) -> jax.Array:
        for i, w in enumerate(p):
            x = stage_boundary(x) if i else x
            x = dense(w, x)
        return x

    pipe = Pipeline.from_function(model_fn, loss=mse, schedule=one_f_one_b())
    with pytest.raises(ExecutionError, match="2 stage_boundary markers, so 3 stages; the schedule has 2"):
        pipe.step(params(3), batch())


def test_batch_must_split_into_microbatches() -> None:
    pipe = Pipeline([dense] * 2, loss=mse, schedule=one_f_one_b())
    with pytest.raises(ExecutionError, match="6 examples does not split into 4 equal microbatches"):
        pipe.step(params(), batch(size=6))
    with pytest.raises(ExecutionError, match="disagree on the batch size"):
        pipe.step(params(), (jnp.ones((8, WIDTH)), jnp.ones((4, WIDTH))))


def test_stage_that_raises_while_traced_is_named() -> None:
    def broken(p: jax.Array, x: jax.Array) -> jax.Array:
        raise ValueError("no such layer")

    pipe = Pipeline([dense, broken], loss=mse, schedule=one_f_one_b())
    with pytest.raises(ExecutionError, match=r"stage 1 \(device 1\).*ValueError: no such layer") as info:
        pipe.step(params(), batch())
    assert (info.value.stage, info.value.device) == (1, 1)


def test_marked_model_that_raises_is_blamed_on_its_stage() -> None:
    def model_fn(p: list[jax.Array], x: jax.Array) -> jax.Array:
        x = stage_boundary(dense(p[0], x))
        raise RuntimeError("second stage is broken")

    pipe = Pipeline.from_function(model_fn, loss=mse, schedule=one_f_one_b())
    with pytest.raises(ExecutionError, match=r"stage 1 \(device 1\).*second stage is broken"):
        pipe.step(params(), batch())


def test_shape_mismatch_at_a_boundary_names_both_stages() -> None:
    def widen(p: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.concatenate([x, x], axis=-1)

    pipe = Pipeline([widen, dense], loss=mse, schedule=one_f_one_b())
    with pytest.raises(ExecutionError, match=r"stage 1 \(device 1\).*output of stage 0 \(float32\[2,8\]\)") as info:
        pipe.step([jnp.zeros(()), jnp.eye(WIDTH)], batch())
    assert info.value.stage == 1


def test_stage_that_fails_while_running_stops_every_device_at_once() -> None:
    def fail(x: Any) -> None:
        raise ValueError("bad data on the host")

    def flaky(p: jax.Array, x: jax.Array) -> jax.Array:
        jax.debug.callback(fail, x)
        return dense(p, x)

    # Device 0 waits for gradients that device 1 will never send; it must learn of the
    # failure at once (it then only echoes it). Had it gone on waiting, its own error (a
    # receive nobody answers, or a stall after the receive timeout) would come first and be
    # the step's: the error raised says which happened, and the timeout only bounds a hang.
    pipe = Pipeline([dense, flaky], loss=mse, schedule=one_f_one_b(), options=RunOptions(recv_timeout=120.0))
    pipe.compile(params(), batch())
    with pytest.raises(ExecutionError, match=r"stage 1 \(device 1\) failed while running 1F0.*bad data on the host"):
        pipe.step(params(), batch())


def _failing_callback_stage() -> Callable[[jax.Array, jax.Array], jax.Array]:
    def fail(x: Any) -> None:
        raise ValueError("bad data on the host")

    def flaky(p: jax.Array, x: jax.Array) -> jax.Array:
        jax.debug.callback(fail, x)
        return dense(p, x)

    return flaky


def test_a_failure_inside_the_one_program_of_shared_devices_is_named_by_the_actions_apart() -> None:
    # Stages sharing a JAX device run as one program, which XLA reports as a whole. A step
    # without an update donates nothing, so the same step dispatched action by action
    # names the action that fails.
    shared = [jax.devices()[0]] * 2
    pipe = Pipeline([dense, _failing_callback_stage()], loss=mse, schedule=one_f_one_b(), devices=shared)
    assert pipe.backend.fuse == "loop"
    with pytest.raises(ExecutionError, match=r"stage 1 \(device 1\) failed while running 1F0.*bad data on the host"):
        pipe.step(params(), batch())


def test_a_one_program_failure_the_actions_apart_do_not_repeat_is_still_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever made the one program fail (here injected), a step that then runs action by
    # action must not pass for a good one.
    shared = [jax.devices()[0]] * 2
    pipe = Pipeline([dense, dense], loss=mse, schedule=one_f_one_b(), devices=shared)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("out of memory while running the program")

    monkeypatch.setattr(FusedStep, "run", fail)
    with pytest.raises(ExecutionError, match=r"one program .*out of memory.*action by action.*the same step ran"):
        pipe.step(params(), batch())


def test_a_failure_inside_the_one_program_of_an_update_says_what_was_lost_and_how_to_find_it() -> None:
    shared = [jax.devices()[0]] * 2
    pipe = Pipeline([dense, _failing_callback_stage()], loss=mse, schedule=one_f_one_b(), devices=shared)
    with pytest.raises(ExecutionError) as info:
        pipe.train_step(params(), None, batch(), optimizer=optax.sgd(0.1))
    message = str(info.value)
    assert "one program" in message and "bad data on the host" in message
    assert "donated parameters and optimizer state are gone" in message and "fuse='off'" in message


def test_a_receive_no_device_will_answer_is_found_at_once() -> None:
    schedule = one_f_one_b()
    pipe = Pipeline([dense] * 2, loss=mse, schedule=schedule)
    programs = pipe.compile(params(), batch())
    runtime = DeviceRuntime(pipe.program.devices[1], dict(enumerate(programs)), recv_timeout=60.0)
    exchange = LocalExchange([resharder(m) for m in pipe.backend.meshes])

    def silent() -> Steps[None]:  # a device whose program sends nothing
        return None
        yield

    targets = [(jnp.zeros((2, WIDTH)),)] * 4
    device_1 = runtime.steps(exchange.endpoint(1), {1: (jnp.eye(WIDTH),)}, (), targets)
    # Every device waits (device 0 has ended), so the step ends with that error, not with a
    # stall after its timeout (which would raise instead): the timeout only bounds a hang.
    results, errors = run_watched(
        [silent(), device_1], exchange, timeout=60.0, doing=lambda d: "", progress=lambda: None
    )
    assert errors[0] is None and isinstance(errors[1], ExecutionError)
    assert "device 1 waits for act(0,0) from device 0, which never sends it" in str(errors[1])


def test_stalled_stage_is_named_within_a_bounded_wait() -> None:
    # The stage stays stuck until the test releases it, after the step has failed: so the
    # failure came while the stage was still running, whatever the machine's speed. The
    # release's own timeout only bounds a wrong program, which would wait for the stage.
    # The receive timeout is the stall's definition: long enough that no device that is
    # working (however slow this machine is) goes that long without progress.
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()

    def hold(x: Any) -> None:
        entered.set()
        release.wait(timeout=120.0)
        returned.set()

    def stuck(p: jax.Array, x: jax.Array) -> jax.Array:
        jax.debug.callback(hold, x)
        return dense(p, x)

    pipe = Pipeline(
        [dense, stuck], loss=mse, schedule=one_f_one_b(microbatches=2), options=RunOptions(recv_timeout=5.0)
    )
    pipe.compile(params(), batch(4))
    try:
        with pytest.raises(ExecutionError) as info:
            pipe.value_and_grad(params(), batch(4))
        stuck_when_it_failed = entered.is_set() and not returned.is_set()
    finally:
        release.set()
        # The devices' helper thread leaves XLA once the stage wakes; it may not be inside
        # XLA when the tests end (a thread inside XLA at interpreter exit aborts the process).
        returned.wait(timeout=30.0)
        jax.effects_barrier()
    # The stalled device is named with what it was doing; the step fails about one
    # receive timeout after the last progress, while the stage is still stuck.
    assert info.value.device == 1
    assert "device 1 is stalled: still running instruction" in str(info.value)
    assert "1F0" in str(info.value) and "without progress" in str(info.value)
    assert stuck_when_it_failed


def test_too_few_devices_says_how_to_get_more() -> None:
    schedule = one_f_one_b(pp=16, microbatches=16)
    with pytest.raises(ExecutionError, match="XLA_FLAGS=--xla_force_host_platform_device_count=16"):
        Pipeline([dense] * 16, loss=mse, schedule=schedule)


def test_several_pipeline_devices_may_share_one_jax_device() -> None:
    schedule = one_f_one_b()
    cpu = jax.devices()[0]
    pipe = Pipeline([dense] * 2, loss=mse, schedule=schedule, devices=[cpu, cpu])
    loss, _ = pipe.value_and_grad(params(), batch())
    expected = mse(dense(params()[1], dense(params()[0], batch()[0])), batch()[1])
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


def test_marker_inside_a_loop_is_rejected() -> None:
    def model_fn(p: jax.Array, x: jax.Array) -> jax.Array:
        def body(h: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return stage_boundary(dense(p, h)), None

        return jax.lax.scan(body, x, None, length=2)[0]

    pipe = Pipeline.from_function(model_fn, loss=mse, schedule=one_f_one_b())
    with pytest.raises(ExecutionError, match="inside scan"):
        pipe.step(jnp.eye(WIDTH), batch())


def test_functions_that_cannot_be_called_are_named_before_tracing() -> None:
    with pytest.raises(ExecutionError, match="Pipeline: loss must be a function"):
        Pipeline([dense] * 2, loss=None, schedule=one_f_one_b())  # type: ignore[arg-type]
    with pytest.raises(ExecutionError, match=r"Pipeline: stages\[1\] must be a function"):
        Pipeline([dense, "dense"], loss=mse, schedule=one_f_one_b())  # type: ignore[list-item]
    with pytest.raises(ExecutionError, match="Pipeline: model_fn must be a function"):
        Pipeline.from_function(None, loss=mse, schedule=one_f_one_b())  # type: ignore[arg-type]


def test_loss_must_be_a_scalar() -> None:
    pipe = Pipeline([dense] * 2, loss=lambda y, t: (y - t) ** 2, schedule=one_f_one_b())
    with pytest.raises(ExecutionError, match="must be a floating-point scalar"):
        pipe.step(params(), batch())


def test_parameters_must_be_floating_point() -> None:
    pipe = Pipeline([lambda p, x: x * p["scale"]] * 2, loss=mse, schedule=one_f_one_b())
    with pytest.raises(ExecutionError, match="dtype int32; parameters must be floating point"):
        pipe.step([{"scale": jnp.ones((), jnp.int32)}] * 2, batch())


def test_unknown_backend() -> None:
    with pytest.raises(ExecutionError, match="unknown backend 'mpi'"):
        Pipeline([dense] * 2, loss=mse, schedule=one_f_one_b(), backend="mpi")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: RayConfig(devices_per_process=0), "devices_per_process must be a positive integer, got 0"),
        (lambda: RayWorld.start(0), "num_processes must be a positive integer, got 0"),
        (
            lambda: RayWorld.start(2, devices_per_process=True),
            "devices_per_process must be a positive integer, got True",
        ),
    ],
)
def test_ray_options_are_checked_before_anything_starts(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ExecutionError, match=message):
        make()


def test_invalid_schedule_is_rejected_before_anything_else() -> None:
    schedule = one_f_one_b()
    broken = Schedule(
        name="broken",
        num_stages=2,
        num_devices=2,
        num_microbatches=4,
        placement=schedule.placement,
        orders=(schedule.orders[0][:-1], schedule.orders[1]),
    )
    with pytest.raises(pipedsl.ScheduleInvalid):
        Pipeline([dense] * 2, loss=mse, schedule=broken)
