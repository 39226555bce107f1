"""SelfNormalizedSoftmax: infrequent normalisation (Weaknorm, WeaknormSQ)."""

import math

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import to_numpy
from battery import HeadBattery
from battery import assert_directional_gradients
from keras import ops
from multibackend import FD64
from multibackend import float64  # noqa: F401 (fixture)
from multibackend import jit_with_state
from references import numpy_word_major_scores

import keras_softmax_heads as ksh
from keras_softmax_heads.heads.self_normalized_softmax import SelfNormalizedSoftmax
from keras_softmax_heads.heads.self_normalized_softmax import weaknorm_nll

pytestmark = pytest.mark.multibackend


class TestSelfNormalizedBattery(HeadBattery):
    exact_training_loss = False
    cases = {
        "weaknorm_sq_bounded": lambda v, d, **kw: SelfNormalizedSoftmax(
            v, variant="weaknorm_sq", alpha=0.5, gamma=0.5, score_bound=True,
            seed=2, **kw
        ),
    }


def built_head(v=11, d=5, **kwargs):
    keras.utils.set_random_seed(0)
    head = SelfNormalizedSoftmax(v, bias_initializer="random_normal", **kwargs)
    head(np.zeros((1, d), "float32"))
    return head


def numpy_scores(head, h, bound):
    z = numpy_word_major_scores(head, h)
    return 10 * np.tanh(z / 5) if bound else z


def numpy_logsumexp(s):
    m = s.max(-1)
    return m + np.log(np.exp(s - m[:, None]).sum(-1))


def test_numpy_reference():
    for variant in ("weaknorm", "weaknorm_sq"):
        for bound in (False, True):
            _check_numpy_reference(variant, bound)


def _check_numpy_reference(variant, bound):
    head = built_head(variant=variant, alpha=0.7, score_bound=bound)
    rng = np.random.default_rng(0)
    h = 2 * rng.normal(size=(2, 4, 5)).astype("float32")
    t = rng.integers(0, 11, size=(2, 4))
    rows = np.array([6, 1, 3])
    s = numpy_scores(head, h.reshape(8, 5), bound)
    log_z = numpy_logsumexp(s)
    penalty = log_z if variant == "weaknorm" else log_z**2
    want = -s[np.arange(8), t.ravel()]
    want[rows] += 0.7 * (8 / 3) * penalty[rows]
    got = to_numpy(head.loss_with_rows(h, t, rows))
    assert got.shape == (2, 4) and got.dtype == np.float32
    np.testing.assert_allclose(got.ravel(), want, rtol=1e-5, atol=1e-5)
    # Evaluation normalises the (bounded) scores exactly.
    log_p = s - log_z[:, None]
    np.testing.assert_allclose(to_numpy(head(h)).reshape(8, 11), log_p, atol=1e-5)


def test_plain_function():
    got = weaknorm_nll(
        np.array([1.0, 2.0, 3.0, 4.0]), np.array([2.0, -1.0]), np.array([3, 0]),
        4, 0.5, "weaknorm_sq",
    )
    np.testing.assert_allclose(to_numpy(got), [-1 + 1.0, -2, -3, -4 + 4.0])


def test_weaknorm_alpha_one_gamma_one_is_exact_nll():
    """Weaknorm with alpha=1, gamma=1: -s_t + log Z, the exact NLL."""
    for bound in (False, True):
        head = built_head(variant="weaknorm", alpha=1.0, gamma=1.0, score_bound=bound)
        h = 3 * np.random.default_rng(1).normal(size=(4, 3, 5)).astype("float32")
        t = np.random.default_rng(2).integers(0, 11, size=(4, 3))
        exact = -to_numpy(head.log_likelihood(h, t))
        np.testing.assert_allclose(to_numpy(head.training_loss(h, t)), exact, atol=1e-5)
        np.testing.assert_allclose(
            to_numpy(head.training_loss(h, t, training=False)), exact, atol=1e-6
        )
    jitted = jit_with_state(head, head.training_loss)
    np.testing.assert_allclose(to_numpy(jitted(h, t)), exact, atol=1e-5)


def test_weaknorm_is_unbiased_estimate_of_nll():
    """alpha=1, gamma<1: the batch mean equals the mean NLL in expectation."""
    head = built_head(variant="weaknorm", alpha=1.0, gamma=0.25, seed=0)
    h = 2 * np.random.default_rng(1).normal(size=(12, 5)).astype("float32")
    t = np.random.default_rng(2).integers(0, 11, size=12)
    nll = -to_numpy(head.log_likelihood(h, t)).mean()
    loss = jit_with_state(head, lambda: ops.mean(head.training_loss(h, t)))
    draws = np.array([float(to_numpy(loss())) for _ in range(400)])
    stderr = draws.std() / np.sqrt(draws.size)
    assert abs(draws.mean() - nll) < 5 * stderr, (draws.mean(), nll, stderr)


