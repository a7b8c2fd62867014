"""What ``pipedsl simulate`` imports, and the simulator package's names bound on first use."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from pipedsl.cli.main import COMMANDS, build_parser
from pipedsl.library import library_path


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


def test_simulate_imports_neither_the_search_nor_the_executor_nor_plotting() -> None:
    path = library_path("1f1b")
    code = (
        "import json, sys\n"
        "from pipedsl.cli import main\n"
        f"assert main(['simulate', {str(path)!r}, '--json']) == 0\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = set(json.loads(_run(code)))
    assert {"pipedsl.simulator.engine", "pipedsl.cli.simulate"} <= loaded
    unwanted = {
        "pipedsl.simulator.search", "pipedsl.simulator.estimate", "pipedsl.simulator.plot", "pipedsl.cli.plan",
        "pipedsl.cli.run", "pipedsl.executor", "jax", "pandas", "matplotlib", "rich",
    }  # fmt: skip
    assert not unwanted & loaded


def test_the_command_table_names_the_module_of_every_command() -> None:
    (commands,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    owners = {name: parser.get_default("handler").__module__ for name, parser in commands.choices.items()}
    assert owners == {name: f"pipedsl.cli.{module}" for module, names in COMMANDS.items() for name in names}
    assert list(owners) == [name for names in COMMANDS.values() for name in names]


def test_a_submodule_imported_first_leaves_the_function_of_its_name() -> None:
    code = (
        "import pipedsl.simulator.search, pipedsl.simulator.estimate\n"
        "from pipedsl.simulator import estimate, search, CostModel\n"
        "import pipedsl.simulator as s\n"
        "print(callable(search), callable(estimate), s.search is search, s.estimate is estimate,"
        " CostModel.__module__)\n"
    )
    assert _run(code) == "True True True True pipedsl.simulator.costs"


def test_every_exported_name_resolves() -> None:
    import pipedsl.simulator as simulator

    for name in simulator.__all__:
        assert getattr(simulator, name).__name__ == name
