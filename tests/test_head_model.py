import os

import keras
import numpy as np
import pytest
from backends import to_numpy

import keras_softmax_heads as ksh

pytestmark = pytest.mark.multibackend


def _model(vocab=11, dim=5):
    keras.utils.set_random_seed(0)
    backbone = keras.Sequential([keras.Input((6,), dtype="int32"),
                                 keras.layers.Embedding(vocab, dim)])
    return ksh.HeadModel(backbone, ksh.FullSoftmax(vocab))


def _data(n=8, vocab=11):
    x = np.random.default_rng(0).integers(0, vocab, size=(n, 6))
    return x, np.roll(x, -1, axis=1)


def test_evaluate_is_exact_mean_nll_with_sample_weight():
    model = _model()
    model.compile("sgd")
    x, y = _data()
    weights = (np.random.default_rng(1).random(y.shape) > 0.3).astype("float32")
    logs = model.evaluate(x, y, sample_weight=weights, batch_size=8, verbose=0,
                          return_dict=True)
    log_p = model.predict(x, verbose=0)
    ll = np.take_along_axis(log_p, y[..., None], -1)[..., 0]
    expected = -(ll * weights).sum() / weights.sum()
    assert logs["loss"] == pytest.approx(expected, rel=1e-5)
    assert logs["perplexity"] == pytest.approx(np.exp(expected), rel=1e-5)


def test_fit_matches_sequential_with_sparse_crossentropy():
    """HeadModel's training loss for an exact head is the usual token-mean NLL."""
    x, y = _data()
    model = _model()
    model.compile(keras.optimizers.SGD(0.5))
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    keras.utils.set_random_seed(0)
    seq = keras.Sequential([keras.Input((6,), dtype="int32"),
                            keras.layers.Embedding(11, 5), ksh.FullSoftmax(11)])
    seq.compile(keras.optimizers.SGD(0.5),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seq.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), seq.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_compile_metrics_and_loss_argument(tmp_path):
    model = _model()
    model.compile("adam", metrics=["sparse_categorical_accuracy"])
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(logs) == {"loss", "perplexity", "sparse_categorical_accuracy"}
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    model.compile("adam", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="do not pass `loss`"):
        model.fit(x, y, epochs=1, verbose=0)


@pytest.mark.parametrize("make", [
    lambda v: ksh.SampledSoftmax(v, num_sampled=4, seed=0),
    lambda v: ksh.NCE(v, num_sampled=4, sampler="uniform", seed=0),
    lambda v: ksh.SelfNormalizedSoftmax(v, seed=0)])
