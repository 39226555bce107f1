"""`HeadModel`: train any head with `model.fit` through its training loss."""

import keras
from keras import ops

from keras_softmax_heads.heads.head_utils import load_random_states
from keras_softmax_heads.heads.head_utils import random_states
from keras_softmax_heads.heads.head_utils import save_random_states
from keras_softmax_heads.heads.head_utils import token_weights
from keras_softmax_heads.validation import keras_mask_weights
from keras_softmax_heads.validation import per_replica
from keras_softmax_heads.validation import with_keras_mask_of


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
      next step draws. (On PyTorch, Keras draws an unseeded `Dropout`'s
      masks from torch's global generator, which is not saved: give the
      layers a `seed` for exact resumes there.)

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
        # "train" / "test" while Keras runs (or traces) a step, else None.
        self._step_mode = None

    def call(self, inputs, training=None):
        h = self.backbone(inputs, training=training)
        if self._step_mode is None:
            return self.head(h)
        # Inside `fit` / `evaluate`: hand the contexts to `compute_loss`;
        # the log-probabilities only when compiled metrics need them.
        outputs = {"contexts": h}
        if self._wants_metrics():
            # The exact log-probabilities (with the head's training-mode
            # dropout in training), whatever the head returns in training
            # (a sampling head its contexts; `return_probabilities`).
            outputs["log_probs"] = self.head.call_log_probs(h, training=training)
        return outputs

    @property
    def input_dtype(self):
        """The backbone's input dtype: the dtype of its `keras.Input` (a
        functional or `Sequential` backbone built from one), else the
        backbone layer's `input_dtype` (`"int32"` for the library's
        backbones). `model.export` writes it in the serving signature."""
        try:
            inputs = self.backbone.inputs
        except (AttributeError, ValueError):
            inputs = None
        if inputs:
            return keras.backend.standardize_dtype(inputs[0].dtype)
        return self.backbone.input_dtype

    def build(self, input_shape):
        if not self.backbone.built:
            self.backbone.build(input_shape)
        if not self.head.built:
            self.head.build(self.backbone.compute_output_shape(input_shape))
        self.built = True

    def _run_step(self, mode, step, *args, **kwargs):
        """Runs Keras' own `train_step` / `test_step` (whatever the backend's
        signature) with `call` returning the contexts."""
        self._check_compiled_loss()
        previous, self._step_mode = self._step_mode, mode
        try:
            # The head learns whether this step is compiled with XLA
            # (HierarchicalSoftmax picks its tiles by it).
            with self.head.compiled_with(bool(getattr(self, "jit_compile", False))):
                return step(*args, **kwargs)
        finally:
            self._step_mode = previous

    def train_step(self, *args, **kwargs):
        return self._run_step("train", super().train_step, *args, **kwargs)

    def test_step(self, *args, **kwargs):
        return self._run_step("test", super().test_step, *args, **kwargs)

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        """Token-mean training objective (training) or exact NLL (evaluation).

        `y_pred` is what `call` returns inside a step: `{"contexts": h}`.
        Training minimises `head.training_loss(h, y)` plus the regularisation
        losses; evaluation uses `-head.log_likelihood(h, y)`. Both are
        averaged over tokens weighted by `sample_weight` (a `[B]` weight
        covers its sequence's tokens) and by the backbone's Keras mask (e.g.
        `Embedding(mask_zero=True)`: padding counts for nothing, as in a
        Keras loss), and the mean is what `loss` reports.
        A head with `gradient_in_forward` on trains through
        `head.summed_training_loss(h, y, weights)` with those weights over
        their sum: the same mean, its gradient computed with it. Under a
        `tf.distribute` strategy the returned value is divided by the number
        of replicas (Keras sums their gradients).
        """
        self._check_compiled_loss()
        h = y_pred["contexts"]
        # The backbone's Keras mask (e.g. `Embedding(mask_zero=True)`) weighs
        # the tokens as `sample_weight` does, as in a Keras loss.
        mask_weight = keras_mask_weights(h)
        if training and self.head.gradient_in_forward:
            weight = token_weights(y, sample_weight) * mask_weight
            count = ops.sum(weight)
            loss = self.head.summed_training_loss(
                h, y, weight / ops.maximum(count, 1e-12), training=True
            )
        else:
            if training:
                per_token = self.head.training_loss(h, y, training=True)
            else:
                per_token = -self.head.log_likelihood(h, y)
            loss, count = self._token_mean(per_token, sample_weight, mask_weight)
        if training and self.losses:
            loss = loss + ops.sum(
                ops.stack([ops.cast(l, "float32") for l in self.losses])
            )
        self._nll_tracker.update_state(loss, sample_weight=count)
        return per_replica(loss)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = {}
        if self._wants_metrics():
            if isinstance(y_pred, dict):
                # The backbone's Keras mask (padding) on the log-probabilities,
                # where the compiled metrics read it (as `compute_loss` does).
                log_probs = with_keras_mask_of(y_pred["contexts"], y_pred["log_probs"])
            else:
                log_probs = y_pred
            logs = super().compute_metrics(x, y, log_probs, sample_weight)
        logs["loss"] = self._nll_tracker.result()
        if self._step_mode == "test":
            logs["perplexity"] = ops.exp(logs["loss"])
        return logs

    def _token_mean(self, per_token, sample_weight, mask_weight):
        per_token = ops.cast(per_token, "float32")
        weight = token_weights(per_token, sample_weight) * mask_weight
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

    # ---------------------------------------------------------------- saving
    def random_states(self):
        """The state variables of the random-number generators of backbone
        and head (dropout, samplers): Keras' `variables` (all layer state,
        random seeds included) less `weights`, in tracking order (the same
        for a model rebuilt from its config)."""
        return random_states(self)

    def save_own_variables(self, store):
        super().save_own_variables(store)
        # Keras saves no `SeedGenerator` state: a loaded model would draw
        # its dropout masks and samples afresh from the initial seeds.
        save_random_states(self, store)

    def load_own_variables(self, store):
        load_random_states(self, store, super().load_own_variables)

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
