"""One stage's compiled programs: ``F``, ``B`` and the ``I``/``W`` halves, on its mesh.

:func:`compile_stage` traces stage ``s`` of a :class:`~pipedsl.executor.stages.model.StagedModel`
into a forward that keeps the residuals its backward needs and a backward split into the
input half and the weight half (:mod:`pipedsl.executor.stages.backward`), and jits each for the
stage's mesh (:class:`~pipedsl.executor.stages.mesh.StageLayout`). A :class:`StageProgram` is what
the interpreter calls.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Literal, Var, jaxpr_as_fun
from jax.tree_util import PyTreeDef

from pipedsl.executor.errors import ExecutionError, stage_failure
from pipedsl.executor.stages.backward import BackwardSplit, split_backward
from pipedsl.executor.stages.jaxprs import aval_struct, calls_host
from pipedsl.executor.stages.mesh import StageLayout, data_size
from pipedsl.executor.stages.model import StagedModel, describe_avals
from pipedsl.executor.stages.packing import Packing
from pipedsl.executor.stages.shards import DataShards, stage_forms
from pipedsl.executor.stages.stage_options import StageOptions, tracing

__all__ = ["StageMemory", "StageProgram", "compile_stage"]

Leaves = tuple[Any, ...]


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


def _picker(slots: Sequence[_Slot], *, num_computed: int, num_inputs: int) -> _Picker:
    """A function ``(computed, params, x, targets) -> values of slots``, worked out once:
    each value is taken by position from the computed outputs, the inputs
    ``(*params, *x, *targets)`` (``num_inputs`` of them) or the trace's constants."""
    consts = tuple(where for kind, where in slots if kind == _CONST)
    positions, k = [], 0
    for kind, where in slots:
        if kind == _COMPUTED:
            positions.append(where)
        elif kind == _INPUT:
            positions.append(num_computed + where)
        else:
            positions.append(num_computed + num_inputs + k)
            k += 1
    take = _getter(positions)
    if all(kind == _COMPUTED for kind, _ in slots):
        return lambda computed, p, x, t: take(computed)
    return lambda computed, p, x, t: take((*computed, *p, *x, *t, *consts))


_Picker = Callable[[Sequence[Any], Leaves, Leaves, Leaves], Leaves]


def _getter(positions: Sequence[int]) -> Callable[[Sequence[Any]], Leaves]:
    """``lambda pool: tuple(pool[i] for i in positions)``, at the cost of one C call."""
    if not positions:
        return lambda pool: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda pool: (pool[i],)
    return itemgetter(*positions)


@dataclass(frozen=True, slots=True)
class _Boundary:
    """How the values a stage keeps between its actions cross its programs' boundaries.

    Attributes:
      stored: per stored value, where ``F`` gives it: a computed result or one of its
        arguments (held by reference), as a slot.
      refs: per value ``W`` reads from ``I``'s arguments, (True, k) stored value k or
        (False, j) output cotangent j.
      pick_y: the activation, from ``F``'s results and arguments.
      pick_res: the stored values, from ``F``'s results and arguments.
      pick_refs: what ``W`` reads from ``I``'s arguments (``refs``).
    """

    stored: tuple[_Slot, ...]
    refs: tuple[tuple[bool, int], ...]
    pick_y: _Picker
    pick_res: _Picker
    pick_refs: Callable[[Sequence[Any]], Leaves]

    @staticmethod
    def of(
        y_slots: tuple[_Slot, ...],
        stored: tuple[_Slot, ...],
        refs: tuple[tuple[bool, int], ...],
        *,
        num_computed: int,
        num_inputs: int,
    ) -> _Boundary:
        """The boundary of an ``F`` with ``num_computed`` results and ``num_inputs``
        arguments, whose activation is ``y_slots`` and whose stored values are ``stored``."""
        sizes = {"num_computed": num_computed, "num_inputs": num_inputs}
        return _Boundary(
            stored=stored,
            refs=refs,
            pick_y=_picker(y_slots, **sizes),
            pick_res=_picker(stored, **sizes),
            pick_refs=_getter([k if from_stored else len(stored) + k for from_stored, k in refs]),
        )

    @property
    def computed(self) -> tuple[bool, ...]:
        """Per stored value, whether ``F`` computed it (else it is one of its arguments)."""
        return tuple(kind == _COMPUTED for kind, _ in self.stored)

    @property
    def stored_from(self) -> tuple[int | None, ...]:
        """Per stored value, which of ``F``'s arguments it is, None for one it computes."""
        return tuple(None if kind == _COMPUTED else where for kind, where in self.stored)


