"""Dense vs chunked exact softmax loss: peak memory and step time.

A "step" is the forward and backward pass of `sum_i -log softmax(h W + b)[t_i]`
with respect to `h` `[N, d]`, `W` `[d, V]` and `b` `[V]`:

* `dense`: the head's dense path, `log_softmax(h W + b)` then a gather of the
  targets (what `PointwiseSoftmaxHead.log_likelihood` does without
  `chunk_size`);
* `xent`: TensorFlow's fused `sparse_softmax_cross_entropy_with_logits` on
  the dense logits (the strongest dense baseline TF has; optional);
* `chunked`: `keras_softmax_heads.chunked.chunked_pointwise_nll`.

Every configuration runs in a fresh subprocess. The child builds the inputs,
runs the compiled step once (tracing / XLA compilation), resets the kernel's
peak-RSS counter (`/proc/self/clear_refs`), records `VmRSS` as the baseline,
runs the timed steps and reports `VmHWM - baseline` as the step's peak extra
memory (if the counter cannot be reset, the baseline is the `VmHWM` after
building the inputs and the first call is included). Time is the best of the
timed steps (wall clock, 2 shared cores: the best is the least disturbed).

Dense configurations whose estimated peak exceeds the memory budget are
skipped (estimate: `DENSE_COPIES` float32 `[N, V]` tensors, measured on the
configurations that fit).

Usage:
    python benchmarks/bench_chunked.py            # the full table
    python benchmarks/bench_chunked.py --quick    # smoke test, seconds
    python benchmarks/bench_chunked.py --n 2048 --v 33000 --modes graph \
        --chunk-sizes 2048,4096,8192               # tile-size sweep
"""

import argparse
import json
import os
import subprocess
import sys
import time

import proc_memory  # benchmarks/proc_memory.py (the script's own folder)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

DENSE_COPIES = 5.0  # float32 [N, V] buffers alive at the dense peak (measured).
FULL_N = (2048, 8192)
FULL_V = (33_000, 100_000, 793_471)
D = 512


# --------------------------------------------------------------------- child
def child(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    from keras_softmax_heads.chunked import chunked_pointwise_nll

    n, v, d = args.n, args.v, args.d

    def host_tensor(shape, dtype, fill):
        # A 128-byte aligned NumPy buffer handed to TF without a copy
        # (DLPack): building the inputs leaves nothing in TF's memory pool,
        # which would otherwise hide part of the step's peak.
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw = np.empty(nbytes + 128, np.uint8)
        offset = (-raw.ctypes.data) % 128
        array = raw[offset : offset + nbytes].view(dtype).reshape(shape)
        fill(array)
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())

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
            log_p = tf.nn.log_softmax(tf.matmul(h, kernel) + bias)
            return -tf.gather(log_p, targets, batch_dims=1)
        if args.method == "xent":
            return tf.nn.sparse_softmax_cross_entropy_with_logits(
                targets, tf.matmul(h, kernel) + bias
            )
        return chunked_pointwise_nll(
            h, kernel, bias, targets, chunk_size=args.chunk_size
        )

    @tf.function(jit_compile=args.mode == "xla")
    def step(h, kernel, bias, targets):
        with tf.GradientTape() as tape:
            tape.watch([h, kernel, bias])
            loss = tf.reduce_sum(loss_fn(h, kernel, bias, targets))
        return loss, tape.gradient(loss, [h, kernel, bias])

    # A tiny step of the same kind first: loads the oneDNN / XLA code whose
    # pages would otherwise count as the step's memory.
    float(step(*inputs(8, 2 * args.chunk_size + 3, d))[0])
    data = inputs(n, v, d)
    # TF's CPU allocator (oneDNN build) pools large blocks and never returns
    # them, so the step's peak is measured from its first call on.
    reset = proc_memory.reset_peak()
    baseline = proc_memory.status()["VmRSS" if reset else "VmHWM"]
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        pool_base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    except (ValueError, RuntimeError):
        pool_base = None
    t0 = time.perf_counter()
    loss = float(step(*data)[0])
    first = time.perf_counter() - t0
    times, cpu_times = [], []
    budget_end = time.perf_counter() + args.time_budget
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = step(*data)
        loss = float(out[0])
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        del out
        if time.perf_counter() > budget_end:
            break
    peak = proc_memory.status()["VmHWM"] - baseline
    pool_peak = None
    if pool_base is not None:
        info = tf.config.experimental.get_memory_info("CPU:0")
        pool_peak = (info["peak"] - pool_base) / 2**20
    print(
        "RESULT "
        + json.dumps(
            {
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
def run_child(n, v, mode, method, chunk_size, args):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--n", str(n),
        "--v", str(v),
        "--d", str(args.d),
        "--modes", mode,
        "--method", method,
        "--chunk-size", str(chunk_size),
        "--repeats", str(args.repeats),
        "--time-budget", str(args.time_budget),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"rc={proc.returncode}: " + " | ".join(tail)}


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
    parser.add_argument("--modes", type=str, default="graph,xla")
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

    from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE

    if args.child:
        args.n, args.v, args.mode = int(args.n), int(args.v), args.modes
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
    modes = args.modes.split(",")
    baselines = [b for b in args.baselines.split(",") if b]
    budget = (
        args.memory_budget_gb * 2**30
        if args.memory_budget_gb
        else 0.8 * proc_memory.available_bytes()
    )
    results = []
    header = (
        f"{'mode':5} {'N':>5} {'V':>7} {'method':>13} {'wall s':>8} {'cpu s':>8} "
        f"{'peak MB':>9} {'wall/dense':>10} {'cpu/dense':>9} {'mem/dense':>9}"
    )
    print(f"d={args.d}, memory budget {budget / 2**30:.1f} GiB, "
          f"chunk sizes {chunk_sizes}")
    print(header)
    print("-" * len(header), flush=True)
    for mode in modes:
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
                        r = run_child(n, v, mode, method, 0, args)
                        rows[method] = best(rows.get(method), r)
                    for c in chunk_sizes:
                        r = run_child(n, v, mode, "chunked", c, args)
                        rows[f"chunked-{c}"] = best(rows.get(f"chunked-{c}"), r)
                ref = rows.get("dense", {})
                for name, r in rows.items():
                    r.update({"name": name, "n": n, "v": v, "mode": mode})
                    results.append(r)
                    if "step_s" in r:
                        rel_t = rel_c = rel_m = ""
                        if "step_s" in ref:
                            rel_t = f"{r['step_s'] / ref['step_s']:.2f}"
                            rel_c = f"{r['cpu_s'] / ref['cpu_s']:.2f}"
                            rel_m = f"{r['peak_mb'] / max(ref['peak_mb'], 1e-9):.3f}"
                        print(
                            f"{mode:5} {n:5d} {v:7d} {name:>13} "
                            f"{r['step_s']:8.3f} {r['cpu_s']:8.3f} "
                            f"{r['peak_mb']:9.0f} {rel_t:>10} {rel_c:>9} {rel_m:>9}",
                            flush=True,
                        )
                    else:
                        why = r.get("skipped") or r.get("error")
                        print(f"{mode:5} {n:5d} {v:7d} {name:>13}  -- {why}",
                              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    errors = [r for r in results if "error" in r]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
