"""The backend-specific code of `functional`: one dispatch function each.

Every other module of the package is `keras.ops` code. These functions
branch on `keras.backend.backend()` and import TensorFlow only in their
TensorFlow branch, where TensorFlow has a faster kernel or Keras' generic op
does not fit; the other backends take the `keras.ops` path. A new
backend-specific fast path of a `functional` kernel goes here, as one more
dispatch function tested against its `keras.ops` path.

* `scan_tiles`: a loop over tiles with one iteration in flight
  (`tf.while_loop` + `TensorArray` on TensorFlow, a loop writing each
  iteration into preallocated outputs on PyTorch, `ops.scan` on JAX);
* `knot_histogram`: per-interval sums of weights, by platform
  (`histogram_method`, from `platforms.current_platform`): on the CPU `DenseBincount` on
  TensorFlow, `ops.segment_sum` elsewhere; on a TPU the scatter-free
  `sorted_knot_histogram`; on a GPU under JAX the Pallas kernel of
  `plif_pallas`; as an option `spread_knot_histogram` (interleaved copies
  of the histogram);
* `uses_torch_tiles`, `torch_tiled_kernel`, `torch_plif_scores`: the
  tiles of `plif` and `plif_log_likelihood`, and `plif_scores`, on PyTorch
  in place (`plif_torch`);
* `tile_elements`: the scores per tile of PLIF's tiled kernels, by
  platform (a CPU's cache-sized tile, or few large tiles on a GPU / TPU);
* `lookup`: `table[idx]` for indices known to be in range (`tf.gather` on
  TensorFlow, `torch.index_select` on PyTorch, `ops.take` on JAX);
* `clip`: `ops.clip` with number bounds (`torch.clamp` on PyTorch, whose
  Keras `clip` with tensor bounds is 5x slower on a CPU);
* `softmax_score_gradient`: `u (onehot - softmax)` of a tile's scores
  (in place on PyTorch, without Keras' int64 `one_hot`);
* `cumsum`: a cumulative sum in the input's dtype (`torch.cumsum` on
  PyTorch, whose Keras `cumsum` sums float64 in float32);
* `segment_sum`: per-segment sums in the input's dtype (`index_add_` on
  PyTorch, whose Keras `segment_sum` sums float64 in float32 and copies its
  inputs several times; the knot histogram's and the hierarchical heads'
  sums);
* `segment_max`, `scatter`: one `scatter_reduce_` / `index_put_` on
  PyTorch, where Keras' `segment_max` repeats the ids with a data-dependent
  shape and its `scatter` adds one index at a time in a Python loop (the
  hierarchical heads' tiles and log-probabilities, Weaknorm's penalty rows;
  both broke `torch.compile` graphs);
* `upstream_gradient`: the upstream gradient inside an
  `ops.custom_gradient` gradient function (positional on TensorFlow and
  JAX, keyword on PyTorch);
* `xla_in_graph`: a kernel compiled with XLA in a TensorFlow graph that
  TensorFlow would otherwise run op by op (a Keras step without
  `jit_compile`, Keras' choice on a CPU); `exportable_graph`, the context
  in which it does not (the heads' inference call, which `model.export`
  traces).
"""

import contextlib
import threading

import keras
from keras import ops

from keras_softmax_heads import platforms
from keras_softmax_heads.platforms import current_platform
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_int


def scan_tiles(body, carry, xs, ys_dtypes):
    """`ops.scan(body, carry, xs)` with one iteration in flight at a time.

    `body(carry, x) -> (carry, ys)`, `ys` a tuple of tensors (possibly
    empty) stacked along a new leading axis. JAX uses `ops.scan`; PyTorch
    a loop that writes each iteration's `ys` into preallocated outputs
    (`_torch_scan_tiles`); TensorFlow a `tf.while_loop` with `parallel_iterations=1`
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

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads import functional
    >>> def body(carry, x):
    ...     total = carry[0] + x[0]
    ...     return (total,), (total * 2.0,)
    >>> xs = (np.arange(3, dtype="float32"),)
    >>> (total,), (doubled,) = functional.scan_tiles(body, (np.float32(0),), xs, ("float32",))
    >>> float(total), ops.convert_to_numpy(doubled).tolist()
    (3.0, [0.0, 2.0, 6.0])
    """
    if keras.backend.backend() == "torch":
        return _torch_scan_tiles(body, carry, xs)
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


