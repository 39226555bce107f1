"""A `.keras` file saved on one Keras backend loads on the others.

Every public head, in a `HeadModel` over a small backbone, its trainable
weights moved off their initial values, is saved on this process' backend
(TensorFlow in the default run);
a subprocess per other backend (JAX, PyTorch) loads each file and must
predict the same log-probabilities and evaluate to the same exact loss.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_softmax_heads as ksh

VOCAB, DIM = 17, 8
COUNTS = [int(c) for c in 1000 // np.arange(1, VOCAB + 1)]


def _heads():
    return {
        "full": ksh.FullSoftmax(VOCAB),
        "sigsoftmax": ksh.SigSoftmax(VOCAB),
        "plif": ksh.PLIFSoftmax(VOCAB, num_knots=20),
        "monotonic": ksh.MonotonicSoftmax(VOCAB),
        "mos": ksh.MixtureOfSoftmaxes(VOCAB, num_components=3),
        "moc": ksh.MixtureOfContexts(VOCAB, num_components=3),
        "sampled": ksh.SampledSoftmax(VOCAB, num_sampled=5, counts=COUNTS),
        "nce": ksh.NCE(VOCAB, num_sampled=5, counts=COUNTS),
        "self_normalized": ksh.SelfNormalizedSoftmax(VOCAB),
        "hsm": ksh.HierarchicalSoftmax(VOCAB, num_clusters=4, counts=COUNTS),
        "dsm": ksh.DifferentiatedSoftmax(VOCAB, bands=[(5, 5), (12, 3)], counts=COUNTS),
    }


LOADER = r"""
import json, os, sys
import numpy as np, keras
import keras_softmax_heads  # registers the classes
directory = sys.argv[1]
data = np.load(os.path.join(directory, "data.npz"))
out = {}
for name in json.loads(open(os.path.join(directory, "names.json")).read()):
    model = keras.saving.load_model(os.path.join(directory, name + ".keras"))
    log_p = keras.ops.convert_to_numpy(model.predict(data["x"], verbose=0))
    logs = model.evaluate(data["x"], data["y"], verbose=0, return_dict=True)
    out[name] = {
        "max_abs_diff": float(np.max(np.abs(log_p - data[name]))),
        "loss": float(logs["loss"]),
    }
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cross_backend")
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(8, 5)).astype("int32")
    y = np.roll(x, -1, axis=1)
    arrays, losses = {"x": x, "y": y}, {}
    for name, head in _heads().items():
        keras.utils.set_random_seed(0)
        backbone = keras.Sequential(
            [keras.Input((5,), dtype="int32"), keras.layers.Embedding(VOCAB, DIM)]
        )
        model = ksh.HeadModel(backbone, head)
        model.compile(optimizer="adam")
        model.build(x.shape)
        # Weights off their initial values without a fit (a training step's
        # trace and compilation, 3 s a head here, test nothing this file
        # checks); the loader ignores the optimizer.
        for variable in model.trainable_variables:
            value = keras.ops.convert_to_numpy(variable)
            variable.assign(value + rng.normal(scale=0.05, size=value.shape).astype(value.dtype))
        model.save(str(directory / f"{name}.keras"))
        arrays[name] = keras.ops.convert_to_numpy(model.predict(x, verbose=0))
        losses[name] = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    np.savez(directory / "data.npz", **arrays)
    (directory / "names.json").write_text(json.dumps(sorted(losses)))
    return directory, losses


def _other_backends():
    return [b for b in ("tensorflow", "jax", "torch") if b != keras.backend.backend()]


# JAX under `-m slow` (30 s: its own process and compilation); the default run
# keeps PyTorch here, and tests/test_serialization.py loads TensorFlow-written
# files on JAX in the JAX run.
@pytest.mark.parametrize(
    "backend",
    [pytest.param(b, marks=pytest.mark.slow) if b == "jax" else b for b in _other_backends()],
)
def test_keras_file_loads_on_another_backend(saved, backend):
    pytest.importorskip({"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[backend])
    directory, losses = saved
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", LOADER, str(directory)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    results = json.loads(line[len("RESULT"):])
    assert sorted(results) == sorted(losses)
    for name, result in results.items():
        assert result["max_abs_diff"] < 1e-4, (name, result)
        assert result["loss"] == pytest.approx(losses[name], rel=1e-4), name
