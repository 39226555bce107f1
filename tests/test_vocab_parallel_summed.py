"""The summed passes vocabulary-parallel on JAX (4 simulated host devices,
a subprocess: `XLA_FLAGS` must be set before JAX starts).

`linear_cross_entropy(..., gradient_in_forward=True)`: with the kernel
variable sharded on V by a `keras.distribution` (rows also split over a
batch axis, or not), the summed loss, its argmax and its gradients (hidden
states, kernel, bias, sample weights) equal the single-device summed pass,
with label smoothing, z-loss, a soft cap, an ignore index and sample
weights; and the compiled step gathers no `[V, d]` matrix and keeps the
kernel's gradient sharded.

`linear_divergence` (summed, its gradient in the forward pass): with the
student's kernel sharded on V and the teacher's replicated (another hidden
size, the other kernel layout), both with biases, each divergence (forward
and reverse KL, JSD) at a temperature with soft caps, weights and an ignore
index gives the single-device value and gradients (the teacher's too with
`teacher_gradient`), without gathering the student's `[V, d]` matrix; and
(`-m slow`) `examples/hub_distillation.py --model_parallel=4` trains that way."""

import json

import pytest
from backends import count_calls
from backends import log_likelihood_on_shards
from backends import run_on_simulated_devices
from backends import vocabulary_sharding

pytest.importorskip("jax")

DEVICES = 4


def test_vocab_parallel_summed_matches_single_device():
    result = run_on_simulated_devices(__file__, DEVICES)
    divergences = result.pop("divergence")
    mixtures = result.pop("mixture")
    token_heads = result.pop("token_losses")
    token_divergence = result.pop("token_divergence")
    head = result.pop("head")
    assert sorted(result) == ["batch_plain", "model_transposed_bias"], result
    for name, r in result.items():
        assert r["vocab_parallel_used"] and not r["single_device_used"], (name, r)
        assert abs(r["loss"][0] - r["loss"][1]) < 1e-6 * abs(r["loss"][1]), (name, r)
        assert r["argmax_equal"], (name, r)
        assert len(r["grad_err"]) == (4 if "bias" in name else 3), (name, r)
        assert max(r["grad_err"]) < 1e-5, (name, r)
        # No device gathers the [V, d] matrix; its gradient stays split on V.
        assert not any(s.startswith(r["full_kernel"]) for s in r["all_gather_shapes"]), (name, r)
        assert "model" in r["kernel_grad_spec"], (name, r)
    # FullSoftmax(chunk_size) and MixtureOfContexts trained with HeadLoss,
    # the kernel sharded on V: each device its shard, the unsharded step's
    # loss and weights.
    assert sorted(head) == ["full_softmax", "mixture_of_contexts"], head
    for name, r in head.items():
        assert r["vocab_parallel_calls"] > 0, (name, r)
        assert r["loss_rel_err"] < 1e-5 and r["step_max_err"] < 1e-4 * r["step_scale"], (name, r)
        assert r["kernel_spec"] == [None, "model"], (name, r)
    assert sorted(mixtures) == ["mos_bias_batch", "mos_plif_bias_batch", "moss_transposed",
                                "sig_relu_transposed"], mixtures
    for name, r in mixtures.items():
        assert r["vocab_parallel_calls"] == 1, (name, r)
        assert abs(r["value"][0] - r["value"][1]) < 1e-5 * abs(r["value"][1]), (name, r)
        # latents, log-priors, kernel, weights (+ bias, + the PLIF's slopes)
        assert len(r["grad_err"]) == 4 + ("bias" in name) + ("plif" in name), (name, r)
        assert max(r["grad_err"]) < 1e-4, (name, r)
        # Neither the [V, L] matrix nor a [rows, V] score tile is gathered.
        assert not any(f"{r['vocab']}]" in s or f"[{r['vocab']}," in s
                       for s in r["all_gather_shapes"]), (name, r)
        assert "model" in r["kernel_grad_spec"], (name, r)
    # The heads' per-token log-likelihood (evaluation, training_loss) on each
    # device's shard: values and gradients for a random cotangent.
    assert sorted(token_heads) == ["full_softmax", "mos3_plif", "mos3_tied", "plif",
                                   "sigsoftmax"], token_heads
    for name, r in token_heads.items():
        assert r["token_losses_calls"] == 2, (name, r)  # the two traces (sharded)
        assert r["value_err"] < 1e-5, (name, r)
        assert len(r["grad_err"]) == r["num_weights"] + 1 and max(r["grad_err"]) < 1e-4, (name, r)
        assert not any(f"{r['vocab']}]" in s or f"[{r['vocab']}," in s
                       for s in r["all_gather_shapes"]), (name, r)
    # linear_divergence(reduction="none") on each device's shard.
    assert sorted(token_divergence) == ["forward_kl", "reverse_kl_teacher"], token_divergence
    for name, r in token_divergence.items():
        assert r["vocab_parallel_used"] and not r["single_device_used"], (name, r)
        assert r["value_err"] < 1e-5 and r["ignored_zero"], (name, r)
        assert len(r["grad_err"]) == 6 and max(r["grad_err"]) < 1e-4, (name, r)
        assert not any(s.startswith(r["full_kernel"]) for s in r["all_gather_shapes"]), (name, r)
    assert sorted(divergences) == ["forward_kl", "jsd", "reverse_kl"], divergences
    for name, r in divergences.items():
        assert r["vocab_parallel_used"] and not r["single_device_used"], (name, r)
        assert abs(r["value"][0] - r["value"][1]) < 1e-5 * abs(r["value"][1]), (name, r)
        # student h, kernel, bias (and with the teacher's gradient its h, kernel, bias)
        assert len(r["grad_err"]) == (6 if r["teacher_gradient"] else 3), (name, r)
        assert max(r["grad_err"]) < 1e-4, (name, r)
        assert not any(s.startswith(r["full_kernel"]) for s in r["all_gather_shapes"]), (name, r)
        assert "model" in r["kernel_grad_spec"], (name, r)


