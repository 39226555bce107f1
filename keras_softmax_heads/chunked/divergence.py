"""The tiled divergence core: KL / generalised JSD between two output layers
without the `[N, V]` logits of either.

A student `(h_s [N, d_s], W_s, b_s)` and a teacher `(h_t [N, d_t], W_t,
b_t)` over the same `V` words; per tile of the vocabulary (`chunked.tiling`,
the tile loop and `linear_tile` of `chunked.core`):

    s = g_s(h_s W_s + b_s) / T,   t = g_t(h_t W_t + b_t) / T,

`g` the identity or a soft cap `cap * tanh(z / cap)` (per side),
`q = softmax(s)` (student), `p = softmax(t)` (teacher), per token:

* `"forward_kl"`: `KL(p || q) = sum_v p_v (log p_v - log q_v)`;
* `"reverse_kl"`: `KL(q || p)`;
* `"jsd"` (generalised Jensen-Shannon, Liger's / TRL's convention):
  `beta KL(p || m) + (1 - beta) KL(q || m)`, `m = beta p + (1 - beta) q`.
  At `beta = 0` it is `KL(p || q)` and at `beta = 1` `KL(q || p)` (TRL's
  `generalized_jsd_loss` and Liger's `LigerJSD`: the formula itself would
  vanish there).

Passes (`dispatch.run_pass`): the KLs take one forward pass (online
log-sum-exps of both sides and a rescaled running `sum_v a_v (a_v - b_v)`,
`a` the weighting side); the JSD two (the log-sum-exps, then the two KLs to
the mixture). The backward pass recomputes each tile and applies the exact
per-token cotangent:

    dKL(p||q)/ds = q - p,                 dKL(p||q)/dt = p (log p - log q - KL)
    dJSD/ds = (1-beta) q (log q - log m - KL(q||m))
    dJSD/dt = beta p (log p - log m - KL(p||m))

times `g'(z) / T`, then `dh += dz W_tile^T` and the tile's kernel / bias
gradient columns, for the student always and for the teacher only with
`teacher_gradient=True`. Float32 accumulation (float64 for float64 inputs).
Design notes: `docs/distillation.md`.
"""

import math
from typing import NamedTuple

from keras import ops

from keras_softmax_heads.chunked import dispatch
from keras_softmax_heads.chunked.core import CoreSpec
from keras_softmax_heads.chunked.core import TileProblem
from keras_softmax_heads.chunked.core import accumulation_dtype
from keras_softmax_heads.chunked.core import linear_tile
from keras_softmax_heads.chunked.core import project_tile_gradient
from keras_softmax_heads.chunked.core import projection_gradients
from keras_softmax_heads.chunked.core import tile_loop
from keras_softmax_heads.chunked.core import zero_gradients
from keras_softmax_heads.chunked.tiling import Tiling
from keras_softmax_heads.chunked.tiling import kernel_geometry

#: The divergences of `tiled_divergence`.
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


class OutputLayer(NamedTuple):
    """One side of a divergence: scores `g(hidden @ kernel + bias)`.

    Attributes:
        hidden: `[N, d]` float tensor.
        kernel: `[d, V]`, or `[V, d]` with `kernel_transposed`.
        bias: `[V]` or None.
        kernel_transposed: bool.
        soft_cap: None or a positive float (`g(z) = cap * tanh(z / cap)`).
    """

    hidden: object
    kernel: object
    bias: object = None
    kernel_transposed: bool = False
    soft_cap: object = None


def _problem(layer, tiling, acc, gradients=(True, True)):
    """The `chunked.core.TileProblem` of one side (no transform: the soft
    cap and the temperature are applied here, after `linear_tile`);
    `gradients`: whether its hidden states and kernel get gradients."""
    d, _ = kernel_geometry(layer.hidden, layer.kernel, layer.kernel_transposed)
    spec = CoreSpec(
        d=d, tiling=tiling, acc=acc,
        low_matmul=dispatch.low_precision_matmul(layer.hidden, layer.kernel),
        transform_fn=None, variables=[], kernel_transposed=layer.kernel_transposed,
        has_bias=layer.bias is not None, stats=False, gradients=gradients,
    )
    return TileProblem(spec, layer.hidden, layer.kernel, layer.bias, None, [])


