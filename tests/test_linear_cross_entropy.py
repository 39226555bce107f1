"""`linear_cross_entropy` / `LinearCrossEntropy` (`keras_softmax_heads.fused`)
against the dense cross-entropy.

Every comparison checks the loss and its gradients with respect to the
hidden states, the kernel and the bias against the backend's automatic
differentiation of the dense formula (`[N, V]` logits, Keras' smoothed
targets `(1 - eps) onehot + eps / V`), on small shapes whose vocabulary the
tiles do not divide. Runs on TensorFlow, JAX and PyTorch; compiled means
`tf.function(jit_compile=True)` / `jax.jit`.
"""

import os

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import jit
from backends import to_numpy
from backends import torch_flops
from backends import value_and_grad
from multibackend import sweep
from multibackend import slow_on
from keras import ops

import keras_softmax_heads as ksh
from keras_softmax_heads.chunked import chunked_pointwise_stats
from keras_softmax_heads.losses import linear_cross_entropy

pytestmark = pytest.mark.multibackend
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

N, D, V = 12, 8, 37
IGNORE = -100
RTOL = 2e-5
IMPLEMENTATIONS = ["auto", "ops"] if BACKEND == "tensorflow" else ["auto"]


def assert_close(actual, expected, rtol=RTOL, name=""):
    actual = np.asarray(to_numpy(actual), "float64")
    expected = np.asarray(to_numpy(expected), "float64")
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=name)


def make_data(seed=0, transposed=False, dtype="float32"):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(N, D)).astype(dtype)
    shape = (V, D) if transposed else (D, V)
    kernel = (rng.normal(size=shape) / np.sqrt(D) * 2).astype(dtype)
    bias = rng.normal(size=(V,)).astype(dtype)
    targets = rng.integers(0, V, N)
    targets[[2, 7]] = IGNORE  # only used with ignore_index
    weights = rng.uniform(0.0, 2.0, N).astype("float32")
    return h, kernel, bias, targets, weights


def dense_loss(h, kernel, bias, targets, *, kernel_transposed=False,
               sample_weight=None, ignore_index=None, label_smoothing=0.0,
               z_loss=0.0, logit_soft_cap=None, reduction="mean", **_):
    """The dense reference: `[N, V]` logits, smoothed one-hot targets."""
    h = ops.cast(h, "float32")
    kernel = ops.cast(kernel, "float32")
    z = ops.matmul(h, ops.transpose(kernel) if kernel_transposed else kernel)
    if bias is not None:
        z = z + ops.cast(bias, "float32")
    if logit_soft_cap is not None:
        z = logit_soft_cap * ops.tanh(z / logit_soft_cap)
    targets = ops.convert_to_tensor(np.asarray(targets, "int32"))
    weights = ops.ones((N,), "float32")
    if sample_weight is not None:
        weights = ops.convert_to_tensor(sample_weight)
    if ignore_index is not None:
        ignored = ops.equal(targets, ignore_index)
        targets = ops.where(ignored, 0, targets)
        weights = ops.where(ignored, 0.0, weights)
    q = (1.0 - label_smoothing) * ops.one_hot(targets, V) + label_smoothing / V
    loss = -ops.sum(q * ops.log_softmax(z, axis=-1), axis=-1)
    loss = loss + z_loss * ops.square(ops.logsumexp(z, axis=-1))
    if reduction == "none":
        return loss * weights
    if reduction == "sum":
        return ops.sum(loss * weights)
    return ops.sum(loss * weights) / ops.sum(weights)


#: Option sets; the first (everything at once) is the one that runs off
#: TensorFlow by default.
CASES = {
    "all": dict(kernel_transposed=True, bias=True, sample_weight=True,
                ignore_index=IGNORE, label_smoothing=0.1, z_loss=1e-3,
                logit_soft_cap=4.0),
    "plain": dict(),
    "bias": dict(bias=True),
    "transposed": dict(kernel_transposed=True, bias=True),
    "ignore_index": dict(ignore_index=IGNORE),
    "sample_weight": dict(sample_weight=True, bias=True),
    "label_smoothing": dict(label_smoothing=0.2),
    "z_loss": dict(z_loss=1e-2, bias=True),
    "soft_cap": dict(logit_soft_cap=2.0, bias=True),
    "sum": dict(reduction="sum", ignore_index=IGNORE, sample_weight=True),
    "none": dict(reduction="none", ignore_index=IGNORE, sample_weight=True,
                 label_smoothing=0.1),
}


