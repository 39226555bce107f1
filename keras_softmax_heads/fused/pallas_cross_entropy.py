"""The Pallas GPU kernel of the fused loss's per-token statistics (JAX).

`pallas_pointwise_stats` returns what `chunked.chunked_pointwise_stats`
returns (`nll`, `lse`, `score_sum`, `argmax` per token, differentiable in
the first three) with two Pallas kernels (Triton backend) and a
`jax.custom_vjp`:

* forward: one program per block of `block_n` tokens loops over the
  vocabulary in blocks of `block_v` words; each block's scores
  `z = h W_blk + b_blk` are products over `block_d` slices of the hidden
  size, accumulated in float32, then the online log-sum-exp, the target's
  score, the score sum and the (first) argmax are updated;
* backward: one program per (token block, vocabulary block) recomputes
  the block's scores, forms
  `dg = (u_nll + u_lse) softmax - u_nll onehot(target) + u_sum` (the soft
  cap's chain rule applied by `jax.vjp` of the transform) and adds
  `dz W_blk` into `dh` and `dz^T h_blk` into `dW` (and `sum dz` into `db`)
  with float32 atomic adds, one `block_d` slice at a time.

With `filter_eps`, a backward block whose softmax values are all below
`filter_eps`, that holds none of its tokens' targets and whose tokens have
no score-sum cotangent (label smoothing) is skipped: its gradient terms
`(u_nll + u_lse) softmax` (each below `|u_nll + u_lse| filter_eps`) are
dropped. Off (None) by default: exact.

`pointwise_stats` (`fused.vocab_parallel`) is the one place that chooses
this kernel (`uses_kernel`). Design, block sizes, dispatch and filtering:
`docs/chunked.md`, "The Pallas GPU kernel".
"""

import functools

import keras
from keras import ops

from keras_softmax_heads.validation import check_number

#: Block sizes `(block_n, block_v, block_d)` on a GPU: 64 tokens x 128
#: words per score block (a 64 x 128 float32 accumulator per program),
#: products over 64-wide slices of the hidden size (Triton's `dot` wants
#: powers of two, at least 16).
GPU_BLOCKS = (64, 128, 64)

#: The input dtypes the kernel takes (float64 stays on the XLA path).
KERNEL_DTYPES = ("float16", "bfloat16", "float32")


def check_filter_eps(filter_eps):
    """`filter_eps` as a float in `(0, 1)`, or None; else raises."""
    return check_number(
        "filter_eps", filter_eps, low=0, high=1, low_open=True, allow_none=True
    )


def kernel_platform():
    """The platform the kernel would run on: JAX's default backend
    (`"gpu"`, `"cpu"`, `"tpu"`), or None off the JAX backend."""
    if keras.backend.backend() != "jax":
        return None
    import jax

    return jax.default_backend()


def uses_kernel(hidden, kernel, implementation, platform=None):
    """Whether `pointwise_stats` runs this kernel.

    `implementation="pallas"` always (it raises off the JAX backend or for
    float64 inputs; interpret mode off a GPU); `"auto"` on the JAX backend
    on a GPU platform (`platform`, default `kernel_platform()`) for float16,
    bfloat16 and float32 inputs; never for `"ops"`.
    """
    dtypes = {keras.backend.standardize_dtype(x.dtype) for x in (hidden, kernel)}
    if implementation == "pallas":
        if keras.backend.backend() != "jax" or dtypes - set(KERNEL_DTYPES):
            raise ValueError(
                "implementation='pallas' needs the JAX backend and float16, "
                "bfloat16 or float32 inputs. Received: backend="
                f"{keras.backend.backend()!r}, dtypes={sorted(dtypes)}"
            )
        return True
    if implementation != "auto" or dtypes - set(KERNEL_DTYPES):
        return False
    platform = kernel_platform() if platform is None else platform
    return keras.backend.backend() == "jax" and platform == "gpu"


def block_sizes(rows, vocab, dim, blocks=None):
    """`(block_n, block_v, block_d)`: `blocks` (default `GPU_BLOCKS`), each
    cut to the next power of two of the dimension when that is smaller
    (at least 16)."""
    def fit(block, size):
        return int(min(block, max(16, 1 << max(0, (size - 1).bit_length()))))

    bn, bv, bd = GPU_BLOCKS if blocks is None else blocks
    return fit(bn, rows), fit(bv, vocab), fit(bd, dim)


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
                 has_bias, filter_eps, interpret):
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


def forward_kernel(spec, h_ref, w_ref, *refs):
    """One token block: loops over the vocabulary blocks."""
    import jax
    import jax.numpy as jnp

    b_ref = refs[0] if spec.has_bias else None
    t_ref, nll_ref, lse_ref, sum_ref, arg_ref = refs[int(spec.has_bias):]
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
    run_max, run_sum, target, total, arg = jax.lax.fori_loop(0, num_v, body, init)
    lse = run_max + jnp.log(run_sum)
    nll_ref[...] = lse - target
    lse_ref[...] = lse
    sum_ref[...] = total
    arg_ref[...] = arg


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
    if spec.transform_fn is None:
        g, pullback = z, None
    else:
        g, pullback = jax.vjp(functools.partial(transformed, spec), z)
    g = jnp.where(valid, g, -jnp.inf)
    prob = jnp.exp(g - lse_ref[...][:, None])
    targets = t_ref[...]
    hit = cols[None, :] == targets[:, None]
    u_sum = sum_ref[...]
    dg = soft_ref[...][:, None] * prob - jnp.where(hit, one_ref[...][:, None], 0.0)
    dg = dg + jnp.where(valid, u_sum[:, None], 0.0)
    dz = dg if pullback is None else pullback(dg)[0]
    dz = jnp.where(valid, dz, 0.0)

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
        skip = jnp.logical_and(
            jnp.max(prob) < spec.filter_eps,
            jnp.logical_not(jnp.any(hit)),
        )
        skip = jnp.logical_and(skip, jnp.all(u_sum == 0.0))
        pl.when(jnp.logical_not(skip))(update)


