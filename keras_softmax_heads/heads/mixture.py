"""Mixture heads: Mixture of Softmaxes (and its MoSS / MoS+PLIF variants) and
the low-rank Mixture of Contexts baseline.

Both heads share the parameterisation of Yang et al. (2018): from the context
vector `h` `[..., d]` they compute `K` mixture priors
`pi_k = softmax(h W_pi + b_pi)_k` and `K` latent context vectors
`c_k = tanh(h W_k + b_k)` of dimension `latent_dim`, which are scored against
the shared output projection (`kernel` `[latent_dim, V]`, or a tied
`token_embedding` `[V, latent_dim]`) and bias. They differ in where the
mixture happens:

* `MixtureOfSoftmaxes` mixes *probabilities*:
  `p = sum_k pi_k softmax(c_k W + b)`, computed in log space as
  `log p = logsumexp_k(log pi_k + log_softmax(c_k W + b))`. Its matrix of
  log-probabilities is not limited to rank `d + 2` (it breaks the softmax
  bottleneck).
* `MixtureOfContexts` mixes the *context vectors* first,
  `h' = sum_k pi_k c_k`, then applies one softmax: `softmax(h' W + b)`. It is
  a Linear-Softmax on a non-linear function of `h` and stays low rank
  (`<= latent_dim + 2`).
"""

import keras
from keras import ops

from keras_softmax_heads import functional
from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.chunked import chunked_mixture_nll
from keras_softmax_heads.chunked import chunked_pointwise_nll
from keras_softmax_heads.heads.base import SoftmaxHead
from keras_softmax_heads.heads.head_utils import check_targets
from keras_softmax_heads.heads.head_utils import gather_targets
from keras_softmax_heads.heads.head_utils import nan_if_invalid
from keras_softmax_heads.heads.head_utils import set_context_dim

_COMPONENTS = ("softmax", "sigsoftmax")


def _is_int(value):
    return hasattr(value, "__index__") and not isinstance(value, bool)


