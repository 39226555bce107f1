r"""A keras-hub causal LM's training step with and without the fused loss (issue 20).

A tiny Gemma (`keras_hub.models.GemmaBackbone` built from a local config,
no preset download: `--num_layers`, `--hidden_dim`, ... small so that it
runs on a CPU) with a large vocabulary (`--vocabulary_size`, default
262,144, Gemma 3's), tied embeddings, batch `--batch_size` of
`--seq_len` tokens. Two rows, each in a fresh process:

* `stock`: `keras_hub.models.GemmaCausalLM` compiled as keras-hub does
  (`compile()` with its defaults: Adam, `SparseCategoricalCrossentropy(
  from_logits=True)` on the `[batch, seq, V]` logits, the weighted
  accuracy metric);
* `fused`: `keras_softmax_heads.fused.fused_causal_lm(GemmaCausalLM)`, same
  config, same `compile()` (`fused_loss={"chunk_size": --chunk_size}` when
  given): training never forms the logits.

Per row: one warm-up `train_on_batch` (tracing), then `--steps` timed
ones; `step_s` is their median wall time. Memory from the process' resident
size (`measure.RssPeak`): after the model is built and the batch allocated,
the peak counter is reset and the resident size read (`baseline_mib`);
`peak_mib` is the raw peak resident size over the warm-up and timed steps
(the optimizer's slots are created in the warm-up step and count), and
`peak_over_baseline_mib` their difference. `eval_rows`: the same for the
evaluation step, each in its own fresh process: `test_on_batch` (the stock
model's: logits, its compiled loss and accuracy; the fused model's: the
fused evaluation, `loss`, `token_accuracy`, `perplexity` without logits).

Longest sequence under a memory cap (`--memory_cap_gb`): for each row, the
sequence lengths of `--cap_seq_lens` are tried in increasing order, each in
a fresh process (a warm-up and one timed step), until the first whose raw
peak resident size exceeds the cap (or fails); `max_seq_len_under_cap` is
the last one that stayed under. A child watches its own resident size and
exits as soon as it passes the cap (so a probe never takes the machine's
memory); such a probe is recorded as over the cap.

`--in_process` runs the rows and probes in the parent process instead
(smoke tests: seconds, but the memory readings are not meaningful).

Threads: `--threads` (default 2) is TensorFlow's intra-op pool
(`tf.config.threading.set_intra_op_parallelism_threads`, inter-op 1) and
`OMP_NUM_THREADS` in the child's environment; on PyTorch
`torch.set_num_threads`; JAX's pool is left at its default (pin with
`taskset`).

Usage:
    OMP_NUM_THREADS=2 python benchmarks/bench_fused_causal_lm.py \
        --out=docs/results/bench_fused_causal_lm.json
    python benchmarks/bench_fused_causal_lm.py --vocabulary_size=512 --seq_len=16 \
        --hidden_dim=8 --intermediate_dim=16 --head_dim=4 --steps=1 \
        --cap_seq_lens=16,32 --memory_cap_gb=64 --threads=1   # smoke run
"""

import os
import threading
import time

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py
from absl import app
from absl import flags

ROWS = ("stock", "fused")
OVER_CAP_EXIT = 3  # a child's exit status when its resident size passed the cap

flags.DEFINE_enum("backend", select_backend.default_backend(), select_backend.BACKENDS,
                  "Keras backend.")
