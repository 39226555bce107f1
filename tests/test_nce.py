"""NCE: noise-contrastive estimation with unnormalised scores."""

import math
import os
import tempfile

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import jit
from backends import sparse_gradient_rows
from backends import to_numpy
from backends import value_and_grad
from battery import HeadBattery
from battery import assert_directional_gradients
from keras import ops
from multibackend import FD64
from multibackend import float64  # noqa: F401 (fixture)
from multibackend import jit_with_state
from references import numpy_log_sigmoid
from references import numpy_word_major_scores

import keras_softmax_heads as ksh
from keras_softmax_heads import samplers
from keras_softmax_heads.heads.nce import NCE
from keras_softmax_heads.heads.nce import nce_nll

pytestmark = pytest.mark.multibackend


def zipf_counts(v):
    return (1000.0 / np.arange(1, v + 1)).round() + 1


def _vocab(v, kw):
    return v if v is not None else kw["token_embedding"].input_dim


class TestNCEBattery(HeadBattery):
    avoids_full_scores_in_training = True
    exact_training_loss = False
    cases = {
        "unigram": lambda v, d, **kw: NCE(
            v,
            num_sampled=8,
            noise_ratio=3,
            counts=zipf_counts(_vocab(v, kw)),
            seed=1,
            **kw,
        ),
    }


def built_head(v=11, d=5, **kwargs):
    keras.utils.set_random_seed(0)
    kwargs.setdefault("counts", zipf_counts(v))
    head = NCE(v, bias_initializer="random_normal", **kwargs)
    head(np.zeros((1, d), "float32"))
    return head


def test_numpy_reference():
    for noise_ratio in (None, 2.5):
        _check_numpy_reference(noise_ratio)


def _check_numpy_reference(noise_ratio):
    head = built_head(num_sampled=6, noise_ratio=noise_ratio, log_normalizer=0.7)
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 3, 5)).astype("float32")
    t = np.array([[0, 3, 7], [3, 10, 1]])
    noise = np.array([3, 5, 3, 0, 9, 1])
    q = samplers.unigram_probs(zipf_counts(11))
    k = 6.0 if noise_ratio is None else noise_ratio
    z = numpy_word_major_scores(head, h.reshape(6, 5)) - 0.7
    want = []
    for i, w in enumerate(t.ravel()):
        loss = -numpy_log_sigmoid(z[i, w] - np.log(k * q[w]))
        for n in noise:
            loss -= (k / 6) * numpy_log_sigmoid(-(z[i, n] - np.log(k * q[n])))
        want.append(loss)
    got = to_numpy(head.nce_loss(h, t, noise))
    assert got.shape == (2, 3) and got.dtype == np.float32
    np.testing.assert_allclose(got.ravel(), want, rtol=1e-5, atol=1e-5)


def test_plain_function():
    a, b = np.array([0.3, -2.0]), np.array([[1.0, -1.0, 0.5], [0.0, 2.0, -3.0]])
    want = -numpy_log_sigmoid(a) - 0.7 * numpy_log_sigmoid(-b).sum(-1)
    np.testing.assert_allclose(to_numpy(nce_nll(a, b, 0.7)), want, rtol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's own op")
def test_matches_tf_nce_loss():
    """k = m, same samples, expected counts m q: tf.nn.nce_loss's value."""
    import tensorflow as tf

    v, m = 40, 8
    counts = zipf_counts(v)
    head = built_head(v=v, d=6, num_sampled=m, counts=counts)
    rng = np.random.default_rng(3)
    h = rng.normal(size=(7, 6)).astype("float32")
    t = rng.integers(0, v, size=7).astype("int64")
    ids = rng.integers(0, v, size=m).astype("int64")
    ids[:2] = t[:2]  # accidental hits are kept by both
    q = samplers.unigram_probs(counts)
    want = tf.nn.nce_loss(
        head.kernel, head.bias, t[:, None], h, num_sampled=m, num_classes=v,
        sampled_values=(ids, (m * q[t])[:, None].astype("float32"),
                        (m * q[ids]).astype("float32")),
    )
    got = head.nce_loss(h, t, ids)
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=1e-5, atol=1e-5)