def test_compiled_metrics_with_a_head_of_its_own_objective(make):
    """Compiled metrics beside a sampling or self-normalised head: `fit`
    trains (the metrics get the exact log-probabilities; it raised the
    head's 'called in training mode' error on TensorFlow and PyTorch) and a
    weighted `Perplexity` in `evaluate` is the exact one."""
    keras.utils.set_random_seed(0)
    backbone = keras.Sequential([keras.Input((6,), dtype="int32"),
                                 keras.layers.Embedding(11, 5)])
    model = ksh.HeadModel(backbone, make(11))
    model.compile("adam", metrics=["sparse_categorical_accuracy"],
                  weighted_metrics=[ksh.Perplexity(name="ppl")])
    x, y = _data()
    weights = (np.random.default_rng(1).random(y.shape) > 0.3).astype("float32")
    model.fit(x, y, sample_weight=weights, epochs=1, verbose=0)
    logs = model.evaluate(x, y, sample_weight=weights, verbose=0, return_dict=True)
    ll = np.take_along_axis(model.predict(x, verbose=0), y[..., None], -1)[..., 0]
    expected = np.exp(-(ll * weights).sum() / weights.sum())
    assert logs["ppl"] == pytest.approx(expected, rel=1e-5)
    assert logs["perplexity"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("make", [
    lambda v: ksh.FullSoftmax(v),
    lambda v: ksh.HierarchicalSoftmax(v, num_clusters=3, counts=np.arange(v, 0, -1)),
    lambda v: ksh.SampledSoftmax(v, num_sampled=4, seed=0)])
def test_compiled_metrics_leave_the_padding_out(make):
    """A masked backbone (`Embedding(mask_zero=True)`): the compiled metrics
    see the mask, as the loss does (a `Perplexity` under `metrics=` counted
    the padding and replaced the model's own `perplexity`; accuracy too)."""
    keras.utils.set_random_seed(0)
    backbone = keras.Sequential([keras.Input((6,), dtype="int32"),
                                 keras.layers.Embedding(11, 5, mask_zero=True)])
    model = ksh.HeadModel(backbone, make(11))
    model.compile("adam", metrics=[ksh.Perplexity(name="ppl"),
                                   ksh.HeadMetric("sparse_categorical_accuracy")])
    x, y = _data()
    x[:, 4:] = 0
    x[0, 1:] = 0
    model.fit(x, y, epochs=1, verbose=0, validation_data=(x, y))
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    log_p = model.predict(x, verbose=0)
    ll = np.take_along_axis(log_p, y[..., None], -1)[..., 0]
    real = x != 0
    expected = np.exp(-ll[real].mean())
    assert logs["loss"] == pytest.approx(-ll[real].mean(), rel=1e-5)
    assert logs["ppl"] == pytest.approx(expected, rel=1e-5)
    assert logs["perplexity"] == pytest.approx(expected, rel=1e-5)
    accuracy = (log_p.argmax(-1) == y)[real].mean()
    assert logs["sparse_categorical_accuracy"] == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.parametrize("head", ["full", "sampled"])
def test_save_after_fit_keeps_optimizer_state(tmp_path, head):
    """A model trained with `fit` (never built explicitly) saves its build
    config: loading restores the weights and the optimizer's state, and
    training goes on exactly as without the save."""
    vocab, x, y = 11, *_data()
    backbone = keras.Sequential([keras.layers.Embedding(vocab, 5)])  # no Input
    if head == "full":
        layer = ksh.FullSoftmax(vocab)
    else:
        layer = ksh.SampledSoftmax(vocab, num_sampled=4, sampler="uniform", seed=3)
    model = ksh.HeadModel(backbone, layer)
    model.compile(keras.optimizers.Adam(0.01))
    model.fit(x, y, epochs=2, batch_size=4, shuffle=False, verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 4
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    # Training continues identically, the sampled head's too: the sampler's
    # generator state is saved and restored with the weights.
    model.fit(x, y, epochs=1, batch_size=4, shuffle=False, verbose=0)
    loaded.fit(x, y, epochs=1, batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6)


@keras.saving.register_keras_serializable(package="test_head_model")
class DropoutBackbone(keras.layers.Layer):
    """A backbone whose config is its constructor arguments only (as
    keras-hub's): its layers are rebuilt, not deserialised, on load."""

    def __init__(self, vocab, dim, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.dim = vocab, dim
        self.token_embedding = keras.layers.Embedding(vocab, dim, name="token_embedding")
        # Seeded: on PyTorch an unseeded Dropout draws from torch's global
        # generator, which no saved model can restore.
        self.dropout = keras.layers.Dropout(0.3, seed=7)

    def build(self, input_shape):
        self.token_embedding.build(input_shape)

    def call(self, x, training=None):
        return self.dropout(self.token_embedding(x), training=training)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.dim)

    def get_config(self):
        return {**super().get_config(), "vocab": self.vocab, "dim": self.dim}


def test_tie_and_dropout_state_survive_save_and_load(tmp_path):
    """A head tied to the embedding of a backbone rebuilt from constructor
    arguments stays tied on load (not a second embedding: Keras used to
    fail with "expected 1 variables, but received 0"), and a further step
    (with dropout) equals the original model's."""
    vocab, x, y = 11, *_data()
    keras.utils.set_random_seed(0)
    backbone = DropoutBackbone(vocab, 5)
    model = ksh.HeadModel(backbone, ksh.SigSoftmax(token_embedding=backbone.token_embedding))
    model.compile(keras.optimizers.Adam(0.01))
    model.fit(x, y, epochs=2, batch_size=4, shuffle=False, verbose=0)
    assert model.get_config()["tied_embedding"] == ["token_embedding"]
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.head.token_embedding is loaded.backbone.token_embedding
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    assert len(loaded.variables) == len(model.variables)
    for a, b in zip(model.variables, loaded.variables):  # seed states included
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b), err_msg=a.path)
    model.fit(x, y, epochs=1, batch_size=4, shuffle=False, verbose=0)
    loaded.fit(x, y, epochs=1, batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6)


