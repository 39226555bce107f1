"""`linear_cross_entropy` / `fused_causal_lm` under `keras.distribution` on
JAX with the output matrix sharded on the vocabulary axis (keras-hub's
Gemma / Llama layout maps), on 2 and 8 simulated host devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, a subprocess: the
flag must be set before JAX starts).

Checks that one distributed `fit` step of a fused Gemma 2 style model (tied
`[V, d]` embedding sharded `("model", "batch")`) and of an untied Llama
(`reverse_embeddings` `[d, V]` sharded `("batch", "model")`) gives the
unsharded model's loss and gradients, and reports, from the compiled HLO of
the fused loss + gradients on a sharded kernel, what the partitioner does
with the tiled loop (see `docs/chunked.md`, "Sharding").
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")
keras_hub = pytest.importorskip("keras_hub")

HERE = os.path.dirname(os.path.abspath(__file__))


def _run_child(devices):
    env = dict(os.environ)
    env.update(
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=os.pathsep.join(
            [os.path.dirname(HERE)] + [p for p in [env.get("PYTHONPATH")] if p]),
    )
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(devices)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("devices", [2, 8])
def test_vocab_sharded_fit_matches_unsharded(devices):
    result = _run_child(devices)
    for name in ("gemma2", "llama"):
        r = result[name]
        assert r["kernel_spec"] == r["expected_spec"], r
        assert r["kernel_shards"] == devices, r
        assert r["loss_rel_err"] < 1e-5, r
        assert r["grad_max_err"] < 1e-4 * r["grad_scale"], r
    # The partitioner's treatment of the tiled loop, recorded (not asserted
    # beyond being present): see the docs.
    assert "all_gather_shapes" in result["hlo"]


# ---------------------------------------------------------------- child --

V, T, B, LR = 96, 8, 4, 0.5


def _child(devices):
    import jax
    import keras
    import numpy as np
    from keras import ops

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

    def make(factory, distribution=None):
        keras.utils.set_random_seed(0)
        scope = distribution.scope() if distribution else _null()
        with scope:
            backbone, cls = factory()
            lm = ksh.fused.fused_causal_lm(cls)(
                backbone=backbone, preprocessor=None, fused_loss={"chunk_size": 40})
            lm.compile(optimizer=keras.optimizers.SGD(LR), weighted_metrics=[],
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return lm

    def step(lm):
        w0 = [np.asarray(v.value) for v in lm.trainable_variables]
        loss = lm.fit(x, y, sample_weight=sw, batch_size=B, verbose=0).history["loss"][0]
        grads = [(a - np.asarray(v.value)) / LR for a, v in zip(w0, lm.trainable_variables)]
        return loss, grads

    mesh = keras.distribution.DeviceMesh(
        (1, devices), ("batch", "model"), keras.distribution.list_devices()[:devices])
    result = {"devices": devices}
    for name, factory, path, spec in (
        ("gemma2", gemma2, "token_embedding/embeddings", ("model", "batch")),
        ("llama", llama, "token_embedding/reverse_embeddings", (None, "model")),
    ):
        reference = make(factory)
        layout = factory()[0].__class__.get_layout_map(mesh)
        layout["token_embedding/reverse_embeddings"] = ("batch", "model")
        sharded = make(factory, keras.distribution.ModelParallel(
            layout_map=layout, batch_dim_name="batch"))
        sharded.set_weights(reference.get_weights())
        kernel = next(v for v in sharded.variables if v.path == path)
        loss_ref, g_ref = step(reference)
        loss, g = step(sharded)
        result[name] = {
            "kernel_spec": [a for a in kernel.value.sharding.spec] + [None] * (
                2 - len(kernel.value.sharding.spec)),
            "expected_spec": list(spec),
            "kernel_shards": len({str(s.index) for s in kernel.value.addressable_shards}),
            "loss": loss, "loss_ref": loss_ref,
            "loss_rel_err": abs(loss - loss_ref) / abs(loss_ref),
            "grad_max_err": max(float(np.abs(a - b).max()) for a, b in zip(g, g_ref)),
            "grad_scale": max(float(np.abs(b).max()) for b in g_ref),
        }

    # What the partitioner does with the tiled loop: compile the fused loss
    # and its gradients with the [V, d] kernel sharded on V.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    jmesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("model",))
    n, d, vocab, chunk = 256, 128, 8192, 1024

    def fused(h, w, t):
        return ksh.linear_cross_entropy(h, w, t, kernel_transposed=True, chunk_size=chunk)

    def dense(h, w, t):
        logits = h @ w.T
        return ops.mean(ops.logsumexp(logits, axis=-1) - ops.take_along_axis(
            logits, t[:, None], axis=-1)[:, 0])

    hlo = {}
    args = (
        jax.device_put(np.ones((n, d), "float32"), NamedSharding(jmesh, P())),
        jax.device_put(np.ones((vocab, d), "float32") * 0.01, NamedSharding(jmesh, P("model", None))),
        jax.device_put(np.arange(n, dtype="int32") % vocab, NamedSharding(jmesh, P())),
    )
    for label, fn in (("fused", fused), ("dense", dense)):
        compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile()
        text = compiled.as_text()
        gathers = sorted({
            line.split("=")[1].split("all-gather")[0].strip()
            for line in text.splitlines() if " all-gather(" in line or "all-gather-start(" in line
        })
        memory = compiled.memory_analysis()
        hlo[label] = {
            "all_gather_shapes": gathers,
            "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
            "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
            "output_bytes": getattr(memory, "output_size_in_bytes", None),
        }
    hlo["all_gather_shapes"] = hlo["fused"]["all_gather_shapes"]
    hlo["shape"] = {"N": n, "d": d, "V": vocab, "chunk": chunk}
    hlo["memory_stats"] = jax.devices()[0].memory_stats()
    result["hlo"] = hlo
    print(json.dumps(result, default=str))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    _child(int(sys.argv[1]))