@dataclass(frozen=True, slots=True)
class _ResidualPacking:
    """How a stage's programs pass its residuals and ``I``'s hand-over to ``W`` packed
    (:class:`~pipedsl.executor.stages.packing.Packing`), around the plain programs that
    take them one by one.

    The stored residuals are ``(*kept buffers, *read_by_w buffers, *passed)``: the computed
    residuals ``W`` does not read, those it reads (packed apart, so that between ``I`` and
    ``W`` a microbatch holds no more than ``W`` reads), then those that are ``F``'s
    arguments, each as it is (held by reference, never copied). ``W`` reads
    ``(*read_by_w buffers, *its other references)``.

    Attributes:
      kept, read_by_w: the packings of the computed residuals ``W`` does not read, and reads.
      kept_from, read_from: their positions among ``F``'s computed outputs.
      passed: the residuals that are ``F``'s arguments, as slots.
      order: per residual in the plain order, where it is: ``(0, i)`` the i-th of ``kept``,
        ``(1, i)`` of ``read_by_w``, ``(2, i)`` of ``passed``.
      plain_refs: what ``W`` reads, as the plain programs take it (:attr:`_Boundary.refs`).
      ref_order: per plain reference, ``(0, i)`` the i-th of ``read_by_w`` or ``(1, j)``
        the j-th other reference.
      handed: the packing of what ``I`` computes for ``W``.
    """

    kept: Packing
    kept_from: tuple[int, ...]
    read_by_w: Packing
    read_from: tuple[int, ...]
    passed: tuple[_Slot, ...]
    order: tuple[tuple[int, int], ...]
    plain_refs: tuple[tuple[bool, int], ...]
    ref_order: tuple[tuple[int, int], ...]
    handed: Packing

    @staticmethod
    def of(
        res_slots: tuple[_Slot, ...],
        refs: tuple[tuple[bool, int], ...],
        *,
        computed_avals: Sequence[Any],
        handed_avals: Sequence[Any],
    ) -> _ResidualPacking:
        """The packing of residuals ``res_slots`` (computed ones index ``computed_avals``,
        the avals of ``F``'s computed outputs), of which ``W`` reads ``refs``, and of a
        hand-over shaped ``handed_avals``."""
        read = {k for stored, k in refs if stored and res_slots[k][0] == _COMPUTED}
        kept_from: list[int] = []
        read_from: list[int] = []
        passed: list[_Slot] = []
        order: list[tuple[int, int]] = []
        for r, slot in enumerate(res_slots):
            if slot[0] != _COMPUTED:
                order.append((2, len(passed)))
                passed.append(slot)
            elif r in read:
                order.append((1, len(read_from)))
                read_from.append(slot[1])
            else:
                order.append((0, len(kept_from)))
                kept_from.append(slot[1])
        ref_order: list[tuple[int, int]] = []
        others = 0
        for stored, k in refs:
            if stored and order[k][0] == 1:
                ref_order.append((0, order[k][1]))
            else:
                ref_order.append((1, others))
                others += 1
        return _ResidualPacking(
            kept=Packing.of([computed_avals[i] for i in kept_from]),
            kept_from=tuple(kept_from),
            read_by_w=Packing.of([computed_avals[i] for i in read_from]),
            read_from=tuple(read_from),
            passed=tuple(passed),
            order=tuple(order),
            plain_refs=refs,
            ref_order=tuple(ref_order),
            handed=Packing.of(handed_avals),
        )

    def boundary(self, y_slots: tuple[_Slot, ...], *, num_sent: int, num_inputs: int) -> _Boundary:
        """The boundary of programs that ``F`` returns ``(*activation, *residual buffers)``
        (``num_sent`` computed activation values)."""
        packs = len(self.kept) + len(self.read_by_w)
        stored = tuple((_COMPUTED, num_sent + i) for i in range(packs)) + self.passed
        others = (
            (True, packs + self.order[k][1]) if from_stored else (False, k)
            for (from_stored, k), (where, _) in zip(self.plain_refs, self.ref_order, strict=True)
            if where == 1
        )
        refs = tuple((True, len(self.kept) + i) for i in range(len(self.read_by_w))) + tuple(others)
        return _Boundary.of(y_slots, stored, refs, num_computed=num_sent + packs, num_inputs=num_inputs)

    def functions(self, plain: tuple[Any, Any, Any, Any], *, num_sent: int, last: bool) -> tuple[Any, Any, Any, Any]:
        """``F``, ``B``, ``I`` and ``W`` taking and returning packed values, around the
        ``plain`` ones of :func:`_step_functions`."""
        forward_fn, backward_fn, input_fn, weight_fn = plain
        kept, read_by_w, handed = self.kept, self.read_by_w, self.handed

        def packed(values: Leaves) -> Leaves:
            return (
                *values[:num_sent],
                *kept.pack([values[i] for i in self.kept_from]),
                *read_by_w.pack([values[i] for i in self.read_from]),
            )

        def stored(values: Leaves) -> Leaves:
            k, w = len(kept), len(read_by_w)
            parts = (kept.unpack(values[:k]), read_by_w.unpack(values[k : k + w]), values[k + w :])
            return tuple(parts[where][i] for where, i in self.order)

        def forward_values(p: Leaves, x: Leaves, t: Leaves) -> Leaves:
            return packed(forward_fn(p, x, t))

        def forward_loss(p: Leaves, x: Leaves, t: Leaves, loss: Any) -> tuple[Leaves, Any]:
            values, loss = forward_fn(p, x, t, loss)
            return packed(values), loss

        def backward(res: Leaves, ct: Leaves, acc: Leaves) -> tuple[Leaves, Leaves]:
            return backward_fn(stored(res), ct, acc)

        def input_half(res: Leaves, ct: Leaves) -> tuple[Leaves, Leaves]:
            input_cts, handoff = input_fn(stored(res), ct)
            return input_cts, handed.pack(handoff)

        def weight_half(handoff: Leaves, refs: Leaves, acc: Leaves) -> Leaves:
            w = len(read_by_w)
            parts = (read_by_w.unpack(refs[:w]), refs[w:])
            plain_refs = tuple(parts[where][i] for where, i in self.ref_order)
            return weight_fn(handed.unpack(handoff), plain_refs, acc)

        return forward_loss if last else forward_values, backward, input_half, weight_half


