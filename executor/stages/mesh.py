"""Stage meshes: every pipeline device as a ``dp x cp x tp`` mesh of JAX devices.

A pipeline device runs its stages as SPMD programs on a :class:`jax.sharding.Mesh` with
axes ``"data"`` (size ``dp``), ``"context"`` (size ``cp``) and ``"tensor"`` (size ``tp``),
made by :func:`stage_mesh` on either backend; where ``RunOptions.fsdp`` groups the
data-parallel devices into shard groups, the ``dp`` devices are two axes, ``"replica"``
(``dp / fsdp`` groups) and ``"data"`` (``fsdp`` devices of a group): ZeRO shards over
``"data"`` only, the batch splits over both, and each shard's gradient is all-reduced over
``"replica"`` (:func:`data_axes`). Where each value lives on
that mesh is a :class:`jax.sharding.NamedSharding`, and the stage programs are jitted with
these shardings as their output shardings (their inputs arrive already placed), so XLA
inserts the tensor-parallel collectives and the data-parallel gradient reduction inside
the compiled programs:

- parameters: the model's ``PartitionSpec`` per leaf (``param_specs``; None replicates),
  with ZeRO-3 also sharded over ``"data"``;
- accumulated gradients: with ZeRO 0 and 1 each device's own partial sum, unreduced,
  reduced once per step to the parameters' layout (ZeRO 0) or sharded over ``"data"``
  (ZeRO 1); with ZeRO 2 and 3 sharded over ``"data"`` as every backward adds to them
  (:mod:`pipedsl.executor.stages.shards`);
- optimizer state: as the parameters, with ZeRO-1, 2 and 3 sharded over ``"data"``;
- microbatches, activations and their gradients: axis 0 (the examples) over ``"data"``,
  and with context parallelism axis 1 (the sequence) over ``"context"`` (size ``cp``):
  each device of that axis holds a slice of every sequence, and XLA brings the keys and
  values of the whole sequence to its causal attention, as it brings the tensor-parallel
  collectives (the stage programs are manual over ``"data"`` only).

Sharding a leaf over ``"data"`` takes its first axis that the model's spec leaves whole
and whose size divides by ``dp``; a leaf with no such axis stays replicated over
``"data"`` (small leaves: biases, norms).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.devices import xla_device_flag
from pipedsl.executor.errors import ExecutionError
from pipedsl.run_options import RunOptions

__all__ = [
    "StageLayout",
    "build_meshes",
    "stage_mesh",
    "leaf_specs",
    "data_axes",
    "data_size",
    "DATA",
    "CONTEXT",
    "REPLICA",
    "TENSOR",
]

DATA, CONTEXT, TENSOR = "data", "context", "tensor"
REPLICA = "replica"
"""The mesh axis of the replicas of a shard group (``RunOptions.fsdp``), outside ``"data"``."""


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch splits over: ``("replica", "data")`` on a mesh of shard groups,
    else ``("data",)``."""
    return (REPLICA, DATA) if REPLICA in mesh.axis_names else (DATA,)


def data_size(mesh: Mesh) -> int:
    """The data-parallel devices of ``mesh``: the product of its :func:`data_axes`."""
    return int(np.prod([mesh.shape[a] for a in data_axes(mesh)]))


def _batch_entry(mesh: Mesh) -> str | tuple[str, ...]:
    """A ``PartitionSpec`` entry that splits an axis over every data-parallel device."""
    axes = data_axes(mesh)
    return axes if len(axes) > 1 else axes[0]


