"""Numbers and counts as people write them, for every message and table.

``plural(3, "microbatch")`` is "3 microbatches"; ``number(33.300000000000004)`` is
"33.3"; ``number(16000000016.0)`` is "16,000,000,016"; ``byte_size(1.6e19)`` is
"16 EB". The core, the simulator and the command line print counts, quantities and sizes
through these, so that no float's last bits and no exponent reach a reader.
"""

from __future__ import annotations

import math

__all__ = ["plural", "number", "byte_size"]


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless ``count`` is one: "1 stage", "2 stages",
    "3 microbatches", "1,024 chips"."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count:,} {noun}es" if noun.endswith(("ch", "sh", "s", "x")) else f"{count:,} {noun}s"


def number(value: float, *, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits without an exponent or trailing zeros
    ("33.3", "0.00125"); from ``10**digits`` up, whole, with thousands separators
    ("16,000,000,016"). Not-a-number and infinities as Python names them."""
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) >= 10**digits:
        return f"{round(value):,}"
    decimals = max(digits - 1 - math.floor(math.log10(abs(value))), 0)
    text = f"{value:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


_BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB", "EB")


def byte_size(num_bytes: float) -> str:
    """``num_bytes`` in the largest decimal unit (B, KB, ... EB) that leaves a number of at
    least one: "512 B", "1.5 GB", "16 EB"."""
    value, unit = float(num_bytes), _BYTE_UNITS[0]
    for next_unit in _BYTE_UNITS[1:]:
        if abs(value) < 1000:
            break
        value, unit = value / 1000, next_unit
    return f"{number(value)} {unit}"