class StageProgram:
    """One stage's compiled programs, as the interpreter calls them.

    ``forward`` returns the activation (all outputs), the residuals (a tuple kept in the
    ``RESIDUAL`` buffer; parameters and inputs the backward needs are kept by reference,
    not copied) and, on the last stage, the running loss. ``backward`` and
    ``backward_weight`` add this microbatch's parameter gradients to an accumulator they
    consume (donated: updated in place). With ``packed`` the residuals it computes and
    ``I``'s hand-over to ``W`` travel packed, a few buffers rather than one each
    (:mod:`pipedsl.executor.stages.packing`): the host handles every buffer at every
    dispatch.

    Every program is jitted for the stage's mesh (``layout``): its arguments arrive
    placed, activations and input gradients leave split over ``"data"``, accumulators
    where ``layout.accumulators`` keeps them and the loss replicated, so the collectives
    that tensor and data parallelism need are XLA's, inside the programs. With ``dp > 1``
    each program runs on every device's share of the microbatch
    (:mod:`pipedsl.executor.stages.shards`); :meth:`reduce_grads` then reduces what ZeRO 0 and 1
    accumulate unreduced, once per step.
    """

    __slots__ = (
        "stage",
        "first",
        "last",
        "split",
        "_res_slots",
        "_const_res",
        "_num_res",
        "_handoff_refs",
        "_boundary",
        "_plain_boundary",
        "_param_avals",
        "_master_avals",
        "_cast",
        "_squares",
        "_finite",
        "_forward",
        "_backward",
        "_input",
        "_weight",
        "_zeros",
        "_zero_loss",
        "_reduce",
        "layout",
        "_structs",
        "_num_sent",
        "_plain",
        "calls_host",
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
        master_avals: tuple[jax.ShapeDtypeStruct, ...],
        out_avals: tuple[Any, ...],
        ct_avals: tuple[Any, ...],
        layout: StageLayout,
        example: tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]],
        packed: bool,
    ) -> None:
        self.stage = stage
        self.layout = layout
        # Whether the stage calls back into Python on the host: inside one program over
        # several devices, a callback that raises aborts the whole process (XLA, jax 0.10).
        self.calls_host = calls_host(forward)
        # (inputs, targets, output cotangents) of one microbatch, for compiled_hlo.
        self._structs = example
        self.first = first
        self.last = last
        self.split = split
        self._param_avals = param_avals
        self._master_avals = master_avals
        self._squares: Any = None
        self._finite: Any = None
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
        num_inputs = len(param_avals) + sum(map(len, example[:2]))
        self._plain_boundary = _Boundary.of(
            y_slots, self._res_slots, self._handoff_refs, num_computed=len(computed), num_inputs=num_inputs
        )
        self._jit(
            forward, y_slots=y_slots, computed=computed, out_avals=out_avals, ct_avals=ct_avals,
            num_inputs=num_inputs, packed=packed,
        )  # fmt: skip

    def _jit(
        self,
        forward: ClosedJaxpr,
        *,
        y_slots: tuple[_Slot, ...],
        computed: tuple[int, ...],
        out_avals: Any,
        ct_avals: Any,
        num_inputs: int,
        packed: bool,
    ) -> None:
        """Compile ``F``, ``B``, ``I``, ``W`` and the accumulators' programs for the mesh."""
        layout, split, last = self.layout, self.split, self.last
        shards = DataShards(layout)
        plain = _step_functions(
            forward, split, computed=computed, const_res=self._const_res, num_res=self._num_res, last=last,
            shards=shards,
        )  # fmt: skip
        self._plain = plain
        activations = 0 if last else len(y_slots)
        # The computed outputs of F that are its activation (they come first).
        self._num_sent = sum(1 for i in computed if i < activations)
        if packed:
            packing = _ResidualPacking.of(
                self._res_slots, self._handoff_refs,
                computed_avals=[out_avals[i] for i in computed], handed_avals=[v.aval for v in split.handoff_computed],
            )  # fmt: skip
            functions = packing.functions(plain, num_sent=self._num_sent, last=last)
            self._boundary = packing.boundary(y_slots, num_sent=self._num_sent, num_inputs=num_inputs)
            num_handoff = len(packing.handed)
        else:
            functions = plain
            self._boundary = self._plain_boundary
            num_handoff = len(split.handoff_computed)
        # F returns its activation's computed values, then the stored values it computes.
        num_kept = sum(self._boundary.computed)
        forward_fn, backward_fn, input_fn, weight_fn = functions
        forms = stage_forms(
            shards,
            num_params=len(self._param_avals),
            num_x=len(self._structs[0]),
            num_t=len(self._structs[1]),
            num_cts=len(self._structs[2]),
            num_input_cts=len(ct_avals),
            num_sent=self._num_sent,
            stored_from=self._boundary.stored_from,
            num_handoff=num_handoff,
            handoff_refs=self._boundary.refs,
        )
        # Activations leave split over "data"; residuals stay where XLA computed them.
        values_at = (
            tuple(layout.batch(_whole(out_avals[i], shards.dp).shape) for i in computed[: self._num_sent])
            + (None,) * num_kept
        )
        cts_at = tuple(layout.batch(a.shape) for a in ct_avals)
        acc_at = layout.accumulators
        self._forward = jax.jit(
            shards.program(forward_fn, forms.forward_in(last), forms.forward_out(last)),
            donate_argnums=3 if last else (), out_shardings=(values_at, layout.replicated) if last else values_at,
        )  # fmt: skip
        self._backward = jax.jit(
            shards.program(backward_fn, (forms.stored, forms.cts, forms.acc), (forms.input_cts, forms.acc)),
            donate_argnums=2, out_shardings=(cts_at, acc_at),
        )  # fmt: skip
        # Without equations, I only passes values on: nothing to compile unless each
        # device's share must be taken or the values come packed.
        input_program = shards.program(input_fn, (forms.stored, forms.cts), (forms.input_cts, forms.handoff))
        self._input = (
            jax.jit(input_program, out_shardings=(cts_at, None))
            if split.input_eqns or shards.split or packed
            else input_fn
        )
        self._weight = jax.jit(
            shards.program(weight_fn, (forms.handoff, forms.refs, forms.acc), forms.acc),
            donate_argnums=2, out_shardings=acc_at,
        )  # fmt: skip
        # Gradients accumulate in the master weights' dtype (fp32 under bf16 compute).
        acc_shapes = tuple((shards.dp, *a.shape) if layout.unreduced else a.shape for a in self._master_avals)
        dtypes = tuple(a.dtype for a in self._master_avals)
        compute = tuple(a.dtype for a in self._param_avals)
        self._cast = (
            jax.jit(lambda *p: tuple(v.astype(d) for v, d in zip(p, compute, strict=True)), out_shardings=layout.params)
            if compute != tuple(a.dtype for a in self._master_avals)
            else None
        )
        self._zeros = jax.jit(
            lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype in zip(acc_shapes, dtypes, strict=True)),
            out_shardings=acc_at,
        )
        self._zero_loss = jax.jit(lambda: jnp.zeros((), jnp.float32), out_shardings=layout.replicated)
        self._reduce = jax.jit(shards.reduce(), out_shardings=layout.grads) if layout.unreduced else None

    def inlined(self) -> StageProgram:
        """This stage's programs as the plain functions they jit, to be traced into a
        program of the caller's (one SPMD program over the pipeline devices,
        :mod:`pipedsl.executor.local.ticked`): the same computations, with the same
        arguments and results, unplaced. Only for a stage of one JAX device (``dp = 1``,
        whose functions take the whole microbatch)."""
        if DataShards(self.layout).split:
            raise ExecutionError(f"stage {self.stage} runs over dp > 1 devices: its programs cannot be inlined")
        inlined = object.__new__(StageProgram)
        for name in StageProgram.__slots__:
            if hasattr(self, name):
                setattr(inlined, name, getattr(self, name))
        inlined._forward, inlined._backward, inlined._input, inlined._weight = self._plain
        inlined._boundary = self._plain_boundary
        compute = tuple(a.dtype for a in self._param_avals)
        shapes = tuple(a.shape for a in self._master_avals)
        dtypes = tuple(a.dtype for a in self._master_avals)

        def cast(*p: Any) -> Leaves:
            return tuple(v.astype(d) for v, d in zip(p, compute, strict=True))

        def zeros() -> Leaves:
            return tuple(jnp.zeros(shape, d) for shape, d in zip(shapes, dtypes, strict=True))

        def zero_loss() -> Any:
            return jnp.zeros((), jnp.float32)

        plain: Any = (None if self._cast is None else cast, zeros, zero_loss)
        inlined._cast, inlined._zeros, inlined._zero_loss = plain
        return inlined

    def parameter_residuals(self) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
        """Which values the stage keeps between its actions are its parameters passed
        through (in the compute dtype), not computed: per residual ``forward`` returns, and
        per value ``backward_input`` hands to ``W`` besides those it computes (the hand-over's
        second part), the parameter's position among the stage's, or None. A caller that
        holds the parameters anyway need not keep these per microbatch."""
        num_params = len(self._param_avals)
        res = tuple(where if kind == _INPUT and where < num_params else None for kind, where in self._res_slots)
        refs = tuple(res[k] if stored else None for stored, k in self._handoff_refs)
        return res, refs

    def one_microbatch(self) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
        """Shape structs of one microbatch's (inputs, targets, output cotangents) of the
        stage, whole (not split over ``"data"``)."""
        return self._structs

    def forward(self, params: Leaves, x: Leaves, targets: Leaves, loss: Any) -> tuple[Leaves, Leaves, Any]:
        """``F``: (activation, residuals, running loss) for one microbatch.

        ``loss`` is the running loss (a scalar array, donated) on the last stage, None
        elsewhere; the activation is ``()`` on the last stage.
        """
        if self.last:
            computed, loss = self._forward(params, x, targets, loss)
        else:
            computed = self._forward(params, x, targets)
        at = self._boundary
        return at.pick_y(computed, params, x, targets), at.pick_res(computed, params, x, targets), loss

    def backward(self, residuals: Leaves, ct: Leaves, acc: Leaves) -> tuple[Leaves, Leaves]:
        """``B``: (input cotangents, updated accumulator); ``ct`` is ``()`` on the last stage."""
        return self._backward(residuals, ct, acc)

    def backward_input(self, residuals: Leaves, ct: Leaves) -> tuple[Leaves, Leaves]:
        """``I``: (input cotangents, the hand-over to ``W``)."""
        input_cts, computed = self._input(residuals, ct)
        return input_cts, (computed, self._boundary.pick_refs((*residuals, *ct)))

    def backward_weight(self, handoff: Leaves, acc: Leaves) -> Leaves:
        """``W``: the accumulator with this microbatch's parameter gradients added."""
        computed, refs = handoff
        return self._weight(computed, refs, acc)

    def compiled_hlo(self) -> dict[str, str]:
        """The optimized HLO text of ``F`` and ``B`` as XLA compiled them for this stage's
        mesh and one microbatch (``jit(...).lower(...).compile().as_text()``), and of the
        once-per-step reduction (``"reduce"``, empty when gradients accumulate reduced):
        where the collectives of tensor and data parallelism are, for inspection and tests."""
        forward, backward, reduce = self._compiled()
        return {
            "F": forward.as_text() or "",
            "B": backward.as_text() or "",
            "reduce": "" if reduce is None else reduce.as_text() or "",
        }

    def memory(self) -> StageMemory:
        """Bytes per JAX device of the stage's compiled ``F`` and ``B`` for one microbatch,
        from XLA's memory analysis of the compiled programs."""
        forward, backward, _ = self._compiled()
        f, b = self._analysis(forward), self._analysis(backward)
        params = sum(_bytes(a, s) for a, s in zip(self._master_avals, self.layout.params, strict=True))
        return StageMemory(
            kept=self._kept(forward, f),
            weight_kept=self.weight_kept(),
            forward_temp=int(f.temp_size_in_bytes),
            backward_temp=int(b.temp_size_in_bytes),
            params=params,
            backward_peak=int(
                b.argument_size_in_bytes + b.output_size_in_bytes + b.temp_size_in_bytes - b.alias_size_in_bytes
            ),
        )

    def kept(self) -> int:
        """:attr:`StageMemory.kept` alone: the bytes per JAX device that ``F`` keeps for the
        backward of one microbatch, compiling ``F`` only (:meth:`memory` compiles ``B`` too)."""
        forward = self._compiled_forward()[0]
        return self._kept(forward, self._analysis(forward))

    def weight_kept(self) -> int:
        """:attr:`StageMemory.weight_kept` alone: the bytes per JAX device that ``I`` leaves
        for ``W`` of one microbatch, compiling ``F`` and ``I``: what ``I`` computes and
        hands over (the cotangents of the weight products' outputs, and of the norms'),
        and the residuals and output cotangents ``W`` reads as they are (the products'
        inputs), which stay held by reference once ``I``'s other inputs are freed.
        Parameters and the stage's inputs it reads are kept by reference and not counted."""
        residuals = self._compiled_forward()[1]
        cts = self._batched(self._structs[2])
        handed = 0
        if hasattr(self._input, "lower"):  # a program with equations (else I only passes values on)
            compiled = self._input.lower(residuals, cts).compile()
            infos = jax.tree_util.tree_leaves(compiled.out_info[1])
            shardings = jax.tree_util.tree_leaves(compiled.output_shardings[1])
            handed = sum(_bytes(i, at) for i, at in zip(infos, shardings, strict=True))
        referenced = 0
        computed = self._boundary.computed
        for stored, k in self._boundary.refs:
            if stored and not computed[k]:
                continue  # a parameter or an input, kept by reference whatever W reads
            value = residuals[k] if stored else cts[k]
            referenced += _bytes(value, value.sharding)
        return handed + referenced

    def _analysis(self, compiled: Any) -> Any:
        found = compiled.memory_analysis()
        if found is None:
            raise ExecutionError(f"XLA gives no memory analysis of stage {self.stage}'s programs on this platform")
        return found

    def _kept(self, forward: Any, analysis: Any) -> int:
        """What compiled ``F`` keeps: its outputs less the activation it sends on."""
        return int(analysis.output_size_in_bytes) - self._activation_bytes(forward)

    def _activation_bytes(self, forward: Any) -> int:
        """Bytes per device of what ``F`` sends on (its activation): the rest of its
        output is what it keeps for the backward."""
        if self.last:
            return 4  # the running loss
        infos = jax.tree_util.tree_leaves(forward.out_info)
        shardings = jax.tree_util.tree_leaves(forward.output_shardings)
        pairs = list(zip(infos, shardings, strict=True))[: self._num_sent]
        return sum(_bytes(i, s) for i, s in pairs)

    def _compiled_forward(self) -> tuple[Any, Leaves]:
        """``F`` lowered and compiled for one microbatch, and the residuals it keeps as
        shape structs with their shardings, for lowering ``B``."""
        layout = self.layout
        x_avals, t_avals, _ = self._structs
        p = _at(self._param_avals, layout.params)
        x, t = self._batched(x_avals), self._batched(t_avals)
        if self.last:
            loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=layout.replicated)
            forward = self._forward.lower(p, x, t, loss).compile()
            out_info, out_at = forward.out_info[0], forward.output_shardings[0]
        else:
            forward = self._forward.lower(p, x, t).compile()
            out_info, out_at = forward.out_info, forward.output_shardings
        values = jax.tree_util.tree_map(
            lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding), out_info, out_at
        )
        return forward, self._boundary.pick_res(values, p, x, t)

    def _batched(self, avals: Sequence[Any]) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shape structs of microbatch values ``avals``, split over ``"data"`` as the stage takes them."""
        return _at(avals, [self.layout.batch(a.shape) for a in avals])

    def _compiled(self) -> tuple[Any, Any, Any]:
        """``F``, ``B`` and the reduction (None when gradients accumulate reduced),
        lowered and compiled for one microbatch."""
        forward, residuals = self._compiled_forward()
        ct = self._batched(self._structs[2])
        acc = self.zero_grads()
        backward = self._backward.lower(residuals, ct, acc).compile()
        reduce = None if self._reduce is None else self._reduce.lower(acc).compile()
        return forward, backward, reduce

    @property
    def casts(self) -> bool:
        """Whether :meth:`compute_params` makes a copy (the stage computes in another dtype
        than its master weights'), rather than returning the leaves themselves."""
        return self._cast is not None

    def compute_params(self, params: Leaves) -> Leaves:
        """The stage's parameter leaves (the master weights) as its programs take them: in
        the compute dtype (one bf16 copy per step under bf16, as Megatron-LM keeps one),
        the leaves themselves in fp32."""
        return params if self._cast is None else self._cast(*params)

    def sum_of_squares(self, values: Sequence[Any]) -> jax.Array:
        """The sum of the squares of every entry of ``values`` (gradient leaves on this
        stage's mesh), an fp32 scalar replicated on the mesh: one device's part of a global norm."""
        if self._squares is None:

            def squares(*leaves: Any) -> Any:
                return sum((jnp.sum(jnp.square(v.astype(jnp.float32))) for v in leaves), jnp.zeros((), jnp.float32))

            self._squares = jax.jit(squares, out_shardings=self.layout.replicated)
        return self._squares(*values)

    def all_finite(self, values: Sequence[Any]) -> jax.Array:
        """Whether every entry of ``values`` (arrays on this stage's mesh) is finite: a bool
        scalar replicated on the mesh."""
        if self._finite is None:

            def finite(*leaves: Any) -> Any:
                return jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in leaves] or [jnp.bool_(True)]))

            self._finite = jax.jit(finite, out_shardings=self.layout.replicated)
        return self._finite(*values)

    def zero_loss(self) -> jax.Array:
        """A zero running loss for the last stage's ``F``, replicated on its mesh."""
        return self._zero_loss()

    def zero_grads(self) -> Leaves:
        """A fresh gradient accumulator on the stage's mesh (one dispatch for every leaf)."""
        return self._zeros()

    def reduce_grads(self, acc: Leaves) -> Leaves:
        """The step's gradients from its accumulator (consumed): reduced over ``"data"``
        where they accumulated unreduced, into ``layout.grads``; else ``acc`` itself."""
        return acc if self._reduce is None else self._reduce(acc)


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Bytes per JAX device of one stage's compiled programs for one microbatch (XLA's
    memory analysis).

    Attributes:
      kept: what ``F`` keeps for the backward (its outputs less the activation it sends
        on): the activation memory of one in-flight microbatch, the quantity recompute
        modes trade. Parameters and inputs the backward reads are kept by reference and
        not counted.
      weight_kept: what ``I`` leaves for ``W`` (:meth:`StageProgram.weight_kept`): the
        activation memory of one microbatch between its ``I`` and its ``W``.
      forward_temp, backward_temp: XLA's scratch while ``F`` / ``B`` run.
      params: the stage's parameters on one device.
      backward_peak: ``B``'s arguments, outputs and scratch, less what it updates in place.
    """

    kept: int
    weight_kept: int
    forward_temp: int
    backward_temp: int
    params: int
    backward_peak: int


def _at(avals: Sequence[Any], shardings: Sequence[Any]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shape structs of ``avals`` laid out by ``shardings``, for lowering a program ahead."""
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(avals, shardings, strict=True))


