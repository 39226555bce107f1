"""Noise-contrastive estimation (NCE) with unnormalised scores."""

import math
import numbers

import keras
import numpy as np
from keras import ops

from keras_softmax_heads import samplers
from keras_softmax_heads.heads.word_major_softmax_head import WordMajorSoftmaxHead
from keras_softmax_heads.heads.head_utils import check_num_sampled
from keras_softmax_heads.validation import check_seed
from keras_softmax_heads.heads.head_utils import build_sampler_tables
from keras_softmax_heads.heads.sampled_softmax import placeholder_counts


def nce_nll(target_logits, noise_logits, noise_weight):
    """The NCE loss from posterior logits (the math, no weights).

    `loss_i = -log sigmoid(a_i) - noise_weight * sum_j log(1 - sigmoid(b_ij))
    = softplus(-a_i) + noise_weight * sum_j softplus(b_ij)`.

    Args:
        target_logits: float `[N]`, `a_i = s(t_i) - log(k q(t_i))`, the logit
            of "the target came from the data".
        noise_logits: float `[N, m]`, `b_ij = s(n_j) - log(k q(n_j))`.
        noise_weight: float, the weight of each noise term (`k / m`).

    Returns:
        float `[N]`.

    Example:

    >>> import numpy as np
    >>> loss = nce_nll(np.array([0.0]), np.array([[0.0, 0.0]]), 0.5)
    >>> bool(np.isclose(float(loss[0]), 2 * np.log(2.0)))
    True
    """
    target_logits = ops.convert_to_tensor(target_logits)
    noise_logits = ops.convert_to_tensor(noise_logits)
    data_term = ops.softplus(-target_logits)
    noise_term = ops.sum(ops.softplus(noise_logits), axis=-1)
    return data_term + noise_weight * noise_term


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class NCE(WordMajorSoftmaxHead):
    """Noise-contrastive estimation (Mnih & Teh 2012; Chen et al. 2016).

    Evaluation is exact: `call`, `log_probs` and `log_likelihood` are the full
    `log_softmax(z)`, `z = h W^T + b`. Training (`training_loss(h, targets,
    training=True)`) instead discriminates the data word from noise words
    drawn from a unigram distribution `q`, with the unnormalised model score
    `s(w | h) = z_w - log_normalizer` standing for `log p(w | h)` (the
    normaliser is not computed: Mnih & Teh fix it, `log_normalizer = 0` by
    default; the bias learns any offset). The data-vs-noise mixture holds
    `k = noise_ratio` noise words per data word, so the posterior that a word
    came from the data is

    `P(D = 1 | w, h) = sigmoid(s(w | h) - log(k q(w)))`.

    With `m = num_sampled` noise words `n_1..n_m` drawn from `q` (i.i.d.,
    shared by the batch), the per-token loss is

    `loss = -log sigmoid(s(t) - log(k q(t)))
    - (k / m) sum_j log(1 - sigmoid(s(n_j) - log(k q(n_j))))`,

    a Monte-Carlo estimate of the NCE objective `-log P(D=1 | t) -
    k E_{n~q}[log P(D=0 | n)]`. `k` enters only the posterior (the mixture
    being modelled); `m` only sets how many samples estimate the noise
    expectation, each weighted `k / m`. Chen et al. (section 4.5) decouple the
    two: e.g. a data/noise ratio of 1/50 (`noise_ratio=50`) estimated with
    many more samples (they "up-weight the data sample", i.e. scale the whole
    loss by `m / k`; we keep the data term's weight at 1 so the loss scale
    does not depend on `m`). `noise_ratio=None` (default) sets `k = m`, the
    classic NCE of Mnih & Teh and of `tf.nn.nce_loss` (which it equals when
    given the same samples, expected counts `m q` and no accidental-hit
    removal). A noise word equal to the target is a legitimate noise draw
    and is kept.

    Noise distributions (`sampler=`): `"unigram"` (default, Mnih & Teh and
    Chen et al.: `q ∝ counts ** distortion`, needs `counts`),
    `"log_uniform"` (Zipfian over frequency-sorted ids, no counts) and
    `"uniform"`. Sampling uses `keras.random` with the layer's
    `SeedGenerator` and Walker alias tables (compiles under XLA, unlike
    `tf.random.*_candidate_sampler`); see `keras_softmax_heads.samplers`.
    One code path for eager, graph and XLA, as fast as `tf.nn.nce_loss` on
    CPU (see `benchmarks/bench_large_vocab.py`).

    Weights: `kernel` `[V, d]` (word-major, see
    `keras_softmax_heads.heads.word_major_softmax_head.WordMajorSoftmaxHead`: the loss
    gathers `N + m` rows and their gradient is sparse) and `bias` `[V]`.

    Word statistics: `counts`, a length-`V` array of training counts,
    validated for every sampler, used by `"unigram"`. With `"unigram"`,
    `get_config` records them as a list (ints when integral, like the
    vocabulary of `keras.layers.StringLookup`), so `from_config` alone and
    `keras.models.clone_model` rebuild the same noise distribution; other
    samplers record `counts=None`. They are also stored with the sampling
    tables as non-trainable weights (`counts`, `sampling_log_probs`,
    `alias_thresholds`, `alias_indices`), saved with the model. A
    `"unigram"` config with `counts=None` (written by keras-softmax-heads
    0.1.0) gives a layer of the right shape that raises a `ValueError` from
    `call`, `log_probs`, `log_likelihood`, `training_loss` and
    `sample_noise` until its weights are loaded (`.keras` load,
    `load_weights` or the layer's `set_weights`).

    Args:
        vocab_size: int, number of words `V` (or omit and pass
            `token_embedding`).
        num_sampled: int `m >= 1`, noise words drawn per step (shared by the
            batch). Default 1024.
        noise_ratio: float `k > 0`, noise words per data word in the modelled
            mixture, or `None` for `k = num_sampled`.
        sampler: `"unigram"` (default), `"log_uniform"` or `"uniform"`.
        counts: length-`V` array of non-negative training counts (needed by
            `"unigram"`).
        distortion: float `>= 0`, the unigram power (default 1; 0.75 as
            word2vec).
        log_normalizer: float, the fixed `log Z` subtracted from the scores
            during training (default 0, Mnih & Teh's `Z = 1`). At
            initialisation `z ~ 0`, so with `log Z = 0` every word looks
            `V` times too likely and the first steps push all scores down
            (the exact perplexity rises before it falls); `log Z ~ log V`
            starts training near normalised (trained billionW models have
            `log Z` of 9.4-10.3, Chen et al. section 4.6). Evaluation is
            unaffected (always normalised).
        seed: optional int, seed of the layer's `keras.random.SeedGenerator`.
        token_embedding: optional `keras.layers.Embedding` `[V, d]` tied to
            the output matrix.
        use_bias: bool, per-word output bias (default `True`).
        kernel_initializer, bias_initializer: initializers of `W` `[V, d]`
            and `b` `[V]`.
        return_probabilities: bool, `call` returns probabilities.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 exact log-probabilities `[..., V]`. `training_loss(inputs,
        targets, training=True)` returns the NCE loss, float32 of shape
        `targets.shape` (`training=False`: the exact NLL).

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.nce import NCE
    >>> counts = np.arange(50, 0, -1)
    >>> head = NCE(vocab_size=50, num_sampled=20, noise_ratio=5, counts=counts,
    ...            seed=0)
    >>> h = np.random.rand(2, 3, 4).astype("float32")
    >>> targets = np.array([[1, 2, 3], [4, 5, 6]])
    >>> loss = head.training_loss(h, targets)
    >>> tuple(loss.shape), bool(np.all(np.asarray(loss) > 0))
    ((2, 3), True)
    >>> bool(np.allclose(np.exp(head(h)).sum(-1), 1.0, atol=1e-5))  # exact
    True

    References:
        - Mnih & Teh, 2012. A fast and simple algorithm for training neural
          probabilistic language models. https://arxiv.org/abs/1206.6426
        - Gutmann & Hyvärinen, 2010. Noise-contrastive estimation: A new
          estimation principle for unnormalized statistical models.
        - Chen, Grangier & Auli, 2016. Strategies for Training Large
          Vocabulary Neural Language Models (sections 2.5, 4.5).
          https://arxiv.org/abs/1512.04906
    """

    exact_training_objective = False
    named_bias_initializers = ("noise",)

    def __init__(
        self,
        vocab_size=None,
        num_sampled=1024,
        noise_ratio=None,
        sampler="unigram",
        counts=None,
        distortion=1.0,
        log_normalizer=0.0,
        seed=None,
        token_embedding=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="noise",
        return_probabilities=False,
        **kwargs,
    ):
        super().__init__(
            vocab_size=vocab_size,
            token_embedding=token_embedding,
            use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            return_probabilities=return_probabilities,
            **kwargs,
        )
        num_sampled = check_num_sampled(num_sampled)
        if num_sampled == "all":
            raise ValueError(
                "NCE needs a number of noise samples. Received: num_sampled='all'"
            )
        self.num_sampled = num_sampled
        if noise_ratio is not None and (
            isinstance(noise_ratio, bool)
            or not isinstance(noise_ratio, numbers.Real)
            or not math.isfinite(noise_ratio)
            or noise_ratio <= 0
        ):
            raise ValueError(
                "`noise_ratio` must be None or a finite number > 0 (noise "
                f"words per data word). Received: noise_ratio={noise_ratio!r}"
            )
        self.noise_ratio = None if noise_ratio is None else float(noise_ratio)
        self.sampler = samplers.check_sampler(sampler)
        self.distortion = samplers.check_distortion(distortion)
        if (
            isinstance(log_normalizer, bool)
            or not isinstance(log_normalizer, numbers.Real)
            or not math.isfinite(log_normalizer)
        ):
            raise ValueError(
                "`log_normalizer` must be a finite number. "
                f"Received: log_normalizer={log_normalizer!r}"
            )
        self.log_normalizer = float(log_normalizer)
        self.seed = check_seed(seed)
        counts = samplers.check_counts(counts, self.vocab_size)
        if sampler == "unigram":
            if counts is None:
                raise ValueError(
                    "sampler='unigram' needs the word `counts` (length "
                    f"vocab_size={self.vocab_size}). Received: counts=None"
                )
            samplers.unigram_probs(counts, self.distortion)  # validates the sum
        self._counts = counts if sampler == "unigram" else None
        self.seed_generator = keras.random.SeedGenerator(seed)

    def named_bias_values(self, name):
        """`"noise"`: `log q(w) + log_normalizer`, the noise distribution.

        The model then starts self-normalised (`sum_w exp(s(w | h)) = 1`)
        and equal to the noise, where the NCE posterior of every word is the
        Bayes-optimal `1 / (1 + k)`. Words with `q(w) = 0` start at the
        smallest positive `log q`.
        """
        del name
        if self.sampler == "unigram" and self._counts is None:
            return np.zeros(self.vocab_size)  # legacy config: weights load later
        probs = samplers.sampling_probs(self.sampler, self.vocab_size, self._counts,
                                        self.distortion)
        floor = probs[probs > 0].min()
        return np.log(np.maximum(probs, floor)) + self.log_normalizer

    @property
    def k(self):
        """The noise/data ratio `k` of the modelled mixture."""
        return float(self.num_sampled) if self.noise_ratio is None else self.noise_ratio

    def build_head(self, input_shape):
        del input_shape
        self._sampler = build_sampler_tables(
            self, self.sampler, self._counts, self.distortion
        )

    # ------------------------------------------------------------- sampling
    def sample_noise(self):
        """Draws the `num_sampled` noise words of one step.

        Returns:
            dict with `noise_ids` int32 `[m]` and `noise_log_probs` float32
            `[m]` (`log q`).
        """
        self._check_structure()
        if not self.built:
            raise ValueError("Build the layer (call it once) before sampling.")
        ids = self._sampler.sample(self.num_sampled, self.seed_generator)
        return {
            "noise_ids": ids,
            "noise_log_probs": self._sampler.log_prob(ids, self.accumulation_dtype),
        }

    # ----------------------------------------------------------------- loss
    def nce_loss(self, inputs, targets, noise_ids, noise_log_probs=None,
                 target_log_probs=None):
        """The NCE loss for given noise words (deterministic).

        Args:
            inputs: context vectors `[..., d]`.
            targets: int word ids `[...]`.
            noise_ids: int `[m]`, noise words shared by all rows.
            noise_log_probs: float `[m]`, `log q` of the noise words; `None`
                reads them from the layer's sampler.
            target_log_probs: float `[N]` (flat targets), `log q` of the
                targets; `None` reads them from the layer's sampler.

        Returns:
            float32 `[...]` (the shape of `targets`); each noise term has
            weight `k / m`, `m = len(noise_ids)`.
        """
        h, flat_targets, shape = self._flatten(inputs, targets)
        acc = self.accumulation_dtype
        noise_ids = ops.cast(ops.convert_to_tensor(noise_ids), "int32")
        num_noise = noise_ids.shape[0]
        if num_noise is None:
            raise ValueError("`noise_ids` must have a static length.")
        if noise_log_probs is None:
            noise_log_probs = self._sampler.log_prob(noise_ids, acc)
        if target_log_probs is None:
            target_log_probs = self._sampler.log_prob(flat_targets, acc)
        shift = math.log(self.k) + self.log_normalizer
        target_logits = (
            self.target_scores(h, flat_targets)
            - ops.cast(target_log_probs, acc)
            - shift
        )
        noise_logits = (
            self.candidate_scores(h, noise_ids)
            - ops.cast(noise_log_probs, acc)[None, :]
            - shift
        )
        loss = nce_nll(target_logits, noise_logits, self.k / num_noise)
        return self._finish(loss, flat_targets, shape)

    def training_loss(self, inputs, targets, training=True):
        """NCE loss (`training=True`) or exact NLL, shape `targets.shape`."""
        if not training:
            return -self.log_likelihood(inputs, targets)
        self._check_inputs(inputs)
        return self.nce_loss(inputs, targets, **self.sample_noise())

    # ------------------------------------------------------------ serialising
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_sampled": self.num_sampled,
                "noise_ratio": self.noise_ratio,
                "sampler": self.sampler,
                # None unless "unigram" (or while legacy counts are pending).
                "counts": (
                    None
                    if self._pending_structure is not None
                    else samplers.counts_to_config(
                        self._counts, getattr(self, "counts", None)
                    )
                ),
                "distortion": self.distortion,
                "log_normalizer": self.log_normalizer,
                "seed": self.seed,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        patched = placeholder_counts(config)
        layer = super().from_config(patched)
        if config.get("counts") is None and patched.get("counts") is not None:
            layer._pending_structure = "counts"  # a legacy (0.1.0) config
        return layer
