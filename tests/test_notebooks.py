"""Executes the Colab notebooks end to end (their `QUICK = True` settings).

The kernel is this test's own interpreter: a kernel spec written to a
temporary directory runs `sys.executable -m ipykernel_launcher`, so the
notebooks import the package under test whatever kernels the machine has
installed. A cell prepended at run time checks that.
"""

import importlib.util
import json
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "examples" / "notebooks"
KERNEL_NAME = "ksh-test-python"


def _require(*modules):
    """Skips while a head the notebook imports has not landed yet."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"notebook needs {missing}, not in this checkout")


def _kernel_manager(tmp_path):
    kernel_dir = tmp_path / "kernels" / KERNEL_NAME
    kernel_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "keras-softmax-heads tests",
        "language": "python",
        "env": {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"},
    }
    (kernel_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)


def _execute(name, tmp_path, timeout=300):
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    # Stored clean: no outputs, no execution counts.
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{name}: store notebooks without outputs"
            )
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "QUICK = True" in source, f"{name}: needs a `QUICK = True` parameter"
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(tmp_path),
        timeout=timeout,
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    executable = "".join(o.get("text", "") for o in nb.cells[0].outputs).strip()
    assert os.path.realpath(executable) == os.path.realpath(sys.executable)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    return nb, workdir


def _text(nb):
    return "\n".join(
        o.get("text", "") if o.output_type == "stream"
        else o.get("data", {}).get("text/plain", "")
        for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )


def test_quickstart_notebook(tmp_path):
    _require("keras_softmax_heads.heads.plif_softmax")
    nb, _ = _execute("quickstart.ipynb", tmp_path)
    text = _text(nb)
    assert "perplexity floor" in text and "reloaded test perplexity" in text


@pytest.mark.slow  # its parts are covered by test_synthetic_bottleneck / test_rank
def test_softmax_bottleneck_notebook(tmp_path):
    _require(
        "keras_softmax_heads.heads.plif_softmax",
        "keras_softmax_heads.heads.sig_softmax",
        "keras_softmax_heads.heads.monotonic_softmax",
        "keras_softmax_heads.heads.mixture_of_softmaxes",
    )
    nb, workdir = _execute("softmax_bottleneck.ipynb", tmp_path)
    text = _text(nb)
    assert "Linear-Softmax" in text and "rank" in text
    run = workdir / "synthetic_bottleneck_run"
    assert (run / "synthetic_bottleneck.csv").is_file()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the rank bar plot and the two experiment figures
