"""Sigsoftmax and the other output functions of Kanai et al. (2018)."""

import math
import numbers

import keras

from keras_softmax_heads import functional
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead

OUTPUT_FUNCTIONS = ("sigsoftmax", "sigmoid", "relu")


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class SigSoftmax(PointwiseSoftmaxHead):
    """Sigsoftmax output head (Kanai et al., 2018), and its g:sigmoid / g:ReLU
    siblings.

    The output function of Kanai et al. (eq. 9) normalises a non-negative
    pointwise `g` of the linear scores `z = h W + b`:

    `p(w | h) = g(z_w) / sum_v g(z_v)`, computed as
    `log p = log_softmax(log g(z))`, in float32 and in log space:

    * `output_fn="sigsoftmax"` (eq. 11): `g(z) = exp(z) sigmoid(z)`,
      `log g(z) = z - softplus(-z)` (`= 2z - softplus(z)`, eq. 12). Breaks
      the softmax bottleneck (`log g` is non-linear) and keeps softmax's
      numerical stability and monotonicity.
    * `output_fn="sigmoid"`: `g(z) = sigmoid(z)`, `log g(z) = -softplus(-z)`.
      Stable, but `g <= 1` bounds the ratio of any two probabilities by
      `1 / sigmoid(min z)`; the paper finds it below softmax on WikiText-2.
    * `output_fn="relu"`: `g(z) = ReLU(z) + epsilon`. With `epsilon = 0` this
      is the paper's g:ReLU, which divides by zero when all scores of a row
      are non-positive and has an unbounded gradient of `log g` (the
      paper's "numerically unstable": perplexities in the thousands, table
      1). Here `epsilon > 0` (default `1e-6`) keeps every log-probability
      finite: a row whose scores are all `<= 0` gives the uniform
      distribution, and `d log g / dz = 1 / (z + epsilon)` stays bounded by
      `1 / epsilon`. Expect it to train worse than the other two.

    Args:
        vocab_size: int, number of words `V` (or omit and pass
            `token_embedding`).
        output_fn: one of `"sigsoftmax"` (default), `"sigmoid"`, `"relu"`.
        epsilon: float > 0, the constant added to `ReLU(z)` for
            `output_fn="relu"` (ignored otherwise).
        token_embedding: optional `keras.layers.Embedding` `[V, d]` to tie
            the output projection to.
        use_bias: bool, add a per-word bias (default `True`).
        kernel_initializer, bias_initializer: initializers.
        return_probabilities: bool, `call` returns probabilities.
        chunk_size: optional int, exact chunked loss over vocabulary tiles
            (see `PointwiseSoftmaxHead`).

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 log-probabilities `[..., V]`.

    Example:

    >>> import keras, numpy as np
    >>> from keras_softmax_heads.heads.sig_softmax import SigSoftmax
    >>> head = SigSoftmax(vocab_size=7)
    >>> log_p = keras.ops.convert_to_numpy(head(np.random.rand(2, 3, 4).astype("float32")))
    >>> tuple(log_p.shape)
    (2, 3, 7)
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True
    >>> relu = SigSoftmax(vocab_size=3, output_fn="relu", use_bias=False)
    >>> relu.build((None, 2))
    >>> relu.set_weights([np.ones((2, 3), "float32")])
    >>> log_p = keras.ops.convert_to_numpy(relu(-np.ones((1, 2), "float32")))
    >>> np.round(np.exp(log_p), 3)  # all z < 0
    array([[0.333, 0.333, 0.333]], dtype=float32)

    References:
        - Kanai, Fujiwara, Yamanaka, Adachi. Sigsoftmax: Reanalysis of the
          Softmax Bottleneck. NeurIPS 2018. https://arxiv.org/abs/1805.10829
    """

    def __init__(self, vocab_size=None, output_fn="sigsoftmax", epsilon=1e-6, **kwargs):
        if output_fn not in OUTPUT_FUNCTIONS:
            raise ValueError(
                f"`output_fn` must be one of {OUTPUT_FUNCTIONS}. "
                f"Received: output_fn={output_fn!r}"
            )
        is_number = isinstance(epsilon, numbers.Real) and not isinstance(epsilon, bool)
        if not is_number or not math.isfinite(epsilon) or epsilon <= 0:
            raise ValueError(
                "`epsilon` must be a finite number > 0. "
                f"Received: epsilon={epsilon!r}"
            )
        super().__init__(vocab_size, **kwargs)
        self.output_fn = output_fn
        self.epsilon = float(epsilon)

    def score_transform(self, z):
        """`log g(z)`: the log of the chosen non-negative output function."""
        if self.output_fn == "sigsoftmax":
            return functional.log_sigmoid_scores(z)
        if self.output_fn == "sigmoid":
            return functional.log_sigmoid_output_scores(z)
        return functional.log_relu_output_scores(z, self.epsilon)

    def get_config(self):
        config = super().get_config()
        config.update({"output_fn": self.output_fn, "epsilon": self.epsilon})
        return config