def _bytes(aval: Any, sharding: Any) -> int:
    """Bytes of one device's share of a value of shape and dtype ``aval`` laid out by ``sharding``."""
    shape = sharding.shard_shape(tuple(aval.shape)) if sharding is not None else tuple(aval.shape)
    return int(math.prod(shape)) * jnp.dtype(aval.dtype).itemsize


def _is_float(x: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def compile_stage(
    model: StagedModel,
    stage: int,
    *,
    num_microbatches: int,
    options: StageOptions,
    device: int,
    layout: StageLayout,
) -> StageProgram:
    """Trace stage ``stage`` of ``model`` into its forward and backward programs, for
    the mesh and shardings of ``layout``.

    The last stage's loss is divided by ``num_microbatches`` (and by ``dp``, as each
    device computes it on its share) so that the sum over microbatches is the mean.
    ``options`` say what the backward recomputes, the precision, sequence parallelism and
    whether residuals travel packed (:mod:`pipedsl.executor.stages.stage_options`). ``device`` (the pipeline device) is only for messages.
    """
    first, last = stage == 0, stage == model.num_stages - 1
    dp = data_size(layout.mesh)
    master_avals = tuple(model.param_avals[i] for i in model.stage_params[stage])
    p_avals = options.in_compute_dtype(master_avals)
    # The model's avals are one device's share of a microbatch (all of it when dp = 1).
    x_avals = model.input_avals[stage] if first else options.in_compute_dtype(model.input_avals[stage])
    t_avals = model.target_avals if last else ()
    _check_splittable(x_avals, dp, stage)
    diff_x = tuple(not first and jnp.issubdtype(a.dtype, jnp.inexact) for a in x_avals)
    key = (
        model.functions[stage], diff_x, first, last, options, num_microbatches * dp, layout.mesh,
        p_avals, x_avals, t_avals,
    )  # fmt: skip
    found = _TRACES.get(key)
    if found is None:
        found = _trace(key, stage=stage, device=device)
        _TRACES[key] = found
        if len(_TRACES) > _TRACES_SIZE:
            _TRACES.popitem(last=False)
    else:
        _TRACES.move_to_end(key)
    forward, mask, split = found
    y_slots, res_slots, computed = _output_slots(forward, mask, last=last)
    outvars = forward.jaxpr.outvars
    ct_structs = [aval_struct(v.aval) for v in outvars[: sum(mask)]] if not last else []
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
        master_avals=master_avals,
        out_avals=tuple(v.aval for v in outvars),
        ct_avals=tuple(_whole(a, dp) for a, d in zip(x_avals, diff_x, strict=True) if d),
        layout=layout,
        example=(
            tuple(_whole(a, dp) for a in x_avals),
            tuple(_whole(a, dp) for a in t_avals),
            tuple(_whole(c, dp) for c in ct_structs),
        ),
        packed=_packs(options, layout),
    )


