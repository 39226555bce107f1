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
runs the compiled step once (tracing / XLA compilation), resets the kernel's
peak-RSS counter (`/proc/self/clear_refs`), records `VmRSS` as the baseline,
runs the timed steps and reports `VmHWM - baseline` as the step's peak extra
memory (if the counter cannot be reset, the baseline is the `VmHWM` after
building the inputs and the first call is included). Time is the best of the
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
import json
import os
import subprocess
import sys
import time

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import proc_memory  # benchmarks/proc_memory.py (the script's own folder)
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

DENSE_COPIES = 5.0  # float32 [N, V] buffers alive at the dense peak (measured).
FULL_N = (2048, 8192)
FULL_V = (33_000, 100_000, 793_471)
D = 512


# --------------------------------------------------------------------- child
def child(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import steps

    from keras_softmax_heads.chunked import chunked_pointwise_nll

    n, v, d = args.n, args.v, args.d

    def host_tensor(shape, dtype, fill):
        # A 128-byte aligned NumPy buffer handed to the backend without a
        # copy (steps.host_tensor): building the inputs leaves nothing in
        # TF's memory pool, which would otherwise hide part of the step's peak.
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw = np.empty(nbytes + 128, np.uint8)
        offset = (-raw.ctypes.data) % 128
        array = raw[offset : offset + nbytes].view(dtype).reshape(shape)
        fill(array)
        return steps.host_tensor(array)

    def inputs(n, v, d):
        rng = np.random.default_rng(0)

        def normal(scale):
            def fill(a):
                rng.standard_normal(a.shape, dtype=np.float32, out=a)
                a *= scale

            return fill

        def ids(a):
            a[...] = rng.integers(0, v, size=a.shape, dtype=np.int32)

        return (
            host_tensor((n, d), np.float32, normal(0.5)),
            host_tensor((d, v), np.float32, normal(1.0 / d**0.5)),
            host_tensor((v,), np.float32, normal(0.1)),
            host_tensor((n,), np.int32, ids),
        )

    def loss_fn(h, kernel, bias, targets):
        if args.method == "dense":
            loss = steps.dense_nll(h, kernel, bias, targets)
        elif args.method == "xent":
            loss = steps.fused_xent(h, kernel, bias, targets)
        else:
            loss = chunked_pointwise_nll(
                h, kernel, bias, targets, chunk_size=args.chunk_size
            )
        return keras.ops.sum(loss)

    step = steps.grad_step(loss_fn, [], args.mode, wrt=(0, 1, 2))

    # A tiny step of the same kind first: loads the oneDNN / XLA code whose
    # pages would otherwise count as the step's memory.
    step(*inputs(8, 2 * args.chunk_size + 3, d))
    data = inputs(n, v, d)
    # TF's CPU allocator (oneDNN build) pools large blocks and never returns
    # them, so the step's peak is measured from its first call on.
    reset = proc_memory.reset_peak()
    baseline = proc_memory.status()["VmRSS" if reset else "VmHWM"]
    pool = steps.PeakMemory()
    if pool.allocator:
        pool.start()
    t0 = time.perf_counter()
    loss = step(*data)
    first = time.perf_counter() - t0
    times, cpu_times = [], []
    budget_end = time.perf_counter() + args.time_budget
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step(*data)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if time.perf_counter() > budget_end:
            break
    peak = proc_memory.status()["VmHWM"] - baseline
    pool_peak = pool.peak_mib() if pool.allocator else None
    print(
        "RESULT "
        + json.dumps(
            {
                "backend": steps.BACKEND,
                "n": n,
                "v": v,
                "d": d,
                "mode": args.mode,
                "method": args.method,
                "chunk_size": args.chunk_size,
                "first_s": first,
                "step_s": min(times),
                "cpu_s": min(cpu_times),
                "steps": len(times),
                "peak_mb": peak / 2**20,
                "peak_reset": reset,
                "allocator_peak_mb": pool_peak,
                "loss": loss,
            }
        ),
        flush=True,
    )


# -------------------------------------------------------------------- parent
def run_child(n, v, mode, method, chunk_size, args, backend):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--backend", backend,
        "--n", str(n),
        "--v", str(v),
        "--d", str(args.d),
        "--modes", mode,
        "--method", method,
        "--chunk-size", str(chunk_size),
        "--repeats", str(args.repeats),
        "--time-budget", str(args.time_budget),
    ]
    env = dict(os.environ, KERAS_BACKEND=backend)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": fresh_process.error_text(proc.stderr + proc.stdout, proc.returncode)}


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


