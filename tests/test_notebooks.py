"""The Colab notebooks: stored with their outputs, and executable end to end.

The notebooks read `KSH_NOTEBOOK_QUICK`: `1` shrinks them to a smoke run of
their code (the default suite executes both that way); unset, they run the
settings whose outputs are stored in the repository (`pytest -m slow`
re-executes those and checks what their text claims).

The kernel is this test's own interpreter: a kernel spec written to a
temporary directory runs `sys.executable -m ipykernel_launcher` with this
checkout first on `PYTHONPATH`, so the notebooks import the package under
test whatever kernels or installs the machine has. A cell prepended at run
time checks that.
"""

import importlib.util
import json
import os
import pathlib
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "examples" / "notebooks"
KERNEL_NAME = "ksh-test-python"
QUICKSTART = "quickstart.ipynb"
BOTTLENECK = "softmax_bottleneck.ipynb"
NAMES = (QUICKSTART, BOTTLENECK)


def _require(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {missing}")


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _text(nb):
    return "\n".join(
        o.get("text", "") if o.output_type == "stream"
        else o.get("data", {}).get("text/plain", "")
        for c in _code_cells(nb) for o in c.outputs
    )


def _images(nb):
    return [o for c in _code_cells(nb) for o in c.outputs if "image/png" in o.get("data", {})]


def _errors(nb):
    return [o for c in _code_cells(nb) for o in c.outputs if o.output_type == "error"]


MIN_IMAGES = {QUICKSTART: 1, BOTTLENECK: 3}  # loss curves; rank bars + the two figures


@pytest.mark.parametrize("name", NAMES)
def test_stored_notebook_has_full_outputs(name):
    """Committed executed top to bottom, with the full (not quick) settings."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    cells = _code_cells(nb)
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1)), (
        f"{name}: store it executed once, top to bottom"
    )
    assert not _errors(nb)
    assert "QUICK = False" in _text(nb), f"{name}: stored outputs must be the full settings"
    assert len(_images(nb)) >= MIN_IMAGES[name]
    # Every install the notebook needs is the one its setup cell names.
    setup = cells[0].source
    assert "[notebooks]" in setup and "<org>" not in setup
    assert "missing modules: none" in "".join(o.get("text", "") for o in cells[0].outputs)
    assert "__" not in "".join(c.source for c in nb.cells if c.cell_type == "markdown").replace(
        "__init__", ""), f"{name}: unfilled placeholder in a text cell"


def _kernel_manager(tmp_path, quick):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    kernel_dir = tmp_path / "kernels" / KERNEL_NAME
    kernel_dir.mkdir(parents=True)
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "keras-softmax-heads tests",
        "language": "python",
        "env": {
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "KERAS_BACKEND": "tensorflow",
            "PYTHONPATH": pythonpath,
            "KSH_NOTEBOOK_QUICK": "1" if quick else "0",
        },
    }
    (kernel_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)


def _execute(name, tmp_path, quick, timeout):
    nbclient = pytest.importorskip("nbclient")
    _require("ipykernel", "matplotlib")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in _code_cells(nb):
        cell.outputs, cell.execution_count = [], None
    nb.cells.insert(0, nbformat.v4.new_code_cell(
        "import sys, keras_softmax_heads; print(sys.executable); print(keras_softmax_heads.__file__)"))
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    km = _kernel_manager(tmp_path, quick)
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=timeout,
        resources={"metadata": {"path": str(workdir)}},
    )
    try:
        client.execute()  # raises CellExecutionError on the first failing cell
    finally:
        # nbclient shuts down only a kernel manager it made itself; this
        # kernel (about 1 GB resident) would otherwise live as long as pytest.
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    executable, package = "".join(o.get("text", "") for o in nb.cells[0].outputs).split()
    assert os.path.realpath(executable) == os.path.realpath(sys.executable)
    assert pathlib.Path(package).resolve().is_relative_to(REPO)
    assert not _errors(nb)
    assert all(c.execution_count for c in _code_cells(nb))
    assert len(_images(nb)) >= MIN_IMAGES[name]
    assert f"QUICK = {bool(quick)}" in _text(nb)
    return nb, workdir


def _check_quickstart(nb):
    text = _text(nb)
    assert "perplexity floor" in text and "reloaded test perplexity" in text
    assert "KL to the true model" in text


def _check_bottleneck(nb, workdir):
    text = _text(nb)
    assert "Linear-Softmax" in text and "rank" in text
    assert (workdir / "synthetic_bottleneck_run" / "synthetic_bottleneck.csv").is_file()


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path):
    nb, _ = _execute(QUICKSTART, tmp_path, quick=True, timeout=300)
    _check_quickstart(nb)


@pytest.mark.slow
def test_softmax_bottleneck_notebook_runs(tmp_path):
    nb, workdir = _execute(BOTTLENECK, tmp_path, quick=True, timeout=300)
    _check_bottleneck(nb, workdir)


def _test_losses(nb):
    """`{head: test loss}` from the quickstart's result table."""
    rows = re.findall(r"^(\S+(?: \(reference\))?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+)$",
                      _text(nb), flags=re.MULTILINE)
    return {head: float(loss) for head, _, loss, _, _ in rows}


@pytest.mark.slow
def test_quickstart_notebook_full(tmp_path):
    """The stored settings: what the text cells claim holds on a fresh run."""
    nb, _ = _execute(QUICKSTART, tmp_path, quick=False, timeout=1200)
    _check_quickstart(nb)
    losses = _test_losses(nb)
    bottlenecked = losses["FullSoftmax"]
    assert losses["PLIFSoftmax"] < bottlenecked - 0.03
    assert losses["MixtureOfSoftmaxes"] < bottlenecked - 0.03
    # A larger d gets much closer to the floor than either head at d = 8.
    assert losses["FullSoftmax (reference)"] < min(
        losses["PLIFSoftmax"], losses["MixtureOfSoftmaxes"]) - 0.1


@pytest.mark.slow
def test_softmax_bottleneck_notebook_full(tmp_path):
    from keras_softmax_heads.experiments import synthetic

    nb, workdir = _execute(BOTTLENECK, tmp_path, quick=False, timeout=1200)
    _check_bottleneck(nb, workdir)
    rows = synthetic.read_csv(workdir / "synthetic_bottleneck_run" / synthetic.CSV_NAME)
    kl = {(r["model"], r["D"], r["M"]): r["KL"] for r in rows}
    for dim in (2, 4, 8, 16, 32):  # D < M - 1: the bottleneck bites Linear-Softmax
        for model in ("mos", "lms", "plif"):
            assert kl[(model, dim, 100)] < kl[("softmax", dim, 100)], (model, dim)
