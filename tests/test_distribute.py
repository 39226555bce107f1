"""Distribution strategies: mirrored (2 logical CPUs), multi-worker, TPU path."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_softmax_heads import training
from keras_softmax_heads.heads import registry

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_lm.py"

TINY = dict(
    dataset_options=dict(vocab_size=40, num_train_tokens=3000,
                         num_valid_tokens=400, num_test_tokens=401),
    embedding_dim=8, hidden_size=8, num_layers=1, batch_size=4, bptt=6,
    epochs=1, steps_per_epoch=4, verbose=0, num_diagnostic_contexts=32,
    tensorboard=False, eval_batch_size=4,
)


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    return env


def _python(code, timeout=300):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=_env(), timeout=timeout, cwd=str(REPO))
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


_TWO_LOGICAL_CPUS = """
        import json, numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import keras
        from keras_softmax_heads import training
"""


def test_mirrored_two_replicas_equals_one_device(tmp_path):
    """MirroredStrategy over 2 logical CPUs: each replica carries its own
    streams' LSTM state, so training equals single-device training."""
    code = _TWO_LOGICAL_CPUS + f"""
        base = training.get_config(**{TINY!r})
        out = {{}}
        for strategy in ("default", "mirrored"):
            r = training.train_and_evaluate(
                base.replace(strategy=strategy), {str(tmp_path)!r} + "/" + strategy)
            out[strategy] = {{"test": r["test"]["nll"], "replicas": r["model"]["num_replicas"],
                             "loss": r["history"][-1]["train_loss"]}}
        w = [keras.saving.load_model({str(tmp_path)!r} + f"/{{s}}/model.keras").get_weights()
             for s in ("default", "mirrored")]
        out["max_weight_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(*w))
        print(json.dumps(out))
    """
    out = _python(code)
    assert out["default"]["replicas"] == 1 and out["mirrored"]["replicas"] == 2
    assert out["max_weight_diff"] < 1e-5
    assert out["mirrored"]["test"] == pytest.approx(out["default"]["test"], rel=1e-5)
    assert out["mirrored"]["loss"] == pytest.approx(out["default"]["loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.skipif("sampled_softmax" not in registry.available_heads(),
                    reason="no sampled_softmax head")
def test_mirrored_sampled_head_trains(tmp_path):
    """A sampling head (its candidates drawn per replica) trains and
    evaluates exactly under MirroredStrategy over 2 logical CPUs."""
    code = _TWO_LOGICAL_CPUS + f"""
        base = training.get_config(**{TINY!r})
        r = training.train_and_evaluate(
            base.replace(strategy="mirrored", head="sampled_softmax"), {str(tmp_path)!r})
        print(json.dumps({{"test": r["test"]["nll"], "replicas": r["model"]["num_replicas"]}}))
    """
    out = _python(code)
    assert out["replicas"] == 2 and np.isfinite(out["test"])


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.slow
def test_multi_worker_two_local_processes(tmp_path):
    """MultiWorkerMirroredStrategy, two worker processes on 127.0.0.1."""
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    flags = [
        f"--model_dir={tmp_path}", "--strategy=multi_worker",
        "--dataset_options=vocab_size=40,num_train_tokens=3000,num_valid_tokens=400,"
        "num_test_tokens=401",
        "--embedding_dim=8", "--hidden_size=8", "--num_layers=1", "--batch_size=4",
        "--bptt=6", "--epochs=1", "--steps_per_epoch=3", "--verbose=0",
        "--num_diagnostic_contexts=32", "--checkpoint_every=2",
    ]
    procs = []
    for index in range(2):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        procs.append(subprocess.Popen(
            [sys.executable, str(SCRIPT), *flags], env=_env(TF_CONFIG=tf_config),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO)))
    outputs = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    chief = keras.saving.load_model(tmp_path / "model.keras").get_weights()
    worker = keras.saving.load_model(
        tmp_path / "workers" / "worker_1" / "model.keras").get_weights()
    for a, b in zip(chief, worker):
        np.testing.assert_array_equal(a, b)
    results = [json.loads((d / "results.json").read_text())
               for d in (tmp_path, tmp_path / "workers" / "worker_1")]
    assert results[0]["model"]["num_replicas"] == 2
    assert results[0]["test"]["nll"] == pytest.approx(results[1]["test"]["nll"], rel=1e-6)


