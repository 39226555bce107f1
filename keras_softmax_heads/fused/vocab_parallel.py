"""The vocabulary-parallel form of the fused loss (JAX), and its dispatch.

`pointwise_stats` is the one place where the fused loss chooses between the
single-device tiled pass (`chunked.chunked_pointwise_stats`), the Pallas GPU
kernel (`fused.pallas_cross_entropy`, JAX on a GPU; `single_device_stats`
picks it) and its vocabulary-parallel form (`vocab_parallel_stats`, JAX
under a `keras.distribution` that shards the output matrix on V, each shard
through `single_device_stats`); `vocab_parallel_summed`, the same for the
gradient in the forward pass (`chunked.summed_cross_entropy` on each
shard), and `vocab_parallel_divergence`, the distillation's
(`chunked.summed_divergence` on each shard). See `docs/chunked.md`, "Vocabulary sharding
(JAX)" and "The Pallas GPU kernel".
"""

import keras
from keras import ops

from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import chunked_pointwise_stats
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


def vocab_parallel_layout(kernel, kernel_transposed):
    """`(device_mesh, vocab_axis, batch_axis)` when the vocabulary-parallel
    form applies: the JAX backend, a current `keras.distribution`, and a
    `kernel` variable whose layout shards its vocabulary axis (dividing V)
    over a mesh axis of size > 1. None otherwise."""
    if keras.backend.backend() != "jax" or not isinstance(kernel, keras.Variable):
        return None
    distribution = keras.distribution.distribution()
    if distribution is None or len(kernel.shape) != 2:
        return None
    layout = distribution.get_variable_layout(kernel)
    axes = tuple(getattr(layout, "axes", None) or ())
    if len(axes) != 2:
        return None
    vocab_axis = axes[0] if kernel_transposed else axes[1]
    mesh = layout.device_mesh
    if vocab_axis is None or mesh is None or vocab_axis not in mesh.axis_names:
        return None
    size = mesh.shape[list(mesh.axis_names).index(vocab_axis)]
    vocab = kernel.shape[0] if kernel_transposed else kernel.shape[1]
    if size <= 1 or vocab % size:
        return None
    batch_axis = getattr(distribution, "batch_dim_name", None)
    if batch_axis == vocab_axis or batch_axis not in mesh.axis_names:
        batch_axis = None
    return mesh, vocab_axis, batch_axis


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
        best = jax.lax.stop_gradient(best)
        top = jax.lax.pmax(best, vocab_axis)
        ids = jnp.where(best == top, argmax + start, jnp.iinfo("int32").max)
        argmax = jax.lax.pmin(ids.astype("int32"), vocab_axis)
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
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    mesh, vocab_axis, batch_axis = layout
    d = hidden.shape[-1]
    lead = ops.shape(targets)
    h = ops.reshape(hidden, (-1, d))
    t = ops.reshape(targets, (-1,))
    rows = h.shape[0]
    if batch_axis is not None and (
        rows is None or rows % mesh.shape[list(mesh.axis_names).index(batch_axis)]
    ):
        batch_axis = None
    kernel = ops.convert_to_tensor(kernel)
    has_bias = bias is not None
    if has_bias:  # passed split on the vocabulary axis, whatever its own layout
        bias = ops.convert_to_tensor(bias)
    kernel_spec = (PartitionSpec(vocab_axis, None) if kernel_transposed
                   else PartitionSpec(None, vocab_axis))
    row_spec = PartitionSpec(batch_axis)

    def shard(h, w, t, *b):
        v_local = w.shape[0] if kernel_transposed else w.shape[1]
        start = jax.lax.axis_index(vocab_axis) * v_local
        shifted = t - start
        inside = (shifted >= 0) & (shifted < v_local)
        return local(h, w, b[0] if b else None, jnp.where(inside, shifted, 0), inside, start)

    in_specs = (PartitionSpec(batch_axis, None), kernel_spec, row_spec)
    out = jax.shard_map(
        shard, mesh=mesh.backend_mesh,
        in_specs=in_specs + ((PartitionSpec(vocab_axis),) if has_bias else ()),
        out_specs=(row_spec,) * num_outputs, check_vma=False,
    )(h, kernel, t, *((bias,) if has_bias else ()))
    return tuple(ops.reshape(x, lead) for x in out)


