"""The schedule language: ``.sched`` text to a :class:`~pipedsl.ir.Schedule`.

The pieces, in the order text passes through them:

- :mod:`~pipedsl.lang.parser`: lark parses the text (``grammars/pipedsl.lark``) and the
  parse tree becomes the typed syntax tree of :mod:`~pipedsl.lang.ast`, once;
- :mod:`~pipedsl.lang.syntax_errors`: when the text does not parse, every syntax error is
  found by recovering after each one;
- :mod:`~pipedsl.lang.compile`: expressions and statements become closures over slot frames
  (with :mod:`~pipedsl.lang.arith`'s integers, :mod:`~pipedsl.lang.scope`'s names and
  :mod:`~pipedsl.lang.budget`'s bounds);
- :mod:`~pipedsl.lang.evaluate`: a schedule's items run under its parameters, emitting the
  per-device orders, within a bound on the actions emitted.

Most callers want :func:`pipedsl.load` or :func:`pipedsl.parse` (:mod:`pipedsl.library`).
"""

from pipedsl.lang.ast import Module
from pipedsl.lang.evaluate import MAX_ACTIONS, evaluate, evaluate_arrays, evaluate_layout
from pipedsl.lang.parser import RESERVED_WORDS, parse_source

__all__ = ["MAX_ACTIONS", "Module", "RESERVED_WORDS", "evaluate", "evaluate_arrays", "evaluate_layout", "parse_source"]
