"""The Pallas GPU kernels of the fused loss's per-token statistics (JAX).

`pallas_pointwise_stats` returns what `chunked.chunked_pointwise_stats`
returns (`nll`, `lse`, `score_sum`, `argmax` per token, differentiable in
the first three) with Pallas kernels (Triton backend) and a
`jax.custom_vjp`:

* forward (`forward_kernel`), grid (token blocks, vocabulary splits): each
  program loops over its split's blocks of `block_v` words; a block's
  scores `z = h W_blk + b_blk` are products over `block_d` slices of the
  hidden size with float32 results, then its running max, sum of
  `exp(g - max)`, target score, score sum and first argmax are updated;
  `combine_splits` merges the splits' partials (`[splits, N]` each);
* backward `"gemm"` (the default without filtering): per vocabulary chunk
  (a `lax.fori_loop`), `dz_kernel` recomputes the chunk's scores and writes
  `dz = dg(z)` with `dg = (u_nll + u_lse) softmax - u_nll onehot(target)
  + u_sum` (the soft cap's chain rule by `jax.vjp` in the kernel) in the
  inputs' dtype, then XLA's products give `dh += dz W_c` and
  `dW_c = dz^T h` (float32 results);
* backward `"atomic"` (`backward_kernel`, the one that filters), grid
  (token blocks, vocabulary blocks): each program recomputes its block,
  forms `dz` and adds `dz W_blk` into `dh`, `dz^T h_blk` into `dW` (and
  `sum dz` into `db`) with float32 atomic adds, one `block_d` slice at a
  time.

With `filter_eps` (the `"atomic"` backward), a backward block whose softmax
values are all below `filter_eps`, that holds none of its tokens' targets
and whose tokens have no score-sum cotangent (label smoothing) is skipped:
its gradient terms `(u_nll + u_lse) softmax` (each below
`|u_nll + u_lse| filter_eps`) are dropped. Off (None) by default: exact.

`fused.vocab_parallel.single_device_stats` is the one place that chooses
these kernels (`uses_kernel`). Design, block sizes, dispatch and filtering:
`docs/chunked.md`, "The Pallas GPU kernel".
"""

import functools

import keras
from keras import ops

from keras_softmax_heads import platforms
from keras_softmax_heads.platforms import current_platform
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_number

#: Block sizes `(block_n, block_v, block_d)` on a GPU: 64 tokens x 128
#: words per score block (a 64 x 128 float32 accumulator per program),
#: products over 64-wide slices of the hidden size (Triton's `dot` wants
#: powers of two, at least 16).
GPU_BLOCKS = (64, 128, 64)

#: The input dtypes the kernel takes (float64 stays on the XLA path).
KERNEL_DTYPES = ("float16", "bfloat16", "float32")

#: The forward pass's target number of programs: the vocabulary is split
#: into `ceil(FORWARD_PROGRAMS / (N / block_n))` runs of blocks (at most one
#: per block), whose partial statistics `combine_splits` merges.
FORWARD_PROGRAMS = 1024

#: Values of `backward`: `"gemm"` (score gradients per vocabulary chunk,
#: then XLA's products), `"atomic"` (one fused kernel, atomic adds; the one
#: that filters), `"auto"` (`"atomic"` with `filter_eps`, else `"gemm"`).
BACKWARDS = ("auto", "gemm", "atomic")


def check_filter_eps(filter_eps):
    """`filter_eps` as a float in `(0, 1)`, or None; else raises."""
    return check_number(
        "filter_eps", filter_eps, low=0, high=1, low_open=True, allow_none=True
    )


#: The platforms where `implementation="auto"` runs this kernel (on JAX,
#: where Pallas' Triton backend is there): none today. On an H200 the tiled
#: XLA pass was faster than the kernel in every case measured (bfloat16 and
#: float32, `docs/chunked.md`, "The Pallas GPU kernel"), so `"auto"` takes
#: the tiled pass everywhere and the kernel (and with it `filter_eps`) is
#: `implementation="pallas"`'s.
AUTO_PLATFORMS = ()


