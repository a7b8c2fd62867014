"""The timeline record: when each action and transfer ran, simulated or measured.

The simulator writes one and the executor records one in the same form, so a measured
run can be drawn beside a simulated one and the cost model fitted to measurements.
Storage is by column (numpy arrays, one row per event) because timelines of a million
events are normal and must stay cheap to build, save and turn into a DataFrame.

Times are seconds from the start of the step. A compute event sits on the device that
ran it; a transfer event sits on the sending device, with ``peer`` the receiver, and
spans from the moment the value was handed over to the moment it arrived. A compute has
no peer: None wherever a peer is read (:meth:`Timeline.peer_at`, :meth:`Timeline.peers`,
:meth:`Timeline.events`, the DataFrame, the JSON form).

Readers ask for kinds by :class:`EventKind` (:meth:`Timeline.mask`, :meth:`Timeline.kinds`),
never by the packed codes of the ``kind`` column.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipedsl.errors import ConversionError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["EventKind", "Event", "Timeline", "concatenate"]


class EventKind(enum.Enum):
    """What an event is: a compute action (``F B I W``) or a transfer of a buffer."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - PyTorch's letter for the input-gradient half
    W = "W"
    SEND = "send"

    @property
    def is_compute(self) -> bool:
        return self is not EventKind.SEND

    @property
    def code(self) -> int:
        """The kind's code in the packed ``Timeline.kind`` column (declaration order)."""
        return _KIND_INDEX[self]


_KINDS = tuple(EventKind)
_KIND_INDEX = {k: i for i, k in enumerate(_KINDS)}
_NO_PEER = -1
"""The packed ``peer`` column's entry for a compute; never seen outside this module."""


@dataclass(frozen=True, slots=True)
class Event:
    """One row of a timeline.

    ``buffer`` names what a transfer moved (``"act"`` or ``"grad"``); None for computes.
    ``peer`` is the receiving device of a transfer; None for computes.
    """

    device: int
    kind: EventKind
    stage: int
    microbatch: int
    start: float
    end: float
    peer: int | None = None
    buffer: str | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True, eq=False)
