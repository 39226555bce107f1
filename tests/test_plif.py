import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from battery import HeadBattery
from references import numpy_log_softmax
from references import numpy_plif
from references import softplus

from keras_softmax_heads import functional
from keras_softmax_heads.heads.full_softmax import FullSoftmax
from keras_softmax_heads.heads.plif_softmax import PLIFSoftmax


def dense_ll(z, raw, knot_bound, targets):
    log_p = tf.nn.log_softmax(functional.plif_reference(z, raw, knot_bound))
    return tf.gather(log_p, targets, batch_dims=len(targets.shape))


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
def test_numpy_reference():
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(37,)) * 2
    z = np.concatenate([rng.normal(size=500) * 4, [-50.0, -3.0, 0.0, 3.0, 50.0]])
    expected = numpy_plif(z, raw, 3.0)
    for dtype in ["float32", "float64"]:
        out = functional.plif(tf.constant(z, dtype), tf.constant(raw, dtype), 3.0)
        assert out.dtype == dtype
        np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)
    half = functional.plif(tf.constant(z[:8], tf.bfloat16), raw.astype("float32"), 3.0)
    assert half.dtype == tf.bfloat16


def test_monotone_inside_and_outside_and_continuous_at_knots():
    rng = np.random.default_rng(1)
    num_knots, bound = 50, 2.0
    raw = tf.constant(rng.normal(size=(num_knots,)) * 3, tf.float64)
    grid = tf.constant(np.linspace(-3 * bound, 3 * bound, 30001), tf.float64)
    f = np.asarray(functional.plif(grid, raw, bound))
    assert np.all(np.diff(f) > 0), "PLIF must be strictly increasing"
    # Left and right limits at every knot (the outer knots included).
    knots = -bound + 2 * bound * np.arange(num_knots + 1) / num_knots
    delta = 1e-9
    left = np.asarray(functional.plif(tf.constant(knots - delta), raw, bound))
    right = np.asarray(functional.plif(tf.constant(knots + delta), raw, bound))
    np.testing.assert_allclose(left, right, atol=1e-5)
    # float32 too, within float32 resolution of the knot positions.
    raw32 = tf.cast(raw, tf.float32)
    left32 = np.asarray(functional.plif(tf.constant(knots - 1e-5, tf.float32), raw32, bound))
    right32 = np.asarray(functional.plif(tf.constant(knots + 1e-5, tf.float32), raw32, bound))
    slopes = softplus(np.asarray(raw))
    np.testing.assert_allclose(left32, right32, atol=2e-5 * slopes.max() + 1e-5)


def test_identity_slopes_give_identity():
    raw = tf.fill([1000], functional.plif_identity_raw_slope())
    z = tf.constant(np.linspace(-30, 30, 1001), tf.float32)
    np.testing.assert_allclose(np.asarray(functional.plif(z, raw, 20.0)), np.asarray(z), atol=2e-5)


@pytest.mark.parametrize(
    "tile_elements, mode",
    [(None, "eager"), (None, "graph"), (None, "xla"), (40, "eager"), (40, "xla")],
)
def test_custom_gradient_matches_autodiff(monkeypatch, tile_elements, mode):
    """`plif`'s custom gradient (one piece, or tiles of 40 of the 141 scores:
    3 tiles and a remainder) equals autodiff of the plain formula, float64."""
    if tile_elements is not None:
        monkeypatch.setattr(functional, "TILE_ELEMENTS", tile_elements)
    rng = np.random.default_rng(2)
    z = tf.constant(rng.normal(size=(3, 47)) * 3, tf.float64)
    raw = tf.constant(rng.normal(size=(16,)), tf.float64)
    w = tf.constant(rng.normal(size=(3, 47)), tf.float64)

    def values_and_grads(z, raw):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([z, raw])
            f = functional.plif(z, raw, 2.0)
            ours = tf.reduce_sum(f * w)
            ref = tf.reduce_sum(functional.plif_reference(z, raw, 2.0) * w)
        return f, ours, ref, tape.gradient(ours, [z, raw]), tape.gradient(ref, [z, raw])

    if mode != "eager":
        values_and_grads = tf.function(values_and_grads, jit_compile=mode == "xla")
    f, ours, ref, g_ours, g_ref = values_and_grads(z, raw)
    assert tuple(f.shape) == (3, 47)
    np.testing.assert_allclose(float(ours), float(ref), rtol=1e-12)
    for a, b in zip(g_ours, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-10)


