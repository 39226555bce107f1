"""The vocabulary-parallel form of the summed passes (JAX): the kernel
sharded on its vocabulary axis by a `keras.distribution`, each device
running `chunked.summed_cross_entropy` / `chunked.summed_divergence` /
`chunked.summed_mixture.summed_mixture_nll` on its own `[V / n]` columns
inside `jax.shard_map`, the per-token statistics combined across the
devices (`VocabShards`); and `token_losses`, per-token losses with exact
gradients from any of them (the heads' per-token `log_likelihood`, the
per-token divergence on the shards).

`vocab_parallel_layout` says whether a kernel variable is so sharded (the
one test; `fused.vocab_parallel` uses it for the fused loss's per-token
pass too). The shard map and the collectives are JAX's, imported lazily;
elsewhere nothing here runs. See `docs/chunked.md`, "Sharding" and "The
gradient in the forward pass".
"""

import keras
from keras import ops

from keras_softmax_heads.chunked.platform import chunk_size_for
from keras_softmax_heads.chunked.summed_cross_entropy import summed_cross_entropy
from keras_softmax_heads.chunked.summed_divergence import summed_divergence
from keras_softmax_heads.chunked.summed_mixture import summed_mixture_nll
from keras_softmax_heads.functional import dispatch


def on_shards(shard, mesh, in_specs, out_specs, check_vma=False):
    """`jax.shard_map` of `shard` over the Keras `mesh` (`in_specs`,
    `out_specs` as `PartitionSpec`s), its body traced in
    `functional.dispatch.per_shard`: one device's arrays, on which the
    knot histograms keep the platform's method. `check_vma=False` (the
    passes' convention): a replicated input's cotangent is summed over the
    shards, a replicated output's cotangent reaches each shard divided by
    their number."""
    import jax

    def body(*args):
        with dispatch.per_shard():
            return shard(*args)

    return jax.shard_map(body, mesh=mesh.backend_mesh, in_specs=tuple(in_specs),
                         out_specs=out_specs, check_vma=check_vma)


def batch_axis_for(layout, rows):
    """The layout's batch axis if it divides `rows` (static), else None:
    rows are then not split."""
    mesh, _, batch_axis = layout
    if batch_axis is not None and (
        rows is None or rows % mesh.shape[list(mesh.axis_names).index(batch_axis)]
    ):
        return None
    return batch_axis


def kernel_spec(vocab_axis, kernel_transposed):
    """The `PartitionSpec` that splits a kernel's vocabulary axis over
    `vocab_axis`: the first of a `[V, d]` (transposed) kernel, the second
    of a `[d, V]` one."""
    from jax.sharding import PartitionSpec

    if kernel_transposed:
        return PartitionSpec(vocab_axis, None)
    return PartitionSpec(None, vocab_axis)


def shard_start(vocab_axis, kernel_shard, kernel_transposed):
    """`(start, size)` of this device's vocabulary shard inside a
    `jax.shard_map`: its first word id and its number of words."""
    import jax

    size = kernel_shard.shape[0] if kernel_transposed else kernel_shard.shape[1]
    return jax.lax.axis_index(vocab_axis) * size, size


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
        import jax.numpy as jnp

        return best_word(self.axis, jnp.max(g, axis=1), jnp.argmax(g, axis=1) + self.start)


def shifted_targets(targets, start, size):
    """`targets` shifted into a shard's `[start, start + size)` words, -1
    for another shard's (the summed passes' `shards` convention)."""
    import jax.numpy as jnp

    shifted = targets - start
    return jnp.where((shifted >= 0) & (shifted < size), shifted, -1)


def best_word(vocab_axis, best, ids):
    """Each row's word id over the whole vocabulary (inside a
    `jax.shard_map`) from every shard's best score `best` `[rows]` and its
    word `ids` `[rows]`: the word of the largest, the smallest id of a
    tie, int32."""
    import jax
    import jax.numpy as jnp

    top = jax.lax.pmax(best, vocab_axis)
    ids = jnp.where(best == top, ids.astype("int32"), jnp.iinfo("int32").max)
    return jax.lax.pmin(ids, vocab_axis)


def layer_arrays(layers):
    """The hidden states, kernels and biases (where there is one) of the
    `chunked.divergence.OutputLayer`s `layers`, flat, in order."""
    return [x for layer in layers for x in (layer.hidden, layer.kernel)
            + ((layer.bias,) if layer.bias is not None else ())]


