"""The tiled core: exact `-log softmax(g(h W + b))[target]` over vocabulary tiles.

`pointwise_nll` is the one implementation of the algorithm, in `keras.ops`
inside a `keras.ops.custom_gradient`; what the backends do differently
(the transform's vector-Jacobian product, how a pass runs, JAX's
low-precision product) is named in `chunked.dispatch`. Per tile
`z = h W_tile + b_tile`, `g = g(z)`:

* forward (`forward_tile`): online log-sum-exp (a running max and sum per
  row), the target's score and, with `stats`, the score sum and argmax;
  with `entropy` also the running `sum_v exp(g_v - max) (g_v - max)`,
  rescaled with the running max like the sum, which gives the entropy
  `H = log(sum) - that / sum` and `E_p[g] = lse - H`;
* backward (`backward_tile`): the tile is recomputed,
  `dg = (u_nll + u_lse) softmax - u_nll onehot(target) + u_sum
  - u_H softmax (g - E_p[g])`, the
  vector-Jacobian product of `g` gives `dz` and the transform's parameter
  gradients, then `dh += dz W_tile^T` and the tile's kernel / bias
  gradient is written into place.

With `token_chunk_size` the tiles span at most that many rows too
(`blocked_forward`, `blocked_backward`): the forward pass runs per token
block, and the backward pass takes two passes, the kernel's (bias',
transform parameters') gradient per vocabulary tile summed over the token
blocks, then `h`'s per token block summed over the vocabulary tiles: no
`[N, d]` float32 accumulator, one more recomputation of the scores.

Tile order and masks: `chunked.tiling`. Design notes: `docs/chunked.md`
("Token blocks" for the blocked passes); the entropy:
`docs/token_statistics.md`.
"""

import copy

import keras
import numpy as np
from keras import ops

from keras_softmax_heads.chunked import dispatch
from keras_softmax_heads.chunked.tiling import Tiling
from keras_softmax_heads.chunked.tiling import kernel_geometry


def accumulation_dtype(*tensors):
    """`"float64"` if any of `tensors` is float64, else `"float32"`."""
    for t in tensors:
        if t is not None and keras.backend.standardize_dtype(t.dtype) == "float64":
            return "float64"
    return "float32"


class TileProblem:
    """What every tile function reads: the static geometry, the inputs (as
    the custom gradient received them) and the transform.

    Built inside the custom-gradient function from its arguments: JAX's
    custom gradients must not close over values traced outside them.
    """

    def __init__(self, spec, h, kernel, bias, targets, params):
        self.spec = spec
        self.tiling = spec.tiling
        self.acc = spec.acc
        self.h = h
        self.kernel = kernel
        # Tiles in the accumulation dtype (None: the product takes them as is).
        self.read_tile = None
        if spec.low_matmul is None:
            self.read_tile = dispatch.tile_reader(kernel, spec.acc, spec.implementation)
        self.bias = bias
        self.targets = targets
        self.params = params
        # The kernel gradient's tile write and finish (`zero_gradients`).
        self.write_gradient = self.finish_gradient = None
        self.tail_mask = None
        if self.tiling.overlap:
            self.tail_mask = ops.convert_to_tensor(self.tiling.tail_mask(), spec.acc)
        self.token_tiling, self.rows = token_tiling(spec.token_chunk_size, h)
        self.h_blocks = self.read_rows = None
        # `h` as the products take it: the low-precision product in its own
        # dtype, else widened to the accumulation dtype.
        self.h_acc = None
        if self.token_tiling is None:
            self.h_acc = h if spec.low_matmul else ops.cast(h, spec.acc)
        else:
            # `h` as the blocks read it: padded to whole blocks if `N` is not static.
            self.h_blocks = h
            if self.rows is not None:
                self.h_blocks = pad_rows(h, self.padding)
                self.targets = pad_rows(targets, self.padding)
            # Each block widens its own rows (`token_block`), as tiles of the
            # kernel are: no float32 copy of a low-precision `h` either.
            self.read_rows = (
                (lambda begin, size: ops.slice(self.h_blocks, begin, size)) if spec.low_matmul
                else dispatch.tile_reader(self.h_blocks, spec.acc, spec.implementation))

    @property
    def blocked(self):
        """Whether the passes run over token blocks (`blocked_forward`)."""
        return self.token_tiling is not None

    @property
    def block_rows(self):
        """The rows of the blocked passes' buffers: `N`, or `N` padded to
        whole blocks (a tensor) when `N` is not static."""
        tiling = self.token_tiling
        return tiling.vocab if self.rows is None else tiling.num_full * tiling.size

    @property
    def padding(self):
        """The padding rows (0 when `N` is static)."""
        return 0 if self.rows is None else self.block_rows - self.rows

    def transform(self, z, *values):
        """`g(z)` in the accumulation dtype; listed variables read `values`."""
        spec = self.spec
        if not spec.mapped:
            return ops.cast(spec.transform_fn(z, *values), self.acc)
        mapping = [(spec.variables[j], values[j]) for j in spec.mapped]
        with keras.StatelessScope(state_mapping=mapping, initialize_variables=False):
            return ops.cast(spec.transform_fn(z, *values), self.acc)


