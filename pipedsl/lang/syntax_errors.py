"""Syntax errors in plain words, and recovery after each one so that a file's every
independent syntax error is reported at once.

:func:`collect` runs only once the ordinary parse has failed: it parses the text again
with lark's interactive LALR parser and, at each token the grammar refuses, records an
error and repairs the input as a person would read it, in this order:

* a name or keyword among the few tokens before the refused one that is close to a
  keyword the grammar accepted there, and with which what follows fits (``stage pp``,
  ``fro i in ...``, ``device 2`` for ``devices 2``, which reads as the start of a
  ``device 2:`` row until the next line), is read as that keyword, and the error says
  "did you mean `stages`?" at that word;
* ``=`` where ``==`` would do (``if d = 0``) is read as ``==``, with "did you mean `==`?";
* one missing token is inserted when the refused token then fits (``F(1 }`` gets its
  ``)``);
* otherwise the refused token is skipped.

After a repair that skips input, errors within the next few tokens are not reported:
they are usually echoes of the first. At the end of the file, a ``{`` still open is
reported at that brace (when the indentation shows which ``}`` went missing, at the
brace whose block lost it), not at the end. Every step consumes a token or ends, so the
pass is linear in the input and cannot loop.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterator

import lark
from lark import Token
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark.lexer import PatternStr
from lark.parsers.lalr_analysis import Shift
from lark.parsers.lalr_interactive_parser import InteractiveParser
from lark.parsers.lalr_parser_state import ParseConf
from lark.tree import Meta

from pipedsl.errors import ScheduleSyntaxError, SourcePos

__all__ = ["Source", "collect", "translate"]

# Plain words for the terminals that are patterns rather than fixed strings.
_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "a number",
    "CELL": "an action cell like 0F1",
    "LIMIT_WHAT": "`inflight` or `activations`",
    "STRING": 'a quoted message like "..."',
    "$END": "the end of the file",
}
# Tokens to accept after skipping input before errors are reported again.
_QUIET_AFTER_SKIP = 3
_QUIET_AFTER_REPAIR = 1
# Tokens before a refused one that may hold a misspelt keyword (``device 2`` then the
# refused token: the keyword is two back).
_KEYWORD_LOOKBACK = 3
# How alike (difflib's ratio) a keyword that was taken and another must be for the
# first to be read as a misspelling of the second: `device`/`devices` 0.92, `limit`/`split` 0.6.
_TWIN_KEYWORD = 0.85
# Closing tokens are tried first when one missing token is inserted.
_CLOSERS = ("RPAR", "RSQB", "RBRACE")


class Source:
    """The text being parsed, to make SourcePos values with the line's text."""

    def __init__(self, text: str, file: str) -> None:
        self.file = file
        self.lines = [line.rstrip("\r") for line in text.split("\n")]
        self._text = text

    def at(self, line: int, column: int) -> SourcePos:
        line_text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return SourcePos(self.file, line, column, line_text)

    def token(self, token: Token) -> SourcePos:
        return self.at(token.line or 1, token.column or 1)

    def meta(self, meta: Meta) -> SourcePos:
        return self.at(meta.line, meta.column)

    def end(self) -> SourcePos:
        """Just after the last non-blank character: where an unexpected end of file is."""
        body = self._text.rstrip()
        line = body.count("\n") + 1
        column = len(body) - (body.rfind("\n") + 1) + 1
        return self.at(line, column)

    def indent(self, line: int) -> int:
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return len(text) - len(text.lstrip(" \t"))


def _error(message: str, pos: SourcePos) -> ScheduleSyntaxError:
    return ScheduleSyntaxError(message, pos=pos)


# A parser state: its state stack and its value stack.
_Stacks = tuple[list, list]


@functools.cache
def _parse_conf(parser: lark.Lark) -> ParseConf:
    return parser.parse_interactive("").parser_state.parse_conf


def _stacks(parser: InteractiveParser) -> _Stacks:
    state = parser.parser_state
    return list(state.state_stack), list(state.value_stack)