def test_partition_computed_on_selected_rows_only():
    head = built_head(gamma=0.25, seed=0)
    seen = []
    original = head.full_scores

    def spy(h):
        seen.append(tuple(h.shape))
        return original(h)

    head.full_scores = spy
    h = np.random.default_rng(0).normal(size=(4, 5, 5)).astype("float32")
    head.training_loss(h, np.zeros((4, 5), "int32"))
    assert seen == [(5, 5)]  # ceil(0.25 * 20) rows of d=5


def test_row_selection():
    head = built_head(gamma=0.3, seed=4)
    rows = to_numpy(head.sample_rows(10))
    assert rows.shape == (3,) and len(set(rows.tolist())) == 3
    assert rows.min() >= 0 and rows.max() < 10
    assert head.num_selected_rows(7) == 3
    assert head.num_selected_rows(1) == 1
    counts = np.zeros(10)
    sample = jit_with_state(head, lambda: head.sample_rows(10))
    for _ in range(300):
        counts[to_numpy(sample())] += 1
    # Each row is selected with probability 3/10.
    assert np.all(np.abs(counts / 300 - 0.3) < 5 * np.sqrt(0.21 / 300))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow graph signature")
def test_dynamic_batch_size_in_graph_mode():
    import tensorflow as tf

    head = built_head(gamma=0.3, seed=0)
    fn = tf.function(
        head.training_loss,
        autograph=False,
        input_signature=[
            tf.TensorSpec([None, None, 5], tf.float32),
            tf.TensorSpec([None, None], tf.int32),
        ],
    )
    h = np.random.default_rng(0).normal(size=(3, 4, 5)).astype("float32")
    t = np.ones((3, 4), "int32")
    out = to_numpy(fn(h, t))
    assert out.shape == (3, 4) and np.all(np.isfinite(out))
    # ceil(0.3 * 12) = 4 rows carry the penalty; the others are -s_t only.
    s_t = to_numpy(head.logits(h))[..., 1]
    assert np.sum(~np.isclose(out, -s_t, atol=1e-6)) <= 4


def test_finite_difference_gradient_with_fixed_rows(float64):
    head = built_head(v=9, d=4, variant="weaknorm_sq", alpha=0.3, score_bound=True)
    rng = np.random.default_rng(0)
    h = rng.normal(size=(3, 2, 4))
    t = rng.integers(0, 9, size=(3, 2))
    rows = np.array([4, 0])
    weights = ops.convert_to_tensor(rng.normal(size=t.shape))

    def objective(x):
        return ops.sum(head.loss_with_rows(x, t, rows) * weights)

    assert_directional_gradients(objective, h, list(head.trainable_weights), rng, **FD64)


BAD_ARGUMENTS = [
    ({"variant": "weaknormsq"}, "Received: variant='weaknormsq'"),
    ({"alpha": -1}, "Received: alpha=-1"),
    ({"alpha": float("nan")}, "Received: alpha=nan"),
    ({"gamma": 0}, "Received: gamma=0"),
    ({"gamma": 1.5}, "Received: gamma=1.5"),
    ({"gamma": True}, "Received: gamma=True"),
    ({"score_bound": 1}, "Received: score_bound=1"),
    ({"seed": 1.5}, "Received: seed=1.5"),
]


def test_bad_arguments():
    for kwargs, match in BAD_ARGUMENTS:
        with pytest.raises(ValueError, match=match):
            SelfNormalizedSoftmax(11, **kwargs)


def test_bad_targets():
    head = built_head(gamma=0.5)
    h = np.zeros((2, 5), "float32")
    with pytest.raises(ValueError, match=r"vocab_size=11\). Received: targets\[1\]=11"):
        head.training_loss(h, np.array([0, 11]))
    if BACKEND != "torch":  # values unknown under XLA: NaN
        jitted = jit_with_state(head, head.training_loss)
        out = to_numpy(jitted(h, np.array([0, 11], "int32")))
        assert np.isfinite(out[0]) and np.isnan(out[1])


def test_training_lowers_exact_loss():
    """A tiny LM normalised on 10% of its tokens: exact NLL falls.

    (WeaknormSQ with the score bound trains in the battery's fit test.)
    """
    keras.utils.set_random_seed(0)
    v = 200
    x = (np.arange(8)[None, :] * 7 + np.arange(64)[:, None] * 3) % v
    y = (x * 5 + 1) % v
    backbone = keras.Sequential([keras.layers.Embedding(v, 16)])
    head = SelfNormalizedSoftmax(v, variant="weaknorm", gamma=0.1, seed=0)
    model = ksh.HeadModel(backbone, head)
    model.compile(optimizer=keras.optimizers.Adam(0.05))
    before = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    model.fit(x, y, batch_size=16, epochs=15, verbose=0)
    after = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    assert before > 0.9 * math.log(v)
    assert after < 0.5 * before, (before, after)
