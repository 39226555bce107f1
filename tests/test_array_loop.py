"""`train_and_evaluate_arrays`: the LSTM run fed from NumPy arrays, without
TensorFlow (the GPU machines' loop), and `run_study(loop="arrays")`."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from multibackend import slow_on

from keras_softmax_heads import data as ksh_data
from keras_softmax_heads import training
from keras_softmax_heads.training import studies

pytestmark = pytest.mark.multibackend

TINY = dict(
    dataset_options=dict(vocab_size=40, num_train_tokens=3000, num_valid_tokens=400,
                         num_test_tokens=401),
    embedding_dim=8, hidden_size=8, num_layers=1, batch_size=4, bptt=6, epochs=2,
    steps_per_epoch=3, verbose=0, num_diagnostic_contexts=50, tensorboard=False,
)


def _jit():
    # Compiling the study preset's LSTM costs more than these few steps,
    # except on JAX (whose non-jitted fit runs op by op).
    return keras.backend.backend() == "jax"


def test_stream_windows_are_the_stream_dataset_batches():
    ids = np.arange(1003)
    x, y = ksh_data.stream_windows(ids, batch_size=7, bptt=9)
    assert x.shape == y.shape == (ksh_data.num_stream_windows(1003, 7, 9), 7, 9)
    streams = ksh_data.batchify(ids, 7)
    np.testing.assert_array_equal(x[3], streams[:, 27:36])
    np.testing.assert_array_equal(y[3], streams[:, 28:37])
    with pytest.raises(ValueError, match="bptt=200"):
        ksh_data.stream_windows(np.arange(100), batch_size=2, bptt=200)
    if keras.backend.backend() == "tensorflow":
        ds = list(ksh_data.make_stream_dataset(ids, 7, 9).as_numpy_iterator())
        np.testing.assert_array_equal(np.stack([a for a, _ in ds]), x)
        np.testing.assert_array_equal(np.stack([b for _, b in ds]), y)


# On TensorFlow (15 s) under `-m slow`: there test_arrays_loop_is_the_tf_data_run
# runs the loop, and the JAX and PyTorch runs check its resume.
@slow_on("tensorflow")
def test_arrays_loop_trains_evaluates_and_resumes(tmp_path):
    """`run_study(loop="arrays")` trains a row; more epochs resume it."""
    out = tmp_path / "study.json"
    summary = studies.run_study("bottleneck_ptb", None, str(tmp_path / "runs"), str(out),
                                rows=["softmax"], dataset="synthetic", loop="arrays",
                                **dict(TINY, epochs=1, jit_compile=_jit()))
    (row,) = summary["rows"]
    assert row["loop"] == "arrays" and row["epochs"] == 1
    assert json.loads(out.read_text())["rows"][0]["test_perplexity"] == row["test_perplexity"]
    with pytest.raises(ValueError, match="loop='grid'"):
        studies.run_study("bottleneck_ptb", None, str(tmp_path), str(out), loop="grid")

    workdir = str(tmp_path / "runs" / "softmax")
    config = studies.study_config("bottleneck_ptb", "softmax", dataset="synthetic",
                                  **dict(TINY, jit_compile=_jit()))
    first = training.train_and_evaluate_arrays(config.replace(epochs=1), workdir)
    assert first["already_finished"] and first["test"]["perplexity"] == row["test_perplexity"]
    # More epochs resume from the saved epoch (not from scratch).
    results = training.train_and_evaluate_arrays(config, workdir)
    assert [e["epoch"] for e in results["history"]] == [1, 2]
    assert results["history"][0] == first["history"][0]
    assert results["history"][1]["train_loss"] < results["history"][0]["train_loss"]
    assert results["test"]["perplexity"] < 40  # below uniform
    assert results["diagnostics"]["empirical_rank"]["num_contexts"] == 50
    assert results["model"]["backend"] == keras.backend.backend()
    again = training.train_and_evaluate_arrays(config, workdir)
    assert again["already_finished"] and again["test"] == results["test"]
    with pytest.raises(ValueError, match="other settings"):
        training.train_and_evaluate_arrays(config.replace(hidden_size=12), workdir)
    for bad, name in ((dict(model="ngram"), "model"), (dict(train_seconds=5.0), "train_seconds")):
        with pytest.raises(ValueError, match=f"Received: {name}="):
            training.train_and_evaluate_arrays(config.replace(**bad), str(tmp_path / "x"))


def test_arrays_loop_refuses_a_0_3_mixture_run_naming_the_option(tmp_path):
    """A workdir whose `state.json` was saved without a version (0.3.0 and
    before) by a mixture run, whose latent bias was then the default: today's
    default options are refused, naming the option that resumes it."""
    config = training.get_config(**TINY, head="mos", head_options={"num_components": 2})
    (tmp_path / "state.json").write_text(json.dumps({"config": config.to_dict(), "history": []}))
    with pytest.raises(ValueError,
                       match=r"other settings.*add use_latent_bias=true,use_prior_bias=true"):
        training.train_and_evaluate_arrays(config, str(tmp_path))


def test_arrays_loop_is_the_tf_data_run(tmp_path):
    """Same batches, weights and evaluation: the same numbers as `train_and_evaluate`."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("train_and_evaluate's tf.data input: compared on TensorFlow")
    config = training.get_config("zaremba_small", **TINY)
    a = training.train_and_evaluate(config, str(tmp_path / "tf"))
    b = training.train_and_evaluate_arrays(config, str(tmp_path / "arrays"))
    for split in ("valid", "test"):
        assert b[split]["perplexity"] == pytest.approx(a[split]["perplexity"], rel=1e-6)
    np.testing.assert_allclose([e["train_loss"] for e in b["history"]],
                               [e["train_loss"] for e in a["history"]], rtol=1e-6)
    assert (b["diagnostics"]["empirical_rank"]["rank"]
            == a["diagnostics"]["empirical_rank"]["rank"])


def test_the_arrays_loop_imports_no_tensorflow():
    # A JAX subprocess whatever this run's backend: checked once, in the JAX run.
    if keras.backend.backend() != "jax":
        pytest.skip("a JAX subprocess: checked in the JAX run")
    code = (
        "import sys; sys.modules['tensorflow'] = None\n"
        "from keras_softmax_heads.training import studies, train_and_evaluate_arrays\n"
        "from keras_softmax_heads import data\n"
        "print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        env={**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
