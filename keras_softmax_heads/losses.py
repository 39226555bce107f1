"""`HeadLoss`: train any head in a `Sequential` or functional model with its
own objective; `LinearCrossEntropy` / `linear_cross_entropy` (from
`keras_softmax_heads.fused`): the fused, tiled output projection + exact
cross-entropy of a model that outputs hidden states."""

import weakref

import keras
from keras import ops

from keras_softmax_heads.fused import LinearCrossEntropy  # noqa: F401 (re-export)
from keras_softmax_heads.fused import linear_cross_entropy  # noqa: F401 (re-export)
from keras_softmax_heads.heads.softmax_head import SoftmaxHead
from keras_softmax_heads.heads.softmax_head import context_output_heads
from keras_softmax_heads.heads.head_utils import gather_targets
from keras_softmax_heads.heads.head_utils import token_weights
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid
from keras_softmax_heads.validation import per_replica

#: The reductions under which `HeadLoss` trains a `gradient_in_forward`
#: head through its summed objective (Keras' weighted sum, that sum over the
#: token count, or over the sum of the sample weights); with `"none"`, or a
#: Keras mask, per token.
SUMMED_REDUCTIONS = ("sum", "sum_over_batch_size", "mean", "mean_with_sample_weight")


# Heads already bound to a HeadLoss (weakly held): a restored HeadLoss takes
# the most recently loaded head of its name that no other HeadLoss holds.
_BOUND_HEADS = weakref.WeakSet()


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class HeadLoss(keras.losses.Loss):
    """The loss of a head used as the last layer of a Keras model.

    A Keras loss only sees `(y_true, y_pred)`; a sampled softmax, NCE or a
    hierarchical softmax needs the context vectors `h` and the head's
    weights to compute its training objective without the `[..., V]`
    scores. `HeadLoss(head)` sets `head.training_output = "contexts"`: in
    training the head then returns `h[..., None, :]` and this loss computes
    `head.training_loss(h, y_true)` (the sampled / NCE / self-normalised
    objective, or the exact NLL computed cheaply: chunked, hierarchical).
    In evaluation (`training=False`) the head returns its exact
    log-probabilities and this loss is their negative log-likelihood, so
    `evaluate` and `val_loss` are exact for every head. In training a Keras
    metric would be handed the contexts: give `Perplexity()` as it is and
    any other metric wrapped in `HeadMetric(...)` (both skip those batches).
    A Keras mask on the head's input weighs the tokens, as in Keras' losses.

    Per token the loss is `O(cost of head.training_loss)`: `O(N S d)` for
    `S` sampled words instead of the `O(N V d)` of a softmax over `V` words.

    Args:
        head: the model's output head (a `keras_softmax_heads` head). A
            `HeadLoss` loaded from a `.keras` file finds its head by name
            among the loaded heads the first time it is called.
        head_name: used by `from_config`; pass `head` instead.
        name: the loss's name.
        reduction, dtype: as for every `keras.losses.Loss`, with Keras'
            meanings: the default (`"sum_over_batch_size"`) divides the
            weighted sum by the number of tokens, `"mean_with_sample_weight"`
            by the sum of `sample_weight` (the mean over the non-padding
            tokens when padding has weight 0). A `gradient_in_forward`
            head trains through its summed objective under every
            reduction but `"none"` and a Keras mask.

    Call arguments:
        y_true: integer word ids `[...]`.
        y_pred: the head's output: contexts `[..., 1, d]` in training,
            log-probabilities `[..., V]` otherwise.

    Returns:
        The per-token loss, reduced as `reduction` says.

    Example:

    >>> import numpy as np, keras, keras_softmax_heads as ksh
    >>> V = 50
    >>> head = ksh.SampledSoftmax(V, num_sampled=8)
    >>> model = keras.Sequential([keras.layers.Embedding(V, 16), head])
    >>> model.compile("adam", loss=ksh.HeadLoss(head), metrics=[ksh.Perplexity()])
    >>> x = np.random.randint(0, V, (8, 6)); y = np.roll(x, -1, axis=1)
    >>> history = model.fit(x, y, epochs=1, verbose=0)  # sampled objective
    >>> sorted(model.evaluate(x, y, verbose=0, return_dict=True))  # exact
    ['loss', 'perplexity']
    """

    def __init__(self, head=None, head_name=None, name="head_loss",
                 reduction="sum_over_batch_size", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        if head is not None:
            if not isinstance(head, SoftmaxHead):
                raise ValueError(
                    "`head` must be a keras_softmax_heads head (a SoftmaxHead). "
                    f"Received: head={head!r}"
                )
            head.training_output = "contexts"
            _BOUND_HEADS.add(head)
            head_name = head.name
        elif head_name is None:
            raise ValueError(
                "HeadLoss needs the model's output head: HeadLoss(head). "
                "Received: head=None"
            )
        self.head = head
        self.head_name = head_name

    @classmethod
    def from_config(cls, config):
        loss = cls(**config)
        loss._resolve_head(required=False)  # the head loaded just before
        return loss

    def _resolve_head(self, required=True):
        if self.head is None:
            free = [h for h in context_output_heads(self.head_name) if h not in _BOUND_HEADS]
            if not free:
                if not required:
                    return None
                raise ValueError(
                    f"This HeadLoss (restored from a saved model) could not "
                    f"find its head {self.head_name!r} among the loaded heads. "
                    "Compile again with `loss=keras_softmax_heads.HeadLoss(head)`."
                )
            self.head = free[-1]
            _BOUND_HEADS.add(self.head)
        return self.head

    def __call__(self, y_true, y_pred, sample_weight=None):
        head = self._resolve_head()
        if (
            not head.gradient_in_forward
            or head.last_output != "contexts"
            or self.reduction not in SUMMED_REDUCTIONS
            or head.last_output_masked
        ):
            return super().__call__(y_true, y_pred, sample_weight=sample_weight)
        # The head's summed objective (its gradient computed in the forward
        # pass) with the weights Keras' reduction gives each token.
        h, targets = contexts_and_targets(y_true, y_pred)
        weight = token_weights(targets, sample_weight)
        if self.reduction == "mean_with_sample_weight" and sample_weight is not None:
            weight = ops.divide_no_nan(weight, ops.sum(weight))
        elif self.reduction != "sum":
            weight = weight / ops.cast(ops.size(targets), "float32")
        loss = head.summed_training_loss(h, targets, weight, training=True)
        if self.reduction != "sum":
            loss = per_replica(loss)
        return ops.cast(loss, self.dtype)

    def call(self, y_true, y_pred):
        head = self._resolve_head()
        if head.last_output == "contexts":
            h, targets = contexts_and_targets(y_true, y_pred)
            return head.training_loss(h, targets, training=True)
        targets = ops.convert_to_tensor(y_true)
        if len(targets.shape) == len(y_pred.shape):
            targets = ops.squeeze(targets, axis=-1)
        log_p = ops.log(y_pred) if head.return_probabilities else y_pred
        return -nll_terms(log_p, targets)

    def get_config(self):
        config = super().get_config()
        config["head_name"] = self.head_name
        return config


def contexts_and_targets(y_true, y_pred):
    """`(h, targets)` of a head's training output `h[..., None, :]` and its
    targets (`[...]` or `[..., 1]`)."""
    targets = ops.convert_to_tensor(y_true)
    h = ops.squeeze(y_pred, axis=-2)
    if len(targets.shape) == len(h.shape):  # targets [..., 1]
        targets = ops.squeeze(targets, axis=-1)
    return h, targets


def nll_terms(log_probs, targets):
    """`log_probs[..., targets]` (`[..., V]`, `[...]` -> `[...]`), float32.

    The targets are checked as a head's are (`validation.check_targets`): an
    id outside `[0, V)` raises eagerly and in a TensorFlow graph, and gives
    NaN under XLA, never a plausible number."""
    vocab_size = log_probs.shape[-1]
    targets = check_targets(targets, vocab_size)
    picked = gather_targets(ops.cast(log_probs, "float32"), targets)
    return nan_if_invalid(picked, targets, vocab_size)