def layers_over(layers, arrays):
    """`layers` rebuilt over `arrays` (flat as `layer_arrays` gives them):
    the same kinds, kernel layouts and soft caps."""
    arrays, out = list(arrays), []
    for layer in layers:
        h, w = arrays.pop(0), arrays.pop(0)
        b = arrays.pop(0) if layer.bias is not None else None
        out.append(type(layer)(h, w, b, layer.kernel_transposed, layer.soft_cap))
    return out


def per_device(out):
    """A summed pass's result (a sum, or a tuple whose first item is the
    sum) as a shard map's outputs: the sum as a `[1]` array, one per
    device (those of a batch shard's vocabulary shards are equal), then
    the rest (per-row arrays)."""
    out = out if isinstance(out, tuple) else (out,)
    return (out[0][None],) + out[1:]


def summed_over_shards(shard, mesh, specs, row_spec, extra_outputs, inputs):
    """`shard(*inputs)` in `jax.shard_map` over `mesh` (`specs` the inputs'
    partition specs; `shard` returns `per_device` outputs: a `[1]` sum and
    `extra_outputs` per-row arrays, all split like the rows, `row_spec`):
    the whole sum, or the tuple of it and the per-row outputs."""
    import jax.numpy as jnp

    out = on_shards(shard, mesh, specs, (row_spec,) * (1 + extra_outputs))(*inputs)
    total = jnp.sum(out[0])
    return (total,) + tuple(out[1:]) if extra_outputs else total


def vocab_parallel_summed(layer, targets, weights, layout, *, label_smoothing=0.0,
                          z_loss=0.0, token_chunk_size=None, argmax=False,
                          implementation="auto", return_per_token=False):
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
        label_smoothing, z_loss, token_chunk_size, argmax, implementation,
            return_per_token: as in `chunked.summed_cross_entropy`
            (`token_chunk_size` sized for a shard's `V / n` words by
            default).

    Returns:
        The weighted sum (a scalar), with `argmax` and `return_per_token`
        the tuple `(sum, argmax, per_token)` (those asked for) as
        `chunked.summed_cross_entropy`'s.
    """
    from jax.sharding import PartitionSpec

    mesh, vocab_axis, _ = layout
    transposed, has_bias = layer.kernel_transposed, layer.bias is not None
    kernel = ops.convert_to_tensor(layer.kernel)
    vocab = kernel.shape[0] if transposed else kernel.shape[1]
    batch_axis = batch_axis_for(layout, layer.hidden.shape[0])
    row_spec = PartitionSpec(batch_axis)

    def shard(h, w, t, weights, *b):
        start, v_local = shard_start(vocab_axis, w, transposed)
        local = type(layer)(h, w, b[0] if b else None, transposed, layer.soft_cap)
        out = summed_cross_entropy(
            local, shifted_targets(t, start, v_local), weights,
            label_smoothing=label_smoothing, z_loss=z_loss, token_chunk_size=token_chunk_size,
            argmax=argmax, implementation=implementation,
            shards=VocabShards(vocab_axis, start, vocab), return_per_token=return_per_token)
        return per_device(out)

    in_specs = (PartitionSpec(batch_axis, None), kernel_spec(vocab_axis, transposed),
                row_spec, row_spec)
    return summed_over_shards(
        shard, mesh, in_specs + ((PartitionSpec(vocab_axis),) if has_bias else ()), row_spec,
        argmax + return_per_token,
        [ops.convert_to_tensor(layer.hidden), kernel, targets, weights]
        + ([ops.convert_to_tensor(layer.bias)] if has_bias else []))


def vocab_parallel_divergence(student, teacher, weights, layout, divergence,
                              return_per_token=False, **options):
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
        divergence, return_per_token, **options: as in
            `chunked.summed_divergence` (`beta`, `temperature`,
            `token_chunk_size`, `teacher_gradient`, `implementation`).

    Returns:
        The weighted sum, a scalar; with `return_per_token` the pair `(sum,
        per_token)`.
    """
    from jax.sharding import PartitionSpec

    mesh, vocab_axis, _ = layout
    batch_axis = batch_axis_for(layout, student.hidden.shape[0])
    row_spec = PartitionSpec(batch_axis)
    sides = (student, teacher)
    # Flat inputs and their specs: hidden states (rows), kernel and bias
    # (vocabulary columns) of each side, then the weights.
    inputs = [ops.convert_to_tensor(x) for x in layer_arrays(sides)] + [weights]
    specs = []
    for side in sides:
        specs += [PartitionSpec(batch_axis, None),
                  kernel_spec(vocab_axis, side.kernel_transposed)]
        if side.bias is not None:
            specs.append(PartitionSpec(vocab_axis))
    specs.append(row_spec)
    vocab = inputs[1].shape[0] if student.kernel_transposed else inputs[1].shape[1]

    def shard(*args):
        local = layers_over(sides, args[:-1])
        start, _ = shard_start(vocab_axis, local[0].kernel, student.kernel_transposed)
        out = summed_divergence(local[0], local[1], args[-1], divergence,
                                shards=VocabShards(vocab_axis, start, vocab),
                                return_per_token=return_per_token, **options)
        return per_device(out)

    return summed_over_shards(shard, mesh, specs, row_spec, return_per_token, inputs)


