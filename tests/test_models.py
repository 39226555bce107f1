"""Language-model backbones and the head registry."""

import os

import keras
import numpy as np
import pytest
from multibackend import sweep

import keras_softmax_heads as ksh
from keras_softmax_heads.models import LSTMLanguageModel
from keras_softmax_heads.models import NgramLanguageModel
from keras_softmax_heads.heads import registry
from keras_softmax_heads.models import get_model_class

V, D = 23, 6


def _lstm(**kw):
    args = dict(vocab_size=V, embedding_dim=D, hidden_size=D, num_layers=2, batch_size=3)
    args.update(kw)
    return LSTMLanguageModel(**args)


def _tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, V, size=shape).astype("int32")


# ---------------------------------------------------------------------- LSTM
def test_lstm_shapes_and_projection():
    keras.utils.set_random_seed(0)
    lm = _lstm()
    assert tuple(lm(_tokens((3, 5))).shape) == (3, 5, D)
    assert lm.output_dim == D
    projected = _lstm(hidden_size=9, output_dim=4)
    assert tuple(projected(_tokens((3, 5))).shape) == (3, 5, 4)
    assert projected.output_dim == 4
    assert projected.compute_output_shape((3, 5)) == (3, 5, 4)
    # The carried state is not a weight (it depends on the batch size).
    assert len(lm.carried_state_variables) == 4
    assert not any("carried" in w.path for w in lm.weights)


def test_stateful_windows_equal_one_long_sequence():
    keras.utils.set_random_seed(1)
    lm = _lstm()
    x = _tokens((3, 10), seed=1)
    whole = np.asarray(lm(x))
    lm.reset_states()
    first = np.asarray(lm(x[:, :4]))
    second = np.asarray(lm(x[:, 4:]))
    np.testing.assert_allclose(np.concatenate([first, second], 1), whole, atol=1e-6)
    # Without reset the next call continues; after reset it starts again.
    lm.reset_states()
    np.testing.assert_allclose(np.asarray(lm(x[:, :4])), first, atol=1e-6)
    assert not np.allclose(np.asarray(lm(x[:, :4])), first, atol=1e-4)


