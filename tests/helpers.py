"""What the test tiers share: schedules built straight from their definitions, random valid
schedules, and the executor's single-device references.

- Textbook schedules (:func:`gpipe`, :func:`one_f_one_b`, ...) are expectations written
  independently of the language evaluator.
- :func:`valid_schedules` draws a random topological order of every action, projected onto
  the devices: valid by construction.
- :func:`setup`, :func:`reference_training` and :func:`assert_trees_close` give the loss,
  gradients and training of the unsplit model on one device, which every backend must match.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

import pipedsl
from pipedsl import RunOptions
from pipedsl.executor import Pipeline
from pipedsl.executor.models import BuiltinModel, mlp, reference_stages, transformer
from pipedsl.executor.ray.backend import RayRunner
from pipedsl.executor.ray.cluster import RayConfig
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.validate import dependencies


def _schedule(
    name: str, pp: int, m: int, orders: list[list[Action]], placement: tuple[int, ...] | None = None
) -> Schedule:
    placement = placement if placement is not None else tuple(range(pp))
    return Schedule(
        name=name,
        num_stages=len(placement),
        num_devices=pp,
        num_microbatches=m,
        placement=placement,
        orders=tuple(tuple(o) for o in orders),
        params=(("pp", pp), ("microbatches", m)),
    )


def gpipe(pp: int, m: int) -> Schedule:
    """All forwards, then all backwards, in microbatch order."""
    orders = [[Action(Kind.F, d, i) for i in range(m)] + [Action(Kind.B, d, i) for i in range(m)] for d in range(pp)]
    return _schedule("gpipe", pp, m, orders)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """PipeDream-Flush: pp-1-d warm-up forwards, then F/B pairs, then the remaining backwards."""
    orders = []
    for d in range(pp):
        warmup = min(pp - 1 - d, m)
        order = [Action(Kind.F, d, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(Kind.F, d, warmup + i), Action(Kind.B, d, i)]
        order += [Action(Kind.B, d, i) for i in range(m - warmup, m)]
        orders.append(order)
    return _schedule("1f1b", pp, m, orders)


def one_f_one_b_split(pp: int, m: int) -> Schedule:
    """1F1B with every backward split into I immediately followed by W."""
    base = one_f_one_b(pp, m)
    orders = []
    for order in base.orders:
        new: list[Action] = []
        for a in order:
            if a.kind is Kind.B:
                new += [Action(Kind.I, a.stage, a.microbatch), Action(Kind.W, a.stage, a.microbatch)]
            else:
                new.append(a)
        orders.append(new)
    return _schedule("1f1b_split", pp, m, orders)


def interleaved(pp: int, vpp: int, m: int) -> Schedule:
    """Megatron's interleaved 1F1B: stage s on device s % pp, written from its definition."""
    num_stages = pp * vpp
    total = m * vpp
    orders = []
    for d in range(pp):
        warmup = min(2 * (pp - d - 1) + (vpp - 1) * pp, total)

        def forward(k: int, d: int = d) -> Action:
            return Action(Kind.F, ((k // pp) % vpp) * pp + d, (k // (pp * vpp)) * pp + k % pp)

        def backward(k: int, d: int = d) -> Action:
            return Action(Kind.B, (vpp - 1 - (k // pp) % vpp) * pp + d, (k // (pp * vpp)) * pp + k % pp)

        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        orders.append(tuple(order))
    return Schedule(
        name="interleaved",
        num_stages=num_stages,
        num_devices=pp,
        num_microbatches=m,
        placement=tuple(s % pp for s in range(num_stages)),
        orders=tuple(orders),
    )


def v_shape(pp: int, m: int, *, split: bool) -> Schedule:
    """V placement (device d holds stages d and 2pp-1-d) in a GPipe-like order: all
    forwards by microbatch then stage, all backwards in reverse; projected per device."""
    num_stages = 2 * pp
    placement = tuple(s if s < pp else num_stages - 1 - s for s in range(num_stages))
    order: list[Action] = [Action(Kind.F, s, mb) for mb in range(m) for s in range(num_stages)]
    for mb in range(m):
        for s in reversed(range(num_stages)):
            order += [Action(Kind.I, s, mb), Action(Kind.W, s, mb)] if split else [Action(Kind.B, s, mb)]
    orders = tuple(tuple(a for a in order if placement[a.stage] == d) for d in range(pp))
    return Schedule("v", num_stages, pp, m, placement, orders)


# --- fresh processes ----------------------------------------------------------------------


# The entry of XLA_FLAGS that gives JAX its CPU devices (tests/conftest.py sets it).
_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def fresh_process_env() -> dict[str, str]:
    """This process's environment for a fresh ``pipedsl`` process that must give JAX its
    devices itself: ``XLA_FLAGS`` less its host device count. The rest of the flags stay, so
    the process compiles as this one does (tests/conftest.py: no LLVM optimisation of the
    CPU code); what such a process checks it compares with results of its own or of other
    processes started the same way."""
    env = dict(os.environ)
    kept = " ".join(f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT))
    if kept:
        env["XLA_FLAGS"] = kept
    return env


# --- the Ray world's test modules (tests/ray/conftest.py gives them their cluster) ------------


RAY_MARKS = [
    pytest.mark.ray,
    # The cluster's processes are started from the test process, after JAX has started its
    # threads; Ray execs right after forking, which is safe.
    pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning"),
]

# A world's processes take XLA_FLAGS from their runtime environment (with their own device
# count added), not from the test process: the compile options of tests/conftest.py go
# there, so that they compile as the test process does.
_COMPILE_FLAGS = fresh_process_env().get("XLA_FLAGS", "")
RAY_CONFIG = RayConfig(
    step_timeout=240,
    start_timeout=120,
    runtime_env={"env_vars": {"XLA_FLAGS": _COMPILE_FLAGS}} if _COMPILE_FLAGS else None,
)


def ray_runner(pipe: Any) -> RayRunner:
    """The Ray backend of ``pipe``."""
    backend = pipe.backend
    assert isinstance(backend, RayRunner)
    return backend


# --- random valid schedules ------------------------------------------------------------


def all_actions(num_stages: int, num_mb: int, split: set[tuple[int, int]]) -> list[Action]:
    actions = []
    for s in range(num_stages):
        for m in range(num_mb):
            actions.append(Action(Kind.F, s, m))
            if (s, m) in split:
                actions += [Action(Kind.I, s, m), Action(Kind.W, s, m)]
            else:
                actions.append(Action(Kind.B, s, m))
    return actions


def needs(action: Action, num_stages: int, split: set[tuple[int, int]]) -> tuple[Action, ...]:
    return tuple(Action(*key) for key in dependencies(action, num_stages=num_stages, split=split))


Shape = tuple[int, tuple[int, ...], int, set[tuple[int, int]]]


@st.composite
def shapes(draw: st.DrawFn, *, max_devices: int = 4) -> Shape:
    """(devices, placement, microbatches, split pairs), each device owning at least one stage."""
    num_devices = draw(st.integers(1, max_devices))
    extra = draw(st.lists(st.integers(0, num_devices - 1), max_size=2 * num_devices))
    placement = tuple(draw(st.permutations(list(range(num_devices)) + extra)))
    num_mb = draw(st.integers(1, 4))
    pairs = [(s, m) for s in range(len(placement)) for m in range(num_mb)]
    bits = draw(st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)))
    split = {p for p, bit in zip(pairs, bits) if bit}
    return num_devices, placement, num_mb, split


def random_schedule(num_devices: int, placement: tuple[int, ...], num_mb: int, orders: list[list[Action]]) -> Schedule:
    return Schedule(
        name="random",
        num_stages=len(placement),
        num_devices=num_devices,
        num_microbatches=num_mb,
        placement=placement,
        orders=tuple(tuple(o) for o in orders),
    )


@st.composite
def valid_schedules(draw: st.DrawFn, *, max_devices: int = 4) -> Schedule:
    """A random topological order of every action, split per device: valid by construction."""
    num_devices, placement, num_mb, split = draw(shapes(max_devices=max_devices))
    rng = draw(st.randoms(use_true_random=False))
    num_stages = len(placement)
    pending = all_actions(num_stages, num_mb, split)
    done: set[Action] = set()
    orders: list[list[Action]] = [[] for _ in range(num_devices)]
    while pending:
        ready = [a for a in pending if all(n in done for n in needs(a, num_stages, split))]
        action = rng.choice(ready)
        pending.remove(action)
        done.add(action)
        orders[placement[action.stage]].append(action)
    return random_schedule(num_devices, placement, num_mb, orders)


# --- the executor's single-device references ----------------------------------------------


LIBRARY = ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv")
PP, MICROBATCHES, BATCH = 2, 4, 8


def library(name: str, *, pp: int = PP, microbatches: int = MICROBATCHES) -> Schedule:
    return pipedsl.load(pipedsl.library_path(name), pp=pp, microbatches=microbatches)


@cache
def model(kind: str, num_stages: int) -> BuiltinModel:
    if kind == "mlp":
        return mlp(num_stages=num_stages, width=16, layers_per_stage=1)
    return transformer(num_stages=num_stages, vocab=16, dim=8, heads=2, seq=4, layers_per_stage=1)


@cache
def setup(kind: str, form: str, num_stages: int) -> tuple[Any, tuple[Any, Any], jax.Array, Any]:
    """(params, batch, reference loss, reference grads) on one device."""
    m = model(kind, num_stages)
    key = jax.random.PRNGKey(7)
    batch = m.batch(jax.random.fold_in(key, 1), BATCH)
    if form == "explicit":
        params = m.init_stages(key)
        fn = reference_stages(m)
    else:
        params = m.init_function(key)
        fn = m.model_fn
    loss, grads = jax.jit(jax.value_and_grad(lambda p, x, t: m.loss(fn(p, x), t)))(params, *batch)
    return params, batch, loss, grads


def pipeline(kind: str, form: str, schedule: Schedule, *, options: RunOptions = RunOptions(), **where: Any) -> Pipeline:
    """The built-in ``kind`` model, ``form`` explicit or marked, under ``schedule``; ``where``
    is the backend and devices."""
    m = model(kind, schedule.num_stages)
    if form == "explicit":
        return Pipeline(m.stages, loss=m.loss, schedule=schedule, options=options, **where)
    return Pipeline.from_function(m.model_fn, loss=m.loss, schedule=schedule, options=options, **where)


# Adam divides by the gradient's magnitude, so a gradient that is zero in exact
# arithmetic (the attention key bias: softmax ignores a shift) would move its parameter
# by a full step of rounding noise; eps bounds that magnification.
ADAM = optax.adam(1e-2, eps=1e-4)


def reference_training(
    form: str, num_stages: int, *, steps: int, kind: str = "transformer"
) -> list[tuple[Any, jax.Array]]:
    """(params after, loss of) each of ``steps`` ADAM steps of the unsplit ``kind`` model on
    one device, from :func:`setup`'s parameters and batch."""
    params, batch, _, _ = setup(kind, form, num_stages)
    return _train_unsplit(model(kind, num_stages), form, params, batch, ADAM, steps=steps)


def _train_unsplit(
    m: BuiltinModel, form: str, params: Any, batch: tuple[Any, Any], optimizer: Any, *, steps: int
) -> list[tuple[Any, jax.Array]]:
    """(params after, loss of) each of ``steps`` optimizer steps of the unsplit ``m`` on one device."""
    fn = reference_stages(m) if form == "explicit" else m.model_fn

    @jax.jit
    def step(p: Any, state: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(lambda q: m.loss(fn(q, batch[0]), batch[1]))(p)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    trained, state = [], optimizer.init(params)
    for _ in range(steps):
        params, state, loss = step(params, state)
        trained.append((params, loss))
    return trained


def assert_trees_close(actual: Any, expected: Any, *, atol: float | None = None) -> None:
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree
    for a, e in zip(a_leaves, e_leaves, strict=True):
        e = np.asarray(e)
        # rtol 1e-5 as promised; the default atol forgives float32 rounding of entries that
        # are sums cancelling to near zero: their rounding is that of their terms, which are
        # as large as the leaf's largest entry. Summed in another order (another CPU's XLA
        # kernels), such an entry of a transformer's gradient moved by 1.25e-6 of the largest.
        tol = 1e-5 * float(np.abs(e).max() or 1.0) if atol is None else atol
        np.testing.assert_allclose(np.asarray(a), e, rtol=1e-5, atol=tol)


# --- hybrid plans: every pipeline device a dp x tp mesh --------------------------------------


HYBRID_MICROBATCHES = 4
# Adam with a larger eps than ADAM: tensor and data parallelism sum in other orders, and
# the rounding noise of gradients that are zero in exact arithmetic (the attention key
# bias) reaches the parameters divided by eps.
HYBRID_ADAM = optax.adam(1e-2, eps=1e-3)


def hybrid_schedule(name: str, pp: int, vpp: int) -> pipedsl.ir.Schedule:
    options: dict[str, int] = {"pp": pp, "microbatches": HYBRID_MICROBATCHES}
    if name == "interleaved_1f1b":
        options["vpp"] = vpp
    return pipedsl.load(pipedsl.library_path(name), **options)


@cache
def hybrid_problem(form: str, num_stages: int, dp: int) -> tuple[BuiltinModel, Any, tuple[Any, Any], jax.Array, Any]:
    """(model, params, batch, reference loss, reference grads): one example per data-parallel
    device per microbatch, on one device."""
    m = model("transformer", num_stages)
    key = jax.random.PRNGKey(11)
    batch = m.batch(jax.random.fold_in(key, 1), HYBRID_MICROBATCHES * max(dp, 2))
    params = m.init_stages(key) if form == "explicit" else m.init_function(key)
    fn = reference_stages(m) if form == "explicit" else m.model_fn
    loss, grads = jax.jit(jax.value_and_grad(lambda p, x, t: m.loss(fn(p, x), t)))(params, *batch)
    return m, params, batch, loss, grads


def hybrid(form: str, schedule: Any, *, backend: Any = "local", **options: Any) -> Pipeline:
    """The transformer of :func:`hybrid_problem` under ``schedule`` with its tensor-parallel
    specs, run as ``RunOptions(**options)`` say on ``backend``."""
    run = RunOptions(**options)
    m, params, *_ = hybrid_problem(form, schedule.num_stages, run.dp)
    specs = m.param_specs(params)
    make = Pipeline if form == "explicit" else Pipeline.from_function
    fn = m.stages if form == "explicit" else m.model_fn
    return make(fn, loss=m.loss, schedule=schedule, options=run, backend=backend, param_specs=specs)


def assert_relative_close(actual: Any, expected: Any, *, rtol: float = 1e-5) -> None:
    """Every leaf within ``rtol`` of ``expected`` in relative (L2) error."""
    a_leaves, a_def = jax.tree_util.tree_flatten(jax.device_get(actual))
    e_leaves, e_def = jax.tree_util.tree_flatten(jax.device_get(expected))
    assert a_def == e_def
    for a, e in zip(a_leaves, e_leaves, strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape
        scale = max(float(np.linalg.norm(e)), 1e-12)
        assert float(np.linalg.norm(a - e)) / scale < rtol


def hybrid_reference_adam(form: str, num_stages: int, dp: int, *, steps: int) -> list[tuple[Any, jax.Array]]:
    m, params, batch, _, _ = hybrid_problem(form, num_stages, dp)
    return _train_unsplit(m, form, params, batch, HYBRID_ADAM, steps=steps)


def zb_auto(max_inflight: int) -> Schedule:
    """``zb_auto`` at pp = 2, 4 microbatches, synthesised against a cost model with
    communication (W twice as long as F or I)."""
    from pipedsl.policy import Policy
    from pipedsl.simulator import CostModel
    from pipedsl.synthesize import synthesize

    policy = pipedsl.load("zb_auto", pp=2, microbatches=4, max_inflight=max_inflight)
    assert isinstance(policy, Policy)
    return synthesize(policy, CostModel(forward=1, input_grad=1, weight_grad=2, latency=0.1))


def assert_saved_params(version: str, gathered: Any) -> None:
    """Orbax alone, outside any pipeline, reads every device's part of the sharded checkpoint
    ``version`` (``Pipeline.save``) as numpy, and its parameter leaves (by flat index, over
    every device) are the ``gathered`` parameters'."""
    import orbax.checkpoint as ocp

    read: dict[str, Any] = {}
    for part in sorted(Path(version).glob("device-*")):
        reader = ocp.PyTreeCheckpointer()
        tree = reader.metadata(part).item_metadata.tree
        as_numpy = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        read |= reader.restore(part, args=ocp.args.PyTreeRestore(restore_args=as_numpy))["params"]
    leaves = jax.tree_util.tree_leaves(gathered)
    assert sorted(map(int, read)) == list(range(len(leaves)))
    for i, leaf in enumerate(leaves):
        np.testing.assert_array_equal(read[str(i)], leaf)
