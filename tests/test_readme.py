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
