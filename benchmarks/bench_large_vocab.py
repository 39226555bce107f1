"""Large-vocabulary heads: train-step and evaluation time and peak memory.

Every head of the library is a *row* of the table (`ROWS` below; rows whose
module is missing, e.g. `HierarchicalSoftmax` before it lands, are listed as
such). The steps run on the Keras backend of `--backend` (`tensorflow`,
`jax` or `torch`; `steps.py` builds them). For each vocabulary size `V`,
context size `d`, `N` tokens and each mode of the backend (`--modes`;
TensorFlow: `graph` = `tf.function`, `xla` = `tf.function(jit_compile=True)`,
both by default; JAX: `xla` = `jax.jit` (default), `eager`; PyTorch: `eager`
(default), `compile` = `torch.compile`):

* train: one forward + backward pass of `sum(head.training_loss(h, t))`
  with respect to `h` `[N, d]` and every trainable weight of the head
  (kernel, bias, ...). On TensorFlow, sparse gradients (`tf.IndexedSlices`,
  from row gathers) are returned as such, not densified: an optimizer
  applies them sparsely (JAX and PyTorch return dense gradients);
* eval: the exact `sum(head.log_likelihood(h, t))` (forward only).

Baselines: `FullSoftmax` (dense `log_softmax`; when its `[N, V]` tensors do
not fit in memory, `FullSoftmax (chunked)`, the exact loss of
`keras_softmax_heads.chunked`, is the reference instead) and TensorFlow's
`tf.nn.sampled_softmax_loss` / `tf.nn.nce_loss` with `num_sampled` samples
(their default log-uniform sampler, `unique=True`; weights `[V, d]` as our
sampled heads). TF's samplers do not compile with XLA: their `xla` rows
report the failure. They exist on TensorFlow only; other backends list them
as skipped.

Targets are drawn from a Zipfian unigram distribution (`counts[r] ∝ 1 / (r +
1)`, ids sorted by frequency), the `counts` given to the heads that take
them. `h ~ N(0, 0.25)`.

Each (row, mode, phase) runs in a fresh subprocess. The child builds the
head and the inputs, runs a tiny step of the same kind first (loads the
oneDNN / XLA code), then resets the kernel's peak-RSS counter
(`/proc/self/clear_refs`), records `VmRSS` as the baseline and runs the
compiled step: the first call (trace / compile) and up to `--repeats` timed
calls. Peak memory is `VmHWM - baseline` (peak resident memory of the step,
compilation included, excluding the weights and inputs that existed
before); if the counter cannot be reset, the baseline is the `VmHWM` before
the step. Time is the best timed call (wall clock; on a shared machine the
best is the least disturbed); `cpu s` is the process CPU time (all threads)
of the least CPU-hungry call, less sensitive to other processes competing
for the cores. `t/tf`, `cpu/tf`: our sampled heads against the TensorFlow op
with the same number of samples, in the same mode, or (suffix `g`) against
TF's graph mode when TF's op does not compile with XLA. Ratios are to the `FullSoftmax` row of the
same `V`, mode and phase. Peak memory is the process' resident size on
every backend. Every JSON row carries its `backend`; a row that fails
(e.g. a head not yet written for a backend) is printed and stored with its
error, and the other rows still run.

Configurations whose estimated peak exceeds the memory budget are skipped
(estimate: a few float32 `[N, V]` tensors for full-softmax steps, see
`Row.est`). For evaluation, `--eval-n auto` (default) uses the largest `N`
(halving from `--n`) at which the full-softmax evaluation fits, for every row
of that `V`, so that evaluation ratios compare equal work.

Usage:
    python benchmarks/bench_large_vocab.py --quick          # smoke run
    python benchmarks/bench_large_vocab.py                  # V = 10k, 100k, 793k
    python benchmarks/bench_large_vocab.py --v 100000 --modes graph \\
        --rows SampledSoftmax,tf.nn.sampled_softmax_loss
    python benchmarks/bench_large_vocab.py --skip-full      # no full-softmax rows
    python benchmarks/bench_large_vocab.py --backend jax    # the same on JAX (jax.jit)
"""

