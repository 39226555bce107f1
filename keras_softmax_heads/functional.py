"""Pure functions shared by the heads: output functions in log space and PLIF.

Everything here works on float32 (or float64) tensors; the heads call these
functions on their linear scores `z`. The sigsoftmax family is written with
`keras.ops`. The PLIF kernels use TensorFlow directly (`tf.custom_gradient`,
`tf.while_loop`, `tf.TensorArray`, `tf.raw_ops.DenseBincount` and
`tf.tensor_scatter_nd_add` have no `keras.ops` equivalent with the same cost).

PLIF: where the time goes
-------------------------
A PLIF step adds to a Linear-Softmax step (`N` score rows, `V` words, `K`
intervals): the interval index `floor((z + T) K / 2T)` and two table lookups
per score (forward), and in the backward pass the derivative `s[idx]` (a
third lookup) and the gradient of the `K` slopes, which is a weighted
histogram of all `N * V` scores: per interval `i`, `A_i = sum g` and
`B_i = sum g (z - l_i)` over the scores that fall in it (`g` the upstream
gradient); then `dL/ds_j = (2T/K) sum_{i>j} A_i + B_j` (a reverse cumulative
sum). Automatic differentiation of the plain formula (`plif_reference`) does
the same work with two scatter-adds and keeps more `[N, V]` tensors.

`plif` (any shape) has a custom gradient that saves `z` and the int32
interval index and computes both histograms with `DenseBincount`
(multi-threaded partial histograms in TensorFlow's CPU kernel, much faster
than `unsorted_segment_sum`; a scatter-add under XLA).
`plif_log_likelihood` (the PLIF head's training path) also fuses PLIF with
`log_softmax` and the target lookup: its backward pass recomputes the PLIF
scores and `softmax` tile by tile from `z`, so it saves `z`, the index and
two `[N]` vectors, never the `[N, V]` PLIF scores or log-probabilities.

When the number of scores is static (always under XLA) both work in tiles of
about `TILE_ELEMENTS` scores inside `tf.while_loop`s. The loop keeps a tile in
cache and, more importantly under XLA, stops the compiler from fusing the
softplus / cumulative-sum table computation into every lookup (one fusion
for the whole step re-computes the `[K]` tables, softplus and cumulative
sum, for every score).

What a PLIF step costs beyond Linear-Softmax is inherent to the histogram
and memory-bound on a CPU: the `N * V`-element weighted histogram (a serial
scatter-add under XLA; it cannot be vectorised) and 4-5 extra passes over
`[N, V]` (index, lookups, recomputation, the histogram's inputs), next to a
Linear-Softmax step dominated by its three `N x d x V` matrix products.
Measured ratios to `FullSoftmax` (`benchmarks/bench_exact_heads.py`) are in
`docs/plif.md`.

Precision: `dL/ds_j` contains `z - l_j`, the position of a score inside an
interval of width `2T/K` (4e-4 by default); float32 rounding of `z`
(~1e-7 relative) perturbs it by up to ~1e-3 relative, so two float32
computations of the same slope gradient that round `z` differently (e.g. a
different matmul order) agree to ~1e-3, not 1e-5. The cumulative sums are
computed in blocks (`_blocked_cumsum`) to keep their own error ~10x below
that of a running sum.
"""

import math
import numbers

import tensorflow as tf
from keras import ops

# ------------------------------------------------------------------ sigsoftmax


def log_sigmoid_scores(z):
    """`log(exp(z) * sigmoid(z)) = z - softplus(-z)`, stable for any |z|."""
    return z - ops.softplus(-z)


def log_sigsoftmax(z, axis=-1):
    """Log of sigsoftmax (Kanai et al. 2018, eq. 11), in log space.

    `sigsoftmax(z)_i = exp(z_i) sigmoid(z_i) / sum_j exp(z_j) sigmoid(z_j)`,
    so `log sigsoftmax(z) = log_softmax(z - softplus(-z))`.

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads import functional
    >>> z = np.array([[-1.0, 0.0, 2.0]], "float32")
    >>> g = np.exp(z) / (1 + np.exp(-z))
    >>> bool(np.allclose(np.exp(functional.log_sigsoftmax(z)), g / g.sum(), atol=1e-6))
    True
    """
    return ops.log_softmax(log_sigmoid_scores(z), axis=axis)


