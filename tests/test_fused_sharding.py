"""`linear_cross_entropy` / `fused_causal_lm` under `keras.distribution` on
JAX with the output matrix sharded on the vocabulary axis (keras-hub's
Gemma / Llama layout maps), on 2 and 8 simulated host devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, a subprocess: the
flag must be set before JAX starts).

Checks that one distributed `fit` step of a fused Gemma 2 style model (tied
`[V, d]` embedding sharded `("model", "batch")`) and of an untied Llama
(`reverse_embeddings` `[d, V]` sharded `("batch", "model")`) gives the
unsharded model's loss and gradients (and the fused `evaluate` after it its
perplexity and token accuracy), and reports, from the compiled HLO of
the fused loss + gradients on a sharded kernel, what the partitioner does
with the tiled loop (see `docs/chunked.md`, "Sharding"), and every option of
the vocabulary-parallel form, with and without a bias, against the gathered
one.
"""

import json
import sys

import pytest
from backends import count_calls
from backends import run_on_simulated_devices

pytest.importorskip("jax")
keras_hub = pytest.importorskip("keras_hub")



@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 8])
def test_vocab_sharded_fit_matches_unsharded(devices):
    # Eight devices, of which the child uses `devices` (and 1 and 2 for its HLO).
    result = run_on_simulated_devices(__file__, 8, devices)
    for name in ("gemma2", "llama"):
        for form in ("vocab_parallel", "vocab_parallel_summed", "gathered"):
            r = result[name][form]
            assert r["kernel_spec"] == r["expected_spec"], r
            assert r["kernel_shards"] == devices, r
            assert r["vocab_parallel_applies"], r
            # The fit step ran the vocabulary-parallel form (with the
            # gradient in the forward pass: its summed form), or not.
            assert (r["vocab_parallel_used"] > 0) == (form == "vocab_parallel"), r
            assert (r["vocab_parallel_summed_used"] > 0) == (form == "vocab_parallel_summed"), r
            assert r["loss_rel_err"] < 1e-5, r
            assert r["grad_max_err"] < 1e-4 * r["grad_scale"], r
            # Fused evaluation (after the step) equals the unsharded one.
            assert r["eval_ppl_rel_err"] < 1e-5, r
            assert r["eval_accuracy"][0] == r["eval_accuracy"][1], r
    full = f"f32[{V_HLO},{D_HLO}]"
    hlo = result["hlo"]
    n = str(devices)
    # Vocabulary-parallel: no device gathers the [V, d] matrix and the
    # kernel gradient stays sharded; the gathered form does gather it.
    for form in ("vocab_parallel", "vocab_parallel_summed"):
        assert not any(s.startswith(full) for s in hlo[n][form]["all_gather_shapes"])
        assert "model" in hlo[n][form]["grad_kernel_sharding"]
    assert any(s.startswith(full) for s in hlo[n]["gathered"]["all_gather_shapes"])
    for form in ("vocab_parallel", "vocab_parallel_summed", "gathered"):
        assert abs(hlo[n][form]["loss"] - hlo["1"]["gathered"]["loss"]) < 1e-5
    # A distillation fit step (Gemma 2 style student, Llama teacher, with
    # the student's cross-entropy): the divergence and the cross-entropy
    # each device on its shard, the unsharded step's loss and gradients.
    r = result["distillation"]
    assert r["divergence_vocab_parallel_used"] > 0 and r["cross_entropy_summed_used"] > 0, r
    assert r["loss_rel_err"] < 1e-5, r
    assert r["grad_max_err"] < 1e-4 * r["grad_scale"], r
    assert r["evaluate_vocab_parallel_used"] > 0 and r["eval_rel_err"] < 1e-5, r
    for form in ("vocab_parallel", "vocab_parallel_summed"):
        per_device = [hlo[k][form]["temp_bytes"] + hlo[k][form]["output_bytes"]
                      for k in sorted(hlo, key=int)]
        assert per_device[-1] < per_device[0], (form, per_device)
    for key in ("options", "options_bias"):
        options = hlo[n][key]
        assert options["loss_max_err"] < 1e-5 and options["lse_max_err"] < 1e-5, (key, options)
        assert options["argmax_equal"] and options["accuracy_equal"], (key, options)


