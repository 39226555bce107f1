"""The vocabulary-parallel form of the fused loss (JAX), and its dispatch.

`pointwise_stats` is the one place where the fused loss chooses between the
single-device tiled pass (`chunked.chunked_pointwise_stats`), the Pallas GPU
kernel (`fused.pallas_cross_entropy`, JAX on a GPU; `single_device_stats`
picks it) and its vocabulary-parallel form (`vocab_parallel_stats`, JAX
under a `keras.distribution` that shards the output matrix on V, each shard
through `single_device_stats`). The summed passes' vocabulary-parallel
forms (`vocab_parallel_summed`, `vocab_parallel_divergence`) and the layout
test (`vocab_parallel_layout`, re-exported here) are
`chunked.vocab_parallel`'s. See `docs/chunked.md`, "Vocabulary sharding (JAX)" and "The Pallas
GPU kernel".
"""

import keras
from keras import ops

from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import chunked_pointwise_stats
from keras_softmax_heads.chunked.vocab_parallel import batch_axis_for
from keras_softmax_heads.chunked.vocab_parallel import best_word
from keras_softmax_heads.chunked.vocab_parallel import kernel_spec
from keras_softmax_heads.chunked.vocab_parallel import on_shards
from keras_softmax_heads.chunked.vocab_parallel import shard_start
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_layout
from keras_softmax_heads.fused.pallas_cross_entropy import check_filter_eps
from keras_softmax_heads.fused.pallas_cross_entropy import pallas_pointwise_stats
from keras_softmax_heads.fused.pallas_cross_entropy import uses_kernel
from keras_softmax_heads.validation import check_choice

#: Values of the `vocab_parallel` option.
VOCAB_PARALLEL_OPTIONS = ("auto", True, False)

#: Values of the fused loss's `implementation` option.
IMPLEMENTATIONS = ("auto", "ops", "pallas")


def check_vocab_parallel(vocab_parallel):
    """`vocab_parallel` if it is `"auto"`, True or False, else raises."""
    return check_choice("vocab_parallel", vocab_parallel, VOCAB_PARALLEL_OPTIONS)


def single_device_stats(hidden, kernel, bias, targets, *, transform_fn, chunk_size,
                        kernel_transposed, implementation, filter_eps=None,
                        token_chunk_size=None):
    """The per-token statistics on one device: the Pallas kernel
    (`pallas_cross_entropy.pallas_pointwise_stats`) where
    `pallas_cross_entropy.uses_kernel` says it runs (`implementation`
    `"pallas"`, or `"auto"` with JAX on a GPU; `chunk_size` bounds its
    backward's vocabulary chunk), else the tiled pass
    `chunked.chunked_pointwise_stats` (`"ops"`, and `"auto"` elsewhere;
    `filter_eps` is then ignored: exact gradients). A `token_chunk_size`
    is the tiled pass's (`"auto"` then takes it; with `"pallas"` it
    raises)."""
    if not isinstance(kernel, keras.Variable):
        kernel = ops.convert_to_tensor(kernel)
    if token_chunk_size is not None and implementation == "pallas":
        raise ValueError(
            "`token_chunk_size` sets the tiled pass's token blocks; the Pallas "
            "kernel has its own. Pass implementation='auto' or 'ops', or no "
            f"token_chunk_size. Received: token_chunk_size={token_chunk_size}, "
            "implementation='pallas'"
        )
    if token_chunk_size is None and uses_kernel(
            ops.convert_to_tensor(hidden), kernel, implementation):
        return pallas_pointwise_stats(
            hidden, kernel, bias, targets, transform_fn=transform_fn,
            kernel_transposed=kernel_transposed, filter_eps=filter_eps,
            chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
        )
    return chunked_pointwise_stats(
        hidden, kernel, bias, targets, transform_fn=transform_fn,
        chunk_size=chunk_size, kernel_transposed=kernel_transposed,
        implementation="ops" if implementation == "ops" else "auto",
        token_chunk_size=token_chunk_size,
    )


def pointwise_stats(hidden, kernel, bias, targets, *, transform_fn, chunk_size,
                    kernel_transposed, implementation, vocab_parallel="auto",
                    filter_eps=None, token_chunk_size=None):
    """`chunked.chunked_pointwise_stats`, by the Pallas GPU kernel or
    vocabulary-parallel where they apply.

    Args:
        hidden, kernel, bias, targets, transform_fn, chunk_size,
        kernel_transposed: as in `chunked.chunked_pointwise_stats`.
        implementation: `"auto"`, `"ops"` or `"pallas"`
            (`single_device_stats`).
        filter_eps: None or a float in `(0, 1)`: the Pallas kernel's
            gradient filtering (`pallas_cross_entropy`); the tiled pass
            ignores it.
        token_chunk_size: None or an int: the tiled pass's token blocks
            (`chunked.chunked_pointwise_stats`), on each shard too.
        vocab_parallel: `"auto"`, True or False. `"auto"` and True run
            `vocab_parallel_stats` when `vocab_parallel_layout` finds a
            sharded vocabulary axis; otherwise `"auto"` runs the
            single-device pass and True raises.

    Returns:
        `(nll, lse, score_sum, argmax)`, each of the targets' shape.
    """
    check_vocab_parallel(vocab_parallel)
    implementation = check_choice("implementation", implementation, IMPLEMENTATIONS)
    filter_eps = check_filter_eps(filter_eps)
    layout = parallel_layout(kernel, kernel_transposed, vocab_parallel)
    if layout is not None:
        return vocab_parallel_stats(
            hidden, kernel, targets, layout, bias=bias, transform_fn=transform_fn,
            chunk_size=chunk_size, kernel_transposed=kernel_transposed,
            implementation=implementation, filter_eps=filter_eps,
            token_chunk_size=token_chunk_size,
        )
    return single_device_stats(
        hidden, kernel, bias, targets, transform_fn=transform_fn,
        chunk_size=chunk_size, kernel_transposed=kernel_transposed,
        implementation=implementation, filter_eps=filter_eps,
        token_chunk_size=token_chunk_size,
    )


