"""Exact softmax losses that never materialise the `[N, V]` scores.

`chunked_pointwise_nll` computes the exact negative log-likelihood of the
pointwise family `log p = log_softmax(g(h W + b))` (Linear-Softmax,
sigsoftmax, PLIF, monotonic MLP, ...) by tiling over the vocabulary: the
forward pass keeps only a per-row running maximum and sum (online
log-sum-exp, float32) and the target's score; the backward pass *recomputes*
every tile `z = h W_tile + b_tile`, `g(z)`, `softmax = exp(g - lse)` and
accumulates the gradients of `h`, `W`, `b` and of the transform's parameters
through the vector-Jacobian product of `g`, so any differentiable `g` works.
`chunked_mixture_nll` does the same for a mixture of (pointwise) softmaxes.

Peak extra memory is `O(N * chunk_size + d * chunk_size)` plus the gradient
of the kernel (`[d, V]`, the size of the parameter itself), instead of several
`[N, V]` tensors kept for the backward pass of the dense head. The price is
one extra matrix product per step (the recomputation): 4 instead of 3
`N x d x V` products. See `docs/chunked.md` for measurements and for when
each path wins.

Everything is written with `keras.ops` (`custom_gradient`, `fori_loop`,
`slice`, `slice_update`) and runs on TensorFlow, JAX and PyTorch, eagerly and
compiled (`tf.function(jit_compile=True)`, `jax.jit`): the number of tiles
and every tile's shape are static. Backend-specific: `value_and_vjp`, the
vector-Jacobian product of the pointwise transform inside the backward tile
(`tf.GradientTape`, `jax.vjp`, `torch.autograd.grad`), and, on TensorFlow
only, a faster `tf.while_loop` / `TensorArray` version of the loop
(`implementation="auto"`), tested against the `keras.ops` one.
"""

import math

import keras
import numpy as np
from keras import ops

DEFAULT_CHUNK_SIZE = 4096
"""Default vocabulary tile width (see `docs/chunked.md` for the measurements)."""


def check_chunk_size(chunk_size, default=DEFAULT_CHUNK_SIZE):
    """Returns `chunk_size` as an int (`default` for None), or raises.

    The heads call it with `default=None` (no `chunk_size`: the dense path).
    """
    if chunk_size is None:
        return default
    is_int = hasattr(chunk_size, "__index__") and not isinstance(chunk_size, bool)
    if not is_int or int(chunk_size) < 1:
        raise ValueError(
            "`chunk_size` must be a positive integer or None. "
            f"Received: chunk_size={chunk_size!r}"
        )
    return int(chunk_size)


def kernel_geometry(h, kernel, kernel_transposed):
    """`(d, V)` of a `[d, V]` (or, transposed, `[V, d]`) kernel of static
    shape, checked against the last dimension of `h`."""
    if len(kernel.shape) != 2:
        raise ValueError(
            f"The kernel must be a matrix. Received: kernel.shape={kernel.shape}"
        )
    if kernel_transposed:
        vocab, d = kernel.shape
    else:
        d, vocab = kernel.shape
    if d is None or vocab is None:
        raise ValueError(
            "chunked losses need a kernel of static shape. "
            f"Received: kernel with shape {kernel.shape}"
        )
    if h.shape[-1] is not None and h.shape[-1] != d:
        raise ValueError(
            f"`h` has last dimension {h.shape[-1]} but the kernel has d={d} "
            f"(kernel_transposed={kernel_transposed}). Received: h.shape={h.shape}, "
            f"kernel.shape={kernel.shape}"
        )
    return d, vocab