@pytest.mark.parametrize(
    "tile_elements, mode, histogram",
    [
        (None, "eager", "bincount"),
        (40, "eager", "bincount"),
        (54, "graph", "bincount"),
        (None, "xla", "bincount"),
        (54, "xla", "bincount"),
        (40, "eager", "complex_scatter"),
        (54, "xla", "complex_scatter"),
    ],
)
def test_fused_log_likelihood_matches_dense(monkeypatch, tile_elements, mode, histogram):
    """`plif_log_likelihood` (one tile, tiles dividing the rows, tiles with a
    remainder; both tile histograms) equals `log_softmax(plif(z))[t]`: values
    and gradients."""
    monkeypatch.setattr(functional, "TILE_HISTOGRAM", histogram)
    if tile_elements is not None:
        # V = 9: 4 rows per tile (5 tiles of 20 rows), or 6 (3 + remainder 2).
        monkeypatch.setattr(functional, "TILE_ELEMENTS", tile_elements)
    rng = np.random.default_rng(3)
    z = tf.constant(rng.normal(size=(4, 5, 9)) * 2, tf.float64)
    raw = tf.constant(rng.normal(size=(24,)), tf.float64)
    t = tf.constant(rng.integers(0, 9, size=(4, 5)), tf.int32)
    u = tf.constant(rng.normal(size=(4, 5)), tf.float64)

    def values_and_grads(z, raw):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([z, raw])
            ll = functional.plif_log_likelihood(z, raw, 1.5, t)
            ref = dense_ll(z, raw, 1.5, t)
            a, b = tf.reduce_sum(ll * u), tf.reduce_sum(ref * u)
        return ll, ref, tape.gradient(a, [z, raw]), tape.gradient(b, [z, raw])

    if mode != "eager":
        values_and_grads = tf.function(values_and_grads, jit_compile=mode == "xla")
    ll, ref, g_ll, g_ref = values_and_grads(z, raw)
    assert tuple(ll.shape) == (4, 5)
    np.testing.assert_allclose(np.asarray(ll), np.asarray(ref), atol=1e-12)
    for a, b in zip(g_ll, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-12)


