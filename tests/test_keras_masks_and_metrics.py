"""The heads' losses and metrics in Keras' `fit` / `evaluate` as Keras' own:
the Keras mask of the model's output (`Embedding(mask_zero=True)`), word
ids out of range, and Keras metrics beside `HeadLoss`.

Every expected value is recomputed with NumPy from `predict`'s
log-probabilities (or the dense logits of the same weights)."""

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import to_numpy

import keras_softmax_heads as ksh

pytestmark = pytest.mark.multibackend

V, T, D = 30, 6, 8


def padded_tokens(seed=0):
    """`(x, y)` `[8, T]` whose last two positions (x = 0) are padding, and
    the `[8, T]` 0 / 1 mask of the real tokens."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, V, size=(8, T)).astype("int32")
    x[:, -2:] = 0
    y = np.roll(x, -1, axis=1)
    y[:, -2:] = 0
    return x, y, (x != 0).astype("float32")


def masked_mean_nll(log_p, y, mask):
    nll = -np.take_along_axis(log_p, y[..., None], axis=-1)[..., 0]
    return float((nll * mask).sum() / mask.sum())


@pytest.mark.parametrize("with_head_loss", [True, False])
def test_perplexity_and_loss_honour_the_keras_mask(with_head_loss):
    """With `mask_zero`, `evaluate`'s loss and `Perplexity` average over the
    real tokens only (Keras' own cross-entropy metric agrees), with and
    without `HeadLoss`."""
    keras.utils.set_random_seed(0)
    x, y, mask = padded_tokens()
    head = ksh.HierarchicalSoftmax(V) if with_head_loss else ksh.FullSoftmax(V)
    model = keras.Sequential([keras.Input((T,), dtype="int32"),
                              keras.layers.Embedding(V, D, mask_zero=True), head])
    loss = (ksh.HeadLoss(head) if with_head_loss
            else keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.compile("adam", loss=loss, metrics=[ksh.Perplexity()])
    model.fit(x, y, epochs=1, verbose=0)
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    expected = masked_mean_nll(to_numpy(model.predict(x, verbose=0)), y, mask)
    np.testing.assert_allclose(logs["loss"], expected, rtol=1e-5)
    np.testing.assert_allclose(logs["perplexity"], np.exp(expected), rtol=1e-5)
    # With a per-sequence sample weight too: mask x weight.
    sw = np.linspace(0.5, 2.0, 8).astype("float32")
    metric = ksh.Perplexity()
    metric.update_state(y, model(x), sample_weight=sw)
    log_p = to_numpy(model.predict(x, verbose=0))
    nll = -np.take_along_axis(log_p, y[..., None], axis=-1)[..., 0]
    weight = mask * sw[:, None]
    np.testing.assert_allclose(to_numpy(metric.result()),
                               np.exp((nll * weight).sum() / weight.sum()), rtol=1e-5)


def test_out_of_range_targets_never_give_a_plausible_number():
    """`HeadLoss` in evaluation and `Perplexity` check the word ids as the
    heads do: eagerly a `ValueError` that names the id; compiled (XLA) a
    NaN or an error, never a number."""
    head = ksh.HierarchicalSoftmax(V)
    loss = ksh.HeadLoss(head)
    log_p = keras.ops.log_softmax(keras.random.normal((2, 3, V), seed=0))
    for bad in (V, -1):
        y = np.array([[1, 2, 3], [4, bad, 5]], "int32")
        with pytest.raises(ValueError, match=rf"vocab_size={V}.*targets\[1, 1\]={bad}"):
            loss(y, log_p)
        with pytest.raises(ValueError, match=rf"targets\[1, 1\]={bad}"):
            ksh.Perplexity().update_state(y, log_p)
    if BACKEND == "torch":  # compiled evaluation: TensorFlow's XLA, jax.jit
        return
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((T,), dtype="int32"),
                              keras.layers.Embedding(V, D), head])
    model.compile("sgd", loss=loss, metrics=[ksh.Perplexity()], jit_compile=True)
    x, y, _ = padded_tokens()
    for bad in (V, -1):
        y_bad = y.copy()
        y_bad[3, 2] = bad
        try:
            logs = model.evaluate(x, y_bad, verbose=0, return_dict=True)
        except Exception:  # noqa: BLE001 (an error is an acceptable answer)
            continue
        assert np.isnan(logs["loss"]) and np.isnan(logs["perplexity"]), logs


def test_head_metric_wraps_keras_metrics_beside_head_loss(tmp_path):
    """`HeadMetric("accuracy")` and a top-k metric beside `HeadLoss`: `fit`
    runs (a plain Keras metric would see the context vectors), their
    training value is NaN, their evaluation value is the metric of the
    exact log-probabilities, masks included; the compiled model saves and
    loads, and the wrapper's config round-trips."""
    keras.utils.set_random_seed(0)
    x, y, mask = padded_tokens()
    head = ksh.SampledSoftmax(V, num_sampled=8)
    model = keras.Sequential([keras.Input((T,), dtype="int32"),
                              keras.layers.Embedding(V, D, mask_zero=True), head])
    top3 = keras.metrics.SparseTopKCategoricalAccuracy(k=3, name="top3")
    model.compile("adam", loss=ksh.HeadLoss(head),
                  metrics=[ksh.Perplexity(), ksh.HeadMetric("accuracy"), ksh.HeadMetric(top3)])
    history = model.fit(x, y, epochs=2, verbose=0, validation_data=(x, y)).history
    assert np.isnan(history["accuracy"]).all() and np.isnan(history["top3"]).all()
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    log_p = to_numpy(model.predict(x, verbose=0))
    hits = (log_p.argmax(-1) == y).astype("float32")
    np.testing.assert_allclose(logs["accuracy"], (hits * mask).sum() / mask.sum(), rtol=1e-6)
    in_top3 = (np.argsort(-log_p, axis=-1)[..., :3] == y[..., None]).any(-1)
    np.testing.assert_allclose(logs["top3"], (in_top3 * mask).sum() / mask.sum(), rtol=1e-6)
    np.testing.assert_allclose(history["val_accuracy"][-1], logs["accuracy"], rtol=1e-6)

    metric = ksh.HeadMetric(top3, name="t3")
    restored = ksh.HeadMetric.from_config(metric.get_config())
    assert restored.name == "t3" and restored.metric.get_config() == top3.get_config()
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    again = loaded.evaluate(x, y, verbose=0, return_dict=True)
    np.testing.assert_allclose(again["accuracy"], logs["accuracy"], rtol=1e-6)
    with pytest.raises(ValueError, match="metric=42"):
        ksh.HeadMetric(42)


def test_linear_cross_entropy_honours_the_keras_mask():
    """A model of hidden states whose `Embedding(mask_zero=True)` mask
    reaches the output trains and evaluates on the real tokens only, as
    `Dense` + `SparseCategoricalCrossentropy` on the same weights; a
    per-sequence `sample_weight` multiplies the mask."""
    keras.utils.set_random_seed(0)
    x, y, mask = padded_tokens()
    emb = keras.layers.Embedding(V, D, mask_zero=True)
    model = keras.Sequential([keras.Input((T,), dtype="int32"), emb,
                              keras.layers.Dense(D)])
    loss = ksh.LinearCrossEntropy(emb, chunk_size=7)
    model.compile("sgd", loss=loss)
    hidden = to_numpy(model.predict(x, verbose=0))
    logits = hidden @ to_numpy(emb.embeddings).T
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0),
                               masked_mean_nll(log_p, y, mask), rtol=1e-5)
    sw = np.linspace(0.5, 2.0, 8).astype("float32")
    nll = -np.take_along_axis(log_p, y[..., None], axis=-1)[..., 0]
    weight = mask * sw[:, None]
    np.testing.assert_allclose(to_numpy(loss(y, model(x), sample_weight=sw)),
                               (nll * weight).sum() / weight.sum(), rtol=1e-5)


