"""PLIF, the piecewise linear increasing function of Ganea et al. (2019).

`plif(z, raw_slopes, knot_bound)` applies it to scores of any shape;
`plif_log_likelihood(z, raw_slopes, knot_bound, targets)` is
`log_softmax(plif(z))[targets]` without the `[..., V]` PLIF scores or
log-probabilities; both have custom gradients (the slopes' gradient is a
weighted histogram of the scores, `knot_histogram`). `plif_reference` is the
plain formula under automatic differentiation, for tests and benchmarks.
Why the kernels are shaped this way (histograms, tiles, precision):
`docs/plif.md`.

Reading order: the grid (`_tables`, `_interval`, `_offset`,
`_slope_gradient`); one tile's forward and backward pass (`_plif_tile`,
`_plif_tile_grad`, `_ll_tile`, `_ll_tile_grad`); `_RowTiles` (the loop over
full tiles and the remainder); the pieces for a kernel that differentiates
PLIF itself (`plif_tables`, `plif_scores`, `plif_slope_histograms`,
`plif_raw_slope_gradient`, `scan_row_tiles`); `plif` (in one piece, or tiled) and
`plif_log_likelihood`, whose tiled paths share one custom gradient
(`_tiled_custom_gradient`).
"""

import math
from functools import partial
from typing import NamedTuple

import keras
from keras import ops

from keras_softmax_heads.functional.dispatch import clip
from keras_softmax_heads.functional.dispatch import cumsum
from keras_softmax_heads.functional.dispatch import fused_ll_gradient
from keras_softmax_heads.functional.dispatch import knot_histogram
from keras_softmax_heads.functional.dispatch import lookup
from keras_softmax_heads.functional.dispatch import scan_tiles
from keras_softmax_heads.functional.dispatch import softmax_score_gradient
from keras_softmax_heads.functional.dispatch import tile_elements
from keras_softmax_heads.functional.dispatch import torch_plif_scores
from keras_softmax_heads.functional.dispatch import torch_tiled_kernel
from keras_softmax_heads.functional.dispatch import upstream_gradient
from keras_softmax_heads.functional.dispatch import uses_fused_ll_gradient
from keras_softmax_heads.functional.dispatch import uses_torch_tiles
from keras_softmax_heads.functional.dispatch import xla_in_graph
from keras_softmax_heads.validation import check_positive

TILE_ELEMENTS = 2**19
"""Scores per tile of `plif` and `plif_log_likelihood` on the CPU (2 MiB of
float32); a GPU / TPU takes its `dispatch.ACCELERATOR_TILE_ELEMENTS`
(`dispatch.tile_elements`)."""


def plif_identity_raw_slope():
    """The raw slope `v` with `softplus(v) = 1` (identity initialisation)."""
    return math.log(math.e - 1.0)


def check_knot_bound(knot_bound):
    """Returns `knot_bound` as a float, or raises unless it is finite and > 0."""
    return check_positive("knot_bound", knot_bound)


def check_raw_slopes(raw):
    """Returns the tensor `raw`, or raises unless it is a vector of static
    length `K >= 1` (the raw slopes of a PLIF)."""
    if len(raw.shape) != 1 or raw.shape[0] is None or raw.shape[0] < 1:
        raise ValueError(
            "`raw_slopes` must be a vector of static length K >= 1. "
            f"Received: raw_slopes with shape {tuple(raw.shape)}"
        )
    return raw


# ------------------------------------------------------------------ the grid


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
    raw = check_raw_slopes(ops.cast(ops.convert_to_tensor(raw_slopes), _compute_dtype(z)))
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
    within = cumsum(x, axis=1)
    within = ops.pad(within[:, :-1], [[0, 0], [1, 0]])
    totals = ops.sum(x, axis=1)
    offsets = ops.pad(cumsum(totals)[:-1], [[1, 0]])
    out = ops.reshape(within + offsets[:, None], [-1])[:size]
    return ops.flip(out, axis=0) if reverse else out