class Timeline:
    """A step's events as columns of equal length.

    Attributes:
      name: what ran (the schedule's name).
      num_devices: number of pipeline devices.
      origin: ``"simulated"`` or ``"measured"``.
      device, kind, stage, microbatch, peer: int arrays (``kind`` int8, packing an
        :class:`EventKind` as its :attr:`~EventKind.code`; the others int64, or int32 in
        a simulated timeline, two million rows of which are common: widen before
        multiplying them; ``peer`` is the receiving device of a transfer and means
        nothing on a compute's row: read peers with :meth:`peer_at` or :meth:`peers`,
        which give None there).
      start, end: float64 arrays, seconds from the step's start.
      buffer: per event ``""`` for computes, else the moved buffer's kind.
    """

    name: str
    num_devices: int
    origin: str
    device: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    start: np.ndarray
    end: np.ndarray
    peer: np.ndarray
    buffer: tuple[str, ...]

    @classmethod
    def from_events(cls, events: Iterable[Event], *, name: str, num_devices: int, origin: str) -> Timeline:
        rows = list(events)
        return cls(
            name=name,
            num_devices=num_devices,
            origin=origin,
            device=np.fromiter((e.device for e in rows), dtype=np.int64, count=len(rows)),
            kind=np.fromiter((_KIND_INDEX[e.kind] for e in rows), dtype=np.int8, count=len(rows)),
            stage=np.fromiter((e.stage for e in rows), dtype=np.int64, count=len(rows)),
            microbatch=np.fromiter((e.microbatch for e in rows), dtype=np.int64, count=len(rows)),
            start=np.fromiter((e.start for e in rows), dtype=np.float64, count=len(rows)),
            end=np.fromiter((e.end for e in rows), dtype=np.float64, count=len(rows)),
            peer=np.fromiter((_NO_PEER if e.peer is None else e.peer for e in rows), dtype=np.int64, count=len(rows)),
            buffer=tuple(e.buffer or "" for e in rows),
        )

    @classmethod
    def from_columns(
        cls,
        *,
        name: str,
        num_devices: int,
        origin: str,
        device: np.ndarray,
        kind: np.ndarray,
        stage: np.ndarray,
        microbatch: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
        peer: np.ndarray,
        buffer: tuple[str, ...],
    ) -> Timeline:
        """Build from columns; ``kind`` holds :attr:`EventKind.code` values and ``peer`` is
        read on transfer rows only (anything may stand on a compute's row). A signed int
        ``peer`` keeps its width; one of another type is made int64."""
        kind = np.asarray(kind, dtype=np.int8)
        peer = np.asarray(peer)
        if peer.dtype.kind != "i":
            peer = peer.astype(np.int64)
        peer = np.where(kind == EventKind.SEND.code, peer, _NO_PEER)
        return cls(name, num_devices, origin, device, kind, stage, microbatch, start, end, peer, buffer)

    def __len__(self) -> int:
        return int(self.device.shape[0])

    def event(self, row: int) -> Event:
        """Row ``row`` as an :class:`Event`."""
        return Event(
            device=int(self.device[row]),
            kind=_KINDS[int(self.kind[row])],
            stage=int(self.stage[row]),
            microbatch=int(self.microbatch[row]),
            start=float(self.start[row]),
            end=float(self.end[row]),
            peer=self.peer_at(row),
            buffer=self.buffer[row] or None,
        )

    def events(self) -> Iterator[Event]:
        for row in range(len(self)):
            yield self.event(row)

    def kind_at(self, row: int) -> EventKind:
        return _KINDS[int(self.kind[row])]

    def kinds(self) -> list[EventKind]:
        """Per event, its kind, shape (events,)."""
        return [_KINDS[k] for k in self.kind.tolist()]

    def kinds_present(self) -> set[EventKind]:
        return {_KINDS[k] for k in np.unique(self.kind).tolist()}

    def mask(self, kind: EventKind) -> np.ndarray:
        """Whether each event is of ``kind``, bool shape (events,)."""
        return self.kind == kind.code

    def peer_at(self, row: int) -> int | None:
        """The receiving device of transfer ``row``; None for a compute."""
        return None if int(self.kind[row]) != EventKind.SEND.code else int(self.peer[row])

    def peers(self) -> list[int | None]:
        """Per event, the receiving device of a transfer, None for a compute, shape (events,)."""
        sends = (self.kind == EventKind.SEND.code).tolist()
        return [p if sent else None for p, sent in zip(self.peer.tolist(), sends, strict=True)]

    @property
    def durations(self) -> np.ndarray:
        """Seconds each event took, float64 shape (events,)."""
        return self.end - self.start

    @property
    def compute_mask(self) -> np.ndarray:
        return self.kind != EventKind.SEND.code

    @property
    def makespan(self) -> float:
        """Seconds from the first event's start to the last event's end (0 when empty)."""
        if len(self) == 0:
            return 0.0
        return float(self.end.max() - min(0.0, float(self.start.min())))

    def busy(self) -> np.ndarray:
        """Per device, seconds spent computing (transfers excluded), shape (num_devices,)."""
        mask = self.compute_mask
        return np.bincount(self.device[mask], weights=(self.end - self.start)[mask], minlength=self.num_devices)

    def transfer_time(self) -> np.ndarray:
        """Per device, seconds of the transfers it sent, summed (they may overlap), shape (num_devices,)."""
        mask = ~self.compute_mask
        return np.bincount(self.device[mask], weights=(self.end - self.start)[mask], minlength=self.num_devices)

    def bubble_ratio(self) -> float:
        """``1 - busy / (devices × makespan)``, the definition in docs/design.md."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return float(1.0 - self.busy().sum() / (self.num_devices * span))

    def to_dataframe(self) -> pd.DataFrame:
        """One row per event: device, kind, stage, microbatch, start, end, duration, peer, buffer."""
        import pandas as pd

        return pd.DataFrame(
            {
                "device": self.device,
                "kind": [_KINDS[k].value for k in self.kind],
                "stage": self.stage,
                "microbatch": self.microbatch,
                "start": self.start,
                "end": self.end,
                "duration": self.end - self.start,
                "peer": pd.array(self.peers(), dtype="Int64"),
                "buffer": [b or None for b in self.buffer],
            }
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "pipedsl-timeline",
            "version": 1,
            "name": self.name,
            "num_devices": self.num_devices,
            "origin": self.origin,
            "columns": {
                "device": self.device.tolist(),
                "kind": [_KINDS[k].value for k in self.kind],
                "stage": self.stage.tolist(),
                "microbatch": self.microbatch.tolist(),
                "start": self.start.tolist(),
                "end": self.end.tolist(),
                "peer": self.peers(),
                "buffer": list(self.buffer),
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], *, file: str = "<json>") -> Timeline:
        """Read :meth:`to_json`'s form (see :func:`_read_json`)."""
        return _read_json(cls, data, file=file)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        path = Path(path)
        try:
            data = json.loads(path.read_bytes())
        except OSError as err:
            raise ConversionError(f"{path}: cannot read timeline: {err.strerror or err}") from None
        except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, or nested too deep
            raise ConversionError(f"{path}: cannot read timeline: not JSON: {str(err)[:200]}") from None
        return cls.from_json(data, file=str(path))


