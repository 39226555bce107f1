"""The public chunked losses: exact softmax NLLs without the `[N, V]` scores.

`chunked_pointwise_nll` (the pointwise family `log_softmax(g(h W + b))`),
`chunked_pointwise_stats` (the same pass returning nll, lse, score sum and
argmax: the core of `fused.linear_cross_entropy`) and `chunked_mixture_nll`
(a mixture of softmaxes, its components folded into the rows). They check
and flatten their arguments and call the tiled core (`chunked.core`). See
`docs/chunked.md`.
"""

import math

import keras
from keras import ops

from keras_softmax_heads.chunked.core import pointwise_nll
from keras_softmax_heads.chunked.platform import chunk_size_for
from keras_softmax_heads.platforms import current_platform
from keras_softmax_heads.chunked.tiling import check_chunk_size
from keras_softmax_heads.chunked.tiling import check_token_chunk_size
from keras_softmax_heads.chunked.tiling import kernel_geometry
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_choice


def resolve_chunk_size(chunk_size, h, kernel, kernel_transposed, components=1):
    """`chunk_size` checked, or for None the platform's choice
    (`chunked.platform.chunk_size_for`) for the static rows of `h` `[..., d]`
    (with `components` mixture components folded into them), the kernel's
    vocabulary and the platform `h` is computed on."""
    chunk_size = check_chunk_size(chunk_size, default=None)
    if chunk_size is not None:
        return chunk_size
    _, vocab = kernel_geometry(h, kernel, kernel_transposed)
    lead = tuple(h.shape[:-1])
    rows = math.prod(lead) if all(isinstance(x, int) for x in lead) else None
    return chunk_size_for(vocab, rows=rows, components=components,
                          platform=current_platform(h))


def as_tensor(x):
    """A tensor of `x`'s value (a variable is read: TensorFlow's
    `convert_to_tensor` of a Keras variable gives the `tf.Variable`)."""
    x = ops.convert_to_tensor(x)
    return ops.cast(x, x.dtype)


