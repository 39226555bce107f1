"""Two-level hierarchical softmax (HSM) with a static, padded cluster layout.

`p(w | h) = p(c(w) | h) * p(w | c(w), h)`: a softmax over `C` word clusters
and a softmax over the words of the target's cluster (Goodman, 2001; Mikolov
et al., 2011; Chen, Grangier & Auli, 2016, section 2.2). The exact
log-likelihood of a target costs `O((C + M) d)` per token, `M` the largest
cluster, instead of `O(V d)`; the full distribution over all `V` words is
still available from `call` / `log_probs` (for decoding).

Design notes (see the class docstring for the user-facing summary;
measurements behind them are in `docs/hierarchical.md`):

* The word output matrix is stored word-major, `kernel` `[V, d]` (the
  layout of an embedding, so weight tying with a `token_embedding` is the
  same code path). A token's cluster block is then a row gather, `[M, d]`,
  contiguous in memory (cheaper than gathering columns of a `[d, V]`
  matrix), and its gradient is that of a row gather (`IndexedSlices` on
  TensorFlow; on JAX / PyTorch a scatter-add into `[V, d]`, as for
  `keras.layers.Embedding`). No parameter is
  wasted on padding: only the integer table `cluster_words` `[C, M]` is
  padded.
* Tokens are sorted by cluster and packed into tiles of `tile_size` tokens
  that share a cluster; each tile gathers its cluster block once. The number
  of tiles is bounded statically by
  `K = min(N, (N + (tile_size - 1) * min(C, N)) // tile_size)`, so all shapes
  are static (XLA / TPU) while the gathered weights shrink from `N M d`
  (one block per token) to `K M d`.
* Every tile pays for the padded width `M`, so unequal clusters are
  expensive: the layer's own frequency bins are split to at most
  `ceil(V / C)` words by default (`cluster_size_cap="auto"`).
* The static step is memory-bound, not FLOP-bound, so it is far from the
  `O(V / (C + M))` saving a two-level tree promises in multiply-adds: with
  Zipfian targets a batch hits a large fraction of the clusters, and static
  shapes must cover the worst case, so the `K` tiles gather `K * M` rows
  (more rows than `V` at large `V`, padding included) and the backward pass
  writes a gradient of the same size. Any exact step must at least compute
  the cluster-level softmax and read (forward) and write (backward) the rows
  of the clusters a batch hits; `benchmarks/hsm_floor.py` measures that
  floor.
* Alternatives tried and not kept: a `tf.while_loop` over the tiles actually
  used (dynamic trip count, static shapes inside) reading each cluster's
  window of a cluster-contiguous kernel in place, with a custom gradient
  (XLA runs such a loop on one core and has no public in-place slice
  update, so accumulating the `[V, d]` gradient dominates; in graph mode the
  per-iteration overhead dominates); and, in graph mode, one row gather per
  (target, word) pair with segment log-sum-exp and a custom sparse gradient
  (the `[pairs, d]` gathers and segment sums dominate). Reaching the floor
  needs a fused kernel (one pass per hit cluster, multi-threaded), which
  public TensorFlow / XLA ops do not give.
* `static_shapes=False` (kept; TensorFlow graph mode and PyTorch on CPU /
  GPU, not XLA / TPU / JAX) drops the static worst case instead: only the tiles a batch uses are
  built (data-dependent shapes), and clusters are grouped in size classes
  (`size_class_widths`: `M, ceil(M/1.2), ...` down to `ceil(M/2)`, then
  halving down to 1), each with its own tiles (about `DYNAMIC_TILE_SCORES`
  word scores per token row, at most `DYNAMIC_MAX_TILE` tokens), so a tile
  pads its cluster by less than 1.2x in the wide classes, which hold most
  rows (the rare words, split to the cap `M`), and less than 2x below; the
  rows gathered are then close to the rows hit. The `keras.ops` version
  (`ops_dynamic_within_cluster`, autodiff) runs on PyTorch; on TensorFlow
  a custom gradient (`tf_dynamic_within_cluster`, measured faster)
  recomputes nothing: it returns one `IndexedSlices` for the word
  embeddings and bias, and `d ll / d s = onehot - softmax` per tile, and
  the per-slot results go back to the tokens with one gather
  (`slot_of_token`) rather than one segment sum per size class. The step is
  then bounded by the memory traffic of the gathered blocks (gather,
  forward product, the two backward products, the concatenation of the
  classes' gradients) plus the cluster softmax. Its extra ops make it pay
  for large vocabularies only; at small `V` the static path is faster.
* `tile_size` trades gathered rows (fewer with larger tiles) against padded
  word scores (`K * tile_size * M`, more with larger tiles). The default,
  16, suits XLA, whose batched product of tiny tiles is slow; in graph mode
  a smaller `tile_size` (e.g. 4) can be faster at large `V`.
* The layout (`cluster_of_word`, `position_in_cluster`, `cluster_words`,
  `cluster_sizes`) is stored as non-trainable int32 weights, so it is saved
  in `.keras` files with the other weights; `get_config` stores only the
  layout's shape (`num_clusters`, `max_cluster_size`), never the `V`-long
  lists (heavy at large `V`).
"""

