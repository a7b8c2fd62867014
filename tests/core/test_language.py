"""The schedule language: grammar, evaluation semantics, and every error with its position.

Error cases are table-driven: each source marks the expected error position with ``⁁``
(removed before parsing), so the tables state line and column without counting by hand.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pipedsl.errors import PipedslError, ScheduleEvalError, ScheduleSyntaxError
from pipedsl.ir import Action, Kind
from pipedsl.lang.parser import parse_source
from pipedsl.library import load, parse

MARK = "⁁"


def wrap(body: str, *, top: str = "", header: str = "(pp = 2, microbatches = 2)") -> str:
    """A two-device, one-stage-per-device schedule around an ``on device d`` body."""
    return (
        f"schedule t{header} {{\n"
        f"  {top}\n"
        "  stages pp\n"
        "  devices pp\n"
        "  place s -> s\n"
        "  on device d {\n"
        f"    {body}\n"
        "  }\n"
        "}\n"
    )


def locate(marked: str) -> tuple[str, int, int]:
    """Strip the marker; return the text and the 1-based line and column it marked."""
    index = marked.index(MARK)
    text = marked.replace(MARK, "", 1)
    line = marked.count("\n", 0, index) + 1
    column = index - (marked.rfind("\n", 0, index) + 1) + 1
    return text, line, column


def orders(text: str, **params: int) -> list[list[str]]:
    schedule = parse(text, **params)
    return [[str(a) for a in order] for order in schedule.orders]


# ---- the language works ----------------------------------------------------------------

ONE_F_ONE_B = """\
# 1F1B: warm up, then one forward per backward, then drain.
schedule one_f_one_b(pp = 4, microbatches = 8) {
  require microbatches >= pp, "1F1B needs at least as many microbatches as stages"
  stages pp
  devices pp
  microbatches microbatches      # the keyword, then the parameter
  place s -> s
  on device d {
    warmup = min(pp - 1 - d, microbatches)
    for i in 0 .. warmup { F(i) }
    for i in 0 .. microbatches - warmup { F(warmup + i)  B(i) }
    for i in microbatches - warmup .. microbatches { B(i) }
  }
}
"""


def test_design_example_evaluates() -> None:
    schedule = parse(ONE_F_ONE_B, pp=2, microbatches=3)
    assert schedule.name == "one_f_one_b"
    assert schedule.source is None
    assert schedule.params == (("pp", 2), ("microbatches", 3))
    assert (schedule.num_stages, schedule.num_devices, schedule.num_microbatches) == (2, 2, 3)
    assert schedule.placement == (0, 1)
    assert [[str(a) for a in o] for o in schedule.orders] == [
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"],
    ]


def test_name_override_and_string_parameters() -> None:
    schedule = parse(ONE_F_ONE_B, name="mine", pp="3", microbatches=" 4 ")
    assert schedule.name == "mine"
    assert schedule.params == (("pp", 3), ("microbatches", 4))


def test_load_records_the_path(tmp_path: Path) -> None:
    path = tmp_path / "x.sched"
    path.write_text(ONE_F_ONE_B)
    schedule = load(path, pp=2, microbatches=2)
    assert schedule.source == str(path)
    assert schedule.num_actions == 8


def test_load_of_a_missing_file_is_our_error(tmp_path: Path) -> None:
    # One loader for every entry point: the API says what the CLI says.
    with pytest.raises(PipedslError, match="absent.sched: no such file"):
        load(tmp_path / "absent.sched")


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("7 / 2", 3),
        ("-7 / 2", -4),  # floor division
        ("-7 % 3", 2),  # Python's modulo: the sign of the divisor
        ("7 % -3", -2),
        ("- - 5", 5),
        ("10 - 2 - 3", 5),  # left associative
        ("100 / 10 / 5", 2),
        ("min(5, 3, 9)", 3),
        ("max(5, 3, 9)", 9),
        ("min(4)", 4),
        ("max(pp - 5, 0)", 0),
        ("sq(3) + 1", 10),
        ("twice(sq(2))", 8),
    ],
)
def test_integer_expressions(expr: str, value: int) -> None:
    text = wrap(f"v = {expr}\n    F(v, d)", top="def sq(x) = x * x\n  def twice(x) = 2 * x")
    assert parse(text).orders[0][0].microbatch == value


@pytest.mark.parametrize(
    ("cond", "expected"),
    [
        ("d == 0", [True, False]),
        ("d != 0", [False, True]),
        ("d < 1 and pp == 2", [True, False]),
        ("d > 0 or pp == 3", [False, True]),
        ("not d == 0", [False, True]),
        ("not d == 0 and d == 0", [False, False]),  # not binds tighter than and
        ("d == 0 or 1 / d > 0", [True, True]),  # or short-circuits past the division
        ("d >= 1 and 1 / d >= 1", [False, True]),  # and short-circuits too
        ("(d == 0 or d == 1) and d <= 0", [True, False]),
    ],
)
def test_conditions(cond: str, expected: list[bool]) -> None:
    text = wrap(f"if {cond} {{ F(1) }} else {{ F(0) }}")
    assert [order[0].microbatch == 1 for order in parse(text).orders] == expected


def test_else_if_chain_takes_the_first_true_arm() -> None:
    text = wrap("if d == 5 { F(5) } else if d == 1 { F(1) } else if d >= 0 { F(2) } else { F(3) }")
    assert orders(text) == [["0F2"], ["1F1"]]


def test_locals_update_from_nested_blocks_and_end_with_their_block() -> None:
    text = wrap(
        "count = 0\n    for i in 0 .. 3 { count = count + 1  if i == 1 { inner = 10  F(inner + count) } }\n    F(count)"
    )
    assert orders(text)[0] == ["0F12", "0F3"]


def test_rebinding_in_the_same_scope_and_at_schedule_level() -> None:
    text = """\
