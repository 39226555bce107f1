"""`linear_divergence` (`keras_softmax_heads.fused`) and its tiled core
(`chunked.divergence`) against the dense divergences.

Each comparison checks the divergence and its gradients with respect to
both sides' hidden states, kernels and biases against the backend's
automatic differentiation of the dense formula (both `[N, V]` logits,
`log_softmax`, the KL / JSD), on small shapes whose vocabulary the tiles do
not divide, with different `d` for the student and the teacher. Runs on
TensorFlow, JAX and PyTorch; compiled means `tf.function(jit_compile=True)`
/ `jax.jit`.
"""

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import to_numpy
from backends import torch_flops
from backends import value_and_grad
from keras import ops

from keras_softmax_heads.fused import linear_divergence

pytestmark = pytest.mark.multibackend

N, DS, DT, V = 10, 6, 9, 37
IGNORE = -100
RTOL = 3e-5


def assert_close(actual, expected, rtol=RTOL, name=""):
    actual = np.asarray(to_numpy(actual), "float64")
    expected = np.asarray(to_numpy(expected), "float64")
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=name)


def make_inputs(seed=0, s_transposed=False, t_transposed=True):
    """`[h_s, W_s, b_s, h_t, W_t, b_t]`, targets and weights."""
    rng = np.random.default_rng(seed)

    def side(d, transposed):
        h = rng.normal(size=(N, d)).astype("float32")
        w = (rng.normal(size=(V, d) if transposed else (d, V)) * 2 / np.sqrt(d)).astype("float32")
        return [h, w, rng.normal(size=V).astype("float32")]

    targets = rng.integers(0, V, N)
    targets[[1, 6]] = IGNORE
    weights = rng.uniform(0.0, 2.0, N).astype("float32")
    return side(DS, s_transposed) + side(DT, t_transposed), targets, weights


def dense_divergence(hs, ws, bs, ht, wt, bt, targets=None, *, student_kernel_transposed=False,
                     teacher_kernel_transposed=False, divergence="forward_kl", beta=0.5,
                     temperature=1.0, student_soft_cap=None, teacher_soft_cap=None,
                     ignore_index=None, sample_weight=None, reduction="mean",
                     teacher_gradient=False, **_):
    """The dense reference: both `[N, V]` logits, `log_softmax`, the
    divergence, in `keras.ops` (differentiable on every backend)."""

    def log_probs(h, w, b, transposed, cap):
        z = ops.matmul(h, ops.transpose(w) if transposed else w) + b
        if cap is not None:
            z = cap * ops.tanh(z / cap)
        return ops.log_softmax(z / temperature, axis=-1)

    log_q = log_probs(hs, ws, bs, student_kernel_transposed, student_soft_cap)
    log_p = log_probs(ht, wt, bt, teacher_kernel_transposed, teacher_soft_cap)
    if not teacher_gradient:
        log_p = ops.stop_gradient(log_p)

    def kl(log_a, log_b):
        return ops.sum(ops.exp(log_a) * (log_a - log_b), axis=-1)

    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0):
        per_token = kl(log_p, log_q)
    elif divergence == "reverse_kl" or (divergence == "jsd" and beta == 1):
        per_token = kl(log_q, log_p)
    else:
        log_m = ops.log(beta * ops.exp(log_p) + (1 - beta) * ops.exp(log_q))
        per_token = beta * kl(log_p, log_m) + (1 - beta) * kl(log_q, log_m)
    w = ops.ones_like(per_token) if sample_weight is None else ops.convert_to_tensor(sample_weight)
    if ignore_index is not None:
        w = ops.where(ops.convert_to_tensor(targets) == ignore_index, 0.0, w)
    if reduction == "none":
        return per_token * w
    if reduction == "sum":
        return ops.sum(per_token * w)
    return ops.sum(per_token * w) / ops.sum(w)


