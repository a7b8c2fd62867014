"""Chrome / Perfetto traces of a timeline.

The trace event format (the JSON that ``chrome://tracing`` and https://ui.perfetto.dev
open) shows one process per pipeline device with two kinds of track: ``compute``, the
device's actions, and ``sends``, the transfers it started. Complete events (``"ph":
"X"``) on one track must not overlap, so transfers that overlap in time (a device may
send again before an earlier transfer has arrived) are spread over as many ``sends``
tracks as needed.

Times in the trace are microseconds (the format's unit); a timeline's seconds are
multiplied by 10^6.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipedsl.errors import PipedslError
from pipedsl.timeline import EventKind, Timeline

__all__ = ["chrome_trace", "write_trace"]

_MICROSECONDS = 1e6
_COMPUTE_TID = 0


def _lanes(starts: list[float], ends: list[float]) -> list[int]:
    """Assign each interval (given in start order) the lowest lane free at its start."""
    lane_end: list[float] = []
    out = []
    for start, end in zip(starts, ends, strict=True):
        for lane, busy_until in enumerate(lane_end):
            if busy_until <= start:
                lane_end[lane] = end
                out.append(lane)
                break
        else:
            lane_end.append(end)
            out.append(len(lane_end) - 1)
    return out


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The trace of ``timeline`` as a JSON-ready dict (``{"traceEvents": [...], ...}``).

    Compute events are named like the schedule's actions (``2F0``); transfers like
    ``act 2→3 mb0`` (what moved, from which stage's device to which device, for which
    microbatch). Every event's ``args`` carry its stage and microbatch.
    """
    rows = _Rows(timeline)
    events = _device_names(timeline.num_devices)
    sends: dict[int, list[int]] = {}
    for row, dev in enumerate(rows.device):
        if rows.kind[row] is EventKind.SEND:
            sends.setdefault(dev, []).append(row)
        else:
            events.append(_compute_event(rows, row))
    for dev, sent in sorted(sends.items()):
        events += _send_events(rows, dev, sent)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": timeline.name, "origin": timeline.origin, "num_devices": timeline.num_devices},
    }


class _Rows:
    """The timeline's columns as Python lists: the trace reads every cell once per event."""

    def __init__(self, timeline: Timeline) -> None:
        self.device = timeline.device.tolist()
        self.kind = timeline.kinds()
        self.stage = timeline.stage.tolist()
        self.microbatch = timeline.microbatch.tolist()
        self.start = timeline.start.tolist()
        self.end = timeline.end.tolist()
        self.peer = timeline.peers()
        self.buffer = timeline.buffer


def _device_names(num_devices: int) -> list[dict[str, Any]]:
    """Metadata events: one process per device, sorted by device, with a compute thread."""
    events: list[dict[str, Any]] = []
    for device in range(num_devices):
        events.append(
            {"ph": "M", "name": "process_name", "pid": device, "tid": 0, "args": {"name": f"device {device}"}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": device, "tid": 0, "args": {"sort_index": device}}
        )
        events.append(
            {"ph": "M", "name": "thread_name", "pid": device, "tid": _COMPUTE_TID, "args": {"name": "compute"}}
        )
    return events


def _compute_event(rows: _Rows, row: int) -> dict[str, Any]:
    """The complete ("X") event of compute ``row``, on its device's compute thread."""
    return {
        "ph": "X",
        "name": f"{rows.stage[row]}{rows.kind[row].value}{rows.microbatch[row]}",
        "cat": rows.kind[row].value,
        "pid": rows.device[row],
        "tid": _COMPUTE_TID,
        "ts": rows.start[row] * _MICROSECONDS,
        "dur": (rows.end[row] - rows.start[row]) * _MICROSECONDS,
        "args": {"stage": rows.stage[row], "microbatch": rows.microbatch[row]},
    }


def _send_events(rows: _Rows, dev: int, sent: list[int]) -> list[dict[str, Any]]:
    """Device ``dev``'s sends (rows ``sent``), on as many lanes as their overlaps need."""
    start, end = rows.start, rows.end
    sent = sorted(sent, key=lambda r: (start[r], r))
    lanes = _lanes([start[r] for r in sent], [end[r] for r in sent])
    events: list[dict[str, Any]] = []
    for lane in range(max(lanes) + 1):
        label = "sends" if lane == 0 else f"sends {lane + 1}"
        events.append({"ph": "M", "name": "thread_name", "pid": dev, "tid": 1 + lane, "args": {"name": label}})
    for row, lane in zip(sent, lanes, strict=True):
        what = rows.buffer[row] or "data"
        events.append(
            {
                "ph": "X",
                "name": f"{what} {dev}→{rows.peer[row]} mb{rows.microbatch[row]}",
                "cat": "send",
                "pid": dev,
                "tid": 1 + lane,
                "ts": start[row] * _MICROSECONDS,
                "dur": (end[row] - start[row]) * _MICROSECONDS,
                "args": {
                    "buffer": what,
                    "stage": rows.stage[row],
                    "microbatch": rows.microbatch[row],
                    "peer": rows.peer[row],
                },
            }
        )
    return events


def write_trace(timeline: Timeline, path: str | Path) -> None:
    """Write :func:`chrome_trace` of ``timeline`` to ``path`` as JSON."""
    try:
        Path(path).write_text(json.dumps(chrome_trace(timeline)), encoding="utf-8")
    except OSError as err:
        raise PipedslError(f"{path}: cannot write trace: {err.strerror or err}") from None