def log_sigmoid_output_scores(z):
    """`log g(z)` for the output function `g = sigmoid`: `-softplus(-z)`."""
    return -ops.softplus(-z)


def log_relu_output_scores(z, epsilon):
    """`log g(z)` for the output function `g(z) = ReLU(z) + epsilon`.

    Kanai et al. (2018, section 3.2) note that `g = ReLU` divides by zero
    whenever all scores are non-positive; with `epsilon > 0` every score has
    probability mass at least `epsilon / sum_j g(z_j)`, so a row of
    non-positive scores gives the uniform distribution instead of NaN.
    """
    return ops.log(ops.relu(z) + ops.cast(epsilon, z.dtype))


# ------------------------------------------------------------------------ PLIF

TILE_ELEMENTS = 2**19
"""Scores per tile of `plif_log_likelihood` (2 MiB of float32)."""

TILE_HISTOGRAM = "bincount"
"""How `plif_log_likelihood` accumulates the slopes' histograms per tile.

`"bincount"` (default): two `DenseBincount`s per tile (TensorFlow's
multi-threaded CPU kernel in graph mode, two scatter-adds under XLA).
`"complex_scatter"`: one `tensor_scatter_nd_add` of `A + iB` into a complex
loop-carried buffer: one scatter instead of two, so somewhat faster under
XLA, but slower in graph mode (TensorFlow's scatter-add CPU kernel is
serial, unlike `DenseBincount`); set it to `"complex_scatter"` for XLA-only
training (measurements in `docs/plif.md`).
"""


def plif_identity_raw_slope():
    """The raw slope `v` with `softplus(v) = 1` (identity initialisation)."""
    return math.log(math.e - 1.0)


def check_knot_bound(knot_bound):
    """Returns `knot_bound` as a float, or raises unless it is finite and > 0."""
    ok = isinstance(knot_bound, numbers.Real) and not isinstance(knot_bound, bool)
    if not ok or not math.isfinite(knot_bound) or knot_bound <= 0:
        raise ValueError(
            "`knot_bound` must be a finite number > 0. "
            f"Received: knot_bound={knot_bound!r}"
        )
    return float(knot_bound)


def _compute_dtype(z):
    """PLIF runs in float32 (float64 for float64 scores): the interval index
    of a K=1e5 grid does not fit the precision of float16 / bfloat16."""
    return tf.float64 if z.dtype == tf.float64 else tf.float32


def _prepare(z, raw_slopes, knot_bound):
    z = tf.convert_to_tensor(z)
    if not z.dtype.is_floating:
        z = tf.cast(z, tf.float32)
    dtype = _compute_dtype(z)
    # A variable is read here, outside the custom gradient, so its gradient
    # flows through the read as for any other tensor.
    raw = tf.cast(tf.convert_to_tensor(raw_slopes), dtype)
    if raw.shape.rank != 1 or raw.shape[0] is None or raw.shape[0] < 1:
        raise ValueError(
            "`raw_slopes` must be a vector of static length K >= 1. "
            f"Received: raw_slopes with shape {raw.shape}"
        )
    return z, raw, check_knot_bound(knot_bound)


