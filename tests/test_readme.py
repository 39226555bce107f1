"""The README's Python examples run as written (small data)."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_first_screen_example_trains_the_heads_objective():
    code = _python_blocks()[0]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    model, head, ksh = namespace["model"], namespace["head"], namespace["ksh"]
    assert isinstance(head, ksh.SampledSoftmax)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10_000, (4, 8))
    y = np.roll(x, -1, axis=1)
    history = model.fit(x, y, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    assert np.isclose(logs["perplexity"], np.exp(logs["loss"]), rtol=1e-5)


def test_ci_runs_the_readme_test_command_on_every_backend():
    """`.ci/run` runs exactly the README's second set-up command, and that
    command exercises TensorFlow, JAX and PyTorch."""
    bash = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1)
    command = [l for l in bash.splitlines() if "pytest" in l][0].strip()
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert command in [l.strip() for l in ci]
    for backend in ("jax", "torch"):
        assert f"KERAS_BACKEND={backend} python -m pytest" in command
    assert ".[test,jax,torch]" in command
