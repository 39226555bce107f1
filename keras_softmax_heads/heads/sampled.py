"""Target sampling (sampled softmax) with XLA-compatible candidate sampling.

Also home of `WordMajorSoftmaxHead`, the base of the heads whose training
loss touches only a few rows of the output matrix (`SampledSoftmax`, `NCE`,
`SelfNormalizedSoftmax`): the matrix is stored word-major, `kernel` `[V, d]`
(the layout of an embedding and of `tf.nn.sampled_softmax_loss`'s
`weights`), like `HierarchicalSoftmax`. Scoring a set of candidate words is
then a row gather whose gradient is sparse (`tf.IndexedSlices`, `[S, d]`).
With the contract's `[d, V]` layout the gradient of a column gather is a
dense `[d, V]` tensor built by `unsorted_segment_sum` and a transpose, so
every step would cost `O(V d)` time and memory whatever the number of
samples (measurement: `docs/head_contract.md`, "Weight layout"). `output_kernel()` still
returns the `[d, V]` matrix (a transpose) for code that needs it, and
`logits()` multiplies by the word-major matrix directly.
"""

import math
import numbers

import keras
import numpy as np
from keras import ops

from keras_softmax_heads import samplers
from keras_softmax_heads.heads.base import PointwiseSoftmaxHead
from keras_softmax_heads.heads.base import check_targets
from keras_softmax_heads.heads.base import nan_if_invalid

LOG_COUNT_FLOOR = -80.0
"""Lower bound of the log expected count of a *target* (a zero-count word
under `sampler="unigram"` would give `+inf` corrected logits and a NaN loss;
with the floor its loss is ~0, finite, so a zero `sample_weight` masks it)."""


def _check_seed(seed):
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(
            f"`seed` must be None or an integer >= 0. Received: seed={seed!r}"
        )
    return int(seed)


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return bool(value)


def _check_num_sampled(num_sampled):
    if num_sampled == "all":
        return "all"
    if (
        isinstance(num_sampled, (bool, np.bool_))
        or not isinstance(num_sampled, numbers.Integral)
        or num_sampled < 1
    ):
        raise ValueError(
            "`num_sampled` must be an integer >= 1 (or 'all' for "
            f"SampledSoftmax). Received: num_sampled={num_sampled!r}"
        )
    return int(num_sampled)


def _constant_weight(layer, name, values, dtype):
    """A non-trainable, non-autocast weight initialised to `values`."""
    values = np.asarray(values)

    def initializer(shape, dtype=None):
        del shape
        return ops.convert_to_tensor(values, dtype=dtype)

    return layer.add_weight(
        name=name,
        shape=values.shape,
        dtype=dtype,
        initializer=initializer,
        trainable=False,
        autocast=False,
    )


