"""Pure functions shared by the heads: output functions in log space and PLIF.

Everything here works on float32 (or float64) tensors and is written with
`keras.ops`; the heads call these functions on their linear scores `z`.
"""

import math

from keras import ops


def log_sigmoid_scores(z):
    """`log(exp(z) * sigmoid(z)) = z - softplus(-z)`, stable for any |z|."""
    return z - ops.softplus(-z)


def log_sigsoftmax(z, axis=-1):
    """Log of sigsoftmax (Kanai et al. 2018, eq. 13), in log space.

    `sigsoftmax(z)_i = exp(z_i) sigmoid(z_i) / sum_j exp(z_j) sigmoid(z_j)`,
    so `log sigsoftmax(z) = log_softmax(z - softplus(-z))`.
    """
    return ops.log_softmax(log_sigmoid_scores(z), axis=axis)


def plif_identity_raw_slope():
    """The raw slope `v` with `softplus(v) = 1` (identity initialisation)."""
    return math.log(math.e - 1.0)


def plif(z, raw_slopes, knot_bound):
    """Piecewise linear increasing function (Ganea et al. 2019, section 4).

    `K = len(raw_slopes)` intervals of width `2T/K` cover `[-T, T]`;
    interval `i` has slope `s_i = softplus(raw_slopes[i]) > 0`. The function is
    continuous: `f(l_i) = -T + (2T/K) sum_{j<i} s_j` (a cumulative sum), and
    `f(x) = f(l_i) + s_i (x - l_i)` on interval `i = floor((x + T) K / 2T)`,
    clipped to `[0, K-1]`, so outside `[-T, T]` the first/last piece extends
    linearly (still increasing). With all `s_i = 1`, `f(x) = x`.

    Args:
        z: float tensor of any shape.
        raw_slopes: float tensor `[K]`, the unconstrained slope parameters.
        knot_bound: float `T > 0`.

    Returns:
        `f(z)`, same shape and dtype as `z`.
    """
    num_intervals = ops.shape(raw_slopes)[0]
    slopes = ops.cast(ops.softplus(raw_slopes), z.dtype)
    width = 2.0 * knot_bound / num_intervals
    # f at the left knot of every interval.
    left_values = -knot_bound + width * (ops.cumsum(slopes) - slopes)
    idx = ops.floor((z + knot_bound) / width)
    idx = ops.cast(ops.clip(idx, 0, num_intervals - 1), "int32")
    left_knot = -knot_bound + width * ops.cast(idx, z.dtype)
    return ops.take(left_values, idx) + ops.take(slopes, idx) * (z - left_knot)
