"""`HeadModel` with keras-hub backbones: dict inputs, heads tied to the
backbone's `ReversibleEmbedding`, `.keras` save / load / resume."""

import os

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

import keras  # noqa: E402

import keras_softmax_heads as ksh  # noqa: E402

V, T = 100, 8


def _backbone():
    # A tiny config: no preset download. GPT-2's dropout (0.1) stays on, so
    # resuming is only exact if the dropout generators' states are restored.
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=V,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
    )


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(0, V, (4, T)).astype("int32"),
        "padding_mask": np.ones((4, T), "int32"),
    }
    return x, rng.integers(0, V, (4, T))


def _model(head_class, tied, **kwargs):
    backbone = _backbone()
    if tied:
        head = head_class(token_embedding=backbone.token_embedding, **kwargs)
    else:
        head = head_class(V, **kwargs)
    model = ksh.HeadModel(backbone, head)
    model.compile(optimizer="adam")
    return model


@pytest.mark.parametrize(
    "head_class, tied, kwargs",
    [
        (ksh.SigSoftmax, True, {}),
        pytest.param(ksh.SigSoftmax, False, {}, marks=pytest.mark.slow),
        pytest.param(ksh.SampledSoftmax, True, {"num_sampled": 8, "seed": 1},
                     marks=pytest.mark.slow),
    ],
    ids=["sigsoftmax-tied", "sigsoftmax-untied", "sampled-tied"],
)
def test_train_save_load_resume(tmp_path, head_class, tied, kwargs):
    keras.utils.set_random_seed(0)
    model = _model(head_class, tied, **kwargs)
    x, y = _data()
    model.fit(x, y, epochs=2, verbose=0)
    if tied and head_class is ksh.SigSoftmax:  # a tied head counts only its own
        assert model.head.count_params() == V  # the bias; the embedding is the backbone's
        assert model.count_params() == (model.backbone.count_params()
                                         + model.head.count_params())
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)

    if tied:  # one embedding, shared by backbone and head, as before saving
        assert loaded.head.token_embedding is loaded.backbone.token_embedding
    assert len(loaded.trainable_variables) == len(model.trainable_variables)
    # The optimizer's state came back: same variables, same values.
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    # All state, the dropout / sampler generators' included.
    assert len(loaded.variables) == len(model.variables)
    for a, b in zip(model.variables, loaded.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))

    # Resuming: one more step on each gives the same weights.
    model.fit(x, y, epochs=1, verbose=0)
    loaded.fit(x, y, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# By default, test_fused_causal_lm.py's test_fit_matches_stock_without_logits
# checks the same on GPT-2 (hidden states in training, the loss of the
# logits, one step's gradients equal to the stock step's).
@pytest.mark.slow
def test_fused_causal_lm_trains_without_logits():
    """`fused_causal_lm(GPT2CausalLM)`: training calls return hidden states
    (no `[batch, seq, V]` logits), the fused training loss equals the dense
    weighted cross-entropy of the logits, and `fit` lowers it."""
    from keras import ops

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16, dropout=0.0,
    )
    fused_class = ksh.fused.fused_causal_lm(keras_hub.models.GPT2CausalLM)
    assert ksh.fused.fused_causal_lm(keras_hub.models.GPT2CausalLM) is fused_class
    lm = fused_class(backbone=backbone, preprocessor=None,
                     fused_loss={"chunk_size": 32, "z_loss": 1e-4})
    x, y = _data()
    sw = x["padding_mask"].astype("float32")
    sw[:, -2:] = 0.0
    hidden = lm(x, training=True)
    assert tuple(hidden.shape) == (4, T, 16)  # not [4, T, V]
    assert tuple(lm(x, training=False).shape) == (4, T, V)

    loss = lm.compute_loss(x, y, hidden, sw, training=True)
    logits = ops.convert_to_numpy(lm(x, training=False)).astype("float64")
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = lse - np.take_along_axis(logits, y[..., None], -1)[..., 0] + 1e-4 * lse**2
    np.testing.assert_allclose(float(ops.convert_to_numpy(loss)), (nll * sw).sum() / sw.sum(), rtol=1e-5)

    lm.compile(optimizer=keras.optimizers.Adam(0.01),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               weighted_metrics=["sparse_categorical_accuracy"])
    history = lm.fit(x, y, sample_weight=sw, epochs=5, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    assert set(history) == {"loss"}  # the metrics are skipped on hidden states
    # Fused evaluation: the trained loss (z-loss included), the perplexity
    # of the NLL alone, the token accuracy; the compiled metric needs logits.
    result = lm.evaluate(x, y, sample_weight=sw, verbose=0, return_dict=True)
    logits = ops.convert_to_numpy(lm.predict(x, verbose=0)).astype("float64")
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = lse - np.take_along_axis(logits, y[..., None], -1)[..., 0]
    np.testing.assert_allclose(result["perplexity"], np.exp((nll * sw).sum() / sw.sum()),
                               rtol=1e-5)
    np.testing.assert_allclose(result["loss"], ((nll + 1e-4 * lse**2) * sw).sum() / sw.sum(),
                               rtol=1e-5)
    assert "sparse_categorical_accuracy" not in result
    # fused_evaluate=False: the stock evaluate (logits, the compiled metric).
    plain = fused_class.from_config({**lm.get_config(), "fused_evaluate": False})
    plain.set_weights(lm.get_weights())
    plain.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["sparse_categorical_accuracy"])
    stock = plain.evaluate(x, y, sample_weight=sw, verbose=0, return_dict=True)
    assert set(stock) == {"loss", "sparse_categorical_accuracy"}
    assert stock["sparse_categorical_accuracy"] == pytest.approx(result["token_accuracy"])
    config = lm.get_config()
    assert config["fused_loss"] == {"chunk_size": 32, "z_loss": 1e-4}
