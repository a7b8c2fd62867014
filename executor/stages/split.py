"""Splitting one marked JAX function into pipeline stages.

``stage_boundary(x)`` marks where one stage ends and the next begins. It is a JAX
primitive that is the identity: it compiles to nothing, it is linear (its tangent is the
marker applied to the tangent) and it is its own transpose, so the backward of a marked
function carries the same markers in reverse. A marked model still runs, jits,
vmaps and differentiates as one function on one device.

:func:`marked_model` traces ``loss(model_fn(params, x), targets)`` once per microbatch
shape and cuts the jaxpr at the markers:

- stages are numbered by the markers in trace order: every equation after the k-th
  marker belongs to stage k (so the loss belongs to the last stage);
- a value computed on one stage and used on a later one travels forward through every
  stage in between, as part of their activations (the markers' operands are such
  values; so is anything else used across the boundary, such as a skip connection or
  the model's integer inputs);
- equations that depend on no data, only on parameters and constants (a transposed
  weight, a positional table), are computed by every stage that uses them, so
  parameters go straight to the stages that use them. A parameter used by several
  stages is owned by the first; the pipeline sums its gradients there.

One call of ``stage_boundary`` is one boundary: pass several values as one pytree.
Markers inside loops, branches, ``jax.checkpoint`` or custom-derivative functions cannot
split the model and are rejected; markers inside a nested ``jax.jit`` are fine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Primitive, Var, jaxprs_in_params, subjaxprs
from jax.interpreters import ad, batching, mlir

from pipedsl.executor.errors import ExecutionError, stage_failure
from pipedsl.executor.stages.jaxprs import evaluate, inline_calls, read
from pipedsl.executor.stages.model import (
    LeafFn,
    StagedModel,
    check_float_params,
    check_loss,
    describe_avals,
    explicit_model,
)

__all__ = ["stage_boundary", "stage_boundary_p", "marked_model", "staged_model"]

T = TypeVar("T")

stage_boundary_p = Primitive("stage_boundary")
stage_boundary_p.multiple_results = True
stage_boundary_p.def_impl(lambda *xs: list(xs))
stage_boundary_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(stage_boundary_p, lambda ctx, *xs: list(xs))


def _boundary_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    # Symbolic zeros (and the float0 tangents of integer operands) stay symbolic: only
    # real tangents pass through the marker.
    out = stage_boundary_p.bind(*primals)
    live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    moved = stage_boundary_p.bind(*(tangents[i] for i in live)) if live else []
    tangents_out = list(tangents)
    for i, t in zip(live, moved, strict=True):
        tangents_out[i] = t
    return out, tangents_out


def _boundary_transpose(cts: Sequence[Any], *args: Any) -> list[Any]:
    live = [
        i
        for i, (ct, x) in enumerate(zip(cts, args, strict=True))
        if ad.is_undefined_primal(x) and type(ct) is not ad.Zero
    ]
    moved = stage_boundary_p.bind(*(cts[i] for i in live)) if live else []
    result: list[Any] = [ad.Zero(x.aval.to_ct_aval()) if ad.is_undefined_primal(x) else None for x in args]
    for i, ct in zip(live, moved, strict=True):
        result[i] = ct
    return result


ad.primitive_jvps[stage_boundary_p] = _boundary_jvp
ad.primitive_transposes[stage_boundary_p] = _boundary_transpose
batching.primitive_batchers[stage_boundary_p] = lambda args, dims: (stage_boundary_p.bind(*args), dims)

# While marked_model traces a model, how many boundaries the trace has passed: a model
# that raises mid-trace is blamed on the stage it was in.
_tracing = threading.local()


def stage_boundary(x: T) -> T:
    """End the current pipeline stage after ``x`` (any pytree of arrays); returns ``x``."""
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if hasattr(_tracing, "passed"):
        _tracing.passed += 1
    if not leaves:
        return x
    return jax.tree_util.tree_unflatten(treedef, stage_boundary_p.bind(*leaves))


def _contains_marker(jaxpr: Jaxpr) -> bool:
    here = any(e.primitive is stage_boundary_p for e in jaxpr.eqns)
    return here or any(_contains_marker(j) for j in subjaxprs(jaxpr))


def _check_nesting(jaxpr: Jaxpr) -> None:
    for eqn in jaxpr.eqns:
        for sub in jaxprs_in_params(eqn.params):
            if _contains_marker(sub):
                raise ExecutionError(
                    f"stage_boundary is called inside {eqn.primitive.name} (a loop, branch, "
                    "jax.checkpoint or custom-derivative function), where it cannot split the "
                    "model; call it at the top level of model_fn"
                )


class _AliasEnv(dict[Var, Any]):
    """An environment in which a marker's outputs read as its operands."""

    def __init__(self, alias: dict[Var, Any]) -> None:
        super().__init__()
        self._alias = alias

    def __missing__(self, var: Var) -> Any:
        return read(self, self._alias[var])