flags.DEFINE_integer("vocabulary_size", 262144, "V.")
flags.DEFINE_integer("seq_len", 512, "Tokens per sequence of the timed rows.")
flags.DEFINE_integer("batch_size", 1, "Sequences per step.")
flags.DEFINE_integer("num_layers", 1, "Gemma decoder blocks.")
flags.DEFINE_integer("hidden_dim", 64, "d.")
flags.DEFINE_integer("intermediate_dim", 128, "Feed-forward width.")
flags.DEFINE_integer("num_query_heads", 2, "Query heads.")
flags.DEFINE_integer("num_key_value_heads", 1, "Key / value heads.")
flags.DEFINE_integer("head_dim", 32, "Width of an attention head.")
flags.DEFINE_integer("chunk_size", None, "chunk_size of the fused loss (default: the library's).")
flags.DEFINE_integer("steps", 3, "Timed train_on_batch calls (after one warm-up).")
flags.DEFINE_integer("threads", 2, "TensorFlow / PyTorch / OpenMP threads in each child.")
flags.DEFINE_list("rows", list(ROWS), "Rows.")
flags.DEFINE_float("memory_cap_gb", 8.0, "The memory cap of the longest-sequence search (GiB "
                   "of peak resident size).")
flags.DEFINE_list("cap_seq_lens", ["512", "1024", "2048", "4096", "8192", "16384"],
                  "Sequence lengths tried under the cap, in increasing order ([] to skip).")
flags.DEFINE_bool("in_process", False, "Run every row and probe in this process (smoke tests: "
                  "the memory readings then include the earlier rows', and no watch).")
flags.DEFINE_string("out", None, "Write the results to this JSON file.")
flags.DEFINE_string("row", None, "Internal: run one row at --seq_len and print its result.")
flags.DEFINE_enum("step", "train", ["train", "evaluate"],
                  "Internal: the step --row measures (train_on_batch or test_on_batch).")
FLAGS = flags.FLAGS


def model_config():
    """The GemmaBackbone config of the flags."""
    return dict(
        vocabulary_size=FLAGS.vocabulary_size, num_layers=FLAGS.num_layers,
        num_query_heads=FLAGS.num_query_heads, num_key_value_heads=FLAGS.num_key_value_heads,
        hidden_dim=FLAGS.hidden_dim, intermediate_dim=FLAGS.intermediate_dim,
        head_dim=FLAGS.head_dim,
    )


def build(row, config, chunk_size=None):
    """The compiled `stock` or `fused` GemmaCausalLM of `config`."""
    import keras
    import keras_hub

    import keras_softmax_heads as ksh

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**config)
    cls = keras_hub.models.GemmaCausalLM
    if row == "fused":
        fused_loss = {"chunk_size": chunk_size} if chunk_size else None
        lm = ksh.fused.fused_causal_lm(cls)(backbone=backbone, preprocessor=None,
                                             fused_loss=fused_loss)
    elif row == "stock":
        lm = cls(backbone=backbone, preprocessor=None)
    else:
        raise ValueError(f"Unknown row {row!r}: expected one of {ROWS}")
    lm.compile()  # keras-hub's defaults, for both rows
    return lm


def watch_memory(cap_bytes, interval=0.02):
    """Exits the process (status `OVER_CAP_EXIT`) once its resident size passes `cap_bytes`."""

    def watch():
        while True:
            rss = measure.status()["VmRSS"]
            if rss > cap_bytes:
                print(f"OverCapExit: resident size {rss / 2**30:.2f} GiB over the cap "
                      f"{cap_bytes / 2**30:.2f} GiB", flush=True)
                os._exit(OVER_CAP_EXIT)
            time.sleep(interval)

    threading.Thread(target=watch, daemon=True).start()


def set_threads(threads):
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        return threads
    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(threads)
        return threads
    return None


