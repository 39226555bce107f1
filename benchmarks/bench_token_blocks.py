"""Token blocks against the one-pass tiled pass: time and memory (JAX).

`linear_cross_entropy(h, W, t, kernel_transposed=True, chunk_size=C,
token_chunk_size=T)`'s mean loss and its gradients with respect to `h`
`[N, d]` and the tied `W` `[V, d]` under `jax.jit`, float32, for each
configuration `C:T` of `--configs` (`T = 0`: no token blocks, the one-pass
backward with its float32 `[N, d]` accumulator and `[N, C]` tiles; else the
two-pass backward over `[T, C]` tiles, five `N d V` products instead of
four). Per configuration: XLA's compiled memory (`temp`: the temporaries;
`output`: the gradients) and the median of `--rounds` interleaved timed
calls (one call of every configuration per round, the order rotated).
`--compile_only` records the memory only (a shape too large to run here,
such as the Gemma 2 2B one). Ratios are to the first configuration.

Usage:
    python benchmarks/bench_token_blocks.py --out=docs/results/bench_token_blocks.json
"""

import argparse
import os
import statistics
import time

import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MIB = measure.MIB


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--v", type=int, default=32768)
    parser.add_argument("--configs", default="4096:0,2048:2048,4096:4096,1024:1024",
                        help="chunk_size:token_chunk_size, comma separated (0: no blocks)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile_only", action="store_true")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def parse_configs(text):
    """`[(chunk_size, token_chunk_size or None), ...]`."""
    configs = []
    for item in text.split(","):
        chunk, tokens = (int(x) for x in item.split(":"))
        configs.append((chunk, tokens or None))
    return configs


def compile_step(n, d, v, chunk_size, token_chunk_size=None, dtype="float32",
                 implementation="auto"):
    """The compiled (not run) `jax.jit` step: `linear_cross_entropy`'s mean
    loss of `h` `[n, d]`, the tied `W` `[v, d]` and `n` targets, and its
    gradients with respect to `h` and `W`."""
    import jax

    from keras_softmax_heads.losses import linear_cross_entropy

    def loss(h, w, t):
        return linear_cross_entropy(h, w, t, kernel_transposed=True, chunk_size=chunk_size,
                                    token_chunk_size=token_chunk_size,
                                    implementation=implementation)

    shapes = [jax.ShapeDtypeStruct(s, k) for s, k in
              (((n, d), dtype), ((v, d), dtype), ((n,), "int32"))]
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*shapes).lower().compile()


def main(argv=None):
    args = parse_args(argv)
    select_backend.use("jax")
    import jax
    import numpy as np

    configs = parse_configs(args.configs)
    compiled, rows = {}, []
    for chunk, tokens in configs:
        compiled[(chunk, tokens)] = compile_step(args.n, args.d, args.v, chunk, tokens)
        memory = measure.memory_of_compiled(compiled[(chunk, tokens)])
        rows.append({"chunk_size": chunk, "token_chunk_size": tokens, "memory": memory,
                     "temp_mib": memory["temp"] / MIB, "output_mib": memory["output"] / MIB})
        print(f"chunk {chunk:6d} tokens {tokens or '-':>6}: temp {rows[-1]['temp_mib']:8.1f} MiB",
              flush=True)
    if not args.compile_only:
        rng = np.random.default_rng(0)
        h = jax.numpy.asarray(rng.normal(size=(args.n, args.d)).astype("float32"))
        w = jax.numpy.asarray(
            (rng.normal(size=(args.v, args.d)) / np.sqrt(args.d)).astype("float32"))
        t = jax.numpy.asarray(rng.integers(0, args.v, size=args.n).astype("int32"))
        times = {key: [] for key in compiled}
        grads = {}
        for key, fn in compiled.items():  # warm-up, and the results compared
            loss, g = jax.block_until_ready(fn(h, w, t))
            grads[key] = (float(loss), g)
        keys = list(compiled)
        for r in range(args.rounds):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                start = time.perf_counter()
                jax.block_until_ready(compiled[key](h, w, t))
                times[key].append(time.perf_counter() - start)
        ref_loss, ref_grads = grads[keys[0]]
        for row, key in zip(rows, keys):
            loss, g = grads[key]
            row.update(step_s=statistics.median(times[key]), wall_s=times[key], loss=loss,
                       grad_rel_err=[float(np.linalg.norm(np.asarray(a) - np.asarray(b))
                                           / np.linalg.norm(np.asarray(b)))
                                     for a, b in zip(g, ref_grads)])
            row["time_ratio"] = row["step_s"] / rows[0]["step_s"]
            print(f"chunk {key[0]:6d} tokens {key[1] or '-':>6}: {row['step_s'] * 1e3:9.1f} ms "
                  f"({row['time_ratio']:.2f}x), loss {loss - ref_loss:+.1e}", flush=True)
    for row in rows:
        row["temp_ratio"] = row["temp_mib"] / rows[0]["temp_mib"]
    measure.save({"script": "benchmarks/bench_token_blocks.py", "args": vars(args),
                  "gradients_mib": (args.n + args.v) * args.d * 4 / MIB,
                  "machine": measure.machine(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
