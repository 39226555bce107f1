"""PLIF's slope histogram as Pallas kernels (JAX only: GPU, or interpreted).

`pallas_ll_gradient` is the whole backward tile of `plif_log_likelihood`
(the score gradient and both histograms, from `z`) in one such kernel.

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

LANES = 32
"""Scores per vector (the aggregation's comparison is `LANES x LANES`).
Chosen on a GPU against 128 (`docs/plif.md`, "Measured on a GPU"): a
wider vector sends fewer atomics, but its aggregation is register-heavy."""

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
    lanes = _check_lanes(lanes)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    idx = jnp.reshape(idx, [-1]).astype("int32")
    size = idx.shape[0]
    num_weights = len(weights)
    stacked = jnp.stack([jnp.reshape(w, [-1]).astype("float32") for w in weights])
    if size == 0:
        return tuple(jnp.zeros([num_knots], "float32") for _ in weights)
    row, programs, copies, steps, padded = _layout(size, num_weights, num_knots, lanes,
                                                   programs, copies)
    # Padding adds weight 0 to bin 0.
    idx = jnp.pad(idx, [(0, padded - size)])
    stacked = jnp.pad(stacked, [(0, 0), (0, padded - size)])
    slab = steps * lanes

    def kernel(idx_ref, w_ref, _, out_ref):
        def step(s, carry):
            ids = idx_ref[pl.ds(s * lanes, lanes)]
            _aggregated_add(out_ref, ids, [w_ref[k, pl.ds(s * lanes, lanes)]
                                           for k in range(num_weights)], num_knots)
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
        name="plif_knot_histogram",
    )(idx, stacked, zeros)
    sums = jnp.sum(out[:, :, :num_knots], axis=0)
    return tuple(sums[k] for k in range(num_weights))


def _check_lanes(lanes):
    """`lanes` (default `LANES`) as a power of two; else raises."""
    lanes = check_int("lanes", LANES if lanes is None else lanes, minimum=1)
    if lanes & (lanes - 1):
        raise ValueError(f"`lanes` must be a power of two. Received: lanes={lanes}")
    return lanes


def _layout(size, num_weights, num_knots, lanes, programs, copies):
    """`(row, programs, copies, steps, padded)` of a privatised histogram of
    `size` scores: `K' = row` columns a copy, `P` programs of `steps`
    vectors of `lanes` scores (`padded = P steps lanes >= size`), `C`
    copies (`pallas_knot_histogram`'s defaults)."""
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
    return row, programs, copies, steps, programs * steps * lanes


def pallas_ll_gradient(z, targets, upstream, lse, slopes, left_values, knot_bound,
                       lanes=None, programs=None, copies=None, interpret=None):
    """PLIF's log-likelihood gradient on a tile of rows as one Pallas kernel.

    What `plif_kernels`' backward pass computes on a tile from the scores
    `z` `[n, V]`: the interval `i = clip(floor((z + T) / w), 0, K - 1)`
    (`w = 2T / K`), the offset `o = z - (-T + w i)`, the PLIF score
    `f = left_values[i] + slopes[i] o`, `d_f = u (onehot(target) -
    exp(f - lse))` per row, and returns `dL/dz = d_f slopes[i]` and the
    slopes' two histograms `A = hist(d_f)`, `B = hist(d_f o)`. The XLA path
    writes the interval index, `d_f` and `d_f o` (three `[n, V]` arrays)
    for `pallas_knot_histogram` to read; here each program reads its slab
    of `z` once, gathers its rows' `lse`, `u` and target and the `[K]`
    tables, writes `dL/dz` and adds both histograms as
    `pallas_knot_histogram` does (privatised copies, equal indices
    combined within a vector). Float32 throughout.

    Args:
        z: float32 `[n, V]`.
        targets: int32 `[n]`, in `[0, V)`.
        upstream: float32 `[n]`, `u`, the cotangent of each row's
            log-likelihood.
        lse: float32 `[n]`, each row's `logsumexp(f)`.
        slopes: float32 `[K]`, `s = softplus(v)`.
        left_values: float32 `[K]`, `f` at the left knots.
        knot_bound: float `T`.
        lanes, programs, copies, interpret: as in `pallas_knot_histogram`.

    Returns:
        `(dL/dz [n, V], (A [K], B [K]))`, float32.
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    rows, vocab = z.shape
    num_knots = slopes.shape[0]
    width = 2.0 * float(knot_bound) / num_knots
    lanes = _check_lanes(lanes)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    size = rows * vocab
    row, programs, copies, steps, padded = _layout(size, 2, num_knots, lanes, programs, copies)
    if padded >= 2**31:  # the kernel's int32 positions
        raise ValueError(
            "`z` holds too many scores for one call (under 2**31 with the "
            "kernel's padding; the PLIF kernels tile their rows). Received: "
            f"z.shape={tuple(z.shape)}"
        )
    flat = jnp.pad(jnp.reshape(z, [-1]).astype("float32"), [(0, padded - size)])
    per_row = [jnp.asarray(x, dtype) for x, dtype in
               ((lse, "float32"), (upstream, "float32"), (targets, "int32"))]
    tables = [jnp.asarray(x, "float32") for x in (slopes, left_values)]
    slab = steps * lanes
    bound = float(knot_bound)

    def kernel(z_ref, lse_ref, u_ref, t_ref, slope_ref, left_ref, _, dz_ref, out_ref):
        base = pl.program_id(0) * slab
        offsets = jax.lax.broadcasted_iota(jnp.int32, (lanes,), 0)

        def step(s, carry):
            position = base + s * lanes + offsets  # flat index of each lane
            valid = position < size
            r = jnp.minimum(position // vocab, rows - 1)
            col = position - r * vocab
            zv = z_ref[pl.ds(s * lanes, lanes)]
            # `plif_kernels._interval`: clipped as a float, then as an integer.
            cell = jnp.clip(jnp.floor((zv + bound) / width), 0.0, num_knots - 1.0)
            ids = jnp.clip(cell.astype(jnp.int32), 0, num_knots - 1)
            offset = zv - (-bound + width * ids.astype(jnp.float32))
            slope = slope_ref[ids]
            f = left_ref[ids] + slope * offset
            hit = jnp.where(col == t_ref[r], 1.0, 0.0)
            d_f = jnp.where(valid, u_ref[r] * (hit - jnp.exp(f - lse_ref[r])), 0.0)
            dz_ref[pl.ds(s * lanes, lanes)] = d_f * slope
            _aggregated_add(out_ref, ids, [d_f, d_f * offset], num_knots)
            return carry

        jax.lax.fori_loop(0, steps, step, 0)

    zeros = jnp.zeros([copies, 2, row], "float32")
    whole = lambda x: pl.BlockSpec(x.shape, lambda p: (0,))  # noqa: E731
    d_z, out = pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[pl.BlockSpec((slab,), lambda p: (p,))]
        + [whole(x) for x in per_row + tables]
        + [pl.BlockSpec((None, 2, row), lambda p: (p % copies, 0, 0))],
        out_specs=[pl.BlockSpec((slab,), lambda p: (p,)),
                   pl.BlockSpec((None, 2, row), lambda p: (p % copies, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((padded,), "float32"),
                   jax.ShapeDtypeStruct(zeros.shape, "float32")],
        input_output_aliases={6: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4),
        interpret=interpret,
        name="plif_ll_gradient",
    )(flat, *per_row, *tables, zeros)
    sums = jnp.sum(out[:, :, :num_knots], axis=0)
    return jnp.reshape(d_z[:size], (rows, vocab)), (sums[0], sums[1])


def _aggregated_add(out_ref, ids, weights, num_knots):
    """Adds each vector of `weights` (`[lanes]` each) into row `k` of
    `out_ref` `[W, K']` at the bins `ids` (`[lanes]` int32), one update per
    distinct index: the lane that leads an index (no earlier lane has it)
    sends the sum of its equals' weights, the others add theirs (already
    counted) into the trash columns `num_knots + lane`."""
    import jax
    import jax.numpy as jnp

    lanes = ids.shape[0]
    lane = jax.lax.broadcasted_iota(jnp.int32, (lanes, lanes), 1)
    other = jax.lax.broadcasted_iota(jnp.int32, (lanes, lanes), 0)
    trash = num_knots + jax.lax.broadcasted_iota(jnp.int32, (lanes,), 0)
    same = ids[:, None] == ids[None, :]
    # A lane leads when no earlier lane has its index.
    earlier = jnp.sum(jnp.where(same & (lane < other), 1, 0), axis=1)
    target = jnp.where(earlier == 0, ids, trash)
    for k, w in enumerate(weights):
        total = jnp.sum(jnp.where(same, w[None, :], 0.0), axis=1)
        _atomic_add(out_ref, (k, target), total)


def _atomic_add(ref, index, value):
    """`ref[index] += value` for an index tuple of distinct addresses
    (Triton's atomic add, also under Pallas' interpreter)."""
    from jax.experimental.pallas import triton as plgpu

    plgpu.atomic_add(ref, index, value)

