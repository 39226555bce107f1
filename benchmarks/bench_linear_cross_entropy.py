r"""Fused linear cross-entropy against the dense logits and PyTorch (issue 20).

One step is the forward and backward pass of the mean cross-entropy of the
logits `h W` (`h` `[N, d]`, `W` the `[d, V]` output matrix, targets `[N]`)
with respect to `h` AND `W`, for every vocabulary size `V` of
`--vocab_sizes` and input dtype of `--dtypes` (`float32`, `bfloat16`: `h`
and `W` in that dtype). Rows (`--rows`), each in a fresh process:

* `keras_dense`: the stock Keras path, `keras.ops.matmul(h, W)` (the
  `[N, V]` logits) and `keras.losses.SparseCategoricalCrossentropy(
  from_logits=True)`, gradients by the backend (`--backend`, TensorFlow by
  default) in `--mode` (`steps.grad_step`; TensorFlow's default: `graph`,
  `tf.function` without XLA, what Keras runs on a CPU);
* `ours`: `keras_softmax_heads.losses.linear_cross_entropy(h, W, t)`
  (`--chunk_size`, default the library's), same backend and mode;
* `ours_summed`: the same with `gradient_in_forward=True` (the gradient
  computed in the forward pass over chunks of tokens, three products:
  `chunked.summed_cross_entropy`; its default token chunk);
* `ours_frozen`: `ours` with `W` frozen (the gradient with respect to `h`
  only, as for LoRA's base output matrix or a frozen embedding: on
  PyTorch the loss sees `W` needs no gradient and skips its products, on
  JAX and under TensorFlow's XLA the compiler drops them;
  `docs/chunked.md`, "Frozen inputs");
* `torch_chunked`: `torch.nn.functional.linear_cross_entropy(h, W.T, t,
  options=torch.nn.LinearCrossEntropyOptions())`, PyTorch's chunked
  implementation (`W.T`: PyTorch's `[V, d]` weight layout, built as such);
* `torch_dense`: `F.cross_entropy(h @ W.T, t)` (eager PyTorch);
* `torch_chunked_frozen`: `torch_chunked` with `W` frozen (no
  `requires_grad`).

The PyTorch rows import no Keras; gradients by `loss.backward()` (the
chunked op supports only that), `.grad` cleared before every call. Every
row sees the same values: `h ~ N(0, 1)`, `W ~ N(0, 1 / d)` (so the logits
are about `N(0, 1)`), uniform targets, drawn in float32 with NumPy in
blocks of columns (seeded per block) and rounded to the dtype; the `loss`
of each row is recorded as a check that the rows compute the same thing.

Time: one warm-up call (tracing / compilation; `first_s`), then
`--repeats` timed calls; `step_s` is their median wall time, `best_s` the
fastest.

Memory, from the process' resident size (Linux `/proc/self/status`,
`measure.RssPeak`): the child first runs a tiny step of the same kind (to
load the libraries' code), then allocates `h`, `W` and the targets, resets
the peak counter (`VmHWM`, `/proc/self/clear_refs`) and reads the resident
size, `baseline_mib`. The warm-up call counts towards the peak (TensorFlow's
CPU allocator keeps the blocks of its first call for the next ones). Then:

* `peak_mib`: the raw peak resident size over the warm-up and timed calls;
* `peak_over_inputs_mib = peak_mib - baseline_mib`: what the step added to
  the inputs and weights;
* `grad_mib`: the size of the two gradients `dL/dh` and `dL/dW` in the
  inputs' dtype (`N d + d V` elements), which every row must return;
* `extra_mib = peak_over_inputs_mib - grad_mib`: the memory beyond the
  weights and gradients (the `[N, V]` logits and their gradient for the
  dense rows; tiles and per-token statistics for the fused ones). If the
  peak counter cannot be reset, the baseline is the peak after allocating
  the inputs (`peak_reset: false` in the row).

Ratios per `(V, dtype)`: `time_ours_over_keras_dense`,
`time_ours_over_torch_chunked` (median step times) and
`extra_memory_ours_over_keras_dense` (`extra_mib`).

Threads: `--threads` (default 2) is applied in every child: TensorFlow's
intra-op pool (`tf.config.threading.set_intra_op_parallelism_threads`; the
inter-op pool gets 1 thread: a step is one chain of ops), PyTorch's
`torch.set_num_threads` (and `set_num_interop_threads(1)`), and
`OMP_NUM_THREADS` (oneDNN's and PyTorch's OpenMP pools) in the child's
environment. On JAX, XLA's CPU client is limited to one thread by
`--xla_cpu_multi_thread_eigen=false` when `--threads=1`; other counts leave
JAX's pool at its default (the CPUs the process may run on: pin the run
with `taskset` to bound it).

`--device=gpu` runs the Keras rows on JAX's GPU (`--backend=jax`) and the
PyTorch rows on CUDA, the inputs copied to the device; memory then comes
from the device allocators (`measure.JaxDevicePeak`: `bytes_in_use` /
`peak_bytes_in_use` of JAX's `memory_stats`; `measure.TorchCudaPeak`:
`torch.cuda.memory_allocated` / `max_memory_allocated`),
the same `baseline` / `peak` / `extra` fields
(`benchmarks/device_linear_cross_entropy.sh` runs the GPU table).

`--in_process` runs every row in the parent process instead (for smoke
tests: seconds, but the memory readings then include the earlier rows').

A row that fails (an error, or a child killed, e.g. out of memory) is
recorded with its `error`; the others still run. Dense rows whose estimated
extra memory (`DENSE_COPIES` float32 `[N, V]` buffers) exceeds
`--memory_budget_gb` (default: 80% of the machine's available memory when
the row starts) are recorded as `skipped` rather than run, so that an
out-of-memory kill does not hit other processes of the machine.

Usage:
    OMP_NUM_THREADS=2 python benchmarks/bench_linear_cross_entropy.py \
        --out=docs/results/bench_linear_cross_entropy.json   # the full table
    python benchmarks/bench_linear_cross_entropy.py --quick --out=/tmp/lce.json
    python benchmarks/bench_linear_cross_entropy.py --tokens=64 --dim=16 \
        --vocab_sizes=128,256 --repeats=2 --threads=1
"""

