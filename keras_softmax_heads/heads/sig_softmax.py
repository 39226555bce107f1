"""Sigsoftmax and the other output functions of Kanai et al. (2018)."""

import keras

from keras_softmax_heads import functional
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_positive

OUTPUT_FUNCTIONS = ("sigsoftmax", "sigmoid", "relu")


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class SigSoftmax(PointwiseSoftmaxHead):
    """Sigsoftmax output head (Kanai et al., 2018), and its g:sigmoid / g:ReLU
    siblings.

    Normalises a non-negative pointwise `g` of the linear scores
    `z = h W + b` (eq. 9), in float32 and in log space:

    `p(w | h) = g(z_w) / sum_v g(z_v)`, `log p = log_softmax(log g(z))`.

    * `"sigsoftmax"` (eq. 11): `g(z) = exp(z) sigmoid(z)`,
      `log g(z) = z - softplus(-z)`. Breaks the softmax bottleneck and keeps
      softmax's stability and monotonicity.
    * `"sigmoid"`: `g(z) = sigmoid(z)`, `log g(z) = -softplus(-z)`; `g <= 1`
      bounds the ratio of two probabilities.
    * `"relu"`: `g(z) = ReLU(z) + epsilon`. The paper's g:ReLU
      (`epsilon = 0`) divides by zero when a row's scores are all `<= 0`;
      with `epsilon > 0` that row is uniform and `d log g / dz` stays below
      `1 / epsilon`. Expect it to train worse than the other two.

    Args:
        vocab_size: int `V >= 2` (or omit and pass `token_embedding`).
        output_fn: one of `"sigsoftmax"` (default), `"sigmoid"`, `"relu"`.
        epsilon: float > 0 added to `ReLU(z)` for `output_fn="relu"`
            (default `1e-6`; ignored otherwise).
        gradient_in_forward: bool, or `None` (default: `True` with
            `chunk_size`, `False` without). With `True` the training
            objective as `HeadModel` and `HeadLoss` reduce it
            (`summed_training_loss`) is computed over token chunks with its
            gradient, in the forward pass (`chunked.summed_mixture`, a
            mixture of one component: three `N d V` products where the
            chunked loss runs four, never the `[N, V]` scores).
        token_embedding, use_bias, kernel_initializer, bias_initializer,
            return_probabilities, chunk_size: as in `PointwiseSoftmaxHead`.

    Returns:
        float32 `log_softmax(log g(z))`, shape `[..., V]` for inputs `[..., d]`.

    Example:

    >>> import keras, numpy as np
    >>> from keras_softmax_heads.heads.sig_softmax import SigSoftmax
    >>> head = SigSoftmax(vocab_size=7)
    >>> log_p = keras.ops.convert_to_numpy(head(np.random.rand(2, 3, 4).astype("float32")))
    >>> tuple(log_p.shape)
    (2, 3, 7)
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True
    >>> relu = SigSoftmax(vocab_size=3, output_fn="relu", use_bias=False)
    >>> relu.build((None, 2))
    >>> relu.set_weights([np.ones((2, 3), "float32")])
    >>> log_p = keras.ops.convert_to_numpy(relu(-np.ones((1, 2), "float32")))
    >>> np.round(np.exp(log_p), 3)  # all z < 0
    array([[0.333, 0.333, 0.333]], dtype=float32)

    References:
        - Kanai, Fujiwara, Yamanaka, Adachi. Sigsoftmax: Reanalysis of the
          Softmax Bottleneck. NeurIPS 2018. https://arxiv.org/abs/1805.10829
    """

    def __init__(self, vocab_size=None, output_fn="sigsoftmax", epsilon=1e-6,
                 gradient_in_forward=None, **kwargs):
        output_fn = check_choice("output_fn", output_fn, OUTPUT_FUNCTIONS)
        epsilon = check_positive("epsilon", epsilon)
        super().__init__(vocab_size, **kwargs)
        self.output_fn = output_fn
        self.epsilon = epsilon
        self.gradient_in_forward = self._gradient_in_forward_option(gradient_in_forward)

    def summed_training_loss(self, inputs, targets, weights, training=True):
        """`sum_i weights_i (-log p(targets_i | inputs_i))`, a float32 scalar;
        with `gradient_in_forward=True` computed with its gradient over
        token chunks (`chunked.summed_mixture.summed_mixture_nll` with one
        component), otherwise `training_loss` weighted and summed. A word
        id outside `[0, V)` with a non-zero weight makes the sum NaN."""
        if not self.gradient_in_forward:
            return super().summed_training_loss(inputs, targets, weights, training)
        return self._summed_one_component(inputs, targets, weights,
                                          **self._summed_core_options())

    def _summed_core_options(self):
        return {"output_fn": self.output_fn, "epsilon": self.epsilon}

    def score_transform(self, z):
        """`log g(z)`: the log of the chosen non-negative output function."""
        if self.output_fn == "sigsoftmax":
            return functional.log_sigmoid_scores(z)
        if self.output_fn == "sigmoid":
            return functional.log_sigmoid_output_scores(z)
        return functional.log_relu_output_scores(z, self.epsilon)

    def get_config(self):
        config = super().get_config()
        config.update({"output_fn": self.output_fn, "epsilon": self.epsilon,
                       "gradient_in_forward": self.gradient_in_forward})
        return config
