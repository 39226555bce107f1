"""`MixtureOfContexts`: see `keras_softmax_heads.heads.mixture_head` for the shared
parameterisation."""


import keras
from keras import ops

from keras_softmax_heads.chunked import chunked_pointwise_nll
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.heads.head_utils import gather_targets
from keras_softmax_heads.validation import nan_if_invalid
from keras_softmax_heads.heads.mixture_head import MixtureHead


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class MixtureOfContexts(MixtureHead):
    """Mixture of Contexts (MoC): the low-rank baseline of Yang et al. (2018).

    Same priors and latent context vectors as `MixtureOfSoftmaxes`,

    `pi = softmax(h W_pi + b_pi)`, `c_k = tanh(h W_k + b_k)`,

    but the *contexts* are mixed before a single softmax (Yang et al. 2018,
    section 2.3):

    `h' = sum_k pi_k c_k`, `log p(w | h) = log_softmax(h' W + b)_w`.

    This is a Linear-Softmax applied to a non-linear function of `h`, so its
    matrix of log-probabilities over many contexts has rank at most
    `latent_dim + 2`, like Linear-Softmax: it does not break the softmax
    bottleneck (it is the control experiment showing that MoS's gain comes
    from mixing probabilities). Cost: `O(N K latent_dim)` for the mixture
    plus one `[N, V]` softmax; nothing of size `[N, K, V]` is formed.

    Args:
        vocab_size: int, number of words `V` (or omit and pass
            `token_embedding`).
        num_components: int `K >= 1`, number of mixed context vectors.
        latent_dim: int, dimension of the latent context vectors; `None`
            (default) uses the input dimension `d`. With a tied
            `token_embedding` it must equal the embedding's `output_dim`.
        latent_dropout: float in `[0, 1)`, dropout rate on the latent context
            vectors `c_k`, active only in training.
        token_embedding: optional `keras.layers.Embedding` `[V, latent_dim]`
            to tie the output projection to.
        use_bias: bool, add a per-word output bias (default `True`).
        kernel_initializer, bias_initializer: initializers of the output
            projection and bias.
        prior_initializer: initializer of the prior kernel `[d, K]`.
        latent_initializer: initializer of the latent kernel
            `[d, K * latent_dim]`; the default `"identity"` starts every
            component at the identity plus a Glorot-uniform draw (as
            `MixtureOfSoftmaxes`).
        counts: optional `[V]` training word counts: the default
            `bias_initializer="unigram"` starts the output bias at their log
            unigram (at zero without them).
        seed: optional int, seed of the latent dropout.
        chunk_size: optional int >= 1. If set, `log_likelihood` and
            `training_loss` compute the exact NLL in vocabulary tiles of this
            width (`chunked_pointwise_nll` on the mixed context) without the
            `[N, V]` scores; `None` (default) uses the dense path.
        return_probabilities: bool, `call` returns probabilities instead of
            log-probabilities.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.
        training: bool, enables the latent dropout.

    Returns:
        float32 log-probabilities `[..., V]` (`logsumexp` over the last axis
        is 0).

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.mixture_of_contexts import MixtureOfContexts
    >>> head = MixtureOfContexts(vocab_size=7, num_components=3)
    >>> log_p = head(np.random.rand(2, 5, 4).astype("float32"))
    >>> tuple(log_p.shape)
    (2, 5, 7)
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True

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
        """Exact `log p(targets | inputs)`, float32 of shape `targets.shape`."""
        targets = check_targets(targets, self.vocab_size)
        if self.chunk_size is not None:
            inputs = self._check_inputs(inputs)
            kernel, transposed = self._chunk_kernel()
            nll = chunked_pointwise_nll(
                self._mixed_context(inputs, training),
                kernel,
                self.bias,
                targets,
                chunk_size=self.chunk_size,
                kernel_transposed=transposed,
            )
            return nan_if_invalid(-nll, targets, self.vocab_size)
        ll = gather_targets(self.log_probs(inputs, training=training), targets)
        return nan_if_invalid(ll, targets, self.vocab_size)
