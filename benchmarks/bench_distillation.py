r"""Tiled distillation divergence against the dense KL (issue 30).

One step is the forward and backward pass of the mean forward KL
`KL(softmax(h_t W_t) || softmax(h_s W_s))` per token (`h_s` `[N, d]`,
`W_s` `[d, V]`: the student; `h_t`, `W_t`: the teacher), with respect to
the student's `h_s` AND `W_s` (the teacher is frozen). Rows, each backend in
a fresh process (`--backends`):

* on a Keras backend (`jax`: `jax.jit`; `tensorflow`: `tf.function(
  jit_compile=True)`, XLA; `torch`: eager), two steps, warmed up, then
  timed in `--rounds` interleaved rounds (`measure.interleaved`):
  `tiled`: `keras_softmax_heads.fused.linear_divergence(h_s, W_s, h_t,
  W_t)` (the mean: by default chunks of tokens with the gradient in the
  forward pass, `--token_chunk_size`; `--chunk_size` is the vocabulary
  tile of the per-token form), and `dense`: both `[N, V]` logits,
  `keras.ops.log_softmax`, `sum(p (log p - log q))`, the teacher's side
  under `stop_gradient`;
* `torch_dense` (in the `torch` process, pure PyTorch, eager):
  `F.kl_div(log_softmax(h_s @ W_s), log_softmax(h_t @ W_t),
  log_target=True, reduction="batchmean")`, the teacher's logits under
  `torch.no_grad()`, gradients by `loss.backward()` (with
  `--torch_keras`, timed in the same rounds as the Keras steps on the
  PyTorch backend, eager; by default alone).

Every step sees the same float32 values (`h ~ N(0, 1)`, `W ~ N(0, 1/d)`,
NumPy, seeded); each row records its divergence as a check.

Memory: on JAX, XLA's compiled memory analysis (`measure.compiled_memory`,
`temp` bytes: the scratch memory beyond inputs and outputs); for every
step, in a fresh process of its own, the process' peak resident size of one
call after one warm-up call (`measure.RssPeak`; on TensorFlow over both
calls, as its CPU allocator keeps the blocks of the first call, compilation
included, and also TensorFlow's allocator peak over the second call,
`allocator_peak_mib`, the step's own buffers: the gradients and the
temporaries), `peak_over_inputs_mib`, and
`extra_mib = peak_over_inputs_mib - grad_mib` (`grad_mib`: the two
gradients, `N d + d V` floats). Ratios per backend: the medians over the
rounds of `tiled / dense` time, and the extra memory ratios (on JAX also
the `temp` bytes'); `time_tiled_over_torch_dense_process`: the backend's
median tiled step over the PyTorch process' median dense step (two
processes, run one after the other). `os.getloadavg()` is recorded before and after.

Usage:
    python benchmarks/bench_distillation.py \
        --out=docs/results/distillation/bench_distillation.json   # the full shape
    python benchmarks/bench_distillation.py --tokens=64 --dim=16 --vocab=500 \
        --chunk_size=128 --rounds=2 --out=/tmp/distill.json       # tiny
"""

import argparse
import json
import os
import statistics
import sys

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import measure  # benchmarks/measure.py

BACKENDS = ("jax", "tensorflow", "torch")
MIB = 2**20


def make_inputs(n, d, v, seed=0):
    """`[h_s, W_s, h_t, W_t]`, float32 NumPy: `h ~ N(0, 1)`, `W ~ N(0, 1/d)`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        out.append(rng.standard_normal((n, d), dtype="float32"))
        w = rng.standard_normal((d, v), dtype="float32")
        w *= 1.0 / np.sqrt(d)
        out.append(w)
    return out


def keras_steps(chunk_size, token_chunk_size=None):
    """`{"tiled": loss_fn, "dense": loss_fn}`: `loss_fn(h_s, w_s, h_t, w_t)`
    -> the mean forward KL, in `keras.ops`."""
    from keras import ops

    from keras_softmax_heads.fused import linear_divergence

    def tiled(h_s, w_s, h_t, w_t):
        return linear_divergence(h_s, w_s, h_t, w_t, chunk_size=chunk_size,
                                 token_chunk_size=token_chunk_size)

    def dense(h_s, w_s, h_t, w_t):
        log_q = ops.log_softmax(ops.matmul(h_s, w_s), axis=-1)
        log_p = ops.stop_gradient(ops.log_softmax(ops.matmul(h_t, w_t), axis=-1))
        return ops.mean(ops.sum(ops.exp(log_p) * (log_p - log_q), axis=-1))

    return {"tiled": tiled, "dense": dense}


def compiled_grad_step(loss_fn, arrays):
    """`(call, jax_fn)`: a no-argument call of the compiled forward +
    backward step (the loss and the gradients of `h_s`, `W_s`) on the
    backend's tensors, and the `jax.jit` function on JAX (else None)."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
        args = [jax.numpy.asarray(a) for a in arrays]
        return (lambda: jax.block_until_ready(fn(*args))), (fn, args)
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def step(h_s, w_s, h_t, w_t):
            with tf.GradientTape() as tape:
                tape.watch([h_s, w_s])
                loss = loss_fn(h_s, w_s, h_t, w_t)
            return loss, tape.gradient(loss, [h_s, w_s])

        args = [tf.convert_to_tensor(a) for a in arrays]
        return (lambda: [t.numpy() for t in tf.nest.flatten(step(*args))][0]), None
    import torch

    args = [torch.from_numpy(a) for a in arrays]

    def torch_step():
        h_s, w_s = (a.detach().requires_grad_(True) for a in args[:2])
        loss = loss_fn(h_s, w_s, args[2], args[3])
        loss.backward()
        return float(loss.detach())

    return torch_step, None


