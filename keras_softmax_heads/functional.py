"""Pure functions shared by the heads: output functions in log space and PLIF.

Everything here works on float32 (or float64) tensors of any Keras backend
(TensorFlow, JAX, PyTorch); the heads call these functions on their linear
scores `z`. Everything is written with `keras.ops` (`ops.custom_gradient`,
`ops.scan`, `ops.segment_sum`) except three small dispatch points that
branch on `keras.backend.backend()` and import TensorFlow only in their
TensorFlow branch: `knot_histogram` (the slopes' weighted histogram,
`DenseBincount` on TensorFlow), `_lookup` (the table lookups, `tf.gather`
on TensorFlow) and `scan_tiles` (`ops.scan` on JAX and PyTorch, a
`tf.while_loop` with one iteration in flight and `TensorArray` outputs on
TensorFlow, where Keras' `ops.scan` requires the per-iteration outputs to
have the structure of the carry).

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
interval index and computes both histograms with `knot_histogram`.
`plif_log_likelihood` (the PLIF head's training path) also fuses PLIF with
`log_softmax` and the target lookup: its backward pass recomputes the PLIF
scores and `softmax` tile by tile from `z`, so it saves `z`, the index and
two `[N]` vectors, never the `[N, V]` PLIF scores or log-probabilities.

When the number of scores is static (always under XLA, JAX and PyTorch)
both work in tiles of about `TILE_ELEMENTS` scores inside `scan_tiles`. The
loop keeps a tile in cache, bounds the temporaries of the backward pass to
one tile, and, under XLA, stops the compiler from fusing the softplus /
cumulative-sum table computation into every lookup (one fusion for the
whole step re-computes the `[K]` tables for every score).

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

import keras
from keras import ops

# ------------------------------------------------------------------ sigsoftmax


def soft_cap(z, cap):
    """Final-logit soft-capping `cap * tanh(z / cap)` (Gemma 2): scores
    squashed into `(-cap, cap)`, the identity near 0."""
    return cap * ops.tanh(z / cap)


def log_sigmoid_scores(z):
    """`log(exp(z) * sigmoid(z)) = z - softplus(-z)`, stable for any |z|."""
    z = ops.convert_to_tensor(z)
    return z - ops.softplus(-z)


def log_sigsoftmax(z, axis=-1):
    """Log of sigsoftmax (Kanai et al. 2018, eq. 11), in log space.

    `sigsoftmax(z)_i = exp(z_i) sigmoid(z_i) / sum_j exp(z_j) sigmoid(z_j)`,
    so `log sigsoftmax(z) = log_softmax(z - softplus(-z))`.

    Example:

    >>> import keras, numpy as np
    >>> from keras_softmax_heads import functional
    >>> z = np.array([[-1.0, 0.0, 2.0]], "float32")
    >>> g = np.exp(z) / (1 + np.exp(-z))
    >>> log_p = keras.ops.convert_to_numpy(functional.log_sigsoftmax(z))
    >>> bool(np.allclose(np.exp(log_p), g / g.sum(), atol=1e-6))
    True
    """
    return ops.log_softmax(log_sigmoid_scores(z), axis=axis)


def log_sigmoid_output_scores(z):
    """`log g(z)` for the output function `g = sigmoid`: `-softplus(-z)`."""
    return -ops.softplus(-ops.convert_to_tensor(z))


def log_relu_output_scores(z, epsilon):
    """`log g(z)` for the output function `g(z) = ReLU(z) + epsilon`.

    Kanai et al. (2018, section 3.2) note that `g = ReLU` divides by zero
    whenever all scores are non-positive; with `epsilon > 0` every score has
    probability mass at least `epsilon / sum_j g(z_j)`, so a row of
    non-positive scores gives the uniform distribution instead of NaN.
    """
    z = ops.convert_to_tensor(z)
    return ops.log(ops.relu(z) + ops.cast(epsilon, z.dtype))


# ------------------------------------------------------------------------ PLIF

TILE_ELEMENTS = 2**19
"""Scores per tile of `plif` and `plif_log_likelihood` (2 MiB of float32)."""


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


def knot_histogram(idx, weights, num_knots):
    """Per-interval sums of weights: `out[i] = sum of w where idx == i`.

    The slopes' gradient of PLIF, and the one backend-specific kernel of
    this module: TensorFlow uses `DenseBincount` (multi-threaded partial
    histograms on CPU, much faster there than `unsorted_segment_sum`; a
    scatter-add under XLA), the other backends `ops.segment_sum` (a
    scatter-add; `jax.ops.segment_sum` under JAX). `O(idx.size)` time,
    `O(num_knots)` memory per weight tensor.

    Args:
        idx: int32 tensor of any shape, values in `[0, num_knots)`.
        weights: tuple of float tensors of the shape of `idx`.
        num_knots: int, the number of intervals `K` (static).

    Returns:
        A tuple of `[K]` tensors, one per weight tensor, in its dtype.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads import functional
    >>> idx = np.array([0, 2, 2, 1], "int32")
    >>> w = np.array([1.0, 2.0, 3.0, 4.0], "float32")
    >>> [ops.convert_to_numpy(h).tolist() for h in functional.knot_histogram(idx, (w,), 4)]
    [[1.0, 4.0, 5.0, 0.0]]
    """
    idx = ops.reshape(idx, [-1])
    weights = [ops.reshape(w, [-1]) for w in weights]
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tuple(
            tf.raw_ops.DenseBincount(
                input=idx, size=num_knots, weights=w, binary_output=False
            )
            for w in weights
        )
    return tuple(ops.segment_sum(w, idx, num_segments=num_knots) for w in weights)


def _lookup(table, idx):
    """`table[idx]` for int32 indices known to be in range.

    `ops.take`, except on TensorFlow: `tf.gather` there, which skips the
    pass over `idx` that Keras' `take` adds for negative indices (measured
    about 10% of a graph-mode `plif_log_likelihood` step).
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.gather(table, idx)
    return ops.take(table, idx)