class CoreSpec:
    """The static description of one call of the core (no tensors)."""

    def __init__(self, d, tiling, acc, low_matmul, transform_fn, variables,
                 kernel_transposed, has_bias, stats, implementation="auto",
                 entropy=False, token_chunk_size=None, gradients=(True, True)):
        self.d = d
        # Whether `h` and the kernel get gradients (`dispatch.needs_gradient`):
        # the backward pass skips the products of one nobody asks for.
        self.hidden_gradient, self.kernel_gradient = (bool(g) for g in gradients)
        self.tiling = tiling
        # At most this many rows per tile (None: every tile spans all rows).
        self.token_chunk_size = token_chunk_size
        self.acc = acc
        self.low_matmul = low_matmul
        # The tiles' products: in the inputs' low-precision dtype with float32
        # results where the backend has that, else on float32 (float64) tiles.
        self.product = low_matmul or dispatch.matmul_fn(acc)
        self.transform_fn = transform_fn
        self.variables = variables
        self.mapped = [j for j, v in enumerate(variables) if v is not None]
        self.kernel_transposed = kernel_transposed
        self.has_bias = has_bias
        self.stats = stats
        self.implementation = implementation
        self.entropy = entropy  # stats mode with a fifth column, the entropy


def token_tiling(token_chunk_size, h):
    """`(tiling, rows)`: the token blocks of `h` `[N, d]` (a `Tiling` of its
    rows, or None: one block) and None; or, when `N` is not static (a
    TensorFlow graph's batch), blocks of `token_chunk_size` rows, their
    count a tensor, and `N` (a tensor): the rows are then padded to whole
    blocks (`pad_rows`)."""
    if token_chunk_size is None:
        return None, None
    rows = h.shape[0]
    if rows is not None:
        if rows <= token_chunk_size:
            return None, None
        return Tiling.of(rows, token_chunk_size), None
    rows = ops.shape(h)[0]
    count = (rows + token_chunk_size - 1) // token_chunk_size
    return Tiling(None, token_chunk_size, count, 0), rows


def pad_rows(x, pad):
    """`x` with `pad` (maybe a tensor) rows of zeros appended."""
    return ops.concatenate([x, ops.zeros((pad,) + tuple(x.shape[1:]), x.dtype)], axis=0)


def vocabulary_loop(p, body, state):
    """`state = body(state, start, mask, skip)` over `p`'s vocabulary tiles,
    in their order (`chunked.tiling`): the masked tail tile first (its
    mask, `skip` = its overlap), then the full tiles (`None`, 0)."""
    tiling = p.tiling
    if tiling.overlap:
        state = body(state, tiling.tail_start, p.tail_mask, tiling.overlap)
    return tile_loop(
        tiling.num_full, lambda i, state: body(state, i * tiling.size, None, 0), state)


def tile_loop(count, body, state):
    """`state = body(i, state)` for `i` in `range(count)`: one call with a
    Python 0 for a single tile, else `keras.ops.fori_loop` (`count` may be
    a tensor)."""
    if isinstance(count, int) and count == 1:
        return body(0, state)
    return ops.fori_loop(0, count, body, state)


