"""Mutated schedules never crash the front end: every outcome is a Schedule or a PipedslError.

The library files are mutated at random (characters, tokens and lines deleted, inserted,
duplicated, swapped; numbers and names replaced) with a fixed seed, then parsed,
evaluated and, when that succeeds, validated. Any exception that is not one of ours fails
the test with the offending text.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipedsl.errors import PipedslError, ScheduleEvalError, ScheduleSyntaxError
from pipedsl.library import library_schedules, parse
from pipedsl.policy import Policy
from pipedsl.validate import validate

SEED = 20240611
MUTANTS_PER_FILE = 400  # per library file: over 5,000 mutants in all
MAX_ACTIONS = 20_000  # keeps any one evaluation (and its validation) fast

_TOKEN = re.compile(r'"[^"\n]*"|#[^\n]*|[0-9]+[A-Za-z0-9_]*|[A-Za-z_][A-Za-z0-9_]*|\.\.|->|[=!<>]=|\S')
_ALPHABET = '(){}[],.:;=<>!+-*/%#"_ \n\t0123456789FBIWdsimpqxé€\x00'
_NUMBERS = ["0", "1", "2", "3", "-1", "7", "64", "1000", "1000000", "99999999999", "10000000000000000000"]
_WORDS = [
    "schedule",
    "def",
    "for",
    "in",
    "if",
    "else",
    "require",
    "on",
    "device",
    "devices",
    "stages",
    "microbatches",
    "place",
    "and",
    "or",
    "not",
    "min",
    "max",
    "F",
    "B",
    "I",
    "W",
    "pp",
    "vpp",
    "d",
    "s",
    "i",
    "k",
    "x",
    "0F0",
    "1W2",
    "9X9",
]

Mutation = Callable[[str, random.Random], str]


def _spot(text: str, rng: random.Random) -> int:
    return rng.randrange(len(text) + 1)


def delete_chars(text: str, rng: random.Random) -> str:
    at = _spot(text, rng)
    return text[:at] + text[at + rng.randint(1, 3) :]


def insert_char(text: str, rng: random.Random) -> str:
    at = _spot(text, rng)
    return text[:at] + rng.choice(_ALPHABET) + text[at:]


def duplicate_span(text: str, rng: random.Random) -> str:
    at = _spot(text, rng)
    span = text[at : at + rng.randint(1, 40)]
    return text[:at] + span + text[at:]


def _tokens(text: str) -> list[re.Match[str]]:
    return list(_TOKEN.finditer(text))


def _replace_token(text: str, rng: random.Random, pick: Callable[[re.Match[str], list[re.Match[str]]], str]) -> str:
    tokens = _tokens(text)
    if not tokens:
        return text
    token = rng.choice(tokens)
    return text[: token.start()] + pick(token, tokens) + text[token.end() :]


def delete_token(text: str, rng: random.Random) -> str:
    return _replace_token(text, rng, lambda t, ts: "")


def duplicate_token(text: str, rng: random.Random) -> str:
    return _replace_token(text, rng, lambda t, ts: t.group() + " " + t.group())


def transplant_token(text: str, rng: random.Random) -> str:
    return _replace_token(text, rng, lambda t, ts: rng.choice(ts).group())


def swap_tokens(text: str, rng: random.Random) -> str:
    tokens = _tokens(text)
    if len(tokens) < 2:
        return text
    i = rng.randrange(len(tokens) - 1)
    a, b = tokens[i], tokens[i + 1]
    return text[: a.start()] + b.group() + text[a.end() : b.start()] + a.group() + text[b.end() :]


def replace_number(text: str, rng: random.Random) -> str:
    numbers = [m for m in _tokens(text) if m.group().isdigit()]
    if not numbers:
        return text
    n = rng.choice(numbers)
    return text[: n.start()] + rng.choice(_NUMBERS) + text[n.end() :]


def replace_word(text: str, rng: random.Random) -> str:
    return _replace_token(text, rng, lambda t, ts: rng.choice(_WORDS))


def delete_line(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    del lines[rng.randrange(len(lines))]
    return "\n".join(lines)


def duplicate_line(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    i = rng.randrange(len(lines))
    lines.insert(i, lines[i])
    return "\n".join(lines)


def truncate(text: str, rng: random.Random) -> str:
    return text[: _spot(text, rng)]


MUTATIONS: list[Mutation] = [
    delete_chars,
    insert_char,
    duplicate_span,
    delete_token,
    duplicate_token,
    transplant_token,
    swap_tokens,
    replace_number,
    replace_number,
    replace_word,
    delete_line,
    duplicate_line,
    truncate,
]


def check(text: str, label: str) -> str:
    """Parse, evaluate and validate ``text``; return how it ended. Fails on foreign errors."""
    try:
        schedule = parse(text, file=label, max_actions=MAX_ACTIONS)
    except (ScheduleSyntaxError, ScheduleEvalError) as err:
        assert err.pos is not None and err.pos.file == label
        assert 1 <= err.pos.line <= text.count("\n") + 1
        str(err)
        return type(err).__name__
    except Exception as err:  # noqa: BLE001 - the point: name any foreign exception
        pytest.fail(f"{type(err).__name__}: {err}\n--- text ---\n{text}")
    try:
        # A policy schedule is checked as far as the core can without a cost model.
        schedule.check() if isinstance(schedule, Policy) else validate(schedule)
    except PipedslError as err:
        str(err)
        return type(err).__name__
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"validate raised {type(err).__name__}: {err}\n--- text ---\n{text}")
    return "valid"


@pytest.mark.parametrize("name", sorted(library_schedules()))
def test_mutated_library_files_fail_only_with_our_errors(name: str) -> None:
    original = library_schedules()[name].read_text()
    rng = random.Random(f"{SEED}-{name}")
    outcomes: dict[str, int] = {}
    for n in range(MUTANTS_PER_FILE):
        text = original
        for _ in range(rng.randint(1, 3)):
            text = rng.choice(MUTATIONS)(text, rng)
        outcome = check(text, f"{name}#{n}")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # The mutations reach past the grammar into evaluation and validation.
    assert outcomes.get("ScheduleSyntaxError", 0) > 0
    assert outcomes.get("ScheduleEvalError", 0) + outcomes.get("valid", 0) + outcomes.get("ScheduleInvalid", 0) > 0


_PIECES = [
    "schedule t",
    "(",
    ")",
    "{",
    "}",
    "pp = 2",
    ",",
    "stages 2",
    "devices 2",
    "place s -> s",
    "place [0, 1]",
    "on device d",
    "device 0:",
    "device 1:",
    "0F0",
    "1B0",
    "for i in 0 .. 2",
    "if d == 0",
    "else",
    "require pp > 1",
    '"message"',
    "F(i)",
    "B(i, 1)",
    "x = 1 / d",
    "def f(k) = k % pp",
    "f(3)",
    "min(",
    "max(",
    "and",
    "not",
    "-",
    "#",
    "\n",
]


@settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_PIECES), max_size=30))
def test_token_soup_fails_only_with_our_errors(pieces: list[str]) -> None:
    check(" ".join(pieces), "soup")