def _torch_scan_tiles(body, carry, xs):
    """`scan_tiles` on PyTorch: each iteration's `ys` copied into its slot
    of the `[n, ...]` outputs as soon as it is computed, where Keras'
    `ops.scan` keeps every iteration's `ys` and stacks them at the end (one
    more pass over the whole output, read back from memory)."""
    import torch

    n = xs[0].shape[0]
    carry, outputs = tuple(carry), None
    for i in range(n):
        carry, ys = body(carry, tuple(x[i] for x in xs))
        carry = tuple(carry)
        if outputs is None:
            outputs = tuple(torch.empty((n, *y.shape), dtype=y.dtype, device=y.device)
                            for y in ys)
        for out, y in zip(outputs, ys):
            out[i].copy_(y)
    return carry, outputs if outputs is not None else ()


ACCELERATOR_TILE_ELEMENTS = {"gpu": 2**28, "tpu": 2**24}
"""Scores per tile of PLIF's tiled kernels on a GPU (1 GiB of float32) and
on a TPU (64 MiB: its sorted histogram's temporaries grow with the tile)."""


def tile_elements(cpu_tile_elements):
    """Scores per tile of PLIF's tiled kernels (`plif`, `plif_log_likelihood`)
    on `platforms.current_platform()`.

    On the CPU `cpu_tile_elements` (`plif_kernels.TILE_ELEMENTS`, 2 MiB of
    float32: a tile stays in cache, and the loop keeps XLA from fusing the
    slope tables into every lookup). On a GPU / TPU the loop is sequential,
    each tile a handful of small kernels, so few large tiles (none at all
    when the scores fit one) are what is fast. A GPU takes
    `ACCELERATOR_TILE_ELEMENTS["gpu"]` (2**28); a TPU 2**24, because its
    sorted histogram (a sort, gathers and a scan of the whole tile) holds
    temporaries proportional to the tile. The measurements behind both:
    `docs/plif.md`, "Tiles".

    >>> from keras_softmax_heads.platforms import forced_platform
    >>> with forced_platform("gpu"):
    ...     tile_elements(2**19) == 2**28
    True
    >>> tile_elements(2**19)  # the CPU
    524288
    """
    platform = current_platform()
    if platform == "cpu":
        return cpu_tile_elements
    return ACCELERATOR_TILE_ELEMENTS[platform]


HISTOGRAM_METHODS = ("scatter", "sorted", "pallas", "pallas_fused", "spread")
"""The paths of `knot_histogram` (see `histogram_method`). `"pallas_fused"`
is `"pallas"` for `knot_histogram`; it also makes `plif_log_likelihood`'s
backward tile one kernel (`fused_ll_gradient`). Not a default anywhere:
on a GPU it was slower than `"pallas"`, with less memory (`docs/plif.md`).
`"spread"` (`spread_knot_histogram`) is an option until a GPU has timed it
(on a CPU it is no faster than the scatter: `docs/plif.md`)."""

SPREAD_BUFFER_ELEMENTS = 2**20
"""Bins of `spread_knot_histogram`'s buffer per weight tensor (4 MiB of
float32): it takes as many copies of the histogram as fit (a power of two,
at most `SPREAD_MAX_COPIES`)."""

SPREAD_MAX_COPIES = 256
"""The most copies `spread_knot_histogram` takes by default."""

HISTOGRAM_METHOD = None
"""A path forced for every `knot_histogram` call (None: by platform)."""


@contextlib.contextmanager
def forced_histogram_method(method):
    """Within the scope `HISTOGRAM_METHOD` is `method` (None: by platform);
    restored afterwards. The path is chosen while tracing: trace (or
    compile) inside the scope (benchmarks, studies).

    >>> with forced_histogram_method("sorted"):
    ...     histogram_method()
    'sorted'
    """
    global HISTOGRAM_METHOD
    if method is not None:
        check_choice("method", method, HISTOGRAM_METHODS)
    saved, HISTOGRAM_METHOD = HISTOGRAM_METHOD, method
    try:
        yield
    finally:
        HISTOGRAM_METHOD = saved


def histogram_method():
    """The path `knot_histogram` takes here: `HISTOGRAM_METHOD` when set,
    else by `platforms.current_platform()` and backend.

    * CPU (every backend), and GPU on TensorFlow / PyTorch: `"scatter"`
      (`DenseBincount` on TensorFlow, `ops.segment_sum` elsewhere);
    * GPU on JAX: `"pallas"` (`plif_pallas.pallas_knot_histogram`, a
      privatised kernel without contended atomics), `"scatter"` where the
      installed JAX lacks Pallas' Triton backend
      (`platforms.has_pallas_triton`);
    * TPU: `"sorted"` (`sorted_knot_histogram`, no scatter at all);
    * on JAX under a `keras.distribution.ModelParallel` (whatever the
      platform): `"scatter"`, which then keeps the scores' shape
      (`sharded_scatter`):
      XLA's partitioner splits a scatter-add of sharded scores into each
      device's partial histogram and one `[K]` all-reduce, where flattening
      the scores, sorting them or a kernel would gather all of them on
      every device first.

    Why (and what is measured): `docs/plif.md`.
    """
    if HISTOGRAM_METHOD is not None:
        return check_choice("HISTOGRAM_METHOD", HISTOGRAM_METHOD, HISTOGRAM_METHODS)
    if sharded_scatter():
        return "scatter"
    platform = current_platform()
    if platform == "tpu":
        return "sorted"
    if (platform == "gpu" and keras.backend.backend() == "jax"
            and platforms.has_pallas_triton()):
        return "pallas"
    return "scatter"


