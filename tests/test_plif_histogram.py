"""PLIF's slope histogram on every path (`functional.knot_histogram`):
the scatter-add, the scatter-free sorted form and the Pallas kernel (JAX,
interpreted on the CPU), the platform dispatch, and PLIF's gradients with
each path forced."""

import os

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import PALLAS
from backends import lower_for
from backends import jit
from backends import to_numpy
from backends import value_and_grad
from keras import ops
from multibackend import float64  # noqa: F401 (fixture)
from multibackend import float64_enabled

from keras_softmax_heads.platforms import current_platform
from keras_softmax_heads.platforms import forced_platform
from keras_softmax_heads import functional
from keras_softmax_heads.functional import dispatch

pytestmark = pytest.mark.multibackend

METHODS = ("scatter", "sorted", "spread") + (("pallas",) if PALLAS else ())
pallas_only = pytest.mark.skipif(not PALLAS, reason="Pallas' Triton kernels run on JAX")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _histogram_inputs(size, num_knots, seed):
    """Indices with hot bins (most scores in a few intervals), empty bins,
    and both ends of the range."""
    rng = np.random.default_rng(seed)
    hot = rng.normal(num_knots / 2, 1.5, size=size)
    idx = np.clip(np.round(hot), 0, num_knots - 1).astype("int32")
    idx[:2] = [0, num_knots - 1]
    weights = tuple(rng.normal(size=size).astype("float32") for _ in range(2))
    return idx, weights


def test_knot_histogram_paths_match_numpy():
    """Every path equals NumPy's float64 `bincount`, compiled (3001 scores)
    and eagerly (37; not the sorted path on JAX, which compiles each eager
    op of the scan apart; Pallas compiled only, 301 scores). One
    test, not parametrised: JAX and PyTorch run only a parametrised test's
    first case by default."""
    for method in METHODS:
        histogram = jit(
            lambda i, a, b, method=method: functional.knot_histogram(i, (a, b), 40, method=method)
        )
        # The interpreted Pallas kernel: compiled only, on fewer scores; on
        # JAX each eager op compiles apart (the sorted path: 10 s eagerly).
        cases = ((301, histogram),) if method == "pallas" else ((3001, histogram), (37, None))
        if BACKEND == "jax" and method == "sorted":
            cases = cases[:1]
        for size, run in cases:
            idx, weights = _histogram_inputs(size, 40, seed=size)
            if run is None:
                out = functional.knot_histogram(idx, weights, 40, method=method)
            else:
                out = run(idx, *weights)
            for h, w in zip(out, weights):
                expected = np.bincount(idx, w.astype("float64"), 40)
                scale = max(1.0, np.abs(expected).max())  # float32 sums of ~1000 terms
                np.testing.assert_allclose(
                    ops.convert_to_numpy(h), expected, rtol=0, atol=2e-6 * scale,
                    err_msg=f"{method}, {size} scores",
                )


