"""The notebooks run top to bottom in a fresh kernel of this interpreter, and are committed clean.

Each notebook runs in its own kernel, started from a kernelspec written to a temporary
directory that points at ``sys.executable``, so the kernel is this test venv's Python
whatever other "python3" kernels the machine has. The tests' small-steps parameters are
injected in a cell after the notebook's ``parameters`` cell (as papermill does), and the
kernel's working directory is a temporary directory. The kernel shows every
``DeprecationWarning`` (``-W default::DeprecationWarning``, not only those raised in the
notebook's own code), and a run fails on any it shows: the notebooks teach the current API.

Every notebook starts with the same setup code cell (8 simulated CPU devices, before JAX
starts) and shows at least one picture.
"""

import json
import os
import re
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"01_strategy_to_mesh.ipynb", "02_two_stage_exchange.ipynb", "03_train_moe.ipynb",
            "04_parallelism.ipynb", "05_plan.ipynb", "06_your_model.ipynb"}
# Small values for CI: the whole suite has a 10-minute budget on 2 cores.
PARAMETERS = {"03_train_moe.ipynb": {"STEPS": 20, "SMALL_MODEL": True},
              "04_parallelism.ipynb": {"STEPS": 4},
              "06_your_model.ipynb": {"STEPS": 8}}
KERNEL_NAME = "meshkit-test-venv"
CELL_TIMEOUT_S = 240
SETUP_CALL = "simulate_cpu_devices(8)"  # in every notebook's first code cell


def _dirty_cells(nb: nbformat.NotebookNode) -> list[int]:
    """Indices of code cells that carry outputs or an execution count."""
    return [
        i for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count"))
    ]


def _first_code_cell(nb: nbformat.NotebookNode) -> str:
    """The source of the notebook's first code cell ("" if it has none)."""
    return next((c.source for c in nb.cells if c.cell_type == "code"), "")


def _images(nb: nbformat.NotebookNode) -> int:
    """How many ``image/png`` outputs the code cells hold."""
    return sum("image/png" in out.get("data", {})
               for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)


def _deprecations(nb: nbformat.NotebookNode) -> list[str]:
    """The lines of the outputs that name a ``DeprecationWarning``, with their cell."""
    return [
        f"cell {i}: {line.strip()}"
        for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
        for out in cell.outputs if out.get("output_type") == "stream"
        for line in out.get("text", "").splitlines() if "DeprecationWarning" in line
    ]


def _parameters_cell(nb: nbformat.NotebookNode) -> int:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    if len(tagged) != 1:
        raise ValueError(f"expected one cell tagged 'parameters', found {len(tagged)}")
    return tagged[0]


def _inject(nb: nbformat.NotebookNode, params: dict) -> None:
    """Insert ``NAME = value`` lines after the parameters cell, as papermill does."""
    if not params:
        return
    at = _parameters_cell(nb)
    source = nb.cells[at].source
    unknown = [k for k in params if not re.search(rf"^{k}\s*=", source, re.MULTILINE)]
    if unknown:
        raise ValueError(f"parameters {unknown} are not assigned in the parameters cell")
    cell = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items()))
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(at + 1, cell)


def _snapshot() -> set[str]:
    """Files in the repository's top level and notebooks/, to catch stray outputs."""
    top = {p.name for p in ROOT.iterdir()}
    return top | {f"notebooks/{p.name}" for p in NOTEBOOK_DIR.iterdir()}