def uses_kernel(hidden, kernel, implementation, platform=None):
    """Whether `pointwise_stats` runs this kernel.

    `implementation="pallas"` always (it raises off the JAX backend, for
    float64 inputs, or where JAX lacks Pallas' Triton backend; interpret
    mode off a GPU); `"auto"` on the JAX backend on a platform of
    `AUTO_PLATFORMS` (`platform`, default
    `platforms.current_platform()`) for float16, bfloat16 and float32
    inputs where `platforms.has_pallas_triton()`; never for `"ops"`.
    """
    dtypes = {keras.backend.standardize_dtype(x.dtype) for x in (hidden, kernel)}
    if implementation == "pallas":
        if keras.backend.backend() != "jax" or dtypes - set(KERNEL_DTYPES):
            raise ValueError(
                "implementation='pallas' needs the JAX backend and float16, "
                "bfloat16 or float32 inputs. Received: backend="
                f"{keras.backend.backend()!r}, dtypes={sorted(dtypes)}"
            )
        platforms.require_pallas_triton("implementation", implementation, "'ops' and 'auto'")
        return True
    if implementation != "auto" or dtypes - set(KERNEL_DTYPES):
        return False
    platform = current_platform() if platform is None else platform
    return (keras.backend.backend() == "jax" and platform in AUTO_PLATFORMS
            and platforms.has_pallas_triton())


def block_sizes(rows, vocab, dim, blocks=None):
    """`(block_n, block_v, block_d)`: `blocks` (default `GPU_BLOCKS`), each
    cut to the next power of two of the dimension when that is smaller
    (at least 16)."""
    def fit(block, size):
        return int(min(block, max(16, 1 << max(0, (size - 1).bit_length()))))

    bn, bv, bd = GPU_BLOCKS if blocks is None else blocks
    return fit(bn, rows), fit(bv, vocab), fit(bd, dim)


def chunk_width(vocab_pad, block_v, chunk_size):
    """The `"gemm"` backward's chunk: `block_v` times the largest divisor of
    `vocab_pad / block_v` that keeps it within `chunk_size` (at least one
    block), so that the chunks tile the padded vocabulary exactly."""
    blocks, limit = vocab_pad // block_v, max(1, chunk_size // block_v)
    return block_v * max(k for k in range(1, min(blocks, limit) + 1) if blocks % k == 0)


def padded(x, axis, multiple):
    """`x` padded with zeros on `axis` to a multiple of `multiple` (no copy
    when it already is one)."""
    import jax.numpy as jnp

    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad)


class KernelSpec:
    """The static configuration of one call (hashable closures only)."""

    def __init__(self, vocab, dim, blocks, transform_fn, kernel_transposed,
                 has_bias, filter_eps, interpret, backward="gemm", chunk=None):
        self.backward = backward
        self.chunk = chunk
        self.vocab = vocab
        self.dim = dim
        self.bn, self.bv, self.bd = blocks
        self.transform_fn = transform_fn
        self.kernel_transposed = kernel_transposed
        self.has_bias = has_bias
        self.filter_eps = filter_eps
        self.interpret = interpret

    def params(self, num_warps):
        if self.interpret:
            return None
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=num_warps, num_stages=2)