# Each case: linear_divergence options (and the inputs' layout).
CASES = {
    "forward_kl": dict(divergence="forward_kl"),
    "reverse_kl_t2_caps": dict(divergence="reverse_kl", temperature=2.0,
                               student_soft_cap=1.5, teacher_soft_cap=2.0),
    "jsd_half_masks": dict(divergence="jsd", beta=0.5, ignore_index=IGNORE,
                           sample_weight=True, student_kernel_transposed=True),
    "jsd_beta0_sum": dict(divergence="jsd", beta=0.0, reduction="sum", temperature=0.7),
    "jsd_beta1_cap_teacher": dict(divergence="jsd", beta=1.0, teacher_soft_cap=1.0,
                                  teacher_kernel_transposed=False),
    "jsd_03_none_teacher_grad": dict(divergence="jsd", beta=0.3, reduction="none",
                                     teacher_gradient=True, student_soft_cap=2.0,
                                     temperature=1.5, ignore_index=IGNORE),
    "forward_kl_teacher_grad": dict(divergence="forward_kl", teacher_gradient=True,
                                    sample_weight=True, reduction="sum"),
}


def _case(name, seed=0, path=None):
    """`(inputs, tiled, dense, options)` of a case; `path` `"summed"`
    (`gradient_in_forward=True`, chunks of 4 tokens), `"vocab"`
    (`gradient_in_forward=False`) or None (the default)."""
    options = dict(CASES[name])
    if path == "summed":
        options.update(gradient_in_forward=True, token_chunk_size=4)
    elif path == "vocab":
        options["gradient_in_forward"] = False
    options.setdefault("teacher_kernel_transposed", True)
    inputs, targets, weights = make_inputs(
        seed, options.get("student_kernel_transposed", False),
        options["teacher_kernel_transposed"])
    if options.pop("sample_weight", False):
        options["sample_weight"] = weights
    cot = np.random.default_rng(seed + 1).normal(size=N).astype("float32")

    def scalar(out):  # reduction="none": an arbitrary per-token cotangent
        if options.get("reduction") == "none":
            return ops.sum(out * ops.convert_to_tensor(cot))
        return out

    def tiled(hs, ws, bs, ht, wt, bt):
        return scalar(linear_divergence(hs, ws, ht, wt, targets, student_bias=bs,
                                        teacher_bias=bt, chunk_size=10, **options))

    def dense(*args):
        return scalar(dense_divergence(*args, targets, **options))

    return inputs, tiled, dense, options


NAMES = ["h_s", "W_s", "b_s", "h_t", "W_t", "b_t"]


SUMMED = [name for name, case in CASES.items() if case.get("reduction") != "none"]


@pytest.mark.parametrize("name, path", [(name, "vocab") for name in CASES]
                         + [(name, "summed") for name in SUMMED])
def test_matches_dense(name, path):
    """Both paths: the vocabulary tiles (gradient in the backward pass) and
    the token chunks (gradient in the forward pass, summed reductions)."""
    inputs, tiled, dense, options = _case(name, path=path)
    value, grads, _ = value_and_grad(tiled, inputs)
    expected, expected_grads, _ = value_and_grad(dense, inputs)
    assert_close(value, expected, name="divergence")
    assert value > 0
    for g, e, n in zip(grads[:3], expected_grads[:3], NAMES):
        assert_close(g, e, name=f"d{n}")
    for g, e, n in zip(grads[3:], expected_grads[3:], NAMES[3:]):
        if options.get("teacher_gradient"):
            assert_close(g, e, name=f"d{n}")
        else:  # the teacher is under stop_gradient
            assert g is None or not np.any(g), f"d{n} without teacher_gradient"


def _jit_value_and_grads(fn, args):
    """`fn(*args)` and its gradients, compiled (TF, JAX; PyTorch: eager)."""
    if BACKEND == "jax":
        import jax

        step = jax.jit(jax.value_and_grad(fn, argnums=tuple(range(len(args)))))
        value, grads = step(*args)
        return to_numpy(value), [to_numpy(g) for g in grads]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def step(*a):
            with tf.GradientTape() as tape:
                tape.watch(a)
                value = fn(*a)
            return value, tape.gradient(value, a)

        value, grads = tf.function(step, autograph=False, jit_compile=True)(*args)
        return to_numpy(value), [to_numpy(g) for g in grads]
    value, grads, _ = value_and_grad(fn, args)
    return value, grads


@pytest.mark.parametrize("name", ["jsd_03_none_teacher_grad", "forward_kl_teacher_grad"])
def test_compiled_matches_dense(name):
    inputs, tiled, dense, options = _case(name, seed=3)
    value, grads = _jit_value_and_grads(tiled, inputs)
    expected, expected_grads, _ = value_and_grad(dense, inputs)
    assert_close(value, expected, name="divergence")
    count = 6 if options.get("teacher_gradient") else 3
    for g, e, n in zip(grads[:count], expected_grads[:count], NAMES):
        assert_close(g, e, name=f"d{n}")


