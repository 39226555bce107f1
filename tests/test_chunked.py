"""Chunked exact losses (`keras_softmax_heads.chunked`) against the dense path.

Every comparison checks the loss *and* every gradient (inputs, kernel, bias,
transform parameters) against `log_softmax(g(h W + b))` gathered at the
targets, computed densely with TensorFlow autodiff on the same float32 values.
"""

import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from battery import HeadBattery

import keras_softmax_heads as ksh
from keras_softmax_heads import functional
from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import chunked_mixture_nll
from keras_softmax_heads.chunked import chunked_pointwise_nll
from keras_softmax_heads.chunked import tile_width
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead

RTOL = 1e-5


def assert_close(actual, expected, rtol=RTOL, name=""):
    """Equal to `rtol` relative to the largest magnitude of `expected`."""
    actual = np.asarray(tf.cast(tf.convert_to_tensor(actual), tf.float64))
    expected = np.asarray(tf.cast(tf.convert_to_tensor(expected), tf.float64))
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"non-finite values in {name}"
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    np.testing.assert_allclose(
        actual, expected, rtol=rtol, atol=rtol * scale, err_msg=name
    )


# --------------------------------------------------------------- transforms
KNOT_BOUND = 3.0


def plif_fn(z, raw_slopes):
    return functional.plif(z, raw_slopes, KNOT_BOUND)


def monotonic_mlp_fn(z, a, b, c):
    """A small monotonic MLP `z + sum_j softplus(a_j) tanh(softplus(b_j) z + c_j)`."""
    hidden = tf.tanh(tf.nn.softplus(b) * z[..., None] + c)
    return z + tf.reduce_sum(tf.nn.softplus(a) * hidden, axis=-1)


def make_transform(name, rng):
    """`(transform_fn, params)` for the chunked call and the dense reference."""
    if name == "identity":
        return None, []
    if name == "sigsoftmax":
        return (lambda z: functional.log_sigmoid_scores(z)), []
    if name == "plif":
        return plif_fn, [tf.constant(rng.normal(size=(7,)), tf.float32)]
    if name == "mlp":
        return monotonic_mlp_fn, [
            tf.constant(rng.normal(size=(3,)), tf.float32) for _ in range(3)
        ]
    raise ValueError(name)


# ----------------------------------------------------------------- problems
def problem(n=13, d=6, v=37, scale=1.0, seed=0, ties=False, dtype=tf.float32):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(n, d))
    kernel = rng.normal(size=(d, v)) * scale
    bias = rng.normal(size=(v,))
    if ties:  # identical columns (and biases) for a block of words
        kernel[:, 5:12] = kernel[:, 5:6]
        bias[5:12] = bias[5]
    targets = rng.integers(0, v, size=(n,))
    if ties:
        targets[: n // 2] = rng.integers(5, 12, size=(n // 2,))
    weights = rng.normal(size=(n,))  # per-row upstream gradients, any sign
    weights[0] = 0.0
    cast = lambda x: tf.constant(x, dtype)  # noqa: E731
    return (
        cast(h),
        cast(kernel),
        cast(bias),
        tf.constant(targets, tf.int32),
        tf.constant(weights, tf.float32),
    )


def dense_nll(h, kernel, bias, targets, transform_fn, params, transposed=False):
    w = tf.transpose(kernel) if transposed else kernel
    z = tf.matmul(h, w)
    if bias is not None:
        z = z + bias
    g = z if transform_fn is None else transform_fn(z, *params)
    return -tf.gather(tf.nn.log_softmax(g), targets, batch_dims=1)


def loss_and_grads(fn, sources, weights, mode="eager"):
    def run(*sources):
        with tf.GradientTape() as tape:
            tape.watch(list(sources))
            nll = fn(*sources)
            total = tf.reduce_sum(tf.cast(nll, tf.float32) * weights)
        return nll, tape.gradient(total, list(sources))

    if mode != "eager":
        run = tf.function(run, jit_compile=mode == "xla")
    return run(*sources)


def compare(h, kernel, bias, targets, weights, transform, params, chunk_size,
            transposed=False, mode="eager", rtol=RTOL):
    has_bias = bias is not None

    def unpack(args):
        h, kernel = args[0], args[1]
        b = args[2] if has_bias else None
        return h, kernel, b, list(args[2 + int(has_bias):])

    def chunked(*args):
        h, k, b, p = unpack(args)
        return chunked_pointwise_nll(
            h, k, b, targets, transform, p, chunk_size=chunk_size,
            kernel_transposed=transposed,
        )

    def dense(*args):
        h, k, b, p = unpack(args)
        return dense_nll(h, k, b, targets, transform, p, transposed)

    sources = [h, kernel] + ([bias] if has_bias else []) + list(params)
    nll, grads = loss_and_grads(chunked, sources, weights, mode)
    ref, ref_grads = loss_and_grads(dense, sources, weights)
    assert nll.dtype == tf.float32
    assert_close(nll, ref, rtol, "nll")
    names = ["h", "kernel"] + (["bias"] if has_bias else [])
    names += [f"param{i}" for i in range(len(params))]
    for name, g, r in zip(names, grads, ref_grads):
        assert g is not None, f"no gradient for {name}"
        assert_close(g, r, rtol, f"gradient of {name}")
    return nll, grads


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "transform,use_bias,chunk_size",
    [(t, True, 8) for t in ["identity", "sigsoftmax", "plif", "mlp"]]
    + [(t, False, 1) for t in ["identity", "sigsoftmax", "plif", "mlp"]]
    + [("identity", True, 64), ("plif", False, 64)],
)
def test_matches_dense(transform, use_bias, chunk_size):
    """N=13 and V=37 are not multiples of 8 (4 tiles + a remainder of 5);
    1 is one word per tile; 64 > V is clamped to a single tile."""
    h, kernel, bias, targets, weights = problem()
    fn, params = make_transform(transform, np.random.default_rng(1))
    compare(h, kernel, bias if use_bias else None, targets, weights, fn,
            params, chunk_size)


