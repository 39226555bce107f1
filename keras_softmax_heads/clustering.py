"""Word clustering for a two-level hierarchical softmax (HSM).

A two-level HSM factorises `p(w | x) = p(c(w) | x) * p(w | c(w), x)`, so it
needs a fixed assignment of every word to one of `C` clusters (classes).
Chen, Grangier & Auli (2016), "Strategies for Training Large Vocabulary
Neural Language Models", sections 2.2 and 4.3, compare four strategies, all
implemented here:

* `"random"`: shuffle the vocabulary, split it into equally sized parts;
* `"frequency"`: sort words by count, cut into classes of equal unigram
  mass (Mikolov et al., 2011);
* `"kmeans"`: k-means on Hellinger-PCA embeddings of word co-occurrence
  counts (Lebret & Collobert, 2014);
* `"weighted_kmeans"`: the same, every word weighted by its count.

The paper found random < frequency < k-means ~ weighted k-means (Table 4),
and that plain k-means only matches the weighted variant once every
cluster's unigram mass is capped at 10% (`max_cluster_fraction`).

Everything here is numpy / scipy / scikit-learn (no Keras, no TensorFlow) and
deterministic given `seed`. `ClusterAssignment` turns an assignment vector
into the static, padded `[C, max_cluster_size]` layout a TPU-friendly HSM
layer needs, and serialises it without pickle. See `docs/clustering.md`.

Example:

>>> import numpy as np
>>> from keras_softmax_heads import clustering
>>> counts = np.array([50, 20, 10, 8, 5, 4, 2, 1])
>>> layout = clustering.make_clusters("frequency", counts=counts, num_clusters=3)
>>> layout.cluster_of_word.tolist()
[0, 1, 2, 2, 2, 2, 2, 2]
>>> layout.cluster_words.tolist()
[[0, -1, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1], [2, 3, 4, 5, 6, 7]]
"""

import dataclasses
import json
import math
import numbers
import pathlib
import warnings

import numpy as np
import scipy.sparse

from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_seed

__all__ = [
    "CLUSTERING_STRATEGIES",
    "PAD_WORD",
    "ClusterAssignment",
    "random_clusters",
    "frequency_clusters",
    "cooccurrence_matrix",
    "hellinger_embeddings",
    "kmeans_clusters",
    "hierarchical_layout",
    "default_num_clusters",
    "make_clusters",
]

CLUSTERING_STRATEGIES = ("random", "frequency", "kmeans", "weighted_kmeans")
"""Strategy names accepted by `make_clusters`."""

PAD_WORD = -1
"""Fill value of `ClusterAssignment.cluster_words` beyond a cluster's size."""

_FORMAT = "keras_softmax_heads.ClusterAssignment"
_FORMAT_VERSION = 1
# Relative slack when comparing a cluster's mass against the cap, so float
# rounding of `fraction * total` never rejects an exactly-full cluster.
_CAP_RTOL = 1e-9


# ----------------------------------------------------------------------------
# Validation helpers.
# ----------------------------------------------------------------------------


def _check_num_clusters(num_clusters, vocab_size):
    num_clusters = check_int("num_clusters", num_clusters, minimum=1)
    if num_clusters > vocab_size:
        raise ValueError(
            "`num_clusters` cannot exceed the vocabulary size (every cluster "
            f"needs at least one word). Received: num_clusters={num_clusters} "
            f"> vocab_size={vocab_size}"
        )
    return num_clusters


def _check_fraction(max_cluster_fraction):
    if max_cluster_fraction is None:
        return None
    if isinstance(max_cluster_fraction, (bool, np.bool_)) or not isinstance(
        max_cluster_fraction, numbers.Real
    ):
        raise ValueError(
            "`max_cluster_fraction` must be a number in (0, 1] or None. "
            f"Received: max_cluster_fraction={max_cluster_fraction!r}"
        )
    value = float(max_cluster_fraction)
    if not 0.0 < value <= 1.0:
        raise ValueError(
            "`max_cluster_fraction` must be in (0, 1] (or None for no cap). "
            f"Received: max_cluster_fraction={max_cluster_fraction}"
        )
    return value


def _summarise(array, limit=8):
    """Short text for an array in error messages."""
    flat = np.asarray(array).ravel()
    head = ", ".join(str(v) for v in flat[:limit].tolist())
    return f"[{head}{', ...' if flat.size > limit else ''}]"


def _as_counts(counts, vocab_size=None, name="counts"):
    """Validates unigram counts: 1-D, finite, non-negative, right length."""
    try:
        array = np.asarray(counts)
    except Exception as e:  # pragma: no cover - exotic inputs
        raise ValueError(f"`{name}` must be a 1-D array of numbers. Received: {counts!r}") from e
    if array.dtype == object or not (
        np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_
    ):
        raise ValueError(
            f"`{name}` must be a 1-D array of numbers. Received: {name} with "
            f"dtype={array.dtype}"
        )
    if array.ndim != 1:
        raise ValueError(
            f"`{name}` must be 1-D (one count per word). Received: "
            f"{name}.shape={array.shape}"
        )
    if array.size == 0:
        raise ValueError(f"`{name}` must not be empty. Received: {name}=[]")
    if vocab_size is not None and array.size != vocab_size:
        raise ValueError(
            f"`{name}` must have one entry per word. Received: "
            f"len({name})={array.size} != vocab_size={vocab_size}"
        )
    array = array.astype(np.float64)
    if not np.all(np.isfinite(array)):
        bad = np.flatnonzero(~np.isfinite(array))
        raise ValueError(
            f"`{name}` must be finite. Received non-finite values at word ids "
            f"{_summarise(bad)}: {_summarise(array[bad])}"
        )
    if np.any(array < 0):
        bad = np.flatnonzero(array < 0)
        raise ValueError(
            f"`{name}` must be non-negative. Received negative values at word "
            f"ids {_summarise(bad)}: {name}[{int(bad[0])}]={array[bad[0]]:g}"
        )
    if array.sum() <= 0:
        raise ValueError(f"`{name}` must not be all zero. Received: {name}={_summarise(array)}")
    return array


