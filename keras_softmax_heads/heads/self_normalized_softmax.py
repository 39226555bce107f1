"""`SelfNormalizedSoftmax`: infrequent normalisation (Weaknorm, WeaknormSQ).

Design notes (the penalty's re-weighting, cost, the `"normalized"` bias
start): `docs/sampling.md`; the measured effect of `gamma`:
`docs/recipes.md`.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_softmax_heads.functional.dispatch import scatter
from keras_softmax_heads.heads.sampling_head import SamplingHead
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_number

_VARIANTS = ("weaknorm", "weaknorm_sq")


def bounded_scores(z):
    """`10 tanh(z / 5)`: Chen et al.'s bound on the unnormalised scores."""
    return 10.0 * ops.tanh(z / 5.0)


def weaknorm_nll(target_scores, log_partition, rows, num_rows, alpha, variant):
    """The infrequent-normalisation loss (the math, no weights).

    `loss_i = -s_i + [i in R] (alpha / gamma') penalty(log Z_i)` with
    `penalty(x) = x` (`"weaknorm"`) or `x ** 2` (`"weaknorm_sq"`) and
    `gamma' = |R| / N` the fraction of rows whose partition is computed.

    Args:
        target_scores: float `[N]`, the unnormalised target scores `s_i`.
        log_partition: float `[|R|]`, `log Z` of the rows `rows`.
        rows: int `[|R|]`, distinct row indices in `[0, N)`.
        num_rows: int `N` (Python int or scalar tensor).
        alpha: float, the penalty strength.
        variant: `"weaknorm"` or `"weaknorm_sq"`.

    Returns:
        float `[N]`.

    Example:

    >>> import numpy as np
    >>> loss = weaknorm_nll(np.array([1.0, 2.0]), np.array([3.0]), np.array([1]),
    ...                     2, 1.0, "weaknorm")
    >>> np.asarray(loss).tolist()  # row 1: -2 + (1 / 0.5) * 3
    [-1.0, 4.0]
    """
    target_scores = ops.convert_to_tensor(target_scores)
    log_partition = ops.convert_to_tensor(log_partition)
    penalty = log_partition if variant == "weaknorm" else ops.square(log_partition)
    num_selected = ops.shape(log_partition)[0]
    weight = alpha * ops.cast(num_rows, target_scores.dtype) / ops.cast(
        num_selected, target_scores.dtype
    )
    rows = ops.reshape(ops.cast(rows, "int32"), (-1, 1))
    scattered = scatter(rows, weight * penalty, ops.shape(target_scores))
    return scattered - target_scores


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class SelfNormalizedSoftmax(SamplingHead):
    """Infrequent normalisation (Weaknorm / WeaknormSQ) training.

    Evaluation is exact: `call`, `log_probs` and `log_likelihood` are
    `log_softmax(s)` with `s = z = h W^T + b`, or `s = 10 tanh(z / 5)` with
    `score_bound=True`. Training adds a penalty on the log partition
    `log Z_i = logsumexp_w s(w | h_i)`, computed on a random set `R` of
    `ceil(gamma N)` of the `N` rows only:

    `loss_i = -s(t_i) + [i in R] (alpha N / |R|) penalty(log Z_i)`,

    `penalty(x) = x` (`"weaknorm"`; with `alpha = 1` an unbiased estimate
    of the NLL, the NLL itself at `gamma = 1`) or `x ** 2`
    (`"weaknorm_sq"`). Cost: about `gamma` times the matrix products of a
    full softmax. Design notes: `docs/sampling.md`; the choice of `gamma`:
    `docs/recipes.md`.

    Args:
        vocab_size: int `V` (or omit and pass `token_embedding`).
        variant: `"weaknorm"` (default) or `"weaknorm_sq"`.
        alpha: float `>= 0`, the penalty strength (default 1).
        gamma: float in `(0, 1]`, the fraction of rows whose partition is
            computed each step (default 0.25).
        score_bound: bool, use `s = 10 tanh(z / 5)` (default `False`).
        seed: optional int, seed of the layer's `keras.random.SeedGenerator`
            (row selection).
        bias_initializer: `"normalized"` (default: every bias at `-log V`,
            so `log Z ~ 0` at the start) or any Keras initializer.
        **kwargs: `token_embedding`, `use_bias`, `kernel_initializer`,
            `return_probabilities` (see `SoftmaxHead`) and standard
            `keras.layers.Layer` arguments.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 exact log-probabilities `[..., V]`. `training_loss(inputs,
        targets)`: the per-token Weaknorm loss, float32 of shape
        `targets.shape` (`training=False`: the exact NLL).

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.self_normalized_softmax import SelfNormalizedSoftmax
    >>> head = SelfNormalizedSoftmax(vocab_size=30, gamma=0.25, seed=0)
    >>> h = np.random.rand(2, 4, 8).astype("float32")
    >>> targets = np.arange(8).reshape(2, 4)
    >>> tuple(head.training_loss(h, targets).shape)
    (2, 4)
    >>> exact = SelfNormalizedSoftmax(vocab_size=30, gamma=1.0)  # alpha=1
    >>> _ = exact(h)
    >>> exact.set_weights(head.get_weights())
    >>> bool(np.allclose(exact.training_loss(h, targets),
    ...                  -head.log_likelihood(h, targets), atol=1e-5))
    True

    References:
        - Chen, Grangier & Auli, 2016. Strategies for Training Large
          Vocabulary Neural Language Models (sections 2.6, 4.6).
          https://arxiv.org/abs/1512.04906
        - Devlin et al., 2014. Fast and Robust Neural Network Joint Models
          for Statistical Machine Translation.
        - Andreas & Klein, 2015. When and why are log-linear models
          self-normalizing?
    """

    named_bias_initializers = ("normalized",)

    def __init__(
        self,
        vocab_size=None,
        variant="weaknorm",
        alpha=1.0,
        gamma=0.25,
        score_bound=False,
        seed=None,
        bias_initializer="normalized",
        **kwargs,
    ):
        super().__init__(
            vocab_size=vocab_size, seed=seed, bias_initializer=bias_initializer, **kwargs
        )
        self.variant = check_choice("variant", variant, _VARIANTS)
        self.alpha = check_number("alpha", alpha, low=0)
        self.gamma = check_number("gamma", gamma, low=0, high=1, low_open=True)
        self.score_bound = check_bool("score_bound", score_bound)

    def named_bias_values(self, name):
        """`"normalized"`: every bias at `-log V`, so that `log Z(h) ~ 0`
        at initialisation (the penalty's minimum for WeaknormSQ)."""
        del name
        return np.full(self.vocab_size, -math.log(self.vocab_size))

    def score_transform(self, z):
        """`10 tanh(z / 5)` with `score_bound=True`, else the identity."""
        return bounded_scores(z) if self.score_bound else z

    # ------------------------------------------------------------- sampling
    def num_selected_rows(self, num_rows):
        """`ceil(gamma * N)` (a Python int when `N` is static)."""
        if isinstance(num_rows, int):
            return max(1, min(num_rows, math.ceil(self.gamma * num_rows - 1e-9)))
        n = ops.cast(num_rows, "float32")
        k = ops.cast(ops.ceil(self.gamma * n - 1e-6), "int32")
        return ops.clip(k, 1, num_rows)

    def sample_rows(self, num_rows):
        """`ceil(gamma N)` distinct row indices, uniformly at random, int32."""
        k = self.num_selected_rows(num_rows)
        if isinstance(k, int) and k == num_rows:
            return ops.arange(num_rows, dtype="int32")
        noise = keras.random.uniform((num_rows,), seed=self.seed_generator)
        return ops.cast(ops.top_k(noise, k, sorted=False)[1], "int32")

    # ----------------------------------------------------------------- loss
    def loss_with_rows(self, inputs, targets, rows):
        """The Weaknorm loss with a given set of normalised rows.

        Args:
            inputs: context vectors `[..., d]`.
            targets: int word ids `[...]`.
            rows: int `[|R|]`, distinct indices into the flattened tokens
                (`N = prod(targets.shape)`) whose partition is computed.

        Returns:
            float32 `[...]`, the shape of `targets`.
        """
        h, flat_targets, shape = self._flatten(inputs, targets)
        rows = ops.cast(ops.convert_to_tensor(rows), "int32")
        target_s = self.score_transform(self.target_scores(h, flat_targets))
        selected = ops.take(h, rows, axis=0)
        log_z = ops.logsumexp(self.score_transform(self.full_scores(selected)), axis=-1)
        loss = weaknorm_nll(
            target_s, log_z, rows, ops.shape(h)[0], self.alpha, self.variant
        )
        return self._finish(loss, flat_targets, shape)

    def stochastic_loss(self, inputs, targets):
        """The Weaknorm loss with freshly drawn rows, `targets.shape`."""
        num_rows = 1
        static = True
        for dim in inputs.shape[:-1]:
            if dim is None:
                static = False
                break
            num_rows *= int(dim)
        if not static:
            num_rows = ops.prod(ops.shape(inputs)[:-1])
        return self.loss_with_rows(inputs, targets, self.sample_rows(num_rows))

    # ------------------------------------------------------------ serialising
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "variant": self.variant,
                "alpha": self.alpha,
                "gamma": self.gamma,
                "score_bound": self.score_bound,
            }
        )
        return config