_PER_SHARD = threading.local()


@contextlib.contextmanager
def per_shard():
    """A context for code traced inside a `jax.shard_map` body, whose
    arrays are one device's: there `knot_histogram` keeps the platform's
    method (`sharded_scatter` is False), as on one device. The
    vocabulary-parallel passes (`chunked.vocab_parallel`) trace their
    shards' bodies in it (the PLIF's slope histograms of
    `vocab_parallel_mixture`: a Pallas kernel on a GPU, the sorted
    histogram on a TPU).

    >>> with per_shard():
    ...     sharded_scatter()
    False
    """
    previous = getattr(_PER_SHARD, "active", False)
    _PER_SHARD.active = True
    try:
        yield
    finally:
        _PER_SHARD.active = previous


def sharded_scatter():
    """Whether `knot_histogram`'s scatter keeps the scores' shape: JAX under
    a current `keras.distribution.ModelParallel`, whose layouts may shard
    the scores on their vocabulary axis (`training.VocabularyParallel`),
    outside a shard's body (`per_shard`). Flattened (elsewhere: 1.5x faster
    on one CPU device, measured), that axis would no longer be a block of
    the flat array and XLA would gather the scores and indices on every
    device. Under `DataParallel` (rows split: blocks of the flat array)
    the platform's method stays."""
    return (keras.backend.backend() == "jax"
            and not getattr(_PER_SHARD, "active", False)
            and isinstance(keras.distribution.distribution(),
                           keras.distribution.ModelParallel))


def knot_histogram(idx, weights, num_knots, method=None):
    """Per-interval sums of weights: `out[i] = sum of w where idx == i`.

    The slopes' gradient of PLIF, by one of four paths (`method`; by
    default `histogram_method()`, chosen by platform):

    * `"scatter"`: TensorFlow's `DenseBincount` (multi-threaded partial
      histograms on CPU, much faster there than `unsorted_segment_sum`; a
      scatter-add under XLA), `segment_sum` on the other backends (a
      scatter-add; `jax.ops.segment_sum` under JAX; `index_add_` on
      PyTorch, `dispatch.segment_sum`). On a GPU its updates
      collide on the few bins where most scores fall.
    * `"sorted"`: `sorted_knot_histogram`, without any scatter (`keras.ops`,
      every backend).
    * `"spread"`: `spread_knot_histogram`, a scatter-add into interleaved
      copies of the histogram, so that neighbouring scores in a hot bin
      update different addresses (`keras.ops`, every backend).
    * `"pallas"` (JAX only): `plif_pallas.pallas_knot_histogram`, per-program
      private histograms (interpreted off the GPU); `"pallas_fused"` the
      same here (it fuses `plif_log_likelihood`'s backward tile, see
      `fused_ll_gradient`).

    `O(idx.size)` time (the sorted path `O(idx.size log idx.size)`),
    `O(num_knots)` memory per weight tensor beyond the paths' buffers.

    Args:
        idx: int32 tensor of any shape, values in `[0, num_knots)`.
        weights: tuple of float tensors of the shape of `idx`.
        num_knots: int, the number of intervals `K` (static).
        method: None, or one of `HISTOGRAM_METHODS`.

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
    >>> [ops.convert_to_numpy(h).tolist()
    ...  for h in functional.knot_histogram(idx, (w,), 4, method="sorted")]
    [[1.0, 4.0, 5.0, 0.0]]
    """
    if method is None:
        method = histogram_method()
    method = check_choice("method", method, HISTOGRAM_METHODS)
    if method == "scatter" and sharded_scatter():
        import jax.numpy as jnp

        return tuple(jnp.zeros((num_knots,), w.dtype).at[idx].add(w) for w in weights)
    idx = ops.reshape(idx, [-1])
    weights = [ops.reshape(w, [-1]) for w in weights]
    if method == "sorted":
        return sorted_knot_histogram(idx, weights, num_knots)
    if method == "spread":
        return spread_knot_histogram(idx, weights, num_knots)
    if method in ("pallas", "pallas_fused"):
        if keras.backend.backend() != "jax":
            raise ValueError(
                f"`method={method!r}` needs the JAX backend. "
                f"Received: backend={keras.backend.backend()}"
            )
        platforms.require_pallas_triton("method", method, "'scatter' and 'sorted'")
        from keras_softmax_heads.functional.plif_pallas import pallas_knot_histogram

        sums = pallas_knot_histogram(idx, weights, num_knots)
        return tuple(ops.cast(h, w.dtype) for h, w in zip(sums, weights))
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tuple(
            tf.raw_ops.DenseBincount(
                input=idx, size=num_knots, weights=w, binary_output=False
            )
            for w in weights
        )
    return tuple(segment_sum(w, idx, num_knots) for w in weights)