def _trace(
    model_fn: Callable[[Any, Any], Any],
    loss: Callable[[Any, Any], Any],
    params: Any,
    inputs: Any,
    targets: Any,
    *,
    placement: Sequence[int],
) -> tuple[ClosedJaxpr, Any, int, int]:
    """The jaxpr of ``loss(model_fn(params, inputs), targets)``, the params' treedef,
    and the numbers of input and target leaves."""
    p_leaves, p_treedef = jax.tree_util.tree_flatten(params)
    x_leaves, x_treedef = jax.tree_util.tree_flatten(inputs)
    t_leaves, t_treedef = jax.tree_util.tree_flatten(targets)

    def full(p: list[Any], x: list[Any], t: list[Any]) -> Any:
        y = model_fn(jax.tree_util.tree_unflatten(p_treedef, p), jax.tree_util.tree_unflatten(x_treedef, x))
        return loss(y, jax.tree_util.tree_unflatten(t_treedef, t))

    def struct(v: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v))

    _tracing.passed = 0
    try:
        closed = jax.make_jaxpr(full)(*([struct(v) for v in leaves] for leaves in (p_leaves, x_leaves, t_leaves)))
    except ExecutionError:
        raise
    except Exception as err:  # user code may raise anything while it is traced
        stage = min(_tracing.passed, len(placement) - 1)
        what = f"tracing model_fn and the loss on inputs {describe_avals([struct(v) for v in x_leaves])}"
        raise stage_failure(stage, placement[stage], what, err) from err
    finally:
        del _tracing.passed
    if len(closed.jaxpr.outvars) != 1:
        raise ExecutionError(f"the loss must return one scalar; it returned {len(closed.jaxpr.outvars)} values")
    return closed, p_treedef, len(x_leaves), len(t_leaves)


