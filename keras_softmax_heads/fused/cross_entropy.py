"""`linear_cross_entropy`: the exact cross-entropy of `softmax(g(h W + b))`
without the `[N, V]` logits.

The function, its per-token terms (`token_terms`, one tiled pass of
`chunked.chunked_pointwise_stats`) and its reductions (`reduce_loss`). How
it works, the options and their cost: `docs/chunked.md`, "Fused linear +
cross-entropy from hidden states".
"""

import keras
from keras import ops

from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.chunked import check_token_chunk_size
from keras_softmax_heads.chunked import kernel_geometry
from keras_softmax_heads.chunked.core import accumulation_dtype
from keras_softmax_heads.chunked.divergence import OutputLayer
from keras_softmax_heads.chunked.losses import as_tensor
from keras_softmax_heads.chunked.summed_cross_entropy import summed_cross_entropy
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_summed
from keras_softmax_heads.functional import soft_cap
from keras_softmax_heads.fused.pallas_cross_entropy import check_filter_eps
from keras_softmax_heads.fused.vocab_parallel import parallel_layout
from keras_softmax_heads.fused.vocab_parallel import pointwise_stats
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_float_dtype
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_number
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid

#: Reductions of `linear_cross_entropy`.
REDUCTIONS = ("none", "sum", "mean")


def check_loss_options(reduction="mean", ignore_index=None, label_smoothing=0.0,
                       z_loss=0.0, logit_soft_cap=None):
    """The options of `linear_cross_entropy`, checked and normalised.

    Returns `(reduction, ignore_index, label_smoothing, z_loss,
    logit_soft_cap)`: the reduction one of `REDUCTIONS` (None is `"none"`),
    `ignore_index` an int or None, `label_smoothing` a float in `[0, 1]`,
    `z_loss` a float `>= 0`, `logit_soft_cap` a float `> 0` or None.
    Raises `ValueError` naming the first bad option.
    """
    reduction = check_choice(
        "reduction", "none" if reduction is None else reduction, REDUCTIONS
    )
    ignore_index = check_int("ignore_index", ignore_index, allow_none=True)
    label_smoothing = check_number("label_smoothing", label_smoothing, low=0, high=1)
    z_loss = check_number("z_loss", z_loss, low=0)
    logit_soft_cap = check_number(
        "logit_soft_cap", logit_soft_cap, low=0, low_open=True, allow_none=True
    )
    return reduction, ignore_index, label_smoothing, z_loss, logit_soft_cap


def weighted_mean(values, weights):
    """`sum(w v) / sum(w)`, 0 when the weights sum to 0."""
    return mean_of_weighted_sum(ops.sum(values * weights), weights)


def mean_of_weighted_sum(total, weights):
    """`total / sum(weights)` (`total` a weighted sum), 0 when the weights
    sum to 0."""
    total_w = ops.cast(ops.sum(weights), total.dtype)
    positive = total_w > 0
    return ops.where(positive, total / ops.where(positive, total_w, 1.0), 0.0)