@pytest.mark.slow  # 11 s in its own 4-device process
def test_distillation_example_trains_vocabulary_parallel():
    """`examples/hub_distillation.py --model_parallel=4` trains, the
    divergence vocabulary-parallel, the teacher unchanged."""
    pytest.importorskip("keras_hub")
    example = run_on_simulated_devices(__file__, DEVICES, "example")
    assert example["vocab_parallel_calls"] > 0, example
    assert example["unchanged"], example
    assert example["divergences"][-1] < example["divergences"][0], example


def in_both_modes(steps, args, calls):
    """Runs the jitted steps `steps[True]` (the vocabulary-parallel path on)
    and `steps[False]` (off) on `args`: `(outs, used, gathers)`, `outs[mode]`
    the step's output, `used[mode]` how often each path (`"vocab_parallel"`,
    `"single"`, counted in `calls` by `count_calls`) was traced, `gathers`
    the all-gather shapes of the vocabulary-parallel step compiled."""
    outs, used = {}, {}
    for mode in (True, False):
        before = len(calls)
        outs[mode] = steps[mode](*args)
        used[mode] = {k: calls[before:].count(k) for k in ("vocab_parallel", "single")}
    return outs, used, all_gather_shapes(steps[True].lower(*args).compile())


def all_gather_shapes(compiled):
    """The result shapes (`f32[96,16]`, ...) of a compiled step's
    all-gathers."""
    return sorted({line.split("=")[1].split("all-gather")[0].strip()
                   for line in compiled.as_text().splitlines()
                   if " all-gather(" in line or "all-gather-start(" in line})