def vocab_parallel_mixture(latents, log_priors, kernel, bias, targets, weights, layout, *,
                           kernel_transposed=False, raw_slopes=None, return_per_token=False,
                           **options):
    """`chunked.summed_mixture.summed_mixture_nll` with the kernel sharded
    on V (JAX only): the mixture heads' summed NLL (MoS, MoSS, MoS+PLIF;
    `SigSoftmax` and `PLIFSoftmax` as one component) with its gradient in
    the forward pass, vocabulary-parallel.

    Each device runs the summed pass over token chunks on its `[V / n]`
    columns (its kernel shard and bias slice), each component's
    log-sum-exp and target score combined across the vocabulary mesh axis
    (`VocabShards`: a few `[rows]` all-reduces a chunk), so that the
    likelihoods and the posterior responsibilities are the whole
    vocabulary's; never a `[V, d]` matrix or a `[rows, V]` score tile
    gathered. The kernel and bias gradients stay sharded; the latents' and
    the PLIF slopes' are each device's partial sums (its columns' scores,
    its partial histograms), added across the shards by `jax.shard_map`'s
    transpose. Rows are split over the layout's batch axis when it divides
    them.

    Args:
        latents: `[N, K, L]`; log_priors: `[N, K]`; kernel: `[L, V]` (`[V,
            L]` with `kernel_transposed`); bias: `[V]` or None; targets:
            `[N]` int ids in `[0, V)`; weights: `[N]` float.
        layout: `vocab_parallel_layout(kernel, kernel_transposed)` (not None).
        raw_slopes: the PLIF's `[K']` raw slopes or None (replicated).
        return_per_token, **options: as in `summed_mixture_nll`
            (`output_fn`, `epsilon`, `knot_bound`, `token_chunk_size`,
            `implementation`).

    Returns:
        The weighted sum, a scalar; with `return_per_token` the pair `(sum,
        per_token)`.
    """
    from jax.sharding import PartitionSpec

    mesh, vocab_axis, _ = layout
    latents, kernel = ops.convert_to_tensor(latents), ops.convert_to_tensor(kernel)
    vocab = kernel.shape[0] if kernel_transposed else kernel.shape[1]
    batch_axis = batch_axis_for(layout, latents.shape[0])
    row_spec = PartitionSpec(batch_axis)
    inputs = [latents, ops.convert_to_tensor(log_priors), kernel, targets, weights]
    specs = [PartitionSpec(batch_axis, None, None), PartitionSpec(batch_axis, None),
             kernel_spec(vocab_axis, kernel_transposed), row_spec, row_spec]
    has_bias, has_plif = bias is not None, raw_slopes is not None
    if has_bias:
        inputs.append(ops.convert_to_tensor(bias))
        specs.append(PartitionSpec(vocab_axis))
    if has_plif:
        inputs.append(ops.convert_to_tensor(raw_slopes))
        specs.append(PartitionSpec())

    def shard(lat, lp, w, t, weights, *rest):
        b = rest[0] if has_bias else None
        raw = rest[-1] if has_plif else None
        start, v_local = shard_start(vocab_axis, w, kernel_transposed)
        out = summed_mixture_nll(
            lat, lp, w, b, shifted_targets(t, start, v_local), weights, raw_slopes=raw,
            kernel_transposed=kernel_transposed, shards=VocabShards(vocab_axis, start, vocab),
            return_per_token=return_per_token, **options)
        return per_device(out)

    return summed_over_shards(shard, mesh, specs, row_spec, return_per_token, inputs)