schedule t(n = 2) {
  k = n + 1
  k = k * 10
  stages 1
  devices 1
  place s -> 0
  on device d { x = k  x = x + 1  F(x) }
}
"""
    assert orders(text) == [["0F31"]]


def test_functions_see_arguments_params_and_earlier_names_only() -> None:
    text = """\
def half(x) = x / 2
schedule t(pp = 4) {
  base = 100
  def shifted(k) = half(k) + base + pp
  base = 0
  stages 1
  devices 1
  place s -> 0
  on device d { F(shifted(10)) F(base) }
}
"""
    # shifted froze base = 100 where it was defined; the body sees base = 0.
    assert orders(text) == [["0F109", "0F0"]]


def test_parameter_defaults_may_use_earlier_parameters() -> None:
    text = "schedule t(pp = 3, microbatches = 2 * pp) { stages 1 devices 1 place s -> 0 device 0: }"
    assert parse(text).params == (("pp", 3), ("microbatches", 6))
    assert parse(text, pp=5).params == (("pp", 5), ("microbatches", 10))


def test_microbatches_default_to_the_parameter_else_the_largest_index() -> None:
    table = "schedule t {{ stages 1 devices 1 {} place [0] device 0: 0F0 0F4 0B0 0B4 }}"
    assert parse(table.format("")).num_microbatches == 5
    assert parse(table.format("microbatches 7")).num_microbatches == 7
    assert parse(wrap("F(0)"), microbatches=9).num_microbatches == 9


def test_table_form_and_place_list() -> None:
    text = """\
schedule t {
  stages 4
  devices 2
  place [0, 1, 1, 0]
  device 0: 0F0 3F0 3B0 0B0
  device 1:
    1F0 2F0
    2I0 1I0 2W0 1W0
}
"""
    schedule = parse(text)
    assert schedule.placement == (0, 1, 1, 0)
    assert [[str(a) for a in o] for o in schedule.orders] == [
        ["0F0", "3F0", "3B0", "0B0"],
        ["1F0", "2F0", "2I0", "1I0", "2W0", "1W0"],
    ]
    cell = schedule.orders[1][2]
    assert (cell.pos.line, cell.pos.column, cell.pos.line_text) == (8, 5, "    2I0 1I0 2W0 1W0")


def test_stage_is_optional_only_on_a_one_stage_device() -> None:
    text = """\
