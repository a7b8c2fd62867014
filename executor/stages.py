"""Stages: a model cut into per-stage functions, and each stage's compiled programs.

A :class:`StagedModel` is the common form of both ways to give a model:

- explicit stages, ``f_s(params_s, x) -> y`` plus ``loss(y, targets) -> scalar``
  (:func:`explicit_model`, here);
- one function with ``stage_boundary`` markers (:func:`pipedsl.executor.split.marked_model`).

Either way each stage becomes a function of flat leaves ``(params, x, targets) -> outputs``
(tuples of arrays; ``targets`` is empty except on the last stage, whose single output is
the microbatch loss). :func:`compile_stage` turns one stage into a :class:`StageProgram`:
jit-compiled ``F`` (keeping the residuals its backward needs), ``B``, and the ``I`` and
``W`` halves of :mod:`pipedsl.executor.backward`, each accumulating parameter
gradients in place.

What moves between stages: an activation is the tuple of all of a stage's outputs; a
gradient is the tuple of cotangents of the floating-point ones (integer outputs such as
token ids travel forward but have no cotangent).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var, jaxpr_as_fun
from jax.tree_util import PyTreeDef

from pipedsl.executor.backward import BackwardSplit, split_backward
from pipedsl.executor.errors import ExecutionError, stage_failure
from pipedsl.executor.jaxprs import aval_struct
from pipedsl.executor.mesh import StageLayout

__all__ = ["LeafFn", "StagedModel", "StageProgram", "explicit_model", "compile_stage", "describe_avals"]

Leaves = tuple[Any, ...]
LeafFn = Callable[[Leaves, Leaves, Leaves], Leaves]
"""A stage as a function of flat leaves: ``(params, x, targets) -> outputs``."""


@dataclass(frozen=True, slots=True)
class StagedModel:
    """A model cut into stages, each a function of flat leaves.

    Attributes:
      functions: per stage, its :data:`LeafFn`; the last one returns ``(loss,)``.
      param_treedef: structure of the user's parameters (a list of per-stage pytrees
        for explicit stages).
      param_avals: shape and dtype of every flat parameter leaf.
      stage_params: per stage, the indices of the flat leaves it takes, in order.
      owner: per flat leaf, the stage that owns it: where its optimizer state lives and
        where the gradients of every stage using it are summed.
      owned_treedefs: per stage, the structure its owned leaves (in index order) are
        shown to the optimizer in.
      input_avals: per stage, its input leaves (stage 0: one microbatch of inputs).
      target_avals: the leaves of one microbatch of targets.
    """

    functions: tuple[LeafFn, ...]
    param_treedef: PyTreeDef
    param_avals: tuple[jax.ShapeDtypeStruct, ...]
    stage_params: tuple[tuple[int, ...], ...]
    owner: tuple[int, ...]
    owned_treedefs: tuple[PyTreeDef, ...]
    input_avals: tuple[tuple[jax.ShapeDtypeStruct, ...], ...]
    target_avals: tuple[jax.ShapeDtypeStruct, ...]

    @property
    def num_stages(self) -> int:
        return len(self.functions)

    def owned(self, stage: int) -> tuple[int, ...]:
        """The flat leaves ``stage`` owns, in index order."""
        return tuple(i for i, s in enumerate(self.owner) if s == stage)


def describe_avals(avals: Sequence[Any]) -> str:
    """``f32[4,16], i32[4]``: shapes and dtypes for messages."""
    parts = [f"{jnp.dtype(a.dtype).name}[{','.join(map(str, a.shape))}]" for a in avals]
    return ", ".join(parts) if parts else "nothing"


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def check_float_params(
    avals: Sequence[jax.ShapeDtypeStruct], stage_of: Callable[[int], int], placement: Sequence[int]
) -> None:
    """Every parameter leaf must be floating point: it has a gradient and an update."""
    for i, aval in enumerate(avals):
        if not jnp.issubdtype(aval.dtype, jnp.inexact):
            stage = stage_of(i)
            raise ExecutionError(
                f"parameter leaf {i} of stage {stage} (device {placement[stage]}) has dtype "
                f"{jnp.dtype(aval.dtype).name}; parameters must be floating point (pass integer "
                "data as inputs instead)",
                stage=stage,
                device=placement[stage],
            )


def check_loss(aval: Any, *, stage: int, device: int) -> None:
    if tuple(aval.shape) != () or not jnp.issubdtype(aval.dtype, jnp.floating):
        raise ExecutionError(
            f"the loss (on stage {stage}, device {device}) must be a floating-point scalar; "
            f"it returned {describe_avals([aval])}",
            stage=stage,
            device=device,
        )


def explicit_model(
    stages: Sequence[Callable[[Any, Any], Any]],
    loss: Callable[[Any, Any], Any],
    params: Sequence[Any],
    inputs: Any,
    targets: Any,
    *,
    placement: Sequence[int],
) -> StagedModel:
    """Cut nothing: wrap explicit stage functions as leaf functions.

    ``params`` is the list of per-stage parameter pytrees; ``inputs`` and ``targets``
    are one microbatch (arrays or shape structs). Each stage is traced abstractly on the
    previous stage's output, so a stage that raises or rejects its input shapes is
    reported here, naming the stage and its device, before anything runs.
    """
    if not isinstance(params, (list, tuple)) or len(params) != len(stages):
        got = f"{len(params)} entries" if isinstance(params, (list, tuple)) else type(params).__name__
        raise ExecutionError(
            f"explicit stages take a list of {len(stages)} per-stage parameter pytrees; got {got}"
        )
    param_leaves, param_treedef = jax.tree_util.tree_flatten(list(params))
    param_avals = tuple(_struct(p) for p in param_leaves)
    stage_params: list[tuple[int, ...]] = []
    treedefs: list[PyTreeDef] = []
    start = 0
    for p in params:
        leaves, treedef = jax.tree_util.tree_flatten(p)
        stage_params.append(tuple(range(start, start + len(leaves))))
        treedefs.append(treedef)
        start += len(leaves)
    owner = tuple(s for s, idx in enumerate(stage_params) for _ in idx)
    check_float_params(param_avals, owner.__getitem__, placement)

    x_leaves, x_treedef = jax.tree_util.tree_flatten(inputs)
    t_leaves, t_treedef = jax.tree_util.tree_flatten(targets)
    x_avals = tuple(_struct(x) for x in x_leaves)
    t_avals = tuple(_struct(t) for t in t_leaves)
    last = len(stages) - 1
    functions: list[LeafFn] = []
    input_avals: list[tuple[jax.ShapeDtypeStruct, ...]] = []
    for s, f in enumerate(stages):
        fn, out_treedef = _explicit_fn(f, loss if s == last else None, treedefs[s], x_treedef, t_treedef)
        p_avals = tuple(param_avals[i] for i in stage_params[s])
        source = "the model's inputs" if s == 0 else f"the output of stage {s - 1}"
        what = f"tracing its forward on {source}"
        try:
            out = jax.eval_shape(fn, p_avals, x_avals, t_avals if s == last else ())
        except ExecutionError:
            raise
        except Exception as err:  # a user stage may raise anything while it is traced
            error = stage_failure(s, placement[s], f"{what} ({describe_avals(x_avals)})", err)
            raise error from err
        functions.append(fn)
        input_avals.append(x_avals)
        if s == last:
            check_loss(out[0], stage=s, device=placement[s])
        else:
            x_avals = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out)
            x_treedef = out_treedef()
    return StagedModel(
        functions=tuple(functions),
        param_treedef=param_treedef,
        param_avals=param_avals,
        stage_params=tuple(stage_params),
        owner=owner,
        owned_treedefs=tuple(treedefs),
        input_avals=tuple(input_avals),
        target_avals=t_avals,
    )


def _explicit_fn(
    f: Callable[[Any, Any], Any],
    loss: Callable[[Any, Any], Any] | None,
    p_treedef: PyTreeDef,
    x_treedef: PyTreeDef,
    t_treedef: PyTreeDef,
) -> tuple[LeafFn, Callable[[], PyTreeDef]]:
    """A leaf function for ``f`` (then ``loss`` on the last stage), and a getter for
    the structure of its output, known once it has been traced."""
    seen: list[PyTreeDef] = []

    def fn(p: Leaves, x: Leaves, t: Leaves) -> Leaves:
        y = f(jax.tree_util.tree_unflatten(p_treedef, p), jax.tree_util.tree_unflatten(x_treedef, x))
        if loss is not None:
            return (loss(y, jax.tree_util.tree_unflatten(t_treedef, t)),)
        leaves, treedef = jax.tree_util.tree_flatten(y)
        seen[:] = [treedef]
        return tuple(leaves)

    return fn, lambda: seen[0]


# Where a value the forward returns comes from: computed by the compiled forward, one of
# its inputs passed through (a parameter, an activation), or a constant of the trace.
_COMPUTED, _INPUT, _CONST = 0, 1, 2
_Slot = tuple[int, Any]


def _slot(position: int, atom: Var | Literal, computed: list[int], inputs: dict[Var, int]) -> _Slot:
    """Where output ``position`` (``atom``) of the traced forward comes from; computed
    outputs are numbered in the order they are first met."""
    if isinstance(atom, Literal):
        return (_CONST, atom.val)
    if atom in inputs:
        return (_INPUT, inputs[atom])
    computed.append(position)
    return (_COMPUTED, len(computed) - 1)


def _pick(slot: _Slot, computed: Sequence[Any], inputs: Sequence[Any]) -> Any:
    kind, where = slot
    if kind == _COMPUTED:
        return computed[where]
    if kind == _INPUT:
        return inputs[where]
    return where


class StageProgram:
    """One stage's compiled programs, as the interpreter calls them.

    ``forward`` returns the activation (all outputs), the residuals (a tuple kept in the
    ``RESIDUAL`` buffer; parameters and inputs the backward needs are kept by reference,
    not copied) and, on the last stage, the running loss. ``backward`` and
    ``backward_weight`` add this microbatch's parameter gradients to an accumulator they
    consume (donated: updated in place).

    Every program is jitted for the stage's mesh (``layout``): its arguments arrive
    placed, activations and input gradients leave split over ``"data"``, accumulators
    where ``layout.grads`` keeps them and the loss replicated, so the collectives that
    tensor and data parallelism need are XLA's, inside the programs.
    """

    __slots__ = (
        "stage",
        "first",
        "last",
        "split",
        "_y_slots",
        "_res_slots",
        "_const_res",
        "_num_res",
        "_handoff_refs",
        "_param_avals",
        "_forward",
        "_backward",
        "_input",
        "_weight",
        "_zeros",
        "layout",
    )

    def __init__(
        self,
        *,
        stage: int,
        first: bool,
        last: bool,
        forward: ClosedJaxpr,
        y_slots: tuple[_Slot, ...],
        res_slots: tuple[_Slot, ...],
        computed: tuple[int, ...],
        split: BackwardSplit,
        param_avals: tuple[jax.ShapeDtypeStruct, ...],
        out_avals: tuple[Any, ...],
        ct_avals: tuple[Any, ...],
        layout: StageLayout,
    ) -> None:
        self.stage = stage
        self.layout = layout
        self.first = first
        self.last = last
        self.split = split
        self._y_slots = y_slots
        self._param_avals = param_avals
        # Residuals that are trace constants are baked into the backward, not stored.
        self._const_res = {i: slot[1] for i, slot in enumerate(res_slots) if slot[0] == _CONST}
        self._res_slots = tuple(slot for slot in res_slots if slot[0] != _CONST)
        self._num_res = len(res_slots)
        # What W reads straight from I's inputs: (True, k) is stored residual k, (False,
        # j) is output cotangent j.
        stored_at = {i: k for k, i in enumerate(i for i in range(len(res_slots)) if i not in self._const_res)}
        self._handoff_refs = tuple(
            (True, stored_at[i]) if i < self._num_res else (False, i - self._num_res)
            for i in split.handoff_inputs
            if i not in self._const_res
        )
        run_forward = jaxpr_as_fun(forward)
        const_res = self._const_res

        def forward_fn(p: Leaves, x: Leaves, t: Leaves, loss: Any) -> tuple[Leaves, Any]:
            outs = run_forward(*p, *x, *t)
            values = tuple(outs[i] for i in computed)
            if last:
                return values, loss + outs[0]
            return values, None

        def inputs_of(stored: Leaves, ct: Leaves) -> list[Any]:
            it = iter(stored)
            res = [const_res[i] if i in const_res else next(it) for i in range(self._num_res)]
            return res + list(ct)

        def backward_fn(stored: Leaves, ct: Leaves, acc: Leaves) -> tuple[Leaves, Leaves]:
            param_cts, input_cts = split.full(inputs_of(stored, ct))
            return tuple(input_cts), tuple(a + g for a, g in zip(acc, param_cts, strict=True))

        def input_fn(stored: Leaves, ct: Leaves) -> tuple[Leaves, Leaves]:
            input_cts, handoff = split.input_half(inputs_of(stored, ct))
            return tuple(input_cts), tuple(handoff)

        def weight_fn(handoff: Leaves, refs: Leaves, acc: Leaves) -> Leaves:
            it = iter(refs)
            given = [const_res[i] if i in const_res else next(it) for i in split.handoff_inputs]
            param_cts = split.weight_half(handoff, given)
            return tuple(a + g for a, g in zip(acc, param_cts, strict=True))

        # Activations leave split over "data"; residuals stay where XLA computed them.
        num_y = len(y_slots) if not last else 1
        values_at = tuple(layout.batch(out_avals[i].shape) if i < num_y else None for i in computed)
        cts_at = tuple(layout.batch(a.shape) for a in ct_avals)
        grads_at = layout.grads
        self._forward = jax.jit(
            forward_fn, donate_argnums=3, out_shardings=(values_at, layout.replicated if last else None)
        )
        self._backward = jax.jit(backward_fn, donate_argnums=2, out_shardings=(cts_at, grads_at))
        self._input = jax.jit(input_fn, out_shardings=(cts_at, None)) if split.input_eqns else input_fn
        self._weight = jax.jit(weight_fn, donate_argnums=2, out_shardings=grads_at)
        self._zeros = jax.jit(
            lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in param_avals), out_shardings=grads_at
        )

    def forward(self, params: Leaves, x: Leaves, targets: Leaves, loss: Any) -> tuple[Leaves, Leaves, Any]:
        """``F``: (activation, residuals, running loss) for one microbatch.

        ``loss`` is the running loss (a scalar array, donated) on the last stage, None
        elsewhere; the activation is ``()`` on the last stage.
        """
        computed, loss = self._forward(params, x, targets, loss)
        inputs = (*params, *x, *targets)
        y = tuple(_pick(slot, computed, inputs) for slot in self._y_slots)
        residuals = tuple(_pick(slot, computed, inputs) for slot in self._res_slots)
        return y, residuals, loss

    def backward(self, residuals: Leaves, ct: Leaves, acc: Leaves) -> tuple[Leaves, Leaves]:
        """``B``: (input cotangents, updated accumulator); ``ct`` is ``()`` on the last stage."""
        return self._backward(residuals, ct, acc)

    def backward_input(self, residuals: Leaves, ct: Leaves) -> tuple[Leaves, Leaves]:
        """``I``: (input cotangents, the hand-over to ``W``)."""
        input_cts, computed = self._input(residuals, ct)
        refs = tuple(residuals[k] if stored else ct[k] for stored, k in self._handoff_refs)
        return input_cts, (computed, refs)

    def backward_weight(self, handoff: Leaves, acc: Leaves) -> Leaves:
        """``W``: the accumulator with this microbatch's parameter gradients added."""
        computed, refs = handoff
        return self._weight(computed, refs, acc)

    def zero_grads(self) -> Leaves:
        """A fresh gradient accumulator on the stage's mesh (one dispatch for every leaf)."""
        return self._zeros()