@pytest.mark.parametrize("transform", ["identity", "plif"])
@pytest.mark.parametrize("transposed", [False, True])
def test_divisor_tiles(transform, transposed):
    """V=36, chunk_size=8: tiles of 6 (a divisor of V), nothing masked."""
    assert tile_width(36, 8) == 6 and tile_width(37, 8) == 8
    h, kernel, bias, targets, weights = problem(v=36, seed=11)
    fn, params = make_transform(transform, np.random.default_rng(1))
    if transposed:
        kernel = tf.transpose(kernel)
    compare(h, kernel, bias, targets, weights, fn, params, chunk_size=8,
            transposed=transposed)


def test_tile_width():
    assert tile_width(100_000, 4096) == 4000
    assert tile_width(793_471, 4096) == 3017  # 7 * 431
    assert tile_width(50_257, 4096) == 4096  # 29 * 1733: masked last tile
    assert tile_width(100, 4096) == 100
    assert tile_width(13, 5) == 5 and tile_width(7, 2) == 1


@pytest.mark.parametrize("transform,mode", [("identity", "graph"), ("plif", "xla")])
def test_compiled(transform, mode):
    h, kernel, bias, targets, weights = problem(n=9, v=29)
    fn, params = make_transform(transform, np.random.default_rng(1))
    compare(h, kernel, bias, targets, weights, fn, params, chunk_size=8,
            mode=mode)


@pytest.mark.parametrize("transform", ["identity", "sigsoftmax", "plif"])
def test_large_logits(transform):
    """|logit| ~ 1e3: the online log-sum-exp must not overflow."""
    h, kernel, bias, targets, weights = problem(scale=300.0, seed=2)
    z = np.asarray(h @ kernel)
    assert np.abs(z).max() > 1e3
    fn, params = make_transform(transform, np.random.default_rng(1))
    if transform == "plif":  # knots where the scores are
        fn = lambda z, s: functional.plif(z, s, 2000.0)  # noqa: E731
    nll, _ = compare(h, kernel, bias, targets, weights, fn, params, chunk_size=8)
    assert np.all(np.asarray(nll) >= 0)


@pytest.mark.parametrize("transform", ["identity", "plif"])
def test_ties(transform):
    """Identical columns: equal scores in and across tiles, targets among them."""
    h, kernel, bias, targets, weights = problem(ties=True, seed=3)
    fn, params = make_transform(transform, np.random.default_rng(1))
    compare(h, kernel, bias, targets, weights, fn, params, chunk_size=4)


def test_all_scores_equal():
    h, kernel, bias, targets, weights = problem(seed=4)
    kernel = tf.zeros_like(kernel)
    nll, _ = compare(h, kernel, tf.zeros_like(bias), targets, weights, None, [], 8)
    np.testing.assert_allclose(np.asarray(nll), np.log(37.0), rtol=1e-6)