def vocab_parallel_pointwise_nll(h, kernel, bias, targets, layout, *, transform_fn=None,
                                 transform_params=(), chunk_size=None,
                                 kernel_transposed=False):
    """`chunked.chunked_pointwise_nll` (`-log softmax(g(h W + b))[target]`,
    per token) with the kernel sharded on V (JAX only), for a pointwise
    `g` that has no summed core (`MonotonicSoftmax`'s MLP; any
    differentiable `transform_fn`).

    In a `jax.shard_map`, each device runs the tiled pass
    (`chunked_pointwise_stats`) on its `[V / n]` columns: its rows'
    log-sum-exp over its words and, for the targets in its shard, their
    transformed score `g(z_t)`; the whole vocabulary's log-sum-exp is the
    log-sum-exp of the shards' (a max and a sum across the vocabulary
    axis) and the target's score the sum of the one shard's that holds it:
    `[N]` all-reduces, never the `[V, d]` matrix or a `[rows, V]` tile
    gathered. Differentiated by JAX through the collectives and the tiled
    pass's own backward (the kernel and bias gradients stay sharded; the
    transform's replicated parameters get the sum of the shards'
    gradients). Rows are split over the layout's batch axis when it
    divides them.

    Args:
        h: `[N, d]`; kernel: `[d, V]` (`[V, d]` with `kernel_transposed`)
            variable or tensor; bias: `[V]` or None; targets: `[N]` int ids
            in `[0, V)`.
        layout: `vocab_parallel_layout(kernel, kernel_transposed)` (not None).
        transform_fn, transform_params, chunk_size: as in
            `chunked_pointwise_nll` (a Keras variable among
            `transform_params` reads as the value passed in while
            `transform_fn` runs); `chunk_size` the tile width within a
            shard.

    Returns:
        `[N]` negative log-likelihoods (float32).
    """
    from jax.sharding import PartitionSpec

    from keras_softmax_heads.chunked.losses import chunked_pointwise_stats

    mesh, vocab_axis, _ = layout
    h, kernel = ops.convert_to_tensor(h), ops.convert_to_tensor(kernel)
    vocab = kernel.shape[0] if kernel_transposed else kernel.shape[1]
    batch_axis = batch_axis_for(layout, h.shape[0])
    row_spec = PartitionSpec(batch_axis)
    variables = [p if isinstance(p, keras.Variable) else None for p in transform_params]
    params = [ops.convert_to_tensor(p) for p in transform_params]
    has_bias = bias is not None
    inputs = [h, kernel, ops.convert_to_tensor(targets)] + params
    specs = [PartitionSpec(batch_axis, None), kernel_spec(vocab_axis, kernel_transposed),
             row_spec] + [PartitionSpec()] * len(params)
    if has_bias:
        inputs.append(ops.convert_to_tensor(bias))
        specs.append(PartitionSpec(vocab_axis))

    def shard(h, w, t, *rest):
        values, b = rest[:len(params)], (rest[-1] if has_bias else None)
        start, v_local = shard_start(vocab_axis, w, kernel_transposed)
        local = shifted_targets(t, start, v_local)
        mine = local >= 0
        # The variables among the parameters read as this device's values.
        mapping = [(v, x) for v, x in zip(variables, values) if v is not None]
        with keras.StatelessScope(state_mapping=mapping):
            nll, lse, _, _ = chunked_pointwise_stats(
                h, w, b, ops.maximum(local, 0), transform_fn=transform_fn,
                transform_params=[v if v is not None else x
                                  for v, x in zip(variables, values)],
                chunk_size=chunk_size, kernel_transposed=kernel_transposed)
        shards = VocabShards(vocab_axis, start, vocab)
        peak = shards.max(lse)
        total = peak + ops.log(shards.sum(ops.exp(lse - peak)))
        target = shards.sum(ops.where(mine, lse - nll, ops.zeros_like(nll)))
        return total - target

    # check_vma=False: the tiled pass's custom gradient returns each
    # device's partial gradient of the replicated parameters (histograms),
    # which the shard map's transpose sums; the replicated output's
    # cotangent reaches each device divided by the shards, and the
    # all-reduces' transposes sum it back.
    return on_shards(shard, mesh, specs, row_spec)(*inputs)