@pytest.mark.parametrize("divergence", ["jsd", "reverse_kl"])
def test_summed_chunks_with_padding(divergence):
    """7 tokens in chunks of 4 (one padding row of weight 0); the gradient
    of the weights is the per-token divergence."""
    inputs, targets, weights = make_inputs(seed=11)
    inputs = [x[:7] if i in (0, 3) else x for i, x in enumerate(inputs)]
    targets, weights = targets[:7], weights[:7]
    options = dict(divergence=divergence, beta=0.3, temperature=1.3,
                   student_soft_cap=2.5, teacher_kernel_transposed=True,
                   ignore_index=IGNORE, teacher_gradient=True)

    def summed(hs, ws, bs, ht, wt, bt, sw):
        return linear_divergence(hs, ws, ht, wt, targets, student_bias=bs, teacher_bias=bt,
                                 sample_weight=sw, gradient_in_forward=True,
                                 token_chunk_size=4, **options)

    def dense(*args):
        return dense_divergence(*args[:6], targets, sample_weight=args[6], **options)

    value, grads, _ = value_and_grad(summed, inputs + [weights])
    expected, expected_grads, _ = value_and_grad(dense, inputs + [weights])
    assert_close(value, expected, name="divergence")
    for g, e, n in zip(grads, expected_grads, NAMES + ["sample_weight"]):
        assert_close(g, e, name=f"d{n}")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a None dimension: TensorFlow graphs")
def test_summed_with_a_token_count_known_when_run():
    """A `tf.function` traced with a `None` leading dimension (as Keras'
    `fit` traces its step): the chunk count is computed when it runs."""
    import tensorflow as tf

    inputs, targets, weights = make_inputs(seed=13)
    hs, ws, bs, ht, wt, bt = inputs

    @tf.function(autograph=False, input_signature=[tf.TensorSpec([None, DS], "float32"),
                                  tf.TensorSpec([None, DT], "float32")])
    def step(h_s, h_t):
        with tf.GradientTape() as tape:
            tape.watch(h_s)
            value = linear_divergence(h_s, ws, h_t, wt, teacher_kernel_transposed=True,
                                      gradient_in_forward=True, token_chunk_size=4)
        return value, tape.gradient(value, h_s)

    value, grad = step(hs, ht)
    expected, expected_grads, _ = value_and_grad(
        lambda a: dense_divergence(a, ws, 0.0, ht, wt, 0.0, teacher_kernel_transposed=True),
        [hs])
    assert_close(value, expected, name="divergence")
    assert_close(grad, expected_grads[0], name="dh_s")


def test_per_token_gradients_are_exact():
    """Under `reduction="none"` the gradient of token `i`'s divergence
    reaches row `i` of `h_s` only and equals the dense one."""
    inputs, _, _, _ = _case("forward_kl", seed=5)
    for i in (0, 7):
        def pick(out, i=i):
            return out[i]

        value, grads, _ = value_and_grad(
            lambda hs, ws, bs, ht, wt, bt: pick(linear_divergence(
                hs, ws, ht, wt, student_bias=bs, teacher_bias=bt,
                teacher_kernel_transposed=True, reduction="none", chunk_size=10)),
            inputs)
        expected, expected_grads, _ = value_and_grad(
            lambda *a: pick(dense_divergence(*a, teacher_kernel_transposed=True,
                                             reduction="none")), inputs)
        assert_close(value, expected)
        dh = grads[0]
        assert not np.delete(dh, i, axis=0).any(), "gradient leaks to other rows"
        for g, e, n in zip(grads[:3], expected_grads[:3], NAMES):
            assert_close(g, e, name=f"d{n}[{i}]")


def test_low_precision_inputs_accumulate_in_float32():
    inputs, _, _, _ = _case("forward_kl", seed=7)
    low = [ops.cast(x, "bfloat16") for x in inputs]
    out = linear_divergence(low[0], low[1], low[3], low[4], student_bias=low[2],
                            teacher_bias=low[5], teacher_kernel_transposed=True,
                            reduction="none", chunk_size=10)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    rounded = [ops.cast(x, "float32") for x in low]
    expected = dense_divergence(*rounded, teacher_kernel_transposed=True, reduction="none")
    assert_close(out, expected, rtol=1e-4)