def _execute(nb: nbformat.NotebookNode, kernel_name: str, cwd: Path) -> None:
    """Run every cell in a fresh kernel; raise CellExecutionError (cell + traceback) on error."""
    client = nbclient.NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        resources={"metadata": {"path": str(cwd)}},  # the kernel's working directory
    )
    client.execute()


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec running this interpreter, found through JUPYTER_PATH."""
    data_dir = tmp_path_factory.mktemp("jupyter")
    spec_dir = data_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    spec = {
        "argv": [sys.executable, "-W", "default::DeprecationWarning", "-m", "ipykernel_launcher",
                 "-f", "{connection_file}"],
        "display_name": "meshkit tests",
        "language": "python",
        "env": {"PYTHONPATH": pythonpath},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(
            p for p in (str(data_dir), os.environ.get("JUPYTER_PATH")) if p))
        yield KERNEL_NAME


def test_the_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = _dirty_cells(nb)
    assert not dirty, (
        f"{path.name}: code cells {dirty} have outputs or execution counts; clear them "
        "(e.g. jupyter nbconvert --clear-output --inplace) before committing"
    )
    assert SETUP_CALL in _first_code_cell(nb), (
        f"{path.name}: the first code cell must set the simulated devices ({SETUP_CALL})"
    )
    _parameters_cell(nb)


def test_the_first_code_cells_are_identical():
    first = {p.name: _first_code_cell(nbformat.read(p, as_version=4)) for p in NOTEBOOKS}
    assert len(set(first.values())) == 1, f"the notebooks' first code cells differ: {first}"


def test_the_checks_fire():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("y = 2")])
    assert _dirty_cells(nb) == []
    nb.cells[1].execution_count = 3
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="1")]
    assert _dirty_cells(nb) == [0, 1]
    with pytest.raises(ValueError, match="one cell tagged 'parameters', found 0"):
        _inject(nb, {"STEPS": 2})
    nb.cells[0].metadata["tags"] = ["parameters"]
    with pytest.raises(ValueError, match=r"\['STEPS'\] are not assigned"):
        _inject(nb, {"STEPS": 2})
    nb.cells[0].source = "STEPS = 300"
    _inject(nb, {"STEPS": 2})
    assert nb.cells[1].source == "STEPS = 2"
    assert _first_code_cell(nb) == "STEPS = 300"
    assert _first_code_cell(nbformat.v4.new_notebook()) == ""
    assert _images(nb) == 0 and _deprecations(nb) == []
    nb.cells[1].outputs = [
        nbformat.v4.new_output("display_data", data={"image/png": "", "text/plain": "<Figure>"}),
        nbformat.v4.new_output("stream", name="stderr", text="x.py:3: DeprecationWarning: old\n"
                                                               "  old()\n")]
    assert _images(nb) == 1
    assert _deprecations(nb) == ["cell 1: x.py:3: DeprecationWarning: old"]


def test_an_error_in_a_cell_fails_the_run(kernel_name, tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("STEPS = 300"),
        nbformat.v4.new_code_cell("assert STEPS == 2, STEPS"),
        nbformat.v4.new_code_cell("raise RuntimeError('boom')"),
    ])
    nb.cells[0].metadata["tags"] = ["parameters"]
    _inject(nb, {"STEPS": 2})
    with pytest.raises(nbclient.exceptions.CellExecutionError) as error:
        _execute(nb, kernel_name, tmp_path)
    assert (error.value.ename, error.value.evalue) == ("RuntimeError", "boom")
    assert [c.execution_count for c in nb.cells] == [1, 2, 3, 4]


def test_the_kernel_shows_every_deprecation_warning(kernel_name, tmp_path):
    library = 'import warnings\nwarnings.warn("old", DeprecationWarning)'
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import meshkit\nmeshkit.preset"),  # a moved name
        # raised in a library's module, which Python's default filters would hide
        nbformat.v4.new_code_cell(f"exec({library!r}, {{'__name__': 'somelib'}})"),
    ])
    _execute(nb, kernel_name, tmp_path)
    found = _deprecations(nb)
    assert len(found) == 2, found
    assert "meshkit.preset moved to meshkit.exchange.cost.preset" in found[0], found
    assert found[1].startswith("cell 1:") and "DeprecationWarning: old" in found[1], found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_name, tmp_path, record_property):
    nb = nbformat.read(path, as_version=4)
    params = dict(PARAMETERS.get(path.name, {}))
    if re.search(r"^WORKDIR\s*=", nb.cells[_parameters_cell(nb)].source, re.MULTILINE):
        params["WORKDIR"] = str(tmp_path / "workdir")  # cleaned up by pytest
    _inject(nb, params)
    # A last cell that reports which Python the kernel runs.
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable, end='')"))
    before = _snapshot()
    start = time.perf_counter()
    _execute(nb, kernel_name, tmp_path)
    seconds = time.perf_counter() - start
    record_property("seconds", round(seconds, 1))
    print(f"{path.name}: {seconds:.1f} s")
    assert all(c.execution_count for c in nb.cells if c.cell_type == "code")
    assert nb.cells[-1].outputs[0]["text"] == sys.executable, "the kernel runs another Python"
    assert _snapshot() == before, f"{path.name} left files in the repository"
    assert not _deprecations(nb), f"{path.name} uses deprecated API: {_deprecations(nb)}"
    assert _images(nb) >= 1, f"{path.name} shows no picture (no image/png output)"