def _as_int_array(values, name):
    """Converts to an int64 array, rejecting float / bool / object input."""
    array = np.asarray(values)
    if array.size == 0 and array.dtype == np.float64:  # `[]` -> float64
        array = array.astype(np.int64)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"`{name}` must contain integers. Received: {name} with "
            f"dtype={array.dtype}, first values {_summarise(array)}"
        )
    return array.astype(np.int64)


def _as_ids(ids, vocab_size):
    """Validates a 1-D stream of token ids in `[0, vocab_size)`."""
    array = _as_int_array(ids, "ids")
    if array.ndim != 1:
        raise ValueError(
            "`ids` must be a 1-D token-id stream (flatten / concatenate your "
            f"sentences first). Received: ids.shape={array.shape}"
        )
    if array.size == 0:
        raise ValueError("`ids` must not be empty. Received: ids=[]")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"`ids` must lie in [0, vocab_size={vocab_size}). Received: an id "
            f"equal to {bad}"
        )
    return array


def default_num_clusters(vocab_size):
    """The paper's default number of clusters, `ceil(sqrt(vocab_size))`.

    With `C ~ sqrt(V)` balanced clusters an HSM evaluates `O(2 sqrt(V))`
    outputs per token instead of `V`.

    Args:
        vocab_size: positive int.

    Returns:
        `ceil(sqrt(vocab_size))` as an int.

    Example:

    >>> default_num_clusters(100), default_num_clusters(101)
    (10, 11)
    """
    vocab_size = check_int("vocab_size", vocab_size, minimum=1)
    root = math.isqrt(vocab_size)
    return root if root * root == vocab_size else root + 1


# ----------------------------------------------------------------------------
# Strategies. Each returns an int32 assignment vector `[V]` with values in
# `[0, C)` and every cluster non-empty.
# ----------------------------------------------------------------------------


def random_clusters(vocab_size, num_clusters, seed=0):
    """Random balanced assignment of words to clusters.

    The vocabulary is shuffled with `numpy.random.default_rng(seed)` and dealt
    round-robin into `num_clusters` clusters, so cluster sizes differ by at
    most one. The paper's weakest baseline (Table 4).

    Args:
        vocab_size: number of words `V`.
        num_clusters: number of clusters `C`, `1 <= C <= V`.
        seed: non-negative int; same seed, same assignment.

    Returns:
        int32 array `[V]`, the cluster of each word.

    Example:

    >>> a = random_clusters(10, 3, seed=0)
    >>> sorted(np.bincount(a).tolist())
    [3, 3, 4]
    """
    vocab_size = check_int("vocab_size", vocab_size, minimum=1)
    num_clusters = _check_num_clusters(num_clusters, vocab_size)
    rng = np.random.default_rng(check_seed(seed, allow_none=False))
    assignment = np.empty(vocab_size, dtype=np.int32)
    assignment[rng.permutation(vocab_size)] = np.arange(vocab_size) % num_clusters
    return assignment


def _split_evenly(n, parts):
    """Start offsets splitting `n` items into `parts` contiguous runs."""
    return (np.arange(parts, dtype=np.int64) * n) // parts