def test_summed_low_precision_keeps_float32_weights():
    """bfloat16 hidden states: the summed path weights the tokens in
    float32 (as the per-token path does), not in bfloat16."""
    inputs, _, weights = make_inputs(seed=8)
    low = [ops.cast(x, "bfloat16") for x in inputs]
    weights = weights + np.float32(1e-3)  # not bfloat16 numbers
    args = (low[0], low[1], low[3], low[4])
    kwargs = dict(teacher_kernel_transposed=True, sample_weight=weights, reduction="sum")
    summed = linear_divergence(*args, gradient_in_forward=True, **kwargs)
    per_token = linear_divergence(*args, gradient_in_forward=False, **kwargs)
    assert_close(summed, per_token, rtol=1e-5)


def test_leading_shape_and_divisible_tiles():
    inputs, _, _, _ = _case("forward_kl", seed=9)
    hs, ws, bs, ht, wt, bt = inputs
    out = linear_divergence(hs.reshape(2, 5, DS), ws, ht.reshape(2, 5, DT), wt,
                            teacher_kernel_transposed=True, reduction="none",
                            chunk_size=V)  # one tile
    expected = dense_divergence(hs, ws, 0.0, ht, wt, 0.0, teacher_kernel_transposed=True,
                                reduction="none")
    assert tuple(out.shape) == (2, 5)
    assert_close(ops.reshape(out, (N,)), expected)


@pytest.mark.parametrize("bad, match", [
    (dict(divergence="kl"), "divergence"),
    (dict(beta=1.5), "beta"),
    (dict(temperature=0.0), "temperature"),
    (dict(student_soft_cap=-1.0), "student_soft_cap"),
    (dict(reduction="avg"), "reduction"),
    (dict(ignore_index=IGNORE), "targets"),
    (dict(gradient_in_forward=True, reduction="none"), "gradient_in_forward"),
    (dict(gradient_in_forward="yes"), "gradient_in_forward"),
    (dict(token_chunk_size=0), "token_chunk_size"),
    (dict(vocab_parallel="yes"), "vocab_parallel"),
    # A kernel no keras.distribution shards (any backend).
    (dict(vocab_parallel=True), "vocab_parallel=True needs .*Received: kernel"),
])
def test_bad_options(bad, match):
    inputs, _, _, _ = _case("forward_kl")
    with pytest.raises(ValueError, match=match):
        linear_divergence(inputs[0], inputs[1], inputs[3], inputs[4],
                          teacher_kernel_transposed=True, **bad)


def test_vocabularies_must_match():
    inputs, _, _, _ = _case("forward_kl")
    with pytest.raises(ValueError, match="same vocabulary"):
        linear_divergence(inputs[0], inputs[1], inputs[3], inputs[4][:-1],
                          teacher_kernel_transposed=True)


# keras-hub: `DistillationCausalLM` on tiny models built from configs.
HUB_V, HUB_T, HUB_B = 64, 6, 3
HUB_LR = 0.5


def _hub_models(seed=0):
    """A Gemma 2 style student (tied, final soft cap, d=16) and a Llama
    teacher (untied `reverse_embeddings`, d=24) over the same vocabulary."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(seed)
    student = keras_hub.models.GemmaCausalLM(backbone=keras_hub.models.GemmaBackbone(
        vocabulary_size=HUB_V, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8, final_logit_soft_cap=1.5,
        attention_logit_soft_cap=50.0, use_post_ffw_norm=True,
        use_post_attention_norm=True, query_head_dim_normalize=False,
    ), preprocessor=None)
    teacher = keras_hub.models.LlamaCausalLM(backbone=keras_hub.models.LlamaBackbone(
        vocabulary_size=HUB_V, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=24, intermediate_dim=32, tie_word_embeddings=False,
    ), preprocessor=None)
    return student, teacher


def _hub_data(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((HUB_B, HUB_T), "int32")
    mask[1, -2:] = 0
    x = {"token_ids": rng.integers(1, HUB_V, (HUB_B, HUB_T)).astype("int32"),
         "padding_mask": mask}
    y = rng.integers(0, HUB_V, (HUB_B, HUB_T)).astype("int32")
    return x, y, mask.astype("float32")


def _dense_from_logits(student_logits, teacher_logits, sw, temperature, divergence, beta):
    """The divergence of the stock models' logits (`keras.ops`)."""
    log_q = ops.log_softmax(student_logits / temperature, axis=-1)
    log_p = ops.stop_gradient(ops.log_softmax(teacher_logits / temperature, axis=-1))
    kl = lambda a, b: ops.sum(ops.exp(a) * (a - b), axis=-1)  # noqa: E731
    if divergence == "forward_kl":
        per_token = kl(log_p, log_q)
    else:
        log_m = ops.log(beta * ops.exp(log_p) + (1 - beta) * ops.exp(log_q))
        per_token = beta * kl(log_p, log_m) + (1 - beta) * kl(log_q, log_m)
    sw = ops.convert_to_tensor(sw)
    return ops.sum(per_token * sw) / ops.sum(sw)