import argparse
import math
import os
import re
import sys

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import measure  # benchmarks/measure.py (the script's own folder)
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

FULL_V = (10_000, 100_000, 793_471)
D = 512
N = 2048
NUM_SAMPLED = 1024
GAMMA = 0.1


# ------------------------------------------------------------------- rows
class Row:
    """One line of the table.

    Args:
        name: the row's label (also what `--rows` matches).
        kind: `"head"` (a layer with `training_loss` / `log_likelihood`),
            `"chunked"` (exact loss of `keras_softmax_heads.chunked` on a
            `FullSoftmax`), or `"tf"` (a `tf.nn` sampled loss, train only).
        make: `make(args) -> head` (kinds "head" / "chunked"); may raise
            ImportError when the head's module is absent.
        est: `est(args, phase, n) -> bytes`, the estimated peak of the step.
        full: whether this is a full-softmax reference row.
        eval: whether the row has an evaluation phase.
        tf_ref: name of the TensorFlow row this row is compared with.
        xla: whether the row compiles with XLA (False: data-dependent
            shapes by design; its `xla` cells are skipped, not failures).
    """

    def __init__(self, name, kind, make=None, est=None, full=False, eval=True,
                 tf_ref=None, xla=True):
        self.name = name
        self.xla = xla
        self.tf_ref = tf_ref
        self.kind = kind
        self.make = make
        self.est = est or (lambda a, phase, n: 0)
        self.full = full
        self.eval = eval


def _f32(*dims):
    return 4 * math.prod(dims)


def est_dense(copies_train=5, copies_eval=3):
    """Full `[n, V]` scores: a few float32 copies plus the kernel and grads."""

    def est(a, phase, n):
        copies = copies_train if phase == "train" else copies_eval
        weights = (3 if phase == "train" else 1) * _f32(a.v, a.d)
        return copies * _f32(n, a.v) + weights

    return est


def est_sampled(a, phase, n):
    if phase == "eval":
        return est_dense()(a, phase, n)
    return 2 * _f32(a.v, a.d) + 4 * _f32(n, n + a.num_sampled)


def est_self_normalized(a, phase, n):
    if phase == "eval":
        return est_dense()(a, phase, n)
    rows = math.ceil(GAMMA * n)
    return 5 * _f32(rows, a.v) + 3 * _f32(a.v, a.d)


def est_chunked(a, phase, n):
    return 3 * _f32(a.v, a.d) + 6 * _f32(n, 8192)


def _full(a):
    import keras_softmax_heads as ksh

    return ksh.FullSoftmax(a.v)


def _sampled(sampler):
    def make(a):
        from keras_softmax_heads.heads.sampled_softmax import SampledSoftmax

        return SampledSoftmax(
            a.v, num_sampled=a.num_sampled, sampler=sampler, counts=a.counts, seed=0
        )

    return make


def _nce(a):
    from keras_softmax_heads.heads.nce import NCE

    return NCE(
        a.v,
        num_sampled=a.num_sampled,
        counts=a.counts,
        log_normalizer=math.log(a.v),
        seed=0,
    )


def _self_normalized(variant):
    def make(a):
        from keras_softmax_heads.heads.self_normalized_softmax import SelfNormalizedSoftmax

        return SelfNormalizedSoftmax(
            a.v, variant=variant, gamma=GAMMA, score_bound=variant == "weaknorm_sq",
            seed=0,
        )

    return make


def _hierarchical(a):
    from keras_softmax_heads.heads.hierarchical_softmax import HierarchicalSoftmax

    return HierarchicalSoftmax(a.v, counts=a.counts)


