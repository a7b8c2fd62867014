"""One program for the whole step, where the pipeline devices run on the same JAX devices.

When the pipeline devices of a local backend share their JAX devices (one TPU chip, one GPU
or one CPU device holding every stage; or there is one pipeline device, pp = 1), no action
ever waits for another device: the
schedule's order only serialises work on the same hardware. The step is then traced once
into a single jitted program that runs every device's whole step, the optimizer update
included, with the parameters and optimizer state donated: one dispatch per step instead
of one per action, as JaxPP fuses a device's adjacent tasks. On a TPU v5e chip a
dispatch costs about 120 us plus 4 us per argument or result buffer, and a stage action
passes a hundred buffers (parameters, residuals, accumulators), so dispatching actions
one by one cost more host time than the chip spent computing them.

The program is built from the workers' own step code
(:meth:`pipedsl.executor.runtime.worker.Worker.steps`) run on tracers, by the one scheduler
(:mod:`pipedsl.executor.runtime.scheduler`) in the order it dispatches a step apart, each
receive answered by the value its sender handed over (values that stay on one device move
nowhere). Two programs, as ``fuse`` says (:data:`pipedsl.run_options.Fuse`):

- ``"loop"``: every device's program for one microbatch (:func:`one_microbatch`: the same
  compiled stage programs, which take one microbatch) inside a ``lax.scan`` over the
  microbatches, the gradients and the loss summed in its carry; then each device's gradient
  sums and update (:meth:`~pipedsl.executor.runtime.worker.Worker.finish`). Each stage's
  forward and backward are in the program once, so it compiles about as long as one
  ``jax.jit`` that accumulates the same microbatches, and one microbatch's activations are
  kept at a time. On shared devices the schedule's order buys nothing (the same hardware
  runs every stage's work); the schedule still says which stages each device holds and
  which backwards are split.
- ``"unrolled"``: every device's whole step, every action of the schedule in its order,
  which XLA schedules as data dependencies allow (overlapping microbatches), at the price
  of a program with a copy of a stage's computation per action.

What the devices report that is not a value (peak residuals held, leftover buffers) is
read while tracing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp

from pipedsl.executor.runtime.interpreter import DeviceRuntime, DeviceStep
from pipedsl.executor.runtime.scheduler import NOTHING, Receive, Steps, run_steps
from pipedsl.executor.runtime.transport import Transport
from pipedsl.executor.runtime.worker import Update, Worker, WorkerStep, place_states_together
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.program import Buffer, lower

__all__ = ["FusedStep", "one_microbatch", "run_traced", "shared_devices"]


def shared_devices(meshes: Sequence[Any]) -> bool:
    """Whether every pipeline device's mesh is the same JAX devices in the same shape."""
    first = meshes[0].devices
    return all(m.devices.shape == first.shape and (m.devices == first).all() for m in meshes[1:])


