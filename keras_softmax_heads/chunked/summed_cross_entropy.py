"""The summed cross-entropy over token chunks, its gradient taken in the
forward pass: `sum_i w_i loss_i` of one output layer.

`chunked.core`'s tiled pass gives per-token statistics with an exact
gradient for any upstream cotangent; its backward pass recomputes the
scores, four `N d V` products where the dense loss does three. When the
loss is summed with known weights (`linear_cross_entropy`'s `"sum"` /
`"mean"` reductions), the cotangent of every token is the one scalar
upstream times its weight, so the gradient can be finished in the forward
pass, as `chunked.summed_divergence` does for two output layers: rows of
`token_chunk_size` tokens at a time, each chunk's scores over the whole
vocabulary (`[chunk, V]`, never `[N, V]`), its log-sum-exp, loss and score
gradient, its rows of `dh` and its term of `dW` (on a CPU added into place
one vocabulary tile at a time; one product on a GPU / TPU) and `db`. Three products, as dense; the
backward pass only scales the stored gradients by the upstream scalar.

Per token, with `g` the scores (soft-capped or not), `lse = logsumexp g`,
`eps` the label smoothing and `zl` the z-loss weight:

    loss = (1 - eps) (lse - g_target) + eps (lse - mean_v g_v) + zl lse**2
    dloss/dg_v = (1 + 2 zl lse) p_v - (1 - eps) [v = target] - eps / V

The price: a call whose gradient is not taken still computes it in a
TensorFlow graph without XLA (not under `jax.jit` or `jit_compile=True`,
where XLA removes the unused work, nor on PyTorch, where
`dispatch.needs_gradient` skips it: `docs/results/forward_only/`), and the
kernel's gradient is accumulated over the chunks in float32 (a float32
`[d, V]` buffer beside a bfloat16 kernel's). Design notes and measurements:
`docs/chunked.md`, "The gradient in the forward pass".

The same arithmetic runs on one device's shard of the vocabulary (`shards`:
`chunked.vocab_parallel.vocab_parallel_summed`), the row statistics (max,
sum of exponentials, target score, score sum, argmax) then combined across
the shards by the collectives `shards` names.
"""

from keras import ops

from keras_softmax_heads.chunked import dispatch
from keras_softmax_heads.chunked.core import accumulation_dtype
from keras_softmax_heads.chunked.core import tile_loop
from keras_softmax_heads.chunked.divergence import upstream_of
from keras_softmax_heads.chunked.summed_divergence import Side
from keras_softmax_heads.chunked.summed_divergence import TokenChunks
from keras_softmax_heads.chunked.summed_divergence import float_weights
from keras_softmax_heads.chunked.summed_divergence import local_to_shard
from keras_softmax_heads.chunked.summed_divergence import normaliser_and_exponentials
from keras_softmax_heads.chunked.summed_divergence import padded
from keras_softmax_heads.chunked.summed_divergence import target_scores
from keras_softmax_heads.chunked.summed_divergence import unpadded
from keras_softmax_heads.chunked.summed_divergence import unpadded_rows
from keras_softmax_heads.chunked.tiling import kernel_geometry