class VocabShards:
    """The collectives across the vocabulary mesh axis `axis` (inside a
    `jax.shard_map`) that `chunked.summed_cross_entropy` takes as its
    `shards`: `vocab`, the whole vocabulary's size; `start`, this device's
    first word id; `max`, `sum` and `argmax` of per-row statistics."""

    def __init__(self, axis, start, vocab):
        self.axis, self.start, self.vocab = axis, start, vocab

    def max(self, x):
        import jax

        return jax.lax.pmax(jax.lax.stop_gradient(x), self.axis)

    def sum(self, x):
        import jax

        return jax.lax.psum(x, self.axis)

    def logsumexp(self, g):
        """`log sum_v exp(g_v)` of each row of `g` `[rows, V / n]` over the
        whole vocabulary, `[rows, 1]`."""
        import jax.numpy as jnp

        peak = self.max(jnp.max(g, axis=1, keepdims=True))
        return peak + jnp.log(self.sum(jnp.sum(jnp.exp(g - peak), axis=1, keepdims=True)))

    def argmax(self, g):
        """The word id of each row's largest score `g` `[rows, V / n]` over
        the whole vocabulary (the first of a tie, as `argmax` on one
        device), int32."""
        import jax
        import jax.numpy as jnp

        best = jnp.max(g, axis=1)
        ids = jnp.argmax(g, axis=1).astype("int32") + self.start
        top = jax.lax.pmax(best, self.axis)
        ids = jnp.where(best == top, ids, jnp.iinfo("int32").max)
        return jax.lax.pmin(ids, self.axis)


