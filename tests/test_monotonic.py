import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import jit
from backends import to_numpy
from backends import value_and_grad
from multibackend import slow_on
from battery import HeadBattery
from keras import ops
from references import numpy_log_softmax
from references import softplus

from keras_softmax_heads.heads.monotonic_softmax import MonotonicSoftmax
from keras_softmax_heads.heads.monotonic_softmax import monotonic_mlp

pytestmark = pytest.mark.multibackend

# Keras computes float64 only on TensorFlow (JAX and PyTorch promote to 32
# bits): exact comparisons in float64 there, float32 elsewhere.
DTYPE = "float64" if BACKEND == "tensorflow" else "float32"


def numpy_mlp(z, raw_u, b, raw_v):
    """eq. 14 with u = softplus(raw_u), v = softplus(raw_v), float64."""
    z = np.asarray(z, "float64")[..., None]
    pre = softplus(raw_u) * z + b
    return np.sum(softplus(raw_v) / (1.0 + np.exp(-pre)), axis=-1)


def randomise(head, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    for w in head.weights:
        value = to_numpy(w)
        w.assign((value + scale * rng.normal(size=value.shape)).astype(value.dtype))


class TestMonotonicSoftmaxBattery(HeadBattery):
    # The exact path (the K sigmoids at every score) and the default
    # tabulated one; the finite differences of the tabulated path see the
    # grid move with u and b (not differentiated, ~0.5% of those weights'
    # gradients): `test_tabulated_matches_exact` checks it at its accuracy.
    cases = {
        "units4": lambda v, d, **kw: MonotonicSoftmax(
            v, num_units=4, init_range=3.0, grid_size=None, **kw),
        "units4_tabulated": lambda v, d, **kw: MonotonicSoftmax(
            v, num_units=4, init_range=3.0, **kw),
    }

    def test_gradients_finite_difference(self, case):
        if case == "units4_tabulated":
            pytest.skip("the grid moves with u and b: test_tabulated_matches_exact")
        super().test_gradients_finite_difference(case)


@pytest.mark.parametrize("compiled", [False, True])
# JAX under `-m slow` (6 s; no JAX-specific path).
@slow_on("jax")
def test_tabulated_matches_exact(compiled):
    """The default grid (4096 points) vs the K sigmoids at every score, with
    trained-looking weights: log-probabilities to 2e-5, every gradient to
    1% of its largest entry."""
    rng = np.random.default_rng(0)
    h = rng.normal(size=(6, 9, 12)).astype("float32")
    y = rng.integers(0, 50, size=(6, 9))
    heads = [MonotonicSoftmax(50, grid_size=g) for g in (None, 4096)]
    for head in heads:
        head(h)
    randomise(heads[0])
    heads[0].kernel.assign(heads[0].kernel * 5.0)  # scores over [-20, 20]
    heads[1].set_weights(heads[0].get_weights())
    call = jit if compiled else (lambda f: f)
    exact, table = (to_numpy(call(lambda h, m=m: m(h))(h)) for m in heads)
    np.testing.assert_allclose(table, exact, atol=2e-5)
    grads = []
    for head in heads:
        _, (dh,), dw = value_and_grad(
            lambda x, m=head: keras.ops.mean(m.training_loss(x, y)), [h],
            head.trainable_weights)
        grads.append([dh] + list(dw))
    for e, t in zip(*grads):
        np.testing.assert_allclose(t, e, atol=1e-2 * np.abs(e).max())


def test_numpy_reference():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(5, 7, 8)).astype("float32")
    head = MonotonicSoftmax(11, num_units=5, bias_initializer="random_normal")
    head(h)
    randomise(head)
    out = to_numpy(head(h))
    z = h.astype("float64") @ to_numpy(head.kernel) + to_numpy(head.bias)
    f = numpy_mlp(
        z,
        *(to_numpy(w) for w in head.function_parameters()),
    )
    np.testing.assert_allclose(out, numpy_log_softmax(f), atol=1e-5)
    np.testing.assert_allclose(np.exp(out).sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(to_numpy(jit(lambda h: head(h))(h)), out, atol=2e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_custom_gradient_matches_autodiff(compiled):
    """The memory-saving custom gradient equals autodiff of the naive
    `[..., K]` broadcast (float64 on TensorFlow, all inputs), eagerly and
    compiled (`backends.jit`)."""
    rng = np.random.default_rng(1)
    z = (rng.normal(size=(3, 4, 5)) * 3).astype(DTYPE)
    params = [rng.normal(size=(6,)).astype(DTYPE) for _ in range(3)]
    w = rng.normal(size=(3, 4, 5)).astype(DTYPE)

    def naive(z, raw_u, b, raw_v):
        s = ops.sigmoid(ops.softplus(raw_u) * z[..., None] + b)
        return ops.sum(ops.softplus(raw_v) * s, -1)

    def ours(*args):
        return ops.sum(ops.multiply(monotonic_mlp(*args), w))

    def ref(*args):
        return ops.sum(ops.multiply(naive(*args), w))

    if compiled:
        ours, ref = jit(ours), jit(ref)
    value, grads, _ = value_and_grad(ours, [z] + params)
    ref_value, ref_grads, _ = value_and_grad(ref, [z] + params)
    rtol, atol = (1e-10, 1e-12) if DTYPE == "float64" else (1e-5, 1e-5)
    np.testing.assert_allclose(value, ref_value, rtol=rtol)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision(policy):
    rng = np.random.default_rng(4)
    h = rng.normal(size=(3, 4)).astype("float32")
    y = rng.integers(0, 9, size=(3,))
    reference = MonotonicSoftmax(9, num_units=4, init_range=3.0)
    reference(h)
    keras.config.set_dtype_policy(policy)
    head = MonotonicSoftmax(9, num_units=4, init_range=3.0)
    head(h)
    head.set_weights(reference.get_weights())
    assert keras.backend.standardize_dtype(head.hidden_biases.dtype) == "float32"
    out, ll = head(h), head.log_likelihood(h, y)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    assert keras.backend.standardize_dtype(ll.dtype) == "float32"
    tol = 0.05 if policy == "mixed_bfloat16" else 0.01
    np.testing.assert_allclose(to_numpy(out), to_numpy(reference(h)), atol=tol)
    _, _, grads = value_and_grad(
        lambda h: ops.sum(head.training_loss(h, y)), [h], head.trainable_weights
    )
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_monotone_and_preserves_argmax():
    head = MonotonicSoftmax(40, num_units=8, bias_initializer="random_normal")
    rng = np.random.default_rng(2)
    h = rng.normal(size=(64, 6)).astype("float32")
    head(h)
    randomise(head, seed=3)
    grid = np.linspace(-30, 30, 20001)
    f = numpy_mlp(
        grid,
        *(to_numpy(w) for w in head.function_parameters()),
    )
    inside = np.abs(grid) < 8  # outside, float64 sigmoids saturate to equality
    assert np.all(np.diff(f) >= 0)
    assert np.all(np.diff(f[inside]) > 0)
    f_ours = to_numpy(head.score_transform(grid.astype("float32")))
    np.testing.assert_allclose(f_ours, f, atol=1e-4)
    np.testing.assert_array_equal(
        np.argmax(to_numpy(head(h)), -1), np.argmax(to_numpy(head.logits(h)), -1)
    )


def test_initialisation_is_close_to_a_shifted_identity():
    head = MonotonicSoftmax(5, num_units=64, init_range=10.0)
    head.build((None, 3))
    x = np.linspace(-5, 5, 101).astype("float32")
    f = to_numpy(head.score_transform(x))
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
    assert config["parameter_scale"] == 0.05
    assert MonotonicSoftmax.from_config(config).get_config() == config


def test_parameter_scale_keeps_the_function_and_scales_its_gradients():
    """The stored weights are f's parameters / scale: the same f, and the
    gradient of every stored weight is `scale` times that of the plain
    parameterisation (their SGD step `scale**2` times)."""
    x = np.random.default_rng(0).normal(size=(3, 5)).astype("float32")
    y = np.array([1, 4, 7])
    heads = [MonotonicSoftmax(9, num_units=4, parameter_scale=s) for s in (1.0, 0.05)]
    for head in heads:
        head.build((None, 5))
    heads[1].kernel.assign(heads[0].kernel)
    heads[1].bias.assign(heads[0].bias)
    outs = [to_numpy(h(x)) for h in heads]
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5)
    grads = []
    for head in heads:
        _, _, g = value_and_grad(lambda: keras.ops.mean(head.training_loss(x, y)),
                                 variables=head.trainable_weights[2:])
        grads.append(g)
    for plain, scaled in zip(*grads):
        np.testing.assert_allclose(scaled, 0.05 * plain, rtol=1e-4, atol=1e-8)
    # A config written before parameter_scale existed holds unscaled weights.
    legacy = {k: v for k, v in heads[0].get_config().items() if k != "parameter_scale"}
    assert MonotonicSoftmax.from_config(legacy).parameter_scale == 1.0


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), "0.1", True])
def test_bad_parameter_scale(scale):
    with pytest.raises(ValueError, match="Received: parameter_scale="):
        MonotonicSoftmax(10, parameter_scale=scale)