def torch_dense_step(arrays):
    """PyTorch's dense forward KL (eager), forward and backward."""
    import torch
    import torch.nn.functional as F

    h_s, w_s, h_t, w_t = (torch.from_numpy(a) for a in arrays)
    w_s.requires_grad_(True)

    def step():
        h = h_s.detach().requires_grad_(True)
        w_s.grad = None
        with torch.no_grad():
            log_p = F.log_softmax(h_t @ w_t, dim=-1)
        log_q = F.log_softmax(h @ w_s, dim=-1)
        loss = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
        loss.backward()
        return float(loss.detach())

    return step


def value_of(result):
    """The loss of a step's result (a float, or the first of a tuple)."""
    import numpy as np

    while isinstance(result, (tuple, list)):
        result = result[0]
    return float(np.asarray(result))


def steps_of(backend, arrays, chunk_size, keras_rows=True, torch_dense=True,
             token_chunk_size=None):
    """`({name: call}, {name: jax (fn, args)})` of the backend's steps."""
    calls, jitted = {}, {}
    steps = keras_steps(chunk_size, token_chunk_size) if keras_rows else {}
    for name, loss_fn in steps.items():
        calls[name], jitted[name] = compiled_grad_step(loss_fn, arrays)
    if backend == "torch" and torch_dense:
        calls["torch_dense"] = torch_dense_step(arrays)
    return calls, jitted


def measure_memory(backend, step, n, d, v, chunk_size, token_chunk_size=None):
    """`{step}_peak_over_inputs_mib` and `{step}_extra_mib` of one call of
    `step` after its warm-up (on TensorFlow: of both calls), alone in its
    process (`measure.RssPeak`)."""
    arrays = make_inputs(n, d, v)
    calls, _ = steps_of(backend, arrays, chunk_size, step != "torch_dense",
                        step == "torch_dense", token_chunk_size)
    call = calls[step]
    reader = measure.RssPeak()
    allocator = None
    if backend == "tensorflow":  # its allocator keeps the first call's blocks
        reader.start()
    call()
    if backend != "tensorflow":
        reader.start()
    elif step != "torch_dense":  # the allocator's peak over the second call
        allocator = measure.TensorFlowAllocatorPeak()
        allocator.start()
    call()
    peak = reader.peak_mib()
    row = {f"{step}_peak_over_inputs_mib": peak,
           f"{step}_extra_mib": peak - (n * d + d * v) * 4 / MIB,
           "peak_reset": reader.reset}
    if allocator is not None and allocator.peak_mib() is not None:
        row[f"{step}_allocator_peak_mib"] = allocator.peak_mib()
    return row


