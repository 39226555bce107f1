"""The tile width of the chunked losses, chosen for the platform that runs them.

`chunk_size_for` is the one dispatch point: the chunked losses call it when
they are given no `chunk_size` (`chunked_pointwise_nll(..., chunk_size=None)`,
`chunked_mixture_nll`, the mixture heads' default training loss).

* CPU (and any platform not named below): `DEFAULT_CHUNK_SIZE` words per
  tile, divided by the number of mixture components folded into the rows
  (a mixture of `K` softmaxes holds `[K * N, width]` tiles, so `K` times
  narrower tiles hold as many scores as one softmax's). For one softmax this
  is the width used before this module existed: CPU results are unchanged.
* GPU / TPU: a tile of up to `ACCELERATOR_TILE_ELEMENTS` scores
  (`rows * width`, rows known statically under `jit`), at least
  `ACCELERATOR_CHUNK_SIZE / components` words: few, large tiles (one kernel
  launch per product instead of hundreds), and no loop at all when the
  whole vocabulary fits in one tile.

The platform is `platforms.current_platform()` (a test forces one with
`platforms.forced_platform("gpu")`). Design notes: `docs/backends.md`.
"""

from keras_softmax_heads.chunked.tiling import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.platforms import PLATFORMS
from keras_softmax_heads.platforms import current_platform
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_int

#: Scores in one tile on a GPU / TPU (2**28 float32 scores: 1 GiB).
ACCELERATOR_TILE_ELEMENTS = 2**28

#: Tile width on a GPU / TPU when the number of rows is not static.
ACCELERATOR_CHUNK_SIZE = 32768

#: The narrowest tile the platform choice gives (a mixture of many components).
MIN_CHUNK_SIZE = 64


def chunk_size_for(vocab_size, rows=None, components=1, platform=None):
    """The vocabulary tile width (`chunk_size`) for a chunked loss.

    Args:
        vocab_size: int `V`, the words to tile.
        rows: the static number of rows of a tile (`N`, or `K * N` for a
            mixture), or None when it is not known when tracing.
        components: int `K >= 1`, mixture components folded into the rows.
        platform: `"cpu"`, `"gpu"`, `"tpu"`, or None: `current_platform()`.

    Returns:
        An int `chunk_size` for `chunked.tiling.tile_width`: on the CPU
        `max(DEFAULT_CHUNK_SIZE // components, MIN_CHUNK_SIZE)`; on a GPU /
        TPU `ACCELERATOR_TILE_ELEMENTS // rows` words (at least
        `ACCELERATOR_CHUNK_SIZE // components`, at most `V`: one tile, no
        loop), `ACCELERATOR_CHUNK_SIZE // components` without static rows.

    Example:

    >>> chunk_size_for(33_278), chunk_size_for(33_278, components=15)
    (4096, 273)
    >>> chunk_size_for(33_278, rows=4096, platform="gpu")  # one tile
    33278
    >>> chunk_size_for(33_278, rows=15 * 8192, components=15, platform="gpu")
    2184
    """
    vocab_size = check_int("vocab_size", vocab_size, minimum=1)
    components = check_int("components", components, minimum=1)
    platform = current_platform() if platform is None else check_choice(
        "platform", platform, PLATFORMS)
    if platform == "cpu":
        return max(DEFAULT_CHUNK_SIZE // components, MIN_CHUNK_SIZE)
    width = max(ACCELERATOR_CHUNK_SIZE // components, MIN_CHUNK_SIZE)
    if rows is not None:
        width = max(width, ACCELERATOR_TILE_ELEMENTS // max(int(rows), 1))
    return min(width, vocab_size)