def summed_mixture_nll_auto(latents, log_priors, kernel, bias, targets, weights, *,
                            kernel_transposed=False, **options):
    """`summed_mixture_nll`, vocabulary-parallel (`vocab_parallel_mixture`)
    where `vocab_parallel_layout(kernel, kernel_transposed)` applies (the
    `kernel` variable sharded on V by the current `keras.distribution`, on
    JAX), on one device otherwise. What the mixture heads' (and
    `SigSoftmax`'s, `PLIFSoftmax`'s) summed training objective calls."""
    layout = vocab_parallel_layout(kernel, kernel_transposed)
    if layout is None:
        return summed_mixture_nll(latents, log_priors, kernel, bias, targets, weights,
                                  kernel_transposed=kernel_transposed, **options)
    return vocab_parallel_mixture(latents, log_priors, kernel, bias, targets, weights, layout,
                                  kernel_transposed=kernel_transposed, **options)


def tile_sized_token_chunk(rows, vocab, chunk_size, components=1):
    """The token chunk of a per-token pass on vocabulary shards
    (`token_losses`): `N * chunk_size / V` tokens, at least 1 and at most
    `N`, so that the pass runs as many chunks as the tiled per-token pass
    has tiles (`V / chunk_size`) and each device's chunk holds `1 / n` of a
    tile's scores (`[tokens, V / n]` against `[N, chunk_size]`); None (the
    summed pass's default) when `N` is not static. `chunk_size` None: the
    tiled pass's width on this platform for `components` mixture components
    (`chunked.platform.chunk_size_for` of `K N` rows). The summed training
    pass keeps its own larger default chunks (sized for speed)."""
    if not isinstance(rows, int):
        return None
    if chunk_size is None:
        chunk_size = chunk_size_for(vocab, rows * components, components)
    return max(1, min(rows, rows * chunk_size // vocab))


def token_losses(summed, inputs, targets=None):
    """Per-token losses `[N]` with their exact gradient for any cotangent,
    from a summed pass (JAX): `summed(weights, targets, *inputs)` (without
    `targets`: `summed(weights, *inputs)`; `N` is then the first input's
    rows) returns `(sum_i weights_i loss_i, losses)`, the sum
    differentiable with respect to `inputs` (`vocab_parallel_summed`,
    `vocab_parallel_mixture`, `vocab_parallel_divergence` with
    `return_per_token`).

    The forward pass runs `summed` with unit weights and keeps the losses
    (under `jax.jit` XLA drops the gradient work nothing reads); the
    backward pass runs it again with the per-token cotangent as the
    weights and takes the sum's gradient: `d/dx sum_i u_i loss_i`, the
    per-token losses' vector-Jacobian product. The vocabulary-parallel
    passes thus give the heads' per-token `log_likelihood` (evaluation,
    `training_loss`) as well as their summed objective: four `N d V`
    products with a gradient, as the tiled per-token pass (the heads size
    its chunks like the tiled pass's tiles: `tile_sized_token_chunk`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    inputs = [ops.convert_to_tensor(x) for x in inputs]
    if targets is None:  # the pass reads no ids: rows only
        targets, read = jnp.zeros((inputs[0].shape[0],), "int32"), summed

        def summed(weights, targets, *inputs):
            return read(weights, *inputs)

    targets = jnp.asarray(targets)

    @jax.custom_vjp
    def losses(targets, *inputs):
        return summed(jnp.ones(targets.shape, "float32"), targets, *inputs)[1]

    def forward(targets, *inputs):
        return losses(targets, *inputs), (targets, inputs)

    def backward(saved, u):
        targets, inputs = saved
        total, pullback = jax.vjp(lambda *a: summed(u, targets, *a)[0], *inputs)
        no_gradient = np.zeros(targets.shape, jax.dtypes.float0)
        return (no_gradient, *pullback(jnp.ones_like(total)))

    losses.defvjp(forward, backward)
    return losses(targets, *inputs)
