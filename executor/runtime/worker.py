"""The device side of a step, written once for every backend.

A :class:`Worker` is one pipeline device of one pipeline: its lowered program, the
compiled stages it owns (SPMD programs on its stage mesh, see :mod:`pipedsl.executor.stages.mesh`)
and its resident state: the parameter leaves its stages use and the optimizer state
of the leaves they own. :meth:`Worker.steps` runs a whole step on the device:

1. cut the batch's leaves (where the first / last stage lives) into microbatches, each
   split over the mesh's ``"data"`` axis;
2. run the program (:class:`pipedsl.executor.runtime.interpreter.DeviceRuntime`), accumulating
   every local stage's gradients over its microbatches, then reduce them over ``"data"``
   once where they accumulated unreduced (:mod:`pipedsl.executor.stages.shards`);
3. sum the gradients of shared parameters on their owner (contributions added in stage
   order), sending those of leaves owned elsewhere;
4. when training: a barrier with every other device, so that an optimizer step is all
   or nothing (a step that fails before it leaves the resident state as it was), then
   the optimizer update of the owned leaves, one program for every local stage, and the
   hand-out of updated shared leaves to the other devices that use them.

What a step needs before its first action (the parameters in the compute dtype, zero
gradient accumulators, a zero running loss) comes out of the last update's program, made
for the next step; a step with nothing made for it (the first, or one after a step
without an update) makes it with one program for the device. So a step dispatches, per
device, its tasks and transfers and one program more.

Everything between devices goes through the backend's
:class:`~pipedsl.executor.runtime.transport.Transport`. :meth:`Worker.steps` is the step as a
generator that yields what it waits for (:class:`~pipedsl.executor.runtime.scheduler.Receive`,
:class:`~pipedsl.executor.runtime.scheduler.Computed`), run by the one scheduler
(:mod:`pipedsl.executor.runtime.scheduler`): a Ray backend process runs its device's steps,
the local backend every pipeline device's on one thread, switching devices where one waits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.runtime.interpreter import DeviceRuntime, DeviceStep
from pipedsl.executor.runtime.optimizers import couples_through_global_norm
from pipedsl.executor.runtime.scheduler import Receive, Steps
from pipedsl.executor.runtime.timing import Recorder
from pipedsl.executor.runtime.transport import Transport
from pipedsl.executor.stages.mesh import StageLayout
from pipedsl.executor.stages.model import StagedModel
from pipedsl.executor.stages.shards import DataShards
from pipedsl.executor.stages.stage_options import StageOptions
from pipedsl.executor.stages.stage_program import StageProgram, compile_stage
from pipedsl.program import Buffer, DeviceProgram
from pipedsl.run_options import RunOptions
from pipedsl.timeline import Event

__all__ = [
    "Update",
    "WorkerStep",
    "Worker",
    "compile_device",
    "optimizer_init",
    "optimizer_step",
    "place_states_together",
]

Leaves = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Update:
    """The optimizer step that follows a step's program; ``init`` starts the optimizer
    state afresh (else the resident state is used); with ``skip_nonfinite`` every device
    keeps its parameters and optimizer state where the loss or any gradient of the step is
    not finite (decided on the devices, nothing read on the host)."""

    optimizer: optax.GradientTransformation
    init: bool
    skip_nonfinite: bool = False


@dataclass(frozen=True, slots=True)
class WorkerStep:
    """What one device's step produced.

    Attributes:
      loss: the mean loss over microbatches when the last stage is here, else None.
      grads: per flat parameter leaf this device owns, its gradient summed over every
        using stage and microbatch (empty after an optimizer step, which consumes them).
      peak_held: the most (stage, microbatch) pairs whose residuals were held at once.
      leftover: buffers still held after the last instruction.
      events: the recorded events (empty unless recording).
    """

    loss: Any
    grads: Mapping[int, Any]
    peak_held: int
    leftover: tuple[Buffer, ...]
    events: tuple[Event, ...]


class Worker:
    """Pipeline device ``program.device`` of a pipeline of ``num_devices`` devices.

    ``stages`` holds the compiled programs of (at least) the stages ``program`` runs,
    each on this device's mesh; ``placement`` maps every stage to its device;
    ``num_microbatches`` is the schedule's. ``recv_timeout`` bounds every wait, in
    seconds.
    """

    def __init__(
        self,
        program: DeviceProgram,
        model: StagedModel,
        stages: Mapping[int, StageProgram],
        *,
        placement: Sequence[int],
        num_devices: int,
        num_microbatches: int,
        recv_timeout: float,
        barrier: bool = True,
    ) -> None:
        self.index = program.device
        # Whether an optimizer step waits for every device first: needed where a failed
        # device leaves the others able to take another step (not in a jax.distributed
        # world, which a failure ends).
        self.barrier = barrier
        self.program = program
        self.model = model
        self.runtime = DeviceRuntime(program, stages, recv_timeout=recv_timeout)
        self.placement = tuple(placement)
        self.num_devices = num_devices
        self.count = num_microbatches
        self.leaves: dict[int, Any] = {}
        self.states: dict[int, Any] = {}
        # The caller's array each resident leaf was loaded from, so that passing the same
        # parameters again moves nothing.
        self._sources: dict[int, Any] = {}
        # Whether the last step got as far as the optimizer update (the resident state
        # of this device then no longer matches the other devices' if another failed).
        self.applied = False
        # What the step is doing (see doing()), for a stalled device's error.
        self.phase = "idle"
        local = self.runtime.stages
        self.local = tuple(sorted(local))
        # Where each leaf a local stage uses is kept (the same spec on every stage).
        self._kept: dict[int, NamedSharding] = {}
        for s in self.local:
            for k, i in enumerate(model.stage_params[s]):
                self._kept.setdefault(i, local[s].layout.params[k])
        self.owned = tuple(i for i in sorted(self._kept) if placement[model.owner[i]] == self.index)
        self._placed_states: set[int] = set()
        self._optimizers: dict[int, _Compiled] = {}
        # What the last update made for the next step (see the module docstring).
        self._prepared: _Begin | None = None
        self._begin: Callable[..., Any] | None = None  # the program that makes it otherwise
        first, last = 0 in local, model.num_stages - 1 in local
        self._input_layout = local[0].layout if first else None
        self._target_layout = local[model.num_stages - 1].layout if last else None

    # -- resident state ------------------------------------------------------------

    def load(self, leaves: Mapping[int, Any] | None, states: Mapping[int, Any] | None) -> None:
        """Replace the parameter leaves (by flat index; every leaf a local stage uses) and
        the optimizer states (by local stage), each when given."""
        if leaves is not None:
            missing = sorted(set(self._kept) - set(leaves))
            if missing:
                raise ExecutionError(f"device {self.index} was given no value for parameter leaves {missing}")
            for i, target in self._kept.items():
                value = leaves[i]
                if isinstance(value, jax.Array) and self._sources.get(i) is value:
                    continue  # loaded before (JAX arrays are immutable): nothing to move
                self._sources[i] = value if isinstance(value, jax.Array) else None
                # A copy even where the caller's array is placed already: the optimizer
                # update donates the resident leaves, never the caller's.
                self.leaves[i] = _copied(value, target)
                self._prepared = None
        if states is not None:
            self.states = {s: states[s] for s in self.local if s in states}
            self._placed_states.clear()

    def kept(self) -> dict[int, NamedSharding]:
        """Where each parameter leaf a local stage uses is kept, by flat index."""
        return dict(self._kept)

    def gather(self, *, params: bool, states: bool) -> tuple[dict[int, Any], dict[int, Any]]:
        """The owned parameter leaves and the local stages' optimizer states as numpy
        (each only when asked for)."""
        mine = {i: self.leaves[i] for i in self.owned} if params else {}
        return jax.device_get(mine), (jax.device_get(dict(self.states)) if states else {})

    # -- the step ------------------------------------------------------------------

    def steps(
        self,
        transport: Transport,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        *,
        update: Update | None,
        recorder: Recorder | None,
        keep_grads: bool,
    ) -> Steps[WorkerStep]:
        """One step (see the module docstring). ``inputs``/``targets`` are the whole
        batch's leaves where the first/last stage lives (else empty); with
        ``keep_grads`` (and no ``update``) the summed gradients are returned."""
        self.start(update)
        self.phase = "program"
        begin = self.begin()
        result = yield from self.runtime.steps(
            transport,
            begin.params,
            self.microbatches(inputs, self._input_layout),
            self.microbatches(targets, self._target_layout),
            recorder=recorder,
            begin=(begin.grads, begin.loss),
        )
        return (yield from self.finish(transport, result, update=update, keep_grads=keep_grads))

    def start(self, update: Update | None) -> None:
        """Before a step's program: a resident optimizer state that ``update`` cannot use
        is refused while no device has updated anything."""
        self.applied = False
        if update is not None and not update.init:
            self._check_states(update.optimizer)

    def compute_params(self) -> dict[int, Leaves]:
        """Per local stage, its parameter leaves in the compute dtype its programs take: one
        bf16 copy of the master weights per step under bf16 (StageProgram.compute_params)."""
        stages, model = self.runtime.stages, self.model
        return {s: stages[s].compute_params(tuple(self.leaves[i] for i in model.stage_params[s])) for s in self.local}

    def begin(self) -> _Begin:
        """What this step needs before its first action: what the last update made for it
        where it did, else made now by one program for every local stage (module docstring).
        Inside a step traced into one program the values are traced too, and none is kept."""
        stages, model = self.runtime.stages, self.model
        leaves = {s: tuple(self.leaves[i] for i in model.stage_params[s]) for s in self.local}
        traced = any(isinstance(v, jax.core.Tracer) for v in self.leaves.values())
        # What an update made holds values, never to be taken into a traced program.
        prepared, self._prepared = (None, self._prepared) if traced else (self._prepared, None)
        if prepared is None:
            if self._begin is None:
                last = self.runtime.last_stage

                def begin(leaves: Any) -> Any:
                    return (
                        {s: stages[s].compute_params(leaves[s]) for s in leaves if stages[s].casts},
                        {s: stages[s].zero_grads() for s in leaves},
                        None if last is None else last.zero_loss(),
                    )

                self._begin = jax.jit(begin)
            prepared = _Begin(*self._begin(leaves))
        # Stages that compute in their parameters' own dtype take the leaves themselves.
        params = {s: prepared.params[s] if s in prepared.params else stages[s].compute_params(leaves[s])
                  for s in self.local}  # fmt: skip
        return _Begin(params, prepared.grads, prepared.loss)

    def finish(
        self, transport: Transport, result: DeviceStep, *, update: Update | None, keep_grads: bool
    ) -> Steps[WorkerStep]:
        """The rest of a step after its program produced ``result``: the gradient
        reductions and sums, and with ``update`` the optimizer step (module docstring,
        3 and 4)."""
        # Reduced once per step where they accumulated unreduced (ZeRO 0 and 1, dp > 1).
        # Nothing is waited for: the reductions, sums and the update are queued behind the
        # program's computations, and a failure among them is raised where a result is read.
        stage_grads = {s: self.runtime.stages[s].reduce_grads(g) for s, g in result.grads.items()}
        self.phase = "summing shared gradients"
        grads = yield from self._sum_shared(transport, stage_grads)
        if update is not None:
            finite = None
            if update.skip_nonfinite:
                self.phase = "telling the other devices whether its gradients and loss are finite"
                finite = yield from self._all_finite(transport, grads, result.loss)
            if self.barrier:
                self.phase = "waiting for every device to finish its program"
                yield from self._barrier(transport)
            self.applied = True
            self.phase = "applying the optimizer update"
            yield from self._update(transport, update, grads, finite)
        self.phase = "idle"
        return WorkerStep(
            loss=result.loss,
            grads=grads if keep_grads and update is None else {},
            peak_held=result.peak_held,
            leftover=result.leftover,
            events=result.events,
        )

    def doing(self) -> str:
        """What the current step is doing, in words (read from another thread)."""
        phase = self.phase
        if phase == "program":
            return f"running {self.runtime.doing() or 'its program'}"
        return phase

    def microbatches(self, leaves: Sequence[Any], layout: Any) -> list[Leaves]:
        """The batch's ``leaves`` cut into this pipeline's microbatches along axis 0,
        each placed split over ``"data"`` (stacked first, so no device sends rows to
        another).

        On a mesh of one CPU device they are host arrays (views), which the stage program
        that reads them copies in as it is dispatched, as received activations are
        (:mod:`pipedsl.executor.local.exchange`): placing the batch and cutting it with one
        jitted program cost about 5 us of host time per microbatch and leaf, besides
        the placement itself (64 microbatches of a 4-wide row, jaxlib 0.10)."""
        if not leaves or layout is None:
            return []
        count = self.count
        devices = layout.mesh.devices
        traced = isinstance(leaves[0], jax.core.Tracer)  # inside one program of the whole step
        if devices.size == 1 and devices.flat[0].platform == "cpu" and not traced:
            host = [np.asarray(leaf) for leaf in leaves]
            # Iterating a [count, rows, ...] view yields the microbatches' views.
            return list(zip(*(list(h.reshape((count, h.shape[0] // count, *h.shape[1:]))) for h in host), strict=True))
        parts = []
        for leaf in leaves:
            stacked = _stacked(leaf, count, layout)
            parts.append(_unstack(count, layout.batch(stacked.shape[1:]))(stacked))
        return [tuple(part[m] for part in parts) for m in range(count)]

    def stacked(self, inputs: Sequence[Any], targets: Sequence[Any]) -> tuple[Leaves, Leaves]:
        """The batch's input and target leaves (where the first / last stage lives, else
        empty) as ``[microbatches, examples, ...]`` stacks, axis 1 split over ``"data"``:
        what a loop over the microbatches inside one program slices."""

        def stack(leaves: Sequence[Any], layout: StageLayout | None) -> Leaves:
            return () if layout is None else tuple(_stacked(leaf, self.count, layout) for leaf in leaves)

        return stack(inputs, self._input_layout), stack(targets, self._target_layout)

    def _sum_shared(self, transport: Transport, stage_grads: Mapping[int, Leaves]) -> Steps[dict[int, Any]]:
        """Per flat leaf this device owns, the sum of every using stage's gradient."""
        model, me, placement = self.model, self.index, self.placement
        for s in self.local:
            for g, i in zip(stage_grads[s], model.stage_params[s], strict=True):
                owner = placement[model.owner[i]]
                if owner != me:
                    transport.send(("grad", s, i), g, owner, stage=s)
        total: dict[int, Any] = {}
        for s in range(model.num_stages):
            local = s in stage_grads
            for k, i in enumerate(model.stage_params[s]):
                if placement[model.owner[i]] != me:
                    continue
                g = stage_grads[s][k] if local else (yield Receive(("grad", s, i), placement[s]))
                total[i] = g if i not in total else total[i] + g
        return total

    def _barrier(self, transport: Transport) -> Steps[None]:
        """Return once every device of the pipeline has finished its program (or raise)."""
        # Keyed by the sender: a device hears "done" from every other one, and the local
        # mailboxes are keyed by (key, receiver) only.
        others = [d for d in range(self.num_devices) if d != self.index]
        for d in others:
            transport.send(("done", self.index), (), d, stage=None)
        for d in others:
            yield Receive(("done", d), d)

    def _all_finite(self, transport: Transport, grads: Mapping[int, Any], loss: Any) -> Steps[Any]:
        """Whether the loss and every gradient of the model are finite (a bool scalar on this
        device's mesh): each device tells every other one about its own."""
        model = self.model
        flags = [self.runtime.stages[s].all_finite([grads[i] for i in model.owned(s)]) for s in self.local]
        if loss is not None:
            flags.append(jnp.isfinite(loss))
        mine = functools.reduce(jnp.logical_and, flags)
        others = [d for d in range(self.num_devices) if d != self.index]
        for d in others:
            transport.send(("finite", self.index), mine, d, stage=None)
        for d in others:
            mine = jnp.logical_and(mine, (yield Receive(("finite", d), d)))
        return mine

    def _update(self, transport: Transport, update: Update, grads: dict[int, Any], finite: Any = None) -> Steps[None]:
        """Apply the optimizer to every local stage's owned leaves, then hand updated
        shared leaves to the other devices that use them.

        An optimizer that combines leaves through the global norm of the gradients
        (``optax.clip_by_global_norm``) sees, besides a stage's own leaves, one scalar
        leaf whose square is the sum of squares of every other gradient leaf of the model
        (exchanged between the devices, :meth:`_rest_of_norm`), so that its norm is the
        whole model's, as on one device; one that combines them otherwise is refused
        (:func:`~pipedsl.executor.runtime.optimizers.couples_through_global_norm`). ``finite``
        (a bool scalar, or None to update unconditionally) keeps the parameters and state
        as they were where it is false, inside the same programs."""
        model = self.model
        self._sources.clear()  # the resident leaves are no longer the caller's arrays
        self.place_states(update.optimizer, fresh=update.init)
        compiled = self._compiled_for(update.optimizer)
        rest = (yield from self._rest_of_norm(transport, grads)) if compiled.coupled else {}
        # Inside a step traced into one program nothing is made for the next step.
        traced = any(isinstance(v, jax.core.Tracer) for v in self.leaves.values())
        program = self._device_update(compiled, prepare=not traced)
        params = {
            s: jax.tree_util.tree_unflatten(model.owned_treedefs[s], [self.leaves[i] for i in model.owned(s)])
            for s in self.local
        }
        owned_grads = {
            s: jax.tree_util.tree_unflatten(model.owned_treedefs[s], [grads[i] for i in model.owned(s)])
            for s in self.local
        }
        new_params, self.states, made = program(finite, owned_grads, rest, dict(self.states), params)
        for s in self.local:
            for i, leaf in zip(model.owned(s), jax.tree_util.tree_leaves(new_params[s]), strict=True):
                self.leaves[i] = leaf
        if made is not None:
            self._prepared = _Begin(*made)
        me, placement = self.index, self.placement
        for s in range(model.num_stages):
            for i in model.stage_params[s]:
                if placement[model.owner[i]] == me and placement[s] != me:
                    transport.send(("param", s, i), self.leaves[i], placement[s], stage=model.owner[i])
        received = False
        for s in self.local:
            for i in model.stage_params[s]:
                owner = placement[model.owner[i]]
                if owner != me:
                    self.leaves[i] = yield Receive(("param", s, i), owner)
                    received = True
        if received and self._prepared is not None:
            # A stage's compute-dtype copy was made before its shared leaves came back: made anew.
            self._prepared = _Begin({}, self._prepared.grads, self._prepared.loss)

    def place_states(self, optimizer: optax.GradientTransformation, *, fresh: bool) -> None:
        """Make every local stage's optimizer state resident where its layout keeps it:
        made by the optimizer's ``init`` where there is none (all of them with ``fresh``),
        copied into buffers of this worker's own where it was loaded (the update donates
        the state, and a loaded one is the caller's)."""
        for s, init, params_s in self._states_to_make(optimizer, fresh=fresh):
            self.states[s] = init(params_s)
            self._placed_states.add(s)

    def _states_to_make(
        self, optimizer: optax.GradientTransformation, *, fresh: bool
    ) -> list[tuple[int, Callable[[Any], Any], Any]]:
        """:meth:`place_states` but for the states ``init`` makes: those are returned as
        (stage, the jitted ``init``, the stage's owned parameters), to be made."""
        if fresh:
            self.states = {}
            self._placed_states.clear()
        else:
            self._check_states(optimizer)
        compiled = self._compiled_for(optimizer)
        to_make = []
        for s in self.local:
            if s in self._placed_states:
                continue
            _, init, state_at = self._compiled_update(compiled, s)
            state = self.states.get(s)
            if state is None:
                owned = self.model.owned(s)
                params_s = jax.tree_util.tree_unflatten(self.model.owned_treedefs[s], [self.leaves[i] for i in owned])
                to_make.append((s, init, params_s))
                continue
            self.states[s] = jax.device_put(state, state_at, may_alias=False)
            self._placed_states.add(s)
        return to_make

    def _check_states(self, optimizer: optax.GradientTransformation) -> None:
        """Refuse a loaded optimizer state whose structure this optimizer does not give."""
        compiled = self._compiled_for(optimizer)
        for s in self.local:
            state = self.states.get(s)
            if state is not None and s not in self._placed_states:
                _check_state(state, self._compiled_update(compiled, s)[2], s)

    def abstract_state(self, optimizer: optax.GradientTransformation, stage: int) -> Any:
        """The shapes, dtypes and shardings of local ``stage``'s optimizer state (a pytree
        of ``jax.ShapeDtypeStruct``), for reading a saved state back in place."""
        _, _, state_at = self._compiled_update(self._compiled_for(optimizer), stage)
        model = self.model
        owned = [model.param_avals[i] for i in model.owned(stage)]
        shapes = jax.eval_shape(optimizer.init, jax.tree_util.tree_unflatten(model.owned_treedefs[stage], owned))
        return jax.tree_util.tree_map(
            lambda v, at: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=at), shapes, state_at
        )

    def _rest_of_norm(self, transport: Transport, grads: Mapping[int, Any]) -> Steps[dict[int, Any]]:
        """Per local stage, the sum of squares of every gradient value of the model outside
        the leaves it owns (an fp32 scalar on its mesh): each device sends the sum over its
        own leaves to every other device through the transport."""
        model = self.model
        own = {s: self.runtime.stages[s].sum_of_squares([grads[i] for i in model.owned(s)]) for s in self.local}
        mine = sum(own.values(), jnp.zeros((), jnp.float32))
        others = [d for d in range(self.num_devices) if d != self.index]
        for d in others:
            transport.send(("sqnorm", self.index), mine, d, stage=None)
        theirs = []
        for d in others:
            theirs.append((yield Receive(("sqnorm", d), d)))
        return {
            s: sum([*theirs, *(own[t] for t in self.local if t != s)], jnp.zeros((), jnp.float32)) for s in self.local
        }

    def _compiled_for(self, optimizer: optax.GradientTransformation) -> _Compiled:
        entry = self._optimizers.get(id(optimizer))
        if entry is None or entry.optimizer is not optimizer:
            entry = _Compiled(optimizer, couples_through_global_norm(optimizer), {}, {})
            self._optimizers[id(optimizer)] = entry
        return entry

    def _device_update(self, entry: _Compiled, *, prepare: bool) -> Callable[..., Any]:
        """One program of every local stage's update: ``(finite, grads, rest of the norm,
        states, params)``, each a dict by stage (the grads, states and params donated), to
        (new params, new states, what the next step needs before its first action: its
        compute-dtype parameters, zero accumulators and zero running loss, with
        ``prepare``, else None)."""
        found = entry.devices.get(prepare)
        if found is not None:
            return found
        stages, model, coupled, local = self.runtime.stages, self.model, entry.coupled, self.local
        last = self.runtime.last_stage
        updates = {s: self._compiled_update(entry, s)[0] for s in local}

        def program(finite: Any, grads: Any, rest: Any, states: Any, params: Any) -> Any:
            new_params, new_states = {}, {}
            for s in local:
                args = (grads[s], rest[s]) if coupled else (grads[s],)
                new_params[s], new_states[s] = updates[s](finite, *args, states[s], params[s])
            if not prepare:
                return new_params, new_states, None
            leaves = {
                i: leaf
                for s in local
                for i, leaf in zip(model.owned(s), jax.tree_util.tree_leaves(new_params[s]), strict=True)
            }
            cast = {
                s: stages[s].compute_params(tuple(leaves[i] for i in model.stage_params[s]))
                for s in local
                if stages[s].casts and all(i in leaves for i in model.stage_params[s])
            }
            zeros = {s: stages[s].zero_grads() for s in local}
            return new_params, new_states, (cast, zeros, None if last is None else last.zero_loss())

        found = entry.devices[prepare] = jax.jit(program, donate_argnums=(1, 3, 4))
        return found

    def _compiled_update(self, entry: _Compiled, stage: int) -> tuple[Callable, Callable, Any]:
        """(update, init, state shardings) of the optimizer for ``stage``'s owned leaves:
        jitted so that the state is kept where the stage's layout says (ZeRO), the
        parameters come back where they are kept, and the state and parameters are
        updated in place (donated: the resident ones are this worker's own copies)."""
        compiled = entry.stages.get(stage)
        if compiled is not None:
            return compiled
        optimizer, coupled = entry.optimizer, entry.coupled
        model = self.model
        layout = self.runtime.stages[stage].layout
        position = {i: k for k, i in enumerate(model.stage_params[stage])}
        owned = model.owned(stage)
        treedef = model.owned_treedefs[stage]
        params_at = jax.tree_util.tree_unflatten(treedef, [layout.params[position[i]] for i in owned])
        state_leaf_at = jax.tree_util.tree_unflatten(treedef, [layout.states[position[i]] for i in owned])
        avals = jax.tree_util.tree_unflatten(treedef, [model.param_avals[i] for i in owned])
        if coupled:
            # The optimizer's tree: the stage's leaves and the rest of the norm's leaf.
            avals = (avals, jax.ShapeDtypeStruct((), jnp.float32))
            state_leaf_at = (state_leaf_at, layout.replicated)
        state_at = optax.tree_utils.tree_map_params(
            optimizer,
            lambda _, at: at,
            jax.eval_shape(optimizer.init, avals),
            state_leaf_at,
            transform_non_params=lambda _: layout.replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )

        def apply(finite: Any, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
            return optimizer_step(optimizer, finite, grads, None, state, params)

        def apply_coupled(finite: Any, grads: Any, rest: Any, state: Any, params: Any) -> tuple[Any, Any]:
            return optimizer_step(optimizer, finite, grads, rest, state, params)

        # Arguments: (finite, grads[, rest], state, params).
        step, first_state = (apply_coupled, 3) if coupled else (apply, 2)
        update: Callable[..., tuple[Any, Any]]
        if layout.gathers_params:
            # ZeRO 1 and 2: each device updates its shard, then one program gathers the
            # new parameters, a bucket at a time (XLA would gather each leaf apart). The
            # whole parameters cannot take the shards' place, so the gradients do.
            positions = [position[i] for i in owned]
            gather = jax.jit(
                DataShards(layout).whole(positions), out_shardings=tuple(jax.tree_util.tree_leaves(params_at))
            )
            sharded_at = state_leaf_at[0] if coupled else state_leaf_at
            sharded = jax.jit(step, donate_argnums=(1, first_state), out_shardings=(sharded_at, state_at))

            def gathered(*args: Any) -> tuple[Any, Any]:
                new, state = sharded(*args)
                return jax.tree_util.tree_unflatten(treedef, gather(*jax.tree_util.tree_leaves(new))), state

            update = gathered
        else:
            update = jax.jit(step, donate_argnums=(first_state, first_state + 1), out_shardings=(params_at, state_at))
        init_params = functools.partial(optimizer_init, optimizer, coupled=coupled)
        compiled = (update, jax.jit(init_params, out_shardings=state_at), state_at)
        entry.stages[stage] = compiled
        return compiled


@dataclass(slots=True)
class _Compiled:
    """An optimizer's compiled updates on one device: whether it couples leaves through
    the global norm (:func:`~pipedsl.executor.runtime.optimizers.couples_through_global_norm`), per local stage
    (update, init, state shardings), and the device's update program (by whether it
    prepares the next step, :meth:`Worker._device_update`)."""

    optimizer: optax.GradientTransformation
    coupled: bool
    stages: dict[int, tuple[Callable, Callable, Any]]
    devices: dict[bool, Callable[..., Any]]


@dataclass(frozen=True, slots=True)
class _Begin:
    """What a step needs before its first action, per local stage: its parameters in the
    compute dtype (a stage missing here takes its master leaves' cast when it starts), its
    zero gradient accumulator; and the last stage's zero running loss (None elsewhere)."""

    params: Mapping[int, Leaves]
    grads: Mapping[int, Leaves]
    loss: Any


def place_states_together(workers: Sequence[Worker], optimizer: optax.GradientTransformation, *, fresh: bool) -> None:
    """:meth:`Worker.place_states` of every worker, the states ``init`` makes made by one
    program: one compile for the whole pipeline rather than one per stage shape (where the
    step itself is one program, they are most of what its first call compiles besides)."""
    to_make = [
        (w, s, init, params_s) for w in workers for s, init, params_s in w._states_to_make(optimizer, fresh=fresh)
    ]
    if not to_make:
        return
    inits = [init for _, _, init, _ in to_make]
    made = jax.jit(lambda *params: tuple(init(p) for init, p in zip(inits, params, strict=True)))(
        *(params_s for _, _, _, params_s in to_make)
    )
    for (w, s, _, _), state in zip(to_make, made, strict=True):
        w.states[s] = state
        w._placed_states.add(s)


def compile_device(
    model: StagedModel,
    stages: Sequence[int],
    mesh: Mesh,
    *,
    specs: Sequence[PartitionSpec],
    options: RunOptions,
    num_microbatches: int,
    stage_options: Sequence[StageOptions],
    placement: Sequence[int],
) -> dict[int, StageProgram]:
    """The compiled programs of ``stages`` (all on one pipeline device, whose mesh is
    ``mesh``), as both backends compile them; ``specs`` gives every flat parameter leaf's
    ``PartitionSpec``, ``options`` the ZeRO mode, ``stage_options`` every stage's
    :class:`~pipedsl.executor.stages.stage_options.StageOptions`."""
    programs = {}
    for s in stages:
        idx = model.stage_params[s]
        avals = [model.param_avals[i] for i in idx]
        layout = StageLayout(
            mesh, [specs[i] for i in idx], avals, zero=options.zero, leaves=idx, reduce_once=options.reduce_once
        )
        programs[s] = compile_stage(
            model, s, num_microbatches=num_microbatches, options=stage_options[s], device=placement[s], layout=layout
        )
    return programs


def _copied(value: Any, target: NamedSharding) -> jax.Array:
    """``value`` on ``target`` in buffers of its own. ``device_put(..., may_alias=False)``
    still shares the caller's buffer with the replica on the caller's own device when
    ``target`` replicates over several devices (jax 0.10), and a donation would then delete
    the caller's array: such a placement is copied once more."""
    placed = jax.device_put(value, target, may_alias=False)
    if isinstance(value, jax.Array):
        theirs = {shard.data.unsafe_buffer_pointer() for shard in value.addressable_shards}
        if any(shard.data.unsafe_buffer_pointer() in theirs for shard in placed.addressable_shards):
            placed = jnp.copy(placed)
    return placed


def _stacked(leaf: Any, count: int, layout: StageLayout) -> Any:
    """A batch leaf ``[count * rows, ...]`` as ``[count, rows, ...]``, axis 1 split over
    ``"data"`` (placed so, or constrained so inside a traced program)."""
    return jax.device_put(leaf.reshape((count, leaf.shape[0] // count, *leaf.shape[1:])), layout.stacked())


@lru_cache(maxsize=64)
def _unstack(count: int, sharding: NamedSharding) -> Callable[[Any], tuple[Any, ...]]:
    """A jitted cut of a ``[count, ...]`` stack into its ``count`` entries, each placed
    with ``sharding``: one dispatch per leaf instead of one per microbatch."""
    return jax.jit(lambda x: tuple(x[m] for m in range(count)), out_shardings=(sharding,) * count)


def optimizer_step(
    optimizer: optax.GradientTransformation, finite: Any, grads: Any, rest: Any, state: Any, params: Any
) -> tuple[Any, Any]:
    """(new parameters, new state) of one stage's owned leaves (pytrees in the stage's
    owned structure) after ``optimizer``'s update, traced inside a program. ``rest`` is,
    for an optimizer that couples leaves through the global norm, the sum of squares of
    every other gradient of the model (an fp32 scalar: the stage's leaves and the rest of
    the norm make the optimizer's tree), else None; where ``finite`` (a bool scalar, or
    None) is false the old values are kept."""
    if rest is None:
        updates, new_state = optimizer.update(grads, state, params)
        return _kept(finite, optax.apply_updates(params, updates), params), _kept(finite, new_state, state)
    aug = (grads, jnp.sqrt(rest)), state, (params, jnp.zeros((), jnp.float32))
    coupled_updates, new_state = optimizer.update(*aug)
    return _kept(finite, optax.apply_updates(params, coupled_updates[0]), params), _kept(finite, new_state, state)


def optimizer_init(optimizer: optax.GradientTransformation, params: Any, *, coupled: bool) -> Any:
    """``optimizer``'s fresh state for one stage's owned leaves (with the rest of the norm's
    leaf where it ``coupled``, :func:`optimizer_step`)."""
    return optimizer.init((params, jnp.zeros((), jnp.float32))) if coupled else optimizer.init(params)


def _kept(finite: Any, new: Any, old: Any) -> Any:
    """``new``, or where ``finite`` (a bool scalar) is false ``old``; ``new`` when it is None."""
    if finite is None:
        return new
    return jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)


def _check_state(state: Any, state_at: Any, stage: int) -> None:
    """Refuse an optimizer state for ``stage`` whose structure is not the one this
    optimizer's ``init`` gives the stage's parameters (``state_at``, its placement), naming
    ``opt_state`` rather than leaving it to ``device_put``'s tree-prefix error."""
    given: Any = jax.tree_util.tree_structure(state)
    wanted: Any = jax.tree_util.tree_structure(state_at)
    if given != wanted:
        raise ExecutionError(
            f"opt_state[{stage}] (the optimizer state of stage {stage}) is not what this optimizer's init gives"
            f" the stage's parameters: {given.num_leaves} leaves in {_shown(given)}, expected"
            f" {wanted.num_leaves} in {_shown(wanted)}; pass the opt_state a previous train_step returned"
            " with the same optimizer, or None to start afresh"
        )


def _shown(treedef: Any) -> str:
    text = str(treedef)
    return text if len(text) <= 160 else text[:157] + "..."
