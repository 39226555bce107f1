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

Everything here is TensorFlow (`tf.custom_gradient`, `tf.while_loop`,
`tf.TensorArray` have no `keras.ops` equivalent) and works eagerly, in
`tf.function` graphs and under XLA (`jit_compile=True`): the number of tiles
is static and a vocabulary that `chunk_size` does not divide is handled by one
statically shaped remainder tile, without padding or copying the kernel.
"""

import tensorflow as tf

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


def tile_width(vocab_size, chunk_size):
    """The tile width used for `vocab_size` words and `chunk_size`.

    `chunk_size` is the maximum: a vocabulary smaller than it is one tile;
    otherwise the largest divisor of `vocab_size` in
    `[chunk_size / 2, chunk_size]` is used when there is one (every tile is
    full: nothing is masked and the kernel's gradient is assembled without a
    copy, also under XLA), else `chunk_size` itself (the last tile then
    overlaps its neighbour and the overlap is masked).

    >>> tile_width(100_000, 4096), tile_width(793_471, 4096), tile_width(50_257, 4096)
    (4000, 3017, 4096)
    """
    if vocab_size <= chunk_size:
        return vocab_size
    for width in range(chunk_size, (chunk_size + 1) // 2 - 1, -1):
        if vocab_size % width == 0:
            return width
    return chunk_size


def _accumulation_dtype(*tensors):
    if any(t is not None and t.dtype == tf.float64 for t in tensors):
        return tf.float64
    return tf.float32


def _as_tensor(x):
    """Reads a (Keras or TF) variable into a tensor; tensors pass through."""
    return tf.convert_to_tensor(x)


def _dense_grad(grad, like):
    """`tape.gradient` may give None or IndexedSlices; return a dense tensor."""
    if grad is None:
        return tf.zeros_like(like)
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.convert_to_tensor(grad)
    return tf.cast(grad, like.dtype)


def _pointwise_nll(
    h,
    kernel,
    bias,
    targets,
    transform_fn,
    params,
    chunk_size,
    kernel_transposed,
    parallel_iterations,
):
    """Flat core: h `[N, d]`, targets `[N]` int32 -> nll `[N]` (acc dtype).

    Tiling (`size = tile_width(V, chunk_size)`): `ceil(V / size)` tiles of
    `size` columns; tile `i` starts at
    `min(i * size, V - size)`, so every tile has the same static shape and
    the last one, when `size` does not divide `V`, overlaps its neighbour by
    `skip = num_tiles * size - V` columns. Those leading columns are masked
    (score `-inf`: no probability, no gradient), and the last tile's kernel
    gradient rows are rolled by `-skip` so that the stacked `[num_tiles *
    size, d]` gradient holds word `v` in row `v` (zeros past `V`).
    """
    acc = _accumulation_dtype(h, kernel)
    d = kernel.shape[1] if kernel_transposed else kernel.shape[0]
    vocab = kernel.shape[0] if kernel_transposed else kernel.shape[1]
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
        def forward_body(i, run_max, run_sum, target_score):
            start, skip = tile_geometry(i)
            z, _, mask = tile_linear(h_acc, kernel, bias, start, skip)
            g = tile_transform(z, params, mask)
            new_max = tf.maximum(run_max, tf.reduce_max(g, axis=1))
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
            return i + 1, new_max, run_sum, target_score

        run_max, run_sum, target_score = loop(
            forward_body,
            (tf.fill([n], neg_inf), tf.zeros([n], acc), tf.zeros([n], acc)),
        )
        lse = run_max + tf.math.log(run_sum)
        nll = lse - target_score

        # ----------------------------------------------------------- backward
        def grad_fn(upstream, variables=None):
            variables = list(variables or [])
            upstream = tf.cast(upstream, acc)
            rows = tf.range(n)
            watched = params + variables

            def backward_body(i, dh, dparams, dvars, w_array, b_array):
                start, skip = tile_geometry(i)
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
                dg = tf.exp(g - lse[:, None]) * upstream[:, None]
                col, in_tile = target_columns(start, skip)
                dg = tf.tensor_scatter_nd_add(
                    dg,
                    tf.stack([rows, col], axis=1),
                    tf.where(in_tile, -upstream, tf.zeros_like(upstream)),
                )
                if transform_fn is not None:
                    grads = tape.gradient(g, [z] + watched, output_gradients=dg)
                    dz = _dense_grad(grads[0], z)
                    param_grads = grads[1 : 1 + num_params]
                    var_grads = grads[1 + num_params :]
                    dparams = [
                        acc_p + tf.cast(_dense_grad(g_p, p), acc)
                        for acc_p, g_p, p in zip(dparams, param_grads, params)
                    ]
                    dvars = [
                        acc_v + tf.cast(_dense_grad(g_v, acc_v), acc)
                        for acc_v, g_v in zip(dvars, var_grads)
                    ]
                else:
                    dz = dg
                if kernel_transposed:  # w: [size, d]
                    dh = dh + tf.matmul(dz, w)
                else:  # w: [d, size]
                    dh = dh + tf.matmul(dz, w, transpose_b=True)
                # The kernel's gradient is built word-major, [size, d], in
                # both layouts, so that the tiles stack into [V, d].
                dw = tf.matmul(dz, h_acc, transpose_a=True)
                db = tf.reduce_sum(dz, axis=0)
                if masked:  # the last tile's own rows first (no-op elsewhere)
                    dw = tf.roll(dw, -skip, axis=0)
                    db = tf.roll(db, -skip, axis=0)
                return (
                    i + 1,
                    dh,
                    dparams,
                    dvars,
                    w_array.write(i, dw),
                    b_array.write(i, db),
                )

            dh, dparams, dvars, w_array, b_array = loop(
                backward_body,
                (
                    tf.zeros_like(h_acc),
                    [tf.zeros(tf.shape(p), acc) for p in params],
                    [tf.zeros(v.shape, acc) for v in variables],
                    tf.TensorArray(acc, size=num_tiles, element_shape=[size, d]),
                    tf.TensorArray(acc, size=num_tiles, element_shape=[size]),
                ),
            )
            # [tiles, size, d] -> [tiles * size, d] -> the first V rows: a
            # reshape and a leading-axis slice, which TensorFlow does without
            # a copy. Only the [d, V] layout pays one transpose.
            dkernel = tf.reshape(w_array.stack(), [padded, d])
            dbias = tf.reshape(b_array.stack(), [padded])
            if masked:
                dkernel = tf.slice(dkernel, [0, 0], [vocab, d])
                dbias = tf.slice(dbias, [0], [vocab])
            if not kernel_transposed:
                dkernel = tf.transpose(dkernel)
            grads = [tf.cast(dh, h.dtype), tf.cast(dkernel, kernel.dtype)]
            if has_bias:
                grads.append(tf.cast(dbias, bias.dtype))
            grads += [tf.cast(g, p.dtype) for g, p in zip(dparams, params)]
            if variables:
                return grads, [tf.cast(g, v.dtype) for g, v in zip(dvars, variables)]
            return grads

        return nll, grad_fn

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
    parallel_iterations=1,
):
    """Exact `-log softmax(g(h W + b))[target]` without the `[N, V]` scores.

    The vocabulary is processed in tiles of `chunk_size` columns inside a
    `tf.custom_gradient`: the forward pass keeps a running max / sum per row
    (online log-sum-exp) and the target's score `g(z_target)`; the backward
    pass recomputes each tile and accumulates the gradients of `h`, the
    kernel, the bias and the transform's parameters, using the
    vector-Jacobian product of `transform_fn` (any differentiable pointwise
    function works: identity, sigsoftmax's `z - softplus(-z)`, PLIF with its
    own custom gradient, a monotonic MLP).

    Scores are accumulated in float32 (float64 if `h` or `kernel` is
    float64). bfloat16 / float16 `h` and `kernel` are upcast tile by tile, so
    the scores are the exact float32 products of the low-precision inputs;
    the gradients are returned in the inputs' dtypes.

    Peak extra memory: `O(N * chunk_size + d * chunk_size)` for the tiles,
    plus the kernel's gradient (`[d, V]`, like the kernel) in the backward
    pass. The number of tiles is static (a last partial tile handles
    `V % chunk_size` without padding), so it compiles with XLA.

    Args:
        h: float tensor `[..., d]`, the context vectors.
        kernel: the output projection, `[d, V]`, or `[V, d]` (e.g. a tied
            embedding matrix, no transposed copy is made) with
            `kernel_transposed=True`. Tensors or variables (variables are
            read once, outside the custom gradient, so their gradients flow
            through ordinary autodiff).
        bias: `[V]` bias, or `None`.
        targets: integer word ids of shape `[...]` (the leading shape of `h`),
            in `[0, V)`. An id outside that range is not validated here: its
            result is `logsumexp(g)` (use `base.nan_if_invalid`).
        transform_fn: `None` (identity: Linear-Softmax, fastest path) or a
            callable `(z, *transform_params) -> g(z)` applied elementwise to a
            float32 tile `z`. It may also read variables directly (e.g. a
            layer's weights); their gradients are then returned through
            `tf.custom_gradient`'s `variables` mechanism.
        transform_params: list of tensors or variables passed to
            `transform_fn` after `z`; gradients flow to them.
        chunk_size: int, vocabulary tile width (clamped to `V`); `None`
            means `DEFAULT_CHUNK_SIZE`.
        kernel_transposed: bool, `kernel` is `[V, d]`.
        parallel_iterations: iterations of the tile loops that graph mode may
            run concurrently. 1 (default) keeps one tile alive at a time.

    Returns:
        Float32 (float64 for float64 inputs) tensor of shape `targets.shape`:
        the negative log-likelihood of each target.

    Example:

    >>> import numpy as np, tensorflow as tf
    >>> from keras_softmax_heads.chunked import chunked_pointwise_nll
    >>> rng = np.random.default_rng(0)
    >>> h = tf.constant(rng.normal(size=(4, 3)), tf.float32)
    >>> w = tf.constant(rng.normal(size=(3, 10)), tf.float32)
    >>> t = tf.constant([0, 3, 9, 5])
    >>> nll = chunked_pointwise_nll(h, w, None, t, chunk_size=4)
    >>> dense = -tf.gather(tf.nn.log_softmax(h @ w), t, batch_dims=1)
    >>> bool(np.allclose(nll, dense, atol=1e-5))
    True
    """
    chunk_size = check_chunk_size(chunk_size)
    h = _as_tensor(h)
    kernel = _as_tensor(kernel)
    if bias is not None:
        bias = _as_tensor(bias)
    params = [_as_tensor(p) for p in transform_params]
    targets = tf.cast(tf.convert_to_tensor(targets), tf.int32)
    if (
        h.shape[:-1].is_fully_defined()
        and targets.shape.is_fully_defined()
        and h.shape[:-1].num_elements() != targets.shape.num_elements()
    ):
        raise ValueError(
            "`targets` must have one word id per context vector. Received: "
            f"h.shape={h.shape}, targets.shape={targets.shape}"
        )
    out_shape = tf.shape(targets)
    d = h.shape[-1]
    flat_h = tf.reshape(h, [-1, d if d is not None else tf.shape(h)[-1]])
    flat_t = tf.reshape(targets, [-1])
    nll = _pointwise_nll(
        flat_h,
        kernel,
        bias,
        flat_t,
        transform_fn,
        params,
        chunk_size,
        bool(kernel_transposed),
        int(parallel_iterations),
    )
    return tf.reshape(nll, out_shape)


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
    parallel_iterations=1,
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
    of sigsoftmax (Kanai et al. 2018) is `transform_fn=ops.log_sigmoid_scores`;
    MoS + PLIF (Ganea et al. 2019) is `transform_fn=ops.plif` with its slopes
    and knot bound.

    Args:
        latents: float tensor `[..., K, d]`, the per-component context vectors
            (e.g. `tanh(W_k h)`).
        log_priors: float tensor `[..., K]`, normalised log mixture weights
            (`log_softmax` of the prior logits).
        kernel, bias, transform_fn, transform_params, chunk_size,
        kernel_transposed, parallel_iterations: as in `chunked_pointwise_nll`
            (`transform_fn` is applied to every component's scores).
        targets: integer word ids `[...]`.

    Returns:
        Float32 tensor of shape `targets.shape`: `-log p(targets)`.

    Example:

    >>> import numpy as np, tensorflow as tf
    >>> from keras_softmax_heads.chunked import chunked_mixture_nll
    >>> rng = np.random.default_rng(0)
    >>> lat = tf.constant(rng.normal(size=(4, 2, 3)), tf.float32)
    >>> log_pi = tf.nn.log_softmax(tf.constant(rng.normal(size=(4, 2)), tf.float32))
    >>> w = tf.constant(rng.normal(size=(3, 10)), tf.float32)
    >>> t = tf.constant([0, 3, 9, 5])
    >>> nll = chunked_mixture_nll(lat, log_pi, w, None, t, chunk_size=4)
    >>> comp = tf.nn.log_softmax(tf.einsum("nkd,dv->nkv", lat, w))
    >>> log_p = tf.reduce_logsumexp(log_pi[..., None] + comp, axis=1)
    >>> bool(np.allclose(nll, -tf.gather(log_p, t, batch_dims=1), atol=1e-5))
    True
    """
    latents = _as_tensor(latents)
    log_priors = _as_tensor(log_priors)
    targets = tf.cast(tf.convert_to_tensor(targets), tf.int32)
    num_components = latents.shape[-2]
    d = latents.shape[-1]
    if num_components is None or d is None:
        raise ValueError(
            "`latents` needs static last two dimensions [K, d]. "
            f"Received: latents.shape={latents.shape}"
        )
    out_shape = tf.shape(targets)
    flat_t = tf.reshape(targets, [-1])
    flat_latents = tf.reshape(latents, [-1, d])
    component_targets = tf.repeat(flat_t, num_components)
    component_nll = chunked_pointwise_nll(
        flat_latents,
        kernel,
        bias,
        component_targets,
        transform_fn=transform_fn,
        transform_params=transform_params,
        chunk_size=chunk_size,
        kernel_transposed=kernel_transposed,
        parallel_iterations=parallel_iterations,
    )
    component_nll = tf.reshape(component_nll, [-1, num_components])
    flat_log_priors = tf.cast(
        tf.reshape(log_priors, [-1, num_components]), component_nll.dtype
    )
    log_p = tf.reduce_logsumexp(flat_log_priors - component_nll, axis=1)
    return tf.reshape(-log_p, out_shape)
