"""The papers' rank property (Kanai et al. 2018, Table 3; Yang et al. 2018).

Over many random contexts, the matrix of log-probabilities of a Linear-Softmax
head has rank at most d + 2 (d from `h W`, one from the bias, one from the
normaliser); so has the Mixture of Contexts baseline. Sigsoftmax, trained or
perturbed PLIF, the monotonic MLP and the Mixture of Softmaxes break that
bottleneck: their rank is clearly above d + 2.
"""

import keras
import numpy as np
import pytest

from keras_softmax_heads import diagnostics

D, V, CONTEXTS = 4, 60, 300


def _contexts(seed=0):
    return np.random.default_rng(seed).normal(size=(CONTEXTS, D)).astype("float32") * 2


def _rank(head):
    keras.utils.set_random_seed(0)
    h = _contexts()
    head(h[:1])
    rng = np.random.default_rng(1)
    for w in head.trainable_weights:
        value = w.numpy()
        w.assign(value + 0.5 * rng.normal(size=value.shape).astype(value.dtype))
    return diagnostics.empirical_rank(diagnostics.log_prob_matrix(head, h))


def _heads():
    import keras_softmax_heads as ksh

    return ksh


@pytest.mark.multibackend
def test_empirical_rank_threshold_matches_press():
    rng = np.random.default_rng(0)
    low = rng.normal(size=(50, 3)) @ rng.normal(size=(3, 40))
    assert diagnostics.empirical_rank(low) == 3
    assert diagnostics.empirical_rank(low.astype("float32")) == 3
    assert diagnostics.empirical_rank(rng.normal(size=(50, 40))) == 40
    with pytest.raises(ValueError, match="2-D"):
        diagnostics.empirical_rank(np.zeros(3))
    assert diagnostics.empirical_rank(np.outer(np.arange(1, 5), np.arange(1, 4))) == 1  # ints
    # The backend's SVD (JAX's on JAX) is NumPy's, and so is the rank.
    for matrix in (low, low.astype("float32"), rng.normal(size=(30, 45)).astype("float32")):
        np.testing.assert_allclose(diagnostics.singular_values(matrix),
                                   np.linalg.svd(matrix, compute_uv=False),
                                   rtol=1e-4, atol=1e-4 * np.abs(matrix).max())
        assert diagnostics.empirical_rank(matrix) == np.linalg.matrix_rank(matrix)


@pytest.mark.parametrize(
    "name,kwargs",
    [("FullSoftmax", {}), ("MixtureOfContexts", {"num_components": 3})],
)
def test_low_rank_heads(name, kwargs):
    ksh = _heads()
    head = getattr(ksh, name)(V, **kwargs)
    assert _rank(head) <= D + 2


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("SigSoftmax", {}),
        ("PLIFSoftmax", {"num_knots": 200, "knot_bound": 5.0}),
        ("MonotonicSoftmax", {"num_units": 8}),
        ("MixtureOfSoftmaxes", {"num_components": 3}),
    ],
)
def test_high_rank_heads(name, kwargs):
    ksh = _heads()
    head = getattr(ksh, name)(V, **kwargs)
    rank = _rank(head)
    assert rank > 2 * (D + 2), f"{name}: rank {rank} not clearly above d+2={D + 2}"


def test_untrained_plif_is_low_rank():
    """Identity-initialised PLIF equals Linear-Softmax, so its rank is <= d+2."""
    ksh = _heads()
    head = ksh.PLIFSoftmax(V, num_knots=200, knot_bound=5.0)
    h = _contexts()
    assert diagnostics.empirical_rank(diagnostics.log_prob_matrix(head, h)) <= D + 2