schedule t {
  stages 3
  devices 2
  place s -> min(s, 1)
  on device d { if d == 0 { F(0) } else { F(0, 1)  F(0, 2) } }
}
"""
    assert orders(text) == [["0F0"], ["1F0", "2F0"]]


def test_actions_share_the_position_of_the_call_that_emitted_them() -> None:
    schedule = parse(wrap("for i in 0 .. 3 { F(i) }"))
    first, second, _ = schedule.orders[0]
    assert first.pos is second.pos
    assert (first.pos.file, first.pos.line, first.pos.column) == ("<string>", 7, 23)
    assert first == Action(Kind.F, 0, 0)


def test_keywords_are_names_where_an_item_cannot_start() -> None:
    text = """\
schedule t(stages = 1, devices = 1, microbatches = 2) {
  stages stages
  devices devices
  microbatches microbatches
  place s -> devices - 1
  on device d { device = d  for i in 0 .. microbatches { F(i, device) } }
}
"""
    assert orders(text) == [["0F0", "0F1"]]
    # Where an item may start, `device` begins a table row, so it cannot be bound there.
    with pytest.raises(ScheduleSyntaxError, match="unexpected `=`; expected a number"):
        parse("schedule t { device = 0 }")


def test_comments_and_layout_do_not_matter() -> None:
    compact = "schedule t{stages 1 devices 1 place s->0 on device d{for i in 0..2{F(i)B(i)}}}"
    spread = "schedule t # name\n{\n stages 1 # one\n devices\n 1\n place s ->\n 0\n on device d {\n for i in 0 .. 2 {\n F(i)\n B(i) } } }\n"
    assert orders(compact) == orders(spread) == [["0F0", "0B0", "0F1", "0B1"]]


def test_the_empty_range_is_allowed() -> None:
    assert orders(wrap("for i in 2 .. 2 { F(i) }  F(0)")) == [["0F0"], ["1F0"]]


def test_max_actions_bounds_the_output() -> None:
    text = wrap("for i in 0 .. 10 { F(i) }")
    assert parse(text, max_actions=20).num_actions == 20
    with pytest.raises(ScheduleEvalError, match="more than max_actions=19"):
        parse(text, max_actions=19)


def test_parse_source_keeps_positions_on_every_node() -> None:
    module = parse_source(wrap("F(1 + 2)"), file="f.sched")
    body = module.schedule.items[-1].body
    emit = body[0]
    assert emit.pos.file == "f.sched"
    assert (emit.pos.line, emit.pos.column) == (7, 5)
    plus = emit.args[0]
    assert (plus.pos.line, plus.pos.column) == (7, 9)  # an operator node sits at its operator


# ---- errors: one of ours, at the right place -------------------------------------------

SYNTAX_ERRORS = [
    pytest.param("schedule t { stages ⁁}", "expected one of a name, a number", id="missing-expression"),
    pytest.param("schedule t(pp = 4 ⁁{ }", "expected one of `)` or `,`", id="unclosed-params"),
    pytest.param("schedule t { x = 3 ⁁$ }", "unexpected character '$'", id="bad-character"),
    pytest.param("schedule⁁", "unexpected end of the file; expected a name", id="end-of-file"),
    pytest.param("⁁", "unexpected end of the file; expected one of `def` or `schedule`", id="empty"),
    pytest.param('schedule t { require 1 < 2, ⁁"open }', "unterminated message", id="open-string"),
    pytest.param("schedule t { ⁁for = 1 }", "`for` is a reserved word", id="reserved-word"),
    pytest.param("schedule t { device 0: 0F0 ⁁0X1 }", "`0X1` is not an action cell", id="bad-cell"),
    pytest.param(wrap("⁁chunk(1)"), "`chunk(...)` cannot stand on its own", id="call-statement"),
    pytest.param("schedule t { x = ⁁99999999999999999999 }", "too large", id="huge-number"),
    pytest.param(wrap("F(1 ⁁}"), "expected one of `)` or `,`", id="unclosed-call"),
    pytest.param(wrap("for i in 0 .. ⁁{ }"), "unexpected `{`", id="missing-range-end"),
    pytest.param("schedule t { } ⁁schedule u { }", "unexpected `schedule`", id="two-schedules"),
]


@pytest.mark.parametrize(("marked", "message"), SYNTAX_ERRORS)
def test_syntax_errors(marked: str, message: str) -> None:
    text, line, column = locate(marked)
    with pytest.raises(ScheduleSyntaxError) as info:
        parse(text, file="e.sched")
    err = info.value
    assert type(err) is ScheduleSyntaxError
    assert message in err.message
    assert (err.pos.file, err.pos.line, err.pos.column) == ("e.sched", line, column)
    # The rendered message names the place and shows the line with a caret under it
    # (first, when recovery finds further errors after it).
    rendered = str(err)
    assert rendered.startswith(f"e.sched:{line}:{column}: ")
    if err.pos.line_text:
        caret_line = rendered.splitlines()[2]
        assert caret_line.index("^") - 4 == column - 1


EVAL_ERRORS = [
    pytest.param(wrap("warmup = 1  F(⁁warmpu)"), "unknown name `warmpu`; did you mean `warmup`?", id="unknown-name"),
    pytest.param(wrap("F(⁁chunk(1))"), "unknown function `chunk`", id="unknown-function"),
    pytest.param(
        wrap("F(⁁f(1, 2))", top="def f(x) = x"), "f takes 1 argument (x), but this call passes 2", id="function-arity"
    ),
    pytest.param(wrap("⁁F(0, 1, 2)"), "F takes a microbatch and, optionally, a stage", id="action-arity"),
    pytest.param(wrap("⁁B()"), "this call passes 0", id="action-no-arguments"),
    pytest.param(wrap("x = ⁁min()"), "min() needs at least one argument", id="min-no-arguments"),
    pytest.param(wrap("x = 1 ⁁/ (d - d)"), "division by zero: 1 / 0 (evaluating d = 0)", id="division-by-zero"),
    pytest.param(wrap("x = d ⁁% 0"), "division by zero: 0 % 0", id="modulo-by-zero"),
    pytest.param(
        wrap("F(0)", top='⁁require pp > 5, "pp is too small"'), "requirement failed: pp is too small", id="require-top"
    ),
    pytest.param(
        wrap('⁁require d < 1, "one device only"'),
        "requirement failed: one device only (evaluating d = 1)",
        id="require-body",
    ),
    pytest.param(wrap("⁁require d < 1"), "requirement failed (evaluating d = 1)", id="require-no-message"),
    pytest.param(wrap("⁁for i in 3 .. 1 { }"), "negative range 3 .. 1", id="negative-range"),
    pytest.param(
        wrap("⁁for i in 0 .. 1000000000000 { }"),
        "runaway expansion: this loop of 1000000000000 iterations",
        id="runaway-empty-loop",
    ),
    pytest.param(wrap("for i in 0 .. 100 { ⁁F(i) }"), "more than max_actions=50", id="too-many-actions"),
    pytest.param(
        "schedule t { stages 2 devices 1 place s -> 0 on device d { ⁁F(0) } }",
        "F(0) leaves out the stage, but device 0 holds stages 0, 1",
        id="stage-omitted",
    ),
    pytest.param(
        "schedule t { stages 1 devices 2 place s -> 0 on device d { ⁁W(0) } }",
        "W(0) leaves out the stage, but device 1 holds no stage",
        id="stage-omitted-empty-device",
    ),
    pytest.param(wrap("x = 1 ⁁< 2"), "this is a condition, but a number is needed", id="condition-as-number"),
    pytest.param(wrap("if ⁁3 { }"), "a condition is needed here", id="number-as-condition"),
    pytest.param(
        wrap("for i in 0 .. 2 { ⁁i = 3 }"), "`i` is the loop variable and cannot be assigned", id="assign-loop-variable"
    ),
    pytest.param(wrap("⁁d = 3"), "`d` is the device variable", id="assign-device-variable"),
    pytest.param(wrap("⁁pp = 3"), "`pp` is a schedule-level name", id="assign-parameter-in-body"),
    pytest.param(wrap("F(0)", top="⁁pp = 3"), "`pp` is a parameter and cannot be rebound", id="rebind-parameter"),
    pytest.param(wrap("if d == 0 { y = 1 }  F(⁁y)"), "unknown name `y`", id="block-scoped-local"),
    pytest.param(
        wrap("for i in 0 .. 2 { ⁁for i in 0 .. 2 { } }"), "`i` is already a local", id="shadowed-loop-variable"
    ),
    pytest.param(wrap("F(f(1))", top="def f(x) = ⁁f(x)"), "`f` calls itself: recursion is not allowed", id="recursion"),
    pytest.param(
        wrap("F(0)", top="def f(x) = ⁁g(x)\n  def g(x) = x"),
        "`g` is not defined above this point",
        id="call-defined-below",
    ),
    pytest.param(wrap("F(⁁F)"), "`F` is an action", id="action-as-value"),
    pytest.param(wrap("x = ⁁F(1)"), "`F(...)` is an action", id="action-in-expression"),
    pytest.param(wrap("x = ⁁max"), "`max` is a function", id="function-as-value"),
    pytest.param(wrap("x = 3000000000 * 3000000000 ⁁* 3"), "integer overflow", id="overflow-multiply"),
    pytest.param(wrap("x = 1  for i in 0 .. 70 { ⁁x = x + x }"), "integer overflow", id="overflow-assign"),
    pytest.param("schedule t { x = 9223372036854775807 ⁁+ 1 }", "integer overflow", id="overflow-schedule-level"),
    pytest.param(
        "schedule t {\n  stages 3\n  ⁁stages 3\n}", "`stages` is declared twice (first at line 2)", id="declared-twice"
    ),
    pytest.param("schedule t { ⁁stages 0 }", "stages must be at least 1, got 0", id="no-stages"),
    pytest.param("schedule t { stages 2 ⁁devices -1 }", "devices must be at least 1, got -1", id="negative-devices"),
    pytest.param(
        "schedule t { stages 2 devices 2 place s -> s ⁁+ 1 on device d { } }",
        "place puts stage 1 on device 2, but the devices are 0 .. 1",
        id="place-out-of-range",
    ),
    pytest.param(
        "schedule t { stages 2 devices 2 place [0, ⁁5] device 0: device 1: }",
        "place puts stage 1 on device 5",
        id="place-list-out-of-range",
    ),
    pytest.param(
        "schedule t { stages 2 devices 2 ⁁place [0] device 0: device 1: }",
        "place lists 1 device, one per stage, but there are 2 stages",
        id="place-list-length",
    ),
    pytest.param(
        "schedule t { stages 2 ⁁place s -> s devices 2 }", "declare `devices` before `place`", id="place-too-early"
    ),
    pytest.param(
        "schedule t { stages 2 devices 2 ⁁on device d { } }",
        "declare `place` before the device orders",
        id="orders-before-place",
    ),
    pytest.param(
        "schedule ⁁t { stages 2 devices 2 place s -> s }",
        "has neither an `on device` block nor table rows",
        id="no-orders",
    ),
    pytest.param("schedule ⁁t { devices 2 }", "never declares `stages`", id="no-stages-declared"),
    pytest.param(
        "schedule t { stages 1 devices 2 place [0] ⁁device 0: 0F0 }",
        "the table has no row for device 1",
        id="missing-row",
    ),
    pytest.param(
        "schedule t { stages 1 devices 1 place [0] device 0: ⁁device 0: }", "device 0 has two rows", id="duplicate-row"
    ),
    pytest.param(
        "schedule t { stages 1 devices 1 place [0] ⁁device 3: }",
        "row for device 3, but the devices are 0 .. 0",
        id="row-out-of-range",
    ),
    pytest.param(
        "schedule t { stages 1 devices 1 place [0] on device d { } ⁁device 0: }", "not both", id="table-and-body"
    ),
    pytest.param("schedule t(pp = 1, ⁁pp = 2) { }", "parameter `pp` is declared twice", id="duplicate-parameter"),
    pytest.param("⁁def f(x, x) = x schedule t { }", "f names its argument `x` twice", id="duplicate-argument"),
    pytest.param("schedule t { ⁁def min(x) = x }", "`min` is a builtin", id="redefine-builtin"),
    pytest.param("schedule t(a = 1 ⁁/ 0) { }", "division by zero", id="bad-default"),
]


@pytest.mark.parametrize(("marked", "message"), EVAL_ERRORS)
def test_eval_errors(marked: str, message: str) -> None:
    text, line, column = locate(marked)
    with pytest.raises(ScheduleEvalError) as info:
        parse(text, file="e.sched", max_actions=50)
    err = info.value
    assert isinstance(err, ScheduleEvalError)
    assert message in err.message
    assert (err.pos.file, err.pos.line, err.pos.column) == ("e.sched", line, column)
    assert str(err).startswith(f"e.sched:{line}:{column}: ")
    assert "^" in str(err)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"foo": 1}, "unknown parameter `foo` for schedule t (its parameters: pp, microbatches)"),
        ({"micobatches": 1}, "did you mean `microbatches`?"),
        ({"pp": 2.5}, "parameter `pp` must be a 64-bit integer, got 2.5"),
        ({"pp": True}, "parameter `pp` must be a 64-bit integer, got True"),
        ({"pp": "two"}, "parameter `pp` must be a 64-bit integer, got 'two'"),
        ({"pp": 2**70}, "must be a 64-bit integer, got 1180591620717411303424"),
        ({"pp": "9" * 5000}, "must be a 64-bit integer"),
        # Text is read as the language reads a number, which no file may write these ways.
        ({"pp": "\u0664"}, "parameter `pp` must be a 64-bit integer, got '\u0664'"),
        ({"pp": "1_0"}, "parameter `pp` must be a 64-bit integer, got '1_0'"),
        ({"pp": "+2"}, "parameter `pp` must be a 64-bit integer, got '+2'"),
    ],
)
def test_parameter_errors(params: dict[str, object], message: str) -> None:
    with pytest.raises(ScheduleEvalError) as info:
        parse(wrap("F(0) B(0)"), file="e.sched", **params)  # type: ignore[arg-type]
    assert message in info.value.message
    assert info.value.pos is not None and info.value.pos.line == 1


def test_parameters_take_integers_of_any_type_and_text_the_language_reads() -> None:
    import numpy as np

    for value in (np.int64(3), np.int32(3), "3", " 3 "):
        assert parse(wrap("F(0) B(0)"), pp=value).num_stages == 3  # type: ignore[arg-type, union-attr]


def test_deep_nesting_is_handled() -> None:
    # Parentheses add no depth; a chain of 500 operators evaluates; a chain too long for
    # Python's stack is our error, not a RecursionError.
    assert parse(wrap("F(" + "(" * 5000 + "1" + ")" * 5000 + ")")).orders[0][0].microbatch == 1
    assert parse(wrap("F(" + " + ".join(["1"] * 500) + ")")).orders[0][0].microbatch == 500
    with pytest.raises(ScheduleEvalError, match="nests too deeply"):
        parse(wrap("F(" + " + ".join(["1"] * 5000) + ")"))


def test_exponential_function_expansion_is_refused() -> None:
    defs = ["def f0(x) = x + 1"] + [f"def f{i}(x) = f{i - 1}(f{i - 1}(x))" for i in range(1, 30)]
    with pytest.raises(ScheduleEvalError, match="expand to more than"):
        parse(wrap("F(f29(0))", top="\n  ".join(defs)))


def test_error_message_layout() -> None:
    text = textwrap.dedent(
        """\
        schedule t {
          stages 1
          devices 1
          place s -> 0
          on device d { F(1 / 0) }
        }
        """
    )
    with pytest.raises(ScheduleEvalError) as info:
        parse(text, file="x.sched")
    assert str(info.value) == (
        "x.sched:5:21: division by zero: 1 / 0 (evaluating d = 0)\n"
        "      on device d { F(1 / 0) }\n"
        "                        ^"
    )