def frequency_clusters(counts, num_clusters):
    """Frequency binning: clusters of (approximately) equal unigram mass.

    Words are sorted by descending count (ties by ascending word id) and the
    sorted list is cut into `num_clusters` contiguous runs of about
    `total / num_clusters` mass each (Mikolov et al., 2011; Goodman, 2001).
    Cluster 0 therefore holds the most frequent words and the cluster id is
    non-decreasing along the frequency ranking.

    Heavy words: a word whose count alone reaches the per-cluster target
    (`remaining mass / remaining clusters`) gets a cluster of its own; the
    target is then recomputed on the rest, repeatedly (in a Zipfian vocabulary
    the first few words are usually singletons). The remaining words are
    binned by where the midpoint of each word's mass interval falls on the
    cumulative-mass axis, so each of those clusters has the tail target mass
    `T = tail_mass / tail_clusters` within plus or minus the largest tail
    count, and none is empty.

    Args:
        counts: array `[V]` of non-negative unigram counts (or probabilities),
            not all zero.
        num_clusters: number of clusters `C`, `1 <= C <= V`.

    Returns:
        int32 array `[V]`, the cluster of each word. Deterministic.

    Example:

    >>> frequency_clusters([1, 1, 1, 1, 4, 0], 3).tolist()
    [1, 1, 2, 2, 0, 2]
    """
    counts = _as_counts(counts)
    vocab_size = counts.size
    num_clusters = _check_num_clusters(num_clusters, vocab_size)
    order = np.argsort(-counts, kind="stable")
    sorted_counts = counts[order]
    labels = np.empty(vocab_size, dtype=np.int64)

    # 1. Heavy words get their own cluster while they reach the target.
    head = 0
    remaining_mass = float(sorted_counts.sum())
    while num_clusters - head > 1:
        target = remaining_mass / (num_clusters - head)
        if remaining_mass <= 0 or sorted_counts[head] < target:
            break
        labels[head] = head
        remaining_mass -= float(sorted_counts[head])
        head += 1

    # 2. Bin the tail by the midpoints of the words' mass intervals.
    tail = sorted_counts[head:]
    tail_clusters = num_clusters - head
    n = tail.size
    if remaining_mass > 0:
        cumulative = np.cumsum(tail)
        midpoints = cumulative - 0.5 * tail
        width = cumulative[-1] / tail_clusters
        cuts = np.arange(1, tail_clusters, dtype=np.float64) * width
        starts = np.concatenate([[0], np.searchsorted(midpoints, cuts, side="left")])
    else:  # Only zero-count words are left: split them evenly by rank.
        starts = _split_evenly(n, tail_clusters)
    # Guarantee non-empty clusters even under float rounding (a no-op in
    # exact arithmetic because every tail word is lighter than `width`).
    starts = starts.astype(np.int64)
    for j in range(1, tail_clusters):
        starts[j] = min(max(starts[j], starts[j - 1] + 1), n - (tail_clusters - j))
    sizes = np.diff(np.concatenate([starts, [n]]))
    labels[head:] = head + np.repeat(np.arange(tail_clusters), sizes)

    assignment = np.empty(vocab_size, dtype=np.int32)
    assignment[order] = labels
    return assignment


def cooccurrence_matrix(ids, vocab_size, window=5, context_size=10000):
    """Symmetric-window word co-occurrence counts from a token-id stream.

    Entry `[w, j]` counts how often context word `context_words[j]` occurs
    within `window` positions (left or right) of an occurrence of `w`, where
    `context_words` are the `context_size` most frequent words of `ids`
    (descending count, ties by ascending id), as is standard for Hellinger
    PCA (Lebret & Collobert, 2014) to keep the matrix small. Windows run
    across sentence boundaries; pass one long stream.

    Args:
        ids: 1-D integer array of token ids in `[0, vocab_size)`.
        vocab_size: number of words `V` (rows of the result).
        window: positive int, context half-width.
        context_size: positive int, number of context words (columns);
            clipped to `vocab_size`.

    Returns:
        `scipy.sparse.csr_matrix` of shape `[V, min(context_size, V)]`,
        float64 counts. Memory is `O(nnz)`; ids are processed one offset at
        a time.

    Example:

    >>> m = cooccurrence_matrix([0, 1, 0, 2], vocab_size=3, window=1)
    >>> m.toarray().tolist()  # columns: words 0, 1, 2 by frequency
    [[0.0, 2.0, 1.0], [2.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    """
    vocab_size = check_int("vocab_size", vocab_size, minimum=1)
    window = check_int("window", window, minimum=1)
    context_size = check_int("context_size", context_size, minimum=1)
    ids = _as_ids(ids, vocab_size)
    context_size = min(context_size, vocab_size)
    counts = np.bincount(ids, minlength=vocab_size)
    context_words = np.argsort(-counts, kind="stable")[:context_size]
    column_of = np.full(vocab_size, -1, dtype=np.int64)
    column_of[context_words] = np.arange(context_size)
    shape = (vocab_size, context_size)
    matrix = scipy.sparse.csr_matrix(shape, dtype=np.float64)
    for offset in range(1, min(window, ids.size - 1) + 1):
        left, right = ids[:-offset], ids[offset:]
        for rows, contexts in ((left, right), (right, left)):
            columns = column_of[contexts]
            keep = columns >= 0
            matrix = matrix + scipy.sparse.coo_matrix(
                (np.ones(int(keep.sum())), (rows[keep], columns[keep])), shape=shape
            ).tocsr()
    matrix.sum_duplicates()
    return matrix


def _as_cooccurrence(cooccurrence):
    if scipy.sparse.issparse(cooccurrence):
        matrix = scipy.sparse.csr_matrix(cooccurrence, dtype=np.float64)
    else:
        array = np.asarray(cooccurrence)
        if array.dtype == object or not np.issubdtype(array.dtype, np.number):
            raise ValueError(
                "The co-occurrence matrix must be numeric. Received: "
                f"dtype={array.dtype}"
            )
        matrix = scipy.sparse.csr_matrix(array.astype(np.float64))
    if matrix.ndim != 2 or min(matrix.shape) == 0:
        raise ValueError(
            "The co-occurrence matrix must be 2-D `[V, num_contexts]` and "
            f"non-empty. Received: shape={matrix.shape}"
        )
    if matrix.nnz and (not np.all(np.isfinite(matrix.data)) or matrix.data.min() < 0):
        raise ValueError(
            "The co-occurrence matrix must hold finite, non-negative counts. "
            f"Received: min={matrix.data.min():g}"
        )
    return matrix


