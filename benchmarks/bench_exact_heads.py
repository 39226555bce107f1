"""Exact output heads vs FullSoftmax: training-step time and peak memory.

A "step" is the forward and backward pass of the head's training loss,
the objective `HeadLoss` and `HeadModel` train (`head.summed_training_loss(h,
y, 1 / N)`: `mean(head.training_loss(h, y))`, with its gradient computed in
the forward pass where the head has a summed core, e.g. the mixtures), with
respect to `h` `[N, d]` and all of the head's trainable weights
(`steps.train_step(..., summed=True)`), on the Keras backend(s) of
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
  `--mixture-components` components.

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
import functools
import itertools
import os
import time

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import measure  # benchmarks/measure.py (the script's own folder)
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ALL_HEADS = ("full", "sigsoftmax", "monotonic", "plif", "plif_naive", "mos", "moc")


# --------------------------------------------------------------------- heads
def make_head(name, vocab, args):
    """A fresh head `name` for a vocabulary of `vocab` words."""
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
        import keras_softmax_heads as ksh

        cls = ksh.MixtureOfSoftmaxes if name == "mos" else ksh.MixtureOfContexts
        return cls(vocab, num_components=args.mixture_components)
    raise ValueError(f"Unknown head {name!r}. Known: {ALL_HEADS}")


def inputs(n, v, d):
    """`h` `[N, d]` ~ N(0, 1) and uniform targets `[N]`, as backend tensors."""
    import numpy as np
    import steps

    y = np.random.default_rng(1).integers(0, v, size=n).astype(np.int32)
    return steps.normal((n, d), seed=0), steps.tensor(y)


# --------------------------------------------------------------------- child
def child_time(args):
    import steps

    n, v, d = args.n[0], args.v[0], args.d[0]
    h, y = inputs(n, v, d)
    calls, errors = {}, {}
    for name in args.heads:
        try:
            head = make_head(name, v, args)
            head.build((None, d))
            calls[name] = functools.partial(
                steps.train_step(head, args.modes[0], summed=True), h, y)
        except Exception as err:  # reported as the head's row
            errors[name] = measure.error_text(err)
    warmup_s = {}
    for name, call in list(calls.items()):
        try:
            _, warmup_s[name], _ = measure.clock(
                functools.partial(measure.time_calls, call, warmup=max(args.warmup, 1),
                                  repeats=0))
        except Exception as err:  # reported as the head's row
            errors[name] = measure.error_text(err)
            del calls[name]
    wall, cpu = measure.interleaved(calls, args.rounds)
    fresh_process.report({"names": list(calls), "wall": wall, "cpu": cpu,
                          "warmup_s": warmup_s, "errors": errors})


def child_memory(args):
    import steps

    n, v, d = args.n[0], args.v[0], args.d[0]
    head = make_head(args.heads[0], v, args)
    head.build((None, d))
    step = steps.train_step(head, args.modes[0], summed=True)
    h, y = inputs(n, v, d)
    rss_before = measure.status()["VmHWM"]
    step(h, y)  # tracing / compilation, and a first step
    rss_first = measure.status()["VmHWM"] - rss_before
    memory = steps.peak_memory()
    measure.time_calls(lambda: step(h, y), warmup=0, repeats=args.memory_steps, memory=memory)
    fresh_process.report({"peak_mib": memory.peak_mib(), "memory_source": memory.source,
                          "rss_first_call_mib": rss_first / 2**20})


# -------------------------------------------------------------------- parent
def run_child(kind, heads, n, v, d, mode, args, backend):
    flags = ["--child", kind, "--backend", backend, "--n", str(n), "--v", str(v),
             "--d", str(d), "--modes", mode, "--heads", ",".join(heads),
             "--rounds", str(args.rounds), "--warmup", str(args.warmup),
             "--memory-steps", str(args.memory_steps), "--mono-units", str(args.mono_units),
             "--plif-knots", str(args.plif_knots), "--plif-bound", str(args.plif_bound),
             "--mixture-components", str(args.mixture_components)]
    return fresh_process.run(__file__, flags, {"KERAS_BACKEND": backend}).result()


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


def parse_args():
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

    args.backends, args.modes_of = backends, modes
    if args.quick and not args.child:
        args.n, args.v, args.d = [64], [500], [32]
        args.rounds, args.warmup, args.memory_steps = 3, 1, 1
        args.plif_knots = 1000
        args.mono_units = 4
        args.mixture_components = 2
    return args


def table_row(record, full_mem):
    """A head's line of the table (`record`: its JSON record)."""
    import numpy as np

    peak = record["peak_mib"]
    mem_text = "-" if peak is None else f"{peak:.1f}"
    if peak is None and record["memory_error"]:
        mem_text = "error"
    mem_ratio = f"{peak / full_mem:.2f}" if peak is not None and full_mem else "-"
    return (f"| {record['backend']} | {record['n']} | {record['v']} | {record['d']} "
            f"| {record['mode']} | {record['head']} | {record['wall_ms']:.0f} "
            f"| {_spread(np.array(record['wall_ratios']))} "
            f"| {_spread(np.array(record['cpu_ratios']))} | {mem_text} | {mem_ratio} |")


