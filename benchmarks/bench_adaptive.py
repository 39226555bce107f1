r"""Adaptive softmax (issue 21): train step and exact evaluation against peers.

Rows (each (row, phase, `V`) in its own fresh process; `--row` runs one and
prints `RESULT <json>`):

* `static`: our `AdaptiveSoftmax(V, cutoffs, factor=4)` with
  `static_shapes=True` (blocks of the tails' capacities, custom gradient), under
  `tf.function(jit_compile=True)` (mode `xla`, as `bench_peers.py` and
  `bench_large_vocab.py` run our heads);
* `dynamic`: the same head with `static_shapes=False` (each tail gathers
  exactly its tokens: data-dependent shapes, so `tf.function` without XLA,
  mode `graph`);
* `in_forward`: the `static` head with `gradient_in_forward=True`, its
  train step the summed objective `HeadLoss` trains
  (`summed_training_loss`, weights 1: the same sum), mode `xla`;
* `chunked`: the `static` head with `chunk_size=--chunk_size` (default
  4096: the head cluster's and the tails' log-normalisers over tiles of
  that many words, recomputed in the backward pass), mode `xla`;
* `full`: `FullSoftmax(V)` (mode `xla`), the exact reference;
* `hsm`: `HierarchicalSoftmax(V, counts=..., clustering="frequency")` (its
  default clustering, frequency bins; static shapes, mode `xla`);
* `torch`: `torch.nn.AdaptiveLogSoftmaxWithLoss(d, V, cutoffs,
  div_value=4)`, PyTorch eager, float32, on the CPU.

Phases, as the other benchmarks define them (`steps.py`):

* `train`: forward and backward of the summed training loss with respect to
  `h` `[N, d]` and every trainable weight of the head (ours:
  `steps.train_step(head, mode, reduction="sum")`; torch:
  `torch.autograd.grad(module(h, y).loss * N, [h, *module.parameters()])`);
* `eval`: the exact `sum(log p(y | h))`, forward only (ours:
  `steps.eval_step`, `head.log_likelihood`; torch under `torch.no_grad()`:
  `module(h, y).output.sum()`. Torch's `output` is the exact normalised
  log-probability of each target, head log-softmax plus the tail's
  log-softmax, the same numbers as `module.log_prob(h)` gathered at the
  targets (`torch_eval_is_exact` checks it) without the `[N, V]` matrix,
  which at `V = 793471`, `N = 2048` would take 6.5 GB).

Cutoffs (`cutoffs_for(V)`; `--cutoffs=V:c1/c2/...` overrides):

* `V = 33278` (WikiText-2): `[2000, 10000]`, the common WikiText-2 choice
  (a head of the 2000 most frequent words; also the `adaptive_wikitext2`
  study's row);
* `V = 100000`: `[2000, 10000, 50000]`, `bench_peers.py`'s rule (2%, 10%,
  50% of `V`, `torch.nn.AdaptiveLogSoftmaxWithLoss`'s usual shape);
* `V = 793471` (One Billion Word): `[60000, 100000, 640000]`, Transformer-XL's
  lm1b setting (kimiyoung/transformer-xl, `pytorch/train.py`, with
  `div_val = 4`). A smaller head, e.g. Grave et al.'s style of a few
  thousand words, is `--cutoffs=793471:4000/40000/200000`;
* any other `V`: `reference_inputs.adaptive_cutoffs(V)` (2%, 10%, 50%;
  the table and the rule: `reference_inputs.adaptive_benchmark_cutoffs`).

`factor` / `div_value` 4 for every row.

Inputs (`reference_inputs.numpy_inputs`, as in `bench_peers.py`):
`h ~ N(0, 0.25)` (seed 0), targets from a Zipfian unigram distribution
(`counts[r] ∝ 1 / (r + 1)`, ids sorted by frequency; seed 1). Our heads' weights: `random.seed(0)` then their own
initialisers; torch's module: `torch.manual_seed(0)` then its own.

Timing (`measure.step_row`): `--warmup` calls (the first traces /
compiles, `first_call_s`), then `--repeats` timed calls; `step_s` is the
median wall time. Threads: `--threads` (default 2) is TensorFlow's intra-op
parallelism and `torch.set_num_threads`; set `OMP_NUM_THREADS` to the same
number. Peak memory (`peak_mib`, `memory_source` on each row): TensorFlow's
CPU allocator peak minus its usage before the timed calls
(`steps.peak_memory`); torch: the process' peak resident size minus its
resident size before the timed calls (`measure.RssPeak`).

A row whose estimated peak (float32 `[N, V]` tensors: 6 for the full
softmax's train step, 2 for its evaluation) exceeds `--memory_budget_gb`
(default: 80% of the machine's available memory) is not run and is recorded
as an error row (`skipped`); so is a row whose process fails or is killed
(e.g. out of memory).

Ratios (`ratios` in the JSON, per `V`): `static_over_torch_train`,
`dynamic_over_torch_train` (target: < 1 at every `V`), `static_over_full_eval`,
`dynamic_over_full_eval`, `hsm_over_full_eval` (target for ours: <= 1), and
the train steps over the full softmax's.

Usage:

    OMP_NUM_THREADS=2 TF_NUM_INTRAOP_THREADS=2 TF_NUM_INTEROP_THREADS=1 \
        python benchmarks/bench_adaptive.py --threads=2 \
        --out=docs/results/bench_adaptive.json
    # smoke run (seconds):
    python benchmarks/bench_adaptive.py --vocab_sizes=300 --tokens=64 --dim=16 \
        --repeats=1 --warmup=1 --threads=1 --out=/tmp/adaptive.json
"""

