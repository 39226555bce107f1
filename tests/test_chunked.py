"""Chunked exact losses (`keras_softmax_heads.chunked`) against the dense path.

Every comparison checks the loss *and* every gradient (inputs, kernel, bias,
transform parameters, mixture weights) against `log_softmax(g(h W + b))`
gathered at the targets: the values against NumPy (float64), the gradients
against the backend's automatic differentiation of the dense formula on the
same values. The module runs on TensorFlow, JAX and PyTorch
(`tests/backends.py`); compiled means `tf.function(jit_compile=True)` /
`jax.jit`.
"""

import contextlib
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
from backends import BACKEND
from backends import jit
from backends import to_numpy
from backends import value_and_grad
from multibackend import float64_enabled
from multibackend import slow_off_tensorflow
from multibackend import sweep
from multibackend import slow_on
from battery import HeadBattery
from keras import ops
from references import numpy_log_sigmoid
from references import numpy_log_softmax
from references import numpy_plif

import keras_softmax_heads as ksh
from keras_softmax_heads import functional
from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import chunked_mixture_nll
from keras_softmax_heads.chunked import chunked_pointwise_nll
from keras_softmax_heads.chunked import tile_width
from keras_softmax_heads.chunked import value_and_vjp
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead

pytestmark = pytest.mark.multibackend

RTOL = 1e-5
TF_ONLY = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow only")
#: On TensorFlow `"auto"` is the `tf.while_loop` fast path; `"ops"` is the
#: `keras.ops` version (the only one elsewhere), checked there too.
IMPLEMENTATIONS = ["auto", "ops"] if BACKEND == "tensorflow" else ["auto"]


def assert_close(actual, expected, rtol=RTOL, name=""):
    """Equal to `rtol` relative to the largest magnitude of `expected`."""
    actual = np.asarray(to_numpy(actual), "float64")
    expected = np.asarray(to_numpy(expected), "float64")
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"non-finite values in {name}"
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    np.testing.assert_allclose(
        actual, expected, rtol=rtol, atol=rtol * scale, err_msg=name
    )


def matmul(a, b):
    """`a @ b` in the inputs' dtype (Keras' PyTorch `matmul` rounds float64
    products to float32)."""
    return ops.einsum("ij,jk->ik", a, b)


# --------------------------------------------------------------- transforms
KNOT_BOUND = 3.0


def plif_ops(z, raw_slopes, knot_bound=KNOT_BOUND):
    """PLIF written with plain `keras.ops` (gathers, automatic gradient), so
    the tests of a transform with parameters do not depend on the library's
    PLIF kernels (`numpy_plif` is its float64 oracle)."""
    num_knots = raw_slopes.shape[0]
    width = 2.0 * knot_bound / num_knots
    slopes = ops.softplus(ops.cast(raw_slopes, z.dtype))
    # Exclusive cumulative sum as a product with a triangular matrix
    # (Keras' PyTorch `cumsum` rounds float64 to float32).
    before = np.triu(np.ones((num_knots, num_knots)), k=1)
    left = -knot_bound + width * ops.einsum(
        "k,kj->j", slopes, ops.convert_to_tensor(before, z.dtype)
    )
    idx = ops.cast(ops.clip((z + knot_bound) / width, 0, num_knots - 1), "int32")
    offset = z - (-knot_bound + width * ops.cast(idx, z.dtype))
    return ops.take(left, idx) + ops.take(slopes, idx) * offset


def monotonic_mlp_fn(z, a, b, c):
    """A small monotonic MLP `z + sum_j softplus(a_j) tanh(softplus(b_j) z + c_j)`
    (tanh as `2 sigmoid(2x) - 1`: Keras' JAX `tanh` rounds float64 to float32)."""
    x = ops.softplus(b) * z[..., None] + c
    hidden = 2.0 * ops.sigmoid(2.0 * x) - 1.0
    return z + ops.sum(ops.softplus(a) * hidden, axis=-1)


def numpy_transform(name, z, params):
    """The float64 oracle of each transform."""
    sp = lambda x: np.logaddexp(0.0, x)  # noqa: E731
    if name == "identity":
        return z
    if name == "sigsoftmax":
        return z + numpy_log_sigmoid(z)
    if name in ("plif", "library_plif"):
        return numpy_plif(z, params[0], KNOT_BOUND)
    if name == "mlp":
        a, b, c = params
        return z + (sp(a) * np.tanh(sp(b) * z[..., None] + c)).sum(-1)
    raise ValueError(name)


def _library_plif_runs():
    """Whether `functional.plif` runs on this backend, compiled too."""
    tensor_type = type(ops.zeros((1,)))
    try:
        out = jit(lambda z, s: functional.plif(z, s, KNOT_BOUND))(
            ops.zeros((2, 3)), ops.zeros((4,))
        )
    except Exception:  # noqa: BLE001 (a TensorFlow-only kernel on this backend)
        return False
    return isinstance(out, tensor_type)


def make_transform(name, rng):
    """`(transform_fn, params)`: params are float64 NumPy arrays."""
    if name == "identity":
        return None, []
    if name == "sigsoftmax":
        return (lambda z: functional.log_sigmoid_scores(z)), []
    if name == "plif":
        return plif_ops, [rng.normal(size=(7,))]
    if name == "library_plif":
        if not _library_plif_runs():
            pytest.skip(f"functional.plif does not run on {BACKEND} yet")
        return (lambda z, s: functional.plif(z, s, KNOT_BOUND)), [rng.normal(size=(7,))]
    if name == "mlp":
        return monotonic_mlp_fn, [rng.normal(size=(3,)) for _ in range(3)]
    raise ValueError(name)