def concatenate(parts: Sequence[Timeline], *, name: str, num_devices: int, origin: str) -> Timeline:
    """Join timelines (for example one per device of a measured run) into one."""
    return Timeline(
        name=name,
        num_devices=num_devices,
        origin=origin,
        device=np.concatenate([p.device for p in parts]) if parts else np.zeros(0, np.int64),
        kind=np.concatenate([p.kind for p in parts]) if parts else np.zeros(0, np.int8),
        stage=np.concatenate([p.stage for p in parts]) if parts else np.zeros(0, np.int64),
        microbatch=np.concatenate([p.microbatch for p in parts]) if parts else np.zeros(0, np.int64),
        start=np.concatenate([p.start for p in parts]) if parts else np.zeros(0, np.float64),
        end=np.concatenate([p.end for p in parts]) if parts else np.zeros(0, np.float64),
        peer=np.concatenate([p.peer for p in parts]) if parts else np.zeros(0, np.int64),
        buffer=tuple(b for p in parts for b in p.buffer),
    )


def _read_json(cls: type[Timeline], data: dict[str, Any], *, file: str) -> Timeline:
    """The reader of the saved form: :meth:`Timeline.to_json`'s dict back to a Timeline.

    Every field is checked before anything is built: work and memory stay proportional
    to the input's size (the device count may exceed the devices the events name by at
    most :data:`DEVICE_SLACK`), and a malformed input raises
    :class:`~pipedsl.errors.ConversionError` naming the field. A compute's peer is null;
    files written before that used -1, which reads the same.
    """
    if not isinstance(data, dict) or data.get("format") != "pipedsl-timeline":
        raise ConversionError(f'{file}: not a pipedsl timeline (expected "format": "pipedsl-timeline")')
    return cls(**_checked_fields(data, file))


# --- reading saved timelines ------------------------------------------------------------

DEVICE_SLACK = 64
"""How many more devices than its events name a saved timeline may declare (idle devices)."""

_MAX_INDEX = 2**31 - 1  # stages and microbatches; keeps products of indices within int64
_MAX_SECONDS = 1e9  # about 30 years: times beyond are no timeline's
_INT_COLUMNS = ("device", "stage", "microbatch", "peer")
_FLOAT_COLUMNS = ("start", "end")
_COLUMNS = ("device", "kind", "stage", "microbatch", "start", "end", "peer", "buffer")
_KIND_BY_VALUE = {k.value: i for i, k in enumerate(_KINDS)}
_Fail = Callable[[str, str], ConversionError]  # (field, problem) -> the error to raise