def marked_model(
    model_fn: Callable[[Any, Any], Any],
    loss: Callable[[Any, Any], Any],
    params: Any,
    inputs: Any,
    targets: Any,
    *,
    num_stages: int,
    placement: Sequence[int],
) -> StagedModel:
    """Cut ``loss(model_fn(params, inputs), targets)`` into stages at its markers.

    ``inputs`` and ``targets`` are one microbatch (arrays or shape structs). Raises
    :class:`ExecutionError` when the markers do not make ``num_stages`` stages.
    """
    closed, p_treedef, n_x, n_t = _trace(model_fn, loss, params, inputs, targets, placement=placement)
    closed = inline_calls(closed)
    jaxpr = closed.jaxpr
    _check_nesting(jaxpr)
    markers = sum(e.primitive is stage_boundary_p for e in jaxpr.eqns)
    if markers + 1 != num_stages:
        raise ExecutionError(
            f"model_fn has {markers} stage_boundary markers, so {markers + 1} stages; the schedule "
            f"has {num_stages} stages: call stage_boundary {num_stages - 1} times"
        )
    n_p = len(jaxpr.invars) - n_x - n_t
    p_vars, x_vars, t_vars = jaxpr.invars[:n_p], jaxpr.invars[n_p : n_p + n_x], jaxpr.invars[n_p + n_x :]
    last = num_stages - 1
    cut = _cut(jaxpr, x_vars, t_vars, last)
    # Per stage, the parameter leaves it reads or owns; per leaf, its owner (the first
    # stage that reads it; stage 0 for a leaf no stage reads).
    param_index = {v: i for i, v in enumerate(p_vars)}
    uses = [sorted(param_index[v] for v in cut.reads[k] if v in param_index) for k in range(num_stages)]
    owner = [next((k for k in range(num_stages) if i in uses[k]), 0) for i in range(n_p)]
    stage_params = [tuple(sorted(set(uses[k]) | {i for i in range(n_p) if owner[i] == k})) for k in range(num_stages)]
    param_avals = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in p_vars)
    check_float_params(param_avals, owner.__getitem__, placement)
    check_loss(cut.outputs[last][0].aval, stage=last, device=placement[last])

    consts = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    functions = tuple(
        _stage_fn(
            eqns=cut.eqns[k],
            alias=cut.alias,
            consts=consts,
            params=tuple(p_vars[i] for i in stage_params[k]),
            inputs=cut.inputs[k],
            targets=tuple(t_vars) if k == last else (),
            outputs=cut.outputs[k],
        )
        for k in range(num_stages)
    )
    return StagedModel(
        functions=functions,
        param_treedef=p_treedef,
        param_avals=param_avals,
        stage_params=tuple(stage_params),
        owner=tuple(owner),
        owned_treedefs=tuple(
            jax.tree_util.tree_structure(tuple(0 for s in owner if s == k)) for k in range(num_stages)
        ),
        input_avals=tuple(
            tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in cut.inputs[k])  # type: ignore[attr-defined]
            for k in range(num_stages)
        ),
        target_avals=tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in t_vars),
    )


class _Cut:
    """The jaxpr divided into stages (see :func:`_cut`)."""

    __slots__ = ("eqns", "alias", "inputs", "outputs", "reads")

    def __init__(
        self,
        eqns: list[list[JaxprEqn]],
        alias: dict[Var, Any],
        inputs: list[tuple[Var, ...]],
        outputs: list[tuple[Any, ...]],
        reads: list[set[Var]],
    ) -> None:
        self.eqns = eqns
        self.alias = alias
        self.inputs = inputs
        self.outputs = outputs
        self.reads = reads