def vocab_parallel_stats(hidden, kernel, targets, layout, *, transform_fn,
                         chunk_size, kernel_transposed, implementation,
                         filter_eps=None, token_chunk_size=None, bias=None):
    """`chunked_pointwise_stats` with the kernel sharded on V (JAX only).

    Each device runs the tiled pass on its `[V / n, d]` shard (and its
    `[V / n]` slice of the bias, if any), with the
    targets shifted to its range (a target elsewhere contributes no target
    score), then the statistics are combined across the vocabulary mesh
    axis: `lse = m + log(psum(exp(lse_k - m)))` (`m = pmax(lse_k)`, no
    gradient), target score and score sum by `psum`, the argmax by `pmax` of
    each shard's best score (then the smallest id). Gradients flow through
    the collectives and each shard's own backward pass: the kernel gradient
    stays sharded.

    Args:
        hidden: `[..., d]`; kernel: `[d, V]` (or `[V, d]`,
            `kernel_transposed`); targets: `[...]` int32 in `[0, V)`.
        layout: what `vocab_parallel_layout(kernel, kernel_transposed)`
            returned (not None).
        transform_fn, chunk_size, kernel_transposed, implementation,
            filter_eps, token_chunk_size: as in `single_device_stats` (each
            shard's pass).
        bias: `[V]` or None, split over the vocabulary axis like the
            kernel (its gradient comes back split too).

    Returns:
        `(nll, lse, score_sum, argmax)`, each of the targets' shape.
    """
    import jax
    import jax.numpy as jnp

    vocab_axis = layout[1]

    def local(h, w, b, local_targets, inside, start):
        nll, lse, score_sum, argmax = single_device_stats(
            h, w, b, local_targets, transform_fn=transform_fn,
            chunk_size=chunk_size, kernel_transposed=kernel_transposed,
            implementation=implementation, filter_eps=filter_eps,
            token_chunk_size=token_chunk_size,
        )
        total_lse, target = combine_shards(lse, nll, inside, vocab_axis)
        score_sum = jax.lax.psum(score_sum, vocab_axis)
        # The argmax: each shard's best score, recomputed from its row.
        row = jnp.take(w, argmax, axis=0) if kernel_transposed else jnp.take(w, argmax, axis=1).T
        best = jnp.sum(h.astype(lse.dtype) * row.astype(lse.dtype), axis=-1)
        if b is not None:
            best = best + jnp.take(b, argmax).astype(lse.dtype)
        if transform_fn is not None:
            best = transform_fn(best)
        argmax = best_word(vocab_axis, jax.lax.stop_gradient(best), argmax + start)
        return total_lse - target, total_lse, score_sum, argmax

    return over_vocabulary_shards(local, 4, hidden, kernel, bias, targets, layout,
                                  kernel_transposed)


def over_vocabulary_shards(local, num_outputs, hidden, kernel, bias, targets, layout,
                           kernel_transposed):
    """Runs `local` on each device's vocabulary shard (`jax.shard_map`).

    `local(h, w, b, local_targets, inside, start)` gets the flat rows `h`
    `[n, d]`, the device's kernel shard `w` and bias slice `b` (None
    without a bias), the targets shifted into the
    shard's range (0 outside it), whether each target is in the shard, and
    the shard's first word id; it returns `num_outputs` per-row tensors,
    combined across the vocabulary axis by its own collectives. Rows are
    split over the layout's batch axis when it divides them. Returns the
    outputs reshaped to the targets' shape.
    """
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    mesh, vocab_axis, _ = layout
    d = hidden.shape[-1]
    lead = ops.shape(targets)
    h = ops.reshape(hidden, (-1, d))
    t = ops.reshape(targets, (-1,))
    batch_axis = batch_axis_for(layout, h.shape[0])
    kernel = ops.convert_to_tensor(kernel)
    has_bias = bias is not None
    if has_bias:  # passed split on the vocabulary axis, whatever its own layout
        bias = ops.convert_to_tensor(bias)
    row_spec = PartitionSpec(batch_axis)

    def shard(h, w, t, *b):
        start, v_local = shard_start(vocab_axis, w, kernel_transposed)
        shifted = t - start
        inside = (shifted >= 0) & (shifted < v_local)
        return local(h, w, b[0] if b else None, jnp.where(inside, shifted, 0), inside, start)

    in_specs = (PartitionSpec(batch_axis, None), kernel_spec(vocab_axis, kernel_transposed),
                row_spec)
    out = on_shards(
        shard, mesh, in_specs + ((PartitionSpec(vocab_axis),) if has_bias else ()),
        (row_spec,) * num_outputs,
    )(h, kernel, t, *((bias,) if has_bias else ()))
    return tuple(ops.reshape(x, lead) for x in out)