@pytest.mark.parametrize("transform", ["identity", "sigsoftmax"])
def test_tied_layout(transform):
    """`kernel_transposed=True` takes the `[V, d]` embedding matrix as is."""
    h, kernel, bias, targets, weights = problem(seed=5)
    embeddings = tf.transpose(kernel)
    fn, params = make_transform(transform, np.random.default_rng(1))
    compare(h, embeddings, bias, targets, weights, fn, params, chunk_size=8,
            transposed=True)
    compare(h, embeddings, None, targets, weights, fn, params, chunk_size=8,
            transposed=True, mode="xla" if transform == "identity" else "graph")


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_low_precision_inputs(dtype):
    """bf16 / fp16 inputs: same as the float32 dense path on the rounded values."""
    h, kernel, bias, targets, weights = problem(seed=6, dtype=dtype)
    fn, params = make_transform("plif", np.random.default_rng(1))
    sources = [h, kernel, bias] + params

    def chunked(h, k, b, *p):
        return chunked_pointwise_nll(h, k, b, targets, fn, p, chunk_size=8)

    nll, grads = loss_and_grads(chunked, sources, weights)
    assert nll.dtype == tf.float32
    assert [g.dtype for g in grads] == [s.dtype for s in sources]
    rounded = [tf.cast(s, tf.float32) for s in sources]

    def dense(h, k, b, *p):
        return dense_nll(h, k, b, targets, fn, p)

    ref, ref_grads = loss_and_grads(dense, rounded, weights)
    assert_close(nll, ref, RTOL, "nll")
    # The gradients are accumulated in float32 and rounded once to `dtype`.
    eps = float(np.finfo(np.float16).eps) if dtype == tf.float16 else 2.0**-8
    for name, g, r in zip(["h", "kernel", "bias", "slopes"], grads, ref_grads):
        expected = tf.cast(tf.cast(r, g.dtype), tf.float32) if g.dtype != r.dtype else r
        assert_close(g, expected, 2 * eps, f"gradient of {name}")


def test_float64():
    h, kernel, bias, targets, weights = problem(seed=7, dtype=tf.float64)
    nll = chunked_pointwise_nll(h, kernel, bias, targets, chunk_size=8)
    assert nll.dtype == tf.float64
    ref = dense_nll(h, kernel, bias, targets, None, [])
    np.testing.assert_allclose(np.asarray(nll), np.asarray(ref), rtol=1e-12)


def test_variables_as_inputs_and_read_inside_transform():
    """Keras variables as kernel / bias / explicit params, and a transform that
    reads a variable itself (the way a head's `score_transform` does)."""
    h, kernel, bias, targets, weights = problem(seed=8)
    rng = np.random.default_rng(9)
    kernel_var = keras.Variable(np.asarray(kernel), name="kernel")
    bias_var = keras.Variable(np.asarray(bias), name="bias")
    slopes_var = keras.Variable(rng.normal(size=(7,)).astype("float32"), name="slopes")
    mlp_vars = [
        keras.Variable(rng.normal(size=(3,)).astype("float32")) for _ in range(3)
    ]
    variables = [kernel_var, bias_var, slopes_var] + mlp_vars

    def transform(z, *mlp_params):  # slopes read from the variable directly
        return monotonic_mlp_fn(plif_fn(z, slopes_var), *mlp_params)

    def step(chunked):
        with tf.GradientTape() as tape:
            if chunked:
                nll = chunked_pointwise_nll(
                    h, kernel_var, bias_var, targets, transform, mlp_vars,
                    chunk_size=8,
                )
            else:
                nll = dense_nll(
                    h, kernel_var, bias_var, targets, transform,
                    [v.value for v in mlp_vars],
                )
            total = tf.reduce_sum(nll * weights)
        return nll, tape.gradient(total, [v.value for v in variables])

    ref, ref_grads = step(False)
    for mode in ["eager", "xla"]:
        fn = step if mode == "eager" else tf.function(
            step, jit_compile=mode == "xla"
        )
        nll, grads = fn(True)
        assert_close(nll, ref, RTOL, f"nll ({mode})")
        for i, (g, r) in enumerate(zip(grads, ref_grads)):
            assert g is not None, f"no gradient for variable {i} ({mode})"
            assert_close(g, r, RTOL, f"gradient of variable {i} ({mode})")


