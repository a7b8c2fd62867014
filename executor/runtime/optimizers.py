"""Which optimizers a pipeline can apply stage by stage, and how.

Every stage's parameters are updated where they live (:mod:`pipedsl.executor.runtime.worker`). That
is the one-device update when the optimizer treats each leaf on its own (sgd, adam, adamw,
per-leaf clipping), and also when its leaves meet only through the global norm of the
gradients (``optax.clip_by_global_norm``), given the rest of the model's norm as one more
leaf. :func:`couples_through_global_norm` tells these apart by running the optimizer on a
probe, and refuses any other coupling.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedsl.executor.errors import ExecutionError

__all__ = ["couples_through_global_norm"]


# Optimizers probed, by id: (the optimizer, so that an id reused by another object is not
# taken for it, the answer). Every device of a pipeline asks about the same optimizer, and
# a probe runs a dozen small programs.
_PROBED: OrderedDict[int, tuple[optax.GradientTransformation, bool]] = OrderedDict()
_PROBED_SIZE = 16


def couples_through_global_norm(optimizer: optax.GradientTransformation) -> bool:
    """Whether ``optimizer`` combines its leaves, found by running it on a probe of two
    leaves on the CPU at gradient scales from 1e-3 to 1e6 (whatever thresholds it clips at):
    False when each leaf's update is what it is alone (sgd, adam, clipping each leaf: the
    per-stage update is exact), True when the leaves meet only through the global norm
    (``clip_by_global_norm``: exact with the rest of the norm as one more leaf). Refused
    otherwise, as an update per stage could not give the one-device result. An optimizer
    that cannot take the probe's tree (one written for a given structure) is applied
    per stage as it is. Probed once per optimizer object."""
    found = _PROBED.get(id(optimizer))
    if found is not None and found[0] is optimizer:
        _PROBED.move_to_end(id(optimizer))
        return found[1]
    coupled = _probe(optimizer)
    _PROBED[id(optimizer)] = (optimizer, coupled)
    if len(_PROBED) > _PROBED_SIZE:
        _PROBED.popitem(last=False)
    return coupled


def _probe(optimizer: optax.GradientTransformation) -> bool:
    a, b = np.array([3.0, -4.0], np.float32), np.array([12.0, 5.0, 1.0], np.float32)

    def updates_of_a(tree: tuple[Any, ...]) -> list[np.ndarray]:
        def run(tree: tuple[Any, ...]) -> list[Any]:
            params = tuple(jnp.full_like(leaf, 0.5) for leaf in tree)
            state = optimizer.init(params)
            out = []
            for scale in (1e-3, 1.0, 1e3, 1e6):
                updates, state = optimizer.update(tuple(leaf * scale for leaf in tree), state, params)
                out.append(updates[0])
            return out

        # One program per probe: run op by op, each of the optimizer's operations would
        # compile a program of its own (a second of the first step on a CPU).
        return [np.asarray(u) for u in jax.jit(run)(tree)]

    def same(x: list[np.ndarray], y: list[np.ndarray]) -> bool:
        return all(np.allclose(u, v, rtol=1e-5, atol=0.0) for u, v in zip(x, y, strict=True))

    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS names no CPU: the probe's few values go to a device
        cpu = None
    with jax.default_device(cpu):
        try:
            together = updates_of_a((a, b))
            alone = updates_of_a((a,))
        except Exception:  # an optimizer for another tree structure: not ours to probe
            return False
        if same(together, alone):
            return False
        if same(together, updates_of_a((a, np.array(np.linalg.norm(b), np.float32)))):
            return True
    raise ExecutionError(
        "the optimizer combines parameters in another way than through the global norm of the gradients: "
        "the pipeline updates each stage's parameters where they live, so it could not give the one-device "
        "result; use transforms that treat parameters independently (sgd, adam, adamw, ...), optionally after "
        "optax.clip_by_global_norm"
    )