@pytest.mark.parametrize("num_units", [0, -2, 2.5, True, "4", None])
def test_bad_num_units(num_units):
    with pytest.raises(ValueError, match="Received: num_units="):
        MonotonicSoftmax(10, num_units=num_units)


@pytest.mark.parametrize("init_range", [0.0, -1.0, float("nan"), "3"])
def test_bad_init_range(init_range):
    with pytest.raises(ValueError, match="Received: init_range="):
        MonotonicSoftmax(10, init_range=init_range)


def test_interpolate_table_reference_and_gradients():
    """`functional.interpolate_table` vs `np.interp` inside the grid, linear
    extension outside, and its custom gradients vs autodiff of the same
    interpolation written with a one-hot matrix."""
    from keras_softmax_heads import functional

    rng = np.random.default_rng(0)
    table = np.sort(rng.normal(size=9)).astype("float32")
    grid = np.linspace(-2.0, 2.0, 9)
    z = rng.uniform(-3.0, 3.0, size=(4, 7)).astype("float32")
    out = to_numpy(functional.interpolate_table(z, table, -2.0, 4.0))
    inside = np.abs(z) <= 2.0
    np.testing.assert_allclose(out[inside], np.interp(z[inside], grid, table), atol=1e-6)
    slope_lo, slope_hi = (table[1] - table[0]) / 0.5, (table[-1] - table[-2]) / 0.5
    below, above = z < -2.0, z > 2.0
    np.testing.assert_allclose(out[below], table[0] + slope_lo * (z[below] + 2.0), atol=1e-5)
    np.testing.assert_allclose(out[above], table[-1] + slope_hi * (z[above] - 2.0), atol=1e-5)

    weights = rng.normal(size=z.shape).astype("float32")
    idx = np.clip(np.floor((z + 2.0) / 0.5), 0, 7).astype(int)
    frac = ((z + 2.0) / 0.5 - idx).astype("float32")
    left = np.eye(9, dtype="float32")[idx]
    right = np.eye(9, dtype="float32")[idx + 1]

    def dense(x, t):
        # The same interpolant with the grid position of the scores held fixed.
        ops = keras.ops
        f = ops.convert_to_tensor(frac) + (x - ops.stop_gradient(x)) / 0.5
        lt = ops.matmul(ops.convert_to_tensor(left), t)
        rt = ops.matmul(ops.convert_to_tensor(right), t)
        return ops.sum((lt + (rt - lt) * f) * ops.convert_to_tensor(weights))

    _, got, _ = value_and_grad(
        lambda x, t: keras.ops.sum(functional.interpolate_table(x, t, -2.0, 4.0)
                                   * keras.ops.convert_to_tensor(weights)),
        [z, table])
    _, want, _ = value_and_grad(dense, [z, table])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