def _hierarchical_dynamic(a):
    from keras_softmax_heads.heads.hierarchical_softmax import HierarchicalSoftmax

    return HierarchicalSoftmax(a.v, counts=a.counts, static_shapes=False)


def _differentiated(a, chunk_size=None):
    from keras_softmax_heads.heads.differentiated_softmax import DifferentiatedSoftmax

    return DifferentiatedSoftmax(a.v, counts=a.counts, chunk_size=chunk_size)


def _differentiated_chunked(a):
    return _differentiated(a, chunk_size=4096)


SS, NCE_TF = "tf.nn.sampled_softmax_loss", "tf.nn.nce_loss"
ROWS = [
    Row("FullSoftmax", "head", _full, est_dense(), full=True),
    Row("FullSoftmax (chunked)", "chunked", _full, est_chunked, full=True),
    Row(SS, "tf", est=est_sampled, eval=False),
    Row(NCE_TF, "tf", est=est_sampled, eval=False),
    Row("SampledSoftmax log_uniform", "head", _sampled("log_uniform"), est_sampled,
        tf_ref=SS),
    Row("SampledSoftmax unigram", "head", _sampled("unigram"), est_sampled, tf_ref=SS),
    Row("SampledSoftmax batch", "head", _sampled("batch"), est_sampled, tf_ref=SS),
    Row("NCE unigram", "head", _nce, est_sampled, tf_ref=NCE_TF),
    Row(f"SelfNormalized weaknorm g={GAMMA}", "head", _self_normalized("weaknorm"),
        est_self_normalized),
    Row("HierarchicalSoftmax", "head", _hierarchical,
        lambda a, phase, n: 3 * _f32(a.v, a.d) + 4 * _f32(n, 4 * int(a.v ** 0.5))),
    Row("HierarchicalSoftmax (dynamic)", "head", _hierarchical_dynamic,
        lambda a, phase, n: 3 * _f32(a.v, a.d) + 4 * _f32(n, 4 * int(a.v ** 0.5)),
        xla=False),
    Row("DifferentiatedSoftmax", "head", _differentiated, est_dense()),
    Row("DifferentiatedSoftmax (chunked)", "head", _differentiated_chunked,
        est_chunked),
]


def zipf_counts(v, total=8e8):
    import numpy as np

    weights = 1.0 / np.arange(1, v + 1)
    return np.maximum(np.round(total * weights / weights.sum()), 1.0)


# ------------------------------------------------------------------ child
def numpy_inputs(rng, n, v, d):
    """`h ~ N(0, 0.25)` `[n, d]` and Zipfian int32 targets `[n]` as tensors."""
    import numpy as np
    import steps

    h = rng.standard_normal((n, d), dtype=np.float32)
    h *= 0.5
    p = zipf_counts(v)
    targets = rng.choice(v, size=n, p=p / p.sum()).astype(np.int32)
    return steps.tensor(h), steps.tensor(targets)


def tf_sampled_loss(row, v, args, rng):
    """`(loss_fn, variables)` of a `tf.nn` sampled loss (weights `[V, d]`)."""
    import numpy as np
    import tensorflow as tf

    w = tf.Variable(rng.standard_normal((v, args.d), dtype=np.float32) / args.d**0.5)
    b = tf.Variable(np.zeros(v, np.float32))
    fn = getattr(tf.nn, row.name.split(".")[-1])

    def loss_fn(h, t):
        return fn(w, b, tf.cast(t, tf.int64)[:, None], h, num_sampled=args.num_sampled,
                  num_classes=v)

    return loss_fn, [w, b]