# ----------------------------------------------------------------- problems
def problem(n=13, d=6, v=37, scale=1.0, seed=0, ties=False):
    """float64 NumPy `(h, kernel, bias, targets, weights)`."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(n, d))
    kernel = rng.normal(size=(d, v)) * scale
    bias = rng.normal(size=(v,))
    if ties:  # identical columns (and biases) for a block of words
        kernel[:, 5:12] = kernel[:, 5:6]
        bias[5:12] = bias[5]
    targets = rng.integers(0, v, size=(n,)).astype("int32")
    if ties:
        targets[: n // 2] = rng.integers(5, 12, size=(n // 2,))
    weights = rng.normal(size=(n,))  # per-row upstream gradients, any sign
    weights[0] = 0.0
    return h, kernel, bias, targets, weights


def numpy_nll(h, kernel, bias, targets, name, params, transposed=False):
    w = kernel.T if transposed else kernel
    z = h @ w + (0.0 if bias is None else bias)
    g = numpy_transform(name, z, params)
    return -numpy_log_softmax(g)[np.arange(len(targets)), targets]


def dense_nll(h, kernel, bias, targets, transform_fn, params, transposed=False):
    """The dense formula in `keras.ops` (differentiated by the backend)."""
    w = ops.transpose(kernel) if transposed else kernel
    z = matmul(h, w)
    if bias is not None:
        z = z + bias
    g = z if transform_fn is None else transform_fn(z, *params)
    log_p = ops.log_softmax(g, axis=-1)
    t = ops.convert_to_tensor(np.asarray(targets)[:, None])
    return -ops.take_along_axis(log_p, t, axis=1)[:, 0]


def weighted(fn, weights, dtype):
    """`sum(fn(*args) * weights)`, the scalar the gradients are taken of."""
    def total(*args):
        out = fn(*args)
        w = ops.convert_to_tensor(np.asarray(weights, dtype))
        return ops.sum(ops.cast(out, dtype) * w)

    return total


def compare(*args, **kwargs):
    """`compare_one` for each implementation; the last one's results."""
    for implementation in IMPLEMENTATIONS:
        out = compare_one(*args, implementation=implementation, **kwargs)
    return out


def compare_one(h, kernel, bias, targets, weights, name, transform, params,
                chunk_size, transposed=False, mode="eager", dtype="float32",
                rtol=None, implementation="auto", token_chunk_size=None):
    """Chunked vs dense: NumPy values, and autodiff gradients of every input."""
    has_bias = bias is not None
    rtol = rtol or (1e-9 if dtype == "float64" else RTOL)

    def unpack(args):
        b = args[2] if has_bias else None
        return args[0], args[1], b, list(args[2 + int(has_bias):])

    def chunked(*args):
        h, k, b, p = unpack(args)
        return chunked_pointwise_nll(
            h, k, b, targets, transform, p, chunk_size=chunk_size,
            kernel_transposed=transposed, implementation=implementation,
            token_chunk_size=token_chunk_size,
        )

    def dense(*args):
        h, k, b, p = unpack(args)
        return dense_nll(h, k, b, targets, transform, p, transposed)

    sources = [h, kernel] + ([bias] if has_bias else []) + list(params)
    sources = [np.asarray(s, dtype) for s in sources]
    with float64_enabled() if dtype == "float64" else contextlib.nullcontext():
        nll = chunked(*[ops.convert_to_tensor(s) for s in sources])
        assert keras.backend.standardize_dtype(nll.dtype) == (
            "float64" if dtype == "float64" else "float32"
        )
        loss_fn = weighted(chunked, weights, dtype)
        if mode == "jit":
            loss_fn = jit(loss_fn)
        value, grads, _ = value_and_grad(loss_fn, sources)
        ref_value, ref_grads, _ = value_and_grad(weighted(dense, weights, dtype), sources)
    ref = numpy_nll(*[np.asarray(s, "float64") for s in sources[:2]],
                    np.asarray(sources[2], "float64") if has_bias else None,
                    targets, name, [np.asarray(p, "float64") for p in sources[2 + has_bias:]],
                    transposed)
    assert_close(nll, ref, rtol, "nll")
    assert abs(value - ref_value) <= rtol * max(1.0, abs(ref_value)), (value, ref_value)
    names = ["h", "kernel"] + (["bias"] if has_bias else [])
    names += [f"param{i}" for i in range(len(params))]
    for n, g, r in zip(names, grads, ref_grads):
        assert g is not None, f"no gradient for {n}"
        assert_close(g, r, rtol, f"gradient of {n} ({mode}, {dtype})")
    return to_numpy(nll), grads


# ------------------------------------------------------------------- tests
TRANSFORMS = ["identity", "sigsoftmax", "plif", "mlp"]


_MATCHES_DENSE = [
    (*case, dtype)
    for case in [(t, True, 8) for t in TRANSFORMS]
    + [(t, False, 1) for t in TRANSFORMS]
    + [("identity", True, 64), ("plif", False, 64), ("identity", True, 5),
       ("mlp", True, 36), ("library_plif", True, 8)]
    for dtype in ("float32", "float64")
]


# One word per tile (37 eager tiles, 3-5 s each on TensorFlow): PLIF in
# float64 by default, the other transforms under `-m slow`.
@pytest.mark.parametrize(
    "transform,use_bias,chunk_size,dtype",
    sweep(_MATCHES_DENSE, keep=[c for c in _MATCHES_DENSE
                                if c[2] != 1 or c[0::3] == ("plif", "float64")]),
)
def test_matches_dense(transform, use_bias, chunk_size, dtype):
    """N=13 and V=37: 8 gives 4 full tiles and an overlapping last tile
    (37 is prime, no divisor in [4, 8]); 5 likewise; 36 two tiles of 19
    overlapping by 1; 1 is one word per tile; 64 > V is clamped to one
    tile."""
    h, kernel, bias, targets, weights = problem()
    fn, params = make_transform(transform, np.random.default_rng(1))
    compare(h, kernel, bias if use_bias else None, targets, weights, transform,
            fn, params, chunk_size, dtype=dtype)


@pytest.mark.parametrize("transform", ["identity", "plif"])
@pytest.mark.parametrize("transposed", [False, True])
def test_divisor_tiles(transform, transposed):
    """V=36, chunk_size=8: tiles of 6 (a divisor of V), nothing masked."""
    assert tile_width(36, 8) == 6 and tile_width(37, 8) == 8
    h, kernel, bias, targets, weights = problem(v=36, seed=11)
    fn, params = make_transform(transform, np.random.default_rng(1))
    if transposed:
        kernel = kernel.T
    compare(h, kernel, bias, targets, weights, transform, fn, params,
            chunk_size=8, transposed=transposed, dtype="float64")


