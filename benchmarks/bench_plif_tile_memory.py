"""XLA's compiled temporary memory of PLIF's loss and gradients per tile size (JAX).

`functional.plif_log_likelihood`'s summed loss and its gradients with
respect to the scores `z` `[N, V]` and the raw slopes `[K]`, under
`jax.jit`, compiled (not run) on this machine with the path of a forced
platform (`platforms.forced_platform`: a TPU's sorted histogram, a GPU's
Pallas paths, interpreted since this is not a GPU) and
`dispatch.ACCELERATOR_TILE_ELEMENTS` set to each `--tiles` value; each row
is `compiled.memory_analysis()`'s temporary bytes. The GPU compiler fuses
differently, so the GPU rows are indicative; the tile's effect is what they
show. Chooses `dispatch.ACCELERATOR_TILE_ELEMENTS` (`docs/plif.md`).

Usage:
    python benchmarks/bench_plif_tile_memory.py \\
        --out=docs/results/plif_histogram/tile_memory_cpu.json
"""

import argparse
import os

import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

#: (platform, histogram method) rows: a TPU's path and a GPU's two.
PATHS = (("tpu", None), ("gpu", "pallas"), ("gpu", "pallas_fused"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--v", type=int, default=33278)
    parser.add_argument("--knots", type=int, default=100_000)
    parser.add_argument("--tiles", default="19,22,24,26,28", help="log2 of the tile sizes")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def temp_bytes(n, v, knots, platform, method, tile):
    """The compiled temporary bytes of the loss and gradients."""
    import jax

    from keras_softmax_heads import functional
    from keras_softmax_heads.functional import dispatch
    from keras_softmax_heads.platforms import forced_platform

    def loss(z, raw, t):
        return functional.plif_log_likelihood(z, raw, 20.0, t).sum()

    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in
              (((n, v), "float32"), ((knots,), "float32"), ((n,), "int32"))]
    saved = dict(dispatch.ACCELERATOR_TILE_ELEMENTS)
    dispatch.ACCELERATOR_TILE_ELEMENTS[platform] = tile
    try:
        with forced_platform(platform), dispatch.forced_histogram_method(method):
            # A new function: traced afresh.
            step = jax.jit(jax.grad(lambda z, raw, t: loss(z, raw, t), argnums=(0, 1)))
            return measure.memory_of_compiled(step.trace(*shapes).lower().compile())
    finally:
        dispatch.ACCELERATOR_TILE_ELEMENTS.update(saved)


def main(argv=None):
    args = parse_args(argv)
    select_backend.use("jax")
    rows = []
    for platform, method in PATHS:
        for log2 in [int(x) for x in args.tiles.split(",")]:
            memory = temp_bytes(args.n, args.v, args.knots, platform, method, 2**log2)
            rows.append({"platform": platform, "method": method, "tile_elements": 2**log2,
                         "memory": memory, "temp_gib": memory["temp"] / 2**30})
            print(f"{platform} {method or 'sorted':13s} tile 2^{log2}: "
                  f"temp {rows[-1]['temp_gib']:.2f} GiB", flush=True)
    measure.save({"script": "benchmarks/bench_plif_tile_memory.py", "args": vars(args),
                  "machine": measure.machine(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