def make_step(row, v, args, rng):
    """The timed step (`steps.py`) of `row` for a vocabulary of `v` words."""
    import keras
    import steps

    from keras_softmax_heads.chunked import chunked_pointwise_nll

    if row.kind == "tf":
        loss_fn, variables = tf_sampled_loss(row, v, args, rng)
        ll_fn, state = None, []
    else:
        head = row.make(argparse.Namespace(**dict(vars(args), v=v, counts=zipf_counts(v))))
        head(keras.ops.zeros((1, args.d)))
        variables, state = list(head.trainable_variables), list(head.variables)
        if row.kind == "chunked":
            def loss_fn(h, t):
                return chunked_pointwise_nll(h, head.kernel, head.bias, t)

            def ll_fn(h, t):
                return -loss_fn(h, t)
        else:
            def loss_fn(h, t):
                return head.training_loss(h, t, training=True)

            ll_fn = head.log_likelihood
    if args.phase == "train":
        return steps.grad_step(lambda h, t: keras.ops.sum(loss_fn(h, t)), variables,
                               args.modes, wrt=(0,), state=state)
    return steps.value_step(lambda h, t: keras.ops.sum(ll_fn(h, t)), args.modes, state=state)


def measure_row(args, track_memory=True):
    """Builds one (row, V, N, mode, phase) step, times it, returns a dict."""
    import numpy as np

    row = next(r for r in ROWS if r.name == args.row)
    rng = np.random.default_rng(0)
    # Warm-up on a tiny problem of the same kind (code pages, XLA runtime).
    small_v = max(2 * args.num_sampled + 3, 64)
    warm = make_step(row, small_v, args, rng)
    warm(*numpy_inputs(rng, 16, small_v, args.d))

    step = make_step(row, args.v, args, rng)
    data = numpy_inputs(rng, args.n, args.v, args.d)
    memory = measure.RssPeak() if track_memory else measure.NoMemory()
    t = measure.time_calls(lambda: step(*data), warmup=1, repeats=args.repeats, memory=memory,
                           memory_covers_warmup=True, time_budget=args.time_budget)
    return {
        "first_s": t.first_s, "step_s": t.best_s, "cpu_s": t.best_cpu_s, "steps": len(t.wall),
        "peak_mb": memory.peak_mib(), "peak_reset": memory.reset, "loss": t.value,
    }


def child(args):
    select_backend.use(args.backend)
    fresh_process.report(measure_row(args))


def run_in_process(row, v, n, mode, phase, args):
    """Quick mode: no subprocess (fast; peak memory is not measured)."""
    sub = argparse.Namespace(**vars(args))
    sub.row, sub.v, sub.n, sub.modes, sub.phase = row.name, v, n, mode, phase
    select_backend.use(args.backend)
    try:
        return measure_row(sub, track_memory=False)
    except Exception as err:  # report, as a subprocess failure would be
        text = f"{type(err).__name__}: {err}"
        reason = _xla_reason(text) if mode == "xla" else None
        return {"error": reason or text.splitlines()[0][:300]}


# ----------------------------------------------------------------- parent
def _xla_reason(text):
    """'XLA cannot compile <op>' when `text` is XLA's unsupported-op error."""
    found = sorted(set(re.findall(r"(\w+CandidateSampler)", text)))
    if found:
        return f"XLA cannot compile {found[0]}"
    match = re.search(r"unsupported operations?[^\n]*?(\w+)\s*\(No registered", text)
    if match:
        return f"XLA cannot compile {match.group(1)}"
    return None


def run_child(row, v, n, mode, phase, args):
    flags = ["--child", "--backend", args.backend, "--row", row.name, "--v", str(v),
             "--n", str(n), "--d", str(args.d), "--num-sampled", str(args.num_sampled),
             "--modes", mode, "--phase", phase, "--repeats", str(args.repeats),
             "--time-budget", str(args.time_budget)]
    child = fresh_process.run(__file__, flags, {"KERAS_BACKEND": args.backend})
    if child.results:
        return child.results[0]
    reason = _xla_reason(child.output) if mode == "xla" else None
    return {"error": reason or child.error}