def test_tile_width():
    assert tile_width(100_000, 4096) == 4000
    assert tile_width(793_471, 4096) == 3017  # 7 * 431
    # 29 * 1733: no divisor in [2048, 4096]; 13 tiles as with 4096, 1 masked column
    assert tile_width(50_257, 4096) == 3866
    assert tile_width(50_257, 8192) == 7180  # 7 tiles, 3 masked columns (not 7,087)
    assert tile_width(37, 36) == 19
    assert tile_width(100, 4096) == 100
    assert tile_width(13, 5) == 5 and tile_width(7, 2) == 1


@slow_off_tensorflow  # JAX / PyTorch: test_linear_cross_entropy's token-block cases
@pytest.mark.parametrize(
    "transform,transposed,token_chunk_size,mode",
    sweep([("plif", True, 4, "eager"), ("identity", False, 6, "eager"),
           ("mlp", False, 5, "eager"), ("sigsoftmax", True, 1, "jit")],
          keep=[("plif", True, 4, "eager")]),
)
def test_token_blocks_match_dense(transform, transposed, token_chunk_size, mode):
    """Token blocks (`token_chunk_size`) and the two-pass backward against
    the dense formula, float64 so that the comparison is tight. N = 13 rows
    and V = 37 words (tiles of 8, the last overlapping): blocks of 4 (the
    last overlapping the one before by 3 rows), of 5 (by 2), and one row
    per block; a transform with parameters (PLIF, the MLP) sums their
    gradients over the blocks of each tile."""
    h, kernel, bias, targets, weights = problem()
    fn, params = make_transform(transform, np.random.default_rng(1))
    if transposed:
        kernel = kernel.T
    compare(h, kernel, bias, targets, weights, transform, fn, params, chunk_size=8,
            transposed=transposed, mode=mode, dtype="float64" if mode == "eager" else "float32",
            token_chunk_size=token_chunk_size)


@slow_off_tensorflow  # eager JAX compiles each of the nested loops: 7 s
def test_token_blocks_stats_and_entropy():
    """`chunked_pointwise_stats` (nll, lse, score sum, entropy; a cotangent
    on each) with token blocks: the same values and gradients as without."""
    h, kernel, bias, _, _ = problem(n=11, v=29, seed=5)
    targets = np.random.default_rng(5).integers(0, 29, size=(11,)).astype("int32")
    cot = np.random.default_rng(6).normal(size=(11, 5)).astype("float32")
    cot[:, 3] = 0.0  # the argmax has no gradient

    def total(token_chunk_size):
        def fn(h, k, b):
            out = ksh.chunked.chunked_pointwise_stats(
                h, k, b, targets, lambda z: 3.0 * ops.tanh(z / 3.0), chunk_size=8,
                entropy=True, token_chunk_size=token_chunk_size)
            stacked = ops.stack([ops.cast(x, "float32") for x in out], axis=1)
            return ops.sum(stacked * ops.convert_to_tensor(cot))
        return fn

    args = [np.asarray(x, "float32") for x in (h, kernel, bias)]
    value, grads, _ = value_and_grad(total(None), args)
    got, got_grads, _ = value_and_grad(total(3), args)
    assert abs(float(got) - float(value)) <= 1e-5 * max(1.0, abs(float(value)))
    for name, g, e in zip(["h", "kernel", "bias"], got_grads, grads):
        assert_close(g, e, 1e-5, f"gradient of {name}")


@TF_ONLY
@pytest.mark.parametrize("implementation", [
    "auto", pytest.param("ops", marks=pytest.mark.slow)])
def test_token_blocks_with_an_unknown_number_of_rows(implementation):
    """In a TensorFlow graph whose batch is unknown (`fit`'s), token blocks
    of `token_chunk_size` rows over the rows padded to whole blocks (13 rows
    in blocks of 4: three padding rows): the same loss and gradients as
    without blocks, compiled with XLA too."""
    import tensorflow as tf

    h, kernel, bias, targets, weights = [
        np.asarray(x, "float32") if x.dtype == np.float64 else x for x in problem()]
    fn, params = make_transform("plif", np.random.default_rng(1))
    params = [np.asarray(x, "float32") for x in params]

    def step(token_chunk_size, jit_compile):
        @tf.function(autograph=False, jit_compile=jit_compile, input_signature=[
            tf.TensorSpec([None, 6], "float32"), tf.TensorSpec([None], "int32")])
        def run(h_in, t_in):
            sources = [tf.constant(kernel), tf.constant(bias)] + [tf.constant(x) for x in params]
            with tf.GradientTape() as tape:
                tape.watch([h_in] + sources)
                nll = chunked_pointwise_nll(
                    h_in, sources[0], sources[1], t_in, fn, sources[2:], chunk_size=8,
                    implementation=implementation, token_chunk_size=token_chunk_size)
                total = tf.reduce_sum(nll * weights)
            return [nll] + tape.gradient(total, [h_in] + sources)

        return [to_numpy(x) for x in run(h, targets)]

    expected = step(None, False)
    for jit_compile in (False, True):
        for got, want, name in zip(step(4, jit_compile), expected,
                                   ["nll", "h", "kernel", "bias", "slopes"]):
            assert_close(got, want, 1e-5, f"{name} (jit_compile={jit_compile})")


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's compiled memory of a jax.jit step")
def test_token_blocks_memory_does_not_grow_with_rows():
    """XLA's compiled temporaries of the loss and its gradients: with token
    blocks about the same at 2,048 and 32,768 rows (only `[N]` vectors
    grow), and below the one-pass form's, which holds `[N, chunk]` tiles
    and a float32 `[N, d]` accumulator."""
    import jax
    import jax.numpy as jnp

    def temp(n, token_chunk_size):
        def loss(h, w, t):
            return jnp.mean(chunked_pointwise_nll(
                h, w, None, t, chunk_size=256, kernel_transposed=True,
                token_chunk_size=token_chunk_size))

        shapes = [jax.ShapeDtypeStruct(s, k) for s, k in
                  (((n, 64), "float32"), ((2000, 64), "float32"), ((n,), "int32"))]
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*shapes).lower()
        return compiled.compile().memory_analysis().temp_size_in_bytes

    small, large = temp(2048, 512), temp(32768, 512)
    assert large <= 1.25 * small, (small, large)
    assert temp(32768, None) > 10 * large


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "8"])
def test_bad_token_chunk_size(value):
    h, kernel, bias, targets, _ = problem()
    with pytest.raises(ValueError, match=f"token_chunk_size={value!r}"):
        chunked_pointwise_nll(h.astype("float32"), kernel.astype("float32"), None,
                              targets, token_chunk_size=value)


