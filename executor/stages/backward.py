"""The input/weight split of a stage's backward, without recomputation.

A stage's backward (``B``) maps its residuals and the cotangent of its output to the
cotangents of its parameters and of its input. Zero-bubble schedules run that in two
halves: ``I`` computes the input cotangent as early as possible (the previous stage is
waiting for it), ``W`` computes the parameter cotangents later, in a bubble.

Two separately compiled halves of one ``jax.vjp`` would each walk the whole cotangent
chain through the stage, so ``W`` would redo most of ``I``. Instead the backward is
traced once into a jaxpr and its equations are divided:

- ``I`` gets every equation the input cotangents depend on;
- ``W`` gets the remaining equations the parameter cotangents depend on;
- what ``W`` reads that ``I`` computed (intermediate cotangents) or that ``I`` was given
  (residuals, the output cotangent) is the hand-over: the ``WEIGHT_RESIDUAL`` buffer.

Every equation of the backward runs exactly once across ``I`` and ``W``, so ``I + W``
does the work of ``B``; :meth:`BackwardSplit.counts` lets tests check that per primitive.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, Var

from pipedsl.executor.stages.jaxprs import (
    CALL_PRIMITIVES,
    REMAT_PRIMITIVES,
    defined_by,
    evaluate,
    inline_calls,
    needed,
    read,
)

__all__ = ["BackwardSplit", "split_backward"]


@dataclass(frozen=True, slots=True)
class BackwardSplit:
    """A stage's backward program and its division into ``I`` and ``W``.

    Attributes:
      jaxpr: the backward with nested calls inlined; its inputs are the residual slots
        followed by the output-cotangent slots, its outputs the ``num_param_cts``
        parameter cotangents followed by the input cotangents.
      num_param_cts: how many outputs are parameter cotangents.
      input_eqns: the equations ``I`` runs, in program order.
      weight_eqns: the equations ``W`` runs, in program order.
      handoff_computed: variables ``I`` computes and ``W`` reads.
      handoff_inputs: positions of backward inputs that ``W`` reads directly.
    """

    jaxpr: ClosedJaxpr
    num_param_cts: int
    input_eqns: tuple[JaxprEqn, ...]
    weight_eqns: tuple[JaxprEqn, ...]
    handoff_computed: tuple[Var, ...]
    handoff_inputs: tuple[int, ...]

    def _env(self, inputs: Sequence[Any]) -> dict[Var, Any]:
        env = dict(zip(self.jaxpr.jaxpr.constvars, self.jaxpr.consts, strict=True))
        env.update(zip(self.jaxpr.jaxpr.invars, inputs, strict=True))
        return env

    @property
    def _param_outs(self) -> list[Var | Literal]:
        return self.jaxpr.jaxpr.outvars[: self.num_param_cts]

    @property
    def _input_outs(self) -> list[Var | Literal]:
        return self.jaxpr.jaxpr.outvars[self.num_param_cts :]

    def full(self, inputs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """``B``: (parameter cotangents, input cotangents) from all backward inputs."""
        env = self._env(inputs)
        evaluate(self.jaxpr.jaxpr.eqns, env)
        return [read(env, v) for v in self._param_outs], [read(env, v) for v in self._input_outs]

    def input_half(self, inputs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """``I``: (input cotangents, the computed part of the hand-over)."""
        env = self._env(inputs)
        evaluate(self.input_eqns, env)
        return [read(env, v) for v in self._input_outs], [env[v] for v in self.handoff_computed]

    def weight_half(self, computed: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
        """``W``: parameter cotangents from the hand-over.

        ``computed`` matches :attr:`handoff_computed`; ``inputs`` matches
        :attr:`handoff_inputs` (the backward inputs ``W`` reads).
        """
        invars = self.jaxpr.jaxpr.invars
        env = dict(zip(self.jaxpr.jaxpr.constvars, self.jaxpr.consts, strict=True))
        env.update(zip(self.handoff_computed, computed, strict=True))
        env.update((invars[i], value) for i, value in zip(self.handoff_inputs, inputs, strict=True))
        evaluate(self.weight_eqns, env)
        return [read(env, v) for v in self._param_outs]

    def counts(self) -> tuple[Counter[str], Counter[str], Counter[str]]:
        """Equations per primitive name in (``B``, ``I``, ``W``)."""

        def count(eqns: Sequence[JaxprEqn]) -> Counter[str]:
            return Counter(e.primitive.name for e in eqns)

        return count(self.jaxpr.jaxpr.eqns), count(self.input_eqns), count(self.weight_eqns)


def split_backward(backward: ClosedJaxpr, *, num_param_cts: int) -> BackwardSplit:
    """Inline ``backward``'s nested calls and divide its equations between ``I`` and ``W``.

    ``backward``'s outputs are ``num_param_cts`` parameter cotangents followed by the
    input cotangents (none on the first stage, whose ``I`` then only hands over).
    """
    flat = inline_calls(backward, inline=CALL_PRIMITIVES | REMAT_PRIMITIVES)
    jaxpr = flat.jaxpr
    eqns = jaxpr.eqns
    param_outs = jaxpr.outvars[:num_param_cts]
    input_outs = jaxpr.outvars[num_param_cts:]
    in_input = needed(eqns, input_outs)
    in_weight = needed(eqns, param_outs, skip=lambda i: in_input[i])

    weight_eqns = [e for e, w in zip(eqns, in_weight, strict=True) if w]
    produced_by_weight = {v for e in weight_eqns for v in e.outvars}
    wanted = [v for e in weight_eqns for v in e.invars] + list(param_outs)
    producer = defined_by(eqns)
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    computed: dict[Var, int] = {}
    from_inputs: set[int] = set()
    for v in wanted:
        if not isinstance(v, Var) or v in produced_by_weight:
            continue
        if v in producer:
            computed[v] = producer[v]
        elif v in position:
            from_inputs.add(position[v])
    return BackwardSplit(
        jaxpr=flat,
        num_param_cts=num_param_cts,
        input_eqns=tuple(e for e, i in zip(eqns, in_input, strict=True) if i),
        weight_eqns=tuple(weight_eqns),
        handoff_computed=tuple(sorted(computed, key=computed.__getitem__)),
        handoff_inputs=tuple(sorted(from_inputs)),
    )
