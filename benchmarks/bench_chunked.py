"""Dense vs chunked exact softmax loss: peak memory and step time.

A "step" is the forward and backward pass of `sum_i -log softmax(h W + b)[t_i]`
with respect to `h` `[N, d]`, `W` `[d, V]` and `b` `[V]`, on the Keras
backend(s) of `--backend` (`tensorflow`, `jax`, `torch`; a comma list runs
each in its own processes) in the backend's modes (`--modes`; TensorFlow:
`graph`, `xla`; JAX: `xla`; PyTorch: `eager`, by default; see `steps.py`):

* `dense`: the head's dense path, `log_softmax(h W + b)` then a gather of the
  targets (what `PointwiseSoftmaxHead.log_likelihood` does without
  `chunk_size`; `steps.dense_nll`);
* `xent`: the backend's fused sparse softmax cross-entropy on the dense
  logits (TensorFlow's `sparse_softmax_cross_entropy_with_logits`, the
  strongest dense baseline TF has; optional);
* `chunked`: `keras_softmax_heads.chunked.chunked_pointwise_nll`.

Every configuration runs in a fresh subprocess. The child builds the inputs,
resets the kernel's peak-RSS counter (`measure.RssPeak`), runs the compiled
step once (tracing / XLA compilation) and the timed steps
(`measure.time_calls`), and reports the peak resident size over them minus
the resident size before them as the step's peak extra memory (if the
counter cannot be reset, the baseline is the `VmHWM` after building the
inputs). Time is the best of the
timed steps (wall clock, 2 shared cores: the best is the least disturbed).
`allocator_peak_mb` (TensorFlow only) is the peak of TensorFlow's CPU
allocator over the same steps. Every JSON row carries its `backend`; a
configuration that fails is printed and stored with its error.

Dense configurations whose estimated peak exceeds the memory budget are
skipped (estimate: `DENSE_COPIES` float32 `[N, V]` tensors, measured on the
configurations that fit).

Usage:
    python benchmarks/bench_chunked.py            # the full table
    python benchmarks/bench_chunked.py --quick    # smoke test, seconds
    python benchmarks/bench_chunked.py --n 2048 --v 33000 --modes graph \
        --chunk-sizes 2048,4096,8192               # tile-size sweep
    python benchmarks/bench_chunked.py --backend tensorflow,jax --modes xla
"""

import argparse
import functools
import os
import sys

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import measure  # benchmarks/measure.py (the script's own folder)
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

DENSE_COPIES = 5.0  # float32 [N, V] buffers alive at the dense peak (measured).
FULL_N = (2048, 8192)
FULL_V = (33_000, 100_000, 793_471)
D = 512


# --------------------------------------------------------------------- child
def host_inputs(n, v, d, seed=0):
    """`h` `[n, d]`, `W` `[d, v]`, `b` `[v]`, int32 targets `[n]` in 128-byte
    aligned NumPy buffers handed to the backend without a copy
    (`steps.host_tensor`): building the inputs leaves nothing in TF's memory
    pool, which would otherwise hide part of the step's peak."""
    import numpy as np
    import steps

    rng = np.random.default_rng(seed)
    out = []
    for shape, scale in (((n, d), 0.5), ((d, v), 1.0 / d**0.5), ((v,), 0.1)):
        array = steps.aligned_empty(shape, np.float32)
        rng.standard_normal(shape, dtype=np.float32, out=array)
        array *= scale
        out.append(steps.host_tensor(array))
    targets = steps.aligned_empty((n,), np.int32)
    targets[...] = rng.integers(0, v, size=n, dtype=np.int32)
    return out + [steps.host_tensor(targets)]


def loss_of(h, kernel, bias, targets, method, chunk_size):
    """The summed NLL of `method` (`dense`, `xent` or `chunked`)."""
    import keras
    import steps

    from keras_softmax_heads.chunked import chunked_pointwise_nll

    if method == "dense":
        loss = steps.dense_nll(h, kernel, bias, targets)
    elif method == "xent":
        loss = steps.fused_xent(h, kernel, bias, targets)
    else:
        loss = chunked_pointwise_nll(h, kernel, bias, targets, chunk_size=chunk_size)
    return keras.ops.sum(loss)


def child(args):
    import steps

    loss_fn = functools.partial(loss_of, method=args.method, chunk_size=args.chunk_size)
    step = steps.grad_step(loss_fn, [], args.mode, wrt=(0, 1, 2))
    # A tiny step of the same kind first: loads the oneDNN / XLA code whose
    # pages would otherwise count as the step's memory.
    step(*host_inputs(8, 2 * args.chunk_size + 3, args.d))
    data = host_inputs(args.n, args.v, args.d)
    # TF's CPU allocator (oneDNN build) pools large blocks and never returns
    # them, so the step's peak is measured from its first call on.
    rss, pool = measure.RssPeak(), steps.peak_memory()
    rss.start()
    if pool.allocator:
        pool.start()
    t = measure.time_calls(lambda: step(*data), warmup=1, repeats=args.repeats,
                           time_budget=args.time_budget)
    fresh_process.report({
        "backend": steps.BACKEND, "n": args.n, "v": args.v, "d": args.d, "mode": args.mode,
        "method": args.method, "chunk_size": args.chunk_size, "first_s": t.first_s,
        "step_s": t.best_s, "cpu_s": t.best_cpu_s, "steps": len(t.wall),
        "peak_mb": rss.peak_mib(), "peak_reset": rss.reset,
        "allocator_peak_mb": pool.peak_mib() if pool.allocator else None, "loss": t.value,
    })