@pytest.mark.parametrize(
    "transform,chunk_size,transposed",
    sweep([("identity", 8, False), ("plif", 8, False), ("mlp", 6, True),
           ("sigsoftmax", 29, False)],
          keep=[("identity", 8, False), ("plif", 8, False), ("sigsoftmax", 29, False)]),
)
def test_compiled_equals_eager(transform, chunk_size, transposed):
    """XLA (TensorFlow, JAX; PyTorch runs eagerly): the same loss and
    gradients, masked tail tile (V=29) included."""
    h, kernel, bias, targets, weights = problem(n=9, v=29)
    fn, params = make_transform(transform, np.random.default_rng(1))
    if transposed:
        kernel = kernel.T
    compare(h, kernel, bias, targets, weights, transform, fn, params,
            chunk_size=chunk_size, transposed=transposed, mode="jit")


@pytest.mark.parametrize("transform", ["identity", "sigsoftmax", "plif"])
def test_large_logits(transform):
    """|logit| ~ 1e3: the online log-sum-exp must not overflow."""
    h, kernel, bias, targets, weights = problem(scale=300.0, seed=2)
    assert np.abs(h @ kernel).max() > 1e3
    fn, params = make_transform(transform, np.random.default_rng(1))
    if transform == "plif":  # knots where the scores are
        fn = lambda z, s: plif_ops(z, s, 2000.0)  # noqa: E731
        params = [np.zeros(7) + 0.5]
        ref_fn = lambda z: numpy_plif(z, params[0], 2000.0)  # noqa: E731
        h32 = [np.asarray(x, "float32") for x in (h, kernel, bias)]
        nll = to_numpy(chunked_pointwise_nll(*h32, targets, fn, params, chunk_size=8))
        z = h32[0].astype("float64") @ h32[1] + h32[2]
        ref = -numpy_log_softmax(ref_fn(z))[np.arange(len(targets)), targets]
        assert_close(nll, ref, 1e-5, "nll")
        return
    nll, _ = compare(h, kernel, bias, targets, weights, transform, fn, params,
                     chunk_size=8, dtype="float64")
    assert np.all(nll >= 0)


@pytest.mark.parametrize("transform", ["identity", "plif"])
def test_ties(transform):
    """Identical columns: equal scores in and across tiles, targets among them."""
    h, kernel, bias, targets, weights = problem(ties=True, seed=3)
    fn, params = make_transform(transform, np.random.default_rng(1))
    compare(h, kernel, bias, targets, weights, transform, fn, params, 4)


def test_all_scores_equal():
    h, kernel, bias, targets, weights = problem(seed=4)
    nll, _ = compare(h, 0 * kernel, 0 * bias, targets, weights, "identity",
                     None, [], 8)
    np.testing.assert_allclose(nll, np.log(37.0), rtol=1e-6)


@pytest.mark.parametrize("transform", ["identity", "sigsoftmax"])
def test_tied_layout(transform):
    """`kernel_transposed=True` takes the `[V, d]` embedding matrix as is."""
    h, kernel, bias, targets, weights = problem(seed=5)
    fn, params = make_transform(transform, np.random.default_rng(1))
    compare(h, kernel.T, bias, targets, weights, transform, fn, params,
            chunk_size=8, transposed=True)
    compare(h, kernel.T, None, targets, weights, transform, fn, params,
            chunk_size=8, transposed=True, mode="jit")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_inputs(dtype):
    """bf16 / fp16 inputs (mixed precision): float32 accumulation, the same
    as the float32 dense path on the rounded values; gradients come back in
    the inputs' dtypes, rounded once."""
    h, kernel, bias, targets, weights = problem(seed=6)
    fn, params = make_transform("plif", np.random.default_rng(1))
    sources = [ops.cast(np.asarray(s, "float32"), dtype) for s in [h, kernel, bias] + params]
    rounded = [to_numpy(ops.cast(s, "float32")) for s in sources]

    def chunked(h, k, b, *p):
        return chunked_pointwise_nll(h, k, b, targets, fn, p, chunk_size=8)

    nll = chunked(*sources)
    assert keras.backend.standardize_dtype(nll.dtype) == "float32"
    ref = numpy_nll(*[r.astype("float64") for r in rounded[:3]], targets, "plif",
                    [rounded[3].astype("float64")])
    assert_close(nll, ref, RTOL, "nll")
    if BACKEND == "torch":
        inputs = [s.detach().clone().requires_grad_(True) for s in sources]
        import torch

        out = chunked(*inputs)
        grads = torch.autograd.grad(
            ops.sum(out * ops.convert_to_tensor(weights.astype("float32"))), inputs
        )
    else:
        loss = weighted(chunked, weights, "float32")
        _, grads, _ = value_and_grad_raw(loss, sources)
    assert [keras.backend.standardize_dtype(g.dtype) for g in grads] == [dtype] * 4
    _, ref_grads, _ = value_and_grad(weighted(
        lambda h, k, b, *p: dense_nll(h, k, b, targets, fn, p), weights, "float32"),
        rounded)
    eps = float(np.finfo(np.float16).eps) if dtype == "float16" else 2.0**-8
    for name, g, r in zip(["h", "kernel", "bias", "slopes"], grads, ref_grads):
        expected = to_numpy(ops.cast(ops.cast(r, dtype), "float32"))
        assert_close(ops.cast(g, "float32"), expected, 2 * eps, f"gradient of {name}")