def vocab_parallel_summed(layer, targets, weights, layout, *, label_smoothing=0.0,
                          z_loss=0.0, token_chunk_size=None, argmax=False,
                          implementation="auto"):
    """`chunked.summed_cross_entropy` with the kernel sharded on V (JAX
    only): the gradient in the forward pass, vocabulary-parallel.

    Each device runs the summed pass over token chunks on its `[V / n, d]`
    shard (and `[V / n]` bias slice), each chunk's row statistics (max, sum
    of exponentials, target score, score sum, argmax) combined across the
    vocabulary mesh axis (`VocabShards`): per chunk a few `[rows]`
    all-reduces, never a `[V, d]` gather. The kernel and bias gradients
    stay sharded; `h`'s is each device's partial sum, added across the
    shards by `jax.shard_map`'s transpose (`h` is replicated over that
    axis). Rows are split over the layout's batch axis when it divides
    them.

    Args:
        layer: a `chunked.divergence.OutputLayer` (`hidden` `[N, d]`, the
            kernel, the bias or None, the soft cap).
        targets: `[N]` int32 ids in `[0, V)`; weights: `[N]` float.
        layout: what `vocab_parallel_layout(kernel, kernel_transposed)`
            returned (not None).
        label_smoothing, z_loss, token_chunk_size, argmax, implementation:
            as in `chunked.summed_cross_entropy` (`token_chunk_size` sized
            for a shard's `V / n` words by default).

    Returns:
        The weighted sum (a scalar), with `argmax` the pair `(sum, argmax)`
        as `chunked.summed_cross_entropy`'s.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from keras_softmax_heads.chunked.summed_cross_entropy import summed_cross_entropy

    mesh, vocab_axis, batch_axis = layout
    transposed, has_bias = layer.kernel_transposed, layer.bias is not None
    kernel = ops.convert_to_tensor(layer.kernel)
    vocab = kernel.shape[0] if transposed else kernel.shape[1]
    rows = layer.hidden.shape[0]
    if batch_axis is not None and (
        rows is None or rows % mesh.shape[list(mesh.axis_names).index(batch_axis)]
    ):
        batch_axis = None
    row_spec = PartitionSpec(batch_axis)

    def shard(h, w, t, weights, *b):
        v_local = w.shape[0] if transposed else w.shape[1]
        start = jax.lax.axis_index(vocab_axis) * v_local
        shifted = t - start
        local_targets = jnp.where((shifted >= 0) & (shifted < v_local), shifted, -1)
        local = type(layer)(h, w, b[0] if b else None, transposed, layer.soft_cap)
        out = summed_cross_entropy(
            local, local_targets, weights, label_smoothing=label_smoothing, z_loss=z_loss,
            token_chunk_size=token_chunk_size, argmax=argmax, implementation=implementation,
            shards=VocabShards(vocab_axis, start, vocab))
        # One sum per device; those of a batch shard's vocabulary shards are equal.
        return (out[0][None], out[1]) if argmax else (out[None],)

    kernel_spec = (PartitionSpec(vocab_axis, None) if transposed
                   else PartitionSpec(None, vocab_axis))
    in_specs = (PartitionSpec(batch_axis, None), kernel_spec, row_spec, row_spec)
    out = jax.shard_map(
        shard, mesh=mesh.backend_mesh,
        in_specs=in_specs + ((PartitionSpec(vocab_axis),) if has_bias else ()),
        out_specs=(row_spec,) * (2 if argmax else 1), check_vma=False,
    )(ops.convert_to_tensor(layer.hidden), kernel, targets, weights,
      *((ops.convert_to_tensor(layer.bias),) if has_bias else ()))
    total = jnp.sum(out[0])
    return (total, out[1]) if argmax else total


def vocab_parallel_divergence(student, teacher, weights, layout, divergence, **options):
    """`chunked.summed_divergence` with the output matrices sharded on V
    (JAX only): the distillation's summed divergence with its gradient in
    the forward pass, vocabulary-parallel.

    Each device runs the summed pass over token chunks on its `[V / n]`
    columns of both sides (the student's kernel shard; the teacher's kernel
    and both biases are split the same way whatever their own layouts),
    each chunk's per-token log-sum-exps and sums combined across the
    vocabulary mesh axis (`VocabShards`). The student's kernel and bias
    gradients stay sharded (the teacher's too, with `teacher_gradient`);
    the hidden states' are each device's partial sums, added across the
    shards by `jax.shard_map`'s transpose. Rows are split over the
    layout's batch axis when it divides them.

    Args:
        student, teacher: `chunked.divergence.OutputLayer`s (flat hidden
            states `[N, d_s]`, `[N, d_t]`; the same `V`).
        weights: `[N]` float.
        layout: `vocab_parallel_layout` of the student's kernel (not None).
        divergence, **options: as in `chunked.summed_divergence` (`beta`,
            `temperature`, `token_chunk_size`, `teacher_gradient`,
            `implementation`).

    Returns:
        The weighted sum, a scalar.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from keras_softmax_heads.chunked.summed_divergence import summed_divergence

    mesh, vocab_axis, batch_axis = layout
    rows = student.hidden.shape[0]
    if batch_axis is not None and (
        rows is None or rows % mesh.shape[list(mesh.axis_names).index(batch_axis)]
    ):
        batch_axis = None
    row_spec = PartitionSpec(batch_axis)
    sides = (student, teacher)
    # Flat inputs and their specs: hidden states (rows), kernel and bias
    # (vocabulary columns) of each side, then the weights.
    inputs, specs, slots = [], [], []
    for side in sides:
        kernel = ops.convert_to_tensor(side.kernel)
        vocab = kernel.shape[0] if side.kernel_transposed else kernel.shape[1]
        inputs += [ops.convert_to_tensor(side.hidden), kernel]
        specs += [PartitionSpec(batch_axis, None),
                  PartitionSpec(vocab_axis, None) if side.kernel_transposed
                  else PartitionSpec(None, vocab_axis)]
        slots.append(side.bias is not None)
        if side.bias is not None:
            inputs.append(ops.convert_to_tensor(side.bias))
            specs.append(PartitionSpec(vocab_axis))
    inputs.append(weights)
    specs.append(row_spec)

    def shard(*args):
        args = list(args)
        local = []
        for side, has_bias in zip(sides, slots):
            h, w = args.pop(0), args.pop(0)
            b = args.pop(0) if has_bias else None
            local.append(type(side)(h, w, b, side.kernel_transposed, side.soft_cap))
        v_local = (local[0].kernel.shape[0] if student.kernel_transposed
                   else local[0].kernel.shape[1])
        start = jax.lax.axis_index(vocab_axis) * v_local
        total = summed_divergence(local[0], local[1], args[0], divergence,
                                  shards=VocabShards(vocab_axis, start, vocab), **options)
        # One sum per device; those of a batch shard's vocabulary shards are equal.
        return total[None]

    out = jax.shard_map(shard, mesh=mesh.backend_mesh, in_specs=tuple(specs),
                        out_specs=row_spec, check_vma=False)(*inputs)
    return jnp.sum(out)


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
