import numpy as np
import pytest
import tensorflow as tf
from battery import HeadBattery
from references import numpy_log_softmax
from references import softplus

from keras_softmax_heads.heads.monotonic_softmax import MonotonicSoftmax
from keras_softmax_heads.heads.monotonic_softmax import monotonic_mlp


def numpy_mlp(z, raw_u, b, raw_v):
    """eq. 14 with u = softplus(raw_u), v = softplus(raw_v), float64."""
    z = np.asarray(z, "float64")[..., None]
    pre = softplus(raw_u) * z + b
    return np.sum(softplus(raw_v) / (1.0 + np.exp(-pre)), axis=-1)


def randomise(head, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    for w in head.weights:
        w.assign(w.numpy() + scale * rng.normal(size=w.shape).astype(w.dtype))


class TestMonotonicSoftmaxBattery(HeadBattery):
    cases = {"units4": lambda v, d, **kw: MonotonicSoftmax(v, num_units=4, init_range=3.0, **kw)}


def test_numpy_reference():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(5, 7, 8)).astype("float32")
    head = MonotonicSoftmax(11, num_units=5, bias_initializer="random_normal")
    head(h)
    randomise(head)
    out = np.asarray(head(h))
    z = h.astype("float64") @ head.kernel.numpy() + head.bias.numpy()
    f = numpy_mlp(
        z,
        head.raw_input_weights.numpy(),
        head.hidden_biases.numpy(),
        head.raw_output_weights.numpy(),
    )
    np.testing.assert_allclose(out, numpy_log_softmax(f), atol=1e-5)


def test_custom_gradient_matches_autodiff():
    """The memory-saving custom gradient equals autodiff of the naive
    `[..., K]` broadcast (float64, all inputs)."""
    rng = np.random.default_rng(1)
    z = tf.constant(rng.normal(size=(3, 4, 5)) * 3, tf.float64)
    params = [tf.constant(rng.normal(size=(6,)), tf.float64) for _ in range(3)]
    w = tf.constant(rng.normal(size=(3, 4, 5)), tf.float64)

    def naive(z, raw_u, b, raw_v):
        s = tf.sigmoid(tf.nn.softplus(raw_u) * z[..., None] + b)
        return tf.reduce_sum(tf.nn.softplus(raw_v) * s, -1)

    for fn in [monotonic_mlp, tf.function(monotonic_mlp, jit_compile=True)]:
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([z] + params)
            ours = tf.reduce_sum(fn(z, *params) * w)
            ref = tf.reduce_sum(naive(z, *params) * w)
        np.testing.assert_allclose(float(ours), float(ref), rtol=1e-12)
        for a, b in zip(tape.gradient(ours, [z] + params), tape.gradient(ref, [z] + params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


def test_monotone_and_preserves_argmax():
    head = MonotonicSoftmax(40, num_units=8, bias_initializer="random_normal")
    rng = np.random.default_rng(2)
    h = rng.normal(size=(64, 6)).astype("float32")
    head(h)
    randomise(head, seed=3)
    grid = np.linspace(-30, 30, 20001)
    f = numpy_mlp(
        grid,
        head.raw_input_weights.numpy(),
        head.hidden_biases.numpy(),
        head.raw_output_weights.numpy(),
    )
    inside = np.abs(grid) < 8  # outside, float64 sigmoids saturate to equality
    assert np.all(np.diff(f) >= 0)
    assert np.all(np.diff(f[inside]) > 0)
    f_tf = np.asarray(head.score_transform(tf.constant(grid, tf.float32)))
    np.testing.assert_allclose(f_tf, f, atol=1e-4)
    np.testing.assert_array_equal(
        np.argmax(np.asarray(head(h)), -1), np.argmax(np.asarray(head.logits(h)), -1)
    )


def test_initialisation_is_close_to_a_shifted_identity():
    head = MonotonicSoftmax(5, num_units=64, init_range=10.0)
    head.build((None, 3))
    x = np.linspace(-5, 5, 101).astype("float32")
    f = np.asarray(head.score_transform(x))
    np.testing.assert_allclose(f - x, 10.0, atol=0.05)


def test_weights_and_config():
    head = MonotonicSoftmax(9, num_units=3, init_range=2.0)
    head.build((None, 4))
    assert [w.path.split("/")[-1] for w in head.trainable_weights] == [
        "kernel",
        "bias",
        "raw_input_weights",
        "hidden_biases",
        "raw_output_weights",
    ]
    config = head.get_config()
    assert config["num_units"] == 3 and config["init_range"] == 2.0
    assert MonotonicSoftmax.from_config(config).get_config() == config


@pytest.mark.parametrize("num_units", [0, -2, 2.5, True, "4", None])
def test_bad_num_units(num_units):
    with pytest.raises(ValueError, match="Received: num_units="):
        MonotonicSoftmax(10, num_units=num_units)


@pytest.mark.parametrize("init_range", [0.0, -1.0, float("nan"), "3"])
def test_bad_init_range(init_range):
    with pytest.raises(ValueError, match="Received: init_range="):
        MonotonicSoftmax(10, init_range=init_range)
