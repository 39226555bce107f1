"""Vocabulary tiles of the chunked losses: width, count, order and masks.

Every tile has the same static width `size = tile_width(V, chunk_size)`,
so one loop body serves the whole vocabulary and the loop compiles with
XLA. There are `ceil(V / size)` tiles. When `size` divides `V` they are
the full tiles starting at `0, size, 2 size, ...`. Otherwise the last
tile is the last `size` words: it overlaps the tile before it by
`overlap = num_tiles * size - V` columns, which it masks (score `-inf`: no
probability, no gradient).

Tile order, the same in the forward and the backward pass and on every
backend: the masked tail tile first (outside the loop, with a static
mask), then the full tiles in increasing order. In the backward pass the
full tile processed after the tail overwrites the tail's zero gradient
columns. See `docs/chunked.md`.
"""

from typing import NamedTuple

import numpy as np

from keras_softmax_heads.validation import check_int

DEFAULT_CHUNK_SIZE = 4096
"""Default vocabulary tile width (see `docs/chunked.md` for how to choose)."""


def check_chunk_size(chunk_size, default=DEFAULT_CHUNK_SIZE):
    """Returns `chunk_size` as an int (`default` for None), or raises.

    `chunk_size` must be an integer >= 1 (bools, floats and strings are
    refused) or None. The heads call it with `default=None` (no
    `chunk_size`: the dense path).

    >>> check_chunk_size(None), check_chunk_size(512)
    (4096, 512)
    """
    chunk_size = check_int("chunk_size", chunk_size, minimum=1, allow_none=True)
    return default if chunk_size is None else chunk_size


def check_token_chunk_size(token_chunk_size):
    """Returns `token_chunk_size` (None, or an int >= 1), or raises.

    >>> check_token_chunk_size(None), check_token_chunk_size(2048)
    (None, 2048)
    """
    return check_int("token_chunk_size", token_chunk_size, minimum=1, allow_none=True)


def kernel_geometry(h, kernel, kernel_transposed):
    """`(d, V)` of a `[d, V]` (or, transposed, `[V, d]`) kernel of static
    shape, checked against the last dimension of `h`."""
    if len(kernel.shape) != 2:
        raise ValueError(
            f"The kernel must be a matrix. Received: kernel.shape={kernel.shape}"
        )
    if kernel_transposed:
        vocab, d = kernel.shape
    else:
        d, vocab = kernel.shape
    if d is None or vocab is None:
        raise ValueError(
            "chunked losses need a kernel of static shape. "
            f"Received: kernel with shape {kernel.shape}"
        )
    if h.shape[-1] is not None and h.shape[-1] != d:
        raise ValueError(
            f"`h` has last dimension {h.shape[-1]} but the kernel has d={d} "
            f"(kernel_transposed={kernel_transposed}). Received: h.shape={h.shape}, "
            f"kernel.shape={kernel.shape}"
        )
    return d, vocab


def tile_width(vocab_size, chunk_size):
    """The tile width used for `vocab_size` words and `chunk_size`.

    `chunk_size` is the maximum: a vocabulary smaller than it is one tile;
    otherwise the largest divisor of `vocab_size` in
    `[chunk_size / 2, chunk_size]` is used when there is one (every tile is
    full: nothing is masked), else the narrowest width that covers the
    vocabulary in as few tiles as `chunk_size` does,
    `ceil(V / ceil(V / chunk_size))` (then one tile, the last `width`
    words, overlaps its neighbour by fewer columns than there are tiles and
    masks them: tiles of `chunk_size` itself would compute up to a whole
    tile of masked scores).

    >>> tile_width(100_000, 4096), tile_width(793_471, 4096), tile_width(50_257, 4096)
    (4000, 3017, 3866)
    """
    if vocab_size <= chunk_size:
        return vocab_size
    for width in range(chunk_size, (chunk_size + 1) // 2 - 1, -1):
        if vocab_size % width == 0:
            return width
    num_tiles = -(-vocab_size // chunk_size)
    return -(-vocab_size // num_tiles)


class Tiling(NamedTuple):
    """The static tiling of a vocabulary (see the module docstring).

    Attributes:
        vocab: the number of words `V`.
        size: the tile width.
        num_full: the number of full tiles, starting at `i * size`.
        overlap: the masked leading columns of the tail tile (0: no tail
            tile, every tile is full).
    """

    vocab: int
    size: int
    num_full: int
    overlap: int

    @classmethod
    def of(cls, vocab, chunk_size):
        """The tiling of `vocab` words in tiles of at most `chunk_size`."""
        size = tile_width(vocab, chunk_size)
        num_tiles = -(-vocab // size)
        overlap = num_tiles * size - vocab
        return cls(vocab, size, num_tiles - 1 if overlap else num_tiles, overlap)

    @property
    def tail_start(self):
        """The first word of the tail tile (`V - size`)."""
        return self.vocab - self.size

    def tail_mask(self):
        """`[size]` float64 NumPy array: `-inf` on the tail tile's
        overlapping columns, 0 elsewhere."""
        return np.where(np.arange(self.size) >= self.overlap, 0.0, -np.inf)
