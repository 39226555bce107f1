"""PLIF's tiled kernels on PyTorch: loops over tiles, in place.

PyTorch runs PLIF op by op. Each `keras.ops` call allocates a fresh tensor
of the tile's size, and on a CPU the stacked tiles of a `keras.ops.scan`
are one more copy of the whole output. Here every tile's work is done in
a few scratch buffers allocated once per call, and each tile's result is
written straight into its rows of the output (`out=` and in-place ops):
the interval index and offset share one buffer, the PLIF score is one
`addcmul_`, the softmax gradient is formed in the output's rows, and the
slopes' two histograms are `scatter_add_`s into the same two `[K]`
vectors, tile after tile (int64 indices in the backward pass: PyTorch's
`scatter_add_` takes no others, and it is faster than `index_add_`). On
one CPU thread, N = 2,048, V = 10,000, PLIFSoftmax's training step took
1.47-1.55x FullSoftmax's where the per-tile `ops.scan` it replaced took
1.68-1.85x (`docs/plif.md`).

* `log_likelihood`, `log_likelihood_gradient`: `plif_log_likelihood`'s
  forward and backward pass over row tiles;
* `plif`, `plif_gradient`: `plif`'s, over tiles of the flat scores;
* `scores`: `plif_scores` (the summed mixtures differentiate PLIF
  themselves);
* `softmax_gradient_`: `u (onehot - softmax)` in place.

They compute the formulas of `plif_kernels` (`_interval`, `_offset`,
`_scores`, `_ll_tile`, `_ll_tile_grad`, `_plif_tile`, `_plif_tile_grad`),
their `keras.ops` reference, against which `tests/test_plif.py` checks
them. They are called from `dispatch` (`torch_tiled_kernel`,
`torch_plif_scores`, `softmax_score_gradient`), outside a recorded
autograd graph (`dispatch.uses_torch_tiles`: PLIF's custom gradient
computes its own).
"""

import torch


class _Scratch:
    """One tile's buffers, `size` elements each: the position (then the
    offset) in the scores' dtype, the interval index (`index_dtype`) and the
    slope in the slope table's."""

    def __init__(self, size, scores, index_dtype, slopes):
        self.position = scores.new_empty(size)
        self.index = torch.empty(size, dtype=index_dtype, device=scores.device)
        self.slope = slopes.new_empty(size)

    def of(self, z):
        """The buffers' first `z.numel()` elements, shaped as `z`."""
        n = z.numel()
        return tuple(b[:n].view(z.shape) for b in (self.position, self.index, self.slope))


def _interval(z, slopes, knot_bound, position, index, slope):
    """`(slope, flat idx, offset)` of the scores `z`, in the buffers given
    (of `z`'s shape): `idx = clip(int(clip(floor((z + T) / w), 0, K - 1)),
    0, K - 1)`, `offset = z - (-T + w idx)`, `slope = slopes[idx]`
    (`plif_kernels._interval`, `_offset`)."""
    num_knots = slopes.shape[0]
    width = 2.0 * knot_bound / num_knots
    torch.add(z, knot_bound, out=position)
    position.div_(width).floor_().clamp_(0.0, num_knots - 1.0)
    # The integer clamp sends NaN (cast to an arbitrary integer) into range.
    index.copy_(position).clamp_(0, num_knots - 1)
    # `position` holds float(idx) (NaN where `z` is NaN, whose offset is NaN
    # either way): the offset `z - (-T + w idx)` in its buffer.
    offset = position.mul_(width).add_(-knot_bound).neg_().add_(z)
    flat = index.view(-1)
    torch.index_select(slopes, 0, flat, out=slope.view(-1))
    return slope, flat, offset


def _scores_into(out, z, slopes, left_values, knot_bound, buffers):
    """PLIF scores `f = left[idx] + slope[idx] offset` of `z` written into
    `out` (`z`'s shape); returns `(f, slope, flat idx, offset)`."""
    slope, flat, offset = _interval(z, slopes, knot_bound, *buffers)
    torch.index_select(left_values, 0, flat, out=out.view(-1))
    return out.addcmul_(slope, offset), slope, flat, offset


def scores(z, slopes, left_values, knot_bound):
    """`(f, slope, idx, offset)` of scores `z` of any shape, as
    `plif_kernels.plif_scores` (`idx` int32 of `z`'s shape); for the
    summed passes that differentiate PLIF themselves
    (`chunked.summed_mixture`)."""
    z = z.contiguous()
    buffers = _Scratch(z.numel(), z, torch.int32, slopes).of(z)
    out = torch.empty_like(z, dtype=left_values.dtype)
    f, slope, _, offset = _scores_into(out, z, slopes, left_values, knot_bound, buffers)
    return f, slope, buffers[1], offset


