"""`MixtureOfContexts`: the low-rank mixture baseline of Yang et al. (2018)."""


import keras
from keras import ops

from keras_softmax_heads.chunked import chunked_pointwise_nll
from keras_softmax_heads.chunked.divergence import OutputLayer
from keras_softmax_heads.chunked.losses import as_tensor
from keras_softmax_heads.chunked.vocab_parallel import tile_sized_token_chunk
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_layout
from keras_softmax_heads.heads.head_utils import gather_targets
from keras_softmax_heads.heads.head_utils import linear_nll_on_shards
from keras_softmax_heads.heads.head_utils import summed_linear_cross_entropy
from keras_softmax_heads.heads.mixture_head import MixtureHead
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class MixtureOfContexts(MixtureHead):
    """Mixture of Contexts (MoC): the low-rank baseline of Yang et al. (2018).

    The priors and latent context vectors of `MixtureOfSoftmaxes`, mixed
    before a single softmax (Yang et al. 2018, section 2.3):

    `h' = sum_k pi_k c_k`, `log p(w | h) = log_softmax(h' W + b)_w`.

    A Linear-Softmax on a non-linear function of `h`: its log-probability
    matrix has rank at most `latent_dim + 2`, so it does not break the
    softmax bottleneck (the control experiment for MoS). Nothing of size
    `[N, K, V]` is formed.

    Args:
        vocab_size, num_components, latent_dim, latent_dropout,
        token_embedding, use_bias, kernel_initializer, bias_initializer,
        prior_initializer, latent_initializer, use_latent_bias,
        use_prior_bias, counts,
        seed, return_probabilities: as in `MixtureOfSoftmaxes`.
        chunk_size: optional int >= 1, the maximum vocabulary tile width of
            the exact tiled NLL of `log_likelihood` and `training_loss`
            (`chunked_pointwise_nll` of the mixed context, never the
            `[N, V]` scores); `None` (default): the platform's width
            (`chunked.platform.chunk_size_for`).

    Call arguments:
        inputs: float context vectors `[..., d]`.
        training: bool, enables the latent dropout.

    Returns:
        float32 `log_softmax(h' W + b)`, shape `[..., V]`.

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.mixture_of_contexts import MixtureOfContexts
    >>> head = MixtureOfContexts(vocab_size=7, num_components=3, latent_dim=2)
    >>> h = np.random.rand(10, 4).astype("float32")
    >>> tuple(head(h).shape), tuple(head.logits(h).shape)  # one score vector
    ((10, 7), (10, 7))
    >>> tuple(head.training_loss(h, np.arange(10) % 7).shape)
    (10,)

    References:
        - Breaking the softmax bottleneck (section 2.3, Mixture of Contexts):
          Yang et al., 2018. https://arxiv.org/abs/1711.03953
    """

    def _mixed_context(self, inputs, training):
        """`h' = sum_k pi_k c_k`, `[N, L]` in the compute dtype."""
        log_priors, latent = self._priors_and_latents(inputs, training)
        acc = self.accumulation_dtype
        mixed = ops.einsum("nk,nkl->nl", ops.exp(log_priors), ops.cast(latent, acc))
        return ops.cast(mixed, self.compute_dtype)

    def logits(self, inputs, training=None):
        """Scores of the mixed context, `z = h' W + b`, float32 `[..., V]`."""
        inputs = self._check_inputs(inputs)
        z = self._project(self._mixed_context(inputs, training))
        return ops.reshape(z, self._output_shape_of(inputs))

    def log_probs(self, inputs, training=None):
        """Exact log-probabilities `log_softmax(h' W + b)`, float32 `[..., V]`."""
        return ops.log_softmax(self.logits(inputs, training=training), axis=-1)

    def log_likelihood(self, inputs, targets, training=None):
        """Exact `log p(targets | inputs)`, float32 of shape `targets.shape`.

        Computed in vocabulary tiles of the mixed context
        (`chunked_pointwise_nll`), never holding the `[N, V]` scores; the
        tile width is `chunk_size`, or with `chunk_size=None` the
        platform's choice (`chunked.platform.chunk_size_for`). On JAX, with
        the kernel (or tied embedding) sharded on V by a
        `keras.distribution`, each device scores its own shard
        (`chunked.vocab_parallel.vocab_parallel_summed` with its per-token
        losses), in as many token chunks as the tiled pass has tiles.
        """
        targets = check_targets(targets, self.vocab_size)
        inputs = self._check_inputs(inputs)
        kernel, transposed = self.chunked_projection()
        mixed = self._mixed_context(inputs, training)
        layout = vocab_parallel_layout(kernel, transposed)
        if layout is not None:  # JAX, the kernel sharded on V: each device its shard
            nll = linear_nll_on_shards(
                mixed, kernel, self.bias, transposed, layout, targets, self.vocab_size,
                tile_sized_token_chunk(mixed.shape[0], self.vocab_size, self.chunk_size))
        else:
            nll = chunked_pointwise_nll(
                mixed,
                kernel,
                self.bias,
                targets,
                chunk_size=self.chunk_size,
                kernel_transposed=transposed,
            )
        return nan_if_invalid(-nll, targets, self.vocab_size)

    def summed_training_loss(self, inputs, targets, weights, training=True):
        """`sum_i weights_i (-log p(targets_i | inputs_i))`, a float32 scalar.

        With `gradient_in_forward=True` the summed cross-entropy of the
        mixed context `h'` computes it and its gradient in one pass over
        token chunks (`chunked.summed_cross_entropy`; on JAX, with the
        kernel or tied embedding sharded on V by a `keras.distribution`, on
        each device's shard: `chunked.vocab_parallel.
        vocab_parallel_summed`); the gradient reaches the priors and
        latents through `h'`. Otherwise `training_loss` weighted and
        summed. A weight-0 token adds nothing; a word id outside `[0, V)`
        with a non-zero weight makes the sum NaN.
        """
        if not self.gradient_in_forward:
            return super().summed_training_loss(inputs, targets, weights, training)
        inputs = self._check_inputs(inputs)
        targets = check_targets(targets, self.vocab_size)
        kernel, transposed = self.chunked_projection()
        bias = None if self.bias is None else as_tensor(self.bias)
        layer = OutputLayer(self._mixed_context(inputs, training), as_tensor(kernel), bias,
                            transposed)
        return summed_linear_cross_entropy(layer, kernel, targets, weights, self.vocab_size)

    def dense_log_likelihood(self, inputs, targets, training=None):
        """`log_likelihood` from the `[N, V]` log-probabilities (the
        reference of the tiled path)."""
        targets = check_targets(targets, self.vocab_size)
        ll = gather_targets(self.log_probs(inputs, training=training), targets)
        return nan_if_invalid(ll, targets, self.vocab_size)
