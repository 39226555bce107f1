"""The papers' evaluation metrics, as plain NumPy functions.

* `empirical_rank` -- numerical rank of a matrix of log-probabilities
  (Kanai et al. 2018, Table 3; Yang et al. 2018), with the threshold of
  Press et al. (Numerical Recipes) that both papers use; `singular_values`
  (on the JAX backend, on JAX's device).
* `perplexity` -- `exp` of a mean negative log-likelihood in nats.
* `kl_divergence`, `mode_matching` -- Ganea et al. 2019, section 5.1.
* `entropy_per_frequency_band` -- Chen et al. 2016, Table 5.
* `log_prob_matrix` -- a head's `[num_contexts, V]` log-probabilities.

They take NumPy arrays (or anything `np.asarray` accepts) and return Python
floats / NumPy arrays, so they can be used on any head's outputs.
"""

import keras
import numpy as np


def empirical_rank(matrix, tol=None):
    """Numerical rank of `matrix` (e.g. log-probabilities `[contexts, V]`).

    The rank is the number of singular values above
    `tol = S.max() * max(M, N) * eps`, with `eps` the machine epsilon of the
    matrix's dtype: the threshold of Press et al., "Numerical Recipes", used by
    Yang et al. (2018) and Kanai et al. (2018, Table 3) to count linearly
    independent log-output vectors. This is NumPy's `matrix_rank` default;
    pass float32 log-probabilities as computed by the model so that the
    threshold matches their precision.

    A Linear-Softmax head with bias has log-probability rank at most `d + 2`
    (`d` for `h W`, one for the bias, one for the normaliser); the heads that
    break the bottleneck exceed it.

    Args:
        matrix: 2-D array.
        tol: optional explicit threshold on the singular values.

    Returns:
        int, the numerical rank.

    Example:

    >>> import numpy as np
    >>> empirical_rank(np.outer(np.arange(1.0, 5.0), np.arange(1.0, 4.0)))
    1
    """
    matrix = np.asarray(matrix)
    if matrix.ndim != 2:
        raise ValueError(
            f"empirical_rank expects a 2-D matrix. Received: shape={matrix.shape}"
        )
    s = singular_values(matrix)
    if tol is None:
        tol = (s.max() if s.size else 0.0) * max(matrix.shape) * np.finfo(s.dtype).eps
    return int(np.sum(s > tol))


def singular_values(matrix):
    """Singular values of a 2-D `matrix` (NumPy), in its dtype.

    On the JAX backend a float32 matrix's are computed by
    `jax.numpy.linalg.svd` on JAX's default device: on a GPU a
    `[10000, 10000]` matrix takes seconds where LAPACK on a few CPU cores
    takes minutes (other dtypes stay on NumPy: JAX computes in float32
    unless x64 is enabled). Otherwise NumPy's
    `np.linalg.svd`. The two agree to the matrix's precision
    (`tests/test_rank.py`).
    """
    matrix = np.asarray(matrix)
    if keras.backend.backend() == "jax" and matrix.dtype == np.float32:
        import jax.numpy as jnp

        return np.asarray(jnp.linalg.svd(jnp.asarray(matrix), compute_uv=False))
    return np.linalg.svd(matrix, compute_uv=False)


def log_prob_matrix(head, contexts, batch_size=1024):
    """The head's log-probabilities for each context vector: `[num, V]`.

    Args:
        head: a built keras-softmax-heads head (or any callable `h -> log p`).
        contexts: array `[num_contexts, d]`.
        batch_size: contexts per call.

    Returns:
        float32 array `[num_contexts, V]`.
    """
    contexts = np.asarray(contexts)
    parts = [
        keras.ops.convert_to_numpy(head(contexts[i : i + batch_size]))
        for i in range(0, len(contexts), batch_size)
    ]
    return np.concatenate(parts, axis=0)


def perplexity(mean_nll):
    """`exp(mean negative log-likelihood in nats)`."""
    return float(np.exp(mean_nll))


def kl_divergence(true_probs, log_q):
    """Mean `KL(P* || Q)` over rows, in nats (Ganea et al. 2019, Fig. 3).

    Args:
        true_probs: `[num_contexts, V]` true next-word distributions.
        log_q: `[num_contexts, V]` model log-probabilities.

    Returns:
        float, the average over contexts of `sum_w P*(w) (log P*(w) - log Q(w))`
        (terms with `P*(w) = 0` contribute 0).
    """
    p = np.asarray(true_probs, dtype=np.float64)
    log_q = np.asarray(log_q, dtype=np.float64)
    if p.shape != log_q.shape:
        raise ValueError(
            "true_probs and log_q must have the same shape. Received: "
            f"{p.shape} and {log_q.shape}"
        )
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - log_q), 0.0)
    return float(terms.sum(-1).mean())


def mode_matching(true_probs, log_q):
    """Fraction of contexts whose most likely word is the model's argmax.

    Ganea et al. 2019, eq. (10).
    """
    p = np.asarray(true_probs)
    q = np.asarray(log_q)
    if p.shape != q.shape:
        raise ValueError(
            "true_probs and log_q must have the same shape. Received: "
            f"{p.shape} and {q.shape}"
        )
    return float(np.mean(np.argmax(p, -1) == np.argmax(q, -1)))


def entropy_per_frequency_band(target_log_probs, targets, counts, band_edges):
    """Average per-token entropy (bits) over frequency-rank bands.

    Chen et al. 2016, Table 5: words are ranked by training frequency (rank 1
    = most frequent) and the test entropy `-mean log2 p(w)` is reported for
    the tokens whose word falls in each band of ranks.

    Args:
        target_log_probs: `[num_tokens]` model `log p(target)` in nats.
        targets: `[num_tokens]` word ids.
        counts: `[V]` training counts (defines the frequency ranks; ties are
            broken by word id).
        band_edges: increasing rank boundaries, e.g. `[1000, 10000]` gives the
            bands `[0, 1000)`, `[1000, 10000)`, `[10000, V)` of 0-based ranks.

    Returns:
        list of dicts `{"band": "lo-hi", "tokens": n, "entropy_bits": e}`
        (`entropy_bits` is NaN for a band without test tokens).
    """
    ll = np.asarray(target_log_probs, dtype=np.float64).reshape(-1)
    targets = np.asarray(targets).reshape(-1)
    counts = np.asarray(counts)
    if ll.shape != targets.shape:
        raise ValueError(
            "target_log_probs and targets must have the same size. Received: "
            f"{ll.shape} and {targets.shape}"
        )
    vocab_size = len(counts)
    order = np.lexsort((np.arange(vocab_size), -counts))
    rank = np.empty(vocab_size, dtype=np.int64)
    rank[order] = np.arange(vocab_size)
    edges = [0] + [int(e) for e in band_edges if 0 < e < vocab_size] + [vocab_size]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(
            f"band_edges must be increasing. Received: band_edges={band_edges}"
        )
    token_rank = rank[targets]
    bands = []
    for lo, hi in zip(edges, edges[1:]):
        sel = (token_rank >= lo) & (token_rank < hi)
        n = int(sel.sum())
        entropy = float(-ll[sel].mean() / np.log(2.0)) if n else float("nan")
        bands.append({"band": f"{lo}-{hi}", "tokens": n, "entropy_bits": entropy})
    return bands
