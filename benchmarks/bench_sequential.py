r"""A head as the last layer of a `keras.Sequential`: train-step time of the
README pattern against `HeadModel` and against the full softmax.

Issue 13's check: at V = 100k, N = 2048, d = 512 the `SampledSoftmax`
Sequential step (compiled with `HeadLoss(head)`) must be within 1.5x of the
`HeadModel` step and at least 5x faster than `FullSoftmax` with
`SparseCategoricalCrossentropy(from_logits=True)`. Rows (same backbone: one
`Dense(d)` on `N` context vectors, Adam, `train_on_batch`):

* `sequential_sampled`: `Sequential([..., SampledSoftmax])` + `HeadLoss`;
* `head_model_sampled`: `HeadModel(backbone, SampledSoftmax)`;
* `sequential_full_scce`: `Sequential([..., FullSoftmax])` + SCCE;
* `sequential_hsm`: `Sequential([..., HierarchicalSoftmax])` + `HeadLoss`.

Each row runs in a fresh process (`--row`); the parent prints the ratios of
one run and writes them as JSON. `--backend` picks the Keras backend
(TensorFlow by default, or `$KERAS_BACKEND`); `--jit_compile` defaults to
False on TensorFlow (the measured setting) and to Keras' `"auto"` elsewhere.

    python benchmarks/bench_sequential.py --out docs/results/bench_sequential.json
"""

import os

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py
from absl import app
from absl import flags

flags.DEFINE_integer("vocab_size", 100_000, "V.")
flags.DEFINE_integer("dim", 512, "d.")
flags.DEFINE_integer("tokens", 2048, "N, tokens per step.")
flags.DEFINE_integer("num_sampled", 1024, "Samples of SampledSoftmax.")
flags.DEFINE_integer("steps", 10, "Timed steps (after 3 warm-up steps).")
flags.DEFINE_enum("backend", select_backend.default_backend(), select_backend.BACKENDS,
                  "Keras backend.")
flags.DEFINE_bool("jit_compile", None, "XLA (default: False on TensorFlow, Keras' "
                  "'auto' elsewhere).")
flags.DEFINE_string("row", None, "Internal: run one row and print its JSON.")
flags.DEFINE_list("rows", ["sequential_sampled", "head_model_sampled",
                           "sequential_full_scce", "sequential_hsm"], "Rows.")
flags.DEFINE_string("out", None, "Write the results to this JSON file.")
FLAGS = flags.FLAGS


def run_row(name):
    import keras
    import numpy as np

    import keras_softmax_heads as ksh

    V, d, N = FLAGS.vocab_size, FLAGS.dim, FLAGS.tokens
    jit_compile = FLAGS.jit_compile
    if jit_compile is None:
        jit_compile = False if FLAGS.backend == "tensorflow" else "auto"
    rng = np.random.default_rng(0)
    counts = 1.0 / np.arange(1, V + 1)  # Zipf
    x = rng.normal(size=(N, d)).astype("float32")
    y = rng.choice(V, size=N, p=counts / counts.sum()).astype("int32")

    def backbone():
        return [keras.Input((d,)), keras.layers.Dense(d)]

    if name == "sequential_sampled":
        head = ksh.SampledSoftmax(V, num_sampled=FLAGS.num_sampled, sampler="unigram", counts=counts)
        model = keras.Sequential(backbone() + [head])
        model.compile("adam", loss=ksh.HeadLoss(head), jit_compile=jit_compile)
    elif name == "head_model_sampled":
        head = ksh.SampledSoftmax(V, num_sampled=FLAGS.num_sampled, sampler="unigram", counts=counts)
        model = ksh.HeadModel(keras.Sequential(backbone()), head)
        model.compile("adam", jit_compile=jit_compile)
    elif name == "sequential_full_scce":
        model = keras.Sequential(backbone() + [ksh.FullSoftmax(V)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit_compile)
    elif name == "sequential_hsm":
        head = ksh.HierarchicalSoftmax(V, counts=counts)
        model = keras.Sequential(backbone() + [head])
        model.compile("adam", loss=ksh.HeadLoss(head), jit_compile=jit_compile)
    else:
        raise ValueError(f"Unknown row {name!r}")
    t = measure.time_calls(lambda: model.train_on_batch(x, y), warmup=3, repeats=FLAGS.steps)
    return {"row": name, "median_s": float(t.median_s), "min_s": float(t.best_s),
            "steps": FLAGS.steps}


def child_flags(row):
    flags = [f"--row={row}"] + [f"--{k}={getattr(FLAGS, k)}" for k in
                                ("vocab_size", "dim", "tokens", "num_sampled", "steps")]
    flags.append(f"--backend={FLAGS.backend}")
    if FLAGS.jit_compile is not None:
        flags.append(f"--jit_compile={FLAGS.jit_compile}")
    return flags


def ratios_of(results):
    """The issue's ratios, where both rows ran."""
    by = {r["row"]: r["median_s"] for r in results}
    ratios = {}
    if {"sequential_sampled", "head_model_sampled"} <= set(by):
        ratios["sequential_over_head_model"] = by["sequential_sampled"] / by["head_model_sampled"]
    if {"sequential_sampled", "sequential_full_scce"} <= set(by):
        ratios["full_over_sequential_sampled"] = by["sequential_full_scce"] / by["sequential_sampled"]
    if {"sequential_hsm", "sequential_full_scce"} <= set(by):
        ratios["full_over_sequential_hsm"] = by["sequential_full_scce"] / by["sequential_hsm"]
    return ratios


def run_all():
    """Every row in a fresh process: the JSON report."""
    results = []
    for row in FLAGS.rows:
        result = fresh_process.run_row(__file__, child_flags(row))
        result["backend"] = FLAGS.backend
        results.append(result)
        print(f"{row:24s} {result['median_s'] * 1e3:9.1f} ms/step "
              f"(min {result['min_s'] * 1e3:.1f})", flush=True)
    ratios = ratios_of(results)
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    return {
        "command": measure.command_line(__file__),
        "machine": f"{os.cpu_count()} CPU cores",
        "settings": {k: getattr(FLAGS, k) for k in ("backend", "vocab_size", "dim", "tokens",
                                                    "num_sampled", "steps", "jit_compile")},
        "rows": results, "ratios": ratios,
    }


if __name__ == "__main__":
    app.run(fresh_process.absl_main(run_row, run_all, FLAGS))
