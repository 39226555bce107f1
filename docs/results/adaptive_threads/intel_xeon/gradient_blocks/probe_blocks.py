"""How many blocks `static_tail_summed_nll` should split a tail's capacity into.

A probe, not a benchmark of record. `AdaptiveSoftmax(gradient_in_forward=True)`
splits each tail's capacity into `adaptive_softmax.GRADIENT_BLOCKS` blocks
(8) and runs the fewest that hold the batch's members under one `ops.switch`,
a branch per count: more blocks score fewer padded rows but compile more
branches. For each `V` (`--vocab_sizes`) one process builds
`bench_adaptive.py`'s head (cutoffs `adaptive_benchmark_cutoffs(V)`,
factor 4, N = 2,048, d = 512, Zipf targets of `reference_inputs.numpy_inputs`)
and its train step (the summed objective with weights 1, gradients w.r.t.
`h` and every weight, `tf.function(jit_compile=True)`, `steps.train_step`)
for:

* `static`: `gradient_in_forward=False` (the static path, autodiff);
* `blocks_B` for each B in `--blocks`: `gradient_in_forward=True` with
  `static_tail_summed_nll`'s `blocks=B, min_blocks=1` while the step is
  traced (a switch branch for every count of blocks, 1 to B);
* `half_B` for each B in `--halves`: the same with `min_blocks=B // 2`
  (branches for B / 2 to B blocks; the library's default since this probe,
  B = 8);
* `loop_B` for each B in `--loops`: a prototype not kept (`loop_only.patch`
  beside this file; run against a package with that patch applied): no
  switch, every block in the while loop.

Each row's first call (trace and compile) is timed (`first_call_s`; rows
compiled in the order given, then again in reverse order in a second
function each, `first_call_s_again`, so that a row's place in the process
does not decide its compile time). Then the rows' steps alternate over
`--rounds` rounds (each round: the median of 5 timed calls of every row
after 2 untimed ones); a row's ratio is the median over rounds of its time
over `static`'s of the same round. Losses are checked equal to `static`'s.

Usage (from a checkout):

    OMP_NUM_THREADS=1 taskset -c 1 python \
        docs/results/adaptive_threads/intel_xeon/gradient_blocks/probe_blocks.py \
        --threads=1 --out=blocks_t1.json
"""

import functools
import inspect
import json
import os
import random
import sys
import time

import numpy as np
from absl import app
from absl import flags

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "..", "..", "..", "..", "..", "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# ../probe.py's helpers, and its flags --threads, --rounds and --out.
from probe import cpu_model, rounds_of, summary  # noqa: E402

flags.DEFINE_string("vocab_sizes", "33278,100000", "Comma-separated V.")
flags.DEFINE_string("blocks", "1,2,4,8,16", "Comma-separated block counts.")
flags.DEFINE_string("halves", "", "Comma-separated block counts of `half_B` rows: "
                    "B blocks, at least half of them scored.")
flags.DEFINE_string("loops", "", "Comma-separated block counts of `loop_B` rows "
                    "(needs `loop_only.patch`).")
FLAGS = flags.FLAGS
N, D = 2048, 512


def main(argv):
    del argv
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras_softmax_heads as ksh
    import steps
    from keras_softmax_heads.heads import adaptive_softmax
    from reference_inputs import adaptive_benchmark_cutoffs, numpy_inputs

    library = adaptive_softmax.static_tail_summed_nll
    blocks = [int(b) for b in FLAGS.blocks.split(",")]
    result = {"machine": {"cpu": cpu_model(), "threads": FLAGS.threads,
                          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
              "versions": {"tensorflow": tf.__version__}, "tokens": N, "dim": D,
              "library_blocks": adaptive_softmax.GRADIENT_BLOCKS, "vocab": {}}
    for v in [int(x) for x in FLAGS.vocab_sizes.split(",")]:
        cutoffs = adaptive_benchmark_cutoffs(v)
        h_np, y_np = numpy_inputs(N, v, D)
        h, y = steps.tensor(h_np), steps.tensor(y_np)
        heads = {}
        halves = [int(b) for b in FLAGS.halves.split(",") if b]
        loops = [int(b) for b in FLAGS.loops.split(",") if b]
        for name in (["static"] + [f"blocks_{b}" for b in blocks] + [f"half_{b}" for b in halves]
                     + [f"loop_{b}" for b in loops]):
            random.seed(0)
            heads[name] = ksh.AdaptiveSoftmax(
                v, cutoffs=cutoffs, factor=4, gradient_in_forward=name != "static")
            heads[name].build((None, D))
            if name != "static":
                heads[name].set_weights(heads["static"].get_weights())

        def compiled(name):
            head = heads[name]
            step = steps.train_step(head, "xla", reduction="sum", summed=name != "static")
            if name != "static":
                kind, count = name.split("_")
                options = {"blocks": int(count)}
                if kind == "half":
                    options["min_blocks"] = int(count) // 2
                elif "min_blocks" in inspect.signature(library).parameters:
                    options["min_blocks"] = 1  # before it: every count had a branch
                adaptive_softmax.static_tail_summed_nll = functools.partial(library, **options)
                adaptive_softmax.LOOP_ONLY = kind == "loop"
            try:
                start = time.perf_counter()
                loss = float(step(h, y))
                return step, loss, time.perf_counter() - start
            finally:
                adaptive_softmax.static_tail_summed_nll = library
                adaptive_softmax.LOOP_ONLY = False

        rows, first, losses = {}, {}, {}
        for name in heads:
            rows[name], losses[name], first[name] = compiled(name)
            print(v, name, "first call", round(first[name], 2), "loss", losses[name], flush=True)
        again = {}
        for name in reversed(list(heads)):
            _, _, again[name] = compiled(name)
            print(v, name, "first call again", round(again[name], 2), flush=True)
        times = rounds_of({k: (lambda s=s: s(h, y)) for k, s in rows.items()}, FLAGS.rounds)
        step = summary(times, "static")
        for name in heads:
            step[name].update(first_call_s=first[name], first_call_s_again=again[name],
                              loss=losses[name],
                              loss_rel_diff=abs(losses[name] / losses["static"] - 1))
        edges = cutoffs + [v]
        result["vocab"][str(v)] = {
            "cutoffs": cutoffs, "capacities": heads["static"].tail_capacities(N),
            "members": [int(((y_np >= edges[i]) & (y_np < edges[i + 1])).sum())
                        for i in range(len(cutoffs))], "step": step}
        print(v, {k: (round(s["median_ms"], 1), round(s["over_static"], 3),
                      round(s["first_call_s"], 1), round(s["first_call_s_again"], 1))
                  for k, s in step.items()}, flush=True)
        if FLAGS.out:
            with open(FLAGS.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