def test_tied_head_counts_only_its_own_parameters():
    """`summary()` counts a tied matrix once, in the embedding's row: the
    head's row is its own weights (a tied SigSoftmax: the bias)."""
    vocab, dim = 2000, 64
    embedding = keras.layers.Embedding(vocab, dim)
    backbone = keras.Sequential([keras.Input((6,), dtype="int32"), embedding])
    head = ksh.SigSoftmax(token_embedding=embedding)
    model = ksh.HeadModel(backbone, head)
    model.build((None, 6))
    assert head.count_params() == vocab  # not 130,000
    assert model.count_params() == vocab * dim + vocab  # each weight once
    assert backbone.count_params() + head.count_params() == model.count_params()
    lines = []
    model.summary(print_fn=lambda line, **kwargs: lines.append(line))
    text = "\n".join(lines)
    row = next(line for line in text.splitlines() if "SigSoftmax" in line)
    assert "2,000" in row and "130,000" not in row
    assert "Total params: 130,000" in text
    untied = ksh.SigSoftmax(vocab)
    untied.build((None, dim))
    assert untied.count_params() == dim * vocab + vocab


def test_keras_fit_machinery_steps_per_execution_and_callbacks():
    """HeadModel trains through Keras' own fit loop on every backend:
    `steps_per_execution` gives the same weights as one step per call, and
    callbacks see every batch."""
    x, y = _data(n=16)
    weights = []
    # Keras runs PyTorch one step per call.
    for steps in (1, 1 if keras.backend.backend() == "torch" else 4):
        model = _model()
        model.compile(keras.optimizers.SGD(0.5), steps_per_execution=steps)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ends = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(float(logs["loss"])))
    model = _model()
    model.compile("adam")
    model.fit(x, y, batch_size=4, epochs=1, callbacks=[callback], verbose=0)
    assert len(ends) == 4 and all(np.isfinite(ends))


@pytest.mark.parametrize("kind", ["sequential", "head_model"])
def test_load_model_and_fit_resumes_the_samplers_draws(tmp_path, kind):
    """`fit` 2 epochs, save, `load_model`, `fit` 2 more equals `fit` 4: the
    head's sampler state travels in the `.keras` file in a `Sequential` +
    `HeadLoss` model too (the head saves it; only `HeadModel` did, and a
    loaded `Sequential` drew from the initial seed again)."""
    vocab, length = 30, 6
    x = np.random.default_rng(0).integers(0, vocab, (8, length)).astype("int32")
    y = np.roll(x, -1, 1)

    def make():
        keras.utils.set_random_seed(0)
        head = ksh.SampledSoftmax(vocab, num_sampled=4, seed=7)
        layers = [keras.Input((length,), dtype="int32"), keras.layers.Embedding(vocab, 8)]
        if kind == "sequential":
            model = keras.Sequential(layers + [head])
            model.compile(keras.optimizers.SGD(0.5), loss=ksh.HeadLoss(head))
        else:
            model = ksh.HeadModel(keras.Sequential(layers), head)
            model.compile(keras.optimizers.SGD(0.5))
        return model

    fit = dict(batch_size=8, verbose=0, shuffle=False)
    straight = make()
    losses = straight.fit(x, y, epochs=4, **fit).history["loss"]
    first = make()
    resumed = first.fit(x, y, epochs=2, **fit).history["loss"]
    path = os.path.join(tmp_path, "m.keras")
    first.save(path)
    loaded = keras.models.load_model(path)
    resumed += loaded.fit(x, y, epochs=2, **fit).history["loss"]
    np.testing.assert_allclose(resumed, losses, rtol=1e-6)
    for a, b in zip(loaded.get_weights(), straight.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