def run_config(backend, n, v, d, mode, heads, args):
    """One (backend, N, V, d, mode): `(records, table lines, memory sources)`."""
    import numpy as np

    t0 = time.perf_counter()
    where = {"backend": backend, "n": n, "v": v, "d": d, "mode": mode}
    timing = run_child("time", heads, n, v, d, mode, args, backend)
    if "error" in timing:
        print(f"  {backend} N={n} V={v} d={d} {mode}: {timing['error']}", flush=True)
        return [dict(where, head=None, error=timing["error"])], [], {}
    records, lines, sources = [], [], {}
    for name, error in timing.get("errors", {}).items():
        print(f"  {backend} N={n} V={v} d={d} {mode} {name}: {error}", flush=True)
        records.append(dict(where, head=name, error=error))
        lines.append(f"| {backend} | {n} | {v} | {d} | {mode} | {name} "
                     f"| error: {error[:120]} | | | | |")
    names = timing["names"]
    if "full" not in names:
        return records, lines, sources
    memory = {}
    if not args.no_memory:
        memory = {name: run_child("memory", [name], n, v, d, mode, args, backend)
                  for name in names}
    full_wall, full_cpu = np.array(timing["wall"]["full"]), np.array(timing["cpu"]["full"])
    full_mem = memory.get("full", {}).get("peak_mib")
    for name in names:
        wall, cpu = np.array(timing["wall"][name]), np.array(timing["cpu"][name])
        mem = memory.get(name, {})
        if mem.get("memory_source"):
            sources[backend] = mem["memory_source"]
        record = dict(where, head=name, wall_ms=float(np.median(wall) * 1e3),
                      wall_ratios=(wall / full_wall).tolist(),
                      cpu_ratios=(cpu / full_cpu).tolist(), peak_mib=mem.get("peak_mib"),
                      rss_first_call_mib=mem.get("rss_first_call_mib"),
                      memory_error=mem.get("error"), memory_source=mem.get("memory_source"))
        records.append(record)
        lines.append(table_row(record, full_mem))
    print(f"  {backend} N={n} V={v} d={d} {mode}: done in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return records, lines, sources


def print_comparison(records, tolerance):
    lines, outside = compare_backends(records, tolerance)
    print()
    print("| N | V | d | head | backend | time / full | reference | time / full "
          "| ratio / TF ratio | |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for line in lines:
        print(line)
    if outside:
        print(f"not within {tolerance:g}x of TensorFlow's ratio: " + "; ".join(outside))


def main():
    args = parse_args()
    if args.child:
        select_backend.use(args.backends[0])
        args.modes = args.modes_of[args.backends[0]]
        return (child_time if args.child == "time" else child_memory)(args)
    heads = ["full"] + [x for x in args.heads if x != "full"]
    print(
        f"# N={args.n}, V={args.v}, d={args.d}; monotonic K={args.mono_units} units, "
        f"PLIF K={args.plif_knots} knots on [-{args.plif_bound:g}, {args.plif_bound:g}], "
        f"mixtures {args.mixture_components} components; {args.rounds} rounds; backends "
        f"{', '.join(f'{b} ({chr(44).join(args.modes_of[b])})' for b in args.backends)}",
        flush=True,
    )
    rows, records, sources = [], [], {}
    for backend in args.backends:
        for n, v, d in itertools.product(args.n, args.v, args.d):
            for mode in args.modes_of[backend]:
                r, lines, s = run_config(backend, n, v, d, mode, heads, args)
                records += r
                rows += lines
                sources.update(s)
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
    if len(args.backends) > 1:
        print_comparison(records, args.tolerance)
    measure.save({
        "command": measure.command_line(__file__),
        "machine": measure.machine(),
        "objective": "summed_training_loss(h, y, 1 / N): what HeadLoss and HeadModel train",
        "rows": records,
    }, args.json)


if __name__ == "__main__":
    main()