class _Tables(NamedTuple):
    """The `[K]` tables of one PLIF, shared by all tiles, and the grid's
    constants as Python values (a gradient function reads no attribute of
    a tensor of the forward pass: `torch.compile` refuses that)."""

    slopes: object  # s = softplus(v)
    left_values: object  # f(l_i) at the left knots
    knot_bound: float
    num_knots: int
    dtype: str  # the compute dtype of the scores


def _tables(raw, knot_bound):
    """Slopes `s = softplus(v)` and `f(l_i)` at the left knots."""
    num_knots = raw.shape[0]
    width = 2.0 * knot_bound / num_knots
    slopes = ops.softplus(raw)
    left_values = -knot_bound + width * _blocked_cumsum(slopes)
    dtype = keras.backend.standardize_dtype(raw.dtype)
    return _Tables(slopes, left_values, knot_bound, num_knots, dtype)


def _interval(z, num_knots, knot_bound):
    """`clip(floor((z + T) K / 2T), 0, K - 1)` as int32 (0 for NaN)."""
    width = 2.0 * knot_bound / num_knots
    position = clip(ops.floor((z + knot_bound) / width), 0.0, num_knots - 1.0)
    # The integer clip sends NaN (cast to an arbitrary integer) into range.
    return clip(ops.cast(position, "int32"), 0, num_knots - 1)


def _offset(z, idx, num_knots, knot_bound, dtype):
    """`z - l_idx`, the distance to the left knot of the interval (`dtype`
    that of `z`)."""
    width = 2.0 * knot_bound / num_knots
    return z - (-knot_bound + width * ops.cast(idx, dtype))


def _slope_gradient(sum_grad, sum_grad_offset, raw, knot_bound):
    """`dL/dv_j` from the histograms: `(w sum_{i>j} A_i + B_j) sigmoid(v_j)`."""
    width = 2.0 * knot_bound / raw.shape[0]
    d_slopes = width * _blocked_cumsum(sum_grad, reverse=True)
    return (d_slopes + sum_grad_offset) * ops.sigmoid(raw)


# ------------------------------------------------------------- one tile


def _scores(tables, z, idx):
    """PLIF scores `f(z)` of the interval index `idx`, with the slope and
    offset they used."""
    offset = _offset(z, idx, tables.num_knots, tables.knot_bound, tables.dtype)
    slope = lookup(tables.slopes, idx)
    return lookup(tables.left_values, idx) + slope * offset, slope, offset


def _plif_tile(tables, z):
    """`plif` forward: `(f(z),)`."""
    idx = _interval(z, tables.num_knots, tables.knot_bound)
    offset = _offset(z, idx, tables.num_knots, tables.knot_bound, tables.dtype)
    return (lookup(tables.left_values, idx) + lookup(tables.slopes, idx) * offset,)


def _plif_tile_grad(tables, z, upstream):
    """`plif` backward: `(dL/dz, (A, B))`, the slopes' two histograms (the
    interval index recomputed from `z`)."""
    idx = _interval(z, tables.num_knots, tables.knot_bound)
    offset = _offset(z, idx, tables.num_knots, tables.knot_bound, tables.dtype)
    sums = knot_histogram(idx, (upstream, upstream * offset), tables.num_knots)
    return upstream * lookup(tables.slopes, idx), sums


def _ll_tile(tables, z, targets):
    """`plif_log_likelihood` forward on rows `z` `[n, V]`: the
    log-normaliser `[n]` and the log-likelihood `[n]`."""
    idx = _interval(z, tables.num_knots, tables.knot_bound)
    f, _, _ = _scores(tables, z, idx)
    lse = ops.logsumexp(f, axis=-1)
    picked = ops.take_along_axis(f, targets[:, None], axis=-1)[:, 0]
    return lse, picked - lse