# Two models' fit steps: compiling them takes 15 s on TensorFlow and a
# minute on JAX (-m slow there); by default on PyTorch (seconds).
@pytest.mark.parametrize("divergence", [
    pytest.param("jsd", marks=[pytest.mark.slow] if BACKEND != "torch" else []),
    pytest.param("forward_kl", marks=pytest.mark.slow),
])
def test_causal_lm_distillation_matches_stock_logits(divergence, monkeypatch):
    from test_fused_causal_lm import ReverseCalls

    from keras_softmax_heads.fused import DistillationCausalLM

    # The JSD case mixes in the student's cross-entropy with the targets
    # (its gradient in the forward pass too, when training).
    ce_weight = 0.5 if divergence == "jsd" else 0.0
    options = dict(divergence=divergence, beta=0.4, temperature=2.0, chunk_size=24,
                   cross_entropy_weight=ce_weight)

    def dense_cross_entropy(logits, y, sw):
        nll = -ops.take_along_axis(ops.log_softmax(logits, axis=-1),
                                   ops.convert_to_tensor(y[..., None]), axis=-1)[..., 0]
        sw = ops.convert_to_tensor(sw)
        return ops.sum(nll * sw) / ops.sum(sw)

    class DenseDistillation(DistillationCausalLM):
        """The reference: both stock models' logits."""

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         training=True):
            logits_s = self.student.backbone.token_embedding(y_pred, reverse=True)
            logits_t = self.teacher(x, training=False)
            loss = _dense_from_logits(logits_s, logits_t, sample_weight, 2.0, divergence, 0.4)
            if ce_weight:
                loss = loss + ce_weight * dense_cross_entropy(logits_s, y, sample_weight)
            return loss

    student, teacher = _hub_models()
    student_ref, _ = _hub_models()
    student_ref.set_weights(student.get_weights())
    x, y, sw = _hub_data()
    distiller = DistillationCausalLM(student, teacher, **options)
    reference = DenseDistillation(student_ref, teacher, **options)
    for model in (distiller, reference):
        model.compile(optimizer=keras.optimizers.SGD(HUB_LR))

    # The loss equals the divergence of the stock models' logits (the
    # student's final soft cap included).
    hidden = distiller(x, training=True)
    loss = float(to_numpy(distiller.compute_loss(x, y, hidden, sw)))
    expected = float(to_numpy(_dense_from_logits(
        student(x), teacher(x), sw, 2.0, divergence, 0.4)))
    if ce_weight:
        expected += ce_weight * float(to_numpy(dense_cross_entropy(student(x), y, sw)))
    assert expected > 1e-3
    np.testing.assert_allclose(loss, expected, rtol=1e-5)

    # One SGD step each: the same student weights; the teacher's unchanged;
    # the tiled step never forms logits.
    teacher_before = [to_numpy(v) for v in teacher.weights]
    w0 = [to_numpy(v) for v in student.trainable_variables]
    calls = ReverseCalls(monkeypatch, distiller)
    logs = distiller.fit(x, y, sample_weight=sw, batch_size=HUB_B, epochs=1,
                         verbose=0, shuffle=False).history
    assert calls.steps > 0 and calls.count == 0, "the distillation step formed logits"
    calls.undo()
    ref_logs = reference.fit(x, y, sample_weight=sw, batch_size=HUB_B, epochs=1,
                             verbose=0, shuffle=False).history
    np.testing.assert_allclose(logs["loss"], ref_logs["loss"], rtol=1e-5)
    mixed = np.asarray(logs["divergence"]) + ce_weight * np.asarray(
        logs.get("cross_entropy", [0.0]))
    np.testing.assert_allclose(mixed, logs["loss"], rtol=1e-6)
    steps = [(a - to_numpy(b)) / HUB_LR for a, b in zip(w0, student.trainable_variables)]
    ref_steps = [(a - to_numpy(b)) / HUB_LR
                 for a, b in zip(w0, student_ref.trainable_variables)]
    scale = max(float(np.abs(g).max()) for g in ref_steps)
    assert scale > 1e-4
    for g, e, v in zip(steps, ref_steps, student.trainable_variables):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4 * scale, err_msg=v.path)
    for a, v in zip(teacher_before, teacher.weights):
        np.testing.assert_array_equal(a, to_numpy(v))

    # Evaluation (no gradient in the forward pass) agrees too.
    result = distiller.evaluate(x, y, sample_weight=sw, batch_size=HUB_B, verbose=0,
                                return_dict=True)
    expected = reference.evaluate(x, y, sample_weight=sw, batch_size=HUB_B, verbose=0,
                                  return_dict=True)
    np.testing.assert_allclose(result["loss"], expected["loss"], rtol=1e-5)