def _blocked_cumsum(x, reverse=False):
    """Exclusive cumulative sum of a vector in blocks of ~sqrt(K) elements.

    A running float32 sum over K = 1e5 terms loses ~sqrt(K) ulps (TensorFlow's
    CPU `cumsum` is sequential, XLA's a tree: they differ by ~2e-5 relative);
    summing within blocks, then over the block totals, keeps the error at the
    level of a ~sqrt(K)-term sum, and the same in every execution mode.
    """
    size = x.shape[0]
    block = max(1, int(math.ceil(math.sqrt(size))))
    blocks = -(-size // block)
    padded = tf.pad(x, [[0, blocks * block - size]]) if blocks * block > size else x
    padded = tf.reshape(padded, [blocks, block])
    within = tf.cumsum(padded, axis=1, exclusive=True, reverse=reverse)
    offsets = tf.cumsum(tf.reduce_sum(padded, axis=1), exclusive=True, reverse=reverse)
    return tf.reshape(within + offsets[:, None], [-1])[:size]


def _tables(raw, knot_bound):
    """Slopes `s = softplus(v)`, `f(l_i)` at the left knots, interval width."""
    num_knots = raw.shape[0]
    width = 2.0 * knot_bound / num_knots
    slopes = tf.nn.softplus(raw)
    left_values = -knot_bound + width * _blocked_cumsum(slopes)
    return slopes, left_values, width


def _interval(z, num_knots, knot_bound):
    """`clip(floor((z + T) K / 2T), 0, K - 1)` as int32 (0 for NaN)."""
    width = 2.0 * knot_bound / num_knots
    position = tf.clip_by_value(tf.floor((z + knot_bound) / width), 0.0, num_knots - 1.0)
    # The integer clip sends NaN (cast to an arbitrary integer) into range.
    return tf.clip_by_value(tf.cast(position, tf.int32), 0, num_knots - 1)


def _offset(z, idx, num_knots, knot_bound):
    """`z - l_idx`, the distance to the left knot of the interval."""
    width = 2.0 * knot_bound / num_knots
    return z - (-knot_bound + width * tf.cast(idx, z.dtype))


def _histograms(idx, grad, offset, num_knots):
    """Per interval: `A_i = sum grad`, `B_i = sum grad * offset` (any shapes).

    `DenseBincount` with weights: multi-threaded partial histograms in
    TensorFlow's CPU kernel (much faster than `unsorted_segment_sum` or a
    scatter-add, which are serial there), a scatter-add under XLA.
    """
    idx = tf.reshape(idx, [-1])

    def bincount(weights):
        return tf.raw_ops.DenseBincount(
            input=idx,
            size=num_knots,
            weights=tf.reshape(weights, [-1]),
            binary_output=False,
        )

    return bincount(grad), bincount(grad * offset)


def _accumulate_histograms(sums, idx, grad, offset):
    """Adds one tile's histograms to the loop-carried `sums`.

    `sums` is a complex `[K]` vector (`A + iB`) for
    `TILE_HISTOGRAM = "complex_scatter"`: one scatter-add per tile into the
    loop-carried buffer (in place under XLA), else a pair of `[K]` vectors
    updated with two `DenseBincount`s.
    """
    if TILE_HISTOGRAM == "complex_scatter":
        update = tf.complex(grad, grad * offset)
        return tf.tensor_scatter_nd_add(sums, idx[..., None], update)
    a, b = _histograms(idx, grad, offset, sums[0].shape[0])
    return sums[0] + a, sums[1] + b


def _slope_gradient(sum_grad, sum_grad_offset, raw, knot_bound):
    """`dL/dv_j` from the histograms: `(w sum_{i>j} A_i + B_j) sigmoid(v_j)`."""
    width = 2.0 * knot_bound / raw.shape[0]
    d_slopes = width * _blocked_cumsum(sum_grad, reverse=True)
    return (d_slopes + sum_grad_offset) * tf.sigmoid(raw)


def plif(z, raw_slopes, knot_bound):
    """Piecewise linear increasing function (Ganea et al. 2019, section 4).

    `K = len(raw_slopes)` intervals of width `2T/K` cover `[-T, T]`;
    interval `i` has slope `s_i = softplus(raw_slopes[i]) > 0`. The function is
    continuous: `f(l_i) = -T + (2T/K) sum_{j<i} s_j` (a cumulative sum), and
    `f(x) = f(l_i) + s_i (x - l_i)` on interval `i = floor((x + T) K / 2T)`,
    clipped to `[0, K-1]`, so outside `[-T, T]` the first/last piece extends
    linearly (still increasing). With all `s_i = 1`, `f(x) = x`. The paper's
    free offset `b_0` is left out: a softmax does not see it.

    The gradient is custom (see the module docstring): it saves `z` and the
    int32 interval index, gives `df/dz = s[idx]` and the slopes' gradient by
    two weighted histograms and a reverse cumulative sum. Extra memory does
    not grow with `K` beyond the `[K]` tables. Inputs of static size larger
    than `TILE_ELEMENTS` are processed in tiles (`tf.while_loop`).

    Args:
        z: float tensor of any shape (float16 / bfloat16 are computed in
            float32 and cast back).
        raw_slopes: float tensor or variable `[K]`, the unconstrained slope
            parameters.
        knot_bound: float `T > 0`.

    Returns:
        `f(z)`, same shape and dtype as `z`.

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads import functional
    >>> raw = np.full((4,), functional.plif_identity_raw_slope(), "float32")
    >>> z = np.array([-3.0, -0.5, 0.25, 7.0], "float32")
    >>> bool(np.allclose(functional.plif(z, raw, 2.0), z, atol=1e-6))  # identity
    True
    >>> raw[2] = 3.0  # steeper on [0, 1]
    >>> np.asarray(functional.plif(z, raw, 2.0)).round(3).tolist()  # doctest: +ELLIPSIS
    [-3.0, -0.5, 0.76..., 9.04...]
    """
    z, raw, knot_bound = _prepare(z, raw_slopes, knot_bound)
    out_dtype = z.dtype
    num_knots = raw.shape[0]
    z = tf.cast(z, _compute_dtype(z))
    size = z.shape.num_elements()
    if size is not None and size > TILE_ELEMENTS:
        flat = tf.reshape(z, [size])
        out = _plif_tiled(flat, raw, knot_bound, _tile_rows(size, 1))
        return tf.cast(tf.reshape(out, tf.shape(z)), out_dtype)

    @tf.custom_gradient
    def _plif(z, raw):
        slopes, left_values, _ = _tables(raw, knot_bound)
        idx = _interval(z, num_knots, knot_bound)
        offset = _offset(z, idx, num_knots, knot_bound)
        out = tf.gather(left_values, idx) + tf.gather(slopes, idx) * offset

        def grad(upstream):
            upstream = tf.cast(upstream, z.dtype)
            offset = _offset(z, idx, num_knots, knot_bound)
            d_z = upstream * tf.gather(slopes, idx)
            sums = _histograms(idx, upstream, offset, num_knots)
            return d_z, _slope_gradient(*sums, raw, knot_bound)

        return out, grad

    return tf.cast(_plif(z, raw), out_dtype)


def _plif_tiled(z, raw, knot_bound, tile):
    """`plif` of a flat vector of static size, in tiles of `tile` elements.

    The same function and custom gradient, with `tf.while_loop`s over the
    tiles: under XLA the loop keeps each tile in cache and the `[K]` tables
    materialised (as one fusion, XLA re-computes the softplus and the
    cumulative sum inside every lookup, which dominates the step).
    """
    size = z.shape[0]
    num_knots = raw.shape[0]
    num_full = size // tile
    remainder = size - num_full * tile
    dtype = z.dtype

    def forward_tile(zt, slopes, left_values):
        idx = _interval(zt, num_knots, knot_bound)
        offset = _offset(zt, idx, num_knots, knot_bound)
        return idx, tf.gather(left_values, idx) + tf.gather(slopes, idx) * offset

    def backward_tile(zt, idx, upstream, slopes, sums):
        offset = _offset(zt, idx, num_knots, knot_bound)
        a, b = _histograms(idx, upstream, offset, num_knots)
        return upstream * tf.gather(slopes, idx), (sums[0] + a, sums[1] + b)

    def arrays(dtype_):
        return tf.TensorArray(dtype_, size=num_full, element_shape=[tile])

    def loop(body, state):
        return tf.while_loop(
            lambda i, *_: i < num_full,
            body,
            (tf.constant(0),) + state,
            maximum_iterations=num_full,
            parallel_iterations=1,
        )[1:]

    @tf.custom_gradient
    def tiled(z, raw):
        z = tf.stop_gradient(z)  # see `_fused_plif_ll`
        slopes, left_values, _ = _tables(tf.stop_gradient(raw), knot_bound)
        z2 = tf.reshape(z[: num_full * tile], [num_full, tile])

        def fwd_body(i, idx_ta, out_ta):
            idx, out = forward_tile(z2[i], slopes, left_values)
            return i + 1, idx_ta.write(i, idx), out_ta.write(i, out)

        idx_ta, out_ta = loop(fwd_body, (arrays(tf.int32), arrays(dtype)))
        idx2 = idx_ta.stack()
        out = tf.reshape(out_ta.stack(), [num_full * tile])
        if remainder:
            idx_rem, out_rem = forward_tile(z[num_full * tile :], slopes, left_values)
            out = tf.concat([out, out_rem], 0)

        def grad(upstream):
            upstream = tf.cast(upstream, dtype)
            u2 = tf.reshape(upstream[: num_full * tile], [num_full, tile])

            def bwd_body(i, dz_ta, sums):
                d_z, sums = backward_tile(z2[i], idx2[i], u2[i], slopes, sums)
                return i + 1, dz_ta.write(i, d_z), sums

            zeros = tf.zeros([num_knots], dtype)
            dz_ta, sums = loop(bwd_body, (arrays(dtype), (zeros, zeros)))
            d_z = tf.reshape(dz_ta.stack(), [num_full * tile])
            if remainder:
                d_rem, sums = backward_tile(
                    z[num_full * tile :], idx_rem, upstream[num_full * tile :],
                    slopes, sums,
                )
                d_z = tf.concat([d_z, d_rem], 0)
            return d_z, _slope_gradient(*sums, raw, knot_bound)

        return out, grad

    return tiled(z, raw)


def plif_reference(z, raw_slopes, knot_bound):
    """`plif` written with plain differentiable ops (automatic gradient).

    The straightforward formulation (two gathers, autodiff through them);
    kept as a reference for tests and benchmarks.
    """
    z, raw, knot_bound = _prepare(z, raw_slopes, knot_bound)
    num_knots = raw.shape[0]
    slopes, left_values, _ = _tables(tf.cast(raw, z.dtype), knot_bound)
    idx = _interval(z, num_knots, knot_bound)
    offset = _offset(z, idx, num_knots, knot_bound)
    return tf.gather(left_values, idx) + tf.gather(slopes, idx) * offset


def _tile_rows(rows, vocab_size):
    """Rows per tile: about `TILE_ELEMENTS` scores, a divisor of `rows` if one
    is within a factor 2 (then there is no remainder tile to concatenate)."""
    target = max(1, min(rows, TILE_ELEMENTS // max(vocab_size, 1)))
    # Divisors of `rows` in [target / 2, target], largest first.
    for small in range(1, int(math.isqrt(rows)) + 1):
        if rows % small == 0 and (target + 1) // 2 <= rows // small <= target:
            return rows // small
    for small in range(min(target, int(math.isqrt(rows))), (target + 1) // 2 - 1, -1):
        if small > 0 and rows % small == 0:
            return small
    return target


def plif_log_likelihood(z, raw_slopes, knot_bound, targets):
    """`log_softmax(plif(z))[targets]` with one fused custom gradient.

    Exact log-likelihood of the PLIF head (Ganea et al. 2019) from the linear
    scores `z`, without ever holding the `[..., V]` PLIF scores or
    log-probabilities: the forward pass keeps the int32 interval index and
    the per-row log-normaliser; the backward pass recomputes the PLIF scores
    and `softmax` tile by tile and returns `dL/dz` and the slopes' gradient
    (two weighted histograms, see the module docstring). Rows are processed
    in tiles of about `TILE_ELEMENTS` scores in a `tf.while_loop` when their
    number is static (always under XLA), in one piece otherwise.

    Args:
        z: float tensor `[..., V]`, the linear scores (float16 / bfloat16 are
            computed in float32).
        raw_slopes: float tensor or variable `[K]`.
        knot_bound: float `T > 0`.
        targets: integer tensor `[...]` (the leading shape of `z`). Ids
            outside `[0, V)` are clipped (validate them beforehand, e.g. with
            `heads.head_utils.check_targets` / `nan_if_invalid`).

    Returns:
        float32 (float64 for float64 `z`) tensor of shape `targets.shape`.

    Example:

    >>> import numpy as np, tensorflow as tf
    >>> from keras_softmax_heads import functional
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(3, 4, 9)).astype("float32")
    >>> raw = rng.normal(size=(16,)).astype("float32")
    >>> t = rng.integers(0, 9, size=(3, 4))
    >>> ll = functional.plif_log_likelihood(z, raw, 2.0, t)
    >>> dense = np.asarray(tf.nn.log_softmax(functional.plif(z, raw, 2.0)))
    >>> expected = np.take_along_axis(dense, t[..., None], -1)[..., 0]
    >>> bool(np.allclose(ll, expected, atol=1e-5))
    True
    """
    z, raw, knot_bound = _prepare(z, raw_slopes, knot_bound)
    z = tf.cast(z, _compute_dtype(z))
    vocab_size = z.shape[-1]
    if vocab_size is None:
        raise ValueError(
            f"`z` needs a static last dimension. Received: z.shape={z.shape}"
        )
    targets = tf.convert_to_tensor(targets)
    out_shape = tf.shape(targets)
    flat_z = tf.reshape(z, [-1, vocab_size])
    flat_t = tf.clip_by_value(tf.reshape(tf.cast(targets, tf.int32), [-1]), 0, vocab_size - 1)
    ll = _fused_plif_ll(flat_z, raw, flat_t, knot_bound)
    ll = tf.reshape(ll, out_shape)
    if targets.shape.rank is not None:
        ll = tf.ensure_shape(ll, targets.shape)
    return ll


def _fused_plif_ll(z, raw, targets, knot_bound):
    """Flat core: `z` `[M, V]`, `targets` `[M]` int32 -> log-likelihood `[M]`."""
    rows, vocab_size = z.shape
    num_knots = raw.shape[0]
    dtype = z.dtype

    def scores(zt, idx, slopes, left_values):
        offset = _offset(zt, idx, num_knots, knot_bound)
        slope = tf.gather(slopes, idx)
        return tf.gather(left_values, idx) + slope * offset, slope, offset

    def forward_tile(zt, tt, slopes, left_values):
        idx = _interval(zt, num_knots, knot_bound)
        f, _, _ = scores(zt, idx, slopes, left_values)
        lse = tf.reduce_logsumexp(f, axis=-1)
        picked = tf.gather(f, tt, batch_dims=1)
        return idx, lse, picked - lse

    def backward_tile(zt, idx, tt, ut, lse, slopes, left_values):
        f, slope, offset = scores(zt, idx, slopes, left_values)
        # d ll / d f = upstream * (onehot(target) - softmax(f)).
        d_f = (
            tf.one_hot(tt, vocab_size, dtype=dtype) - tf.exp(f - lse[:, None])
        ) * ut[:, None]
        return d_f * slope, offset, d_f

    tile = None if rows is None else _tile_rows(rows, vocab_size)
    if tile is None or tile >= rows:
        return _fused_untiled(z, raw, targets, knot_bound, forward_tile, backward_tile)
    num_full = rows // tile
    remainder = rows - num_full * tile

    @tf.custom_gradient
    def fused(z, raw):
        # `stop_gradient`: an outer tape recording the forward loop would
        # make it keep per-iteration temporaries for a gradient that the
        # custom gradient replaces.
        z = tf.stop_gradient(z)
        slopes, left_values, _ = _tables(tf.stop_gradient(raw), knot_bound)
        z3 = tf.reshape(z[: num_full * tile], [num_full, tile, vocab_size])
        t2 = tf.reshape(targets[: num_full * tile], [num_full, tile])

        def arrays(dtype_, shape):
            return tf.TensorArray(dtype_, size=num_full, element_shape=shape)

        def fwd_body(i, idx_ta, lse_ta, ll_ta):
            idx, lse, ll = forward_tile(z3[i], t2[i], slopes, left_values)
            return i + 1, idx_ta.write(i, idx), lse_ta.write(i, lse), ll_ta.write(i, ll)

        _, idx_ta, lse_ta, ll_ta = tf.while_loop(
            lambda i, *_: i < num_full,
            fwd_body,
            (
                tf.constant(0),
                arrays(tf.int32, [tile, vocab_size]),
                arrays(dtype, [tile]),
                arrays(dtype, [tile]),
            ),
            maximum_iterations=num_full,
            parallel_iterations=1,
        )
        idx3 = idx_ta.stack()
        lse2 = lse_ta.stack()
        ll = tf.reshape(ll_ta.stack(), [num_full * tile])
        if remainder:
            z_rem, t_rem = z[num_full * tile :], targets[num_full * tile :]
            idx_rem, lse_rem, ll_rem = forward_tile(z_rem, t_rem, slopes, left_values)
            ll = tf.concat([ll, ll_rem], 0)

        def grad(upstream):
            upstream = tf.cast(upstream, dtype)
            u2 = tf.reshape(upstream[: num_full * tile], [num_full, tile])

            def bwd_body(i, dz_ta, sums):
                idx = idx3[i]
                d_z, offset, d_f = backward_tile(
                    z3[i], idx, t2[i], u2[i], lse2[i], slopes, left_values
                )
                sums = _accumulate_histograms(sums, idx, d_f, offset)
                return i + 1, dz_ta.write(i, d_z), sums

            if TILE_HISTOGRAM == "complex_scatter":
                complex_dtype = tf.complex128 if dtype == tf.float64 else tf.complex64
                sums = tf.zeros([num_knots], complex_dtype)
            else:
                sums = (tf.zeros([num_knots], dtype), tf.zeros([num_knots], dtype))
            _, dz_ta, sums = tf.while_loop(
                lambda i, *_: i < num_full,
                bwd_body,
                (tf.constant(0), arrays(dtype, [tile, vocab_size]), sums),
                maximum_iterations=num_full,
                parallel_iterations=1,
            )
            d_z = tf.reshape(dz_ta.stack(), [num_full * tile, vocab_size])
            if remainder:
                d_rem, offset, d_f = backward_tile(
                    z_rem, idx_rem, t_rem, upstream[num_full * tile :], lse_rem,
                    slopes, left_values,
                )
                d_z = tf.concat([d_z, d_rem], 0)
                sums = _accumulate_histograms(sums, idx_rem, d_f, offset)
            if TILE_HISTOGRAM == "complex_scatter":
                sums = tf.math.real(sums), tf.math.imag(sums)
            return d_z, _slope_gradient(*sums, raw, knot_bound)

        return ll, grad

    return fused(z, raw)


def _fused_untiled(z, raw, targets, knot_bound, forward_tile, backward_tile):
    """`_fused_plif_ll` in one piece (rows unknown when tracing, or one tile)."""

    @tf.custom_gradient
    def fused(z, raw):
        slopes, left_values, _ = _tables(raw, knot_bound)
        idx, lse, ll = forward_tile(z, targets, slopes, left_values)

        def grad(upstream):
            upstream = tf.cast(upstream, z.dtype)
            d_z, offset, d_f = backward_tile(
                z, idx, targets, upstream, lse, slopes, left_values
            )
            sums = _histograms(idx, d_f, offset, raw.shape[0])
            return d_z, _slope_gradient(*sums, raw, knot_bound)

        return ll, grad

    return fused(z, raw)