def softmax_gradient_(shifted, targets, upstream):
    """`u (onehot - exp(shifted))` in `shifted`'s buffer, which holds the
    scores less their log-normaliser `[n, V]`: `exp_`, scaled by `-u`, and
    `u` added at each row's target by one `scatter_add_` (no `[n, V]`
    one-hot). Used by `log_likelihood_gradient` and by
    `dispatch.softmax_score_gradient` on PyTorch."""
    shifted.exp_().mul_(torch.neg(upstream)[:, None])
    return shifted.scatter_add_(1, targets.long()[:, None], upstream[:, None].to(shifted.dtype))


def _tiles(rows, tile_rows):
    """`(start, stop)` of each tile of `tile_rows` rows (the last one shorter)."""
    return [(start, min(start + tile_rows, rows)) for start in range(0, rows, tile_rows)]


def log_likelihood(z, targets, slopes, left_values, knot_bound, tile_rows):
    """`(lse [M], log-likelihood [M])` of the scores `z` `[M, V]`, `targets`
    `[M]`, in tiles of `tile_rows` rows (`plif_kernels._ll_tile`)."""
    z = z.contiguous()
    rows, vocab_size = z.shape
    targets = targets.long()
    lse, picked = z.new_empty(rows), z.new_empty(rows)
    tile_rows = max(1, min(tile_rows, rows))
    scratch = _Scratch(tile_rows * vocab_size, z, torch.int32, slopes)
    f_buffer = z.new_empty(tile_rows * vocab_size)
    for start, stop in _tiles(rows, tile_rows):
        tile = z[start:stop]
        f, _, _, _ = _scores_into(f_buffer[: tile.numel()].view(tile.shape), tile, slopes,
                                  left_values, knot_bound, scratch.of(tile))
        torch.logsumexp(f, dim=-1, out=lse[start:stop])
        torch.gather(f, 1, targets[start:stop, None], out=picked[start:stop, None])
    return lse, picked.sub_(lse)


def log_likelihood_gradient(z, targets, upstream, lse, slopes, left_values, knot_bound,
                            tile_rows):
    """`(dL/dz [M, V], (A [K], B [K]))`: the gradient `u (onehot -
    softmax(f)) slope[idx]` and the slopes' two histograms, in tiles of
    `tile_rows` rows (`plif_kernels._ll_tile_grad`), each tile's gradient
    formed in its rows of `dL/dz`."""
    z = z.contiguous()
    rows, vocab_size = z.shape
    d_z = torch.empty_like(z)
    sums = (z.new_zeros(slopes.shape[0]), z.new_zeros(slopes.shape[0]))
    tile_rows = max(1, min(tile_rows, rows))
    scratch = _Scratch(tile_rows * vocab_size, z, torch.int64, slopes)
    for start, stop in _tiles(rows, tile_rows):
        tile = z[start:stop]
        f, slope, flat, offset = _scores_into(d_z[start:stop], tile, slopes, left_values,
                                              knot_bound, scratch.of(tile))
        d_f = softmax_gradient_(f.sub_(lse[start:stop, None]), targets[start:stop],
                                upstream[start:stop])
        _add_histograms(sums, flat, d_f, offset)
        d_f.mul_(slope)
    return d_z, sums


def _add_histograms(sums, flat, weight, offset):
    """`A += hist(weight)`, `B += hist(weight offset)` (`offset`'s buffer is
    overwritten)."""
    sums[0].scatter_add_(0, flat, weight.view(-1))
    sums[1].scatter_add_(0, flat, offset.mul_(weight).view(-1))


def plif(z, slopes, left_values, knot_bound, tile):
    """`(f(z),)` of the flat scores `z` `[S]`, in tiles of `tile` scores
    (`plif_kernels._plif_tile`)."""
    z = z.contiguous()
    out = torch.empty_like(z)
    scratch = _Scratch(max(1, min(tile, z.numel())), z, torch.int32, slopes)
    for start, stop in _tiles(z.shape[0], tile):
        _scores_into(out[start:stop], z[start:stop], slopes, left_values, knot_bound,
                     scratch.of(z[start:stop]))
    return (out,)


def plif_gradient(z, upstream, slopes, left_values, knot_bound, tile):
    """`(dL/dz [S], (A [K], B [K]))` of the flat scores `z` `[S]` and the
    upstream gradient `[S]`, in tiles of `tile` scores
    (`plif_kernels._plif_tile_grad`)."""
    z, upstream = z.contiguous(), upstream.contiguous()
    d_z = torch.empty_like(z)
    sums = (z.new_zeros(slopes.shape[0]), z.new_zeros(slopes.shape[0]))
    scratch = _Scratch(max(1, min(tile, z.numel())), z, torch.int64, slopes)
    for start, stop in _tiles(z.shape[0], tile):
        slope, flat, offset = _interval(z[start:stop], slopes, knot_bound,
                                        *scratch.of(z[start:stop]))
        weight = upstream[start:stop]
        _add_histograms(sums, flat, weight, offset)
        torch.mul(weight, slope, out=d_z[start:stop])
    return d_z, sums