class _Post:
    """The devices' :class:`~pipedsl.executor.runtime.transport.Transport` and
    :class:`~pipedsl.executor.runtime.scheduler.Mail` while the step is traced: a send hands
    the value over as it is (every device is on the same JAX devices)."""

    __slots__ = ("_mail", "_arrived")

    def __init__(self) -> None:
        self._mail: dict[tuple[Hashable, int], Any] = {}
        self._arrived: list[tuple[Hashable, int]] = []

    def send(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        self._mail[(key, dst)] = value
        self._arrived.append((key, dst))

    def take(self, request: Receive, device: int) -> Any:
        return self._mail.pop((request.key, device), NOTHING)

    def arrivals(self) -> list[tuple[Hashable, int]]:
        arrived, self._arrived = self._arrived, []
        return arrived

    def fail(self, device: int) -> None:
        """Nothing waits while a step is traced: the error reaches the caller as it is."""

    def abort(self, error: BaseException) -> None:
        """As :meth:`fail`."""


def run_traced(make: Callable[[Transport], Sequence[Steps[Any]]]) -> list[Any]:
    """Every device's steps, ``make(post)`` (each sending through ``post``), run to their
    end on this thread by the scheduler, each receive answered with what ``post`` was
    handed; raises the first device's error (an :class:`ExecutionError` when every device
    waits for a value none will send)."""
    post = _Post()
    results, errors = run_steps(make(post), post, timeout=0.0)
    failed = next((err for err in errors if err is not None), None)
    if failed is not None:
        raise failed
    return results


def one_microbatch(schedule: Schedule) -> Schedule:
    """``schedule`` with one microbatch: every device runs its stages' forwards in stage
    order, then their backwards in reverse (as a split backward where ``schedule`` splits
    that stage's), which is each device's share of one global order of the actions, so
    no device waits for one that waits for it."""
    split = {a.stage for order in schedule.orders for a in order if a.kind is Kind.I}
    orders = []
    for d in range(schedule.num_devices):
        mine = [s for s in range(schedule.num_stages) if schedule.placement[s] == d]
        backward = [
            Action(kind, s, 0) for s in reversed(mine) for kind in ((Kind.I, Kind.W) if s in split else (Kind.B,))
        ]
        orders.append((*(Action(Kind.F, s, 0) for s in mine), *backward))
    return Schedule(
        name=f"{schedule.name}, one microbatch",
        num_stages=schedule.num_stages,
        num_devices=schedule.num_devices,
        num_microbatches=1,
        placement=schedule.placement,
        orders=tuple(orders),
    )


@dataclass(frozen=True, slots=True)
class _Traced:
    """What a traced step reports besides values, per device: (peak residual pairs held,
    leftover buffers)."""

    held: tuple[int, ...]
    leftover: tuple[tuple[Buffer, ...], ...]


class FusedStep:
    """The whole step of ``workers`` (pipeline devices sharing their JAX devices) as one
    jitted program per kind of step (an optimizer's, skipping a non-finite update or not,
    or gradients only), traced on its first use. ``first``/``last`` are the devices of the
    first and last stage."""

    def __init__(
        self, workers: Sequence[Worker], *, schedule: Schedule, first: int, last: int, mode: Literal["loop", "unrolled"]
    ) -> None:
        self.workers = tuple(workers)
        self.first, self.last = first, last
        # Per worker, its parameter leaves' flat indices in the order the program takes them.
        self._order = tuple(tuple(sorted(w.kept())) for w in self.workers)
        self._last_stage = schedule.num_stages - 1
        # A loop: every device's program for one microbatch, which the loop runs once per
        # microbatch (the stages' compiled programs are the same: they take one microbatch).
        self._single: tuple[DeviceRuntime, ...] | None = None
        if mode == "loop":
            single = lower(one_microbatch(schedule))
            self._single = tuple(
                DeviceRuntime(single.devices[d], w.runtime.stages, recv_timeout=w.runtime.recv_timeout)
                for d, w in enumerate(self.workers)
            )
        # By (optimizer's id, skip_nonfinite) and keep_grads: (the optimizer, so that an id
        # reused by another object is not taken for it, the program, what its trace reported).
        self._programs: dict[Any, tuple[Any, Callable[..., Any], list[_Traced]]] = {}

    def run(
        self, inputs: Sequence[Any], targets: Sequence[Any], *, update: Update | None, keep_grads: bool
    ) -> tuple[WorkerStep, ...]:
        """One step over the batch's leaves: the workers' resident parameters and optimizer
        state are replaced by the step's (donated: updated in place), and each device's
        report returned; nothing is waited for."""
        workers = self.workers
        if update is not None:
            place_states_together(workers, update.optimizer, fresh=update.init)
        optimizer = None if update is None else update.optimizer
        key = (None if update is None else (id(optimizer), update.skip_nonfinite), keep_grads)
        found = self._programs.get(key)
        if found is None or found[0] is not optimizer:
            found = self._programs[key] = (optimizer, *self._program(update, keep_grads))
        _, program, traced = found
        order = self._order
        leaves = tuple(tuple(w.leaves[i] for i in mine) for w, mine in zip(workers, order, strict=True))
        states = tuple(tuple(w.states[s] for s in w.local) for w in workers) if update is not None else ()
        new_leaves, new_states, losses, grads = program(leaves, states, tuple(inputs), tuple(targets))
        if update is not None:
            for w, at, mine, theirs in zip(workers, order, new_leaves, new_states, strict=True):
                w.leaves = dict(zip(at, mine, strict=True))
                w.states = dict(zip(w.local, theirs, strict=True))
                w.applied = True
        info = traced[0]
        return tuple(
            WorkerStep(loss=losses[d], grads=grads[d], peak_held=info.held[d], leftover=info.leftover[d], events=())
            for d in range(len(workers))
        )

    def intact(self) -> bool:
        """Whether every worker still holds live parameters and optimizer state (a program
        that failed after it was dispatched may have consumed its donated buffers)."""
        for w in self.workers:
            for value in jax.tree_util.tree_leaves((w.leaves, w.states)):
                if isinstance(value, jax.Array) and value.is_deleted():
                    return False
        return True

    def _program(self, update: Update | None, keep_grads: bool) -> tuple[Callable[..., Any], list[_Traced]]:
        """The jitted step and where its trace leaves what it reports besides values."""
        workers = self.workers
        traced: list[_Traced] = []
        steady = None if update is None else Update(update.optimizer, init=False, skip_nonfinite=update.skip_nonfinite)

        def step(leaves: Any, states: Any, inputs: Any, targets: Any) -> Any:
            kept = [(w.leaves, w.states) for w in workers]
            try:
                for d, w in enumerate(workers):
                    w.leaves = dict(zip(self._order[d], leaves[d], strict=True))
                    if steady is not None:
                        w.states = dict(zip(w.local, states[d], strict=True))
                results = (
                    self._unrolled(inputs, targets, steady, keep_grads)
                    if self._single is None
                    else self._looped(self._single, inputs, targets, steady, keep_grads)
                )
                traced[:] = [_Traced(tuple(r.peak_held for r in results), tuple(r.leftover for r in results))]
                new_leaves: Any = ()
                new_states: Any = ()
                if steady is not None:
                    new_leaves = tuple(
                        tuple(w.leaves[i] for i in at) for w, at in zip(workers, self._order, strict=True)
                    )
                    new_states = tuple(tuple(w.states[s] for s in w.local) for w in workers)
                return new_leaves, new_states, tuple(r.loss for r in results), tuple(dict(r.grads) for r in results)
            finally:
                for w, (held, states_kept) in zip(workers, kept, strict=True):
                    w.leaves, w.states = held, states_kept

        donate = (0, 1) if update is not None else ()
        return jax.jit(step, donate_argnums=donate), traced

    def _unrolled(self, inputs: Any, targets: Any, update: Update | None, keep_grads: bool) -> list[WorkerStep]:
        """Every device's whole step traced as it is dispatched apart: every action once."""
        first, last = self.first, self.last
        return run_traced(
            lambda post: [
                w.steps(
                    post,
                    inputs if d == first else (),
                    targets if d == last else (),
                    update=update,
                    recorder=None,
                    keep_grads=keep_grads,
                )
                for d, w in enumerate(self.workers)
            ]
        )

    def _looped(
        self,
        single: Sequence[DeviceRuntime],
        inputs: Any,
        targets: Any,
        update: Update | None,
        keep_grads: bool,
    ) -> list[WorkerStep]:
        """Every device's step as a loop over the microbatches, each through every device's
        program for one microbatch (its gradients and loss summed in the loop's carry),
        then the devices' gradient sums and update after it."""
        workers, first, last = self.workers, self.first, self.last
        for w in workers:
            w.start(update)
        params = [w.compute_params() for w in workers]
        xs = (workers[first].stacked(inputs, ())[0], workers[last].stacked((), targets)[1])
        zero = tuple({s: rt.stages[s].zero_grads() for s in rt.stages} for rt in single)
        kept: list[DeviceStep] = []

        def one(carry: Any, batch: Any) -> Any:
            grads, loss = carry
            x, t = batch
            results = run_traced(
                lambda post: [
                    rt.steps(post, params[d], [x] if d == first else [], [t] if d == last else [], recorder=None)
                    for d, rt in enumerate(single)
                ]
            )
            kept[:] = results
            summed = tuple(
                {s: jax.tree_util.tree_map(jnp.add, grads[d][s], r.grads[s]) for s in grads[d]}
                for d, r in enumerate(results)
            )
            return (summed, loss + results[last].loss), None

        (grads, loss), _ = jax.lax.scan(one, (zero, single[last].stages[self._last_stage].zero_loss()), xs)
        ends = [
            DeviceStep(
                grads=grads[d],
                loss=loss if d == last else None,
                peak_held=r.peak_held,
                leftover=r.leftover,
                events=(),
            )
            for d, r in enumerate(kept)
        ]
        return run_traced(
            lambda post: [w.finish(post, ends[d], update=update, keep_grads=keep_grads) for d, w in enumerate(workers)]
        )
