"""`NCE`: noise-contrastive estimation with unnormalised scores.

Design notes (the data/noise ratio `k` against the number of samples `m`,
the noise distributions, the `"noise"` bias start): `docs/sampling.md`.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_softmax_heads import samplers
from keras_softmax_heads.heads.head_utils import check_num_sampled
from keras_softmax_heads.heads.sampling_head import CandidateSamplingHead
from keras_softmax_heads.validation import check_number
from keras_softmax_heads.validation import check_positive


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
class NCE(CandidateSamplingHead):
    """Noise-contrastive estimation (Mnih & Teh 2012; Chen et al. 2016).

    Evaluation is exact: `call`, `log_probs` and `log_likelihood` are
    `log_softmax(z)`, `z = h W^T + b`. Training discriminates the target
    from `m = num_sampled` noise words `n_j ~ q` (shared by the batch), with
    the unnormalised score `s(w | h) = z_w - log_normalizer` and `k` noise
    words per data word in the modelled mixture:

    `loss = -log sigmoid(s(t) - log(k q(t)))
    - (k / m) sum_j log(1 - sigmoid(s(n_j) - log(k q(n_j))))`.

    With `noise_ratio=None` (`k = m`) this is the classic NCE of
    `tf.nn.nce_loss`. How `k` and `m` differ, the noise distributions and
    the bias start: `docs/sampling.md`.

    Args:
        vocab_size: int `V` (or omit and pass `token_embedding`).
        num_sampled: int `m >= 1`, noise words drawn per step. Default 1024.
        noise_ratio: float `k > 0`, noise words per data word in the
            modelled mixture, or None for `k = num_sampled`.
        sampler: the noise distribution `q`: `"unigram"` (default,
            `q ∝ counts ** distortion`), `"log_uniform"` or `"uniform"`.
        counts: non-negative training counts `[V]` (needed by
            `"unigram"`). A target whose count is 0 has noise probability
            0 under `"unigram"`: its data term is 0 (finite, no gradient
            to raise it), only the noise term remains; smooth the counts
            (`counts + 1`) if such words occur in training.
        distortion: float `>= 0`, the unigram power (default 1).
        log_normalizer: float, the fixed `log Z` subtracted from the scores
            in training (default 0; evaluation is always normalised).
        seed: optional int, seed of the layer's `keras.random.SeedGenerator`.
        bias_initializer: `"noise"` (default: `log q(w) + log_normalizer`,
            the model starts equal to the noise) or any Keras initializer.
        **kwargs: `token_embedding`, `use_bias`, `kernel_initializer`,
            `return_probabilities` (see `SoftmaxHead`) and standard
            `keras.layers.Layer` arguments.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 normalised log-probabilities `[..., V]` (the noise is for
        training only). `training_loss(inputs, targets)`: the NCE loss of one
        noise draw, float32 of shape `targets.shape` (the exact NLL with
        `training=False`).

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
        bias_initializer="noise",
        **kwargs,
    ):
        num_sampled = check_num_sampled(num_sampled)
        if num_sampled == "all":
            raise ValueError(
                "NCE needs a number of noise samples. Received: num_sampled='all'"
            )
        noise_ratio = check_positive("noise_ratio", noise_ratio, allow_none=True)
        samplers.check_sampler(sampler)
        log_normalizer = check_number("log_normalizer", log_normalizer)
        super().__init__(
            vocab_size, sampler, counts, distortion, seed=seed,
            bias_initializer=bias_initializer, **kwargs,
        )
        self.num_sampled = num_sampled
        self.noise_ratio = noise_ratio
        self.log_normalizer = log_normalizer

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

    # ------------------------------------------------------------- sampling
    def sample_noise(self):
        """Draws the `num_sampled` noise words of one step.

        Returns:
            dict with `noise_ids` int32 `[m]` and `noise_log_probs` float32
            `[m]` (`log q`).
        """
        self.check_sampling_ready()
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

    def stochastic_loss(self, inputs, targets):
        """The NCE loss with fresh noise words, `targets.shape`."""
        return self.nce_loss(inputs, targets, **self.sample_noise())

    # ------------------------------------------------------------ serialising
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_sampled": self.num_sampled,
                "noise_ratio": self.noise_ratio,
                "log_normalizer": self.log_normalizer,
            }
        )
        return config