def _case_inputs(options, seed=0, dtype="float32"):
    options = dict(options)
    transposed = options.get("kernel_transposed", False)
    h, kernel, bias, targets, weights = make_data(seed, transposed, dtype)
    if options.pop("bias", False) is False:
        bias = None
    if options.pop("sample_weight", False):
        options["sample_weight"] = weights
    if options.get("ignore_index") is None:
        targets = np.where(targets == IGNORE, 3, targets)
    return h, kernel, bias, targets, options


# Each option alone under `-m slow`: "all" holds every option at once,
# "none" and "sum" the reductions with weights, ignored targets, smoothing.
@pytest.mark.parametrize("case", sweep(CASES, keep=["all", "plain", "transposed", "sum", "none"]))
def test_matches_dense(case):
    h, kernel, bias, targets, options = _case_inputs(CASES[case])
    # "none": a random cotangent per token makes the per-token loss a scalar.
    cot = ops.convert_to_tensor(np.random.default_rng(1).normal(size=N).astype("float32"))

    def scalar(loss):
        return ops.sum(loss * cot) if options.get("reduction") == "none" else loss

    inputs = [h, kernel] + ([bias] if bias is not None else [])

    def split(args):
        return args[0], args[1], (args[2] if bias is not None else None)

    # JAX: each loss compiled once (eager JAX dispatches op by op: 4x slower).
    compiled = jit if BACKEND == "jax" else (lambda fn: fn)
    value, grads, _ = value_and_grad(
        compiled(lambda *a: scalar(dense_loss(*split(a), targets, **options))), inputs
    )
    # 37 words: 4 tiles of 10, 3 of 13 (overlapping); token_chunk_size=5:
    # three blocks of 4 of the 12 tokens, the two-pass backward. Summed
    # reductions: also the gradient in the forward pass, in one chunk and in
    # chunks of 4 tokens.
    configs = [(10, None, False), (16, None, False), (10, 5, False)]
    if options.get("reduction") != "none":
        configs += [(10, None, True), (10, 5, True)]
    for impl in IMPLEMENTATIONS:
        for chunk, tokens, in_forward in configs:
            got, got_grads, _ = value_and_grad(
                compiled(lambda *a: scalar(linear_cross_entropy(
                    *split(a)[:2], targets, split(a)[2], chunk_size=chunk,
                    implementation=impl, token_chunk_size=tokens,
                    gradient_in_forward=in_forward, **options))),
                inputs,
            )
            tag = f"{case}/{impl}/{chunk}/{tokens}/{in_forward}"
            assert_close(got, value, name=f"{tag}: loss")
            for name, g, e in zip(["hidden", "kernel", "bias"], got_grads, grads):
                assert_close(g, e, name=f"{tag}: d{name}")


def test_per_token_gradients_under_none_with_a_mask():
    """`reduction="none"`: the gradient of token i's loss touches row i of
    the hidden states only, equals the dense one, and is 0 when ignored."""
    h, kernel, bias, targets, weights = make_data(2)
    options = dict(ignore_index=IGNORE, sample_weight=weights, label_smoothing=0.1,
                   z_loss=1e-3, reduction="none")
    per_token = to_numpy(linear_cross_entropy(h, kernel, targets, bias,
                                              chunk_size=10, **options))
    assert per_token.shape == (N,)
    assert per_token[2] == 0.0 and per_token[7] == 0.0
    assert_close(per_token, dense_loss(h, kernel, bias, targets, **options))
    for i in (0, 2, 5):
        onehot = ops.convert_to_tensor(np.eye(N, dtype="float32")[i])
        _, (dh, dk), _ = value_and_grad(
            lambda h, k: ops.sum(onehot * linear_cross_entropy(
                h, k, targets, bias, chunk_size=10, **options)), [h, kernel])
        _, (eh, ek), _ = value_and_grad(
            lambda h, k: ops.sum(onehot * dense_loss(h, k, bias, targets, **options)),
            [h, kernel])
        others = np.delete(dh, i, axis=0)
        assert not others.any(), f"token {i}: gradient leaks to other rows"
        if targets[i] == IGNORE:
            assert not dh.any() and not dk.any(), "ignored token has a gradient"
        assert_close(dh, eh, name=f"dh[{i}]")
        assert_close(dk, ek, name=f"dkernel[{i}]")