import os
import random
import time

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py
from reference_inputs import INPUTS, adaptive_benchmark_cutoffs, numpy_inputs
from absl import app
from absl import flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

#: Row key -> (row name, compilation mode).
ROWS = {
    "static": ("AdaptiveSoftmax (static_shapes=True)", "xla"),
    "dynamic": ("AdaptiveSoftmax (static_shapes=False)", "graph"),
    "in_forward": ("AdaptiveSoftmax (static_shapes=True, gradient_in_forward=True)", "xla"),
    "chunked": ("AdaptiveSoftmax (static_shapes=True, chunk_size)", "xla"),
    "full": ("FullSoftmax", "xla"),
    "hsm": ("HierarchicalSoftmax (frequency)", "xla"),
    "torch": ("torch.nn.AdaptiveLogSoftmaxWithLoss", "eager"),
}
PHASES = ("train", "eval")
FACTOR = 4
#: Estimated peak in float32 `[N, V]` tensors of the rows that build them.
FULL_UNITS = {"train": 6, "eval": 2}

FLAGS = flags.FLAGS


def define_flags():
    """Defines the script's absl flags (called by `__main__` only, so that the
    module imports without defining flags, e.g. in tests)."""
    flags.DEFINE_list("vocab_sizes", ["33278", "100000", "793471"], "Vocabulary sizes V.")
    flags.DEFINE_integer("dim", 512, "Context size d.")
    flags.DEFINE_integer("tokens", 2048, "Tokens N per step.")
    flags.DEFINE_integer("chunk_size", 4096, "The `chunked` row's chunk_size.")
    flags.DEFINE_list("rows", list(ROWS), f"Rows ({', '.join(ROWS)}).")
    flags.DEFINE_list("phases", list(PHASES), "Phases (train, eval).")
    flags.DEFINE_list("cutoffs", [], "Overrides, 'V:c1/c2/...' (e.g. 793471:4000/40000/200000).")
    flags.DEFINE_integer("repeats", 5, "Timed calls per row.")
    flags.DEFINE_integer("warmup", 2, "Untimed calls per row (the first compiles).")
    flags.DEFINE_integer("threads", 2, "TensorFlow intra-op threads and torch.set_num_threads.")
    flags.DEFINE_float("memory_budget_gb", 0.0,
                       "Skip rows whose estimated peak exceeds this (0: 80% of MemAvailable).")
    flags.DEFINE_string("out", None, "Write the JSON results here.")
    flags.DEFINE_string("row", None, "Internal: run one row ('key:phase:V') and print its RESULT.")


