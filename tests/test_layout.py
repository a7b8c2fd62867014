"""The house rules of DESIGN.md, read off the source: which way imports run, no circles.

- the core (``pipedsl/`` outside ``pipedsl/cli/``) imports neither the simulator nor the executor;
- the simulator imports neither JAX nor Ray (nor the executor), not even inside a function;
- the executor never imports the simulator;
- module-level imports between pipedsl's own modules form no circle;
- no module is over 500 lines;
- no function is over 60 lines unless a comment above it says why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject's package-dir).
PACKAGES = {"pipedsl": "pipedsl", "simulator": "pipedsl.simulator", "executor": "pipedsl.executor"}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """Modules ``path`` imports; with ``top_level_only``, those run at import time (not
    inside functions, not under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _touches(names: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))


def test_the_modules_are_found() -> None:
    assert {"pipedsl.library", "pipedsl.lang.parser", "pipedsl.cli.main", "pipedsl.simulator.engine"} <= set(MODULES)


CORE = [m for m in MODULES if not m.startswith(("pipedsl.cli", "pipedsl.simulator", "pipedsl.executor"))]


@pytest.mark.parametrize("name", CORE)
def test_the_core_imports_neither_simulator_nor_executor(name: str) -> None:
    bad = _touches(_imports(MODULES[name], top_level_only=False), ("pipedsl.simulator", "pipedsl.executor"))
    assert not bad, f"{name} imports {bad}; only pipedsl.cli may"


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("pipedsl.simulator")])
def test_the_simulator_imports_neither_jax_nor_ray(name: str) -> None:
    bad = _touches(_imports(MODULES[name], top_level_only=False), ("jax", "jaxlib", "ray", "optax", "pipedsl.executor"))
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("pipedsl.executor")])
def test_the_executor_never_imports_the_simulator(name: str) -> None:
    bad = _touches(_imports(MODULES[name], top_level_only=False), ("pipedsl.simulator", "pipedsl.cli"))
    assert not bad, f"{name} imports {bad}"


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        targets = set()
        for imported in _imports(path, top_level_only=True):
            # `from pipedsl.x import y` names module pipedsl.x, or pipedsl.x.y when y is one.
            # A package is initialised before its submodules, so an edge to an enclosing
            # package closes no circle.
            if imported in MODULES and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, if any (depth-first search for a back edge)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            # A package's __init__ importing its own submodules is how packages re-export.
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circles() -> None:
    circle = _cycle(_graph())
    assert circle is None, " -> ".join(circle or [])


def test_a_circle_is_found_when_there_is_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_500_lines(name: str) -> None:
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {lines} lines; split it by concern"


MAX_FUNCTION_LINES = 60
# A longer function says why next to its ``def``: a comment block right above it (or above
# its decorators) with a line that starts with this.
LONG_REASON = "# Over 60 lines:"


def _long_functions(path: Path, *, root: Path = ROOT) -> list[str]:
    """Functions of ``path`` over :data:`MAX_FUNCTION_LINES` lines with no reason above them."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        # The comment block right above the def (or its decorators), read upwards.
        comment = []
        row = first - 2
        while row >= 0 and lines[row].lstrip().startswith("#"):
            comment.append(lines[row].strip())
            row -= 1
        if length > MAX_FUNCTION_LINES and not any(c.startswith(LONG_REASON) for c in comment):
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_function_is_over_60_lines_without_a_reason(name: str) -> None:
    long = _long_functions(MODULES[name])
    assert not long, f"split these, or write `{LONG_REASON} why` above the def: {', '.join(long)}"


def test_a_long_function_needs_its_reason(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    bare = tmp_path / "bare.py"
    bare.write_text(f"def f() -> None:\n{body}")
    reasoned = tmp_path / "reasoned.py"
    reasoned.write_text(f"{LONG_REASON} one table, read top to bottom.\n# (second line)\ndef f() -> None:\n{body}")
    found = _long_functions(bare, root=tmp_path)
    assert found == [f"bare.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert _long_functions(reasoned, root=tmp_path) == []