def test_noise_ratio_is_decoupled_from_num_samples():
    """Each noise term weighs k / m: repeating the noise list changes nothing."""
    head = built_head(num_sampled=4, noise_ratio=50)
    h = np.random.default_rng(1).normal(size=(3, 5)).astype("float32")
    t = np.array([1, 2, 3])
    noise = np.array([0, 4, 9, 2])
    once = to_numpy(head.nce_loss(h, t, noise))
    twice = to_numpy(head.nce_loss(h, t, np.concatenate([noise, noise])))
    np.testing.assert_allclose(once, twice, rtol=1e-6)
    # ...while k itself changes the posterior.
    other = built_head(num_sampled=4, noise_ratio=5)
    assert not np.allclose(to_numpy(other.nce_loss(h, t, noise)), once)


def test_noise_samples_and_their_log_probs():
    v = 30
    counts = zipf_counts(v)
    head = built_head(v=v, num_sampled=50_000, counts=counts, distortion=0.75)
    s = head.sample_noise()
    ids = to_numpy(s["noise_ids"])
    q = samplers.unigram_probs(counts, 0.75)
    np.testing.assert_allclose(np.exp(to_numpy(s["noise_log_probs"])), q[ids], rtol=1e-5)
    freq = np.bincount(ids, minlength=v) / ids.size
    assert np.all(np.abs(freq - q) <= 5 * np.sqrt(q * (1 - q) / ids.size))


def _fixed_noise_problem():
    head = built_head(v=9, d=4, num_sampled=5, noise_ratio=3)
    rng = np.random.default_rng(0)
    h = rng.normal(size=(3, 2, 4))
    t = rng.integers(0, 9, size=(3, 2))
    noise = np.array([1, 4, 4, 8, t[0, 0]])
    weights = ops.convert_to_tensor(rng.normal(size=t.shape))

    def objective(x):
        return ops.sum(head.nce_loss(x, t, noise) * weights)

    return head, h, t, noise, objective, rng


def test_finite_difference_gradient_with_fixed_samples(float64):
    head, h, t, noise, objective, rng = _fixed_noise_problem()
    grads = assert_directional_gradients(
        objective, h, list(head.trainable_weights), rng, **FD64
    )
    # Only the rows of the targets and noise words get a gradient.
    assert set(np.flatnonzero(np.abs(grads[1]).sum(-1))) <= set(t.ravel()) | set(noise)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.IndexedSlices")
def test_kernel_gradient_is_sparse_on_tensorflow(float64):
    head, h, t, noise, objective, _ = _fixed_noise_problem()
    assert sparse_gradient_rows(objective, h, head.kernel) <= set(t.ravel()) | set(noise)


def test_training_false_is_exact_nll_and_zero_count_targets_are_finite():
    counts = zipf_counts(11)
    counts[4] = 0
    head = built_head(num_sampled=5, counts=counts)
    h = np.random.default_rng(2).normal(size=(3, 5)).astype("float32")
    t = np.array([4, 0, 10])
    np.testing.assert_allclose(
        to_numpy(head.training_loss(h, t, training=False)),
        -to_numpy(head.log_likelihood(h, t)),
        atol=1e-6,
    )
    assert np.all(np.isfinite(to_numpy(head.training_loss(h, t))))


def test_xla_training_step():
    """Compiles with the log-uniform sampler (the battery: "unigram")."""
    head = NCE(30, num_sampled=6, sampler="log_uniform", seed=0)
    h = np.random.default_rng(0).normal(size=(4, 3, 5)).astype("float32")
    t = np.random.default_rng(1).integers(0, 30, size=(4, 3)).astype("int32")
    head(h)

    def loss_fn(x):
        return ops.mean(head.training_loss(x, t))

    loss, grad_h, grads = value_and_grad(jit(loss_fn), [h], head.trainable_weights)
    assert np.isfinite(loss)
    assert all(np.all(np.isfinite(g)) for g in grad_h + grads)
    # Compiled draws advance the layer's seed state.
    sample = jit_with_state(head, head.sample_noise)
    first, second = (to_numpy(sample()["noise_ids"]) for _ in range(2))
    assert not np.array_equal(first, second)