import math

import keras
import numpy as np
from keras import ops

from keras_softmax_heads import clustering
from keras_softmax_heads.clustering import CLUSTERING_STRATEGIES
from keras_softmax_heads.heads.softmax_head import SoftmaxHead
from keras_softmax_heads.heads.head_utils import add_constant_weight
from keras_softmax_heads.heads.head_utils import check_static_shapes
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import is_concrete
from keras_softmax_heads.validation import nan_if_invalid
from keras_softmax_heads.samplers import check_counts
from keras_softmax_heads.validation import check_int



def _placeholder_layout(vocab_size, num_clusters):
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
    per_cluster = ops.segment_sum(ops.ones_like(cluster), cluster, num_segments=num_clusters)
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
        ops.scatter(ops.expand_dims(slot_sorted, -1), order + 1, (num_tiles * tile,)) - 1
    )
    slot_of_token = ops.scatter(ops.expand_dims(order, -1), slot_sorted, (n,))
    return slot_token, slot_of_token


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
    return ops.scatter(
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


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class HierarchicalSoftmax(SoftmaxHead):
    """Two-level hierarchical softmax over a fixed word clustering.

    Every word `w` belongs to one cluster `c(w)` of `C`, and

    `log p(w | h) = log_softmax(h U + a)[c(w)]
    + log_softmax_{v in c(w)}(h W_v + b_v)[w]`,

    with a cluster kernel `U` `[d, C]`, cluster bias `a` `[C]`, word
    embeddings `W` `[V, d]` (the layer's `kernel`, stored word-major) and word
    bias `b` `[V]`. The second softmax runs only over the words of `c(w)`.

    `log_likelihood` (and so training with `ksh.HeadModel` and evaluation)
    costs `O((C + M) d)` per token, `M = max_cluster_size`, and never scores
    all `V` words: tokens are grouped by cluster into tiles of `tile_size`
    tokens, each tile gathers its cluster's `[M, d]` block once, padded slots
    are masked to `-inf`. All shapes are static (`jit_compile=True` works).
    `call` / `log_probs` return the full normalised `[..., V]` distribution
    (`O(V d)`, for decoding), in word-id order.

    The clustering (Chen et al. 2016, section 2.2 and Table 4): pass an
    explicit `clusters` layout (a `keras_softmax_heads.clustering.
    ClusterAssignment`, e.g. from `clustering.make_clusters("kmeans",
    ids=...)`, or an int array `[V]` of cluster ids), or let the layer cluster
    with `clustering="frequency"` (needs `counts`; equal unigram mass per
    cluster, Mikolov et al. 2011, then capped in size, see below) or
    `"random"`. The k-means strategies need co-occurrence
    statistics, not only counts: build them with `make_clusters` and pass
    `clusters=`. Without `counts`, `"frequency"` assumes word ids are already
    sorted by frequency and cuts the id range into `num_clusters` contiguous
    blocks of (almost) equal size.

    Cost depends on the padded width `M`, the largest cluster: with static
    shapes every tile pays for `M` words. Per step, `log_likelihood` gathers
    `K * M` rows of `W` with
    `K = min(N, (N + (tile_size - 1) * min(C, N)) // tile_size)` tiles
    (`N` tokens) and computes `K * tile_size * M` word scores
    (`likelihood_cost`). Equal-mass frequency bins of a Zipfian vocabulary
    are very unequal in size (`V = 100k`, `C = 317`: largest bin 2,778
    words, mean 316), so by default (`cluster_size_cap="auto"`) the layer
    splits its frequency bins into pieces of at most `ceil(V / C)` words
    (`V = 100k`: 563 clusters of at most 316 words; `V = 793k`: 1,598 of at
    most 891), which cuts the gathered rows ~6x; `cluster_size_cap=None`
    keeps the paper's bins. Random clusters are balanced already.

    Saving: `get_config` records the final layout (after any splitting) as
    `clusters`, a `ClusterAssignment.to_config()` dict (`V` ints, like the
    vocabulary of `keras.layers.StringLookup`), with `num_clusters` and
    `max_cluster_size`, so `from_config` alone (and
    `keras.models.clone_model`) rebuilds the same layout and weights;
    `counts` is not needed once the layout is known and is recorded as
    None. The layout is also kept as non-trainable int32 weights
    (`cluster_of_word` `[V]`, `position_in_cluster` `[V]`, `cluster_words`
    `[C, M]`, `cluster_sizes` `[C]`), saved with the other weights.
    A config with `clusters=None` and `counts=None` (written by
    keras-softmax-heads 0.1.0, whose layout lived only in the weights)
    gives a layer of the right shape whose layout is pending: `call`,
    `log_probs`, `log_likelihood`, `training_loss` and `cluster_assignment`
    raise a `ValueError` until its weights are loaded (`.keras` load,
    `load_weights` or the layer's `set_weights`). `cluster_assignment`
    returns the current layout.

    Args:
        vocab_size: int, number of words `V` (or omit and pass
            `token_embedding`).
        num_clusters: int `C`, `1 <= C <= V`; default `ceil(sqrt(V))`, or
            the number of clusters of `clusters`.
        clusters: optional `ClusterAssignment`, its `to_config()` dict, or an
            int array `[V]` with the cluster of every word (every cluster in
            `[0, num_clusters)` non-empty).
        counts: optional unigram counts `[V]` (non-negative), used by the
            `"frequency"` clustering.
        clustering: strategy used when `clusters` is None: `"frequency"`
            (default) or `"random"`; `"kmeans"` / `"weighted_kmeans"` raise
            (they need `ids`; use `clustering.make_clusters`).
        cluster_size_cap: `"auto"` (default), None or an int. Clusters of
            more words are split into consecutive pieces (by descending
            count), which adds clusters (`split_large_clusters`). `"auto"`:
            only for the layer's own `"frequency"` clustering, cap
            `ceil(V / num_clusters)`; None: never split (the paper's
            equal-mass bins exactly); an int: any layout, `clusters` too.
        max_cluster_size: optional int, pad clusters to this width (>= the
            largest cluster), e.g. a multiple of 128 for TPU tiles; default
            the largest cluster.
        tile_size: int, tokens per tile in `log_likelihood` (default 16; 1
            gathers one block per token).
        static_shapes: bool (default `True`). `False`: `log_likelihood` (and
            so training) computes only the tiles the batch uses, with
            data-dependent shapes, grouping clusters in size classes
            (`size_class_widths(M)`: `M, ceil(M/1.2), ..., ceil(M/2)`,
            then halving down to 1; tiles of
            `clip(4096 // width, 1, 64)` tokens) (on TensorFlow with a
            custom gradient that returns one `IndexedSlices` for the word
            embeddings). It gathers about the rows of the clusters hit
            instead of the static worst case (at V = 793k, N = 2048: 296k
            rows instead of 1.45M), for TensorFlow graph mode or PyTorch on
            CPU / GPU; it does not compile with XLA (TPU), so the layer sets
            `supports_jit = False` and Keras runs a model containing it
            without XLA. On the JAX backend (always traced with static
            shapes) the constructor raises a `ValueError`.
        seed: int, seed of the `"random"` clustering.
        token_embedding: optional `keras.layers.Embedding` `[V, d]` tied to
            the word embeddings `W`.
        use_bias: bool, word and cluster biases (default `True`).
        kernel_initializer: initializer of `W` and `U`.
        bias_initializer: initializer of `b` and `a`.
        return_probabilities: bool, `call` returns probabilities.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 log-probabilities `[..., V]` in word-id order.

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.hierarchical_softmax import HierarchicalSoftmax
    >>> counts = np.array([40, 20, 10, 8, 6, 5, 4, 3, 2, 1])
    >>> head = HierarchicalSoftmax(vocab_size=10, counts=counts)
    >>> head.cluster_assignment.cluster_of_word.tolist()  # last bin split
    [0, 1, 2, 2, 3, 3, 3, 4, 4, 4]
    >>> head.num_clusters, head.max_cluster_size
    (5, 3)
    >>> head.likelihood_cost(num_tokens=6)
    {'tiles': 5, 'gathered_rows': 15, 'word_scores': 240, 'cluster_scores': 30}
    >>> h = np.random.rand(2, 3, 8).astype("float32")
    >>> log_p = np.asarray(head(h))
    >>> log_p.shape
    (2, 3, 10)
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True
    >>> targets = np.array([[0, 5, 9], [1, 2, 3]])
    >>> ll = head.log_likelihood(h, targets)  # never scores all V words
    >>> bool(np.allclose(ll, np.take_along_axis(log_p, targets[..., None], -1)[..., 0],
    ...                  atol=1e-5))
    True

    References:
        - Chen, Grangier & Auli, 2016. Strategies for Training Large
          Vocabulary Neural Language Models (section 2.2).
          https://arxiv.org/abs/1512.04906
        - Goodman, 2001. Classes for fast maximum entropy training.
          https://arxiv.org/abs/cs/0108006
        - Mikolov et al., 2011. Extensions of recurrent neural network
          language model.
    """

    def __init__(
        self,
        vocab_size=None,
        num_clusters=None,
        clusters=None,
        counts=None,
        clustering="frequency",
        cluster_size_cap="auto",
        max_cluster_size=None,
        tile_size=16,
        static_shapes=True,
        seed=0,
        token_embedding=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        return_probabilities=False,
        **kwargs,
    ):
        super().__init__(
            vocab_size=vocab_size,
            token_embedding=token_embedding,
            use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            return_probabilities=return_probabilities,
            **kwargs,
        )
        vocab = self.vocab_size
        if clustering not in CLUSTERING_STRATEGIES:
            raise ValueError(
                f"`clustering` must be one of {CLUSTERING_STRATEGIES}. "
                f"Received: clustering={clustering!r}"
            )
        self.clustering = clustering
        self.tile_size = check_int("tile_size", tile_size, 1)
        self.static_shapes = check_static_shapes(
            static_shapes, "builds tiles of data-dependent shapes")
        # Keras turns `jit_compile="auto"` (and `True`, with a warning) off
        # for a model with this layer when the shapes are data-dependent.
        self.supports_jit = self.static_shapes
        self.seed = check_int("seed", seed, 0)
        if num_clusters is not None:
            num_clusters = check_int("num_clusters", num_clusters, 1)
            if num_clusters > vocab:
                raise ValueError(
                    "`num_clusters` cannot exceed the vocabulary size (every "
                    f"cluster needs a word). Received: num_clusters="
                    f"{num_clusters} > vocab_size={vocab}"
                )
        if cluster_size_cap not in (None, "auto"):
            cluster_size_cap = check_int("cluster_size_cap", cluster_size_cap, 1)
        self.cluster_size_cap = cluster_size_cap
        counts = check_counts(counts, vocab)
        layout = self._resolve_layout(clusters, counts, num_clusters)
        if cluster_size_cap == "auto":
            if clusters is None and self.clustering == "frequency":
                cap = -(-vocab // layout.num_clusters)
                layout = split_large_clusters(layout, cap, counts)
        elif cluster_size_cap is not None:
            layout = split_large_clusters(layout, cluster_size_cap, counts)
        if max_cluster_size is None:
            max_cluster_size = layout.max_cluster_size
        max_cluster_size = check_int("max_cluster_size", max_cluster_size, 1)
        if max_cluster_size < layout.max_cluster_size:
            raise ValueError(
                "`max_cluster_size` must be at least the size of the largest "
                f"cluster ({layout.max_cluster_size}). Received: "
                f"max_cluster_size={max_cluster_size}"
            )
        self.num_clusters = layout.num_clusters
        self.max_cluster_size = max_cluster_size
        self._initial_layout = layout

    def _resolve_layout(self, clusters, counts, num_clusters):
        vocab = self.vocab_size
        if clusters is not None:
            if isinstance(clusters, dict):
                clusters = clustering.ClusterAssignment.from_config(clusters)
            if isinstance(clusters, clustering.ClusterAssignment):
                layout = clusters
            else:
                array = np.asarray(clusters)
                if array.ndim != 1 or array.size != vocab:
                    raise ValueError(
                        "`clusters` must give the cluster of every word, shape "
                        f"[vocab_size]. Received: clusters.shape={array.shape}, "
                        f"vocab_size={vocab}"
                    )
                layout = clustering.hierarchical_layout(array, num_clusters)
            if layout.vocab_size != vocab:
                raise ValueError(
                    "`clusters` covers a different vocabulary. Received: "
                    f"clusters.vocab_size={layout.vocab_size}, vocab_size={vocab}"
                )
            if num_clusters is not None and num_clusters != layout.num_clusters:
                raise ValueError(
                    "`num_clusters` disagrees with `clusters`. Received: "
                    f"num_clusters={num_clusters}, clusters has "
                    f"{layout.num_clusters} clusters"
                )
            return layout
        if num_clusters is None:
            num_clusters = clustering.default_num_clusters(vocab)
        if self.clustering in ("kmeans", "weighted_kmeans"):
            raise ValueError(
                f"clustering={self.clustering!r} needs word co-occurrence "
                "statistics, not only counts. Build the layout with "
                f"`keras_softmax_heads.clustering.make_clusters("
                f"{self.clustering!r}, ids=token_ids, counts=counts)` and pass "
                "it as `clusters=`. Received: clusters=None"
            )
        if self.clustering == "random":
            return clustering.make_clusters(
                "random", vocab_size=vocab, num_clusters=num_clusters, seed=self.seed
            )
        if counts is None:
            return _placeholder_layout(vocab, num_clusters)
        return clustering.make_clusters(
            "frequency", counts=counts, num_clusters=num_clusters
        )

    word_major = True

    # ------------------------------------------------------------------ build
    def build_head(self, input_shape):
        """Cluster weights and the layout (after `kernel` `[V, d]` and `bias`)."""
        d, num_clusters = self.input_dim, self.num_clusters
        self.cluster_bias = None
        self.cluster_kernel = self.add_weight(
            name="cluster_kernel",
            shape=(d, num_clusters),
            initializer=self.kernel_initializer,
        )
        if self.use_bias:
            self.cluster_bias = self.add_weight(
                name="cluster_bias",
                shape=(num_clusters,),
                initializer=self.bias_initializer,
                autocast=False,
            )
        layout = self._initial_layout
        table = np.zeros((num_clusters, self.max_cluster_size), np.int32)
        table[:, : layout.max_cluster_size] = layout.padded_cluster_words(0)
        self.cluster_of_word = add_constant_weight(self, "cluster_of_word", "int32", layout.cluster_of_word)
        self.position_in_cluster = add_constant_weight(self, "position_in_cluster", "int32", layout.position_in_cluster
        )
        self.cluster_words = add_constant_weight(self, "cluster_words", "int32", table)
        self.cluster_sizes = add_constant_weight(self, "cluster_sizes", "int32", layout.cluster_sizes)

    @property
    def cluster_assignment(self):
        """The current layout as a `clustering.ClusterAssignment`."""
        self._check_structure()
        if not self.built:
            return self._initial_layout
        return clustering.hierarchical_layout(
            np.asarray(keras.ops.convert_to_numpy(self.cluster_of_word)),
            self.num_clusters,
        )

    # ---------------------------------------------------------------- scores
    def cluster_log_probs(self, inputs):
        """`log p(c | h)`, float32 `[..., C]`."""
        inputs = ops.cast(self._check_inputs(inputs), self.compute_dtype)
        kernel = ops.cast(self.cluster_kernel, self.compute_dtype)
        zc = ops.cast(ops.matmul(inputs, kernel), self.accumulation_dtype)
        if self.cluster_bias is not None:
            zc = zc + ops.cast(self.cluster_bias, self.accumulation_dtype)
        return ops.log_softmax(zc, axis=-1)

    def log_probs(self, inputs):
        """Exact `log p(w | h)` for all `V` words, float32 `[..., V]`."""
        inputs = self._check_inputs(inputs)
        lead = ops.shape(inputs)[:-1]
        z = ops.reshape(self.logits(inputs), (-1, self.vocab_size))  # [N, V]
        class_lp = ops.reshape(
            self.cluster_log_probs(inputs), (-1, self.num_clusters)
        )  # [N, C]
        # Per-cluster logsumexp of the word scores, with a per-cluster max.
        cow = ops.convert_to_tensor(self.cluster_of_word)
        zt = ops.transpose(z)  # [V, N]
        peak = ops.segment_max(zt, cow, num_segments=self.num_clusters)  # [C, N]
        peak_w = ops.take(peak, cow, axis=0)  # [V, N]
        total = ops.segment_sum(ops.exp(zt - peak_w), cow, num_segments=self.num_clusters)
        lse_w = ops.take(ops.log(total) + peak, cow, axis=0)  # [V, N]
        word_lp = ops.transpose(zt - lse_w)  # [N, V]
        log_p = word_lp + ops.take(class_lp, cow, axis=1)
        return ops.reshape(log_p, tuple(lead) + (self.vocab_size,))

    # ------------------------------------------------------- cheap likelihood
    def log_likelihood(self, inputs, targets):
        """Exact `log p(targets | inputs)` in `O((C + M) d)` per token.

        Args:
            inputs: context vectors `[..., d]`.
            targets: int word ids `[...]` in `[0, V)`.

        Returns:
            float32 tensor of shape `targets.shape`. Out-of-range ids raise
            a `ValueError` eagerly (`InvalidArgumentError` from a TensorFlow
            graph) and give NaN under XLA / `jax.jit` / `torch.compile`
            (`head_utils.check_targets`).
        """
        inputs = self._check_inputs(inputs)
        targets = check_targets(targets, self.vocab_size)
        out_shape = ops.shape(targets)
        d = self.input_dim
        h = ops.reshape(inputs, (-1, d))
        t = ops.clip(ops.reshape(targets, (-1,)), 0, self.vocab_size - 1)
        cluster = ops.take(ops.convert_to_tensor(self.cluster_of_word), t)  # [N]
        class_lp = self.cluster_log_probs(h)  # [N, C]
        ll_class = ops.squeeze(
            ops.take_along_axis(class_lp, ops.expand_dims(cluster, -1), axis=-1), -1
        )
        position = ops.take(ops.convert_to_tensor(self.position_in_cluster), t)
        if self.static_shapes:
            ll_word = self._within_cluster_log_likelihood(h, cluster, position)
        else:
            ll_word = dynamic_within_cluster(
                ops.cast(h, self.compute_dtype),
                ops.cast(self.output_embeddings(), self.compute_dtype),
                None if self.bias is None else ops.cast(self.bias, self.accumulation_dtype),
                self._dynamic_plan(cluster, position),
                self.accumulation_dtype,
            )
        ll = ops.reshape(ll_class + ll_word, out_shape)
        return nan_if_invalid(ll, targets, self.vocab_size)

    def _within_cluster_log_likelihood(self, h, cluster, position):
        """`log p(w | c(w), h)` for flat `h` `[N, d]`, clusters/positions `[N]`."""
        # Keep in sync with `likelihood_cost`.
        tile, width, C = self.tile_size, self.max_cluster_size, self.num_clusters
        n = ops.shape(cluster)[0]
        if isinstance(n, int):
            num_tiles = min(n, (n + (tile - 1) * min(C, n)) // tile)
        else:  # Unknown batch size at trace time (static again under XLA).
            num_tiles = ops.minimum(n, (n + (tile - 1) * ops.minimum(C, n)) // tile)
        slot_token, slot_of_token = pack_tiles(cluster, tile, num_tiles, C)
        # Every used tile has its slot 0 filled; empty tiles are never read.
        tile_token = ops.maximum(ops.reshape(slot_token, (-1, tile))[:, 0], 0)
        tile_cluster = ops.take(cluster, tile_token)  # [K]

        words = ops.take(
            ops.convert_to_tensor(self.cluster_words), tile_cluster, axis=0
        )  # [K, M]
        blocks = ops.cast(
            ops.take(self.output_embeddings(), words, axis=0), self.compute_dtype
        )  # [K, M, d]
        h_tiles = ops.reshape(
            ops.take(ops.cast(h, self.compute_dtype), ops.maximum(slot_token, 0), axis=0),
            (-1, tile, self.input_dim),
        )  # [K, T, d]
        scores = ops.cast(
            ops.einsum("ktd,kmd->ktm", h_tiles, blocks), self.accumulation_dtype
        )
        if self.bias is not None:
            bias = ops.take(ops.cast(self.bias, self.accumulation_dtype), words)
            scores = scores + ops.expand_dims(bias, 1)
        sizes = ops.take(ops.convert_to_tensor(self.cluster_sizes), tile_cluster)
        valid = ops.arange(width, dtype="int32")[None, :] < sizes[:, None]  # [K, M]
        masked = ops.where(
            ops.expand_dims(valid, 1),
            scores,
            ops.full_like(scores, float("-inf")),
        )
        lse = ops.reshape(ops.logsumexp(masked, axis=-1), (-1,))  # [K * T]
        flat = ops.take(ops.reshape(scores, (-1,)), slot_of_token * width + position)
        return flat - ops.take(lse, slot_of_token)

    def _dynamic_plan(self, cluster, position):
        """Size classes and their used tiles for `static_shapes=False`.

        `cluster`, `position`: int32 `[N]`, every target's cluster and
        position in it.
        """
        sizes = ops.convert_to_tensor(self.cluster_sizes)
        table = ops.convert_to_tensor(self.cluster_words)
        widths = size_class_widths(self.max_cluster_size)
        # Class of a cluster: the narrowest width that holds it.
        fits = ops.expand_dims(ops.array(widths, "int32"), 0) >= ops.expand_dims(sizes, 1)
        token_class = ops.take(ops.sum(ops.cast(fits, "int32"), axis=1) - 1, cluster)
        plan = []
        for j, width in enumerate(widths):
            tile = max(1, min(DYNAMIC_MAX_TILE, DYNAMIC_TILE_SCORES // width))
            members = ops.cast(ops.nonzero(token_class == j)[0], "int32")  # data-dependent
            member_cluster = ops.take(cluster, members)
            slot_token, _ = pack_tiles(member_cluster, tile, None, self.num_clusters)
            slots = ops.reshape(slot_token, (-1, tile))  # [K, T], -1 empty
            tokens = ops.where(slots >= 0, ops.take(members, ops.maximum(slots, 0)), -1)
            positions = ops.where(
                slots >= 0, ops.take(position, ops.maximum(tokens, 0)), 0
            )  # [K, T]
            tile_cluster = ops.take(member_cluster, ops.maximum(slots[:, 0], 0))
            words = ops.take(table[:, :width], tile_cluster, axis=0)  # [K, w]
            valid = ops.arange(width, dtype="int32")[None, :] < ops.expand_dims(
                ops.take(sizes, tile_cluster), 1
            )
            plan.append((tokens, positions, words, valid))
        return plan

    def likelihood_cost(self, num_tokens):
        """Static sizes of one `log_likelihood` call on `num_tokens` tokens.

        Args:
            num_tokens: int `N`.

        Returns:
            dict: `tiles` (`K`), `gathered_rows` (`K * M` rows of the
            `[V, d]` word embeddings gathered; their gradient has as many),
            `word_scores` (`K * tile_size * M`) and `cluster_scores`
            (`N * C`). A dense softmax computes `N * V` scores.
        """
        n = check_int("num_tokens", num_tokens, 0)
        tile, width, num_clusters = self.tile_size, self.max_cluster_size, self.num_clusters
        tiles = min(n, (n + (tile - 1) * min(num_clusters, n)) // tile)
        return {
            "tiles": tiles,
            "gathered_rows": tiles * width,
            "word_scores": tiles * tile * width,
            "cluster_scores": n * num_clusters,
        }

    # ------------------------------------------------------------ serialising
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_clusters": self.num_clusters,
                # The final layout rebuilds everything `counts` was used
                # for. None only while a legacy (0.1.0) layout is pending.
                "clusters": (
                    None
                    if self._pending_structure is not None
                    else self.cluster_assignment.to_config()
                ),
                "counts": None,
                "clustering": self.clustering,
                "cluster_size_cap": self.cluster_size_cap,
                "max_cluster_size": self.max_cluster_size,
                "tile_size": self.tile_size,
                "static_shapes": self.static_shapes,
                "seed": self.seed,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        # 0.1.0 wrote both keys as None; the current `get_config` never does
        # (except for a layer still pending).
        legacy = all(
            key in config and config[key] is None for key in ("clusters", "counts")
        )
        if legacy:
            # keras-softmax-heads 0.1.0 kept the layout in the weights only:
            # a placeholder of the saved shape, pending until they are loaded.
            vocab = config.get("vocab_size")
            embedding = config.get("token_embedding")
            if vocab is None and isinstance(embedding, dict):
                vocab = embedding["config"]["input_dim"]
            num_clusters = config.get("num_clusters")
            if vocab is not None and num_clusters is not None:
                config["clusters"] = _placeholder_layout(vocab, num_clusters)
        layer = super().from_config(config)
        if legacy:
            layer._pending_structure = "clusters"
        return layer

