"""The executor against the unsplit model: every library schedule, both model forms.

Each pipelined step must give the loss and gradients of ``jax.value_and_grad`` of the
unsplit model on one device (float32, rtol 1e-5), free every buffer at its last use,
hold no more residuals than the schedule's in-flight peak, and split the backward into
I and W without recomputation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (
    ADAM,
    LIBRARY,
    assert_trees_close,
    library,
    pipeline,
    reference_training,
    setup,
)
from pipedsl.executor import Pipeline, RunOptions, stage_boundary
from pipedsl.executor.stages.split import marked_model
from pipedsl.program import BufferKind, lower
from pipedsl.timeline import EventKind
from pipedsl.validate import peak_inflight


# Every library schedule with the MLP split explicitly and with the transformer split
# from its marked function; the other two pairs run too (the MLP marked under 1f1b and
# zb_h1 on four devices, the transformer explicit under zbv in the optimizer test and in
# the hybrid grid), so the interpreter meets every model and form.
@pytest.mark.parametrize(
    ("name", "kind", "form"),
    [(n, "mlp", "explicit") for n in LIBRARY] + [(n, "transformer", "marked") for n in LIBRARY],
)
def test_library_schedule_matches_single_device(name: str, kind: str, form: str) -> None:
    schedule = library(name)
    params, batch, ref_loss, ref_grads = setup(kind, form, schedule.num_stages)
    result = pipeline(kind, form, schedule).step(params, batch)
    np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(result.grads, ref_grads)
    # Every buffer is freed by the end of the step, and no device ever held residuals
    # of more (stage, microbatch) pairs than the schedule keeps in flight.
    assert result.leftover == ((),) * schedule.num_devices
    assert result.peak_held == peak_inflight(schedule)


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_four_devices(name: str) -> None:
    schedule = library(name, pp=4, microbatches=4)
    params, batch, ref_loss, ref_grads = setup("mlp", "marked", 4)
    result = pipeline("mlp", "marked", schedule).step(params, batch)
    np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(result.grads, ref_grads)
    assert result.peak_held == peak_inflight(schedule)


@pytest.mark.parametrize("form", ["explicit", "marked"])
def test_optimizer_steps_match_single_device_loop(form: str) -> None:
    schedule = library("zbv")
    params, batch, _, _ = setup("transformer", form, schedule.num_stages)
    pipe = pipeline("transformer", form, schedule)
    pipe_params, pipe_state = params, None
    for ref_params, ref_loss in reference_training(form, schedule.num_stages, steps=3):
        pipe_params, pipe_state, loss = pipe.train_step(pipe_params, pipe_state, batch, optimizer=ADAM)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    # Adam moves a parameter by lr / eps = 100 times its gradient's rounding (float32, about
    # 1e-8 for gradients of this size) at each step: 3e-6 after three steps. Parameters are
    # of size ~0.1, so an absolute 5e-6 is still tight.
    assert_trees_close(pipe.gather(pipe_params), ref_params, atol=5e-6)


def test_tied_parameter_is_owned_by_first_user() -> None:
    # The marked transformer's embedding is read by the first and the last stage; its
    # gradient is the sum of both, kept where stage 0 lives.
    schedule = library("zb_h1")
    params, batch, _, ref_grads = setup("transformer", "marked", schedule.num_stages)
    pipe = pipeline("transformer", "marked", schedule)
    grads = pipe.step(params, batch).grads
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    embed = [i for i, path in enumerate(paths) if path.startswith("['embed']")]
    assert embed and set(embed) <= set(pipe.backend.workers[schedule.placement[0]].owned)
    assert_trees_close(grads["embed"], ref_grads["embed"])


def test_full_recompute_gives_the_same_gradients() -> None:
    schedule = library("zb_h1")
    params, batch, ref_loss, ref_grads = setup("transformer", "explicit", schedule.num_stages)
    result = pipeline("transformer", "explicit", schedule, options=RunOptions(recompute="full")).step(params, batch)
    np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(result.grads, ref_grads)


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_weight_half_repeats_nothing_of_the_input_half(kind: str) -> None:
    # I and W together run exactly B's equations: every matmul (and every other
    # primitive) of the backward is in one half only.
    schedule = library("zb_h1")
    params, batch, _, _ = setup(kind, "explicit", schedule.num_stages)
    programs = pipeline(kind, "explicit", schedule).compile(params, batch)
    for program in programs:
        full, input_half, weight_half = program.split.counts()
        assert input_half + weight_half == full
        if not program.first:
            assert input_half["dot_general"] > 0 and weight_half["dot_general"] > 0
        assert not {id(e) for e in program.split.input_eqns} & {id(e) for e in program.split.weight_eqns}


def test_weight_residual_buffers_carry_the_handoff() -> None:
    schedule = library("zb_h1")
    program = lower(schedule)
    kinds = {i.buffer.kind for dev in program.devices for i in dev.instructions if hasattr(i, "buffer")}
    assert BufferKind.WEIGHT_RESIDUAL in kinds
    params, batch, _, _ = setup("mlp", "explicit", schedule.num_stages)
    last = pipeline("mlp", "explicit", schedule).compile(params, batch)[-1]
    # W reads intermediate cotangents computed by I, not only residuals.
    assert last.split.handoff_computed


def test_measured_timeline_records_every_action_and_transfer() -> None:
    schedule = library("1f1b")
    params, batch, _, _ = setup("mlp", "explicit", schedule.num_stages)
    pipe = pipeline("mlp", "explicit", schedule)
    timeline = pipe.step(params, batch, record=True).timeline
    assert timeline is not None and timeline.origin == "measured"
    frame = timeline.to_dataframe()
    computes = frame[frame.kind != EventKind.SEND.value]
    assert len(computes) == schedule.num_actions
    sends = [i for dev in pipe.program.devices for i in dev.instructions if type(i).__name__ == "Send"]
    assert (frame.kind == EventKind.SEND.value).sum() == len(sends)
    assert (frame.end >= frame.start).all() and (frame.start >= 0).all()
    # Within a device, recorded actions do not overlap and keep the program's order.
    for device, rows in computes.groupby("device"):
        order = [f"{s}{k}{m}" for s, k, m in zip(rows.stage, rows.kind, rows.microbatch, strict=True)]
        assert order == [str(a) for a in schedule.orders[device]]
        assert (rows.start.to_numpy()[1:] >= rows.end.to_numpy()[:-1]).all()


def test_compiled_stages_are_reused_across_steps() -> None:
    schedule = library("1f1b")
    params, batch, _, _ = setup("mlp", "explicit", schedule.num_stages)
    pipe = pipeline("mlp", "explicit", schedule)
    first = pipe.compile(params, batch)
    pipe.step(params, batch)
    assert pipe.compile(params, batch) is first
    bigger = tuple(jnp.concatenate([x, x]) for x in batch)
    assert pipe.compile(params, bigger) is not first


def test_a_pipeline_keeps_its_compiled_stages_however_many_others_are_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pipelines stepped in turns (the demo's runs and its calibration's steps) never
    # compile again, even when more of them are alive than the shared cache holds.
    from collections import OrderedDict

    import pipedsl.executor.local.backend

    monkeypatch.setattr(pipedsl.executor.local.backend, "_COMPILED", OrderedDict())
    monkeypatch.setattr(pipedsl.executor.local.backend, "_CACHE_SIZE", 1)
    schedule = library("1f1b")
    params, batch, _, _ = setup("mlp", "explicit", schedule.num_stages)
    bigger = tuple(jnp.concatenate([x, x]) for x in batch)
    mine, other = pipeline("mlp", "explicit", schedule), pipeline("mlp", "explicit", schedule)
    first = mine.compile(params, batch)
    other.compile(params, bigger)  # drops the first from the shared cache
    assert mine.compile(params, batch) is first
    assert other.compile(params, batch) is not first  # only the pipeline that compiled them keeps them


def test_marked_split_routes_inputs_integers_and_parameter_only_values() -> None:
    # Stage 2 reads the raw input (carried through stage 1 untouched) and the integer
    # ids (carried forward, with no gradient); stage 1 reads a value computed from
    # parameters alone (computed where it is used); one parameter is used nowhere.
    def model_fn(p: dict[str, Any], batch_in: dict[str, jax.Array]) -> jax.Array:
        x, ids = batch_in["x"], batch_in["ids"]
        h = jnp.tanh(x @ p["a"])
        h = stage_boundary(h)
        h = jnp.tanh(h @ (p["b"] * 2.0).T)
        h = stage_boundary(h)
        mask = (ids % 2).astype(h.dtype)[:, None]
        return h * mask + x @ p["c"]

    def loss(y: jax.Array, t: jax.Array) -> jax.Array:
        return jnp.mean((y - t) ** 2)

    key = jax.random.PRNGKey(3)
    params = {name: jax.random.normal(jax.random.fold_in(key, i), (4, 4)) for i, name in enumerate("abcd")}
    inputs = {"x": jax.random.normal(jax.random.fold_in(key, 9), (8, 4)), "ids": jnp.arange(8, dtype=jnp.int32)}
    targets = jax.random.normal(jax.random.fold_in(key, 10), (8, 4))
    ref_loss, ref_grads = jax.value_and_grad(lambda p: loss(model_fn(p, inputs), targets))(params)
    cut = marked_model(model_fn, loss, params, inputs, targets, num_stages=3, placement=(0, 1, 2))
    assert cut.stage_params == ((0, 3), (1,), (2,))  # leaves a, b, c, d; d unused, owned by stage 0
    assert [len(avals) for avals in cut.input_avals] == [2, 3, 3]  # (ids, x), then (h, x, ids) twice
    for name in ("1f1b", "zb_h1"):
        schedule = library(name, pp=3, microbatches=4)
        result = Pipeline.from_function(model_fn, loss=loss, schedule=schedule).step(params, (inputs, targets))
        np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
        assert_trees_close(result.grads, ref_grads)
        assert not np.asarray(result.grads["d"]).any()
