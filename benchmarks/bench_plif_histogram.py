"""PLIF's slope gradient on each path of `functional.knot_histogram` (JAX).

Two rows per number of knots `K` and path (`--methods`: `scatter`, today's
`segment_sum`; `sorted`, the scatter-free sort + segmented scan; `pallas`,
the privatised Pallas kernel, interpreted off the GPU; `spread`, the
scatter into interleaved copies, `spread:64` with 64 copies):

* `histogram`: the two histograms of the slopes' gradient, `A = hist(g)`
  and `B = hist(g * offset)`, of all `N * V` scores, in tiles of the
  platform's `functional.dispatch.tile_elements` scores (a `scan_tiles`
  loop, as in the PLIF kernels);
* `loss_grad`: `functional.plif_log_likelihood`'s summed loss and its
  gradients w.r.t. the scores and the raw slopes (the head's step without
  its matrix products), the path forced through
  `functional.dispatch.HISTOGRAM_METHOD`.

Scores `z ~ N(0, --score-scale^2)` (most of them in a few hot intervals at
`K = 1000`), upstream weights `g ~ N(0, 1)`, `jax.jit`, float32, on JAX's
default device (the GPU when there is one). The calls of one `K` are
interleaved (`measure.interleaved`): each ratio to `scatter` is from the
same rounds. Raw JSON: `docs/results/plif_histogram/<platform>_jax.json`.

Usage:
    python benchmarks/bench_plif_histogram.py --quick --out /tmp/h.json  # smoke run
    python benchmarks/bench_plif_histogram.py       # N=2048, V=33278, K in {1e5, 1e3}, CPU paths
    python benchmarks/bench_plif_histogram.py --n 8192 --methods scatter,sorted,pallas
        # on a GPU (the last run of benchmarks/device_heads.sh; see docs/plif.md)
"""

import argparse
import contextlib
import os
import statistics

import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO, "docs", "results", "plif_histogram")
KNOT_BOUND = 20.0  # PLIFSoftmax's default


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048, help="score rows N")
    parser.add_argument("--v", type=int, default=33278, help="vocabulary V")
    parser.add_argument("--knots", default="100000,1000", help="comma-separated K")
    parser.add_argument("--methods", default=None,
                        help="comma-separated paths (default: scatter,sorted; with pallas on a "
                        "GPU); 'pallas:32' sets the Pallas kernels' vector width (LANES)")
    parser.add_argument("--rows", default="histogram,loss_grad", help="which rows")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 2)")
    parser.add_argument("--score-scale", type=float, default=3.0)
    parser.add_argument("--tile-elements", type=int, default=None,
                        help="scores per tile on every platform (default: the library's, "
                        "functional.dispatch.tile_elements)")
    parser.add_argument("--quick", action="store_true", help="N=64, V=500, K in {1000, 100}")
    parser.add_argument("--out", default=None, help="JSON path (default: by platform)")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.v, args.knots = 64, 500, "1000,100"
    if args.rounds is None:
        args.rounds = 2 if args.quick else 3
    return args


def parse_method(label):
    """`"pallas:32"` -> `("pallas", 32)`: a path, and its option: for the
    Pallas paths the kernels' vector width (`plif_pallas.LANES`), for
    `"spread"` the number of copies (`dispatch.spread_copies`); None: the
    library's."""
    method, _, option = label.partition(":")
    return method, int(option) if option else None


@contextlib.contextmanager
def option_scope(method, option):
    """The option of `method` (`parse_method`) set while tracing (None:
    unchanged): `plif_pallas.LANES = option` for the Pallas paths, `option`
    copies for `"spread"`."""
    from keras_softmax_heads.functional import dispatch
    from keras_softmax_heads.functional import plif_pallas

    if method == "spread":
        module, names = dispatch, ("SPREAD_MAX_COPIES", "SPREAD_BUFFER_ELEMENTS")
        values = (option, 2**31 - 1)
    else:
        module, names, values = plif_pallas, ("LANES",), (option,)
    saved = [getattr(module, name) for name in names]
    if option:
        for name, value in zip(names, values):
            setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(module, name, value)


def histogram_call(label, num_knots, z, g, tile_elements):
    """A compiled `() -> (A, B)`: the two slope histograms of `z` (flat)
    with weights `g` and `g * offset`, tile by tile, by the path `label`
    (`parse_method`)."""
    import jax
    from keras import ops

    from keras_softmax_heads import functional

    width = 2.0 * KNOT_BOUND / num_knots
    size = z.size
    tile = min(size, tile_elements)
    tiles = size // tile
    z_tiles = z[: tiles * tile].reshape(tiles, tile)
    g_tiles = g[: tiles * tile].reshape(tiles, tile)

    def one_tile(sums, xs):
        z, g = xs
        idx = ops.clip(ops.cast(ops.floor((z + KNOT_BOUND) / width), "int32"), 0, num_knots - 1)
        offset = z - (-KNOT_BOUND + width * ops.cast(idx, "float32"))
        a, b = functional.knot_histogram(idx, (g, g * offset), num_knots, method=method)
        return (sums[0] + a, sums[1] + b), ()

    method, option = parse_method(label)

    def run(z_tiles, g_tiles):
        zeros = ops.zeros([num_knots], "float32")
        sums, _ = functional.scan_tiles(one_tile, (zeros, zeros), (z_tiles, g_tiles), ())
        return sums

    with option_scope(method, option):
        compiled = jax.jit(run).lower(z_tiles, g_tiles).compile()
    return lambda: jax.block_until_ready(compiled(z_tiles, g_tiles))