def test_stateless_lstm_and_stateful_batch_checks():
    keras.utils.set_random_seed(2)
    lm = _lstm(stateful=False, batch_size=None)
    x = _tokens((2, 4))
    np.testing.assert_allclose(np.asarray(lm(x)), np.asarray(lm(x)), atol=1e-6)
    assert lm.carried_state_variables == []
    with pytest.raises(ValueError, match="batch_size"):
        LSTMLanguageModel(vocab_size=V, stateful=True)
    stateful = _lstm()
    stateful(_tokens((3, 4)))
    with pytest.raises(ValueError, match="batch_size=3"):
        stateful(_tokens((2, 4)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"embedding_dropout": 1.0}, "embedding_dropout"),
        ({"hidden_dropout": -0.1}, "hidden_dropout"),
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": 2.5}, "hidden_size"),
        ({"init_scale": 0}, "init_scale"),
        ({"output_dim": 0}, "output_dim"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_lstm_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _lstm(**kwargs)


def test_init_scale_and_forget_bias():
    keras.utils.set_random_seed(3)
    lm = _lstm(init_scale=0.05, unit_forget_bias=False)
    lm(_tokens((3, 2)))
    for w in lm.weights:
        assert np.abs(np.asarray(w)).max() <= 0.05 + 1e-7, w.path
    default = _lstm()
    default(_tokens((3, 2)))
    bias = np.asarray(default.lstms[0].cell.bias)
    np.testing.assert_array_equal(bias[D:2 * D], 1.0)  # Keras' unit forget bias


def test_dropout_only_in_training():
    keras.utils.set_random_seed(4)
    lm = _lstm(embedding_dropout=0.5, hidden_dropout=0.5, output_dropout=0.5,
               stateful=False, batch_size=None)
    x = _tokens((3, 5))
    np.testing.assert_allclose(np.asarray(lm(x)), np.asarray(lm(x, training=False)))
    assert not np.allclose(np.asarray(lm(x, training=True)), np.asarray(lm(x)))


# --------------------------------------------------------------------- n-gram
@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("backbone", ["lstm", "ngram"])
def test_dropout_seeds_draw_as_unseeded_layers(backbone, rate, monkeypatch):
    """The backbones seed their `Dropout` layers (exact resumes on PyTorch)
    with the draws Keras makes for unseeded ones, and only those: the same
    masks and the same initialisation of every later layer as unseeded
    layers give (a zero-rate layer drew a seed Keras does not draw, which
    moved the initialisation of every LSTM preset without dropout)."""
    import random

    from keras_softmax_heads.models import lstm_lm
    from keras_softmax_heads.models import ngram_lm

    def build():
        keras.utils.set_random_seed(0)
        if backbone == "lstm":
            model = _lstm(embedding_dropout=rate, hidden_dropout=rate, output_dropout=rate)
            layers = [model.embedding_dropout_layer, *model.hidden_dropout_layers,
                      model.output_dropout_layer]
        else:
            model = NgramLanguageModel(vocab_size=V, order=3, embedding_dim=5,
                                       hidden_sizes=[7, 6], dropout=rate)
            layers = model.dropout_layers
        states = [keras.ops.convert_to_numpy(layer.seed_generator.state) for layer in layers
                  if hasattr(layer, "seed_generator")]
        return states, random.random()

    seeded = build()
    for module in (lstm_lm, ngram_lm):  # unseeded layers, as Keras builds them
        monkeypatch.setattr(module, "dropout_seed", lambda rate: None)
    unseeded = build()
    assert len(seeded[0]) == (0 if rate == 0 else 3 if backbone == "lstm" else 2)
    assert all(np.array_equal(a, b) for a, b in zip(seeded[0], unseeded[0]))
    assert seeded[1] == unseeded[1]


def test_ngram_matches_numpy_reference():
    keras.utils.set_random_seed(5)
    lm = NgramLanguageModel(vocab_size=V, order=4, embedding_dim=5, hidden_sizes=[7, 6])
    x = _tokens((8, 3))
    out = np.asarray(lm(x))
    assert out.shape == (8, 6) and lm.output_dim == 6
    emb = np.asarray(lm.embedding.embeddings)
    h = emb[x].reshape(8, 15)
    for dense in lm.hidden_layers:
        h = np.tanh(h @ np.asarray(dense.kernel) + np.asarray(dense.bias))
    np.testing.assert_allclose(out, h, atol=1e-5)
    # Leading dimensions are kept.
    assert tuple(lm(_tokens((2, 5, 3))).shape) == (2, 5, 6)
    with pytest.raises(ValueError, match="reads 3 context words"):
        lm(_tokens((8, 4)))
    with pytest.raises(ValueError, match="order"):
        NgramLanguageModel(vocab_size=V, order=1)
    with pytest.raises(ValueError, match="hidden_sizes"):
        NgramLanguageModel(vocab_size=V, hidden_sizes=[])


# ------------------------------------------------------- tying, config, save
def _backbones():
    return {
        "lstm": lambda: _lstm(num_layers=1),
        "lstm_projected": lambda: _lstm(num_layers=1, hidden_size=8, output_dim=D),
        "ngram": lambda: NgramLanguageModel(
            vocab_size=V, order=3, embedding_dim=D, hidden_sizes=[D], dropout=0.1),
    }


def _inputs(name):
    return _tokens((3, 2)) if name == "ngram" else _tokens((3, 5))


def _targets(name):
    return _tokens((3,), seed=9) if name == "ngram" else _tokens((3, 5), seed=9)


@pytest.mark.parametrize("name", sorted(_backbones()))
def test_config_round_trip(name):
    backbone = _backbones()[name]()
    config = backbone.get_config()
    clone = backbone.__class__.from_config(config)
    # The clone gets its own embedding (a copy, not a shared layer).
    assert clone.embedding is not backbone.embedding
    cfg_a = {k: v for k, v in config.items() if k != "embedding"}
    cfg_b = {k: v for k, v in clone.get_config().items() if k != "embedding"}
    assert cfg_a == cfg_b
    serialized = keras.saving.serialize_keras_object(backbone)
    restored = keras.saving.deserialize_keras_object(serialized)
    assert type(restored) is type(backbone)
    assert restored.output_dim == backbone.output_dim


@pytest.mark.parametrize("name, tied", sweep(
    [("lstm_projected", True), ("ngram", False), ("lstm", False), ("ngram", True)],
    keep=[("lstm_projected", True), ("ngram", False)]))
def test_head_model_keras_save_load(name, tied, tmp_path):
    keras.utils.set_random_seed(6)
    backbone = _backbones()[name]()
    head = registry.make_head(
        "full_softmax", V, token_embedding=backbone.token_embedding if tied else None)
    model = ksh.HeadModel(backbone, head)
    x, y = _inputs(name), _targets(name)
    model.build(x.shape)
    model.compile(keras.optimizers.Adam(0.01))
    model.fit(x, y, batch_size=3, epochs=1, verbose=0, shuffle=False)
    if tied:
        assert head.kernel is None and head.token_embedding is backbone.token_embedding
        # The embedding is trained once, not twice.
        assert len(model.trainable_variables) == len({id(v) for v in model.trainable_variables})
    path = os.path.join(tmp_path, "lm.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.backbone) is type(backbone)
    if tied:
        assert loaded.head.token_embedding is loaded.backbone.token_embedding
    assert len(loaded.weights) == len(model.weights)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    backbone.reset_states()
    loaded.backbone.reset_states()
    np.testing.assert_allclose(
        loaded.predict(x, batch_size=3, verbose=0),
        model.predict(x, batch_size=3, verbose=0), atol=1e-6)
    # The optimizer state comes back too.
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations)


def test_stateful_lstm_trains_with_mixed_precision():
    # jit_compile=True is covered by tests/test_distribute.py (TPU path).
    keras.utils.set_random_seed(7)
    keras.config.set_dtype_policy("mixed_bfloat16")
    backbone = _lstm(num_layers=1)
    model = ksh.HeadModel(backbone, ksh.FullSoftmax(V))
    model.build((3, 5))
    model.compile(keras.optimizers.Adam(0.01))
    x = _tokens((6, 5))
    history = model.fit(x, np.roll(x, -1, 1), batch_size=3, epochs=2, verbose=0, shuffle=False)
    assert np.all(np.isfinite(history.history["loss"]))
    for v in backbone.carried_state_variables:
        assert v.dtype == "float32"
        assert np.abs(np.asarray(v)).max() > 0


# ------------------------------------------------------------------ registry
def test_registry_builds_every_available_head():
    available = registry.available_heads()
    assert "full_softmax" in available
    counts = np.arange(V, 0, -1)
    for name in available:
        head = registry.make_head(name, V, counts=counts)
        assert head.vocab_size == V
        assert isinstance(head, ksh.SoftmaxHead), name
        log_p = np.asarray(head(np.random.default_rng(0).normal(size=(2, D)).astype("float32")))
        np.testing.assert_allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-4)


def test_registry_errors_and_aliases(monkeypatch):
    assert registry.canonical_head_name("softmax") == "full_softmax"
    assert registry.canonical_head_name("MoS") == "mixture_of_softmaxes"
    with pytest.raises(ValueError, match="Unknown head"):
        registry.make_head("nope", V)
    with pytest.raises(ValueError, match="does not take"):
        registry.make_head("full_softmax", V, num_knots=3)
    monkeypatch.setitem(registry.HEADS, "ghost", ("keras_softmax_heads.heads.ghost", "Ghost"))
    with pytest.raises(ValueError, match="not available"):
        registry.get_head_class("ghost")
    assert "ghost" not in registry.available_heads()
    head = registry.make_head("full_softmax", V, chunk_size=4, init_scale=0.1)
    head.build((None, D))
    assert np.abs(np.asarray(head.kernel)).max() <= 0.1
    if "differentiated" in registry.available_heads():
        assert not registry.supports_tying("differentiated")  # per-band sizes
    assert registry.supports_tying("full_softmax")
    assert get_model_class("lstm") is LSTMLanguageModel
    with pytest.raises(ValueError, match="Unknown model"):
        get_model_class("gru")
