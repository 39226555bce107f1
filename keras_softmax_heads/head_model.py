"""`HeadModel`: train any head with `model.fit` through its training loss."""

import keras
import tensorflow as tf
from keras import ops


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class HeadModel(keras.Model):
    """A backbone (tokens -> context vectors `h`) followed by a head.

    `call(x)` returns the head's exact log-probabilities `[..., V]`, so
    `predict` behaves as for any Keras classifier. Training and evaluation
    never need that tensor:

    * `fit` minimises `head.training_loss(h, y)` (sampled softmax, NCE,
      self-normalisation, chunked exact NLL, ... whatever the head trains
      with), averaged over tokens with `sample_weight`, plus the backbone's
      and head's regularisation losses;
    * `evaluate` reports `loss` = exact mean negative log-likelihood from
      `head.log_likelihood(h, y)` (cheap for hierarchical heads) and
      `perplexity = exp(loss)`. Metrics given to `compile(metrics=...)` are
      computed on the full log-probabilities `[..., V]` (an extra head
      forward pass per step): leave them out for very large vocabularies.

    Args:
        backbone: a `keras.layers.Layer` or `keras.Model` mapping inputs to
            context vectors `[..., d]`.
        head: a `keras_softmax_heads` head.

    Example:

    >>> import numpy as np, keras, keras_softmax_heads as ksh
    >>> backbone = keras.Sequential([keras.layers.Embedding(20, 8)])
    >>> model = ksh.HeadModel(backbone, ksh.FullSoftmax(20))
    >>> model.compile(optimizer="adam")
    >>> x = np.random.randint(0, 20, (8, 5)); y = np.roll(x, -1, axis=1)
    >>> history = model.fit(x, y, epochs=1, verbose=0)
    >>> sorted(model.evaluate(x, y, verbose=0, return_dict=True))
    ['loss', 'perplexity']
    """

    def __init__(self, backbone, head, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.head = head
        self._nll_tracker = keras.metrics.Mean(name="loss")

    def call(self, inputs, training=None):
        return self.head(self.backbone(inputs, training=training))

    def build(self, input_shape):
        if not self.backbone.built:
            self.backbone.build(input_shape)
        if not self.head.built:
            self.head.build(self.backbone.compute_output_shape(input_shape))
        self.built = True

    def _mark_built(self, x):
        """Marks the model built after a step traced backbone and head.

        Goes through `build` (which only builds what is still unbuilt) so
        that Keras records the input shape: a `.keras` file then carries a
        build config, and loading rebuilds the model before restoring the
        weights *and the optimizer's state*.
        """
        if not self.built:
            self.build(keras.tree.map_structure(lambda t: tuple(t.shape), x))

    def _token_mean(self, per_token, y, sample_weight):
        per_token = ops.cast(per_token, "float32")
        if sample_weight is None:
            weight = ops.ones_like(per_token)
        else:
            weight = ops.broadcast_to(
                ops.cast(sample_weight, "float32"), ops.shape(per_token)
            )
        total = ops.sum(per_token * weight)
        count = ops.sum(weight)
        return total / ops.maximum(count, 1e-12), count

    def _check_compiled_loss(self):
        if getattr(self, "loss", None) is not None:
            raise ValueError(
                "HeadModel trains with `head.training_loss` and evaluates with "
                "`head.log_likelihood`; do not pass `loss` to compile(). "
                f"Received: loss={self.loss!r}"
            )

    def _wants_metrics(self):
        # compile(metrics=...) adds Keras' "compile_metrics" container.
        return any(m.name == "compile_metrics" for m in super().metrics)

    def train_step(self, data):
        self._check_compiled_loss()
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            h = self.backbone(x, training=True)
            per_token = self.head.training_loss(h, y, training=True)
            self._mark_built(x)
            loss, count = self._token_mean(per_token, y, sample_weight)
            if self.losses:
                loss = loss + ops.sum(ops.stack(self.losses))
            self._nll_tracker.update_state(loss, sample_weight=count)
            # Gradients are summed over replicas: average them instead.
            scaled = loss / tf.distribute.get_strategy().num_replicas_in_sync
            if self.optimizer is not None:
                scaled = self.optimizer.scale_loss(scaled)
        variables = self.trainable_variables
        grads = tape.gradient(scaled, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        logs = {}
        if self._wants_metrics():
            logs = self.compute_metrics(x, y, self.head(h), sample_weight)
        logs["loss"] = self._nll_tracker.result()
        return logs

    def test_step(self, data):
        self._check_compiled_loss()
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        h = self.backbone(x, training=False)
        nll = -self.head.log_likelihood(h, y)
        self._mark_built(x)
        loss, count = self._token_mean(nll, y, sample_weight)
        self._nll_tracker.update_state(loss, sample_weight=count)
        logs = {}
        if self._wants_metrics():
            y_pred = self.head(h)
            logs = self.compute_metrics(x, y, y_pred, sample_weight)
            logs.pop("loss", None)
        result = self._nll_tracker.result()
        logs.update({"loss": result, "perplexity": ops.exp(result)})
        return logs

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "backbone": keras.saving.serialize_keras_object(self.backbone),
                "head": keras.saving.serialize_keras_object(self.head),
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        backbone = keras.saving.deserialize_keras_object(config.pop("backbone"))
        head = keras.saving.deserialize_keras_object(config.pop("head"))
        return cls(backbone, head, **config)