def linear_tile(p, start, mask):
    """`(z, w)`: `z = h W_tile + b_tile` `[N, size]` and the kernel tile, in
    the accumulation dtype. For the identity transform `mask` (the tail
    tile's) rides on the bias add."""
    spec, size = p.spec, p.tiling.size
    if spec.kernel_transposed:
        begin, shape = [start, 0], [size, spec.d]
    else:
        begin, shape = [0, start], [spec.d, size]
    if p.read_tile is None:
        w = ops.slice(p.kernel, begin, shape)
    else:
        w = p.read_tile(begin, shape)
    z = spec.product(p.h_acc, ops.transpose(w) if spec.kernel_transposed else w)
    shift = None
    if spec.has_bias:
        shift = ops.cast(ops.slice(p.bias, [start], [size]), p.acc)
    if mask is not None and spec.transform_fn is None:
        shift = mask if shift is None else shift + mask
    if shift is not None:
        z = z + shift
    return z, w


def target_columns(p, start, skip):
    """`(col, inside)`: each target's column in the tile starting at
    `start` (clipped into it) and whether it is one of the tile's unmasked
    columns (`skip` leading columns are masked)."""
    col = p.targets - start
    inside = ops.logical_and(col >= skip, col < p.tiling.size)
    return ops.clip(col, 0, p.tiling.size - 1), inside


def finite_scores(g, mask):
    """`g` with the masked columns (`-inf`, `mask` not None) set to 0, so
    that `p * g` is 0 there rather than NaN."""
    if mask is None:
        return g
    return ops.where(mask[None, :] == 0, g, ops.zeros_like(g))


def forward_tile(p, state, start, mask, skip):
    """One tile of the forward pass: `state` is `(run_max, run_sum,
    target_score)`, plus `(score_sum, argmax)` with `stats` and
    `run_shifted` (`sum_v exp(g_v - max) (g_v - max)`) with `entropy`, all
    `[N]`."""
    run_max, run_sum, target_score = state[:3]
    z, _ = linear_tile(p, start, mask)
    g = z
    if p.spec.transform_fn is not None:
        g = p.transform(z, *p.params)
        if mask is not None:
            g = g + mask
    tile_max = ops.max(g, axis=1)
    extra = ()
    if p.spec.stats:
        score_sum, run_arg = state[3:5]
        # `skip` is static here: the masked columns are left out.
        score_sum = score_sum + ops.sum(g[:, skip:] if skip else g, axis=1)
        tile_arg = ops.cast(ops.argmax(g, axis=1), p.acc) + ops.cast(start, p.acc)
        # The first maximal word wins (the tail tile comes first).
        better = ops.logical_or(
            tile_max > run_max,
            ops.logical_and(tile_max == run_max, tile_arg < run_arg),
        )
        extra = (score_sum, ops.where(better, tile_arg, run_arg))
    # Not `ops.maximum`: Keras' PyTorch backend returns float32 for it.
    new_max = ops.where(tile_max > run_max, tile_max, run_max)
    # Rows whose scores are all -inf so far: avoid (-inf) - (-inf).
    safe_max = ops.where(ops.isfinite(new_max), new_max, ops.zeros_like(new_max))
    scale = ops.exp(run_max - safe_max)
    if not p.spec.entropy:  # (on PyTorch the exponential in place of the difference)
        e = dispatch.shifted_exp(g, safe_max)
    else:
        shifted = g - safe_max[:, None]
        e = ops.exp(shifted)
        # sum e (g - m'), rescaled from the old max m: the old sum of
        # e (g - m) becomes scale (old - (m' - m) run_sum); no term while
        # the row is all -inf (run_sum = 0).
        run_shifted = state[5]
        step = ops.where(ops.isfinite(run_max), safe_max - run_max,
                         ops.zeros_like(run_max))
        run_shifted = scale * (run_shifted - step * run_sum) + ops.sum(
            e * finite_scores(shifted, mask), axis=1
        )
        extra = extra + (run_shifted,)
    run_sum = run_sum * scale + ops.sum(e, axis=1)
    col, inside = target_columns(p, start, skip)
    picked = ops.take_along_axis(g, col[:, None], axis=1)[:, 0]
    target_score = target_score + ops.where(inside, picked, ops.zeros_like(picked))
    return (new_max, run_sum, target_score) + extra


