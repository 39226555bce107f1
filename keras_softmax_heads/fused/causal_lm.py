"""keras-hub integration: `fused_causal_lm(CausalLMClass)` trains a keras-hub
causal LM through `linear_cross_entropy`, without the `[batch, seq, V]`
logits (`FusedLossCausalLM`, the mixin). See `docs/chunked.md`, "Fused
linear + cross-entropy from hidden states" (keras-hub, LoRA, vocabulary
sharding)."""

import keras
from keras import ops

from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.chunked import check_token_chunk_size
from keras_softmax_heads.fused.cross_entropy import check_loss_options
from keras_softmax_heads.fused.cross_entropy import linear_cross_entropy
from keras_softmax_heads.fused.cross_entropy import reduce_loss
from keras_softmax_heads.fused.cross_entropy import token_terms
from keras_softmax_heads.fused.vocab_parallel import check_vocab_parallel
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import keras_integer_targets
from keras_softmax_heads.validation import per_replica


class FusedLossCausalLM:
    """Mixin for a keras-hub `CausalLM` class: `fit` and `evaluate` run
    through `linear_cross_entropy`, without the `[batch, seq, V]` logits.

    Use `fused_causal_lm(cls)` to get the subclass (call it before loading
    a saved one: it registers the class). In training (and in fused
    evaluation) `call` returns the backbone's hidden states
    `[batch, seq, d]`, and `compute_loss` (Keras' public hook) applies
    `linear_cross_entropy` to them with the projection the stock
    `token_embedding(h, reverse=True)` applies (`fused_projection()`), the
    targets `y`, the `sample_weight` (the padding mask) and the model's
    other losses (`model.losses`). The compiled metrics need logits: they
    are skipped in training and in fused evaluation (compile with
    `weighted_metrics=[]` to have none). Fused `evaluate` (also `fit`'s
    validation and `test_on_batch`) reports `loss` (the fused loss, as
    trained), `token_accuracy` (argmax == target, weighted) and
    `perplexity` (`exp` of the token-weighted mean negative
    log-likelihood over the whole evaluation). `predict` and `generate` are
    unchanged (logits). On JAX under a `keras.distribution` that shards the
    output matrix on its vocabulary axis, the loss is vocabulary-parallel
    (with `gradient_in_forward` too).

    For models whose logits are `token_embedding(backbone(x), reverse=True)`
    (GPT-2, Gemma / Gemma 2, Llama, Mistral, ...); not for a quantized
    embedding. The default reduction `"mean"` is `sum(w loss) / sum(w)`,
    Keras' `reduction="mean_with_sample_weight"`. `keras.saving.load_model`
    does not re-compile a keras-hub task: compile the loaded model again.
    Details (LoRA, sharding, the stock loss's reduction): `docs/chunked.md`,
    "Fused linear + cross-entropy from hidden states".

    Args:
        fused_loss: None or a dict of `linear_cross_entropy` options
            (`chunk_size`, `token_chunk_size`, `label_smoothing`, `z_loss`,
            `ignore_index`, `reduction`, `vocab_parallel`, `implementation`,
            `gradient_in_forward`: the training step only; evaluation
            takes the per-token pass, which needs no gradient);
            `logit_soft_cap`, if given, must equal the model's (it is read
            from the model). Stored in `get_config`.
        fused_evaluate: bool (default True): `evaluate` and
            `test_on_batch` run the fused pass; False keeps the stock
            `evaluate` (logits, compiled loss and metrics). Stored in
            `get_config`.
        *args, **kwargs: those of the keras-hub `CausalLM` class.
    """

    _fused_evaluating = False  # True inside `evaluate` (fused_evaluate)
    _fused_eval_terms = None  # the test step's per-token terms

    def __init__(self, *args, fused_loss=None, fused_evaluate=True, **kwargs):
        super().__init__(*args, **kwargs)
        fused_evaluate = check_bool("fused_evaluate", fused_evaluate)
        options = dict(fused_loss or {})
        for key in ("sample_weight", "kernel_transposed", "bias", "return_lse",
                    "return_argmax"):
            if key in options:
                raise ValueError(
                    f"`fused_loss` sets the linear_cross_entropy options; {key!r} "
                    f"comes from the model and the data. Received: fused_loss={options}"
                )
        reduction = check_loss_options(
            options.get("reduction", "mean"), options.get("ignore_index"),
            options.get("label_smoothing", 0.0), options.get("z_loss", 0.0),
            options.get("logit_soft_cap"))[0]
        check_vocab_parallel(options.get("vocab_parallel", "auto"))
        check_chunk_size(options.get("chunk_size"))
        check_token_chunk_size(options.get("token_chunk_size"))
        check_bool("gradient_in_forward", options.get("gradient_in_forward", False))
        if reduction == "none":
            # Keras differentiates the scalar `compute_loss` returns: per-token
            # losses would train on their sum (TensorFlow) or fail (JAX, torch).
            raise ValueError(
                "`fused_loss['reduction']` must be 'mean' (the default) or 'sum': "
                "the task model trains on one scalar loss. Received: "
                f"fused_loss={options}"
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
        y = keras_integer_targets(y)
        options = dict(self.fused_loss)
        reduction = check_loss_options(options.pop("reduction", "mean"))[0]
        if options.pop("gradient_in_forward", False) and training:
            loss = linear_cross_entropy(
                y_pred, kernel, y, sample_weight=sample_weight,
                kernel_transposed=transposed, logit_soft_cap=cap, reduction=reduction,
                gradient_in_forward=True, **options,
            )
        else:
            # `linear_cross_entropy`'s two steps, keeping the per-token terms.
            terms = token_terms(
                y_pred, kernel, y, sample_weight=sample_weight,
                kernel_transposed=transposed, logit_soft_cap=cap, **options,
            )
            loss = reduce_loss(terms["loss"], terms["weights"], reduction)
            if not training:  # read by `compute_metrics`, next in the same test step
                self._fused_eval_terms = terms
        return with_additional_losses(self, loss, reduction)

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


def with_additional_losses(model, loss, reduction):
    """The value a fused `compute_loss` returns: its reduced `loss` plus the
    model's additional losses (`model.losses`, e.g. weight regularisers),
    scaled as Keras' `compute_loss` scales them: under a `tf.distribute`
    strategy, a mean and the additional losses by the replica count (the
    replicas' gradients are summed); a sum as it is."""
    if reduction == "mean":
        loss = per_replica(loss)
    for extra in model.losses:
        loss = loss + per_replica(ops.cast(ops.sum(extra), loss.dtype))
    return loss


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
