"""Linear-Monotonic-Softmax with a learnable monotonic MLP (Ganea et al. 2019)."""


import keras
import numpy as np
from keras import ops

from keras_softmax_heads import functional
from keras_softmax_heads.functional.dispatch import upstream_gradient
from keras_softmax_heads.functional.dispatch import xla_in_graph
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_positive


def _softplus_inverse(y):
    """`x` with `softplus(x) = y` (`y > 0`), as a float64 numpy array."""
    y = np.asarray(y, "float64")
    return y + np.log(-np.expm1(-y))


def monotonic_mlp(z, raw_input_weights, hidden_biases, raw_output_weights):
    """`f(z) = sum_k v_k sigmoid(u_k z + b_k)`, `u = softplus(.)`, `v = softplus(.)`.

    The one-hidden-layer monotonic network of Ganea et al. (2019, eq. 14)
    applied elementwise, with a custom gradient that saves only `z`: the
    units are summed one at a time in a `functional.scan_tiles` loop and
    the backward pass recomputes each unit's sigmoid, so memory is
    `O(z.size)` whatever `K` (the broadcast `monotonic_mlp_dense` holds
    `[..., K]`; `docs/plif.md`, "MonotonicSoftmax"). In a TensorFlow graph
    run without XLA both passes are compiled with XLA all the same
    (`functional.dispatch.xla_in_graph`).

    Args:
        z: float tensor of any shape.
        raw_input_weights, hidden_biases, raw_output_weights: float tensors
            or variables `[K]` (unconstrained; the weights are made
            positive by softplus).

    Returns:
        `f(z)`, same shape and dtype as `z`.
    """
    z = ops.convert_to_tensor(z)
    out_dtype = z.dtype
    dtype = "float64" if keras.backend.standardize_dtype(z.dtype) == "float64" else "float32"
    # Variables are read here, outside the custom gradient.
    params = [
        ops.cast(ops.convert_to_tensor(p), dtype)
        for p in (raw_input_weights, hidden_biases, raw_output_weights)
    ]
    num_units = params[0].shape[0]
    if num_units is None:
        raise ValueError("The monotonic MLP needs weights of static length K.")

    @ops.custom_gradient
    def mlp(z, raw_u, b, raw_v):
        u, v = ops.softplus(raw_u), ops.softplus(raw_v)
        # `stop_gradient`: a loop recorded by an outer gradient tape would
        # otherwise keep every iteration's temporaries for a gradient that
        # the custom gradient below replaces.
        z_ = ops.stop_gradient(z)

        def forward(carry, unit):
            u_k, b_k, v_k = unit
            return (carry[0] + v_k * ops.sigmoid(u_k * z_ + b_k),), ()

        units = tuple(ops.stop_gradient(x) for x in (u, b, v))

        def run_forward():
            (out,), _ = functional.scan_tiles(forward, (ops.zeros_like(z_),), units, ())
            return out

        out = xla_in_graph(run_forward)

        def grad(*args, upstream=None):
            upstream = ops.cast(upstream_gradient(args, upstream), z.dtype)

            def backward(carry, unit):
                u_k, b_k, v_k = unit
                s = ops.sigmoid(u_k * z_ + b_k)
                t = upstream * (v_k * s * (1.0 - s))  # d out / d pre-activation
                d_u = ops.sum(t * z_)
                d_b = ops.sum(t)
                d_v = ops.sum(upstream * s)
                return (carry[0] + u_k * t,), (d_u, d_b, d_v)

            def run_backward():
                return functional.scan_tiles(
                    backward, (ops.zeros_like(z_),), units, (dtype, dtype, dtype)
                )

            (d_z,), (d_u, d_b, d_v) = xla_in_graph(run_backward)
            return (
                d_z,
                d_u * ops.sigmoid(raw_u),
                d_b,
                d_v * ops.sigmoid(raw_v),
            )

        return out, grad

    return ops.cast(mlp(ops.cast(z, dtype), *params), out_dtype)