def value_and_grad_raw(fn, inputs):
    """Like `backends.value_and_grad` but returns the gradients as backend
    tensors (their dtypes are checked)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(inputs)
            value = fn(*inputs)
        return value, tape.gradient(value, inputs), None
    import jax

    value, grads = jax.value_and_grad(fn, argnums=tuple(range(len(inputs))))(*inputs)
    return value, list(grads), None


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_variables_as_inputs_and_read_inside_transform(implementation):
    """Keras variables as kernel / bias / params, and a transform that reads
    a variable of `transform_params` itself (the way a head's
    `score_transform` does): it reads the value passed in, and its gradient
    comes back (eagerly and compiled)."""
    h, kernel, bias, targets, weights = problem(seed=8)
    rng = np.random.default_rng(9)
    kernel_var = keras.Variable(kernel.astype("float32"), name="kernel")
    bias_var = keras.Variable(bias.astype("float32"), name="bias")
    slopes_var = keras.Variable(rng.normal(size=(7,)).astype("float32"), name="slopes")
    mlp_vars = [
        keras.Variable(rng.normal(size=(3,)).astype("float32")) for _ in range(3)
    ]
    variables = [kernel_var, bias_var, slopes_var] + mlp_vars

    def transform(z, slopes, *mlp_params):  # slopes read from the variable
        del slopes
        return monotonic_mlp_fn(plif_ops(z, slopes_var), *mlp_params)

    def loss(chunked):
        def total(h):  # noqa: B023
            if chunked:
                nll = chunked_pointwise_nll(
                    h, kernel_var, bias_var, targets, transform,
                    [slopes_var] + mlp_vars, chunk_size=8,
                    implementation=implementation,
                )
            else:
                nll = dense_nll(
                    h, kernel_var, bias_var, targets,
                    lambda z, *p: monotonic_mlp_fn(plif_ops(z, slopes_var), *p),
                    list(mlp_vars),
                )
            return ops.sum(nll * ops.convert_to_tensor(weights.astype("float32")))

        return total

    h32 = h.astype("float32")
    ref, ref_h, ref_vars = value_and_grad(loss(False), [h32], variables)
    for mode in ["eager", "jit"]:
        fn = loss(True) if mode == "eager" else jit(loss(True))
        value, g_h, g_vars = value_and_grad(fn, [h32], variables)
        assert abs(value - ref) <= RTOL * abs(ref)
        for i, (g, r) in enumerate(zip(g_h + g_vars, ref_h + ref_vars)):
            assert g is not None, f"no gradient for variable {i} ({mode})"
            assert_close(g, r, RTOL, f"gradient of variable {i} ({mode})")


@TF_ONLY
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unlisted_variable_read_by_the_transform_raises(implementation):
    """A transform that reads a trainable variable it was not given would
    get no gradient for it: TensorFlow sees the read, and it is an error,
    with either implementation (one core)."""
    import tensorflow as tf

    h, kernel, bias, targets, _ = problem(seed=8)
    slopes = keras.Variable(np.zeros(7, "float32"))
    with tf.GradientTape() as tape:
        nll = chunked_pointwise_nll(
            h.astype("float32"), kernel.astype("float32"), None, targets,
            lambda z: plif_ops(z, slopes), chunk_size=8,
            implementation=implementation,
        )
    with pytest.raises(ValueError, match="transform_params"):
        tape.gradient(nll, [slopes.value])


def test_value_and_vjp():
    """The backend dispatch point against the analytic derivative."""
    x = ops.convert_to_tensor(np.linspace(-2.0, 2.0, 6).astype("float32"))
    a = ops.convert_to_tensor(np.array([1.5], "float32"))
    ct = ops.convert_to_tensor(np.arange(6).astype("float32"))
    out, vjp = value_and_vjp(lambda x, a: a * ops.sigmoid(x), [x, a])
    gx, ga = vjp(ct)
    s = 1.0 / (1.0 + np.exp(-to_numpy(x)))
    assert_close(out, 1.5 * s, 1e-6, "value")
    assert_close(gx, to_numpy(ct) * 1.5 * s * (1 - s), 1e-6, "d/dx")
    assert_close(ga, [np.sum(to_numpy(ct) * s)], 1e-6, "d/da")


@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_passes_match_the_chunked_loss(use_bias):
    """`linear_nll_forward` / `linear_nll_backward` (the two passes on their
    own, for a caller's custom gradient) equal `chunked_pointwise_nll` and
    its autodiff gradients, with a last partial tile."""
    from keras_softmax_heads.chunked import linear_nll_backward
    from keras_softmax_heads.chunked import linear_nll_forward

    h, kernel, bias, targets, weights = (
        x.astype("float32") if x.dtype == np.float64 else x for x in problem(seed=11))
    bias = bias if use_bias else None
    nll, lse = linear_nll_forward(h, kernel, bias, targets, 8)
    want = numpy_nll(h, kernel, bias, targets, "identity", [])
    assert_close(nll, want, 1e-5, "nll")
    z = h @ kernel + (0.0 if bias is None else bias)
    assert_close(lse, np.log(np.exp(z).sum(-1)), 1e-5, "lse")
    grads = linear_nll_backward(h, kernel, bias, targets, lse, weights, 8)
    primals = [kernel] + ([bias] if use_bias else [])

    def objective(x, k, *b):
        return ops.sum(chunked_pointwise_nll(x, k, b[0] if b else None, targets,
                                             chunk_size=8) * ops.convert_to_tensor(weights))

    _, want_grads, _ = value_and_grad(objective, [h] + primals)
    assert len(grads) == 2 + int(use_bias)
    for got, exp, name in zip(grads, want_grads, ["h", "kernel", "bias"]):
        assert_close(got, exp, 1e-5, name)


def test_leading_dims_and_shapes():
    h, kernel, bias, targets, _ = problem(n=12, seed=10)
    f32 = lambda x: x.astype("float32")  # noqa: E731
    nll = chunked_pointwise_nll(
        f32(h).reshape(3, 4, 6), f32(kernel), f32(bias), targets.reshape(3, 4),
        chunk_size=8,
    )
    assert tuple(nll.shape) == (3, 4)
    ref = numpy_nll(h, kernel, bias, targets, "identity", [])
    assert_close(to_numpy(nll).reshape(-1), ref, RTOL, "nll")


def test_bad_implementation():
    h, kernel, bias, targets, _ = problem()
    with pytest.raises(ValueError, match="Received: implementation"):
        chunked_pointwise_nll(h, kernel, bias, targets, implementation="tf")


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


def _largest_f32_array(hlo):
    sizes = [
        int(np.prod([int(x) for x in dims.split(",") if x]))
        for dims in re.findall(r"f32\[([\d,]*)\]", hlo)
    ]
    return max(sizes)


def _compiled_hlo(fn, *args):
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, autograph=False, jit_compile=True).experimental_get_compiler_ir(*args)(
            stage="hlo"
        )
    import jax

    return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.skipif(BACKEND == "torch", reason="no XLA program on PyTorch")
def test_no_tensor_of_size_tokens_times_vocabulary():
    """The compiled forward + backward program (loop bodies included) holds
    no [N, V] array: the largest ones are the kernel, its gradient and
    [N, chunk] tiles. The same probe finds [N, V] in the dense program."""
    n, d, v, chunk = 64, 8, 1000, 128
    h, kernel, bias, targets, _ = [
        x.astype("float32") if x.dtype == np.float64 else x for x in problem(n=n, d=d, v=v)
    ]

    def step(loss_fn):
        if BACKEND == "tensorflow":
            import tensorflow as tf

            def run(h, kernel, bias):
                with tf.GradientTape() as tape:
                    tape.watch([h, kernel, bias])
                    total = tf.reduce_sum(loss_fn(h, kernel, bias))
                return tape.gradient(total, [h, kernel, bias])

            return run
        import jax

        return jax.grad(lambda *a: ops.sum(loss_fn(*a)), argnums=(0, 1, 2))

    chunked = step(
        lambda h, k, b: chunked_pointwise_nll(h, k, b, targets, chunk_size=chunk)
    )
    dense = step(lambda h, k, b: dense_nll(h, k, b, targets, None, []))
    args = [ops.convert_to_tensor(x) for x in (h, kernel, bias)]
    assert _largest_f32_array(_compiled_hlo(dense, *args)) >= n * v
    assert _largest_f32_array(_compiled_hlo(chunked, *args)) <= max(d * v, n * chunk)



@pytest.mark.skipif(BACKEND == "torch", reason="no XLA program on PyTorch")
@pytest.mark.parametrize("transposed", [False, True])
def test_bfloat16_kernel_is_not_widened_whole(transposed):
    """With a bfloat16 kernel, the optimised XLA program of the loss and its
    gradients holds no float32 array as large as the kernel: each tile is
    widened on its own (XLA's CPU compiler would otherwise widen the whole
    kernel once, ahead of the tile loop)."""
    n, d, v, chunk = 16, 64, 1024, 128
    rng = np.random.default_rng(0)
    h = ops.cast(rng.normal(size=(n, d)).astype("float32"), "bfloat16")
    shape = (v, d) if transposed else (d, v)
    kernel = ops.cast(rng.normal(size=shape).astype("float32") * 0.1, "bfloat16")
    targets = ops.convert_to_tensor(rng.integers(0, v, size=(n,)).astype("int32"))

    def loss(h, kernel):
        return ops.sum(chunked_pointwise_nll(
            h, kernel, None, targets, chunk_size=chunk, kernel_transposed=transposed))

    assert _largest_f32_array(_optimized_step_hlo(loss, h, kernel)) < d * v


def _optimized_step_hlo(loss, h, kernel):
    """The optimised XLA program of `loss(h, kernel)` and its gradients
    with respect to both (TensorFlow's `jit_compile`, `jax.jit`)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def step(h, kernel):
            with tf.GradientTape() as tape:
                tape.watch([h, kernel])
                value = loss(h, kernel)
            return value, tape.gradient(value, [h, kernel])

        return tf.function(step, autograph=False, jit_compile=True).experimental_get_compiler_ir(
            h, kernel)(stage="optimized_hlo")
    import jax

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, kernel).compile().as_text()


@pytest.mark.skipif(BACKEND == "torch", reason="no XLA program on PyTorch")
def test_token_blocks_hold_no_float32_rows_by_width():
    """With token blocks and bfloat16 inputs, the optimised XLA program of
    the loss and its gradients holds no float32 array of `N x d` elements
    (the one pass's `dh` accumulator; each block's is written into a
    bfloat16 gradient), while the one pass does."""
    n, d, v, chunk, tokens = 512, 64, 256, 64, 64
    rng = np.random.default_rng(0)
    h = ops.cast(rng.normal(size=(n, d)).astype("float32"), "bfloat16")
    kernel = ops.cast(rng.normal(size=(v, d)).astype("float32") * 0.1, "bfloat16")
    targets = ops.convert_to_tensor(rng.integers(0, v, size=(n,)).astype("int32"))

    def largest(token_chunk_size):
        def loss(h, kernel):
            return ops.sum(chunked_pointwise_nll(
                h, kernel, None, targets, chunk_size=chunk, kernel_transposed=True,
                token_chunk_size=token_chunk_size))

        return _largest_f32_array(_optimized_step_hlo(loss, h, kernel))

    assert largest(None) >= n * d
    assert largest(tokens) < n * d


def _largest_constant_fill(graph_def):
    """The most elements a `Fill` with constant dimensions makes in any
    function of `graph_def`: a constant subgraph TensorFlow's XLA bridge
    evaluates while it compiles."""
    import tensorflow as tf

    largest = 0
    for fn in graph_def.library.function:
        consts = {n.name: n for n in fn.node_def if n.op == "Const"}
        for n in fn.node_def:
            dims = consts.get(n.input[0].split(":")[0]) if n.op == "Fill" else None
            if dims is not None:
                largest = max(largest, int(np.prod(tf.make_ndarray(dims.attr["value"].tensor))))
    return largest


@TF_ONLY
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_buffers_are_not_compile_time_constants(dtype):
    """Under a caller's `jit_compile=True`, the passes build their kernel
    gradient buffer from the kernel, not as a constant `Fill` of its shape:
    TensorFlow's XLA bridge evaluated that `[d, V]` constant while
    compiling, and kept the memory (`docs/results/relayout_ab/run3`)."""
    import tensorflow as tf

    n, d, v = 16, 64, 1024
    rng = np.random.default_rng(0)
    h = tf.cast(rng.normal(size=(n, d)).astype("float32"), dtype)
    kernel = tf.cast(rng.normal(size=(d, v)).astype("float32") * 0.1, dtype)
    targets = tf.constant(rng.integers(0, v, size=(n,)).astype("int32"))

    @tf.function(autograph=False, jit_compile=True)
    def step(h, kernel):
        with tf.GradientTape() as tape:
            tape.watch([h, kernel])
            value = ops.sum(chunked_pointwise_nll(h, kernel, None, targets, chunk_size=128))
        return value, tape.gradient(value, [h, kernel])

    graph_def = step.get_concrete_function(h, kernel).graph.as_graph_def()
    assert len(graph_def.library.function) > 0  # the nested passes
    assert _largest_constant_fill(graph_def) < d * v


# ------------------------------------------------------------------ mixture
def mixture_problem(n=11, k=3, d=5, v=23, seed=0):
    rng = np.random.default_rng(seed)
    latents = np.tanh(rng.normal(size=(n, k, d)))
    prior_logits = rng.normal(size=(n, k))
    kernel = rng.normal(size=(d, v))
    bias = rng.normal(size=(v,))
    targets = rng.integers(0, v, size=(n,)).astype("int32")
    weights = rng.normal(size=(n,))
    return latents, prior_logits, kernel, bias, targets, weights


def numpy_mixture_nll(latents, prior_logits, kernel, bias, targets, name, params):
    z = np.einsum("nkd,dv->nkv", latents, kernel) + bias
    g = numpy_transform(name, z, params)
    log_p = np.logaddexp.reduce(
        numpy_log_softmax(prior_logits)[..., None] + numpy_log_softmax(g), axis=1
    )
    return -log_p[np.arange(len(targets)), targets]


def dense_mixture_nll(latents, log_priors, kernel, bias, targets, fn, params):
    z = ops.einsum("nkd,dv->nkv", latents, kernel) + bias
    g = z if fn is None else fn(z, *params)
    log_p = ops.logsumexp(
        log_priors[..., None] + ops.log_softmax(g, axis=-1), axis=1
    )
    t = ops.convert_to_tensor(targets[:, None])
    return -ops.take_along_axis(log_p, t, axis=1)[:, 0]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "transform,mode,dtype",
    [
        ("identity", "eager", "float64"),
        ("sigsoftmax", "eager", "float64"),
        ("plif", "eager", "float64"),
        ("plif", "jit", "float32"),
        ("identity", "jit", "float32"),
    ],
)
def test_mixture_matches_dense(transform, mode, dtype, implementation):
    """Loss and gradients of latents, prior logits (through the mixture
    weights), kernel, bias and transform parameters."""
    latents, prior_logits, kernel, bias, targets, weights = mixture_problem()
    fn, params = make_transform(transform, np.random.default_rng(1))
    rtol = 1e-9 if dtype == "float64" else RTOL

    def make(chunked):
        def nll(latents, prior_logits, kernel, bias, *params):
            log_priors = ops.log_softmax(prior_logits, axis=-1)
            if chunked:
                return chunked_mixture_nll(
                    latents, log_priors, kernel, bias, targets, fn, params,
                    chunk_size=7, implementation=implementation,
                )
            return dense_mixture_nll(
                latents, log_priors, kernel, bias, targets, fn, params
            )

        return nll

    sources = [np.asarray(s, dtype) for s in
               [latents, prior_logits, kernel, bias] + params]
    with float64_enabled() if dtype == "float64" else contextlib.nullcontext():
        out = make(True)(*[ops.convert_to_tensor(s) for s in sources])
        loss = weighted(make(True), weights, dtype)
        value, grads, _ = value_and_grad(jit(loss) if mode == "jit" else loss, sources)
        ref_value, ref_grads, _ = value_and_grad(weighted(make(False), weights, dtype), sources)
    ref = numpy_mixture_nll(*[np.asarray(s, "float64") for s in sources[:4]],
                            targets, transform, [np.asarray(p, "float64") for p in sources[4:]])
    assert_close(out, ref, rtol, "mixture nll")
    assert abs(value - ref_value) <= rtol * max(1.0, abs(ref_value))
    names = ["latents", "prior_logits", "kernel", "bias", "slopes"]
    for name, g, r in zip(names, grads, ref_grads):
        assert_close(g, r, rtol, f"gradient of {name}")


