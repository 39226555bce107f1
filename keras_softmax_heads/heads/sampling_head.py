"""Bases of the heads that train with a random objective.

`SamplingHead`: exact evaluation, a seeded random training loss
(`SampledSoftmax`, `NCE`, `SelfNormalizedSoftmax`). `CandidateSamplingHead`
adds a word sampler `q` (`"log_uniform"`, `"uniform"`, `"unigram"`): its
tables as non-trainable weights and its `counts` in the config
(`SampledSoftmax`, `NCE`). Design notes: `docs/sampling.md`.
"""

import keras
import numpy as np

from keras_softmax_heads import samplers
from keras_softmax_heads.heads.head_utils import build_sampler_tables
from keras_softmax_heads.heads.head_utils import config_vocab_size
from keras_softmax_heads.heads.word_major_softmax_head import WordMajorSoftmaxHead
from keras_softmax_heads.validation import check_seed


class SamplingHead(WordMajorSoftmaxHead):
    """A word-major head whose training objective is random.

    `call`, `log_probs` and `log_likelihood` are exact, `log_softmax(z)` with
    `z = h W^T + b` (`W` `[V, d]`); `training_loss(h, targets,
    training=True)` is one draw of the subclass's objective
    (`stochastic_loss`), `training=False` the exact NLL. Random numbers come
    from the layer's `keras.random.SeedGenerator` (`seed_generator`), so the
    loss compiles under XLA and `jax.jit`.

    Args:
        vocab_size: int `V` (or omit and pass `token_embedding`).
        seed: optional int in `[0, 2**32)`, seed of `seed_generator`.
        **kwargs: `token_embedding`, `use_bias`, `kernel_initializer`,
            `bias_initializer`, `return_probabilities` (see `SoftmaxHead`)
            and standard `keras.layers.Layer` arguments.
    """

    exact_training_objective = False

    def __init__(self, vocab_size=None, seed=None, **kwargs):
        super().__init__(vocab_size=vocab_size, **kwargs)
        self.seed = check_seed(seed)
        self.seed_generator = keras.random.SeedGenerator(seed)

    def stochastic_loss(self, inputs, targets):
        """One draw of the training objective for checked `inputs`, float32
        of shape `targets.shape` (implemented by subclasses)."""
        raise NotImplementedError

    def training_loss(self, inputs, targets, training=True):
        """The random objective (`training=True`) or the exact NLL.

        Returns:
            float32 tensor of shape `targets.shape`.
        """
        if not training:
            return -self.log_likelihood(inputs, targets)
        return self.stochastic_loss(self._check_inputs(inputs), targets)

    def get_config(self):
        config = super().get_config()
        config["seed"] = self.seed
        return config


class CandidateSamplingHead(SamplingHead):
    """A `SamplingHead` that draws words from a sampler `q`.

    `q` is `"log_uniform"` (Zipfian over frequency-sorted ids), `"uniform"`
    or `"unigram"` (`q ∝ counts ** distortion`, needs `counts`); its alias
    tables are non-trainable weights (`sampling_log_probs`,
    `alias_thresholds`, `alias_indices`, and `counts` for `"unigram"`), read
    by `self._sampler` (a `samplers.CandidateSampler`) once built. With
    `"unigram"`, `get_config` records `counts` (ints when integral), so
    `from_config` alone rebuilds the sampler; other samplers record None.

    Args:
        vocab_size: int `V` (or omit and pass `token_embedding`).
        sampler: the sampler's name (checked by the subclass; other names
            build no tables).
        counts: optional non-negative counts `[V]` (needed by `"unigram"`,
            validated for every sampler).
        distortion: float `>= 0`, the unigram power.
        seed: optional int, see `SamplingHead`.
        **kwargs: see `SamplingHead`.
    """

    def __init__(self, vocab_size=None, sampler="unigram", counts=None, distortion=1.0,
                 seed=None, **kwargs):
        super().__init__(vocab_size=vocab_size, seed=seed, **kwargs)
        self.sampler = sampler
        self.distortion = samplers.check_distortion(distortion)
        counts = samplers.check_counts(counts, self.vocab_size)
        if sampler == "unigram":
            if counts is None:
                raise ValueError(
                    "sampler='unigram' needs the word `counts` (length "
                    f"vocab_size={self.vocab_size}). Received: counts=None"
                )
            samplers.unigram_probs(counts, self.distortion)  # validates the sum
        self._counts = counts if sampler == "unigram" else None

    def build_head(self, input_shape):
        del input_shape
        self._sampler = build_sampler_tables(
            self, self.sampler, self._counts, self.distortion
        )

    def check_sampling_ready(self):
        """Raises unless the layer is built and its counts are loaded."""
        self._check_structure()
        if not self.built:
            raise ValueError("Build the layer (call it once) before sampling.")

    def get_config(self):
        config = super().get_config()
        # None unless "unigram" (or while legacy counts are pending).
        counts = None
        if self._pending_structure is None:
            counts = samplers.counts_to_config(self._counts, getattr(self, "counts", None))
        config.update(
            {"sampler": self.sampler, "counts": counts, "distortion": self.distortion}
        )
        return config

    @classmethod
    def from_config(cls, config):
        layer = super().from_config(placeholder_counts(config))
        if legacy_counts_config(config):
            layer._pending_structure = "counts"
        return layer


def legacy_counts_config(config):
    """Whether a sampled head's config lacks the counts its sampler needs.

    Only keras-softmax-heads 0.1.0 wrote such configs (`sampler="unigram"`,
    `counts=None`, the counts in the weights only).
    """
    return config.get("counts") is None and config.get("sampler") == "unigram"


def placeholder_counts(config):
    """Config with placeholder counts (ones) where the sampler needs counts.

    For legacy (0.1.0) configs only (`legacy_counts_config`): the layer gets
    the right shape, and is unusable until its weights (the real counts and
    sampling tables) are loaded.
    """
    config = dict(config)
    if legacy_counts_config(config):
        config["counts"] = np.ones(int(config_vocab_size(config)))
    return config