def cutoffs_for(vocab_size, overrides=()):
    """The cutoffs of `vocab_size`: `overrides` ('V:c1/c2'), else
    `reference_inputs.adaptive_benchmark_cutoffs` (the benchmarks' table,
    else 2%, 10%, 50% of V).

    >>> cutoffs_for(33278)
    [2000, 10000]
    >>> cutoffs_for(1000, ["1000:10/100"])
    [10, 100]
    """
    for item in overrides:
        v, _, cuts = item.partition(":")
        if int(v) == vocab_size:
            return [int(c) for c in cuts.split("/") if c]
    return adaptive_benchmark_cutoffs(vocab_size)


def estimated_bytes(key, phase, vocab_size, tokens):
    """Estimated peak of a row (only the full softmax's `[N, V]` tensors count)."""
    if key != "full":
        return 0
    return FULL_UNITS[phase] * tokens * vocab_size * 4


# --------------------------------------------------------------- one row
def torch_module(dim, vocab_size, cutoffs):
    """`torch_heads.AdaptiveSoftmax(d, V, cutoffs, div_value=4)`, seed 0."""
    import torch_heads  # benchmarks/torch_heads.py (imports PyTorch)

    return torch_heads.AdaptiveSoftmax(dim, vocab_size, cutoffs, div_value=FACTOR, seed=0)


def torch_eval_is_exact(dim=16, vocab_size=50, tokens=40, cutoffs=(5, 20)):
    """Whether torch's `forward(h, y).output` equals `log_prob(h)` at `y`."""
    import numpy as np
    import torch

    h_np, y_np = numpy_inputs(tokens, vocab_size, dim)
    module = torch_module(dim, vocab_size, list(cutoffs)).module
    h, y = torch.from_numpy(h_np), torch.from_numpy(y_np.astype(np.int64))
    with torch.no_grad():
        out = module(h, y).output
        ref = module.log_prob(h).gather(1, y[:, None])[:, 0]
    return bool(torch.allclose(out, ref, atol=1e-5))


def run_torch_row(phase, vocab_size, dim, tokens, cutoffs, warmup, repeats, threads):
    import numpy as np
    import torch
    import torch_heads

    torch.set_num_threads(threads)
    h_np, y_np = numpy_inputs(tokens, vocab_size, dim)
    h = torch.from_numpy(h_np)
    y = torch.from_numpy(y_np.astype(np.int64))
    head = torch_module(dim, vocab_size, cutoffs)
    if phase == "train":
        call = torch_heads.train_call(head, h, y)
    else:
        call = torch_heads.eval_call(head.target_log_likelihood, h, y)
    result = measure.step_row(call, warmup, repeats, measure.RssPeak())
    result.update(threads=torch.get_num_threads(), versions={"torch": torch.__version__})
    return result


def build_head(key, vocab_size, dim, cutoffs, chunk_size=4096):
    """Our head of row `key`, built for `[None, dim]` inputs (seeded)."""
    from keras_softmax_heads import AdaptiveSoftmax, FullSoftmax, HierarchicalSoftmax

    random.seed(0)  # Keras' unseeded initialisers draw their seeds from it
    if key in ("static", "dynamic", "chunked", "in_forward"):
        head = AdaptiveSoftmax(vocab_size, cutoffs=cutoffs, factor=FACTOR,
                               static_shapes=key != "dynamic",
                               chunk_size=chunk_size if key == "chunked" else None,
                               gradient_in_forward=key == "in_forward")
    elif key == "full":
        head = FullSoftmax(vocab_size)
    elif key == "hsm":
        import numpy as np

        counts = 1.0 / np.arange(1, vocab_size + 1)  # the targets' Zipfian law
        head = HierarchicalSoftmax(vocab_size, counts=counts, clustering="frequency")
    else:
        raise ValueError(f"Unknown row {key!r}")
    head.build((None, dim))
    return head