def _packs(options: StageOptions, layout: StageLayout) -> bool:
    """Whether the stage's residuals travel packed (``RunOptions.pack_residuals``). Never
    over a ``"tensor"`` or ``"context"`` axis: there XLA lays a residual out over the axis,
    and packing would gather it."""
    if layout.mesh.size != data_size(layout.mesh):
        return False
    if options.pack_residuals is not None:
        return options.pack_residuals
    return bool(layout.mesh.devices.flat[0].platform != "cpu")


# Traced stages, by what their trace depends on: (the stage's function, which inputs are
# differentiated, first, last, options, loss scale, mesh, parameter, input and target
# avals). Stages of one function on the same shapes (a transformer's middle stages) are
# traced once; least recently used entries are dropped beyond this many.
_TRACES: OrderedDict[tuple[Any, ...], tuple[ClosedJaxpr, tuple[bool, ...], BackwardSplit]] = OrderedDict()
_TRACES_SIZE = 64


def _trace(key: tuple[Any, ...], *, stage: int, device: int) -> tuple[ClosedJaxpr, tuple[bool, ...], BackwardSplit]:
    """Stage ``stage``'s forward jaxpr, the float mask of its outputs and its backward
    split in halves, traced as ``key`` (of :data:`_TRACES`) says."""
    fn, diff_x, first, last, options, loss_scale, mesh, p_avals, x_avals, t_avals = key
    fwd, traced = _forward_fn(fn, diff_x, first=first, last=last, options=options, loss_scale=loss_scale)
    try:
        with tracing(mesh, options):
            forward = jax.make_jaxpr(fwd)(p_avals, x_avals, t_avals)
    except ExecutionError:
        raise
    except Exception as err:  # a user stage may raise anything while it is traced
        raise stage_failure(stage, device, f"tracing its forward on inputs {describe_avals(x_avals)}", err) from err
    mask: tuple[bool, ...] = traced["mask"]
    outvars = forward.jaxpr.outvars
    res_structs = [aval_struct(v.aval) for v in outvars[len(mask) :]]
    ct_structs = [aval_struct(v.aval) for v in outvars[: sum(mask)]] if not last else []
    try:
        backward = _backward_jaxpr(traced["pullback"], res_structs, ct_structs, loss=outvars[0].aval if last else None)
    except Exception as err:  # differentiation rules of user code may raise
        raise stage_failure(stage, device, "tracing its backward", err) from err
    return forward, mask, split_backward(backward, num_param_cts=len(p_avals))


