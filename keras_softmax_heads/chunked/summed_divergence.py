"""The summed divergence over token chunks, its gradient taken in the
forward pass: `sum_i w_i D_i` between two output layers.

`chunked.divergence.tiled_divergence` gives the per-token divergence `D_i`
with an exact gradient for any upstream cotangent; its backward pass
recomputes both sides' scores, six `N d V` products where the dense
divergence does four. When the divergence is summed with known weights
(the `"sum"` / `"mean"` reductions), the cotangent of every token is the
one scalar upstream times its weight, so the gradient can be finished in
the forward pass: rows of `token_chunk_size` tokens at a time, each
chunk's scores over the whole vocabulary (`[chunk, V]`, never `[N, V]`),
its divergence, its score gradients (`divergence.score_gradients`), its
rows of `dh` and its term of `dW` (and `db`). Four products, as dense; the
backward pass only scales the stored gradients by the upstream scalar (the
fused linear losses of Liger-Kernel work the same way). The price: a
forward pass whose gradient is not wanted still computes it in a
TensorFlow graph without XLA (under `jax.jit` and `jit_compile=True` XLA
removes the unused work; on PyTorch `dispatch.needs_gradient` skips it:
`docs/results/forward_only/`); `linear_divergence`'s
`gradient_in_forward=False` avoids it everywhere.

Chunks: all of one width (`chunked.tiling.tile_width` of the token count
when it is static: a divisor where there is one); the hidden states and
weights are padded with zero rows (weight 0) to a whole number of chunks,
which also serves a token count known only when the step runs (a `None`
batch dimension in a TensorFlow graph: the chunk count is then a tensor).
Design notes: `docs/distillation.md`.
"""

import keras
from keras import ops

from keras_softmax_heads.chunked import dispatch
from keras_softmax_heads.chunked.core import accumulation_dtype
from keras_softmax_heads.chunked.core import tile_loop
from keras_softmax_heads.chunked.divergence import OutputLayer
from keras_softmax_heads.chunked.divergence import canonical_divergence
from keras_softmax_heads.chunked.divergence import flat_inputs
from keras_softmax_heads.chunked.divergence import log_mixture
from keras_softmax_heads.chunked.divergence import over_tiles
from keras_softmax_heads.chunked.divergence import score_gradients
from keras_softmax_heads.chunked.divergence import shared_vocabulary
from keras_softmax_heads.chunked.divergence import tempered_scores
from keras_softmax_heads.chunked.divergence import upstream_of
from keras_softmax_heads.chunked.divergence import wanted_gradients
from keras_softmax_heads.chunked.platform import ACCELERATOR_TILE_ELEMENTS
from keras_softmax_heads.chunked.tiling import Tiling
from keras_softmax_heads.chunked.tiling import kernel_geometry
from keras_softmax_heads.chunked.tiling import tile_width
from keras_softmax_heads.platforms import current_platform

#: The default chunk holds about this many scores (`[chunk, V]`, float32:
#: 256 MiB a tensor; about three alive under JAX's XLA).
CHUNK_SCORES = 2**26

#: The vocabulary tile width of the kernel gradient's accumulation (CPU).
KERNEL_TILE = 4096


