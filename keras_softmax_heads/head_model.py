"""`HeadModel`: train any head with `model.fit` through its training loss."""

import warnings

import keras
import tensorflow as tf
from keras import ops

# The `save_own_variables` keys of the random-number generators' states
# (`SEED_STATE_KEY.format(i)`), next to Keras' own "0", "1", ... keys.
SEED_STATE_PREFIX = "seed_state_"
SEED_STATE_KEY = SEED_STATE_PREFIX + "{}"


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

    Saving (`.keras`, `save_weights`) keeps what a resumed run needs:

    * a head tied to an embedding of the backbone stays tied on load, also
      when the backbone's config does not describe its layers (keras-hub
      backbones such as `GPT2Backbone` are rebuilt from their constructor
      arguments): the config records where the embedding is in the backbone
      (`tied_embedding`, layer names from the backbone down) and
      `from_config` hands that layer of the rebuilt backbone to the head;
    * the states of the random-number generators of backbone and head
      (dropout, sampled heads' samplers) are saved with the weights and
      restored, so a step after loading draws what the original model's
      next step draws.

    Args:
        backbone: a `keras.layers.Layer` or `keras.Model` mapping inputs to
            context vectors `[..., d]` (a tensor or, e.g. for keras-hub
            backbones, a dict of tensors).
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

    # ---------------------------------------------------------------- saving
    def random_states(self):
        """The state variables of the random-number generators of backbone
        and head (dropout, samplers): Keras' `variables` (all layer state,
        random seeds included) less `weights`, in tracking order (the same
        for a model rebuilt from its config)."""
        weights = {id(w) for w in self.weights}
        return [v for v in self.variables if id(v) not in weights]

    def save_own_variables(self, store):
        super().save_own_variables(store)
        # Keras saves no `SeedGenerator` state: a loaded model would draw
        # its dropout masks and samples afresh from the initial seeds.
        for i, state in enumerate(self.random_states()):
            store[SEED_STATE_KEY.format(i)] = state

    def load_own_variables(self, store):
        seed_keys = [k for k in store.keys() if k.startswith(SEED_STATE_PREFIX)]
        super().load_own_variables(
            {k: store[k] for k in store.keys() if k not in seed_keys}
        )
        if not seed_keys:
            return  # a file without them (keras-softmax-heads <= 0.1.0)
        states = self.random_states()
        if len(seed_keys) != len(states):
            warnings.warn(
                f"{self.__class__.__name__} '{self.name}': not restoring the "
                f"random-number generators' states: the file has "
                f"{len(seed_keys)}, the model {len(states)}.",
                stacklevel=2,
            )
            return
        for i, state in enumerate(states):
            state.assign(store[SEED_STATE_KEY.format(i)])

    def get_config(self):
        config = super().get_config()
        embedding = getattr(self.head, "token_embedding", None)
        config.update(
            {
                "backbone": keras.saving.serialize_keras_object(self.backbone),
                "head": keras.saving.serialize_keras_object(self.head),
                "tied_embedding": (
                    None if embedding is None
                    else layer_path(self.backbone, embedding)
                ),
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        backbone = keras.saving.deserialize_keras_object(config.pop("backbone"))
        head_config = config.pop("head")
        path = config.pop("tied_embedding", None)
        if path is not None:
            # Tie the head to the rebuilt backbone's own layer: deserialising
            # the embedding from the head's config would make a second one
            # (unless the backbone's config lists its layers, as Sequential
            # and functional models do, and Keras shares the object).
            embedding = find_layer(backbone, path)
            if embedding is not None:
                head_config = dict(head_config)
                head_config["config"] = dict(
                    head_config["config"], token_embedding=embedding
                )
        head = keras.saving.deserialize_keras_object(head_config)
        return cls(backbone, head, **config)


def _sublayers(layer):
    """The layers `layer` holds directly: a model's `layers`, and layers
    (or lists / dicts of layers) kept as attributes, in definition order."""
    found, seen = [], {id(layer)}

    def add(value):
        if isinstance(value, keras.layers.Layer) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        elif isinstance(value, dict):
            for item in value.values():
                add(item)

    if isinstance(layer, keras.Model):
        add(layer.layers)
    for value in vars(layer).values():
        add(value)
    return found


def layer_path(root, target):
    """Layer names from `root` down to `target`, a layer tracked by `root`.

    Returns `[]` when `target` is `root`, None when `root` does not track
    it or when names do not tell it apart (`find_layer` would not find it).

    Example:

    >>> import keras
    >>> embedding = keras.layers.Embedding(10, 4, name="embedding")
    >>> backbone = keras.Sequential([embedding, keras.layers.Dense(4)])
    >>> layer_path(backbone, embedding)
    ['embedding']
    """
    frontier, seen = [(root, [])], {id(root)}
    while frontier:  # breadth first: the shortest path
        next_frontier = []
        for layer, path in frontier:
            if layer is target:
                return path if find_layer(root, path) is target else None
            for child in _sublayers(layer):
                if id(child) not in seen:
                    seen.add(id(child))
                    next_frontier.append((child, path + [child.name]))
        frontier = next_frontier
    return None


def find_layer(root, path):
    """The layer at `path` (names, as from `layer_path`) below `root`, or
    None."""
    layer = root
    for name in path:
        layer = next((c for c in _sublayers(layer) if c.name == name), None)
        if layer is None:
            return None
    return layer
