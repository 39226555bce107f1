"""Linear-Monotonic-Softmax with a piecewise linear increasing function (PLIF)."""

import keras

from keras_softmax_heads import functional
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_positive
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class PLIFSoftmax(PointwiseSoftmaxHead):
    """LMS-PLIF output head (Ganea et al. 2019, section 4).

    `log p = log_softmax(f(z))`, `z = h W + b`, with `f` a learnable piecewise
    linear increasing function (PLIF) of `K` intervals on `[-T, T]`:

    `f(x) = -T + (2T/K) sum_{j<i} s_j + s_i (x - l_i)`,
    `i = clip(floor((x + T) K / 2T), 0, K - 1)`, `s_j = softplus(v_j)`,

    with knots `l_i = -T + 2Ti/K`; the end pieces extend linearly. The
    slopes start at 1: an untrained `PLIFSoftmax` equals `FullSoftmax` with
    the same kernel and bias. `log_likelihood` / `training_loss` use the
    fused `keras_softmax_heads.functional.plif_log_likelihood` (never the
    `[..., V]` PLIF scores), `call` / `log_probs` `functional.plif`. How the
    kernels work and what they cost: `docs/plif.md`.

    Args:
        vocab_size: int `V >= 2` (or omit and pass `token_embedding`).
        num_knots: int >= 1, the number of intervals `K` (default `100_000`,
            the paper's PTB / WikiText-2 setting).
        knot_bound: float `T > 0` (default 20, not given by the paper).
            Scores outside `[-T, T]` see the first / last slope only, so `T`
            should cover the range of the logits.
        gradient_in_forward: bool, or `None` (default: `True` with
            `chunk_size`, else `False`). With `True` the training objective
            as `HeadModel` and `HeadLoss` reduce it (`summed_training_loss`)
            is computed over token chunks with its gradient, in the forward
            pass (`chunked.summed_mixture`, a mixture of one component):
            three `N x d x V` products where the tiled chunked loss runs four,
            one pass of the PLIF over the scores where it runs two, and a
            float32 `[d, V]` gradient buffer; the same value and gradients
            (to float32 rounding). Measurements: `docs/plif.md`.
        **kwargs: `token_embedding`, `use_bias`, `kernel_initializer`,
            `bias_initializer`, `return_probabilities`, `chunk_size` and the
            Keras layer arguments (`PointwiseSoftmaxHead`).

    Returns:
        float32 `log_softmax(f(h W + b))` `[..., V]` for context vectors `h`
        `[..., d]`.

    Example:

    >>> import keras, numpy as np
    >>> from keras_softmax_heads.heads.plif_softmax import PLIFSoftmax
    >>> from keras_softmax_heads.heads.full_softmax import FullSoftmax
    >>> h = np.random.default_rng(0).normal(size=(2, 3, 4)).astype("float32")
    >>> head = PLIFSoftmax(vocab_size=7, num_knots=1000, knot_bound=5.0)
    >>> log_p = keras.ops.convert_to_numpy(head(h))
    >>> tuple(log_p.shape), tuple(head.raw_slopes.shape)
    ((2, 3, 7), (1000,))
    >>> full = FullSoftmax(vocab_size=7)
    >>> tuple(full(h).shape)
    (2, 3, 7)
    >>> full.set_weights(head.get_weights()[:2])
    >>> bool(np.allclose(log_p, keras.ops.convert_to_numpy(full(h)), atol=1e-5))  # identity initialisation
    True
    >>> y = np.array([[0, 1, 2], [3, 4, 5]])
    >>> tuple(head.training_loss(h, y).shape)
    (2, 3)

    References:
        - Ganea, Gelly, Bécigneul, Severyn. Breaking the Softmax Bottleneck
          via Learnable Monotonic Pointwise Non-linearities. ICML 2019.
          https://arxiv.org/abs/1902.08077
    """

    def __init__(self, vocab_size=None, num_knots=100_000, knot_bound=20.0,
                 gradient_in_forward=None, **kwargs):
        num_knots = check_int("num_knots", num_knots, minimum=1)
        knot_bound = check_positive("knot_bound", knot_bound)
        super().__init__(vocab_size, **kwargs)
        self.num_knots = num_knots
        self.knot_bound = knot_bound
        self.gradient_in_forward = self._gradient_in_forward_option(gradient_in_forward)

    def build_head(self, input_shape):
        # autocast=False: under mixed precision the slopes are read in
        # float32 (float16 would round softplus(v) = 1 and break the
        # identity initialisation).
        self.raw_slopes = self.add_weight(
            name="raw_slopes",
            shape=(self.num_knots,),
            initializer=keras.initializers.Constant(functional.plif_identity_raw_slope()),
            autocast=False,
        )

    def score_transform(self, z):
        """The PLIF `f(z)` (`keras_softmax_heads.functional.plif`)."""
        return functional.plif(z, self.raw_slopes, self.knot_bound)

    def log_likelihood(self, inputs, targets):
        if self.chunk_size is not None:
            return super().log_likelihood(inputs, targets)
        targets = check_targets(targets, self.vocab_size)
        ll = functional.plif_log_likelihood(
            self.logits(inputs), self.raw_slopes, self.knot_bound, targets
        )
        return nan_if_invalid(ll, targets, self.vocab_size)

    def summed_training_loss(self, inputs, targets, weights, training=True):
        """`sum_i weights_i (-log p(targets_i | inputs_i))`, a float32 scalar;
        with `gradient_in_forward=True` computed with its gradient over
        token chunks (`chunked.summed_mixture.summed_mixture_nll` with one
        component and the PLIF), otherwise `training_loss` weighted and
        summed. A word id outside `[0, V)` with a non-zero weight makes the
        sum NaN."""
        if not self.gradient_in_forward:
            return super().summed_training_loss(inputs, targets, weights, training)
        return self._summed_one_component(inputs, targets, weights,
                                          **self._summed_core_options())

    def _summed_core_options(self):
        return {"raw_slopes": self.raw_slopes, "knot_bound": self.knot_bound}

    def get_config(self):
        config = super().get_config()
        config.update({"num_knots": self.num_knots, "knot_bound": self.knot_bound,
                       "gradient_in_forward": self.gradient_in_forward})
        return config
