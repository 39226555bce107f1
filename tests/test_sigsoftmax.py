import numpy as np
import pytest
from backends import jit
from backends import to_numpy
from backends import value_and_grad
from battery import HeadBattery
from keras import ops
from references import numpy_log_sigmoid
from references import numpy_log_softmax

from keras_softmax_heads import functional
from keras_softmax_heads.heads.sig_softmax import SigSoftmax

pytestmark = pytest.mark.multibackend


def numpy_log_g(z, output_fn, epsilon=1e-6):
    z = z.astype("float64")
    if output_fn == "sigsoftmax":  # log(exp(z) sigmoid(z))
        return z - np.logaddexp(0.0, -z)
    if output_fn == "sigmoid":
        return numpy_log_sigmoid(z)
    return np.log(np.maximum(z, 0.0) + epsilon)


class TestSigSoftmaxBattery(HeadBattery):
    cases = {
        "sigsoftmax": lambda v, d, **kw: SigSoftmax(v, **kw),
    }


class TestSigSoftmaxVariantsBattery(HeadBattery):
    """g:sigmoid and g:ReLU; their training tests run in the slow suite."""

    cases = {
        "sigmoid": lambda v, d, **kw: SigSoftmax(v, output_fn="sigmoid", **kw),
        "relu": lambda v, d, **kw: SigSoftmax(v, output_fn="relu", **kw),
    }

    slow_tests = ("test_fit_reduces_loss", "test_jit_compile_fit_step", "test_mixed_float16_fit")


@pytest.mark.parametrize("output_fn", ["sigsoftmax", "sigmoid", "relu"])
def test_numpy_reference(output_fn):
    rng = np.random.default_rng(0)
    h = rng.normal(size=(5, 7, 8)).astype("float32")
    head = SigSoftmax(11, output_fn=output_fn, bias_initializer="random_normal")
    out = to_numpy(head(h))
    z = h.astype("float64") @ to_numpy(head.kernel) + to_numpy(head.bias)
    if output_fn == "relu":
        # log(ReLU(z) + 1e-6) is ill-conditioned for 0 < z << 1: start from
        # the head's own float32 scores.
        z = to_numpy(head.logits(h)).astype("float64")
    expected = numpy_log_softmax(numpy_log_g(z, output_fn))
    np.testing.assert_allclose(out, expected, atol=1e-5)
    # The definition, eq. 9: g(z) / sum g(z), in probability space.
    if output_fn == "sigsoftmax":
        g = np.exp(z) / (1.0 + np.exp(-z))
    elif output_fn == "sigmoid":
        g = 1.0 / (1.0 + np.exp(-z))
    else:
        g = np.maximum(z, 0.0) + 1e-6
    np.testing.assert_allclose(np.exp(out), g / g.sum(-1, keepdims=True), atol=1e-6)
    if output_fn != "relu":  # (ill-conditioned near 0: XLA rounds z differently)
        np.testing.assert_allclose(to_numpy(jit(lambda h: head(h))(h)), out, atol=2e-5)


def test_sigsoftmax_matches_ops():
    rng = np.random.default_rng(1)
    h = rng.normal(size=(4, 6)).astype("float32")
    head = SigSoftmax(9)
    expected = functional.log_sigsoftmax(head.logits(h))
    np.testing.assert_allclose(to_numpy(head(h)), to_numpy(expected), atol=1e-6)


def test_relu_all_nonpositive_row_is_uniform_and_finite():
    """The paper's division by zero (all ReLUs zero) gives the uniform law."""
    head = SigSoftmax(5, output_fn="relu", use_bias=False)
    head.build((None, 3))
    head.set_weights([np.ones((3, 5), "float32")])
    h = np.array([[-1.0, -2.0, -0.5], [1.0, 0.0, -0.5]], "float32")  # row 0: all z < 0
    log_p = to_numpy(head(h))
    ll, g_in, g_w = value_and_grad(
        lambda h: ops.sum(head.log_likelihood(h, np.array([2, 0]))), [h], head.trainable_weights
    )
    assert np.all(np.isfinite(log_p))
    np.testing.assert_allclose(log_p[0], np.log(0.2), atol=1e-6)
    np.testing.assert_allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-6)
    assert np.isfinite(ll)
    for g in g_in + g_w:
        assert np.all(np.isfinite(g))
    # Exactly zero scores too (z = 0 for every word).
    zero = to_numpy(head(np.zeros((1, 3), "float32")))
    np.testing.assert_allclose(zero, np.log(0.2), atol=1e-6)


def test_relu_epsilon_sets_the_floor():
    rng = np.random.default_rng(2)
    h = rng.normal(size=(3, 4)).astype("float32")
    for eps in [1e-3, 1e-1]:
        head = SigSoftmax(6, output_fn="relu", epsilon=eps)
        out = to_numpy(head(h))
        z = to_numpy(head.logits(h)).astype("float64")
        expected = numpy_log_softmax(numpy_log_g(z, "relu", eps))
        np.testing.assert_allclose(out, expected, atol=1e-5)
    assert SigSoftmax(6, output_fn="relu", epsilon=1e-3).get_config()["epsilon"] == 1e-3


@pytest.mark.parametrize("output_fn", ["sigsoftmax", "sigmoid"])
def test_preserves_argmax(output_fn):
    rng = np.random.default_rng(3)
    h = rng.normal(size=(64, 8)).astype("float32")
    head = SigSoftmax(50, output_fn=output_fn, bias_initializer="random_normal")
    np.testing.assert_array_equal(
        np.argmax(to_numpy(head(h)), -1), np.argmax(to_numpy(head.logits(h)), -1)
    )


@pytest.mark.parametrize("output_fn", ["softmax", "ReLU", "", None, 3])
def test_bad_output_fn(output_fn):
    with pytest.raises(ValueError, match="Received: output_fn="):
        SigSoftmax(10, output_fn=output_fn)


@pytest.mark.parametrize("epsilon", [0.0, -1e-6, float("nan"), float("inf"), "1e-6", True])
def test_bad_epsilon(epsilon):
    with pytest.raises(ValueError, match="Received: epsilon="):
        SigSoftmax(10, output_fn="relu", epsilon=epsilon)