def _ll_tile_grad(tables, z, targets, upstream, lse):
    """`plif_log_likelihood` backward on rows `z` `[n, V]`: the interval
    index, PLIF scores and `softmax` recomputed, `(dL/dz, (A, B))` (one
    Pallas kernel with the `"pallas_fused"` histogram method,
    `dispatch.fused_ll_gradient`)."""
    if uses_fused_ll_gradient(tables.dtype):
        return fused_ll_gradient(z, targets, upstream, lse, tables.slopes,
                                 tables.left_values, tables.knot_bound)
    idx = _interval(z, tables.num_knots, tables.knot_bound)
    f, slope, offset = _scores(tables, z, idx)
    # d ll / d f = upstream * (onehot(target) - softmax(f)).
    d_f = softmax_score_gradient(f, lse, targets, upstream)
    sums = knot_histogram(idx, (d_f, d_f * offset), tables.num_knots)
    return d_f * slope, sums


# --------------------------------------------------------------- the tiles


def _tile_rows(rows, vocab_size):
    """Rows per tile: about `tile_elements(TILE_ELEMENTS)` scores (the
    platform's), a divisor of `rows` if one is within a factor 2 (then there
    is no remainder tile to concatenate)."""
    target = max(1, min(rows, tile_elements(TILE_ELEMENTS) // max(vocab_size, 1)))
    # Divisors of `rows` in [target / 2, target], largest first.
    for small in range(1, int(math.isqrt(rows)) + 1):
        if rows % small == 0 and (target + 1) // 2 <= rows // small <= target:
            return rows // small
    for small in range(min(target, int(math.isqrt(rows))), (target + 1) // 2 - 1, -1):
        if small > 0 and rows % small == 0:
            return small
    return target


class _RowTiles:
    """The rows of a tensor as `num_full` tiles of `tile` rows, processed in a
    `scan_tiles` loop (one tile in flight), and the rows past them (all rows
    when `rows` is unknown or fits one tile) in one piece.

    Tensors travel as `(full, rest)` pairs: the full tiles stacked
    `[num_full, tile, ...]` (None when there are none) and the remainder
    (None when there is none).
    """

    def __init__(self, rows, row_size):
        self.tile = None if rows is None else _tile_rows(rows, row_size)
        tiled = self.tile is not None and self.tile < rows
        self.num_full = rows // self.tile if tiled else 0
        self.start = self.num_full * self.tile if self.num_full else 0
        self.has_rest = self.num_full == 0 or rows > self.start

    def split(self, x):
        """`x` `[rows, ...]` as `(full, rest)`."""
        full = None
        if self.num_full:
            full = ops.reshape(x[: self.start], [self.num_full, self.tile, *x.shape[1:]])
        return full, (x[self.start :] if self.has_rest else None)

    def join(self, full, rest, row_shape=()):
        """The `[rows, *row_shape]` tensor of a `(full, rest)` pair."""
        parts = []
        if full is not None:
            parts.append(ops.reshape(full, [self.start, *row_shape]))
        if rest is not None:
            parts.append(rest)
        return parts[0] if len(parts) == 1 else ops.concatenate(parts, 0)

    def map(self, tile_fn, pairs, ys_dtypes):
        """`tile_fn(*xs) -> ys` on every tile of the `(full, rest)` pairs of
        `xs`; returns one `(full, rest)` pair per output."""

        def body(carry, xs):
            return carry, tile_fn(*xs)

        _, full, rest = self._run(body, (), pairs, ys_dtypes)
        return _pairs(full, rest, len(ys_dtypes))

    def accumulate(self, tile_grad_fn, sums, pairs, dtype):
        """`tile_grad_fn(*xs) -> (d_z, (a, b))` on every tile, the histograms
        added to `sums` tile by tile; returns `(sums, (full, rest) of d_z)`."""

        def body(sums, xs):
            d_z, (a, b) = tile_grad_fn(*xs)
            return (sums[0] + a, sums[1] + b), (d_z,)

        sums, full, rest = self._run(body, sums, pairs, (dtype,))
        ((d_z_full, d_z_rest),) = _pairs(full, rest, 1)
        return sums, (d_z_full, d_z_rest)

    def _run(self, body, carry, pairs, ys_dtypes):
        full_ys = rest_ys = None
        if self.num_full:
            carry, full_ys = scan_tiles(body, carry, tuple(p[0] for p in pairs), ys_dtypes)
        if self.has_rest:
            carry, rest_ys = body(carry, tuple(p[1] for p in pairs))
        return carry, full_ys, rest_ys


def _pairs(full, rest, count):
    """Per-output `(full, rest)` pairs from two tuples of outputs (or None)."""
    full = full if full is not None else (None,) * count
    rest = rest if rest is not None else (None,) * count
    return tuple(zip(full, rest))


# ------------------------------------------- the pieces, for other kernels


def plif_tables(raw_slopes, knot_bound):
    """The `[K]` tables of one PLIF, for a kernel that differentiates it
    itself (`chunked.summed_mixture`): `slopes = softplus(v)`, the values
    `f(l_i)` at the left knots (a blocked cumulative sum), and the grid's
    constants. `raw_slopes` `[K]` in the scores' dtype (float32 / float64),
    read as a constant: the caller returns its gradient
    (`plif_raw_slope_gradient`)."""
    return _tables(raw_slopes, check_knot_bound(knot_bound))


def plif_scores(tables, z):
    """`(f, slope, idx, offset)` of scores `z` (the dtype of `tables`):
    `f = plif(z)`, `df/dz = slope`, the int32 interval index and `z - l_idx`,
    the last two for `plif_slope_histograms` (in place on PyTorch outside a
    recorded graph, `dispatch.torch_plif_scores`)."""
    if uses_torch_tiles(z, tables.slopes):
        return torch_plif_scores(z, tables.slopes, tables.left_values, tables.knot_bound)
    idx = _interval(z, tables.num_knots, tables.knot_bound)
    f, slope, offset = _scores(tables, z, idx)
    return f, slope, idx, offset


def plif_slope_histograms(tables, idx, offset, d_f):
    """`(A, B)` `[K]`: the sums of `d_f` (a gradient with respect to `f`)
    and of `d_f * offset` per interval (`knot_histogram`, the platform's
    path). Summed over any number of score blocks, they give the raw
    slopes' gradient (`plif_raw_slope_gradient`)."""
    return knot_histogram(idx, (d_f, d_f * offset), tables.num_knots)


def plif_raw_slope_gradient(histograms, raw_slopes, knot_bound):
    """The gradient with respect to the raw slopes `v` `[K]` from the two
    histograms `(A, B)` of `plif_slope_histograms`:
    `dL/dv_j = ((2T/K) sum_{i>j} A_i + B_j) sigmoid(v_j)`.

    Example (inside `[-T, T]`, `f(z) = -T + sum_j s_j clip(z - l_j, 0,
    2T/K)`, so `dL/ds_j = sum d_f clip(z - l_j, 0, 2T/K)`):

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads import functional
    >>> rng = np.random.default_rng(0)
    >>> z = rng.uniform(-1.9, 1.9, size=(4, 6)).astype("float32")
    >>> raw = rng.normal(size=(8,)).astype("float32")
    >>> d_f = rng.normal(size=(4, 6)).astype("float32")  # dL/df
    >>> tables = functional.plif_tables(raw, 2.0)
    >>> f, slope, idx, offset = functional.plif_scores(tables, z)
    >>> sums = functional.plif_slope_histograms(tables, idx, offset, d_f)
    >>> grad = ops.convert_to_numpy(functional.plif_raw_slope_gradient(sums, raw, 2.0))
    >>> knots = -2.0 + 0.5 * np.arange(8)
    >>> ramps = np.clip(z[..., None] - knots, 0.0, 0.5)
    >>> expected = (d_f[..., None] * ramps).sum((0, 1)) / (1 + np.exp(-raw))
    >>> bool(np.allclose(grad, expected, atol=1e-5))
    True
    >>> bool(np.allclose(ops.convert_to_numpy(f),
    ...                  ops.convert_to_numpy(functional.plif(z, raw, 2.0)), atol=1e-6))
    True
    """
    return _slope_gradient(histograms[0], histograms[1], raw_slopes,
                           check_knot_bound(knot_bound))


def scan_row_tiles(body, carry, xs, ys_dtypes):
    """`body(carry, xs_tile) -> (carry, ys_tile)` over tiles of the rows of
    `xs`, the tiles PLIF's own kernels take on this platform.

    `xs`: a tuple of tensors with a common static leading dimension `rows`;
    a tile holds about `dispatch.tile_elements(TILE_ELEMENTS)` elements of
    the first (`xs[0]`: the scores; its elements past the leading axis make
    a row), a whole number of rows (at least one): a CPU's cache-sized
    tiles in a `scan_tiles` loop, a GPU's in one piece. `ys_tile` is a
    tuple of tensors whose leading axis is the tile's rows; returns
    `(carry, ys)`, each of `ys` with all `rows` rows. For the per-score work
    of a kernel that differentiates PLIF itself
    (`chunked.summed_mixture`).

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads import functional
    >>> z = np.arange(12, dtype="float32").reshape(6, 2)
    >>> def body(carry, xs):
    ...     return (carry[0] + ops.sum(xs[0]),), (2.0 * xs[0],)
    >>> (total,), (twice,) = functional.scan_row_tiles(body, (np.float32(0),), (z,), ("float32",))
    >>> float(total), bool(np.allclose(ops.convert_to_numpy(twice), 2 * z))
    (66.0, True)
    """
    first = xs[0]
    row_size = math.prod(first.shape[1:])
    tiles = _RowTiles(first.shape[0], row_size)
    pairs = [tiles.split(x) for x in xs]
    carry, full, rest = tiles._run(body, tuple(carry), pairs, tuple(ys_dtypes))
    ys = []
    for y_full, y_rest in _pairs(full, rest, len(ys_dtypes)):
        row_shape = (y_full.shape[2:] if y_full is not None else y_rest.shape[1:])
        ys.append(tiles.join(y_full, y_rest, list(row_shape)))
    return carry, tuple(ys)


# ------------------------------------------------------------------ plif


def plif(z, raw_slopes, knot_bound):
    """Piecewise linear increasing function (Ganea et al. 2019, section 4).

    `K = len(raw_slopes)` intervals of width `2T/K` cover `[-T, T]`;
    interval `i` has slope `s_i = softplus(raw_slopes[i]) > 0`. The function is
    continuous: `f(l_i) = -T + (2T/K) sum_{j<i} s_j` (a cumulative sum), and
    `f(x) = f(l_i) + s_i (x - l_i)` on interval `i = floor((x + T) K / 2T)`,
    clipped to `[0, K-1]`, so outside `[-T, T]` the first/last piece extends
    linearly (still increasing). With all `s_i = 1`, `f(x) = x`. The paper's
    free offset `b_0` is left out: a softmax does not see it.

    The gradient is custom (`ops.custom_gradient`, see `docs/plif.md`): it
    saves `z` only (the interval index is recomputed from it), gives
    `df/dz = s[idx]` and the
    slopes' gradient by two weighted histograms (`knot_histogram`) and a
    reverse cumulative sum. Extra memory does not grow with `K` beyond the
    `[K]` tables. Inputs of static size larger than the platform's tile
    (`dispatch.tile_elements`: `TILE_ELEMENTS` scores on the CPU) are
    processed in tiles (`scan_tiles`). In a TensorFlow graph run without XLA
    (Keras' `jit_compile="auto"` on a CPU) it is compiled with XLA all the
    same (`dispatch.xla_in_graph`).

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

    References:
        - Ganea, Gelly, Bécigneul, Severyn. Breaking the Softmax Bottleneck
          via Learnable Monotonic Pointwise Non-linearities. ICML 2019.
          https://arxiv.org/abs/1902.08077
    """
    z, raw, knot_bound = _prepare(z, raw_slopes, knot_bound)
    out_dtype = z.dtype
    z = ops.cast(z, _compute_dtype(z))
    shape = tuple(z.shape)
    # Unknown (None) or symbolic (a JAX export's batch) dimensions: untiled.
    size = math.prod(shape) if all(isinstance(d, int) for d in shape) else None
    # PyTorch's in-place loop (`plif_torch`) also takes a single tile.
    if size is not None and (size > tile_elements(TILE_ELEMENTS)
                             or uses_torch_tiles(ops.stop_gradient(z))):
        out = _plif_tiled(ops.reshape(z, [size]), raw, knot_bound)
        return ops.cast(ops.reshape(out, shape), out_dtype)
    return ops.cast(_plif_untiled(z, raw, knot_bound), out_dtype)


def _plif_untiled(z, raw, knot_bound):
    """`plif` in one piece (any shape, also dynamic)."""

    @ops.custom_gradient
    def untiled(z, raw):
        tables = _tables(raw, knot_bound)
        (out,) = xla_in_graph(_plif_tile, tables, z)

        def grad(*args, upstream=None):
            upstream = ops.cast(upstream_gradient(args, upstream), z.dtype)

            def backward():
                d_z, sums = _plif_tile_grad(tables, z, upstream)
                return d_z, _slope_gradient(*sums, raw, knot_bound)

            return xla_in_graph(backward)

        return out, grad

    return untiled(z, raw)


def _plif_tiled(z, raw, knot_bound):
    """`plif` of a flat vector of static size, in tiles of about
    `tile_elements(TILE_ELEMENTS)` scores (on a CPU under XLA the loop keeps
    each tile in cache and the `[K]` tables materialised, see
    `docs/plif.md`; on PyTorch `plif_torch`'s loop)."""
    tiled = _tiled_custom_gradient(
        _plif_tile, _plif_tile_grad, z.dtype, (z.dtype,),
        _RowTiles(z.shape[0], 1), knot_bound, torch_kernel="plif",
    )
    return tiled(z, raw)


def _tiled_custom_gradient(tile_fn, tile_grad_fn, dtype, ys_dtypes, tiles, knot_bound,
                           row_shape=(), torch_kernel=None):
    """A PLIF kernel over `tiles` with its custom gradient.

    Returns `f(z, raw, *extra)`. The forward pass runs
    `tile_fn(tables, z, *extra) -> (*saved, out)` on every tile
    (`ys_dtypes` the dtypes of those outputs) and returns the tiles' `out`;
    the backward pass runs
    `tile_grad_fn(tables, z, *extra, upstream, *saved) -> (dL/dz, (A, B))`
    on every tile, adds the slopes' histograms `A`, `B` tile by tile and
    returns `dL/dz` (`[rows, *row_shape]`, `dtype`, the dtype of `z`),
    `dL/draw` and None for `extra` (integer inputs such as the targets).
    `dtype` is passed in: the gradient function reads no attribute of a
    tensor of the forward pass (`torch.compile` refuses that).

    On PyTorch (`dispatch.uses_torch_tiles`) the loops are
    `torch_tiled_kernel(torch_kernel)` and its `"_gradient"` (the same
    arguments, whole tensors, the tables' three fields and the tile size
    instead of `tables`).
    """

    def torch_loop(name, tables, *args):
        if (torch_kernel is None or tiles.tile is None
                or not uses_torch_tiles(*args, tables.slopes)):
            return None
        return torch_tiled_kernel(torch_kernel + name)(
            *args, tables.slopes, tables.left_values, tables.knot_bound, tiles.tile)

    @ops.custom_gradient
    def tiled(z, raw, *extra):
        tables = _tables(ops.stop_gradient(raw), knot_bound)

        def forward():
            outputs = torch_loop("", tables, ops.stop_gradient(z), *extra)
            if outputs is not None:
                *saved, out = outputs
                return saved, out
            *saved, out = tiles.map(
                partial(tile_fn, tables), _split_inputs(tiles, z, extra), ys_dtypes
            )
            return [tiles.join(*pair) for pair in saved], tiles.join(*out)

        saved, out = xla_in_graph(forward)

        def grad(*args, upstream=None):
            upstream = ops.cast(upstream_gradient(args, upstream), dtype)

            def backward():
                result = torch_loop("_gradient", tables, ops.stop_gradient(z), *extra,
                                    upstream, *saved)
                if result is None:
                    zeros = ops.zeros([tables.num_knots], dtype)
                    z_tiles, *extra_tiles = _split_inputs(tiles, z, extra)
                    sums, d_z = tiles.accumulate(
                        partial(tile_grad_fn, tables),
                        (zeros, zeros),
                        (z_tiles, *extra_tiles, tiles.split(upstream),
                         *(tiles.split(x) for x in saved)),
                        dtype,
                    )
                    result = tiles.join(*d_z, row_shape=row_shape), sums
                d_z, sums = result
                return d_z, _slope_gradient(*sums, raw, knot_bound)

            return xla_in_graph(backward) + (None,) * len(extra)

        return out, grad

    return tiled


def _split_inputs(tiles, z, extra):
    """The tiles of `z` (under `stop_gradient`: an outer tape recording the
    forward loop would make it keep per-iteration temporaries for a
    gradient that the custom gradient replaces) and of the `extra` inputs.
    The backward pass splits the inputs again rather than keep the forward
    pass's slices: those alias the inputs, which `torch.compile` refuses in
    a gradient function."""
    return (tiles.split(ops.stop_gradient(z)), *(tiles.split(x) for x in extra))


def plif_reference(z, raw_slopes, knot_bound):
    """`plif` written with plain differentiable ops (automatic gradient).

    The straightforward formulation (two gathers, autodiff through them);
    kept as a reference for tests and benchmarks.
    """
    z, raw, knot_bound = _prepare(z, raw_slopes, knot_bound)
    num_knots = raw.shape[0]
    tables = _tables(ops.cast(raw, z.dtype), knot_bound)
    idx = _interval(z, num_knots, knot_bound)
    offset = _offset(z, idx, num_knots, knot_bound, z.dtype)
    return ops.take(tables.left_values, idx) + ops.take(tables.slopes, idx) * offset


# ------------------------------------------------------ plif_log_likelihood


def plif_log_likelihood(z, raw_slopes, knot_bound, targets):
    """`log_softmax(plif(z))[targets]` with one fused custom gradient.

    Exact log-likelihood of the PLIF head (Ganea et al. 2019) from the linear
    scores `z`, without ever holding the `[..., V]` PLIF scores or
    log-probabilities: the forward pass keeps the per-row log-normaliser
    (and `z`); the backward pass recomputes the interval index, the PLIF
    scores and `softmax` tile by tile and returns `dL/dz` and the slopes' gradient
    (two weighted histograms, see `docs/plif.md`). Rows are processed in
    tiles of about `dispatch.tile_elements` scores (`TILE_ELEMENTS` on the
    CPU, far more on a GPU / TPU) in `scan_tiles` when their number is
    static (always under XLA, JAX and PyTorch), in one piece otherwise. In
    a TensorFlow graph run without XLA it is compiled with XLA all the same
    (`dispatch.xla_in_graph`).

    Args:
        z: float tensor `[..., V]`, the linear scores (float16 / bfloat16 are
            computed in float32).
        raw_slopes: float tensor or variable `[K]`.
        knot_bound: float `T > 0`.
        targets: integer tensor `[...]` (the leading shape of `z`). Ids
            outside `[0, V)` are clipped (validate them beforehand, e.g. with
            `keras_softmax_heads.validation.check_targets` /
            `nan_if_invalid`).

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
    """Flat core: `z` `[M, V]`, `targets` `[M]` int32 -> log-likelihood `[M]`.

    `targets` is an argument of the custom gradient, not a closure: JAX's
    custom gradient cannot close over values traced by an enclosing
    `jax.jit`.
    """
    rows, vocab_size = z.shape
    fused = _tiled_custom_gradient(
        _ll_tile, _ll_tile_grad, z.dtype, (z.dtype, z.dtype),
        _RowTiles(rows, vocab_size), knot_bound, row_shape=(vocab_size,),
        torch_kernel="log_likelihood",
    )
    return fused(z, raw, targets)