def _check_splittable(x_avals: Sequence[Any], dp: int, stage: int) -> None:
    if dp > 1 and any(not a.shape for a in x_avals):
        raise ExecutionError(
            f"stage {stage}'s inputs are {describe_avals(x_avals)}: with dp={dp} every value passed between "
            "stages needs an axis 0 to split its examples over",
            stage=stage,
        )


def _forward_fn(
    fn: Any, diff_x: tuple[bool, ...], *, first: bool, last: bool, options: StageOptions, loss_scale: int
) -> tuple[Any, dict[str, Any]]:
    """The stage's forward as ``(params, inputs, targets) -> (yd, aux, pullback leaves)``
    for :func:`jax.make_jaxpr`, and the dict where tracing leaves the float mask of its
    outputs (``"mask"``) and the pullback's tree (``"pullback"``)."""
    traced: dict[str, Any] = {}

    def fwd(p: Leaves, x: Leaves, t: Leaves) -> tuple[Leaves, Leaves, list[Any]]:
        def g(p: Leaves, xd: Leaves) -> tuple[Leaves, Leaves]:
            it = iter(xd)
            xs = options.in_compute_dtype(tuple(next(it) if d else v for v, d in zip(x, diff_x, strict=True)))
            out = fn(tuple(p), xs, tuple(t))
            if last:
                traced["mask"] = (True,)
                return (out[0].astype(jnp.float32) / loss_scale,), ()
            out = options.in_compute_dtype(out)
            mask = tuple(_is_float(o) for o in out)
            traced["mask"] = mask
            return tuple(o for o, m in zip(out, mask) if m), tuple(o for o, m in zip(out, mask) if not m)

        body = options.checkpoint(g)
        xd = tuple(v for v, d in zip(x, diff_x, strict=True) if d)
        if first:
            yd, pullback, aux = jax.vjp(lambda p: body(p, ()), tuple(p), has_aux=True)
        else:
            yd, pullback, aux = jax.vjp(body, tuple(p), xd, has_aux=True)
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        traced["pullback"] = treedef
        return yd, aux, leaves

    return fwd, traced


