"""Word co-occurrence counts and their Hellinger-PCA embeddings.

The word vectors the k-means strategies cluster (Lebret & Collobert,
2014): `cooccurrence_matrix` counts context words in a symmetric window of
a token stream, `hellinger_embeddings` projects the square-rooted row
distributions with a truncated SVD. See `docs/clustering.md`.
"""

import numpy as np
import scipy.sparse

from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_seed
from keras_softmax_heads.validation.arrays import check_ids


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
    ids = check_ids(ids, vocab_size)
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


def check_cooccurrence(cooccurrence):
    """A `[V, K]` matrix of finite counts `>= 0` (scipy sparse or array-like)
    as a float64 CSR matrix, or raises `ValueError`."""
    if scipy.sparse.issparse(cooccurrence):
        matrix = scipy.sparse.csr_matrix(cooccurrence, dtype=np.float64)
    else:
        array = np.asarray(cooccurrence)
        if array.dtype == object or not np.issubdtype(array.dtype, np.number):
            raise ValueError(
                "`cooccurrence` must be a numeric matrix. Received: "
                f"cooccurrence with dtype={array.dtype}"
            )
        matrix = scipy.sparse.csr_matrix(array.astype(np.float64))
    if matrix.ndim != 2 or min(matrix.shape) == 0:
        raise ValueError(
            "`cooccurrence` must be a non-empty 2-D matrix `[V, num_contexts]`. "
            f"Received: cooccurrence.shape={matrix.shape}"
        )
    if matrix.nnz and (not np.all(np.isfinite(matrix.data)) or matrix.data.min() < 0):
        raise ValueError(
            "`cooccurrence` must hold finite, non-negative counts. "
            f"Received: cooccurrence with min={matrix.data.min():g}"
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

    matrix = check_cooccurrence(cooccurrence)
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