def forward(p):
    """`(out, saved)`: `out` is the nll `[N]` (with `stats` `[N, 4]`: nll,
    lse, score_sum, argmax; with `entropy` `[N, 5]`, the entropy last) and
    `saved` what the backward pass reads: `(lse,)`, with `entropy`
    `(lse, E_p[g])`, each `[N]`."""
    zeros = ops.zeros_like(p.targets, dtype=p.acc)
    state = (ops.full_like(p.targets, float("-inf"), dtype=p.acc), zeros, zeros)
    if p.spec.stats:
        state += (zeros, zeros)
    if p.spec.entropy:
        state += (zeros,)
    state = vocabulary_loop(
        p, lambda state, start, mask, skip: forward_tile(p, state, start, mask, skip), state)
    run_max, run_sum, target_score = state[:3]
    lse = run_max + ops.log(run_sum)
    nll = lse - target_score
    if p.spec.entropy:
        # H = lse - E_p[g] = log(sum) - sum e (g - max) / sum.
        entropy = ops.log(run_sum) - state[5] / run_sum
        out = ops.stack([nll, lse, state[3], state[4], entropy], axis=1)
        return out, (lse, lse - entropy)
    if p.spec.stats:
        return ops.stack([nll, lse, state[3], state[4]], axis=1), (lse,)
    return nll, (lse,)


class Cotangents:
    """The backward pass's per-row weights of `softmax`, `onehot(target)`,
    the constant term in `dg` (None: no sum term) and, with `entropy`, the
    entropy's cotangent and `E_p[g]` (else None)."""

    def __init__(self, upstream, acc, stats, entropy=False, mean=None):
        upstream = ops.cast(upstream, acc)
        self.entropy, self.mean = None, None
        if stats:  # d/dg of u_nll nll + u_lse lse + u_sum score_sum (+ u_H H)
            self.soft = upstream[:, 0] + upstream[:, 1]
            self.onehot = upstream[:, 0]
            self.sum = upstream[:, 2]
            if entropy:
                self.entropy, self.mean = upstream[:, 4], mean
        else:
            self.soft, self.onehot, self.sum = upstream, upstream, None


def score_gradient(p, g, lse, cot, start, mask, skip):
    """`dg = soft softmax - onehot onehot(target) (+ sum)
    (- u_H softmax (g - E_p[g]))` of one tile; the masked columns have
    `g = -inf`, hence no softmax and no gradient."""
    col, inside = target_columns(p, start, skip)
    # A target outside the tile: nothing subtracted at its clipped column.
    onehot = ops.where(inside, cot.onehot, ops.zeros_like(cot.onehot))
    if cot.entropy is None:
        dg = dispatch.scaled_minus_target(dispatch.shifted_exp(g, lse), cot.soft, col, onehot)
    else:  # dH/dg_v = -p_v (g_v - E_p[g])
        centred = finite_scores(g - cot.mean[:, None], mask)
        weight = cot.soft[:, None] - cot.entropy[:, None] * centred
        dg = dispatch.scaled_minus_target(ops.exp(g - lse[:, None]) * weight, None, col, onehot)
    if cot.sum is not None:
        if mask is None:
            dg = dg + cot.sum[:, None]
        else:  # not on the masked columns
            dg = ops.where(mask[None, :] == 0, dg + cot.sum[:, None], dg)
    return dg


def tile_score_gradient(p, lse, cot, dparams, start, mask, skip):
    """`(dz, w, dparams)`: one tile's recomputed score gradient `dz`
    `[rows, size]` (through the transform's vector-Jacobian product), its
    kernel tile, and `dparams` plus the tile's transform-parameter
    gradients (`dparams=None`: the product w.r.t. `z` only, None
    returned)."""
    spec = p.spec
    z, w = linear_tile(p, start, mask)
    if spec.transform_fn is not None:
        if dparams is None:
            g, pullback = dispatch.value_and_vjp(
                lambda z: p.transform(z, *p.params), [z])
        else:
            g, pullback = dispatch.value_and_vjp(p.transform, [z] + p.params)
        if mask is not None:
            g = g + mask
    else:
        g = z
    dz = score_gradient(p, g, lse, cot, start, mask, skip)
    if spec.transform_fn is not None:
        grads = pullback(dz)
        dz = ops.cast(grads[0], p.acc)
        if dparams is not None:
            dparams = [a + ops.cast(g_p, p.acc) for a, g_p in zip(dparams, grads[1:])]
    return dz, w, dparams