def _whole(aval: Any, dp: int) -> jax.ShapeDtypeStruct:
    """The whole microbatch's value of which ``aval`` is one of ``dp`` devices' shares
    (split along axis 0)."""
    shape = tuple(aval.shape)
    return jax.ShapeDtypeStruct((shape[0] * dp, *shape[1:]) if shape else shape, aval.dtype)


def _output_slots(
    forward: Any, mask: tuple[bool, ...], *, last: bool
) -> tuple[tuple[_Slot, ...], tuple[_Slot, ...], list[int]]:
    """Where the traced forward's activations and residuals come from: the activation
    slots in the stage's output order (none for the last stage: its output is the loss,
    which the forward adds to the running loss), the residual slots, and the outputs
    that are computed rather than passed through."""
    outvars = forward.jaxpr.outvars
    num_y, num_yd = len(mask), sum(mask)
    inputs = {v: i for i, v in enumerate(forward.jaxpr.invars)}
    computed: list[int] = []
    y_slots: tuple[_Slot, ...] = ()
    if not last:
        yd_slots = [_slot(i, outvars[i], computed, inputs) for i in range(num_yd)]
        aux_slots = [_slot(i, outvars[i], computed, inputs) for i in range(num_yd, num_y)]
        yd_it, aux_it = iter(yd_slots), iter(aux_slots)
        y_slots = tuple(next(yd_it) if m else next(aux_it) for m in mask)
    res_slots = tuple(_slot(num_y + i, v, computed, inputs) for i, v in enumerate(outvars[num_y:]))
    return y_slots, res_slots, computed


