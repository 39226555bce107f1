"""A function given by its values on a uniform grid, interpolated linearly.

`interpolate_table` evaluates a tabulated function at every score with one
lookup, and differentiates it to the table with a weighted histogram;
`MonotonicSoftmax` (`grid_size`) uses it.
"""

from keras import ops

from keras_softmax_heads.functional.dispatch import clip
from keras_softmax_heads.functional.dispatch import knot_histogram
from keras_softmax_heads.functional.dispatch import lookup
from keras_softmax_heads.functional.dispatch import upstream_gradient
from keras_softmax_heads.functional.dispatch import xla_in_graph


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
    are constants of the grid: they get no gradient. In a TensorFlow graph
    run without XLA both passes are compiled with XLA all the same
    (`dispatch.xla_in_graph`).

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
    step = ops.stop_gradient(ops.cast(width, z.dtype)) / (num - 1)
    lo = ops.stop_gradient(ops.cast(lo, z.dtype))

    def forward(z, table, lo, step):
        pos = (z - lo) / step
        idx = ops.cast(clip(ops.floor(pos), 0, num - 2), "int32")
        frac = pos - ops.cast(idx, z.dtype)
        left = lookup(table, idx)
        rise = lookup(table, idx + 1) - left
        return idx, frac, rise, left + rise * frac

    # `lo` and `step` are arguments, not closed over: a custom gradient that
    # closes over a tensor of the enclosing computation cannot be exported
    # (jax2tf, `model.export` on JAX).
    @ops.custom_gradient
    def interpolate(z, table, lo, step):
        idx, frac, rise, out = xla_in_graph(forward, ops.stop_gradient(z), table, lo, step)

        def grad(*args, upstream=None):
            upstream = ops.cast(upstream_gradient(args, upstream), z.dtype)

            def backward():
                d_z = upstream * rise / step
                w_right = upstream * frac
                at_left, at_right = knot_histogram(idx, (upstream - w_right, w_right), num - 1)
                zero = ops.zeros((1,), z.dtype)
                d_table = ops.concatenate([at_left, zero]) + ops.concatenate([zero, at_right])
                return d_z, d_table, ops.zeros_like(lo), ops.zeros_like(step)

            return xla_in_graph(backward)

        return out, grad

    return interpolate(z, table, lo, step)