@pytest.mark.parametrize("name", ["full", "nce"])
def test_head_model_honours_the_backbone_mask(name):
    """`HeadModel` weighs the tokens by its backbone's Keras mask, as
    `sample_weight=mask` does: evaluation is the masked mean NLL; a
    training step moves the weights as with the mask given as weights."""
    x, y, mask = padded_tokens()
    outcomes = []
    for masked in (True, False):
        keras.utils.set_random_seed(0)
        backbone = keras.Sequential([keras.Input((T,), dtype="int32"),
                                     keras.layers.Embedding(V, D, mask_zero=masked)])
        head = ksh.FullSoftmax(V) if name == "full" else ksh.NCE(V, num_sampled=8, counts=np.arange(1, V + 1), seed=1)
        model = ksh.HeadModel(backbone, head)
        model.compile(keras.optimizers.SGD(0.5))
        sw = None if masked else mask
        logs = model.evaluate(x, y, sample_weight=sw, verbose=0, return_dict=True)
        if masked:
            expected = masked_mean_nll(to_numpy(model.predict(x, verbose=0)), y, mask)
            np.testing.assert_allclose(logs["loss"], expected, rtol=1e-5)
        loss = model.train_on_batch(x, y, sample_weight=sw)
        outcomes.append((logs["loss"], loss, [to_numpy(w) for w in model.trainable_weights]))
    (eval_a, loss_a, weights_a), (eval_b, loss_b, weights_b) = outcomes
    np.testing.assert_allclose(eval_a, eval_b, rtol=1e-6)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    for a, b in zip(weights_a, weights_b):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("option", ["use_bias", "return_probabilities"])
def test_every_head_refuses_a_non_bool_flag(option):
    """`use_bias="yes"` (or 1) is refused by every registry head with the
    value echoed, not read as true."""
    from keras_softmax_heads.heads.registry import HEADS
    from keras_softmax_heads.heads.registry import make_head

    counts = np.arange(V, 0, -1)
    for name in HEADS:
        for bad in ("yes", 1):
            with pytest.raises(ValueError, match=rf"{option}={bad!r}"):
                make_head(name, V, counts=counts, **{option: bad})


def test_linear_cross_entropy_refuses_mismatched_token_shapes():
    """One id per token and one weight per token (or per sequence): a
    `[N, 1]` or reshaped target array, or a weight of another length, is a
    `ValueError` that shows both shapes, in both passes."""
    h = np.ones((12, 4), "float32")
    w = np.ones((4, 9), "float32")
    for in_forward in (False, True):
        for bad in (np.zeros((12, 1), "int32"), np.zeros((2, 6), "int32")):
            with pytest.raises(ValueError, match=r"targets.shape=\((12, 1|2, 6)\)"):
                ksh.linear_cross_entropy(h, w, bad, gradient_in_forward=in_forward)
        with pytest.raises(ValueError, match=r"sample_weight.shape=\(5,\)"):
            ksh.linear_cross_entropy(h, w, np.zeros(12, "int32"), sample_weight=np.ones(5),
                                     gradient_in_forward=in_forward)
    loss = ksh.LinearCrossEntropy(keras.Variable(w))
    with pytest.raises(ValueError, match=r"sample_weight.shape=\(5,\)"):
        loss(np.zeros(12, "int32"), h, sample_weight=np.ones(5, "float32"))
    per_sequence = ksh.linear_cross_entropy(h.reshape(3, 4, 4), w, np.zeros((3, 4), "int32"),
                                            sample_weight=np.ones(3, "float32"))
    assert np.isfinite(to_numpy(per_sequence))