def default_token_chunk(vocab, backend=None, platform="cpu"):
    """The default number of tokens per chunk for `vocab` words on
    `backend` (default: Keras' backend) and `platform`. On a CPU
    `CHUNK_SCORES // vocab`, half that on TensorFlow (whose XLA keeps the
    exponentials of the log-sum-exps as buffers of their own: four
    `[chunk, V]` tensors alive, not three); on a GPU / TPU
    `chunked.platform.ACCELERATOR_TILE_ELEMENTS // vocab` (the tiled pass's
    accelerator tile: few, large chunks, one kernel launch per product
    instead of hundreds); at least 1. Measured (CPU):
    `docs/results/distillation/`.

    >>> default_token_chunk(131072, "jax"), default_token_chunk(131072, "tensorflow")
    (512, 256)
    >>> default_token_chunk(256000, "jax", platform="gpu")
    1048
    """
    if platform != "cpu":
        return max(1, ACCELERATOR_TILE_ELEMENTS // vocab)
    scores = CHUNK_SCORES
    if (backend or keras.backend.backend()) == "tensorflow":
        scores //= 2
    return max(1, scores // vocab)


def kernel_tile_width(vocab, platform="cpu"):
    """The words per product of a chunk's kernel-gradient term `h^T dz`:
    `KERNEL_TILE` on a CPU (added into place tile by tile: no `[d, V]`
    temporary), the whole vocabulary on a GPU / TPU (one product per
    chunk).

    >>> kernel_tile_width(50257), kernel_tile_width(50257, platform="tpu")
    (4096, 50257)
    """
    return KERNEL_TILE if platform == "cpu" else vocab


class Side:
    """One output layer's tensors inside the custom gradient, in the
    accumulation dtype where the product needs it; `gradients`: whether
    its hidden states and kernel get gradients (`dispatch.needs_gradient`:
    the products of one nobody asks for are skipped)."""

    def __init__(self, layer, acc, pad, kernel_tile=KERNEL_TILE, gradients=(True, True)):
        self.hidden_gradient, self.kernel_gradient = (bool(g) for g in gradients)
        self.d, self.vocab = kernel_geometry(layer.hidden, layer.kernel,
                                             layer.kernel_transposed)
        self.low_matmul = dispatch.low_precision_matmul(layer.hidden, layer.kernel)
        self.product = self.low_matmul or dispatch.matmul_fn(acc)
        hidden = layer.hidden if self.low_matmul else ops.cast(layer.hidden, acc)
        self.hidden = padded(hidden, pad)
        self.kernel = layer.kernel if self.low_matmul else ops.cast(layer.kernel, acc)
        self.bias = None if layer.bias is None else ops.cast(layer.bias, acc)
        self.transposed = layer.kernel_transposed
        self.cap = layer.soft_cap
        self.acc = acc
        self.tiling = Tiling.of(self.vocab, kernel_tile)
        self.tail_keep = None
        if self.tiling.overlap:
            keep = (self.tiling.tail_mask() == 0).astype("float32")
            self.tail_keep = ops.convert_to_tensor(keep, acc)

    def rows(self, start, size):
        return ops.slice(self.hidden, [start, 0], [size, self.d])

    def scores(self, h, inv_t):
        """`(g, dg/dz)` of a chunk: `g(h W + b) / T` `[size, V]` and the
        derivative (a scalar without a soft cap)."""
        kernel = ops.transpose(self.kernel) if self.transposed else self.kernel
        z = self.product(h, kernel)
        if self.bias is not None:
            z = z + self.bias
        return tempered_scores(z, self.cap, inv_t)

    def gradients(self, h, dz, state, start):
        """`state = (dh, dkernel, dbias)` after a chunk's score gradient
        `dz` `[size, V]`: its `dh` rows written, its kernel / bias terms
        added."""
        dh, dkernel, dbias = state
        if self.hidden_gradient:
            if self.transposed:  # kernel [V, d]
                dh_rows = self.product(dz, self.kernel)
            else:
                dh_rows = self.product(dz, ops.transpose(self.kernel))
            dh = dispatch.update_slice(dh, [start, 0], dh_rows)
        if self.kernel_gradient:
            dkernel = self.add_kernel_gradient(dkernel, h, dz)
        if self.bias is not None:
            dbias = dbias + ops.sum(dz, axis=0)
        return dh, dkernel, dbias

    def add_kernel_gradient(self, dkernel, h, dz):
        """`dkernel + h^T dz` (transposed: `+ dz^T h`), added one vocabulary
        tile (`self.tiling`) at a time into place: no `[d, V]` temporary."""
        size = self.tiling.size
        rows = ops.shape(h)[0]

        def add(start, mask, dk):
            dz_tile = ops.slice(dz, [0, start], [rows, size])
            if mask is not None:  # the tail tile's columns of its neighbour
                dz_tile = dz_tile * mask
            if self.transposed:
                begin, term = [start, 0], self.product(ops.transpose(dz_tile), h)
            else:
                begin, term = [0, start], self.product(ops.transpose(h), dz_tile)
            return dispatch.add_to_slice(dk, begin, term)

        return over_tiles(self.tiling, self.tail_keep, add, dkernel)

    def zeros(self, implementation):
        """The zero gradient buffers of the (padded) hidden states, the
        kernel and the bias (a scalar for one without a gradient, or no
        bias: loops carry no None)."""
        dbias = ops.zeros((self.vocab,) if self.bias is not None else (), self.acc)
        dh = dkernel = ops.zeros((), self.acc)
        if self.hidden_gradient:
            dh = dispatch.zeros_like(self.hidden, self.acc, implementation)
        if self.kernel_gradient:
            dkernel = dispatch.zeros_like(self.kernel, self.acc, implementation)
        return dh, dkernel, dbias

    def scaled(self, u, grads, inputs):
        """`u` times the gradients of `inputs` (`hidden, kernel[, bias]`) in
        their dtypes, None for one without a gradient (zip drops the scalar
        bias placeholder of a side without a bias)."""
        wanted = (self.hidden_gradient, self.kernel_gradient, True)
        return [ops.cast(u * g, x.dtype) if keep else None
                for g, x, keep in zip(grads, inputs, wanted)]


def padded(x, pad):
    """`x` with `pad` (an int or a scalar tensor) zero rows appended."""
    if isinstance(pad, int) and pad == 0:
        return x
    return ops.pad(x, [[0, pad]] + [[0, 0]] * (len(x.shape) - 1))


def unpadded(x, n):
    """The first `n` rows of `x`."""
    return ops.slice(x, [0] * len(x.shape), [n] + list(x.shape[1:]))


def unpadded_rows(grads, n):
    """`(dh, dkernel, dbias)` with `dh` cut to its first `n` rows (`()`
    stays `()`, and so does a scalar placeholder `dh`)."""
    if not grads or len(grads[0].shape) == 0:
        return grads
    return (unpadded(grads[0], n), *grads[1:])


class TokenChunks:
    """The chunks of `n` tokens (an int, or a scalar tensor when unknown
    until the step runs): `size` (static), `count` and `pad` (ints, or
    tensors), `count * size = n + pad`; `kernel_tile`, the words per
    product of a chunk's kernel-gradient term (`kernel_tile_width`)."""

    def __init__(self, n, chunk_size, kernel_tile=KERNEL_TILE):
        self.n = n
        if isinstance(n, int):
            self.size = tile_width(n, chunk_size)
            self.count = -(-n // self.size)
        else:
            self.size = chunk_size
            self.count = (n + chunk_size - 1) // chunk_size
        self.pad = self.count * self.size - n
        self.kernel_tile = kernel_tile

    @classmethod
    def of(cls, hidden, vocab, token_chunk_size=None, components=1):
        """The chunks of `hidden`'s rows `[N, ...]` for `vocab` words: at
        most `token_chunk_size` tokens (default `default_token_chunk`, over
        `components` score rows a token: a mixture's `K`) and the kernel
        tile, both for the platform that computes `hidden`."""
        n = hidden.shape[0]
        if n is None:
            n = ops.shape(hidden)[0]
        platform = current_platform(hidden)
        default = max(1, default_token_chunk(vocab, platform=platform) // components)
        return cls(n, token_chunk_size or default, kernel_tile_width(vocab, platform))


def float_weights(weights, acc):
    """`weights` as a tensor, cast to `acc` unless already floating."""
    weights = ops.convert_to_tensor(weights)
    if keras.backend.standardize_dtype(weights.dtype) not in ("float16", "bfloat16",
                                                              "float32", "float64"):
        weights = ops.cast(weights, acc)
    return weights


def normaliser_and_exponentials(s, shards=None):
    """`(lse, e, total)` of a chunk's scores `s` `[rows, V]` with one `exp`
    pass: `e = exp(s - max_v s)`, `total = sum_v e`, `lse = max_v s +
    log(total)` (`logsumexp(s)`), so that the softmax is `e / total` and a
    row's gradient scale folds in `1 / total`. `ops.logsumexp` followed by
    `exp(s - lse)` runs the exponential twice (and, eagerly, two more
    passes): MoS(4)'s per-chunk work took about 1.3x this form's on a CPU,
    its Keras step up to 1.05x (`docs/chunked.md`, "One exponential pass").
    The scores are finite (a row's maximum is a real score). `e` is the
    caller's to overwrite (`dispatch.scaled_minus_target`). With `shards`
    (`summed_cross_entropy`) `s` is one device's columns of the vocabulary:
    the maximum and the sum are the shards' (`shards.max`, `shards.sum`),
    `e` this device's columns."""
    peak = ops.max(s, axis=1)
    if shards is not None:
        peak = shards.max(peak)
    e = dispatch.shifted_exp(s, peak)
    total = ops.sum(e, axis=1)
    if shards is not None:
        total = shards.sum(total)
    return peak + ops.log(total), e, total


def target_scores(s, targets, shards=None):
    """`(targets, score, inside)` of a chunk's scores `s` `[rows, V]` and
    its target ids `[rows]`: the ids to write the target's gradient at,
    each row's target score, and (with `shards`) which rows' target is this
    shard's (None without). With `shards` `s` is one device's columns and
    `targets` are shifted into them, negative for another shard's word:
    those read column 0 (`local_to_shard` zeroes what they write) and the
    score is the shards' sum, given by the shard that holds the target."""
    inside = None
    if shards is not None:
        inside = targets >= 0
        targets = ops.where(inside, targets, ops.zeros_like(targets))
    score = ops.take_along_axis(s, targets[:, None], axis=1)[:, 0]
    if shards is not None:
        score = shards.sum(local_to_shard(score, inside))
    return targets, score, inside


def local_to_shard(x, inside):
    """`x` `[rows]` where the row's target is this shard's (`inside`, from
    `target_scores`), 0 elsewhere; `x` itself on one device (None)."""
    return x if inside is None else ops.where(inside, x, ops.zeros_like(x))


def chunk_divergence(divergence, beta, s, t, teacher_gradient, shards=None):
    """`(D, ds, dt)` of a chunk's scores `s` (student), `t` (teacher)
    `[size, V]`: the per-token divergence `[size]` and its gradients with
    respect to `s` and `t` (`dt` None without `teacher_gradient`).

    The KLs are written from the log-sum-exps so that XLA keeps three
    `[size, V]` buffers alive (`s`, the weighting side's probabilities,
    the gradient), not the log-probabilities too:
    `KL(p || q) = sum_v p_v (t_v - s_v) + lse_s - lse_t`. The one-pass
    softmax of the cross-entropy (`normaliser_and_exponentials`) does not
    pay here: XLA then keeps the exponentials as buffers of their own, JAX's
    compiled temporaries of the mean forward KL at N = 4,096, d = 1,024,
    V = 131,072 grew from 770 to 1,282 MiB (1,026 MiB with one side's
    exponentials only), past the tenth of the dense KL's that
    `docs/distillation.md` holds it to.

    With `shards` (`summed_divergence`) `s` and `t` are one device's
    columns of the vocabulary: the log-sum-exps and the row sums are the
    shards' (`shards.logsumexp`, `shards.sum`), the gradients this
    device's columns."""
    if shards is None:
        lse_s = ops.logsumexp(s, axis=-1, keepdims=True)
        lse_t = ops.logsumexp(t, axis=-1, keepdims=True)

        def row_sum(x):
            return ops.sum(x, axis=1)
    else:
        lse_s, lse_t = shards.logsumexp(s), shards.logsumexp(t)

        def row_sum(x):
            return shards.sum(ops.sum(x, axis=1))
    if divergence == "jsd":
        log_q, log_p = s - lse_s, t - lse_t
        q, p = ops.exp(log_q), ops.exp(log_p)
        log_m = log_mixture(log_p, log_q, beta)
        kls = {"kl_p": row_sum(p * (log_p - log_m)),
               "kl_q": row_sum(q * (log_q - log_m))}
        ds, dt = score_gradients(divergence, beta, log_q, log_p, q, p, kls)
        return beta * kls["kl_p"] + (1.0 - beta) * kls["kl_q"], ds, dt
    if divergence == "forward_kl":  # (on PyTorch written in place: `dispatch`)
        p = dispatch.shifted_exp(t, lse_t[:, 0])
        kl = row_sum(p * (t - s)) + (lse_s - lse_t)[:, 0]
        ds = dispatch.subtract(dispatch.shifted_exp(s, lse_s[:, 0]), p)
        dt = None
        if teacher_gradient:
            dt = p * ((t - lse_t) - (s - lse_s) - kl[:, None])
        return kl, ds, dt
    q = dispatch.shifted_exp(s, lse_s[:, 0])  # reverse KL(q || p)
    kl = row_sum(q * (s - t)) + (lse_t - lse_s)[:, 0]
    ds = q * ((s - lse_s) - (t - lse_t) - kl[:, None])
    dt = dispatch.subtract(dispatch.shifted_exp(t, lse_t[:, 0]), q) if teacher_gradient else None
    return kl, ds, dt


def summed_divergence(student, teacher, weights, divergence="forward_kl", *,
                      beta=0.5, temperature=1.0, token_chunk_size=None,
                      teacher_gradient=False, implementation="auto", shards=None,
                      return_per_token=False):
    """`sum_i w_i D_i` and its gradient, over chunks of tokens.

    The core behind `linear_divergence`'s `"sum"` / `"mean"` reductions
    (which checks the arguments). `student`, `teacher`, `divergence`,
    `beta`, `temperature`, `teacher_gradient` and `implementation` are
    `tiled_divergence`'s; `weights` `[N]` float (0: the token is left out;
    its gradient is `D`).
    At most `token_chunk_size` tokens (default `default_token_chunk(V)`)
    are scored over the whole vocabulary at a time; the gradients are
    computed in the forward pass (the module docstring).

    `shards` (None: one device): both sides' kernels and biases are one
    device's columns of a vocabulary split over devices, inside a
    `jax.shard_map` (`chunked.vocab_parallel.vocab_parallel_divergence`):
    the per-token log-sum-exps and sums are combined across the shards
    (`shards.logsumexp`, `shards.sum`), the returned sum is the whole
    vocabulary's, the gradients this device's share, as in
    `chunked.summed_cross_entropy`. `return_per_token=True` also returns
    the per-token divergences `[N]` (no gradient of their own: the sum
    carries it; `chunked.vocab_parallel.token_losses`).

    Returns:
        A scalar, float32 (float64 for float64 inputs); with
        `return_per_token=True` the pair `(sum, per_token)`.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> rng = np.random.default_rng(0)
    >>> student = [rng.normal(size=s).astype("float32") for s in [(5, 8), (8, 50)]]
    >>> teacher = [rng.normal(size=s).astype("float32") for s in [(5, 16), (16, 50)]]
    >>> weights = np.array([1.0, 0.5, 0.0, 2.0, 1.0], "float32")
    >>> total = summed_divergence(OutputLayer(*student), OutputLayer(*teacher), weights,
    ...                           "reverse_kl", token_chunk_size=2)
    >>> log_q = ops.convert_to_numpy(ops.log_softmax(student[0] @ student[1]))
    >>> log_p = ops.convert_to_numpy(ops.log_softmax(teacher[0] @ teacher[1]))
    >>> reverse_kl = (np.exp(log_q) * (log_q - log_p)).sum(-1)
    >>> bool(np.isclose(float(total), (weights * reverse_kl).sum(), rtol=1e-4))
    True
    """
    divergence, beta = canonical_divergence(divergence, beta)
    vocab = shared_vocabulary(student, teacher)
    chunks = TokenChunks.of(student.hidden, vocab, token_chunk_size)
    n = chunks.n
    acc = accumulation_dtype(student.hidden, student.kernel, teacher.hidden, teacher.kernel)
    inv_t = 1.0 / temperature
    s_bias, t_bias = student.bias is not None, teacher.bias is not None
    s_args, t_args = flat_inputs(student, teacher, teacher_gradient)
    n_s = len(s_args)
    gradients = wanted_gradients(s_args, t_args, teacher_gradient)

    @ops.custom_gradient
    def summed_fn(weights, *args):
        s = Side(OutputLayer(args[0], args[1], args[2] if s_bias else None,
                             student.kernel_transposed, student.soft_cap), acc, chunks.pad,
                 chunks.kernel_tile, gradients[0])
        t = Side(OutputLayer(args[n_s], args[n_s + 1], args[n_s + 2] if t_bias else None,
                             teacher.kernel_transposed, teacher.soft_cap), acc, chunks.pad,
                 chunks.kernel_tile, gradients[1])
        w_all = padded(ops.cast(weights, acc), chunks.pad)

        def body(i, state):
            total, per_token, s_state, t_state = state
            start = i * chunks.size
            h_s, h_t = s.rows(start, chunks.size), t.rows(start, chunks.size)
            g_s, d_s = s.scores(h_s, inv_t)
            g_t, d_t = t.scores(h_t, inv_t)
            value, ds, dt = chunk_divergence(divergence, beta, g_s, g_t, teacher_gradient,
                                             shards)
            w = ops.slice(w_all, [start], [chunks.size])
            # A weight-0 token (padding too) adds nothing, even a non-finite
            # divergence.
            total = total + ops.sum(ops.where(w != 0, w * value, ops.zeros_like(value)))
            per_token = ops.slice_update(per_token, [start], value)
            s_state = s.gradients(h_s, dispatch.multiply(ds, w[:, None] * d_s), s_state, start)
            if teacher_gradient:
                t_state = t.gradients(h_t, dispatch.multiply(dt, w[:, None] * d_t), t_state,
                                      start)
            return total, per_token, s_state, t_state

        def forward():
            state = (ops.zeros((), acc), ops.zeros_like(w_all), s.zeros(implementation),
                     t.zeros(implementation) if teacher_gradient else ())
            # `chunks.count` is a tensor when `N` is known only when the step runs.
            total, per_token, s_grads, t_grads = tile_loop(chunks.count, body, state)
            # Without the padding rows.
            return (total, unpadded(per_token, n), unpadded_rows(s_grads, n),
                    unpadded_rows(t_grads, n))

        total, per_token, s_grads, t_grads = dispatch.run_pass(forward, implementation)

        def grad_fn(*args, upstream=None, variables=None):
            u = upstream_of(args, upstream, variables, "summed_divergence")
            u = ops.cast(u[0] if return_per_token else u, acc)
            # Under `shards` each device receives its share of `u`
            # (`chunked.summed_cross_entropy`).
            u_all = u if shards is None else shards.sum(u)
            s_out = s.scaled(u_all, s_grads, s_args)
            t_out = (t.scaled(u_all, t_grads, t_args) if teacher_gradient
                     else [None] * len(t_args))
            return (ops.cast(u * per_token, weights.dtype), *s_out, *t_out)

        if return_per_token:  # one output: the sum, then the per-token divergences
            return ops.concatenate([total[None], per_token]), grad_fn
        return total, grad_fn

    out = summed_fn(float_weights(weights, acc), *(s_args + t_args))
    if not return_per_token:
        return out
    return out[0], ops.stop_gradient(out[1:])
