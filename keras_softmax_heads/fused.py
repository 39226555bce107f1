"""Fused linear + cross-entropy: the exact loss of `softmax(g(h W + b))`
without the `[N, V]` logits.

`linear_cross_entropy(hidden, kernel, targets, ...)` is the loss of a language
model's output projection computed tile by tile over the vocabulary by the
library's chunked core (`chunked.chunked_pointwise_stats`, shared with the
heads' chunked paths): one forward pass keeps per-token `[N]` statistics
(log-sum-exp, target score, sum of scores, argmax), one backward pass
recomputes the tiles and applies the upstream cotangents, so the gradients
of every token are exact whatever the reduction, weights or mask. Options:
a `[d, V]` kernel or a tied `[V, d]` embedding (`kernel_transposed=True`, no
transposed copy), a bias, `sample_weight`, `ignore_index`, label smoothing
(closed form: `(1 - eps) nll + eps (lse - mean_v g_v)`), z-loss
(`z_loss * lse**2`), final-logit soft-capping (`cap * tanh(z / cap)`,
Gemma 2), reductions `"none"` / `"sum"` / `"mean"`, and the argmax / token
accuracy. Scores and statistics are float32 (float64 for float64 inputs),
whatever the inputs' dtype.

`LinearCrossEntropy` is the same loss as a `keras.losses.Loss` for a model
whose output is the hidden states; `fused_causal_lm(GPT2CausalLM)` makes a
keras-hub causal LM train through it. Written in `keras.ops`: TensorFlow, JAX
and PyTorch, eager and compiled; on JAX, vocabulary-parallel under a
`keras.distribution` that shards the output matrix on V
(`vocab_parallel_stats`, the one JAX-specific dispatch point). See
`docs/chunked.md`.
"""

import numbers

import keras
from keras import ops

from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.chunked import chunked_pointwise_stats
from keras_softmax_heads.chunked import kernel_geometry
from keras_softmax_heads.functional import soft_cap
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid

#: Input dtypes whose scores can be accumulated (in float32, or float64).
ACCUMULABLE_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Reductions of `linear_cross_entropy`.
REDUCTIONS = ("none", "sum", "mean")



def _check_dtype(name, x):
    dtype = keras.backend.standardize_dtype(x.dtype)
    if dtype not in ACCUMULABLE_DTYPES:
        raise ValueError(
            f"`{name}` must be a floating tensor of one of {ACCUMULABLE_DTYPES} "
            f"(its scores are accumulated in float32). Received: {name} with "
            f"dtype={dtype}"
        )


def _check_number(name, value, low, high=None, closed_high=True):
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and value >= low and (
        high is None or (value <= high if closed_high else value < high)
    )
    if not ok:
        bound = "" if high is None else f", {high}" + ("]" if closed_high else ")")
        raise ValueError(
            f"`{name}` must be a number in [{low}{bound or ', inf)'}. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def _check_options(reduction, ignore_index, label_smoothing, z_loss, logit_soft_cap):
    if reduction is None:
        reduction = "none"
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"`reduction` must be one of {REDUCTIONS}. Received: reduction={reduction!r}"
        )
    if ignore_index is not None and not (
        hasattr(ignore_index, "__index__") and not isinstance(ignore_index, bool)
    ):
        raise ValueError(
            f"`ignore_index` must be an integer or None. Received: ignore_index={ignore_index!r}"
        )
    label_smoothing = _check_number("label_smoothing", label_smoothing, 0.0, 1.0)
    z_loss = _check_number("z_loss", z_loss, 0.0)
    if logit_soft_cap is not None:
        logit_soft_cap = _check_number("logit_soft_cap", logit_soft_cap, 0.0)
        if logit_soft_cap == 0.0:
            raise ValueError(
                "`logit_soft_cap` must be positive or None. "
                f"Received: logit_soft_cap={logit_soft_cap!r}"
            )
    ignore_index = None if ignore_index is None else int(ignore_index)
    return reduction, ignore_index, label_smoothing, z_loss, logit_soft_cap


