"""`SampledSoftmax`: target sampling, exact at evaluation.

Design notes (samplers, the `log Q` correction, XLA-compatible sampling,
saved counts): `docs/sampling.md`.
"""

import math

import keras
from keras import ops

from keras_softmax_heads import samplers
from keras_softmax_heads.heads.head_utils import check_num_sampled
from keras_softmax_heads.heads.sampling_head import CandidateSamplingHead
from keras_softmax_heads.validation import check_bool

# Moved to `sampling_head`; still importable from here.
from keras_softmax_heads.heads.sampling_head import (  # noqa: F401 (re-export)
    legacy_counts_config,
    placeholder_counts,
)

LOG_COUNT_FLOOR = -80.0
"""Lower bound of the log expected count of a *target* (a zero-count word
under `sampler="unigram"` would give `+inf` corrected logits and a NaN loss;
with the floor its loss is ~0, finite, so a zero `sample_weight` masks it)."""


def sampled_softmax_nll(target_logits, candidate_logits, candidate_mask=None):
    """The sampled-softmax loss from corrected logits (the math, no weights).

    `loss_i = -l_i + log(exp(l_i) + sum_{j: mask_ij} exp(c_ij))`: the
    negative log-probability of the target in a softmax over the target and
    the (unmasked) candidates.

    Args:
        target_logits: float `[N]`, `l_i = z_{i, t_i} - log Q(t_i)`.
        candidate_logits: float `[N, S]`, `c_ij = z_{i, s_j} - log Q(s_j)`.
        candidate_mask: optional bool `[N, S]` (or broadcastable); `False`
            entries (accidental hits, duplicates) are left out.

    Returns:
        float `[N]`.

    Example:

    >>> import numpy as np
    >>> loss = sampled_softmax_nll(np.array([0.0]), np.array([[0.0, 5.0]]),
    ...                            np.array([[True, False]]))
    >>> round(float(loss[0]), 6) == round(float(np.log(2.0)), 6)
    True
    """
    target_logits = ops.convert_to_tensor(target_logits)
    candidate_logits = ops.convert_to_tensor(candidate_logits)
    if candidate_mask is not None:
        candidate_logits = ops.where(
            candidate_mask,
            candidate_logits,
            ops.full_like(candidate_logits, -float("inf")),
        )
    # The target column is always finite, so the log-sum-exp (and its
    # gradient, a softmax) is well defined even if every candidate is masked.
    logits = ops.concatenate([target_logits[:, None], candidate_logits], axis=-1)
    return ops.logsumexp(logits, axis=-1) - target_logits