def linear_cross_entropy(
    hidden,
    kernel,
    targets,
    bias=None,
    *,
    kernel_transposed=False,
    sample_weight=None,
    ignore_index=None,
    label_smoothing=0.0,
    z_loss=0.0,
    logit_soft_cap=None,
    reduction="mean",
    chunk_size=DEFAULT_CHUNK_SIZE,
    return_lse=False,
    return_argmax=False,
    implementation="auto",
    vocab_parallel="auto",
    filter_eps=None,
    token_chunk_size=None,
    gradient_in_forward=False,
):
    """Exact cross-entropy of `softmax(g(hidden @ kernel + bias))`, tiled.

    Per token, with `z = h W + b`, `g = logit_soft_cap * tanh(z / cap)` (or
    `g = z`), `lse = logsumexp_v g_v` and `eps = label_smoothing`:

        loss = (1 - eps) (lse - g_target) + eps (lse - mean_v g_v)
               + z_loss * lse**2

    (the cross-entropy with Keras' smoothed targets
    `(1 - eps) onehot + eps / V`, in closed form). The `[N, V]` scores are
    never formed: the vocabulary is processed in tiles of at most
    `chunk_size` words in float32 (float64 for float64 inputs), and the
    backward pass recomputes them (`chunked.chunked_pointwise_stats`).
    Gradients reach `hidden`, `kernel` and `bias` and are exact per token
    for every reduction, weight and mask (they are computed from the
    upstream cotangent in the backward pass).

    Args:
        hidden: float tensor `[..., d]` (float16, bfloat16, float32 or
            float64), the final hidden states.
        kernel: `[d, V]`, or `[V, d]` with `kernel_transposed=True` (a tied
            embedding matrix; no transposed copy is made). A tensor or a
            Keras variable.
        targets: integer word ids `[...]` (the leading shape of `hidden`),
            in `[0, V)` or equal to `ignore_index`.
        bias: `[V]` or None.
        kernel_transposed: bool, `kernel` is `[V, d]`.
        sample_weight: None or float weights of shape `targets.shape` (or a
            prefix of it, broadcast over the trailing axes).
        ignore_index: None or an integer id whose tokens get weight 0 and no
            gradient (e.g. `-100`, or the padding id).
        label_smoothing: float in `[0, 1]`.
        z_loss: float >= 0, the weight of `lse**2` (PaLM's z-loss).
        logit_soft_cap: None or a positive float: the scores are
            `cap * tanh(z / cap)` (Gemma 2) for every term.
        reduction: `"mean"` (default: the weighted mean over the
            non-ignored tokens, `sum(w * loss) / sum(w)`, 0 if that is 0),
            `"sum"` (`sum(w * loss)`) or `"none"` (`w * loss` per token,
            shape `targets.shape`; 0 on ignored tokens).
        chunk_size: maximum vocabulary tile width (`chunked.tile_width`);
            need not divide `V`.
        token_chunk_size: None (default) or an int: the tiled pass's tiles
            span at most this many tokens (when their number is static and
            larger), and its backward takes two passes (the kernel's
            gradient per vocabulary tile, `hidden`'s per token block): no
            float32 `[N, d]` accumulator and memory independent of `N`, for
            one more `N d V` product per step (5 instead of 4). For long
            sequences and the tightest memory (`docs/chunked.md`, "Token
            blocks"). Not with `implementation="pallas"`. With
            `gradient_in_forward`: the most tokens a chunk (default about
            `2**26` scores a chunk, `2**25` on TensorFlow).
        gradient_in_forward: bool (default False). True: the gradient is
            computed in the forward pass, over chunks of tokens each scored
            over the whole vocabulary (`[chunk, V]` float32, never
            `[N, V]`): three `N d V` products per training step, as the
            dense loss, instead of the tiled pass's four
            (`chunked.summed_cross_entropy`; Liger-Kernel's form). Needs a
            summed reduction (`"sum"` / `"mean"`: the cotangents are then
            the weights), and a call whose gradient is not taken
            (evaluation) still computes it in a TensorFlow graph without
            XLA (not under `jax.jit`, `jit_compile=True` or PyTorch's
            `no_grad`: `docs/results/forward_only/`); the kernel's gradient is
            accumulated in float32 over the chunks; `chunk_size` does not
            apply (each chunk spans the vocabulary). Not with `return_lse`
            or `implementation="pallas"`. Vocabulary-parallel too (each
            device its shard's columns of the chunk, `vocab_parallel`). See
            `docs/chunked.md`, "The gradient in the forward pass".
        return_lse: also return the per-token `lse` (`[...]`,
            differentiable).
        return_argmax: also return the per-token argmax word (int32, first
            on ties) and the token accuracy (the weighted mean of
            `argmax == target` over the non-ignored tokens).
        implementation: `"auto"` (default), `"ops"` or `"pallas"`.
            `"auto"` and `"ops"` run the tiled pass as in
            `chunked.chunked_pointwise_nll` on every backend and platform
            (on a GPU it was measured faster than the kernel);
            `"pallas"` runs the Pallas kernel
            (`fused.pallas_cross_entropy`: a fused forward and backward,
            same results; JAX only, Pallas' interpret mode off a GPU). See
            `docs/chunked.md`, "The Pallas GPU kernel".
        filter_eps: None (default: exact gradients) or a float in
            `(0, 1)`: the Pallas kernel skips the backward blocks (64
            tokens x 128 words) whose softmax values are all below it and
            that hold none of their tokens' targets, dropping those
            `softmax` terms of the gradient (each below `filter_eps` times
            the token's cotangent); no effect with label smoothing's
            tokens, nor on the tiled pass (exact there): it takes
            `implementation="pallas"`. For fine-tuning:
            from scratch, Cut Cross-Entropy's bfloat16 default `2**-12`
            cost 1.2-1.5x in PTB perplexity (`docs/chunked.md`).
        vocab_parallel: `"auto"` (default), True or False. On JAX, under a
            `keras.distribution` whose layout shards the `kernel` variable
            on its vocabulary axis (keras-hub's Gemma / Llama layout maps),
            `"auto"` and True run the tiled pass on each device's own
            vocabulary shard (`jax.shard_map`) and combine the per-token
            statistics across that mesh axis (max, sums): no device gathers
            the `[V, d]` matrix or its gradient (a bias is split the same
            way). `"auto"` falls back to the single-device form otherwise (where
            XLA's partitioner gathers the whole matrix on every device);
            True raises instead.

    Returns:
        The loss (float32; float64 for float64 inputs), reduced as
        `reduction` says. With `return_lse` or `return_argmax`: a tuple
        `(loss, aux)`, `aux` a dict with `"lse"` and / or `"argmax"` and
        `"accuracy"`.

    Raises:
        ValueError: eagerly, for a target outside `[0, V)` that is not
            `ignore_index` (the message names the first one and its index;
            in a TensorFlow graph a `tf.debugging` assertion; under XLA such
            tokens give a NaN loss), a kernel whose `d` does not match
            `hidden`, a non-floating dtype, or a bad option.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads.losses import linear_cross_entropy
    >>> rng = np.random.default_rng(0)
    >>> h = rng.normal(size=(2, 3, 8)).astype("float32")
    >>> emb = rng.normal(size=(37, 8)).astype("float32")   # tied [V, d]
    >>> y = np.array([[1, 5, -100], [36, 0, 7]])
    >>> loss = linear_cross_entropy(h, emb, y, kernel_transposed=True,
    ...                             ignore_index=-100, chunk_size=16)
    >>> log_p = ops.convert_to_numpy(ops.log_softmax(h @ emb.T, axis=-1))
    >>> keep = y != -100
    >>> dense = -np.take_along_axis(log_p, np.where(keep, y, 0)[..., None], -1)[..., 0]
    >>> bool(np.isclose(float(loss), dense[keep].mean(), atol=1e-5))
    True
    """
    reduction = check_loss_options(
        reduction, ignore_index, label_smoothing, z_loss, logit_soft_cap
    )[0]
    options = dict(
        kernel_transposed=kernel_transposed, sample_weight=sample_weight,
        ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        logit_soft_cap=logit_soft_cap, implementation=implementation,
        vocab_parallel=vocab_parallel, filter_eps=filter_eps,
        token_chunk_size=token_chunk_size,
    )
    if check_bool("gradient_in_forward", gradient_in_forward):
        return summed_loss(hidden, kernel, targets, bias, reduction=reduction,
                           return_lse=return_lse, return_argmax=return_argmax, **options)
    terms = token_terms(hidden, kernel, targets, bias, chunk_size=chunk_size, **options)
    out = reduce_loss(terms["loss"], terms["weights"], reduction)
    if not (return_lse or return_argmax):
        return out
    aux = {}
    if return_lse:
        aux["lse"] = terms["lse"]
    if return_argmax:
        aux["argmax"] = terms["argmax"]
        aux["accuracy"] = ops.stop_gradient(
            weighted_mean(terms["correct"], terms["weights"])
        )
    return out, aux