def _weighted_mean(values, weights):
    """`sum(w v) / sum(w)`, 0 when the weights sum to 0."""
    total_w = ops.sum(weights)
    positive = total_w > 0
    return ops.where(
        positive, ops.sum(values * weights) / ops.where(positive, total_w, 1.0), 0.0
    )


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
        return_lse: also return the per-token `lse` (`[...]`,
            differentiable).
        return_argmax: also return the per-token argmax word (int32, first
            on ties) and the token accuracy (the weighted mean of
            `argmax == target` over the non-ignored tokens).
        implementation: `"auto"` or `"ops"`, as in
            `chunked.chunked_pointwise_nll`.
        vocab_parallel: `"auto"` (default), True or False. On JAX, under a
            `keras.distribution` whose layout shards the `kernel` variable
            on its vocabulary axis (keras-hub's Gemma / Llama layout maps),
            `"auto"` and True run the tiled pass on each device's own
            vocabulary shard (`jax.shard_map`) and combine the per-token
            statistics across that mesh axis (max, sums): no device gathers
            the `[V, d]` matrix or its gradient. Without a bias only.
            `"auto"` falls back to the single-device form otherwise (where
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
    reduction = _check_options(
        reduction, ignore_index, label_smoothing, z_loss, logit_soft_cap
    )[0]
    terms = _token_terms(
        hidden, kernel, targets, bias, kernel_transposed=kernel_transposed,
        sample_weight=sample_weight, ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss,
        logit_soft_cap=logit_soft_cap, chunk_size=chunk_size,
        implementation=implementation, vocab_parallel=vocab_parallel,
    )
    out = _reduce(terms["loss"], terms["weights"], reduction)
    if not (return_lse or return_argmax):
        return out
    aux = {}
    if return_lse:
        aux["lse"] = terms["lse"]
    if return_argmax:
        aux["argmax"] = terms["argmax"]
        aux["accuracy"] = ops.stop_gradient(
            _weighted_mean(terms["correct"], terms["weights"])
        )
    return out, aux


def _reduce(loss, weights, reduction):
    """`linear_cross_entropy`'s reduction of the per-token `loss`."""
    if reduction == "none":
        return loss * weights
    if reduction == "sum":
        return ops.sum(loss * weights)
    return _weighted_mean(loss, weights)


def _token_terms(
    hidden, kernel, targets, bias=None, *, kernel_transposed=False,
    sample_weight=None, ignore_index=None, label_smoothing=0.0, z_loss=0.0,
    logit_soft_cap=None, chunk_size=DEFAULT_CHUNK_SIZE, implementation="auto",
    vocab_parallel="auto",
):
    """The per-token terms of `linear_cross_entropy` (same arguments), one
    tiled pass: a dict of tensors of the targets' shape: `"loss"` (the
    unweighted loss, smoothing and z-loss included, 0 on ignored tokens),
    `"nll"` (`lse - g_target`, 0 on ignored tokens), `"lse"`, `"weights"`
    (`sample_weight` broadcast, 0 on ignored tokens), `"argmax"` (int32) and
    `"correct"` (`argmax == target`, float, no gradient)."""
    _, ignore_index, eps, z_loss, cap = _check_options(
        "mean", ignore_index, label_smoothing, z_loss, logit_soft_cap
    )
    chunk_size = check_chunk_size(chunk_size)
    hidden = ops.convert_to_tensor(hidden)
    if not isinstance(kernel, keras.Variable):
        kernel = ops.convert_to_tensor(kernel)
    if bias is not None and not isinstance(bias, keras.Variable):
        bias = ops.convert_to_tensor(bias)
    _check_dtype("hidden", hidden)
    _check_dtype("kernel", kernel)
    if bias is not None:
        _check_dtype("bias", bias)
    _, vocab = kernel_geometry(hidden, kernel, kernel_transposed)
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ValueError(
            f"`bias` must have shape ({vocab},) (the kernel's V). "
            f"Received: bias.shape={tuple(bias.shape)}"
        )
    targets = ops.convert_to_tensor(targets)
    if "int" not in keras.backend.standardize_dtype(targets.dtype):
        raise ValueError(
            "`targets` must be integer word ids. "
            f"Received: targets with dtype={keras.backend.standardize_dtype(targets.dtype)}"
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

    transform_fn = None
    if cap is not None:
        transform_fn = lambda z: soft_cap(z, cap)  # noqa: E731
    if vocab_parallel not in ("auto", True, False):
        raise ValueError(
            '`vocab_parallel` must be "auto", True or False. '
            f"Received: vocab_parallel={vocab_parallel!r}"
        )
    layout = None
    if vocab_parallel:
        layout = vocab_parallel_layout(kernel, kernel_transposed)
        if layout is not None and bias is not None:
            layout = None
        if layout is None and vocab_parallel is True:
            raise ValueError(
                "vocab_parallel=True needs the JAX backend, no bias, and a "
                "`kernel` variable that the current keras.distribution shards "
                "on its vocabulary axis (evenly)."
            )
    if layout is not None:
        nll, lse, score_sum, argmax = vocab_parallel_stats(
            hidden, kernel, targets, layout, transform_fn=transform_fn,
            chunk_size=chunk_size, kernel_transposed=kernel_transposed,
            implementation=implementation,
        )
    else:
        nll, lse, score_sum, argmax = chunked_pointwise_stats(
            hidden,
            kernel,
            bias,
            targets,
            transform_fn=transform_fn,
            chunk_size=chunk_size,
            kernel_transposed=kernel_transposed,
            implementation=implementation,
        )
    loss = nll
    if eps:
        loss = (1.0 - eps) * nll + eps * (lse - score_sum / vocab)
    if z_loss:
        loss = loss + z_loss * ops.square(lse)
    loss = nan_if_invalid(loss, targets, vocab)
    nll = nan_if_invalid(nll, targets, vocab)

    weights = ops.ones_like(loss)
    if sample_weight is not None:
        sample_weight = ops.cast(ops.convert_to_tensor(sample_weight), loss.dtype)
        while len(sample_weight.shape) < len(loss.shape):
            sample_weight = ops.expand_dims(sample_weight, -1)
        weights = ops.broadcast_to(sample_weight, ops.shape(loss))
    if ignored is not None:
        weights = ops.where(ignored, ops.zeros_like(weights), weights)
        loss = ops.where(ignored, ops.zeros_like(loss), loss)
        nll = ops.where(ignored, ops.zeros_like(nll), nll)
    correct = ops.stop_gradient(ops.cast(ops.equal(argmax, targets), weights.dtype))
    return {"loss": loss, "nll": nll, "lse": lse, "weights": weights,
            "argmax": argmax, "correct": correct}


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
                         chunk_size, kernel_transposed, implementation):
    """`chunked_pointwise_stats` with the kernel sharded on V (JAX only; the
    one dispatch point of the vocabulary-parallel form).

    Each device runs the tiled pass on its `[V / n, d]` shard, with the
    targets shifted to its range (a target elsewhere contributes no target
    score), then the statistics are combined across the vocabulary mesh
    axis: `lse = m + log(psum(exp(lse_k - m)))` (`m = pmax(lse_k)`, no
    gradient), target score and score sum by `psum`, the argmax by `pmax` of
    each shard's best score (then the smallest id). Gradients flow through
    the collectives and each shard's own backward pass: the kernel gradient
    stays sharded.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    mesh, vocab_axis, batch_axis = layout
    jax_mesh = mesh.backend_mesh
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
    kernel_spec = (PartitionSpec(vocab_axis, None) if kernel_transposed
                   else PartitionSpec(None, vocab_axis))
    row_spec = PartitionSpec(batch_axis)

    def local(h, w, t):
        v_local = w.shape[0] if kernel_transposed else w.shape[1]
        start = jax.lax.axis_index(vocab_axis) * v_local
        shifted = t - start
        inside = (shifted >= 0) & (shifted < v_local)
        nll, lse, score_sum, argmax = chunked_pointwise_stats(
            h, w, None, jnp.where(inside, shifted, 0), transform_fn=transform_fn,
            chunk_size=chunk_size, kernel_transposed=kernel_transposed,
            implementation=implementation,
        )
        peak = jax.lax.pmax(jax.lax.stop_gradient(lse), vocab_axis)
        total_lse = peak + jnp.log(jax.lax.psum(jnp.exp(lse - peak), vocab_axis))
        target = jax.lax.psum(jnp.where(inside, lse - nll, 0.0), vocab_axis)
        score_sum = jax.lax.psum(score_sum, vocab_axis)
        # The argmax: each shard's best score, recomputed from its row.
        row = jnp.take(w, argmax, axis=0) if kernel_transposed else jnp.take(w, argmax, axis=1).T
        best = jnp.sum(h.astype(lse.dtype) * row.astype(lse.dtype), axis=-1)
        if transform_fn is not None:
            best = transform_fn(best)
        best = jax.lax.stop_gradient(best)
        top = jax.lax.pmax(best, vocab_axis)
        ids = jnp.where(best == top, argmax + start, jnp.iinfo("int32").max)
        argmax = jax.lax.pmin(ids.astype("int32"), vocab_axis)
        return total_lse - target, total_lse, score_sum, argmax

    out = jax.shard_map(
        local, mesh=jax_mesh, in_specs=(PartitionSpec(batch_axis, None), kernel_spec, row_spec),
        out_specs=(row_spec,) * 4, check_vma=False,
    )(h, kernel, t)
    return tuple(ops.reshape(x, lead) for x in out)


def _layer_kernel(source):
    """`(kernel, bias, kernel_transposed)` of a variable or a built layer."""
    if isinstance(source, keras.Variable):
        return source, None, None
    if isinstance(source, keras.layers.Layer):
        if not source.built:
            raise ValueError(
                f"LinearCrossEntropy: layer {source.name!r} is not built yet."
            )
        reverse = getattr(source, "reverse_embeddings", None)
        if reverse is not None and not getattr(source, "tie_weights", True):
            return reverse, None, False  # keras-hub untied: [d, V]
        if getattr(source, "embeddings", None) is not None:
            return source.embeddings, None, True  # [V, d]
        if getattr(source, "kernel", None) is not None:
            return source.kernel, getattr(source, "bias", None), False
    raise ValueError(
        "LinearCrossEntropy needs the output projection: a Keras variable, a "
        "Dense-like layer (`kernel` [d, V], `bias`) or an embedding layer "
        f"(`embeddings` [V, d], tied). Received: {source!r}"
    )


#: `keras.losses.Loss` reductions -> `linear_cross_entropy` reductions.
_KERAS_REDUCTIONS = {
    None: "none",
    "none": "none",
    "sum": "sum",
    "sum_over_batch_size": "mean",
    "mean": "mean",
    "mean_with_sample_weight": "mean",
}


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class LinearCrossEntropy(keras.losses.Loss):
    """`linear_cross_entropy` as a Keras loss, for models that output hidden
    states.

    The model's output (`y_pred`) is the final hidden states `[..., d]`; this
    loss applies the output projection itself, tile by tile, so `fit` never
    builds the `[..., V]` logits. Pass the projection: a Dense-like layer
    (its `kernel` `[d, V]` and `bias`), an embedding layer (tied weights: its
    `embeddings` `[V, d]`, `kernel_transposed`; a keras-hub
    `ReversibleEmbedding`), or a Keras variable. A layer is read when the
    loss is first called, so it may be unbuilt when the loss is made.

    Reductions: `"sum_over_batch_size"` (Keras' default), `"mean"` and
    `"mean_with_sample_weight"` all average over the non-ignored tokens,
    weighted by `sample_weight` (`sum(w * loss) / sum(w)`); `"sum"`; `None`
    / `"none"` (per token).

    Serialisation: `get_config` stores the options and the paths of the
    kernel and bias variables (`variable.path`), not the variables. A loss
    rebuilt by `from_config` (or by `keras.saving.load_model`) is unbound:
    call `loss.bind(model)` (finds those paths among `model.variables`) or
    `loss.bind(layer_or_variable)` before using it.

    Args:
        kernel: the projection (layer or variable); `None` only for an
            unbound loss with `kernel_path`.
        bias: a `[V]` variable, or None (a Dense layer's own bias is used
            when `kernel` is that layer).
        kernel_transposed: None (from the layer: True for an embedding), or
            bool for a variable `kernel`.
        ignore_index, label_smoothing, z_loss, logit_soft_cap, chunk_size,
        implementation: as in `linear_cross_entropy`.
        kernel_path, bias_path: used by `from_config`.
        reduction, name, dtype: as for every `keras.losses.Loss`.

    Example:

    >>> import numpy as np, keras, keras_softmax_heads as ksh
    >>> V, d = 50, 16
    >>> emb = keras.layers.Embedding(V, d)
    >>> model = keras.Sequential([emb, keras.layers.Dense(d)])  # -> hidden states
    >>> model.compile("adam", loss=ksh.LinearCrossEntropy(emb, chunk_size=16))
    >>> x = np.random.randint(0, V, (8, 6)); y = np.roll(x, -1, axis=1)
    >>> history = model.fit(x, y, epochs=1, verbose=0)
    """

    def __init__(
        self,
        kernel=None,
        bias=None,
        kernel_transposed=None,
        ignore_index=None,
        label_smoothing=0.0,
        z_loss=0.0,
        logit_soft_cap=None,
        chunk_size=DEFAULT_CHUNK_SIZE,
        implementation="auto",
        kernel_path=None,
        bias_path=None,
        reduction="sum_over_batch_size",
        name="linear_cross_entropy",
        dtype=None,
    ):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        (_, self.ignore_index, self.label_smoothing, self.z_loss,
         self.logit_soft_cap) = _check_options(
            "mean", ignore_index, label_smoothing, z_loss, logit_soft_cap
        )
        self.chunk_size = check_chunk_size(chunk_size)
        if implementation not in ("auto", "ops"):
            raise ValueError(
                '`implementation` must be "auto" or "ops". '
                f"Received: implementation={implementation!r}"
            )
        self.implementation = implementation
        self.kernel_transposed = kernel_transposed
        self.kernel_path = kernel_path
        self.bias_path = bias_path
        self._source = None
        self._bias = None
        if kernel is None and kernel_path is None:
            raise ValueError(
                "LinearCrossEntropy needs the output projection: "
                "LinearCrossEntropy(dense_or_embedding_layer_or_variable). "
                "Received: kernel=None"
            )
        if kernel is not None:
            self.bind(kernel, bias)

    def bind(self, source, bias=None):
        """Attaches the projection: a layer or variable (as in the
        constructor), or a model / layer holding the variables named by
        `kernel_path` / `bias_path`. Returns the loss."""
        if (
            self.kernel_path is not None
            and isinstance(source, keras.layers.Layer)
            and any(v.path == self.kernel_path for v in source.variables)
        ):
            by_path = {v.path: v for v in source.variables}
            self._source = by_path[self.kernel_path]
            self._bias = by_path.get(self.bias_path) if self.bias_path else None
            if self.bias_path and self._bias is None:
                raise ValueError(
                    f"LinearCrossEntropy.bind: no variable {self.bias_path!r} in {source.name!r}."
                )
            if self.kernel_transposed is None:
                raise ValueError(
                    "LinearCrossEntropy.bind: kernel_transposed is unknown."
                )
            return self
        if not isinstance(source, (keras.Variable, keras.layers.Layer)):
            _layer_kernel(source)  # raises
        self._source = source
        self._bias = bias
        if isinstance(source, keras.layers.Layer) and source.built:
            self._resolve()
        return self

    def _resolve(self):
        if self._source is None:
            raise ValueError(
                f"This LinearCrossEntropy (kernel_path={self.kernel_path!r}) is "
                "not bound to its projection (it was restored from a config). "
                "Call `loss.bind(model)` or `loss.bind(layer_or_variable)`."
            )
        kernel, bias, transposed = _layer_kernel(self._source)
        if self._bias is not None:
            bias = self._bias
        if transposed is None:
            transposed = bool(self.kernel_transposed)
        elif self.kernel_transposed is not None and bool(self.kernel_transposed) != transposed:
            raise ValueError(
                f"kernel_transposed={self.kernel_transposed} does not match the "
                f"layer {self._source.name!r} (its kernel is "
                f"{'[V, d]' if transposed else '[d, V]'})."
            )
        self.kernel_transposed = transposed
        self.kernel_path = kernel.path
        self.bias_path = None if bias is None else bias.path
        return kernel, bias, transposed

    def _targets(self, y_true, y_pred):
        targets = ops.convert_to_tensor(y_true)
        if len(targets.shape) == len(y_pred.shape):  # targets [..., 1]
            targets = ops.squeeze(targets, axis=-1)
        if "int" not in keras.backend.standardize_dtype(targets.dtype):
            targets = ops.cast(targets, "int32")  # float labels, as Keras' losses take
        return targets

    def _loss(self, y_true, y_pred, sample_weight, reduction):
        kernel, bias, transposed = self._resolve()
        y_pred = ops.convert_to_tensor(y_pred)
        return linear_cross_entropy(
            y_pred,
            kernel,
            self._targets(y_true, y_pred),
            bias,
            kernel_transposed=transposed,
            sample_weight=sample_weight,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            logit_soft_cap=self.logit_soft_cap,
            reduction=reduction,
            chunk_size=self.chunk_size,
            implementation=self.implementation,
        )

    def call(self, y_true, y_pred):
        """The per-token loss (0 on ignored tokens), unweighted."""
        return self._loss(y_true, y_pred, None, "none")

    def __call__(self, y_true, y_pred, sample_weight=None):
        # Our own reduction: the mean is over the non-ignored tokens.
        return self._loss(
            y_true, y_pred, sample_weight, _KERAS_REDUCTIONS[self.reduction]
        )

    def get_config(self):
        config = super().get_config()
        source = self._source
        if isinstance(source, keras.Variable) or getattr(source, "built", False):
            self._resolve()  # fills in the paths and the layout
        config.update(
            kernel_transposed=self.kernel_transposed,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            logit_soft_cap=self.logit_soft_cap,
            chunk_size=self.chunk_size,
            implementation=self.implementation,
            kernel_path=self.kernel_path,
            bias_path=self.bias_path,
        )
        return config


class FusedLossCausalLM:
    """Mixin for a keras-hub `CausalLM` class: `fit` trains through
    `linear_cross_entropy` and never forms the `[batch, seq, V]` logits.

    In training (`call(..., training=True)`, what `fit` runs) the model
    returns the backbone's hidden states `[batch, seq, d]` instead of the
    logits, and `compute_loss` (Keras' public hook) applies
    `linear_cross_entropy` to them with what the stock
    `token_embedding(h, reverse=True)` applies (`fused_projection()`, public
    attributes of keras' `ReversibleEmbedding` only): the tied
    `embeddings` `[V, d]` (`kernel_transposed`; GPT-2, Gemma) or the untied
    `reverse_embeddings` `[d, V]` (`tie_weights=False`, Llama's default),
    and the layer's `logit_soft_cap` (Gemma 2's `final_logit_soft_cap`),
    plus the targets `y`, the `sample_weight` (the preprocessor's padding
    mask) and the model's other losses (`model.losses`). With LoRA on the
    tied embedding (`backbone.enable_lora(r, target_layer_names=[...,
    "token_embedding"])`) the `embeddings` property is the merged
    `W + (alpha / r) A B`, as in the stock reverse call. The compiled
    metrics are skipped in training (they would see hidden states: the
    training logs hold the loss; compile with `weighted_metrics=[]` to have
    none). `evaluate` (with `fit`'s validation and `test_on_batch`) also
    runs without the logits by default (`fused_evaluate=True`): one tiled
    pass per step gives the fused loss (as trained) and the logs `loss`,
    `token_accuracy` (argmax == target, weighted) and `perplexity` (`exp`
    of the token-weighted mean negative log-likelihood over the whole
    evaluation; `loss` is Keras' average of the batches' losses, weighted by
    batch size); the compiled metrics, which need logits, are skipped.
    `fused_evaluate=False` keeps the stock `evaluate` (logits, compiled loss
    and metrics). `predict` and `generate` are unchanged (logits). On JAX under a `keras.distribution`
    that shards the output matrix on its vocabulary axis, the loss is
    vocabulary-parallel (`linear_cross_entropy(vocab_parallel="auto")`).

    `fused_loss` (a dict of `linear_cross_entropy` options: `chunk_size`,
    `label_smoothing`, `z_loss`, `ignore_index`, `reduction`,
    `vocab_parallel`, ...) and `fused_evaluate` (bool, default True) are
    constructor arguments and part of `get_config`; `logit_soft_cap` comes
    from the model (a different value is an error). The default reduction,
    `"mean"`, averages over the weighted tokens (`sum(w loss) / sum(w)`), as
    Keras' `reduction="mean_with_sample_weight"` does, whereas Keras'
    default compiled loss (`"sum_over_batch_size"`) divides by all tokens,
    padding included: with `fused_evaluate=False`, training and validation
    losses differ by that factor when there is padding unless the compiled
    loss uses `"mean_with_sample_weight"`.

    For models whose logits are `token_embedding(backbone(x), reverse=True)`
    (GPT-2, Gemma / Gemma 2, Llama, Mistral, ...). Not for a quantized
    embedding. `keras.saving.load_model` does not re-compile a keras-hub
    task (its `compile` is custom): compile the loaded model again. Use
    `fused_causal_lm(cls)` to get the subclass (call it before loading a
    saved one, to register it).
    """

    _fused_evaluating = False  # True inside `evaluate` (fused_evaluate)
    _fused_eval_terms = None  # the test step's per-token terms

    def __init__(self, *args, fused_loss=None, fused_evaluate=True, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(fused_evaluate, bool):
            raise ValueError(
                f"`fused_evaluate` must be True or False. Received: fused_evaluate={fused_evaluate!r}"
            )
        options = dict(fused_loss or {})
        for key in ("sample_weight", "kernel_transposed", "bias", "return_lse",
                    "return_argmax"):
            if key in options:
                raise ValueError(
                    f"`fused_loss` sets the linear_cross_entropy options; {key!r} "
                    f"comes from the model and the data. Received: fused_loss={options}"
                )
        _check_options(options.get("reduction", "mean"), options.get("ignore_index"),
                       options.get("label_smoothing", 0.0), options.get("z_loss", 0.0),
                       options.get("logit_soft_cap"))
        if options.get("vocab_parallel", "auto") not in ("auto", True, False):
            raise ValueError(
                '`fused_loss["vocab_parallel"]` must be "auto", True or False. '
                f"Received: fused_loss={options}"
            )
        model_cap = getattr(self.backbone.token_embedding, "logit_soft_cap", None)
        if "logit_soft_cap" in options:
            cap = options["logit_soft_cap"]
            if (cap is None) != (model_cap is None) or (
                cap is not None and float(cap) != float(model_cap)
            ):
                raise ValueError(
                    "`fused_loss['logit_soft_cap']` must match the model's final "
                    "logit soft cap (`backbone.token_embedding.logit_soft_cap` = "
                    f"{model_cap!r}), which the fused loss reads itself. "
                    f"Received: fused_loss={options}"
                )
            del options["logit_soft_cap"]
        self.fused_loss = options
        self.fused_evaluate = fused_evaluate
        if fused_evaluate:
            # The evaluation metrics (token-weighted over the whole run).
            self.token_accuracy_tracker = keras.metrics.Mean(name="token_accuracy")
            self.token_nll_tracker = keras.metrics.Mean(name="token_nll")

    def evaluate(self, *args, **kwargs):
        """Keras' `evaluate` (also what `fit` runs for validation); with
        `fused_evaluate` (the default) through the fused loss, without the
        logits: the logs hold `loss`, `token_accuracy` and `perplexity`."""
        return self._fused_test(super().evaluate, *args, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        """Keras' `test_on_batch`, fused as `evaluate` is (they share the
        compiled test step)."""
        return self._fused_test(super().test_on_batch, *args, **kwargs)

    def _fused_test(self, method, *args, **kwargs):
        if not self.fused_evaluate:
            return method(*args, **kwargs)
        previous, self._fused_evaluating = self._fused_evaluating, True
        try:
            return method(*args, **kwargs)
        finally:
            self._fused_evaluating = previous

    def call(self, inputs, training=None, mask=None):
        if training or self._fused_evaluating:
            return self.backbone(inputs, training=training)
        return super().call(inputs, training=training, mask=mask)

    def fused_projection(self):
        """`(kernel, kernel_transposed, logit_soft_cap)`: what the stock
        model's `token_embedding(h, reverse=True)` applies, read from the
        backbone's `token_embedding` (public attributes only).

        Tied (`tie_weights=True`, GPT-2, Gemma): `embeddings` `[V, d]`,
        `kernel_transposed=True`; with LoRA enabled on the embedding this is
        the merged `W + (alpha / r) A B` (the layer's own `embeddings`
        property, as its reverse call uses). Untied (`tie_weights=False`,
        Llama's default): `reverse_embeddings` `[d, V]`. The soft cap is the
        layer's `logit_soft_cap` (Gemma 2's `final_logit_soft_cap`), or None.
        """
        embedding = self.backbone.token_embedding
        if getattr(embedding, "quantization_mode", None) is not None:
            raise ValueError(
                "FusedLossCausalLM trains through the float output matrix; the "
                f"token embedding is quantized ({embedding.quantization_mode!r})."
            )
        cap = getattr(embedding, "logit_soft_cap", None)
        cap = None if cap is None else float(cap)
        if not getattr(embedding, "tie_weights", True):
            return embedding.reverse_embeddings, False, cap
        return embedding.embeddings, True, cap

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        if not (training or self._fused_evaluating):  # logits: the compiled loss
            return super().compute_loss(x, y, y_pred, sample_weight, training=training)
        kernel, transposed, cap = self.fused_projection()
        options = dict(self.fused_loss)
        reduction = _check_options(options.pop("reduction", "mean"), None, 0.0, 0.0, None)[0]
        # `linear_cross_entropy`'s two steps, keeping the per-token terms.
        terms = _token_terms(
            y_pred, kernel, y, sample_weight=sample_weight,
            kernel_transposed=transposed, logit_soft_cap=cap, **options,
        )
        loss = _reduce(terms["loss"], terms["weights"], reduction)
        if not training:  # read by `compute_metrics`, next in the same test step
            self._fused_eval_terms = terms
        for extra in self.losses:
            loss = loss + ops.cast(ops.sum(extra), loss.dtype)
        return loss

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        if self._fused_evaluating:
            terms, self._fused_eval_terms = self._fused_eval_terms, None
            if terms is not None:
                self.token_accuracy_tracker.update_state(
                    terms["correct"], sample_weight=terms["weights"])
                self.token_nll_tracker.update_state(
                    terms["nll"], sample_weight=terms["weights"])
            return self.get_metrics_result()
        vocab = self.backbone.token_embedding.input_dim
        if y_pred is None or y_pred.shape[-1] == vocab:  # logits
            return super().compute_metrics(x, y, y_pred, sample_weight)
        # Hidden states (training): the loss only; the compiled metrics
        # need logits.
        return {m.name: m.result() for m in self.metrics if m.name == "loss"}

    def get_metrics_result(self):
        """The metrics' results, without the compiled metrics while they
        have seen no logits (training only). In fused evaluation: `loss`,
        `token_accuracy` and `perplexity` (`exp` of the token-weighted mean
        negative log-likelihood over the whole evaluation)."""
        own = [getattr(self, "token_accuracy_tracker", None),
               getattr(self, "token_nll_tracker", None)]
        if self._fused_evaluating:
            results = {m.name: m.result() for m in self.metrics if m.name == "loss"}
            results["token_accuracy"] = own[0].result()
            results["perplexity"] = ops.exp(own[1].result())
            return results
        results = {}
        for metric in self.metrics:
            if getattr(metric, "built", True) is False or any(metric is m for m in own):
                continue
            result = metric.result()
            if isinstance(result, dict):
                results.update(result)
            else:
                results[metric.name] = result
        return results

    def get_config(self):
        config = super().get_config()
        config["fused_loss"] = dict(self.fused_loss)
        config["fused_evaluate"] = self.fused_evaluate
        return config


_FUSED_CLASSES = {}


def fused_causal_lm(causal_lm_class):
    """The subclass of a keras-hub `CausalLM` class (e.g.
    `keras_hub.models.GPT2CausalLM`) that trains through
    `linear_cross_entropy` (`FusedLossCausalLM`); registered serializable as
    `keras_softmax_heads>Fused<name>`.

    Example (not run here: keras-hub is optional):

        FusedGPT2 = ksh.fused.fused_causal_lm(keras_hub.models.GPT2CausalLM)
        lm = FusedGPT2(backbone=backbone, preprocessor=None,
                       fused_loss={"chunk_size": 8192, "z_loss": 1e-4})
        lm.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), weighted_metrics=[])
        lm.fit(x, y, sample_weight=padding_mask)  # no [batch, seq, V] logits
    """
    if causal_lm_class not in _FUSED_CLASSES:
        name = f"Fused{causal_lm_class.__name__}"
        cls = type(name, (FusedLossCausalLM, causal_lm_class), {
            "__doc__": f"`{causal_lm_class.__name__}` trained through "
                       "`linear_cross_entropy` (see `FusedLossCausalLM`).",
            "__module__": __name__,
        })
        _FUSED_CLASSES[causal_lm_class] = keras.saving.register_keras_serializable(
            package="keras_softmax_heads", name=name)(cls)
    return _FUSED_CLASSES[causal_lm_class]