def block_scores(spec, h_ref, w_ref, b_ref, j):
    """`(z, cols)`: the pre-transform scores `h W_blk + b_blk` of vocabulary
    block `j` (float32 `[block_n, block_v]`) and its word ids."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    bn, bv, bd = spec.bn, spec.bv, spec.bd
    cols = j * bv + jnp.arange(bv, dtype=jnp.int32)

    def product(k, acc):
        hk = h_ref[:, pl.ds(k * bd, bd)]
        if spec.kernel_transposed:
            wk = w_ref[pl.ds(j * bv, bv), pl.ds(k * bd, bd)]
            return acc + jnp.dot(hk, wk.T, preferred_element_type=jnp.float32)
        wk = w_ref[pl.ds(k * bd, bd), pl.ds(j * bv, bv)]
        return acc + jnp.dot(hk, wk, preferred_element_type=jnp.float32)

    z = jax.lax.fori_loop(
        0, h_ref.shape[1] // bd, product, jnp.zeros((bn, bv), jnp.float32)
    )
    if spec.has_bias:
        z = z + b_ref[pl.ds(j * bv, bv)].astype(jnp.float32)[None, :]
    return z, cols


def transformed(spec, z):
    """`g(z)` in float32 (the identity without a transform)."""
    import jax.numpy as jnp

    if spec.transform_fn is None:
        return z
    return jnp.asarray(spec.transform_fn(z), jnp.float32)


def forward_kernel(spec, per_split, h_ref, w_ref, *refs):
    """One (token block, vocabulary split): loops over the split's
    `per_split` vocabulary blocks; writes the split's running max, sum of
    `exp(g - max)`, target score, score sum and first argmax."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    b_ref = refs[0] if spec.has_bias else None
    t_ref, max_ref, sum_ref, target_ref, total_ref, arg_ref = refs[int(spec.has_bias):]
    targets = t_ref[...]
    bn = spec.bn
    big = jnp.int32(2**31 - 1)

    def body(j, carry):
        run_max, run_sum, target, total, arg = carry
        z, cols = block_scores(spec, h_ref, w_ref, b_ref, j)
        valid = (cols < spec.vocab)[None, :]
        g = jnp.where(valid, transformed(spec, z), -jnp.inf)
        block_max = jnp.max(g, axis=1)
        new_max = jnp.maximum(run_max, block_max)
        run_sum = run_sum * jnp.exp(run_max - new_max) + jnp.sum(
            jnp.exp(g - new_max[:, None]), axis=1
        )
        hit = cols[None, :] == targets[:, None]
        target = target + jnp.sum(jnp.where(hit, g, 0.0), axis=1)
        total = total + jnp.sum(jnp.where(valid, g, 0.0), axis=1)
        block_arg = jnp.min(jnp.where(g == block_max[:, None], cols[None, :], big), axis=1)
        # Strictly better only: the earlier (smaller) word wins ties.
        arg = jnp.where(block_max > run_max, block_arg, arg)
        return new_max, run_sum, target, total, arg

    zeros = jnp.zeros((bn,), jnp.float32)
    init = (zeros - jnp.inf, zeros, zeros, zeros, jnp.zeros((bn,), jnp.int32))
    num_v = w_ref.shape[0 if spec.kernel_transposed else 1] // spec.bv
    first = pl.program_id(1) * per_split
    last = jnp.minimum(first + per_split, num_v)
    run_max, run_sum, target, total, arg = jax.lax.fori_loop(first, last, body, init)
    max_ref[...] = run_max
    sum_ref[...] = run_sum
    target_ref[...] = target
    total_ref[...] = total
    arg_ref[...] = arg


def combine_splits(run_max, run_sum, target, total, arg):
    """The per-token statistics from the splits' `[S, N]` partials:
    `lse = m + log(sum_s sum_s exp(max_s - m))` (`m = max_s max_s`), the
    target score and score sum added, the argmax of the first split that
    reaches `m`. Returns `(nll, lse, score_sum, argmax)` `[N]`."""
    import jax.numpy as jnp

    peak = jnp.max(run_max, axis=0)
    lse = peak + jnp.log(jnp.sum(run_sum * jnp.exp(run_max - peak[None, :]), axis=0))
    target = jnp.sum(target, axis=0)
    best = jnp.argmax(run_max, axis=0)  # the first maximal split
    argmax = jnp.take_along_axis(arg, best[None, :], axis=0)[0]
    return lse - target, lse, jnp.sum(total, axis=0), argmax