@functools.cache
def _fixed_strings(parser: lark.Lark) -> dict[str, str]:
    """Terminal name to its fixed text (``"LBRACE"`` to ``"{"``), for the terminals that have one."""
    return {t.name: t.pattern.value for t in parser.terminals if isinstance(t.pattern, PatternStr)}


def _describe_terminals(parser: lark.Lark, names: set[str]) -> str:
    strings = _fixed_strings(parser)
    words = sorted(
        {_TERMINAL_WORDS.get(n) or f"`{strings[n]}`" for n in names if n in _TERMINAL_WORDS or n in strings},
        # Named things first ("a name", "a number"), then symbols and keywords.
        key=lambda w: (w.startswith("`"), w),
    )
    if not words:
        return ""
    if len(words) == 1:
        return f"; expected {words[0]}"
    return f"; expected one of {', '.join(words[:-1])} or {words[-1]}"


def _describe(token: Token) -> str:
    if token.type == "NAME":
        return f"name `{token.value}`"
    if token.type == "INT":
        return f"number {token.value}"
    if token.type == "CELL":
        return f"`{token.value}`"
    if token.type == "STRING":
        return f"message {token.value}"
    return f"`{token.value}`"


def _accepts(parser: lark.Lark, at: _Stacks) -> set[str]:
    """The terminals the parser would take next in state ``at``.

    Like lark's ``accepts()``, it replays the pending reductions for each candidate, so
    the answer is exact (the LALR table row alone over-approximates in merged states);
    it replays them on a copy of the state stack alone, building no tree, so that an
    error costs little even in a long file.
    """
    conf = _parse_conf(parser)
    table = conf.states
    end_state = conf.end_state
    found = set()
    for name in table[at[0][-1]]:
        if not name.isupper():
            continue
        stack = list(at[0])
        while True:
            step = table[stack[-1]].get(name)
            if step is None:
                break
            action, arg = step
            if action is Shift:
                found.add(name)
                break
            if arg.expansion:
                del stack[-len(arg.expansion) :]
            stack.append(table[stack[-1]][arg.origin.name][1])
            if name == "$END" and stack[-1] == end_state:
                found.add(name)
                break
    return found


def translate(parser: lark.Lark, err: UnexpectedInput, source: Source) -> ScheduleSyntaxError:
    """One lark error as ours, with what the grammar expected there in words."""
    interactive = getattr(err, "interactive_parser", None)
    if interactive is not None:
        expected = _describe_terminals(parser, _accepts(parser, _stacks(interactive)))
    elif isinstance(err, UnexpectedToken):
        expected = _describe_terminals(parser, set(err.expected))
    else:
        expected = ""
    if isinstance(err, UnexpectedCharacters):
        if err.char == '"':
            return _error(
                'unterminated message: a quoted message must close with " on the same line',
                source.at(err.line, err.column),
            )
        return _error(f"unexpected character {err.char!r}{expected}", source.at(err.line, err.column))
    if isinstance(err, UnexpectedToken) and err.token.type != "$END":
        return _error(f"unexpected {_describe(err.token)}{expected}", source.token(err.token))
    return _error(f"unexpected end of the file{expected}", source.end())


def collect(parser: lark.Lark, text: str, source: Source) -> tuple[list[ScheduleSyntaxError], lark.Tree | None]:
    """Every syntax error of ``text`` that recovery finds, in the order of the text, and
    the parse tree of the repaired text when the repairs let the parse finish (None
    otherwise): what semantic checks can still read."""
    recovery = _Recovery(parser, text, source)
    errors = recovery.run()
    unique = {(e.pos.line, e.pos.column) if e.pos else (0, 0): e for e in reversed(errors)}
    return [unique[key] for key in sorted(unique)], recovery.tree