def backward_tile(p, lse, cot, state, start, mask, skip):
    """One tile of the backward pass: `state` is `(dh, dparams, dkernel,
    dbias)`; the tile's kernel and bias gradient columns are complete here
    and written into place in the kernel's / bias' own dtype."""
    dh, dparams, dkernel, dbias = state
    dz, w, dparams = tile_score_gradient(p, lse, cot, dparams, start, mask, skip)
    dh, dkernel, dbias = project_tile_gradient(p, dz, w, start, dh, dkernel, dbias)
    return dh, dparams, dkernel, dbias


def project_tile_gradient(p, dz, w, start, dh, dkernel, dbias):
    """`(dh, dkernel, dbias)` after one tile's score gradient `dz`
    `[N, size]`: `dh += dz W_tile^T`, and the tile's kernel and bias
    gradient columns written into place (`zero_gradients` made the
    buffers)."""
    if p.spec.hidden_gradient:
        dh = dh + hidden_tile_gradient(p, dz, w)
    if p.spec.kernel_gradient:
        dkernel = p.write_gradient(dkernel, kernel_begin(p, start), kernel_tile_gradient(p, dz))
    if p.spec.has_bias:
        db = ops.cast(ops.sum(dz, axis=0), dbias.dtype)
        dbias = ops.slice_update(dbias, [start], db)
    return dh, dkernel, dbias


def hidden_tile_gradient(p, dz, w):
    """`dz W_tile^T` `[rows, d]`: a tile's part of the gradient of `h`."""
    if p.spec.kernel_transposed:  # w: [size, d]
        return p.spec.product(dz, w)
    return p.spec.product(dz, ops.transpose(w))  # w: [d, size]


def kernel_tile_gradient(p, dz):
    """The tile's kernel gradient from `dz` `[rows, size]` and the rows'
    `h`: `[size, d]` (transposed kernel) or `[d, size]`."""
    if p.spec.kernel_transposed:
        return p.spec.product(ops.transpose(dz), p.h_acc)
    return p.spec.product(ops.transpose(p.h_acc), dz)


def kernel_begin(p, start):
    """Where the tile starting at word `start` begins in the kernel."""
    return [start, 0] if p.spec.kernel_transposed else [0, start]


def zero_gradients(p):
    """`(dh, dkernel, dbias)`: the zero gradient buffers of `h` (a float32
    accumulator), the kernel and the bias (`kernel_gradient_buffers`)."""
    dh = ops.zeros((), p.acc)  # a placeholder without a gradient: loops carry no None
    if p.spec.hidden_gradient:
        dh = dispatch.zeros_like(p.h, p.acc, p.spec.implementation)
    return (dh,) + kernel_gradient_buffers(p)


def kernel_gradient_buffers(p):
    """`(dkernel, dbias)`: the zero gradient buffers of the kernel
    (`dispatch.gradient_writer`'s, which also sets `p.write_gradient` and
    `p.finish_gradient`; a scalar placeholder without a kernel gradient)
    and the bias (a scalar without one)."""
    if p.spec.kernel_gradient:
        dkernel, p.write_gradient, p.finish_gradient = dispatch.gradient_writer(
            p.kernel, p.spec.implementation)
    else:
        dkernel = ops.zeros((), p.acc)
    dbias = ops.zeros((), p.acc)
    if p.spec.has_bias:
        dbias = ops.zeros((p.tiling.vocab,), p.bias.dtype)
    return dkernel, dbias


def projection_gradients(p, dh, dkernel, dbias):
    """The gradients of `h`, the kernel and the bias (if any), in their
    dtypes, from the buffers of `zero_gradients` (None for one nobody asks
    for: `CoreSpec.hidden_gradient`, `kernel_gradient`)."""
    spec = p.spec
    grads = [ops.cast(dh, p.h.dtype) if spec.hidden_gradient else None,
             ops.cast(p.finish_gradient(dkernel), p.kernel.dtype)
             if spec.kernel_gradient else None]
    if p.spec.has_bias:
        grads.append(ops.cast(dbias, p.bias.dtype))
    return grads