def test_token_blocks_are_the_tiled_pass_s():
    """`token_chunk_size` with `implementation="pallas"` is refused (the
    kernel has its own blocks), naming both; bad values are refused."""
    h, kernel, _, targets, _ = make_data(1)
    targets = np.where(targets == IGNORE, 0, targets)
    with pytest.raises(ValueError, match="token_chunk_size=4.*implementation='pallas'"):
        linear_cross_entropy(h, kernel, targets, token_chunk_size=4, implementation="pallas")
    with pytest.raises(ValueError, match="token_chunk_size=0"):
        linear_cross_entropy(h, kernel, targets, token_chunk_size=0)


def _jit_value_and_grads(fn, args):
    """`fn(*args)` and its gradients, compiled (TF, JAX; PyTorch: eager)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function(autograph=False, jit_compile=True)
        def step(*a):
            with tf.GradientTape() as tape:
                tape.watch(a)
                value = fn(*a)
            return value, tape.gradient(value, a)

        value, grads = step(*[tf.convert_to_tensor(x) for x in args])
    elif BACKEND == "jax":
        import jax

        value, grads = jax.jit(
            jax.value_and_grad(fn, argnums=tuple(range(len(args))))
        )(*args)
    else:
        value, grads, _ = value_and_grad(fn, args)
    return to_numpy(value), [to_numpy(g) for g in grads]


@pytest.mark.parametrize("case", ["all", "none", "all-in-forward"])
def test_compiled_matches_dense(case):
    in_forward = case.endswith("-in-forward")
    h, kernel, bias, targets, options = _case_inputs(CASES[case.split("-")[0]], seed=3)
    if in_forward:  # 12 tokens in chunks of 5 (tile_width: 4)
        options.update(gradient_in_forward=True, token_chunk_size=5)
    cot = np.random.default_rng(4).normal(size=N).astype("float32")

    def scalar(loss):
        if options.get("reduction") == "none":
            return ops.sum(loss * ops.convert_to_tensor(cot))
        return loss

    bias = bias if bias is not None else np.zeros(V, "float32")
    value, grads = _jit_value_and_grads(
        lambda h, k, b: scalar(linear_cross_entropy(h, k, targets, b, chunk_size=10,
                                                    **options)),
        [h, kernel, bias],
    )
    expected, expected_grads, _ = value_and_grad(
        lambda h, k, b: scalar(dense_loss(h, k, b, targets, **options)), [h, kernel, bias]
    )
    assert_close(value, expected, name="loss")
    for name, g, e in zip(["hidden", "kernel", "bias"], grads, expected_grads):
        assert_close(g, e, name=f"d{name}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "bfloat16-in-forward"])
def test_low_precision_inputs_accumulate_in_float32(dtype):
    h, kernel, bias, targets, options = _case_inputs(CASES["all"], seed=5)
    if dtype.endswith("-in-forward"):
        dtype = dtype.split("-")[0]
        options.update(gradient_in_forward=True, token_chunk_size=5)
    h16 = ops.cast(h, dtype)
    k16 = ops.cast(kernel, dtype)
    # The reference: float32 on the same (rounded) values.
    h32, k32 = ops.cast(h16, "float32"), ops.cast(k16, "float32")
    loss, (dh, dk), _ = value_and_grad(
        lambda h, k: linear_cross_entropy(h, k, targets, bias, chunk_size=10, **options),
        [h16, k16],
    )
    expected, (eh, ek), _ = value_and_grad(
        lambda h, k: dense_loss(h, k, bias, targets, **options), [h32, k32]
    )
    out = linear_cross_entropy(h16, k16, targets, bias, chunk_size=10, **options)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    assert_close(loss, expected, name="loss")  # float32-exact scores
    # The gradients come back in the inputs' dtype (rounded once).
    assert dh.dtype == to_numpy(h16).dtype
    assert_close(dh, eh, rtol=1e-2, name="dhidden")
    assert_close(dk, ek, rtol=1e-2, name="dkernel")


def test_lse_argmax_and_accuracy():
    h, kernel, bias, targets, weights = make_data(6)
    z = h @ kernel + bias
    targets = np.where(targets == IGNORE, 0, targets)
    targets[:5] = z[:5].argmax(1)  # 5 of 12 right, at least
    targets[5] = IGNORE
    loss, aux = linear_cross_entropy(
        h, kernel, targets, bias, ignore_index=IGNORE, sample_weight=weights,
        chunk_size=10, return_lse=True, return_argmax=True,
    )
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    assert_close(aux["lse"], lse, name="lse")
    np.testing.assert_array_equal(to_numpy(aux["argmax"]), z.argmax(1))
    keep = targets != IGNORE
    correct = (z.argmax(1) == targets) & keep
    expected = (weights * correct).sum() / weights[keep].sum()
    assert_close(aux["accuracy"], expected, name="accuracy")
    # The returned lse is differentiable: lse**2 as a z-loss term.
    _, (dh,), _ = value_and_grad(
        lambda h: ops.sum(ops.square(linear_cross_entropy(
            h, kernel, targets, bias, ignore_index=IGNORE, reduction="none",
            chunk_size=10, return_lse=True)[1]["lse"])), [h])
    _, (eh,), _ = value_and_grad(
        lambda h: ops.sum(ops.square(ops.logsumexp(
            ops.matmul(h, kernel) + ops.convert_to_tensor(bias), axis=-1))), [h])
    assert_close(dh, eh, name="d lse**2 / dh")


def test_gradient_in_forward_argmax_padding_and_errors():
    """`gradient_in_forward=True`: the argmax and accuracy of the per-token
    pass; 13 tokens in chunks of 4 (padded to 16) give the dense loss and
    gradients; the options it cannot take are refused, naming them."""
    h, kernel, bias, targets, weights = make_data(6)
    z = h @ kernel + bias
    targets[:5] = z[:5].argmax(1)
    options = dict(ignore_index=IGNORE, sample_weight=weights, chunk_size=10)
    expected = linear_cross_entropy(h, kernel, targets, bias, return_argmax=True, **options)
    loss, aux = linear_cross_entropy(h, kernel, targets, bias, return_argmax=True,
                                     gradient_in_forward=True, token_chunk_size=5, **options)
    assert_close(loss, expected[0], name="loss")
    np.testing.assert_array_equal(to_numpy(aux["argmax"]), z.argmax(1))
    assert_close(aux["accuracy"], expected[1]["accuracy"], name="accuracy")

    from keras_softmax_heads.chunked.divergence import OutputLayer
    from keras_softmax_heads.chunked.summed_cross_entropy import summed_cross_entropy

    rng = np.random.default_rng(3)
    h13 = rng.normal(size=(13, D)).astype("float32")
    y13 = rng.integers(0, V, 13).astype("int32")
    w13 = rng.uniform(0.0, 2.0, 13).astype("float32")
    value, (dh, dk), _ = value_and_grad(
        lambda h, k: summed_cross_entropy(OutputLayer(h, k), y13, w13, token_chunk_size=4),
        [h13, kernel])
    log_p = lambda h, k: ops.log_softmax(ops.matmul(h, k), axis=-1)  # noqa: E731
    e_value, (eh, ek), _ = value_and_grad(
        lambda h, k: -ops.sum(ops.convert_to_tensor(w13) * ops.take_along_axis(
            log_p(h, k), ops.convert_to_tensor(y13[:, None]), axis=1)[:, 0]),
        [h13, kernel])
    assert_close(value, e_value, name="13 tokens: loss")
    assert_close(dh, eh, name="13 tokens: dh")
    assert_close(dk, ek, name="13 tokens: dkernel")
    # A GPU / TPU's geometry (`platforms.forced_platform`): 2**28 scores a
    # chunk (here one chunk), the kernel gradient one product a chunk; the
    # same results.
    from keras_softmax_heads.chunked.summed_divergence import kernel_tile_width
    from keras_softmax_heads.platforms import forced_platform

    assert kernel_tile_width(V, "cpu") == 4096 and kernel_tile_width(V, "gpu") == V
    for platform in ("gpu", "tpu"):
        with forced_platform(platform):
            value, (dh, dk), _ = value_and_grad(
                lambda h, k: summed_cross_entropy(OutputLayer(h, k), y13, w13), [h13, kernel])
        assert_close(value, e_value, name=f"{platform}: loss")
        assert_close(dh, eh, name=f"{platform}: dh")
        assert_close(dk, ek, name=f"{platform}: dkernel")

    good = np.where(targets == IGNORE, 0, targets)
    for bad, name in ((dict(reduction="none"), "reduction='none'"),
                      (dict(return_lse=True), "return_lse=True"),
                      (dict(implementation="pallas"), "implementation='pallas'"),
                      (dict(filter_eps=0.01, implementation="pallas"), "implementation='pallas'")):
        with pytest.raises(ValueError, match=f"gradient_in_forward=True.*{name}"):
            linear_cross_entropy(h, kernel, good, gradient_in_forward=True, **bad)
    with pytest.raises(ValueError, match="gradient_in_forward=1"):
        linear_cross_entropy(h, kernel, good, gradient_in_forward=1)


# The matrix products of one gradient, per path: the tiled pass (scores,
# their recomputation, dh, dW), the gradient in the forward pass (scores,
# dh, dW) and token blocks (scores; pass 1: scores, dW; pass 2: scores, dh).
FROZEN_PATHS = {
    "tiled": ({}, 4, 3),
    "in_forward": ({"gradient_in_forward": True}, 3, 2),
    "token_blocks": ({"token_chunk_size": 5}, 5, 3),
}


def _flop_ratio(fn, args, frozen):
    """FLOPs of `fn`'s gradients with input `frozen` (0: h, 1: the kernel)
    left out, over those of all: PyTorch's `FlopCounterMode` (matrix
    products) on the loss built with that input frozen; XLA's cost analysis
    of the compiled gradients on JAX. None on TensorFlow."""
    if BACKEND == "torch":
        import torch

        def count(wanted):
            tensors = [torch.tensor(x).requires_grad_(w) for x, w in zip(args, wanted)]
            return torch_flops(lambda: fn(*tensors).backward())

        return count([i != frozen for i in range(2)]) / count([True, True])
    if BACKEND == "jax":
        import jax

        def count(argnums):
            cost = jax.jit(jax.grad(fn, argnums=argnums)).lower(*args).compile().cost_analysis()
            return (cost[0] if isinstance(cost, list) else cost)["flops"]

        return count(1 - frozen) / count((0, 1))
    return None


@pytest.mark.parametrize("path", list(FROZEN_PATHS))
def test_frozen_input_skips_its_products(path):
    """A frozen output matrix (LoRA's base weights, a frozen embedding) or
    frozen hidden states: the other input's gradient is the same, and its
    products are not computed. PyTorch says which inputs need a gradient
    while the loss is built (`dispatch.needs_gradient`); on JAX, XLA drops
    the unused products under `jax.jit` by itself."""
    options, products, without_one = FROZEN_PATHS[path]
    h, kernel, bias, targets, _ = make_data(transposed=True)

    def loss(h, kernel):
        return linear_cross_entropy(h, kernel, targets, kernel_transposed=True,
                                    ignore_index=IGNORE, chunk_size=16, **options)

    _, (dh, dkernel), _ = value_and_grad(loss, (h, kernel))
    frozen_kernel = keras.Variable(kernel, trainable=False)
    _, (dh_alone,), _ = value_and_grad(lambda h: loss(h, frozen_kernel), (h,))
    assert_close(dh_alone, dh, rtol=1e-6, name="dh")
    _, (dkernel_alone,), _ = value_and_grad(lambda k: loss(ops.convert_to_tensor(h), k),
                                            (kernel,))
    assert_close(dkernel_alone, dkernel, rtol=1e-6, name="dkernel")
    for frozen in (0, 1):
        ratio = _flop_ratio(loss, (h, kernel), frozen)
        if BACKEND == "torch":  # exactly the products left
            assert ratio == pytest.approx(without_one / products), (frozen, ratio)
        elif BACKEND == "jax":  # the products and what XLA fuses around them
            assert ratio < (without_one + 0.25) / products, (frozen, ratio)


def test_chunked_pointwise_stats_matches_dense():
    h, kernel, bias, targets, _ = make_data(7)
    targets = np.where(targets == IGNORE, 1, targets)
    for impl in IMPLEMENTATIONS:
        nll, lse, total, arg = chunked_pointwise_stats(
            h, kernel, bias, targets, chunk_size=16, implementation=impl)
        z = h @ kernel + bias
        expected_lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        assert_close(lse, expected_lse, name="lse")
        assert_close(nll, expected_lse - z[np.arange(N), targets], name="nll")
        assert_close(total, z.sum(1), name="score sum")
        np.testing.assert_array_equal(to_numpy(arg), z.argmax(1))


# --------------------------------------------------------------------- errors
def test_errors_name_the_value():
    h, kernel, bias, targets, _ = make_data(8)
    good = np.where(targets == IGNORE, 0, targets)
    bad = good.copy()
    bad[4] = V + 3
    with pytest.raises(ValueError, match=rf"targets\[4\]={V + 3}"):
        linear_cross_entropy(h, kernel, bad, chunk_size=10)
    with pytest.raises(ValueError, match=r"targets\[2\]=-100"):  # no ignore_index
        linear_cross_entropy(h, kernel, targets, chunk_size=10)
    bad = targets.copy()
    bad[9] = -1
    with pytest.raises(ValueError, match=r"targets\[9\]=-1.*ignore_index=-100"):
        linear_cross_entropy(h, kernel, bad, ignore_index=IGNORE, chunk_size=10)
    with pytest.raises(ValueError, match="d=8"):
        linear_cross_entropy(h[:, :5], kernel, good)
    with pytest.raises(ValueError, match="d=37"):  # the [V, d] layout not declared
        linear_cross_entropy(h, kernel.T, good)
    with pytest.raises(ValueError, match="dtype=int32"):
        linear_cross_entropy(h.astype("int32"), kernel, good)
    with pytest.raises(ValueError, match="targets with dtype=float32"):
        linear_cross_entropy(h, kernel, good.astype("float32"))
    with pytest.raises(ValueError, match="label_smoothing=1.5"):
        linear_cross_entropy(h, kernel, good, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction='avg'"):
        linear_cross_entropy(h, kernel, good, reduction="avg")
    with pytest.raises(ValueError, match="logit_soft_cap=0"):
        linear_cross_entropy(h, kernel, good, logit_soft_cap=0)
    with pytest.raises(ValueError, match=r"bias.shape=\(5,\)"):
        linear_cross_entropy(h, kernel, good, bias[:5])


@pytest.mark.skipif(BACKEND == "torch", reason="no XLA on PyTorch")
def test_out_of_range_target_under_jit_is_nan():
    h, kernel, _, targets, _ = make_data(9)
    targets = np.where(targets == IGNORE, 0, targets)
    targets[1] = V
    fn = jit(lambda h, k, t: linear_cross_entropy(h, k, t, chunk_size=10,
                                                  reduction="none"))
    out = to_numpy(fn(ops.convert_to_tensor(h), ops.convert_to_tensor(kernel),
                      ops.convert_to_tensor(targets.astype("int32"))))
    assert np.isnan(out[1]) and np.isfinite(np.delete(out, 1)).all()
    summed = jit(lambda h, k, t: linear_cross_entropy(h, k, t, gradient_in_forward=True))
    assert np.isnan(to_numpy(summed(ops.convert_to_tensor(h), ops.convert_to_tensor(kernel),
                                    ops.convert_to_tensor(targets.astype("int32")))))


# ----------------------------------------------------------------- Keras loss
def _hidden_model(tied):
    emb = keras.layers.Embedding(V, D, name="emb")
    out = keras.layers.Dense(V, name="proj")
    model = keras.Sequential([keras.Input((6,), dtype="int32"), emb,
                              keras.layers.Dense(D, name="mix")])
    out.build((None, D))
    return model, (emb if tied else out)


# The untied `[d, V]` kernel's fit under `-m slow` (8 s on TensorFlow;
# test_matches_dense checks that layout's loss and gradients).
@pytest.mark.parametrize("tied", sweep([True, False, "in_forward"], keep=[True, "in_forward"]))
def test_keras_loss_fit_and_config(tied):
    keras.utils.set_random_seed(0)
    in_forward = tied == "in_forward"
    tied = bool(tied)
    model, proj = _hidden_model(tied)
    # 48 tokens in blocks of 16: the two-pass backward trains the model; or
    # the gradient in the forward pass, in chunks of 16 tokens (on
    # TensorFlow `fit`'s batch is `None`: a chunk count known when it runs).
    loss = ksh.LinearCrossEntropy(proj, ignore_index=0, label_smoothing=0.1,
                                  z_loss=1e-4, chunk_size=10, token_chunk_size=16,
                                  gradient_in_forward=in_forward)
    rng = np.random.default_rng(0)
    x = rng.integers(1, V, (8, 6)).astype("int32")
    y = np.roll(x, -1, axis=1)
    y[:, -1] = 0  # padding, ignored
    sw = rng.uniform(0.5, 1.5, (8, 6)).astype("float32")
    hidden = model(x)
    kernel = proj.embeddings if tied else proj.kernel
    bias = None if tied else proj.bias
    expected = linear_cross_entropy(hidden, kernel, y, bias, kernel_transposed=tied,
                                    ignore_index=0, label_smoothing=0.1, z_loss=1e-4,
                                    sample_weight=sw, chunk_size=10)
    assert_close(loss(y, hidden, sample_weight=sw), expected, name="loss")
    per_token = loss.call(y, hidden)
    assert tuple(per_token.shape) == (8, 6) and not to_numpy(per_token)[:, -1].any()

    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, epochs=5, verbose=0)
    assert model.evaluate(x, y, verbose=0) < before
    if not tied:  # the projection is trained through the loss
        assert np.abs(to_numpy(proj.kernel)).sum() > 0

    config = loss.get_config()
    assert config["kernel_path"] == kernel.path and config["token_chunk_size"] == 16
    assert config["gradient_in_forward"] is in_forward
    assert config["kernel_transposed"] is tied
    restored = keras.losses.deserialize(keras.losses.serialize(loss))
    assert isinstance(restored, ksh.LinearCrossEntropy)
    assert restored.get_config() == config
    with pytest.raises(ValueError, match="bind"):
        restored(y, hidden)
    holder = model if tied else proj
    restored.bind(holder)
    assert_close(restored(y, hidden), loss(y, hidden), name="restored loss")


# JAX under `-m slow` (8 s): Keras' reductions and the argument errors.
@slow_on("jax")
def test_keras_loss_reductions_and_errors():
    model, proj = _hidden_model(True)
    x = np.arange(1, 13, dtype="int32").reshape(2, 6)
    y = x.copy()
    y[0, 0] = 0
    hidden = model(x)
    kernel = proj.embeddings
    total = linear_cross_entropy(hidden, kernel, y, kernel_transposed=True,
                                 ignore_index=0, reduction="sum", chunk_size=10)
    summed = ksh.LinearCrossEntropy(proj, ignore_index=0, reduction="sum", chunk_size=10)
    assert_close(summed(y, hidden), total)
    mean = ksh.LinearCrossEntropy(proj, ignore_index=0, chunk_size=10)
    assert_close(mean(y[..., None], hidden), to_numpy(total) / 11)  # 11 kept tokens
    assert_close(mean(y.astype("float32"), hidden), to_numpy(total) / 11)  # float labels
    with pytest.raises(ValueError, match="kernel=None"):
        ksh.LinearCrossEntropy()
    with pytest.raises(ValueError, match="z_loss=-1"):
        ksh.LinearCrossEntropy(proj, z_loss=-1)
    with pytest.raises(ValueError, match="does not match"):
        ksh.LinearCrossEntropy(proj, kernel_transposed=False)
    summed_in_forward = ksh.LinearCrossEntropy(proj, ignore_index=0, reduction="sum",
                                               chunk_size=10, gradient_in_forward=True)
    assert_close(summed_in_forward(y, hidden), total)
    with pytest.raises(ValueError, match="gradient_in_forward=True.*reduction='none'"):
        ksh.LinearCrossEntropy(proj, reduction="none", gradient_in_forward=True)


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's compiled memory of a jax.jit step")
def test_tiled_memory_benchmark_smoke(monkeypatch, tmp_path):
    """`benchmarks/bench_cross_entropy_memory.py` at a tiny shape: a row per
    tile width, the temporaries growing with it."""
    import json

    monkeypatch.syspath_prepend(BENCH)
    import bench_cross_entropy_memory as bench

    out = tmp_path / "m.json"
    bench.main(["--n=64", "--d=32", "--v=3000", "--chunk_sizes=1024,128", f"--out={out}"])
    result = json.loads(out.read_text())
    temps = [r["memory"]["temp"] for r in result["rows"]]
    assert [r["chunk_size"] for r in result["rows"]] == [1024, 128]
    assert temps[0] > temps[1] > 0
    assert result["dh_float32_accumulator_mib"] == 64 * 32 * 4 / 2**20


@pytest.mark.skipif(BACKEND != "jax", reason="times jax.jit steps")
def test_tail_tile_benchmark_smoke(monkeypatch, tmp_path):
    """`benchmarks/bench_tail_tile.py` at a tiny shape: both widths give the
    same loss, the balanced one masks fewer columns, and the library's
    `tile_width` is restored afterwards."""
    import json

    from keras_softmax_heads.chunked import tiling

    monkeypatch.syspath_prepend(BENCH)
    import bench_tail_tile as bench

    before = tiling.tile_width
    out = tmp_path / "t.json"
    bench.main(["--n=8", "--d=4", "--v=37", "--chunk_sizes=16", "--rounds=1", f"--out={out}"])
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["old_width"], row["new_width"]) == (16, 13)
    assert (row["old_masked_columns"], row["new_masked_columns"]) == (11, 2)
    assert row["loss_relative_difference"] < 1e-6
    assert tiling.tile_width is before


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's compiled memory of jax.jit steps")
def test_token_blocks_benchmark_smoke(monkeypatch, tmp_path):
    """`benchmarks/bench_token_blocks.py` at a tiny shape: a row per
    configuration, the same loss, the blocked one's temporaries smaller."""
    import json

    monkeypatch.syspath_prepend(BENCH)
    import bench_token_blocks as bench

    out = tmp_path / "t.json"
    bench.main(["--n=512", "--d=32", "--v=3000", "--configs=1024:0,256:128", "--rounds=1",
                f"--out={out}"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["chunk_size"], r["token_chunk_size"]) for r in rows] == [(1024, None), (256, 128)]
    assert rows[1]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-6)
    assert max(rows[1]["grad_rel_err"]) < 1e-5
    assert rows[1]["temp_mib"] < rows[0]["temp_mib"] and rows[1]["step_s"] > 0
