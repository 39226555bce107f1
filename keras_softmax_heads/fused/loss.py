"""`LinearCrossEntropy`: `linear_cross_entropy` as a `keras.losses.Loss`,
for models whose output is the final hidden states."""

import keras
from keras import ops

from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.chunked import check_token_chunk_size
from keras_softmax_heads.fused.cross_entropy import broadcast_weights
from keras_softmax_heads.fused.cross_entropy import check_loss_options
from keras_softmax_heads.fused.cross_entropy import check_token_shapes
from keras_softmax_heads.fused.cross_entropy import linear_cross_entropy
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import keras_integer_targets
from keras_softmax_heads.validation import keras_mask_weights
from keras_softmax_heads.validation import per_replica


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
    loss is first called, so it may be unbuilt when the loss is made. A
    layer that soft-caps its logits (keras-hub's `ReversibleEmbedding`
    with `logit_soft_cap`, Gemma 2's `final_logit_soft_cap`) gives the
    loss its cap when `logit_soft_cap` is not passed, so that the loss is
    the stock model's; another cap is a `ValueError`.

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
        implementation, token_chunk_size: as in `linear_cross_entropy`.
        gradient_in_forward: bool (default False), as in
            `linear_cross_entropy`: the gradient computed in the forward
            pass (three products a step instead of four; an evaluation
            still computes it in a TensorFlow graph without XLA). Needs a
            summed reduction (not `None` / `"none"`); `call` (per token)
            does not use it.
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
        token_chunk_size=None,
        gradient_in_forward=False,
        kernel_path=None,
        bias_path=None,
        reduction="sum_over_batch_size",
        name="linear_cross_entropy",
        dtype=None,
    ):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        (_, self.ignore_index, self.label_smoothing, self.z_loss,
         self.logit_soft_cap) = check_loss_options(
            "mean", ignore_index, label_smoothing, z_loss, logit_soft_cap
        )
        self.chunk_size = check_chunk_size(chunk_size)
        self.token_chunk_size = check_token_chunk_size(token_chunk_size)
        self.gradient_in_forward = check_bool("gradient_in_forward", gradient_in_forward)
        if self.gradient_in_forward and _KERAS_REDUCTIONS.get(self.reduction) == "none":
            raise ValueError(
                "`gradient_in_forward=True` needs a summed reduction (the "
                "cotangents are then the weights). Received: "
                f"reduction={self.reduction!r}"
            )
        self.implementation = check_choice(
            "implementation", implementation, ("auto", "ops")
        )
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
        self._adopt_soft_cap(source)
        self._source = source
        self._bias = bias
        if isinstance(source, keras.layers.Layer) and source.built:
            self._resolve()
        return self

    def _adopt_soft_cap(self, source):
        """A layer with a final logit soft cap of its own (keras-hub's
        `ReversibleEmbedding(logit_soft_cap=...)`, Gemma 2's
        `final_logit_soft_cap`) caps the scores the model trains on: its
        cap becomes this loss' `logit_soft_cap` when none was given (as
        the stock task model's logits), and another cap is an error."""
        cap = getattr(source, "logit_soft_cap", None)
        if not isinstance(source, keras.layers.Layer) or cap is None:
            return
        if self.logit_soft_cap is None:
            self.logit_soft_cap = float(cap)
        elif float(self.logit_soft_cap) != float(cap):
            raise ValueError(
                f"LinearCrossEntropy: logit_soft_cap={self.logit_soft_cap} does not "
                f"match the layer {source.name!r}, whose logits are soft-capped at "
                f"{cap} (its `logit_soft_cap`, which the loss uses when none is "
                "given)."
            )

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
        targets = keras_integer_targets(y_true)  # float labels, as Keras' losses take
        if len(targets.shape) == len(y_pred.shape):  # targets [..., 1]
            targets = ops.squeeze(targets, axis=-1)
        return targets

    def _loss(self, targets, y_pred, sample_weight, reduction):
        """`linear_cross_entropy` of `y_pred` (a tensor) and `targets` (from
        `_targets`) with this loss' options."""
        kernel, bias, transposed = self._resolve()
        return linear_cross_entropy(
            y_pred,
            kernel,
            targets,
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
            token_chunk_size=self.token_chunk_size,
            gradient_in_forward=self.gradient_in_forward and reduction != "none",
        )

    def call(self, y_true, y_pred):
        """The per-token loss (0 on ignored tokens), unweighted."""
        y_pred = ops.convert_to_tensor(y_pred)
        return self._loss(self._targets(y_true, y_pred), y_pred, None, "none")

    def __call__(self, y_true, y_pred, sample_weight=None):
        # Our own reduction: the mean is over the non-ignored tokens, the
        # Keras mask of `y_pred` (e.g. `Embedding(mask_zero=True)`'s, handed
        # on by the layers after it) a weight, as in Keras' own losses.
        weight = keras_mask_weights(y_pred)  # before a conversion drops the mask
        y_pred = ops.convert_to_tensor(y_pred)
        targets = self._targets(y_true, y_pred)
        if sample_weight is not None:
            check_token_shapes(y_pred, targets, sample_weight)
            weight = weight * broadcast_weights(sample_weight, weight)
        reduction = _KERAS_REDUCTIONS[self.reduction]
        loss = self._loss(targets, y_pred, weight, reduction)
        # A mean under a `tf.distribute` strategy: each replica's share, as
        # Keras' own losses give (the replicas' gradients are summed).
        return per_replica(loss) if reduction == "mean" else loss

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
            token_chunk_size=self.token_chunk_size,
            gradient_in_forward=self.gradient_in_forward,
            kernel_path=self.kernel_path,
            bias_path=self.bias_path,
        )
        return config