def summed_loss(
    hidden, kernel, targets, bias=None, *, kernel_transposed=False,
    sample_weight=None, ignore_index=None, label_smoothing=0.0, z_loss=0.0,
    logit_soft_cap=None, reduction="mean", return_lse=False, return_argmax=False,
    implementation="auto", vocab_parallel="auto", filter_eps=None,
    token_chunk_size=None,
):
    """`linear_cross_entropy(..., gradient_in_forward=True)` (same
    arguments): the summed loss of `chunked.summed_cross_entropy`, reduced;
    raises for the options that path does not take."""
    _, ignore_index, eps, z_loss, cap = check_loss_options(
        reduction, ignore_index, label_smoothing, z_loss, logit_soft_cap
    )
    implementation = check_choice("implementation", implementation, ("auto", "ops", "pallas"))
    token_chunk_size = check_token_chunk_size(token_chunk_size)
    check_filter_eps(filter_eps)
    refused = {
        "reduction='none'": reduction == "none",
        "return_lse=True": bool(return_lse),
        "implementation='pallas'": implementation == "pallas",
        f"filter_eps={filter_eps}": filter_eps is not None,
    }
    hidden, kernel, bias, vocab = projection(hidden, kernel, bias, kernel_transposed)
    for option, bad in refused.items():
        if bad:
            raise ValueError(
                "`gradient_in_forward=True` computes the gradient of a summed loss "
                "(reduction 'sum' or 'mean') with the tiled pass's arithmetic; "
                "the per-token cotangents, the log-sum-exp's gradient and the "
                "Pallas kernel need gradient_in_forward=False. Received: "
                f"{option}"
            )
    layout = parallel_layout(kernel, kernel_transposed, vocab_parallel)
    targets = ops.convert_to_tensor(targets)
    check_token_shapes(hidden, targets, sample_weight)
    targets, ignored = checked_targets(targets, vocab, ignore_index)
    acc = accumulation_dtype(hidden, kernel)
    weights = broadcast_weights(sample_weight, ops.zeros(ops.shape(targets), acc))
    if ignored is not None:
        weights = ops.where(ignored, ops.zeros_like(weights), weights)
    d = hidden.shape[-1]
    layer = OutputLayer(ops.reshape(hidden, (-1, d)), as_tensor(kernel),
                        None if bias is None else as_tensor(bias),
                        kernel_transposed, cap)
    options = dict(label_smoothing=eps, z_loss=z_loss, token_chunk_size=token_chunk_size,
                   argmax=bool(return_argmax),
                   implementation="ops" if implementation == "ops" else "auto")
    flat = ops.reshape(targets, (-1,)), ops.reshape(weights, (-1,))
    if layout is None:
        out = summed_cross_entropy(layer, *flat, **options)
    else:  # each device its vocabulary shard
        out = vocab_parallel_summed(layer, *flat, layout, **options)
    total, argmax = out if return_argmax else (out, None)
    # An id outside [0, V) gives NaN, as the per-token terms do.
    valid = ops.all(ops.logical_and(targets >= 0, targets < vocab))
    total = ops.where(valid, total, ops.full_like(total, float("nan")))
    loss = total if reduction == "sum" else mean_of_weighted_sum(total, weights)
    if not return_argmax:
        return loss
    argmax = ops.reshape(argmax, ops.shape(targets))
    correct = ops.cast(ops.equal(argmax, targets), weights.dtype)
    return loss, {"argmax": argmax,
                  "accuracy": ops.stop_gradient(weighted_mean(correct, weights))}