import os

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py
from absl import app
from absl import flags

ROWS = ("keras_dense", "ours", "ours_summed", "ours_frozen", "torch_chunked", "torch_dense",
        "torch_chunked_frozen")
TORCH_ROWS = ("torch_chunked", "torch_dense", "torch_chunked_frozen")
#: Rows with `W` frozen: the gradient with respect to `h` only.
FROZEN_ROWS = ("ours_frozen", "torch_chunked_frozen")
DTYPES = ("float32", "bfloat16")
#: float32 `[N, V]` buffers alive at the dense rows' peak (estimate, for
#: the memory-budget skip), with a margin over the measured extra memory at
#: N = 4096, V = 128k-256k (2 threads): Keras / TensorFlow 1.84-1.94, PyTorch
#: 2.74-2.75 (`docs/results/bench_linear_cross_entropy.json`).
DENSE_COPIES = {"keras_dense": 2.5, "torch_dense": 3.5}
#: Flops of a step per `N d V`: the logits and the two gradient products;
#: the fused rows recompute the logits in the backward pass.
FLOPS_PER_NDV = {"keras_dense": 6, "ours": 8, "ours_summed": 6, "ours_frozen": 6,
                 "torch_chunked": 6, "torch_dense": 6, "torch_chunked_frozen": 4}
BLOCK = 4096  # columns of W drawn at a time

flags.DEFINE_enum("backend", select_backend.default_backend(), select_backend.BACKENDS,
                  "Keras backend of the `keras_dense` and `ours` rows.")
flags.DEFINE_string("mode", None, "Compilation mode of the Keras rows (select_backend.MODES; "
                    "default: the backend's first default, TensorFlow `graph`).")
flags.DEFINE_integer("tokens", 4096, "N, tokens per step.")
flags.DEFINE_integer("dim", 1024, "d, the hidden size.")
flags.DEFINE_list("vocab_sizes", ["32768", "131072", "262144"], "Vocabulary sizes V.")
flags.DEFINE_list("dtypes", list(DTYPES), "Dtypes of h and W.")
flags.DEFINE_list("rows", list(ROWS), "Rows to run.")
flags.DEFINE_integer("chunk_size", None, "chunk_size of `ours` (default: the library's).")
flags.DEFINE_integer("repeats", 3, "Timed calls per row (after one warm-up call).")
flags.DEFINE_integer("threads", 2, "Threads of TensorFlow, PyTorch and OpenMP in each child.")
flags.DEFINE_float("memory_budget_gb", None, "Skip dense rows estimated above this "
                   "(default: 80% of MemAvailable when the row starts).")
