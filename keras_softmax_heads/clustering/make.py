"""`make_clusters`: one entry point from a strategy name to a layout.

Finds the vocabulary size from the arguments, checks that the chosen
strategy has the inputs it needs, runs it (`strategies`, `kmeans`) and
returns the `ClusterAssignment` (`assignment`).
"""

import numpy as np

from keras_softmax_heads.clustering.assignment import check_num_clusters
from keras_softmax_heads.clustering.assignment import default_num_clusters
from keras_softmax_heads.clustering.assignment import hierarchical_layout
from keras_softmax_heads.clustering.kmeans import kmeans_clusters
from keras_softmax_heads.clustering.strategies import frequency_clusters
from keras_softmax_heads.clustering.strategies import random_clusters
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation.arrays import check_counts
from keras_softmax_heads.validation.arrays import check_ids

CLUSTERING_STRATEGIES = ("random", "frequency", "kmeans", "weighted_kmeans")
"""Strategy names accepted by `make_clusters`."""


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
    """Clusters a vocabulary with one of `CLUSTERING_STRATEGIES`; returns its layout.

    Inputs per strategy (`V` is taken from `vocab_size`, `len(counts)` or
    `cooccurrence.shape[0]`, which must agree):

    * `"random"` (`random_clusters`): anything giving `V`.
    * `"frequency"` (`frequency_clusters`): `counts`, or `ids` (counts =
      `bincount(ids)`).
    * `"kmeans"`, `"weighted_kmeans"` (`kmeans_clusters`): `ids` (a 1-D
      token stream) or a precomputed `cooccurrence` matrix `[V, K]`, not
      both; `counts` optional. Only these two use `max_cluster_fraction`,
      `embedding_dim`, `window`, `context_size` and `n_init`.

    Args:
        strategy: one of `"random"`, `"frequency"`, `"kmeans"`,
            `"weighted_kmeans"`.
        counts: unigram counts `[V]`.
        vocab_size: number of words `V`.
        num_clusters: number of clusters; default `ceil(sqrt(V))`
            (`default_num_clusters`).
        ids: 1-D integer token-id stream.
        cooccurrence: `[V, K]` co-occurrence counts (k-means strategies).
        seed: non-negative int; the result is deterministic given it.
        max_cluster_fraction: k-means cap on a cluster's unigram mass
            fraction, or None. A small vocabulary (`C` around 10 or fewer)
            usually cannot meet the default 10%; pass a larger
            `num_clusters` or fraction then.
        embedding_dim, window, context_size, n_init: see `kmeans_clusters`.

    Returns:
        A `ClusterAssignment`.

    Example:

    >>> layout = make_clusters("random", vocab_size=10)
    >>> layout.num_clusters, layout.cluster_sizes.tolist()
    (4, [3, 3, 2, 2])

    See `docs/clustering.md` for which strategy to use when.
    """
    strategy = check_choice("strategy", strategy, CLUSTERING_STRATEGIES)
    vocab = _vocab_size(strategy, vocab_size, counts, cooccurrence)
    if num_clusters is None:
        num_clusters = default_num_clusters(vocab)
    num_clusters = check_num_clusters(num_clusters, vocab)
    if strategy == "random":
        assignment = random_clusters(vocab, num_clusters, seed=seed)
    elif strategy == "frequency":
        assignment = frequency_clusters(_unigram_counts(counts, ids, vocab), num_clusters)
    else:
        _check_kmeans_source(strategy, ids, cooccurrence)
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


def _vocab_size(strategy, vocab_size, counts, cooccurrence):
    """`V` from whichever of the arguments give it; they must agree."""
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
    if len({size for _, size in sources}) > 1:
        raise ValueError(
            "Inconsistent vocabulary sizes. Received: "
            + ", ".join(f"{name}={size}" for name, size in sources)
        )
    return sources[0][1]


def _unigram_counts(counts, ids, vocab_size):
    """The checked `counts` `[V]`, or `bincount(ids)` without them."""
    if counts is None:
        if ids is None:
            raise ValueError(
                "strategy='frequency' needs `counts` or `ids`. Received: "
                "counts=None, ids=None"
            )
        counts = np.bincount(check_ids(ids, vocab_size), minlength=vocab_size)
    return check_counts(counts, vocab_size, allow_all_zero=False)


def _check_kmeans_source(strategy, ids, cooccurrence):
    """The k-means strategies take exactly one of `ids` and `cooccurrence`."""
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
