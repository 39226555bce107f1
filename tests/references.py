"""NumPy reference implementations shared by the tests (float64 oracles).

Written from the papers' definitions, independently of the library, so a test
compares the library against them. Import them like `battery`::

    from references import numpy_log_softmax

Head-specific references (a mixture in probability space, the hierarchical
tree, the differentiated bands, ...) stay in their test modules; what is here
is used by more than one of them.
"""

import numpy as np


def numpy_log_softmax(z, mask=None):
    """`log_softmax` over the last axis in float64; `mask` (bool, broadcast
    to `z`) keeps only the `True` entries (the others get `-inf`)."""
    z = np.asarray(z).astype("float64")
    if mask is not None:
        z = np.where(mask, z, -np.inf)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def softplus(x):
    """`log(1 + exp(x))`, stable for any `x`."""
    return np.logaddexp(0.0, x)


def numpy_log_sigmoid(x):
    """`log sigmoid(x) = -softplus(-x)`."""
    return -np.logaddexp(0.0, -x)


def numpy_plif(z, raw_slopes, knot_bound):
    """PLIF, section 4 of Ganea et al. 2019, in float64: `K` intervals of
    width `2T / K` on `[-T, T]`, slopes `softplus(raw_slopes)`, the first /
    last piece extended outside `[-T, T]`."""
    z = np.asarray(z, "float64")
    num_knots = len(raw_slopes)
    width = 2.0 * knot_bound / num_knots
    slopes = softplus(np.asarray(raw_slopes, "float64"))
    left = -knot_bound + width * np.concatenate([[0.0], np.cumsum(slopes)[:-1]])
    idx = np.clip(np.floor((z + knot_bound) / width), 0, num_knots - 1).astype(int)
    return left[idx] + slopes[idx] * (z - (-knot_bound + width * idx))


def numpy_word_major_scores(head, h):
    """`z = h W^T + b` in float64 for a head with a word-major `kernel`
    `[V, d]` and a `bias` `[V]` (sampled, NCE, self-normalised)."""
    words = head.kernel.numpy().astype("float64")
    return np.asarray(h).astype("float64") @ words.T + head.bias.numpy()
