r"""Steady-state training step of `train_and_evaluate` against a bare
`model.fit` of the same model, in one run (issue 14, section 1).

Both rows build the model with `training.build_model` from the same config
(by default Zaremba et al.'s small LSTM on PTB: 2 x 200, batch 20 x bptt
20, SGD with clipping) and read the same `tf.data` input
(`training.train_dataset`); each runs in a fresh process:

* `bare`: `model.fit(dataset, steps_per_epoch=S, epochs=1)` with only a
  callback that records the end time of every step;
* `train_lm`: `train_and_evaluate` for one epoch of `S` steps (its
  checkpoints, callbacks, TensorBoard and logging as configured), no
  validation, a 2-window evaluation.

The step time is `(t_last - t_first) / (S - 1)` over the step end times
(the first step, which compiles, is left out), as `results.json`'s
`steps_per_second` measures it. Falls back to the synthetic corpus when
no PTB directory is given. `--backend` picks the Keras backend (TensorFlow
by default, or `$KERAS_BACKEND`).

    python benchmarks/bench_train_loop.py --data_dir=../shared/data/ptb \
        --out docs/results/bench_train_loop.json
"""

import os
import tempfile
import time

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py
from absl import app
from absl import flags

flags.DEFINE_string("data_dir", None, "PTB directory (train.txt, valid.txt, test.txt); "
                    "None: the synthetic corpus.")
flags.DEFINE_string("preset", "zaremba_small", "Training preset.")
flags.DEFINE_string("head", "full_softmax", "Head of the `bare` and `train_lm` rows.")
flags.DEFINE_string("compare_head", None, "Also time `train_lm` with this head (row "
                    "`train_lm_<head>`) and report its ratio to `train_lm`.")
flags.DEFINE_enum("backend", select_backend.default_backend(), select_backend.BACKENDS,
                  "Keras backend.")
flags.DEFINE_integer("steps", 400, "Training steps per row.")
flags.DEFINE_enum("jit_compile", "auto", ["auto", "true", "false"],
                  "XLA compilation of every row's step ('auto': Keras' choice, which on "
                  "TensorFlow without a GPU is no XLA).")
flags.DEFINE_list("rows", ["bare", "train_lm"], "Rows.")
flags.DEFINE_string("row", None, "Internal: run one row and print its JSON.")
flags.DEFINE_string("out", None, "Write the results to this JSON file.")
FLAGS = flags.FLAGS


def _config():
    from keras_softmax_heads import training

    dataset = {"dataset": "ptb", "data_dir": FLAGS.data_dir} if FLAGS.data_dir else {}
    jit = {"auto": "auto", "true": True, "false": False}[FLAGS.jit_compile]
    return training.get_config(
        FLAGS.preset, head=FLAGS.head, epochs=1, steps_per_epoch=FLAGS.steps, jit_compile=jit,
        validate_every_epoch=False, eval_steps=2, num_diagnostic_contexts=20, verbose=0,
        **dataset,
    )


def run_row(name):
    import keras

    from keras_softmax_heads import training
    from keras_softmax_heads.data import load_dataset

    config = _config()
    if name == "train_lm":
        with tempfile.TemporaryDirectory() as workdir:
            results = training.train_and_evaluate(config, workdir)
        return {"row": name, "step_s": 1.0 / results["training"]["steps_per_second"]}
    if name != "bare":
        raise ValueError(f"Unknown row {name!r}")
    keras.utils.set_random_seed(config.seed)
    corpus = load_dataset(config.dataset, config.data_dir,
                          **training.parse_options(config.dataset_options))
    steps = training.train_steps_per_epoch(config, corpus)
    model, _ = training.build_model(config, corpus)
    model.optimizer.learning_rate = training.optimizer_learning_rate(config, 0)
    dataset = training.train_dataset(config, corpus, 0, steps, 0)
    ends = []
    timer = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs=None: ends.append(time.perf_counter()))
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[timer])
    return {"row": name, "step_s": (ends[-1] - ends[0]) / (len(ends) - 1)}


def child_flags(row, head):
    flags = [f"--row={row}", f"--preset={FLAGS.preset}", f"--head={head}",
             f"--steps={FLAGS.steps}", f"--backend={FLAGS.backend}",
             f"--jit_compile={FLAGS.jit_compile}"]
    if FLAGS.data_dir:
        flags.append(f"--data_dir={FLAGS.data_dir}")
    return flags


def run_all():
    """Every row in a fresh process: the JSON report."""
    results = []
    rows = [(row, FLAGS.head) for row in FLAGS.rows]
    if FLAGS.compare_head:
        rows.append(("train_lm", FLAGS.compare_head))
    for row, head in rows:
        result = fresh_process.run_row(__file__, child_flags(row, head))
        if head != FLAGS.head:
            result["row"] = f"train_lm_{head}"
        result["head"] = head
        result["backend"] = FLAGS.backend
        results.append(result)
        print(f"{result['row']:18s} {result['step_s'] * 1e3:8.1f} ms/step", flush=True)
    by = {r["row"]: r["step_s"] for r in results}
    ratio = by["train_lm"] / by["bare"] if {"bare", "train_lm"} <= set(by) else None
    if ratio is not None:
        print(f"train_lm / bare: {ratio:.3f}x")
    head_ratio = None
    if FLAGS.compare_head and "train_lm" in by:
        head_ratio = by[f"train_lm_{FLAGS.compare_head}"] / by["train_lm"]
        print(f"train_lm {FLAGS.compare_head} / {FLAGS.head}: {head_ratio:.3f}x")
    return {
        "command": measure.command_line(__file__),
        "machine": f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} CPU cores",
        "settings": {"backend": FLAGS.backend, "preset": FLAGS.preset, "head": FLAGS.head,
                     "steps": FLAGS.steps, "jit_compile": FLAGS.jit_compile,
                     "dataset": "ptb" if FLAGS.data_dir else "synthetic"},
        "rows": results, "train_lm_over_bare": ratio, "compare_head_over_head": head_ratio,
    }


if __name__ == "__main__":
    app.run(fresh_process.absl_main(run_row, run_all, FLAGS))
