"""`Backbone`: the base of the language-model backbones (tokens -> `h`).

It holds what every backbone shares: the input embedding a head may tie to
(`token_embedding`) and its serialisation, and the carried-state interface
the training loop calls (`reset_states`, `carried_state_variables`).
"""

import random

import keras


def dropout_seed(rate):
    """A seed for a backbone's `keras.layers.Dropout(rate)`, drawn as Keras
    draws an unseeded layer's (`random.randint(1, 10**9)`, Python's
    generator, which `keras.utils.set_random_seed` seeds), and only where
    Keras draws one (`rate > 0`; `None` otherwise): the same masks, and the
    same draws of every layer built after it, on TensorFlow and JAX as
    without it. On PyTorch an unseeded `Dropout` takes torch's global
    generator, which no checkpoint restores; a seeded one draws from its
    `SeedGenerator`, whose state `HeadModel` saves, so a resumed run
    (`examples/train_lm.py`) repeats the same masks."""
    return random.randint(1, int(1e9)) if rate > 0 else None


class Backbone(keras.layers.Layer):
    """Base class of a language-model backbone with a tieable input embedding.

    A subclass creates `self.embedding` (a `keras.layers.Embedding`, or the
    one given as its `embedding=` argument), defines the property
    `output_dim` (the size `d` of the context vectors) and returns its own
    constructor arguments, except `embedding`, from `backbone_config()`.
    `get_config` appends the embedding layer itself (not its dict): Keras
    then serialises it once and records it, so that a head tied to it is
    restored tied (one shared layer) when a saved model is loaded.
    `from_config` rebuilds the embedding, and a config straight from
    `get_config()` (holding the layer) gets a fresh copy, not a share.

    A stateless backbone keeps the default `reset_states` (nothing to do)
    and `carried_state_variables` (none).

    Example:

    >>> class Bag(Backbone):
    ...     def __init__(self, vocab_size=10, embedding=None, **kwargs):
    ...         super().__init__(**kwargs)
    ...         self.vocab_size = vocab_size
    ...         self.embedding = embedding or keras.layers.Embedding(vocab_size, 4)
    ...     output_dim = 4
    ...     def call(self, inputs):
    ...         return keras.ops.mean(self.embedding(inputs), axis=-2)
    ...     def backbone_config(self):
    ...         return {"vocab_size": self.vocab_size}
    >>> bag = Bag()
    >>> sorted(k for k in bag.get_config() if k in ("vocab_size", "embedding"))
    ['embedding', 'vocab_size']
    >>> Bag.from_config(bag.get_config()).embedding is bag.embedding
    False
    """

    @property
    def input_dtype(self):
        """`"int32"`: a backbone takes word ids (what `model.export`
        writes in the signature of a model built on it; float inputs are
        cast)."""
        return "int32"

    @property
    def token_embedding(self):
        """The input `keras.layers.Embedding` (pass it to a head to tie)."""
        return self.embedding

    @property
    def carried_state_variables(self):
        """The variables of the state carried across calls (none here)."""
        return []

    def reset_states(self):
        """Zeroes the carried state; nothing to do without one."""

    def backbone_config(self):
        """The subclass's constructor arguments except `embedding`."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement `backbone_config()`."
        )

    def get_config(self):
        config = super().get_config()
        config.update(self.backbone_config())
        config["embedding"] = self.embedding
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["embedding"] = _embedding_from_config(config.get("embedding"))
        return cls(**config)


def _embedding_from_config(embedding):
    """The embedding layer of a config: deserialised from its dict, a fresh
    copy of a layer object (a config straight from `get_config()`), or None."""
    if isinstance(embedding, dict):
        return keras.layers.deserialize(embedding)
    if isinstance(embedding, keras.layers.Layer):
        return embedding.__class__.from_config(embedding.get_config())
    return embedding
