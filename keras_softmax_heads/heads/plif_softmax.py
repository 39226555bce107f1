"""Linear-Monotonic-Softmax with a piecewise linear increasing function (PLIF)."""

import numbers

import keras

from keras_softmax_heads import functional
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class PLIFSoftmax(PointwiseSoftmaxHead):
    """LMS-PLIF output head (Ganea et al. 2019, section 4).

    `log p = log_softmax(f(z))` with `z = h W + b` and `f` a learnable
    piecewise linear increasing function (PLIF): `K + 1` equally spaced
    knots `l_i = -T + 2Ti/K` on `[-T, T]`, slope `s_i = softplus(v_i) > 0`
    on `[l_i, l_{i+1}]`, continuity through a cumulative sum,

    `f(x) = -T + (2T/K) sum_{j<i} s_j + s_i (x - l_i)`,
    `i = clip(floor((x + T) K / 2T), 0, K - 1)`,

    so the first and last pieces extend linearly outside `[-T, T]` (`f` is
    increasing and defined on all of R). The forward pass is one index
    computation and two table lookups per score; the paper's free offset
    `b_0` is left out (softmax is shift-invariant). The slopes start at 1
    (`v_i = log(e - 1)`): an untrained `PLIFSoftmax` equals `FullSoftmax`
    with the same kernel and bias.

    `log_likelihood` / `training_loss` use
    `keras_softmax_heads.functional.plif_log_likelihood`, which fuses PLIF,
    `log_softmax` and the target lookup in one custom gradient: it saves the
    scores `z`, their int32 interval index and two per-row vectors (not the
    `[..., V]` PLIF scores or log-probabilities), so the extra memory over
    Linear-Softmax is the index, independent of `K`. `call` / `log_probs`
    use `ops.plif` (custom gradient saving `z` and the index). With
    `chunk_size` set the loss goes through the chunked vocabulary-tiled path
    instead (see `PointwiseSoftmaxHead`).

    Cost: `O(N V)` on top of Linear-Softmax's `O(N V d)`, whatever `K`
    (plus `O(K)` for the slope tables). The paper's "negligible" is a GPU
    statement: on a memory-bound CPU the slopes' gradient, a weighted
    histogram of all `N V` scores into `K` intervals (a serial scatter-add
    under XLA), and the extra passes over `[N, V]` for the index and the
    lookups remain, so the ratio to `FullSoftmax` is lowest at large `d`,
    where the matrix products weigh more (see the module docstring of
    `keras_softmax_heads.functional`; measured ratios in `docs/plif.md`). Peak step
    memory stays close to `FullSoftmax`'s, unlike the straightforward PLIF
    (automatic differentiation of two gathers), which keeps several more
    `[N, V]` tensors. The kernels are `keras.ops` code and run on
    TensorFlow, JAX and PyTorch; the histogram of the slopes' gradient is
    `functional.knot_histogram`.

    Args:
        vocab_size: int, number of words `V` (or omit and pass
            `token_embedding`).
        num_knots: int >= 1, the number of intervals `K` (default `100_000`,
            the paper's PTB / WikiText-2 setting; they also use `10**6` with
            MoS).
        knot_bound: float `T > 0`, the knots cover `[-T, T]` (default 20; the
            paper does not give its value. Scores outside `[-T, T]` see the
            first / last slope only, so `T` should cover the range of the
            logits; the interval width is `2T / K`).
        token_embedding, use_bias, kernel_initializer, bias_initializer,
        return_probabilities, chunk_size: as in `PointwiseSoftmaxHead`.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 log-probabilities `[..., V]`.

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

    def __init__(self, vocab_size=None, num_knots=100_000, knot_bound=20.0, **kwargs):
        if (
            isinstance(num_knots, bool)
            or not isinstance(num_knots, numbers.Integral)
            or num_knots < 1
        ):
            raise ValueError(
                "`num_knots` must be an integer >= 1. "
                f"Received: num_knots={num_knots!r}"
            )
        knot_bound = functional.check_knot_bound(knot_bound)
        super().__init__(vocab_size, **kwargs)
        self.num_knots = int(num_knots)
        self.knot_bound = knot_bound

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
        """The PLIF `f(z)` (custom gradient, see `keras_softmax_heads.functional.plif`)."""
        return functional.plif(z, self.raw_slopes, self.knot_bound)

    def log_likelihood(self, inputs, targets):
        if self.chunk_size is not None:
            return super().log_likelihood(inputs, targets)
        targets = check_targets(targets, self.vocab_size)
        ll = functional.plif_log_likelihood(
            self.logits(inputs), self.raw_slopes, self.knot_bound, targets
        )
        return nan_if_invalid(ll, targets, self.vocab_size)

    def get_config(self):
        config = super().get_config()
        config.update({"num_knots": self.num_knots, "knot_bound": self.knot_bound})
        return config