def test_segment_sum_keeps_float64(float64):
    """`dispatch.segment_sum` sums float64 in float64 on every backend (Keras'
    PyTorch `segment_sum` sums in float32), a vector and rows of a 2-D
    `data`, int32 and int64 ids, and float32 as `ops.segment_sum` does."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 5, 200).astype("int32")
    data = 1.0 + rng.normal(size=(200, 3)) * 1e-9  # below float32's resolution
    out = ops.convert_to_numpy(dispatch.segment_sum(ops.convert_to_tensor(data), ids, 5))
    expected = np.zeros((5, 3))
    np.add.at(expected, ids, data)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, expected, rtol=1e-14)
    # A vector, int64 ids too.
    for id_dtype in ("int32", "int64"):
        out = dispatch.segment_sum(ops.convert_to_tensor(data[:, 1]), ids.astype(id_dtype), 5)
        assert ops.convert_to_numpy(out).dtype == np.float64
        np.testing.assert_allclose(ops.convert_to_numpy(out), expected[:, 1], rtol=1e-14)
    data32 = data.astype("float32")[:, 0]
    out32 = dispatch.segment_sum(ops.convert_to_tensor(data32), ids, 5)
    assert ops.convert_to_numpy(out32).dtype == np.float32
    np.testing.assert_array_equal(ops.convert_to_numpy(out32),
                                  ops.convert_to_numpy(ops.segment_sum(data32, ids, 5)))
    counts = dispatch.segment_sum(ops.ones([200], "int32"), ids, 5)
    assert ops.convert_to_numpy(counts).tolist() == np.bincount(ids, minlength=5).tolist()
    assert keras.backend.standardize_dtype(counts.dtype) == "int32"


def _python_scan(body, carry, xs):
    """The reference of `scan_tiles`: `body` tile by tile in Python, outputs
    stacked (Keras' TensorFlow `scan` needs outputs of the carry's structure)."""
    ys = []
    for i in range(xs[0].shape[0]):
        carry, y = body(carry, tuple(x[i] for x in xs))
        ys.append(y)
    return carry, tuple(ops.stack(parts) for parts in zip(*ys))


def test_scan_tiles_matches_a_python_loop():
    """`dispatch.scan_tiles` (a `tf.while_loop` on TensorFlow, `ops.scan` on
    JAX, a loop into preallocated outputs on PyTorch) gives the carry and
    stacked outputs of `body` run tile by tile: two outputs of different
    dtypes and shapes, none at all, and gradients through the outputs (on
    PyTorch the loop's in-place copies are recorded)."""
    rng = np.random.default_rng(3)
    x = ops.convert_to_tensor(rng.normal(size=(5, 3, 4)).astype("float32"))

    def body(carry, xs):
        (tile,) = xs
        total = carry[0] + ops.sum(tile)
        return (total,), (tile * total, ops.cast(ops.argmax(tile, axis=-1), "int32"))

    zero = ops.zeros(())
    carry, ys = dispatch.scan_tiles(body, (zero,), (x,), ("float32", "int32"))
    ref_carry, ref_ys = _python_scan(body, (zero,), (x,))
    np.testing.assert_allclose(to_numpy(carry[0]), to_numpy(ref_carry[0]), rtol=1e-6)
    for y, ref in zip(ys, ref_ys):
        assert tuple(y.shape) == tuple(ref.shape) and to_numpy(y).dtype == to_numpy(ref).dtype
        np.testing.assert_allclose(to_numpy(y), to_numpy(ref), rtol=1e-6)
    carry, ys = dispatch.scan_tiles(lambda c, xs: ((c[0] + ops.sum(xs[0]),), ()),
                                    (zero,), (x,), ())
    assert len(ys) == 0
    np.testing.assert_allclose(to_numpy(carry[0]), to_numpy(x).sum(), rtol=1e-5)

    def loss(x):
        return ops.sum(dispatch.scan_tiles(body, (ops.zeros(()),), (x,),
                                           ("float32", "int32"))[1][0] ** 2)

    def ref_loss(x):
        return ops.sum(_python_scan(body, (ops.zeros(()),), (x,))[1][0] ** 2)

    value, (grad,), _ = value_and_grad(loss, [to_numpy(x)])
    ref_value, (ref_grad,), _ = value_and_grad(ref_loss, [to_numpy(x)])
    np.testing.assert_allclose(to_numpy(value), to_numpy(ref_value), rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_clip_matches_numpy():
    """`dispatch.clip` (PLIF's interval index; `torch.clamp` on PyTorch):
    float32 with NaN and infinities, int32, float bounds on a float tensor
    and int bounds on either, as NumPy's `clip` (NaN stays NaN), in the
    input's dtype; bool and tensor bounds go through `ops.clip`."""
    x = np.array([-np.inf, -2.5, 0.0, 0.75, 3.0, np.inf, np.nan], "float32")
    for low, high in ((0.0, 1.0), (0, 2), (-1, 0.5)):
        out = dispatch.clip(ops.convert_to_tensor(x), low, high)
        assert keras.backend.standardize_dtype(out.dtype) == "float32"
        np.testing.assert_array_equal(ops.convert_to_numpy(out), np.clip(x, low, high))
    ints = np.array([-7, 0, 3, 9, 2**31 - 1], "int32")
    out = dispatch.clip(ops.convert_to_tensor(ints), 0, 4)
    assert keras.backend.standardize_dtype(out.dtype) == "int32"
    assert ops.convert_to_numpy(out).tolist() == [0, 0, 3, 4, 4]
    flags = np.array([True, False])
    np.testing.assert_array_equal(ops.convert_to_numpy(dispatch.clip(flags, 0, 1)),
                                  ops.convert_to_numpy(ops.clip(flags, 0, 1)))
    bound = ops.convert_to_tensor(np.float32(0.5))
    np.testing.assert_array_equal(ops.convert_to_numpy(dispatch.clip(x[1:5], 0.0, bound)),
                                  np.clip(x[1:5], 0.0, 0.5))


def test_softmax_score_gradient_matches_numpy():
    """`dispatch.softmax_score_gradient` (PLIF's backward tile; in place on
    PyTorch): `u (onehot - exp(f - lse))`, repeated targets, a zero
    cotangent, float32 and float64 (on TensorFlow), as NumPy's."""
    rng = np.random.default_rng(3)
    for dtype in ("float32",) + (("float64",) if BACKEND == "tensorflow" else ()):
        f = rng.normal(size=(5, 7)).astype(dtype)
        lse = np.log(np.exp(f).sum(-1))
        t = np.array([0, 6, 6, 2, 3], "int32")
        u = np.array([1.0, -2.0, 0.5, 0.0, 3.0], dtype)
        expected = u[:, None] * (np.eye(7)[t] - np.exp(f - lse[:, None]))
        out = dispatch.softmax_score_gradient(ops.convert_to_tensor(f), ops.convert_to_tensor(lse),
                                              ops.convert_to_tensor(t), ops.convert_to_tensor(u))
        assert keras.backend.standardize_dtype(out.dtype) == dtype
        np.testing.assert_allclose(ops.convert_to_numpy(out), expected, rtol=1e-5, atol=1e-6)


def test_lookup_matches_numpy():
    """`dispatch.lookup`: a `[K]` and a `[K, 3]` table at int32 and int64
    indices of any shape, and its gradient into the table (repeated
    indices add), as NumPy's `table[idx]`."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(7, 3)).astype("float32")
    idx = rng.integers(0, 7, size=(4, 5))
    for dtype in ("int32", "int64"):
        for t in (table[:, 0], table):
            out = ops.convert_to_numpy(dispatch.lookup(t, idx.astype(dtype)))
            np.testing.assert_array_equal(out, t[idx])
    weights = rng.normal(size=(4, 5)).astype("float32")
    _, (grad,), _ = value_and_grad(
        lambda t: ops.sum(ops.multiply(dispatch.lookup(t, idx.astype("int32")), weights)),
        [table[:, 0]])
    np.testing.assert_allclose(grad, np.bincount(idx.ravel(), weights.ravel(), 7), rtol=1e-6)


def test_sorted_histogram_edge_cases():
    """One score, one interval, and every score in one interval (compiled)."""

    def check(idx, w, num_knots, expected):
        run = jit(lambda i, w: dispatch.sorted_knot_histogram(i, (w,), num_knots)[0])
        np.testing.assert_allclose(ops.convert_to_numpy(run(idx, w)), expected)

    check(np.array([2], "int32"), np.array([2.5], "float32"), 4, [0, 0, 2.5, 0])
    w = np.arange(6, dtype="float32")
    check(np.zeros([2, 3], "int32"), w.reshape(2, 3), 1, [15.0])
    check(np.full([6], 3, "int32"), w, 5, [0, 0, 0, 15.0, 0])


def test_spread_histogram_copies():
    """`spread_knot_histogram` with 1, 3, 8 and more copies than scores,
    float64 weights summed in float64, and empty input, against NumPy
    (compiled); the default copies from the buffer budget; bad copies
    refused."""
    idx, weights = _histogram_inputs(1001, 40, seed=5)
    for copies in (1, 3, 8, 2000):
        run = jit(lambda i, a, b, c=copies: dispatch.spread_knot_histogram(i, (a, b), 40, c))
        for h, w in zip(run(idx, *weights), weights):
            expected = np.bincount(idx, w.astype("float64"), 40)
            np.testing.assert_allclose(ops.convert_to_numpy(h), expected, rtol=0,
                                       atol=2e-6 * np.abs(expected).max(), err_msg=copies)
    w64 = 1.0 + np.random.default_rng(0).normal(size=1001) * 1e-9  # below float32's resolution
    with float64_enabled():
        (h64,) = dispatch.spread_knot_histogram(idx, (ops.convert_to_tensor(w64),), 40, copies=4)
        h64 = ops.convert_to_numpy(h64)
    assert h64.dtype == np.float64
    np.testing.assert_allclose(h64, np.bincount(idx, w64, 40), rtol=1e-14)
    (empty,) = dispatch.spread_knot_histogram(np.zeros([0], "int32"),
                                              (np.zeros([0], "float32"),), 3)
    np.testing.assert_array_equal(ops.convert_to_numpy(empty), np.zeros(3))
    assert dispatch.spread_copies(1000, 10**6) == dispatch.SPREAD_MAX_COPIES
    assert dispatch.spread_copies(100_000, 10**6) == 8  # 2**20 // 1e5 = 10, a power of two
    assert dispatch.spread_copies(2**21, 10**6) == 1
    assert dispatch.spread_copies(10, 3) == 2
    with pytest.raises(ValueError, match="Received: copies=0"):
        dispatch.spread_copies(10, 5, copies=0)
    with pytest.raises(ValueError, match="fit int32"):
        dispatch.spread_copies(2**20, 5, copies=2**12)


def test_spread_histogram_sums_hot_bins_exactly():
    """A million float32 weights in hot bins (K = 1,000): the spread sums,
    each copy a 256th of a bin, stay within 5e-7 of the largest float64
    sum (JAX's serial float32 scatter-add on a CPU: 3.2e-6)."""
    rng = np.random.default_rng(0)
    z = rng.normal(size=2**20) * 3
    idx = np.clip(np.floor((z + 20) / 0.04), 0, 999).astype("int32")
    w = (rng.random(2**20) * 1e-3).astype("float32")
    expected = np.bincount(idx, w.astype("float64"), 1000)
    (h,) = jit(lambda i, w: dispatch.spread_knot_histogram(i, (w,), 1000))(idx, w)
    assert np.abs(ops.convert_to_numpy(h) - expected).max() < 5e-7 * expected.max()


def test_platform_dispatch(monkeypatch):
    """A forced platform picks its path; `HISTOGRAM_METHOD` overrides it."""
    expected = {
        "cpu": "scatter",
        "tpu": "sorted",
        "gpu": "pallas" if PALLAS else "scatter",
    }
    for platform, method in expected.items():
        with forced_platform(platform):
            assert dispatch.histogram_method() == method, platform
    monkeypatch.setattr(dispatch, "HISTOGRAM_METHOD", "sorted")
    assert dispatch.histogram_method() == "sorted"


def test_histogram_under_a_distribution_keeps_the_scores_shape():
    """On JAX under a `keras.distribution.ModelParallel`, every platform's
    default is the scatter, on the scores' own shape (`sharded_scatter`:
    XLA then partitions it into per-device histograms and one all-reduce;
    `tests/test_vocab_parallel_heads.py` checks the compiled collectives);
    the same sums as the flat scatter. Off JAX, without a distribution or
    under `DataParallel`, nothing changes."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 7, (3, 5, 11)).astype("int32")
    w = rng.normal(size=(3, 5, 11)).astype("float32")
    expected = np.bincount(idx.ravel(), w.ravel().astype("float64"), 7)
    assert not dispatch.sharded_scatter()
    if BACKEND != "jax":
        pytest.skip("keras.distribution runs on JAX")
    devices = keras.distribution.list_devices()[:1]
    with keras.distribution.DataParallel(devices=devices).scope():
        assert not dispatch.sharded_scatter()
        with forced_platform("tpu"):
            assert dispatch.histogram_method() == "sorted"
    mesh = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), devices)
    distribution = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch")
    with distribution.scope():
        assert dispatch.sharded_scatter()
        for platform in ("cpu", "gpu", "tpu"):
            with forced_platform(platform):
                assert dispatch.histogram_method() == "scatter", platform
        (h,) = dispatch.knot_histogram(idx, (w,), 7)
        assert tuple(h.shape) == (7,)
        assert np.abs(ops.convert_to_numpy(h) - expected).max() < 1e-5
        # An explicit method is respected.
        (h,) = dispatch.knot_histogram(idx, (w,), 7, method="sorted")
        assert np.abs(ops.convert_to_numpy(h) - expected).max() < 1e-5
        # Inside a shard's body (one device's arrays) the platform's method.
        with dispatch.per_shard():
            assert not dispatch.sharded_scatter()
            with forced_platform("tpu"):
                assert dispatch.histogram_method() == "sorted"
        assert dispatch.sharded_scatter()
    assert not dispatch.sharded_scatter()


def test_tile_elements_by_platform():
    """PLIF's tile: the CPU's (cache-sized) on a CPU, few large tiles on a
    GPU (2**28 scores) and a TPU (2**24), whatever the CPU's is set to."""
    cpu = functional.plif_kernels.TILE_ELEMENTS
    assert dispatch.tile_elements(cpu) == cpu == 2**19
    for platform, tile in (("gpu", 2**28), ("tpu", 2**24)):
        with forced_platform(platform):
            assert dispatch.tile_elements(cpu) == dispatch.ACCELERATOR_TILE_ELEMENTS[platform]
            assert dispatch.tile_elements(7) == tile


@pallas_only
def test_no_tile_loop_on_an_accelerator(monkeypatch):
    """`plif_log_likelihood` and its gradients at 4,096 x 1,000 scores (8
    CPU tiles), lowered (not run): a `scan_tiles` loop on the CPU, none on a
    GPU (lowered for CUDA, JAX reporting a GPU: the Pallas histogram through
    Triton) or a TPU (its sorted histogram), where the scores fit one tile."""
    import jax

    z = jax.ShapeDtypeStruct((4096, 1000), "float32")
    raw = jax.ShapeDtypeStruct((64,), "float32")
    t = jax.ShapeDtypeStruct((4096,), "int32")

    def loss(z, raw, t):
        return functional.plif_log_likelihood(z, raw, 2.0, t).sum()

    def lowered(platform=None):
        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        if platform is None:
            return step.trace(z, raw, t).lower().as_text()
        return lower_for(step, (z, raw, t), platform).as_text()

    assert lowered().count("stablehlo.while") == 2  # the forward and backward loops
    with forced_platform("tpu"):  # (the sorted histogram's binary search is a loop too)
        untiled = lowered().count("stablehlo.while")
        monkeypatch.setitem(dispatch.ACCELERATOR_TILE_ELEMENTS, "tpu", 2**19)
        assert lowered().count("stablehlo.while") == untiled + 2
        monkeypatch.undo()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    text = lowered("cuda")
    assert text.count("stablehlo.while") == 0 and "xla.gpu.triton" in text


def test_this_machine_is_a_cpu():
    """The test machine's platform, and today's path on it."""
    assert current_platform() == "cpu"
    assert dispatch.histogram_method() == "scatter"


def test_bad_method():
    with pytest.raises(ValueError, match="`method` must be"):
        functional.knot_histogram(np.zeros([3], "int32"), (np.ones([3], "float32"),), 2,
                                  method="bincount")
    if BACKEND != "jax":
        with pytest.raises(ValueError, match="needs the JAX backend"):
            functional.knot_histogram(np.zeros([3], "int32"), (np.ones([3], "float32"),), 2,
                                      method="pallas")


def test_plif_gradients_on_each_path(monkeypatch):
    """`plif`, `plif_log_likelihood` (tiled: 3 tiles and a remainder) and
    (not on JAX) `interpolate_table`,
    compiled (eager on TensorFlow), with the path of each forced platform whose path is not the
    CPU's (TPU: sorted; GPU on JAX: Pallas; on JAX also the fused backward
    tile, `"pallas_fused"`), and the `"spread"` option, give the gradients of the CPU path (scatter);
    each path is seen to be taken."""
    monkeypatch.setattr(functional.plif_kernels, "TILE_ELEMENTS", 40)
    for platform in ("gpu", "tpu"):  # tiled there too
        monkeypatch.setitem(dispatch.ACCELERATOR_TILE_ELEMENTS, platform, 40)
    rng = np.random.default_rng(3)
    z = (rng.normal(size=(6, 23)) * 2).astype("float32")
    raw = rng.normal(size=(16,)).astype("float32")
    w = rng.normal(size=(6, 23)).astype("float32")
    t = rng.integers(0, 23, size=(6,))

    def loss(z, raw):
        plif = ops.sum(ops.multiply(functional.plif(z, raw, 2.0), w))
        plif = plif + ops.sum(functional.plif_log_likelihood(z, raw, 2.0, t))
        if BACKEND == "jax":
            # `interpolate_table`'s custom gradient closes over values
            # traced from `z`, which `jax.jit` refuses (as before).
            return plif
        # `interpolate_table` (MonotonicSoftmax's grid) also takes the path.
        table = functional.interpolate_table(z, ops.cumsum(ops.softplus(raw)), -3.0, 6.0)
        return plif + ops.sum(ops.multiply(table, w))

    def compiled():
        """TensorFlow eagerly (its XLA compilations of the two tiled PLIFs
        take 18 s; the histogram tests above compile the sorted path
        there); elsewhere a new compiled function for each path: `jax.jit`
        of the same function would reuse its first trace, and the path
        that trace took."""
        return loss if BACKEND == "tensorflow" else jit(lambda z, raw: loss(z, raw))

    taken = []

    def spy(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: (taken.append(name), real(*a, **k))[1])

    spy(dispatch, "sorted_knot_histogram")
    spy(dispatch, "spread_knot_histogram")
    if PALLAS:
        from keras_softmax_heads.functional import plif_pallas

        spy(plif_pallas, "pallas_knot_histogram")
        spy(plif_pallas, "pallas_ll_gradient")
    _, ref_grads, _ = value_and_grad(compiled(), [z, raw])
    assert taken == []  # the CPU's scatter
    paths = [("tpu", None, "sorted_knot_histogram"), ("cpu", "spread", "spread_knot_histogram")]
    if PALLAS:
        paths += [("gpu", None, "pallas_knot_histogram"),
                  # the log-likelihood's backward tile as one kernel (interpreted)
                  ("cpu", "pallas_fused", "pallas_ll_gradient")]
    for platform, method, path in paths:
        monkeypatch.setattr(dispatch, "HISTOGRAM_METHOD", method)
        taken.clear()
        with forced_platform(platform):
            _, grads, _ = value_and_grad(compiled(), [z, raw])
        assert path in taken, (platform, method, taken)
        for a, b in zip(grads, ref_grads):
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * max(1.0, np.abs(b).max()))


@pallas_only
def test_fused_ll_gradient_matches_numpy():
    """`plif_pallas.pallas_ll_gradient` (interpreted): the score gradient
    and both slope histograms of a backward tile against NumPy, with
    padding (V = 53), programs sharing a private histogram, scores outside
    `[-T, T]` and hot bins; it lowers through Triton for a GPU."""
    import jax

    from keras_softmax_heads.functional.plif_pallas import pallas_ll_gradient

    rng = np.random.default_rng(0)
    n, vocab, knots, bound = 7, 53, 16, 2.0
    z = (rng.normal(size=(n, vocab)) * 2).astype("float32")
    z[0, :20] = 0.01  # one hot bin
    raw = rng.normal(size=knots).astype("float32")
    slopes = np.log1p(np.exp(raw)).astype("float32")
    width = 2 * bound / knots
    left = (-bound + width * np.concatenate([[0], np.cumsum(slopes)[:-1]])).astype("float32")
    t = rng.integers(0, vocab, n).astype("int32")
    u = rng.normal(size=n).astype("float32")
    idx = np.clip(np.floor((z + bound) / width), 0, knots - 1).astype(int)
    offset = z - (-bound + width * idx)
    f = left[idx] + slopes[idx] * offset
    lse = np.log(np.exp(f).sum(1)).astype("float32")
    d_f = u[:, None] * ((np.arange(vocab)[None] == t[:, None]) - np.exp(f - lse[:, None]))
    expected = [d_f * slopes[idx], np.bincount(idx.ravel(), d_f.ravel(), knots),
                np.bincount(idx.ravel(), (d_f * offset).ravel(), knots)]
    for kwargs in ({}, {"lanes": 16, "programs": 5, "copies": 2}):
        d_z, (a, b) = jax.jit(lambda *x, kw=kwargs: pallas_ll_gradient(*x, bound, **kw))(
            z, t, u, lse, slopes, left)
        for got, want in zip((d_z, a, b), expected):
            np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6)
    S = jax.ShapeDtypeStruct
    fn = jax.jit(lambda *x: pallas_ll_gradient(*x, 20.0, interpret=False))
    args = (S((4096, 33278), "float32"), S((4096,), "int32"), S((4096,), "float32"),
            S((4096,), "float32"), S((100000,), "float32"), S((100000,), "float32"))
    text = lower_for(fn, args, "cuda").as_text()
    assert text.count("xla.gpu.triton") == 1
    with pytest.raises(ValueError, match="too many scores for one call"):
        fn.trace(S((65536, 32768), "float32"), *(S((65536,), d) for d in
                                                 ("int32", "float32", "float32")),
                 S((1000,), "float32"), S((1000,), "float32"))


@pallas_only
def test_pallas_kernel_shapes():
    """The Pallas kernel (interpreted) at vector widths and program counts
    that leave padding, programs sharing a private histogram, more lanes
    than scores, and hot bins."""
    from keras_softmax_heads.functional.plif_pallas import pallas_knot_histogram

    for lanes, programs, copies in [(8, 5, 2), (32, None, None)]:
        idx, weights = _histogram_inputs(301, 7, seed=lanes)
        out = pallas_knot_histogram(idx, weights, 7, lanes=lanes, programs=programs,
                                    copies=copies)
        for h, w in zip(out, weights):
            expected = np.bincount(idx, w.astype("float64"), 7)
            np.testing.assert_allclose(np.asarray(h), expected,
                                       atol=2e-6 * np.abs(expected).max())
        (h,) = pallas_knot_histogram(idx[:3], (weights[0][:3],), 7, lanes=lanes)
        np.testing.assert_allclose(np.asarray(h), np.bincount(idx[:3], weights[0][:3], 7),
                                   atol=1e-6)


@pallas_only
def test_pallas_kernel_lowers_to_triton():
    """The kernel passes Pallas' Triton lowering for a GPU (no GPU needed:
    lowering only), at the benchmark's `K`."""
    import jax
    import jax.numpy as jnp

    from keras_softmax_heads.functional.plif_pallas import pallas_knot_histogram

    fn = jax.jit(lambda i, a, b: pallas_knot_histogram(i, (a, b), 100000, interpret=False))
    idx = jax.ShapeDtypeStruct((2**12,), jnp.int32)
    w = jax.ShapeDtypeStruct((2**12,), jnp.float32)
    text = lower_for(fn, (idx, w, w), "cuda").as_text()
    assert "triton" in text


@pallas_only
@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    """`benchmarks/bench_plif_histogram.py` at a tiny shape, one round
    (about 40 s: under `-m slow`)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "h.json"
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_plif_histogram.py"),
         "--quick", "--rows", "histogram", "--rounds", "1",
         "--methods", "scatter,sorted", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["knots"], r["method"]) for r in rows] == [
        (1000, "scatter"), (1000, "sorted"), (100, "scatter"), (100, "sorted")]
    assert max(r["max_abs_diff_to_first_method_rel"] for r in rows) < 1e-5


@pallas_only
def test_tile_memory_benchmark_smoke(monkeypatch, tmp_path):
    """`benchmarks/bench_plif_tile_memory.py` at a tiny shape: a row per
    path and tile, the temporaries growing with the tile on the TPU path,
    and the library's tiles restored afterwards."""
    import json

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_plif_tile_memory as bench

    before = dict(dispatch.ACCELERATOR_TILE_ELEMENTS)
    out = tmp_path / "m.json"
    bench.main(["--n=64", "--v=50", "--knots=100", "--tiles=6,12", f"--out={out}"])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(bench.PATHS) * 2
    tpu = [r["memory"]["temp"] for r in rows if r["platform"] == "tpu"]
    assert tpu[0] < tpu[1]
    assert dispatch.ACCELERATOR_TILE_ELEMENTS == before and dispatch.HISTOGRAM_METHOD is None
