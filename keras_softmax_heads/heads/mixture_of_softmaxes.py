"""`MixtureOfSoftmaxes`: Mixture of Softmaxes (MoS), MoSS and MoS+PLIF."""


import keras
import numpy as np
from keras import ops

from keras_softmax_heads import functional
from keras_softmax_heads.chunked import chunked_mixture_nll
from keras_softmax_heads.chunked.vocab_parallel import summed_mixture_nll_auto
from keras_softmax_heads.chunked.vocab_parallel import tile_sized_token_chunk
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_layout
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_mixture
from keras_softmax_heads.heads.head_utils import summed_over_valid_targets
from keras_softmax_heads.heads.head_utils import token_nll_on_shards
from keras_softmax_heads.heads.mixture_head import MixtureHead
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_positive
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid

#: Mixture components: softmax (MoS) or sigsoftmax (MoSS).
COMPONENTS = ("softmax", "sigsoftmax")


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class MixtureOfSoftmaxes(MixtureHead):
    """Mixture of Softmaxes (MoS) output head, with MoSS and MoS+PLIF variants.

    From the context vector `h` `[..., d]`, `K` priors and latent context
    vectors (Yang et al., 2018) scored against one output projection `W`
    (the `kernel` `[latent_dim, V]` or a tied `token_embedding`):

    `pi = softmax(h W_pi)`, `c_k = tanh(h W_k)` (the papers' priors and
    latents, without biases unless `use_prior_bias=True` /
    `use_latent_bias=True`), `z_k = c_k W + b`,
    `log p(w | h) = logsumexp_k(log pi_k + log_softmax(g(z_k))_w)`,

    in float32 and in log space. `g` is the identity for MoS; with
    `component="sigsoftmax"` the components and the priors are sigsoftmax
    (MoSS, Kanai et al. 2018, eq. 19); with `num_knots` `g` is one PLIF
    shared by the components, initialised to the identity (MoS + PLIF,
    Ganea et al. 2019). The mixture is not limited to rank `d + 2` as
    Linear-Softmax is. `call` / `log_probs` compute the `[N, K, V]`
    component scores; the training loss (`log_likelihood`, `training_loss`,
    hence `fit` with `HeadModel` / `HeadLoss`) never does: it runs in
    vocabulary tiles (`chunked_mixture_nll`, `docs/mixtures.md`).

    Args:
        vocab_size: int `V >= 2` (or omit and pass `token_embedding`).
        num_components: int `K >= 1` (Yang et al. use 15 on PTB).
        latent_dim: int >= 1, the dimension of the latent vectors `c_k` and
            the input dimension of the output projection; `None` (default):
            the input dimension `d`. With a tied `token_embedding`, its
            `output_dim`.
        latent_dropout: float in `[0, 1)`, dropout on the latent vectors in
            training (`call(..., training=True)`, `training_loss`, `fit`).
        component: `"softmax"` (MoS) or `"sigsoftmax"` (MoSS).
        num_knots: `None` (no PLIF) or int `>= 1`, the PLIF intervals.
        knot_bound: float `T > 0`, the PLIF knots cover `[-T, T]`.
        token_embedding: optional `keras.layers.Embedding` `[V, latent_dim]`
            to tie the output projection to.
        use_bias: bool, add a per-word output bias (default `True`).
        kernel_initializer: initializer of the output projection.
        bias_initializer: initializer of the output bias, or `"unigram"`
            (default; `None` means the same): every component starts at the
            smoothed unigram of `counts` (the bias `log u` for softmax
            components, its sigsoftmax counterpart for MoSS:
            `named_bias_values`; zeros without `counts`).
        prior_initializer: initializer of the prior kernel `[d, K]`.
        latent_initializer: initializer of the latent kernel
            `[d, K * latent_dim]`; the default `"identity"` is
            `near_identity_initializer` (the untrained head is close to a
            Linear-Softmax on `tanh(h)`).
        use_latent_bias: bool, add a bias inside the latents' tanh,
            `c_k = tanh(h W_k + b_k)` (default `False`: the papers'
            `tanh(h W_k)`; under Zaremba's clipped SGD the latent bias took
            a large share of the clipping norm and slowed training, see
            `docs/recipes.md`, "Mixtures"). Files written by 0.3.0 and
            before load with the latent bias they were trained with.
        use_prior_bias: bool, add a bias to the prior logits,
            `pi = softmax(h W_pi + b_pi)` (default `False`: the papers'
            priors, which trained as far or further, `docs/recipes.md`,
            "Mixtures"). Files written before this option existed load with
            the prior bias they were trained with.
        counts: optional `[V]` training word counts, for the `"unigram"`
            bias (`keras_softmax_heads.training` passes them). Why these
            defaults: `docs/mixtures.md`.
        seed: optional int, seed of the latent dropout and the identity
            start's Glorot draw.
        chunk_size: optional int >= 1, the maximum vocabulary tile width of
            the exact tiled NLL of `log_likelihood` and `training_loss`
            (`chunked_mixture_nll`: tiles `[K * N, width]`); `None`
            (default): the width chosen for the platform and `K`
            (`chunked.platform.chunk_size_for`).
        gradient_in_forward: bool, or `None` (default: `True`). With
            `True` the training objective as `HeadModel` and `HeadLoss`
            reduce it (`summed_training_loss`) computes its gradient in the
            forward pass, token chunk by token chunk
            (`chunked.summed_mixture`; with PLIF its slope histograms summed
            over the chunks): three `N K L V` products where the tiled loss
            runs four, and a float32 `[L, V]` gradient buffer; the same
            value and gradients (to float32 rounding). `False`: the tiled
            per-token loss. Measurements: `docs/mixtures.md`.
        return_probabilities: bool, `call` returns probabilities.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.
        training: bool, enables the latent dropout.

    Returns:
        float32 log-probabilities of the mixture, `[..., V]`.

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.mixture_of_softmaxes import MixtureOfSoftmaxes
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

    def __init__(self, *args, component="softmax", num_knots=None, knot_bound=10.0,
                 bias_initializer="unigram", **kwargs):
        component = check_choice("component", component, COMPONENTS)
        if bias_initializer is None:  # the default before MoSS had its unigram start
            bias_initializer = "unigram"
        super().__init__(*args, bias_initializer=bias_initializer, **kwargs)
        self.component = component
        self.num_knots = check_int("num_knots", num_knots, minimum=1, allow_none=True)
        self.knot_bound = check_positive("knot_bound", knot_bound)

    def named_bias_values(self, name):
        """`"unigram"`: the bias whose component distribution is the
        smoothed unigram `u = (counts + 1) / sum(counts + 1)`.

        For softmax components that is `log u`. A sigsoftmax component
        scores `exp(b) sigmoid(b) = x**2 / (1 + x)` with `x = exp(b)`, which
        a softmax does not: the level of the bias matters, not only its
        differences. Its unigram bias is `log x` for the positive root of
        `x**2 = lam u (1 + x)`, `x = (lam u + sqrt(lam u (lam u + 4))) / 2`,
        with `lam = V / 2`: the scores then sum to `V / 2`, as from zeros,
        and a word of average frequency (`u = 1 / V`) gets `b = 0` (uniform
        counts give the zero bias). With `lam = 1` every word sat where
        `sigmoid(b) ~ 0` and the component scored `~exp(2 z)`; MoSS trained
        slower from there than from zeros on PTB, and from `log u` (the
        scores `~u**2`) it stalled (`docs/recipes.md`, "Mixtures"). Zeros
        without `counts`.
        """
        log_u = super().named_bias_values(name)
        if self.component != "sigsoftmax" or self._counts is None:
            return log_u
        scaled = np.exp(log_u) * (self.vocab_size / 2.0)
        return np.log((scaled + np.sqrt(scaled * (scaled + 4.0))) / 2.0)

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

        Computed in vocabulary tiles (`chunked_mixture_nll`): per component
        the target's score and the log-sum-exp over the vocabulary, tile by
        tile, gradients by recomputation; neither the `[N, K, V]` scores nor
        the `[N, V]` mixture is formed. The tile width is `chunk_size`, or
        with `chunk_size=None` the platform's choice for `K` components
        (`chunked.platform.chunk_size_for`). `dense_log_likelihood` is the
        same value from the `[N, K, V]` scores. On JAX, with the kernel (or
        tied embedding) sharded on V by a `keras.distribution`, each device
        scores its own shard (`chunked.vocab_parallel.token_losses` over
        `vocab_parallel_mixture`).
        """
        inputs = self._check_inputs(inputs)
        targets = check_targets(targets, self.vocab_size)
        log_priors, latent = self._priors_and_latents(inputs, training)
        kernel, transposed = self.chunked_projection()
        layout = vocab_parallel_layout(kernel, transposed)
        if layout is not None:  # JAX, the kernel sharded on V: each device its shard
            nll = self._vocab_parallel_nll(latent, log_priors, kernel, transposed, layout,
                                           targets)
            return nan_if_invalid(-nll, targets, self.vocab_size)
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

    def _vocab_parallel_nll(self, latent, log_priors, kernel, transposed, layout, targets):
        """`-log p(targets)` (shape `targets.shape`) on each device's
        vocabulary shard: the summed core with its per-token losses
        (`chunked.vocab_parallel.token_losses`, exact gradients for any
        cotangent)."""
        # As many chunks as the tiled pass has tiles, 1 / n of a tile's scores each.
        chunk = tile_sized_token_chunk(latent.shape[0], self.vocab_size, self.chunk_size,
                                       self.num_components)
        has_bias, has_plif = self.bias is not None, self.raw_slopes is not None
        extra = [x for x in (self.bias, self.raw_slopes) if x is not None]

        def summed(weights, t, lat, lp, w, *rest):
            return vocab_parallel_mixture(
                lat, lp, w, rest[0] if has_bias else None, t, weights, layout,
                kernel_transposed=transposed, output_fn=self.component,
                raw_slopes=rest[-1] if has_plif else None,
                knot_bound=self.knot_bound if has_plif else None, token_chunk_size=chunk,
                return_per_token=True)

        return token_nll_on_shards(summed, [latent, log_priors, kernel, *extra], targets,
                                   self.vocab_size)

    def summed_training_loss(self, inputs, targets, weights, training=True):
        """`sum_i weights_i (-log p(targets_i | inputs_i))`, a float32 scalar.

        With `gradient_in_forward=True` one pass over token chunks computes
        it and its gradient (`chunked.summed_mixture.summed_mixture_nll`;
        on JAX, with the kernel or tied embedding sharded on V by a
        `keras.distribution`, on each device's shard:
        `chunked.vocab_parallel.vocab_parallel_mixture`); otherwise
        `training_loss` weighted and summed. `weights` has the shape of
        `targets`; a weight-0 token adds nothing, a word id outside `[0, V)`
        with a non-zero weight makes the sum NaN.
        """
        if not self.gradient_in_forward:
            return super().summed_training_loss(inputs, targets, weights, training)
        inputs = self._check_inputs(inputs)
        targets = check_targets(targets, self.vocab_size)
        log_priors, latent = self._priors_and_latents(inputs, training)
        kernel, transposed = self.chunked_projection()

        def summed(ids, weights):
            return summed_mixture_nll_auto(
                latent, log_priors, kernel, self.bias, ids, weights,
                output_fn=self.component, raw_slopes=self.raw_slopes,
                knot_bound=None if self.raw_slopes is None else self.knot_bound,
                kernel_transposed=transposed,
            )

        return summed_over_valid_targets(targets, weights, self.vocab_size, summed)

    def dense_log_likelihood(self, inputs, targets, training=None):
        """`log_likelihood` from the `[N, K, V]` component scores (the
        reference of the tiled path; memory `O(N K V)`).

        Gathers the target's score in each component and subtracts that
        component's log-sum-exp over the vocabulary, so neither the
        `[N, K, V]` log-softmax nor the `[N, V]` mixture is formed.
        """
        inputs = self._check_inputs(inputs)
        targets = check_targets(targets, self.vocab_size)
        log_priors, latent = self._priors_and_latents(inputs, training)
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