def run_keras_row(key, phase, vocab_size, dim, tokens, cutoffs, warmup, repeats, threads,
                  chunk_size=4096):
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError:  # already initialised
        pass
    import keras
    import steps  # benchmarks/steps.py (imports Keras)

    mode = ROWS[key][1]
    h_np, y_np = numpy_inputs(tokens, vocab_size, dim)
    h, y = steps.tensor(h_np), steps.tensor(y_np)
    head = build_head(key, vocab_size, dim, cutoffs, chunk_size)
    if phase == "train":
        fn = steps.train_step(head, mode, reduction="sum", summed=key == "in_forward")
    else:
        fn = steps.eval_step(head, mode)
    result = measure.step_row(lambda: fn(h, y), warmup, repeats, steps.peak_memory())
    result.update(threads=tf.config.threading.get_intra_op_parallelism_threads(),
                  versions={"tensorflow": tf.__version__, "keras": keras.__version__})
    if key in ("static", "dynamic", "chunked", "in_forward"):
        result["capacities"] = head.tail_capacities(tokens)
    if key == "chunked":
        result["chunk_size"] = head.chunk_size
    return result


def run_row(key, phase, vocab_size, dim, tokens, cutoffs, warmup, repeats, threads,
            chunk_size=4096):
    """One row in this process: the `measure.step_row` dict."""
    if key == "torch":
        return run_torch_row(phase, vocab_size, dim, tokens, cutoffs, warmup, repeats,
                             threads)
    return run_keras_row(key, phase, vocab_size, dim, tokens, cutoffs, warmup, repeats,
                         threads, chunk_size)


# ----------------------------------------------------------------- parent
def child_args(key, phase, vocab_size):
    return [f"--row={key}:{phase}:{vocab_size}", f"--dim={FLAGS.dim}",
            f"--tokens={FLAGS.tokens}", f"--repeats={FLAGS.repeats}",
            f"--warmup={FLAGS.warmup}", f"--threads={FLAGS.threads}",
            f"--chunk_size={FLAGS.chunk_size}",
            "--cutoffs=" + ",".join(FLAGS.cutoffs)]


def run_child(key, phase, vocab_size):
    """Runs one row in a fresh process: its result, or `{"error": ...}`."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
           "KERAS_BACKEND": "tensorflow"}
    return fresh_process.run(__file__, child_args(key, phase, vocab_size), env).result()


def ratios_of(rows):
    """Per `V`: our train steps over torch's and the full softmax's, and the
    exact evaluations over the full softmax's (None where a row is missing)."""
    t = {(r["key"], r["phase"], r["v"]): r.get("step_s") for r in rows}
    out = []
    for v in sorted({r["v"] for r in rows}):
        def ratio(a, b):
            return t[a] / t[b] if t.get(a) and t.get(b) else None

        entry = {"v": v}
        for key in ("static", "dynamic", "chunked", "in_forward"):
            entry[f"{key}_over_torch_train"] = ratio((key, "train", v), ("torch", "train", v))
            entry[f"{key}_over_full_train"] = ratio((key, "train", v), ("full", "train", v))
        entry["in_forward_over_static_train"] = ratio(("in_forward", "train", v),
                                                      ("static", "train", v))
        for phase in PHASES:
            entry[f"chunked_over_static_{phase}"] = ratio(("chunked", phase, v),
                                                          ("static", phase, v))
        for key in ("static", "dynamic", "chunked", "hsm", "torch"):
            entry[f"{key}_over_full_eval"] = ratio((key, "eval", v), ("full", "eval", v))
        entry["hsm_over_full_train"] = ratio(("hsm", "train", v), ("full", "train", v))
        out.append(entry)
    return out