def combine_shards(lse, nll, inside, vocab_axis):
    """`(lse, target_score)` over the whole vocabulary from each shard's
    `lse` and `nll` (inside a `shard_map`): a stable log-sum-exp of the
    shards' `lse`, and the target's score from the shard that holds it."""
    import jax
    import jax.numpy as jnp

    peak = jax.lax.pmax(jax.lax.stop_gradient(lse), vocab_axis)
    total_lse = peak + jnp.log(jax.lax.psum(jnp.exp(lse - peak), vocab_axis))
    target = jax.lax.psum(jnp.where(inside, lse - nll, 0.0), vocab_axis)
    return total_lse, target


def parallel_layout(kernel, kernel_transposed, vocab_parallel):
    """`vocab_parallel_layout(kernel, kernel_transposed)` where the
    `vocab_parallel` option asks for it, else None; raises for
    `vocab_parallel=True` without one. (A bias goes with the kernel's
    shards, whatever its own layout.)"""
    check_vocab_parallel(vocab_parallel)
    if not vocab_parallel:
        return None
    layout = vocab_parallel_layout(kernel, kernel_transposed)
    if layout is None and vocab_parallel is True:
        raise ValueError(
            "vocab_parallel=True needs the JAX backend and a `kernel` "
            "variable that the current keras.distribution shards on its "
            f"vocabulary axis (evenly). Received: kernel of shape "
            f"{tuple(kernel.shape)} ({type(kernel).__name__}) on the "
            f"{keras.backend.backend()} backend"
        )
    return layout


def pointwise_entropy(hidden, kernel, bias, targets, *, transform_fn, chunk_size,
                      kernel_transposed, implementation, vocab_parallel="auto"):
    """`(nll, lse, entropy)` of `softmax(g(h W + b))`: one tiled pass of
    `chunked.chunked_pointwise_stats(..., entropy=True)`,
    vocabulary-parallel where `pointwise_stats` is.

    Args: as in `pointwise_stats`.

    Returns:
        `(nll, lse, entropy)`, each of the targets' shape, differentiable.
    """
    layout = parallel_layout(kernel, kernel_transposed, vocab_parallel)
    if layout is not None:
        return vocab_parallel_entropy(
            hidden, kernel, targets, layout, bias=bias, transform_fn=transform_fn,
            chunk_size=chunk_size, kernel_transposed=kernel_transposed,
            implementation=implementation,
        )
    nll, lse, _, _, entropy = chunked_pointwise_stats(
        hidden, kernel, bias, targets, transform_fn=transform_fn,
        chunk_size=chunk_size, kernel_transposed=kernel_transposed,
        implementation=implementation, entropy=True,
    )
    return nll, lse, entropy


def vocab_parallel_entropy(hidden, kernel, targets, layout, *, transform_fn,
                           chunk_size, kernel_transposed, implementation, bias=None):
    """`pointwise_entropy` with the kernel sharded on V (JAX only).

    Each device runs the tiled pass on its shard (and bias slice; targets
    shifted to its range), giving its `lse_k`, target score and entropy `H_k`, hence
    `E_k = lse_k - H_k` (the mean score under the shard's own softmax).
    Combined across the vocabulary mesh axis: `lse = m + log(psum(exp(lse_k
    - m)))`, the target score by `psum`, and
    `E_p[g] = psum(exp(lse_k - lse) E_k)`, `H = lse - E_p[g]`. Gradients flow
    through the collectives and each shard's own backward pass.

    Args: as in `vocab_parallel_stats`.

    Returns:
        `(nll, lse, entropy)`, each of the targets' shape.
    """
    import jax
    import jax.numpy as jnp

    vocab_axis = layout[1]

    def local(h, w, b, local_targets, inside, start):
        nll, lse, _, _, entropy = chunked_pointwise_stats(
            h, w, b, local_targets, transform_fn=transform_fn,
            chunk_size=chunk_size, kernel_transposed=kernel_transposed,
            implementation=implementation, entropy=True,
        )
        total_lse, target = combine_shards(lse, nll, inside, vocab_axis)
        mean = jax.lax.psum(jnp.exp(lse - total_lse) * (lse - entropy), vocab_axis)
        return total_lse - target, total_lse, total_lse - mean

    return over_vocabulary_shards(local, 3, hidden, kernel, bias, targets, layout,
                                  kernel_transposed)
