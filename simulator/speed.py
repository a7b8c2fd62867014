"""How one time compares with another, in words: the one convention every command
prints ("1.06x faster", "1.06x slower"), so that no bare ratio leaves its reader to
guess which way it points. Imports nothing, so that a command that only simulates
can use it."""

from __future__ import annotations

__all__ = ["relative_speed"]


def relative_speed(time_s: float, reference_s: float) -> str:
    """How fast ``time_s`` is against ``reference_s`` in words, the one convention every
    command prints: ``"1.06x faster"`` (the reference takes 1.06 times as long),
    ``"1.06x slower"`` (this takes 1.06 times as long), ``"as fast"`` within 0.5%."""
    if time_s <= 0 or reference_s <= 0:
        return "-"
    if round(time_s / reference_s, 2) == 1.0:
        return "as fast"
    if time_s < reference_s:
        return f"{reference_s / time_s:.2f}x faster"
    return f"{time_s / reference_s:.2f}x slower"
