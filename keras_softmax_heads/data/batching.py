"""`tf.data` batchings of an id stream, their NumPy twin (`stream_windows`),
and training-split word counts.

TensorFlow is imported by the `tf.data` functions when they are called, so
the corpora and the NumPy batching load on any Keras backend without it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from keras_softmax_heads.validation import check_int

if TYPE_CHECKING:  # annotations only: TensorFlow is imported where it is used
    import tensorflow as tf


#: Id arrays larger than this are not embedded as graph constants.
_MAX_CONSTANT_BYTES = 1 << 30


def without_autotune(dataset):
    """`dataset` with `tf.data`'s autotuning off (`Options().autotune.enabled
    = False`; the options carry over to the datasets made from it).

    The batchings here are a slice or a gather per batch, with nothing to
    tune, and autotuning costs Keras' `fit` seconds per epoch: at an epoch's
    end Keras replaces the iterator, and TensorFlow 2.21 frees the old one
    only after its autotuning thread wakes up. Measured on one core of this
    project's CPU (`docs/data.md`, "Autotuning"): the first batch of every
    epoch after the first took 5.3-5.8 s with it, 0.05-0.39 s without.
    A `map` with `num_parallel_calls=AUTOTUNE` then runs as many calls in
    parallel as there are cores.
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def _as_id_array(ids, name: str = "ids", vocab_size: int | None = None) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be a 1-D id array. Received: shape={arr.shape}")
    if arr.size == 0:
        raise ValueError(f"`{name}` is empty (0 tokens); the corpus needs at least one token.")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"`{name}` must hold integer ids. Received: dtype={arr.dtype}")
    if arr.min() < 0:
        raise ValueError(f"`{name}` must be non-negative. Received: min({name})={arr.min()}")
    if vocab_size is not None and arr.max() >= vocab_size:
        raise ValueError(
            f"`{name}` has ids >= vocab_size. Received: max({name})={arr.max()}, "
            f"vocab_size={vocab_size}"
        )
    if arr.max() > np.iinfo(np.int32).max:
        raise ValueError(f"`{name}` ids do not fit in int32. Received: max={arr.max()}")
    return arr.astype(np.int32, copy=False)


def batchify(ids, batch_size: int) -> np.ndarray:
    """Cuts an id stream into `batch_size` parallel streams (numpy).

    Stream `b` is `ids[b * L:(b + 1) * L]` with `L = len(ids) // batch_size`;
    the last `len(ids) % batch_size` tokens are dropped (Zaremba et al. 2014 /
    AWD-LSTM `batchify`).

    Args:
        ids: 1-D integer id array.
        batch_size: number of parallel streams `B`.

    Returns:
        `np.ndarray[int32]` of shape `[B, L]`.

    Raises:
        ValueError: empty `ids` or fewer tokens than streams.

    Example:

    >>> batchify(np.arange(10), 3)
    array([[0, 1, 2],
           [3, 4, 5],
           [6, 7, 8]], dtype=int32)
    """
    ids = _as_id_array(ids)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    length = ids.size // batch_size
    if length == 0:
        raise ValueError(
            f"Received: batch_size={batch_size} but the corpus has only {ids.size} "
            "tokens, fewer than one per stream."
        )
    return ids[: batch_size * length].reshape(batch_size, length)


def num_stream_windows(num_tokens: int, batch_size: int, bptt: int) -> int:
    """Number of full `[batch_size, bptt]` windows `make_stream_dataset` yields.

    Each of the `batch_size` streams has `L = num_tokens // batch_size`
    tokens; window `k` reads inputs `[k*bptt, (k+1)*bptt)` and targets one
    position later, so there are `(L - 1) // bptt` full windows.
    """
    return max(0, (num_tokens // batch_size - 1) // bptt)



def _checked_streams(ids, batch_size, bptt):
    """`(batchify(ids, batch_size), bptt)`, checked for one full window."""
    bptt = check_int("bptt", bptt, minimum=1)
    streams = batchify(ids, batch_size)
    batch_size, length = streams.shape
    if bptt > length - 1:
        raise ValueError(
            f"Received: bptt={bptt} but each of the {batch_size} streams has only "
            f"{length} tokens (a window needs bptt + 1 = {bptt + 1} tokens, inputs "
            "plus the shifted targets). Use a smaller bptt or batch_size."
        )
    return streams, bptt


def stream_windows(ids, batch_size: int, bptt: int):
    """The batches of `make_stream_dataset` as NumPy arrays (no TensorFlow).

    Returns:
        `(inputs, targets)`, int32 arrays of shape `[K, batch_size, bptt]`,
        `K = num_stream_windows(len(ids), batch_size, bptt)`: element `k`
        is the `k`-th batch of `make_stream_dataset(ids, batch_size, bptt)`.

    Raises:
        ValueError: as `make_stream_dataset`.

    Example:

    >>> import numpy as np
    >>> x, y = stream_windows(np.arange(1000), batch_size=20, bptt=35)
    >>> x.shape, int(y[0, 0, 0])
    ((1, 20, 35), 1)
    """
    streams, bptt = _checked_streams(ids, batch_size, bptt)
    batch_size, length = streams.shape
    num_windows = (length - 1) // bptt
    span = num_windows * bptt
    streams = streams.astype(np.int32)
    inputs = streams[:, :span].reshape(batch_size, num_windows, bptt).transpose(1, 0, 2)
    targets = streams[:, 1:span + 1].reshape(batch_size, num_windows, bptt).transpose(1, 0, 2)
    return np.ascontiguousarray(inputs), np.ascontiguousarray(targets)

def make_stream_dataset(ids, batch_size: int, bptt: int) -> "tf.data.Dataset":
    """Contiguous-stream LM batches (Zaremba et al. 2014 / AWD-LSTM convention).

    The id stream is cut into `batch_size` parallel streams (`batchify`; the
    remainder is trimmed). Batch `k` is

        inputs  = streams[:, k*bptt     : (k+1)*bptt]      # [batch, bptt]
        targets = streams[:, k*bptt + 1 : (k+1)*bptt + 1]  # [batch, bptt]

    so row `b` of batch `k+1` continues row `b` of batch `k` exactly (an RNN
    may carry its state across batches), and targets are the inputs shifted
    by one. Only full windows are produced (`drop_remainder` semantics): the
    element spec is static, `[batch_size, bptt]` int32, so the pipeline
    compiles under XLA/TPU. The order is fixed (no shuffling).

    Args:
        ids: 1-D integer id array (e.g. `corpus.train`).
        batch_size: number of parallel streams `B`.
        bptt: window length (truncated-BPTT steps).

    Returns:
        A finite `tf.data.Dataset` of `(inputs, targets)` int32 pairs of
        static shape `[batch_size, bptt]`, with known cardinality
        `num_stream_windows(len(ids), batch_size, bptt)`.

    Raises:
        ValueError: empty `ids`, non-positive sizes, or `bptt` too large for
            one full window (the message gives both numbers).

    Example:

    >>> import numpy as np
    >>> ds = make_stream_dataset(np.arange(1000), batch_size=20, bptt=35)
    >>> x, y = next(iter(ds))
    >>> x.shape, y.shape
    (TensorShape([20, 35]), TensorShape([20, 35]))
    """
    import tensorflow as tf

    streams, bptt = _checked_streams(ids, batch_size, bptt)
    batch_size, length = streams.shape
    num_windows = (length - 1) // bptt
    spec = tf.TensorSpec([batch_size, bptt], tf.int32)
    if streams.nbytes > _MAX_CONSTANT_BYTES:
        # Too big to embed as a graph constant: stream windows from numpy.
        def windows():
            for k in range(num_windows):
                start = k * bptt
                yield streams[:, start:start + bptt], streams[:, start + 1:start + bptt + 1]

        ds = tf.data.Dataset.from_generator(windows, output_signature=(spec, spec))
        return without_autotune(ds.apply(tf.data.experimental.assert_cardinality(num_windows)))

    data = tf.constant(streams)

    def window(k):
        start = tf.cast(k, tf.int32) * bptt
        inputs = tf.slice(data, [0, start], [batch_size, bptt])
        targets = tf.slice(data, [0, start + 1], [batch_size, bptt])
        return inputs, targets

    return without_autotune(tf.data.Dataset.range(num_windows).map(window))


def make_ngram_dataset(
    ids,
    order: int,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int | None = 0,
    drop_remainder: bool = True,
    pad_id: int | None = None,
) -> "tf.data.Dataset":
    """Fixed-window n-gram examples for feed-forward (Bengio-style) LMs.

    For every position `t` with a full history, the example is
    `(context, target) = (ids[t-n+1 : t], ids[t])` with `n = order`. Without
    `pad_id` that is every `t >= n - 1` (`len(ids) - n + 1` examples); with
    `pad_id` the stream is left-padded with `n - 1` copies of it so every
    token is a target (`len(ids)` examples).

    Args:
        ids: 1-D integer id array.
        order: the n of the n-gram (context length `n - 1`); `order >= 2`.
        batch_size: examples per batch.
        shuffle: shuffle examples (full-size buffer; reshuffled every epoch).
        seed: shuffle seed (deterministic order per seed).
        drop_remainder: drop the last partial batch, giving static shapes
            `[batch_size, n-1]` / `[batch_size]`.
        pad_id: optional id to left-pad with (e.g. `vocab.eos_id`).

    Returns:
        `tf.data.Dataset` of `(context [batch, n-1], target [batch])` int32.

    Raises:
        ValueError: empty `ids`, `order < 2`, or fewer examples than one
            batch when `drop_remainder=True`.

    Example:

    >>> import numpy as np
    >>> ds = make_ngram_dataset(np.arange(1000), order=4, batch_size=128, seed=1)
    >>> context, target = next(iter(ds))
    >>> context.shape, target.shape
    (TensorShape([128, 3]), TensorShape([128]))
    """
    ids = _as_id_array(ids)
    order = check_int("order", order, minimum=1)
    if order < 2:
        raise ValueError(f"`order` must be >= 2 (context of order - 1 words). Received: order={order}")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    context = order - 1
    if pad_id is not None:
        ids = np.concatenate([np.full(context, pad_id, dtype=np.int32), ids])
    num_examples = ids.size - context
    if num_examples < 1:
        raise ValueError(
            f"Received: order={order} but the corpus has only {ids.size} tokens; "
            f"an example needs {order}. Pass pad_id or use a smaller order."
        )
    if drop_remainder and num_examples < batch_size:
        raise ValueError(
            f"Received: batch_size={batch_size} but there are only {num_examples} "
            "n-gram examples, so drop_remainder=True leaves no batch."
        )
    import tensorflow as tf

    stream = tf.constant(ids)
    offsets = tf.range(order, dtype=tf.int64)

    ds = tf.data.Dataset.range(num_examples)
    if shuffle:
        ds = ds.shuffle(num_examples, seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)

    def gather(start):
        window = tf.gather(stream, start[:, None] + offsets[None, :])  # [b, order]
        return window[:, :context], window[:, context]

    ds = ds.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return without_autotune(ds)


def word_counts(ids, vocab_size: int) -> np.ndarray:
    """Length-`V` count array of an id stream (`np.bincount(ids, minlength=V)`).

    This is what frequency-aware heads (adaptive / sampled softmax, unigram
    samplers) take as `counts`.

    Args:
        ids: 1-D integer id array (normally `corpus.train`).
        vocab_size: `V`.

    Returns:
        `np.ndarray[int64]` of shape `[V]`.

    Raises:
        ValueError: empty `ids` or ids outside `[0, V)`.

    Example:

    >>> word_counts(np.array([0, 2, 2]), vocab_size=4)
    array([1, 0, 2, 0])
    """
    vocab_size = check_int("vocab_size", vocab_size, minimum=1)
    ids = _as_id_array(ids, vocab_size=vocab_size)
    return np.bincount(ids, minlength=vocab_size).astype(np.int64)