def _is_float(x: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def compile_stage(
    model: StagedModel,
    stage: int,
    *,
    num_microbatches: int,
    remat: bool,
    device: int,
    layout: StageLayout,
) -> StageProgram:
    """Trace stage ``stage`` of ``model`` into its forward and backward programs, for
    the mesh and shardings of ``layout``.

    The last stage's loss is divided by ``num_microbatches`` so that the sum over
    microbatches is the mean. With ``remat``, the forward keeps only its inputs and the
    backward recomputes the rest. ``device`` (the pipeline device) is only for messages.
    """
    fn = model.functions[stage]
    first, last = stage == 0, stage == model.num_stages - 1
    p_avals = tuple(model.param_avals[i] for i in model.stage_params[stage])
    x_avals = model.input_avals[stage]
    t_avals = model.target_avals if last else ()
    diff_x = tuple(not first and jnp.issubdtype(a.dtype, jnp.inexact) for a in x_avals)
    traced: dict[str, Any] = {}

    def fwd(p: Leaves, x: Leaves, t: Leaves) -> tuple[Leaves, Leaves, list[Any]]:
        def g(p: Leaves, xd: Leaves) -> tuple[Leaves, Leaves]:
            it = iter(xd)
            xs = tuple(next(it) if d else v for v, d in zip(x, diff_x, strict=True))
            out = fn(tuple(p), xs, tuple(t))
            if last:
                traced["mask"] = (True,)
                return (out[0] / num_microbatches,), ()
            mask = tuple(_is_float(o) for o in out)
            traced["mask"] = mask
            return tuple(o for o, m in zip(out, mask) if m), tuple(o for o, m in zip(out, mask) if not m)

        body = jax.checkpoint(g) if remat else g
        xd = tuple(v for v, d in zip(x, diff_x, strict=True) if d)
        if first:
            yd, pullback, aux = jax.vjp(lambda p: body(p, ()), tuple(p), has_aux=True)
        else:
            yd, pullback, aux = jax.vjp(body, tuple(p), xd, has_aux=True)
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        traced["pullback"] = treedef
        return yd, aux, leaves

    try:
        forward = jax.make_jaxpr(fwd)(p_avals, x_avals, t_avals)
    except ExecutionError:
        raise
    except Exception as err:  # a user stage may raise anything while it is traced
        raise stage_failure(stage, device, f"tracing its forward on inputs {describe_avals(x_avals)}", err) from err
    mask: tuple[bool, ...] = traced["mask"]
    outvars = forward.jaxpr.outvars
    num_y = len(mask)
    num_yd = sum(mask)
    inputs = {v: i for i, v in enumerate(forward.jaxpr.invars)}
    computed: list[int] = []
    if last:
        # The loss is not an activation: the forward adds it to the running loss.
        y_slots: tuple[_Slot, ...] = ()
    else:
        yd_slots = [_slot(i, outvars[i], computed, inputs) for i in range(num_yd)]
        aux_slots = [_slot(i, outvars[i], computed, inputs) for i in range(num_yd, num_y)]
        yd_it, aux_it = iter(yd_slots), iter(aux_slots)
        y_slots = tuple(next(yd_it) if m else next(aux_it) for m in mask)
    res_vars = outvars[num_y:]
    res_slots = tuple(_slot(num_y + i, v, computed, inputs) for i, v in enumerate(res_vars))

    res_structs = [aval_struct(v.aval) for v in res_vars]
    ct_structs = [aval_struct(v.aval) for v in outvars[:num_yd]] if not last else []
    pullback_def: PyTreeDef = traced["pullback"]

    def bwd(res: list[Any], ct: list[Any]) -> Any:
        pullback = jax.tree_util.tree_unflatten(pullback_def, res)
        if last:
            return pullback((jnp.ones((), outvars[0].aval.dtype),))
        return pullback(tuple(ct))

    try:
        backward = jax.make_jaxpr(bwd)(res_structs, ct_structs)
    except Exception as err:  # differentiation rules of user code may raise
        raise stage_failure(stage, device, "tracing its backward", err) from err
    split = split_backward(backward, num_param_cts=len(p_avals))
    return StageProgram(
        stage=stage,
        first=first,
        last=last,
        forward=forward,
        y_slots=y_slots,
        res_slots=res_slots,
        computed=tuple(computed),
        split=split,
        param_avals=p_avals,
        out_avals=tuple(v.aval for v in outvars),
        ct_avals=tuple(a for a, d in zip(x_avals, diff_x, strict=True) if d),
        layout=layout,
    )