def uses_fused_ll_gradient(dtype):
    """Whether `plif_log_likelihood`'s backward tile runs as one Pallas
    kernel (`fused_ll_gradient`): the `"pallas_fused"` method
    (`histogram_method()`), the JAX backend and float32 scores."""
    return (
        histogram_method() == "pallas_fused"
        and keras.backend.backend() == "jax"
        and keras.backend.standardize_dtype(dtype) == "float32"
    )


def fused_ll_gradient(z, targets, upstream, lse, slopes, left_values, knot_bound):
    """`plif_log_likelihood`'s backward tile in one Pallas kernel (JAX):
    `(dL/dz [n, V], (A [K], B [K]))` from the scores `z` `[n, V]`, the
    rows' targets, cotangents `upstream` and `lse` `[n]`, and the `[K]`
    tables (`plif_pallas.pallas_ll_gradient`; the `keras.ops` tile of
    `plif_kernels` is its reference)."""
    platforms.require_pallas_triton("HISTOGRAM_METHOD", "pallas_fused",
                                    "'scatter' and 'sorted'")
    from keras_softmax_heads.functional.plif_pallas import pallas_ll_gradient

    return pallas_ll_gradient(z, targets, upstream, lse, slopes, left_values, knot_bound)


def uses_torch_tiles(*tensors):
    """Whether the tiles of `plif` and `plif_log_likelihood`, and
    `plif_scores`, run as `plif_torch`'s in-place functions
    (`torch_tiled_kernel`, `torch_plif_scores`): the
    PyTorch backend, the `"scatter"` histogram method (the platform's
    choice on PyTorch; a forced `"sorted"` / `"spread"` keeps the
    `keras.ops` tile), float32 / float64 scores and no tensor recorded by
    autograd (PLIF's custom gradient runs its tiles on detached tensors)."""
    if keras.backend.backend() != "torch" or histogram_method() != "scatter":
        return False
    import torch

    if tensors[0].dtype not in (torch.float32, torch.float64):
        return False
    return not (torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors))


def torch_tiled_kernel(name):
    """The PyTorch loop over tiles of one of PLIF's tiled kernels, in place
    (`plif_torch`; the `keras.ops` tiles of `plif_kernels` are its
    reference): `"log_likelihood"` and `"log_likelihood_gradient"`
    (`plif_log_likelihood`), `"plif"` and `"plif_gradient"` (`plif`)."""
    from keras_softmax_heads.functional import plif_torch

    if name not in ("log_likelihood", "log_likelihood_gradient", "plif", "plif_gradient"):
        raise ValueError(f"Unknown PLIF kernel. Received: name={name!r}")
    return getattr(plif_torch, name)


def torch_plif_scores(z, slopes, left_values, knot_bound):
    """`plif_scores` on PyTorch, in place (`plif_torch.scores`; the
    `keras.ops` formulas of `plif_kernels` are its reference): `(f, slope,
    idx, offset)` of the scores `z`."""
    from keras_softmax_heads.functional.plif_torch import scores

    return scores(z, slopes, left_values, knot_bound)


def sorted_knot_histogram(idx, weights, num_knots):
    """`knot_histogram` without a scatter: sort, segmented scan, gather.

    The scores are sorted by interval (`ops.argsort` of `idx`, the weights
    gathered in that order); a segmented inclusive sum
    (`ops.associative_scan` of `(starts a segment, weight)` pairs, restarted
    at every change of index) leaves each interval's sum at its last sorted
    position; `ops.searchsorted` of `0..K-1` finds those positions, and one
    gather of `K` values reads them (0 for empty intervals). Every sum runs
    over its own interval's weights only (no difference of running sums,
    so no cancellation): float32-exact like a scatter-add. Static shapes:
    `[idx.size]` and `[K]`. Plain `keras.ops`, on every backend; on
    accelerators the sort replaces the contended atomic updates of a
    scatter-add.

    Args:
        idx: int32 tensor of any shape, values in `[0, num_knots)`.
        weights: tuple of float tensors of the shape of `idx`.
        num_knots: int, the number of intervals `K` (static).

    Returns:
        A tuple of `[K]` tensors, one per weight tensor, in its dtype.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads.functional.dispatch import sorted_knot_histogram
    >>> idx = np.array([0, 2, 2, 1], "int32")
    >>> w = np.array([1.0, 2.0, 3.0, 4.0], "float32")
    >>> [ops.convert_to_numpy(h).tolist() for h in sorted_knot_histogram(idx, (w,), 4)]
    [[1.0, 4.0, 5.0, 0.0]]
    """
    idx = ops.reshape(ops.cast(idx, "int32"), [-1])
    weights = [ops.reshape(w, [-1]) for w in weights]
    if idx.shape[0] == 0:
        return tuple(ops.zeros([num_knots], w.dtype) for w in weights)
    order = ops.argsort(idx)
    keys = ops.take(idx, order)
    values = tuple(ops.take(w, order) for w in weights)
    # int32 flags: PyTorch's `associative_scan` cannot interleave bools.
    starts = ops.concatenate(
        [ops.ones([1], "int32"), ops.cast(ops.not_equal(keys[1:], keys[:-1]), "int32")],
        axis=0,
    )

    sums = _segmented_sums(starts, values)
    bins = ops.arange(num_knots, dtype="int32")
    ends = ops.cast(ops.searchsorted(keys, bins, side="right"), "int32")
    begins = ops.cast(ops.searchsorted(keys, bins, side="left"), "int32")
    last = ops.maximum(ends - 1, 0)
    return tuple(
        ops.where(ends > begins, ops.take(s, last), ops.zeros_like(s[:1])) for s in sums
    )