def tempered_scores(z, cap, inv_t, derivative=True):
    """`(g, dg/dz)`: `g = z / T` or, with a soft cap, `cap tanh(z / cap) /
    T` (`inv_t = 1 / T`), and its derivative (a scalar without a cap; None
    with a cap unless `derivative`)."""
    if cap is None:
        return (z * inv_t if inv_t != 1.0 else z), inv_t
    y = ops.tanh(z / cap)
    deriv = (1.0 - ops.square(y)) * inv_t if derivative else None
    return y * (cap * inv_t), deriv


class Pair:
    """Both sides' tile problems and the scores' options (built inside the
    custom-gradient function from its arguments); `gradients`: each side's
    `(hidden, kernel)` flags (`dispatch.needs_gradient`)."""

    def __init__(self, student, teacher, caps, temperature, tiling, acc,
                 gradients=((True, True), (True, True))):
        self.s = _problem(student, tiling, acc, gradients[0])
        self.t = _problem(teacher, tiling, acc, gradients[1])
        self.caps = caps
        self.inv_t = 1.0 / temperature
        self.tiling = tiling
        self.acc = acc

    def scores(self, p, cap, start, mask, derivative=False):
        """`(g, gm, w, dg/dz)` of one side's tile: the scores `g(z) / T`,
        the same with `mask` (`-inf` on masked columns; for maxima and
        exponentials), the kernel tile and, on request, the derivative."""
        z, w = linear_tile(p, start, None)
        g, deriv = tempered_scores(z, cap, self.inv_t, derivative)
        gm = g if mask is None else g + mask
        return g, gm, w, deriv

    def both(self, start, mask, derivative=False):
        return (self.scores(self.s, self.caps[0], start, mask, derivative),
                self.scores(self.t, self.caps[1], start, mask, derivative))


def _online(run_max, run_sum, gm):
    """One online log-sum-exp step: `(new_max, scale, e, new_sum)`, `e` the
    tile's `exp(gm - new_max)` and `scale = exp(run_max - new_max)`."""
    tile_max = ops.max(gm, axis=1)
    # Not `ops.maximum`: Keras' PyTorch backend returns float32 for it.
    new_max = ops.where(tile_max > run_max, tile_max, run_max)
    scale = ops.exp(run_max - new_max)
    e = ops.exp(gm - new_max[:, None])
    return new_max, scale, e, run_sum * scale + ops.sum(e, axis=1)


def over_tiles(tiling, tail_mask, body, state):
    """`state = body(start, mask, state)` over the tiles of `tiling`, in
    `chunked.tiling`'s order: the tail tile first with `tail_mask` (if the
    tiling has one), then the full tiles with None."""
    if tiling.overlap:
        state = body(tiling.tail_start, tail_mask, state)
    return tile_loop(
        tiling.num_full, lambda i, st: body(i * tiling.size, None, st), state
    )


def _over_tiles(pair, body, state):
    """`over_tiles` of a pair's vocabulary tiles (the student's `-inf`
    tail mask)."""
    return over_tiles(pair.tiling, pair.s.tail_mask, body, state)


def _initial(pair, count):
    n = ops.shape(pair.s.h)[0]
    minus_inf = ops.full((n,), float("-inf"), dtype=pair.acc)
    zeros = ops.zeros((n,), dtype=pair.acc)
    return (minus_inf, zeros, minus_inf, zeros) + (zeros,) * count