def hellinger_embeddings(cooccurrence, embedding_dim=64, seed=0):
    """Hellinger-PCA word embeddings (Lebret & Collobert, 2014).

    Each row of the co-occurrence matrix is normalised to a probability
    distribution over contexts, square-rooted element-wise (so Euclidean
    distance between rows is `sqrt(2)` times the Hellinger distance), then
    projected to `embedding_dim` dimensions with scikit-learn's randomized
    `TruncatedSVD` (no centering, so the matrix stays sparse). Words that
    never co-occur with a context word get a zero row.

    Args:
        cooccurrence: `[V, K]` scipy sparse matrix or array of non-negative
            counts, e.g. from `cooccurrence_matrix`.
        embedding_dim: positive int; clipped to `min(V, K)`.
        seed: non-negative int, `random_state` of the SVD.

    Returns:
        float64 array `[V, min(embedding_dim, V, K)]`.

    Example:

    >>> m = cooccurrence_matrix([0, 1, 0, 2, 3, 2, 3], 4, window=1)
    >>> hellinger_embeddings(m, embedding_dim=2).shape
    (4, 2)
    """
    from sklearn.decomposition import TruncatedSVD

    matrix = _as_cooccurrence(cooccurrence)
    embedding_dim = check_int("embedding_dim", embedding_dim, minimum=1)
    seed = check_seed(seed, allow_none=False)
    row_sums = np.asarray(matrix.sum(axis=1)).ravel()
    scale = np.divide(1.0, row_sums, out=np.zeros_like(row_sums), where=row_sums > 0)
    hellinger = scipy.sparse.diags(scale) @ matrix
    hellinger = scipy.sparse.csr_matrix(hellinger)
    hellinger.data = np.sqrt(hellinger.data)
    dim = min(embedding_dim, *matrix.shape)
    svd = TruncatedSVD(n_components=dim, algorithm="randomized", random_state=seed)
    return svd.fit_transform(hellinger)


def _relabel_by_mass(labels, masses_of_words, num_clusters):
    """Renumbers clusters by descending mass (ties: smallest word id first)."""
    mass = np.bincount(labels, weights=masses_of_words, minlength=num_clusters)
    first_word = np.full(num_clusters, labels.size, dtype=np.int64)
    np.minimum.at(first_word, labels, np.arange(labels.size))
    order = np.lexsort((first_word, -mass))
    new_label = np.empty(num_clusters, dtype=np.int64)
    new_label[order] = np.arange(num_clusters)
    return new_label[labels]


def _capped_assignment(embeddings, centers, labels, counts, cap):
    """Moves words out of clusters whose unigram mass would exceed `cap`.

    Words are visited by descending count (ties: ascending index); each goes
    to its k-means cluster if that still has room, else to the nearest
    centroid whose cluster has room. Raises ValueError when no cluster does.
    """
    limit = cap * (1.0 + _CAP_RTOL)
    mass = [0.0] * centers.shape[0]
    out = labels.copy()
    order = np.argsort(-counts, kind="stable")
    counts_list = counts.tolist()
    labels_list = labels.tolist()
    for i in order.tolist():
        c = counts_list[i]
        k = labels_list[i]
        if mass[k] + c > limit:
            distances = ((centers - embeddings[i]) ** 2).sum(axis=1)
            for k in np.argsort(distances, kind="stable").tolist():
                if mass[k] + c <= limit:
                    break
            else:
                raise ValueError(
                    "The per-cluster frequency cap cannot be met: word with "
                    f"count {c:g} fits in none of the {centers.shape[0]} "
                    f"clusters (cap {cap:g} per cluster, cluster masses "
                    f"{_summarise(sorted(mass, reverse=True))}). Increase "
                    "`num_clusters` or `max_cluster_fraction`, or pass "
                    "max_cluster_fraction=None."
                )
        out[i] = k
        mass[k] += c
    return out


def _fill_empty_clusters(embeddings, centers, labels):
    """Gives every empty cluster the word (from a cluster of >= 2 words)
    nearest to its centroid. Can only lower cluster masses below the cap."""
    num_clusters = centers.shape[0]
    sizes = np.bincount(labels, minlength=num_clusters)
    for k in np.flatnonzero(sizes == 0).tolist():
        movable = np.flatnonzero(sizes[labels] >= 2)
        distances = ((embeddings[movable] - centers[k]) ** 2).sum(axis=1)
        word = movable[int(np.argmin(distances))]
        sizes[labels[word]] -= 1
        labels[word] = k
        sizes[k] += 1
    return labels