def chunk_loss(g, targets, weights, label_smoothing, z_loss, argmax, shards=None):
    """`(loss, dg, best)` of a chunk's scores `g` `[size, V]`, targets and
    weights `[size]`: the per-token loss `[size]`, the gradient of
    `sum_i w_i loss_i` with respect to `g` and the argmax word (int32, None
    unless `argmax`). The token weights scale the softmax's row and the
    target's column as they are written (`dispatch.scaled_minus_target`),
    not in a pass of their own.

    With `shards` (see `summed_cross_entropy`) `g` is this device's columns
    of the vocabulary and `targets` are shifted into them (negative: the
    target is another shard's); the row statistics are combined across the
    shards, `dg` is this shard's columns."""
    vocab = g.shape[1] if shards is None else shards.vocab
    lse, e, total = normaliser_and_exponentials(g, shards)
    targets, target_score, inside = target_scores(g, targets, shards)
    target_weights = local_to_shard((1.0 - label_smoothing) * weights, inside)
    loss = lse - target_score
    soft = ops.ones_like(lse)
    if label_smoothing:
        score_sum = ops.sum(g, axis=1)
        mean_score = (score_sum if shards is None else shards.sum(score_sum)) / vocab
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - mean_score)
    if z_loss:
        loss = loss + z_loss * ops.square(lse)
        soft = soft + 2.0 * z_loss * lse
    best = None
    if argmax:
        best = (ops.cast(ops.argmax(g, axis=1), "int32") if shards is None
                else shards.argmax(g))
    dg = dispatch.scaled_minus_target(e, soft * weights / total, targets, target_weights)
    if label_smoothing:
        dg = dg - (label_smoothing / vocab) * weights[:, None]
    return loss, dg, best