OPTIONAL_MODULES = {
    "HierarchicalSoftmax": "keras_softmax_heads.heads.hierarchical_softmax",
    "DifferentiatedSoftmax": "keras_softmax_heads.heads.differentiated_softmax",
}


def _available_rows(rows, backend):
    """`{row name: reason}` for rows that cannot run on `backend`.

    TensorFlow's ops run on TensorFlow only; heads whose module does not
    import are missing. Imports the heads only when some row needs the check.
    """
    status = {}
    for row in rows:
        if row.kind == "tf" and backend != "tensorflow":
            status[row.name] = f"a TensorFlow op: not run on {backend}"
            continue
        module = OPTIONAL_MODULES.get(row.name)
        if module is None:
            continue
        try:
            __import__(module)
        except ImportError as err:
            status[row.name] = f"not available ({err})"
    return status


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row", type=str, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--phase", type=str, default="train", help=argparse.SUPPRESS)
    parser.add_argument("--v", type=str, default=None, help="comma-separated V")
    parser.add_argument("--n", type=int, default=N, help="tokens per step")
    parser.add_argument("--d", type=int, default=D, help="context size")
    parser.add_argument("--num-sampled", type=int, default=NUM_SAMPLED)
    select_backend.add_flag(parser)
    parser.add_argument(
        "--modes", type=str, default="",
        help="comma-separated modes (default: the backend's defaults)",
    )
    parser.add_argument("--phases", type=str, default="train,eval")
    parser.add_argument(
        "--rows", type=str, default=None,
        help="comma-separated substrings of row names to run (default: all)",
    )
    parser.add_argument(
        "--skip-full", action="store_true",
        help="skip the full-softmax reference rows (tens of seconds at V=793k)",
    )
    parser.add_argument(
        "--eval-n", type=str, default="auto",
        help="tokens of the eval phase: an int, or 'auto' (largest N/2^k that fits)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    select_backend.add_budget_flags(parser)
    parser.add_argument(
        "--in-process", action="store_true",
        help="run every row in this process (default with --quick): fast, "
        "but no peak-memory measurement",
    )
    parser.add_argument("--json", type=str, default=None, help="write results here")
    args = parser.parse_args()
    args.backend = select_backend.parse(args.backend, parser)
    if not args.child:
        args.modes = select_backend.modes(args.modes, args.backend, parser)
    return args


def selected_rows(args):
    """The rows of `--rows` (and the full-softmax references unless `--skip-full`)."""
    rows = ROWS
    if args.rows:
        wanted = [w.strip() for w in args.rows.split(",") if w.strip()]
        rows = [r for r in rows if r.full or any(w in r.name for w in wanted)]
    if args.skip_full:
        rows = [r for r in rows if not r.full]
    return rows


def eval_tokens(a, budget, args):
    """`N` of the eval phase: `--eval-n`, or the largest `N / 2^k` at which the
    full-softmax evaluation fits in `budget`."""
    if args.eval_n != "auto":
        return int(args.eval_n)
    eval_n = args.n
    while eval_n > 16 and est_dense()(a, "eval", eval_n) > budget:
        eval_n //= 2
    return eval_n


def run_cell(row, a, n, mode, phase, measured, unavailable, budget, args):
    """The result of one (row, V, mode, phase): measured, or why it is skipped."""
    if unavailable.get(row.name):
        return {"skipped": unavailable[row.name]}
    if mode == "xla" and not row.xla:
        return {"skipped": "data-dependent shapes: not for XLA"}
    if row.name == "FullSoftmax (chunked)" and "step_s" in measured.get("FullSoftmax", {}):
        return {"skipped": "dense FullSoftmax fits; chunked not needed"}
    if row.est(a, phase, n) > budget:
        return {"skipped": f"estimated {row.est(a, phase, n) / 2**30:.1f} GiB"}
    run = run_in_process if args.in_process else run_child
    return run(row, a.v, n, mode, phase, args)


def tf_ratios(r, row, measured_all):
    """`(time, cpu)` ratios of `r` to its TensorFlow op's row: same mode, else
    (marked `g`) TF's graph mode, where its samplers do not compile with XLA."""
    if not row.tf_ref:
        return "", ""
    tf_r, mark = measured_all.get((r["v"], r["mode"], r["phase"], row.tf_ref), {}), ""
    if "step_s" not in tf_r:
        tf_r, mark = measured_all.get((r["v"], "graph", r["phase"], row.tf_ref), {}), "g"
    if "step_s" not in tf_r:
        return "", ""
    return (f"{r['step_s'] / tf_r['step_s']:.2f}{mark}",
            f"{r['cpu_s'] / tf_r['cpu_s']:.2f}{mark}")


def print_row(r, row, ref, measured_all):
    where = f"{r['v']:7d} {r['mode']:5} {r['phase']:5} {r['n']:5d} {row.name:34}"
    if "step_s" not in r:
        print(f"{where}  -- {r.get('skipped') or r.get('error')}", flush=True)
        return
    rel_t = rel_m = ""
    if "step_s" in ref:
        rel_t = f"{r['step_s'] / ref['step_s']:.4f}"
        if r["peak_mb"] is not None and ref["peak_mb"]:
            rel_m = f"{r['peak_mb'] / max(ref['peak_mb'], 1e-9):.4f}"
    peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.1f}"
    rel_tf, cpu_tf = tf_ratios(r, row, measured_all)
    print(f"{where} {r['step_s']:9.4f} {r['cpu_s']:8.4f} {peak:>9} "
          f"{rel_t:>8} {rel_m:>8} {rel_tf:>7} {cpu_tf:>7}", flush=True)