flags.DEFINE_float("assumed_gflops", None, "Float32 GFLOP/s of the machine for the runtime "
                   "estimate (default: 40 per thread).")
flags.DEFINE_enum("device", "cpu", ["cpu", "gpu"], "Where the rows run. `gpu`: the Keras "
                  "rows on JAX's GPU, the PyTorch rows on CUDA; memory from the device "
                  "allocators (JAX `memory_stats`, `torch.cuda.max_memory_allocated`).")
flags.DEFINE_bool("quick", False, "Smoke run: N=64, d=16, V=128,256, chunk 64, 2 repeats.")
flags.DEFINE_bool("in_process", False, "Run every row in this process (smoke tests: no fresh "
                  "process per row, so the memory readings are not meaningful).")
flags.DEFINE_string("out", None, "Write the results to this JSON file.")
flags.DEFINE_string("row", None, "Internal: run one row (with --vocab_sizes=V, --dtypes=D) "
                    "and print its result.")
FLAGS = flags.FLAGS


# ----------------------------------------------------------------- inputs
def fill_inputs(n, d, v, seed=0):
    """Yields `(name, slice, float32 block)` of the inputs, the same in every row.

    `h`: rows of `[n, d]`; `W`: column blocks `[d, BLOCK]` of `[d, V]`, each
    from its own seed (so the PyTorch rows can build `W.T` block by block);
    `t`: the `[n]` targets.
    """
    import numpy as np

    rng = np.random.default_rng([seed, 0])
    yield "h", slice(0, n), rng.standard_normal((n, d), dtype=np.float32)
    for j0 in range(0, v, BLOCK):
        j1 = min(v, j0 + BLOCK)
        rng = np.random.default_rng([seed, 1, j0])
        block = rng.standard_normal((d, j1 - j0), dtype=np.float32)
        block *= d**-0.5
        yield "W", slice(j0, j1), block
    yield "t", slice(0, n), np.random.default_rng([seed, 2]).integers(0, v, n).astype(np.int32)


def numpy_inputs(n, d, v, dtype):
    """`(h [n, d], W [d, v], t [n])` aligned NumPy arrays (`dtype`: via ml_dtypes)."""
    import ml_dtypes
    import numpy as np
    from steps import aligned_empty  # benchmarks/steps.py (imports Keras)

    np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    h = aligned_empty((n, d), np_dtype)
    w = aligned_empty((d, v), np_dtype)
    t = None
    for name, where, block in fill_inputs(n, d, v):
        if name == "h":
            h[where] = block
        elif name == "W":
            w[:, where] = block
        else:
            t = aligned_empty((n,), np.int32)
            t[...] = block
    return h, w, t


def torch_inputs(n, d, v, dtype):
    """`(h [n, d], W^T [v, d], t [n] int64)` PyTorch tensors, the same values."""
    import torch

    torch_dtype = getattr(torch, dtype)
    h = torch.empty((n, d), dtype=torch_dtype)
    w = torch.empty((v, d), dtype=torch_dtype)
    t = None
    for name, where, block in fill_inputs(n, d, v):
        if name == "h":
            h[where] = torch.from_numpy(block)
        elif name == "W":
            w[where] = torch.from_numpy(block.T.copy())
        else:
            t = torch.from_numpy(block).long()
    return h, w, t


# ------------------------------------------------------------------- rows
def set_threads(row, threads):
    """The row's framework's intra-op threads (inter-op: 1); what it uses."""
    if row in TORCH_ROWS:
        import torch_heads  # benchmarks/torch_heads.py (imports PyTorch)

        torch_heads.set_threads(threads, interop=1)
        return threads
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        return tf.config.threading.get_intra_op_parallelism_threads()
    return threads if keras.backend.backend() != "jax" or threads == 1 else None