def loss_grad_call(label, num_knots, z, targets, raw):
    """A compiled `() -> (loss, dz, draw)` of `plif_log_likelihood` with the
    histogram path of `label` (`parse_method`) forced while tracing."""
    import jax

    from keras_softmax_heads import functional
    from keras_softmax_heads.functional import dispatch

    def loss(z, raw):
        return -functional.plif_log_likelihood(z, raw, KNOT_BOUND, targets).sum()

    method, option = parse_method(label)
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    with dispatch.forced_histogram_method(method), option_scope(method, option):
        compiled = grad.lower(z, raw).compile()  # traced with `method`
    return lambda: jax.block_until_ready(compiled(z, raw))


def run(args, save=None):
    """Measures every row; returns the JSON result (`save(partial)`, when
    given, after each method's first call, in `first_calls`, and after each
    row's methods: a run stopped from outside keeps them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from keras_softmax_heads import functional
    from keras_softmax_heads.functional import dispatch

    if args.tile_elements:  # the CPU's tile and the accelerators'
        functional.plif_kernels.TILE_ELEMENTS = args.tile_elements
        dispatch.ACCELERATOR_TILE_ELEMENTS = dict.fromkeys(
            dispatch.ACCELERATOR_TILE_ELEMENTS, args.tile_elements)
    tile = dispatch.tile_elements(functional.plif_kernels.TILE_ELEMENTS)
    from keras_softmax_heads.platforms import current_platform

    platform = current_platform()

    def header():
        return _header(args, platform, tile)

    methods = args.methods or ("scatter,sorted,pallas" if platform == "gpu" else "scatter,sorted")
    all_methods = methods.split(",")
    rng = np.random.default_rng(0)
    z = jnp.asarray((rng.normal(size=(args.n, args.v)) * args.score_scale).astype("float32"))
    g = jnp.asarray(rng.normal(size=(args.n * args.v,)).astype("float32"))
    targets = jnp.asarray(rng.integers(0, args.v, size=(args.n,)).astype("int32"))
    rows = []
    for num_knots in [int(k) for k in args.knots.split(",")]:
        raw = jnp.asarray(rng.normal(0.5, 0.3, size=(num_knots,)).astype("float32"))
        for row in args.rows.split(","):
            calls, first, check = {}, {}, {}
            # For the histograms alone "pallas_fused" is "pallas".
            methods = [m for m in all_methods
                       if row != "histogram" or parse_method(m)[0] != "pallas_fused"]
            for method in methods:
                if row == "histogram":
                    call = histogram_call(method, num_knots, z.reshape(-1), g, tile)
                else:
                    call = loss_grad_call(method, num_knots, z, targets, raw)
                value, first[method], _ = measure.clock(call)
                # The slopes: B (histogram) or dL/draw (loss_grad).
                check[method] = np.asarray(jax.tree.leaves(value)[-1]).astype("float64")
                calls[method] = call
                if save:  # each first call (compile + run) as it lands
                    save(dict(header(), rows=rows, complete=False, first_calls=dict(
                        row=row, knots=num_knots, first_s=dict(first))))
            wall, cpu = measure.interleaved(calls, args.rounds)
            reference = check[methods[0]]
            scale = max(1.0, float(np.abs(reference).max()))
            for method in methods:
                rows.append({
                    "row": row, "knots": num_knots, "method": method,
                    "first_s": first[method],
                    "wall_s": wall[method], "cpu_s": cpu[method],
                    "median_ms": 1e3 * statistics.median(wall[method]),
                    "ratio_to_first_method": statistics.median(
                        w / r for w, r in zip(wall[method], wall[methods[0]])),
                    "max_abs_diff_to_first_method_rel": float(
                        np.abs(check[method] - reference).max() / scale),
                })
                print(f"{row:9s} K={num_knots:6d} {method:8s} {rows[-1]['median_ms']:9.1f} ms "
                      f"x{rows[-1]['ratio_to_first_method']:.2f} "
                      f"diff {rows[-1]['max_abs_diff_to_first_method_rel']:.1e}")
            if save:
                save(dict(header(), rows=rows, complete=False))
    return dict(header(), rows=rows, complete=True)


def _header(args, platform, tile):
    import jax

    device = jax.devices()[0]
    return {
        "script": "benchmarks/bench_plif_histogram.py", "args": vars(args),
        "platform": platform, "device": getattr(device, "device_kind", str(device)),
        "jax": jax.__version__, "tile_elements": tile,
        "loadavg": os.getloadavg(), "machine": measure.machine(),
    }


def main(argv=None):
    args = parse_args(argv)
    select_backend.use("jax")
    from keras_softmax_heads.platforms import current_platform

    out = args.out or os.path.join(OUT_DIR, f"{current_platform()}_jax.json")
    measure.save(run(args, save=lambda partial: measure.save(partial, out)), out)


if __name__ == "__main__":
    main()