def reduce_loss(loss, weights, reduction):
    """`linear_cross_entropy`'s reduction of the per-token `loss` with the
    per-token `weights`: `"none"` (`w * loss`), `"sum"` or `"mean"`
    (`weighted_mean`)."""
    if reduction == "none":
        return loss * weights
    if reduction == "sum":
        return ops.sum(loss * weights)
    return weighted_mean(loss, weights)


def token_terms(
    hidden, kernel, targets, bias=None, *, kernel_transposed=False,
    sample_weight=None, ignore_index=None, label_smoothing=0.0, z_loss=0.0,
    logit_soft_cap=None, chunk_size=DEFAULT_CHUNK_SIZE, implementation="auto",
    vocab_parallel="auto", filter_eps=None, token_chunk_size=None,
):
    """The per-token terms of `linear_cross_entropy` (same arguments), one
    tiled pass: a dict of tensors of the targets' shape: `"loss"` (the
    unweighted loss, smoothing and z-loss included, 0 on ignored tokens),
    `"nll"` (`lse - g_target`, 0 on ignored tokens), `"lse"`, `"weights"`
    (`sample_weight` broadcast, 0 on ignored tokens), `"argmax"` (int32) and
    `"correct"` (`argmax == target`, float, no gradient)."""
    _, ignore_index, eps, z_loss, cap = check_loss_options(
        "mean", ignore_index, label_smoothing, z_loss, logit_soft_cap
    )
    chunk_size = check_chunk_size(chunk_size)
    token_chunk_size = check_token_chunk_size(token_chunk_size)
    filter_eps = check_filter_eps(filter_eps)
    hidden, kernel, bias, vocab = projection(hidden, kernel, bias, kernel_transposed)
    targets = ops.convert_to_tensor(targets)
    check_token_shapes(hidden, targets, sample_weight)
    targets, ignored = checked_targets(targets, vocab, ignore_index)
    transform_fn = None
    if cap is not None:
        transform_fn = lambda z: soft_cap(z, cap)  # noqa: E731
    nll, lse, score_sum, argmax = pointwise_stats(
        hidden, kernel, bias, targets, transform_fn=transform_fn,
        chunk_size=chunk_size, kernel_transposed=kernel_transposed,
        implementation=implementation, vocab_parallel=vocab_parallel,
        filter_eps=filter_eps, token_chunk_size=token_chunk_size,
    )
    loss = nll
    if eps:
        loss = (1.0 - eps) * nll + eps * (lse - score_sum / vocab)
    if z_loss:
        loss = loss + z_loss * ops.square(lse)
    loss = nan_if_invalid(loss, targets, vocab)
    nll = nan_if_invalid(nll, targets, vocab)

    weights = broadcast_weights(sample_weight, loss)
    if ignored is not None:
        weights = ops.where(ignored, ops.zeros_like(weights), weights)
        loss = ops.where(ignored, ops.zeros_like(loss), loss)
        nll = ops.where(ignored, ops.zeros_like(nll), nll)
    correct = ops.stop_gradient(ops.cast(ops.equal(argmax, targets), weights.dtype))
    return {"loss": loss, "nll": nll, "lse": lse, "weights": weights,
            "argmax": argmax, "correct": correct}