def _checked_fields(data: dict[str, Any], file: str) -> dict[str, Any]:
    """The keyword arguments of :class:`Timeline` from a saved timeline's JSON, checked."""

    def fail(field: str, problem: str) -> ConversionError:
        return ConversionError(f"{file}: malformed timeline: {field}: {problem}")

    if data.get("version", 1) != 1:
        raise fail("version", f"{str(data.get('version'))[:40]}; this pipedsl reads version 1")
    for key in ("name", "origin"):
        if not isinstance(data.get(key), str):
            raise fail(key, "missing or not a string")
    cols = data.get("columns")
    if not isinstance(cols, dict):
        raise fail("columns", "missing or not an object of columns")
    for key in _COLUMNS:
        if not isinstance(cols.get(key), list):
            raise fail(f"columns.{key}", "missing or not a list")
    n = len(cols["device"])
    for key in _COLUMNS:
        if len(cols[key]) != n:
            raise fail(f"columns.{key}", f"{len(cols[key])} entries, but columns.device has {n}")
    columns = {**cols, "peer": [_NO_PEER if p is None else p for p in cols["peer"]]}
    ints = {key: _int_column(columns[key], f"columns.{key}", fail) for key in _INT_COLUMNS}
    times = {key: _float_column(cols[key], f"columns.{key}", fail) for key in _FLOAT_COLUMNS}
    if any(type(k) is not str or k not in _KIND_BY_VALUE for k in cols["kind"]):
        raise fail("columns.kind", f"every entry must be one of {sorted(_KIND_BY_VALUE)}")
    kind = np.fromiter((_KIND_BY_VALUE[k] for k in cols["kind"]), dtype=np.int8, count=n)
    if any(type(b) is not str or len(b) > 64 for b in cols["buffer"]):
        raise fail("columns.buffer", 'every entry must be a string ("" for computes) of at most 64 characters')
    named = int(max(ints["device"].max(initial=-1), ints["peer"].max(initial=-1))) + 1
    num_devices = data.get("num_devices")
    if type(num_devices) is not int or not 1 <= num_devices <= named + DEVICE_SLACK:
        raise fail(
            "num_devices",
            f"{str(num_devices)[:40]}; expected a whole number from 1 to {named + DEVICE_SLACK} "
            f"(the events name {named} devices)",
        )
    _check_ranges(ints, times, kind, num_devices, fail)
    return {
        "name": data["name"],
        "num_devices": num_devices,
        "origin": data["origin"],
        "kind": kind,
        "buffer": tuple(cols["buffer"]),
        **ints,
        **times,
    }


def _int_column(values: list[Any], field: str, fail: _Fail) -> np.ndarray:
    """``values`` as int64, refusing anything but whole numbers within int64."""
    if not values:
        return np.zeros(0, np.int64)
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError):  # ragged nesting, or numbers numpy cannot hold
        raise fail(field, "every entry must be a whole number") from None
    if array.ndim != 1 or array.dtype.kind not in "iu" or array.dtype.itemsize > 8 or array.dtype == np.uint64:
        raise fail(field, "every entry must be a whole number")
    return array.astype(np.int64)


def _float_column(values: list[Any], field: str, fail: _Fail) -> np.ndarray:
    """``values`` as float64, refusing anything but finite numbers of at most
    :data:`_MAX_SECONDS` in size."""
    if not values:
        return np.zeros(0, np.float64)
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError):
        raise fail(field, "every entry must be a number of seconds") from None
    if array.ndim != 1 or array.dtype.kind not in "iuf":
        raise fail(field, "every entry must be a number of seconds")
    array = array.astype(np.float64)
    bad = ~(np.abs(array) <= _MAX_SECONDS)  # also true for NaN
    if bad.any():
        row = int(np.argmax(bad))
        raise fail(field, f"row {row} is {values[row]!r}; times must be finite seconds within ±{_MAX_SECONDS:g}")
    return array


def _check_ranges(
    ints: dict[str, np.ndarray], times: dict[str, np.ndarray], kind: np.ndarray, num_devices: int, fail: _Fail
) -> None:
    """Indices within their ranges, peers only on transfers, no event ending before it starts."""
    send = kind == _KIND_INDEX[EventKind.SEND]
    peer = ints["peer"]
    checks = [
        ("columns.device", (ints["device"] < 0) | (ints["device"] >= num_devices), f"from 0 to {num_devices - 1}"),
        ("columns.stage", (ints["stage"] < 0) | (ints["stage"] > _MAX_INDEX), f"from 0 to {_MAX_INDEX}"),
        ("columns.microbatch", (ints["microbatch"] < 0) | (ints["microbatch"] > _MAX_INDEX), f"from 0 to {_MAX_INDEX}"),
        (
            "columns.peer",
            send & ((peer < 0) | (peer >= num_devices)),
            f"a device from 0 to {num_devices - 1} on a transfer",
        ),
        ("columns.peer", ~send & (peer != _NO_PEER), "null on a compute event"),
        ("columns.end", times["end"] < times["start"], "no earlier than the event's start"),
    ]
    values = {**ints, **times}
    for field, bad, expected in checks:
        if bad.any():
            row = int(np.argmax(bad))
            column = values[field.removeprefix("columns.")]
            raise fail(field, f"row {row} is {column[row].item()!r}; expected {expected}")