def chunked_pointwise_nll(
    h,
    kernel,
    bias,
    targets,
    transform_fn=None,
    transform_params=(),
    chunk_size=None,
    kernel_transposed=False,
    implementation="auto",
    token_chunk_size=None,
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

    Peak extra memory: `O(N * chunk_size + d * chunk_size)` for the tiles
    and a float32 `[N, d]` accumulator of the gradient of `h`, plus the
    kernel's gradient (`[d, V]`, like the kernel) in the backward pass;
    with `token_chunk_size` `O((token_chunk_size + chunk_size) * (d +
    chunk_size))`, whatever `N`. The number of tiles and their shapes are static, so it compiles
    with XLA (`jit_compile=True`, `jax.jit`). Design notes and when each
    path wins: `docs/chunked.md`.

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
            result is `logsumexp(g)` (use `keras_softmax_heads.validation.nan_if_invalid`).
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
            `None` (default): the width chosen for the platform running
            the computation (`chunked.platform.chunk_size_for`:
            `DEFAULT_CHUNK_SIZE` on a CPU, larger tiles on a GPU / TPU).
        kernel_transposed: bool, `kernel` is `[V, d]`.
        implementation: `"auto"` (default): the backend's fast primitives
            for the tile loop and the gradient writes (`chunked.dispatch`:
            on TensorFlow a `tf.while_loop` running one tile at a time);
            `"ops"`: the plain `keras.ops` ones on every backend. The same
            algorithm, tile order and results either way.
        token_chunk_size: None (default): every tile spans all `N` rows.
            An int: when the number of rows is static and larger, tiles of
            at most `token_chunk_size` rows (`chunked.tile_width` of the
            rows) by `chunk_size` words, and a backward in two passes, one
            per vocabulary tile (its kernel, bias and transform-parameter
            gradients summed over the token blocks) and one per token block
            (its gradient of `h` summed over the vocabulary tiles): no
            `[N, d]` float32 accumulator, memory independent of `N`, at the
            cost of one more recomputation of the scores (five `N d V`
            products per step instead of four). Same results to float32
            rounding (`docs/chunked.md`, "Token blocks").

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
    return run_core(
        h, kernel, bias, targets, transform_fn, transform_params, chunk_size,
        kernel_transposed, implementation, stats=False,
        token_chunk_size=token_chunk_size,
    )


def chunked_pointwise_stats(
    h,
    kernel,
    bias,
    targets,
    transform_fn=None,
    transform_params=(),
    chunk_size=None,
    kernel_transposed=False,
    implementation="auto",
    entropy=False,
    token_chunk_size=None,
):
    """Per-row statistics of `g = g(h W + b)` over the vocabulary, tiled.

    The same tiled pass as `chunked_pointwise_nll` (same arguments,
    `token_chunk_size` included, same memory, one backward pass that recomputes the tiles), returning four
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

    With `entropy=True` a fifth tensor, the entropy
    `H = lse - E_p[g] = -sum_v p_v log p_v` of `p = softmax(g)`, accumulated
    online in the same pass (rescaled with the running max like the sum)
    and differentiable in the same backward pass
    (`dH/dg_v = -p_v (g_v - E_p[g])`). Without it nothing is computed for
    it. See `docs/token_statistics.md`.

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
    >>> *_, ent = chunked_pointwise_stats(h, w, None, [0, 3, 9, 5], chunk_size=4,
    ...                                   entropy=True)
    >>> p = ops.convert_to_numpy(ops.softmax(z, axis=-1))
    >>> bool(np.allclose(ops.convert_to_numpy(ent), -(p * np.log(p)).sum(1), atol=1e-5))
    True
    """
    out = run_core(
        h, kernel, bias, targets, transform_fn, transform_params, chunk_size,
        kernel_transposed, implementation, stats=True, entropy=entropy,
        token_chunk_size=token_chunk_size,
    )
    nll, lse, score_sum = out[..., 0], out[..., 1], out[..., 2]
    argmax = ops.cast(ops.stop_gradient(out[..., 3]), "int32")
    if entropy:
        return nll, lse, score_sum, argmax, out[..., 4]
    return nll, lse, score_sum, argmax


def run_core(
    h, kernel, bias, targets, transform_fn, transform_params, chunk_size,
    kernel_transposed, implementation, stats, entropy=False, token_chunk_size=None,
):
    """Flattens, checks and calls the core; the result has shape
    `targets.shape` (plus a last axis of 4 with `stats`, 5 with `entropy`)."""
    implementation = check_choice("implementation", implementation, ("auto", "ops"))
    token_chunk_size = check_token_chunk_size(token_chunk_size)
    h = as_tensor(h)
    kernel = as_tensor(kernel)
    chunk_size = resolve_chunk_size(chunk_size, h, kernel, kernel_transposed)
    if bias is not None:
        bias = as_tensor(bias)
    transform_params = list(transform_params)
    variables = [p if isinstance(p, keras.Variable) else None for p in transform_params]
    params = [as_tensor(p) for p in transform_params]
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
    entropy = check_bool("entropy", entropy)
    if stats:
        out_shape = tuple(out_shape) + (5 if entropy else 4,)
    d = h.shape[-1]
    flat_h = ops.reshape(h, (-1, d if d is not None else ops.shape(h)[-1]))
    flat_t = ops.reshape(targets, (-1,))
    out = pointwise_nll(
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
        implementation=implementation,
        entropy=entropy,
        token_chunk_size=token_chunk_size,
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
    chunk_size=None,
    kernel_transposed=False,
    implementation="auto",
):
    """Exact mixture-of-softmaxes NLL without the `[N, K, V]` scores.

    `log p(t) = logsumexp_k(log pi_k + g(z_k)_t - logsumexp_v g(z_k)_v)` with
    `z_k = latent_k W + b`. The `K` components are folded into the rows of
    `chunked_pointwise_nll` (`N * K` rows of dimension `d`, the target repeated
    `K` times), so only tiles `[N * K, width]` are ever held; the
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
            (`transform_fn` is applied to every component's scores). The
            default `chunk_size=None` is the platform's width for `K`
            components (`chunked.platform.chunk_size_for`): on a CPU
            `DEFAULT_CHUNK_SIZE // K`, so a `[N * K, width]` tile holds as
            many scores as one softmax's `[N, DEFAULT_CHUNK_SIZE]`.
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
    latents = as_tensor(latents)
    log_priors = as_tensor(log_priors)
    targets = ops.cast(ops.convert_to_tensor(targets), "int32")
    num_components = latents.shape[-2]
    d = latents.shape[-1]
    if num_components is None or d is None:
        raise ValueError(
            "`latents` needs static last two dimensions [K, d]. "
            f"Received: latents.shape={latents.shape}"
        )
    kernel = as_tensor(kernel)
    chunk_size = resolve_chunk_size(
        chunk_size, latents, kernel, kernel_transposed, components=num_components
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
