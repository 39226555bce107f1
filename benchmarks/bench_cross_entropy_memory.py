"""XLA's compiled memory of the fused loss's tiled pass per tile width (JAX).

`linear_cross_entropy(h, W, t, kernel_transposed=True, ignore_index=-100,
implementation="ops", chunk_size=C)`'s mean loss and its gradients with
respect to `h` `[N, d]` and the tied `W` `[V, d]` (the step of
`bench_gpu_cross_entropy.py`'s `ours_tiled` row), under `jax.jit`, compiled
(not run) on this machine for each `--chunk_sizes` value; each row is
`compiled.memory_analysis()` (the temporaries, and the output: the
gradients). Issue 29 asks for at most the gradients + 64 MB: what the tiled
pass holds besides its `[N, C]` tiles shows here (the float32 `dh`
accumulator of `N x d`). Float32 by default: XLA's CPU compiler computes a
bfloat16 step in float32 (a float32 copy of `W` in its temporaries), so only
float32 rows stand for a GPU; the GPU compiler fuses differently, so the
rows are indicative.

Usage:
    python benchmarks/bench_cross_entropy_memory.py \\
        --out=docs/results/gpu_cross_entropy/tiled_memory_cpu.json
"""

import argparse
import os

import bench_token_blocks  # benchmarks/bench_token_blocks.py
import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MIB = measure.MIB


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--d", type=int, default=2304)
    parser.add_argument("--v", type=int, default=256_000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunk_sizes", default="4096,2048,1024,512")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def memory(n, d, v, dtype, chunk_size):
    """`measure.memory_of_compiled` of the tiled step at one tile width."""
    return measure.memory_of_compiled(bench_token_blocks.compile_step(
        n, d, v, chunk_size, dtype=dtype, implementation="ops"))


def main(argv=None):
    args = parse_args(argv)
    select_backend.use("jax")
    import numpy as np

    itemsize = np.dtype(args.dtype).itemsize
    accumulator_mib = args.n * args.d * 4 / MIB
    rows = []
    for chunk in [int(x) for x in args.chunk_sizes.split(",")]:
        m = memory(args.n, args.d, args.v, args.dtype, chunk)
        rows.append({"chunk_size": chunk, "memory": m, "temp_mib": m["temp"] / MIB,
                     "output_mib": m["output"] / MIB,
                     "tile_mib": args.n * chunk * 4 / MIB})
        print(f"chunk {chunk:6d}: temp {rows[-1]['temp_mib']:8.1f} MiB "
              f"(one float32 [N, chunk] tile {rows[-1]['tile_mib']:.1f} MiB, the float32 dh "
              f"accumulator {accumulator_mib:.1f} MiB)", flush=True)
    measure.save({"script": "benchmarks/bench_cross_entropy_memory.py", "args": vars(args),
                  "gradients_mib": (args.n + args.v) * args.d * itemsize / MIB,
                  "dh_float32_accumulator_mib": accumulator_mib,
                  "machine": measure.machine(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