def kl_forward(pair, teacher_weighted):
    """One pass: `(kl, lse_s, lse_t)`, `kl = KL(p || q)` with
    `teacher_weighted`, else `KL(q || p)`, all `[N]`."""

    def body(start, mask, state):
        m_s, sum_s, m_t, sum_t, acc = state
        (g_s, gm_s, _, _), (g_t, gm_t, _, _) = pair.both(start, mask)
        m_s, scale_s, e_s, sum_s = _online(m_s, sum_s, gm_s)
        m_t, scale_t, e_t, sum_t = _online(m_t, sum_t, gm_t)
        if teacher_weighted:
            acc = acc * scale_t + ops.sum(e_t * (g_t - g_s), axis=1)
        else:
            acc = acc * scale_s + ops.sum(e_s * (g_s - g_t), axis=1)
        return m_s, sum_s, m_t, sum_t, acc

    m_s, sum_s, m_t, sum_t, acc = _over_tiles(pair, body, _initial(pair, 1))
    lse_s = m_s + ops.log(sum_s)
    lse_t = m_t + ops.log(sum_t)
    if teacher_weighted:
        return acc / sum_t - lse_t + lse_s, lse_s, lse_t
    return acc / sum_s - lse_s + lse_t, lse_s, lse_t


def log_mixture(log_p, log_q, beta):
    """`log(beta p + (1 - beta) q)`, stable."""
    a = log_p + math.log(beta)
    b = log_q + math.log(1.0 - beta)
    top = ops.where(a > b, a, b)
    return top + ops.log1p(ops.exp(-ops.abs(a - b)))


def jsd_forward(pair, beta):
    """Two passes: `(kl_p, kl_q, lse_s, lse_t)`, `kl_p = KL(p || m)`,
    `kl_q = KL(q || m)`, `m = beta p + (1 - beta) q`, all `[N]`."""

    def lse_body(start, mask, state):
        m_s, sum_s, m_t, sum_t = state
        (_, gm_s, _, _), (_, gm_t, _, _) = pair.both(start, mask)
        m_s, _, _, sum_s = _online(m_s, sum_s, gm_s)
        m_t, _, _, sum_t = _online(m_t, sum_t, gm_t)
        return m_s, sum_s, m_t, sum_t

    m_s, sum_s, m_t, sum_t = _over_tiles(pair, lse_body, _initial(pair, 0))
    lse_s = m_s + ops.log(sum_s)
    lse_t = m_t + ops.log(sum_t)

    def kl_body(start, mask, state):
        kl_p, kl_q = state
        (g_s, gm_s, _, _), (g_t, gm_t, _, _) = pair.both(start, mask)
        log_q, log_p = g_s - lse_s[:, None], g_t - lse_t[:, None]
        log_m = log_mixture(log_p, log_q, beta)
        q = ops.exp(gm_s - lse_s[:, None])
        p = ops.exp(gm_t - lse_t[:, None])
        return (kl_p + ops.sum(p * (log_p - log_m), axis=1),
                kl_q + ops.sum(q * (log_q - log_m), axis=1))

    zeros = ops.zeros_like(lse_s)
    kl_p, kl_q = _over_tiles(pair, kl_body, (zeros, zeros))
    return kl_p, kl_q, lse_s, lse_t


def score_gradients(divergence, beta, log_q, log_p, q, p, kls):
    """`(ds, dt)`: the per-token divergence's gradients with respect to the
    student's and the teacher's (tempered, capped) scores, `[N, size]`.
    `log_q`, `log_p`, `q`, `p` are the two sides' log-probabilities and
    probabilities on a tile (or the whole vocabulary); `kls` the per-token
    KLs `[N]`: `kls["kl"]` for the KLs, `kls["kl_p"]` and `kls["kl_q"]`
    (`KL(p || m)`, `KL(q || m)`) for the JSD."""
    if divergence == "forward_kl":
        return q - p, p * (log_p - log_q - kls["kl"][:, None])
    if divergence == "reverse_kl":
        return q * (log_q - log_p - kls["kl"][:, None]), p - q
    log_m = log_mixture(log_p, log_q, beta)
    return ((1.0 - beta) * q * (log_q - log_m - kls["kl_q"][:, None]),
            beta * p * (log_p - log_m - kls["kl_p"][:, None]))


