"""Interop: schedules in PyTorch's compute-only CSV, in JSON, and back to ``.sched`` text.

Three foreign or exchange forms meet the IR here, each with a reader and a writer:

- **CSV**, PyTorch pipelining's compute-only form: one row per rank, one cell per action
  in execution order (``0F0,0F1,,0B0``); an empty cell is an idle slot and carries no
  meaning for the order, so it is skipped. The stage → device placement is inferred from
  the cells, as PyTorch's ``_load_csv`` does; the number of stages and microbatches is one
  more than the largest index seen, unless the caller states the microbatch count (PyTorch
  keeps it outside the file, in the schedule object). Every imported action carries its
  cell's position, so validation errors point at the cell.
- **JSON**, a lossless form of the IR (``"format": "pipedsl-schedule"``, version 1) for
  tools that would rather not parse text.
- **``.sched`` text** in the language's table form, so that an imported schedule becomes
  a file the language reads back unchanged.

:func:`pipedsl.library.load` picks the reader by file extension.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipedsl.errors import ConversionError, SourcePos
from pipedsl.ir import Action, Schedule, parse_action
from pipedsl.lang import RESERVED_WORDS
from pipedsl.program import BufferKind, Compute, Free, Instruction, Send, lower

__all__ = [
    "FORMATS",
    "JSON_FORMAT",
    "JSON_VERSION",
    "to_csv",
    "from_csv",
    "to_json",
    "from_json",
    "to_sched_text",
    "export",
    "to_lowered_csv",
]

FORMATS = ("csv", "json", "sched")
"""The formats :func:`export` produces, named as the CLI's ``--to`` names them."""

JSON_FORMAT = "pipedsl-schedule"
JSON_VERSION = 1

# PyTorch's lowered schedules spell communication and FSDP steps in the same cells
# (``1SEND_F0``, ``2UNSHARD``, ``(0F1;1B0)OVERLAP_F_B``); recognising them gives a
# better message than "not an action".
_LOWERED_CELL = re.compile(
    r"^\(.*\)[A-Z_]+$"  # (0F1;1B0)OVERLAP_F_B
    r"|^\d*(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|OVERLAP_F_B)\d*$"
)


# --- CSV ---------------------------------------------------------------------------


def to_csv(schedule: Schedule) -> str:
    """PyTorch's compute-only CSV of ``schedule``: row d is device d's actions in order.

    No idle cells are written: the order alone is the schedule, and the simulator, not
    the file, decides when each action runs.
    """
    return "".join(",".join(map(str, order)) + "\n" for order in schedule.orders)


def _lowered_cell(instruction: Instruction) -> str | None:
    """One instruction as PyTorch's runtime form spells it, or None for a ``free``.

    A send names the sending stage and a receive the receiving one, as PyTorch's
    ``_add_send_recv`` does: ``1SEND_F0`` is stage 1 sending its forward output for
    microbatch 0, ``2RECV_F0`` stage 2 receiving it; ``_B`` is the input gradient going
    the other way.
    """
    if isinstance(instruction, Compute):
        return str(instruction.action)
    if isinstance(instruction, Free):
        return None  # PyTorch frees by reference counting; its runtime form has no such step
    buffer = instruction.buffer
    forward = buffer.kind is BufferKind.ACTIVATION
    if buffer.kind not in (BufferKind.ACTIVATION, BufferKind.GRADIENT):
        raise ConversionError(f"{instruction}: PyTorch's runtime form moves only activations and gradients")
    if isinstance(instruction, Send):
        return f"{buffer.stage}SEND_{'F' if forward else 'B'}{buffer.microbatch}"
    receiver = buffer.stage + 1 if forward else buffer.stage - 1
    return f"{receiver}RECV_{'F' if forward else 'B'}{buffer.microbatch}"


