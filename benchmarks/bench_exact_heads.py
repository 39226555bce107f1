"""Exact output heads vs FullSoftmax: training-step time and peak memory.

A "step" is the forward and backward pass of the head's training loss,
`mean(head.training_loss(h, y))`, with respect to `h` `[N, d]` and all of the
head's trainable weights (`steps.train_step`), on the Keras backend(s) of
`--backend` (`tensorflow`, `jax`, `torch`; a comma list runs each in its
own processes and sets their ratios side by side), in the backend's modes
(`--modes`; TensorFlow: `graph` = `tf.function`, `xla` =
`tf.function(jit_compile=True)`; JAX: `xla` = `jax.jit`, `eager`; PyTorch:
`eager`, `compile` = `torch.compile`; default: TensorFlow's two, JAX's
`xla`, PyTorch's `eager`).

Heads (each optional with `--heads`):

* `full`: `FullSoftmax` (the reference of every ratio);
* `sigsoftmax`: `SigSoftmax` (`output_fn="sigsoftmax"`);
* `monotonic`: `MonotonicSoftmax` with `--mono-units` hidden units (16 by
  default: its cost grows linearly with the units, `K` sigmoids per score);
* `plif`: `PLIFSoftmax` with `--plif-knots` knots (1e5, the paper's setting);
* `plif_naive`: the same head with the straightforward PLIF (two gathers,
  automatic differentiation, no fused loss): what `PLIFSoftmax` improves on;
* `mos`, `moc`: `MixtureOfSoftmaxes` / `MixtureOfContexts` with
  `--mixture-components` components, when `keras_softmax_heads.heads.mixture_of_softmaxes`
  is importable.

Time: for each (V, d, mode) one process builds every head on the same `h`,
`y`, compiles the steps, runs `--warmup` steps each, then `--rounds` rounds;
a round runs one step of every head, in an order rotated from round to round
(so FullSoftmax and each head alternate). A head's ratio is computed per
round against FullSoftmax's step of the same round; the table shows the
median ratio and its spread (25th-75th percentile over the rounds), for wall
time and for process CPU time (user + system, all threads; less sensitive to
other processes on a shared machine, but it also counts thread-pool spinning).

Peak memory: every (backend, V, d, mode, head) runs in a fresh process. The
child builds the inputs, runs the step once (tracing / XLA compilation), resets
TensorFlow's allocator statistics (`tf.config.experimental.reset_memory_stats`
on `CPU:0`; this TensorFlow build's oneDNN CPU allocator is a BFC allocator
that keeps them), runs `--memory-steps` steps and reports the allocator's
peak minus its current usage before the steps: the memory the step itself
allocates (activations, tensors saved for the backward pass, gradients,
XLA's temporary buffers), not the weights or the compiler. Peak RSS is not
usable for this: the BFC allocator keeps the pages of the first step, so a
second step's RSS high-water mark hardly moves. The JSON output also has
`rss_first_call_mib`, the `VmHWM` increase over the first call (tracing and
compilation included). On JAX and PyTorch, whose CPU allocators keep no
statistics, `peak MiB` is the process' peak resident size during the steps
minus its resident size before them (`VmHWM` after resetting it); the
table and the JSON (`memory_source`) say which reading a row has.

With several backends, a last table compares each head's median time
ratio to `FullSoftmax` on a backend with its TensorFlow ratio (JAX `xla`
and PyTorch `compile` against TensorFlow `xla`; `eager` against `graph`)
and marks the heads whose ratios differ by more than `--tolerance`.

A head that fails to build or run on a backend is a row with its error;
the other heads of that configuration are still measured.

Usage:
    python benchmarks/bench_exact_heads.py --quick        # smoke test, ~1 min
    python benchmarks/bench_exact_heads.py                # V in {10k, 33k}, d in {256, 512}
    python benchmarks/bench_exact_heads.py --v 10000 --d 256 --heads full,plif \
        --rounds 15                                       # the PLIF acceptance number
    python benchmarks/bench_exact_heads.py --backend tensorflow,jax --modes xla
                                                          # JAX's ratios next to TF's
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

ALL_HEADS = ("full", "sigsoftmax", "monotonic", "plif", "plif_naive", "mos", "moc")


# --------------------------------------------------------------------- heads
def make_head(name, vocab, args):
    """A fresh head `name` for a vocabulary of `vocab` words, or None."""
    if name == "full":
        from keras_softmax_heads.heads.full_softmax import FullSoftmax

        return FullSoftmax(vocab)
    if name == "sigsoftmax":
        from keras_softmax_heads.heads.sig_softmax import SigSoftmax

        return SigSoftmax(vocab)
    if name == "monotonic":
        from keras_softmax_heads.heads.monotonic_softmax import MonotonicSoftmax

        return MonotonicSoftmax(vocab, num_units=args.mono_units)
    if name in ("plif", "plif_naive"):
        from keras_softmax_heads.heads.plif_softmax import PLIFSoftmax

        if name == "plif":
            return PLIFSoftmax(
                vocab, num_knots=args.plif_knots, knot_bound=args.plif_bound
            )
        from keras_softmax_heads import functional
        from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead

        class NaivePLIF(PLIFSoftmax):
            """Two gathers + autodiff, dense `log_softmax` loss."""

            def score_transform(self, z):
                return functional.plif_reference(z, self.raw_slopes, self.knot_bound)

            log_likelihood = PointwiseSoftmaxHead.log_likelihood

        return NaivePLIF(vocab, num_knots=args.plif_knots, knot_bound=args.plif_bound)
    if name in ("mos", "moc"):
        try:
            from keras_softmax_heads.heads import mixture_of_softmaxes as mixture
        except ImportError:
            return None
        cls = getattr(
            mixture, "MixtureOfSoftmaxes" if name == "mos" else "MixtureOfContexts", None
        )
        if cls is None:
            return None
        return cls(vocab, num_components=args.mixture_components)
    raise ValueError(f"Unknown head {name!r}. Known: {ALL_HEADS}")


def inputs(n, v, d):
    """`h` `[N, d]` ~ N(0, 1) and uniform targets `[N]`, as backend tensors."""
    import numpy as np
    import steps

    y = np.random.default_rng(1).integers(0, v, size=n).astype(np.int32)
    return steps.normal((n, d), seed=0), steps.tensor(y)


def _error_text(err):
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


# --------------------------------------------------------------------- child
def child_time(args):
    import steps

    n, v, d = args.n[0], args.v[0], args.d[0]
    h, y = inputs(n, v, d)
    names, step_fns, errors = [], {}, {}
    for name in args.heads:
        try:
            head = make_head(name, v, args)
            if head is None:
                continue
            head.build((None, d))
            step_fns[name] = steps.train_step(head, args.modes[0])
        except Exception as err:  # reported as the head's row
            errors[name] = _error_text(err)
            continue
        names.append(name)
    compile_s = {}
    for name in list(names):
        t0 = time.perf_counter()
        try:
            for _ in range(max(args.warmup, 1)):
                step_fns[name](h, y)
        except Exception as err:  # reported as the head's row
            errors[name] = _error_text(err)
            names.remove(name)
            continue
        compile_s[name] = time.perf_counter() - t0
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)] if names else []
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            step_fns[name](h, y)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    result = {"names": names, "wall": wall, "cpu": cpu, "warmup_s": compile_s,
              "errors": errors}
    print("RESULT " + json.dumps(result), flush=True)


def child_memory(args):
    import steps

    n, v, d = args.n[0], args.v[0], args.d[0]
    head = make_head(args.heads[0], v, args)
    if head is None:
        print("RESULT " + json.dumps({"skipped": True}), flush=True)
        return
    head.build((None, d))
    step = steps.train_step(head, args.modes[0])
    h, y = inputs(n, v, d)
    rss_before = proc_memory.status()["VmHWM"]
    step(h, y)  # tracing / compilation, and a first step
    rss_first = proc_memory.status()["VmHWM"] - rss_before
    memory = steps.PeakMemory()
    memory.start()
    for _ in range(args.memory_steps):
        step(h, y)
    print(
        "RESULT "
        + json.dumps({"peak_mib": memory.peak_mib(), "memory_source": memory.source,
                      "rss_first_call_mib": rss_first / 2**20}),
        flush=True,
    )


# -------------------------------------------------------------------- parent
def run_child(kind, heads, n, v, d, mode, args, backend):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child", kind,
        "--backend", backend,
        "--n", str(n), "--v", str(v), "--d", str(d),
        "--modes", mode,
        "--heads", ",".join(heads),
        "--rounds", str(args.rounds),
        "--warmup", str(args.warmup),
        "--memory-steps", str(args.memory_steps),
        "--mono-units", str(args.mono_units),
        "--plif-knots", str(args.plif_knots),
        "--plif-bound", str(args.plif_bound),
        "--mixture-components", str(args.mixture_components),
    ]
    env = dict(os.environ, KERAS_BACKEND=backend)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": fresh_process.error_text(proc.stderr + proc.stdout, proc.returncode)}


def compare_backends(records, tolerance):
    """Rows of the table of each head's ratio to FullSoftmax vs TensorFlow's."""
    import numpy as np

    ratio = {}
    for r in records:
        if r.get("wall_ratios"):
            key = (r["backend"], r["n"], r["v"], r["d"], r["mode"], r["head"])
            ratio[key] = float(np.median(r["wall_ratios"]))
    lines, outside = [], []
    for (backend, n, v, d, mode, head), value in sorted(ratio.items()):
        if backend == "tensorflow" or head == "full":
            continue
        tf_mode = select_backend.TF_MODE[mode]
        ref = ratio.get(("tensorflow", n, v, d, tf_mode, head))
        if ref is None:
            continue
        quotient = value / ref
        flag = "" if 1 / tolerance <= quotient <= tolerance else "OUTSIDE"
        if flag:
            outside.append(f"{backend} {mode} N={n} V={v} d={d} {head}: {quotient:.2f}")
        lines.append(f"| {n} | {v} | {d} | {head} | {backend} {mode} | {value:.2f} "
                     f"| tensorflow {tf_mode} | {ref:.2f} | {quotient:.2f} | {flag} |")
    return lines, outside


def _spread(values):
    import numpy as np

    q = np.percentile(values, [25, 50, 75])
    return f"{q[1]:.2f} [{q[0]:.2f}-{q[2]:.2f}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--child", choices=["time", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--n", type=str, default="2048", help="comma-separated N")
    parser.add_argument("--v", type=str, default="10000,33000", help="comma-separated V")
    parser.add_argument("--d", type=str, default="256,512", help="comma-separated d")
    select_backend.add_flag(parser, multiple=True)
    parser.add_argument(
        "--modes", type=str, default="",
        help="comma-separated modes (default: each backend's defaults)",
    )
    parser.add_argument(
        "--tolerance", type=float, default=1.2,
        help="mark heads whose ratio to FullSoftmax on a backend is not within "
        "this factor of TensorFlow's",
    )
    parser.add_argument("--heads", type=str, default=",".join(ALL_HEADS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true", help="skip peak memory")
    parser.add_argument("--mono-units", type=int, default=16)
    parser.add_argument("--plif-knots", type=int, default=100_000)
    parser.add_argument("--plif-bound", type=float, default=20.0)
    parser.add_argument("--mixture-components", type=int, default=4)
    parser.add_argument("--json", type=str, default=None, help="write results here")
    args = parser.parse_args()
    args.n = [int(x) for x in args.n.split(",")]
    args.v = [int(x) for x in args.v.split(",")]
    args.d = [int(x) for x in args.d.split(",")]
    args.heads = args.heads.split(",")
    backends = select_backend.parse(args.backend, parser, multiple=len(
        [b for b in args.backend.split(",") if b]) > 1)
    backends = backends if isinstance(backends, list) else [backends]
    modes = {b: select_backend.modes(args.modes, b, parser) for b in backends}
    for name in args.heads:
        if name not in ALL_HEADS:
            parser.error(f"unknown head {name!r}; known: {', '.join(ALL_HEADS)}")

    if args.child:
        select_backend.use(backends[0])
        args.modes = modes[backends[0]]
        return (child_time if args.child == "time" else child_memory)(args)

    if args.quick:
        args.n, args.v, args.d = [64], [500], [32]
        args.rounds, args.warmup, args.memory_steps = 3, 1, 1
        args.plif_knots = 1000
        args.mono_units = 4
        args.mixture_components = 2
    if "full" not in args.heads:
        args.heads = ["full"] + args.heads
    heads = ["full"] + [x for x in args.heads if x != "full"]

    print(
        f"# N={args.n}, V={args.v}, d={args.d}; monotonic K={args.mono_units} units, "
        f"PLIF K={args.plif_knots} knots on [-{args.plif_bound:g}, {args.plif_bound:g}], "
        f"mixtures {args.mixture_components} components; {args.rounds} rounds; "
        f"backends {', '.join(f'{b} ({chr(44).join(modes[b])})' for b in backends)}",
        flush=True,
    )
    rows, records, sources = [], [], {}
    for backend in backends:
        for n in args.n:
            for v in args.v:
                for d in args.d:
                    for mode in modes[backend]:
                        t0 = time.perf_counter()
                        timing = run_child("time", heads, n, v, d, mode, args, backend)
                        if "error" in timing:
                            print(f"  {backend} N={n} V={v} d={d} {mode}: {timing['error']}",
                                  flush=True)
                            records.append({"backend": backend, "n": n, "v": v, "d": d,
                                            "mode": mode, "head": None,
                                            "error": timing["error"]})
                            continue
                        names = timing["names"]
                        for name, error in timing.get("errors", {}).items():
                            print(f"  {backend} N={n} V={v} d={d} {mode} {name}: {error}",
                                  flush=True)
                            records.append({"backend": backend, "n": n, "v": v, "d": d,
                                            "mode": mode, "head": name, "error": error})
                            rows.append(f"| {backend} | {n} | {v} | {d} | {mode} | {name} "
                                        f"| error: {error[:120]} | | | | |")
                        if "full" not in names:
                            continue
                        memory = {}
                        if not args.no_memory:
                            for name in names:
                                memory[name] = run_child("memory", [name], n, v, d, mode, args,
                                                         backend)
                        import numpy as np

                        full_wall = np.array(timing["wall"]["full"])
                        full_cpu = np.array(timing["cpu"]["full"])
                        full_mem = memory.get("full", {}).get("peak_mib")
                        for name in names:
                            wall = np.array(timing["wall"][name])
                            cpu = np.array(timing["cpu"][name])
                            mem = memory.get(name, {})
                            peak = mem.get("peak_mib")
                            if mem.get("memory_source"):
                                sources[backend] = mem["memory_source"]
                            record = {
                                "backend": backend,
                                "n": n, "v": v, "d": d, "mode": mode, "head": name,
                                "wall_ms": float(np.median(wall) * 1e3),
                                "wall_ratios": (wall / full_wall).tolist(),
                                "cpu_ratios": (cpu / full_cpu).tolist(),
                                "peak_mib": peak,
                                "rss_first_call_mib": mem.get("rss_first_call_mib"),
                                "memory_error": mem.get("error"),
                                "memory_source": mem.get("memory_source"),
                            }
                            records.append(record)
                            mem_text = "-"
                            if peak is not None:
                                mem_text = f"{peak:.1f}"
                            elif mem.get("error"):
                                mem_text = "error"
                            mem_ratio = (
                                f"{peak / full_mem:.2f}"
                                if peak is not None and full_mem
                                else "-"
                            )
                            rows.append(
                                f"| {backend} | {n} | {v} | {d} | {mode} | {name} "
                                f"| {np.median(wall) * 1e3:.0f} "
                                f"| {_spread(wall / full_wall)} "
                                f"| {_spread(cpu / full_cpu)} "
                                f"| {mem_text} | {mem_ratio} |"
                            )
                        print(
                            f"  {backend} N={n} V={v} d={d} {mode}: done in "
                            f"{time.perf_counter() - t0:.0f} s",
                            flush=True,
                        )
    print()
    print(
        "| backend | N | V | d | mode | head | step ms (median) | time / full, wall: median "
        "[p25-p75] | time / full, CPU | peak MiB | peak / full |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    for backend, source in sources.items():
        print(f"peak MiB on {backend}: {source}")
    if len(backends) > 1:
        lines, outside = compare_backends(records, args.tolerance)
        print()
        print("| N | V | d | head | backend | time / full | reference | time / full "
              "| ratio / TF ratio | |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for line in lines:
            print(line)
        if outside:
            print(f"not within {args.tolerance:g}x of TensorFlow's ratio: "
                  + "; ".join(outside))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