def broadcast_weights(sample_weight, loss):
    """Per-token weights of `loss`'s shape and dtype: ones, or
    `sample_weight` (the shape of `loss` or a prefix of it) broadcast over
    the trailing axes."""
    if sample_weight is None:
        return ops.ones_like(loss)
    sample_weight = ops.cast(ops.convert_to_tensor(sample_weight), loss.dtype)
    while len(sample_weight.shape) < len(loss.shape):
        sample_weight = ops.expand_dims(sample_weight, -1)
    return ops.broadcast_to(sample_weight, ops.shape(loss))


def projection(hidden, kernel, bias, kernel_transposed):
    """`(hidden, kernel, bias, V)`: the tensors (variables kept), checked."""
    hidden = ops.convert_to_tensor(hidden)
    if not isinstance(kernel, keras.Variable):
        kernel = ops.convert_to_tensor(kernel)
    if bias is not None and not isinstance(bias, keras.Variable):
        bias = ops.convert_to_tensor(bias)
    check_float_dtype("hidden", hidden)
    check_float_dtype("kernel", kernel)
    if bias is not None:
        check_float_dtype("bias", bias)
    _, vocab = kernel_geometry(hidden, kernel, kernel_transposed)
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ValueError(
            f"`bias` must have shape ({vocab},) (the kernel's V). "
            f"Received: bias.shape={tuple(bias.shape)}"
        )
    return hidden, kernel, bias, vocab


def check_token_shapes(hidden, targets, sample_weight):
    """Raises unless `targets` has the shape of `hidden` without its last
    axis and `sample_weight` (if any) that of `targets` or a prefix of it
    (axes of size 1 broadcast). Axes unknown while tracing are not
    compared."""
    tokens = tuple(hidden.shape[:-1])
    shape = tuple(targets.shape)
    if len(shape) != len(tokens) or any(
            a is not None and b is not None and a != b for a, b in zip(shape, tokens)):
        raise ValueError(
            "`targets` must have the shape of `hidden` without its last axis, one id "
            f"per token. Received: targets.shape={shape}, hidden.shape={tuple(hidden.shape)}"
        )
    if sample_weight is None:
        return
    weight = tuple(ops.convert_to_tensor(sample_weight).shape)
    if len(weight) > len(shape) or any(
            a is not None and b is not None and a not in (1, b) for a, b in zip(weight, shape)):
        raise ValueError(
            "`sample_weight` must have the shape of `targets` (or a prefix of it, "
            f"e.g. one weight per sequence). Received: sample_weight.shape={weight}, "
            f"targets.shape={shape}"
        )


def checked_targets(targets, vocab, ignore_index):
    """`(targets, ignored)`: int32 ids in `[0, V)` (ignored tokens set to 0,
    checked as `validation.check_targets` does) and the boolean mask of the
    ignored tokens (None without `ignore_index`)."""
    targets = ops.convert_to_tensor(targets)
    dtype = keras.backend.standardize_dtype(targets.dtype)
    if "int" not in dtype:
        raise ValueError(
            f"`targets` must be integer word ids. Received: targets with dtype={dtype}"
        )
    targets = ops.cast(targets, "int32")
    ignored = None
    if ignore_index is not None:
        ignored = ops.equal(targets, ignore_index)
        targets = ops.where(ignored, ops.zeros_like(targets), targets)
    try:
        targets = check_targets(targets, vocab)
    except ValueError as error:
        if ignore_index is None:
            raise
        raise ValueError(f"{error} (ignore_index={ignore_index})") from None
    return targets, ignored