class _MixtureHead(SoftmaxHead):
    """Shared machinery of the mixture heads: priors, latents, dropout.

    Not a public head; see `MixtureOfSoftmaxes` and `MixtureOfContexts`.
    """

    def __init__(
        self,
        vocab_size=None,
        num_components=4,
        latent_dim=None,
        latent_dropout=0.0,
        token_embedding=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        prior_initializer="glorot_uniform",
        latent_initializer="glorot_uniform",
        seed=None,
        chunk_size=None,
        return_probabilities=False,
        **kwargs,
    ):
        super().__init__(
            vocab_size=vocab_size,
            token_embedding=token_embedding,
            use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            return_probabilities=return_probabilities,
            **kwargs,
        )
        if not _is_int(num_components) or num_components < 1:
            raise ValueError(
                "`num_components` must be an integer >= 1. "
                f"Received: num_components={num_components!r}"
            )
        if latent_dim is not None and (not _is_int(latent_dim) or latent_dim < 1):
            raise ValueError(
                "`latent_dim` must be None (use the input dimension) or an "
                f"integer >= 1. Received: latent_dim={latent_dim!r}"
            )
        if (
            isinstance(latent_dropout, bool)
            or not isinstance(latent_dropout, (int, float))
            or not 0.0 <= latent_dropout < 1.0
        ):
            raise ValueError(
                "`latent_dropout` must be a float in [0, 1). "
                f"Received: latent_dropout={latent_dropout!r}"
            )
        if (
            latent_dim is not None
            and token_embedding is not None
            and token_embedding.output_dim != latent_dim
        ):
            raise ValueError(
                "With a tied `token_embedding`, `latent_dim` must equal its "
                f"output_dim={token_embedding.output_dim} (the latent context "
                "vectors are scored against the embedding rows). Received: "
                f"latent_dim={latent_dim}"
            )
        self.chunk_size = check_chunk_size(chunk_size, default=None)
        self.num_components = int(num_components)
        self.latent_dim = None if latent_dim is None else int(latent_dim)
        self.latent_dropout = float(latent_dropout)
        self.prior_initializer = keras.initializers.get(prior_initializer)
        self.latent_initializer = keras.initializers.get(latent_initializer)
        self.seed = seed
        self.seed_generator = None
        if self.latent_dropout > 0.0:
            self.seed_generator = keras.random.SeedGenerator(seed)

    # ------------------------------------------------------------------ build
    def build(self, input_shape):
        set_context_dim(self, input_shape)
        latent_dim = self.latent_dim if self.latent_dim is not None else self.input_dim
        self.latent_units = latent_dim
        self.kernel = None
        if self.token_embedding is not None:
            emb_dim = self.token_embedding.output_dim
            if emb_dim != latent_dim:
                raise ValueError(
                    f"The tied `token_embedding` has output_dim={emb_dim} but "
                    f"the latent context vectors have dimension {latent_dim} "
                    f"(`latent_dim={self.latent_dim}`; None means the input "
                    f"dimension {self.input_dim}). Pass latent_dim={emb_dim}. "
                    f"Received: input_shape={input_shape}"
                )
            if not self.token_embedding.built:
                self.token_embedding.build((None,))
        else:
            self.kernel = self.add_weight(
                name="kernel",
                shape=(latent_dim, self.vocab_size),
                initializer=self.kernel_initializer,
            )
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias",
                shape=(self.vocab_size,),
                initializer=self.bias_initializer,
                autocast=False,  # read in float32 under mixed precision
            )
        k = self.num_components
        self.prior_kernel = self.add_weight(
            name="prior_kernel",
            shape=(self.input_dim, k),
            initializer=self.prior_initializer,
        )
        self.prior_bias = self.add_weight(
            name="prior_bias", shape=(k,), initializer="zeros"
        )
        self.latent_kernel = self.add_weight(
            name="latent_kernel",
            shape=(self.input_dim, k * latent_dim),
            initializer=self.latent_initializer,
        )
        self.latent_bias = self.add_weight(
            name="latent_bias", shape=(k * latent_dim,), initializer="zeros"
        )
        self.build_head(input_shape)

    # ---------------------------------------------------------------- helpers
    def _prior_log_normaliser(self, prior_logits):
        """`log pi` from the `[N, K]` prior logits (float32)."""
        return ops.log_softmax(prior_logits, axis=-1)

    def _priors_and_latents(self, inputs, training):
        """Flattened `log pi` `[N, K]` (float32) and latents `[N, K, L]`.

        The latents are in the compute dtype, with dropout applied when
        `training` and `latent_dropout > 0`.
        """
        x = ops.cast(inputs, self.compute_dtype)
        x = ops.reshape(x, (-1, self.input_dim))
        acc = self.accumulation_dtype
        prior_logits = ops.cast(
            ops.matmul(x, ops.cast(self.prior_kernel, self.compute_dtype)), acc
        ) + ops.cast(self.prior_bias, acc)
        log_priors = self._prior_log_normaliser(prior_logits)
        latent = ops.tanh(
            ops.matmul(x, ops.cast(self.latent_kernel, self.compute_dtype))
            + ops.cast(self.latent_bias, self.compute_dtype)
        )
        latent = ops.reshape(latent, (-1, self.num_components, self.latent_units))
        if training and self.seed_generator is not None:
            latent = keras.random.dropout(
                latent, self.latent_dropout, seed=self.seed_generator
            )
        return log_priors, latent

    def _project(self, latent):
        """`latent W + b` in float32: `[..., L]` -> `[..., V]`."""
        z = ops.cast(ops.matmul(latent, self.output_kernel()), self.accumulation_dtype)
        if self.bias is not None:
            z = z + ops.cast(self.bias, self.accumulation_dtype)
        return z

    def _chunk_kernel(self):
        """The output projection for the chunked loss, never transposed."""
        if self.token_embedding is not None:
            return self.token_embedding.embeddings, True
        return self.kernel, False

    def _output_shape_of(self, inputs):
        return tuple(ops.shape(inputs)[:-1]) + (self.vocab_size,)

    # --------------------------------------------------------------- contract
    def call(self, inputs, training=None):
        if training:
            contexts = self.training_contexts(inputs)
            if contexts is not None:
                return contexts
        self.last_output = "log_probs"
        log_p = self.log_probs(inputs, training=training)
        if self.return_probabilities:
            return ops.exp(log_p)
        return log_p

    def training_loss(self, inputs, targets, training=True):
        """`-log p(targets | inputs)`, with latent dropout when `training`."""
        return -self.log_likelihood(inputs, targets, training=training)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_components": self.num_components,
                "latent_dim": self.latent_dim,
                "latent_dropout": self.latent_dropout,
                "prior_initializer": keras.initializers.serialize(
                    self.prior_initializer
                ),
                "latent_initializer": keras.initializers.serialize(
                    self.latent_initializer
                ),
                "seed": self.seed,
                "chunk_size": self.chunk_size,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class MixtureOfSoftmaxes(_MixtureHead):
    """Mixture of Softmaxes (MoS) output head, with MoSS and MoS+PLIF variants.

    From the context vector `h` (dimension `d`) the head computes `K` priors
    and `K` latent context vectors (Yang et al., 2018)

    `pi = softmax(h W_pi + b_pi)`, `c_k = tanh(h W_k + b_k)`,

    scores every latent against the shared output projection,
    `z_k = c_k W + b` (`W` is the owned `kernel` `[latent_dim, V]` or the
    transposed tied `token_embedding`), and mixes the `K` distributions:

    `p(w | h) = sum_k pi_k softmax(g(z_k))_w`,

    evaluated in log space as
    `log p = logsumexp_k(log pi_k + log_softmax(g(z_k)))` (never the log of a
    sum of probabilities), all in float32. `g` is the identity for MoS.

    * `component="sigsoftmax"` gives the mixture of sigsoftmax (MoSS, Kanai
      et al. 2018, eq. 19): the components *and the priors* are sigsoftmax,
      `sigsoftmax(a)_i = exp(a_i) sigmoid(a_i) / sum_j exp(a_j) sigmoid(a_j)`.
    * `num_knots=n` gives MoS + PLIF (Ganea et al. 2019, Table 1): one
      piecewise linear increasing function `g` with `n` intervals on
      `[-knot_bound, knot_bound]`, shared by all components, is applied to
      the component scores before their softmax. It is initialised to the
      identity, so an untrained MoS+PLIF equals MoS.

    The log-probability matrix of a mixture is not limited to rank `d + 2`
    as Linear-Softmax is (it breaks the "softmax bottleneck").

    Memory: the dense path materialises the `[N, K, V]` component scores
    (`N` = number of context vectors): `K` times the memory and matmul cost
    of a Linear-Softmax, and the backward pass keeps tensors of that size
    too. This is inherent to `call` / `log_probs`, which return the mixture
    over all `V` words. The dense `log_likelihood` (hence `training_loss` and
    `HeadModel.evaluate`) avoids the extra `[N, K, V]` log-softmax and the
    `[N, V]` mixture (it gathers the target score of each component and uses
    each component's log-sum-exp over `V`) but still computes the
    `[N, K, V]` scores. With `chunk_size` set, `log_likelihood` and
    `training_loss` use `keras_softmax_heads.chunked.chunked_mixture_nll`
    instead: tiles of `[N * K, chunk_size]` scores, never the `[N, K, V]`
    tensor, at the price of recomputing the tiles in the backward pass.

    Args:
        vocab_size: int, number of words `V` (or omit and pass
            `token_embedding`).
        num_components: int `K >= 1`, number of mixture components
            (Yang et al. use 15 on PTB; `K = 1` is a Linear-Softmax on
            `tanh(h W_1 + b_1)`).
        latent_dim: int, dimension of the latent context vectors `c_k`, which
            is also the input dimension of the output projection. `None`
            (default) uses the input dimension `d`. With a tied
            `token_embedding` it must equal the embedding's `output_dim`.
        latent_dropout: float in `[0, 1)`, dropout rate on the latent context
            vectors, active only in training (`call(..., training=True)`,
            `training_loss(..., training=True)`, `fit`).
        component: `"softmax"` (MoS) or `"sigsoftmax"` (MoSS: sigsoftmax
            components and priors).
        num_knots: `None` (no PLIF) or int `>= 1`, the number of PLIF
            intervals (MoS + PLIF).
        knot_bound: float `T > 0`, the PLIF knots cover `[-T, T]`; outside,
            the first and last pieces extend linearly.
        token_embedding: optional `keras.layers.Embedding` `[V, latent_dim]`
            to tie the output projection to.
        use_bias: bool, add a per-word output bias (default `True`).
        kernel_initializer, bias_initializer: initializers of the output
            projection and bias.
        prior_initializer: initializer of the prior kernel `[d, K]` (its bias
            starts at zero).
        latent_initializer: initializer of the latent kernel
            `[d, K * latent_dim]` (its bias starts at zero).
        seed: optional int, seed of the latent dropout.
        chunk_size: optional int >= 1. If set, `log_likelihood` and
            `training_loss` compute the exact NLL in vocabulary tiles of this
            width (`chunked_mixture_nll`) without the `[N, K, V]` scores;
            `None` (default) uses the dense path.
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
    >>> from keras_softmax_heads.heads.mixture import MixtureOfSoftmaxes
    >>> head = MixtureOfSoftmaxes(vocab_size=7, num_components=3)
    >>> log_p = head(np.random.rand(2, 5, 4).astype("float32"))
    >>> tuple(log_p.shape)
    (2, 5, 7)
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True
    >>> moss = MixtureOfSoftmaxes(7, num_components=3, component="sigsoftmax")
    >>> plif = MixtureOfSoftmaxes(7, num_components=3, num_knots=100)
    >>> tuple(plif(np.zeros((2, 4), "float32")).shape)
    (2, 7)

    Exact training loss in vocabulary tiles, without the `[N, K, V]` scores:

    >>> tiled = MixtureOfSoftmaxes(7, num_components=3, chunk_size=3)
    >>> h, y = np.zeros((2, 5, 4), "float32"), np.ones((2, 5), "int32")
    >>> tuple(tiled.training_loss(h, y).shape)
    (2, 5)

    References:
        - Breaking the softmax bottleneck: Yang et al., 2018.
          https://arxiv.org/abs/1711.03953
        - Sigsoftmax (mixture of sigsoftmax, eq. 19): Kanai et al., 2018.
          https://arxiv.org/abs/1805.10829
        - Breaking the softmax bottleneck via learnable monotonic pointwise
          non-linearities (MoS + PLIF): Ganea et al., 2019.
          https://arxiv.org/abs/1902.08077
    """

    def __init__(
        self,
        vocab_size=None,
        num_components=4,
        latent_dim=None,
        latent_dropout=0.0,
        component="softmax",
        num_knots=None,
        knot_bound=10.0,
        token_embedding=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        prior_initializer="glorot_uniform",
        latent_initializer="glorot_uniform",
        seed=None,
        chunk_size=None,
        return_probabilities=False,
        **kwargs,
    ):
        super().__init__(
            vocab_size=vocab_size,
            num_components=num_components,
            latent_dim=latent_dim,
            latent_dropout=latent_dropout,
            token_embedding=token_embedding,
            use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            prior_initializer=prior_initializer,
            latent_initializer=latent_initializer,
            seed=seed,
            chunk_size=chunk_size,
            return_probabilities=return_probabilities,
            **kwargs,
        )
        if component not in _COMPONENTS:
            raise ValueError(
                f"`component` must be one of {_COMPONENTS}. "
                f"Received: component={component!r}"
            )
        if num_knots is not None and (not _is_int(num_knots) or num_knots < 1):
            raise ValueError(
                "`num_knots` must be None (no PLIF) or an integer >= 1. "
                f"Received: num_knots={num_knots!r}"
            )
        if (
            isinstance(knot_bound, bool)
            or not isinstance(knot_bound, (int, float))
            or not knot_bound > 0
        ):
            raise ValueError(
                "`knot_bound` must be a number > 0. "
                f"Received: knot_bound={knot_bound!r}"
            )
        self.component = component
        self.num_knots = None if num_knots is None else int(num_knots)
        self.knot_bound = float(knot_bound)

    def build_head(self, input_shape):
        self.raw_slopes = None
        if self.num_knots is not None:
            self.raw_slopes = self.add_weight(
                name="raw_slopes",
                shape=(self.num_knots,),
                initializer=keras.initializers.Constant(
                    functional.plif_identity_raw_slope()
                ),
            )

    def _prior_log_normaliser(self, prior_logits):
        if self.component == "sigsoftmax":
            return functional.log_sigsoftmax(prior_logits, axis=-1)
        return ops.log_softmax(prior_logits, axis=-1)

    def _component_scores(self, latent):
        """Unnormalised component log-scores `[N, K, V]`, float32.

        `g(z_k)` for `log_softmax`: `z_k`, PLIF(`z_k`), and for sigsoftmax the
        additional `log sigmoid` term (`log_sigsoftmax(z) = log_softmax(z -
        softplus(-z))`).
        """
        z = self._project(latent)
        if self.raw_slopes is not None:
            slopes = ops.cast(self.raw_slopes, self.accumulation_dtype)
            z = functional.plif(z, slopes, self.knot_bound)
        if self.component == "sigsoftmax":
            z = functional.log_sigmoid_scores(z)
        return z

    def _chunk_transform(self):
        """`(transform_fn, params)`: the component transform, chunked loss."""
        sig = self.component == "sigsoftmax"
        if self.raw_slopes is None:
            return (functional.log_sigmoid_scores if sig else None), []
        bound = self.knot_bound

        def transform(z, raw_slopes):
            z = functional.plif(z, ops.cast(raw_slopes, z.dtype), bound)
            return functional.log_sigmoid_scores(z) if sig else z

        return transform, [self.raw_slopes]

    def logits(self, inputs, training=None):
        """Component scores `z_k = c_k W + b`, float32 `[..., K, V]`.

        These are the linear scores of the `K` components (before PLIF and
        the sigsoftmax term), not a `[..., V]` tensor like other heads'
        `logits`: a mixture has no single score vector.
        """
        inputs = self._check_inputs(inputs)
        _, latent = self._priors_and_latents(inputs, training)
        z = self._project(latent)
        return ops.reshape(
            z, tuple(ops.shape(inputs)[:-1]) + (self.num_components, self.vocab_size)
        )

    def component_log_probs(self, inputs, training=None):
        """`log pi_k` `[..., K]` and component log-probabilities `[..., K, V]`."""
        inputs = self._check_inputs(inputs)
        log_priors, latent = self._priors_and_latents(inputs, training)
        comp = ops.log_softmax(self._component_scores(latent), axis=-1)
        lead = tuple(ops.shape(inputs)[:-1])
        return (
            ops.reshape(log_priors, lead + (self.num_components,)),
            ops.reshape(comp, lead + (self.num_components, self.vocab_size)),
        )

    def log_probs(self, inputs, training=None):
        """Exact mixture log-probabilities, float32 `[..., V]`."""
        inputs = self._check_inputs(inputs)
        log_priors, latent = self._priors_and_latents(inputs, training)
        comp = ops.log_softmax(self._component_scores(latent), axis=-1)
        log_p = ops.logsumexp(ops.expand_dims(log_priors, -1) + comp, axis=1)
        return ops.reshape(log_p, self._output_shape_of(inputs))

    def log_likelihood(self, inputs, targets, training=None):
        """Exact `log p(targets | inputs)`, float32 of shape `targets.shape`.

        Gathers the target's score in each component and subtracts that
        component's log-sum-exp over the vocabulary, so neither the
        `[N, K, V]` log-softmax nor the `[N, V]` mixture is formed.
        """
        inputs = self._check_inputs(inputs)
        targets = check_targets(targets, self.vocab_size)
        log_priors, latent = self._priors_and_latents(inputs, training)
        if self.chunk_size is not None:
            kernel, transposed = self._chunk_kernel()
            transform, params = self._chunk_transform()
            nll = chunked_mixture_nll(
                latent,
                log_priors,
                kernel,
                self.bias,
                targets,
                transform_fn=transform,
                transform_params=params,
                chunk_size=self.chunk_size,
                kernel_transposed=transposed,
            )
            return nan_if_invalid(-nll, targets, self.vocab_size)
        scores = self._component_scores(latent)  # [N, K, V]
        lse = ops.logsumexp(scores, axis=-1)  # [N, K]
        flat_t = ops.clip(ops.reshape(targets, (-1, 1, 1)), 0, self.vocab_size - 1)
        idx = ops.broadcast_to(
            flat_t, (ops.shape(scores)[0], self.num_components, 1)
        )
        target_scores = ops.squeeze(ops.take_along_axis(scores, idx, axis=-1), -1)
        ll = ops.logsumexp(log_priors + target_scores - lse, axis=-1)  # [N]
        ll = ops.reshape(ll, ops.shape(targets))
        return nan_if_invalid(ll, targets, self.vocab_size)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "component": self.component,
                "num_knots": self.num_knots,
                "knot_bound": self.knot_bound,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class MixtureOfContexts(_MixtureHead):
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
            `[d, K * latent_dim]`.
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
    >>> from keras_softmax_heads.heads.mixture import MixtureOfContexts
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