def kmeans_clusters(
    cooccurrence_or_corpus,
    num_clusters,
    counts=None,
    weighted=False,
    embedding_dim=64,
    max_cluster_fraction=0.1,
    seed=0,
    *,
    vocab_size=None,
    window=5,
    context_size=10000,
    n_init=4,
):
    """K-means clusters of Hellinger-PCA word embeddings, with a mass cap.

    The strategy the paper found best (Table 4). Words occurring in similar
    contexts land in the same cluster, which makes cluster likelihoods
    easy to learn.

    1. Build (or take) the co-occurrence matrix, embed it with
       `hellinger_embeddings`.
    2. Frequency cap (`max_cluster_fraction=f`, default 10% as in the paper):
       `cap = f * sum(counts)`. A word whose own count exceeds `cap` gets a
       singleton cluster. scikit-learn `KMeans` then clusters the other words
       into the remaining `num_clusters - num_singletons` clusters, and one
       capacity-constrained pass visits them by descending count, keeping
       each in its k-means cluster while that has room and otherwise moving
       it to the nearest centroid whose cluster has room. Every cluster then
       has mass `<= cap` or is a single word.
       Raises ValueError when the non-singleton mass exceeds
       `(num_clusters - num_singletons) * cap`, or when the greedy pass finds
       no room for a word.
    3. A cluster left empty (only when there are fewer distinct embeddings
       than clusters) takes the word nearest to its centroid from a cluster
       with at least two words.
    4. Clusters are renumbered by descending unigram mass (ties: smallest
       word id first), so cluster 0 is the heaviest.

    Args:
        cooccurrence_or_corpus: either a `[V, K]` co-occurrence matrix (scipy
            sparse or 2-D array), or a 1-D integer token-id stream from which
            one is built with `cooccurrence_matrix(ids, V, window,
            context_size)`.
        num_clusters: number of clusters `C`, `1 <= C <= V`.
        counts: optional unigram counts `[V]` for the weights and the cap.
            Default: `bincount(ids)` for a corpus, the co-occurrence row
            sums (proportional to frequency) for a matrix.
        weighted: if True, weighted k-means (`sample_weight=counts`), the
            paper's "weighted k-means".
        embedding_dim: Hellinger-PCA dimension (clipped to the matrix size).
        max_cluster_fraction: per-cluster cap on the unigram-mass fraction,
            in `(0, 1]`, or None for no cap.
        seed: non-negative int for the SVD and k-means.
        vocab_size: `V` for a corpus input; defaults to `len(counts)`.
            Ignored (checked) for a matrix input.
        window: co-occurrence half-width for a corpus input.
        context_size: number of context words for a corpus input.
        n_init: k-means restarts (best inertia kept).

    Returns:
        int32 array `[V]`, the cluster of each word.

    Example:

    >>> ids = np.array([0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3])
    >>> kmeans_clusters(ids, 2, vocab_size=4, max_cluster_fraction=None).tolist()
    [0, 0, 1, 1]
    """
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    fraction = _check_fraction(max_cluster_fraction)
    seed = check_seed(seed, allow_none=False)
    n_init = check_int("n_init", n_init, minimum=1)
    is_matrix = scipy.sparse.issparse(cooccurrence_or_corpus) or np.ndim(cooccurrence_or_corpus) == 2
    if is_matrix:
        matrix = _as_cooccurrence(cooccurrence_or_corpus)
        num_words = matrix.shape[0]
        if vocab_size is not None and check_int("vocab_size", vocab_size, 1) != num_words:
            raise ValueError(
                "`vocab_size` must match the co-occurrence matrix rows. "
                f"Received: vocab_size={vocab_size} != matrix.shape[0]={num_words}"
            )
        if counts is None:
            counts = np.asarray(matrix.sum(axis=1)).ravel()
    else:
        if vocab_size is None:
            if counts is None:
                raise ValueError(
                    "`vocab_size` (or `counts`) is required with a token-id "
                    "corpus. Received: vocab_size=None, counts=None"
                )
            vocab_size = np.asarray(counts).size
        num_words = check_int("vocab_size", vocab_size, minimum=1)
        ids = _as_ids(cooccurrence_or_corpus, num_words)
        matrix = cooccurrence_matrix(ids, num_words, window=window, context_size=context_size)
        if counts is None:
            counts = np.bincount(ids, minlength=num_words)
    counts = _as_counts(counts, num_words)
    num_clusters = _check_num_clusters(num_clusters, num_words)
    total = float(counts.sum())

    if fraction is None:
        heavy = np.zeros(num_words, dtype=bool)
        cap = None
    else:
        cap = fraction * total
        heavy = counts > cap * (1.0 + _CAP_RTOL)
    heavy_words = np.flatnonzero(heavy)
    light_words = np.flatnonzero(~heavy)
    num_light_clusters = num_clusters - heavy_words.size
    if light_words.size and num_light_clusters < 1:
        raise ValueError(
            f"max_cluster_fraction={fraction} gives {heavy_words.size} words a "
            f"cluster of their own (count > {cap:g}), leaving none of the "
            f"num_clusters={num_clusters} clusters for the other "
            f"{light_words.size} words. Increase `num_clusters` or "
            "`max_cluster_fraction`."
        )
    light_mass = float(counts[light_words].sum())
    if cap is not None and light_mass > num_light_clusters * cap * (1.0 + _CAP_RTOL):
        raise ValueError(
            f"max_cluster_fraction={fraction} is impossible with "
            f"num_clusters={num_clusters}: {heavy_words.size} words heavier "
            f"than the cap take a cluster each, and the remaining "
            f"{num_light_clusters} clusters can hold at most "
            f"{num_light_clusters * fraction:.3g} of the unigram mass, but the "
            f"other words carry {light_mass / total:.3g}. Increase "
            "`num_clusters` or `max_cluster_fraction`, or pass "
            "max_cluster_fraction=None."
        )

    labels = np.empty(num_words, dtype=np.int64)
    labels[heavy_words] = num_light_clusters + np.arange(heavy_words.size)
    if light_words.size:
        embeddings = hellinger_embeddings(matrix, embedding_dim=embedding_dim, seed=seed)
        light_embeddings = np.ascontiguousarray(embeddings[light_words])
        light_counts = counts[light_words]
        weights = light_counts if weighted and light_counts.sum() > 0 else None
        with warnings.catch_warnings():
            # Fewer distinct points than clusters: repaired below.
            warnings.simplefilter("ignore", ConvergenceWarning)
            kmeans = KMeans(n_clusters=num_light_clusters, n_init=n_init, random_state=seed)
            kmeans.fit(light_embeddings, sample_weight=weights)
        centers = kmeans.cluster_centers_
        light_labels = kmeans.predict(light_embeddings).astype(np.int64)
        if cap is not None:
            light_labels = _capped_assignment(light_embeddings, centers, light_labels, light_counts, cap)
        labels[light_words] = _fill_empty_clusters(light_embeddings, centers, light_labels)
    return _relabel_by_mass(labels, counts, num_clusters).astype(np.int32)


