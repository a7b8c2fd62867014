"""What a calibration found and how well it holds, in one form for every source.

A :class:`Report` lists each parameter it set (:class:`Measured`: the cluster field, its
value and unit, and the measurement behind it in words) and each calibration step with
its measured and reproduced seconds (:class:`Reproduced`), so that a reader sees which
number came from where and where the model and the machine disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipedsl.simulator.calibration.fitter import Fitted

__all__ = ["Measured", "Reproduced", "Report", "reproduced", "quantity"]


@dataclass(frozen=True, slots=True)
class Measured:
    """One parameter: the cluster field ``name``, its ``value`` in ``unit`` (``FLOP/s``,
    ``B/s``, ``B``, ``s``, ``cores``, ``devices``) and ``source``, the measurement behind
    it (or the datasheet) in words."""

    name: str
    value: float
    unit: str
    source: str


@dataclass(frozen=True, slots=True)
class Reproduced:
    """One calibration step: what was measured (``name``), its ``measured_s`` and the
    fitted model's ``priced_s`` (seconds)."""

    name: str
    measured_s: float
    priced_s: float

    @property
    def error(self) -> float:
        """(priced - measured) / measured."""
        return self.priced_s / self.measured_s - 1.0


def reproduced(fitted: Fitted) -> tuple[Reproduced, ...]:
    """Each step of ``fitted`` with its price on the fitted cluster."""
    return tuple(Reproduced(s.name, s.measured_s, p) for s, p in zip(fitted.steps, fitted.priced_s, strict=True))


_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n"))


def quantity(value: float, unit: str) -> str:
    """``value`` with an SI prefix on ``unit`` (``2.5e9 FLOP/s`` is ``2.5 GFLOP/s``);
    counts (``cores``, ``devices``) as they are."""
    if unit in ("cores", "devices", "") or value == 0 or not math.isfinite(value):
        return f"{value:.3g} {unit}".rstrip()
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


@dataclass(frozen=True, slots=True)
class Report:
    """A calibration: ``title`` (what was calibrated, on which ``platform``), the
    ``parameters`` it set and the ``steps`` it was fitted to, as reproduced."""

    title: str
    platform: str
    parameters: tuple[Measured, ...]
    steps: tuple[Reproduced, ...]

    @property
    def worst(self) -> float:
        """The largest absolute error of a step (0 without steps)."""
        return max((abs(s.error) for s in self.steps), default=0.0)

    def lines(self) -> list[str]:
        """The report as text lines: the title, one line per parameter, one per step."""
        out = [f"{self.title} (platform: {self.platform})", "parameters:"]
        width = max((len(p.name) for p in self.parameters), default=0)
        for p in self.parameters:
            out.append(f"  {p.name:<{width}}  {quantity(p.value, p.unit):>14}  {p.source}")
        if self.steps:
            out.append(f"calibration steps, measured against the fitted model (worst {self.worst:.1%}):")
            named = max(len(s.name) for s in self.steps)
            for s in self.steps:
                out.append(
                    f"  {s.name:<{named}}  measured {s.measured_s * 1e3:9.2f} ms  model {s.priced_s * 1e3:9.2f} ms"
                    f"  {s.error:+.1%}"
                )
        return out

    def text(self) -> str:
        return "\n".join(self.lines())

    def summary(self) -> str:
        """The report in one paragraph: the title, each parameter's value, and how close
        the fitted model reproduces the steps (:meth:`text` has the sources and each step)."""
        values = ", ".join(f"{p.name} {quantity(p.value, p.unit)}" for p in self.parameters)
        fit = f"; {len(self.steps)} calibration steps reproduced within {self.worst:.0%}" if self.steps else ""
        return f"{self.title}: {values}{fit}"

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "platform": self.platform,
            "parameters": [
                {"name": p.name, "value": p.value, "unit": p.unit, "source": p.source} for p in self.parameters
            ],
            "steps": [{"name": s.name, "measured_s": s.measured_s, "priced_s": s.priced_s} for s in self.steps],
        }