def to_lowered_csv(schedule: Schedule) -> str:
    """PyTorch's CSV of ``schedule`` in its runtime (lowered) form: row d is device d's
    computations with the sends and receives between them (``SEND_F``, ``RECV_F``,
    ``SEND_B``, ``RECV_B``), in the order :func:`pipedsl.program.lower` runs them.

    Validates the schedule (lowering does). A transfer between two stages of one device
    is no send: the value stays on the device.
    """
    rows = []
    for program in lower(schedule).devices:
        cells = (_lowered_cell(instruction) for instruction in program.instructions)
        rows.append(",".join(cell for cell in cells if cell is not None))
    return "".join(row + "\n" for row in rows)


def _cells(line: str) -> list[tuple[int, str]]:
    """Split one CSV row into (1-based column of the cell's first character, text)."""
    cells = []
    start = 0
    for piece in line.split(","):
        stripped = piece.strip()
        # PyTorch's own reader tolerates cells wrapped in double quotes.
        if len(stripped) >= 2 and stripped[0] == stripped[-1] == '"':
            stripped = stripped[1:-1].strip()
        column = start + 1 + (len(piece) - len(piece.lstrip()))
        cells.append((column, stripped))
        start += len(piece) + 1
    return cells


def from_csv(
    text: str,
    *,
    file: str | None = None,
    name: str | None = None,
    num_microbatches: int | None = None,
) -> Schedule:
    """Read PyTorch's compute-only CSV into a :class:`Schedule` (not yet validated).

    Args:
      text: the file's contents.
      file: where the text came from, for error positions and ``Schedule.source``.
      name: the schedule's name; defaults to the file's stem, or ``"csv"``.
      num_microbatches: the microbatch count when the caller knows it; by default one
        more than the largest microbatch index in the file. Stating it lets validation
        catch an out-of-range index instead of a missing action.

    Raises:
      ConversionError: a cell that is not a compute action (``file:row:column``), a
        stage that appears in no row, or a file without a single action.
    """
    label = file if file is not None else "<csv>"
    orders, placement = _csv_orders(text, label)
    num_stages = max(placement) + 1
    # The first gap is within len(placement) of 0; a scan of every stage number could be
    # as long as the largest index a cell happens to spell.
    unplaced = next((s for s in range(num_stages) if s not in placement), None)
    if unplaced is not None:
        raise ConversionError(
            f"{label}: stage {unplaced} appears in no row, so it has no device; "
            f"the CSV names stages 0..{num_stages - 1} and every one needs its actions"
        )
    if num_microbatches is None:
        num_microbatches = 1 + max(a.microbatch for order in orders for a in order)
    return Schedule(
        name=name if name is not None else (Path(file).stem if file is not None else "csv"),
        num_stages=num_stages,
        num_devices=len(orders),
        num_microbatches=num_microbatches,
        placement=tuple(placement[s] for s in range(num_stages)),
        orders=tuple(orders),
        source=file,
    )


def _csv_orders(text: str, label: str) -> tuple[list[tuple[Action, ...]], dict[int, int]]:
    """Each row's actions, and the row (device) that first names each stage."""
    lines = text.removeprefix("\ufeff").splitlines()
    # Blank lines at the end are an editor's doing, not ranks without work.
    while lines and not lines[-1].strip():
        lines.pop()
    orders: list[tuple[Action, ...]] = []
    placement: dict[int, int] = {}
    for row, line in enumerate(lines):
        order = []
        for column, cell in _cells(line):
            if not cell:
                continue
            pos = SourcePos(label, row + 1, column, line)
            action = parse_action(cell, pos=pos)
            if action is None:
                raise ConversionError(_bad_cell_message(cell), pos=pos)
            # The first row a stage appears in owns it; a later row that runs the same
            # stage is left for validation to report as wrong-device, at that cell.
            placement.setdefault(action.stage, row)
            order.append(action)
        orders.append(tuple(order))
    if not placement:
        raise ConversionError(f"{label} holds no actions; expected rows of cells such as 0F0,0F1,0B0,0B1")
    return orders, placement


def _bad_cell_message(cell: str) -> str:
    shown = repr(cell if len(cell) <= 40 else cell[:37] + "...")
    if _LOWERED_CELL.match(cell):
        return (
            f"cell {shown} is a communication or sharding step of a lowered schedule; "
            "only the compute-only form (F, B, I, W cells) is read: export that one, "
            "pipedsl inserts the sends and receives itself"
        )
    return f"cell {shown} is not an action; write {{stage}}{{kind}}{{microbatch}} such as 2F0, with kind F, B, I or W"