def scan_tiles(body, carry, xs, ys_dtypes):
    """`ops.scan(body, carry, xs)` with one iteration in flight at a time.

    `body(carry, x) -> (carry, ys)`, `ys` a tuple of tensors (possibly
    empty) stacked along a new leading axis. JAX and PyTorch use
    `ops.scan`; TensorFlow a `tf.while_loop` with `parallel_iterations=1`
    and `TensorArray` outputs of `ys_dtypes` (Keras' TensorFlow `scan`
    needs outputs of the carry's structure, and a loop with parallel
    iterations would hold several tiles' temporaries at once).

    Args:
        body: the step function.
        carry: tuple of tensors.
        xs: tuple of tensors with a common static leading dimension `n`.
        ys_dtypes: tuple of the dtypes of `ys` (used by TensorFlow).

    Returns:
        `(carry, ys)`, `ys` a tuple of `[n, ...]` tensors.
    """
    if keras.backend.backend() != "tensorflow":
        return ops.scan(body, carry, xs)
    import tensorflow as tf

    n = xs[0].shape[0]
    arrays = tuple(tf.TensorArray(dtype, size=n) for dtype in ys_dtypes)

    def loop_body(i, carry, arrays):
        carry, ys = body(carry, tuple(x[i] for x in xs))
        return i + 1, tuple(carry), tuple(a.write(i, y) for a, y in zip(arrays, ys))

    _, carry, arrays = tf.while_loop(
        lambda i, *_: i < n,
        loop_body,
        (tf.constant(0), tuple(carry), arrays),
        maximum_iterations=n,
        parallel_iterations=1,
    )
    return carry, tuple(a.stack() for a in arrays)


def _upstream(args, upstream):
    """The upstream gradient of an `ops.custom_gradient` gradient function
    (positional on TensorFlow / JAX, keyword on PyTorch)."""
    return args[-1] if upstream is None else upstream


def _compute_dtype(z):
    """PLIF runs in float32 (float64 for float64 scores): the interval index
    of a K=1e5 grid does not fit the precision of float16 / bfloat16."""
    dtype = keras.backend.standardize_dtype(z.dtype)
    return "float64" if dtype == "float64" else "float32"


def _prepare(z, raw_slopes, knot_bound):
    knot_bound = check_knot_bound(knot_bound)
    z = ops.convert_to_tensor(z)
    if not keras.backend.is_float_dtype(z.dtype):
        z = ops.cast(z, "float32")
    # A variable is read here, outside the custom gradient, so its gradient
    # flows through the read as for any other tensor.
    raw = ops.cast(ops.convert_to_tensor(raw_slopes), _compute_dtype(z))
    if len(raw.shape) != 1 or raw.shape[0] is None or raw.shape[0] < 1:
        raise ValueError(
            "`raw_slopes` must be a vector of static length K >= 1. "
            f"Received: raw_slopes with shape {tuple(raw.shape)}"
        )
    return z, raw, knot_bound