def tile_width(vocab_size, chunk_size):
    """The tile width used for `vocab_size` words and `chunk_size`.

    `chunk_size` is the maximum: a vocabulary smaller than it is one tile;
    otherwise the largest divisor of `vocab_size` in
    `[chunk_size / 2, chunk_size]` is used when there is one (every tile is
    full: nothing is masked and the kernel's gradient is assembled without a
    copy), else `chunk_size` itself (then one tile, the last `chunk_size`
    words, overlaps its neighbour and masks the overlap).

    >>> tile_width(100_000, 4096), tile_width(793_471, 4096), tile_width(50_257, 4096)
    (4000, 3017, 4096)
    """
    if vocab_size <= chunk_size:
        return vocab_size
    for width in range(chunk_size, (chunk_size + 1) // 2 - 1, -1):
        if vocab_size % width == 0:
            return width
    return chunk_size


def value_and_vjp(fn, primals):
    """`fn(*primals)` and its vector-Jacobian product.

    Returns `(out, vjp)`: `out = fn(*primals)` and a function `vjp(cotangent)`
    giving the gradients of `sum(out * cotangent)` with respect to each of
    `primals`, as a list of dense tensors of their shapes (zeros for a primal
    `out` does not depend on). `fn` is differentiated by the backend's
    automatic differentiation: `jax.vjp`, a `tf.GradientTape`,
    `torch.autograd.grad`. This is the only backend dispatch of the chunked
    losses; they call it on one `[N, chunk]` tile at a time.
    """
    backend = keras.backend.backend()
    primals = list(primals)
    if backend == "jax":
        import jax

        out, pullback = jax.vjp(fn, *primals)
        return out, lambda cotangent: list(pullback(cotangent))
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(primals)
            out = fn(*primals)

        def tf_vjp(cotangent):
            grads = tape.gradient(
                out,
                primals,
                output_gradients=cotangent,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            return [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices

        return out, tf_vjp
    if backend == "torch":
        import torch

        leaves = [p.detach().requires_grad_(True) for p in primals]
        with torch.enable_grad():
            out = fn(*leaves)

        def torch_vjp(cotangent):
            if not out.requires_grad:
                return [torch.zeros_like(p) for p in leaves]
            grads = torch.autograd.grad(
                out, leaves, grad_outputs=cotangent, allow_unused=True
            )
            return [
                torch.zeros_like(p) if g is None else g for g, p in zip(grads, leaves)
            ]

        return out.detach(), torch_vjp
    raise NotImplementedError(
        "The chunked losses need automatic differentiation: the TensorFlow, "
        f"JAX or PyTorch backend. Received: backend {backend!r}"
    )


def _as_tensor(x):
    """A tensor of `x`'s value (a variable is read: TensorFlow's
    `convert_to_tensor` of a Keras variable gives the `tf.Variable`)."""
    x = ops.convert_to_tensor(x)
    return ops.cast(x, x.dtype)


def _accumulation_dtype(*tensors):
    for t in tensors:
        if t is not None and keras.backend.standardize_dtype(t.dtype) == "float64":
            return "float64"
    return "float32"


def _matmul_fn(dtype):
    """`ops.matmul`, or for float64 an `ops.einsum` (Keras' PyTorch `matmul`
    computes float64 products in float32)."""
    if dtype == "float64":
        return lambda a, b: ops.einsum("ij,jk->ik", a, b)
    return ops.matmul


def _low_precision_matmul(*tensors):
    """For bfloat16 / float16 inputs on JAX: `(a, b) -> a @ b` taking both in
    the inputs' dtype and returning the exact float32 products
    (`preferred_element_type`: the GPU's low-precision matrix units,
    accumulated in float32, no rounding of the result). None elsewhere: the
    tiles are then upcast to float32 before their products (the one
    backend-specific product, measured on the GPU: `docs/chunked.md`)."""
    low = {keras.backend.standardize_dtype(t.dtype) for t in tensors if t is not None}
    if keras.backend.backend() != "jax" or len(low) != 1 or low - {"bfloat16", "float16"}:
        return None
    import jax.numpy as jnp

    (dtype,) = low

    def matmul(a, b):
        return jnp.matmul(
            ops.cast(a, dtype), ops.cast(b, dtype), preferred_element_type=jnp.float32
        )

    return matmul


def _loop(count, body, state):
    """`body(i, state)` for `i` in `range(count)` (a static count): one call
    with a Python 0 for a single tile, else `ops.fori_loop`."""
    if count == 1:
        return body(0, state)
    return ops.fori_loop(0, count, body, state)


def _pointwise_nll(
    h,
    kernel,
    bias,
    targets,
    transform_fn,
    params,
    variables,
    chunk_size,
    kernel_transposed,
    stats=False,
):
    """Flat core: h `[N, d]`, targets `[N]` int32 -> nll `[N]` (acc dtype).

    With `stats=True` the result is `[N, 4]`: the columns `nll`, `lse`
    (`logsumexp_v g_v`), `score_sum` (`sum_v g_v`) and `argmax` (the word of
    the largest score, as a float: exact below 2**24 words). The first three
    are differentiable (their cotangents combine in one backward pass), the
    argmax gets no gradient.

    `params` are tensors, `variables[j]` the Keras variable `params[j]` was
    read from (or None): while `transform_fn` runs, reading that variable
    gives `params[j]` (a `keras.StatelessScope`).

    Tiling (`size = tile_width(V, chunk_size)`, `T = ceil(V / size)`): full
    tiles start at `0, size, ...`. When `size` does not divide `V`, the last
    tile is the last `size` words: it overlaps the tile before it by
    `overlap = T * size - V` columns, which it masks (score `-inf`: no
    probability, no gradient). That tile is processed first, outside the
    loop with a static mask, so the loop body has none; in the backward pass
    the full tile processed after it overwrites its (zero) gradient columns.
    Every tile's gradient is written into place in the `[d, V]` (or
    `[V, d]`) kernel gradient with `ops.slice_update`.
    """
    acc = _accumulation_dtype(h, kernel)
    low_matmul = _low_precision_matmul(h, kernel)
    # The tiles' products: in the inputs' low-precision dtype with float32
    # results where the backend has that, else on float32 (float64) tiles.
    product = low_matmul or _matmul_fn(acc)
    d, vocab = kernel_geometry(h, kernel, kernel_transposed)
    size = tile_width(vocab, chunk_size)
    num_tiles = -(-vocab // size)
    overlap = num_tiles * size - vocab
    num_full = num_tiles - 1 if overlap else num_tiles
    has_bias = bias is not None
    mapped = [j for j, v in enumerate(variables) if v is not None]
    tail_start = vocab - size

    def call_transform(z, *values):
        if not mapped:
            return ops.cast(transform_fn(z, *values), acc)
        mapping = [(variables[j], values[j]) for j in mapped]
        with keras.StatelessScope(state_mapping=mapping, initialize_variables=False):
            return ops.cast(transform_fn(z, *values), acc)

    def linear(h_acc, kernel, bias, start, mask):
        """`(z, w)`: `z = h W_tile + b_tile` `[N, size]` and the kernel tile,
        in the accumulation dtype. For the identity transform `mask` (the
        tail tile's) rides on the bias add."""
        if kernel_transposed:
            w = ops.slice(kernel, [start, 0], [size, d])
        else:
            w = ops.slice(kernel, [0, start], [d, size])
        if low_matmul is None:
            w = ops.cast(w, acc)
        if kernel_transposed:
            z = product(h_acc, ops.transpose(w))
        else:
            z = product(h_acc, w)
        shift = None
        if has_bias:
            shift = ops.cast(ops.slice(bias, [start], [size]), acc)
        if mask is not None and transform_fn is None:
            shift = mask if shift is None else shift + mask
        if shift is not None:
            z = z + shift
        return z, w

    # Every tensor the custom-gradient function uses is one of its arguments
    # or made inside it: JAX's custom gradients must not close over values
    # traced outside them (under `jax.jit` even constants are traced).
    @ops.custom_gradient
    def nll_fn(targets, *args):
        h, kernel = args[0], args[1]
        bias = args[2] if has_bias else None
        params = list(args[2 + int(has_bias) :])
        # With `low_matmul`, h stays in its dtype (the products take it so).
        h_acc = h if low_matmul else ops.cast(h, acc)
        tail_mask = None
        if overlap:
            tail_mask = ops.convert_to_tensor(
                np.where(np.arange(size) >= overlap, 0.0, -np.inf), acc
            )

        def target_columns(start, skip):
            col = targets - start
            inside = ops.logical_and(col >= skip, col < size)
            return ops.clip(col, 0, size - 1), inside

        # ------------------------------------------------------------ forward
        def forward_tile(state, start, mask, skip):
            run_max, run_sum, target_score = state[:3]
            z, _ = linear(h_acc, kernel, bias, start, mask)
            g = z
            if transform_fn is not None:
                g = call_transform(z, *params)
                if mask is not None:
                    g = g + mask
            tile_max = ops.max(g, axis=1)
            extra = ()
            if stats:
                score_sum, run_arg = state[3:]
                # `skip` is static here: the masked columns are left out.
                score_sum = score_sum + ops.sum(g[:, skip:] if skip else g, axis=1)
                tile_arg = ops.cast(ops.argmax(g, axis=1), acc) + ops.cast(start, acc)
                # The first maximal word wins (the tail tile comes first).
                better = ops.logical_or(
                    tile_max > run_max,
                    ops.logical_and(tile_max == run_max, tile_arg < run_arg),
                )
                extra = (score_sum, ops.where(better, tile_arg, run_arg))
            # Not `ops.maximum`: Keras' PyTorch backend returns float32 for it.
            new_max = ops.where(tile_max > run_max, tile_max, run_max)
            # Rows whose scores are all -inf so far: avoid (-inf) - (-inf).
            safe_max = ops.where(
                ops.isfinite(new_max), new_max, ops.zeros_like(new_max)
            )
            run_sum = run_sum * ops.exp(run_max - safe_max) + ops.sum(
                ops.exp(g - safe_max[:, None]), axis=1
            )
            col, inside = target_columns(start, skip)
            picked = ops.take_along_axis(g, col[:, None], axis=1)[:, 0]
            target_score = target_score + ops.where(
                inside, picked, ops.zeros_like(picked)
            )
            return (new_max, run_sum, target_score) + extra

        state = (
            ops.full_like(targets, float("-inf"), dtype=acc),
            ops.zeros_like(targets, dtype=acc),
            ops.zeros_like(targets, dtype=acc),
        )
        if stats:
            state += (ops.zeros_like(targets, dtype=acc),) * 2
        if overlap:
            state = forward_tile(state, tail_start, tail_mask, overlap)
        state = _loop(
            num_full,
            lambda i, state: forward_tile(state, i * size, None, 0),
            state,
        )
        run_max, run_sum, target_score = state[:3]
        lse = run_max + ops.log(run_sum)
        nll = lse - target_score
        out = nll
        if stats:
            out = ops.stack([nll, lse, state[3], state[4]], axis=1)

        # ----------------------------------------------------------- backward
        def grad_fn(*args, upstream=None, variables=None):
            # TensorFlow and JAX call grad_fn(upstream); PyTorch
            # grad_fn(*inputs, upstream=upstream).
            if variables:
                raise ValueError(
                    "The `transform_fn` of a chunked loss read trainable "
                    f"variables it was not given: {[v.name for v in variables]}. "
                    "Pass them in `transform_params`."
                )
            if upstream is None:
                (upstream,) = args
            upstream = ops.cast(upstream, acc)
            # d/dg of u_nll * nll + u_lse * lse + u_sum * score_sum:
            # (u_nll + u_lse) softmax - u_nll onehot(target) + u_sum.
            soft_up = upstream
            sum_up = None
            if stats:
                soft_up = upstream[:, 0] + upstream[:, 1]
                sum_up = upstream[:, 2]
                upstream = upstream[:, 0]
            h_t = None if kernel_transposed else ops.transpose(h_acc)
            columns = ops.arange(size, dtype="int32")

            def backward_tile(state, start, mask, skip):
                dh, dparams, dkernel, dbias = state
                z, w = linear(h_acc, kernel, bias, start, mask)
                if transform_fn is not None:
                    g, pullback = value_and_vjp(call_transform, [z] + params)
                    if mask is not None:
                        g = g + mask
                else:
                    g = z
                # d nll / d g = upstream * (softmax - onehot(target)); masked
                # columns have g = -inf, so softmax (and the gradient) is 0.
                dg = ops.exp(g - lse[:, None]) * soft_up[:, None]
                col, inside = target_columns(start, skip)
                hit = ops.logical_and(
                    ops.equal(columns[None, :], col[:, None]), inside[:, None]
                )
                dg = ops.where(hit, dg - upstream[:, None], dg)
                if sum_up is not None:
                    if mask is None:
                        dg = dg + sum_up[:, None]
                    else:  # not on the masked columns
                        dg = ops.where(mask[None, :] == 0, dg + sum_up[:, None], dg)
                if transform_fn is not None:
                    grads = pullback(dg)
                    dz = ops.cast(grads[0], acc)
                    dparams = [
                        a + ops.cast(g_p, acc) for a, g_p in zip(dparams, grads[1:])
                    ]
                else:
                    dz = dg
                # A tile's kernel / bias gradient columns are complete here:
                # stored in the kernel's / bias' own dtype.
                if kernel_transposed:  # w: [size, d]
                    dh = dh + product(dz, w)
                    dw = product(ops.transpose(dz), h_acc)
                    dkernel = ops.slice_update(
                        dkernel, [start, 0], ops.cast(dw, dkernel.dtype)
                    )
                else:  # w: [d, size]
                    dh = dh + product(dz, ops.transpose(w))
                    dkernel = ops.slice_update(
                        dkernel, [0, start], ops.cast(product(h_t, dz), dkernel.dtype)
                    )
                if has_bias:
                    dbias = ops.slice_update(
                        dbias, [start], ops.cast(ops.sum(dz, axis=0), dbias.dtype)
                    )
                return dh, dparams, dkernel, dbias

            state = (
                ops.zeros_like(h, dtype=acc),
                [ops.zeros(p.shape, acc) for p in params],
                ops.zeros(kernel.shape, kernel.dtype),
                ops.zeros((vocab,), bias.dtype) if has_bias else ops.zeros((), acc),
            )
            if overlap:
                state = backward_tile(state, tail_start, tail_mask, overlap)
            dh, dparams, dkernel, dbias = _loop(
                num_full,
                lambda i, state: backward_tile(state, i * size, None, 0),
                state,
            )
            grads = [ops.cast(dh, h.dtype), ops.cast(dkernel, kernel.dtype)]
            if has_bias:
                grads.append(ops.cast(dbias, bias.dtype))
            grads += [ops.cast(g, p.dtype) for g, p in zip(dparams, params)]
            return (None, *grads)  # None: no gradient for the integer targets

        return out, grad_fn

    args = [h, kernel] + ([bias] if has_bias else []) + list(params)
    return nll_fn(targets, *args)


def _tf_dense_grad(grad, like):
    """`tape.gradient` may give None or IndexedSlices; return a dense tensor."""
    import tensorflow as tf

    if grad is None:
        return tf.zeros_like(like)
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.convert_to_tensor(grad)
    return tf.cast(grad, like.dtype)


def _tensorflow_pointwise_nll(
    h,
    kernel,
    bias,
    targets,
    transform_fn,
    params,
    variables,
    chunk_size,
    kernel_transposed,
    stats=False,
    parallel_iterations=1,
):
    """TensorFlow fast path of `_pointwise_nll` (same arguments and result).

    `tf.while_loop` with `parallel_iterations=1` (one tile alive at a time in
    graph mode), and each tile's kernel and bias gradient written in place
    into a loop-carried buffer of the kernel's shape and dtype with
    `tf.raw_ops.TensorStridedSliceUpdate` in graph mode (`slice_update`
    under XLA): no stacked or transposed copy at the end; graph mode still
    copies the buffer at each write, so its peak holds two (`docs/chunked.md`).
    Measured faster and leaner than the `keras.ops` loop on TensorFlow,
    whose `slice_update` (an `XlaDynamicUpdateSlice` kernel) is slower in
    graph mode. Tested against `_pointwise_nll`.

    Tiling (`size = tile_width(V, chunk_size)`): `ceil(V / size)` tiles of
    `size` columns; tile `i` starts at `min(i * size, V - size)`, so every
    tile has the same static shape and the last one, when `size` does not
    divide `V`, overlaps its neighbour by `skip = num_tiles * size - V`
    columns. Those leading columns are masked (score `-inf`: no
    probability, no gradient). The backward pass runs the tiles last to
    first, so the full tile overwrites the masked tile's zero columns.
    """
    import tensorflow as tf

    acc = tf.as_dtype(_accumulation_dtype(h, kernel))
    mapped = [j for j, v in enumerate(variables) if v is not None]
    d, vocab = kernel_geometry(h, kernel, kernel_transposed)
    size = tile_width(vocab, chunk_size)
    num_tiles = -(-vocab // size)
    padded = num_tiles * size
    masked = padded != vocab  # static: only then does the last tile overlap
    has_bias = bias is not None
    num_params = len(params)
    neg_inf = tf.constant(float("-inf"), acc)

    def tile_geometry(i):
        """First column of tile `i` and its leading columns to mask."""
        start = tf.minimum(i * size, vocab - size)
        return start, i * size - start

    def tile_linear(h_acc, kernel, bias, start, skip):
        """`(z, w, mask)` of a tile, in the accumulation dtype.

        `z = h W_tile + b_tile` `[N, size]`, `w` the kernel tile and `mask`
        `[size]` (0, or -inf on the skipped columns; None when nothing is
        masked). For the identity transform the mask is already folded into
        `z` (with the bias, one pass over the tile) and `mask` is None.
        """
        if kernel_transposed:
            w = tf.cast(tf.slice(kernel, [start, 0], [size, d]), acc)
            z = tf.matmul(h_acc, w, transpose_b=True)
        else:
            w = tf.cast(tf.slice(kernel, [0, start], [d, size]), acc)
            z = tf.matmul(h_acc, w)
        shift = None
        if has_bias:
            shift = tf.cast(tf.slice(bias, [start], [size]), acc)
        mask = None
        if masked:
            mask = tf.where(tf.range(size) >= skip, tf.zeros([size], acc), neg_inf)
        if transform_fn is None and mask is not None:
            shift = mask if shift is None else shift + mask
            mask = None
        if shift is not None:
            z = tf.nn.bias_add(z, shift)
        return z, w, mask

    def tile_transform(z, params, mask):
        """`g(z)` with the skipped columns at -inf."""
        if transform_fn is None:
            return z
        if mapped:
            mapping = [(variables[j], params[j]) for j in mapped]
            with keras.StatelessScope(state_mapping=mapping, initialize_variables=False):
                g = tf.cast(transform_fn(z, *params), acc)
        else:
            g = tf.cast(transform_fn(z, *params), acc)
        if mask is not None:
            g = tf.nn.bias_add(g, mask)
        return g

    def target_columns(start, skip):
        col = targets - start
        in_tile = tf.logical_and(col >= skip, col < size)
        return tf.clip_by_value(col, 0, size - 1), in_tile

    def loop(body, state):
        return tf.while_loop(
            lambda i, *_: i < num_tiles,
            body,
            (tf.constant(0),) + tuple(state),
            parallel_iterations=parallel_iterations,
            maximum_iterations=num_tiles,
        )[1:]

    @tf.custom_gradient
    def nll_fn(*args):
        h, kernel = args[0], args[1]
        bias = args[2] if has_bias else None
        params = list(args[2 + int(has_bias) :])
        h_acc = tf.cast(h, acc)
        n = tf.shape(h)[0]

        # ------------------------------------------------------------ forward
        def forward_body(i, run_max, run_sum, target_score, *extra):
            start, skip = tile_geometry(i)
            z, _, mask = tile_linear(h_acc, kernel, bias, start, skip)
            g = tile_transform(z, params, mask)
            tile_max = tf.reduce_max(g, axis=1)
            if stats:
                score_sum, run_arg = extra
                valid_g = g
                if masked:  # not the masked columns
                    valid_g = tf.where(tf.range(size) >= skip, g, tf.zeros_like(g))
                score_sum = score_sum + tf.reduce_sum(valid_g, axis=1)
                tile_arg = tf.cast(tf.argmax(g, axis=1), acc) + tf.cast(start, acc)
                better = tf.logical_or(
                    tile_max > run_max,
                    tf.logical_and(tile_max == run_max, tile_arg < run_arg),
                )
                extra = (score_sum, tf.where(better, tile_arg, run_arg))
            new_max = tf.maximum(run_max, tile_max)
            # Rows whose scores are all -inf so far: avoid (-inf) - (-inf).
            safe_max = tf.where(
                tf.math.is_finite(new_max), new_max, tf.zeros_like(new_max)
            )
            run_sum = run_sum * tf.exp(run_max - safe_max) + tf.reduce_sum(
                tf.exp(g - safe_max[:, None]), axis=1
            )
            col, in_tile = target_columns(start, skip)
            picked = tf.gather(g, col, batch_dims=1)
            target_score = target_score + tf.where(
                in_tile, picked, tf.zeros_like(picked)
            )
            return (i + 1, new_max, run_sum, target_score) + tuple(extra)

        state = (tf.fill([n], neg_inf), tf.zeros([n], acc), tf.zeros([n], acc))
        if stats:
            state += (tf.zeros([n], acc), tf.zeros([n], acc))
        state = loop(forward_body, state)
        run_max, run_sum, target_score = state[:3]
        lse = run_max + tf.math.log(run_sum)
        nll = lse - target_score
        out = nll
        if stats:
            out = tf.stack([nll, lse, state[3], state[4]], axis=1)

        # ----------------------------------------------------------- backward
        def grad_fn(upstream, variables=None):
            variables = list(variables or [])
            upstream = tf.cast(upstream, acc)
            soft_up = upstream
            sum_up = None
            if stats:  # as in `_pointwise_nll`
                soft_up = upstream[:, 0] + upstream[:, 1]
                sum_up = upstream[:, 2]
                upstream = upstream[:, 0]
            rows = tf.range(n)
            watched = params + variables
            # In-place tile writes: a strided-slice update in graph mode
            # (XLA wants its bounds constant), a dynamic-update-slice under
            # XLA (`jit_compile=True`, TPUs).
            in_xla = tf.__internal__.get_enclosing_xla_context() is not None

            def write(buffer, begin, end, value):
                if in_xla:
                    return ops.slice_update(buffer, begin, value)
                return tf.raw_ops.TensorStridedSliceUpdate(
                    input=buffer, begin=begin, end=end,
                    strides=[1] * len(begin), value=value,
                )

            def backward_body(i, dh, dparams, dvars, dkernel, dbias):
                start, skip = tile_geometry(num_tiles - 1 - i)
                z, w, mask = tile_linear(h_acc, kernel, bias, start, skip)
                if transform_fn is not None:
                    with tf.GradientTape(watch_accessed_variables=False) as tape:
                        tape.watch(z)
                        tape.watch(watched)
                        g = tile_transform(z, params, mask)
                else:
                    g = z
                # d nll / d g = upstream * (softmax - onehot(target)); masked
                # columns have g = -inf, so softmax (and the gradient) is 0.
                dg = tf.exp(g - lse[:, None]) * soft_up[:, None]
                col, in_tile = target_columns(start, skip)
                dg = tf.tensor_scatter_nd_add(
                    dg,
                    tf.stack([rows, col], axis=1),
                    tf.where(in_tile, -upstream, tf.zeros_like(upstream)),
                )
                if sum_up is not None:
                    added = dg + sum_up[:, None]
                    dg = tf.where(tf.range(size) >= skip, added, dg) if masked else added
                if transform_fn is not None:
                    grads = tape.gradient(g, [z] + watched, output_gradients=dg)
                    dz = _tf_dense_grad(grads[0], z)
                    param_grads = grads[1 : 1 + num_params]
                    var_grads = grads[1 + num_params :]
                    dparams = [
                        acc_p + tf.cast(_tf_dense_grad(g_p, p), acc)
                        for acc_p, g_p, p in zip(dparams, param_grads, params)
                    ]
                    dvars = [
                        acc_v + tf.cast(_tf_dense_grad(g_v, acc_v), acc)
                        for acc_v, g_v in zip(dvars, var_grads)
                    ]
                else:
                    dz = dg
                if kernel_transposed:  # w: [size, d]
                    dh = dh + tf.matmul(dz, w)
                else:  # w: [d, size]
                    dh = dh + tf.matmul(dz, w, transpose_b=True)
                # Each tile's kernel (and bias) gradient columns are complete
                # after this tile: written into their place in the gradient buffer
                # in the kernel's own layout and dtype.
                if kernel_transposed:  # dkernel: [V, d]
                    dw = tf.matmul(dz, h_acc, transpose_a=True)
                    begin, end = [start, 0], [start + size, d]
                else:  # dkernel: [d, V]
                    dw = tf.matmul(h_acc, dz, transpose_a=True)
                    begin, end = [0, start], [d, start + size]
                dkernel = write(dkernel, begin, end, tf.cast(dw, dkernel.dtype))
                if has_bias:
                    db = tf.cast(tf.reduce_sum(dz, axis=0), dbias.dtype)
                    dbias = write(dbias, [start], [start + size], db)
                return i + 1, dh, dparams, dvars, dkernel, dbias

            # The tiles run last to first: the overlapping last tile writes
            # its (zero) masked columns before the full tile they belong to.
            dh, dparams, dvars, dkernel, dbias = loop(
                backward_body,
                (
                    tf.zeros_like(h_acc),
                    [tf.zeros(tf.shape(p), acc) for p in params],
                    [tf.zeros(v.shape, acc) for v in variables],
                    tf.zeros(kernel.shape, kernel.dtype),
                    tf.zeros([vocab], bias.dtype) if has_bias else tf.zeros([], acc),
                ),
            )
            grads = [tf.cast(dh, h.dtype), tf.cast(dkernel, kernel.dtype)]
            if has_bias:
                grads.append(tf.cast(dbias, bias.dtype))
            grads += [tf.cast(g, p.dtype) for g, p in zip(dparams, params)]
            if variables:
                return grads, [tf.cast(g, v.dtype) for g, v in zip(dvars, variables)]
            return grads

        return out, grad_fn

    args = [h, kernel] + ([bias] if has_bias else []) + list(params)
    return nll_fn(*args)



def chunked_pointwise_nll(
    h,
    kernel,
    bias,
    targets,
    transform_fn=None,
    transform_params=(),
    chunk_size=DEFAULT_CHUNK_SIZE,
    kernel_transposed=False,
    implementation="auto",
):
    """Exact `-log softmax(g(h W + b))[target]` without the `[N, V]` scores.

    The vocabulary is processed in tiles of at most `chunk_size` columns
    inside a `keras.ops.custom_gradient`: the forward pass keeps a running
    max / sum per row (online log-sum-exp) and the target's score
    `g(z_target)`; the backward pass recomputes each tile and accumulates the
    gradients of `h`, the kernel, the bias and the transform's parameters,
    using the vector-Jacobian product of `transform_fn` (any differentiable
    pointwise function works: identity, sigsoftmax's `z - softplus(-z)`,
    PLIF with its own custom gradient, a monotonic MLP).

    Scores are accumulated in float32 (float64 if `h` or `kernel` is
    float64). With bfloat16 / float16 `h` and `kernel` the scores are the
    exact float32 products of the low-precision inputs (on JAX computed in
    that dtype with float32 results, elsewhere from tiles upcast to
    float32); the gradients are returned in the inputs' dtypes.

    Peak extra memory: `O(N * chunk_size + d * chunk_size)` for the tiles,
    plus the kernel's gradient (`[d, V]`, like the kernel) in the backward
    pass. The number of tiles and their shapes are static, so it compiles
    with XLA (`jit_compile=True`, `jax.jit`).

    Args:
        h: float tensor `[..., d]`, the context vectors.
        kernel: the output projection, `[d, V]`, or `[V, d]` (e.g. a tied
            embedding matrix, no transposed copy is made) with
            `kernel_transposed=True`. A tensor or a Keras variable (read
            once, before the custom gradient, so its gradient flows through
            ordinary autodiff).
        bias: `[V]` bias (tensor or variable), or `None`.
        targets: integer word ids of shape `[...]` (the leading shape of `h`),
            in `[0, V)`. An id outside that range is not validated here: its
            result is `logsumexp(g)` (use `base.nan_if_invalid`).
        transform_fn: `None` (identity: Linear-Softmax, fastest path) or a
            callable `(z, *transform_params) -> g(z)` applied elementwise to a
            float32 tile `z`. It must be a function of its arguments: a
            variable it reads must be one of `transform_params`.
        transform_params: tensors or Keras variables passed to
            `transform_fn` after `z`; gradients flow to them. While
            `transform_fn` runs, a variable listed here may also be read
            directly (e.g. `self.raw_slopes` in a head's `score_transform`):
            it then holds the value passed in (a `keras.StatelessScope`).
        chunk_size: int, maximum vocabulary tile width (`tile_width`);
            `None` means `DEFAULT_CHUNK_SIZE`.
        kernel_transposed: bool, `kernel` is `[V, d]`.
        implementation: `"auto"` (default): on TensorFlow a `tf.while_loop`
            / `TensorArray` version, measured faster and leaner there (see
            `docs/chunked.md`), elsewhere the `keras.ops` one; `"ops"`: the
            `keras.ops` version on every backend. Both give the same results.

    Returns:
        Float32 (float64 for float64 inputs) tensor of shape `targets.shape`:
        the negative log-likelihood of each target.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads.chunked import chunked_pointwise_nll
    >>> rng = np.random.default_rng(0)
    >>> h = rng.normal(size=(4, 3)).astype("float32")
    >>> w = rng.normal(size=(3, 10)).astype("float32")
    >>> t = np.array([0, 3, 9, 5])
    >>> nll = chunked_pointwise_nll(h, w, None, t, chunk_size=4)
    >>> log_p = ops.log_softmax(ops.matmul(h, w), axis=-1)
    >>> dense = -np.take_along_axis(ops.convert_to_numpy(log_p), t[:, None], 1)[:, 0]
    >>> bool(np.allclose(ops.convert_to_numpy(nll), dense, atol=1e-5))
    True
    """
    return _run_core(
        h, kernel, bias, targets, transform_fn, transform_params, chunk_size,
        kernel_transposed, implementation, stats=False,
    )


def chunked_pointwise_stats(
    h,
    kernel,
    bias,
    targets,
    transform_fn=None,
    transform_params=(),
    chunk_size=DEFAULT_CHUNK_SIZE,
    kernel_transposed=False,
    implementation="auto",
):
    """Per-row statistics of `g = g(h W + b)` over the vocabulary, tiled.

    The same tiled pass as `chunked_pointwise_nll` (same arguments, same
    memory, one backward pass that recomputes the tiles), returning four
    tensors of shape `targets.shape` (float32, float64 for float64 inputs):

    * `nll`: `logsumexp_v g_v - g_target`;
    * `lse`: `logsumexp_v g_v` (z-loss, self-normalisation);
    * `score_sum`: `sum_v g_v` (closed-form label smoothing: the
      cross-entropy with the uniform distribution is
      `lse - score_sum / V`);
    * `argmax`: int32, the word of the largest score (the first on ties):
      token accuracy without the logits. No gradient.

    Gradients of any combination of `nll`, `lse` and `score_sum` reach `h`,
    the kernel, the bias and the transform's parameters, computed in the
    backward pass from the upstream cotangents (one recomputation of the
    tiles for all three), so per-row weights and masks get exact gradients.
    This is the core of `keras_softmax_heads.fused.linear_cross_entropy`.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads.chunked import chunked_pointwise_stats
    >>> rng = np.random.default_rng(0)
    >>> h = rng.normal(size=(4, 3)).astype("float32")
    >>> w = rng.normal(size=(3, 10)).astype("float32")
    >>> nll, lse, total, arg = chunked_pointwise_stats(h, w, None, [0, 3, 9, 5], chunk_size=4)
    >>> z = ops.convert_to_numpy(ops.matmul(h, w))
    >>> bool(np.allclose(ops.convert_to_numpy(total), z.sum(1), atol=1e-5))
    True
    >>> bool(np.array_equal(ops.convert_to_numpy(arg), z.argmax(1)))
    True
    """
    out = _run_core(
        h, kernel, bias, targets, transform_fn, transform_params, chunk_size,
        kernel_transposed, implementation, stats=True,
    )
    nll, lse, score_sum = out[..., 0], out[..., 1], out[..., 2]
    argmax = ops.cast(ops.stop_gradient(out[..., 3]), "int32")
    return nll, lse, score_sum, argmax


def _run_core(
    h, kernel, bias, targets, transform_fn, transform_params, chunk_size,
    kernel_transposed, implementation, stats,
):
    """Flattens, checks and calls the core; the result has shape
    `targets.shape` (plus a last axis of 4 with `stats`)."""
    chunk_size = check_chunk_size(chunk_size)
    if implementation not in ("auto", "ops"):
        raise ValueError(
            '`implementation` must be "auto" or "ops". '
            f"Received: implementation={implementation!r}"
        )
    core = _pointwise_nll
    if implementation == "auto" and keras.backend.backend() == "tensorflow":
        core = _tensorflow_pointwise_nll
    h = _as_tensor(h)
    kernel = _as_tensor(kernel)
    if bias is not None:
        bias = _as_tensor(bias)
    transform_params = list(transform_params)
    variables = [p if isinstance(p, keras.Variable) else None for p in transform_params]
    params = [_as_tensor(p) for p in transform_params]
    targets = ops.cast(ops.convert_to_tensor(targets), "int32")
    lead = tuple(h.shape[:-1])
    if (
        all(x is not None for x in lead)
        and all(x is not None for x in targets.shape)
        and math.prod(lead) != math.prod(targets.shape)
    ):
        raise ValueError(
            "`targets` must have one word id per context vector. Received: "
            f"h.shape={tuple(h.shape)}, targets.shape={tuple(targets.shape)}"
        )
    out_shape = ops.shape(targets)
    if stats:
        out_shape = tuple(out_shape) + (4,)
    d = h.shape[-1]
    flat_h = ops.reshape(h, (-1, d if d is not None else ops.shape(h)[-1]))
    flat_t = ops.reshape(targets, (-1,))
    out = core(
        flat_h,
        kernel,
        bias,
        flat_t,
        transform_fn,
        params,
        variables,
        chunk_size,
        bool(kernel_transposed),
        stats=stats,
    )
    return ops.reshape(out, out_shape)


def chunked_mixture_nll(
    latents,
    log_priors,
    kernel,
    bias,
    targets,
    transform_fn=None,
    transform_params=(),
    chunk_size=DEFAULT_CHUNK_SIZE,
    kernel_transposed=False,
    implementation="auto",
):
    """Exact mixture-of-softmaxes NLL without the `[N, K, V]` scores.

    `log p(t) = logsumexp_k(log pi_k + g(z_k)_t - logsumexp_v g(z_k)_v)` with
    `z_k = latent_k W + b`. The `K` components are folded into the rows of
    `chunked_pointwise_nll` (`N * K` rows of dimension `d`, the target repeated
    `K` times), so only tiles `[N * K, chunk_size]` are ever held; the
    mixture itself is an ordinary `[N, K]` log-sum-exp whose gradient
    (the posterior responsibilities) flows into the chunked function through
    ordinary autodiff. Gradients reach `latents`, `log_priors`, `kernel`,
    `bias` and the transform's parameters.

    Mixture of softmaxes (Yang et al. 2018) is `transform_fn=None`; mixture
    of sigsoftmax (Kanai et al. 2018) is
    `transform_fn=functional.log_sigmoid_scores`; MoS + PLIF (Ganea et al.
    2019) is `transform_fn=functional.plif` with its slopes and knot bound.

    Args:
        latents: float tensor `[..., K, d]`, the per-component context vectors
            (e.g. `tanh(W_k h)`).
        log_priors: float tensor `[..., K]`, normalised log mixture weights
            (`log_softmax` of the prior logits).
        kernel, bias, transform_fn, transform_params, chunk_size,
        kernel_transposed, implementation: as in `chunked_pointwise_nll`
            (`transform_fn` is applied to every component's scores).
        targets: integer word ids `[...]`.

    Returns:
        Float32 tensor of shape `targets.shape`: `-log p(targets)`.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads.chunked import chunked_mixture_nll
    >>> rng = np.random.default_rng(0)
    >>> lat = rng.normal(size=(4, 2, 3)).astype("float32")
    >>> log_pi = ops.log_softmax(rng.normal(size=(4, 2)).astype("float32"), axis=-1)
    >>> w = rng.normal(size=(3, 10)).astype("float32")
    >>> t = np.array([0, 3, 9, 5])
    >>> nll = chunked_mixture_nll(lat, log_pi, w, None, t, chunk_size=4)
    >>> comp = ops.log_softmax(ops.einsum("nkd,dv->nkv", lat, w), axis=-1)
    >>> log_p = ops.convert_to_numpy(ops.logsumexp(log_pi[..., None] + comp, axis=1))
    >>> dense = -np.take_along_axis(log_p, t[:, None], 1)[:, 0]
    >>> bool(np.allclose(ops.convert_to_numpy(nll), dense, atol=1e-5))
    True
    """
    latents = _as_tensor(latents)
    log_priors = _as_tensor(log_priors)
    targets = ops.cast(ops.convert_to_tensor(targets), "int32")
    num_components = latents.shape[-2]
    d = latents.shape[-1]
    if num_components is None or d is None:
        raise ValueError(
            "`latents` needs static last two dimensions [K, d]. "
            f"Received: latents.shape={latents.shape}"
        )
    out_shape = ops.shape(targets)
    flat_t = ops.reshape(targets, (-1,))
    flat_latents = ops.reshape(latents, (-1, d))
    component_targets = ops.repeat(flat_t, num_components)
    component_nll = chunked_pointwise_nll(
        flat_latents,
        kernel,
        bias,
        component_targets,
        transform_fn=transform_fn,
        transform_params=transform_params,
        chunk_size=chunk_size,
        kernel_transposed=kernel_transposed,
        implementation=implementation,
    )
    component_nll = ops.reshape(component_nll, (-1, num_components))
    flat_log_priors = ops.cast(
        ops.reshape(log_priors, (-1, num_components)), component_nll.dtype
    )
    log_p = ops.logsumexp(flat_log_priors - component_nll, axis=1)
    return ops.reshape(-log_p, out_shape)
