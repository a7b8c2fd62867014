"""Every notebook in ``notebooks/`` runs top to bottom without an error.

Each notebook is executed with nbclient in a fresh kernel whose working directory is
``notebooks/``. The kernel is this interpreter (``sys.executable -m ipykernel_launcher``)
through a kernel spec written for the test, not whatever ``python3`` kernel spec the
machine has installed: a fresh CI machine has none, and a developer's may point at
another Python. The kernel starts without ``XLA_FLAGS`` (other test modules set it in
this process), so a notebook that needs several CPU devices must ask for them itself,
as a reader's fresh kernel would.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 120
"""Seconds one cell may run before the test fails (the slowest takes a few)."""


def _kernel_manager(tmp_path: Path) -> KernelManager:
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "pipedsl test kernel",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    specs = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)], ensure_native_kernel=False)
    return KernelManager(
        kernel_name="python3",
        kernel_spec_manager=specs,
        connection_file=str(tmp_path / "connection.json"),
    )


def _kernel_env() -> dict[str, str]:
    """This process's environment less what would make the kernel differ from a reader's:
    XLA flags set by other test modules, and a matplotlib backend chosen for pytest."""
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MPLBACKEND")}


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), (
        f"{path.name} is stored with outputs; clear them before saving, so that it diffs cleanly"
    )
    km = _kernel_manager(tmp_path)
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(NOTEBOOKS)}})
    try:
        client.execute(env=_kernel_env())
    except CellExecutionError as err:
        pytest.fail(f"{path.name} failed:\n{err}", pytrace=False)
    finally:
        # Given a kernel manager, the client leaves the kernel running: stop it here.
        if client.kc is not None:
            client.kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    blank = [cell.id for cell in code if _figure_without_picture(cell)]
    assert not blank, f"{path.name}: cells {blank} show a figure as text, not as a picture"


def _figure_without_picture(cell: nbformat.NotebookNode) -> bool:
    """Whether the cell shows a matplotlib figure only by its repr (``<Figure size ...>``):
    the picture was lost, for example because no inline backend was set up."""
    for output in cell.get("outputs", ()):
        data = output.get("data", {})
        if str(data.get("text/plain", "")).startswith("<Figure size") and "image/png" not in data:
            return True
    return False


def test_the_tours_are_there() -> None:
    # An empty glob would parametrize nothing and pass silently.
    names = {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    assert {"01_tour.ipynb", "02_planning.ipynb", "03_executing.ipynb"} <= names, sorted(names)