def _blocked_cumsum(x, reverse=False):
    """Exclusive cumulative sum of a vector in blocks of ~sqrt(K) elements.

    A running float32 sum over K = 1e5 terms loses ~sqrt(K) ulps (sequential
    and tree-shaped cumulative sums differ by ~2e-5 relative); summing
    within blocks, then over the block totals, keeps the error at the level
    of a ~sqrt(K)-term sum, and the same in every execution mode.
    """
    size = x.shape[0]
    block = max(1, int(math.ceil(math.sqrt(size))))
    blocks = -(-size // block)
    if reverse:
        x = ops.flip(x, axis=0)
    if blocks * block > size:
        x = ops.pad(x, [[0, blocks * block - size]])
    x = ops.reshape(x, [blocks, block])
    within = ops.cumsum(x, axis=1)
    within = ops.pad(within[:, :-1], [[0, 0], [1, 0]])
    totals = ops.sum(x, axis=1)
    offsets = ops.pad(ops.cumsum(totals)[:-1], [[1, 0]])
    out = ops.reshape(within + offsets[:, None], [-1])[:size]
    return ops.flip(out, axis=0) if reverse else out


def _tables(raw, knot_bound):
    """Slopes `s = softplus(v)` and `f(l_i)` at the left knots."""
    width = 2.0 * knot_bound / raw.shape[0]
    slopes = ops.softplus(raw)
    left_values = -knot_bound + width * _blocked_cumsum(slopes)
    return slopes, left_values


def _interval(z, num_knots, knot_bound):
    """`clip(floor((z + T) K / 2T), 0, K - 1)` as int32 (0 for NaN)."""
    width = 2.0 * knot_bound / num_knots
    position = ops.clip(ops.floor((z + knot_bound) / width), 0.0, num_knots - 1.0)
    # The integer clip sends NaN (cast to an arbitrary integer) into range.
    return ops.clip(ops.cast(position, "int32"), 0, num_knots - 1)


def _offset(z, idx, num_knots, knot_bound):
    """`z - l_idx`, the distance to the left knot of the interval."""
    width = 2.0 * knot_bound / num_knots
    return z - (-knot_bound + width * ops.cast(idx, z.dtype))


def _slope_gradient(sum_grad, sum_grad_offset, raw, knot_bound):
    """`dL/dv_j` from the histograms: `(w sum_{i>j} A_i + B_j) sigmoid(v_j)`."""
    width = 2.0 * knot_bound / raw.shape[0]
    d_slopes = width * _blocked_cumsum(sum_grad, reverse=True)
    return (d_slopes + sum_grad_offset) * ops.sigmoid(raw)


def plif(z, raw_slopes, knot_bound):
    """Piecewise linear increasing function (Ganea et al. 2019, section 4).

    `K = len(raw_slopes)` intervals of width `2T/K` cover `[-T, T]`;
    interval `i` has slope `s_i = softplus(raw_slopes[i]) > 0`. The function is
    continuous: `f(l_i) = -T + (2T/K) sum_{j<i} s_j` (a cumulative sum), and
    `f(x) = f(l_i) + s_i (x - l_i)` on interval `i = floor((x + T) K / 2T)`,
    clipped to `[0, K-1]`, so outside `[-T, T]` the first/last piece extends
    linearly (still increasing). With all `s_i = 1`, `f(x) = x`. The paper's
    free offset `b_0` is left out: a softmax does not see it.

    The gradient is custom (`ops.custom_gradient`, see the module
    docstring): it saves `z` and the int32 interval index, gives
    `df/dz = s[idx]` and the slopes' gradient by two weighted histograms
    (`knot_histogram`) and a reverse cumulative sum. Extra memory does not
    grow with `K` beyond the `[K]` tables. Inputs of static size larger
    than `TILE_ELEMENTS` are processed in tiles (`scan_tiles`).

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
    >>> from keras import ops
    >>> from keras_softmax_heads import functional
    >>> raw = np.full((4,), functional.plif_identity_raw_slope(), "float32")
    >>> z = np.array([-3.0, -0.5, 0.25, 7.0], "float32")
    >>> f = ops.convert_to_numpy(functional.plif(z, raw, 2.0))
    >>> bool(np.allclose(f, z, atol=1e-6))  # identity
    True
    >>> raw[2] = 3.0  # steeper on [0, 1]
    >>> ops.convert_to_numpy(functional.plif(z, raw, 2.0)).round(3).tolist()  # doctest: +ELLIPSIS
    [-3.0, -0.5, 0.76..., 9.04...]
    """
    z, raw, knot_bound = _prepare(z, raw_slopes, knot_bound)
    out_dtype = z.dtype
    z = ops.cast(z, _compute_dtype(z))
    shape = tuple(z.shape)
    size = math.prod(shape) if all(d is not None for d in shape) else None
    if size is not None and size > TILE_ELEMENTS:
        flat = ops.reshape(z, [size])
        out = _plif_tiled(flat, raw, knot_bound, _tile_rows(size, 1))
        return ops.cast(ops.reshape(out, shape), out_dtype)
    return ops.cast(_plif_untiled(z, raw, knot_bound), out_dtype)


def _plif_untiled(z, raw, knot_bound):
    """`plif` in one piece (any shape, also dynamic)."""
    num_knots = raw.shape[0]

    @ops.custom_gradient
    def _plif(z, raw):
        slopes, left_values = _tables(raw, knot_bound)
        idx = _interval(z, num_knots, knot_bound)
        offset = _offset(z, idx, num_knots, knot_bound)
        out = _lookup(left_values, idx) + _lookup(slopes, idx) * offset

        def grad(*args, upstream=None):
            upstream = ops.cast(_upstream(args, upstream), z.dtype)
            offset = _offset(z, idx, num_knots, knot_bound)
            d_z = upstream * _lookup(slopes, idx)
            sums = knot_histogram(idx, (upstream, upstream * offset), num_knots)
            return d_z, _slope_gradient(*sums, raw, knot_bound)

        return out, grad

    return _plif(z, raw)


def _plif_tiled(z, raw, knot_bound, tile):
    """`plif` of a flat vector of static size, in tiles of `tile` elements.

    The same function and custom gradient, with `scan_tiles` loops over the
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
        return idx, _lookup(left_values, idx) + _lookup(slopes, idx) * offset

    def backward_tile(zt, idx, upstream, slopes, sums):
        offset = _offset(zt, idx, num_knots, knot_bound)
        a, b = knot_histogram(idx, (upstream, upstream * offset), num_knots)
        return upstream * _lookup(slopes, idx), (sums[0] + a, sums[1] + b)

    @ops.custom_gradient
    def tiled(z, raw):
        # `stop_gradient`: an outer tape recording the forward loop would
        # make it keep per-iteration temporaries for a gradient that the
        # custom gradient replaces.
        z = ops.stop_gradient(z)
        slopes, left_values = _tables(ops.stop_gradient(raw), knot_bound)
        z2 = ops.reshape(z[: num_full * tile], [num_full, tile])

        def fwd_body(carry, x):
            return carry, forward_tile(x[0], slopes, left_values)

        _, (idx2, out) = scan_tiles(fwd_body, (), (z2,), ("int32", dtype))
        out = ops.reshape(out, [num_full * tile])
        if remainder:
            idx_rem, out_rem = forward_tile(z[num_full * tile :], slopes, left_values)
            out = ops.concatenate([out, out_rem], 0)

        def grad(*args, upstream=None):
            upstream = ops.cast(_upstream(args, upstream), dtype)
            u2 = ops.reshape(upstream[: num_full * tile], [num_full, tile])

            def bwd_body(sums, x):
                d_z, sums = backward_tile(x[0], x[1], x[2], slopes, sums)
                return sums, (d_z,)

            zeros = ops.zeros([num_knots], dtype)
            sums, (d_z,) = scan_tiles(
                bwd_body, (zeros, zeros), (z2, idx2, u2), (dtype,)
            )
            d_z = ops.reshape(d_z, [num_full * tile])
            if remainder:
                d_rem, sums = backward_tile(
                    z[num_full * tile :], idx_rem, upstream[num_full * tile :],
                    slopes, sums,
                )
                d_z = ops.concatenate([d_z, d_rem], 0)
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
    slopes, left_values = _tables(ops.cast(raw, z.dtype), knot_bound)
    idx = _interval(z, num_knots, knot_bound)
    offset = _offset(z, idx, num_knots, knot_bound)
    return ops.take(left_values, idx) + ops.take(slopes, idx) * offset


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
    in tiles of about `TILE_ELEMENTS` scores in `scan_tiles` when their
    number is static (always under XLA, JAX and PyTorch), in one piece
    otherwise.

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

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads import functional
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(3, 4, 9)).astype("float32")
    >>> raw = rng.normal(size=(16,)).astype("float32")
    >>> t = rng.integers(0, 9, size=(3, 4))
    >>> ll = ops.convert_to_numpy(functional.plif_log_likelihood(z, raw, 2.0, t))
    >>> dense = ops.convert_to_numpy(ops.log_softmax(functional.plif(z, raw, 2.0)))
    >>> expected = np.take_along_axis(dense, t[..., None], -1)[..., 0]
    >>> bool(np.allclose(ll, expected, atol=1e-5))
    True
    """
    z, raw, knot_bound = _prepare(z, raw_slopes, knot_bound)
    z = ops.cast(z, _compute_dtype(z))
    vocab_size = z.shape[-1]
    if vocab_size is None:
        raise ValueError(
            f"`z` needs a static last dimension. Received: z.shape={tuple(z.shape)}"
        )
    targets = ops.convert_to_tensor(targets)
    out_shape = ops.shape(targets)
    flat_z = ops.reshape(z, [-1, vocab_size])
    flat_t = ops.clip(ops.reshape(ops.cast(targets, "int32"), [-1]), 0, vocab_size - 1)
    ll = _fused_plif_ll(flat_z, raw, flat_t, knot_bound)
    return ops.reshape(ll, out_shape)


def _fused_plif_ll(z, raw, targets, knot_bound):
    """Flat core: `z` `[M, V]`, `targets` `[M]` int32 -> log-likelihood `[M]`."""
    rows, vocab_size = z.shape
    num_knots = raw.shape[0]
    dtype = z.dtype

    def scores(zt, idx, slopes, left_values):
        offset = _offset(zt, idx, num_knots, knot_bound)
        slope = _lookup(slopes, idx)
        return _lookup(left_values, idx) + slope * offset, slope, offset

    def forward_tile(zt, tt, slopes, left_values):
        idx = _interval(zt, num_knots, knot_bound)
        f, _, _ = scores(zt, idx, slopes, left_values)
        lse = ops.logsumexp(f, axis=-1)
        picked = ops.take_along_axis(f, tt[:, None], axis=-1)[:, 0]
        return idx, lse, picked - lse

    def backward_tile(zt, idx, tt, ut, lse, slopes, left_values, sums):
        f, slope, offset = scores(zt, idx, slopes, left_values)
        # d ll / d f = upstream * (onehot(target) - softmax(f)).
        d_f = (
            ops.one_hot(tt, vocab_size, dtype=dtype) - ops.exp(f - lse[:, None])
        ) * ut[:, None]
        a, b = knot_histogram(idx, (d_f, d_f * offset), num_knots)
        return d_f * slope, (sums[0] + a, sums[1] + b)

    tile = None if rows is None else _tile_rows(rows, vocab_size)
    num_full = 0 if tile is None or tile >= rows else rows // tile
    # Rows past the full tiles, in one piece (all rows when untiled, also
    # when their number is unknown).
    remainder = num_full == 0 or rows > num_full * tile
    start = num_full * tile if num_full else 0

    # `targets` is an argument, not a closure: JAX's custom gradient cannot
    # close over values traced by an enclosing `jax.jit`.
    @ops.custom_gradient
    def fused(z, raw, targets):
        z = ops.stop_gradient(z)  # see `_plif_tiled`
        slopes, left_values = _tables(ops.stop_gradient(raw), knot_bound)
        lls = []
        if num_full:
            z3 = ops.reshape(z[: num_full * tile], [num_full, tile, vocab_size])
            t2 = ops.reshape(targets[: num_full * tile], [num_full, tile])

            def fwd_body(carry, x):
                return carry, forward_tile(x[0], x[1], slopes, left_values)

            _, (idx3, lse2, ll2) = scan_tiles(
                fwd_body, (), (z3, t2), ("int32", dtype, dtype)
            )
            lls.append(ops.reshape(ll2, [num_full * tile]))
        if remainder:
            z_rem, t_rem = z[start:], targets[start:]
            idx_rem, lse_rem, ll_rem = forward_tile(z_rem, t_rem, slopes, left_values)
            lls.append(ll_rem)
        ll = lls[0] if len(lls) == 1 else ops.concatenate(lls, 0)

        def grad(*args, upstream=None):
            upstream = ops.cast(_upstream(args, upstream), dtype)
            zeros = ops.zeros([num_knots], dtype)
            sums, d_zs = (zeros, zeros), []
            if num_full:
                u2 = ops.reshape(upstream[: num_full * tile], [num_full, tile])

                def bwd_body(sums, x):
                    d_z, sums = backward_tile(*x, slopes, left_values, sums)
                    return sums, (d_z,)

                sums, (d_z,) = scan_tiles(
                    bwd_body, sums, (z3, idx3, t2, u2, lse2), (dtype,)
                )
                d_zs.append(ops.reshape(d_z, [num_full * tile, vocab_size]))
            if remainder:
                d_rem, sums = backward_tile(
                    z_rem, idx_rem, t_rem, upstream[start:], lse_rem,
                    slopes, left_values, sums,
                )
                d_zs.append(d_rem)
            d_z = d_zs[0] if len(d_zs) == 1 else ops.concatenate(d_zs, 0)
            return d_z, _slope_gradient(*sums, raw, knot_bound), None

        return ll, grad

    return fused(z, raw, targets)


# ------------------------------------------------------- tabulated functions


def interpolate_table(z, table, lo, width):
    """Piecewise-linear interpolation of a table on a uniform grid.

    `table[g]` is a function's value at `lo + g * width / (G - 1)`,
    `g = 0..G-1`; `z` inside `[lo, lo + width]` gets the linear
    interpolation between its two neighbouring grid values, and outside the
    first / last piece extends linearly. The gradient is custom
    (`ops.custom_gradient`): `d out / dz` is the slope of the score's piece,
    and `d out / d table` two weighted histograms (`knot_histogram`: the
    weights `1 - frac` and `frac` of each score's left and right grid
    points), so nothing of size `[z.size, G]` is formed. `lo` and `width`
    are constants of the grid: they get no gradient.

    Args:
        z: float tensor of any shape.
        table: float `[G]`, `G >= 2` (static).
        lo: float scalar tensor, the first grid point.
        width: float scalar tensor `> 0`, the grid's extent.

    Returns:
        The interpolated values, the shape and dtype of `z`.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads import functional
    >>> table = np.array([0.0, 1.0, 4.0], "float32")  # x**2 at x = 0, 1, 2
    >>> z = np.array([0.5, 1.5, 3.0], "float32")
    >>> ops.convert_to_numpy(functional.interpolate_table(z, table, 0.0, 2.0)).tolist()
    [0.5, 2.5, 7.0]
    """
    z = ops.convert_to_tensor(z)
    table = ops.cast(ops.convert_to_tensor(table), z.dtype)
    num = table.shape[0]
    if num is None or num < 2:
        raise ValueError(f"`table` needs a static length G >= 2. Received: {table.shape}")
    z_ = ops.stop_gradient(z)
    step = ops.stop_gradient(ops.cast(width, z.dtype)) / (num - 1)
    pos = (z_ - ops.stop_gradient(ops.cast(lo, z.dtype))) / step
    idx = ops.cast(ops.clip(ops.floor(pos), 0, num - 2), "int32")
    frac = pos - ops.cast(idx, z.dtype)

    @ops.custom_gradient
    def interpolate(z, table):
        left = _lookup(table, idx)
        rise = _lookup(table, idx + 1) - left
        out = left + rise * frac

        def grad(*args, upstream=None):
            upstream = ops.cast(_upstream(args, upstream), z.dtype)
            d_z = upstream * rise / step
            w_right = upstream * frac
            at_left, at_right = knot_histogram(idx, (upstream - w_right, w_right), num - 1)
            zero = ops.zeros((1,), z.dtype)
            d_table = ops.concatenate([at_left, zero]) + ops.concatenate([zero, at_right])
            return d_z, d_table

        return out, grad

    return interpolate(z, table)