def test_leading_dims_and_shapes():
    h, kernel, bias, targets, _ = problem(n=12, seed=10)
    nll = chunked_pointwise_nll(
        tf.reshape(h, [3, 4, 6]), kernel, bias, tf.reshape(targets, [3, 4]),
        chunk_size=8,
    )
    assert tuple(nll.shape) == (3, 4)
    ref = dense_nll(h, kernel, bias, targets, None, [])
    assert_close(tf.reshape(nll, [-1]), ref, RTOL, "nll")


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True, "8"])
def test_bad_chunk_size(chunk_size):
    h, kernel, bias, targets, _ = problem()
    with pytest.raises(ValueError, match="Received: chunk_size"):
        chunked_pointwise_nll(h, kernel, bias, targets, chunk_size=chunk_size)


def test_bad_shapes():
    h, kernel, bias, targets, _ = problem()
    with pytest.raises(ValueError, match="targets"):
        chunked_pointwise_nll(h, kernel, bias, targets[:5], chunk_size=8)
    with pytest.raises(ValueError, match="d=6"):
        chunked_pointwise_nll(h[:, :4], kernel, bias, targets, chunk_size=8)


def _largest_array(fn, *args):
    """Elements of the largest f32 array in the XLA program of `fn`."""
    hlo = tf.function(fn, jit_compile=True).experimental_get_compiler_ir(*args)(
        stage="hlo"
    )
    sizes = [
        int(np.prod([int(x) for x in dims.split(",") if x]))
        for dims in re.findall(r"f32\[([\d,]*)\]", hlo)
    ]
    return max(sizes)