def test_mixture_tied_layout_and_leading_dims():
    latents, prior_logits, kernel, bias, targets, _ = mixture_problem(n=12)
    f32 = lambda x: np.asarray(x, "float32")  # noqa: E731
    log_priors = ops.log_softmax(f32(prior_logits), axis=-1)
    out = chunked_mixture_nll(
        f32(latents).reshape(3, 4, 3, 5), ops.reshape(log_priors, (3, 4, 3)),
        f32(kernel.T), None, targets.reshape(3, 4), chunk_size=5,
        kernel_transposed=True,
    )
    assert tuple(out.shape) == (3, 4)
    ref = numpy_mixture_nll(latents, prior_logits, kernel, 0.0, targets, "identity", [])
    assert_close(to_numpy(out).reshape(-1), ref, RTOL, "mixture nll")


def test_mixture_of_softmaxes_head_inputs():
    """Fed with `MixtureOfSoftmaxes`' own priors / latents, the chunked mixture
    equals the head's exact log-likelihood (all three component variants)."""
    from keras_softmax_heads.heads.mixture_of_softmaxes import MixtureOfSoftmaxes

    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 5, 6)).astype("float32")
    y = rng.integers(0, 17, size=(2, 5))
    variants = [{}, {"component": "sigsoftmax"}]
    if _library_plif_runs():
        variants.append({"num_knots": 6, "knot_bound": 2.0})
    for kwargs in variants:
        head = MixtureOfSoftmaxes(17, num_components=3, **kwargs)
        head(h)
        for w in head.weights:
            value = to_numpy(w)
            w.assign(value + 0.3 * rng.normal(size=w.shape).astype("float32"))
        log_priors, latents = head._priors_and_latents(h, False)
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
        ref = -to_numpy(head.log_likelihood(h, y))
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
        value = to_numpy(w)
        w.assign((value + 0.3 * rng.normal(size=w.shape)).astype(value.dtype))
    chunked.set_weights(dense.get_weights())
    return dense, chunked


