"""Linear-Softmax: the baseline head."""

import keras
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class FullSoftmax(PointwiseSoftmaxHead):
    """Linear-Softmax output head.

    `log p(w | h) = z_w - logsumexp(z)` with `z = h W + b`, computed in
    float32 with `log_softmax` (never `log(softmax)`).

    Args:
        vocab_size: int, number of words `V` (or omit and pass
            `token_embedding`).
        token_embedding: optional `keras.layers.Embedding` of shape `[V, d]`
            to tie the output projection to.
        use_bias: bool, add a per-word bias (default `True`).
        kernel_initializer, bias_initializer: initializers.
        return_probabilities: bool, `call` returns probabilities instead of
            log-probabilities.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 log-probabilities `[..., V]` (`logsumexp` over the last axis
        is 0).

    Example:

    >>> import numpy as np, keras_softmax_heads as ksh
    >>> head = ksh.FullSoftmax(vocab_size=7)
    >>> log_p = head(np.random.rand(2, 3, 4).astype("float32"))
    >>> tuple(log_p.shape)
    (2, 3, 7)
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True

    References:
        - The softmax bottleneck: Yang et al., 2018. https://arxiv.org/abs/1711.03953
    """
