"""`linear_token_scores` (`keras_softmax_heads.fused`) and the entropy
column of `chunked_pointwise_stats` against dense references.

Log-probabilities and entropies of `softmax(g(h W + b) / T)` (soft cap,
temperature, bias, transposed kernel, a vocabulary the tiles do not divide)
against NumPy in float64, and the gradients of `sum(u logp + v H)` (random
per-token weights `u`, `v`: per-token gradients exact) against the
backend's automatic differentiation of the dense `keras.ops` formula, eager
and compiled (`tf.function(jit_compile=True)` / `jax.jit`). Runs on
TensorFlow, JAX and PyTorch.
"""

import numpy as np
import pytest
from backends import BACKEND
from backends import jit
from backends import to_numpy
from backends import value_and_grad
from keras import ops

from keras_softmax_heads.chunked import chunked_pointwise_stats
from keras_softmax_heads.fused import linear_token_scores

pytestmark = pytest.mark.multibackend

N, D, V = 10, 8, 37
CHUNK = 16  # 37 words: two full tiles and a masked tail tile


def assert_close(actual, expected, rtol=2e-5, name=""):
    actual = np.asarray(to_numpy(actual), "float64")
    expected = np.asarray(to_numpy(expected), "float64")
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=name)


def make_data(seed=0, transposed=False):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(N, D)).astype("float32")
    kernel = (rng.normal(size=(V, D) if transposed else (D, V)) * 0.8).astype("float32")
    bias = rng.normal(size=(V,)).astype("float32")
    tokens = rng.integers(0, V, N)
    u = rng.normal(size=N).astype("float32")
    v = rng.normal(size=N).astype("float32")
    return h, kernel, bias, tokens, u, v


def numpy_scores(h, kernel, bias, tokens, transposed=False, temperature=1.0, cap=None):
    """Float64 NumPy reference: (log_probs, entropy)."""
    w = np.asarray(kernel, "float64")
    z = np.asarray(h, "float64") @ (w.T if transposed else w)
    if bias is not None:
        z = z + bias
    g = z if cap is None else cap * np.tanh(z / cap)
    g = g / temperature
    m = g.max(-1, keepdims=True)
    log_p = g - m - np.log(np.exp(g - m).sum(-1, keepdims=True))
    return (np.take_along_axis(log_p, tokens[..., None], -1)[..., 0],
            -(np.exp(log_p) * log_p).sum(-1))


def dense_scores(h, kernel, bias, tokens, transposed=False, temperature=1.0, cap=None):
    """The dense `keras.ops` formula (differentiated by the backend)."""
    z = ops.matmul(h, ops.transpose(kernel) if transposed else kernel)
    if bias is not None:
        z = z + bias
    if cap is not None:
        z = cap * ops.tanh(z / cap)
    log_p = ops.log_softmax(z / temperature, axis=-1)
    picked = ops.take_along_axis(log_p, ops.cast(tokens, "int32")[:, None], axis=-1)[:, 0]
    return picked, -ops.sum(ops.exp(log_p) * log_p, axis=-1)


