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
    events: list[dict[str, Any]] = []
    for device in range(timeline.num_devices):
        events.append(
            {"ph": "M", "name": "process_name", "pid": device, "tid": 0, "args": {"name": f"device {device}"}}
        )
        events.append({"ph": "M", "name": "process_sort_index", "pid": device, "tid": 0, "args": {"sort_index": device}})
        events.append({"ph": "M", "name": "thread_name", "pid": device, "tid": _COMPUTE_TID, "args": {"name": "compute"}})

    device = timeline.device.tolist()
    kind = timeline.kinds()
    stage = timeline.stage.tolist()
    microbatch = timeline.microbatch.tolist()
    start = timeline.start.tolist()
    end = timeline.end.tolist()
    peer = timeline.peers()

    sends: dict[int, list[int]] = {}
    for row in range(len(timeline)):
        if kind[row] is EventKind.SEND:
            sends.setdefault(device[row], []).append(row)
            continue
        name = f"{stage[row]}{kind[row].value}{microbatch[row]}"
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": kind[row].value,
                "pid": device[row],
                "tid": _COMPUTE_TID,
                "ts": start[row] * _MICROSECONDS,
                "dur": (end[row] - start[row]) * _MICROSECONDS,
                "args": {"stage": stage[row], "microbatch": microbatch[row]},
            }
        )

    for dev, rows in sorted(sends.items()):
        rows.sort(key=lambda r: (start[r], r))
        lanes = _lanes([start[r] for r in rows], [end[r] for r in rows])
        for lane in range(max(lanes) + 1):
            label = "sends" if lane == 0 else f"sends {lane + 1}"
            events.append({"ph": "M", "name": "thread_name", "pid": dev, "tid": 1 + lane, "args": {"name": label}})
        for row, lane in zip(rows, lanes, strict=True):
            what = timeline.buffer[row] or "data"
            events.append(
                {
                    "ph": "X",
                    "name": f"{what} {dev}→{peer[row]} mb{microbatch[row]}",
                    "cat": "send",
                    "pid": dev,
                    "tid": 1 + lane,
                    "ts": start[row] * _MICROSECONDS,
                    "dur": (end[row] - start[row]) * _MICROSECONDS,
                    "args": {"buffer": what, "stage": stage[row], "microbatch": microbatch[row], "peer": peer[row]},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": timeline.name, "origin": timeline.origin, "num_devices": timeline.num_devices},
    }


def write_trace(timeline: Timeline, path: str | Path) -> None:
    """Write :func:`chrome_trace` of ``timeline`` to ``path`` as JSON."""
    try:
        Path(path).write_text(json.dumps(chrome_trace(timeline)), encoding="utf-8")
    except OSError as err:
        raise PipedslError(f"{path}: cannot write trace: {err.strerror or err}") from None