# --- JSON --------------------------------------------------------------------------


def to_json(schedule: Schedule) -> str:
    """The JSON form of ``schedule``: every field of the IR, one device's order a line."""
    header: dict[str, Any] = {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "name": schedule.name,
        "num_stages": schedule.num_stages,
        "num_devices": schedule.num_devices,
        "num_microbatches": schedule.num_microbatches,
        "placement": list(schedule.placement),
        "params": dict(schedule.params),
    }
    lines = [f"  {json.dumps(key)}: {json.dumps(value)}," for key, value in header.items()]
    orders = ",\n".join("    " + json.dumps([str(a) for a in order]) for order in schedule.orders)
    return "{\n" + "\n".join(lines) + '\n  "orders": [\n' + orders + "\n  ]\n}\n"


def from_json(text: str, *, file: str | None = None) -> Schedule:
    """Read the JSON form back into a :class:`Schedule` (not yet validated).

    Raises:
      ConversionError: text that is not JSON (with its line and column), another format
        or version, a missing or mistyped field, or an order entry that is not an action.
    """
    label = file if file is not None else "<json>"
    data = _json_object(text, label)

    def field(key: str, kind: type) -> Any:
        if key not in data:
            raise ConversionError(f"{label}: field {key!r} is missing")
        value = data[key]
        if not (_is_int(value) if kind is int else isinstance(value, kind)):
            raise ConversionError(f"{label}: field {key!r} should be {_TYPE_WORDS[kind]}, got {json.dumps(value)}")
        return value

    placement = field("placement", list)
    if not all(_is_int(d) for d in placement):
        raise ConversionError(
            f"{label}: field 'placement' should list one device number per stage, got {json.dumps(placement)}"
        )
    params = data.get("params", {})
    if not isinstance(params, dict) or not all(_is_int(v) for v in params.values()):
        raise ConversionError(f"{label}: field 'params' should map names to integers, got {json.dumps(params)}")
    return Schedule(
        name=field("name", str),
        num_stages=field("num_stages", int),
        num_devices=field("num_devices", int),
        num_microbatches=field("num_microbatches", int),
        placement=tuple(placement),
        orders=_json_orders(field("orders", list), label),
        params=tuple(params.items()),
        source=file,
    )


