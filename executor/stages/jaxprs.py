"""Working with jaxprs: evaluate a subset of equations, inline calls, trace dependencies.

Stage splitting (:mod:`pipedsl.executor.stages.split`) and the input/weight split of the
backward (:mod:`pipedsl.executor.stages.backward`) both cut one traced program into pieces and
run each piece on its own. A piece here is just a list of equations of the original
jaxpr plus the variables it reads and writes; :func:`evaluate` binds those equations'
primitives again, so a piece is an ordinary Python function that ``jax.jit``, ``jax.vjp``
and ``jax.make_jaxpr`` can trace. Only the public ``jax.extend.core`` types are used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

__all__ = [
    "CALL_PRIMITIVES",
    "REMAT_PRIMITIVES",
    "read",
    "evaluate",
    "inline_calls",
    "needed",
    "defined_by",
    "aval_struct",
    "calls_host",
]

# Calls whose body can be evaluated in place without changing what is computed.
CALL_PRIMITIVES: frozenset[str] = frozenset({"jit", "pjit", "closed_call", "core_call"})
# Rematerialisation wrappers; inlined only in backward programs, where the forward they
# protect from common-subexpression elimination is not present anyway.
REMAT_PRIMITIVES: frozenset[str] = frozenset({"remat2", "checkpoint"})

Env = dict[Var, Any]


def read(env: Mapping[Var, Any], atom: Var | Literal) -> Any:
    """The value of ``atom``: a literal's constant, or a variable's entry in ``env``."""
    if isinstance(atom, Literal):
        return atom.val
    return env[atom]


def _write(env: Env, outvars: Sequence[Var], values: Sequence[Any]) -> None:
    for var, value in zip(outvars, values, strict=True):
        if not isinstance(var, DropVar):
            env[var] = value


def _body(eqn: JaxprEqn) -> tuple[Jaxpr, Sequence[Any]] | None:
    """The jaxpr and constants of a call-like equation, or None if it has no single body."""
    for key in ("jaxpr", "call_jaxpr"):
        body = eqn.params.get(key)
        if isinstance(body, ClosedJaxpr):
            return body.jaxpr, body.consts
        if isinstance(body, Jaxpr):
            return body, ()
    return None


def evaluate(eqns: Iterable[JaxprEqn], env: Env, *, inline: frozenset[str] = frozenset()) -> None:
    """Run ``eqns`` in order, reading their inputs from ``env`` and writing outputs to it.

    Equations whose primitive is named in ``inline`` are not bound as calls: their body
    is evaluated in place, recursively, so a trace of this function sees its equations.
    """
    for eqn in eqns:
        invals = [read(env, v) for v in eqn.invars]
        body = _body(eqn) if eqn.primitive.name in inline else None
        if body is not None:
            jaxpr, consts = body
            inner: Env = dict(zip(jaxpr.constvars, consts, strict=True))
            inner.update(zip(jaxpr.invars, invals, strict=True))
            evaluate(jaxpr.eqns, inner, inline=inline)
            _write(env, eqn.outvars, [read(inner, v) for v in jaxpr.outvars])
            continue
        bound = eqn.primitive.get_bind_params(eqn.params)
        # Older JAX returns (subfunctions, params); newer returns params alone.
        subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*subfuns, *invals, **params)
        _write(env, eqn.outvars, out if eqn.primitive.multiple_results else [out])


def calls_host(closed: ClosedJaxpr) -> bool:
    """Whether ``closed`` (or any jaxpr inside it: calls, loops, branches) calls back into
    Python on the host (``jax.debug.callback``, ``jax.pure_callback``, ``io_callback``)."""
    stack: list[Jaxpr] = [closed.jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            if "callback" in eqn.primitive.name:
                return True
            for value in eqn.params.values():
                for item in value if isinstance(value, tuple | list) else (value,):
                    if isinstance(item, ClosedJaxpr):
                        stack.append(item.jaxpr)
                    elif isinstance(item, Jaxpr):
                        stack.append(item)
    return False


def aval_struct(aval: Any) -> jax.ShapeDtypeStruct:
    """A ``ShapeDtypeStruct`` with ``aval``'s shape, dtype and weak type."""
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def inline_calls(closed: ClosedJaxpr, *, inline: frozenset[str] = CALL_PRIMITIVES) -> ClosedJaxpr:
    """``closed`` traced again with the calls named in ``inline`` flattened into it.

    The result computes the same values with the same inputs and outputs, but a nested
    ``jit`` (which ``jax.numpy`` uses internally) no longer hides its equations, so they
    can be assigned to stages or split between ``I`` and ``W`` one by one.
    """
    jaxpr = closed.jaxpr

    def run(*args: Any) -> list[Any]:
        env: Env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        evaluate(jaxpr.eqns, env, inline=inline)
        return [read(env, v) for v in jaxpr.outvars]

    return jax.make_jaxpr(run)(*(aval_struct(v.aval) for v in jaxpr.invars))


def defined_by(eqns: Sequence[JaxprEqn]) -> dict[Var, int]:
    """For every variable an equation defines, the index of that equation."""
    return {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars if not isinstance(v, DropVar)}


def needed(
    eqns: Sequence[JaxprEqn],
    outputs: Iterable[Var | Literal],
    *,
    skip: Callable[[int], bool] | None = None,
) -> list[bool]:
    """Which of ``eqns`` are needed to compute ``outputs`` (a flag per equation).

    ``skip(i)`` marks equations whose outputs are taken as given: they are neither
    included nor followed further back.
    """
    producer = defined_by(eqns)
    flags = [False] * len(eqns)
    stack = [producer[v] for v in outputs if isinstance(v, Var) and v in producer]
    while stack:
        i = stack.pop()
        if flags[i] or (skip is not None and skip(i)):
            continue
        flags[i] = True
        stack.extend(producer[v] for v in eqns[i].invars if isinstance(v, Var) and v in producer)
    return flags
