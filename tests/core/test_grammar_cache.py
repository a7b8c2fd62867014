"""The parser's tables kept between processes, and actions made a column at a time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipedsl.arrays import make_actions
from pipedsl.errors import SourcePos
from pipedsl.ir import Action, Kind
from pipedsl.lang.parser import CACHE_ENV

# Parses a schedule in a fresh process with lark's log on stderr (set after lark's import
# has set its own level), which says when the tables come from the cache.
_PARSE = (
    "import logging\n"
    "from pipedsl.lang.parser import parse_source\n"
    "logging.getLogger('lark').setLevel(logging.DEBUG)\n"
    "module = parse_source('schedule s(pp = 2) { stages pp devices pp place s -> s on device d { F(0) B(0) } }')\n"
    "print(module.schedule.name)\n"
)


def _parse_in_process(cache: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **{CACHE_ENV: cache})
    done = subprocess.run([sys.executable, "-c", _PARSE], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "s"
    return done


def test_the_tables_are_written_once_and_read_back(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    first = _parse_in_process(str(folder))
    (table,) = folder.iterdir()
    assert table.name.startswith("grammar-") and table.stat().st_size > 0
    assert "Loading grammar from cache" not in first.stderr
    second = _parse_in_process(str(folder))
    assert "Loading grammar from cache" in second.stderr
    assert list(folder.iterdir()) == [table]


def test_a_damaged_table_file_is_rebuilt(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    _parse_in_process(str(folder))
    (table,) = folder.iterdir()
    table.write_bytes(b"not a table\n")
    _parse_in_process(str(folder))
    assert "Loading grammar from cache" in _parse_in_process(str(folder)).stderr


def test_parsing_works_where_no_cache_folder_can_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    done = _parse_in_process(str(blocker / "cache"))
    assert "Loading grammar from cache" not in done.stderr
    assert blocker.is_file()


def test_an_empty_cache_setting_turns_the_cache_off() -> None:
    for _ in range(2):
        assert "Loading grammar from cache" not in _parse_in_process("").stderr


def test_actions_made_by_columns_are_the_constructors_actions() -> None:
    pos = SourcePos("x.sched", 3, 5)
    columns = ([Kind.F, Kind.W, Kind.I], [0, 7, 2], [1, 2**40, 0], [pos, None, pos])
    made = make_actions(*columns)
    expected = [Action(*fields) for fields in zip(*columns)]
    assert made == expected
    assert [(a.kind, a.stage, a.microbatch, a.pos) for a in made] == [tuple(f) for f in zip(*columns)]
    assert [hash(a) for a in made] == [hash(a) for a in expected]
    assert [repr(a) for a in made] == [repr(a) for a in expected]
    assert make_actions([], [], [], []) == []
