"""Every notebook in ``notebooks/`` runs top to bottom without an error, and is stored
with the outputs of such a run (so that it reads as a tutorial where it is shown without
being run).

Each notebook is executed with nbclient in a fresh kernel whose working directory is
``notebooks/``; the test does not write the result back. ``make notebooks`` runs this
module with ``PIPEDSL_WRITE_NOTEBOOKS=1``, which writes each executed notebook over its
file: the one way to refresh the stored outputs, in the same kernel set-up. The kernel is this interpreter (``sys.executable -m ipykernel_launcher``)
through a kernel spec written for the test, not whatever ``python3`` kernel spec the
machine has installed: a fresh CI machine has none, and a developer's may point at
another Python. The kernel starts without ``XLA_FLAGS`` (other test modules set it in
this process), so a notebook that needs several CPU devices must ask for them itself,
as a reader's fresh kernel would.

Every stored output of a cell that computes the same thing on every machine (library
listings, simulated makespans, estimates, search verdicts) must be what a fresh run
prints: a change in the code that changes such an output fails here until `make
notebooks` stores the new one. Cells whose output is measured on the machine (step
times, measured timelines, floating-point noise across threads) carry the tag
``measured`` in their metadata and are not compared; pictures are compared by their text
form only.
"""

from __future__ import annotations

import copy
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
WRITE = os.environ.get("PIPEDSL_WRITE_NOTEBOOKS") == "1"
"""Write each executed notebook back to its file (``make notebooks``)."""


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


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    stored = copy.deepcopy(nb)
    if not WRITE:
        _check_stored_outputs(path, nb)
    km = _kernel_manager(tmp_path)
    # Without timing metadata a refresh changes only what the cells print.
    client = NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, record_timing=False, resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
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
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    blank = [cell.id for cell in code if _figure_without_picture(cell)]
    assert not blank, f"{path.name}: cells {blank} show a figure as text, not as a picture"
    if WRITE:
        nbformat.write(nb, path)
    else:
        stale = _stale_cells(stored, nb)
        assert not stale, (
            f"{path.name}: the stored outputs of cells {stale} differ from a fresh run; run `make notebooks`"
            " to store the fresh ones (and read the prose around them)"
        )


MEASURED = "measured"
"""The tag of a cell whose output is measured on the machine, not compared."""


def _text_outputs(cell: nbformat.NotebookNode) -> list[str]:
    """What a cell shows as text: its printed streams and the text form of its results."""
    texts = []
    for output in cell.get("outputs", ()):
        if output.get("output_type") == "stream":
            texts.append(str(output.get("text", "")))
        elif "data" in output:
            texts.append(str(output["data"].get("text/plain", "")))
        elif output.get("output_type") == "error":
            texts.append(f"{output.get('ename')}: {output.get('evalue')}")
    return texts


def _stale_cells(stored: nbformat.NotebookNode, fresh: nbformat.NotebookNode) -> list[str]:
    """The ids of the code cells not tagged :data:`MEASURED` whose stored text outputs
    are not the fresh run's."""
    stale = []
    for old, new in zip(stored.cells, fresh.cells, strict=True):
        if old.cell_type != "code" or MEASURED in old.get("metadata", {}).get("tags", ()):
            continue
        if _text_outputs(old) != _text_outputs(new):
            stale.append(old.get("id"))
    return stale


def _check_stored_outputs(path: Path, nb: nbformat.NotebookNode) -> None:
    """The stored notebook shows one run from the top: every code cell executed, in order."""
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name} is stored without the outputs of one run from the top (execution counts {counts}); "
        "run `make notebooks` to refresh them"
    )
    blank = [cell.id for cell in code if _figure_without_picture(cell)]
    assert not blank, f"{path.name}: stored cells {blank} show a figure as text, not as a picture"


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


def test_a_changed_output_of_a_deterministic_cell_is_stale() -> None:
    nb = nbformat.read(NOTEBOOKS / "01_tour.ipynb", as_version=4)
    fresh = copy.deepcopy(nb)
    assert _stale_cells(nb, fresh) == []
    listing = next(c for c in fresh.cells if c.cell_type == "code" and "library_schedules()" in c.source)
    listing.outputs[0]["text"] = "1f1b, gpipe\n"
    assert _stale_cells(nb, fresh) == [listing.id]
    listing.metadata["tags"] = [MEASURED]
    nb_tagged = copy.deepcopy(fresh)
    nb_tagged.cells[fresh.cells.index(listing)].outputs[0]["text"] = "something else\n"
    assert _stale_cells(nb_tagged, fresh) == []