def keras_step(row, mode, chunk_size, device="cpu"):
    """`(step, make_inputs)` of a Keras row (`keras_dense`, `ours`,
    `ours_summed`)."""
    import keras
    import steps

    from keras_softmax_heads.losses import linear_cross_entropy

    scce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_fn(h, w, t):
        if row == "keras_dense":
            return scce(t, keras.ops.matmul(h, w))
        return linear_cross_entropy(h, w, t, chunk_size=chunk_size,
                                    gradient_in_forward=row == "ours_summed")

    step = steps.grad_step(loss_fn, [], mode, wrt=(0,) if row in FROZEN_ROWS else (0, 1))

    def make_inputs(n, d, v, dtype):
        arrays = numpy_inputs(n, d, v, dtype)
        tensors = []
        for a in arrays:
            if device == "gpu":  # copied to the default (GPU) device
                tensors.append(keras.ops.convert_to_tensor(a))
                continue
            try:  # no copy where the backend takes the buffer (float32, int32)
                tensors.append(steps.host_tensor(a))
            except BufferError:  # bfloat16: NumPy exports no DLPack for it
                tensors.append(keras.ops.convert_to_tensor(a))
        # The NumPy arrays stay alive with the tensors (some share them).
        return tensors, arrays

    return step, make_inputs


def torch_step(row, device="cpu"):
    """`(step, make_inputs)` of a PyTorch row (`torch_heads.py`)."""
    import torch_heads

    def make_inputs(n, d, v, dtype):
        h, w, t = torch_inputs(n, d, v, dtype)
        if device == "gpu":
            h, w, t = h.cuda(), w.cuda(), t.cuda()
        return [h.requires_grad_(True), w.requires_grad_(row not in FROZEN_ROWS), t], None

    return torch_heads.linear_cross_entropy_step(row.removesuffix("_frozen")), make_inputs


def memory_reader(row, device):
    """The process' resident size on the CPU; on a GPU, the row's device
    allocator (JAX's peak is the process': the tiny step's, below the inputs')."""
    if device != "gpu":
        return measure.RssPeak()
    return measure.TorchCudaPeak() if row in TORCH_ROWS else measure.JaxDevicePeak()


def run_row(row, n, d, v, dtype, repeats, threads, mode=None, chunk_size=None,
            device="cpu"):
    """Measures one row in this process; returns its result dict."""
    result = {"row": row, "n": n, "d": d, "v": v, "dtype": dtype}
    if row in TORCH_ROWS:
        import torch

        step, make_inputs = torch_step(row, device)
        result.update(framework=f"torch {torch.__version__}", mode="eager")
    else:
        import keras

        from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE

        backend = keras.backend.backend()
        mode = mode or select_backend.DEFAULT_MODES[backend][0]
        chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
        step, make_inputs = keras_step(row, mode, chunk_size, device)
        result.update(framework=f"keras {keras.__version__} ({backend})", mode=mode)
        if row in ("ours", "ours_frozen"):
            result["chunk_size"] = chunk_size
        if row == "ours_summed":
            from keras_softmax_heads.chunked.summed_divergence import default_token_chunk
            from keras_softmax_heads.platforms import current_platform

            result["token_chunk_size"] = default_token_chunk(v, platform=current_platform())
    result["threads"] = set_threads(row, threads)
    # A tiny step of the same kind first: loads the libraries' code, whose
    # pages would otherwise count as the step's memory.
    small, _ = make_inputs(8, min(d, 8), 16, dtype)
    step(*small)
    del small
    data, keep = make_inputs(n, d, v, dtype)
    if device == "gpu":
        result["device"] = gpu_name(row)
    memory = memory_reader(row, device)
    t = measure.time_calls(lambda: step(*data), warmup=1, repeats=repeats, memory=memory,
                           memory_covers_warmup=True)
    baseline, peak = memory.baseline, memory.peak_bytes()
    del keep
    itemsize = 2 if dtype == "bfloat16" else 4
    grad_bytes = (n * d + (0 if row in FROZEN_ROWS else d * v)) * itemsize
    mib = measure.MIB
    result.update(
        loss=t.value, first_s=t.first_s, step_s=t.median_s, best_s=t.best_s, times_s=t.wall,
        baseline_mib=baseline / mib, peak_mib=peak / mib,
        peak_over_inputs_mib=(peak - baseline) / mib, grad_mib=grad_bytes / mib,
        extra_mib=(peak - baseline - grad_bytes) / mib, peak_reset=memory.reset,
    )
    return result


