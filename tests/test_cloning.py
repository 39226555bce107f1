"""`clone_function_keeping_ties`: `keras.models.clone_model` of a model with
a tied head keeps the tie (Sequential and functional models, a tied
`FullSoftmax` and an `AdaptiveSoftmax` tied to its `AdaptiveEmbedding`), on
every backend; without it the clone's head has an embedding of its own."""

import keras
import numpy as np
import pytest

import keras_softmax_heads as ksh

pytestmark = pytest.mark.multibackend

V, D, T = 30, 8, 5


def _sequential():
    emb = keras.layers.Embedding(V, D)
    return keras.Sequential([keras.Input((T,), dtype="int32"), emb,
                             keras.layers.Dense(D, activation="tanh"),
                             ksh.FullSoftmax(token_embedding=emb)])


def _functional():
    tokens = keras.Input((T,), dtype="int32")
    emb = ksh.AdaptiveEmbedding(V, D, cutoffs=[10, 20], factor=2)
    head = ksh.AdaptiveSoftmax(adaptive_embedding=emb, factor=2)
    return keras.Model(tokens, head(keras.layers.Dense(D)(emb(tokens))))


@pytest.mark.parametrize("make", [_sequential, _functional])
def test_clone_keeps_the_tie(make):
    model = make()
    x = np.random.default_rng(0).integers(0, V, (2, T)).astype("int32")
    model(x)
    untied = keras.models.clone_model(model)
    assert len(untied.weights) > len(model.weights)  # Keras alone: a second embedding
    calls = []

    def dense_only(layer):  # the caller's clone_function still applies elsewhere
        calls.append(layer.name)
        return layer.__class__.from_config(layer.get_config())

    clone = keras.models.clone_model(
        model, clone_function=ksh.clone_function_keeping_ties(dense_only))
    assert len(clone.weights) == len(model.weights)
    head = clone.layers[-1]
    tied = getattr(head, "adaptive_embedding", None) or head.token_embedding
    assert any(tied is layer for layer in clone.layers)
    assert model.layers[-1].name not in calls and calls
    clone.set_weights(model.get_weights())
    np.testing.assert_allclose(keras.ops.convert_to_numpy(clone(x)),
                               keras.ops.convert_to_numpy(model(x)), rtol=1e-6, atol=1e-6)