# The example script, in-process at a tiny shape (by default on PyTorch,
# the fastest here; -m slow on the others).
@(pytest.mark.slow if BACKEND != "torch" else pytest.mark.multibackend)
def test_hub_distillation_example_runs():
    import importlib.util
    import pathlib

    pytest.importorskip("keras_hub")
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "hub_distillation.py"
    spec = importlib.util.spec_from_file_location("hub_distillation", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    divergences, unchanged = example.main([
        "--steps=3", "--vocab_size=64", "--student_dim=16", "--teacher_dim=24",
        "--batch_size=2", "--seq_len=6", "--chunk_size=24", "--divergence=jsd",
        "--learning_rate=1e-2"])
    assert unchanged
    assert len(divergences) == 3 and divergences[-1] < divergences[0]


# The benchmark's steps, in-process at a tiny shape (the current backend's
# row; by default on PyTorch, -m slow on the others).
@(pytest.mark.slow if BACKEND != "torch" else pytest.mark.multibackend)
def test_bench_distillation_smoke(monkeypatch):
    import importlib.util
    import pathlib

    bench_dir = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench_dir))
    spec = importlib.util.spec_from_file_location(
        "bench_distillation", bench_dir / "bench_distillation.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.measure_backend(BACKEND, 16, 8, 50, 16, rounds=1, keras_rows=True)
    np.testing.assert_allclose(row["tiled_value"], row["dense_value"], rtol=1e-5)
    if BACKEND == "torch":
        np.testing.assert_allclose(row["torch_dense_value"], row["dense_value"], rtol=1e-5)
    assert row["ratios"]["time_tiled_over_dense"] > 0
    memory = bench.measure_memory(BACKEND, "tiled", 16, 8, 50, 16)
    assert "tiled_extra_mib" in memory


@pytest.mark.parametrize("gradient_in_forward", [False, True], ids=["tiled", "in_forward"])
def test_frozen_student_kernel_gets_no_gradient_work(gradient_in_forward):
    """A student whose output matrix is frozen (LoRA's base weights): its
    hidden states' gradient is the same as with the kernel's; on PyTorch
    the kernel's products are skipped (`chunked.dispatch.needs_gradient`)."""
    rng = np.random.default_rng(4)
    n, d_s, d_t, v = 7, 6, 5, 40
    h_s, w_s = rng.normal(size=(n, d_s)).astype("float32"), rng.normal(size=(d_s, v)).astype("float32")
    h_t, w_t = rng.normal(size=(n, d_t)).astype("float32"), rng.normal(size=(d_t, v)).astype("float32")

    def loss(h, w):
        return linear_divergence(h, w, h_t, w_t, divergence="jsd", chunk_size=16,
                                 gradient_in_forward=gradient_in_forward, token_chunk_size=4)

    _, (dh, _), _ = value_and_grad(loss, (h_s, w_s))
    frozen = keras.Variable(w_s, trainable=False)
    _, (dh_alone,), _ = value_and_grad(lambda h: loss(h, frozen), (h_s,))
    np.testing.assert_allclose(dh_alone, dh, rtol=1e-6, atol=1e-7)
    if BACKEND == "torch":
        import torch

        def flops(kernel_grad):
            h = torch.tensor(h_s).requires_grad_(True)
            w = torch.tensor(w_s).requires_grad_(kernel_grad)
            return torch_flops(lambda: loss(h, w).backward())

        assert flops(False) < flops(True)