def backward(p, saved, upstream):
    """The gradients of `h`, the kernel, the bias (if any) and the
    transform's parameters, in their dtypes; `saved` is `forward`'s."""
    spec = p.spec
    lse, mean = saved[0], (saved[1] if len(saved) > 1 else None)
    cot = Cotangents(upstream, p.acc, spec.stats, spec.entropy, mean)
    dh, dkernel, dbias = zero_gradients(p)
    state = (dh, [ops.zeros(x.shape, p.acc) for x in p.params], dkernel, dbias)
    dh, dparams, dkernel, dbias = vocabulary_loop(
        p, lambda state, start, mask, skip: backward_tile(
            p, lse, cot, state, start, mask, skip), state)
    grads = projection_gradients(p, dh, dkernel, dbias)
    return grads + [ops.cast(g, x.dtype) for g, x in zip(dparams, p.params)]


def row_slice(x, start, size):
    """Rows `[start, start + size)` of `x` (`start` may be traced)."""
    return ops.slice(x, [start] + [0] * (len(x.shape) - 1), [size] + list(x.shape[1:]))


def token_block(p, start):
    """`p` restricted to the token block of `token_tiling.size` rows
    starting at row `start` (its `h` and targets; the rest is shared)."""
    q = copy.copy(p)
    size = p.token_tiling.size
    q.h_acc = p.read_rows([start, 0], [size, p.spec.d])
    q.targets = row_slice(p.targets, start, size)
    return q


def token_loop(tiling, body, state, tail=None):
    """`body(start, state)` over the blocks of `tiling` (a `Tiling` of rows
    or words): the overlapping tail block first (`tail(start, state)`, or
    `body`), then the full blocks in order."""
    if tiling.overlap:
        state = (tail or body)(tiling.tail_start, state)
    return tile_loop(tiling.num_full, lambda i, state: body(i * tiling.size, state), state)


def blocked_forward(p):
    """`forward` over token blocks (each a whole pass over the vocabulary
    tiles, `[rows, size]` tiles): the same `(out, saved)`. The tail block's
    overlapping rows are computed again and overwritten by the block that
    owns them."""
    n = p.block_rows
    columns = (5 if p.spec.entropy else 4) if p.spec.stats else None
    out = ops.zeros((n,) if columns is None else (n, columns), p.acc)
    saved = [ops.zeros((n,), p.acc) for _ in range(2 if p.spec.entropy else 1)]

    def block(start, state):
        out_b, saved_b = forward(token_block(p, start))
        return tuple(ops.slice_update(buf, [start] + [0] * (len(buf.shape) - 1), v)
                     for buf, v in zip(state, (out_b,) + tuple(saved_b)))

    out, *saved = token_loop(p.token_tiling, block, (out, *saved))
    if p.rows is not None:  # the padding rows' results dropped
        out = row_slice(out, 0, p.rows)
    return out, tuple(saved)


def block_cotangents(cot, start, size, keep=None):
    """The `Cotangents` of the `size` rows from `start`; `keep` (`[size]`
    bool, or None) zeroes the rows it marks False (the tail block's
    overlap)."""
    block = copy.copy(cot)
    for name in ("soft", "onehot", "sum", "entropy", "mean"):
        value = getattr(cot, name)
        if value is not None:
            value = row_slice(value, start, size)
            if keep is not None and name != "mean":
                value = ops.where(keep, value, ops.zeros_like(value))
        setattr(block, name, value)
    return block