BAD_ARGUMENTS = [
    ({"counts": np.ones(5)}, "counts.shape=\\(5,\\), vocab_size=11"),
    ({"counts": -np.ones(11)}, "counts\\[0\\]=-1"),
    ({"counts": None}, "needs the word `counts`"),
    ({"sampler": "batch"}, "Received: sampler='batch'"),
    ({"num_sampled": "all"}, "Received: num_sampled='all'"),
    ({"num_sampled": -2}, "Received: num_sampled=-2"),
    ({"noise_ratio": 0}, "Received: noise_ratio=0"),
    ({"noise_ratio": float("inf")}, "Received: noise_ratio=inf"),
    ({"log_normalizer": "z"}, "Received: log_normalizer='z'"),
    ({"distortion": float("nan")}, "Received: distortion=nan"),
]


def test_bad_arguments():
    for kwargs, match in BAD_ARGUMENTS:
        kwargs = {"counts": zipf_counts(11), **kwargs}
        with pytest.raises(ValueError, match=match):
            NCE(11, **kwargs)


def test_bad_targets():
    head = built_head()
    h = np.zeros((2, 5), "float32")
    with pytest.raises(ValueError, match=r"vocab_size=11\). Received: targets\[1\]=11"):
        head.training_loss(h, np.array([0, 11]))
    if BACKEND != "torch":  # values unknown under XLA: NaN
        jitted = jit_with_state(head, head.training_loss)
        out = to_numpy(jitted(h, np.array([0, 11], "int32")))
        assert np.isfinite(out[0]) and np.isnan(out[1])


def test_counts_survive_keras_save_load():
    counts = zipf_counts(17)
    head = NCE(17, counts=counts, num_sampled=4, noise_ratio=2)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, head(inputs))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.keras")
        model.save(path)
        loaded = keras.models.load_model(path).layers[-1]
    assert loaded.get_config() == head.get_config()
    np.testing.assert_array_equal(loaded.counts.numpy(), counts.astype("float32"))
    for name in ("sampling_log_probs", "alias_thresholds", "alias_indices"):
        np.testing.assert_array_equal(
            getattr(loaded, name).numpy(), getattr(head, name).numpy()
        )


def test_nce_training_lowers_exact_loss():
    """A tiny LM trained by NCE (20 noise words of 200): exact NLL falls.

    (With log_normalizer=0 the exact NLL first rises, 5.3 -> 9.5 after 20
    steps, and needs ~100 steps to fall below its start: NCE must first push
    all scores to ~log(1/V).)
    """
    keras.utils.set_random_seed(0)
    v = 200
    x = (np.arange(8)[None, :] * 7 + np.arange(64)[:, None] * 3) % v
    y = (x * 5 + 1) % v
    counts = np.bincount(y.ravel(), minlength=v) + 1
    backbone = keras.Sequential([keras.layers.Embedding(v, 16)])
    head = NCE(v, num_sampled=20, counts=counts, log_normalizer=math.log(v), seed=0)
    model = ksh.HeadModel(backbone, head)
    model.compile(optimizer=keras.optimizers.Adam(0.05))
    before = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    model.fit(x, y, batch_size=16, epochs=15, verbose=0)
    after = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    # The default bias start ("noise") is the unigram: below uniform.
    unigram = -np.mean(np.log(counts / counts.sum())[y])
    assert before == pytest.approx(unigram, rel=0.05)
    assert after < 0.5 * before, (before, after)


def test_nce_starts_self_normalised_at_the_noise():
    """The default bias is `log q(w) + log_normalizer`: sum_w exp(s(w|h)) = 1
    at h = 0, and the NCE posterior of every word is the Bayes-optimal
    1 / (1 + k). `bias_initializer="zeros"` restores the old start."""
    counts = np.array([5.0, 3.0, 0.0, 2.0])
    head = NCE(4, num_sampled=2, counts=counts, log_normalizer=1.5)
    head(np.zeros((1, 3), "float32"))
    bias = keras.ops.convert_to_numpy(head.bias)
    q = np.array([0.5, 0.3, 0.2, 0.2])  # the zero count floored at min q
    np.testing.assert_allclose(bias, np.log(q) + 1.5, rtol=1e-6)
    assert head.get_config()["bias_initializer"] == "noise"
    assert NCE.from_config(head.get_config()).get_config() == head.get_config()
    zeros = NCE(4, num_sampled=2, counts=counts, bias_initializer="zeros")
    zeros(np.zeros((1, 3), "float32"))
    assert not keras.ops.convert_to_numpy(zeros.bias).any()
    uniform = NCE(4, num_sampled=2, sampler="uniform")
    uniform(np.zeros((1, 3), "float32"))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(uniform.bias), -np.log(4.0),
                               rtol=1e-6)
