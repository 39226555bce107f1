"""`plif_log_likelihood`'s row tiles (and `plif_scores`) on PyTorch, eagerly and in place.

PyTorch runs PLIF's tiles op by op. Each `keras.ops` call allocates a fresh
`[rows, V]` tensor, and on a CPU a tile-sized tensor is a new mapping whose
page faults cost as much as the arithmetic. `ll_tile`, `ll_tile_gradient`
and `scores` run the same formulas as `plif_kernels._ll_tile`,
`_ll_tile_grad` and `plif_scores` (their `keras.ops` reference, against
which `tests/test_plif.py` checks them). They use buffers
of their own, updated in place: the interval index and offset share one
buffer, the PLIF score is one `addcmul_`, and the softmax gradient is formed
in that same buffer. On a 32 x 10,000 tile on one CPU thread the backward
tile took 3.9 ms against 7.5 ms (`docs/plif.md`).

They are called only from `dispatch.torch_ll_tile`,
`dispatch.torch_ll_tile_gradient`, `dispatch.torch_plif_scores` and
`dispatch.softmax_score_gradient`, outside a recorded autograd graph
(`dispatch.uses_torch_tiles`: PLIF's custom gradient computes its own).
"""

import torch


def _scores(z, slopes, left_values, knot_bound):
    """`(f, slope, idx, offset)` of the scores `z` `[n, V]`, the formulas of
    `plif_kernels._interval`, `_offset` and `_scores`: `idx =
    clip(int(clip(floor((z + T) / w), 0, K - 1)), 0, K - 1)` (int32),
    `offset = z - (-T + w idx)`, `f = left[idx] + slope[idx] offset`."""
    num_knots = slopes.shape[0]
    width = 2.0 * knot_bound / num_knots
    position = torch.add(z, knot_bound)
    position.div_(width).floor_().clamp_(0.0, num_knots - 1.0)
    # The integer clamp sends NaN (cast to an arbitrary integer) into range.
    idx = position.to(torch.int32).clamp_(0, num_knots - 1)
    # `position` holds float(idx) (NaN where `z` is NaN, whose offset is NaN
    # either way): the offset `z - (-T + w idx)` in its buffer.
    offset = position.mul_(width).add_(-knot_bound).neg_().add_(z)
    flat = idx.reshape(-1)
    slope = torch.index_select(slopes, 0, flat).reshape(z.shape)
    f = torch.index_select(left_values, 0, flat).reshape(z.shape)
    return f.addcmul_(slope, offset), slope, flat, offset


def scores(z, slopes, left_values, knot_bound):
    """`(f, slope, idx, offset)` of scores `z` of any shape, as
    `plif_kernels.plif_scores` (`idx` int32 of `z`'s shape); for the
    summed passes that differentiate PLIF themselves
    (`chunked.summed_mixture`)."""
    f, slope, flat, offset = _scores(z, slopes, left_values, knot_bound)
    return f, slope, flat.reshape(z.shape), offset


def softmax_gradient_(shifted, targets, upstream):
    """`u (onehot - exp(shifted))` in `shifted`'s buffer, which holds the
    scores less their log-normaliser `[n, V]`: `exp_`, scaled by `-u`, and
    `u` added at each row's target by one `scatter_add_` (no `[n, V]`
    one-hot). Used by `ll_tile_gradient` and by
    `dispatch.softmax_score_gradient` on PyTorch."""
    shifted.exp_().mul_(torch.neg(upstream)[:, None])
    return shifted.scatter_add_(1, targets.long()[:, None], upstream[:, None].to(shifted.dtype))


def ll_tile(z, targets, slopes, left_values, knot_bound):
    """`(lse [n], log-likelihood [n])` of a tile `z` `[n, V]`, `targets` `[n]`."""
    f, _, _, _ = _scores(z, slopes, left_values, knot_bound)
    lse = torch.logsumexp(f, dim=-1)
    picked = torch.gather(f, 1, targets.long()[:, None])[:, 0]
    return lse, picked - lse


def ll_tile_gradient(z, targets, upstream, lse, slopes, left_values, knot_bound):
    """`(dL/dz [n, V], (A [K], B [K]))` of a tile: the gradient
    `u (onehot - softmax(f)) slope[idx]` and the slopes' two histograms
    (`index_add_` in the scores' dtype, as `dispatch.segment_sum`)."""
    f, slope, flat, offset = _scores(z, slopes, left_values, knot_bound)
    d_f = softmax_gradient_(f.sub_(lse[:, None]), targets, upstream)
    num_knots = slopes.shape[0]
    a = torch.zeros(num_knots, dtype=f.dtype, device=f.device)
    a.index_add_(0, flat, d_f.reshape(-1))
    b = torch.zeros(num_knots, dtype=f.dtype, device=f.device)
    b.index_add_(0, flat, offset.mul_(d_f).reshape(-1))
    return d_f.mul_(slope), (a, b)