# The first case runs on every backend (the others on TensorFlow, and under
# `-m slow` on JAX / PyTorch), compiled too.
CASES = {
    "temperature_cap_bias": dict(temperature=0.6, cap=1.5, bias=True),
    "plain": dict(),
    "cap_transposed": dict(cap=1.5, transposed=True, temperature=1.7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients(case):
    opts = CASES[case]
    transposed = opts.get("transposed", False)
    temperature, cap = opts.get("temperature", 1.0), opts.get("cap")
    h, kernel, b, tokens, u, v = make_data(1, transposed)
    bias = b if opts.get("bias") else None
    kwargs = dict(kernel_transposed=transposed, temperature=temperature,
                  logit_soft_cap=cap, chunk_size=CHUNK)

    log_p, ent = linear_token_scores(h, kernel, tokens, bias, return_entropy=True, **kwargs)
    ref_lp, ref_ent = numpy_scores(h, kernel, bias, tokens, transposed, temperature, cap)
    assert to_numpy(log_p).dtype == np.float32 and tuple(log_p.shape) == (N,)
    assert_close(log_p, ref_lp, name="log_probs")
    assert_close(ent, ref_ent, name="entropy")
    only = linear_token_scores(h, kernel, tokens, bias, **kwargs)
    assert_close(only, ref_lp, name="log_probs alone")

    args = [h, kernel] + ([bias] if bias is not None else [])
    u, v = ops.convert_to_tensor(u), ops.convert_to_tensor(v)

    def fused(h, kernel, *rest):
        lp, e = linear_token_scores(h, kernel, tokens, rest[0] if rest else None,
                                    return_entropy=True, **kwargs)
        return ops.sum(u * lp + v * e)

    def dense(h, kernel, *rest):
        lp, e = dense_scores(h, kernel, rest[0] if rest else None, tokens,
                             transposed, temperature, cap)
        return ops.sum(u * lp + v * e)

    # The first case compiled (the other tests run eagerly).
    compiled = case == "temperature_cap_bias"
    value, grads, _ = value_and_grad(jit(fused) if compiled else fused, args)
    ref_value, ref_grads, _ = value_and_grad(dense, args)
    assert_close(value, ref_value, name="value")
    for name, g, r in zip(["h", "kernel", "bias"], grads, ref_grads):
        assert_close(g, r, rtol=5e-5, name=name)


def test_per_token_gradients_and_entropy_alone():
    """The gradient of one token's entropy alone (the other cotangents 0),
    and of a log-prob alone, are the dense ones: per token exact."""
    h, kernel, _, tokens, _, _ = make_data(2)
    for which in (0, 1):
        for k in (5,):
            def fused(h, which=which, k=k):
                out = linear_token_scores(h, kernel, tokens, return_entropy=True,
                                          chunk_size=CHUNK)
                return out[which][k]

            def dense(h, which=which, k=k):
                return dense_scores(h, kernel, None, tokens)[which][k]

            _, (g,), _ = value_and_grad(fused, [h])
            _, (r,), _ = value_and_grad(dense, [h])
            assert_close(g, r, rtol=5e-5, name=f"stat {which} token {k}")
            assert np.abs(to_numpy(g)[np.arange(N) != k]).max() == 0


def test_bfloat16_inputs_give_float32_scores():
    h, kernel, _, tokens, _, _ = make_data(3)
    h16 = ops.cast(h, "bfloat16")
    k16 = ops.cast(kernel, "bfloat16")
    log_p, ent = linear_token_scores(h16, k16, tokens, return_entropy=True,
                                     chunk_size=CHUNK, temperature=0.8)
    assert to_numpy(log_p).dtype == np.float32 and to_numpy(ent).dtype == np.float32
    # The reference: the float32 scores of the bfloat16-rounded inputs.
    ref_lp, ref_ent = numpy_scores(to_numpy(ops.cast(h16, "float32")),
                                   to_numpy(ops.cast(k16, "float32")), None, tokens,
                                   temperature=0.8)
    assert_close(log_p, ref_lp, rtol=1e-4)
    assert_close(ent, ref_ent, rtol=1e-4)
    _, (gh, gk), _ = value_and_grad(
        lambda h, k: ops.sum(ops.add(*linear_token_scores(
            h, k, tokens, return_entropy=True, chunk_size=CHUNK))), [h16, k16])
    assert str(to_numpy(gh).dtype) == "bfloat16" and np.isfinite(
        np.asarray(to_numpy(gk), "float32")).all()


def test_stats_entropy_column_leaves_the_others_unchanged():
    """`chunked_pointwise_stats(..., entropy=True)`: the four usual
    statistics are those of the call without it, the fifth the entropy."""
    h, kernel, bias, tokens, _, _ = make_data(4)
    base = chunked_pointwise_stats(h, kernel, bias, tokens, chunk_size=CHUNK)
    more = chunked_pointwise_stats(h, kernel, bias, tokens, chunk_size=CHUNK, entropy=True)
    assert len(base) == 4 and len(more) == 5
    for a, b in zip(base, more):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    assert_close(more[4], numpy_scores(h, kernel, bias, tokens)[1])


def test_bad_arguments():
    h, kernel, _, tokens, _, _ = make_data(5)
    with pytest.raises(ValueError, match="temperature"):
        linear_token_scores(h, kernel, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="logit_soft_cap"):
        linear_token_scores(h, kernel, tokens, logit_soft_cap=-1.0)
    with pytest.raises(ValueError, match="return_entropy"):
        linear_token_scores(h, kernel, tokens, return_entropy="yes")
    with pytest.raises(ValueError):
        linear_token_scores(h, kernel, np.full(N, V))
    if BACKEND != "jax":
        with pytest.raises(ValueError, match=r"vocab_parallel=True needs.*Received: kernel"):
            linear_token_scores(h, kernel, tokens, vocab_parallel=True)
