"""Linear-Monotonic-Softmax with a learnable monotonic MLP (Ganea et al. 2019)."""


import keras
import numpy as np
from keras import ops

from keras_softmax_heads import functional
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_positive
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead


def _softplus_inverse(y):
    """`x` with `softplus(x) = y` (`y > 0`), as a float64 numpy array."""
    y = np.asarray(y, "float64")
    return y + np.log(-np.expm1(-y))


def monotonic_mlp(z, raw_input_weights, hidden_biases, raw_output_weights):
    """`f(z) = sum_k v_k sigmoid(u_k z + b_k)`, `u = softplus(.)`, `v = softplus(.)`.

    The one-hidden-layer monotonic network of Ganea et al. (2019, eq. 14;
    Daniels & Velikova, 2010) applied elementwise, with a custom gradient
    (`ops.custom_gradient`) that keeps memory at `O(z.size)`: the units are
    summed one at a time in a loop (`functional.scan_tiles`: `ops.scan`, on
    TensorFlow a `tf.while_loop` with one iteration in flight; the naive
    broadcast `sigmoid(z[..., None] * u + b)` holds `K` tensors of the size
    of `z` for the backward pass, `[N, V, K]`; so does a Python loop, whose
    unrolled units TensorFlow and XLA schedule side by side); the backward
    pass recomputes each unit's sigmoid and accumulates `df/dz` and the
    three `[K]` parameter gradients. Saved for the backward pass: `z` only.
    The cost is `K` sigmoids per score in the forward pass and again in the
    backward pass, each unit a pass over `z`.

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
        (out,), _ = functional.scan_tiles(forward, (ops.zeros_like(z_),), units, ())

        def grad(*args, upstream=None):
            upstream = args[-1] if upstream is None else upstream
            upstream = ops.cast(upstream, z.dtype)

            def backward(carry, unit):
                u_k, b_k, v_k = unit
                s = ops.sigmoid(u_k * z_ + b_k)
                t = upstream * (v_k * s * (1.0 - s))  # d out / d pre-activation
                d_u = ops.sum(t * z_)
                d_b = ops.sum(t)
                d_v = ops.sum(upstream * s)
                return (carry[0] + u_k * t,), (d_u, d_b, d_v)

            (d_z,), (d_u, d_b, d_v) = functional.scan_tiles(
                backward, (ops.zeros_like(z_),), units, (dtype, dtype, dtype)
            )
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

    The grid covers the interval where `f` is not flat, from
    `min_k (-b_k - SATURATION) / u_k` to `max_k (-b_k + SATURATION) / u_k`
    (it depends on the parameters only, not on the scores: a context gets
    the same log-probabilities in any batch); beyond it every unit is
    saturated and the end pieces extend with a slope below `1e-7`. The
    gradients are those of the interpolant on that grid (the grid's own
    movement with `u` and `b` is not differentiated). `f` is evaluated exactly at the grid points (`[grid_size, K]`,
    with automatic differentiation to its `3K` parameters) and
    `functional.interpolate_table` interpolates it at every score: one
    lookup per score instead of `K` sigmoids, and one weighted histogram in
    the backward pass instead of `K` more (the error bound and measurements
    are in `docs/recipes.md`).
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

    `log p = log_softmax(f(z))` with `z = h W + b` and the learnable,
    increasing pointwise function of eq. 14,

    `f(x) = sum_{k=1..K} v_k sigmoid(u_k x + b_k)`, `u_k, v_k > 0`,

    a one-hidden-layer network with positive weights (Daniels & Velikova,
    2010), a universal approximator of increasing functions. Positivity is
    a reparametrisation: `u_k = softplus(raw_input_weights_k)`,
    `v_k = softplus(raw_output_weights_k)`; the biases `b_k` are free. The
    paper's output bias `b` is left out: softmax is shift-invariant, its
    gradient would always be zero. Being increasing, `f` preserves the
    order of the scores (the argmax); being non-linear it lifts the rank
    bound of Linear-Softmax. `f` is bounded (`0 < f < sum_k v_k`), so the
    ratio of two probabilities is at most `exp(sum_k v_k)`.

    Initialisation: `u_k = 1` and the sigmoid centres `-b_k` at the
    midpoints of `K` equal cells of `[-init_range, init_range]`, with
    `v_k` = the cell width, so that `f(x) ~ x + init_range` (a shifted
    identity, i.e. Linear-Softmax) on that interval, saturating outside.

    Cost: `K` sigmoids per score in the forward pass and `K` more in the
    backward pass (`O(N V K)` time, like MoS; the paper moves to PLIF for
    this reason). Memory: the naive broadcast holds `[N, V, K]` for the
    backward pass; here a custom gradient sums the units one at a time and
    saves only `z`, so the extra memory is `O(N V)` whatever `K`. Measured
    step time and memory relative to `FullSoftmax`
    (`benchmarks/bench_exact_heads.py`) are in `docs/plif.md`.

    Args:
        vocab_size: int, number of words `V` (or omit and pass
            `token_embedding`).
        num_units: int >= 1, the number of hidden units `K` (default 16).
        init_range: float > 0, half-width of the interval on which the
            initial `f` is close to the identity (default 10).
        parameter_scale: float > 0 (default 0.05). The `3K` parameters of
            `f` are stored divided by it (the weights hold `raw / scale`):
            their gradients, and so their share of a global clipping norm,
            are multiplied by it, and an SGD step moves them
            `parameter_scale ** 2` times as far as an unscaled parameter
            (Adam: about `parameter_scale` times). Shared by all `N V`
            scores, these few parameters otherwise get the largest
            gradients of the model: under Zaremba's SGD (clip 0.25 per
            token) they took most of the clipping norm and the backbone
            learned at half speed (`docs/recipes.md`). 1.0 is the plain
            parameterisation (files written before 0.3 load with it).
        grid_size: int >= 2 (default 4096) or None. `f` is evaluated at
            `grid_size` points spanning the interval where it is not flat
            and interpolated linearly at every score
            (`monotonic_mlp_tabulated`: one table lookup per score instead
            of `K` sigmoids, and a histogram instead of `K` more in the
            backward pass). The interpolation error is at most
            `h**2 / 8 * max |f''|` for a grid step `h` (about 2e-6 at
            initialisation, where the grid spans [-26.4, 26.4]). `None` evaluates the
            `K` sigmoids at every score (`monotonic_mlp`; files written
            before 0.3 load with it).
        token_embedding, use_bias, kernel_initializer, bias_initializer,
        return_probabilities, chunk_size: as in `PointwiseSoftmaxHead`.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 log-probabilities `[..., V]`.

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
        if grid_size is not None:
            grid_size = check_int("grid_size", grid_size, minimum=2)
        super().__init__(vocab_size, **kwargs)
        self.grid_size = None if grid_size is None else int(grid_size)
        self.num_units = int(num_units)
        self.init_range = float(init_range)
        self.parameter_scale = float(parameter_scale)

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