def _step_functions(
    forward: ClosedJaxpr,
    split: BackwardSplit,
    *,
    computed: tuple[int, ...],
    const_res: dict[int, Any],
    num_res: int,
    last: bool,
    shards: DataShards,
) -> tuple[Any, Any, Any, Any]:
    """The four functions a stage's programs jit, each on one device's share of the
    microbatch: ``F`` (forward; on the last stage ``(p, x, t, loss)``, adding the
    devices' loss, else ``(p, x, t)``), ``B`` (both halves of the backward, accumulating
    parameter gradients), ``I`` (input gradients and the hand-off to ``W``) and ``W``
    (parameter gradients from the hand-off). ``const_res`` are residuals baked in as trace
    constants."""
    run_forward = jaxpr_as_fun(forward)

    def forward_values(p: Leaves, x: Leaves, t: Leaves) -> Leaves:
        outs = run_forward(*p, *x, *t)
        return tuple(outs[i] for i in computed)

    def forward_loss(p: Leaves, x: Leaves, t: Leaves, loss: Any) -> tuple[Leaves, Any]:
        outs = run_forward(*p, *x, *t)
        return tuple(outs[i] for i in computed), loss + shards.total(outs[0])

    def inputs_of(stored: Leaves, ct: Leaves) -> list[Any]:
        it = iter(stored)
        res = [const_res[i] if i in const_res else next(it) for i in range(num_res)]
        return res + list(ct)

    def backward_fn(stored: Leaves, ct: Leaves, acc: Leaves) -> tuple[Leaves, Leaves]:
        param_cts, input_cts = split.full(inputs_of(stored, ct))
        return tuple(input_cts), shards.accumulate(acc, param_cts)

    def input_fn(stored: Leaves, ct: Leaves) -> tuple[Leaves, Leaves]:
        input_cts, handoff = split.input_half(inputs_of(stored, ct))
        return tuple(input_cts), tuple(handoff)

    def weight_fn(handoff: Leaves, refs: Leaves, acc: Leaves) -> Leaves:
        it = iter(refs)
        given = [const_res[i] if i in const_res else next(it) for i in split.handoff_inputs]
        return shards.accumulate(acc, split.weight_half(handoff, given))

    return forward_loss if last else forward_values, backward_fn, input_fn, weight_fn


def _backward_jaxpr(pullback_def: PyTreeDef, res_structs: list[Any], ct_structs: list[Any], *, loss: Any) -> Any:
    """The backward as a jaxpr of (residuals, output cotangents): the forward's pullback
    rebuilt from its leaves. On the last stage (``loss``: the loss's aval) the cotangent
    is a constant one, not an input."""

    def bwd(res: list[Any], ct: list[Any]) -> Any:
        pullback = jax.tree_util.tree_unflatten(pullback_def, res)
        if loss is not None:
            return pullback((jnp.ones((), loss.dtype),))
        return pullback(tuple(ct))

    return jax.make_jaxpr(bwd)(res_structs, ct_structs)