def _cut(jaxpr: Jaxpr, x_vars: Sequence[Var], t_vars: Sequence[Var], last: int) -> _Cut:
    """Assign equations to stages and find what crosses each boundary.

    One pass over the equations finds which stage defines each data-dependent variable,
    which equations are data-free (placed later, where needed), and the last stage that
    reads each variable; marker outputs are aliases of their operands. Then, per stage:
    its equations (the data-free ones it needs first, then its own), its input variables
    (stage 0: the model's inputs), its outputs (the last stage: the loss) and every
    variable its equations read.
    """
    alias: dict[Var, Any] = {}

    def resolve(atom: Any) -> Any:
        while isinstance(atom, Var) and atom in alias:
            atom = alias[atom]
        return atom

    order: dict[Var, int] = {}
    home: dict[Var, int] = {}  # data-dependent variable -> stage that defines it
    for v in x_vars:
        home[v] = 0
        order[v] = len(order)
    for v in t_vars:
        home[v] = last
        order[v] = len(order)
    floating: dict[Var, int] = {}  # data-free variable -> index of its equation
    own: list[list[int]] = [[] for _ in range(last + 1)]
    needed_at: dict[Var, int] = {}
    stage = 0
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is stage_boundary_p:
            stage += 1
            for out, operand in zip(eqn.outvars, eqn.invars, strict=True):
                alias[out] = resolve(operand)
            continue
        ins = [resolve(v) for v in eqn.invars]
        data = [v for v in ins if isinstance(v, Var) and v in home]
        if not data:
            for out in eqn.outvars:
                floating[out] = i
            continue
        for v in data:
            needed_at[v] = max(needed_at.get(v, 0), stage)
        own[stage].append(i)
        for out in eqn.outvars:
            home[out] = stage
            order[out] = len(order)
    loss = resolve(jaxpr.outvars[0])
    if isinstance(loss, Var) and loss in home:
        needed_at[loss] = max(needed_at.get(loss, 0), last)

    def carried(boundary: int) -> tuple[Var, ...]:
        """Data-dependent values defined before stage ``boundary`` and used from it on."""
        live = [v for v, at in needed_at.items() if home[v] < boundary <= at]
        return tuple(sorted(live, key=order.__getitem__))

    inputs = [tuple(x_vars)] + [carried(k) for k in range(1, last + 1)]
    outputs: list[tuple[Any, ...]] = [carried(k + 1) for k in range(last)] + [(loss,)]
    eqns: list[list[JaxprEqn]] = []
    reads: list[set[Var]] = []
    for k in range(last + 1):
        roots = [resolve(v) for i in own[k] for v in jaxpr.eqns[i].invars]
        if k == last:
            roots.append(loss)
        prelude = _floating_closure(jaxpr.eqns, floating, roots, resolve)
        chosen = [jaxpr.eqns[i] for i in prelude + own[k]]
        eqns.append(chosen)
        read_here = {r for e in chosen for v in e.invars if isinstance(r := resolve(v), Var)}
        if k == last and isinstance(loss, Var):
            read_here.add(loss)
        reads.append(read_here)
    return _Cut(eqns, alias, inputs, outputs, reads)


def _floating_closure(
    eqns: Sequence[JaxprEqn],
    floating: dict[Var, int],
    roots: Sequence[Any],
    resolve: Callable[[Any], Any],
) -> list[int]:
    """Indices (in program order) of the data-free equations ``roots`` depend on."""
    chosen: set[int] = set()
    stack = [r for r in roots if isinstance(r, Var) and r in floating]
    while stack:
        i = floating[stack.pop()]
        if i in chosen:
            continue
        chosen.add(i)
        stack.extend(r for v in eqns[i].invars if isinstance(r := resolve(v), Var) and r in floating)
    return sorted(chosen)


def _stage_fn(
    *,
    eqns: Sequence[JaxprEqn],
    alias: dict[Var, Any],
    consts: dict[Var, Any],
    params: tuple[Var, ...],
    inputs: tuple[Var, ...],
    targets: tuple[Var, ...],
    outputs: tuple[Any, ...],
) -> LeafFn:
    def fn(p: tuple[Any, ...], x: tuple[Any, ...], t: tuple[Any, ...]) -> tuple[Any, ...]:
        env = _AliasEnv(alias)
        env.update(consts)
        env.update(zip(params, p, strict=True))
        env.update(zip(inputs, x, strict=True))
        env.update(zip(targets, t, strict=True))
        evaluate(eqns, env)
        return tuple(read(env, v) for v in outputs)

    return fn


def staged_model(
    stages: Sequence[Callable[[Any, Any], Any]] | None,
    model_fn: Callable[[Any, Any], Any] | None,
    loss: Callable[[Any, Any], Any],
    params: Any,
    inputs: Any,
    targets: Any,
    *,
    placement: Sequence[int],
) -> StagedModel:
    """The model cut into stages, from either form a pipeline takes: explicit ``stages``
    (:func:`~pipedsl.executor.stages.model.explicit_model`) or one ``model_fn`` cut at its
    markers (:func:`marked_model`); every backend traces it this way, the Ray backend on the
    driver and in each process alike."""
    if stages is not None:
        return explicit_model(stages, loss, params, inputs, targets, placement=placement)
    assert model_fn is not None  # a pipeline is given one of the two forms
    return marked_model(model_fn, loss, params, inputs, targets, num_stages=len(placement), placement=placement)