# ---------------------------------------------------------------- child --

V, T, B, LR = 96, 8, 4, 0.5
N_HLO, D_HLO, V_HLO, CHUNK_HLO = 1024, 128, 16384, 2048


def _child(devices):
    import keras
    import numpy as np

    import keras_softmax_heads as ksh

    def gemma2():
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=V, num_layers=1, num_query_heads=8,
            num_key_value_heads=8, hidden_dim=16, intermediate_dim=32,
            head_dim=4, use_post_ffw_norm=True, use_post_attention_norm=True,
            final_logit_soft_cap=1.5, attention_logit_soft_cap=50.0,
        ), keras_hub.models.GemmaCausalLM

    def llama():
        return keras_hub.models.LlamaBackbone(
            vocabulary_size=V, num_layers=1, num_query_heads=8,
            num_key_value_heads=8, hidden_dim=16, intermediate_dim=32,
            tie_word_embeddings=False,
        ), keras_hub.models.LlamaCausalLM

    rng = np.random.default_rng(0)
    mask = np.ones((B, T), "int32")
    mask[1, -3:] = 0
    x = {"token_ids": rng.integers(1, V, (B, T)).astype("int32"), "padding_mask": mask}
    y = rng.integers(0, V, (B, T)).astype("int32")
    sw = mask.astype("float32")

    def make(factory, distribution=None, **options):
        keras.utils.set_random_seed(0)
        scope = distribution.scope() if distribution else _null()
        with scope:
            backbone, cls = factory()
            lm = ksh.fused.fused_causal_lm(cls)(
                backbone=backbone, preprocessor=None,
                fused_loss={"chunk_size": 40, **options})
            lm.compile(optimizer=keras.optimizers.SGD(LR), weighted_metrics=[],
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return lm

    def step(lm):
        w0 = [np.asarray(v.value) for v in lm.trainable_variables]
        loss = lm.fit(x, y, sample_weight=sw, batch_size=B, verbose=0).history["loss"][0]
        grads = [(a - np.asarray(v.value)) / LR for a, v in zip(w0, lm.trainable_variables)]
        return loss, grads

    # Counts the vocabulary-parallel forms' (traced) calls.
    calls = []
    count_calls(ksh.fused.vocab_parallel, "vocab_parallel_stats", calls, "stats")
    count_calls(ksh.fused.cross_entropy, "vocab_parallel_summed", calls, "summed")
    mesh = keras.distribution.DeviceMesh(
        (1, devices), ("batch", "model"), keras.distribution.list_devices()[:devices])
    result = {"devices": devices}
    for name, factory, path, spec, transposed in (
        ("gemma2", gemma2, "token_embedding/embeddings", ("model", "batch"), True),
        ("llama", llama, "token_embedding/reverse_embeddings", ("batch", "model"), False),
    ):
        reference = make(factory)
        initial = reference.get_weights()
        loss_ref, g_ref = step(reference)
        eval_ref = reference.evaluate(x, y, sample_weight=sw, verbose=0, return_dict=True)
        result[name] = {}
        # The vocabulary-parallel form over token blocks (32 tokens in blocks
        # of 8, on each shard), and with the gradient in the forward pass
        # (chunks of 8 tokens): the same step as the unsharded one pass.
        for form, options in (("vocab_parallel", {"token_chunk_size": 8}),
                              ("vocab_parallel_summed", {"token_chunk_size": 8,
                                                         "gradient_in_forward": True}),
                              ("gathered", {"vocab_parallel": False})):
            layout = factory()[0].__class__.get_layout_map(mesh)
            layout["token_embedding/reverse_embeddings"] = ("batch", "model")
            distribution = keras.distribution.ModelParallel(
                layout_map=layout, batch_dim_name="batch")
            sharded = make(factory, distribution, **options)
            sharded.set_weights(initial)
            kernel = next(v for v in sharded.variables if v.path == path)
            with distribution.scope():
                applies = ksh.fused.vocab_parallel_layout(kernel, transposed) is not None
                calls.clear()
                loss, g = step(sharded)  # traced under the distribution
                used = {name: calls.count(name) for name in ("stats", "summed")}
                evaluated = sharded.evaluate(x, y, sample_weight=sw, verbose=0,
                                             return_dict=True)  # fused, sharded
            result[name][form] = {
                "kernel_spec": list(kernel.value.sharding.spec) + [None] * (
                    2 - len(kernel.value.sharding.spec)),
                "expected_spec": list(spec),
                "kernel_shards": len({str(s.index) for s in kernel.value.addressable_shards}),
                "vocab_parallel_applies": applies,
                "vocab_parallel_used": used["stats"],
                "vocab_parallel_summed_used": used["summed"],
                "loss": loss, "loss_ref": loss_ref,
                "loss_rel_err": abs(loss - loss_ref) / abs(loss_ref),
                "grad_max_err": max(float(np.abs(a - b).max()) for a, b in zip(g, g_ref)),
                "grad_scale": max(float(np.abs(b).max()) for b in g_ref),
                "eval_ppl_rel_err": abs(evaluated["perplexity"] / eval_ref["perplexity"] - 1),
                "eval_accuracy": [evaluated["token_accuracy"], eval_ref["token_accuracy"]],
            }
    result["distillation"] = _distillation(mesh, gemma2, llama, x, y, sw, make, step, calls)
    result["hlo"] = {str(n): _hlo(n) for n in sorted({1, 2, devices})}
    print(json.dumps(result, default=str))


def _distillation(mesh, student_factory, teacher_factory, x, y, sw, make, step, calls):
    """One distillation `fit` step sharded on the vocabulary and unsharded:
    the losses, the student's gradients, and the vocabulary-parallel
    forms' traced calls."""
    import keras
    import numpy as np

    import keras_softmax_heads as ksh
    from keras_softmax_heads.fused import distillation

    divergence_calls = []
    count_calls(distillation, "vocab_parallel_divergence", divergence_calls)

    def distiller(distribution=None):
        scope = distribution.scope() if distribution else _null()
        with scope:
            student = make(student_factory, distribution)
            teacher = make(teacher_factory, distribution)
            model = ksh.fused.DistillationCausalLM(
                student, teacher, divergence="jsd", beta=0.4, temperature=2.0,
                chunk_size=40, token_chunk_size=8, cross_entropy_weight=0.5)
            model.compile(optimizer=keras.optimizers.SGD(LR))
        return model

    reference = distiller()
    student_weights = reference.student.get_weights()
    teacher_weights = reference.teacher.get_weights()
    loss_ref, g_ref = step(reference)
    # The student's map (the teacher's variables that match it are sharded
    # too: its embeddings, and its untied output matrix on V).
    layout = student_factory()[0].__class__.get_layout_map(mesh)
    layout["token_embedding/reverse_embeddings"] = ("batch", "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
    sharded = distiller(distribution)
    sharded.student.set_weights(student_weights)
    sharded.teacher.set_weights(teacher_weights)
    with distribution.scope():
        calls.clear()
        loss, g = step(sharded)
        trained = len(divergence_calls)
        # Evaluation: vocabulary-parallel too (the summed pass).
        evaluated = sharded.evaluate(x, y, sample_weight=sw, verbose=0, return_dict=True)
    expected = reference.evaluate(x, y, sample_weight=sw, verbose=0, return_dict=True)
    return {
        "evaluate_vocab_parallel_used": len(divergence_calls) - trained,
        "eval_rel_err": max(abs(evaluated[k] / expected[k] - 1)
                            for k in ("loss", "divergence", "cross_entropy")),
        "divergence_vocab_parallel_used": trained,
        "cross_entropy_summed_used": calls.count("summed"),
        "loss_rel_err": abs(loss - loss_ref) / abs(loss_ref),
        "grad_max_err": max(float(np.abs(a - b).max()) for a, b in zip(g, g_ref)),
        "grad_scale": max(float(np.abs(b).max()) for b in g_ref),
    }


def _hlo(devices):
    """Per-device memory (XLA's `memory_analysis` of the compiled loss +
    gradients; `device.memory_stats()` is None on CPU) and the all-gathers
    of the fused loss with the `[V, d]` kernel sharded on V over `devices`:
    vocabulary-parallel, gathered (`vocab_parallel=False`), and the dense
    `[N, V]` logits for scale."""
    import jax
    import keras
    import numpy as np
    from keras import ops

    import keras_softmax_heads as ksh

    mesh = keras.distribution.DeviceMesh(
        (devices,), ("model",), keras.distribution.list_devices()[:devices])
    layout = keras.distribution.LayoutMap(mesh)
    layout["hlo_kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout)
    rng = np.random.default_rng(0)
    with distribution.scope():
        w = keras.Variable(rng.normal(0, 0.01, (V_HLO, D_HLO)).astype("float32"),
                           name="hlo_kernel")
        h = rng.normal(size=(N_HLO, D_HLO)).astype("float32")
        t = (np.arange(N_HLO) * 7 % V_HLO).astype("int32")
        out = {"jax_memory_stats": jax.devices()[0].memory_stats()}
        for form in ("vocab_parallel", "vocab_parallel_summed", "gathered", "dense"):
            def loss(h, wv, t):
                with keras.StatelessScope(state_mapping=[(w, wv)]):
                    if form == "dense":
                        z = ops.matmul(h, ops.transpose(w))
                        return ops.mean(ops.logsumexp(z, axis=-1) - ops.take_along_axis(
                            z, t[:, None], axis=-1)[:, 0])
                    return ksh.linear_cross_entropy(
                        h, w, t, kernel_transposed=True, chunk_size=CHUNK_HLO,
                        gradient_in_forward=form == "vocab_parallel_summed",
                        vocab_parallel=False if form == "gathered" else "auto")

            compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
                h, w.value, t).compile()
            gathers = sorted({
                line.split("=")[1].split("all-gather")[0].strip()
                for line in compiled.as_text().splitlines()
                if " all-gather(" in line or "all-gather-start(" in line
            })
            memory = compiled.memory_analysis()
            value, (_, grad) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(h, w.value, t)
            out[form] = {
                "all_gather_shapes": gathers,
                "temp_bytes": memory.temp_size_in_bytes,
                "output_bytes": memory.output_size_in_bytes,
                "argument_bytes": memory.argument_size_in_bytes,
                "loss": float(value),
                "grad_kernel_sharding": str(grad.sharding.spec) if hasattr(
                    grad.sharding, "spec") else str(grad.sharding),
            }
        # Every option, eagerly: the vocabulary-parallel form against the
        # gathered one and NumPy (argmax, lse); without a bias, and with one
        # (replicated, split by the vocabulary-parallel form like the kernel).
        options = dict(kernel_transposed=True, chunk_size=CHUNK_HLO, label_smoothing=0.1,
                       z_loss=1e-3, logit_soft_cap=1.0, return_lse=True, return_argmax=True,
                       ignore_index=5, reduction="none")
        bias = rng.normal(0, 0.5, V_HLO).astype("float32")
        for key, b in (("options", None), ("options_bias", bias)):
            (vp_loss, vp_aux), (ref_loss, ref_aux) = (
                ksh.linear_cross_entropy(h, w, t, b, vocab_parallel=mode,
                                         token_chunk_size=tokens, **options)
                for mode, tokens in ((True if devices > 1 else "auto", 256), (False, None)))
            z = h.astype("float64") @ np.asarray(w.value, "float64").T
            z = np.tanh(z if b is None else z + b)
            lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
            argmax = np.asarray(vp_aux["argmax"])
            out[key] = {
                "loss_max_err": float(np.abs(np.asarray(vp_loss) - np.asarray(ref_loss)).max()),
                "lse_max_err": float(np.abs(np.asarray(vp_aux["lse"]) - lse).max()),
                "argmax_equal": bool(np.array_equal(argmax, z.argmax(1)))
                and bool(np.array_equal(argmax, np.asarray(ref_aux["argmax"]))),
                "accuracy_equal": float(vp_aux["accuracy"]) == float(ref_aux["accuracy"]),
            }
    out["shape"] = {"N": N_HLO, "d": D_HLO, "V": V_HLO, "chunk": CHUNK_HLO}
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    _child(int(sys.argv[1]))