def child():
    import jax
    import keras
    import numpy as np

    import keras_softmax_heads as ksh

    n, d, v = 24, 16, 96
    rng = np.random.default_rng(0)
    h = rng.normal(size=(n, d)).astype("float32")
    y = rng.integers(0, v, n).astype("int32")
    y[3] = -100
    sw = rng.uniform(0.5, 2.0, n).astype("float32")
    calls = []
    count_calls(ksh.fused.cross_entropy, "vocab_parallel_summed", calls, "vocab_parallel")
    count_calls(ksh.fused.cross_entropy, "summed_cross_entropy", calls, "single")
    result = {}
    for name, mesh_shape, transposed, with_bias in (
            ("model_transposed_bias", (1, DEVICES), True, True),
            ("batch_plain", (2, DEVICES // 2), False, False)):
        mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"),
                                             keras.distribution.list_devices())
        distribution = vocabulary_sharding(mesh, transposed)
        w = (rng.normal(size=(v, d) if transposed else (d, v)) * 0.5).astype("float32")
        b = rng.normal(size=v).astype("float32")
        with distribution.scope():
            kernel = keras.Variable(w, name="kernel")
            bias = keras.Variable(b, name="bias") if with_bias else None
            steps = {}
            for mode in (True, False):
                def loss(h, kval, bval, weights, mode=mode):
                    mapping = [(kernel, kval)] + ([(bias, bval)] if with_bias else [])
                    with keras.StatelessScope(state_mapping=mapping):
                        value, aux = ksh.linear_cross_entropy(
                            h, kernel, y, bias, kernel_transposed=transposed,
                            sample_weight=weights, ignore_index=-100, label_smoothing=0.1,
                            z_loss=1e-3, logit_soft_cap=2.0, return_argmax=True,
                            gradient_in_forward=True, token_chunk_size=5,
                            vocab_parallel=mode)
                    return value, aux["argmax"]

                argnums = (0, 1, 2, 3) if with_bias else (0, 1, 3)
                steps[mode] = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
            outs, used, gathers = in_both_modes(
                steps, (h, kernel.value, bias.value if with_bias else None, sw), calls)
        grad_spec = str(outs[True][1][1].sharding.spec)
        a, r = ((float(value), np.asarray(argmax), [np.asarray(g) for g in grads])
                for (value, argmax), grads in (outs[True], outs[False]))
        result[name] = {
            "vocab_parallel_used": used[True]["vocab_parallel"] > 0,
            "single_device_used": used[True]["single"] > 0 or used[False]["vocab_parallel"] > 0,
            "loss": [a[0], r[0]],
            "argmax_equal": bool(np.array_equal(a[1], r[1])),
            "grad_err": [float(np.abs(x - z).max() / np.abs(z).max())
                         for x, z in zip(a[2], r[2])],
            "all_gather_shapes": gathers,
            "full_kernel": f"f32[{w.shape[0]},{w.shape[1]}]",
            "kernel_grad_spec": grad_spec,
        }
    result["divergence"] = divergences(rng)
    result["mixture"] = mixtures(rng)
    result["token_losses"] = head_token_losses(rng)
    result["token_divergence"] = token_divergences(rng)
    result["head"] = {"full_softmax": summed_head_step(rng, "full_softmax"),
                      "mixture_of_contexts": summed_head_step(rng, "mixture_of_contexts")}
    print(json.dumps(result))


def distillation_example():
    """`examples/hub_distillation.py --model_parallel=4` at a tiny shape:
    its divergences, whether the teacher is unchanged, and how many times
    the vocabulary-parallel divergence was traced."""
    import importlib.util
    import pathlib

    from keras_softmax_heads.fused import distillation

    if importlib.util.find_spec("keras_hub") is None:
        return None
    calls = []
    count_calls(distillation, "vocab_parallel_divergence", calls)
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "hub_distillation.py"
    spec = importlib.util.spec_from_file_location("hub_distillation", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    divergences, unchanged = example.main([
        f"--model_parallel={DEVICES}", "--steps=3", "--vocab_size=64", "--student_dim=16",
        "--teacher_dim=24", "--batch_size=2", "--seq_len=6", "--chunk_size=24",
        "--divergence=jsd", "--learning_rate=1e-2"])
    return {"divergences": divergences, "unchanged": unchanged,
            "vocab_parallel_calls": len(calls)}


def summed_head_step(rng, module_name):
    """One SGD step of `Sequential([Embedding, head])` with `HeadLoss` (the
    summed objective, its gradient in the forward pass), the head's
    `[d, V]` kernel sharded on V, against the same step unsharded; the head
    `FullSoftmax(chunk_size)` (`module_name="full_softmax"`) or
    `MixtureOfContexts` (`"mixture_of_contexts"`: the summed cross-entropy
    of its mixed context)."""
    import keras
    import numpy as np

    import keras_softmax_heads as ksh
    from keras_softmax_heads.heads import head_utils

    v, d, batch, steps, lr = 96, 16, 4, 6, 0.5
    x = rng.integers(0, v, (batch, steps)).astype("int32")
    y = rng.integers(0, v, (batch, steps)).astype("int32")
    calls = []
    # Both heads' summed pass: `head_utils.summed_linear_cross_entropy` (`fit`
    # only here: no per-token evaluation).
    count_calls(head_utils, "vocab_parallel_summed", calls)

    def model(distribution=None):
        keras.utils.set_random_seed(0)
        with (distribution.scope() if distribution else keras.name_scope("unsharded")):
            if module_name == "full_softmax":
                head = ksh.FullSoftmax(v, chunk_size=40, name="head", logit_soft_cap=3.0)
            else:
                head = ksh.MixtureOfContexts(v, num_components=3, name="head")
            m = keras.Sequential([keras.Input((steps,), dtype="int32"),
                                  keras.layers.Embedding(v, d), head])
            m.compile(keras.optimizers.SGD(lr), loss=ksh.HeadLoss(head))
        return m, head

    def step(m):
        w0 = [np.asarray(w) for w in m.get_weights()]
        loss = m.fit(x, y, batch_size=batch, epochs=1, verbose=0).history["loss"][0]
        return loss, [(a - np.asarray(b)) / lr for a, b in zip(w0, m.get_weights())]

    reference, _ = model()
    loss_ref, steps_ref = step(reference)
    mesh = keras.distribution.DeviceMesh((1, DEVICES), ("batch", "model"),
                                         keras.distribution.list_devices())
    distribution = vocabulary_sharding(mesh, False, ".*head/kernel")
    sharded, head = model(distribution)
    with distribution.scope():
        loss, steps_ = step(sharded)
    return {
        "vocab_parallel_calls": len(calls),
        "kernel_spec": list(head.kernel.value.sharding.spec),
        "loss_rel_err": abs(loss - loss_ref) / abs(loss_ref),
        "step_max_err": max(float(np.abs(a - b).max()) for a, b in zip(steps_, steps_ref)),
        "step_scale": max(float(np.abs(b).max()) for b in steps_ref),
    }


def distillation_inputs(rng):
    """`(n, d_s, V, h_s, h_t, targets, distribution)` of the distillation
    checks: 24 tokens, a student of width 16 and a teacher of width 24,
    V = 96, target 5 the ignore index -1, and a 2 x 2 mesh whose layout
    splits the student's tied `[V, d_s]` kernel (`student_kernel`) on V."""
    import keras

    n, d_s, d_t, v = 24, 16, 24, 96
    h_s = rng.normal(size=(n, d_s)).astype("float32")
    h_t = rng.normal(size=(n, d_t)).astype("float32")
    y = rng.integers(0, v, n).astype("int32")
    y[5] = -1
    mesh = keras.distribution.DeviceMesh((2, DEVICES // 2), ("batch", "model"),
                                         keras.distribution.list_devices())
    return n, d_s, v, h_s, h_t, y, vocabulary_sharding(mesh, True, "student_kernel")


def distillation_weights(rng, h_s, h_t, v):
    """`(student kernel variable [V, d_s], teacher kernel [d_t, V] (an
    array: replicated), student bias, teacher bias)`, made under the
    distribution's scope."""
    import keras

    w_s = keras.Variable((rng.normal(size=(v, h_s.shape[1])) * 0.5).astype("float32"),
                         name="student_kernel")
    w_t = (rng.normal(size=(h_t.shape[1], v)) * 0.5).astype("float32")
    b_s, b_t = (rng.normal(size=v).astype("float32") for _ in range(2))
    return w_s, w_t, b_s, b_t


def divergences(rng):
    """The distillation's summed divergence, vocabulary-parallel against one
    device: `{divergence: result}`."""
    import jax
    import keras
    import numpy as np

    import keras_softmax_heads as ksh
    from keras_softmax_heads.fused import distillation

    n, d_s, v, h_s, h_t, y, distribution = distillation_inputs(rng)
    sw = rng.uniform(0.5, 2.0, n).astype("float32")
    calls = []
    count_calls(distillation, "vocab_parallel_divergence", calls, "vocab_parallel")
    count_calls(distillation, "summed_divergence", calls, "single")
    result = {}
    with distribution.scope():
        w_s, w_t, b_s, b_t = distillation_weights(rng, h_s, h_t, v)
        for divergence, teacher_gradient in (("forward_kl", False), ("reverse_kl", True),
                                             ("jsd", False)):
            steps = {}
            for mode in (True, False):
                def loss(h_s, w, b_s, h_t, w_t, b_t, mode=mode):
                    with keras.StatelessScope(state_mapping=[(w_s, w)]):
                        return ksh.linear_divergence(
                            h_s, w_s, h_t, w_t, y, student_bias=b_s, teacher_bias=b_t,
                            student_kernel_transposed=True, divergence=divergence,
                            beta=0.3, temperature=1.5, student_soft_cap=3.0,
                            teacher_soft_cap=2.0, ignore_index=-1, sample_weight=sw,
                            teacher_gradient=teacher_gradient, token_chunk_size=5,
                            vocab_parallel=mode)

                argnums = (0, 1, 2, 3, 4, 5) if teacher_gradient else (0, 1, 2)
                steps[mode] = jax.jit(jax.value_and_grad(loss, argnums=argnums))
            outs, used, gathers = in_both_modes(steps, (h_s, w_s.value, b_s, h_t, w_t, b_t),
                                                calls)
            grad_spec = str(outs[True][1][1].sharding.spec)
            a, r = ((float(value), [np.asarray(g) for g in grads])
                    for value, grads in (outs[True], outs[False]))
            result[divergence] = {
                "teacher_gradient": teacher_gradient,
                "vocab_parallel_used": used[True]["vocab_parallel"] > 0,
                "single_device_used": used[True]["single"] > 0
                or used[False]["vocab_parallel"] > 0,
                "value": [a[0], r[0]],
                "grad_err": [float(np.abs(x - z).max() / np.abs(z).max())
                             for x, z in zip(a[1], r[1])],
                "all_gather_shapes": gathers,
                "full_kernel": f"f32[{v},{d_s}]",
                "kernel_grad_spec": grad_spec,
            }
    return result


def mixtures(rng):
    """The mixture heads' summed NLL (`summed_mixture_nll`: MoS, MoSS,
    MoS+PLIF, a one-component SigSoftmax), vocabulary-parallel against one
    device: `{case: result}`."""
    import jax
    import keras
    import numpy as np

    from keras_softmax_heads.chunked import summed_mixture
    from keras_softmax_heads.chunked import vocab_parallel

    n, dim, v = 24, 16, 120
    y = rng.integers(0, v, n).astype("int32")
    sw = rng.uniform(0.5, 2.0, n).astype("float32")
    sw[4] = 0.0
    calls = []
    count_calls(vocab_parallel, "vocab_parallel_mixture", calls)
    result = {}
    for name, mesh_shape, k, options in (
            ("mos_bias_batch", (2, DEVICES // 2), 3, {}),
            ("moss_transposed", (1, DEVICES), 2, dict(output_fn="sigsoftmax")),
            ("mos_plif_bias_batch", (2, DEVICES // 2), 2, dict(knot_bound=3.0)),
            ("sig_relu_transposed", (1, DEVICES), 1, dict(output_fn="relu", epsilon=1e-3))):
        transposed, with_bias = "transposed" in name, "bias" in name
        mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"),
                                             keras.distribution.list_devices())
        w = (rng.normal(size=(v, dim) if transposed else (dim, v)) * 0.5).astype("float32")
        latents = rng.normal(size=(n, k, dim)).astype("float32")
        log_priors = np.asarray(jax.nn.log_softmax(rng.normal(size=(n, k)), axis=1), "float32")
        b = rng.normal(size=v).astype("float32") if with_bias else None
        raw = rng.normal(size=32).astype("float32") if "plif" in name else None
        distribution = vocabulary_sharding(mesh, transposed)
        with distribution.scope():
            kernel = keras.Variable(w, name="kernel")

        def loss(lat, lp, kval, weights, *rest, sharded):
            b_, raw_ = (rest[0] if with_bias else None), (rest[-1] if raw is not None else None)
            if not sharded:
                return summed_mixture.summed_mixture_nll(
                    lat, lp, kval, b_, y, weights, raw_slopes=raw_, kernel_transposed=transposed,
                    token_chunk_size=5, **options)
            with keras.StatelessScope(state_mapping=[(kernel, kval)]):
                return vocab_parallel.summed_mixture_nll_auto(
                    lat, lp, kernel, b_, y, weights, raw_slopes=raw_,
                    kernel_transposed=transposed, token_chunk_size=5, **options)

        args = [latents, log_priors, kernel.value, sw] + [x for x in (b, raw) if x is not None]
        outs = {}
        for sharded in (True, False):
            step = jax.jit(jax.value_and_grad(
                lambda *a, sharded=sharded: loss(*a, sharded=sharded),
                argnums=tuple(range(len(args)))))
            with distribution.scope():  # traced under the distribution
                value, grads = step(*args)
                if sharded:
                    gathers = all_gather_shapes(step.lower(*args).compile())
            outs[sharded] = (float(value), [np.asarray(g) for g in grads])
            if sharded:
                grad_spec = str(grads[2].sharding.spec)
        a, r = outs[True], outs[False]
        result[name] = {
            "vocab_parallel_calls": len(calls),
            "value": [a[0], r[0]],
            "grad_err": [float(np.abs(x - z).max() / np.abs(z).max())
                         for x, z in zip(a[1], r[1])],
            "all_gather_shapes": gathers,
            "vocab": v,
            "kernel_grad_spec": grad_spec,
        }
        calls.clear()
    return result


def head_token_losses(rng):
    """Each head's per-token `log_likelihood` (with `chunk_size`; MoS
    always tiled) traced under a `VocabularyParallel` distribution (each
    device its shard: `token_losses`) against the same head traced without
    one: the log-likelihoods, and the gradients of `sum(u * ll)` for a
    random cotangent `u` with respect to the inputs and every trainable
    weight; and whether the compiled evaluation gathers a V-sized array."""
    import keras

    import keras_softmax_heads as ksh
    from keras_softmax_heads import training
    from keras_softmax_heads.heads import head_utils

    b, t, dim, v = 4, 6, 16, 120
    h = rng.normal(size=(b, t, dim)).astype("float32")
    y = rng.integers(0, v, (b, t)).astype("int32")
    u = rng.normal(size=(b, t)).astype("float32")
    calls = []
    count_calls(head_utils, "token_losses", calls)  # the heads' one path to it
    distribution = training.VocabularyParallel(v, vocab_shards=DEVICES // 2)  # 2 x 2
    result = {}
    for name, make in (
            ("full_softmax", lambda: ksh.FullSoftmax(v, chunk_size=32, logit_soft_cap=3.0)),
            ("sigsoftmax", lambda: ksh.SigSoftmax(v, chunk_size=32)),
            ("plif", lambda: ksh.PLIFSoftmax(v, chunk_size=32, num_knots=64)),
            ("mos3_plif", lambda: ksh.MixtureOfSoftmaxes(v, num_components=3, num_knots=64)),
            ("mos3_tied", None)):
        with distribution.scope():
            if make is None:  # a [V, d] tied embedding, no bias
                embedding = keras.layers.Embedding(v, dim)
                embedding.build((None,))
                head = ksh.MixtureOfSoftmaxes(v, num_components=3, token_embedding=embedding,
                                              use_bias=False)
            else:
                head = make()
            head.build((None, None, dim))
        r = log_likelihood_on_shards(head, h, y, u, distribution, calls)
        result[name] = {
            "token_losses_calls": len(r["calls"]),
            "value_err": r["value_err"],
            "num_weights": r["num_weights"],
            "grad_err": r["grad_err"],
            "all_gather_shapes": all_gather_shapes(r["compiled"]),
            "vocab": v,
        }
    return result


def token_divergences(rng):
    """`linear_divergence(reduction="none")` with the student's tied kernel
    sharded on V: vocabulary-parallel (`token_losses` over
    `vocab_parallel_divergence`) against `vocab_parallel=False`, the
    per-token values and the gradients of `sum(u * D)` for a random `u`
    (both sides' hidden states, kernels and biases; the teacher's zero
    without `teacher_gradient`)."""
    import jax
    import keras
    import numpy as np

    import keras_softmax_heads as ksh
    from keras_softmax_heads.fused import distillation

    n, d_s, v, h_s, h_t, y, distribution = distillation_inputs(rng)
    u = rng.normal(size=n).astype("float32")
    calls = []
    count_calls(distillation, "vocab_parallel_token_divergence", calls, "vocab_parallel")
    count_calls(distillation, "tiled_divergence", calls, "single")
    result = {}
    with distribution.scope():
        w_s, w_t, b_s, b_t = distillation_weights(rng, h_s, h_t, v)
        for name, divergence, teacher_gradient in (("forward_kl", "forward_kl", False),
                                                   ("reverse_kl_teacher", "reverse_kl", True)):
            steps = {}
            for mode in (True, False):
                def loss(h_s, w, b_s, h_t, w_t, b_t, mode=mode):
                    with keras.StatelessScope(state_mapping=[(w_s, w)]):
                        per_token = ksh.linear_divergence(
                            h_s, w_s, h_t, w_t, y, student_bias=b_s, teacher_bias=b_t,
                            student_kernel_transposed=True, divergence=divergence,
                            temperature=1.5, student_soft_cap=3.0, ignore_index=-1,
                            teacher_gradient=teacher_gradient, reduction="none",
                            chunk_size=32, vocab_parallel=mode)
                    return jax.numpy.sum(u * per_token), per_token

                steps[mode] = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)),
                                                         has_aux=True))
            outs, used, gathers = in_both_modes(steps, (h_s, w_s.value, b_s, h_t, w_t, b_t),
                                                calls)
            a, r = ((np.asarray(per_token), [np.asarray(g) for g in grads])
                    for (_, per_token), grads in (outs[True], outs[False]))
            result[name] = {
                "vocab_parallel_used": used[True]["vocab_parallel"] > 0,
                "single_device_used": used[True]["single"] > 0
                or used[False]["vocab_parallel"] > 0,
                "value_err": float(np.abs(a[0] - r[0]).max() / np.abs(r[0]).max()),
                "ignored_zero": bool(a[0][5] == 0.0),
                "grad_err": [float(np.abs(x - z).max() / max(np.abs(z).max(), 1e-12))
                             for x, z in zip(a[1], r[1])],
                "all_gather_shapes": gathers,
                "full_kernel": f"f32[{v},{d_s}]",
            }
    return result


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["example"]:  # its own process: it sets a global distribution
        print(json.dumps(distillation_example()))
    else:
        child()