def build_meshes(
    num_devices: int, options: RunOptions, *, devices: Sequence[jax.Device] | None, what: str
) -> tuple[Mesh, ...]:
    """One mesh per pipeline device, over consecutive JAX devices, of the shape ``options`` gives.

    ``devices`` (when given) lists the JAX devices of every pipeline device in order,
    ``options.mesh_size`` each (one JAX device may appear several times when ``dp = tp = 1``:
    pipeline devices then share it). ``what`` names the schedule in messages.
    """
    needed = num_devices * options.mesh_size
    if devices is None:
        available = jax.devices()
        if len(available) < needed:
            platform = available[0].platform
            raise ExecutionError(
                f"{what} needs {needed} JAX devices (pp={num_devices} x dp={options.dp} x cp={options.cp} x "
                f"tp={options.tp}) "
                f"but JAX has {len(available)} {platform} device(s); on CPU set "
                f"XLA_FLAGS={xla_device_flag(needed)} before jax is imported (the `pipedsl run` command "
                "does this itself), or pass devices=[...] to map several pipeline devices onto one JAX device"
            )
        devices = available[:needed]
    elif len(devices) != needed:
        raise ExecutionError(
            f"{what} has {num_devices} pipeline devices of dp={options.dp} x cp={options.cp} x tp={options.tp}: it needs "
            f"{needed} JAX devices; {len(devices)} were given"
        )
    size = options.mesh_size
    if size > 1 and len(set(devices)) != len(devices):
        raise ExecutionError("with dp, cp or tp above 1, every JAX device given must be distinct")
    return tuple(stage_mesh(devices[d * size : (d + 1) * size], options) for d in range(num_devices))


def stage_mesh(devices: Sequence[jax.Device], options: RunOptions) -> Mesh:
    """One pipeline device's mesh: ``devices`` (``options.mesh_size`` of them, row-major)
    as ``dp x cp x tp`` with axes ``"data"``, ``"context"`` and ``"tensor"``; with shard
    groups (``options.fsdp``) as ``dp/fsdp x fsdp x cp x tp``, the groups (consecutive
    devices: a node's, a slice's) along ``"replica"`` outside ``"data"``."""
    shape: tuple[int, ...] = (options.dp, options.cp, options.tp)
    names: tuple[str, ...] = (DATA, CONTEXT, TENSOR)
    if options.fsdp is not None:
        shape, names = (options.replicas, options.fsdp, options.cp, options.tp), (REPLICA, *names)
    return Mesh(np.array(list(devices), dtype=object).reshape(shape), names)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def leaf_specs(specs: Any, params: Any) -> tuple[PartitionSpec, ...]:
    """Per flat leaf of ``params``, its spec from ``specs`` (a pytree with the structure
    of ``params``, or a prefix of it: a spec or None stands for every leaf below it)."""
    if specs is None:
        return tuple(PartitionSpec() for _ in jax.tree_util.tree_leaves(params))
    try:
        full = jax.tree_util.tree_map(
            lambda spec, leaf: jax.tree_util.tree_map(lambda _: spec or PartitionSpec(), leaf),
            specs,
            params,
            is_leaf=_is_spec,
        )
    except ValueError as err:
        raise ExecutionError(
            f"param_specs must have the structure of the parameters (a PartitionSpec or None per leaf or "
            f"subtree): {err}"
        ) from err
    leaves = jax.tree_util.tree_leaves(full, is_leaf=lambda x: isinstance(x, PartitionSpec))
    bad = [leaf for leaf in leaves if not isinstance(leaf, PartitionSpec)]
    if bad:
        raise ExecutionError(f"param_specs leaves must be PartitionSpec or None, got {type(bad[0]).__name__}")
    return tuple(leaves)


def _check_spec(spec: PartitionSpec, shape: tuple[int, ...], tp: int, leaf: int) -> None:
    if len(spec) > len(shape):
        raise ExecutionError(f"parameter leaf {leaf} of shape {shape} has a spec of {len(spec)} axes: {spec}")
    for axis, name in enumerate(spec):
        names = name if isinstance(name, tuple) else (name,)
        for n in names:
            if n not in (None, TENSOR, DATA):
                raise ExecutionError(
                    f"parameter leaf {leaf}'s spec {spec} names axis {n!r}; the mesh has 'data' and 'tensor'"
                )
        if TENSOR in names and shape[axis] % tp:
            raise ExecutionError(
                f"parameter leaf {leaf} of shape {shape} splits axis {axis} ({shape[axis]}) over tp={tp}, "
                "which does not divide it"
            )


def _over_data(spec: PartitionSpec, shape: tuple[int, ...], dp: int) -> PartitionSpec:
    """``spec`` with ``"data"`` added on the first whole axis that divides by ``dp``."""
    if dp == 1 or any(DATA in (n if isinstance(n, tuple) else (n,)) for n in spec):
        return spec
    names = list(spec) + [None] * (len(shape) - len(spec))
    for axis, name in enumerate(names):
        if name is None and shape[axis] % dp == 0:
            names[axis] = DATA
            return PartitionSpec(*names)
    return spec