def run_row(row, config, seq_len, batch_size, steps, threads, chunk_size=None,
            memory_cap_bytes=None, step="train"):
    """Measures one row's training (or, `step="evaluate"`, evaluation) step
    in this process; returns its result dict."""
    import keras
    import numpy as np

    if memory_cap_bytes:
        watch_memory(memory_cap_bytes)
    used_threads = set_threads(threads)
    lm = build(row, config, chunk_size)
    rng = np.random.default_rng(0)
    v = config["vocabulary_size"]
    x = {"token_ids": rng.integers(1, v, (batch_size, seq_len)).astype("int32"),
         "padding_mask": np.ones((batch_size, seq_len), "int32")}
    y = rng.integers(0, v, (batch_size, seq_len)).astype("int32")
    sample_weight = np.ones((batch_size, seq_len), "float32")
    step_fn = lm.test_on_batch if step == "evaluate" else lm.train_on_batch
    memory = measure.RssPeak()
    t = measure.time_calls(
        lambda: step_fn(x, y, sample_weight=sample_weight, return_dict=True),
        warmup=1, repeats=steps, memory=memory, memory_covers_warmup=True)
    logs, baseline, peak = t.value, memory.baseline, memory.peak_bytes()
    mib = measure.MIB
    return {
        "row": row, "step": step, "seq_len": seq_len, "batch_size": batch_size,
        "backend": keras.backend.backend(), "threads": used_threads,
        "loss": float(logs["loss"]), "logs": {k: float(v) for k, v in logs.items()},
        "first_s": t.first_s, "step_s": t.median_s, "times_s": t.wall,
        "baseline_mib": baseline / mib, "peak_mib": peak / mib,
        "peak_over_baseline_mib": (peak - baseline) / mib, "peak_reset": memory.reset,
    }


# ----------------------------------------------------------------- parent
def run_child(row, seq_len, steps, settings, memory_cap_gb=None, step="train"):
    """One row in a fresh process; a failure is a row with its `error`."""
    if settings.get("in_process"):
        try:
            return run_row(row, settings["model"], seq_len, settings["batch_size"], steps,
                           settings["threads"], settings.get("chunk_size"), step=step)
        except Exception as error:  # noqa: BLE001 (a row, not a crash)
            return {"row": row, "seq_len": seq_len,
                    "error": f"{type(error).__name__}: {error}"[:300]}
    args = [f"--row={row}", f"--step={step}", f"--seq_len={seq_len}", f"--steps={steps}",
            f"--threads={settings['threads']}", f"--backend={settings['backend']}",
            f"--batch_size={settings['batch_size']}"]
    args += [f"--{key}={value}" for key, value in settings["model"].items()]
    if settings.get("chunk_size"):
        args.append(f"--chunk_size={settings['chunk_size']}")
    args.append(f"--memory_cap_gb={memory_cap_gb or 0}")  # 0: no watch
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": str(settings["threads"]),
           "KERAS_BACKEND": settings["backend"]}
    child = fresh_process.run(__file__, args, env)
    if child.results:
        return child.results[0]
    out = {"row": row, "seq_len": seq_len}
    if child.returncode == OVER_CAP_EXIT:
        out["over_cap"] = True
        out["error"] = f"resident size over the cap ({memory_cap_gb} GiB)"
    else:
        out["error"] = child.error
    return out


def longest_under_cap(row, settings):
    """Tries `cap_seq_lens` in increasing order; returns the probes and the longest under the cap."""
    cap = settings["memory_cap_gb"]
    probes, best = [], None
    for seq_len in settings["cap_seq_lens"]:
        r = run_child(row, seq_len, 1, settings, memory_cap_gb=cap)
        probe = {"seq_len": seq_len}
        if "peak_mib" in r:
            probe.update(peak_mib=r["peak_mib"], step_s=r["step_s"],
                         under_cap=r["peak_mib"] <= cap * 1024)
        else:
            probe.update(under_cap=False, error=r["error"])
        probes.append(probe)
        print(f"  {row:6s} seq {seq_len:6d}: "
              + (f"peak {probe['peak_mib']:.0f} MiB" if "peak_mib" in probe else probe["error"]),
              flush=True)
        if not probe["under_cap"]:
            break
        best = seq_len
    return {"row": row, "memory_cap_gb": cap, "max_seq_len_under_cap": best, "probes": probes}