def _json_object(text: str, label: str) -> dict[str, Any]:
    """The parsed JSON object, checked to be pipedsl's format at this version."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        lines = err.doc.splitlines()
        line_text = lines[err.lineno - 1] if 0 < err.lineno <= len(lines) else ""
        pos = SourcePos(label, err.lineno, err.colno, line_text)
        raise ConversionError(f"not valid JSON: {err.msg}", pos=pos) from None
    if not isinstance(data, dict):
        raise ConversionError(
            f'{label}: expected a JSON object with "format": "{JSON_FORMAT}", got {type(data).__name__}'
        )
    if data.get("format") != JSON_FORMAT:
        raise ConversionError(f'{label}: "format" is {data.get("format")!r}, expected {JSON_FORMAT!r}')
    if data.get("version") != JSON_VERSION:
        raise ConversionError(
            f"{label}: version {data.get('version')!r} is not supported; this pipedsl reads version {JSON_VERSION}"
        )
    return data


def _json_orders(orders: list[Any], label: str) -> tuple[tuple[Action, ...], ...]:
    """The ``orders`` field as actions, each entry checked."""
    result = []
    for device, order in enumerate(orders):
        if not isinstance(order, list):
            raise ConversionError(f"{label}: orders[{device}] should be a list of actions, got {json.dumps(order)}")
        actions = []
        for index, cell in enumerate(order):
            action = parse_action(cell) if isinstance(cell, str) else None
            if action is None:
                raise ConversionError(
                    f'{label}: orders[{device}][{index}] is {json.dumps(cell)}, not an action such as "2F0"'
                )
            actions.append(action)
        result.append(tuple(actions))
    return tuple(result)


_TYPE_WORDS = {int: "an integer", str: "a string", list: "a list"}


def _is_int(value: object) -> bool:
    # bool is an int to Python, but never a count, an index or a parameter here.
    return isinstance(value, int) and not isinstance(value, bool)


# --- .sched text ----------------------------------------------------------------------

# Cells per line of a table row: long rows wrap, the cells staying in aligned columns.
_CELLS_PER_LINE = 16


def _placement(placement: tuple[int, ...], num_devices: int) -> str:
    """The ``place`` item for ``placement``: the usual formula where one fits (one stage
    per device, round-robin interleaving, the V of zero-bubble schedules, contiguous
    blocks), as a reader would write it; otherwise the list of devices."""
    listed = f"place [{', '.join(map(str, placement))}]"
    if num_devices < 1:
        return listed
    num_stages = len(placement)
    d = num_devices
    candidates: list[tuple[str, Callable[[int], int]]] = [
        ("0", lambda s: 0),
        ("s", lambda s: s),
        (f"s % {d}", lambda s: s % d),
        (f"min(s, {2 * d - 1} - s)", lambda s: min(s, 2 * d - 1 - s)),
        (f"min(s % {2 * d}, {2 * d - 1} - s % {2 * d})", lambda s: min(s % (2 * d), 2 * d - 1 - s % (2 * d))),
    ]
    if num_stages % d == 0:
        block = num_stages // d
        candidates.append((f"s / {block}", lambda s: s // block))
    for text, fn in candidates:
        if all(fn(s) == device for s, device in enumerate(placement)):
            return f"place s -> {text}"
    return listed


def _identifier(name: str) -> str:
    """``name`` made into a schedule name the grammar accepts."""
    ident = re.sub(r"\W", "_", name, flags=re.ASCII) or "imported"
    if ident[0].isdigit() or ident in RESERVED_WORDS:
        ident = "s_" + ident
    return ident


def to_sched_text(schedule: Schedule) -> str:
    """``schedule`` as a ``.sched`` file in the table form, which the language reads back
    to the same schedule.

    The table is the evaluated order, so the file has no parameters; the values the
    schedule was evaluated with are kept in a comment.
    """
    width = max((len(str(a)) for _, a in schedule.actions()), default=1)
    lines = []
    if schedule.params:
        values = ", ".join(f"{k}={v}" for k, v in schedule.params)
        lines.append(f"# {schedule.name} evaluated with {values}, as a table.")
    lines += [
        f"schedule {_identifier(schedule.name)} {{",
        f"  stages {schedule.num_stages}",
        f"  devices {schedule.num_devices}",
        f"  microbatches {schedule.num_microbatches}",
        f"  {_placement(schedule.placement, schedule.num_devices)}",
    ]
    for device, order in enumerate(schedule.orders):
        head = f"  device {device}:"
        cells = [str(a).rjust(width) for a in order]
        chunks = [cells[i : i + _CELLS_PER_LINE] for i in range(0, len(cells), _CELLS_PER_LINE)] or [[]]
        lines.append(" ".join([head, *chunks[0]]).rstrip())
        indent = " " * len(head)
        lines += [" ".join([indent, *chunk]) for chunk in chunks[1:]]
    lines.append("}")
    return "\n".join(lines) + "\n"


# --- files -------------------------------------------------------------------------


def export(schedule: Schedule, fmt: str, *, lowered: bool = False) -> str:
    """``schedule`` as text in ``fmt``, one of :data:`FORMATS`; with ``lowered``, CSV in
    PyTorch's runtime form (:func:`to_lowered_csv`), the only format that has one."""
    if lowered:
        if fmt != "csv":
            raise ConversionError(f"only csv has a lowered form (PyTorch's runtime CSV), not {fmt}")
        return to_lowered_csv(schedule)
    if fmt == "csv":
        return to_csv(schedule)
    if fmt == "json":
        return to_json(schedule)
    if fmt == "sched":
        return to_sched_text(schedule)
    raise ConversionError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
