"""The two simple clustering strategies: random and frequency binning.

Each returns an int32 assignment vector `[V]` (the cluster of every word)
with values in `[0, C)` and every cluster non-empty; `hierarchical_layout`
turns it into a `ClusterAssignment`. See `docs/clustering.md`.
"""

import numpy as np

from keras_softmax_heads.clustering.assignment import check_num_clusters
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_seed
from keras_softmax_heads.validation.arrays import check_counts


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
    num_clusters = check_num_clusters(num_clusters, vocab_size)
    rng = np.random.default_rng(check_seed(seed, allow_none=False))
    assignment = np.empty(vocab_size, dtype=np.int32)
    assignment[rng.permutation(vocab_size)] = np.arange(vocab_size) % num_clusters
    return assignment


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
    counts = check_counts(counts, allow_all_zero=False)
    vocab_size = counts.size
    num_clusters = check_num_clusters(num_clusters, vocab_size)
    order = np.argsort(-counts, kind="stable")
    sorted_counts = counts[order]
    head, tail_mass = _singletons(sorted_counts, num_clusters)
    tail_clusters = num_clusters - head
    sizes = _tail_sizes(sorted_counts[head:], tail_mass, tail_clusters)
    labels = np.concatenate(
        [np.arange(head), head + np.repeat(np.arange(tail_clusters), sizes)]
    )
    assignment = np.empty(vocab_size, dtype=np.int32)
    assignment[order] = labels
    return assignment


def _singletons(sorted_counts, num_clusters):
    """`(head, tail_mass)`: how many of the heaviest words get a cluster of
    their own (each while its count reaches `remaining mass / remaining
    clusters`) and the mass left to the others."""
    head = 0
    remaining_mass = float(sorted_counts.sum())
    while num_clusters - head > 1:
        target = remaining_mass / (num_clusters - head)
        if remaining_mass <= 0 or sorted_counts[head] < target:
            break
        remaining_mass -= float(sorted_counts[head])
        head += 1
    return head, remaining_mass


def _tail_sizes(tail, tail_mass, tail_clusters):
    """Sizes of `tail_clusters` contiguous, non-empty runs of the sorted
    `tail` counts, cut where the midpoints of the words' mass intervals
    cross multiples of `sum(tail) / tail_clusters` (an even split by rank
    when no mass is left, `tail_mass <= 0`)."""
    n = tail.size
    if tail_mass > 0:
        cumulative = np.cumsum(tail)
        midpoints = cumulative - 0.5 * tail
        width = cumulative[-1] / tail_clusters
        cuts = np.arange(1, tail_clusters, dtype=np.float64) * width
        starts = np.concatenate([[0], np.searchsorted(midpoints, cuts, side="left")])
    else:
        starts = (np.arange(tail_clusters, dtype=np.int64) * n) // tail_clusters
    # Guarantee non-empty clusters even under float rounding (a no-op in
    # exact arithmetic because every tail word is lighter than `width`).
    starts = starts.astype(np.int64)
    for j in range(1, tail_clusters):
        starts[j] = min(max(starts[j], starts[j - 1] + 1), n - (tail_clusters - j))
    return np.diff(np.concatenate([starts, [n]]))