def _head_loss_and_grads(head, h, y, weights, variables=None):
    variables = head.trainable_weights if variables is None else variables

    def total(h):
        loss = head.training_loss(h, y)
        return ops.sum(loss * ops.convert_to_tensor(weights))

    loss = to_numpy(head.training_loss(h, y))
    _, g_h, g_vars = value_and_grad(total, [h], variables)
    return loss, g_h + g_vars


@pytest.mark.parametrize("use_bias", [True, False])
def test_full_softmax_head_matches_dense(use_bias):
    h = np.random.default_rng(1).normal(size=(3, 4, 6)).astype("float32")
    y = np.random.default_rng(2).integers(0, 13, size=(3, 4))
    weights = np.random.default_rng(3).normal(size=(3, 4)).astype("float32")
    dense, chunked = _twin_heads(
        lambda c: ksh.FullSoftmax(13, use_bias=use_bias, chunk_size=c), h
    )
    loss, grads = _head_loss_and_grads(chunked, h, y, weights)
    ref, ref_grads = _head_loss_and_grads(dense, h, y, weights)
    assert loss.shape == (3, 4)
    assert_close(loss, ref, RTOL, "loss")
    assert_close(-to_numpy(chunked.log_likelihood(h, y)), ref, RTOL, "log_likelihood")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, RTOL, "gradient")
    # `call` still returns the full distribution.
    assert tuple(chunked(h).shape) == (3, 4, 13)


