r"""Per-token log-probabilities + entropy, forward and backward: the tiled
`linear_token_scores` against the dense computation (logits, log_softmax,
gather, entropy), on JAX (`jax.jit`) and TensorFlow under XLA
(`tf.function(jit_compile=True)`).

The step, on both rows: `loss = sum_i(u_i logp_i + v_i H_i)` (random
per-token weights `u`, `v`) and its gradients with respect to the hidden
states `[N, d]` and the kernel `[d, V]`, float32. Each backend runs in its
own fresh process (`fresh_process`; `--in_process` runs the current
backend in this one, for smoke tests): one warm-up (compilation) call of
each row, then `--rounds` rounds of both rows in turns (`measure.interleaved`),
so that the time ratio `time_fused_over_dense` (the median of the per-round
ratios) comes from one run. Memory: on JAX XLA's own estimate of the
compiled step's scratch memory (`measure.compiled_memory`, `temp` bytes:
what the step needs beyond its inputs and outputs); on TensorFlow the
process' peak resident size over one call after the warm-up
(`measure.RssPeak`, minus the resident size before it).
`extra_memory_fused_over_dense` divides the two rows' numbers. The
machine's load average is recorded (`os.getloadavg()`) before and after.

The issue's shape (N = 4096, d = 1024, V = 131072; two threads):

    python benchmarks/bench_token_scores.py

A smoke run:

    python benchmarks/bench_token_scores.py --tokens=32 --dim=8 --vocab=96 \
        --chunk_size=40 --rounds=1 --in_process --out=/tmp/ts.json
"""

import os
import sys

from absl import app
from absl import flags

FLAGS = flags.FLAGS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fresh_process  # noqa: E402
import measure  # noqa: E402
import select_backend  # noqa: E402


def define_flags():
    """The script's flags (defined when it runs, not on import)."""
    flags.DEFINE_integer("tokens", 4096, "Tokens N.")
    flags.DEFINE_integer("dim", 1024, "Hidden size d.")
    flags.DEFINE_integer("vocab", 131072, "Vocabulary size V.")
    flags.DEFINE_integer("chunk_size", 4096, "Vocabulary tile width of the fused row.")
    flags.DEFINE_integer("rounds", 3, "Interleaved timed rounds.")
    flags.DEFINE_integer("threads", 2, "Intra-op threads (TensorFlow; OMP).")
    flags.DEFINE_list("backends", ["jax", "tensorflow"], "Backends, one process each.")
    flags.DEFINE_string("backend", None, "The backend of this process (children).")
    flags.DEFINE_bool("row", False, "Child: measure this process' backend and report it.")
    flags.DEFINE_bool("in_process", False, "Measure the current backend here.")
    flags.DEFINE_string("out", "docs/results/token_scores/bench_token_scores.json",
                        "JSON output.")