def test_no_tensor_of_size_tokens_times_vocabulary():
    """The compiled forward + backward program (while-loop bodies included)
    holds no [N, V] array: the largest ones are the kernel, its gradient and
    [N, chunk] tiles. The same probe finds [N, V] in the dense program."""
    n, d, v, chunk = 64, 8, 1000, 128
    h, kernel, bias, targets, weights = problem(n=n, d=d, v=v)

    def step(loss_fn):
        def run(h, kernel, bias):
            with tf.GradientTape() as tape:
                tape.watch([h, kernel, bias])
                total = tf.reduce_sum(loss_fn(h, kernel, bias))
            return tape.gradient(total, [h, kernel, bias])

        return run

    chunked = step(
        lambda h, k, b: chunked_pointwise_nll(h, k, b, targets, chunk_size=chunk)
    )
    dense = step(lambda h, k, b: dense_nll(h, k, b, targets, None, []))
    assert _largest_array(dense, h, kernel, bias) >= n * v
    padded = -(-v // chunk) * chunk  # the stacked kernel-gradient tiles
    assert _largest_array(chunked, h, kernel, bias) <= max(d * padded, n * chunk)


# ------------------------------------------------------------------ mixture
def mixture_problem(n=11, k=3, d=5, v=23, seed=0):
    rng = np.random.default_rng(seed)
    latents = tf.constant(np.tanh(rng.normal(size=(n, k, d))), tf.float32)
    prior_logits = tf.constant(rng.normal(size=(n, k)), tf.float32)
    kernel = tf.constant(rng.normal(size=(d, v)), tf.float32)
    bias = tf.constant(rng.normal(size=(v,)), tf.float32)
    targets = tf.constant(rng.integers(0, v, size=(n,)), tf.int32)
    weights = tf.constant(rng.normal(size=(n,)), tf.float32)
    return latents, prior_logits, kernel, bias, targets, weights


def dense_mixture_nll(latents, log_priors, kernel, bias, targets, fn, params):
    z = tf.einsum("nkd,dv->nkv", latents, kernel) + bias
    g = z if fn is None else fn(z, *params)
    log_p = tf.reduce_logsumexp(log_priors[..., None] + tf.nn.log_softmax(g), axis=1)
    return -tf.gather(log_p, targets, batch_dims=1)


@pytest.mark.parametrize(
    "transform,mode",
    [
        ("identity", "eager"),
        ("sigsoftmax", "eager"),
        ("plif", "eager"),
        ("plif", "xla"),
    ],
)
def test_mixture_matches_dense(transform, mode):
    latents, prior_logits, kernel, bias, targets, weights = mixture_problem()
    fn, params = make_transform(transform, np.random.default_rng(1))

    def make(chunked):
        def nll(latents, prior_logits, kernel, bias, *params):
            log_priors = tf.nn.log_softmax(prior_logits)
            if chunked:
                return chunked_mixture_nll(
                    latents, log_priors, kernel, bias, targets, fn, params,
                    chunk_size=7,
                )
            return dense_mixture_nll(
                latents, log_priors, kernel, bias, targets, fn, params
            )

        return nll

    sources = [latents, prior_logits, kernel, bias] + params
    out, grads = loss_and_grads(make(True), sources, weights, mode)
    ref, ref_grads = loss_and_grads(make(False), sources, weights)
    assert_close(out, ref, RTOL, "mixture nll")
    names = ["latents", "prior_logits", "kernel", "bias", "slopes"]
    for name, g, r in zip(names, grads, ref_grads):
        assert_close(g, r, RTOL, f"gradient of {name}")


def test_mixture_tied_layout_and_leading_dims():
    latents, prior_logits, kernel, bias, targets, _ = mixture_problem(n=12)
    log_priors = tf.nn.log_softmax(prior_logits)
    out = chunked_mixture_nll(
        tf.reshape(latents, [3, 4, 3, 5]), tf.reshape(log_priors, [3, 4, 3]),
        tf.transpose(kernel), None, tf.reshape(targets, [3, 4]), chunk_size=5,
        kernel_transposed=True,
    )
    assert tuple(out.shape) == (3, 4)
    ref = dense_mixture_nll(latents, log_priors, kernel, 0.0, targets, None, [])
    assert_close(tf.reshape(out, [-1]), ref, RTOL, "mixture nll")


def test_mixture_of_softmaxes_head_inputs():
    """Fed with `MixtureOfSoftmaxes`' own priors / latents, the chunked mixture
    equals the head's exact log-likelihood (all three component variants)."""
    mixture = pytest.importorskip("keras_softmax_heads.heads.mixture_of_softmaxes")
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 5, 6)).astype("float32")
    y = rng.integers(0, 17, size=(2, 5))
    variants = [{}, {"component": "sigsoftmax"}, {"num_knots": 6, "knot_bound": 2.0}]
    for kwargs in variants:
        head = mixture.MixtureOfSoftmaxes(17, num_components=3, **kwargs)
        head(h)
        for w in head.weights:
            w.assign(w.numpy() + 0.3 * rng.normal(size=w.shape).astype("float32"))
        try:
            log_priors, latents = head._priors_and_latents(h, False)
        except AttributeError:
            pytest.skip("MixtureOfSoftmaxes internals changed")
        fn, params = None, []
        if head.raw_slopes is not None:
            fn = lambda z, s: functional.plif(z, s, head.knot_bound)  # noqa: E731
            params = [head.raw_slopes]
        if head.component == "sigsoftmax":
            inner = fn
            fn = lambda z, *p: functional.log_sigmoid_scores(  # noqa: E731
                z if inner is None else inner(z, *p)
            )
        nll = chunked_mixture_nll(
            latents, log_priors, head.kernel, head.bias, y, fn, params,
            chunk_size=5,
        )
        ref = -np.asarray(head.log_likelihood(h, y))
        assert_close(nll, ref, RTOL, f"MixtureOfSoftmaxes {kwargs}")


# -------------------------------------------------------------------- heads
def test_head_chunk_size_validation_and_config():
    for bad in [0, -1, 1.5, True, "4"]:
        with pytest.raises(ValueError, match="Received: chunk_size"):
            ksh.FullSoftmax(10, chunk_size=bad)
    head = ksh.FullSoftmax(10, chunk_size=4)
    assert head.get_config()["chunk_size"] == 4
    assert ksh.FullSoftmax(10).get_config()["chunk_size"] is None
    clone = ksh.FullSoftmax.from_config(head.get_config())
    assert clone.chunk_size == 4


def _twin_heads(make, h, seed=0):
    """A dense head and a chunked head with identical (random) weights."""
    dense, chunked = make(None), make(5)
    dense(h)
    chunked(h)
    rng = np.random.default_rng(seed)
    for w in dense.weights:
        w.assign((w.numpy() + 0.3 * rng.normal(size=w.shape)).astype(w.dtype))
    chunked.set_weights(dense.get_weights())
    return dense, chunked


def _head_loss_and_grads(head, h, y, weights, variables=None):
    with tf.GradientTape() as tape:
        tape.watch(h)
        loss = head.training_loss(h, y)
        total = tf.reduce_sum(loss * weights)
    variables = head.trainable_weights if variables is None else variables
    return loss, tape.gradient(total, [h] + list(variables))