def canonical_divergence(divergence, beta):
    """`(divergence, beta)` with the JSD at `beta` 0 / 1 named as the
    forward / reverse KL it equals."""
    if divergence == "jsd" and beta == 0.0:
        return "forward_kl", 0.0
    if divergence == "jsd" and beta == 1.0:
        return "reverse_kl", 1.0
    return divergence, float(beta)


def backward(pair, divergence, beta, residuals, upstream, teacher_gradient):
    """The gradients of the student's `(h, kernel[, bias])` and, with
    `teacher_gradient`, the teacher's, in their dtypes."""
    u = ops.cast(upstream, pair.acc)[:, None]
    lse_s, lse_t = residuals["lse_s"][:, None], residuals["lse_t"][:, None]

    def body(start, mask, state):
        (g_s, gm_s, w_s, d_s), (g_t, gm_t, w_t, d_t) = pair.both(start, mask, True)
        log_q, log_p = g_s - lse_s, g_t - lse_t
        q, p = ops.exp(gm_s - lse_s), ops.exp(gm_t - lse_t)
        ds, dt = score_gradients(divergence, beta, log_q, log_p, q, p, residuals)
        state = list(state)
        state[0] = project_tile_gradient(pair.s, ds * (u * d_s), w_s, start, *state[0])
        if teacher_gradient:
            state[1] = project_tile_gradient(pair.t, dt * (u * d_t), w_t, start, *state[1])
        return tuple(state)

    state = (zero_gradients(pair.s), zero_gradients(pair.t) if teacher_gradient else ())
    state = _over_tiles(pair, body, state)
    return (projection_gradients(pair.s, *state[0]),
            projection_gradients(pair.t, *state[1]) if teacher_gradient else None)


def shared_vocabulary(student, teacher):
    """The `V` of two `OutputLayer`s, which must be the same."""
    _, vocab = kernel_geometry(student.hidden, student.kernel, student.kernel_transposed)
    _, vocab_t = kernel_geometry(teacher.hidden, teacher.kernel, teacher.kernel_transposed)
    if vocab_t != vocab:
        raise ValueError(
            "The student and the teacher must score the same vocabulary. "
            f"Received: student V={vocab}, teacher V={vocab_t}"
        )
    return vocab


def flat_inputs(student, teacher, teacher_gradient):
    """`(s_args, t_args)`: each side's `[hidden, kernel(, bias)]`, the
    teacher's under `stop_gradient` unless `teacher_gradient`."""
    s_args = [student.hidden, student.kernel] + (
        [student.bias] if student.bias is not None else [])
    t_args = [teacher.hidden, teacher.kernel] + (
        [teacher.bias] if teacher.bias is not None else [])
    if not teacher_gradient:
        t_args = [ops.stop_gradient(x) for x in t_args]
    return s_args, t_args


def wanted_gradients(s_args, t_args, teacher_gradient):
    """`((student hidden, kernel), (teacher hidden, kernel))`: which of
    them get gradients (`dispatch.needs_gradient`; the teacher's only with
    `teacher_gradient`)."""
    teacher = dispatch.gradients_needed(*t_args[:2]) if teacher_gradient else (False, False)
    return dispatch.gradients_needed(*s_args[:2]), teacher


def upstream_of(args, upstream, variables, name):
    """The upstream cotangent a custom gradient's `grad_fn` received:
    TensorFlow and JAX call `grad_fn(upstream)`, PyTorch
    `grad_fn(*inputs, upstream=upstream)`. Raises for variables read
    inside (`name`: the caller, for the message)."""
    if variables:
        raise ValueError(
            f"{name} read variables it was not given: {[v.name for v in variables]}"
        )
    if upstream is None:
        (upstream,) = args
    return upstream