def inputs(n, d, v, seed=0):
    """Float32 NumPy `(h [n, d], kernel [d, v], tokens [n], u [n], w [n])`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n, d), dtype="float32")
    kernel = (rng.standard_normal((d, v), dtype="float32") / np.sqrt(d)).astype("float32")
    tokens = rng.integers(0, v, n).astype("int32")
    return (h, kernel, tokens, rng.standard_normal(n, dtype="float32"),
            rng.standard_normal(n, dtype="float32"))


def losses(chunk_size):
    """`{"fused": loss, "dense": loss}`, each `(h, kernel, tokens, u, w) ->
    sum(u logp + w H)` in `keras.ops`."""
    from keras import ops

    from keras_softmax_heads.fused import linear_token_scores

    def fused(h, kernel, tokens, u, w):
        lp, ent = linear_token_scores(h, kernel, tokens, return_entropy=True,
                                      chunk_size=chunk_size)
        return ops.sum(u * lp + w * ent)

    def dense(h, kernel, tokens, u, w):
        log_p = ops.log_softmax(ops.matmul(h, kernel), axis=-1)
        lp = ops.take_along_axis(log_p, tokens[:, None], axis=-1)[:, 0]
        ent = -ops.sum(ops.exp(log_p) * log_p, axis=-1)
        return ops.sum(u * lp + w * ent)

    return {"fused": fused, "dense": dense}


def compiled_steps(chunk_size, args):
    """`{row: call}` of the compiled value-and-gradient steps (`h`, kernel)
    of the current backend, and `{row: compiled memory}` on JAX."""
    import keras

    backend = keras.backend.backend()
    steps, memory = {}, {}
    for name, loss in losses(chunk_size).items():
        if backend == "jax":
            import jax

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            memory[name] = measure.compiled_memory(step, *args)

            def call(step=step):
                out = step(*args)
                jax.block_until_ready(out)
                return out
        elif backend == "tensorflow":
            import tensorflow as tf

            @tf.function(jit_compile=True)
            def step(h, kernel, tokens, u, w, loss=loss):
                with tf.GradientTape() as tape:
                    tape.watch([h, kernel])
                    value = loss(h, kernel, tokens, u, w)
                return value, tape.gradient(value, [h, kernel])

            tensors = [tf.constant(a) for a in args]

            def call(step=step, tensors=tensors):
                out = step(*tensors)
                return float(out[0].numpy()), out
        else:
            raise ValueError(f"bench_token_scores runs on jax or tensorflow. Received: {backend}")
        steps[name] = call
    return steps, memory


def measure_backend(n, d, v, chunk_size, rounds, threads):
    """One backend's rows: times, memory, ratios (a dict)."""
    import statistics

    import keras
    import numpy as np

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:  # TensorFlow already initialised (in-process runs)
            pass
        threads = tf.config.threading.get_intra_op_parallelism_threads()
    args = inputs(n, d, v)
    steps, memory = compiled_steps(chunk_size, args)
    result = {"backend": backend, "n": n, "d": d, "v": v, "chunk_size": chunk_size,
              "threads": threads, "rows": {}}
    values = {}
    for name, call in steps.items():
        value, first_s, _ = measure.clock(call)
        reader = measure.RssPeak()
        reader.start()
        measure.clock(call)
        values[name] = float(np.asarray(value[0]))
        result["rows"][name] = {"first_call_s": first_s, "rss_extra_mib": reader.peak_mib(),
                                "loss": values[name]}
        if name in memory:
            result["rows"][name]["compiled_memory"] = memory[name]
            result["rows"][name]["temp_mib"] = memory[name]["temp"] / measure.MIB
    wall, cpu = measure.interleaved(steps, rounds)
    for name in steps:
        result["rows"][name].update(step_s=statistics.median(wall[name]), wall_s=wall[name],
                                    cpu_s=cpu[name])
    ratios = [f / s for f, s in zip(wall["fused"], wall["dense"])]
    key = "temp_mib" if backend == "jax" else "rss_extra_mib"
    fused_mem, dense_mem = (result["rows"][r].get(key) for r in ("fused", "dense"))
    result["ratios"] = {
        "time_fused_over_dense": statistics.median(ratios),
        "time_fused_over_dense_rounds": ratios,
        "memory_measure": key,
        "extra_memory_fused_over_dense": (fused_mem / dense_mem
                                          if fused_mem and dense_mem else None),
    }
    result["loss_relative_difference"] = abs(values["fused"] - values["dense"]) / max(
        abs(values["dense"]), 1e-30)
    return result


def settings():
    return (FLAGS.tokens, FLAGS.dim, FLAGS.vocab, FLAGS.chunk_size, FLAGS.rounds,
            FLAGS.threads)


def run_all():
    """Every backend in a fresh process (or this one, `--in_process`)."""
    result = {"benchmark": "bench_token_scores", "command": measure.command_line(__file__),
              "machine": measure.machine(), "loadavg_before": list(os.getloadavg()),
              "backends": {}}
    if FLAGS.in_process:
        r = measure_backend(*settings())
        result["backends"][r["backend"]] = r
    else:
        for backend in FLAGS.backends:
            child_args = [f"--backend={backend}", "--row", f"--tokens={FLAGS.tokens}",
                          f"--dim={FLAGS.dim}", f"--vocab={FLAGS.vocab}",
                          f"--chunk_size={FLAGS.chunk_size}", f"--rounds={FLAGS.rounds}",
                          f"--threads={FLAGS.threads}"]
            child = fresh_process.run(__file__, child_args, {
                "KERAS_BACKEND": backend, "OMP_NUM_THREADS": str(FLAGS.threads)})
            result["backends"][backend] = child.result()
            print(backend, result["backends"][backend].get("ratios",
                                                           result["backends"][backend]))
    result["loadavg_after"] = list(os.getloadavg())
    return result


def main(argv):
    del argv
    select_backend.use(FLAGS.backend or select_backend.default_backend())
    if FLAGS.row:
        fresh_process.report(measure_backend(*settings()))
        return
    result = run_all()
    for backend, r in result["backends"].items():
        print(backend, r.get("ratios", r))
    measure.save(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    app.run(main)