def spread_copies(num_knots, size, copies=None):
    """The number of histogram copies `spread_knot_histogram` takes:
    `copies` when given (checked), else the largest power of two with
    `copies * num_knots <= SPREAD_BUFFER_ELEMENTS`, at most
    `SPREAD_MAX_COPIES`; never more than the `size` scores (at least 1).

    >>> spread_copies(1000, 10**6), spread_copies(100_000, 10**6), spread_copies(1000, 5)
    (256, 8, 4)
    """
    num_knots = check_int("num_knots", num_knots, minimum=1)
    if copies is None:
        fits = max(1, min(SPREAD_MAX_COPIES, SPREAD_BUFFER_ELEMENTS // num_knots, size))
        return 1 << (fits.bit_length() - 1)
    copies = check_int("copies", copies, minimum=1)
    if copies * num_knots >= 2**31:
        raise ValueError(
            "`copies * num_knots` must fit int32 indices. Received: "
            f"copies={copies}, num_knots={num_knots}"
        )
    return copies


def spread_knot_histogram(idx, weights, num_knots, copies=None):
    """`knot_histogram` by a scatter-add into interleaved copies.

    Score `m` adds its weight to copy `m mod C` of `C` histograms (a
    `[C, K]` buffer, bin `(m mod C) K + idx[m]`), and the copies are summed:
    `out[k] = sum_c sum_{m = c mod C, idx[m] = k} w[m]`. Neighbouring
    scores, which a GPU hands to neighbouring threads of one warp, then
    never update one address, and a hot bin's updates are spread over `C`
    addresses: the collisions that make a GPU's atomic scatter-add slow
    when most scores fall into a few bins (few knots) are divided by `C`.
    The copies cost a `[C, K]` zero-fill and reduction
    (`spread_copies`: `C K` at most `SPREAD_BUFFER_ELEMENTS` by default).
    Each copy sums a `C`-th of a bin's weights in its own chain, so its
    float32 sums are more exact than a serial scatter's (`docs/plif.md`).
    Plain `keras.ops` (`segment_sum`), every backend, static shapes. On a CPU, whose scatter-add is a serial loop, it is no
    faster (`docs/plif.md`); on a GPU it is the `"spread"` method of
    `benchmarks/bench_plif_histogram.py` and the `_spread` rows of
    `benchmarks/bench_device_heads.py`.

    Args:
        idx: int32 tensor of any shape, values in `[0, num_knots)`.
        weights: tuple of float tensors of the shape of `idx`.
        num_knots: int, the number of intervals `K` (static).
        copies: int, the number of copies `C` (default: `spread_copies`).

    Returns:
        A tuple of `[K]` tensors, one per weight tensor, in its dtype.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads.functional.dispatch import spread_knot_histogram
    >>> idx = np.array([0, 2, 2, 1, 2], "int32")
    >>> w = np.array([1.0, 2.0, 3.0, 4.0, 5.0], "float32")
    >>> [ops.convert_to_numpy(h).tolist()
    ...  for h in spread_knot_histogram(idx, (w,), 4, copies=2)]
    [[1.0, 4.0, 10.0, 0.0]]
    """
    idx = ops.reshape(ops.cast(idx, "int32"), [-1])
    weights = [ops.reshape(w, [-1]) for w in weights]
    size = idx.shape[0]
    if size is None:
        raise ValueError("`spread_knot_histogram` needs a static number of scores.")
    copies = spread_copies(num_knots, size, copies)
    if size == 0:
        return tuple(ops.zeros([num_knots], w.dtype) for w in weights)
    if copies == 1:
        return tuple(segment_sum(w, idx, num_knots) for w in weights)
    lane = ops.mod(ops.arange(size, dtype="int32"), copies)
    ids = lane * num_knots + idx
    return tuple(
        ops.sum(ops.reshape(segment_sum(w, ids, copies * num_knots), [copies, num_knots]),
                axis=0)
        for w in weights
    )


def _segmented_sums(starts, values):
    """Inclusive sums of `values` restarted where `starts` is 1.

    `ops.associative_scan` of `(start, value)` pairs (`O(n)` work,
    `O(log n)` depth), except on TensorFlow, where Keras' `associative_scan`
    does not compile under XLA (both branches of its `tf.cond` on odd
    lengths are compiled, one with mismatched shapes): there a
    Hillis-Steele scan of `ceil(log2 n)` shifted passes (`O(n log n)`).
    """
    if keras.backend.backend() != "tensorflow":

        def combine(left, right):
            # A segment start drops what came before it.
            restart = ops.greater(right[0], 0)
            return (ops.maximum(left[0], right[0]),) + tuple(
                ops.where(restart, b, a + b) for a, b in zip(left[1:], right[1:])
            )

        return ops.associative_scan(combine, (starts, *values))[1:]
    size = starts.shape[0]
    shift = 1
    values = list(values)
    while shift < size:
        # Element i holds the sum over (i - shift, i] cut at a segment start.
        keep = ops.greater(starts, 0)
        values = [
            ops.where(keep, v, v + ops.pad(v[:-shift], [[shift, 0]])) for v in values
        ]
        starts = ops.maximum(starts, ops.pad(starts[:-shift], [[shift, 0]], constant_values=1))
        shift *= 2
    return tuple(values)


def lookup(table, idx):
    """`table[idx]` for int32 indices known to be in range.

    `ops.take` on JAX; on TensorFlow `tf.gather`, which skips the pass over
    `idx` that Keras' `take` adds for negative indices (measured on a
    graph-mode `plif_log_likelihood` step, see `docs/plif.md`); on PyTorch
    `torch.index_select` of the int32 indices as they are, where Keras'
    `take` also converts them to int64 and masks them with `where` (three
    passes over a PLIF tile's indices for each of its lookups).

    >>> import numpy as np
    >>> from keras import ops
    >>> table = np.array([10.0, 20.0, 30.0], "float32")
    >>> ops.convert_to_numpy(lookup(table, np.array([[2, 0]], "int32"))).tolist()
    [[30.0, 10.0]]
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.gather(table, idx)
    if backend == "torch":
        import torch

        table = ops.convert_to_tensor(table)
        idx = _torch_indices(idx)
        rows = torch.index_select(table, 0, idx.reshape(-1))
        return rows.reshape(tuple(idx.shape) + tuple(table.shape[1:]))
    return ops.take(table, idx, axis=0)


def clip(x, low, high):
    """`ops.clip(x, low, high)` with Python-number bounds, for the per-score
    passes of PLIF and the tabulated functions (their interval index): on
    PyTorch `torch.clamp` with the numbers (Keras' PyTorch `clip` turns the
    bounds into tensors, and `torch.clip` with tensor bounds took 5x the
    time of `torch.clamp` on a CPU: 460 against 92 us for 320,000 float32
    scores, `docs/plif.md`), `ops.clip` elsewhere (and for tensor bounds).

    >>> import numpy as np
    >>> from keras import ops
    >>> ops.convert_to_numpy(clip(np.array([-1.0, 0.5, 3.0], "float32"), 0.0, 1.0)).tolist()
    [0.0, 0.5, 1.0]
    """
    numbers = all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (low, high))
    if keras.backend.backend() == "torch" and numbers:
        import torch

        x = ops.convert_to_tensor(x)
        if x.dtype != torch.bool:
            return torch.clamp(x, low, high)
    return ops.clip(x, low, high)


def softmax_score_gradient(f, lse, targets, upstream):
    """`upstream[:, None] * (onehot(targets) - exp(f - lse[:, None]))`, the
    gradient of `upstream * log_softmax(f)[targets]` with respect to the
    scores `f` `[rows, V]` (`lse` `[rows]` their log-normaliser, `targets`
    `[rows]` int ids in `[0, V)`, not checked).

    On PyTorch, outside a recorded graph: the exponentials scaled in place
    and the targets' terms added by one `scatter_add_`
    (`plif_torch.softmax_gradient_`, which PyTorch's in-place row tiles
    also use; here for the `keras.ops` tile, e.g. with a forced
    `"sorted"` histogram) (Keras' PyTorch
    `one_hot` writes an int64 `[rows, V]` tensor, masks it with `where` and
    converts it: three passes of 8-byte elements a tile). Elsewhere the
    `keras.ops` formula, which XLA fuses into the pass that uses it.

    >>> import numpy as np
    >>> from keras import ops
    >>> f = np.log(np.array([[1.0, 3.0], [2.0, 2.0]], "float32"))
    >>> lse = np.log(np.array([4.0, 4.0], "float32"))
    >>> out = softmax_score_gradient(f, lse, np.array([1, 0], "int32"), np.array([1.0, 2.0], "float32"))
    >>> np.round(ops.convert_to_numpy(out), 6).tolist()
    [[-0.25, 0.25], [1.0, -1.0]]
    """
    if keras.backend.backend() == "torch":
        import torch

        f, lse, upstream = (ops.convert_to_tensor(x) for x in (f, lse, upstream))
        if not (torch.is_grad_enabled() and any(x.requires_grad for x in (f, lse, upstream))):
            from keras_softmax_heads.functional.plif_torch import softmax_gradient_

            # `f - lse` is a fresh tensor of our own.
            return softmax_gradient_(f - lse[:, None], ops.convert_to_tensor(targets), upstream)
    one_hot = ops.one_hot(targets, f.shape[-1], dtype=keras.backend.standardize_dtype(f.dtype))
    return (one_hot - ops.exp(f - lse[:, None])) * upstream[:, None]


def cumsum(x, axis=0):
    """`ops.cumsum(x, axis)` in `x`'s dtype: on PyTorch `torch.cumsum`
    (Keras' PyTorch `cumsum` sums float64 in float32), `ops.cumsum`
    elsewhere."""
    if keras.backend.backend() == "torch":
        import torch

        x = ops.convert_to_tensor(x)
        return torch.cumsum(x, dim=axis)
    return ops.cumsum(x, axis=axis)


def segment_sum(data, segment_ids, num_segments):
    """`ops.segment_sum(data, segment_ids, num_segments=num_segments)` in
    `data`'s dtype. On PyTorch one `index_add_` into a zero buffer (int32
    ids as they are; float16 / bfloat16 summed in float32): Keras' PyTorch
    `segment_sum` sums float64 in float32 (`data.float()`), and its copies
    of the ids (repeated, int64, two `where` passes) and of the data made it
    3-4x slower than `index_add_` on a CPU for the knot histogram's tiles
    (`docs/plif.md`). `ops.segment_sum` elsewhere. The ids must lie in `[0,
    num_segments)` (TensorFlow and `index_add_` refuse others).

    >>> import numpy as np
    >>> from keras import ops
    >>> out = segment_sum(np.array([1.0, 2.0, 3.0], "float32"), np.array([0, 2, 0], "int32"), 3)
    >>> ops.convert_to_numpy(out).tolist()
    [4.0, 0.0, 2.0]
    """
    if keras.backend.backend() != "torch":
        return ops.segment_sum(data, segment_ids, num_segments=num_segments)
    import torch

    data = ops.convert_to_tensor(data)
    ids = _torch_indices(segment_ids)
    acc = torch.float32 if data.dtype in (torch.float16, torch.bfloat16) else data.dtype
    out = torch.zeros((num_segments,) + tuple(data.shape[1:]), dtype=acc, device=data.device)
    return out.index_add_(0, ids, data.to(acc)).to(data.dtype)


def segment_max(data, segment_ids, num_segments):
    """`ops.segment_max(data, segment_ids, num_segments=num_segments)`. On
    PyTorch one `scatter_reduce_("amax")` of the rows into a `-inf` buffer
    (an empty segment is `-inf`, as on JAX): Keras' PyTorch `segment_max`
    copies the ids once per element of a row (`repeat_interleave`, int64), a
    data-dependent shape that also breaks a `torch.compile` graph.
    `ops.segment_max` elsewhere. The ids must lie in `[0, num_segments)`.

    >>> import numpy as np
    >>> from keras import ops
    >>> data = np.array([[1.0, 5.0], [3.0, 2.0], [0.5, 0.5]], "float32")
    >>> out = segment_max(data, np.array([1, 1, 0], "int32"), 2)
    >>> ops.convert_to_numpy(out).tolist()
    [[0.5, 0.5], [3.0, 5.0]]
    """
    if keras.backend.backend() != "torch":
        return ops.segment_max(data, segment_ids, num_segments=num_segments)
    import torch

    data = ops.convert_to_tensor(data)
    ids = _torch_indices(segment_ids).long()
    index = ids.reshape((-1,) + (1,) * (data.dim() - 1)).expand_as(data)
    out = torch.full((num_segments,) + tuple(data.shape[1:]), float("-inf"),
                     dtype=data.dtype, device=data.device)
    return out.scatter_reduce_(0, index, data, reduce="amax", include_self=True)


def scatter(indices, values, shape):
    """`ops.scatter(indices, values, shape)`: `values` added into zeros of
    `shape` at `indices` (`[..., k]`, the first `k` axes), duplicates
    summed. On PyTorch one `index_put_(accumulate=True)`: Keras' PyTorch
    `scatter` adds one index at a time in a Python loop (a few
    microseconds each, and a `torch.compile` graph break each).
    `ops.scatter` elsewhere.

    >>> import numpy as np
    >>> from keras import ops
    >>> out = scatter(np.array([[2], [0], [2]], "int32"), np.array([1.0, 2.0, 3.0], "float32"), (4,))
    >>> ops.convert_to_numpy(out).tolist()
    [2.0, 0.0, 4.0, 0.0]
    """
    if keras.backend.backend() != "torch":
        return ops.scatter(indices, values, shape)
    import torch

    indices = ops.convert_to_tensor(indices)
    values = ops.convert_to_tensor(values)
    shape = tuple(int(d) for d in shape)
    depth = indices.shape[-1]
    flat = indices.reshape(-1, depth).long()
    values = values.reshape((flat.shape[0],) + shape[depth:])
    out = torch.zeros(shape, dtype=values.dtype, device=values.device)
    return out.index_put_(tuple(flat.unbind(-1)), values, accumulate=True)


def _torch_indices(x):
    """`x` as a PyTorch index tensor: int32 and int64 as they are (PyTorch's
    `index_select` and `index_add_` take both), other dtypes as int64."""
    import torch

    x = ops.convert_to_tensor(x)
    return x if x.dtype in (torch.int32, torch.int64) else x.long()


def upstream_gradient(args, upstream):
    """The upstream gradient of an `ops.custom_gradient` gradient function
    `grad(*args, upstream=None)` (positional on TensorFlow / JAX, keyword on
    PyTorch)."""
    return args[-1] if upstream is None else upstream


_EXPORTABLE = threading.local()


@contextlib.contextmanager
def exportable_graph():
    """A context in which `xla_in_graph` adds no nested XLA function.

    Inside it, `xla_in_graph(fn, *args)` is `fn(*args)` on every backend, so
    a TensorFlow graph traced there holds plain ops only. Tools that convert
    a graph op by op cannot inline a function marked for XLA compilation:
    `model.export(format="onnx")` (tf2onnx) left it as an invalid
    `PartitionedCall` node. The heads trace their inference call
    (`training` falsy: `predict`, `evaluate`, `model.export`) in this
    context; their training losses keep the compiled kernels.

    >>> from keras import ops
    >>> with exportable_graph():
    ...     float(xla_in_graph(lambda x: ops.sum(x), ops.ones(3)))
    3.0
    """
    depth = getattr(_EXPORTABLE, "depth", 0)
    _EXPORTABLE.depth = depth + 1
    try:
        yield
    finally:
        _EXPORTABLE.depth = depth


def xla_in_graph(fn, *args):
    """`fn(*args)`, compiled with XLA where TensorFlow would run it op by op.

    On TensorFlow inside a graph (a `tf.function`: Keras' train, test and
    predict steps, which Keras' `jit_compile="auto"` runs without XLA on a
    CPU), `fn(*args)` runs as a nested `tf.function(jit_compile=True)`.
    XLA then fuses the elementwise passes over the `[N, V]` scores of PLIF
    and of the monotonic MLP (interval index, lookups, recomputation, the
    histograms' weights), which TensorFlow's executor runs one kernel and
    one `[N, V]` buffer each (what that costs and saves: `docs/plif.md`,
    "Without XLA"). Under an enclosing `jit_compile=True` the call is
    simply part of that program. Eagerly, and on the other backends (JAX
    compiles under `jit` anyway, PyTorch has no XLA), `fn(*args)` as is.

    Call it inside a custom gradient, once for the forward pass and once
    for the backward pass: TensorFlow would differentiate a compiled call
    by making the intermediates its gradient reads extra outputs of the
    call, `[N, V]` buffers held until the backward pass.

    `fn` must compile with XLA on static or dynamic shapes (no
    data-dependent shapes); its Python arguments (ints, floats, None) are
    constants of the compiled program. It may return nested tuples, lists
    and None. Inside `exportable_graph()`, `fn(*args)` as is.

    >>> from keras import ops
    >>> float(xla_in_graph(lambda x, y: ops.sum(x * y), ops.ones(3), 2.0))
    6.0
    """
    if keras.backend.backend() != "tensorflow" or getattr(_EXPORTABLE, "depth", 0):
        return fn(*args)
    import tensorflow as tf

    if tf.executing_eagerly():
        return fn(*args)

    def call():
        return fn(*args)

    call.__name__ = getattr(fn, "__name__", "call")  # the compiled function's name
    return tf.function(call, jit_compile=True, autograph=False)()