class _Recovery:
    """One pass of the interactive parser over the text, repairing after each error."""

    def __init__(self, parser: lark.Lark, text: str, source: Source) -> None:
        self.parser = parser
        self.text = text
        self.source = source
        self.live = parser.parse_interactive(text)
        self.errors: list[ScheduleSyntaxError] = []
        self.quiet = 0
        self.open_braces: list[Token] = []
        self.closed_braces: list[tuple[Token, Token]] = []
        self.last: Token | None = None
        self.tree: lark.Tree | None = None
        # The last few tokens taken, each with the parser as it stood before it: what a
        # misspelt keyword is checked against.
        self.recent: list[tuple[Token, _Stacks]] = []
        self.by_text = {value: name for name, value in _fixed_strings(parser).items()}
        self.keywords = {value: name for value, name in self.by_text.items() if value.isalpha()}

    def run(self) -> list[ScheduleSyntaxError]:
        for token in self._tokens():
            self._take(token)
        self._end()
        return self.errors

    def _report(self, error: ScheduleSyntaxError) -> None:
        if self.quiet == 0:
            self.errors.append(error)

    def _tokens(self) -> Iterator[Token]:
        """The tokens of the text; a character no token can start is reported and skipped."""
        lexer = self.live.lexer_thread
        state = lexer.state
        assert state is not None  # parse_interactive(text) gave the lexer its text
        while True:
            try:
                yield from lexer.lex(self.live.parser_state)
                return
            except UnexpectedCharacters as err:
                self._report(translate(self.parser, err, self.source))
                self.quiet = _QUIET_AFTER_SKIP
                counter = state.line_ctr
                if counter.char_pos == err.pos_in_stream:
                    counter.feed(self.text[counter.char_pos : counter.char_pos + 1])
            except UnexpectedToken as err:
                # The contextual lexer found a token that is valid elsewhere, not here.
                yield err.token

    def _feed(self, start: _Stacks, tokens: list[Token]) -> _Stacks | None:
        """Feed ``tokens`` to the parser in state ``start``: on success that is the live
        state and the result None, else the live state is as it was and the result is
        the state in which the parser refused a token."""
        # The live state is updated in place: the lexer reads its position from that object.
        state = self.live.parser_state
        saved = _stacks(self.live)
        state.state_stack[:] = start[0]
        state.value_stack[:] = start[1]
        try:
            for token in tokens:
                result = state.feed_token(token, token.type == "$END")
                if token.type == "$END":
                    self.tree = result
        except UnexpectedToken:
            # The parser reduces what it can before it finds that it cannot shift, so
            # this state expects exactly what may follow what was read (`)` or `,`
            # after a complete argument, rather than every operator too).
            refused = _stacks(self.live)
            state.state_stack[:] = saved[0]
            state.value_stack[:] = saved[1]
            return refused
        for token in tokens:
            self._track_brace(token)
        return None

    def _fits(self, start: _Stacks, tokens: list[Token]) -> bool:
        return self._feed(start, tokens) is None

    def _track_brace(self, token: Token) -> None:
        if token.type == "LBRACE":
            self.open_braces.append(token)
        elif token.type == "RBRACE" and self.open_braces:
            self.closed_braces.append((self.open_braces.pop(), token))

    def _variants(self, token: Token) -> list[Token]:
        """``token`` and the other terminals its text also spells (``2`` is a number or a
        cell): the lexer's fallback after a refused token may have picked either."""
        text = token.value
        types = [token.type]
        if text in self.keywords:
            types.append(self.keywords[text])
        if text.isidentifier():
            types.append("NAME")
        if text.isdigit():
            types.append("INT")
        unique = dict.fromkeys(types)
        return [token if kind == token.type else Token.new_borrow_pos(kind, text, token) for kind in unique]

    def _take(self, token: Token) -> None:
        now = _stacks(self.live)
        variants = self._variants(token)
        refused = self._feed(now, [token])
        if refused is None or any(self._fits(now, [v]) for v in variants[1:]):
            self.quiet = max(self.quiet - 1, 0)
        else:
            self._repair(token, refused)
        self.recent = [*self.recent[-(_KEYWORD_LOOKBACK - 1) :], (token, now)]
        self.last = token

    def _repair(self, token: Token, refused: _Stacks) -> None:
        if self._misspelt_keyword(token) or self._assignment_for_comparison(token):
            self.quiet = _QUIET_AFTER_REPAIR
            return
        accepted = _accepts(self.parser, refused)
        self._report(
            _error(
                f"unexpected {_describe(token)}{_describe_terminals(self.parser, accepted)}",
                self.source.token(token),
            )
        )
        candidates = sorted(accepted - {"$END"}, key=lambda name: (name not in _CLOSERS, name))
        for name in candidates:
            filler = Token.new_borrow_pos(name, self._filler_text(name), token)
            if any(self._fits(refused, [filler, v]) for v in self._variants(token)):
                self.quiet = _QUIET_AFTER_REPAIR
                return
        self.quiet = _QUIET_AFTER_SKIP

    def _filler_text(self, name: str) -> str:
        return _fixed_strings(self.parser).get(name, "0" if name == "INT" else "_")

    def _misspelt_keyword(self, token: Token) -> bool:
        """A word shortly before ``token`` read as the keyword it is closest to, if one
        fits there with what follows it: the nearest such word wins."""
        for back in range(len(self.recent) - 1, -1, -1):
            word, before = self.recent[back]
            following = [t for t, _ in self.recent[back + 1 :]]
            # A keyword the parser took right before the refused token is what that token
            # is refused after (`device = 0`: `device` starts a row), not a misspelling.
            if word.type != "NAME" and (word.value not in self.keywords or not following):
                continue
            if not difflib.get_close_matches(word.value, list(self.keywords), n=3, cutoff=0.6):
                continue
            accepted = _accepts(self.parser, before)
            allowed = [value for value, term in self.keywords.items() if term in accepted and value != word.value]
            # A keyword the parser took is suspect only next to a near twin (`device`, `devices`).
            cutoff = 0.6 if word.type == "NAME" else _TWIN_KEYWORD
            close = difflib.get_close_matches(word.value, allowed, n=1, cutoff=cutoff)
            if not close:
                continue
            keyword = Token.new_borrow_pos(self.keywords[close[0]], close[0], word)
            fits = any(self._fits(before, [keyword, *following, v]) for v in self._variants(token))
            # Right after the word, the keyword alone may fit, the refused token skipped.
            if not fits and not following:
                fits = self._fits(before, [keyword])
            # A keyword, or a word further back, is blamed only where the keyword makes the rest fit.
            if fits or (not following and word.type == "NAME"):
                what = "name" if word.type == "NAME" else "keyword"
                self._report(
                    _error(f"unexpected {what} `{word.value}`; did you mean `{close[0]}`?", self.source.token(word))
                )
                return fits
        return False

    def _assignment_for_comparison(self, token: Token) -> bool:
        if token.value != "=" or "==" not in self.by_text:
            return False
        equals = Token.new_borrow_pos(self.by_text["=="], "==", token)
        if not self._fits(_stacks(self.live), [equals]):
            return False
        self._report(
            _error(
                "unexpected `=`; did you mean `==`? (`=` gives a name a value, `==` compares)",
                self.source.token(token),
            )
        )
        return True

    def _end(self) -> None:
        end = Token.new_borrow_pos("$END", "", self.last) if self.last is not None else Token("$END", "")
        refused = self._feed(_stacks(self.live), [end])
        if refused is None:
            return
        if self.open_braces and "RBRACE" in _accepts(self.parser, refused):
            brace = self._unclosed_brace()
            self.quiet = 0
            self._report(
                _error(
                    f"this `{{` is never closed: the file ends at line {self.source.end().line}"
                    " while its block is still open",
                    self.source.token(brace),
                )
            )
            return
        accepted = _accepts(self.parser, refused)
        self._report(
            _error(
                f"unexpected end of the file{_describe_terminals(self.parser, accepted)}",
                self.source.end(),
            )
        )

    def _unclosed_brace(self) -> Token:
        """The ``{`` whose ``}`` is missing: by indentation when it tells, else the innermost open."""
        for opening, closing in sorted(self.closed_braces, key=lambda pair: pair[1].start_pos or 0):
            line = closing.line or 0
            starts_line = self.source.indent(line) + 1 == closing.column
            if (
                starts_line
                and line != opening.line
                and self.source.indent(line) < self.source.indent(opening.line or 0)
            ):
                return opening
        return self.open_braces[-1]
