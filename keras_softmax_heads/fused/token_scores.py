"""`linear_token_scores`: per-token log-probabilities and entropies of
`softmax(g(h W + b) / T)` without the `[N, V]` logits.

One tiled pass of the chunked core (`fused.vocab_parallel.pointwise_stats`,
or `pointwise_entropy` with the entropy), exact per-token gradients. Design:
`docs/token_statistics.md`.
"""

from keras import ops

from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.functional import soft_cap
from keras_softmax_heads.fused.cross_entropy import checked_targets
from keras_softmax_heads.fused.cross_entropy import projection
from keras_softmax_heads.fused.vocab_parallel import check_vocab_parallel
from keras_softmax_heads.fused.vocab_parallel import pointwise_entropy
from keras_softmax_heads.fused.vocab_parallel import pointwise_stats
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_number
from keras_softmax_heads.validation import nan_if_invalid


def score_transform(temperature=1.0, logit_soft_cap=None):
    """The pointwise transform `g(z) = cap * tanh(z / cap) / T` (the soft cap
    first, then the temperature; either left out when unset), or None for
    the identity. The arguments are checked: `temperature` a float `> 0`,
    `logit_soft_cap` a float `> 0` or None."""
    temperature = check_number("temperature", temperature, low=0, low_open=True)
    cap = check_number("logit_soft_cap", logit_soft_cap, low=0, low_open=True,
                       allow_none=True)
    if cap is None and temperature == 1.0:
        return None

    def transform(z):
        g = z if cap is None else soft_cap(z, cap)
        return g if temperature == 1.0 else g / temperature

    return transform


def linear_token_scores(
    hidden,
    kernel,
    tokens,
    bias=None,
    *,
    kernel_transposed=False,
    temperature=1.0,
    logit_soft_cap=None,
    return_entropy=False,
    chunk_size=DEFAULT_CHUNK_SIZE,
    implementation="auto",
    vocab_parallel="auto",
):
    """Per-token log-probabilities (and entropies) without the logits.

    With `z = h W + b` and `g = cap * tanh(z / cap) / T` (the soft cap, if
    any, then the temperature `T`), per token:

        log_prob = g_token - logsumexp_v g_v
        entropy  = -sum_v p_v log p_v = logsumexp_v g_v - E_p[g],
                   p = softmax(g)

    in one pass over vocabulary tiles of at most `chunk_size` words (the
    `[N, V]` scores are never formed: `chunked.chunked_pointwise_stats`,
    the entropy accumulated online); the backward pass recomputes the tiles
    once for both. Gradients reach `hidden`, `kernel` and `bias` and are
    exact per token (the upstream cotangent of each token's log-prob and
    entropy enters the backward pass), so any loss built on them (a
    policy gradient, an entropy bonus, a PPO ratio) gets exact gradients.
    Design: `docs/token_statistics.md`.

    Args:
        hidden: float tensor `[..., d]` (float16, bfloat16, float32 or
            float64), the final hidden states.
        kernel: `[d, V]`, or `[V, d]` with `kernel_transposed=True` (a tied
            embedding matrix). A tensor or a Keras variable.
        tokens: integer word ids `[...]` (the leading shape of `hidden`) in
            `[0, V)`: the tokens whose log-probabilities are returned.
        bias: `[V]` or None.
        kernel_transposed: bool, `kernel` is `[V, d]`.
        temperature: float `> 0`, divides the (capped) scores.
        logit_soft_cap: None or a float `> 0` (Gemma 2's final soft cap),
            applied before the temperature.
        return_entropy: bool, also return the entropy of each position's
            distribution.
        chunk_size: maximum vocabulary tile width (`chunked.tile_width`).
        implementation: `"auto"` or `"ops"`, as in
            `chunked.chunked_pointwise_nll`.
        vocab_parallel: `"auto"`, True or False, as in
            `linear_cross_entropy` (JAX, a `keras.distribution` sharding the
            kernel variable on V; a bias split the same way).

    Returns:
        `log_probs` of shape `tokens.shape`, float32 (float64 for float64
        inputs; float32 under bfloat16 / float16 inputs), or
        `(log_probs, entropy)` with `return_entropy`.

    Raises:
        ValueError: eagerly, for a token outside `[0, V)` (under XLA such
            tokens give NaN), a kernel whose `d` does not match `hidden`, a
            non-floating dtype, or a bad option.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads.fused import linear_token_scores
    >>> rng = np.random.default_rng(0)
    >>> h = rng.normal(size=(2, 3, 8)).astype("float32")
    >>> w = rng.normal(size=(8, 37)).astype("float32")
    >>> y = np.array([[1, 5, 0], [36, 0, 7]])
    >>> log_p, ent = linear_token_scores(h, w, y, temperature=0.7,
    ...                                  return_entropy=True, chunk_size=16)
    >>> dense = ops.convert_to_numpy(ops.log_softmax(h @ w / 0.7, axis=-1))
    >>> ref = np.take_along_axis(dense, y[..., None], -1)[..., 0]
    >>> bool(np.allclose(ops.convert_to_numpy(log_p), ref, atol=1e-5))
    True
    >>> ref_ent = -(np.exp(dense) * dense).sum(-1)
    >>> bool(np.allclose(ops.convert_to_numpy(ent), ref_ent, atol=1e-5))
    True
    """
    transform_fn = score_transform(temperature, logit_soft_cap)
    return_entropy = check_bool("return_entropy", return_entropy)
    chunk_size = check_chunk_size(chunk_size)
    implementation = check_choice("implementation", implementation, ("auto", "ops"))
    check_vocab_parallel(vocab_parallel)
    hidden, kernel, bias, vocab = projection(hidden, kernel, bias, kernel_transposed)
    tokens, _ = checked_targets(tokens, vocab, None)
    options = dict(transform_fn=transform_fn, chunk_size=chunk_size,
                   kernel_transposed=kernel_transposed,
                   implementation=implementation, vocab_parallel=vocab_parallel)
    if return_entropy:
        nll, _, entropy = pointwise_entropy(hidden, kernel, bias, tokens, **options)
    else:
        nll = pointwise_stats(hidden, kernel, bias, tokens, **options)[0]
    log_probs = nan_if_invalid(-nll, tokens, vocab)
    if return_entropy:
        return log_probs, entropy
    return log_probs