def test_fused_log_likelihood_unknown_rows():
    """Rows unknown at tracing time (graph mode): the untiled path."""
    rng = np.random.default_rng(4)
    raw = tf.constant(rng.normal(size=(24,)), tf.float32)

    @tf.function(input_signature=[
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


def _tensor_sizes_in_hlo(fn, *args):
    hlo = fn.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
    sizes = []
    for dims in re.findall(r"\b(?:f32|f64|s32|c64|c128|pred|s64)\[([0-9,]*)\]", hlo):
        sizes.append(int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
    return sizes


@pytest.mark.parametrize("path", ["fused", "plif"])
def test_memory_does_not_scale_with_knots_times_batch(monkeypatch, path):
    """With K = 200k knots and N V = 8 * 64 scores, no tensor of a training
    step (forward + backward, graph and XLA-optimised HLO) is larger than
    `max(K, N V)` elements: the backward state is index-sized (`[N, V]`)
    and the slope tables and their gradient are `[K]`; nothing is `N x K`
    or `N x V x K` (tiling forced: 2 rows per tile)."""
    monkeypatch.setattr(functional, "TILE_ELEMENTS", 128)  # 2 rows per tile
    num_knots, rows, vocab = 200_000, 8, 64
    rng = np.random.default_rng(5)
    z = tf.constant(rng.normal(size=(rows, vocab)), tf.float32)
    raw = tf.constant(rng.normal(size=(num_knots,)), tf.float32)
    t = tf.constant(rng.integers(0, vocab, size=(rows,)), tf.int32)

    def step(z, raw):
        with tf.GradientTape() as tape:
            tape.watch([z, raw])
            if path == "fused":
                loss = -tf.reduce_sum(functional.plif_log_likelihood(z, raw, 3.0, t))
            else:
                log_p = tf.nn.log_softmax(functional.plif(z, raw, 3.0))
                loss = -tf.reduce_sum(tf.gather(log_p, t, batch_dims=1))
        return loss, tape.gradient(loss, [z, raw])

    # (XLA pads the [K] cumulative sums by a few elements.)
    limit = 1.01 * max(num_knots, rows * vocab)
    graph_sizes = _tensor_sizes_in_graph(tf.function(step), z, raw)
    assert max(graph_sizes) <= limit
    if path == "fused":  # the training path, also after XLA's optimisations
        hlo_sizes = _tensor_sizes_in_hlo(tf.function(step, jit_compile=True), z, raw)
        assert max(hlo_sizes) <= limit
    # Sanity: the check sees the [K] tables and the [N, V] scores.
    assert num_knots in graph_sizes and rows * vocab in graph_sizes


# ---------------------------------------------------------------------- head
def test_head_numpy_reference():
    rng = np.random.default_rng(6)
    h = rng.normal(size=(5, 7, 8)).astype("float32")
    head = PLIFSoftmax(11, num_knots=32, knot_bound=1.0, bias_initializer="random_normal")
    head(h)
    head.raw_slopes.assign(rng.normal(size=(32,)).astype("float32"))
    out = np.asarray(head(h))
    z = h.astype("float64") @ head.kernel.numpy() + head.bias.numpy()
    expected = numpy_log_softmax(numpy_plif(z, head.raw_slopes.numpy(), 1.0))
    np.testing.assert_allclose(out, expected, atol=1e-5)
    y = rng.integers(0, 11, size=(5, 7))
    np.testing.assert_allclose(
        np.asarray(head.log_likelihood(h, y)),
        np.take_along_axis(expected, y[..., None], -1)[..., 0],
        atol=1e-5,
    )


def test_identity_initialisation_equals_full_softmax():
    rng = np.random.default_rng(7)
    h = rng.normal(size=(4, 6, 8)).astype("float32") * 3
    y = rng.integers(0, 50, size=(4, 6))
    plif = PLIFSoftmax(50, bias_initializer="random_normal")  # K = 1e5, T = 20
    full = FullSoftmax(50)
    plif(h)
    full(h)
    full.set_weights(plif.get_weights()[:2])
    np.testing.assert_allclose(np.asarray(plif(h)), np.asarray(full(h)), atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(plif.log_likelihood(h, y)), np.asarray(full.log_likelihood(h, y)), atol=1e-5
    )


def test_preserves_argmax():
    rng = np.random.default_rng(8)
    h = rng.normal(size=(128, 8)).astype("float32")
    head = PLIFSoftmax(40, num_knots=200, knot_bound=2.0)
    head(h)
    head.raw_slopes.assign(rng.normal(size=(200,)).astype("float32") * 3)
    np.testing.assert_array_equal(
        np.argmax(np.asarray(head(h)), -1), np.argmax(np.asarray(head.logits(h)), -1)
    )


def test_slopes_are_float32_under_mixed_precision():
    keras.config.set_dtype_policy("mixed_float16")
    head = PLIFSoftmax(9, num_knots=16, knot_bound=2.0)
    h = np.random.default_rng(9).normal(size=(3, 4)).astype("float32")
    head(h)
    assert head.raw_slopes.dtype == "float32"
    # Identity initialisation survives (slopes not rounded to float16).
    np.testing.assert_allclose(
        np.asarray(head.score_transform(head.logits(h))), np.asarray(head.logits(h)), atol=1e-5
    )


def test_weights_and_config():
    head = PLIFSoftmax(9, num_knots=10, knot_bound=3.0)
    head.build((None, 4))
    assert [w.path.split("/")[-1] for w in head.trainable_weights] == [
        "kernel",
        "bias",
        "raw_slopes",
    ]
    np.testing.assert_allclose(
        np.asarray(keras.ops.softplus(head.raw_slopes)), 1.0, rtol=1e-6
    )
    config = head.get_config()
    assert config["num_knots"] == 10 and config["knot_bound"] == 3.0
    assert config["chunk_size"] is None
    assert PLIFSoftmax.from_config(config).get_config() == config
    defaults = PLIFSoftmax(9).get_config()
    assert defaults["num_knots"] == 100_000 and defaults["knot_bound"] == 20.0


def test_chunked_loss_matches_fused():
    rng = np.random.default_rng(10)
    h = tf.constant(rng.normal(size=(6, 5)), tf.float32)
    y = rng.integers(0, 13, size=(6,))
    fused = PLIFSoftmax(13, num_knots=32, knot_bound=1.0)
    chunked = PLIFSoftmax(13, num_knots=32, knot_bound=1.0, chunk_size=5)
    fused(h)
    chunked(h)
    fused.raw_slopes.assign(rng.normal(size=(32,)).astype("float32"))
    chunked.set_weights(fused.get_weights())
    results = []
    for head in [fused, chunked]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(head.training_loss(h, y))
        results.append((loss, tape.gradient(loss, head.trainable_weights)))
    np.testing.assert_allclose(float(results[0][0]), float(results[1][0]), rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("num_knots", [0, -5, 2.5, True, "64", None])
def test_bad_num_knots(num_knots):
    with pytest.raises(ValueError, match=re.escape(f"Received: num_knots={num_knots!r}")):
        PLIFSoftmax(10, num_knots=num_knots)


@pytest.mark.parametrize("knot_bound", [0, -1.0, float("inf"), float("nan"), "5", None])
def test_bad_knot_bound(knot_bound):
    with pytest.raises(ValueError, match="Received: knot_bound="):
        PLIFSoftmax(10, knot_bound=knot_bound)
    with pytest.raises(ValueError, match="Received: knot_bound="):
        functional.plif(tf.zeros([3]), tf.zeros([4]), knot_bound)