@pytest.mark.parametrize("use_bias", [True, False])
def test_full_softmax_head_matches_dense(use_bias):
    h = tf.constant(np.random.default_rng(1).normal(size=(3, 4, 6)), tf.float32)
    y = np.random.default_rng(2).integers(0, 13, size=(3, 4))
    weights = np.random.default_rng(3).normal(size=(3, 4)).astype("float32")
    dense, chunked = _twin_heads(
        lambda c: ksh.FullSoftmax(13, use_bias=use_bias, chunk_size=c), h
    )
    loss, grads = _head_loss_and_grads(chunked, h, y, weights)
    ref, ref_grads = _head_loss_and_grads(dense, h, y, weights)
    assert tuple(loss.shape) == (3, 4)
    assert_close(loss, ref, RTOL, "loss")
    assert_close(-chunked.log_likelihood(h, y), ref, RTOL, "log_likelihood")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, RTOL, "gradient")
    # `call` still returns the full distribution.
    assert tuple(chunked(h).shape) == (3, 4, 13)


def test_tied_head_matches_dense():
    emb = keras.layers.Embedding(13, 6, embeddings_initializer="normal")
    emb.build((None,))
    h = tf.constant(np.random.default_rng(1).normal(size=(7, 6)), tf.float32)
    y = np.random.default_rng(2).integers(0, 13, size=(7,))
    weights = np.ones((7,), "float32")
    dense = ksh.FullSoftmax(token_embedding=emb, use_bias=False)
    chunked = ksh.FullSoftmax(token_embedding=emb, use_bias=False, chunk_size=4)
    loss, grads = _head_loss_and_grads(chunked, h, y, weights, [emb.embeddings])
    ref, ref_grads = _head_loss_and_grads(dense, h, y, weights, [emb.embeddings])
    assert_close(loss, ref, RTOL, "loss")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, RTOL, "gradient")


def test_head_invalid_targets():
    head = ksh.FullSoftmax(13, chunk_size=5)
    h = np.zeros((2, 6), "float32")
    with pytest.raises(tf.errors.InvalidArgumentError, match="vocab_size"):
        head.training_loss(h, np.array([0, 13]))
    jitted = tf.function(head.training_loss, jit_compile=True)
    out = np.asarray(jitted(h, np.array([0, 13])))
    assert np.isfinite(out[0]) and np.isnan(out[1])


def _pointwise_head_classes():
    """The concrete `PointwiseSoftmaxHead` subclasses of the package, one per
    distinct (`score_transform`, `word_major` layout) pair: heads that differ
    only in their training objective (sampled softmax, NCE) share the exact
    chunked path of their parent and are not repeated."""
    import keras_softmax_heads.heads as heads_pkg

    found = {}
    for info in pkgutil.iter_modules(heads_pkg.__path__):
        module = importlib.import_module(f"keras_softmax_heads.heads.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(cls, PointwiseSoftmaxHead)
                and cls is not PointwiseSoftmaxHead
                and not name.startswith("_")
            ):
                found[f"{cls.__module__}.{name}"] = cls
    distinct = {}
    for key in sorted(found, key=lambda k: (len(found[k].__mro__), k)):
        cls = found[key]
        distinct.setdefault((cls.score_transform, cls.word_major), cls)
    return sorted(distinct.values(), key=lambda c: c.__name__)


class _PLIFTestHead(PointwiseSoftmaxHead):
    """A PLIF head defined here (with its own trainable slopes read inside
    `score_transform`), so the head-level chunked path with a transform that
    owns weights is tested whatever the state of the library's PLIF head."""

    def build_head(self, input_shape):
        self.raw_slopes = self.add_weight(
            name="raw_slopes", shape=(7,), initializer="random_normal"
        )

    def score_transform(self, z):
        return functional.plif(z, self.raw_slopes, KNOT_BOUND)


def _head_ll_and_grads(head, h, y, weights):
    with tf.GradientTape() as tape:
        tape.watch(h)
        ll = head.log_likelihood(h, y)
        total = tf.reduce_sum(ll * tf.cast(weights, ll.dtype))
    grads = tape.gradient(total, [h] + list(head.trainable_weights))
    return [ll] + [tf.convert_to_tensor(g) if g is not None else None for g in grads]


