"""Linear-Softmax: the baseline head."""

import keras

from keras_softmax_heads.chunked.divergence import OutputLayer
from keras_softmax_heads.functional import soft_cap
from keras_softmax_heads.heads.head_utils import linear_nll_on_shards
from keras_softmax_heads.heads.head_utils import summed_linear_cross_entropy
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead
from keras_softmax_heads.validation import check_positive


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class FullSoftmax(PointwiseSoftmaxHead):
    """Linear-Softmax output head.

    `log p(w | h) = z_w - logsumexp(z)` with `z = h W + b`, computed in
    float32 with `log_softmax` (never `log(softmax)`). With
    `logit_soft_cap=c` the scores are soft-capped first,
    `z <- c * tanh(z / c)` (Gemma 2 and 3's final-logit capping), on the dense
    and the chunked path alike.

    Args:
        vocab_size: int `V >= 2` (or omit and pass `token_embedding`).
        logit_soft_cap: optional float > 0: soft-cap the scores at this
            value (`None`, the default: no capping).
        gradient_in_forward: bool, or `None` (default: `True` with
            `chunk_size`, `False` without). With `True` the training
            objective as `HeadModel` and `HeadLoss` reduce it
            (`summed_training_loss`) is computed over token chunks with its
            gradient, in the forward pass (`chunked.summed_cross_entropy`:
            three `N d V` products where the chunked loss runs four, never
            the `[N, V]` scores). `docs/chunked.md`.
        token_embedding, use_bias, kernel_initializer, bias_initializer,
        return_probabilities, chunk_size: see `PointwiseSoftmaxHead` and
            `SoftmaxHead`.

    Returns:
        float32 log-probabilities `[..., V]` of the context vectors `[..., d]`
        (`logsumexp` over the last axis is 0).

    Example:

    >>> import numpy as np, keras_softmax_heads as ksh
    >>> head = ksh.FullSoftmax(vocab_size=7)
    >>> log_p = head(np.random.rand(2, 3, 4).astype("float32"))
    >>> tuple(log_p.shape)
    (2, 3, 7)
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True

    >>> capped = ksh.FullSoftmax(vocab_size=7, logit_soft_cap=30.0)
    >>> tuple(capped(np.random.rand(2, 4).astype("float32")).shape)
    (2, 7)

    References:
        - The softmax bottleneck: Yang et al., 2018. https://arxiv.org/abs/1711.03953
        - Final-logit soft-capping: Gemma Team, 2024. https://arxiv.org/abs/2408.00118
    """

    def __init__(self, *args, logit_soft_cap=None, gradient_in_forward=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.logit_soft_cap = check_positive(
            "logit_soft_cap", logit_soft_cap, allow_none=True
        )
        self.gradient_in_forward = self._gradient_in_forward_option(gradient_in_forward)

    def summed_training_loss(self, inputs, targets, weights, training=True):
        """`sum_i weights_i (-log p(targets_i | inputs_i))`, a float32 scalar;
        with `gradient_in_forward=True` computed with its gradient over
        token chunks (`chunked.summed_cross_entropy`), otherwise
        `training_loss` weighted and summed. A word id outside `[0, V)`
        with a non-zero weight makes the sum NaN. On JAX, under a
        `keras.distribution` whose layout shards the kernel (or the tied
        embedding) on its vocabulary axis, the summed pass runs on each
        device's shard (`chunked.vocab_parallel.vocab_parallel_summed`)."""
        if not self.gradient_in_forward:
            return super().summed_training_loss(inputs, targets, weights, training)
        rows, targets, kernel, transposed, bias = self._summed_loss_operands(inputs, targets)
        layer = OutputLayer(rows, kernel, bias, transposed, self.logit_soft_cap)
        return summed_linear_cross_entropy(layer, self.chunked_projection()[0], targets,
                                           weights, self.vocab_size)

    def _vocab_parallel_nll(self, inputs, targets):
        """`-log p(targets)` on each device's vocabulary shard where the
        kernel is sharded on V (JAX): the summed cross-entropy with its
        per-token losses (`chunked.vocab_parallel.token_losses`); None
        elsewhere."""
        operands = self._vocab_parallel_operands(inputs)
        if operands is None:
            return None
        layout, rows, kernel, transposed, chunk = operands
        return linear_nll_on_shards(rows, kernel, self.bias, transposed, layout, targets,
                                    self.vocab_size, chunk, self.logit_soft_cap)

    def score_transform(self, z):
        if self.logit_soft_cap is None:
            return z
        return soft_cap(z, self.logit_soft_cap)

    def has_score_transform(self):
        return self.logit_soft_cap is not None

    def get_config(self):
        config = super().get_config()
        config["logit_soft_cap"] = self.logit_soft_cap
        config["gradient_in_forward"] = self.gradient_in_forward
        return config