def test_tpu_path_static_shapes_under_xla(tmp_path):
    """What a TPU needs, short of a TPU: static shapes everywhere (full
    windows / drop_remainder) and the whole train + eval compiled by XLA,
    several steps per execution."""
    from keras_softmax_heads.data import load_dataset

    for model in ("lstm", "ngram"):
        config = training.get_config(**TINY).replace(
            model=model, ngram_order=3, jit_compile=True, steps_per_execution=2)
        corpus = load_dataset("synthetic", **config.dataset_options)
        steps = training.train_steps_per_epoch(config, corpus)
        spec = training.train_dataset(config, corpus, 0, steps, 0).element_spec
        for s in tf.nest.flatten(spec):
            assert s.shape.is_fully_defined(), (model, spec)
        assert spec[0].shape[0] == config.batch_size
    # The LSTM (carried state in variables, while loops) compiled by XLA.
    results = training.train_and_evaluate(config.replace(model="lstm"), str(tmp_path))
    assert np.isfinite(results["test"]["nll"])
    assert results["training"]["global_steps"] == 4


def test_tpu_strategy_without_tpu_raises_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), f"--model_dir={tmp_path}", "--strategy=tpu",
         "--tpu=local"],
        capture_output=True, text=True, env=_env(), timeout=120, cwd=str(REPO))
    assert proc.returncode != 0
    assert "Could not connect to the TPU 'local'" in proc.stderr
    assert "tpu_scripts/README.md" in proc.stderr


def test_mirrored_fused_losses_equal_one_device():
    """The losses that reduce by themselves (`LinearCrossEntropy`, the fused
    causal LM's and the distiller's `compute_loss`) under MirroredStrategy
    over 2 logical CPUs report the single-device loss and take its step:
    each replica returns its share of the mean, as Keras' own losses do (they
    reported and stepped 2x). The fused LM's first call is `evaluate`
    (Keras traces it with float targets)."""
    pytest.importorskip("keras_hub")
    code = _TWO_LOGICAL_CPUS + """
        import keras_hub
        import keras_softmax_heads as ksh
        V = 64
        ids = np.random.default_rng(0).integers(1, V, (8, 9)).astype("int32")
        x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((8, 8), "int32")}
        y = ids[:, 1:]

        def gpt2(seed, cls=keras_hub.models.GPT2CausalLM):
            keras.utils.set_random_seed(seed)
            backbone = keras_hub.models.GPT2Backbone(
                vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=16,
                intermediate_dim=32, max_sequence_length=16, dropout=0.0)
            return cls(backbone=backbone, preprocessor=None)

        def lce(gradient_in_forward):
            keras.utils.set_random_seed(1)
            embedding = keras.layers.Embedding(V, 8)
            model = keras.Sequential([keras.Input((8,), dtype="int32"), embedding,
                                      keras.layers.Dense(8)])
            model.compile(keras.optimizers.SGD(0.5), loss=ksh.LinearCrossEntropy(
                embedding, gradient_in_forward=gradient_in_forward))
            return model, ids[:, :-1], y

        def fused():
            lm = gpt2(1, ksh.fused.fused_causal_lm(keras_hub.models.GPT2CausalLM))
            lm.compile(keras.optimizers.SGD(0.5), weighted_metrics=[])
            return lm, x, y

        def distiller():
            d = ksh.fused.DistillationCausalLM(gpt2(1), gpt2(2), divergence="forward_kl",
                                               cross_entropy_weight=0.5)
            d.compile(keras.optimizers.SGD(0.5))
            d(x)
            return d, x, y

        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        out = {}
        for name, build in [("lce", lambda: lce(False)), ("lce_summed", lambda: lce(True)),
                            ("fused", fused), ("distiller", distiller)]:
            rows = []
            for scope in (None, strategy):
                if scope is None:
                    model, inputs, targets = build()
                else:
                    with scope.scope():
                        model, inputs, targets = build()
                if scope is None:
                    start = [w.numpy() for w in model.weights]
                else:
                    for v, a in zip(model.weights, start):
                        v.assign(a)
                ev = model.evaluate(inputs, targets, batch_size=8, verbose=0,
                                    return_dict=True)["loss"] if name != "distiller" else 0.0
                loss = float(model.train_on_batch(inputs, targets, return_dict=True)["loss"])
                step = [w.numpy() - a for w, a in zip(model.weights, start)]
                rows.append((float(ev), loss, step))
            (ev1, l1, s1), (ev2, l2, s2) = rows
            out[name] = {"eval": [ev1, ev2], "loss": [l1, l2],
                         "step": max(float(np.abs(a).max()) for a in s1),
                         "step_diff": max(float(np.abs(a - b).max()) for a, b in zip(s1, s2))}
        print(json.dumps(out))
    """
    out = _python(code)
    for name, row in out.items():
        assert row["eval"][1] == pytest.approx(row["eval"][0], rel=1e-5), name
        assert row["loss"][1] == pytest.approx(row["loss"][0], rel=1e-5), name
        assert row["step"] > 1e-4 and row["step_diff"] < 1e-3 * row["step"], (name, row)