def summed_cross_entropy(layer, targets, weights, *, label_smoothing=0.0, z_loss=0.0,
                         token_chunk_size=None, argmax=False, implementation="auto",
                         shards=None, return_per_token=False):
    """`sum_i w_i loss_i` and its gradient, over chunks of tokens.

    The core behind `linear_cross_entropy(..., gradient_in_forward=True)`
    (which checks the arguments). `layer` is a `chunked.divergence.
    OutputLayer` (`hidden` `[N, d]`, the kernel, the bias, the soft cap),
    `targets` `[N]` int32 ids in `[0, V)` (not checked here), `weights`
    `[N]` float (0: the token adds nothing; its gradient is the token's
    loss). At most `token_chunk_size` tokens (default
    `summed_divergence.default_token_chunk(V)` for the platform that runs
    it: `2**26` scores a chunk on a CPU, `2**28` on a GPU / TPU, where the
    kernel gradient's term is one product per chunk,
    `summed_divergence.kernel_tile_width`) are scored over the whole
    vocabulary at a time; the gradients are computed in the forward pass
    (the module docstring). `implementation`: as in
    `chunked.chunked_pointwise_nll`.

    `shards` (None: one device) runs it on one device's columns of a
    vocabulary split over devices, inside a `jax.shard_map`:
    `layer`'s kernel and bias are this device's shard, `targets` are
    shifted into it (-1 for a word of another shard) and `shards`
    gives `vocab` (the whole vocabulary's size) and the collectives across
    the shards, `max(x)`, `sum(x)` (elementwise over `[rows]` vectors) and
    `argmax(g)` (a chunk's `[rows]` word ids over the whole vocabulary).
    The sum and argmax returned are then the whole vocabulary's; the
    gradients are this device's share (its kernel / bias shard, its
    partial `dh`), scaled by `shards.sum` of the upstream cotangent, which
    `jax.shard_map` splits evenly over the devices of an output they all
    hold (`chunked.vocab_parallel.vocab_parallel_summed`).

    `return_per_token=True` also returns the per-token losses `[N]` the
    pass computes (without a gradient of their own: the sum carries it),
    from which `chunked.vocab_parallel.token_losses` makes a per-token
    loss.

    Returns:
        The sum, a float32 scalar (float64 for float64 inputs); with
        `argmax=True` the pair `(sum, argmax)`, `argmax` `[N]` int32 (the
        word of the largest score, the first on ties; no gradient); with
        `return_per_token=True` the per-token losses `[N]` after them.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads.chunked.divergence import OutputLayer
    >>> rng = np.random.default_rng(0)
    >>> h = rng.normal(size=(5, 8)).astype("float32")
    >>> w = rng.normal(size=(8, 50)).astype("float32")
    >>> y = np.array([3, 0, 49, 7, 7], "int32")
    >>> weights = np.array([1.0, 0.5, 0.0, 2.0, 1.0], "float32")
    >>> total = summed_cross_entropy(OutputLayer(h, w), y, weights, token_chunk_size=2)
    >>> log_p = ops.convert_to_numpy(ops.log_softmax(h @ w))
    >>> nll = -log_p[np.arange(5), y]
    >>> bool(np.isclose(float(total), (weights * nll).sum(), rtol=1e-5))
    True
    """
    hidden = layer.hidden
    _, vocab = kernel_geometry(hidden, layer.kernel, layer.kernel_transposed)
    chunks = TokenChunks.of(hidden, vocab, token_chunk_size)
    n = chunks.n
    acc = accumulation_dtype(hidden, layer.kernel)
    has_bias = layer.bias is not None
    args = [hidden, layer.kernel] + ([layer.bias] if has_bias else [])
    gradients = dispatch.gradients_needed(hidden, layer.kernel)
    eps, zl = float(label_smoothing), float(z_loss)

    @ops.custom_gradient
    def summed_fn(targets, weights, *args):
        side = Side(type(layer)(args[0], args[1], args[2] if has_bias else None,
                                layer.kernel_transposed, layer.soft_cap), acc, chunks.pad,
                    chunks.kernel_tile, gradients)
        t_all = padded(targets, chunks.pad)
        w_all = padded(ops.cast(weights, acc), chunks.pad)

        def body(i, state):
            total, per_token, best_all, grads = state
            start = i * chunks.size
            h = side.rows(start, chunks.size)
            g, dg_dz = side.scores(h, 1.0)
            t = ops.slice(t_all, [start], [chunks.size])
            w = ops.slice(w_all, [start], [chunks.size])
            loss, dg, best = chunk_loss(g, t, w, eps, zl, argmax, shards)
            # A weight-0 token (padding too) adds nothing, even a
            # non-finite loss.
            total = total + ops.sum(ops.where(w != 0, w * loss, ops.zeros_like(loss)))
            per_token = ops.slice_update(per_token, [start], loss)
            if argmax:
                best_all = ops.slice_update(best_all, [start], best)
            grads = side.gradients(h, dispatch.multiply(dg, dg_dz), grads, start)
            return total, per_token, best_all, grads

        def forward():
            best_all = ops.zeros_like(t_all) if argmax else ops.zeros((), "int32")
            state = (ops.zeros((), acc), ops.zeros_like(w_all), best_all,
                     side.zeros(implementation))
            # `chunks.count` is a tensor when `N` is known only when the step runs.
            total, per_token, best_all, grads = tile_loop(chunks.count, body, state)
            if argmax:
                best_all = unpadded(best_all, n)
            return total, unpadded(per_token, n), best_all, unpadded_rows(grads, n)

        total, per_token, best_all, grads = dispatch.run_pass(forward, implementation)

        def grad_fn(*args, upstream=None, variables=None):
            u = upstream_of(args, upstream, variables, "summed_cross_entropy")
            u = ops.cast(u[0] if argmax or return_per_token else u, acc)
            # Under `shards` each device receives its share of `u` (the
            # weights' gradient is a share too, as is `h`'s: `jax.shard_map`
            # adds them across the shards).
            out = side.scaled(u if shards is None else shards.sum(u), grads, inputs)
            return (None, ops.cast(u * per_token, weights.dtype), *out)

        inputs = args
        if argmax or return_per_token:
            # One output: the sum, then the argmax words as floats, then
            # the per-token losses.
            parts = [total[None]] + ([ops.cast(best_all, acc)] if argmax else []) + (
                [per_token] if return_per_token else [])
            return ops.concatenate(parts), grad_fn
        return total, grad_fn

    targets = ops.cast(ops.convert_to_tensor(targets), "int32")
    out = summed_fn(targets, float_weights(weights, acc), *args)
    if not (argmax or return_per_token):
        return out
    results, n = [out[0]], targets.shape[0]
    n = ops.shape(targets)[0] if n is None else n
    rest = ops.stop_gradient(out[1:])
    if argmax:
        results.append(ops.cast(rest[:n], "int32"))
        rest = rest[n:]
    if return_per_token:
        results.append(rest)
    return tuple(results)