def dz_kernel(spec, h_ref, w_ref, *refs):
    """One (token block, vocabulary block) of a chunk (the `"gemm"`
    backward): the block's score gradient `dz` (in `h`'s dtype); the chunk's
    padded words have `valid = 0`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    b_ref = refs[0] if spec.has_bias else None
    valid_ref, t_ref, lse_ref, soft_ref, one_ref, sum_ref, dz_ref = refs[int(spec.has_bias):]
    j = pl.program_id(1)
    z, cols = block_scores(spec, h_ref, w_ref, b_ref, j)
    valid = valid_ref[pl.ds(j * spec.bv, spec.bv)][None, :] > 0
    dz, _, _ = score_gradient(spec, z, cols, valid, t_ref, lse_ref, soft_ref, one_ref, sum_ref)
    dz_ref[...] = dz.astype(dz_ref.dtype)


def score_gradient(spec, z, cols, valid, t_ref, lse_ref, soft_ref, one_ref, sum_ref):
    """`(dz, prob, hit)` of a score block: `dg = soft softmax - one
    onehot(target) + u_sum` (valid words), through the transform's
    `jax.vjp`; 0 on the padded words."""
    import functools as ft

    import jax
    import jax.numpy as jnp

    if spec.transform_fn is None:
        g, pullback = z, None
    else:
        g, pullback = jax.vjp(ft.partial(transformed, spec), z)
    g = jnp.where(valid, g, -jnp.inf)
    prob = jnp.exp(g - lse_ref[...][:, None])
    hit = cols[None, :] == t_ref[...][:, None]
    dg = soft_ref[...][:, None] * prob - jnp.where(hit, one_ref[...][:, None], 0.0)
    dg = dg + jnp.where(valid, sum_ref[...][:, None], 0.0)
    dz = dg if pullback is None else pullback(dg)[0]
    return jnp.where(valid, dz, 0.0), prob, hit


def backward_kernel(spec, h_ref, w_ref, *refs):
    """One (token block, vocabulary block): recomputes the scores and adds
    the block's gradients into `dh`, `dW` (and `db`) atomically."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    has_bias = spec.has_bias
    b_ref = refs[0] if has_bias else None
    refs = refs[int(has_bias):]
    t_ref, lse_ref, soft_ref, one_ref, sum_ref = refs[:5]
    # refs[5:8 or 5:7] are the aliased zero inputs; the outputs follow.
    outs = refs[5 + 2 + int(has_bias):]
    dh_ref, dw_ref = outs[0], outs[1]
    db_ref = outs[2] if has_bias else None
    bn, bv, bd = spec.bn, spec.bv, spec.bd
    i, j = pl.program_id(0), pl.program_id(1)

    z, cols = block_scores(spec, h_ref, w_ref, b_ref, j)
    valid = (cols < spec.vocab)[None, :]
    dz, prob, hit = score_gradient(spec, z, cols, valid, t_ref, lse_ref, soft_ref,
                                   one_ref, sum_ref)
    u_sum = sum_ref[...]

    def update():
        dzc = dz.astype(h_ref.dtype)

        def slice_update(k, carry):
            hk = h_ref[:, pl.ds(k * bd, bd)]
            rows = pl.ds(i * bn, bn)
            if spec.kernel_transposed:
                wk = w_ref[pl.ds(j * bv, bv), pl.ds(k * bd, bd)]
                dh = jnp.dot(dzc, wk, preferred_element_type=jnp.float32)
                dw = jnp.dot(dzc.T, hk, preferred_element_type=jnp.float32)
                plgpu.atomic_add(dw_ref, (pl.ds(j * bv, bv), pl.ds(k * bd, bd)), dw)
            else:
                wk = w_ref[pl.ds(k * bd, bd), pl.ds(j * bv, bv)]
                dh = jnp.dot(dzc, wk.T, preferred_element_type=jnp.float32)
                dw = jnp.dot(hk.T, dzc, preferred_element_type=jnp.float32)
                plgpu.atomic_add(dw_ref, (pl.ds(k * bd, bd), pl.ds(j * bv, bv)), dw)
            plgpu.atomic_add(dh_ref, (rows, pl.ds(k * bd, bd)), dh)
            return carry

        jax.lax.fori_loop(0, h_ref.shape[1] // bd, slice_update, 0)
        if has_bias:
            plgpu.atomic_add(db_ref, (pl.ds(j * bv, bv),), jnp.sum(dz, axis=0))

    if spec.filter_eps is None:
        update()
    else:
        # Max reductions only (Triton lowers no boolean any / all).
        keep = jnp.max(prob) >= spec.filter_eps
        keep = jnp.logical_or(keep, jnp.max(jnp.where(hit, 1.0, 0.0)) > 0.0)
        keep = jnp.logical_or(keep, jnp.max(jnp.abs(u_sum)) > 0.0)
        pl.when(keep)(update)


def run_forward(spec, h, w, b, t):
    """The forward kernel on padded inputs, then `combine_splits`:
    `(nll, lse, score_sum, argmax)` `[N_pad]`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    rows, dim = h.shape
    bn = spec.bn
    num_v = w.shape[0 if spec.kernel_transposed else 1] // spec.bv
    row_blocks = rows // bn
    # Enough programs to fill a GPU (about FORWARD_PROGRAMS), each split a
    # contiguous run of vocabulary blocks; no empty split.
    per_split = -(-num_v // max(1, min(num_v, -(-FORWARD_PROGRAMS // row_blocks))))
    splits = -(-num_v // per_split)
    full = lambda x: pl.BlockSpec(x.shape, lambda i, s: (0,) * x.ndim)  # noqa: E731
    in_specs = [pl.BlockSpec((bn, dim), lambda i, s: (i, 0)), full(w)]
    args = [h, w]
    if spec.has_bias:
        in_specs.append(full(b))
        args.append(b)
    in_specs.append(pl.BlockSpec((bn,), lambda i, s: (i,)))
    args.append(t)
    part = pl.BlockSpec((None, bn), lambda i, s: (s, i))
    stat = jax.ShapeDtypeStruct((splits, rows), jnp.float32)
    out = pl.pallas_call(
        functools.partial(forward_kernel, spec, per_split),
        grid=(row_blocks, splits),
        in_specs=in_specs,
        out_specs=[part] * 5,
        out_shape=[stat] * 4 + [jax.ShapeDtypeStruct((splits, rows), jnp.int32)],
        compiler_params=spec.params(num_warps=4),
        interpret=spec.interpret,
        name="linear_cross_entropy_forward",
    )(*args)
    return combine_splits(*out)


def whole(x):
    """The `BlockSpec` of all of `x` on a 2-d grid."""
    from jax.experimental import pallas as pl

    return pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)


def grid_inputs(spec, h, w, b, whole_arrays, row_arrays):
    """`(in_specs, args)` on a (token block, vocabulary block) grid: `h` by
    token block, `w`, `b` (if any) and `whole_arrays` whole, `row_arrays`
    (`[N]`) by token block."""
    from jax.experimental import pallas as pl

    in_specs = [pl.BlockSpec((spec.bn, h.shape[1]), lambda i, j: (i, 0)), whole(w)]
    args = [h, w]
    if spec.has_bias:
        in_specs.append(whole(b))
        args.append(b)
    in_specs += [whole(x) for x in whole_arrays]
    in_specs += [pl.BlockSpec((spec.bn,), lambda i, j: (i,))] * len(row_arrays)
    return in_specs, args + list(whole_arrays) + list(row_arrays)


def run_backward(spec, h, w, b, t, lse, soft, one, u_sum):
    """The backward kernel on padded inputs: float32 `(dh, dW, db)` (`db`
    None without a bias)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    rows, dim = h.shape
    bn, bv = spec.bn, spec.bv
    vocab_pad = w.shape[0 if spec.kernel_transposed else 1]
    in_specs, args = grid_inputs(spec, h, w, b, [], [t, lse, soft, one, u_sum])
    zeros = [jnp.zeros((rows, dim), jnp.float32), jnp.zeros(w.shape, jnp.float32)]
    if spec.has_bias:
        zeros.append(jnp.zeros((vocab_pad,), jnp.float32))
    first = len(args)
    in_specs += [whole(z) for z in zeros]
    args += zeros
    out = pl.pallas_call(
        functools.partial(backward_kernel, spec),
        grid=(rows // bn, vocab_pad // bv),
        in_specs=in_specs,
        out_specs=[whole(z) for z in zeros],
        out_shape=[jax_struct(z) for z in zeros],
        input_output_aliases={first + k: k for k in range(len(zeros))},
        compiler_params=spec.params(num_warps=8),
        interpret=spec.interpret,
        name="linear_cross_entropy_backward",
    )(*args)
    return out[0], out[1], (out[2] if spec.has_bias else None)


def run_dz(spec, h, w_c, b_c, valid_c, t_c, lse, soft, one, u_sum):
    """`dz` `[N_pad, chunk]` (in `h`'s dtype) of one vocabulary chunk
    (`w_c`, `b_c`, `valid_c` its slices, `t_c` the targets shifted to it)."""
    import jax
    from jax.experimental import pallas as pl

    rows, bn, bv = h.shape[0], spec.bn, spec.bv
    chunk = valid_c.shape[0]
    in_specs, args = grid_inputs(spec, h, w_c, b_c, [valid_c], [t_c, lse, soft, one, u_sum])
    return pl.pallas_call(
        functools.partial(dz_kernel, spec),
        grid=(rows // bn, chunk // bv),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bn, bv), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, chunk), h.dtype),
        compiler_params=spec.params(num_warps=4),
        interpret=spec.interpret,
        name="linear_cross_entropy_score_gradient",
    )(*args)


def run_backward_gemm(spec, h, w, b, t, lse, soft, one, u_sum):
    """The `"gemm"` backward: per vocabulary chunk of `spec.chunk` words
    (a `lax.fori_loop`), `dz` by `dz_kernel`, then `dh += dz W_c` and
    `dW_c = dz^T h` (`db_c = sum dz`) as XLA products in `h`'s dtype with
    float32 results; `dW` written in the kernel's dtype chunk by chunk.
    Returns `(dh float32, dW, db)`."""
    import jax
    import jax.numpy as jnp

    chunk = spec.chunk
    v_axis = 0 if spec.kernel_transposed else 1
    vocab_pad = w.shape[v_axis]
    valid = (jnp.arange(vocab_pad) < spec.vocab).astype(jnp.float32)
    hd = h.dtype

    def body(c, state):
        dh, dw, db = state
        start = c * chunk
        w_c = jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=v_axis)
        b_c = None if b is None else jax.lax.dynamic_slice_in_dim(b, start, chunk)
        valid_c = jax.lax.dynamic_slice_in_dim(valid, start, chunk)
        dz = run_dz(spec, h, w_c, b_c, valid_c, t - start, lse, soft, one, u_sum)
        w_c = w_c.astype(hd)
        if spec.kernel_transposed:  # w_c [chunk, d]
            dh = dh + jnp.dot(dz, w_c, preferred_element_type=jnp.float32)
            dw_c = jnp.dot(dz.T, h, preferred_element_type=jnp.float32)
        else:  # w_c [d, chunk]
            dh = dh + jnp.dot(dz, w_c.T, preferred_element_type=jnp.float32)
            dw_c = jnp.dot(h.T, dz, preferred_element_type=jnp.float32)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, dw_c.astype(dw.dtype), start, v_axis)
        if db is not None:
            db_c = jnp.sum(dz.astype(jnp.float32), axis=0).astype(db.dtype)
            db = jax.lax.dynamic_update_slice_in_dim(db, db_c, start, 0)
        return dh, dw, db

    state = (jnp.zeros(h.shape, jnp.float32), jnp.zeros_like(w),
             None if b is None else jnp.zeros_like(b))
    return jax.lax.fori_loop(0, vocab_pad // chunk, body, state)


def jax_struct(x):
    import jax

    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def stats_fn(spec):
    """The `jax.custom_vjp` function `(h, w, b, t) -> (nll, lse, score_sum,
    argmax)` on padded `[N_pad, d_pad]` inputs (`b` None without a bias)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def stats(h, w, b, t):
        return run_forward(spec, h, w, b, t)

    def fwd(h, w, b, t):
        out = run_forward(spec, h, w, b, t)
        return out, (h, w, b, t, out[1])

    def bwd(res, cotangents):
        h, w, b, t, lse = res
        u_nll, u_lse, u_sum = (jnp.asarray(c, jnp.float32) for c in cotangents[:3])
        run = run_backward_gemm if spec.backward == "gemm" else run_backward
        dh, dw, db = run(spec, h, w, b, t, lse, u_nll + u_lse, u_nll, u_sum)
        db = None if b is None else db.astype(b.dtype)
        return dh.astype(h.dtype), dw.astype(w.dtype), db, None

    stats.defvjp(fwd, bwd)
    return stats


def pallas_pointwise_stats(hidden, kernel, bias, targets, *, transform_fn=None,
                           kernel_transposed=False, filter_eps=None, blocks=None,
                           interpret=None, backward="auto", chunk_size=4096):
    """`chunked.chunked_pointwise_stats` as Pallas kernels (JAX only).

    The same statistics of `g = g(h W + b)` per token (`nll = lse -
    g_target`, `lse = logsumexp_v g_v`, `score_sum = sum_v g_v`, `argmax`),
    the same gradients (of `nll`, `lse` and `score_sum`, from the upstream
    cotangent per token, accumulated in float32), computed by the kernels
    the module docstring describes. Inputs are padded (zeros; the padded
    words masked) to multiples of the block sizes where they are not
    already.

    Args:
        hidden: `[..., d]` float16, bfloat16 or float32.
        kernel: `[d, V]`, or `[V, d]` with `kernel_transposed`.
        bias: `[V]` or None.
        targets: int `[...]` in `[0, V)`.
        transform_fn: None or an elementwise function of the float32 scores
            written in `jax.numpy` / `keras.ops` (e.g. the soft cap); its
            derivative is taken by `jax.vjp` inside the kernel.
        kernel_transposed: bool.
        filter_eps: None (exact, default) or a float in `(0, 1)`: skip the
            backward blocks whose softmax values are all below it (see the
            module docstring for what is dropped; the `"atomic"` backward).
        blocks: `(block_n, block_v, block_d)`, powers of two (default
            `GPU_BLOCKS`, cut to the problem).
        interpret: run the kernels in Pallas' interpret mode (default: when
            JAX's default backend is not a GPU).
        backward: one of `BACKWARDS` (default `"auto"`).
        chunk_size: the `"gemm"` backward's chunk width bound
            (`chunk_width`).

    Returns:
        `(nll, lse, score_sum, argmax)` of the targets' shape (float32;
        argmax int32).

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.fused.pallas_cross_entropy import pallas_pointwise_stats
    >>> rng = np.random.default_rng(0)
    >>> h = rng.normal(size=(5, 8)).astype("float32")
    >>> w = rng.normal(size=(8, 37)).astype("float32")
    >>> nll, lse, total, arg = pallas_pointwise_stats(h, w, None, [0, 3, 9, 5, 36])
    >>> z = h @ w
    >>> bool(np.allclose(np.asarray(total), z.sum(1), atol=1e-4))
    True
    >>> bool(np.array_equal(np.asarray(arg), z.argmax(1)))
    True
    """
    import jax
    import jax.numpy as jnp

    filter_eps = check_filter_eps(filter_eps)
    backward = check_choice("backward", backward, BACKWARDS)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    if backward == "auto":
        backward = "gemm" if filter_eps is None else "atomic"
    if backward == "gemm" and filter_eps is not None:
        raise ValueError(
            "`filter_eps` needs backward='atomic' (or 'auto'). "
            f"Received: backward={backward!r}, filter_eps={filter_eps}"
        )
    hidden = jnp.asarray(ops.convert_to_tensor(hidden))
    kernel = jnp.asarray(ops.convert_to_tensor(kernel))
    if hidden.dtype != kernel.dtype:  # one dtype for the kernels' products
        common = jnp.promote_types(hidden.dtype, kernel.dtype)
        hidden, kernel = hidden.astype(common), kernel.astype(common)
    targets = jnp.asarray(ops.convert_to_tensor(targets), jnp.int32)
    dim = hidden.shape[-1]
    vocab = kernel.shape[0] if kernel_transposed else kernel.shape[1]
    lead = targets.shape
    h = hidden.reshape((-1, dim))
    t = targets.reshape((-1,))
    rows = h.shape[0]
    blocks = block_sizes(rows, vocab, dim, blocks)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    bn, bv, bd = blocks
    chunk = chunk_width(-(-vocab // bv) * bv, bv, chunk_size)
    spec = KernelSpec(vocab, dim, blocks, transform_fn, kernel_transposed,
                      bias is not None, filter_eps, interpret, backward, chunk)
    h = padded(padded(h, 0, bn), 1, bd)
    t = padded(t, 0, bn)
    v_axis = 0 if kernel_transposed else 1
    w = padded(padded(kernel, v_axis, bv), 1 - v_axis, bd)
    b = None
    if bias is not None:
        b = padded(jnp.asarray(ops.convert_to_tensor(bias)), 0, bv)
    nll, lse, total, arg = stats_fn(spec)(h, w, b, t)
    return tuple(x[:rows].reshape(lead) for x in (nll, lse, total, arg))