# -------------------------------------------------------------------- parent
def run_child(n, v, mode, method, chunk_size, args, backend):
    flags = ["--child", "--backend", backend, "--n", str(n), "--v", str(v), "--d", str(args.d),
             "--modes", mode, "--method", method, "--chunk-size", str(chunk_size),
             "--repeats", str(args.repeats), "--time-budget", str(args.time_budget)]
    return fresh_process.run(__file__, flags, {"KERAS_BACKEND": backend}).result()


def best(old, new):
    """Keeps the faster of two runs of a configuration (and the larger peak)."""
    if not old or "step_s" not in old:
        return new
    if "step_s" not in new:
        return old
    out = dict(old if old["step_s"] <= new["step_s"] else new)
    out["cpu_s"] = min(old["cpu_s"], new["cpu_s"])
    out["peak_mb"] = max(old["peak_mb"], new["peak_mb"])
    return out


def measure_config(backend, mode, n, v, chunk_sizes, baselines, args):
    """`{name: result}` of one (backend, mode, N, V): the baselines (skipped
    when estimated over the memory budget) and every chunk size, each the
    best of `--rounds` processes."""
    dense_est = DENSE_COPIES * n * v * 4 + 2 * 4 * args.d * v
    budget = measure.memory_budget(args.memory_budget_gb)  # what is free now (shared machine)
    rows = {}
    for _ in range(args.rounds):
        for method in baselines:
            if dense_est > budget:
                rows[method] = {"skipped": f"estimated {dense_est / 2**30:.1f} GiB"}
                continue
            rows[method] = best(rows.get(method), run_child(n, v, mode, method, 0, args, backend))
        for c in chunk_sizes:
            r = run_child(n, v, mode, "chunked", c, args, backend)
            rows[f"chunked-{c}"] = best(rows.get(f"chunked-{c}"), r)
    return rows


def print_row(r, ref):
    name, where = r["name"], f"{r['backend']:10} {r['mode']:5} {r['n']:5d} {r['v']:7d}"
    if "step_s" not in r:
        print(f"{where} {name:>13}  -- {r.get('skipped') or r.get('error')}", flush=True)
        return
    rel_t = rel_c = rel_m = ""
    if "step_s" in ref:
        rel_t = f"{r['step_s'] / ref['step_s']:.2f}"
        rel_c = f"{r['cpu_s'] / ref['cpu_s']:.2f}"
        rel_m = f"{r['peak_mb'] / max(ref['peak_mb'], 1e-9):.3f}"
    print(f"{where} {name:>13} {r['step_s']:8.3f} {r['cpu_s']:8.3f} "
          f"{r['peak_mb']:9.0f} {rel_t:>10} {rel_c:>9} {rel_m:>9}", flush=True)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=str, default=None, help="comma-separated N")
    parser.add_argument("--v", type=str, default=None, help="comma-separated V")
    parser.add_argument("--d", type=int, default=D)
    select_backend.add_flag(parser, multiple=True)
    parser.add_argument(
        "--modes", type=str, default="",
        help="comma-separated modes (default: each backend's defaults)",
    )
    parser.add_argument("--method", type=str, default="chunked")
    parser.add_argument(
        "--baselines", type=str, default="dense", help="dense[,xent]"
    )
    parser.add_argument("--chunk-sizes", type=str, default=None)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run every configuration's processes this many times, "
        "interleaved, and keep the best time (shared machines)",
    )
    select_backend.add_budget_flags(parser, skipped="dense runs")
    parser.add_argument("--json", type=str, default=None, help="write results here")
    args = parser.parse_args()
    args.backends = select_backend.parse(args.backend, parser, multiple=True)
    args.modes = {b: select_backend.modes(args.modes, b, parser) for b in args.backends}
    return args


def main():
    args = parse_args()
    select_backend.use(args.backends[0])

    from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE

    if args.child:
        args.n, args.v, args.mode = int(args.n), int(args.v), args.modes[args.backends[0]][0]
        args.chunk_size = args.chunk_size or DEFAULT_CHUNK_SIZE
        return child(args)

    if args.quick:
        ns, vs, args.d, args.repeats = (64,), (1000, 3001), 32, 2
        chunk_sizes = [256]
    else:
        ns = tuple(int(x) for x in args.n.split(",")) if args.n else FULL_N
        vs = tuple(int(x) for x in args.v.split(",")) if args.v else FULL_V
        chunk_sizes = ([int(x) for x in args.chunk_sizes.split(",")] if args.chunk_sizes
                       else [DEFAULT_CHUNK_SIZE])
    baselines = [b for b in args.baselines.split(",") if b]
    header = (
        f"{'backend':10} {'mode':5} {'N':>5} {'V':>7} {'method':>13} {'wall s':>8} {'cpu s':>8} "
        f"{'peak MB':>9} {'wall/dense':>10} {'cpu/dense':>9} {'mem/dense':>9}"
    )
    print(f"d={args.d}, memory budget {measure.memory_budget(args.memory_budget_gb) / 2**30:.1f} "
          f"GiB, chunk sizes {chunk_sizes}, backends "
          f"{', '.join(f'{b} ({chr(44).join(args.modes[b])})' for b in args.backends)}; "
          "peak MB: process peak resident size (VmHWM)")
    print(header)
    print("-" * len(header), flush=True)
    results = []
    for backend in args.backends:
        for mode in args.modes[backend]:
            for n in ns:
                for v in vs:
                    rows = measure_config(backend, mode, n, v, chunk_sizes, baselines, args)
                    for name, r in rows.items():
                        r.update({"backend": backend, "name": name, "n": n, "v": v,
                                  "mode": mode})
                        results.append(r)
                        print_row(r, rows.get("dense", {}))
    measure.save(results, args.json)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
