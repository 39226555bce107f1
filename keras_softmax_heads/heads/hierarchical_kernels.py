"""Tile kernels and layout planning of `HierarchicalSoftmax`.

The layer (`hierarchical_softmax.py`) owns the weights and the contract; this
module owns how `log p(w | c(w), h)` is computed without scoring all `V`
words: the cluster layout's splitting (`split_large_clusters`), the packing
of tokens into tiles that share a cluster (`pack_tiles`), the static tile
kernel (`static_within_cluster`, XLA-friendly) and the dynamic one
(`dynamic_plan` + `dynamic_within_cluster`, data-dependent shapes).

`dynamic_within_cluster` is the one backend dispatch: TensorFlow runs
`tf_dynamic_within_cluster` (a custom gradient returning `tf.IndexedSlices`),
the other backends `ops_dynamic_within_cluster` (`keras.ops`, the
reference). Design notes and measurements: `docs/hierarchical.md`.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_softmax_heads import clustering
from keras_softmax_heads.functional.dispatch import scatter
from keras_softmax_heads.functional.dispatch import segment_sum
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import is_concrete

# `static_shapes=False`: a class of width `w` packs `clip(DYNAMIC_TILE_SCORES
# // w, 1, DYNAMIC_MAX_TILE)` tokens per tile (4 at w = 891, 64 at w <= 64).
# Larger tiles are slightly faster (their extra padded rows are cheap next to
# the gathered blocks). TOP_CLASS_RATIO splits the widest classes (which hold
# most rows) more finely than SIZE_CLASS_RATIO. Both were tuned at V = 793k;
# the runs are in docs/hierarchical.md.
DYNAMIC_TILE_SCORES = 4096
DYNAMIC_MAX_TILE = 64
SIZE_CLASS_RATIO = 2.0
TOP_CLASS_RATIO = 1.2


def placeholder_layout(vocab_size, num_clusters):
    """Contiguous blocks of word ids, sizes differing by at most one.

    The `"frequency"` layout without counts, and the shape-only stand-in
    for a legacy (0.1.0) config's layout until its weights are loaded.
    """
    assignment = (np.arange(vocab_size, dtype=np.int64) * num_clusters) // vocab_size
    return clustering.hierarchical_layout(assignment, num_clusters)


def split_large_clusters(layout, cap, counts=None):
    """Splits every cluster of more than `cap` words into consecutive pieces.

    A cluster of `s > cap` words becomes `ceil(s / cap)` clusters of (almost)
    equal size, taking its words in descending `counts` order (ties and
    `counts=None`: ascending id), so frequency bins stay frequency bins. The
    pieces of cluster `c` get consecutive ids, in the order of `c`.

    Args:
        layout: a `clustering.ClusterAssignment`.
        cap: int >= 1, the largest cluster size allowed.
        counts: optional float array `[V]`.

    Returns:
        A `ClusterAssignment` (the same object when nothing is split).

    Example:

    >>> from keras_softmax_heads import clustering
    >>> layout = clustering.hierarchical_layout([0, 0, 0, 0, 0, 1, 1])
    >>> split_large_clusters(layout, 2).cluster_of_word.tolist()
    [0, 0, 1, 1, 2, 3, 3]
    """
    cap = check_int("cap", cap, 1)
    if layout.max_cluster_size <= cap:
        return layout
    assignment = np.empty(layout.vocab_size, dtype=np.int64)
    next_id = 0
    for c in range(layout.num_clusters):
        members = layout.cluster_words[c, : layout.cluster_sizes[c]]
        if counts is not None:
            members = members[np.argsort(-counts[members], kind="stable")]
        pieces = -(-members.size // cap)
        for piece in np.array_split(members, pieces):
            assignment[piece] = next_id
            next_id += 1
    return clustering.hierarchical_layout(assignment, next_id)


def pack_tiles(cluster, tile, num_tiles, num_clusters):
    """Packs tokens into tiles of `tile` tokens that share a cluster.

    Args:
        cluster: int32 `[n]`, the cluster of every token.
        tile: int, tokens per tile.
        num_tiles: int or scalar tensor `K`, at least the tiles needed
            (`sum_c ceil(n_c / tile)`); the tiles beyond are empty. None:
            exactly the tiles needed (a data-dependent shape, not for XLA).
        num_clusters: int `C`.

    Returns:
        `(slot_token, slot_of_token)`: int32 `[K * tile]`, the token in each
        slot (-1 if empty; slot 0 of every used tile is filled), and int32
        `[n]`, the slot of every token.
    """
    n = ops.shape(cluster)[0]
    order = ops.cast(ops.argsort(cluster), "int32")
    sorted_cluster = ops.take(cluster, order)
    # `dispatch.segment_sum`: Keras' PyTorch `segment_sum` repeats the ids with
    # a data-dependent `repeat_interleave`, a graph break under `torch.compile`.
    per_cluster = segment_sum(ops.ones_like(cluster), cluster, num_clusters)
    first_token = ops.cumsum(per_cluster) - per_cluster
    tiles_per_cluster = (per_cluster + (tile - 1)) // tile
    first_tile = ops.cumsum(tiles_per_cluster) - tiles_per_cluster
    if num_tiles is None:
        num_tiles = ops.sum(tiles_per_cluster)
        if is_concrete(num_tiles):  # eager: a Python int (PyTorch needs one)
            num_tiles = int(ops.convert_to_numpy(num_tiles))
    rank = ops.arange(n, dtype="int32") - ops.take(first_token, sorted_cluster)
    slot_sorted = (ops.take(first_tile, sorted_cluster) + rank // tile) * tile + (
        rank % tile
    )  # [n], distinct values in [0, num_tiles * tile)
    slot_token = (
        scatter(ops.expand_dims(slot_sorted, -1), order + 1, (num_tiles * tile,)) - 1
    )
    slot_of_token = scatter(ops.expand_dims(order, -1), slot_sorted, (n,))
    return slot_token, slot_of_token


def num_static_tiles(num_tokens, tile_size, num_clusters):
    """`K = min(N, (N + (tile_size - 1) * min(C, N)) // tile_size)`: the
    static bound on the tiles `N` tokens fill (an int for an int `N`, else
    a scalar tensor, e.g. a batch size unknown at trace time).

    >>> num_static_tiles(6, 16, 5)
    5
    """
    n, tile, C = num_tokens, tile_size, num_clusters
    if isinstance(n, int):
        return min(n, (n + (tile - 1) * min(C, n)) // tile)
    return ops.minimum(n, (n + (tile - 1) * ops.minimum(C, n)) // tile)


def static_within_cluster(
    h,
    words_matrix,
    bias,
    cluster,
    position,
    cluster_words,
    cluster_sizes,
    tile_size,
    compute_dtype,
    accumulation_dtype,
    shards=None,
):
    """`log p(t | c(t), h)` over `num_static_tiles` tiles (static shapes).

    Tokens are packed into tiles of `tile_size` tokens that share a cluster
    (`pack_tiles`); each tile gathers its cluster's `[M, d]` block of
    `words_matrix` once, scores its tokens against it and masks the padding
    to `-inf`. All shapes are static (XLA, JAX, TPU).

    Args:
        h: `[N, d]` context vectors.
        words_matrix: `[V, d]` word embeddings (any float dtype; the gathered
            blocks are cast to `compute_dtype`), or with `shards` this
            device's `[V / n, d]` rows.
        bias: `[V]` word bias or None (with `shards`: this device's `[V / n]`).
        cluster: int32 `[N]`, every target's cluster.
        position: int32 `[N]`, every target's position in its cluster.
        cluster_words: int32 `[C, M]`, the words of every cluster (padded).
        cluster_sizes: int32 `[C]`.
        tile_size: int, tokens per tile.
        compute_dtype: dtype of the products.
        accumulation_dtype: dtype of the scores.
        shards: None, or inside a `jax.shard_map` over the vocabulary axis a
            `chunked.vocab_parallel.VocabShards` (`start`: this device's first
            word id; `max`, `sum` across the shards): each device scores the
            words of its rows only (the others masked) and the tiles'
            log-normalisers and the targets' scores are combined across the
            shards (`vocab_parallel_within_cluster`).

    Returns:
        `[N]` log-probabilities in `accumulation_dtype`.
    """
    width = int(cluster_words.shape[-1])
    num_clusters = int(cluster_words.shape[0])
    tile = tile_size
    num_tiles = num_static_tiles(ops.shape(cluster)[0], tile, num_clusters)
    slot_token, slot_of_token = pack_tiles(cluster, tile, num_tiles, num_clusters)
    # Every used tile has its slot 0 filled; empty tiles are never read.
    tile_token = ops.maximum(ops.reshape(slot_token, (-1, tile))[:, 0], 0)
    tile_cluster = ops.take(cluster, tile_token)  # [K]

    words = ops.take(cluster_words, tile_cluster, axis=0)  # [K, M]
    sizes = ops.take(cluster_sizes, tile_cluster)
    valid = ops.arange(width, dtype="int32")[None, :] < sizes[:, None]  # [K, M]
    if shards is not None:  # this device's rows of the tiles' clusters
        words = words - shards.start
        valid = valid & (words >= 0) & (words < ops.shape(words_matrix)[0])
        words = ops.where(valid, words, 0)
    blocks = ops.cast(ops.take(words_matrix, words, axis=0), compute_dtype)  # [K, M, d]
    h_tiles = ops.reshape(
        ops.take(ops.cast(h, compute_dtype), ops.maximum(slot_token, 0), axis=0),
        (-1, tile, ops.shape(h)[-1]),
    )  # [K, T, d]
    scores = ops.cast(ops.einsum("ktd,kmd->ktm", h_tiles, blocks), accumulation_dtype)
    if bias is not None:
        bias = ops.take(ops.cast(bias, accumulation_dtype), words)
        scores = scores + ops.expand_dims(bias, 1)
    masked = ops.where(
        ops.expand_dims(valid, 1),
        scores,
        ops.full_like(scores, float("-inf")),
    )
    at_target = slot_of_token * width + position  # into the flat [K * T * M] scores
    flat = ops.take(ops.reshape(scores, (-1,)), at_target)
    if shards is None:
        lse = ops.reshape(ops.logsumexp(masked, axis=-1), (-1,))  # [K * T]
    else:
        peak = shards.max(ops.max(masked, axis=-1, keepdims=True))  # [K, T, 1]
        total = shards.sum(ops.sum(ops.exp(masked - peak), axis=-1))
        lse = ops.reshape(ops.log(total) + peak[..., 0], (-1,))
        # The target's score from the device that holds its row.
        mine = ops.take(ops.reshape(valid, (-1,)), (slot_of_token // tile) * width + position)
        flat = shards.sum(ops.where(mine, flat, ops.zeros_like(flat)))
    return flat - ops.take(lse, slot_of_token)


def vocab_parallel_within_cluster(h, words_matrix, bias, cluster, position, cluster_words,
                                  cluster_sizes, tile_size, compute_dtype, accumulation_dtype,
                                  layout):
    """`static_within_cluster` with the `[V, d]` word matrix (and the `[V]`
    bias) sharded on V (JAX, `layout` from
    `chunked.vocab_parallel.vocab_parallel_layout`): in a `jax.shard_map`,
    each device gathers the tiles' rows from its own shard only (the other
    rows masked), and per tile row the maximum, the sum of exponentials and
    the target's score are combined across the vocabulary axis: `[K, T]`
    and `[N]` all-reduces, where XLA's partitioner of the gather
    all-reduces the gathered `[K, M, d]` blocks. Rows split over the
    layout's batch axis where it divides them (each batch shard packs its
    own tiles). The word matrix's and bias's gradients stay sharded;
    differentiated by JAX through the collectives."""
    import jax
    from jax.sharding import PartitionSpec

    from keras_softmax_heads.chunked.vocab_parallel import VocabShards
    from keras_softmax_heads.chunked.vocab_parallel import batch_axis_for
    from keras_softmax_heads.chunked.vocab_parallel import on_shards

    mesh, vocab_axis, _ = layout
    words_matrix = ops.convert_to_tensor(words_matrix)
    vocab = words_matrix.shape[0]
    batch_axis = batch_axis_for(layout, h.shape[0])
    rows = PartitionSpec(batch_axis)
    has_bias = bias is not None

    def shard(h, w, cluster, position, cluster_words, cluster_sizes, *b):
        start = jax.lax.axis_index(vocab_axis) * w.shape[0]
        return static_within_cluster(
            h, w, b[0] if has_bias else None, cluster, position, cluster_words,
            cluster_sizes, tile_size, compute_dtype, accumulation_dtype,
            shards=VocabShards(vocab_axis, start, vocab))

    specs = (PartitionSpec(batch_axis, None), PartitionSpec(vocab_axis, None), rows, rows,
             PartitionSpec(), PartitionSpec()) + ((PartitionSpec(vocab_axis),) if has_bias else ())
    inputs = [h, words_matrix, cluster, position, ops.convert_to_tensor(cluster_words),
              ops.convert_to_tensor(cluster_sizes)]
    inputs += [ops.convert_to_tensor(bias)] if has_bias else []
    return on_shards(shard, mesh, specs, rows, check_vma=True)(*inputs)


def size_class_widths(max_cluster_size, ratio=None, top_ratio=None):
    """Widths of the size classes of `static_shapes=False`.

    Strictly decreasing from `M` to 1: steps of a factor `top_ratio`
    (default `TOP_CLASS_RATIO`) while the width is above `ceil(M / ratio)`,
    then `ceil(M / ratio), ceil(M / ratio^2), ...` (default
    `SIZE_CLASS_RATIO`). A cluster belongs to the narrowest class that holds
    it, so a tile pads its cluster by less than a factor `ratio`, and by
    less than `top_ratio` in the widest classes, which hold most of the
    gathered rows (the rare words, in clusters split to the cap `M`).

    Example:

    >>> size_class_widths(13, ratio=2, top_ratio=2)
    [13, 7, 4, 2, 1]
    >>> size_class_widths(891)[:6]
    [891, 743, 620, 517, 446, 223]
    """
    ratio = SIZE_CLASS_RATIO if ratio is None else ratio
    top_ratio = TOP_CLASS_RATIO if top_ratio is None else top_ratio
    widths = [int(max_cluster_size)]
    half = math.ceil(widths[0] / ratio)
    while widths[-1] > 1:
        width = widths[-1]
        if width > half:
            next_width = max(half, math.ceil(width / top_ratio))
        else:
            next_width = math.ceil(width / ratio)
        widths.append(min(width - 1, next_width))
    return widths


def dynamic_plan(cluster, position, cluster_words, cluster_sizes, num_clusters):
    """Size classes and their used tiles for `static_shapes=False`.

    Clusters are grouped by `size_class_widths(M)`: a cluster belongs to the
    narrowest class that holds it; each class packs its tokens into tiles
    of `clip(DYNAMIC_TILE_SCORES // width, 1, DYNAMIC_MAX_TILE)` tokens.
    Data-dependent shapes (not for XLA).

    Args:
        cluster: int32 `[N]`, every target's cluster.
        position: int32 `[N]`, every target's position in its cluster.
        cluster_words: int32 `[C, M]`, the words of every cluster (padded).
        cluster_sizes: int32 `[C]`.
        num_clusters: int `C`.

    Returns:
        The `plan` of `dynamic_within_cluster`: a list of
        `(tokens, positions, words, valid)`, one per size class.
    """
    widths = size_class_widths(int(cluster_words.shape[-1]))
    # Class of a cluster: the narrowest width that holds it.
    fits = ops.expand_dims(ops.array(widths, "int32"), 0) >= ops.expand_dims(cluster_sizes, 1)
    token_class = ops.take(ops.sum(ops.cast(fits, "int32"), axis=1) - 1, cluster)
    plan = []
    for j, width in enumerate(widths):
        tile = max(1, min(DYNAMIC_MAX_TILE, DYNAMIC_TILE_SCORES // width))
        members = ops.cast(ops.nonzero(token_class == j)[0], "int32")  # data-dependent
        member_cluster = ops.take(cluster, members)
        slot_token, _ = pack_tiles(member_cluster, tile, None, num_clusters)
        slots = ops.reshape(slot_token, (-1, tile))  # [K, T], -1 empty
        tokens = ops.where(slots >= 0, ops.take(members, ops.maximum(slots, 0)), -1)
        positions = ops.where(
            slots >= 0, ops.take(position, ops.maximum(tokens, 0)), 0
        )  # [K, T]
        tile_cluster = ops.take(member_cluster, ops.maximum(slots[:, 0], 0))
        words = ops.take(cluster_words[:, :width], tile_cluster, axis=0)  # [K, w]
        valid = ops.arange(width, dtype="int32")[None, :] < ops.expand_dims(
            ops.take(cluster_sizes, tile_cluster), 1
        )
        plan.append((tokens, positions, words, valid))
    return plan


def dynamic_within_cluster(h, words_matrix, bias, plan, accumulation_dtype):
    """`log p(t | c(t), h)` over data-dependent tiles (`static_shapes=False`).

    The backend dispatch of the dynamic path: TensorFlow runs
    `tf_dynamic_within_cluster` (a custom gradient returning one
    `tf.IndexedSlices`, measured faster in graph mode); other backends run
    `ops_dynamic_within_cluster` (`keras.ops`, autodiff), the reference.
    Neither compiles with XLA (data-dependent shapes).

    Args:
        h: `[N, d]` context vectors (compute dtype).
        words_matrix: `[V, d]` word embeddings (compute dtype).
        bias: `[V]` float32 word bias or None.
        plan: list of `(tokens, positions, words, valid)` per size class:
            int32 `[K, T]` the token of every slot (-1 empty), int32
            `[K, T]` its target's position in the cluster, int32 `[K, w]`
            the words of every tile's cluster (padded), bool `[K, w]`.
        accumulation_dtype: dtype of the scores.

    Returns:
        `[N]` log-probabilities in `accumulation_dtype`.
    """
    if keras.backend.backend() == "tensorflow":
        return tf_dynamic_within_cluster(h, words_matrix, bias, plan, accumulation_dtype)
    return ops_dynamic_within_cluster(h, words_matrix, bias, plan, accumulation_dtype)


def slots_of_tokens(plan, num_tokens):
    """int32 `[N]`: the slot of every token in the plan's tiles, flattened
    and concatenated over the size classes (every token has exactly one)."""
    flat_tokens = ops.concatenate(
        [ops.reshape(tokens, (-1,)) for tokens, _, _, _ in plan], axis=0
    )
    filled = ops.cast(ops.nonzero(flat_tokens >= 0)[0], "int32")
    return scatter(
        ops.expand_dims(ops.take(flat_tokens, filled), -1), filled, (num_tokens,)
    )


def ops_dynamic_within_cluster(h, words_matrix, bias, plan, accumulation_dtype):
    """`dynamic_within_cluster` in `keras.ops` with autodiff (any backend,
    eager or a graph with data-dependent shapes).

    Per size class of width `w`: gathers the tiles' contexts `[K, T, d]` and
    cluster blocks `[K, w, d]`, scores them, masks the padding to `-inf` and
    picks the target's log-softmax; `O(K T w d)`. The gradient of the word
    embeddings is that of `ops.take` (sparse on TensorFlow, a scatter-add
    into `[V, d]` on JAX / PyTorch, as for `keras.layers.Embedding`).
    """
    acc = accumulation_dtype
    ll = []
    for tokens, positions, words, valid in plan:
        h_tiles = ops.take(h, ops.maximum(tokens, 0), axis=0)  # [K, T, d]
        blocks = ops.take(words_matrix, words, axis=0)  # [K, w, d]
        s = ops.cast(ops.einsum("ktd,kwd->ktw", h_tiles, blocks), acc)
        if bias is not None:
            s = s + ops.expand_dims(ops.take(ops.cast(bias, acc), words), 1)
        s = ops.where(ops.expand_dims(valid, 1), s, ops.full_like(s, float("-inf")))
        log_p = s - ops.logsumexp(s, axis=-1, keepdims=True)  # [K, T, w]
        picked = ops.take_along_axis(log_p, ops.expand_dims(positions, -1), axis=-1)
        ll.append(ops.reshape(picked, (-1,)))
    slot_of_token = slots_of_tokens(plan, ops.shape(h)[0])
    return ops.take(ops.concatenate(ll, axis=0), slot_of_token)


def tf_dynamic_within_cluster(h, words_matrix, bias, plan, accumulation_dtype):
    """TensorFlow fast path of `dynamic_within_cluster`: a custom gradient.

    TensorFlow only (`tf.custom_gradient`, `tf.IndexedSlices`); the tile
    counts are data-dependent, so this does not compile with XLA. Same
    arguments (see there) and result.

    Returns:
        `[N]` log-probabilities in `accumulation_dtype`. The gradient of
        `words_matrix` (and `bias`) is one `tf.IndexedSlices` with a row per
        tile and word.
    """
    import tensorflow as tf

    n, d = tf.shape(h)[0], tf.shape(h)[-1]
    acc = accumulation_dtype

    # Every token has exactly one slot in the classes' tiles, concatenated:
    # per-slot results go back to the tokens with one gather.
    flat_tokens = tf.concat([tf.reshape(tokens, [-1]) for tokens, _, _, _ in plan], 0)
    filled = tf.where(flat_tokens >= 0)[:, 0]
    slot_of_token = tf.scatter_nd(
        tf.gather(flat_tokens, filled)[:, None], tf.cast(filled, "int32"), [n]
    )

    def forward(h, words_matrix, *maybe_bias):
        bias = maybe_bias[0] if maybe_bias else None
        saved, ll = [], []
        for tokens, positions, words, valid in plan:
            used = tokens >= 0
            safe_tokens = tf.maximum(tokens, 0)  # empty slots read token 0
            h_tiles = tf.gather(h, safe_tokens)  # [K, T, d]
            blocks = tf.gather(words_matrix, words)  # [K, w, d]
            s = tf.cast(tf.einsum("ktd,kwd->ktw", h_tiles, blocks), acc)
            if bias is not None:
                s += tf.gather(tf.cast(bias, acc), words)[:, None, :]
            s = tf.where(valid[:, None, :], s, float("-inf"))
            log_p = s - tf.reduce_logsumexp(s, axis=-1, keepdims=True)  # [K, T, w]
            picked = tf.gather(log_p, positions, batch_dims=2)  # [K, T]
            ll.append(tf.reshape(picked, [-1]))
            saved.append((safe_tokens, used, positions, words, h_tiles, blocks, log_p))
        ll = tf.gather(tf.concat(ll, 0), slot_of_token)

        def grad(g):
            g = tf.cast(g, acc)
            d_h, rows, indices, d_bias = [], [], [], []
            for safe_tokens, used, positions, words, h_tiles, blocks, log_p in saved:
                g_slot = tf.where(used, tf.gather(g, safe_tokens), 0.0)[:, :, None]
                width = tf.shape(log_p)[-1]
                # d ll / d s = onehot(target) - softmax(s), per slot.
                g_scores = g_slot * (tf.one_hot(positions, width, dtype=acc) - tf.exp(log_p))
                g_cast = tf.cast(g_scores, h.dtype)
                d_h.append(
                    tf.reshape(tf.einsum("ktw,kwd->ktd", g_cast, blocks), [-1, d])
                )
                d_blocks = tf.einsum("ktw,ktd->kwd", g_cast, h_tiles)  # [K, w, d]
                rows.append(tf.reshape(d_blocks, [-1, d]))
                indices.append(tf.reshape(words, [-1]))
                d_bias.append(tf.reshape(tf.reduce_sum(g_scores, 1), [-1]))
            d_h = tf.gather(tf.concat(d_h, 0), slot_of_token)
            indices = tf.concat(indices, 0)
            d_words = tf.IndexedSlices(
                tf.cast(tf.concat(rows, 0), words_matrix.dtype),
                indices,
                tf.shape(words_matrix),
            )
            if not maybe_bias:
                return d_h, d_words
            d_bias = tf.IndexedSlices(
                tf.cast(tf.concat(d_bias, 0), bias.dtype), indices, tf.shape(bias)
            )
            return d_h, d_words, d_bias

        return ll, grad

    args = (h, words_matrix) + ((bias,) if bias is not None else ())
    # Tensors, not variables: the custom gradient is with respect to values.
    args = tuple(tf.convert_to_tensor(a) for a in args)
    return tf.custom_gradient(forward)(*args)