def main():
    args = parse_args()
    select_backend.use(args.backend)
    if args.child:
        args.v = int(args.v)
        return child(args)

    if args.quick:
        vs, args.n, args.d, args.num_sampled, args.repeats = (2000,), 64, 32, 16, 2
        args.in_process = True
    else:
        vs = tuple(int(x) for x in args.v.split(",")) if args.v else FULL_V
    rows = selected_rows(args)
    unavailable = _available_rows(rows, args.backend)
    budget = measure.memory_budget(args.memory_budget_gb, gib=True)
    print(f"backend {args.backend}, d={args.d}, N={args.n}, num_sampled={args.num_sampled}, "
          f"memory budget {budget / 2**30:.1f} GiB, modes {args.modes}; peak MB: process "
          "peak resident size (VmHWM)", flush=True)
    header = (
        f"{'V':>7} {'mode':5} {'phase':5} {'N':>5} {'row':34} {'time s':>9} "
        f"{'cpu s':>8} {'peak MB':>9} {'t/full':>8} {'mem/full':>8} "
        f"{'t/tf':>7} {'cpu/tf':>7}"
    )
    print(header)
    print("-" * len(header), flush=True)
    results, measured_all = [], {}
    for v in vs:
        a = argparse.Namespace(v=v, d=args.d, num_sampled=args.num_sampled)
        eval_n = eval_tokens(a, budget, args)
        for mode in args.modes:
            for phase in args.phases.split(","):
                n = args.n if phase == "train" else eval_n
                measured = {}
                for row in rows:
                    if phase == "eval" and not row.eval:
                        continue
                    r = run_cell(row, a, n, mode, phase, measured, unavailable, budget, args)
                    measured[row.name] = measured_all[(v, mode, phase, row.name)] = r
                    ref = next((measured[x.name] for x in rows
                                if x.full and "step_s" in measured.get(x.name, {})), {})
                    r = dict(r, backend=args.backend, row=row.name, v=v, mode=mode,
                             phase=phase, n=n)
                    results.append(r)
                    print_row(r, row, ref, measured_all)
    measure.save(results, args.json)
    errors = [
        r for r in results
        if "error" in r and not r["error"].startswith("XLA cannot compile")
    ]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
