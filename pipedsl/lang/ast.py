"""The typed syntax tree of a ``.sched`` file.

:mod:`pipedsl.lang.parser` builds it from lark's parse tree and :mod:`pipedsl.lang.evaluate`
turns it into a :class:`~pipedsl.ir.Schedule`. Every node is a frozen, slotted
dataclass that carries the :class:`~pipedsl.errors.SourcePos` where it starts, except
operator nodes, whose position is that of the operator (so ``a / b`` blames the ``/``
when ``b`` is zero). Nodes hold no parameter values: one tree evaluates under any
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from pipedsl.errors import SourcePos
from pipedsl.ir import Kind

__all__ = [
    "IntLit",
    "Name",
    "Neg",
    "BinOp",
    "Compare",
    "BoolOp",
    "Not",
    "Call",
    "Expr",
    "Assign",
    "For",
    "Branch",
    "If",
    "Require",
    "Emit",
    "Stmt",
    "Block",
    "FuncDef",
    "Param",
    "Declare",
    "Place",
    "PlaceList",
    "OnDevice",
    "Cell",
    "TableRow",
    "PolicyStmt",
    "PolicyBlock",
    "Item",
    "ScheduleDef",
    "Module",
]


# ---- expressions ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IntLit:
    """A non-negative integer literal (``-3`` is :class:`Neg` of ``3``)."""

    value: int
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Name:
    """A reference to a parameter, binding, loop variable or function argument."""

    ident: str
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Neg:
    """Unary minus."""

    operand: Expr
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class BinOp:
    """Integer arithmetic: ``op`` is one of ``+ - * / %`` (``/`` floors, ``%`` is Python's)."""

    op: str
    left: Expr
    right: Expr
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Compare:
    """A comparison, ``op`` one of ``== != < <= > >=``; a condition, not a number."""

    op: str
    left: Expr
    right: Expr
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class BoolOp:
    """``and`` / ``or`` of two conditions, short-circuiting."""

    op: str
    left: Expr
    right: Expr
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Not:
    """``not`` of a condition."""

    operand: Expr
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Call:
    """A call of a user function (``def``) or of the builtins ``min`` and ``max``."""

    func: str
    args: tuple[Expr, ...]
    pos: SourcePos


Expr: TypeAlias = IntLit | Name | Neg | BinOp | Compare | BoolOp | Not | Call


# ---- statements ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Assign:
    """``target = value``: a new local binding, or a new value for a visible one."""

    target: str
    value: Expr
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class For:
    """``for var in start .. stop { body }`` over the half-open range [start, stop)."""

    var: str
    start: Expr
    stop: Expr
    body: Block
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Branch:
    """One ``if`` / ``else if`` arm: its condition and its block."""

    cond: Expr
    body: Block
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class If:
    """``if c { } else if c2 { } else { }``: the first arm whose condition holds runs."""

    branches: tuple[Branch, ...]
    orelse: Block | None
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Require:
    """``require cond, "message"``: evaluation stops with the message when cond is false."""

    cond: Expr
    message: str | None
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Emit:
    """An action statement ``F(mb)`` / ``F(mb, stage)`` (likewise ``B``, ``I``, ``W``).

    ``args`` is kept as written; the evaluator checks that there are one or two.
    """

    kind: Kind
    args: tuple[Expr, ...]
    pos: SourcePos


Stmt: TypeAlias = Assign | For | If | Require | Emit
Block: TypeAlias = tuple[Stmt, ...]


# ---- schedule-level items ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FuncDef:
    """``def name(params) = body``: a pure integer function; it may call only functions
    defined above it, so recursion cannot be written."""

    name: str
    params: tuple[str, ...]
    body: Expr
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Param:
    """A schedule parameter with its default, an expression over earlier parameters."""

    name: str
    default: Expr
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Declare:
    """``stages E``, ``devices E`` or ``microbatches E``; ``what`` names which."""

    what: str
    value: Expr
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Place:
    """``place var -> device``: the device that owns stage ``var``."""

    var: str
    value: Expr
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class PlaceList:
    """``place [d0, d1, ...]``: the device of each stage, listed in stage order."""

    devices: tuple[Expr, ...]
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class OnDevice:
    """``on device var { body }``: the body runs once per device and emits its order."""

    var: str
    body: Block
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Cell:
    """One ``{stage}{kind}{microbatch}`` cell of a table row, such as ``2F0``."""

    kind: Kind
    stage: int
    microbatch: int
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class TableRow:
    """``device N: cells...``: device N's order, spelled out."""

    device: int
    cells: tuple[Cell, ...]
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class PolicyStmt:
    """One statement of a ``policy`` block.

    ``what`` is ``"split"`` (``split backward``), ``"inflight"`` or ``"activations"``
    (``limit inflight <= e``), ``"prefer"`` (``prefer I > F > W``: ``kinds`` as written),
    ``"idle_w"`` (``W only in idle time``: ``kinds`` holds the kind named) or ``"warmup"``
    (``warmup e``). ``value`` is the expression of a limit or warm-up.
    """

    what: str
    value: Expr | None
    kinds: tuple[str, ...]
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class PolicyBlock:
    """``policy on device var { statements }``: limits and priorities instead of orders."""

    var: str
    body: tuple[PolicyStmt, ...]
    pos: SourcePos


Item: TypeAlias = Require | Assign | FuncDef | Declare | Place | PlaceList | OnDevice | TableRow | PolicyBlock


@dataclass(frozen=True, slots=True)
class ScheduleDef:
    """``schedule name(params) { items }``; ``pos`` is that of the name."""

    name: str
    params: tuple[Param, ...]
    items: tuple[Item, ...]
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class Module:
    """A whole file: helper functions defined before the schedule, and the schedule."""

    functions: tuple[FuncDef, ...]
    schedule: ScheduleDef
    file: str
