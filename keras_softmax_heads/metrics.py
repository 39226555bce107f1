"""`Perplexity`: exact perplexity from a head's log-probabilities, as a Keras
metric."""

import keras
from keras import ops

from keras_softmax_heads.heads.softmax_head import context_output_heads
from keras_softmax_heads.losses import nll_terms


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class Perplexity(keras.metrics.Metric):
    """Exact perplexity `exp(mean -log p(target))` over the tokens seen.

    `y_pred` are normalised log-probabilities `[..., V]` (what every head
    returns), so this is exact; it accumulates the summed negative
    log-likelihood and the token count (weighted by `sample_weight`) and
    reports `exp(sum / count)`. For a head trained through
    `keras_softmax_heads.HeadLoss` the training-mode output is context
    vectors, not log-probabilities: the metric then skips the batch (its
    training value stays `nan`) and reports the exact value in evaluation
    (`val_perplexity`).

    Args:
        from_probabilities: `y_pred` are probabilities (a head built with
            `return_probabilities=True`) rather than log-probabilities.
        name, dtype: as for every `keras.metrics.Metric`.

    Example:

    >>> import numpy as np, keras_softmax_heads as ksh
    >>> m = ksh.Perplexity()
    >>> m.update_state([0, 1], np.log([[0.5, 0.5], [0.25, 0.75]]))
    >>> round(float(m.result()), 4)  # exp(-(log 0.5 + log 0.75) / 2)
    1.633
    """

    def __init__(self, from_probabilities=False, name="perplexity", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.from_probabilities = bool(from_probabilities)
        self.nll_sum = self.add_variable(shape=(), initializer="zeros", name="nll_sum")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = ops.convert_to_tensor(y_pred)
        if _is_context_output(y_pred):
            return
        targets = ops.convert_to_tensor(y_true)
        if len(targets.shape) == len(y_pred.shape):
            targets = ops.squeeze(targets, axis=-1)
        log_p = ops.log(y_pred) if self.from_probabilities else y_pred
        nll = -nll_terms(log_p, targets)
        weight = ops.ones_like(nll) if sample_weight is None else ops.broadcast_to(
            ops.cast(sample_weight, "float32"), ops.shape(nll))
        self.nll_sum.assign_add(ops.sum(nll * weight))
        self.count.assign_add(ops.sum(weight))

    def result(self):
        return ops.exp(self.nll_sum / self.count)

    def get_config(self):
        config = super().get_config()
        config["from_probabilities"] = self.from_probabilities
        return config


def _is_context_output(y_pred):
    """Whether `y_pred` is a head's training-mode context output."""
    return any(
        head.last_output == "contexts"
        and y_pred.shape[-1] == head.input_dim
        and len(y_pred.shape) >= 2 and y_pred.shape[-2] == 1
        for head in context_output_heads()
    )