def build_sampler_tables(layer, sampler, counts, distortion):
    """Creates a head's sampling tables as non-trainable weights.

    For `"log_uniform"` and `"unigram"`: `sampling_log_probs` (float32 `[V]`,
    `log q`), `alias_thresholds` (float32 `[V]`) and `alias_indices` (int32
    `[V]`); for `"unigram"` also `counts` (float32 `[V]`). Sets the layer
    attributes of the same names (`None` when absent) and returns the
    `samplers.CandidateSampler` reading them.
    """
    vocab = layer.vocab_size
    layer.counts = None
    layer.sampling_log_probs = None
    layer.alias_thresholds = None
    layer.alias_indices = None
    if sampler not in ("log_uniform", "unigram"):
        return samplers.CandidateSampler(vocab)
    if sampler == "unigram":
        layer.counts = _constant_weight(layer, "counts", counts, "float32")
    probs = samplers.sampling_probs(sampler, vocab, counts, distortion)
    threshold, alias = samplers.alias_table(probs)
    with np.errstate(divide="ignore"):
        log_probs = np.log(probs)
    layer.sampling_log_probs = _constant_weight(
        layer, "sampling_log_probs", log_probs, "float32"
    )
    layer.alias_thresholds = _constant_weight(
        layer, "alias_thresholds", threshold, "float32"
    )
    layer.alias_indices = _constant_weight(layer, "alias_indices", alias, "int32")
    return samplers.CandidateSampler(
        vocab, layer.sampling_log_probs, layer.alias_thresholds, layer.alias_indices
    )


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


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class WordMajorSoftmaxHead(PointwiseSoftmaxHead):
    """A pointwise head whose output matrix is stored word-major, `[V, d]`.

    `z = h W^T + b` with `W` the layer's `kernel` `[V, d]` (or the tied
    `token_embedding`'s `[V, d]` matrix, the same code path). See the module
    docstring for why. Subclasses add a training objective that scores only
    some words: `target_scores` and `candidate_scores` gather rows of `W`
    (sparse gradients). On its own the class is a Linear-Softmax with the
    word-major layout. To move weights to a `FullSoftmax` (kernel `[d, V]`),
    transpose the kernel.
    """

    word_major = True

    def target_scores(self, h, targets):
        """`z_{i, t_i}` for flat `h` `[N, d]` and targets `[N]`: float32 `[N]`.

        Gathers `N` rows of `W` (sparse gradient); the dot products are
        accumulated in float32 even under mixed precision.
        """
        acc = self.accumulation_dtype
        ids = ops.clip(targets, 0, self.vocab_size - 1)
        rows = ops.take(self.output_embeddings(), ids, axis=0)
        rows = ops.cast(ops.cast(rows, self.compute_dtype), acc)
        h = ops.cast(ops.cast(h, self.compute_dtype), acc)
        z = ops.sum(h * rows, axis=-1)
        if self.bias is not None:
            z = z + ops.cast(ops.take(self.bias, ids, axis=0), acc)
        return z

    def candidate_scores(self, h, ids):
        """`z_{i, s_j}` for flat `h` `[N, d]` and shared ids `[S]`: `[N, S]`."""
        ids = ops.clip(ids, 0, self.vocab_size - 1)
        acc = self.accumulation_dtype
        rows = ops.take(self.output_embeddings(), ids, axis=0)
        rows = ops.cast(rows, self.compute_dtype)
        z = ops.matmul(ops.cast(h, self.compute_dtype), ops.transpose(rows))
        z = ops.cast(z, acc)
        if self.bias is not None:
            z = z + ops.cast(ops.take(self.bias, ids, axis=0), acc)[None, :]
        return z

    def full_scores(self, h):
        """`z` for flat `h` `[N, d]`: `[N, V]`."""
        return self.logits(h)

    # --------------------------------------------------------------- helpers
    def _flatten(self, inputs, targets):
        """Checks and flattens `inputs` `[..., d]`, `targets` `[...]`.

        Returns `(h [N, d], targets [N] int32 validated, targets_shape)`.
        """
        inputs = self._check_inputs(inputs)
        targets = check_targets(targets, self.vocab_size)
        lead = tuple(inputs.shape[:-1])
        tshape = tuple(targets.shape)
        if len(lead) != len(tshape) or any(
            a is not None and b is not None and a != b for a, b in zip(lead, tshape)
        ):
            raise ValueError(
                "`targets` must have the leading shape of `inputs`. Received: "
                f"inputs.shape={tuple(inputs.shape)}, targets.shape={tshape}"
            )
        h = ops.reshape(inputs, (-1, self.input_dim))
        return h, ops.reshape(targets, (-1,)), ops.shape(targets)

    def _finish(self, loss, targets, shape):
        """Reshapes a flat per-token loss and turns invalid targets into NaN."""
        loss = nan_if_invalid(loss, targets, self.vocab_size)
        return ops.reshape(loss, shape)