def monotonic_mlp_dense(x, raw_input_weights, hidden_biases, raw_output_weights):
    """`f(x)` of eq. 14 by broadcasting: `[..., K]` temporaries (small `x`)."""
    u = ops.softplus(raw_input_weights)
    v = ops.softplus(raw_output_weights)
    return ops.sum(v * ops.sigmoid(ops.expand_dims(x, -1) * u + hidden_biases), axis=-1)


#: Beyond this many units of `u_k x + b_k` from its centre a sigmoid is
#: saturated to float32 precision (sigmoid(-17) < 5e-8).
SATURATION = 17.0


def monotonic_mlp_tabulated(z, raw_input_weights, hidden_biases, raw_output_weights,
                            grid_size):
    """`monotonic_mlp` through a table: `f` at `grid_size` points, interpolated.

    The grid spans the interval where `f` is not flat, from
    `min_k (-b_k - SATURATION) / u_k` to `max_k (-b_k + SATURATION) / u_k`
    (it depends on the parameters only, not on the scores); beyond it every
    unit is saturated. `f` is evaluated exactly at the grid points
    (`monotonic_mlp_dense`, automatic differentiation to its `3K`
    parameters) and `functional.interpolate_table` interpolates it at every
    score: one lookup per score instead of `K` sigmoids. The gradients are
    those of the interpolant (the grid's own movement is not
    differentiated). Error bound: `docs/recipes.md`.

    Args:
        z: float tensor of any shape.
        raw_input_weights, hidden_biases, raw_output_weights: float `[K]`.
        grid_size: int >= 2, the number of grid points.

    Returns:
        `f(z)` interpolated, the shape and dtype of `z`.
    """
    z = ops.convert_to_tensor(z)
    dtype = "float64" if keras.backend.standardize_dtype(z.dtype) == "float64" else "float32"
    out_dtype = z.dtype
    z = ops.cast(z, dtype)
    params = [ops.cast(ops.convert_to_tensor(p), dtype)
              for p in (raw_input_weights, hidden_biases, raw_output_weights)]
    u = ops.stop_gradient(ops.softplus(params[0]))
    b = ops.stop_gradient(params[1])
    lo = ops.min((-b - SATURATION) / u)
    width = ops.max((-b + SATURATION) / u) - lo
    grid = lo + width * ops.cast(ops.arange(grid_size), dtype) / (grid_size - 1)
    table = monotonic_mlp_dense(grid, *params)
    return ops.cast(functional.interpolate_table(z, table, lo, width), out_dtype)


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class MonotonicSoftmax(PointwiseSoftmaxHead):
    """Linear-Monotonic-Softmax with a learnable monotonic MLP (Ganea et al. 2019).

    `log p = log_softmax(f(z))`, `z = h W + b`, with the learnable increasing
    pointwise function of eq. 14,

    `f(x) = sum_{k=1..K} v_k sigmoid(u_k x + b_k)`,
    `u_k = softplus(raw_input_weights_k) > 0`, `v_k = softplus(raw_output_weights_k) > 0`,

    a monotonic network (Daniels & Velikova, 2010) that keeps the argmax and
    lifts the rank bound of Linear-Softmax. The paper's output bias is left
    out (softmax is shift-invariant). `f` starts close to `x + init_range`
    on `[-init_range, init_range]`: `u_k = 1`, sigmoid centres at the
    midpoints of `K` equal cells, `v_k` the cell width. Cost `O(N V K)`
    without a grid; memory `O(N V)` whatever `K` (custom gradient). Design
    and measurements: `docs/plif.md`, "MonotonicSoftmax"; the defaults:
    `docs/recipes.md`.

    Args:
        vocab_size: int `V >= 2` (or omit and pass `token_embedding`).
        num_units: int >= 1, the number of hidden units `K` (default 16).
        init_range: float > 0, half-width of the interval on which the
            initial `f` is close to the identity (default 10).
        parameter_scale: float > 0 (default 0.05). The `3K` parameters of
            `f` are stored divided by it, which scales their gradients (and
            their share of a global clipping norm) by it. 1.0 is the plain
            parameterisation (files written before 0.3 load with it).
        grid_size: int >= 2 (default 4096) or None. `f` is evaluated at
            `grid_size` points where it is not flat and interpolated
            linearly at every score (`monotonic_mlp_tabulated`; error at
            most `h**2 / 8 * max |f''|` for a grid step `h`). `None`
            evaluates the `K` sigmoids at every score (`monotonic_mlp`;
            files written before 0.3 load with it).
        token_embedding, use_bias, kernel_initializer, bias_initializer,
        return_probabilities, chunk_size: the `PointwiseSoftmaxHead`
            arguments.

    Call arguments:
        inputs: float context vectors `[..., d]`.

    Returns:
        float32 log-probabilities `log_softmax(f(z))` `[..., V]`.

    Example:

    >>> import keras, numpy as np
    >>> from keras_softmax_heads.heads.monotonic_softmax import MonotonicSoftmax
    >>> head = MonotonicSoftmax(vocab_size=7, num_units=4)
    >>> log_p = keras.ops.convert_to_numpy(head(np.random.rand(2, 3, 5).astype("float32")))
    >>> tuple(log_p.shape)
    (2, 3, 7)
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True
    >>> [tuple(w.shape) for w in head.weights][2:]
    [(4,), (4,), (4,)]

    References:
        - Ganea, Gelly, Bécigneul, Severyn. Breaking the Softmax Bottleneck
          via Learnable Monotonic Pointwise Non-linearities. ICML 2019.
          https://arxiv.org/abs/1902.08077
        - Daniels, Velikova. Monotone and partially monotone neural
          networks. IEEE Transactions on Neural Networks, 2010.
    """

    def __init__(self, vocab_size=None, num_units=16, init_range=10.0,
                 parameter_scale=0.05, grid_size=4096, **kwargs):
        num_units = check_int("num_units", num_units, minimum=1)
        init_range = check_positive("init_range", init_range)
        parameter_scale = check_positive("parameter_scale", parameter_scale)
        grid_size = check_int("grid_size", grid_size, minimum=2, allow_none=True)
        super().__init__(vocab_size, **kwargs)
        self.grid_size = grid_size
        self.num_units = num_units
        self.init_range = init_range
        self.parameter_scale = parameter_scale

    def build_head(self, input_shape):
        k = self.num_units
        cell = 2.0 * self.init_range / k
        centres = -self.init_range + cell * (np.arange(k) + 0.5)

        def constant(values):
            # Stored divided by the scale; `score_transform` multiplies back.
            values = np.asarray(values, "float64") / self.parameter_scale

            def init(shape, dtype=None):
                return keras.ops.cast(np.broadcast_to(values, shape), dtype)

            return init

        # autocast=False: under mixed precision the weights are read in
        # float32, not rounded to float16.
        self.raw_input_weights = self.add_weight(
            name="raw_input_weights",
            shape=(k,),
            initializer=constant(_softplus_inverse(1.0)),
            autocast=False,
        )
        self.hidden_biases = self.add_weight(
            name="hidden_biases",
            shape=(k,),
            initializer=constant(-centres),
            autocast=False,
        )
        self.raw_output_weights = self.add_weight(
            name="raw_output_weights",
            shape=(k,),
            initializer=constant(_softplus_inverse(cell)),
            autocast=False,
        )

    def score_transform(self, z):
        """The monotonic MLP `f(z)` (eq. 14)."""
        if self.grid_size is None:
            return monotonic_mlp(z, *self.function_parameters())
        return monotonic_mlp_tabulated(z, *self.function_parameters(), self.grid_size)

    def function_parameters(self):
        """`(raw_input_weights, hidden_biases, raw_output_weights)` of `f`
        (eq. 14, the arguments of `monotonic_mlp`): the stored weights times
        `parameter_scale`."""
        return tuple(
            ops.convert_to_tensor(w) * self.parameter_scale
            for w in (self.raw_input_weights, self.hidden_biases, self.raw_output_weights)
        )

    @classmethod
    def from_config(cls, config):
        # Configs written before `parameter_scale` existed hold unscaled
        # parameters.
        config = dict(config)
        config.setdefault("parameter_scale", 1.0)
        config.setdefault("grid_size", None)
        return super().from_config(config)

    def get_config(self):
        config = super().get_config()
        config.update({"num_units": self.num_units, "init_range": self.init_range,
                       "parameter_scale": self.parameter_scale,
                       "grid_size": self.grid_size})
        return config