def _make_head(cls, chunk_size):
    try:
        return cls(13, chunk_size=chunk_size)
    except (TypeError, ValueError):  # e.g. a head that needs word counts
        return cls(13, chunk_size=chunk_size, counts=np.arange(13, 0, -1))


def _head_results(cls, values, chunk_size, dtype, mode="eager"):
    """`[log_likelihood, d/dh, d/dweights...]` of a fresh head in `dtype`."""
    keras.config.set_dtype_policy(dtype)
    rng = np.random.default_rng(1)
    h = tf.constant(rng.normal(size=(9, 6)), dtype)
    y = rng.integers(0, 13, size=(9,))
    weights = rng.normal(size=(9,))
    head = _make_head(cls, chunk_size)
    head(h)
    for w, x in zip(head.weights, values):
        w.assign(np.asarray(x).astype(w.dtype))
    if mode == "xla":
        fn = tf.function(
            lambda h: _head_ll_and_grads(head, h, y, weights), jit_compile=True
        )
        out = fn(h)
    else:
        out = _head_ll_and_grads(head, h, y, weights)
    names = ["log_likelihood", "h"] + [w.path for w in head.trainable_weights]
    as_numpy = [None if x is None else np.asarray(tf.cast(x, tf.float64)) for x in out]
    return names, as_numpy


def _xla_in_default_run(cls):
    """XLA compilation of every head's loops is slow on 2 cores: the default
    run compiles FullSoftmax and the PLIF test head (a transform with its own
    weights); `pytest -m slow` compiles all of them."""
    if cls in (_PLIFTestHead,) or cls.__name__ == "FullSoftmax":
        return ["eager", "xla"]
    return ["eager"]


_HEAD_CASES = [
    pytest.param(cls, modes, id=f"{cls.__name__}-{'-'.join(modes)}")
    for cls in _pointwise_head_classes() + [_PLIFTestHead]
    for modes in [_xla_in_default_run(cls)]
] + [
    pytest.param(cls, ["xla"], id=f"{cls.__name__}-xla", marks=pytest.mark.slow)
    for cls in _pointwise_head_classes()
    if "xla" not in _xla_in_default_run(cls)
]


@pytest.mark.parametrize("cls,modes", _HEAD_CASES)
def test_pointwise_heads_chunked_matches_dense(cls, modes):
    """Every pointwise head of the package (FullSoftmax, sigsoftmax, PLIF,
    monotonic, the word-major sampled / self-normalised heads, ... as they
    land): with `chunk_size` the exact log-likelihood and the gradients of all
    weights equal the dense ones.

    In float64 they agree to 1e-9. In float32 (eagerly and under XLA) the
    chunked results must be within 1e-5 (relative to the largest magnitude)
    of the float64 reference, or no further from it than 4x the dense
    float32 path is: some gradients are ill-conditioned in float32 (a PLIF
    with 1e5 knots: every slope's gradient is a suffix sum of
    `softmax - onehot` terms that cancel), and the chunked path only has to
    be as accurate as the dense one there."""
    try:
        probe = _make_head(cls, None)
    except (TypeError, ValueError) as err:
        pytest.skip(f"{cls.__name__}(13, chunk_size=...) failed: {err}")
    probe(np.zeros((1, 6), "float32"))
    rng = np.random.default_rng(0)
    values = [
        w.numpy() if not w.trainable or "int" in str(w.dtype)
        else w.numpy() + 0.3 * rng.normal(size=w.shape)
        for w in probe.weights
    ]
    names, ref = _head_results(cls, values, None, "float64")
    _, chunk64 = _head_results(cls, values, 5, "float64")
    for name, a, r in zip(names, chunk64, ref):
        assert a is not None, f"no gradient for {name}"
        assert_close(a, r, 1e-9, f"{name} (float64)")
    _, dense32 = _head_results(cls, values, None, "float32")
    for mode in modes:
        _, chunk32 = _head_results(cls, values, 5, "float32", mode)
        for name, a, d, r in zip(names, chunk32, dense32, ref):
            assert a is not None, f"no gradient for {name} ({mode})"
            err = float(np.max(np.abs(a - r)))
            dense_err = float(np.max(np.abs(d - r)))
            bound = max(4 * dense_err, 1e-5 * float(np.max(np.abs(r))))
            assert err <= bound, (name, mode, err, dense_err, bound)