# ----------------------------------------------------------------------------
# Static padded layout.
# ----------------------------------------------------------------------------


def _readonly_int32(array):
    array = np.array(array, dtype=np.int32, copy=True)
    array.setflags(write=False)
    return array


@dataclasses.dataclass(frozen=True, eq=False)
class ClusterAssignment:
    """Static, padded two-level HSM layout of a word clustering.

    All shapes are fixed by `(V, C, max_cluster_size)`, so an HSM layer can
    gather `[C, max_cluster_size]` word tables with static shapes (no ragged
    tensors, no data-dependent shapes: XLA / TPU friendly) and mask the
    padding. Build one with `hierarchical_layout` / `from_assignment`; the
    arrays are read-only int32. Invariants (checked on construction):
    `cluster_words[cluster_of_word[w], position_in_cluster[w]] == w` for every
    word, `cluster_words[c, i] == PAD_WORD` (-1) exactly for
    `i >= cluster_sizes[c]`, every cluster is non-empty, and
    `max_cluster_size == max(cluster_sizes)`. Words within a cluster are in
    ascending id order.

    Attributes:
        cluster_of_word: `[V]` cluster of each word.
        position_in_cluster: `[V]` index of each word inside its cluster.
        cluster_words: `[C, max_cluster_size]` word ids, padded with -1.
        cluster_sizes: `[C]` number of words per cluster.

    Example:

    >>> layout = ClusterAssignment.from_assignment([1, 0, 1, 1])
    >>> layout.num_clusters, layout.max_cluster_size, layout.vocab_size
    (2, 3, 4)
    >>> layout.cluster_words.tolist()
    [[1, -1, -1], [0, 2, 3]]
    >>> layout.position_in_cluster.tolist()
    [0, 0, 1, 2]
    >>> ClusterAssignment.from_config(layout.to_config()) == layout
    True
    """

    cluster_of_word: np.ndarray
    position_in_cluster: np.ndarray
    cluster_words: np.ndarray
    cluster_sizes: np.ndarray

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = _as_int_array(getattr(self, field.name), field.name)
            object.__setattr__(self, field.name, _readonly_int32(value))
        cow, pos = self.cluster_of_word, self.position_in_cluster
        words, sizes = self.cluster_words, self.cluster_sizes
        if cow.ndim != 1 or pos.shape != cow.shape or words.ndim != 2 or sizes.shape != words.shape[:1]:
            raise ValueError(
                "Inconsistent ClusterAssignment shapes. Received: "
                f"cluster_of_word {cow.shape}, position_in_cluster {pos.shape}, "
                f"cluster_words {words.shape}, cluster_sizes {sizes.shape}"
            )
        vocab_size, (num_clusters, width) = cow.size, words.shape
        consistent = (
            vocab_size > 0
            and sizes.min() >= 1
            and width == sizes.max()
            and int(sizes.sum()) == vocab_size
            and cow.min() >= 0
            and cow.max() < num_clusters
            and pos.min() >= 0
            and np.all(pos < sizes[cow])
            and np.array_equal(words[cow, pos], np.arange(vocab_size))
            and np.array_equal(words >= 0, np.arange(width)[None, :] < sizes[:, None])
            and np.all(words[words < 0] == PAD_WORD)
        )
        if not consistent:
            raise ValueError(
                "Inconsistent ClusterAssignment arrays; build it with "
                "`hierarchical_layout(assignment)` / "
                "`ClusterAssignment.from_assignment(assignment)`. Received: "
                f"cluster_sizes={_summarise(sizes)}, "
                f"cluster_of_word={_summarise(cow)}"
            )

    @classmethod
    def from_assignment(cls, assignment, num_clusters=None):
        """Same as `hierarchical_layout(assignment, num_clusters)`."""
        return hierarchical_layout(assignment, num_clusters)

    @property
    def vocab_size(self):
        """Number of words `V`."""
        return int(self.cluster_of_word.size)

    @property
    def num_clusters(self):
        """Number of clusters `C`."""
        return int(self.cluster_words.shape[0])

    @property
    def max_cluster_size(self):
        """Padded cluster width, `max(cluster_sizes)`."""
        return int(self.cluster_words.shape[1])

    @property
    def mask(self):
        """Bool `[C, max_cluster_size]`, True where `cluster_words` is a word."""
        return self.cluster_words >= 0

    def padded_cluster_words(self, fill_value=PAD_WORD):
        """`cluster_words` with the padding replaced by `fill_value`.

        Useful for a gather-safe table (`fill_value=0` or `V`) used together
        with `mask`.

        Args:
            fill_value: int written into padded slots.

        Returns:
            A new (writable) int32 array `[C, max_cluster_size]`.
        """
        fill_value = check_int("fill_value", fill_value)
        return np.where(self.mask, self.cluster_words, np.int32(fill_value)).astype(np.int32)

    def cluster_mass(self, counts):
        """Unigram mass per cluster, `[C]` float64, from counts `[V]`."""
        counts = _as_counts(counts, self.vocab_size)
        return np.bincount(self.cluster_of_word, weights=counts, minlength=self.num_clusters)

    # -- serialisation (no pickle) ------------------------------------------

    def to_config(self):
        """Plain-Python dict (lists and ints) for a Keras layer's `get_config`.

        Only the assignment is stored; everything else is rebuilt by
        `from_config`.
        """
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "num_clusters": self.num_clusters,
            "cluster_of_word": self.cluster_of_word.tolist(),
        }

    @classmethod
    def from_config(cls, config):
        """Inverse of `to_config`."""
        if not isinstance(config, dict) or "cluster_of_word" not in config:
            keys = sorted(config) if isinstance(config, dict) else type(config).__name__
            raise ValueError(
                "A ClusterAssignment config must be a dict with key "
                f"'cluster_of_word'. Received: {keys}"
            )
        version = config.get("version", _FORMAT_VERSION)
        if version != _FORMAT_VERSION:
            raise ValueError(
                f"Unsupported ClusterAssignment config version. Received: "
                f"version={version!r}, supported: {_FORMAT_VERSION}"
            )
        return hierarchical_layout(config["cluster_of_word"], config.get("num_clusters"))

    def to_json(self):
        """JSON string of `to_config()`."""
        return json.dumps(self.to_config(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text):
        """Inverse of `to_json`."""
        return cls.from_config(json.loads(text))

    def save(self, path):
        """Writes the assignment to `path`, without pickle.

        A path ending in `.json` gets JSON (`to_json`); any other path gets a
        numpy `.npz` archive holding int arrays only (written to `path`
        exactly, no suffix appended).

        Args:
            path: str or `pathlib.Path`.
        """
        path = pathlib.Path(path)
        if path.suffix.lower() == ".json":
            path.write_text(self.to_json())
            return
        with open(path, "wb") as f:
            np.savez(
                f,
                cluster_of_word=self.cluster_of_word,
                num_clusters=np.int64(self.num_clusters),
                version=np.int64(_FORMAT_VERSION),
            )

    @classmethod
    def load(cls, path):
        """Reads a file written by `save` (JSON or `.npz`, detected from the
        content); `.npz` files are opened with `allow_pickle=False`."""
        path = pathlib.Path(path)
        with open(path, "rb") as f:
            start = f.read(1)
        if start == b"{":
            return cls.from_json(path.read_text())
        with np.load(path, allow_pickle=False) as data:
            config = {
                "cluster_of_word": data["cluster_of_word"],
                "num_clusters": int(data["num_clusters"]),
                "version": int(data["version"]),
            }
        return cls.from_config(config)

    def __eq__(self, other):
        if not isinstance(other, ClusterAssignment):
            return NotImplemented
        return self.num_clusters == other.num_clusters and np.array_equal(
            self.cluster_of_word, other.cluster_of_word
        )

    __hash__ = None

    def __repr__(self):
        return (
            f"ClusterAssignment(vocab_size={self.vocab_size}, "
            f"num_clusters={self.num_clusters}, "
            f"max_cluster_size={self.max_cluster_size})"
        )


def hierarchical_layout(assignment, num_clusters=None):
    """Builds the static padded HSM layout from an assignment vector.

    Empty clusters are rejected rather than silently compacted, so cluster ids
    keep the meaning the caller gave them (compact first with
    `np.unique(assignment, return_inverse=True)[1]` if that is what you want).

    Args:
        assignment: integer array `[V]`, the cluster of each word, values in
            `[0, num_clusters)`.
        num_clusters: `C`; defaults to `max(assignment) + 1`.

    Returns:
        A `ClusterAssignment`.

    Example:

    >>> hierarchical_layout([0, 2, 1, 0]).cluster_words.tolist()
    [[0, 3], [2, -1], [1, -1]]
    """
    assignment = _as_int_array(assignment, "assignment")
    if assignment.ndim != 1 or assignment.size == 0:
        raise ValueError(
            "`assignment` must be a non-empty 1-D array (one cluster id per "
            f"word). Received: assignment.shape={assignment.shape}"
        )
    vocab_size = assignment.size
    low, high = int(assignment.min()), int(assignment.max())
    if low < 0:
        word = int(np.argmin(assignment))
        raise ValueError(
            "`assignment` values must be >= 0. Received: "
            f"assignment[{word}]={low}"
        )
    if num_clusters is None:
        num_clusters = high + 1
    num_clusters = _check_num_clusters(num_clusters, vocab_size)
    if high >= num_clusters:
        word = int(np.argmax(assignment))
        raise ValueError(
            f"`assignment` values must be < num_clusters={num_clusters}. "
            f"Received: assignment[{word}]={high}"
        )
    sizes = np.bincount(assignment, minlength=num_clusters)
    if np.any(sizes == 0):
        empty = np.flatnonzero(sizes == 0)
        raise ValueError(
            f"Every cluster must hold at least one word; {empty.size} of "
            f"num_clusters={num_clusters} are empty: {_summarise(empty)}. "
            "Compact the ids (e.g. `np.unique(assignment, "
            "return_inverse=True)[1]`) or lower `num_clusters`."
        )
    order = np.argsort(assignment, kind="stable")
    starts = np.cumsum(sizes) - sizes
    position = np.empty(vocab_size, dtype=np.int64)
    position[order] = np.arange(vocab_size) - starts[assignment[order]]
    cluster_words = np.full((num_clusters, int(sizes.max())), PAD_WORD, dtype=np.int64)
    cluster_words[assignment, position] = np.arange(vocab_size)
    return ClusterAssignment(
        cluster_of_word=assignment,
        position_in_cluster=position,
        cluster_words=cluster_words,
        cluster_sizes=sizes,
    )


# ----------------------------------------------------------------------------
# Single entry point.
# ----------------------------------------------------------------------------


def make_clusters(
    strategy,
    *,
    counts=None,
    vocab_size=None,
    num_clusters=None,
    ids=None,
    cooccurrence=None,
    seed=0,
    max_cluster_fraction=0.1,
    embedding_dim=64,
    window=5,
    context_size=10000,
    n_init=4,
):
    """Clusters a vocabulary with one of `CLUSTERING_STRATEGIES` and returns its layout.

    Inputs needed per strategy (`V` is taken from `vocab_size`, `len(counts)`
    or `cooccurrence.shape[0]`, which must agree):

    * `"random"`: `vocab_size` (or anything giving `V`).
    * `"frequency"`: `counts`, or `ids` (counts = `bincount(ids)`).
    * `"kmeans"`, `"weighted_kmeans"`: `ids` (a 1-D token stream) or a
      precomputed `cooccurrence` matrix `[V, K]`; `counts` optional (see
      `kmeans_clusters`). Only these two use `max_cluster_fraction`,
      `embedding_dim`, `window`, `context_size` and `n_init`.

    Args:
        strategy: one of `"random"`, `"frequency"`, `"kmeans"`,
            `"weighted_kmeans"`.
        counts: unigram counts `[V]`.
        vocab_size: number of words `V`.
        num_clusters: number of clusters; default `ceil(sqrt(V))`.
        ids: 1-D integer token-id stream.
        cooccurrence: `[V, K]` co-occurrence counts (k-means strategies).
        seed: non-negative int; the result is deterministic given it.
        max_cluster_fraction: k-means per-cluster unigram-mass cap (paper:
            10%), or None. With the default `C = ceil(sqrt(V))` a small
            vocabulary (`C` around 10 or fewer) usually cannot meet a 10% cap;
            pass a larger `num_clusters` or fraction then.
        embedding_dim, window, context_size, n_init: see `kmeans_clusters`.

    Returns:
        A `ClusterAssignment`.

    Example:

    >>> layout = make_clusters("random", vocab_size=10)
    >>> layout.num_clusters, layout.cluster_sizes.tolist()
    (4, [3, 3, 2, 2])
    """
    if strategy not in CLUSTERING_STRATEGIES:
        raise ValueError(f"Unknown `strategy`. Expected one of {CLUSTERING_STRATEGIES}. Received: strategy={strategy!r}")
    sources = []
    if vocab_size is not None:
        sources.append(("vocab_size", check_int("vocab_size", vocab_size, minimum=1)))
    if counts is not None:
        sources.append(("len(counts)", int(np.asarray(counts).size)))
    if cooccurrence is not None:
        sources.append(("cooccurrence.shape[0]", int(np.shape(cooccurrence)[0])))
    if not sources:
        raise ValueError(
            f"strategy={strategy!r} needs the vocabulary size: pass "
            "`vocab_size`, `counts` or `cooccurrence`. Received none of them."
        )
    if len({v for _, v in sources}) > 1:
        raise ValueError(
            "Inconsistent vocabulary sizes. Received: "
            + ", ".join(f"{name}={v}" for name, v in sources)
        )
    vocab = sources[0][1]
    if num_clusters is None:
        num_clusters = default_num_clusters(vocab)
    num_clusters = _check_num_clusters(num_clusters, vocab)

    if strategy == "random":
        assignment = random_clusters(vocab, num_clusters, seed=seed)
    elif strategy == "frequency":
        if counts is None:
            if ids is None:
                raise ValueError(
                    "strategy='frequency' needs `counts` or `ids`. Received: "
                    "counts=None, ids=None"
                )
            counts = np.bincount(_as_ids(ids, vocab), minlength=vocab)
        assignment = frequency_clusters(_as_counts(counts, vocab), num_clusters)
    else:
        if ids is None and cooccurrence is None:
            raise ValueError(
                f"strategy={strategy!r} needs `ids` (a token-id stream) or "
                "`cooccurrence`. Received: ids=None, cooccurrence=None"
            )
        if ids is not None and cooccurrence is not None:
            raise ValueError(
                f"strategy={strategy!r} takes `ids` or `cooccurrence`, not "
                "both. Received both."
            )
        assignment = kmeans_clusters(
            cooccurrence if cooccurrence is not None else ids,
            num_clusters,
            counts=counts,
            weighted=strategy == "weighted_kmeans",
            embedding_dim=embedding_dim,
            max_cluster_fraction=max_cluster_fraction,
            seed=seed,
            vocab_size=vocab,
            window=window,
            context_size=context_size,
            n_init=n_init,
        )
    return hierarchical_layout(assignment, num_clusters)
