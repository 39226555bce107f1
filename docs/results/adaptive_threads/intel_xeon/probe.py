"""Why the static adaptive softmax falls behind torch's module on the Intel Xeon.

A probe, not a benchmark of record: one process, `--threads` threads, rows
alternated over `--rounds` rounds (each round: the median of 5 timed calls of
every row, after 2 untimed ones), so that each round's ratios share the
machine's state. Two parts:

* `gemm`: the step's matrix products, `sum(a @ b)` at the shapes of one
  `AdaptiveSoftmax(33278, cutoffs=[2000, 10000], factor=4)` train step at
  N = 2,048, d = 512 (the head cluster `[2048, 512] x [512, 2002]`; the tails'
  blocks `[410, 128] x [128, 8000]` and `[310, 32] x [32, 23278]`), by XLA
  (`tf.function(jit_compile=True)`), TensorFlow's graph (oneDNN) and torch;
* `step`: `bench_adaptive.py`'s train step (the summed loss, gradients w.r.t.
  `h` and every weight, XLA) of the head as the library builds it
  (`default`), the same head traced with each tail's capacity set to the
  batch's exact member count (`exact`: a bound on what scoring fewer padded
  rows could save; `adaptive_softmax.capacity` replaced while tracing), the
  head built with `capacity_factor=1.0` (`factor_1.0`: the public knob; its
  capacities hold this batch's members, so nothing overflows), the head
  with `gradient_in_forward=True` (`in_forward`, its summed objective with
  weights 1, what `HeadLoss` trains; packages from bf790bf on, else the row
  is left out), and torch's `AdaptiveLogSoftmaxWithLoss`.

Usage (from a checkout, `benchmarks/` on the path):

    OMP_NUM_THREADS=1 taskset -c 1 python docs/results/adaptive_threads/intel_xeon/probe.py \
        --threads=1 --out=probe_t1.json
"""

import json
import os
import platform
import random
import sys
import time

import numpy as np
from absl import app
from absl import flags

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "..", "..", "..", "..", "benchmarks"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

flags.DEFINE_integer("threads", 1, "Intra-op threads (TensorFlow, torch).")
flags.DEFINE_integer("rounds", 8, "Rounds of alternated rows.")
flags.DEFINE_integer("vocab_size", 33278, "V.")
flags.DEFINE_string("out", None, "JSON output.")
FLAGS = flags.FLAGS
N, D = 2048, 512