def gpu_name(row):
    if row in TORCH_ROWS:
        import torch

        return torch.cuda.get_device_name()
    import jax

    return jax.devices()[0].device_kind


# ----------------------------------------------------------------- parent
def dense_estimate_bytes(row, n, v):
    """Estimated extra memory of a dense row (0 for the fused rows)."""
    return DENSE_COPIES.get(row, 0.0) * n * v * 4


def estimate_seconds(rows, n, d, vocab_sizes, dtypes, repeats, gflops):
    """Rough wall time of a run: every row's flops over `gflops` (bfloat16
    products are assumed to run at the float32 rate)."""
    flops = sum(FLOPS_PER_NDV[r] * n * d * v for r in rows for v in vocab_sizes) * len(dtypes)
    return flops * (repeats + 1) / (gflops * 1e9)


def ratios_of(rows):
    """Ratios of `ours` per `(V, dtype)`; None where a row is missing."""
    by = {(r["v"], r["dtype"], r["row"]): r for r in rows if "step_s" in r}
    out = []
    for v, dtype in dict.fromkeys((r["v"], r["dtype"]) for r in rows):
        ours = by.get((v, dtype, "ours"))
        dense = by.get((v, dtype, "keras_dense"))
        chunked = by.get((v, dtype, "torch_chunked"))

        def over(a, b, key):
            return a[key] / b[key] if a and b and b[key] > 0 else None

        summed = by.get((v, dtype, "ours_summed"))
        frozen = by.get((v, dtype, "ours_frozen"))
        chunked_frozen = by.get((v, dtype, "torch_chunked_frozen"))
        entry = {
            "v": v, "dtype": dtype,
            "time_ours_over_keras_dense": over(ours, dense, "step_s"),
            "time_ours_over_torch_chunked": over(ours, chunked, "step_s"),
            "extra_memory_ours_over_keras_dense": over(ours, dense, "extra_mib"),
        }
        if summed:
            entry.update(
                time_ours_summed_over_keras_dense=over(summed, dense, "step_s"),
                time_ours_summed_over_ours=over(summed, ours, "step_s"),
                time_ours_summed_over_torch_chunked=over(summed, chunked, "step_s"),
                extra_memory_ours_summed_over_keras_dense=over(summed, dense, "extra_mib"),
            )
        if frozen:
            entry.update(
                time_ours_frozen_over_ours=over(frozen, ours, "step_s"),
                time_ours_frozen_over_torch_chunked_frozen=over(frozen, chunked_frozen,
                                                                "step_s"),
            )
        out.append(entry)
    return out


def child_args(row, v, dtype, settings):
    args = [f"--row={row}", f"--vocab_sizes={v}", f"--dtypes={dtype}",
            f"--tokens={settings['n']}", f"--dim={settings['d']}",
            f"--repeats={settings['repeats']}", f"--threads={settings['threads']}",
            f"--backend={settings['backend']}"]
    if settings.get("mode"):
        args.append(f"--mode={settings['mode']}")
    if settings.get("chunk_size"):
        args.append(f"--chunk_size={settings['chunk_size']}")
    if settings.get("device", "cpu") != "cpu":
        args.append(f"--device={settings['device']}")
    return args


