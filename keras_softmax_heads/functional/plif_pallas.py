"""PLIF's slope histogram as a Pallas kernel (JAX only: GPU, or interpreted).

`pallas_knot_histogram(idx, weights, num_knots)` is `knot_histogram`'s
result (`out[k] = sum of w where idx == k`, one `[K]` vector per weight
tensor) from a `jax.experimental.pallas` kernel written for JAX's GPU
(Triton) backend, without contended atomic updates:

* **privatised**: program `p` of the grid adds its slab of scores into
  row `p mod C` of a `[C, W, K']` buffer, `C` private copies of the
  histogram, so only programs of the same row can update the same address
  (a hot bin has `C` copies; with `C = P` programs never contend); the
  rows are summed afterwards (`C K'` reads);
* **aggregated within a vector**: a program reads `lanes` scores at a
  time, sums the weights of equal indices inside the vector (an
  `[lanes, lanes]` comparison) and sends one atomic add per distinct
  index, from its first lane; the other lanes add their (already
  counted) weights into trash columns `K + lane` past the histogram, so
  the addresses of one vector are distinct (hot bins: one update per
  vector instead of up to `lanes`).

Off the GPU the kernel runs with `interpret=True` (tests on a CPU). JAX's
interpreter applies a vector `atomic_add` as a gather-add-scatter, which
keeps only one update per repeated address: the distinct addresses of the
aggregation are also what makes the interpreted kernel exact. Design and
dispatch: `docs/plif.md` ("The slope histogram on accelerators").
"""

from keras_softmax_heads.validation import check_int

LANES = 128
"""Scores per vector (the aggregation's comparison is `LANES x LANES`)."""

BUFFER_BYTES = 2**27
"""Upper bound on the privatised `[C, W, K']` buffer (it bounds `C`)."""


def _next_power_of_two(n):
    return 1 << max(0, int(n - 1).bit_length())


def pallas_knot_histogram(idx, weights, num_knots, lanes=None, programs=None, copies=None,
                          interpret=None):
    """Per-interval sums of weights by a privatised Pallas kernel (JAX).

    `out[w][k] = sum_m weights[w][m] [idx[m] == k]`, the result of
    `knot_histogram`, computed by `P` programs that each add a slab of
    `idx.size / P` scores into row `p mod C` of a `[C, W, K']` float32
    buffer (`C` private copies of the histogram, `K' >= K + lanes` a power
    of two), `lanes` scores at a time with equal indices combined inside
    the vector first (module docstring), then the rows summed. With
    `C = P` no two programs touch the same address; one vector never
    sends two updates to one address.

    Args:
        idx: int32 JAX array of any shape, values in `[0, num_knots)`.
        weights: tuple of float JAX arrays of the shape of `idx`.
        num_knots: int, the number of intervals `K` (static).
        lanes: scores per vector, a power of two (default `LANES`).
        programs: number of programs `P` (default: one per `8 * lanes`
            scores).
        copies: number of private histograms `C <= P` (default: as many
            as keep the buffer within `BUFFER_BYTES` and its zero-fill and
            reduction within the traffic of reading the inputs: few for
            large `K`, whose updates rarely collide, up to `P` for small
            `K`, whose hot bins collide most).
        interpret: run Pallas' interpreter (default: off the GPU).

    Returns:
        A tuple of `[K]` float32 arrays, one per weight tensor.

    Example:

    >>> import numpy as np
    >>> import jax.numpy as jnp
    >>> from keras_softmax_heads.functional.plif_pallas import pallas_knot_histogram
    >>> idx = jnp.array([0, 2, 2, 1], "int32")
    >>> w = jnp.array([1.0, 2.0, 3.0, 4.0], "float32")
    >>> [np.asarray(h).tolist() for h in pallas_knot_histogram(idx, (w,), 4, lanes=4)]
    [[1.0, 4.0, 5.0, 0.0]]
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    num_knots = check_int("num_knots", num_knots, minimum=1)
    lanes = check_int("lanes", LANES if lanes is None else lanes, minimum=1)
    if lanes & (lanes - 1):
        raise ValueError(f"`lanes` must be a power of two. Received: lanes={lanes}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    idx = jnp.reshape(idx, [-1]).astype("int32")
    size = idx.shape[0]
    num_weights = len(weights)
    stacked = jnp.stack([jnp.reshape(w, [-1]).astype("float32") for w in weights])
    if size == 0:
        return tuple(jnp.zeros([num_knots], "float32") for _ in weights)
    row = _next_power_of_two(num_knots + lanes)
    vectors = -(-size // lanes)
    if programs is None:
        programs = -(-vectors // 8)
    programs = check_int("programs", programs, minimum=1)
    if copies is None:
        fits = BUFFER_BYTES // (4 * num_weights * row)
        # Zero-fill + reduction (8 W row bytes a copy) <= input (4 + 4 W bytes a score).
        cheap = size * (1 + num_weights) // (2 * num_weights * row)
        copies = max(1, min(programs, fits, cheap))
    copies = check_int("copies", copies, minimum=1, maximum=programs)
    steps = -(-vectors // programs)
    padded = programs * steps * lanes
    # Padding adds weight 0 to bin 0.
    idx = jnp.pad(idx, [(0, padded - size)])
    stacked = jnp.pad(stacked, [(0, 0), (0, padded - size)])
    slab = steps * lanes

    def kernel(idx_ref, w_ref, _, out_ref):
        lane = jax.lax.broadcasted_iota(jnp.int32, (lanes, lanes), 1)
        other = jax.lax.broadcasted_iota(jnp.int32, (lanes, lanes), 0)
        trash = num_knots + jax.lax.broadcasted_iota(jnp.int32, (lanes,), 0)

        def step(s, carry):
            ids = idx_ref[pl.ds(s * lanes, lanes)]
            same = ids[:, None] == ids[None, :]
            # A lane leads when no earlier lane has its index.
            earlier = jnp.sum(jnp.where(same & (lane < other), 1, 0), axis=1)
            target = jnp.where(earlier == 0, ids, trash)
            for k in range(num_weights):
                w = w_ref[k, pl.ds(s * lanes, lanes)]
                total = jnp.sum(jnp.where(same, w[None, :], 0.0), axis=1)
                _atomic_add(out_ref, (k, target), total)
            return carry

        jax.lax.fori_loop(0, steps, step, 0)

    zeros = jnp.zeros([copies, num_weights, row], "float32")
    out = pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[
            pl.BlockSpec((slab,), lambda p: (p,)),
            pl.BlockSpec((num_weights, slab), lambda p: (0, p)),
            pl.BlockSpec((None, num_weights, row), lambda p: (p % copies, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, num_weights, row), lambda p: (p % copies, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(zeros.shape, "float32"),
        input_output_aliases={2: 0},
        # Triton (JAX's default GPU lowering is now Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=4),
        interpret=interpret,
    )(idx, stacked, zeros)
    sums = jnp.sum(out[:, :, :num_knots], axis=0)
    return tuple(sums[k] for k in range(num_weights))


def _atomic_add(ref, index, value):
    """`ref[index] += value` for an index tuple of distinct addresses
    (Triton's atomic add, also under Pallas' interpreter)."""
    from jax.experimental.pallas import triton as plgpu

    plgpu.atomic_add(ref, index, value)

