"""Exact softmax losses that never materialise the `[N, V]` scores.

`chunked_pointwise_nll` computes the exact negative log-likelihood of the
pointwise family `log p = log_softmax(g(h W + b))` (Linear-Softmax,
sigsoftmax, PLIF, monotonic MLP, ...) by tiling over the vocabulary: the
forward pass keeps only a per-row running maximum and sum (online
log-sum-exp) and the target's score; the backward pass recomputes every
tile and accumulates the gradients of `h`, `W`, `b` and of the transform's
parameters through the vector-Jacobian product of `g`, so any
differentiable `g` works. `chunked_pointwise_stats` returns the same pass's
per-row statistics; `chunked_mixture_nll` does it for a mixture of
(pointwise) softmaxes.

Peak extra memory is `O(N * chunk_size + d * chunk_size)` plus the gradient
of the kernel (`[d, V]`, the size of the parameter itself), at the price of
one extra matrix product per step (4 instead of 3 `N x d x V` products).

Modules: `tiling` (tile width, count, order, masks; `check_chunk_size`, `check_token_chunk_size`),
`core` (the algorithm, once, in `keras.ops`), `dispatch` (the
backend-specific primitives), `losses` (the public functions);
`divergence` / `summed_divergence` (distillation) and
`summed_cross_entropy` (a summed cross-entropy whose gradient is computed
in the forward pass, over chunks of tokens). Design notes
and when each path wins: `docs/chunked.md`.
"""

from keras_softmax_heads.chunked.core import linear_nll_backward
from keras_softmax_heads.chunked.core import linear_nll_forward
from keras_softmax_heads.chunked.dispatch import value_and_vjp
from keras_softmax_heads.chunked.losses import chunked_mixture_nll
from keras_softmax_heads.chunked.losses import chunked_pointwise_nll
from keras_softmax_heads.chunked.losses import chunked_pointwise_stats
from keras_softmax_heads.chunked.tiling import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked.tiling import check_chunk_size
from keras_softmax_heads.chunked.tiling import check_token_chunk_size
from keras_softmax_heads.chunked.tiling import kernel_geometry
from keras_softmax_heads.chunked.tiling import tile_width

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "check_chunk_size",
    "check_token_chunk_size",
    "chunked_mixture_nll",
    "chunked_pointwise_nll",
    "chunked_pointwise_stats",
    "kernel_geometry",
    "linear_nll_backward",
    "linear_nll_forward",
    "tile_width",
    "value_and_vjp",
]
from keras_softmax_heads.chunked.divergence import DIVERGENCES  # noqa: E402
from keras_softmax_heads.chunked.divergence import OutputLayer  # noqa: E402
from keras_softmax_heads.chunked.divergence import tiled_divergence  # noqa: E402

__all__ += ["DIVERGENCES", "OutputLayer", "tiled_divergence"]