def main():
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
    parser.add_argument(
        "--time-budget", type=float, default=60.0,
        help="stop repeating a configuration after this many seconds",
    )
    parser.add_argument(
        "--memory-budget-gb", type=float, default=None,
        help="skip dense runs estimated above this (default: 80%% of MemAvailable)",
    )
    parser.add_argument("--json", type=str, default=None, help="write results here")
    args = parser.parse_args()
    backends = select_backend.parse(args.backend, parser, multiple=True)
    modes = {b: select_backend.modes(args.modes, b, parser) for b in backends}
    select_backend.use(backends[0])

    from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE

    if args.child:
        args.n, args.v, args.mode = int(args.n), int(args.v), modes[backends[0]][0]
        args.chunk_size = args.chunk_size or DEFAULT_CHUNK_SIZE
        return child(args)

    if args.quick:
        ns, vs, args.d, args.repeats = (64,), (1000, 3001), 32, 2
        chunk_sizes = [256]
    else:
        ns = tuple(int(x) for x in args.n.split(",")) if args.n else FULL_N
        vs = tuple(int(x) for x in args.v.split(",")) if args.v else FULL_V
        chunk_sizes = (
            [int(x) for x in args.chunk_sizes.split(",")]
            if args.chunk_sizes
            else [DEFAULT_CHUNK_SIZE]
        )
    baselines = [b for b in args.baselines.split(",") if b]
    budget = (
        args.memory_budget_gb * 2**30
        if args.memory_budget_gb
        else 0.8 * proc_memory.available_bytes()
    )
    results = []
    header = (
        f"{'backend':10} {'mode':5} {'N':>5} {'V':>7} {'method':>13} {'wall s':>8} {'cpu s':>8} "
        f"{'peak MB':>9} {'wall/dense':>10} {'cpu/dense':>9} {'mem/dense':>9}"
    )
    print(f"d={args.d}, memory budget {budget / 2**30:.1f} GiB, "
          f"chunk sizes {chunk_sizes}, backends "
          f"{', '.join(f'{b} ({chr(44).join(modes[b])})' for b in backends)}; peak MB: "
          "process peak resident size (VmHWM)")
    print(header)
    print("-" * len(header), flush=True)
    configs = [(b, mode) for b in backends for mode in modes[b]]
    for backend, mode in configs:
        for n in ns:
            for v in vs:
                dense_est = DENSE_COPIES * n * v * 4 + 2 * 4 * args.d * v
                if not args.memory_budget_gb:  # what is free now (shared machine)
                    budget = 0.8 * proc_memory.available_bytes()
                rows = {}
                for _ in range(args.rounds):
                    for method in baselines:
                        if dense_est > budget:
                            rows[method] = {
                                "skipped": f"estimated {dense_est / 2**30:.1f} GiB"
                            }
                            continue
                        r = run_child(n, v, mode, method, 0, args, backend)
                        rows[method] = best(rows.get(method), r)
                    for c in chunk_sizes:
                        r = run_child(n, v, mode, "chunked", c, args, backend)
                        rows[f"chunked-{c}"] = best(rows.get(f"chunked-{c}"), r)
                ref = rows.get("dense", {})
                for name, r in rows.items():
                    r.update({"backend": backend, "name": name, "n": n, "v": v,
                              "mode": mode})
                    results.append(r)
                    if "step_s" in r:
                        rel_t = rel_c = rel_m = ""
                        if "step_s" in ref:
                            rel_t = f"{r['step_s'] / ref['step_s']:.2f}"
                            rel_c = f"{r['cpu_s'] / ref['cpu_s']:.2f}"
                            rel_m = f"{r['peak_mb'] / max(ref['peak_mb'], 1e-9):.3f}"
                        print(
                            f"{backend:10} {mode:5} {n:5d} {v:7d} {name:>13} "
                            f"{r['step_s']:8.3f} {r['cpu_s']:8.3f} "
                            f"{r['peak_mb']:9.0f} {rel_t:>10} {rel_c:>9} {rel_m:>9}",
                            flush=True,
                        )
                    else:
                        why = r.get("skipped") or r.get("error")
                        print(f"{backend:10} {mode:5} {n:5d} {v:7d} {name:>13}  -- {why}",
                              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    errors = [r for r in results if "error" in r]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