def ratios_of(rows, eval_rows):
    """Fused over stock: train step time and peaks, evaluation time and peak
    (each where both rows ran)."""
    by = {r["row"]: r for r in rows if "step_s" in r}
    ratios = {}
    if set(ROWS) <= set(by):
        ratios = {"time_fused_over_stock": by["fused"]["step_s"] / by["stock"]["step_s"],
                  "peak_fused_over_stock": by["fused"]["peak_mib"] / by["stock"]["peak_mib"],
                  "peak_over_baseline_fused_over_stock":
                      by["fused"]["peak_over_baseline_mib"]
                      / max(by["stock"]["peak_over_baseline_mib"], 1e-9)}
    by_eval = {r["row"]: r for r in eval_rows if "step_s" in r}
    if set(ROWS) <= set(by_eval):
        ratios.update(
            eval_time_fused_over_stock=by_eval["fused"]["step_s"] / by_eval["stock"]["step_s"],
            eval_peak_over_baseline_fused_over_stock=(
                by_eval["fused"]["peak_over_baseline_mib"]
                / max(by_eval["stock"]["peak_over_baseline_mib"], 1e-9)))
    return ratios


def main(argv):
    del argv
    select_backend.use(FLAGS.backend)
    config = model_config()
    if FLAGS.row:
        cap = FLAGS.memory_cap_gb * 2**30 if FLAGS.memory_cap_gb else None
        fresh_process.report(run_row(FLAGS.row, config, FLAGS.seq_len, FLAGS.batch_size,
                                     FLAGS.steps, FLAGS.threads, FLAGS.chunk_size, cap,
                                     step=FLAGS.step))
        return
    bad = [r for r in FLAGS.rows if r not in ROWS]
    if bad:
        raise app.UsageError(f"Unknown rows {bad}: expected {ROWS}")
    settings = {
        "backend": FLAGS.backend, "model": {k: v for k, v in config.items()},
        "seq_len": FLAGS.seq_len, "batch_size": FLAGS.batch_size, "steps": FLAGS.steps,
        "threads": FLAGS.threads, "chunk_size": FLAGS.chunk_size, "rows": list(FLAGS.rows),
        "memory_cap_gb": FLAGS.memory_cap_gb,
        "cap_seq_lens": sorted(int(x) for x in FLAGS.cap_seq_lens),
        "in_process": FLAGS.in_process,
    }
    print(f"GemmaCausalLM {config}, batch {FLAGS.batch_size} x {FLAGS.seq_len}, "
          f"{FLAGS.threads} threads, {FLAGS.backend}", flush=True)
    rows, eval_rows = [], []
    for row in FLAGS.rows:
        for step, out in (("train", rows), ("evaluate", eval_rows)):
            r = run_child(row, FLAGS.seq_len, FLAGS.steps, settings, step=step)
            out.append(r)
            if "step_s" in r:
                print(f"{row:6s} {step:8s} {r['step_s']:8.3f} s/step  peak "
                      f"{r['peak_mib']:8.0f} MiB  (+{r['peak_over_baseline_mib']:.0f} over "
                      f"the built model)  {r['logs']}", flush=True)
            else:
                print(f"{row:6s} {step:8s} -- {r['error']}", flush=True)
    cap_rows = []
    if settings["cap_seq_lens"]:
        print(f"Longest sequence under {FLAGS.memory_cap_gb} GiB of peak resident size:")
        cap_rows = [longest_under_cap(row, settings) for row in FLAGS.rows]
        for c in cap_rows:
            print(f"{c['row']:6s} {c['max_seq_len_under_cap']}", flush=True)
    ratios = ratios_of(rows, eval_rows)
    if ratios:
        print(", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    measure.save({
        "command": measure.command_line(__file__),
        "machine": measure.machine(), "settings": settings, "rows": rows,
        "eval_rows": eval_rows, "ratios": ratios, "memory_cap": cap_rows,
    }, FLAGS.out)


if __name__ == "__main__":
    app.run(main)
