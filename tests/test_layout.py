"""The import rules of docs/design.md, read off the source: which way imports run, no circles.

- the core (``pipedsl/`` outside ``pipedsl/cli/``) imports neither the simulator nor the executor;
- the simulator imports neither JAX nor Ray (nor the executor), not even inside a function;
- the executor never imports the simulator;
- imports between pipedsl's own modules form no circle, counting every import anywhere in
  a module (inside functions and under ``if TYPE_CHECKING`` too): a module that imports
  another only when called still depends on it.
- every name a benchmark under ``bench/`` imports from pipedsl is there (the suite runs no
  benchmark, and they import pipedsl inside functions).

Module and function lengths are not checked: a module is one concept, whatever its length.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject's package-dir).
PACKAGES = {"pipedsl": "pipedsl", "simulator": "pipedsl.simulator", "executor": "pipedsl.executor"}


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


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, wherever the import statement stands."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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
    bad = _touches(_imports(MODULES[name]), ("pipedsl.simulator", "pipedsl.executor"))
    assert not bad, f"{name} imports {bad}; only pipedsl.cli may"


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("pipedsl.simulator")])
def test_the_simulator_imports_neither_jax_nor_ray(name: str) -> None:
    bad = _touches(_imports(MODULES[name]), ("jax", "jaxlib", "ray", "optax", "pipedsl.executor"))
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("pipedsl.executor")])
def test_the_executor_never_imports_the_simulator(name: str) -> None:
    bad = _touches(_imports(MODULES[name]), ("pipedsl.simulator", "pipedsl.cli"))
    assert not bad, f"{name} imports {bad}"


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which of ``modules`` (dotted name -> file) each one imports."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            # `from pipedsl.x import y` names module pipedsl.x, or pipedsl.x.y when y is one.
            # A package is initialised before its submodules, so an edge to an enclosing
            # package closes no circle.
            if imported in modules and imported != name and not name.startswith(imported + "."):
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
    circle = _cycle(_graph(MODULES))
    assert circle is None, " -> ".join(circle or [])


def test_a_circle_is_found_when_there_is_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_an_import_inside_a_function_closes_a_circle(tmp_path: Path) -> None:
    # The shape ir.py once had: a method importing, when called, a module that imports it.
    ir, lowering = tmp_path / "ir.py", tmp_path / "lowering.py"
    ir.write_text(
        "class Schedule:\n    def lower(self):\n        from pkg.lowering import lower\n        return lower(self)\n"
    )
    lowering.write_text("from pkg.ir import Schedule\n\ndef lower(schedule: Schedule) -> None: ...\n")
    assert _cycle(_graph({"pkg.ir": ir, "pkg.lowering": lowering})) == ["pkg.ir", "pkg.lowering", "pkg.ir"]


@functools.cache
def _defined(path: Path) -> set[str]:
    """The names a module defines or imports at its top level, and those its ``__all__``
    lists (a package that imports them when first asked for, through ``__getattr__``)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                names.update(ast.literal_eval(node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


@pytest.mark.parametrize("script", sorted((ROOT / "bench").glob("*.py")), ids=lambda p: p.name)
def test_the_benchmarks_import_what_pipedsl_has(script: Path) -> None:
    # The suite runs no benchmark, and most of them import pipedsl inside functions: a
    # name renamed or moved in pipedsl would only fail the next `make bench`.
    missing = [
        f"line {node.lineno}: {node.module}.{alias.name}"
        for node in ast.walk(ast.parse(script.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.module in MODULES
        for alias in node.names
        if alias.name not in _defined(MODULES[node.module]) and f"{node.module}.{alias.name}" not in MODULES
    ]
    assert not missing, f"{script.name} imports what pipedsl does not have: {missing}"
