"""Candidate sampling shared by the sampled heads (target sampling, NCE).

Everything here samples with *static shapes* and with `keras.random` ops
driven by a `keras.random.SeedGenerator`, so a training step that samples
compiles with `jit_compile=True`. TensorFlow's own samplers
(`tf.random.log_uniform_candidate_sampler`, `fixed_unigram_candidate_sampler`,
and therefore `tf.nn.sampled_softmax_loss` / `tf.nn.nce_loss` when they sample
for you) are stateful CPU kernels that XLA cannot compile; `tf.searchsorted`
does compile but XLA lowers it to a comparison against the whole table
(`O(V)` per sample, `O(S V)` for `S` samples; see `docs/head_contract.md`).

Distributions `q` over the `V` word ids:

* `"uniform"`: `q(w) = 1 / V`, sampled with `keras.random.randint`.
* `"log_uniform"`: the Zipfian `q(w) = log((w + 2) / (w + 1)) / log(V + 1)`
  of `tf.random.log_uniform_candidate_sampler` (ids must be sorted by
  decreasing frequency).
* `"unigram"`: `q(w) ∝ counts[w] ** distortion` (`distortion = 0.75` is the
  word2vec choice, `1` the plain unigram, `0` uniform over the words with a
  positive count).

The two tabulated distributions are sampled with Walker's alias method
(`alias_table`): one `randint` and one `uniform` draw per sample, `O(1)` and
exact up to float32 rounding of the per-bucket thresholds (relative error
~1e-7 of each word's probability). A float32 inverse CDF cannot resolve the
rare words of a large vocabulary (`q ~ 1e-9` is below the float32 spacing
near 1) and a float64 one does not run on TPUs. The closed-form inverse CDF
of the log-uniform distribution, `floor(exp(u log(V + 1))) - 1`, has the same
float32 resolution problem near `w ~ V`, so it is tabulated as well.

Draws are i.i.d. ("with replacement"). With `num` draws, the expected
number of times word `w` is drawn is `num * q(w)`, and the probability that
it is drawn at least once is `1 - (1 - q(w)) ** num`; `log_expected_counts`
gives the log of either, the log-Q correction of sampled softmax.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_softmax_heads.validation import arrays
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_number

SAMPLERS = ("uniform", "log_uniform", "unigram")
"""The sampling distributions understood by `CandidateSampler`."""


def check_counts(counts, vocab_size):
    """Word counts of a layer: `None`, or `V` finite numbers `>= 0`.

    `keras_softmax_heads.validation.arrays.check_counts` with `None`
    allowed (a layer without counts); all-zero counts are accepted here
    (`unigram_probs` refuses them when it needs a distribution).

    Args:
        counts: array-like of `V` training counts, or `None`.
        vocab_size: int `V`.

    Returns:
        a float64 NumPy array (or `None` when `counts` is `None`).

    Example:

    >>> check_counts([3, 0, 1], 3)
    array([3., 0., 1.])
    """
    return arrays.check_counts(counts, vocab_size, allow_none=True)


def counts_to_config(counts, stored=None):
    """Word counts as plain JSON-able Python for a layer's `get_config`.

    Args:
        counts: the counts the layer was built with (array `[V]`), or None.
        stored: optional copy held by the layer (its float32 `counts`
            weight). When it disagrees with `counts` (weights loaded from
            a file), the stored values win: they are what the layer uses.

    Returns:
        A list of `V` ints when every count is integral, else of floats;
        None when there are no counts.

    Example:

    >>> counts_to_config(np.array([3.0, 0.0, 1.0]))
    [3, 0, 1]
    >>> counts_to_config([0.5, 2.0])
    [0.5, 2.0]
    >>> counts_to_config(None) is None
    True
    """
    if stored is not None:
        stored = np.asarray(keras.ops.convert_to_numpy(stored), np.float32)
        if counts is None or not np.array_equal(
            stored, np.asarray(counts, np.float64).astype(np.float32)
        ):
            counts = stored
    if counts is None:
        return None
    array = np.asarray(counts, np.float64).ravel()
    if np.all(array == np.floor(array)) and np.all(np.abs(array) < 2.0**53):
        return [int(v) for v in array.tolist()]
    return array.tolist()


def check_sampler(sampler, allowed=SAMPLERS):
    """`sampler` if it is one of `allowed`, else raises `ValueError`."""
    return check_choice("sampler", sampler, allowed)


def check_distortion(distortion):
    """The unigram exponent: a finite number `>= 0`, as a float."""
    return check_number("distortion", distortion, low=0)


def log_uniform_probs(vocab_size):
    """`q(w) = log((w + 2) / (w + 1)) / log(V + 1)`, float64 `[V]`."""
    w = np.arange(vocab_size, dtype=np.float64)
    return np.log1p(1.0 / (w + 1.0)) / np.log(vocab_size + 1.0)


def unigram_probs(counts, distortion=1.0):
    """`q(w) ∝ counts[w] ** distortion` (zero counts stay zero), float64."""
    counts = np.asarray(counts, dtype=np.float64)
    powered = np.where(counts > 0, counts ** distortion, 0.0)
    total = powered.sum()
    if not total > 0:
        raise ValueError(
            "`counts` must have at least one positive entry to define a "
            "sampling distribution. Received: counts summing to "
            f"{counts.sum():g}"
        )
    return powered / total


def sampling_probs(sampler, vocab_size, counts=None, distortion=1.0):
    """The float64 distribution `q` `[V]` of a named sampler."""
    check_sampler(sampler)
    if sampler == "uniform":
        return np.full(vocab_size, 1.0 / vocab_size)
    if sampler == "log_uniform":
        return log_uniform_probs(vocab_size)
    if counts is None:
        raise ValueError(
            "sampler='unigram' needs the word `counts`. Received: counts=None"
        )
    return unigram_probs(counts, distortion)


def alias_table(probs):
    """Walker's alias table (Vose's construction) of a distribution.

    Sampling: draw a bucket `i` uniformly from `[0, V)` and `u ~ U[0, 1)`;
    return `i` if `u < threshold[i]` else `alias[i]`. Word `w` is then drawn
    with probability `(threshold[w] + sum_{i: alias[i] = w} (1 -
    threshold[i])) / V = q(w)`.

    Args:
        probs: float array `[V]`, non-negative, summing to 1.

    Returns:
        `(threshold, alias)`: float64 `[V]` in `[0, 1]` and int64 `[V]`.

    Example:

    >>> threshold, alias = alias_table([0.5, 0.25, 0.25, 0.0])
    >>> recovered = threshold.copy()
    >>> np.add.at(recovered, alias, 1 - threshold)
    >>> recovered / 4
    array([0.5 , 0.25, 0.25, 0.  ])
    """
    probs = np.asarray(probs, dtype=np.float64)
    size = probs.size
    scaled = probs * (size / probs.sum())
    threshold = np.ones(size)
    alias = np.arange(size, dtype=np.int64)
    if np.all(scaled == scaled[0]):
        return threshold, alias
    # Plain Python lists: the loop touches every word once (O(V) Python steps,
    # cheaper on lists than on NumPy scalars).
    values = scaled.tolist()
    # Zero-probability words last, so they are popped (paired with a large
    # bucket, threshold 0) first and can never be left over with a full bucket.
    small = np.flatnonzero((scaled < 1.0) & (scaled > 0.0)).tolist()
    small += np.flatnonzero(scaled == 0.0).tolist()
    large = np.flatnonzero(scaled >= 1.0).tolist()
    thr = threshold.tolist()
    ali = alias.tolist()
    while small and large:
        s = small.pop()
        g = large[-1]
        thr[s] = values[s]
        ali[s] = g
        values[g] = (values[g] + values[s]) - 1.0
        if values[g] < 1.0:
            small.append(large.pop())
    # Leftovers (rounding): their buckets are full.
    return np.asarray(thr, np.float64), np.asarray(ali, np.int64)


class CandidateSampler:
    """i.i.d. word-id draws from a fixed distribution, XLA-friendly.

    A thin object over the layer's tables (or none for `"uniform"`): it does
    not own weights; the head creates the tables as non-trainable weights so
    that they are saved with the model.

    Args:
        vocab_size: int `V`.
        log_probs: optional float32 tensor/variable `[V]`, `log q`; `None`
            for the uniform distribution.
        alias_thresholds: float32 `[V]`, the alias-table thresholds.
        alias_indices: int32 `[V]`, the alias-table aliases.

    Example:

    >>> import keras
    >>> sampler = CandidateSampler(5)
    >>> ids = sampler.sample(8, keras.random.SeedGenerator(0))
    >>> ids.shape, keras.ops.convert_to_numpy(ids).dtype
    (TensorShape([8]), dtype('int32'))
    >>> float(sampler.log_prob(ids)[0]) == float(np.float32(-np.log(5)))
    True
    """

    def __init__(self, vocab_size, log_probs=None, alias_thresholds=None,
                 alias_indices=None):
        self.vocab_size = int(vocab_size)
        self.log_probs = log_probs
        self.alias_thresholds = alias_thresholds
        self.alias_indices = alias_indices

    @property
    def is_uniform(self):
        return self.log_probs is None

    def sample(self, num, seed):
        """`num` i.i.d. word ids, int32 `[num]` (with replacement)."""
        # keras.random draws with a static shape (an alias lookup, not
        # tf.random.*_candidate_sampler or tf.searchsorted): compiles under
        # XLA in O(num) work.
        buckets = keras.random.randint(
            (num,), 0, self.vocab_size, dtype="int32", seed=seed
        )
        if self.is_uniform:
            return buckets
        u = keras.random.uniform((num,), dtype="float32", seed=seed)
        keep = u < ops.take(ops.convert_to_tensor(self.alias_thresholds), buckets)
        aliases = ops.take(ops.convert_to_tensor(self.alias_indices), buckets)
        return ops.where(keep, buckets, ops.cast(aliases, "int32"))

    def log_prob(self, ids, dtype="float32"):
        """`log q(ids)`, same shape as `ids` (ids assumed in `[0, V)`)."""
        ids = ops.clip(ops.cast(ids, "int32"), 0, self.vocab_size - 1)
        if self.is_uniform:
            return ops.full(ops.shape(ids), -math.log(self.vocab_size), dtype=dtype)
        return ops.cast(ops.take(ops.convert_to_tensor(self.log_probs), ids), dtype)


def log_expected_counts(log_q, num_tries, unique):
    """Log-Q correction of `num_tries` i.i.d. draws from `q`.

    * `unique=False` (candidates kept with their multiplicity): the expected
      number of draws of the word, `log(num_tries * q)`.
    * `unique=True` (duplicates removed): the probability that the word is
      drawn at least once, `log(1 - (1 - q) ** num_tries)`, computed as
      `log(-expm1(num_tries * log1p(-q)))` (accurate for tiny `q`).

    Both make `sum_{w in candidates} exp(z_w - correction_w)` an unbiased
    estimate of `sum_{w in V} exp(z_w)`.

    Example:

    >>> import numpy as np
    >>> q = np.array([0.5, 1e-9], "float32")
    >>> counts = np.exp(np.asarray(log_expected_counts(np.log(q), 4, unique=True)))
    >>> bool(np.allclose(counts, [1 - 0.5 ** 4, 4e-9], rtol=1e-5))
    True
    """
    log_q = ops.convert_to_tensor(log_q)
    if not unique:
        return log_q + math.log(num_tries)
    q = ops.exp(log_q)
    return ops.log(-ops.expm1(num_tries * ops.log1p(-q)))


def first_occurrences(sorted_ids):
    """`True` at the first position of each distinct id of a sorted vector."""
    previous = ops.concatenate([sorted_ids[:1] - 1, sorted_ids[:-1]], axis=0)
    return ops.not_equal(sorted_ids, previous)
