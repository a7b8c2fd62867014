"""Timeline pictures: one panel per run, one row per device, one colour per action kind.

Simulated and measured timelines are drawn alike, so a measured run can sit beside the
simulation of the same schedule. Panels of one origin (all simulated, or all measured)
share their time axis by default, so the shorter step is visibly shorter; a measured step
beside a simulated one is drawn on its own time, since the cost model's seconds are not
the machine's (a 2.5 ms step on a 15 s axis would show no bars). Each device row shows its computes as bars labelled
with their microbatch (where the label fits) and, in a thin lane beneath, the transfers
it sent as grey bars. The critical path of a simulation can be outlined.

matplotlib is imported here and only here, so the rest of the simulator never pays for
it. Figures are built as plain ``matplotlib.figure.Figure`` objects, outside pyplot: no
backend is chosen or switched (a notebook's inline display keeps working) and no global
figure list holds on to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipedsl.errors import PipedslError
from pipedsl.timeline import EventKind, Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Panel", "KIND_COLOURS", "plot_timelines", "save_figure", "FORMATS"]

FORMATS = (".png", ".svg", ".pdf")

# Tableau 10 hues: distinct for common colour-vision deficiencies and in greyscale.
# B is the unsplit backward; I and W, its two halves, get their own hues.
KIND_COLOURS: dict[EventKind, str] = {
    EventKind.F: "#4e79a7",
    EventKind.B: "#f28e2b",
    EventKind.I: "#e15759",
    EventKind.W: "#59a14f",
}
_LABELS = {
    EventKind.F: "F forward",
    EventKind.B: "B backward",
    EventKind.I: "I input grad",
    EventKind.W: "W weight grad",
}
_DARK = {EventKind.F, EventKind.I, EventKind.W}
_SEND_COLOUR = "#9c9c9c"
# Above this many bars in a panel, microbatch labels would be unreadable and slow.
_MAX_LABELS = 4000
_COMPUTE_HEIGHT = 0.62
_LATER_STAGE_TINT = 0.45
_SEND_HEIGHT = 0.16


@dataclass(frozen=True, slots=True)
class Panel:
    """One timeline to draw.

    Attributes:
      timeline: the events.
      title: the panel's title; the timeline's name when empty.
      critical: timeline rows to outline (a critical path), or empty.
    """

    timeline: Timeline
    title: str = ""
    critical: tuple[int, ...] = ()


def _chunks(tl: Timeline) -> np.ndarray:
    """Per event, the rank of its stage among the stages its device runs (0 for the
    device's first stage, 1 for its second, ...), shape (events,)."""
    # Widened: a simulated timeline's int32 columns would overflow in the product.
    device, stages = tl.device.astype(np.int64), int(tl.stage.max(initial=0)) + 1
    key = device * stages + tl.stage
    held = np.unique(key)  # sorted by device, then stage
    first_of_device = np.searchsorted(held, device * stages)
    return np.searchsorted(held, key) - first_of_device


def _lighten(colour: str, amount: float) -> str:
    """``colour`` mixed with white: 0 keeps it, 1 is white."""
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def _draw_panel(ax: Axes, panel: Panel, *, seconds_per_inch: float) -> None:
    """Draw one timeline on ``ax``, whose time axis shows ``seconds_per_inch``."""
    tl = panel.timeline
    compute = tl.compute_mask
    # A device's later stages (interleaved chunks, the way back up a V) are lighter.
    chunk = _chunks(tl)
    lightness = chunk * (_LATER_STAGE_TINT / max(int(chunk[compute].max(initial=0)), 1))
    _draw_compute(ax, tl, chunk, lightness, seconds_per_inch=seconds_per_inch)
    _draw_sends(ax, tl)
    if panel.critical:
        _draw_critical(ax, tl, np.asarray(panel.critical, dtype=np.int64))
    _draw_labels(ax, tl, lightness, seconds_per_inch=seconds_per_inch)
    _style_axes(ax, tl, title=panel.title or tl.name)


def _bars(tl: Timeline, sel: np.ndarray) -> list[tuple[float, float]]:
    """(start, duration) of the selected events, as ``broken_barh`` takes them."""
    return list(zip(tl.start[sel].tolist(), tl.durations[sel].tolist(), strict=True))


def _draw_compute(ax: Axes, tl: Timeline, chunk: np.ndarray, lightness: np.ndarray, *, seconds_per_inch: float) -> None:
    """One bar per compute event, coloured by kind and lightened by stage rank."""
    compute, duration, device = tl.compute_mask, tl.durations, tl.device
    # White edges separate neighbouring bars; on bars a few pixels wide they would
    # cover the colour, so dense timelines are drawn without them.
    typical = float(np.median(duration[compute])) if compute.any() else 0.0
    edge = 0.4 if typical >= 0.06 * seconds_per_inch else 0.0
    width = int(chunk.max(initial=0)) + 1
    for event_kind in KIND_COLOURS:
        mask = tl.mask(event_kind)
        for pair in np.unique(device[mask] * width + chunk[mask]).tolist():
            dev, ch = divmod(pair, width)
            sel = mask & (device == dev) & (chunk == ch)
            ax.broken_barh(
                _bars(tl, sel),
                (dev - _COMPUTE_HEIGHT / 2, _COMPUTE_HEIGHT),
                facecolors=_lighten(KIND_COLOURS[event_kind], float(lightness[sel][0])),
                edgecolors="white",
                linewidth=edge,
            )


def _draw_sends(ax: Axes, tl: Timeline) -> None:
    """Sends that take time, in a thin lane under their device's compute lane."""
    sends = (~tl.compute_mask) & (tl.durations > 0)
    for dev in np.unique(tl.device[sends]).tolist():
        ax.broken_barh(
            _bars(tl, sends & (tl.device == dev)),
            (dev + _COMPUTE_HEIGHT / 2 + 0.03, _SEND_HEIGHT),
            facecolors=_SEND_COLOUR,
            edgecolors="none",
            alpha=0.7,
        )


def _draw_critical(ax: Axes, tl: Timeline, crit: np.ndarray) -> None:
    """Outline the events of a critical path (``crit``: timeline rows) in black."""
    device, compute = tl.device, tl.compute_mask
    crit = crit[tl.durations[crit] > 0]
    for dev in np.unique(device[crit]).tolist():
        for on_compute in (True, False):
            sel = crit[(device[crit] == dev) & (compute[crit] == on_compute)]
            if not len(sel):
                continue
            lane = (dev - _COMPUTE_HEIGHT / 2, _COMPUTE_HEIGHT)
            if not on_compute:
                lane = (dev + _COMPUTE_HEIGHT / 2 + 0.03, _SEND_HEIGHT)
            ax.broken_barh(_bars(tl, sel), lane, facecolors="none", edgecolors="black", linewidth=1.2)


def _draw_labels(ax: Axes, tl: Timeline, lightness: np.ndarray, *, seconds_per_inch: float) -> None:
    """Microbatch numbers on the compute bars wide enough to hold them."""
    start, duration, compute = tl.start, tl.durations, tl.compute_mask
    # A label fits when its bar is wider than its digits plus a margin.
    digits = np.floor(np.log10(np.maximum(tl.microbatch, 1))) + 1
    labelled = np.flatnonzero(compute & (duration >= seconds_per_inch * (0.065 * digits + 0.05)))
    if not 0 < len(labelled) <= _MAX_LABELS:
        return
    for row in labelled.tolist():
        on_dark = tl.kind_at(row) in _DARK and lightness[row] < 0.3
        ax.text(
            float(start[row] + duration[row] / 2),
            int(tl.device[row]),
            str(int(tl.microbatch[row])),
            ha="center",
            va="center",
            fontsize=7,
            color="white" if on_dark else "black",
            clip_on=True,
        )


def _style_axes(ax: Axes, tl: Timeline, *, title: str) -> None:
    """Device rows, a light time grid, and a title with makespan and bubble."""
    rows = tl.num_devices
    ax.set_ylim(rows - 0.5 + _SEND_HEIGHT, -0.5 - 0.05)
    ax.set_yticks(range(rows), [f"dev {d}" for d in range(rows)], fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    span = tl.makespan
    busy = float(tl.busy().sum())
    bubble = 1.0 - busy / (rows * span) if span > 0 else 0.0
    origin = "" if tl.origin == "simulated" else f" [{tl.origin}]"
    ax.set_title(f"{title}{origin}    makespan {span:.4g} s · bubble {bubble:.1%}", loc="left", fontsize=9.5)


def plot_timelines(
    panels: Sequence[Panel], *, share_time: bool | None = None, caption: str = "", width: float = 13.0
) -> Figure:
    """A figure with one panel per timeline, stacked top to bottom.

    Args:
      panels: what to draw, in order.
      share_time: give every panel the same time axis (compare makespans at a glance);
        False scales each panel to its own makespan (for runs of different units); None,
        the default, shares it when every timeline has the same origin (simulated or
        measured) and gives each its own otherwise.
      caption: a line under the legend, such as the cost model's description.
      width: figure width in inches; heights follow from the number of devices.
    """
    if not panels:
        raise PipedslError("nothing to plot: give at least one schedule or timeline")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if share_time is None:
        share_time = len({p.timeline.origin for p in panels}) == 1
    heights = [0.32 * p.timeline.num_devices + 0.55 for p in panels]
    fig = Figure(figsize=(width, sum(heights) + 0.9))
    axes = fig.subplots(len(panels), 1, gridspec_kw={"height_ratios": heights}, sharex=share_time, squeeze=False)
    spans = [max(p.timeline.makespan, 1e-12) for p in panels]
    plot_width = width * 0.9  # inches of time axis, after the device labels
    for ax, panel, span in zip(axes[:, 0], panels, spans, strict=True):
        shown = max(spans) if share_time else span
        _draw_panel(ax, panel, seconds_per_inch=shown / plot_width)
        ax.set_xlim(0, shown * 1.005)
    axes[-1, 0].set_xlabel("time (s)", fontsize=8.5)
    kinds_present = set().union(*(p.timeline.kinds_present() for p in panels))
    handles = [Patch(color=KIND_COLOURS[k], label=_LABELS[k]) for k in KIND_COLOURS if k in kinds_present]
    if EventKind.SEND in kinds_present and any(
        (p.timeline.mask(EventKind.SEND) & (p.timeline.durations > 0)).any() for p in panels
    ):
        handles.append(Patch(color=_SEND_COLOUR, alpha=0.7, label="send (transfer)"))
    if any(p.critical for p in panels):
        handles.append(Patch(facecolor="none", edgecolor="black", linewidth=1.2, label="critical path"))
    if any(int(_chunks(p.timeline).max(initial=0)) > 0 for p in panels):
        handles.append(
            Patch(color=_lighten(KIND_COLOURS[EventKind.F], _LATER_STAGE_TINT), label="lighter: later stage")
        )
    top = sum(heights) + 0.9
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), frameon=False, fontsize=8.5)
    header = 0.45
    if caption:
        fig.text(0.5, 1 - 0.38 / top, caption, ha="center", va="top", fontsize=8, color="#555555")
        header += 0.2
    fig.tight_layout(rect=(0, 0, 1, 1 - header / top))
    return fig


def save_figure(figure: Figure, path: str | Path, *, dpi: int = 150) -> None:
    """Write ``figure`` as PNG, SVG or PDF (by ``path``'s suffix)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise PipedslError(f"{path}: cannot tell the picture format; end the name in {', '.join(FORMATS)}")
    try:
        figure.savefig(path, dpi=dpi)
    except OSError as err:
        raise PipedslError(f"{path}: cannot write picture: {err.strerror or err}") from None