def measure_backend(backend, n, d, v, chunk_size, rounds, keras_rows=True, torch_dense=True,
                    token_chunk_size=None):
    """The timing row of one backend (the current Keras backend:
    `backend`), in this process: one warm-up call each, then `rounds`
    interleaved timed rounds (the Keras steps unless not `keras_rows`; on
    PyTorch `torch_dense` too); on JAX XLA's compiled memory analysis."""
    import keras

    assert keras.backend.backend() == backend, (keras.backend.backend(), backend)
    arrays = make_inputs(n, d, v)
    row = {"backend": backend, "n": n, "d": d, "v": v, "chunk_size": chunk_size,
           "dtype": "float32", "grad_mib": (n * d + d * v) * 4 / MIB,
           "mode": {"jax": "jax.jit", "tensorflow": "xla", "torch": "eager"}[backend]}
    calls, jitted = steps_of(backend, arrays, chunk_size, keras_rows, torch_dense,
                             token_chunk_size)
    for name, call in calls.items():
        if jitted.get(name) is not None:
            fn, args = jitted[name]
            row[f"{name}_compiled_memory"] = measure.compiled_memory(fn, *args)
        value, wall, _ = measure.clock(call)
        row[f"{name}_first_s"] = wall
        row[f"{name}_value"] = value_of(value)
    wall, cpu = measure.interleaved(calls, rounds)
    row["times_s"] = wall
    row["cpu_s"] = cpu
    for name in calls:
        row[f"{name}_step_s"] = statistics.median(wall[name])
    row["ratios"] = ratios = {}
    if keras_rows:
        ratios["time_tiled_over_dense"] = statistics.median(
            a / b for a, b in zip(wall["tiled"], wall["dense"]))
    if backend == "jax":
        ratios["temp_memory_tiled_over_dense"] = (
            row["tiled_compiled_memory"]["temp"] / row["dense_compiled_memory"]["temp"])
    return row


def set_threads(threads):
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="N")
    parser.add_argument("--dim", type=int, default=1024, help="d of both sides")
    parser.add_argument("--vocab", type=int, default=131072, help="V")
    parser.add_argument("--chunk_size", type=int, default=4096)
    parser.add_argument("--token_chunk_size", type=int, default=None,
                        help="tokens a chunk of the summed divergence (default: its own)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--torch_keras", action="store_true",
                        help="also the Keras steps on the PyTorch backend (eager)")
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory_step", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run_child(args):
    """In a child process (`--child=<backend>`, `KERAS_BACKEND` set)."""
    set_threads(args.threads)
    keras_rows = args.child != "torch" or args.torch_keras
    if args.memory_step:
        fresh_process.report(measure_memory(args.child, args.memory_step, args.tokens,
                                            args.dim, args.vocab, args.chunk_size,
                                            args.token_chunk_size))
        return
    fresh_process.report(measure_backend(args.child, args.tokens, args.dim, args.vocab,
                                         args.chunk_size, args.rounds, keras_rows,
                                         token_chunk_size=args.token_chunk_size))


def run(args, argv):
    result = {
        "command": measure.command_line(__file__, argv),
        "machine": measure.machine(), "loadavg_before": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
        "rows": [],
    }
    for backend in args.backends.split(","):
        child_argv = [a for a in argv if not a.startswith("--out")] + [f"--child={backend}"]
        env = {"KERAS_BACKEND": backend, "OMP_NUM_THREADS": str(args.threads)}
        row = fresh_process.run(__file__, child_argv, env).result()
        row.setdefault("backend", backend)
        keras_rows = backend != "torch" or args.torch_keras
        steps = (["tiled", "dense"] if keras_rows else []) + (
            ["torch_dense"] if backend == "torch" else [])
        for step in steps:  # each alone in a fresh process
            memory = fresh_process.run(
                __file__, child_argv + [f"--memory_step={step}"], env).result()
            row.update({k if k != "error" else f"{step}_memory_error": x
                        for k, x in memory.items()})
        if keras_rows and "dense_extra_mib" in row and "tiled_extra_mib" in row:
            row.setdefault("ratios", {})["extra_memory_tiled_over_dense"] = (
                row["tiled_extra_mib"] / row["dense_extra_mib"])
        if "dense_allocator_peak_mib" in row and "tiled_allocator_peak_mib" in row:
            row.setdefault("ratios", {})["allocator_memory_tiled_over_dense"] = (
                row["tiled_allocator_peak_mib"] / row["dense_allocator_peak_mib"])
        result["rows"].append(row)
        print(json.dumps({k: row.get(k) for k in ("backend", "tiled_step_s", "dense_step_s",
                                                   "torch_dense_step_s", "ratios", "error")}))
    result["loadavg_after"] = os.getloadavg()
    torch_s = [r["torch_dense_step_s"] for r in result["rows"] if "torch_dense_step_s" in r]
    for row in result["rows"]:  # across processes: medians, not one round
        if torch_s and "tiled_step_s" in row:
            row.setdefault("ratios", {})["time_tiled_over_torch_dense_process"] = (
                row["tiled_step_s"] / torch_s[0])
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return None
    result = run(args, argv)
    measure.save(result, args.out)
    return result


if __name__ == "__main__":
    main()
