"""`WordMajorSoftmaxHead`: a pointwise head whose output matrix is `[V, d]`.

The base of the heads whose training loss touches only a few rows of the
output matrix (`SampledSoftmax`, `NCE`, `SelfNormalizedSoftmax`). Why the
layout: `docs/head_contract.md`, "Weight layout".
"""

import keras
from keras import ops

from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class WordMajorSoftmaxHead(PointwiseSoftmaxHead):
    """A pointwise head whose output matrix is stored word-major, `[V, d]`.

    `z = h W^T + b` with `W` the layer's `kernel` `[V, d]` (or the tied
    `token_embedding`'s `[V, d]` matrix, the same code path). Scoring `S`
    candidate words is then a row gather with a sparse gradient
    (`tf.IndexedSlices`, `[S, d]`), where a `[d, V]` kernel would get a
    dense `[d, V]` gradient every step. Subclasses add a training objective
    that scores only some words (`target_scores`, `candidate_scores`); on
    its own the class is a Linear-Softmax with the word-major layout (to
    move its weights to a `FullSoftmax`, transpose the kernel).
    `output_kernel()` still returns the `[d, V]` view.

    Args:
        *args, **kwargs: the `PointwiseSoftmaxHead` arguments.

    Returns:
        float32 log-probabilities `[..., V]`.

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.word_major_softmax_head import WordMajorSoftmaxHead
    >>> head = WordMajorSoftmaxHead(vocab_size=6)
    >>> h = np.ones((3, 4), "float32")
    >>> tuple(head(h).shape), tuple(head.kernel.shape)
    ((3, 6), (6, 4))
    >>> tuple(head.candidate_scores(h, np.array([0, 5])).shape)
    (3, 2)
    """

    word_major = True

    def target_scores(self, h, targets):
        """`z_{i, t_i}` for flat `h` `[N, d]` and targets `[N]`: float32 `[N]`.

        Gathers `N` rows of `W` (sparse gradient); the dot products are
        accumulated in float32 even under mixed precision.
        """
        acc = self.accumulation_dtype
        ids = ops.clip(targets, 0, self.vocab_size - 1)
        rows = ops.take(self.output_embeddings(), ids, axis=0)
        rows = ops.cast(ops.cast(rows, self.compute_dtype), acc)
        h = ops.cast(ops.cast(h, self.compute_dtype), acc)
        z = ops.sum(h * rows, axis=-1)
        if self.bias is not None:
            z = z + ops.cast(ops.take(self.bias, ids, axis=0), acc)
        return z

    def candidate_scores(self, h, ids):
        """`z_{i, s_j}` for flat `h` `[N, d]` and shared ids `[S]`: `[N, S]`."""
        ids = ops.clip(ids, 0, self.vocab_size - 1)
        acc = self.accumulation_dtype
        rows = ops.take(self.output_embeddings(), ids, axis=0)
        rows = ops.cast(rows, self.compute_dtype)
        z = ops.matmul(ops.cast(h, self.compute_dtype), ops.transpose(rows))
        z = ops.cast(z, acc)
        if self.bias is not None:
            z = z + ops.cast(ops.take(self.bias, ids, axis=0), acc)[None, :]
        return z

    def full_scores(self, h):
        """`z` for flat `h` `[N, d]`: `[N, V]`."""
        return self.logits(h)

    # --------------------------------------------------------------- helpers
    def _flatten(self, inputs, targets):
        """Checks and flattens `inputs` `[..., d]`, `targets` `[...]`.

        Returns `(h [N, d], targets [N] int32 validated, targets_shape)`.
        """
        inputs = self._check_inputs(inputs)
        targets = check_targets(targets, self.vocab_size)
        lead = tuple(inputs.shape[:-1])
        tshape = tuple(targets.shape)
        if len(lead) != len(tshape) or any(
            a is not None and b is not None and a != b for a, b in zip(lead, tshape)
        ):
            raise ValueError(
                "`targets` must have the leading shape of `inputs`. Received: "
                f"inputs.shape={tuple(inputs.shape)}, targets.shape={tshape}"
            )
        h = ops.reshape(inputs, (-1, self.input_dim))
        return h, ops.reshape(targets, (-1,)), ops.shape(targets)

    def _finish(self, loss, targets, shape):
        """Reshapes a flat per-token loss and turns invalid targets into NaN."""
        loss = nan_if_invalid(loss, targets, self.vocab_size)
        return ops.reshape(loss, shape)