def run_child(row, v, dtype, settings):
    """Runs a row in a fresh process; a failure is a row with its `error`."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": str(settings["threads"]),
           "KERAS_BACKEND": settings["backend"]}
    if settings["backend"] == "jax" and settings["threads"] == 1:
        flags = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
        env["XLA_FLAGS"] = flags.strip()
    child = fresh_process.run(__file__, child_args(row, v, dtype, settings), env)
    if child.results:
        return child.results[0]
    return {"row": row, "v": v, "dtype": dtype, "error": child.error}


def print_row(r):
    head = f"{r['row']:14s} V={r['v']:<7d} {r['dtype']:9s}"
    if "step_s" in r:
        print(f"{head} {r['step_s']:9.3f} s  extra {r['extra_mib']:9.1f} MiB  "
              f"(peak over inputs {r['peak_over_inputs_mib']:.1f}, loss {r['loss']:.5f})",
              flush=True)
    else:
        print(f"{head} -- {r.get('skipped') or r.get('error')}", flush=True)


def run(settings):
    """Runs every (V, dtype, row) in a fresh process; returns the JSON dict."""
    n, d = settings["n"], settings["d"]
    rows = []
    for v in settings["vocab_sizes"]:
        for dtype in settings["dtypes"]:
            for row in settings["rows"]:
                budget = measure.memory_budget(settings["memory_budget_gb"])
                need = dense_estimate_bytes(row, n, v)
                if need > budget:
                    r = {"row": row, "v": v, "dtype": dtype, "n": n, "d": d,
                         "skipped": f"estimated {need / 2**30:.1f} GiB > budget "
                                    f"{budget / 2**30:.1f} GiB"}
                elif settings.get("in_process"):
                    try:
                        r = run_row(row, n, d, v, dtype, settings["repeats"],
                                    settings["threads"], settings["mode"],
                                    settings["chunk_size"], settings.get("device", "cpu"))
                    except Exception as error:  # noqa: BLE001 (a row, not a crash)
                        r = {"row": row, "v": v, "dtype": dtype,
                             "error": f"{type(error).__name__}: {error}"[:300]}
                else:
                    r = run_child(row, v, dtype, settings)
                rows.append(r)
                print_row(r)
    ratios = ratios_of(rows)
    for e in ratios:
        print(f"V={e['v']} {e['dtype']}: time ours/keras_dense "
              f"{_fmt(e['time_ours_over_keras_dense'])}, ours/torch_chunked "
              f"{_fmt(e['time_ours_over_torch_chunked'])}; extra memory ours/keras_dense "
              f"{_fmt(e['extra_memory_ours_over_keras_dense'], 4)}")
    return {
        "command": measure.command_line(__file__),
        "machine": measure.machine(),
        "settings": settings,
        "rows": rows,
        "ratios": ratios,
    }


def _fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def settings_from_flags():
    if FLAGS.quick:
        n, d, vocab_sizes, repeats, chunk = 64, 16, [128, 256], 2, FLAGS.chunk_size or 64
    else:
        n, d, repeats, chunk = FLAGS.tokens, FLAGS.dim, FLAGS.repeats, FLAGS.chunk_size
        vocab_sizes = [int(x) for x in FLAGS.vocab_sizes]
    bad = [x for x in FLAGS.rows if x not in ROWS] + [x for x in FLAGS.dtypes if x not in DTYPES]
    if bad:
        raise app.UsageError(f"Unknown rows / dtypes {bad}: rows {ROWS}, dtypes {DTYPES}")
    return {"backend": FLAGS.backend, "mode": FLAGS.mode, "n": n, "d": d,
            "vocab_sizes": vocab_sizes, "dtypes": list(FLAGS.dtypes), "rows": list(FLAGS.rows),
            "chunk_size": chunk, "repeats": repeats, "threads": FLAGS.threads,
            "memory_budget_gb": FLAGS.memory_budget_gb, "in_process": FLAGS.in_process,
            "device": FLAGS.device}


def main(argv):
    del argv
    select_backend.use(FLAGS.backend)
    if FLAGS.row:
        fresh_process.report(run_row(
            FLAGS.row, FLAGS.tokens, FLAGS.dim, int(FLAGS.vocab_sizes[0]), FLAGS.dtypes[0],
            FLAGS.repeats, FLAGS.threads, FLAGS.mode, FLAGS.chunk_size, FLAGS.device))
        return
    settings = settings_from_flags()
    gflops = FLAGS.assumed_gflops or 40.0 * settings["threads"]
    estimate = estimate_seconds(settings["rows"], settings["n"], settings["d"],
                                settings["vocab_sizes"], settings["dtypes"],
                                settings["repeats"], gflops)
    print(f"N={settings['n']} d={settings['d']} V={settings['vocab_sizes']} "
          f"dtypes={settings['dtypes']} threads={settings['threads']} backend="
          f"{settings['backend']}; estimated {estimate / 60:.1f} min of steps at "
          f"{gflops:.0f} GFLOP/s (plus process starts)", flush=True)
    result = run(settings)
    result["estimated_s"] = estimate
    measure.save(result, FLAGS.out)


if __name__ == "__main__":
    app.run(main)
