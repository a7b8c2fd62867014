"""Text to syntax tree: lark parses ``.sched`` text and this module builds :mod:`pipedsl.lang.ast`.

Every failure leaves as a :class:`~pipedsl.errors.ScheduleSyntaxError` with the file,
line and column, the offending line and, in plain words, what was expected there;
no lark exception ever escapes. A text with several syntax errors raises the first,
carrying the others (:mod:`pipedsl.lang.syntax_errors` finds them).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import os
import re
import sys

import lark
from lark import Token, v_args
from lark.exceptions import UnexpectedInput, VisitError
from lark.tree import Meta
from lark.visitors import Transformer_NonRecursive

from pipedsl.errors import PipedslError, ScheduleSyntaxError, SourcePos, several
from pipedsl.ir import Kind
from pipedsl.lang import ast, syntax_errors
from pipedsl.lang.syntax_errors import Source

__all__ = ["parse_source", "RESERVED_WORDS"]

#: Words that can never name a parameter, binding, variable or function. The declaration
#: words (``stages``, ``devices``, ``microbatches``, ``device``) are not among them: they
#: are keywords only where a schedule item starts, so a parameter may be called
#: ``microbatches``.
RESERVED_WORDS = frozenset({"schedule", "def", "for", "in", "if", "else", "require", "on", "place", "and", "or", "not"})

_ACTION_KINDS = {kind.value: kind for kind in Kind}
_CELL_RE = re.compile(r"([0-9]+)([FBIW])([0-9]+)")
# Literals longer than this cannot be int64 values; refusing them early also keeps
# Python's int() away from its own limit on very long digit strings.
_MAX_DIGITS = 19
_INT64_MAX = 2**63 - 1


#: The folder for the built parser tables; empty turns the cache off. Default: the
#: user's cache folder (``$XDG_CACHE_HOME/pipedsl`` or ``~/.cache/pipedsl``).
CACHE_ENV = "PIPEDSL_CACHE_DIR"

_LARK_OPTIONS: dict[str, object] = {
    "parser": "lalr",
    "lexer": "contextual",
    "propagate_positions": True,
    "maybe_placeholders": True,
}


def _cache_file(grammar: str) -> str | None:
    """Where lark keeps the LALR tables built from ``grammar``, or None where no cache
    folder can be made (a read-only home, or the cache turned off).

    The name carries a digest of the grammar, the options and the lark and Python
    versions, so installs that differ never share a file; lark checks its own digest
    inside the file again and rebuilds a stale or damaged one.
    """
    folder = os.environ.get(CACHE_ENV)
    if folder is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "pipedsl")
    if not folder:
        return None
    key = f"{grammar}{sorted(_LARK_OPTIONS.items())}{lark.__version__}{sys.version_info[:2]}"
    digest = hashlib.sha256(key.encode("utf-8"), usedforsecurity=False).hexdigest()[:24]
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK | os.X_OK):
        return None
    return os.path.join(folder, f"grammar-{digest}.lark")


@functools.cache
def _lark() -> lark.Lark:
    """The parser, built once per process. Building the LALR tables takes most of a
    short command's time, so they are kept in a file (lark's ``cache``) and read back by
    later processes; lark itself falls back to building them when the file cannot be
    read or written."""
    grammar = importlib.resources.files("pipedsl.grammars").joinpath("pipedsl.lark").read_text()
    cache = _cache_file(grammar)
    return lark.Lark(grammar, cache=cache if cache is not None else False, **_LARK_OPTIONS)


def _error(message: str, pos: SourcePos) -> ScheduleSyntaxError:
    return ScheduleSyntaxError(message, pos=pos)


@v_args(meta=True)
class _Builder(Transformer_NonRecursive):
    """Builds the AST bottom-up from lark's tree; raises ScheduleSyntaxError on misuse.

    Non-recursive, so a long chain such as ``1 + 1 + ... + 1`` does not exhaust Python's
    stack here (left-recursive rules make such chains as deep as they are long).
    """

    def __init__(self, source: Source) -> None:
        super().__init__(visit_tokens=False)
        self._src = source

    # -- helpers --

    def _name(self, token: Token) -> str:
        if token.value in RESERVED_WORDS:
            raise _error(
                f"`{token.value}` is a reserved word and cannot be used as a name",
                self._src.token(token),
            )
        return str(token.value)

    def _int(self, token: Token) -> int:
        digits = token.value
        if len(digits) > _MAX_DIGITS or int(digits) > _INT64_MAX:
            raise _error(
                f"the number {digits[:24]}{'...' if len(digits) > 24 else ''} is too large:"
                " numbers are 64-bit integers",
                self._src.token(token),
            )
        return int(digits)

    # -- file and schedule --

    def start(self, meta: Meta, children: list) -> tuple:
        *functions, schedule = children
        return tuple(functions), schedule

    def schedule(self, meta: Meta, children: list) -> ast.ScheduleDef:
        name, params, *items = children
        return ast.ScheduleDef(self._name(name), params or (), tuple(items), self._src.token(name))

    def param_list(self, meta: Meta, children: list) -> tuple[ast.Param, ...]:
        return tuple(p for p in children if p is not None)

    def param(self, meta: Meta, children: list) -> ast.Param:
        name, default = children
        return ast.Param(self._name(name), default, self._src.token(name))

    def declare(self, meta: Meta, children: list) -> ast.Declare:
        keyword, value = children
        return ast.Declare(str(keyword.value), value, self._src.token(keyword))

    def place(self, meta: Meta, children: list) -> ast.Place:
        var, value = children
        return ast.Place(self._name(var), value, self._src.meta(meta))

    def place_list(self, meta: Meta, children: list) -> ast.PlaceList:
        return ast.PlaceList(tuple(d for d in children if d is not None), self._src.meta(meta))

    def on_device(self, meta: Meta, children: list) -> ast.OnDevice:
        var, body = children
        return ast.OnDevice(self._name(var), body, self._src.meta(meta))

    def table_row(self, meta: Meta, children: list) -> ast.TableRow:
        device, *cells = children
        return ast.TableRow(self._int(device), tuple(self._cell(c) for c in cells), self._src.meta(meta))

    def _cell(self, token: Token) -> ast.Cell:
        pos = self._src.token(token)
        match = _CELL_RE.fullmatch(token.value)
        if match is None:
            raise _error(
                f"`{token.value}` is not an action cell: write {{stage}}{{F|B|I|W}}{{microbatch}}, like 0F1 or 3W12",
                pos,
            )
        stage, kind, microbatch = match.groups()
        if max(len(stage), len(microbatch)) > _MAX_DIGITS:
            raise _error(f"the cell `{token.value}` has a number too large", pos)
        return ast.Cell(_ACTION_KINDS[kind], int(stage), int(microbatch), pos)

    # -- the policy form --

    def policy(self, meta: Meta, children: list) -> ast.PolicyBlock:
        var, *body = children
        return ast.PolicyBlock(self._name(var), tuple(s for s in body if s is not None), self._src.meta(meta))

    def policy_split(self, meta: Meta, children: list) -> ast.PolicyStmt:
        return ast.PolicyStmt("split", None, (), self._src.meta(meta))

    def policy_limit(self, meta: Meta, children: list) -> ast.PolicyStmt:
        what, value = children
        return ast.PolicyStmt(str(what.value), value, (), self._src.meta(meta))

    def policy_prefer(self, meta: Meta, children: list) -> ast.PolicyStmt:
        return ast.PolicyStmt("prefer", None, tuple(self._kind(k) for k in children), self._src.meta(meta))

    def policy_idle(self, meta: Meta, children: list) -> ast.PolicyStmt:
        (kind,) = children
        return ast.PolicyStmt("idle_w", None, (self._kind(kind),), self._src.meta(meta))

    def policy_warmup(self, meta: Meta, children: list) -> ast.PolicyStmt:
        (value,) = children
        return ast.PolicyStmt("warmup", value, (), self._src.meta(meta))

    def _kind(self, token: Token) -> str:
        if token.value not in _ACTION_KINDS:
            raise _error(f"`{token.value}` is not an action kind: write F, B, I or W", self._src.token(token))
        return str(token.value)

    def fundef(self, meta: Meta, children: list) -> ast.FuncDef:
        name, *params, body = children
        return ast.FuncDef(
            self._name(name),
            tuple(self._name(p) for p in params if p is not None),
            body,
            self._src.meta(meta),
        )

    # -- statements --

    def block(self, meta: Meta, children: list) -> ast.Block:
        return tuple(children)

    def assign(self, meta: Meta, children: list) -> ast.Assign:
        target, value = children
        return ast.Assign(self._name(target), value, self._src.token(target))

    def for_stmt(self, meta: Meta, children: list) -> ast.For:
        var, start, stop, body = children
        return ast.For(self._name(var), start, stop, body, self._src.meta(meta))

    def if_stmt(self, meta: Meta, children: list) -> ast.If:
        cond, body, *rest = children
        orelse = rest.pop()
        first = ast.Branch(cond, body, self._src.meta(meta))
        return ast.If((first, *rest), orelse, first.pos)

    def elif_clause(self, meta: Meta, children: list) -> ast.Branch:
        cond, body = children
        return ast.Branch(cond, body, self._src.meta(meta))

    def else_clause(self, meta: Meta, children: list) -> ast.Block:
        (body,) = children
        return body

    def require(self, meta: Meta, children: list) -> ast.Require:
        cond, message = children
        text = None if message is None else str(message.value[1:-1])
        return ast.Require(cond, text, self._src.meta(meta))

    def action(self, meta: Meta, children: list) -> ast.Emit:
        name, *args = children
        pos = self._src.token(name)
        kind = _ACTION_KINDS.get(name.value)
        if kind is None:
            raise _error(
                f"`{name.value}(...)` cannot stand on its own: only the actions F, B, I and W"
                f" can; to keep a value, bind it: `x = {name.value}(...)`",
                pos,
            )
        return ast.Emit(kind, tuple(a for a in args if a is not None), pos)

    # -- expressions --

    def _binary(self, children: list, node: type) -> ast.Expr:
        left, op, right = children
        return node(str(op.value), left, right, self._src.token(op))

    def or_test(self, meta: Meta, children: list) -> ast.Expr:
        return self._binary(children, ast.BoolOp)

    def and_test(self, meta: Meta, children: list) -> ast.Expr:
        return self._binary(children, ast.BoolOp)

    def comparison(self, meta: Meta, children: list) -> ast.Expr:
        return self._binary(children, ast.Compare)

    def sum(self, meta: Meta, children: list) -> ast.Expr:
        return self._binary(children, ast.BinOp)

    def product(self, meta: Meta, children: list) -> ast.Expr:
        return self._binary(children, ast.BinOp)

    def not_test(self, meta: Meta, children: list) -> ast.Not:
        op, operand = children
        return ast.Not(operand, self._src.token(op))

    def unary(self, meta: Meta, children: list) -> ast.Neg:
        op, operand = children
        return ast.Neg(operand, self._src.token(op))

    def number(self, meta: Meta, children: list) -> ast.IntLit:
        (token,) = children
        return ast.IntLit(self._int(token), self._src.token(token))

    def name(self, meta: Meta, children: list) -> ast.Name:
        (token,) = children
        return ast.Name(self._name(token), self._src.token(token))

    def call(self, meta: Meta, children: list) -> ast.Call:
        name, *args = children
        return ast.Call(self._name(name), tuple(a for a in args if a is not None), self._src.token(name))


def parse_source(text: str, *, file: str = "<string>") -> ast.Module:
    """Parse the text of a ``.sched`` file into its syntax tree.

    ``file`` is only used in positions and messages. Raises ScheduleSyntaxError.
    """
    source = Source(text, file)
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as err:
        # Parse again, recovering after each error, to report all of them at once.
        found, repaired = syntax_errors.collect(_lark(), text, source)
        errors: list[PipedslError] = [*(found or [syntax_errors.translate(_lark(), err, source)])]
        # The syntax errors first, so that what is raised is still a ScheduleSyntaxError.
        if repaired is not None:
            errors += _semantic_errors(repaired, source, file, {e.pos.line for e in errors if e.pos})
        raise several(errors) from None
    return _module(tree, source, file)


def _module(tree: lark.Tree, source: Source, file: str) -> ast.Module:
    try:
        functions, schedule = _Builder(source).transform(tree)
    except VisitError as err:
        if isinstance(err.orig_exc, PipedslError):
            raise err.orig_exc from None
        raise
    return ast.Module(functions, schedule, file)


# Evaluating a repaired text at its defaults stops past this many actions: enough for the
# checks of names and arity to reach every body, and bounded whatever the text says.
_REPAIRED_MAX_ACTIONS = 100_000


def _semantic_errors(tree: lark.Tree, source: Source, file: str, broken: set[int]) -> list[PipedslError]:
    """The evaluation errors of a text repaired after its syntax errors, at its defaults
    (an unknown name, a wrong arity, a division by zero), or, when it evaluates, the
    violations of the validation rules of the schedule it builds (a misorder, a missing
    action, a deadlock) or the checks of its policy; leaving out those on a line with a
    syntax error: there the repair, not the user, wrote what is read."""
    from pipedsl.ir import Schedule
    from pipedsl.lang.evaluate import evaluate
    from pipedsl.validate import validate

    try:
        built = evaluate(_module(tree, source, file), max_actions=_REPAIRED_MAX_ACTIONS)
        if isinstance(built, Schedule):
            validate(built)
        else:
            built.check()
    except PipedslError as err:
        kept = [e for e in err.errors if e.pos is not None and e.pos.line not in broken]
        return sorted(kept, key=lambda e: (e.pos.line, e.pos.column) if e.pos else (0, 0))
    return []