class StageLayout:
    """Where one stage's values live on its pipeline device's mesh.

    Attributes:
      mesh: the pipeline device's mesh.
      params: per parameter leaf of the stage (in the stage's order), where it is kept.
      states: per parameter leaf, where its optimizer state is kept.
      unreduced: whether gradients accumulate unreduced, one partial sum per data-parallel
        device (``dp > 1`` and ZeRO 0 or 1, or 2 and 3 with ``reduce_once``), and are
        reduced once per step.
      gathers_params: whether the optimizer updates shards of parameters that are kept
        whole, which are then gathered (ZeRO 1 and 2 with some leaf split over ``"data"``).
      accumulators: per parameter leaf, where its accumulator is kept: ``[dp, *leaf]``
        split over ``"data"`` when ``unreduced``, else as in ZeRO 2's layout.
      replicated: a whole value on every device of the mesh (the loss, scalars).
    """

    __slots__ = ("mesh", "params", "states", "unreduced", "gathers_params", "accumulators", "replicated", "_batch")

    def __init__(
        self,
        mesh: Mesh,
        specs: Sequence[PartitionSpec],
        avals: Sequence[Any],
        *,
        zero: int,
        leaves: Sequence[int],
        reduce_once: bool = False,
    ) -> None:
        dp, tp = mesh.shape[DATA], mesh.shape[TENSOR]
        base = []
        for spec, aval, leaf in zip(specs, avals, leaves, strict=True):
            shape = tuple(aval.shape)
            _check_spec(spec, shape, tp, leaf)
            base.append(spec if tp > 1 else PartitionSpec(*(_drop_tensor(n) for n in spec)))
        sharded = [_over_data(spec, tuple(a.shape), dp) for spec, a in zip(base, avals, strict=True)]

        def place(level: int) -> tuple[NamedSharding, ...]:
            return tuple(NamedSharding(mesh, s if zero >= level else b) for s, b in zip(sharded, base, strict=True))

        self.mesh = mesh
        self.params = place(3)
        self.states = place(1)
        self.unreduced = data_size(mesh) > 1 and (zero <= 1 or reduce_once)
        self.gathers_params = self.params != self.states
        entry = _batch_entry(mesh)
        self.accumulators = (
            tuple(NamedSharding(mesh, PartitionSpec(entry, *b)) for b in base) if self.unreduced else place(2)
        )
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self._batch: dict[tuple[bool, bool], NamedSharding] = {}

    @property
    def grads(self) -> tuple[NamedSharding, ...]:
        """Per parameter leaf, where the step's reduced gradient is kept: where the
        optimizer reads it, its state's layout (sharded over ``"data"`` from ZeRO 1 on)."""
        return self.states

    def batch(self, shape: Sequence[int]) -> NamedSharding:
        """A value of ``shape`` split over ``"data"`` along axis 0 (the examples) and, with
        context parallelism, over ``"context"`` along axis 1 (the sequence); values
        without such axes (scalars, axes that do not divide) are replicated along them."""
        cp = self.mesh.shape.get(CONTEXT, 1)
        split = bool(shape) and shape[0] % data_size(self.mesh) == 0
        context = cp > 1 and len(shape) > 1 and shape[1] % cp == 0
        sharding = self._batch.get((split, context))
        if sharding is None:
            entry = _batch_entry(self.mesh)
            spec = (
                PartitionSpec(entry if split else None, CONTEXT)
                if context
                else PartitionSpec(entry)
                if split
                else PartitionSpec()
            )
            sharding = NamedSharding(self.mesh, spec)
            self._batch[(split, context)] = sharding
        return sharding

    def stacked(self) -> NamedSharding:
        """A ``[microbatches, examples, ...]`` stack: axis 1 over the data-parallel devices."""
        return NamedSharding(self.mesh, PartitionSpec(None, _batch_entry(self.mesh)))


def _drop_tensor(name: Any) -> Any:
    # With tp = 1 the "tensor" axis has size 1: dropping it keeps the compiled program
    # free of no-op collectives and identical to the unsharded one.
    if isinstance(name, tuple):
        kept = tuple(n for n in name if n != TENSOR)
        return kept or None
    return None if name == TENSOR else name