class TestChunkedFullSoftmaxBattery(HeadBattery):
    """The whole head battery with the chunked loss (5 does not divide V=13)."""
    avoids_full_scores_in_training = True

    cases = {"chunk5": lambda v, d, **kw: ksh.FullSoftmax(v, chunk_size=5, **kw)}


def _fit_weights(chunk_size, strategy=None):
    """Trains a tiny `HeadModel` for 2 epochs: (weights, loss history, eval)."""
    keras.utils.set_random_seed(0)
    vocab, dim = 13, 6
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        backbone = keras.Sequential([keras.layers.Embedding(vocab, dim)])
        head = ksh.FullSoftmax(vocab, chunk_size=chunk_size)
        model = ksh.HeadModel(backbone, head)
        model.compile(optimizer=keras.optimizers.SGD(0.5), jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(32, 5))
    y = (x * 3 + 1) % vocab
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    logs = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    return model.get_weights(), history.history["loss"], logs["loss"]


def test_head_model_fit_same_as_dense():
    """`fit` / `evaluate` through `HeadModel` give the same losses and weights
    (the battery above covers `jit_compile=True` fitting)."""
    w_dense, hist_dense, eval_dense = _fit_weights(None)
    w_chunk, hist_chunk, eval_chunk = _fit_weights(4)
    np.testing.assert_allclose(hist_chunk, hist_dense, rtol=1e-5)
    np.testing.assert_allclose(eval_chunk, eval_dense, rtol=1e-5)
    for a, b in zip(w_chunk, w_dense):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert hist_dense[-1] < hist_dense[0]


MIRRORED_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    sys.path.insert(0, sys.argv[1])
    import keras
    from test_chunked import _fit_weights

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    weights, hist, ev = _fit_weights(4, strategy)
    print("RESULT " + json.dumps({
        "replicas": strategy.num_replicas_in_sync, "loss": hist, "eval": ev,
        "weights": [w.tolist() for w in weights]}))
    """
)


def test_mirrored_strategy_two_cpus():
    """`fit` under MirroredStrategy over 2 logical CPUs (a fresh process: the
    logical devices must be set before TF initialises) equals the
    single-device dense run: each replica's chunked loss and gradients are
    exact, and the replicas' gradients add up to the full batch's."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", MIRRORED_SCRIPT, os.path.dirname(__file__)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert result["replicas"] == 2
    weights, hist, ev = _fit_weights(None)
    np.testing.assert_allclose(result["loss"], hist, rtol=1e-5)
    np.testing.assert_allclose(result["eval"], ev, rtol=1e-5)
    for a, b in zip(result["weights"], weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_default_chunk_size_is_sane():
    assert isinstance(DEFAULT_CHUNK_SIZE, int) and DEFAULT_CHUNK_SIZE >= 1024


@pytest.mark.slow
def test_tiny_language_model_trains_to_the_same_loss():
    """A tiny GRU LM trained with the dense and the chunked loss, same seed."""
    vocab, dim, length = 300, 32, 12
    rng = np.random.default_rng(0)
    # A Markov chain with a sparse transition matrix: learnable, not trivial.
    nxt = rng.integers(0, vocab, size=(vocab, 3))
    seqs = np.zeros((512, length + 1), "int64")
    seqs[:, 0] = rng.integers(0, vocab, size=512)
    for t in range(length):
        seqs[:, t + 1] = nxt[seqs[:, t], rng.integers(0, 3, size=512)]
    x, y = seqs[:, :-1], seqs[:, 1:]

    def train(chunk_size):
        keras.utils.set_random_seed(0)
        backbone = keras.Sequential(
            [
                keras.layers.Embedding(vocab, dim),
                keras.layers.GRU(dim, return_sequences=True),
            ]
        )
        model = ksh.HeadModel(backbone, ksh.FullSoftmax(vocab, chunk_size=chunk_size))
        model.compile(optimizer=keras.optimizers.Adam(1e-2))
        history = model.fit(x, y, batch_size=64, epochs=8, verbose=0, shuffle=False)
        return history.history["loss"], model.evaluate(x, y, verbose=0)

    dense_hist, dense_eval = train(None)
    chunk_hist, chunk_eval = train(64)
    assert dense_hist[-1] < 0.6 * dense_hist[0]
    np.testing.assert_allclose(chunk_hist, dense_hist, rtol=2e-3)
    np.testing.assert_allclose(chunk_eval, dense_eval, rtol=2e-3)