def targets_met(ratios):
    """The issue's targets, per ratio: True / False / None (not measured)."""
    out = {}
    for e in ratios:
        for name, bound, strict in (("static_over_torch_train", 1.0, True),
                                    ("dynamic_over_torch_train", 1.0, True),
                                    ("static_over_full_eval", 1.0, False),
                                    ("dynamic_over_full_eval", 1.0, False)):
            x = e.get(name)
            out[f"{name}@{e['v']}"] = None if x is None else bool(
                x < bound if strict else x <= bound)
    return out


def run_all():
    """Runs every row in its own process; the JSON dict."""
    budget = measure.memory_budget(FLAGS.memory_budget_gb, gib=False)
    rows = []
    vocab_sizes = [int(v) for v in FLAGS.vocab_sizes]
    for v in vocab_sizes:
        cutoffs = cutoffs_for(v, FLAGS.cutoffs)
        for key in FLAGS.rows:
            if key not in ROWS:
                raise ValueError(f"Unknown row {key!r}; expected one of {list(ROWS)}")
            for phase in FLAGS.phases:
                if key == "in_forward" and phase == "eval":
                    continue  # the `static` row's evaluation (`log_likelihood`)
                row = {"key": key, "row": ROWS[key][0], "mode": ROWS[key][1], "phase": phase,
                       "v": v, "d": FLAGS.dim, "n": FLAGS.tokens}
                if key in ("static", "dynamic", "chunked", "in_forward", "torch"):
                    row["cutoffs"] = cutoffs
                est = estimated_bytes(key, phase, v, FLAGS.tokens)
                t0 = time.perf_counter()
                if est > budget:
                    row.update(error=f"skipped: estimated {est / 1e9:.3g} GB > budget "
                               f"{budget / 1e9:.3g} GB", skipped=True)
                else:
                    row.update(run_child(key, phase, v))
                rows.append(row)
                what = (f"{1e3 * row['step_s']:.1f} ms" if "step_s" in row
                        else f"error: {row['error']}")
                print(f"V={v} {row['row']} {phase}: {what} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    ratios = ratios_of(rows)
    for e in ratios:
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in e.items() if v is not None), flush=True)
    return {
        "command": measure.command_line(__file__),
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
                                           "TF_NUM_INTEROP_THREADS") if k in os.environ},
        "machine": measure.machine(keys=("cpu", "cores", "os", "python", "date")),
        "settings": {"vocab_sizes": vocab_sizes, "d": FLAGS.dim, "n": FLAGS.tokens,
                     "factor": FACTOR, "repeats": FLAGS.repeats, "warmup": FLAGS.warmup,
                     "threads": FLAGS.threads, "memory_budget_gb": budget / 1e9,
                     "chunk_size": FLAGS.chunk_size,
                     "cutoffs": {str(v): cutoffs_for(v, FLAGS.cutoffs) for v in vocab_sizes},
                     "inputs": INPUTS,
                     "modes": {k: m for k, (_, m) in ROWS.items()}},
        "rows": rows,
        "ratios": ratios,
        "targets_met": targets_met(ratios),
    }


def main(argv):
    del argv
    select_backend.use("tensorflow")
    if FLAGS.row:
        key, phase, v = FLAGS.row.split(":")
        v = int(v)
        try:
            result = run_row(key, phase, v, FLAGS.dim, FLAGS.tokens,
                             cutoffs_for(v, FLAGS.cutoffs), FLAGS.warmup, FLAGS.repeats,
                             FLAGS.threads, FLAGS.chunk_size)
        except Exception as err:  # recorded as the row's error
            result = {"error": measure.error_text(err)}
        fresh_process.report(result)
        return
    result = run_all()
    measure.save(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main)
