"""Output functions in log space: soft-capping and the sigsoftmax family.

Pure `keras.ops` functions of the linear scores `z`, for any backend. The
heads apply them before `log_softmax` (`FullSoftmax`'s soft cap,
`SigSoftmax`, the MoSS components and priors).
"""

from keras import ops


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
