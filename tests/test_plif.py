import re

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
from references import numpy_plif
from references import softplus

from keras_softmax_heads import functional
from keras_softmax_heads.functional import plif_kernels
from keras_softmax_heads.heads.full_softmax import FullSoftmax
from keras_softmax_heads.heads.plif_softmax import PLIFSoftmax

pytestmark = pytest.mark.multibackend

# Keras computes float64 only on TensorFlow (JAX and PyTorch promote to
# 32 bits): the exact gradient comparisons run in float64 there and in
# float32, with float32 tolerances, on the other backends.
FLOAT64 = BACKEND == "tensorflow"
DTYPE = "float64" if FLOAT64 else "float32"
TOL = 1e-10 if FLOAT64 else 2e-5

tf_only = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow graph / HLO")


def dense_ll(z, raw, knot_bound, targets):
    log_p = ops.log_softmax(functional.plif_reference(z, raw, knot_bound))
    targets = ops.convert_to_tensor(targets)
    return ops.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]


def assert_close(actual, expected, tol):
    """`|actual - expected| <= tol * max(1, max |expected|)`."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tol * scale)


def numpy_plif_grads(z, raw, knot_bound, w):
    """Gradients of `sum(w * plif(z))` w.r.t. `z` and the raw slopes, float64,
    from the definition: `df/dz = s[idx]`; `f(z)` depends on `s_j` through
    `f(l_i)` for every interval `i > j` (weight `2T/K`) and through
    `s_i (z - l_i)` for `j = i`."""
    z, raw, w = (np.asarray(x, "float64") for x in (z, raw, w))
    num_knots = len(raw)
    width = 2.0 * knot_bound / num_knots
    slopes = softplus(raw)
    idx = np.clip(np.floor((z + knot_bound) / width), 0, num_knots - 1).astype(int)
    offset = z - (-knot_bound + width * idx)
    a = np.bincount(idx.ravel(), w.ravel(), num_knots)
    b = np.bincount(idx.ravel(), (w * offset).ravel(), num_knots)
    after = np.cumsum(a[::-1])[::-1] - a  # sum over i > j
    d_slopes = width * after + b
    return w * slopes[idx], d_slopes / (1.0 + np.exp(-raw))

class TestPLIFBattery(HeadBattery):
    cases = {"k64": lambda v, d, **kw: PLIFSoftmax(v, num_knots=64, knot_bound=5.0, **kw)}


@pytest.mark.slow
class TestPLIFNarrowBattery(HeadBattery):
    """Most scores outside [-T, T]: the extended first / last pieces (the
    function-level tests below cover them in the default suite)."""

    cases = {
        "k64_narrow": lambda v, d, **kw: PLIFSoftmax(
            v, num_knots=64, knot_bound=0.5, **kw
        ),
    }


# ------------------------------------------------------------------ function
@pytest.mark.parametrize("dtype", ["float32", "float64"] if FLOAT64 else ["float32"])
def test_numpy_reference(dtype):
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(37,)) * 2
    z = np.concatenate([rng.normal(size=500) * 4, [-50.0, -3.0, 0.0, 3.0, 50.0]])
    expected = numpy_plif(z, raw, 3.0)
    out = functional.plif(z.astype(dtype), raw.astype(dtype), 3.0)
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5)
    ref = functional.plif_reference(z.astype(dtype), raw.astype(dtype), 3.0)
    np.testing.assert_allclose(to_numpy(ref), expected, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_keeps_dtype(dtype):
    z = ops.cast(np.linspace(-4, 4, 8), dtype)
    out = functional.plif(z, np.zeros(16, "float32"), 3.0)
    assert keras.backend.standardize_dtype(out.dtype) == dtype


def test_monotone_inside_and_outside_and_continuous_at_knots():
    rng = np.random.default_rng(1)
    num_knots, bound = 50, 2.0
    raw64 = rng.normal(size=(num_knots,)) * 3
    knots = -bound + 2 * bound * np.arange(num_knots + 1) / num_knots
    if FLOAT64:
        grid = np.linspace(-3 * bound, 3 * bound, 30001)
        f = to_numpy(functional.plif(grid, raw64, bound))
        assert np.all(np.diff(f) > 0), "PLIF must be strictly increasing"
        # Left and right limits at every knot (the outer knots included).
        left = to_numpy(functional.plif(knots - 1e-9, raw64, bound))
        right = to_numpy(functional.plif(knots + 1e-9, raw64, bound))
        np.testing.assert_allclose(left, right, atol=1e-5)
    # float32: increasing on a grid coarser than float32 resolution, and
    # continuous within float32 resolution of the knot positions.
    raw32 = raw64.astype("float32")
    grid = np.linspace(-3 * bound, 3 * bound, 3001).astype("float32")
    f = to_numpy(functional.plif(grid, raw32, bound))
    assert np.all(np.diff(f) > 0), "PLIF must be strictly increasing"
    left32 = to_numpy(functional.plif((knots - 1e-5).astype("float32"), raw32, bound))
    right32 = to_numpy(functional.plif((knots + 1e-5).astype("float32"), raw32, bound))
    np.testing.assert_allclose(left32, right32, atol=2e-5 * softplus(raw64).max() + 1e-5)


def test_identity_slopes_give_identity():
    raw = np.full([1000], functional.plif_identity_raw_slope(), "float32")
    z = np.linspace(-30, 30, 1001).astype("float32")
    np.testing.assert_allclose(to_numpy(functional.plif(z, raw, 20.0)), z, atol=2e-5)


def test_knot_histogram_matches_numpy():
    rng = np.random.default_rng(11)
    idx = rng.integers(0, 7, size=(5, 9)).astype("int32")
    w1, w2 = (rng.normal(size=(5, 9)).astype("float32") for _ in range(2))
    a, b = functional.knot_histogram(idx, (w1, w2), 10)
    np.testing.assert_allclose(to_numpy(a), np.bincount(idx.ravel(), w1.ravel(), 10), atol=1e-5)
    np.testing.assert_allclose(to_numpy(b), np.bincount(idx.ravel(), w2.ravel(), 10), atol=1e-5)


def test_knot_histogram_matches_segment_sum():
    """The backend's histogram kernel (TensorFlow: `DenseBincount`) equals
    the `keras.ops` reference, `ops.segment_sum`."""
    rng = np.random.default_rng(12)
    idx = rng.integers(0, 1000, size=(20000,)).astype("int32")
    w = rng.normal(size=(20000,)).astype("float32")
    (ours,) = functional.knot_histogram(idx, (w,), 1000)
    ref = ops.segment_sum(w, idx, num_segments=1000)
    np.testing.assert_allclose(to_numpy(ours), to_numpy(ref), atol=1e-4)


def test_numpy_gradient_reference_matches_finite_differences():
    rng = np.random.default_rng(13)
    z = rng.normal(size=(40,)) * 2
    raw = rng.normal(size=(8,))
    w = rng.normal(size=(40,))
    _, d_raw = numpy_plif_grads(z, raw, 1.5, w)
    for _ in range(3):
        direction = rng.normal(size=raw.shape)
        eps = 1e-6
        plus = np.sum(w * numpy_plif(z, raw + eps * direction, 1.5))
        minus = np.sum(w * numpy_plif(z, raw - eps * direction, 1.5))
        np.testing.assert_allclose((plus - minus) / (2 * eps), d_raw @ direction, rtol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("tile_elements", [None, 40])
def test_custom_gradient_matches_autodiff(monkeypatch, tile_elements, compiled):
    """`plif`'s custom gradient (one piece, or tiles of 40 of the 141 scores:
    3 tiles and a remainder) equals autodiff of the plain formula and the
    NumPy float64 gradient, eagerly and compiled (`backends.jit`)."""
    if tile_elements is not None:
        monkeypatch.setattr(plif_kernels, "TILE_ELEMENTS", tile_elements)
    rng = np.random.default_rng(2)
    z = (rng.normal(size=(3, 47)) * 3).astype(DTYPE)
    raw = rng.normal(size=(16,)).astype(DTYPE)
    w = rng.normal(size=(3, 47)).astype(DTYPE)

    def ours(z, raw):
        return ops.sum(ops.multiply(functional.plif(z, raw, 2.0), w))

    def ref(z, raw):
        return ops.sum(ops.multiply(functional.plif_reference(z, raw, 2.0), w))

    if compiled:
        ours, ref = jit(ours), jit(ref)
    value, grads, _ = value_and_grad(ours, [z, raw])
    ref_value, ref_grads, _ = value_and_grad(ref, [z, raw])
    np.testing.assert_allclose(value, ref_value, rtol=TOL)
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, TOL)
    for a, b in zip(grads, numpy_plif_grads(z, raw, 2.0, w)):
        assert_close(a, b, 1e-10 if FLOAT64 else 1e-4)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("tile_elements", [None, 36, 54])
def test_fused_log_likelihood_matches_dense(monkeypatch, tile_elements, compiled):
    """`plif_log_likelihood` (one tile, tiles dividing the rows, tiles with a
    remainder) equals `log_softmax(plif(z))[t]`: values and gradients,
    eagerly and compiled."""
    if tile_elements is not None:
        # V = 9: 4 rows per tile (5 tiles of 20 rows), or 6 (3 + remainder 2).
        monkeypatch.setattr(plif_kernels, "TILE_ELEMENTS", tile_elements)
    rng = np.random.default_rng(3)
    z = (rng.normal(size=(4, 5, 9)) * 2).astype(DTYPE)
    raw = rng.normal(size=(24,)).astype(DTYPE)
    t = rng.integers(0, 9, size=(4, 5)).astype("int32")
    u = rng.normal(size=(4, 5)).astype(DTYPE)

    def ours(z, raw):
        return functional.plif_log_likelihood(z, raw, 1.5, t)

    def ref(z, raw):
        return dense_ll(z, raw, 1.5, t)

    if compiled:
        ours, ref = jit(ours), jit(ref)
    ll = ours(z, raw)
    assert tuple(ll.shape) == (4, 5)
    assert_close(to_numpy(ll), to_numpy(ref(z, raw)), TOL)
    _, grads, _ = value_and_grad(lambda z, raw: ops.sum(ops.multiply(ours(z, raw), u)), [z, raw])
    _, ref_grads, _ = value_and_grad(lambda z, raw: ops.sum(ops.multiply(ref(z, raw), u)), [z, raw])
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, TOL)


@pytest.mark.parametrize("tile_elements", [40, None])
def test_torch_tiles_match_the_keras_ops_tiles(monkeypatch, tile_elements):
    """On PyTorch the tiles of `plif_log_likelihood` and `plif` run in
    place (`dispatch.uses_torch_tiles`, `plif_torch`'s loops); with the
    histogram method forced to `"sorted"` they run the `keras.ops` tiles.
    Both give the same values and gradients (several tiles and a shorter
    last one with `tile_elements=40`, scores past the knot bound, repeated
    targets, a zero cotangent); on TensorFlow and JAX the check is that the
    in-place tiles are never chosen."""
    from keras_softmax_heads.functional import dispatch

    if tile_elements is not None:
        monkeypatch.setattr(plif_kernels, "TILE_ELEMENTS", tile_elements)
    rng = np.random.default_rng(8)
    z = (rng.normal(size=(20, 9)) * 2).astype(DTYPE)
    raw = rng.normal(size=(24,)).astype(DTYPE)
    t = np.array([0, 8, 8, 3] * 5, "int32")
    u = rng.normal(size=(20,)).astype(DTYPE)
    u[3] = 0.0

    v = rng.normal(size=(20, 9)).astype(DTYPE)

    def loss(z, raw):
        return ops.sum(ops.multiply(functional.plif_log_likelihood(z, raw, 1.5, t), u))

    def plif_loss(z, raw):  # `plif` itself: its own loop on PyTorch
        return ops.sum(ops.multiply(functional.plif(z, raw, 1.5), v))

    scores = ops.convert_to_tensor(z)
    assert dispatch.uses_torch_tiles(scores) == (BACKEND == "torch")
    for fn in (loss, plif_loss):
        value, grads, _ = value_and_grad(fn, [z, raw])
        with dispatch.forced_histogram_method("sorted"):
            assert not dispatch.uses_torch_tiles(scores)
            ref_value, ref_grads, _ = value_and_grad(fn, [z, raw])
        assert_close(value, ref_value, TOL)
        for a, b in zip(grads, ref_grads):
            assert_close(a, b, TOL)
    # `plif_scores` (the summed passes' PLIF), NaN and scores past the bound too.
    scores = ops.convert_to_tensor(np.concatenate([z, [[np.nan, 9.0, -9.0] * 3]]))
    tables = functional.plif_tables(ops.convert_to_tensor(raw), 1.5)
    out = [to_numpy(x) for x in functional.plif_scores(tables, scores)]
    with dispatch.forced_histogram_method("sorted"):
        ref = [to_numpy(x) for x in functional.plif_scores(tables, scores)]
    assert out[2].dtype == ref[2].dtype == np.int32 and out[2].shape == ref[2].shape
    for a, b in zip(out, ref):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, equal_nan=True)
    if BACKEND == "torch":
        import torch

        assert not dispatch.uses_torch_tiles(torch.zeros(2, requires_grad=True))
        assert not dispatch.uses_torch_tiles(torch.zeros(2, dtype=torch.float16))
        with pytest.raises(ValueError, match="name='scores'"):
            dispatch.torch_tiled_kernel("scores")


@pytest.mark.parametrize("tile_elements", [None, 40])
def test_jit_equals_eager(monkeypatch, tile_elements):
    if tile_elements is not None:
        monkeypatch.setattr(plif_kernels, "TILE_ELEMENTS", tile_elements)
    rng = np.random.default_rng(14)
    z = (rng.normal(size=(6, 9)) * 2).astype("float32")
    raw = rng.normal(size=(24,)).astype("float32")
    t = rng.integers(0, 9, size=(6,)).astype("int32")
    for fn in [
        lambda z, raw: functional.plif(z, raw, 1.5),
        lambda z, raw: functional.plif_log_likelihood(z, raw, 1.5, t),
    ]:
        np.testing.assert_allclose(
            to_numpy(jit(fn)(z, raw)), to_numpy(fn(z, raw)), rtol=1e-5, atol=1e-5
        )


@tf_only
@pytest.mark.parametrize("tile_elements", [None, 40])
def test_graph_mode_gradients(monkeypatch, tile_elements):
    """TensorFlow graph mode (`tf.function` without XLA) gives the eager
    values and gradients."""
    import tensorflow as tf

    if tile_elements is not None:
        monkeypatch.setattr(plif_kernels, "TILE_ELEMENTS", tile_elements)
    rng = np.random.default_rng(15)
    z = tf.constant(rng.normal(size=(4, 5, 9)) * 2, tf.float64)
    raw = tf.constant(rng.normal(size=(24,)), tf.float64)
    t = tf.constant(rng.integers(0, 9, size=(4, 5)), tf.int32)

    def values_and_grads(z, raw):
        with tf.GradientTape() as tape:
            tape.watch([z, raw])
            loss = tf.reduce_sum(functional.plif_log_likelihood(z, raw, 1.5, t))
            loss += tf.reduce_sum(functional.plif(z, raw, 1.5) ** 2)
        return loss, tape.gradient(loss, [z, raw])

    eager = values_and_grads(z, raw)
    graph = tf.function(values_and_grads, autograph=False)(z, raw)
    for a, b in zip(tf.nest.flatten(graph), tf.nest.flatten(eager)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-12)


def _xla_calls(fn, *args):
    """`(forward, backward)` counts of the calls compiled with XLA
    (`_XlaMustCompile`) in the graph of `fn`'s value and gradient under a
    `tf.function` without `jit_compile` (a backward pass's function is
    named so: `functional.dispatch.xla_in_graph` names each call after the
    function it compiles); the values and gradients too."""
    import tensorflow as tf

    def values_and_grads(*args):
        with tf.GradientTape() as tape:
            tape.watch(args)
            loss = tf.reduce_sum(fn(*args) ** 2)
        return loss, tape.gradient(loss, args)

    function = tf.function(values_and_grads, autograph=False)
    graph = function.get_concrete_function(*args).graph
    compiled = [op.get_attr("f").name for op in graph.get_operations()
                if op.type in ("PartitionedCall", "StatefulPartitionedCall")
                and op.get_attr("_XlaMustCompile")]
    backward = [name for name in compiled if "backward" in name]
    return (len(compiled) - len(backward), len(backward)), function(*args), values_and_grads(*args)


@tf_only
@pytest.mark.parametrize("kernel", ["plif", "plif_log_likelihood", "interpolate_table",
                                    "monotonic_mlp"])
def test_graph_mode_kernels_compile_with_xla(kernel):
    """In a TensorFlow graph without XLA (a Keras step under `jit_compile="auto"`
    on a CPU) each `[N, V]` kernel of PLIF and the monotonic MLP runs as one
    call compiled with XLA (`dispatch.xla_in_graph`), and so does its
    gradient; the values and gradients are the eager ones."""
    import tensorflow as tf

    from keras_softmax_heads.heads.monotonic_softmax import monotonic_mlp

    rng = np.random.default_rng(3)
    z = tf.constant(rng.normal(size=(6, 9)) * 2, tf.float64)
    params = tf.constant(rng.normal(size=(24,)), tf.float64)
    targets = tf.constant(rng.integers(0, 9, 6), tf.int32)
    fn, args = {
        "plif": (lambda z, raw: functional.plif(z, raw, 1.5), (z, params)),
        "plif_log_likelihood": (
            lambda z, raw: functional.plif_log_likelihood(z, raw, 1.5, targets), (z, params)),
        "interpolate_table": (
            lambda z, table: functional.interpolate_table(z, table, -3.0, 6.0), (z, params)),
        "monotonic_mlp": (
            lambda z, u: monotonic_mlp(z, u, u * 0.5, -u), (z, params)),
    }[kernel]
    counts, graph, eager = _xla_calls(fn, *args)
    assert counts == (1, 1), counts
    for a, b in zip(tf.nest.flatten(graph), tf.nest.flatten(eager)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


@tf_only
def test_fused_log_likelihood_unknown_rows():
    """Rows unknown at tracing time (graph mode): the untiled path."""
    import tensorflow as tf

    rng = np.random.default_rng(4)
    raw = tf.constant(rng.normal(size=(24,)), tf.float32)

    @tf.function(autograph=False, input_signature=[
        tf.TensorSpec([None, None, 7], tf.float32), tf.TensorSpec([None, None], tf.int32)
    ])
    def loss_and_grad(z, t):
        with tf.GradientTape() as tape:
            tape.watch([z, raw])
            ll = functional.plif_log_likelihood(z, raw, 1.5, t)
            total = tf.reduce_sum(ll)
        return ll, tape.gradient(total, [z, raw])

    z = tf.constant(rng.normal(size=(3, 2, 7)), tf.float32)
    t = tf.constant(rng.integers(0, 7, size=(3, 2)), tf.int32)
    ll, grads = loss_and_grad(z, t)
    with tf.GradientTape() as tape:
        tape.watch([z, raw])
        ref = dense_ll(z, raw, 1.5, t)
        total = tf.reduce_sum(ref)
    ref_grads = tape.gradient(total, [z, raw])
    np.testing.assert_allclose(np.asarray(ll), np.asarray(ref), atol=1e-5)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def _tensor_sizes_in_graph(fn, *args):
    graph = fn.get_concrete_function(*args).graph
    sizes = []
    for op in graph.get_operations():
        for out in op.outputs:
            if out.shape.is_fully_defined():
                sizes.append(int(np.prod(out.shape.as_list())))
    return sizes


def _tensor_sizes_in_hlo(hlo):
    sizes = []
    for dims in re.findall(r"\b(?:f32|f64|s32|c64|c128|pred|s64)\[([0-9,]*)\]", hlo):
        sizes.append(int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
    return sizes


def _tf_gradient_step(loss_fn):
    """`(z, raw) -> (loss, [dz, draw])` on TensorFlow, for a `tf.function`."""
    import tensorflow as tf

    def step(z, raw):
        with tf.GradientTape() as tape:
            tape.watch([z, raw])
            loss = loss_fn(z, raw)
        return loss, tape.gradient(loss, [z, raw])

    return step


@pytest.mark.skipif(BACKEND == "torch", reason="no compiled graph to inspect on PyTorch")
@pytest.mark.parametrize("path", ["fused", "plif"])
def test_memory_does_not_scale_with_knots_times_batch(monkeypatch, path):
    """With K = 200k knots and N V = 8 * 64 scores, no tensor of a training
    step (forward + backward; TensorFlow graph and XLA-optimised HLO, JAX's
    optimised HLO) is larger than `max(K, N V)` elements: the backward state
    is index-sized (`[N, V]`) and the slope tables and their gradient are
    `[K]`; nothing is `N x K` or `N x V x K` (tiling forced: 2 rows per
    tile)."""
    monkeypatch.setattr(plif_kernels, "TILE_ELEMENTS", 128)  # 2 rows per tile
    num_knots, rows, vocab = 200_000, 8, 64
    rng = np.random.default_rng(5)
    z = rng.normal(size=(rows, vocab)).astype("float32")
    raw = rng.normal(size=(num_knots,)).astype("float32")
    t = rng.integers(0, vocab, size=(rows,)).astype("int32")

    def loss_fn(z, raw):
        if path == "fused":
            return -ops.sum(functional.plif_log_likelihood(z, raw, 3.0, t))
        log_p = ops.log_softmax(functional.plif(z, raw, 3.0))
        return -ops.sum(ops.take_along_axis(log_p, t[:, None], axis=-1))

    # (XLA pads the [K] cumulative sums by a few elements.)
    limit = 1.01 * max(num_knots, rows * vocab)
    if BACKEND == "jax":
        import jax

        step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
        hlo_sizes = _tensor_sizes_in_hlo(step.lower(z, raw).compile().as_text())
        assert max(hlo_sizes) <= limit
        assert num_knots in hlo_sizes
        return
    import tensorflow as tf

    step = _tf_gradient_step(loss_fn)
    z, raw = tf.constant(z), tf.constant(raw)
    graph_sizes = _tensor_sizes_in_graph(tf.function(step, autograph=False), z, raw)
    assert max(graph_sizes) <= limit
    if path == "fused":  # the training path, also after XLA's optimisations
        compiled = tf.function(step, autograph=False, jit_compile=True)
        hlo = compiled.experimental_get_compiler_ir(z, raw)(stage="optimized_hlo")
        assert max(_tensor_sizes_in_hlo(hlo)) <= limit
    # Sanity: the check sees the [K] tables and the [N, V] scores.
    assert num_knots in graph_sizes and rows * vocab in graph_sizes


@pytest.mark.skipif(BACKEND == "torch", reason="no compiled graph to inspect on PyTorch")
@pytest.mark.parametrize("path", ["fused", "plif"])
def test_no_index_saved_for_the_backward_pass(monkeypatch, path):
    """The training step keeps no int32 tensor of the scores' size: the
    backward tiles recompute the interval index from `z` (before, the
    forward pass saved it, `N V` int32 between the passes). Checked on the
    XLA-optimised HLO of the loss and gradients, tiled (4 rows a tile)."""
    monkeypatch.setattr(plif_kernels, "TILE_ELEMENTS", 4 * 512)
    rows, vocab = 64, 512
    rng = np.random.default_rng(6)
    z = rng.normal(scale=2.0, size=(rows, vocab)).astype("float32")
    raw = rng.normal(size=(300,)).astype("float32")
    t = rng.integers(0, vocab, size=(rows,)).astype("int32")

    def loss_fn(z, raw):
        if path == "fused":
            return -ops.sum(functional.plif_log_likelihood(z, raw, 3.0, t))
        return ops.sum(functional.plif(z, raw, 3.0) * z)

    if BACKEND == "jax":
        import jax

        hlo = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))).lower(z, raw).compile().as_text()
    else:
        import tensorflow as tf

        z, raw = tf.constant(z), tf.constant(raw)
        compiled = tf.function(_tf_gradient_step(loss_fn), autograph=False, jit_compile=True)
        hlo = compiled.experimental_get_compiler_ir(z, raw)(stage="optimized_hlo")
    int_sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                 for dims in re.findall(r"\bs32\[([0-9,]*)\]", hlo)]
    assert max(int_sizes) < rows * vocab, sorted(int_sizes)[-3:]
    # Sanity: the check sees a tile's index (4 rows).
    assert 4 * vocab in int_sizes, sorted(set(int_sizes))


# ---------------------------------------------------------------------- head
def test_head_numpy_reference():
    rng = np.random.default_rng(6)
    h = rng.normal(size=(5, 7, 8)).astype("float32")
    head = PLIFSoftmax(11, num_knots=32, knot_bound=1.0, bias_initializer="random_normal")
    head(h)
    head.raw_slopes.assign(rng.normal(size=(32,)).astype("float32"))
    out = to_numpy(head(h))
    z = h.astype("float64") @ to_numpy(head.kernel) + to_numpy(head.bias)
    expected = numpy_log_softmax(numpy_plif(z, to_numpy(head.raw_slopes), 1.0))
    np.testing.assert_allclose(out, expected, atol=1e-5)
    np.testing.assert_allclose(np.exp(out).sum(-1), 1.0, atol=1e-5)
    y = rng.integers(0, 11, size=(5, 7))
    np.testing.assert_allclose(
        to_numpy(head.log_likelihood(h, y)),
        np.take_along_axis(expected, y[..., None], -1)[..., 0],
        atol=1e-5,
    )
    compiled = jit(lambda h: head(h))(h)
    np.testing.assert_allclose(to_numpy(compiled), out, atol=2e-5)
    # (The fused kernel: `log_likelihood` validates its targets eagerly.)
    fused = jit(
        lambda h: functional.plif_log_likelihood(
            head.logits(h), head.raw_slopes, head.knot_bound, y
        )
    )(h)
    np.testing.assert_allclose(
        to_numpy(fused), to_numpy(head.log_likelihood(h, y)), atol=2e-5
    )


def test_head_gradients_match_reference():
    """Gradients of the head's training loss (fused path) w.r.t. inputs and
    all weights equal those of the straightforward PLIF (autodiff)."""
    rng = np.random.default_rng(16)
    h = rng.normal(size=(6, 5)).astype("float32")
    y = rng.integers(0, 13, size=(6,))
    head = PLIFSoftmax(13, num_knots=32, knot_bound=1.0)
    head(h)
    head.raw_slopes.assign(rng.normal(size=(32,)).astype("float32"))

    def ref_loss(h):
        z = head.logits(h)
        ll = dense_ll(z, head.raw_slopes, head.knot_bound, y.astype("int32"))
        return -ops.sum(ll)

    def loss(h):
        return ops.sum(head.training_loss(h, y))

    value, g_in, g_w = value_and_grad(loss, [h], head.trainable_weights)
    ref_value, ref_in, ref_w = value_and_grad(ref_loss, [h], head.trainable_weights)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for a, b in zip(g_in + g_w, ref_in + ref_w):
        assert_close(a, b, 1e-5)


# JAX under `-m slow` (7 s): a property of the initial weights.
@slow_on("jax")
def test_identity_initialisation_equals_full_softmax():
    rng = np.random.default_rng(7)
    h = rng.normal(size=(4, 6, 8)).astype("float32") * 3
    y = rng.integers(0, 50, size=(4, 6))
    plif = PLIFSoftmax(50, bias_initializer="random_normal")  # K = 1e5, T = 20
    full = FullSoftmax(50)
    plif(h)
    full(h)
    full.set_weights(plif.get_weights()[:2])
    np.testing.assert_allclose(to_numpy(plif(h)), to_numpy(full(h)), atol=1e-5)
    np.testing.assert_allclose(
        to_numpy(plif.log_likelihood(h, y)), to_numpy(full.log_likelihood(h, y)), atol=1e-5
    )


def test_preserves_argmax():
    rng = np.random.default_rng(8)
    h = rng.normal(size=(128, 8)).astype("float32")
    head = PLIFSoftmax(40, num_knots=200, knot_bound=2.0)
    head(h)
    head.raw_slopes.assign(rng.normal(size=(200,)).astype("float32") * 3)
    np.testing.assert_array_equal(
        np.argmax(to_numpy(head(h)), -1), np.argmax(to_numpy(head.logits(h)), -1)
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision(policy):
    """Slopes stay float32 (the identity initialisation survives), outputs
    and log-likelihoods are float32 and match the float32 head."""
    rng = np.random.default_rng(9)
    h = rng.normal(size=(3, 4)).astype("float32")
    y = rng.integers(0, 9, size=(3,))
    reference = PLIFSoftmax(9, num_knots=16, knot_bound=2.0)
    reference(h)
    keras.config.set_dtype_policy(policy)
    head = PLIFSoftmax(9, num_knots=16, knot_bound=2.0)
    head(h)
    head.set_weights(reference.get_weights())
    assert keras.backend.standardize_dtype(head.raw_slopes.dtype) == "float32"
    z = head.logits(h)
    np.testing.assert_allclose(
        to_numpy(ops.cast(head.score_transform(z), "float32")),
        to_numpy(ops.cast(z, "float32")),
        atol=1e-5,
    )
    out, ll = head(h), head.log_likelihood(h, y)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    assert keras.backend.standardize_dtype(ll.dtype) == "float32"
    tol = 0.05 if policy == "mixed_bfloat16" else 0.01
    np.testing.assert_allclose(to_numpy(out), to_numpy(reference(h)), atol=tol)
    np.testing.assert_allclose(
        to_numpy(ll), to_numpy(reference.log_likelihood(h, y)), atol=tol
    )
    _, _, grads = value_and_grad(lambda h: ops.sum(head.training_loss(h, y)), [h], head.trainable_weights)
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_weights_and_config():
    head = PLIFSoftmax(9, num_knots=10, knot_bound=3.0)
    head.build((None, 4))
    assert [w.path.split("/")[-1] for w in head.trainable_weights] == [
        "kernel",
        "bias",
        "raw_slopes",
    ]
    np.testing.assert_allclose(to_numpy(ops.softplus(head.raw_slopes)), 1.0, rtol=1e-6)
    config = head.get_config()
    assert config["num_knots"] == 10 and config["knot_bound"] == 3.0
    assert config["chunk_size"] is None
    assert PLIFSoftmax.from_config(config).get_config() == config
    defaults = PLIFSoftmax(9).get_config()
    assert defaults["num_knots"] == 100_000 and defaults["knot_bound"] == 20.0


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="keras_softmax_heads.chunked is TensorFlow-only"
)
def test_chunked_loss_matches_fused():
    rng = np.random.default_rng(10)
    h = rng.normal(size=(6, 5)).astype("float32")
    y = rng.integers(0, 13, size=(6,))
    fused = PLIFSoftmax(13, num_knots=32, knot_bound=1.0)
    chunked = PLIFSoftmax(13, num_knots=32, knot_bound=1.0, chunk_size=5)
    fused(h)
    chunked(h)
    fused.raw_slopes.assign(rng.normal(size=(32,)).astype("float32"))
    chunked.set_weights(fused.get_weights())
    results = []
    for head in [fused, chunked]:
        value, _, grads = value_and_grad(
            lambda h, head=head: ops.sum(head.training_loss(h, y)), [h], head.trainable_weights
        )
        results.append((value, grads))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("num_knots", [0, -5, 2.5, True, "64", None])
def test_bad_num_knots(num_knots):
    with pytest.raises(ValueError, match=re.escape(f"Received: num_knots={num_knots!r}")):
        PLIFSoftmax(10, num_knots=num_knots)


@pytest.mark.parametrize("knot_bound", [0, -1.0, float("inf"), float("nan"), "5", None])
def test_bad_knot_bound(knot_bound):
    with pytest.raises(ValueError, match="Received: knot_bound="):
        PLIFSoftmax(10, knot_bound=knot_bound)
    with pytest.raises(ValueError, match="Received: knot_bound="):
        functional.plif(np.zeros([3], "float32"), np.zeros([4], "float32"), knot_bound)