def blocked_backward(p, saved, upstream):
    """`backward` in two passes over `[rows, size]` tiles, neither holding a
    float32 `[N, d]` accumulator: (1) per vocabulary tile, its kernel, bias
    and transform-parameter gradients summed over the token blocks
    (`[size, d]` accumulator); (2) per token block, its `h` gradient summed
    over the vocabulary tiles (`[rows, d]` accumulator), written into
    place. The scores are recomputed in each pass: five `N d V` products
    per step instead of four. A pass whose gradients nobody asks for
    (`CoreSpec.hidden_gradient`; the kernel's, with no bias and no
    transform parameters) is skipped, and so is a frozen kernel's product."""
    spec, tiling, rows = p.spec, p.tiling, p.token_tiling
    lse, mean = saved[0], (saved[1] if len(saved) > 1 else None)
    if p.rows is not None:  # no cotangent on the padding rows
        upstream = pad_rows(upstream, p.padding)
    cot = Cotangents(upstream, p.acc, spec.stats, spec.entropy, mean)
    dkernel, dbias = kernel_gradient_buffers(p)
    # The tail block's rows before `overlap` belong to another block.
    keep = ops.convert_to_tensor(np.arange(rows.size) >= rows.overlap)

    def block_views(start, tail):
        return (token_block(p, start), row_slice(lse, start, rows.size),
                block_cotangents(cot, start, rows.size, keep if tail else None))

    def vocab_tile(state, start, mask, skip):  # pass 1
        dparams, dkernel, dbias = state

        def add_block(t_start, acc_state, tail=False):
            dw, db, dparams = acc_state
            q, lse_b, cot_b = block_views(t_start, tail)
            dz, _, dparams = tile_score_gradient(q, lse_b, cot_b, dparams, start, mask, skip)
            if spec.kernel_gradient:
                dw = dw + kernel_tile_gradient(q, dz)
            if spec.has_bias:
                db = db + ops.sum(dz, axis=0)
            return dw, db, dparams

        shape = (tiling.size, spec.d) if spec.kernel_transposed else (spec.d, tiling.size)
        db = ops.zeros((tiling.size,) if spec.has_bias else (), p.acc)
        dw = ops.zeros(shape if spec.kernel_gradient else (), p.acc)
        dw, db, dparams = token_loop(
            rows, add_block, (dw, db, dparams),
            tail=lambda t_start, acc_state: add_block(t_start, acc_state, tail=True))
        if spec.kernel_gradient:
            dkernel = p.write_gradient(dkernel, kernel_begin(p, start), dw)
        if spec.has_bias:
            dbias = ops.slice_update(dbias, [start], ops.cast(db, dbias.dtype))
        return dparams, dkernel, dbias

    def hidden_block(t_start, dh):  # pass 2
        q, lse_b, cot_b = block_views(t_start, False)

        def add_tile(dh_b, start, mask, skip):
            dz, w, _ = tile_score_gradient(q, lse_b, cot_b, None, start, mask, skip)
            return dh_b + hidden_tile_gradient(q, dz, w)

        dh_b = vocabulary_loop(q, add_tile, ops.zeros((rows.size, spec.d), p.acc))
        return write_dh(dh, [t_start, 0], dh_b)

    dparams = [ops.zeros(x.shape, p.acc) for x in p.params]
    if spec.kernel_gradient or spec.has_bias or p.params:
        dparams, dkernel, dbias = vocabulary_loop(p, vocab_tile, (dparams, dkernel, dbias))
    dh = None
    if spec.hidden_gradient:
        # `h`'s gradient is written block by block in its own dtype (like the
        # kernel's: a bfloat16 `h` has no float32 `[N, d]` buffer either).
        dh, write_dh, finish_dh = dispatch.gradient_writer(p.h_blocks, spec.implementation)
        dh = finish_dh(token_loop(rows, hidden_block, dh))
        if p.rows is not None:
            dh = row_slice(dh, 0, p.rows)
    grads = projection_gradients(p, dh, dkernel, dbias)
    return grads + [ops.cast(g, x.dtype) for g, x in zip(dparams, p.params)]


def unlisted_variables_error(variables):
    return ValueError(
        "The `transform_fn` of a chunked loss read trainable variables it "
        f"was not given: {[v.name for v in variables]}. Pass them in "
        "`transform_params`."
    )


