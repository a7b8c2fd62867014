"""Integers given from outside a file, read as the language reads them.

A parameter's value comes from a file's default, from ``-p NAME=VALUE`` on a command line,
or from a keyword argument of :func:`pipedsl.load`. The two that are text are read as the
language reads a number: ASCII digits, with a minus sign for a negative one, within 64 bits.
So ``-p pp=٤`` (an Arabic-Indic four), ``pp=1_0`` and ``pp=+4``, which no ``.sched`` file may
write, are refused there too, where Python's ``int()`` would take them.
"""

from __future__ import annotations

import numbers
import re

from pipedsl.lang.arith import INT_MAX, INT_MIN

__all__ = ["integer_value", "parse_integer"]

_INTEGER = re.compile(r"-?[0-9]+", re.ASCII)
# Python's int() refuses digit strings past its own limit with its own error: longer than
# any 64-bit number is refused before it is read.
_MAX_DIGITS = 20


def parse_integer(text: str) -> int | None:
    """``text`` (spaces around it allowed) as a 64-bit integer the way a ``.sched`` file
    writes one; None where it is not one."""
    text = text.strip()
    if len(text) > _MAX_DIGITS or not _INTEGER.fullmatch(text):
        return None
    number = int(text)
    return number if INT_MIN <= number <= INT_MAX else None


def integer_value(value: object) -> int | None:
    """A parameter's value as a 64-bit integer: an integer of any integer type (numpy's
    too; not a bool), or text :func:`parse_integer` reads; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        number = int(value)
        return number if INT_MIN <= number <= INT_MAX else None
    if isinstance(value, str):
        return parse_integer(value)
    return None
