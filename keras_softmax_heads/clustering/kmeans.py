"""K-means word clusters on Hellinger-PCA embeddings, with a mass cap.

The strategy Chen et al. (2016) found best: `kmeans_clusters` embeds
co-occurrence counts (`cooccurrence`), runs scikit-learn `KMeans`
(optionally weighted by word counts) and caps every cluster's unigram mass.
The cap, the repair of empty clusters and the renumbering are the private
helpers below, one step each. See `docs/clustering.md`.
"""

import warnings

import numpy as np
import scipy.sparse

from keras_softmax_heads.clustering.assignment import check_num_clusters
from keras_softmax_heads.clustering.cooccurrence import check_cooccurrence
from keras_softmax_heads.clustering.cooccurrence import cooccurrence_matrix
from keras_softmax_heads.clustering.cooccurrence import hellinger_embeddings
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_number
from keras_softmax_heads.validation import check_seed
from keras_softmax_heads.validation.arrays import check_counts
from keras_softmax_heads.validation.arrays import check_ids
from keras_softmax_heads.validation.arrays import summarize

# Relative slack when comparing a cluster's mass against the cap, so float
# rounding of `fraction * total` never rejects an exactly-full cluster.
CAP_RTOL = 1e-9


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

    1. Embed the co-occurrence matrix (given, or built from a token stream)
       with `hellinger_embeddings`.
    2. With `max_cluster_fraction=f`, `cap = f * sum(counts)`: a word whose
       count exceeds `cap` gets a singleton cluster; `KMeans` clusters the
       other words into the remaining clusters, and one pass by descending
       count moves a word to the nearest centroid with room when its own
       cluster is full. Every cluster then has mass `<= cap` or is a single
       word.
    3. A cluster left empty (fewer distinct embeddings than clusters) takes
       the word nearest to its centroid from a cluster of two or more.
    4. Clusters are renumbered by descending unigram mass (ties: smallest
       word id first), so cluster 0 is the heaviest.

    Args:
        cooccurrence_or_corpus: a `[V, K]` co-occurrence matrix (scipy
            sparse or 2-D array), or a 1-D integer token-id stream, from
            which `cooccurrence_matrix(ids, V, window, context_size)` builds
            one.
        num_clusters: number of clusters `C`, `1 <= C <= V`.
        counts: optional unigram counts `[V]` for the weights and the cap.
            Default: `bincount(ids)` for a stream, the row sums for a matrix.
        weighted: if True, weighted k-means (`sample_weight=counts`).
        embedding_dim: Hellinger-PCA dimension (clipped to the matrix size).
        max_cluster_fraction: cap on a cluster's unigram-mass fraction, in
            `(0, 1]`, or None for no cap.
        seed: non-negative int for the SVD and k-means.
        vocab_size: `V` for a stream; defaults to `len(counts)`. Checked
            against the rows of a matrix.
        window: co-occurrence half-width for a stream.
        context_size: number of context words for a stream.
        n_init: k-means restarts (best inertia kept).

    Returns:
        int32 array `[V]`, the cluster of each word.

    Raises:
        ValueError: for bad arguments, and when the cap cannot be met (the
            message gives the numbers; raise `num_clusters` or
            `max_cluster_fraction`, or pass None).

    Example:

    >>> ids = np.array([0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3])
    >>> kmeans_clusters(ids, 2, vocab_size=4, max_cluster_fraction=None).tolist()
    [0, 0, 1, 1]

    References:
        - Chen, Grangier, Auli. Strategies for Training Large Vocabulary
          Neural Language Models, ACL 2016, section 4.3.
          https://arxiv.org/abs/1512.04906
    """
    fraction = check_number(
        "max_cluster_fraction", max_cluster_fraction, low=0, high=1,
        low_open=True, allow_none=True,
    )
    seed = check_seed(seed, allow_none=False)
    n_init = check_int("n_init", n_init, minimum=1)
    matrix, counts = _matrix_and_counts(
        cooccurrence_or_corpus, counts, vocab_size, window, context_size
    )
    num_words = matrix.shape[0]
    num_clusters = check_num_clusters(num_clusters, num_words)
    heavy, cap = _heavy_words(counts, fraction, num_clusters)
    heavy_words = np.flatnonzero(heavy)
    light_words = np.flatnonzero(~heavy)
    num_light_clusters = num_clusters - heavy_words.size

    labels = np.empty(num_words, dtype=np.int64)
    labels[heavy_words] = num_light_clusters + np.arange(heavy_words.size)
    if light_words.size:
        embeddings = hellinger_embeddings(matrix, embedding_dim=embedding_dim, seed=seed)
        labels[light_words] = _light_labels(
            np.ascontiguousarray(embeddings[light_words]), counts[light_words],
            num_light_clusters, weighted=weighted, cap=cap, n_init=n_init, seed=seed,
        )
    return _relabel_by_mass(labels, counts, num_clusters).astype(np.int32)


def _matrix_and_counts(cooccurrence_or_corpus, counts, vocab_size, window, context_size):
    """The co-occurrence matrix `[V, K]` and the checked counts `[V]`."""
    is_matrix = scipy.sparse.issparse(cooccurrence_or_corpus) or np.ndim(cooccurrence_or_corpus) == 2
    if is_matrix:
        matrix = check_cooccurrence(cooccurrence_or_corpus)
        num_words = matrix.shape[0]
        if vocab_size is not None and check_int("vocab_size", vocab_size, 1) != num_words:
            raise ValueError(
                "`vocab_size` must match the co-occurrence matrix rows. "
                f"Received: vocab_size={vocab_size} != matrix.shape[0]={num_words}"
            )
        if counts is None:
            counts = np.asarray(matrix.sum(axis=1)).ravel()
        return matrix, check_counts(counts, num_words, allow_all_zero=False)
    if vocab_size is None:
        if counts is None:
            raise ValueError(
                "`vocab_size` (or `counts`) is required with a token-id "
                "corpus. Received: vocab_size=None, counts=None"
            )
        vocab_size = np.asarray(counts).size
    num_words = check_int("vocab_size", vocab_size, minimum=1)
    ids = check_ids(cooccurrence_or_corpus, num_words)
    matrix = cooccurrence_matrix(ids, num_words, window=window, context_size=context_size)
    if counts is None:
        counts = np.bincount(ids, minlength=num_words)
    return matrix, check_counts(counts, num_words, allow_all_zero=False)


def _heavy_words(counts, fraction, num_clusters):
    """`(heavy, cap)`: the words heavier than the cap (bool `[V]`, each gets
    a cluster of its own) and the cap (None without one); raises when the
    other words cannot fit in the remaining clusters."""
    if fraction is None:
        return np.zeros(counts.size, dtype=bool), None
    total = float(counts.sum())
    cap = fraction * total
    heavy = counts > cap * (1.0 + CAP_RTOL)
    num_heavy = int(heavy.sum())
    num_light = counts.size - num_heavy
    num_light_clusters = num_clusters - num_heavy
    if num_light and num_light_clusters < 1:
        raise ValueError(
            f"max_cluster_fraction={fraction} gives {num_heavy} words a "
            f"cluster of their own (count > {cap:g}), leaving none of the "
            f"num_clusters={num_clusters} clusters for the other "
            f"{num_light} words. Increase `num_clusters` or "
            "`max_cluster_fraction`."
        )
    light_mass = float(counts[~heavy].sum())
    if light_mass > num_light_clusters * cap * (1.0 + CAP_RTOL):
        raise ValueError(
            f"max_cluster_fraction={fraction} is impossible with "
            f"num_clusters={num_clusters}: {num_heavy} words heavier "
            f"than the cap take a cluster each, and the remaining "
            f"{num_light_clusters} clusters can hold at most "
            f"{num_light_clusters * fraction:.3g} of the unigram mass, but the "
            f"other words carry {light_mass / total:.3g}. Increase "
            "`num_clusters` or `max_cluster_fraction`, or pass "
            "max_cluster_fraction=None."
        )
    return heavy, cap


def _light_labels(embeddings, counts, num_clusters, weighted, cap, n_init, seed):
    """K-means labels `[n]` of the words below the cap, capped and with no
    cluster empty."""
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    weights = counts if weighted and counts.sum() > 0 else None
    with warnings.catch_warnings():
        # Fewer distinct points than clusters: repaired below.
        warnings.simplefilter("ignore", ConvergenceWarning)
        kmeans = KMeans(n_clusters=num_clusters, n_init=n_init, random_state=seed)
        kmeans.fit(embeddings, sample_weight=weights)
    centers = kmeans.cluster_centers_
    labels = kmeans.predict(embeddings).astype(np.int64)
    if cap is not None:
        labels = _capped_assignment(embeddings, centers, labels, counts, cap)
    return _fill_empty_clusters(embeddings, centers, labels)


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
    limit = cap * (1.0 + CAP_RTOL)
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
                    f"{summarize(sorted(mass, reverse=True))}). Increase "
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
