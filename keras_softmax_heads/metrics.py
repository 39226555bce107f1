"""`Perplexity`: exact perplexity from a head's log-probabilities, as a Keras
metric; `HeadMetric`: any Keras metric on them, for a model trained through
`HeadLoss`."""

import keras
from keras import ops

from keras_softmax_heads.heads.head_utils import token_weights
from keras_softmax_heads.heads.softmax_head import context_output_heads
from keras_softmax_heads.losses import nll_terms
from keras_softmax_heads.validation import keras_mask_weights


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class Perplexity(keras.metrics.Metric):
    """Exact perplexity `exp(mean -log p(target))` over the tokens seen.

    `y_pred` are normalised log-probabilities `[..., V]` (what every head
    returns), so this is exact; it accumulates the summed negative
    log-likelihood and the token count (weighted by `sample_weight` and by
    the Keras mask of `y_pred`, e.g. an `Embedding(mask_zero=True)`'s, as
    Keras' own metrics are) and reports `exp(sum / count)`. A target outside
    `[0, V)` raises (eagerly, in a TensorFlow graph) or makes the value NaN
    (under XLA). Keras hands `sample_weight` only to a model's
    `weighted_metrics`: compile it there when `fit` / `evaluate` get sample
    weights (under `metrics=` every token counts). For a head trained through
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
        mask_weight = keras_mask_weights(y_pred)  # before a conversion drops the mask
        y_pred = ops.convert_to_tensor(y_pred)
        if _is_context_output(y_pred):
            return
        targets = ops.convert_to_tensor(y_true)
        if len(targets.shape) == len(y_pred.shape):
            targets = ops.squeeze(targets, axis=-1)
        log_p = ops.log(y_pred) if self.from_probabilities else y_pred
        nll = -nll_terms(log_p, targets)
        weight = token_weights(nll, sample_weight) * mask_weight
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


#: Metric names that mean "accuracy" to Keras' `compile`, which infers the
#: sparse form from integer targets; `keras.metrics.get` alone would give
#: exact-match `Accuracy`.
_ACCURACY_NAMES = ("accuracy", "acc")


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class HeadMetric(keras.metrics.Metric):
    """A Keras metric of a head's log-probabilities, for a model trained
    through `HeadLoss`.

    With `loss=HeadLoss(head)` the head returns its context vectors
    `[..., 1, d]` in training, not log-probabilities `[..., V]` (what makes
    training cheap), so a plain Keras metric (`"sparse_categorical_accuracy"`,
    top-k) fails in `fit` or reports a meaningless number. `HeadMetric(m)`
    skips those batches (its training value is `nan`, as `Perplexity`'s)
    and updates `m` on the exact log-probabilities of evaluation, so
    `val_<name>` and `evaluate` report it. Masks and `sample_weight` reach
    `m` as they would without the wrapper.

    Args:
        metric: a `keras.metrics.Metric`, or its name or config (anything
            `keras.metrics.get` takes); `"accuracy"` / `"acc"` mean
            `SparseCategoricalAccuracy` (word ids against `[..., V]`), as in
            `compile`.
        name: the reported name; defaults to `metric`'s.
        dtype: as for every `keras.metrics.Metric`.

    Example:

    >>> import numpy as np, keras, keras_softmax_heads as ksh
    >>> V = 50
    >>> head = ksh.SampledSoftmax(V, num_sampled=8)
    >>> model = keras.Sequential([keras.layers.Embedding(V, 16), head])
    >>> model.compile("adam", loss=ksh.HeadLoss(head),
    ...               metrics=[ksh.Perplexity(), ksh.HeadMetric("accuracy")])
    >>> x = np.random.randint(0, V, (8, 6)); y = np.roll(x, -1, axis=1)
    >>> logs = model.fit(x, y, epochs=1, verbose=0).history
    >>> bool(np.isnan(logs["accuracy"][0]))  # training batches: contexts
    True
    >>> 0.0 <= model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"] <= 1.0
    True
    """

    def __init__(self, metric, name=None, dtype=None):
        if isinstance(metric, str) and metric in _ACCURACY_NAMES:
            metric = keras.metrics.SparseCategoricalAccuracy(name=metric)
        try:
            inner = keras.metrics.get(metric)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"`metric` must be a Keras metric or its name. Received: metric={metric!r}"
            ) from error
        if not isinstance(inner, keras.metrics.Metric):
            inner = keras.metrics.MeanMetricWrapper(
                inner, name=getattr(inner, "__name__", None))
        super().__init__(name=name or inner.name, dtype=dtype)
        self.metric = inner
        self.updates = self.add_variable(shape=(), initializer="zeros", name="updates")

    def update_state(self, y_true, y_pred, sample_weight=None):
        if _is_context_output(ops.convert_to_tensor(y_pred)):
            return
        self.metric.update_state(y_true, y_pred, sample_weight=sample_weight)
        self.updates.assign_add(1.0)

    def result(self):
        value = ops.cast(self.metric.result(), "float32")
        return ops.where(self.updates > 0, value, ops.full_like(value, float("nan")))

    def reset_state(self):
        self.metric.reset_state()
        self.updates.assign(0.0)

    def get_config(self):
        return {"metric": keras.metrics.serialize(self.metric), "name": self.name,
                "dtype": self.dtype}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["metric"] = keras.metrics.deserialize(config["metric"])
        return cls(**config)