def tiled_divergence(student, teacher, divergence="forward_kl", *, beta=0.5,
                     temperature=1.0, chunk_size=4096, teacher_gradient=False,
                     implementation="auto"):
    """Per-token divergence between two output layers, tiled over `V`.

    The flat core behind `fused.linear_divergence` (which checks the
    arguments and reduces). `student` and `teacher` are `OutputLayer`s with
    `hidden` `[N, d_s]` / `[N, d_t]` and kernels over the same `V`;
    `divergence` one of `DIVERGENCES` (`"jsd"` with `beta` 0 or 1 is the
    forward / reverse KL); `temperature > 0` divides both sides' (capped)
    scores. No `[N, V]` tensor is formed; the gradient is exact per token
    (the upstream cotangent is applied in the backward pass) and reaches the
    student's hidden states, kernel and bias, and the teacher's only with
    `teacher_gradient=True` (else the teacher's inputs are under
    `stop_gradient`). `implementation` picks how the passes run
    (`dispatch.run_pass`). See `docs/distillation.md`.

    Returns:
        `[N]` divergences, float32 (float64 for float64 inputs).

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> rng = np.random.default_rng(0)
    >>> h_s, w_s = rng.normal(size=(4, 8)), rng.normal(size=(8, 50))
    >>> h_t, w_t = rng.normal(size=(4, 16)), rng.normal(size=(16, 50))
    >>> kl = tiled_divergence(OutputLayer(h_s.astype("float32"), w_s.astype("float32")),
    ...                       OutputLayer(h_t.astype("float32"), w_t.astype("float32")),
    ...                       chunk_size=16)
    >>> log_q = ops.convert_to_numpy(ops.log_softmax(h_s @ w_s, axis=-1))
    >>> log_p = ops.convert_to_numpy(ops.log_softmax(h_t @ w_t, axis=-1))
    >>> dense = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    >>> bool(np.allclose(ops.convert_to_numpy(kl), dense, rtol=1e-4))
    True
    """
    divergence, beta = canonical_divergence(divergence, beta)
    tiling = Tiling.of(shared_vocabulary(student, teacher), chunk_size)
    acc = accumulation_dtype(student.hidden, student.kernel, teacher.hidden, teacher.kernel)
    caps = (student.soft_cap, teacher.soft_cap)
    s_bias, t_bias = student.bias is not None, teacher.bias is not None
    s_args, t_args = flat_inputs(student, teacher, teacher_gradient)
    n_s = len(s_args)
    gradients = wanted_gradients(s_args, t_args, teacher_gradient)

    @ops.custom_gradient
    def divergence_fn(*args):
        s = OutputLayer(args[0], args[1], args[2] if s_bias else None,
                        student.kernel_transposed, caps[0])
        t = OutputLayer(args[n_s], args[n_s + 1], args[n_s + 2] if t_bias else None,
                        teacher.kernel_transposed, caps[1])
        pair = Pair(s, t, caps, temperature, tiling, acc, gradients)

        def forward():
            if divergence == "jsd":
                kl_p, kl_q, lse_s, lse_t = jsd_forward(pair, beta)
                res = {"kl_p": kl_p, "kl_q": kl_q, "lse_s": lse_s, "lse_t": lse_t}
                return beta * kl_p + (1.0 - beta) * kl_q, res
            kl, lse_s, lse_t = kl_forward(pair, divergence == "forward_kl")
            return kl, {"kl": kl, "lse_s": lse_s, "lse_t": lse_t}

        out, residuals = dispatch.run_pass(forward, implementation)

        def grad_fn(*args, upstream=None, variables=None):
            upstream = upstream_of(args, upstream, variables, "tiled_divergence")
            s_grads, t_grads = dispatch.run_pass(
                lambda: backward(pair, divergence, beta, residuals, upstream,
                                 teacher_gradient),
                implementation,
            )
            if t_grads is None:
                t_grads = [None] * (len(args_all) - n_s)
            return (*s_grads, *t_grads)

        return out, grad_fn

    args_all = s_args + t_args
    return divergence_fn(*args_all)

