"""The tail tile's width: balanced against the old `chunk_size`-wide one (JAX).

`chunked.tile_width` used to fall back to `chunk_size` itself when no
divisor of `V` lies in `[chunk_size / 2, chunk_size]` (the last tile then
computes up to a whole tile of masked scores); it now takes
`ceil(V / ceil(V / chunk_size))`, as few tiles with fewer than one masked
column per tile. This script times `linear_cross_entropy`'s loss and
gradients (`jax.jit`, float32, tied `[V, d]` matrix) with both widths in the
same process, interleaved rounds, the old rule patched into
`chunked.tiling.tile_width` while its step is traced.

Usage:
    python benchmarks/bench_tail_tile.py --out=docs/results/bench_tail_tile.json
"""

import argparse
import os
import statistics
import time

import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def old_rule(tile_width):
    """`chunked.tile_width` before the balanced tail, from `tile_width` (the
    library's): the same width where it divides `V` (one tile, or a divisor
    in `[chunk_size / 2, chunk_size]`), else `chunk_size`. (A balanced width
    never divides `V`: it would be such a divisor.)"""
    def old_tile_width(vocab_size, chunk_size):
        width = tile_width(vocab_size, chunk_size)
        return width if vocab_size % width == 0 else chunk_size

    return old_tile_width


def masked_columns(vocab_size, width):
    """The tail tile's masked columns at tile width `width`."""
    return -(-vocab_size // width) * width - vocab_size


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--v", type=int, default=50257, help="GPT-2's vocabulary (29 x 1733)")
    parser.add_argument("--chunk_sizes", default="4096,8192")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    select_backend.use("jax")
    import jax
    import numpy as np

    from keras_softmax_heads.chunked import tiling
    from keras_softmax_heads.losses import linear_cross_entropy

    rng = np.random.default_rng(0)
    h = jax.numpy.asarray(rng.normal(size=(args.n, args.d)).astype("float32"))
    w = jax.numpy.asarray((rng.normal(size=(args.v, args.d)) / np.sqrt(args.d)).astype("float32"))
    t = jax.numpy.asarray(rng.integers(0, args.v, size=args.n).astype("int32"))
    new_tile_width = tiling.tile_width
    old_tile_width = old_rule(new_tile_width)
    rows = []
    for chunk in [int(x) for x in args.chunk_sizes.split(",")]:
        steps, losses = {}, {}
        for name, width_fn in (("old", old_tile_width), ("new", new_tile_width)):
            tiling.tile_width = width_fn
            try:
                step = jax.jit(jax.value_and_grad(lambda h, w, t, c=chunk: linear_cross_entropy(
                    h, w, t, kernel_transposed=True, chunk_size=c), argnums=(0, 1)))
                losses[name] = float(jax.block_until_ready(step(h, w, t))[0])  # traced here
            finally:
                tiling.tile_width = new_tile_width
            steps[name] = step
        times = {"old": [], "new": []}
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                start = time.perf_counter()
                jax.block_until_ready(steps[name](h, w, t))
                times[name].append(time.perf_counter() - start)
        old_width, new_width = old_tile_width(args.v, chunk), new_tile_width(args.v, chunk)
        rows.append({
            "chunk_size": chunk, "old_width": old_width, "new_width": new_width,
            "old_masked_columns": masked_columns(args.v, old_width),
            "new_masked_columns": masked_columns(args.v, new_width),
            "old_s": statistics.median(times["old"]), "new_s": statistics.median(times["new"]),
            "new_over_old": statistics.median(n / o for n, o in zip(times["new"], times["old"])),
            "loss_relative_difference": abs(losses["new"] - losses["old"]) / abs(losses["old"]),
            "wall_s": times})
        print(f"chunk {chunk}: width {rows[-1]['old_width']} -> {rows[-1]['new_width']}, "
              f"time x{rows[-1]['new_over_old']:.3f}", flush=True)
    measure.save({"script": "benchmarks/bench_tail_tile.py", "args": vars(args),
                  "machine": measure.machine(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