def run_forward(spec, h, w, b, t):
    """The forward kernel on padded inputs: `(nll, lse, score_sum, argmax)`
    `[N_pad]`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    rows, dim = h.shape
    bn = spec.bn
    full = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)  # noqa: E731
    row_block = pl.BlockSpec((bn,), lambda i: (i,))
    in_specs = [pl.BlockSpec((bn, dim), lambda i: (i, 0)), full(w)]
    args = [h, w]
    if spec.has_bias:
        in_specs.append(full(b))
        args.append(b)
    in_specs.append(row_block)
    args.append(t)
    stat = jax.ShapeDtypeStruct((rows,), jnp.float32)
    return pl.pallas_call(
        functools.partial(forward_kernel, spec),
        grid=(rows // bn,),
        in_specs=in_specs,
        out_specs=[row_block] * 4,
        out_shape=[stat, stat, stat, jax.ShapeDtypeStruct((rows,), jnp.int32)],
        compiler_params=spec.params(num_warps=4),
        interpret=spec.interpret,
        name="linear_cross_entropy_forward",
    )(*args)


def run_backward(spec, h, w, b, t, lse, soft, one, u_sum):
    """The backward kernel on padded inputs: float32 `(dh, dW, db)` (`db`
    None without a bias)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    rows, dim = h.shape
    bn, bv = spec.bn, spec.bv
    vocab_pad = w.shape[0 if spec.kernel_transposed else 1]
    full = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)  # noqa: E731
    row_block = pl.BlockSpec((bn,), lambda i, j: (i,))
    in_specs = [pl.BlockSpec((bn, dim), lambda i, j: (i, 0)), full(w)]
    args = [h, w]
    if spec.has_bias:
        in_specs.append(full(b))
        args.append(b)
    in_specs += [row_block] * 5
    args += [t, lse, soft, one, u_sum]
    zeros = [jnp.zeros((rows, dim), jnp.float32), jnp.zeros(w.shape, jnp.float32)]
    if spec.has_bias:
        zeros.append(jnp.zeros((vocab_pad,), jnp.float32))
    first = len(args)
    in_specs += [full(z) for z in zeros]
    args += zeros
    out = pl.pallas_call(
        functools.partial(backward_kernel, spec),
        grid=(rows // bn, vocab_pad // bv),
        in_specs=in_specs,
        out_specs=[full(z) for z in zeros],
        out_shape=[jax_struct(z) for z in zeros],
        input_output_aliases={first + k: k for k in range(len(zeros))},
        compiler_params=spec.params(num_warps=8),
        interpret=spec.interpret,
        name="linear_cross_entropy_backward",
    )(*args)
    return out[0], out[1], (out[2] if spec.has_bias else None)


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
        dh, dw, db = run_backward(spec, h, w, b, t, lse, u_nll + u_lse, u_nll, u_sum)
        db = None if b is None else db.astype(b.dtype)
        return dh.astype(h.dtype), dw.astype(w.dtype), db, None

    stats.defvjp(fwd, bwd)
    return stats


def pallas_pointwise_stats(hidden, kernel, bias, targets, *, transform_fn=None,
                           kernel_transposed=False, filter_eps=None, blocks=None,
                           interpret=None):
    """`chunked.chunked_pointwise_stats` as a Pallas kernel (JAX only).

    The same statistics of `g = g(h W + b)` per token (`nll = lse -
    g_target`, `lse = logsumexp_v g_v`, `score_sum = sum_v g_v`, `argmax`),
    the same gradients (of `nll`, `lse` and `score_sum`, from the upstream
    cotangent per token, accumulated in float32), computed by the two
    kernels the module docstring describes. Inputs are padded (zeros; the
    padded words masked) to multiples of the block sizes where they are
    not already.

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
            module docstring for what is dropped).
        blocks: `(block_n, block_v, block_d)`, powers of two (default
            `GPU_BLOCKS`, cut to the problem).
        interpret: run the kernels in Pallas' interpret mode (default: when
            JAX's default backend is not a GPU).

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
    hidden = jnp.asarray(ops.convert_to_tensor(hidden))
    kernel = jnp.asarray(ops.convert_to_tensor(kernel))
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
    spec = KernelSpec(vocab, dim, blocks, transform_fn, kernel_transposed,
                      bias is not None, filter_eps, interpret)
    bn, bv, bd = blocks
    h = padded(padded(h, 0, bn), 1, bd)
    t = padded(t, 0, bn)
    v_axis = 0 if kernel_transposed else 1
    w = padded(padded(kernel, v_axis, bv), 1 - v_axis, bd)
    b = None
    if bias is not None:
        b = padded(jnp.asarray(ops.convert_to_tensor(bias)), 0, bv)
    nll, lse, total, arg = stats_fn(spec)(h, w, b, t)
    return tuple(x[:rows].reshape(lead) for x in (nll, lse, total, arg))
