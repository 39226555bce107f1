"""The backend-specific code of `functional`: one dispatch function each.

Every other module of the package is `keras.ops` code. These functions
branch on `keras.backend.backend()` and import TensorFlow only in their
TensorFlow branch, where TensorFlow has a faster kernel or Keras' generic op
does not fit; the other backends take the `keras.ops` path. A new
backend-specific fast path of a `functional` kernel goes here, as one more
dispatch function tested against its `keras.ops` path.

* `scan_tiles`: a loop over tiles with one iteration in flight
  (`tf.while_loop` + `TensorArray` on TensorFlow, `ops.scan` elsewhere);
* `knot_histogram`: per-interval sums of weights (`DenseBincount` on
  TensorFlow, `ops.segment_sum` elsewhere);
* `lookup`: `table[idx]` for indices known to be in range (`tf.gather` on
  TensorFlow, `ops.take` elsewhere);
* `upstream_gradient`: the upstream gradient inside an
  `ops.custom_gradient` gradient function (positional on TensorFlow and
  JAX, keyword on PyTorch).
"""

import keras
from keras import ops


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


def knot_histogram(idx, weights, num_knots):
    """Per-interval sums of weights: `out[i] = sum of w where idx == i`.

    The slopes' gradient of PLIF: TensorFlow uses `DenseBincount`
    (multi-threaded partial histograms on CPU, much faster there than
    `unsorted_segment_sum`; a scatter-add under XLA), the other backends
    `ops.segment_sum` (a scatter-add; `jax.ops.segment_sum` under JAX).
    `O(idx.size)` time, `O(num_knots)` memory per weight tensor.

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


def lookup(table, idx):
    """`table[idx]` for int32 indices known to be in range.

    `ops.take`, except on TensorFlow: `tf.gather` there, which skips the
    pass over `idx` that Keras' `take` adds for negative indices (measured
    on a graph-mode `plif_log_likelihood` step, see `docs/plif.md`).
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.gather(table, idx)
    return ops.take(table, idx)


def upstream_gradient(args, upstream):
    """The upstream gradient of an `ops.custom_gradient` gradient function
    `grad(*args, upstream=None)` (positional on TensorFlow / JAX, keyword on
    PyTorch)."""
    return args[-1] if upstream is None else upstream