def cpu_model():
    """The CPU's model name (`/proc/cpuinfo`), else `platform.processor()`."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def rounds_of(rows, rounds):
    """Per row, the median of 5 timed calls in each round (ms)."""
    for fn in rows.values():
        fn()
        fn()
    times = {k: [] for k in rows}
    for _ in range(rounds):
        for key, fn in rows.items():
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            times[key].append(float(np.median(ts) * 1e3))
    return times


def summary(times, reference):
    """Median of each row and median of its per-round ratio to `reference`."""
    ref = np.asarray(times[reference])
    return {k: {"ms": v, "median_ms": float(np.median(v)),
                f"over_{reference}": float(np.median(np.asarray(v) / ref))}
            for k, v in times.items()}


def main(argv):
    del argv
    import tensorflow as tf
    import torch

    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    torch.set_num_threads(FLAGS.threads)
    import keras_softmax_heads as ksh
    import steps
    import torch_heads
    from keras_softmax_heads.heads import adaptive_softmax
    from reference_inputs import adaptive_benchmark_cutoffs, numpy_inputs

    v = FLAGS.vocab_size
    cutoffs = adaptive_benchmark_cutoffs(v)
    h_np, y_np = numpy_inputs(N, v, D)
    edges = cutoffs + [v]
    members = [int(((y_np >= edges[i]) & (y_np < edges[i + 1])).sum())
               for i in range(len(cutoffs))]
    random.seed(0)
    head = ksh.AdaptiveSoftmax(v, cutoffs=cutoffs, factor=4)
    head.build((None, D))
    capacities = head.tail_capacities(N)

    # Part 1: the products.
    shapes = [(N, D, cutoffs[0] + len(cutoffs))]
    shapes += [(k, D // 4 ** (i + 1), edges[i + 1] - edges[i]) for i, k in enumerate(capacities)]
    gemm = {}
    for m, k, n in shapes:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        ta, tb, pa, pb = tf.constant(a), tf.constant(b), torch.from_numpy(a), torch.from_numpy(b)
        xla = tf.function(lambda x, y: tf.reduce_sum(tf.matmul(x, y)), jit_compile=True)
        graph = tf.function(lambda x, y: tf.reduce_sum(tf.matmul(x, y)))
        times = rounds_of({"xla": lambda: float(xla(ta, tb)),
                           "graph": lambda: float(graph(ta, tb)),
                           "torch": lambda: float((pa @ pb).sum())}, FLAGS.rounds)
        gemm[f"{m}x{k}x{n}"] = {"gflop": 2 * m * k * n / 1e9, **summary(times, "torch")}
        print(m, k, n, {r: round(s["median_ms"], 2) for r, s in gemm[f"{m}x{k}x{n}"].items()
                        if isinstance(s, dict)}, flush=True)

    # Part 2: the step, as built and with exact capacities.
    h, y = steps.tensor(h_np), steps.tensor(y_np)
    default = steps.train_step(head, "xla", reduction="sum")
    losses = {"default": default(h, y)}
    library_capacity = adaptive_softmax.capacity
    exact = iter(members)
    adaptive_softmax.capacity = lambda num_tokens, fraction, factor: next(exact)
    try:
        exact_step = steps.train_step(head, "xla", reduction="sum")
        losses["exact"] = exact_step(h, y)
    finally:
        adaptive_softmax.capacity = library_capacity
    random.seed(0)
    lean = ksh.AdaptiveSoftmax(v, cutoffs=cutoffs, factor=4, capacity_factor=1.0)
    lean.build((None, D))
    lean.set_weights(head.get_weights())
    lean_step = steps.train_step(lean, "xla", reduction="sum")
    losses["factor_1.0"] = lean_step(h, y)
    extra = {}
    try:
        fast = ksh.AdaptiveSoftmax(v, cutoffs=cutoffs, factor=4, gradient_in_forward=True)
    except TypeError:  # a package before the option
        fast = None
    if fast is not None:
        fast.build((None, D))
        fast.set_weights(head.get_weights())
        fast_step = steps.train_step(fast, "xla", reduction="sum", summed=True)
        losses["in_forward"] = fast_step(h, y)
        extra["in_forward"] = lambda: fast_step(h, y)
    module = torch_heads.AdaptiveSoftmax(D, v, cutoffs, div_value=4, seed=0)
    th, ty = torch.from_numpy(h_np), torch.from_numpy(y_np.astype(np.int64))
    times = rounds_of({"default": lambda: default(h, y), "exact": lambda: exact_step(h, y),
                       "factor_1.0": lambda: lean_step(h, y), **extra,
                       "torch": torch_heads.train_call(module, th, ty)}, FLAGS.rounds)
    step = summary(times, "torch")
    for key in ("default", "factor_1.0", *extra):
        step[key]["over_exact"] = float(np.median(
            np.asarray(times[key]) / np.asarray(times["exact"])))
    for key in ("factor_1.0", *extra):
        step[key]["over_default"] = float(np.median(
            np.asarray(times[key]) / np.asarray(times["default"])))
    print({r: (round(s["median_ms"], 1), round(s["over_torch"], 3)) for r, s in step.items()},
          flush=True)
    result = {
        "machine": {"cpu": cpu_model(), "threads": FLAGS.threads,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "versions": {"tensorflow": tf.__version__, "torch": torch.__version__},
        "vocab_size": v, "cutoffs": cutoffs, "tokens": N, "dim": D,
        "members": members, "capacities": capacities,
        "capacities_factor_1.0": lean.tail_capacities(N), "losses": losses,
        "gemm": gemm, "step": step,
    }
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