_SAMPLED_SAMPLERS = samplers.SAMPLERS + ("batch", "all")


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class SampledSoftmax(WordMajorSoftmaxHead):
    """Target sampling: a softmax over the target and sampled impostors.

    Evaluation is exact: `call`, `log_probs` and `log_likelihood` are the full
    `log_softmax(z)`, `z = h W^T + b`, so perplexities compare with every other
    head. Only `training_loss(h, targets, training=True)` samples: with a set
    `S` of candidate words shared by the batch and `Q(w)` the expected count
    of word `w` in `S`,

    `loss_i = -(z_{t_i} - log Q(t_i)) + log(exp(z_{t_i} - log Q(t_i))
    + sum_{s in S, s != t_i} exp(z_s - log Q(s)))`

    (Bengio & Senécal 2008; Jean et al. 2015; the formula of
    `tf.nn.sampled_softmax_loss`). `exp(z_s - log Q(s))` summed over `S` is an
    unbiased estimate of the partition function; a candidate equal to the
    row's target ("accidental hit") is removed so the target is not counted
    twice. The gradient touches `|S| + N` rows of `W` only (sparse).

    Samplers (`sampler=`):

    * `"log_uniform"` (default): Zipfian over ids sorted by decreasing
      frequency, as `tf.random.log_uniform_candidate_sampler`.
    * `"uniform"`: `q = 1 / V`.
    * `"unigram"`: `q ∝ counts ** distortion` (needs `counts`).
    * `"batch"`: Chen et al.'s choice (after Jean et al. 2015): every target of
      the mini-batch is an impostor for every row, plus `num_sampled` uniform
      draws. Duplicates are removed; with `subtract_log_q`, batch words get
      `log Q = 0` (they are in `S` surely) and the uniform extras
      `log(1 - (1 - 1/V) ** num_sampled)`, a Horvitz-Thompson estimate of the
      partition given the batch. `|S| = N + num_sampled` slots; `unique`
      does not apply.
    * `"all"` (or `num_sampled="all"`): every word is a candidate with
      `Q = 1`; the loss then equals the exact NLL (a check, not a speed-up).

    Sampling is i.i.d. with replacement (`num_sampled` draws; static shapes).
    With `unique=True` (default) repeated draws are removed and
    `Q(w) = 1 - (1 - q(w)) ** num_sampled`, the probability that `w` is drawn
    at least once, so `S` holds at most `num_sampled` distinct words. With
    `unique=False` duplicates stay, each with `Q(w) = num_sampled * q(w)`
    (expected multiplicity). Both are the exact expected count / inclusion
    probability of the sampler used, so the partition estimate is unbiased
    (the loss, a log of it, is not: sampled softmax is a biased but
    consistent estimate of the NLL). (TensorFlow's `unique=True` samplers instead draw until
    `num_sampled` distinct words are found, a data-dependent number of tries
    that XLA cannot compile, and correct with the realised number of tries.)

    Implementation: one code path for eager, graph and XLA. Sampling uses
    `keras.random` with the layer's `SeedGenerator` and Walker alias tables
    (`keras_softmax_heads.samplers`), not `tf.random.*_candidate_sampler`
    (which XLA cannot compile); the loss is the same gather + matmul +
    log-sum-exp as `tf.nn.sampled_softmax_loss`, which it matches in speed on
    CPU (see `benchmarks/bench_large_vocab.py`).

    Weights: `kernel` `[V, d]` (word-major, see `WordMajorSoftmaxHead`; a
    `FullSoftmax` holds its transpose) and `bias` `[V]`.

    Word statistics: `counts`, a length-`V` array of training counts, is only
    needed by `sampler="unigram"`; it is validated for every sampler. The
    sampling tables (`sampling_log_probs`, `alias_thresholds`,
    `alias_indices`, and `counts` itself, float32) are non-trainable
    weights, saved with the model; `get_config` records `counts=None` (a
    `V = 793k` list in the config would be heavy) and `from_config` builds
    placeholder tables that the saved weights overwrite on load.

    Args:
        vocab_size: int, number of words `V` (or omit and pass
            `token_embedding`).
        num_sampled: int `>= 1`, the number of draws per training step
            (shared by the batch), or `"all"`. Default 1024.
        sampler: `"log_uniform"` (default), `"uniform"`, `"unigram"`,
            `"batch"` or `"all"`.
        counts: optional length-`V` array of non-negative training counts
            (needed by `sampler="unigram"`).
        distortion: float `>= 0`, the unigram power (`0.75` as word2vec;
            default 1).
        unique: bool, remove repeated draws (default `True`; `"batch"`
            always removes them).
        remove_accidental_hits: bool, leave out candidates equal to the
            row's target (default `True`).
        subtract_log_q: bool, apply the `log Q` correction (default `True`;
            `False` gives a plain softmax over the candidates, Jean et al.'s
            biased variant).
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
        targets, training=True)` returns the sampled loss, float32 of shape
        `targets.shape` (`training=False`: the exact NLL).

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.sampled import SampledSoftmax
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
        token_embedding=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
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
        samplers.check_sampler(sampler, _SAMPLED_SAMPLERS)
        num_sampled = _check_num_sampled(num_sampled)
        if num_sampled == "all" or sampler == "all":
            num_sampled, sampler = "all", "all"
        self.num_sampled = num_sampled
        self.sampler = sampler
        self.distortion = samplers.check_distortion(distortion)
        self.unique = _check_bool("unique", unique)
        self.remove_accidental_hits = _check_bool(
            "remove_accidental_hits", remove_accidental_hits
        )
        self.subtract_log_q = _check_bool("subtract_log_q", subtract_log_q)
        self.seed = _check_seed(seed)
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

    # ---------------------------------------------------------------- build
    def build_head(self, input_shape):
        del input_shape
        self._sampler = build_sampler_tables(
            self, self.sampler, self._counts, self.distortion
        )

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
        if not self.built:
            raise ValueError("Build the layer (call it once) before sampling.")
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

    def training_loss(self, inputs, targets, training=True):
        """Sampled loss (`training=True`) or exact NLL, shape `targets.shape`."""
        if not training:
            return -self.log_likelihood(inputs, targets)
        inputs = self._check_inputs(inputs)
        flat = ops.reshape(ops.cast(ops.convert_to_tensor(targets), "int32"), (-1,))
        sample = self.sample_candidates(flat)
        return self.sampled_loss(inputs, targets, **sample)

    # ------------------------------------------------------------ serialising
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_sampled": self.num_sampled,
                "sampler": self.sampler,
                # The counts travel as a non-trainable weight, not here.
                "counts": None,
                "distortion": self.distortion,
                "unique": self.unique,
                "remove_accidental_hits": self.remove_accidental_hits,
                "subtract_log_q": self.subtract_log_q,
                "seed": self.seed,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        return super().from_config(placeholder_counts(config))


def placeholder_counts(config):
    """Config with placeholder counts (ones) where the sampler needs counts.

    The real counts (and the sampling tables) are restored with the weights.
    """
    config = dict(config)
    if config.get("counts") is None and config.get("sampler") == "unigram":
        vocab = config.get("vocab_size")
        embedding = config.get("token_embedding")
        if vocab is None and isinstance(embedding, dict):
            vocab = embedding["config"]["input_dim"]
        config["counts"] = np.ones(int(vocab))
    return config