_SAMPLED_SAMPLERS = samplers.SAMPLERS + ("batch", "all")


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class SampledSoftmax(CandidateSamplingHead):
    """Target sampling: a softmax over the target and sampled impostors.

    Evaluation is exact: `call`, `log_probs` and `log_likelihood` are
    `log_softmax(z)`, `z = h W^T + b`. `training_loss(h, targets,
    training=True)` draws a candidate set `S` shared by the batch and, with
    `Q(w)` the expected count of word `w` in `S`, returns

    `loss_i = -(z_{t_i} - log Q(t_i)) + log(exp(z_{t_i} - log Q(t_i))
    + sum_{s in S, s != t_i} exp(z_s - log Q(s)))`

    (the formula of `tf.nn.sampled_softmax_loss`); its gradient touches
    `|S| + N` rows of `W` only. Samplers, the `unique` correction and the
    saved counts: `docs/sampling.md`.

    Args:
        vocab_size: int `V` (or omit and pass `token_embedding`).
        num_sampled: int `>= 1`, draws per training step (shared by the
            batch), or `"all"`. Default 1024.
        sampler: `"log_uniform"` (default), `"uniform"`, `"unigram"`
            (needs `counts`), `"batch"` (the batch's targets plus
            `num_sampled` uniform draws) or `"all"` (every word, `Q = 1`:
            the exact NLL).
        counts: optional non-negative training counts `[V]`, used by
            `"unigram"` (the default `"log_uniform"` ignores them: it
            assumes word ids ranked by frequency, as this library's
            vocabularies are; with another id order, e.g. a subword
            tokenizer's, pass `sampler="unigram"` with the counts).
        distortion: float `>= 0`, the unigram power (default 1; 0.75 as
            word2vec).
        unique: bool, remove repeated draws (default `True`).
        remove_accidental_hits: bool, leave out candidates equal to the
            row's target (default `True`).
        subtract_log_q: bool, apply the `log Q` correction (default `True`).
        seed: optional int, seed of the layer's `keras.random.SeedGenerator`.
        **kwargs: `token_embedding`, `use_bias`, `kernel_initializer`,
            `bias_initializer` (of `W` `[V, d]` and `b` `[V]`),
            `return_probabilities` (see `SoftmaxHead`) and standard
            `keras.layers.Layer` arguments.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 exact log-probabilities `[..., V]`. `training_loss(inputs,
        targets)`: the loss over one candidate set, float32 of shape
        `targets.shape` (`training=False`: the exact NLL).

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.sampled_softmax import SampledSoftmax
    >>> head = SampledSoftmax(vocab_size=50, num_sampled=8, seed=0)
    >>> h = np.random.rand(2, 3, 4).astype("float32")
    >>> targets = np.array([[1, 2, 3], [4, 5, 6]])
    >>> tuple(head.training_loss(h, targets).shape)
    (2, 3)
    >>> bool(np.allclose(np.exp(head(h)).sum(-1), 1.0, atol=1e-5))  # exact
    True
    >>> exact = SampledSoftmax(vocab_size=50, sampler="all")
    >>> exact(h).shape == head(h).shape
    True
    >>> _ = exact.kernel.assign(head.kernel), exact.bias.assign(head.bias)
    >>> bool(np.allclose(exact.training_loss(h, targets),
    ...                  -head.log_likelihood(h, targets), atol=1e-5))
    True

    References:
        - Chen, Grangier & Auli, 2016. Strategies for Training Large
          Vocabulary Neural Language Models (sections 2.4, 4.2).
          https://arxiv.org/abs/1512.04906
        - Jean, Cho, Memisevic & Bengio, 2015. On Using Very Large Target
          Vocabulary for Neural Machine Translation.
          https://arxiv.org/abs/1412.2007
        - Bengio & Senécal, 2008. Adaptive importance sampling to accelerate
          training of a neural probabilistic language model.
    """

    def __init__(
        self,
        vocab_size=None,
        num_sampled=1024,
        sampler="log_uniform",
        counts=None,
        distortion=1.0,
        unique=True,
        remove_accidental_hits=True,
        subtract_log_q=True,
        seed=None,
        **kwargs,
    ):
        samplers.check_sampler(sampler, _SAMPLED_SAMPLERS)
        num_sampled = check_num_sampled(num_sampled)
        if num_sampled == "all" or sampler == "all":
            num_sampled, sampler = "all", "all"
        super().__init__(
            vocab_size, sampler, counts, distortion, seed=seed, **kwargs
        )
        self.num_sampled = num_sampled
        self.unique = check_bool("unique", unique)
        self.remove_accidental_hits = check_bool(
            "remove_accidental_hits", remove_accidental_hits
        )
        self.subtract_log_q = check_bool("subtract_log_q", subtract_log_q)

    # ------------------------------------------------------------- sampling
    def sample_candidates(self, targets):
        """Draws the candidate set of one training step.

        Args:
            targets: int `[N]`, the flat targets of the batch (used by
                `sampler="batch"` and for the targets' corrections).

        Returns:
            dict with `candidates` int32 `[S]` (`None` for `sampler="all"`:
            every word, in id order), `candidate_log_counts` float32 `[S]`,
            `target_log_counts` float32 `[N]` (`log Q`) and `candidate_mask`
            bool `[S]` (`False` on removed duplicates) or `None`.
        """
        self.check_sampling_ready()
        targets = ops.reshape(ops.cast(targets, "int32"), (-1,))
        acc = self.accumulation_dtype
        if self.sampler == "all":
            zeros_t = ops.zeros(ops.shape(targets), acc)
            return {
                "candidates": None,
                "candidate_log_counts": None,
                "target_log_counts": zeros_t,
                "candidate_mask": None,
            }
        m = self.num_sampled
        if self.sampler == "batch":
            draws = keras.random.randint(
                (m,), 0, self.vocab_size, dtype="int32", seed=self.seed_generator
            )
            # Sort keys: batch targets (even) sort before draws (odd) of the
            # same word, so a word's first occurrence says if it is in the batch.
            keys = ops.sort(ops.concatenate([2 * targets, 2 * draws + 1], axis=0))
            candidates = keys // 2
            from_draws = ops.equal(keys % 2, 1)
            mask = samplers.first_occurrences(candidates)
            p_in = -math.expm1(m * math.log1p(-1.0 / self.vocab_size))
            log_counts = ops.where(
                from_draws,
                ops.full(ops.shape(candidates), math.log(p_in), acc),
                ops.zeros(ops.shape(candidates), acc),
            )
            return {
                "candidates": candidates,
                "candidate_log_counts": log_counts,
                "target_log_counts": ops.zeros(ops.shape(targets), acc),
                "candidate_mask": mask,
            }
        draws = self._sampler.sample(m, self.seed_generator)
        mask = None
        if self.unique:
            draws = ops.sort(draws)
            mask = samplers.first_occurrences(draws)
        log_counts = samplers.log_expected_counts(
            self._sampler.log_prob(draws, acc), m, self.unique
        )
        target_log_counts = samplers.log_expected_counts(
            self._sampler.log_prob(targets, acc), m, self.unique
        )
        return {
            "candidates": draws,
            "candidate_log_counts": log_counts,
            "target_log_counts": target_log_counts,
            "candidate_mask": mask,
        }

    # ----------------------------------------------------------------- loss
    def sampled_loss(
        self,
        inputs,
        targets,
        candidates,
        candidate_log_counts=None,
        target_log_counts=None,
        candidate_mask=None,
    ):
        """The sampled-softmax loss for a given candidate set (deterministic).

        Args:
            inputs: context vectors `[..., d]`.
            targets: int word ids `[...]`.
            candidates: int `[S]` word ids shared by all rows, or `None` for
                all `V` words in id order.
            candidate_log_counts: float `[S]` (`[V]` if `candidates` is None),
                `log Q` of the candidates; `None` means 0.
            target_log_counts: float `[N]` (flat targets) or scalar, `log Q`
                of the targets; `None` means 0.
            candidate_mask: optional bool `[S]`; `False` leaves a candidate
                out (duplicates).

        Returns:
            float32 `[...]` (the shape of `targets`). `subtract_log_q=False`
            ignores the log counts; `remove_accidental_hits` is honoured.
        """
        h, flat_targets, shape = self._flatten(inputs, targets)
        acc = self.accumulation_dtype
        target_z = self.target_scores(h, flat_targets)
        if candidates is None:
            candidate_z = self.full_scores(h)
            ids = ops.arange(self.vocab_size, dtype="int32")
        else:
            ids = ops.cast(ops.convert_to_tensor(candidates), "int32")
            candidate_z = self.candidate_scores(h, ids)
        if self.subtract_log_q:
            if target_log_counts is not None:
                target_lc = ops.cast(ops.convert_to_tensor(target_log_counts), acc)
                target_z = target_z - ops.maximum(target_lc, LOG_COUNT_FLOOR)
            if candidate_log_counts is not None:
                cand_lc = ops.cast(ops.convert_to_tensor(candidate_log_counts), acc)
                candidate_z = candidate_z - cand_lc[None, :]
        mask = None
        if candidate_mask is not None:
            mask = ops.convert_to_tensor(candidate_mask)[None, :]
        if self.remove_accidental_hits:
            hits = ops.not_equal(ids[None, :], flat_targets[:, None])
            mask = hits if mask is None else ops.logical_and(mask, hits)
        loss = sampled_softmax_nll(target_z, candidate_z, mask)
        return self._finish(loss, flat_targets, shape)

    def stochastic_loss(self, inputs, targets):
        """The sampled loss with a fresh candidate set, `targets.shape`."""
        flat = ops.reshape(ops.cast(ops.convert_to_tensor(targets), "int32"), (-1,))
        sample = self.sample_candidates(flat)
        return self.sampled_loss(inputs, targets, **sample)

    # ------------------------------------------------------------ serialising
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_sampled": self.num_sampled,
                "unique": self.unique,
                "remove_accidental_hits": self.remove_accidental_hits,
                "subtract_log_q": self.subtract_log_q,
            }
        )
        return config
