"""The choices a :class:`~pipedsl.policy.Policy` leaves to the synthesiser
(:mod:`~pipedsl.simulator.synthesize`), as the variants it tries: how far ahead a device
runs its forwards, whether its backwards alternate strictly with them, and whether a
``W`` waits for work known to arrive soon. The fastest variant's order wins, the first of
equally fast ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipedsl.policy import Policy

__all__ = ["AHEAD", "Variant", "variants"]

AHEAD = ("1f1b", "eager", "timed", "limits")
"""The ahead counts a :class:`Variant` can name."""


@dataclass(frozen=True, slots=True)
class Variant:
    """One setting of the choices a policy leaves to the synthesiser.

    Attributes:
      ahead: forwards a device keeps ahead of its backwards when the policy states no
        warm-up: ``"1f1b"`` (S - s for a device whose first stage is s), ``"eager"``
        (2(S - s) - 1), ``"timed"`` (the forwards that fit before the first backward can
        arrive under the costs: eager's count for B = 2F and free transfers, more for a
        dearer backward or transfer) or ``"limits"`` (no count: the limits and priorities
        decide).
      strict: with an ahead count, a backward runs only when the device is that many
        forwards ahead (or can run no more forwards): 1F1B's strict alternation, which keeps
        the devices in step; without it a ready backward may run earlier.
      guard_w: a ready ``W`` waits for a backward or admissible forward known to arrive
        before the ``W`` would end, when the delay it would cause is more than
        ``(1 - guard_w)`` × its cost (0: never waits; 1: waits rather than delay at all).
        ``W only in idle time`` fixes it at 1.
    """

    ahead: str
    strict: bool = False
    guard_w: float = 0.0

    def __post_init__(self) -> None:
        if self.ahead not in AHEAD:
            raise ValueError(f"ahead must be one of {', '.join(AHEAD)}, got {self.ahead!r}")
        if not 0.0 <= self.guard_w <= 1.0:
            raise ValueError(f"guard_w is a fraction in [0, 1], got {self.guard_w!r}")


#: The variants tried without stated warm-up counts. Chosen on the comparison grid of
#: ``bench/bench_synthesis.py`` (depths 2-8, 1-4 microbatches per stage, unequal F/I/W,
#: communication from a tenth of F to F, memory limits pp .. 2pp): each is the fastest
#: somewhere, and together they are never slower there than the zero-bubble paper's
#: scheduler with the best of its settings. The last three came from small communication
#: (a tenth to a quarter of F), where a ``W`` that waits for part of its cost, or a
#: warm-up timed to the backward's return, hides the hops that the first four leave open.
_DEFAULT_VARIANTS = (
    Variant("eager"),
    Variant("1f1b", strict=True, guard_w=1.0),
    Variant("limits"),
    Variant("1f1b"),
    Variant("eager", guard_w=0.5),
    Variant("timed", guard_w=0.25),
    Variant("eager", guard_w=0.75),
)


def variants(policy: Policy) -> tuple[Variant, ...]:
    """The variants :func:`~pipedsl.simulator.synthesize.synthesize` tries for ``policy``, in a fixed order (the first
    of equally fast orders wins)."""
    if policy.warmup is None:
        return _DEFAULT_VARIANTS
    # Stated warm-up counts fix the ahead count; "limits" here just means "as stated".
    return (Variant("limits", strict=True, guard_w=1.0), Variant("limits"))