def pointwise_nll(h, kernel, bias, targets, transform_fn, params, variables,
                  chunk_size, kernel_transposed, stats=False, implementation="auto",
                  entropy=False, token_chunk_size=None):
    """Flat core: h `[N, d]`, targets `[N]` int32 -> nll `[N]` (acc dtype).

    With `stats=True` the result is `[N, 4]`: the columns `nll`, `lse`
    (`logsumexp_v g_v`), `score_sum` (`sum_v g_v`) and `argmax` (the word of
    the largest score, as a float: exact below 2**24 words). The first three
    are differentiable (their cotangents combine in one backward pass), the
    argmax gets no gradient. With `entropy=True` (and `stats=True`) a fifth
    column, the entropy `H = lse - E_p[g]` of `softmax(g)`, is accumulated
    online and differentiable too (`dH/dg_v = -p_v (g_v - E_p[g])`, in the
    same backward pass); without it the pass computes nothing for it.

    `params` are tensors, `variables[j]` the Keras variable `params[j]` was
    read from (or None): while `transform_fn` runs, reading that variable
    gives `params[j]` (a `keras.StatelessScope`). A trainable variable the
    transform reads without it being listed is an error on TensorFlow (the
    only backend that sees the read). `implementation` picks how the passes
    run (`dispatch.run_pass`).
    """
    d, vocab = kernel_geometry(h, kernel, kernel_transposed)
    has_bias = bias is not None
    spec = CoreSpec(
        d=d,
        tiling=Tiling.of(vocab, chunk_size),
        acc=accumulation_dtype(h, kernel),
        low_matmul=dispatch.low_precision_matmul(h, kernel),
        transform_fn=transform_fn,
        variables=variables,
        kernel_transposed=kernel_transposed,
        has_bias=has_bias,
        stats=stats,
        implementation=implementation,
        entropy=bool(entropy),
        token_chunk_size=token_chunk_size,
        gradients=dispatch.gradients_needed(h, kernel),
    )
    if spec.entropy and not stats:
        raise ValueError("`entropy=True` needs `stats=True` (the fifth column).")

    @ops.custom_gradient
    def nll_fn(targets, *args):
        bias = args[2] if has_bias else None
        p = TileProblem(spec, args[0], args[1], bias, targets,
                        list(args[2 + int(has_bias):]))
        blocked = p.blocked
        out, saved = dispatch.run_pass(
            lambda: (blocked_forward if blocked else forward)(p), implementation)

        def grad_fn(*args, upstream=None, variables=None):
            # TensorFlow and JAX call grad_fn(upstream); PyTorch
            # grad_fn(*inputs, upstream=upstream).
            if variables:
                raise unlisted_variables_error(variables)
            if upstream is None:
                (upstream,) = args
            grads = dispatch.run_pass(
                lambda: (blocked_backward if blocked else backward)(p, saved, upstream),
                implementation)
            return (None, *grads)  # None: the int targets

        return out, grad_fn

    args = [h, kernel] + ([bias] if has_bias else []) + list(params)
    return nll_fn(targets, *args)


def linear_problem(h, kernel, bias, targets, chunk_size, implementation="auto"):
    """The `TileProblem` of Linear-Softmax (no transform) on flat `h` `[N, d]`
    and a `[d, V]` kernel, both gradients wanted: what `linear_nll_forward`
    and `linear_nll_backward` run, for a caller that writes its own custom
    gradient around the passes (e.g. a head scoring blocks of rows)."""
    d, vocab = kernel_geometry(h, kernel, False)
    spec = CoreSpec(
        d=d, tiling=Tiling.of(vocab, chunk_size), acc=accumulation_dtype(h, kernel),
        low_matmul=dispatch.low_precision_matmul(h, kernel), transform_fn=None,
        variables=[], kernel_transposed=False, has_bias=bias is not None, stats=False,
        implementation=implementation, gradients=(True, True),
    )
    return TileProblem(spec, h, kernel, bias, targets, [])


def linear_nll_forward(h, kernel, bias, targets, chunk_size, implementation="auto"):
    """`(nll, lse)`, each `[N]` (accumulation dtype): the forward pass of
    `-log_softmax(h W + b)[target]` over vocabulary tiles, no gradient."""
    p = linear_problem(h, kernel, bias, targets, chunk_size, implementation)
    nll, (lse,) = dispatch.run_pass(lambda: forward(p), implementation)
    return nll, lse


def linear_nll_backward(h, kernel, bias, targets, lse, upstream, chunk_size,
                        implementation="auto"):
    """`[dh, dkernel]` (plus `dbias` with a bias), in the inputs' dtypes: the
    gradients of `sum(upstream * nll)`, the tiles recomputed from the
    forward pass's `lse` (`linear_nll_forward`)."""
    p = linear_problem(h, kernel, bias, targets, chunk_size, implementation)
    return dispatch.run_pass(lambda: backward(p, (lse,), upstream), implementation)