# JAX under `-m slow` (6 s): test_tied_layout checks the tied layout there.
@slow_on("jax")
def test_tied_head_matches_dense():
    emb = keras.layers.Embedding(13, 6, embeddings_initializer="normal")
    emb.build((None,))
    h = np.random.default_rng(1).normal(size=(7, 6)).astype("float32")
    y = np.random.default_rng(2).integers(0, 13, size=(7,))
    weights = np.ones((7,), "float32")
    dense = ksh.FullSoftmax(token_embedding=emb, use_bias=False)
    chunked = ksh.FullSoftmax(token_embedding=emb, use_bias=False, chunk_size=4)
    loss, grads = _head_loss_and_grads(chunked, h, y, weights, [emb.embeddings])
    ref, ref_grads = _head_loss_and_grads(dense, h, y, weights, [emb.embeddings])
    assert_close(loss, ref, RTOL, "loss")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, RTOL, "gradient")


@TF_ONLY
def test_head_invalid_targets():
    import tensorflow as tf

    head = ksh.FullSoftmax(13, chunk_size=5)
    h = np.zeros((2, 6), "float32")
    with pytest.raises(ValueError, match="vocab_size"):
        head.training_loss(h, np.array([0, 13]))
    jitted = tf.function(head.training_loss, autograph=False, jit_compile=True)
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
        return plif_ops(z, self.raw_slopes)


def _make_head(cls, chunk_size):
    try:
        return cls(13, chunk_size=chunk_size)
    except (TypeError, ValueError):  # e.g. a head that needs word counts
        return cls(13, chunk_size=chunk_size, counts=np.arange(13, 0, -1))


def _head_results(cls, values, chunk_size, dtype, mode="eager"):
    """`[log_likelihood, d/dh, d/dweights...]` of a fresh head in `dtype`."""
    keras.config.set_dtype_policy(dtype)
    rng = np.random.default_rng(1)
    h = rng.normal(size=(9, 6)).astype(dtype)
    y = rng.integers(0, 13, size=(9,))
    weights = rng.normal(size=(9,))
    head = _make_head(cls, chunk_size)
    head(h)
    for w, x in zip(head.weights, values):
        w.assign(np.asarray(x).astype(w.dtype))

    def total(h):
        ll = head.log_likelihood(h, y)
        return ops.sum(ll * ops.cast(weights, ll.dtype))

    ll = to_numpy(head.log_likelihood(h, y))
    fn = jit(total) if mode == "xla" else total
    _, g_h, g_vars = value_and_grad(fn, [h], head.trainable_weights)
    names = ["log_likelihood", "h"] + [w.path for w in head.trainable_weights]
    out = [ll] + g_h + g_vars
    return names, [None if x is None else np.asarray(x, "float64") for x in out]


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
    be as accurate as the dense one there.

    Seeded: the weights must not depend on the tests run before in the
    process. PLIF's gradient jumps at its knots (1e5 of them over the score
    range), so a float32 score rounded to the other side of a knot than in
    float64 moves a score's gradient by a slope difference; on some draws
    the dense float32 path happens to land on float64's side where the
    chunked one does not (seen once in 8 draws: `h`'s gradient 9e-4 off
    against the dense path's 5e-7)."""
    keras.utils.set_random_seed(0)
    try:
        probe = _make_head(cls, None)
    except (TypeError, ValueError) as err:
        pytest.skip(f"{cls.__name__}(13, chunk_size=...) failed: {err}")
    try:
        probe(np.zeros((1, 6), "float32"))
    except Exception as err:  # noqa: BLE001
        if BACKEND == "tensorflow":
            raise
        pytest.skip(f"{cls.__name__} does not run on {BACKEND} yet: {err}")
    rng = np.random.default_rng(0)
    values = [
        to_numpy(w) if not w.trainable or "int" in str(w.dtype)
        else to_numpy(w) + 0.3 * rng.normal(size=w.shape)
        for w in probe.weights
    ]
    with float64_enabled():
        try:
            names, ref = _head_results(cls, values, None, "float64")
        except Exception as err:  # noqa: BLE001
            if BACKEND == "tensorflow":
                raise
            pytest.skip(f"{cls.__name__}'s dense path fails on {BACKEND}: {err}")
        _, chunk64 = _head_results(cls, values, 5, "float64")
    if BACKEND != "tensorflow":
        # A compiled `head.log_likelihood` needs `head_utils.check_targets`
        # to trace on JAX; the compiled chunked loss itself is covered by
        # `test_compiled_equals_eager`.
        modes = [m for m in modes if m != "xla"]
    # Keras' PyTorch `matmul` rounds float64 products to float32: there the
    # dense head (the reference) is only float32-accurate.
    rtol64 = 1e-6 if BACKEND == "torch" else 1e-9
    for name, a, r in zip(names, chunk64, ref):
        assert a is not None, f"no gradient for {name}"
        assert_close(a, r, rtol64, f"{name} (float64)")
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
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
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


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="HeadModel is not ported to this backend yet"
)
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


@pytest.mark.slow
@TF_ONLY
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
