"""Input pipelines: the training batches of an epoch and the evaluation
windows that score every target of a split exactly once."""

from __future__ import annotations

import numpy as np


def train_steps_per_epoch(config, corpus):
    """Training steps per epoch: the full windows (LSTM) or full batches
    (n-gram) of the training split, capped by `config.steps_per_epoch`.

    Raises:
        ValueError: the split is too short for one step (with the numbers).
    """
    from keras_softmax_heads import data as ksh_data

    if config.model == "lstm":
        steps = ksh_data.num_stream_windows(len(corpus.train), config.batch_size, config.bptt)
        if steps < 1:
            # make_stream_dataset raises the explanatory error.
            ksh_data.make_stream_dataset(corpus.train, config.batch_size, config.bptt)
    else:
        steps = (len(corpus.train) - (config.ngram_order - 1)) // config.batch_size
        if steps < 1:
            raise ValueError(
                f"Received: batch_size={config.batch_size} but the training split "
                f"has only {len(corpus.train)} tokens, fewer n-gram examples than "
                "one batch."
            )
    if config.steps_per_epoch:
        steps = min(steps, config.steps_per_epoch)
    return steps


def train_dataset(config, corpus, epoch, steps, skip):
    """Global-batch dataset of `epoch`, its first `skip` batches skipped.

    The batches are a pure function of `(config.seed, epoch)` (contiguous
    streams for the LSTM, shuffled n-grams otherwise) with static shapes,
    so a resumed run skipping the consumed batches continues exactly.
    """
    from keras_softmax_heads import data as ksh_data

    if config.model == "lstm":
        ds = ksh_data.make_stream_dataset(corpus.train, config.batch_size, config.bptt)
    else:
        ds = ksh_data.make_ngram_dataset(
            corpus.train, config.ngram_order, config.batch_size, shuffle=True,
            seed=config.seed * 100_003 + epoch, drop_remainder=True,
        )
    return ds.take(steps).skip(skip).prefetch(2)


def _eval_pad_id(corpus):
    eos = getattr(corpus.vocab, "eos_id", None)
    return 0 if eos is None else int(eos)


def eval_windows(config, corpus, ids, batch_size, previous=None):
    """Every token but the first of `ids` as a target, exactly once.

    Returns window-major arrays `(tokens, targets, position)` of shapes
    `[K, B, bptt]` (LSTM; `tokens` likewise) or `[K, B, n-1]` / `[K, B]`
    (n-gram), where `position` is the index `t - 1` of the target `ids[t]`
    (`-1` for padding and warm-up). The LSTM windows are `config.eval_bptt`
    long (`None`: `config.bptt`).

    LSTM streams. The split is cut into `B` consecutive pieces, one per
    batch row, each scored from a zero state. Stream 0 scores targets
    `0 .. L + W - 1`; stream `b >= 1` first reads the `W =
    config.eval_warmup` tokens before its piece without scoring them (a
    warm-up, so that its first targets have a history, as they would in
    one pass over the split) and then scores `L` targets, `L = ceil((N - 1
    - W) / B)`. Every target is still scored exactly once and only from
    tokens of the split before it; with `B = 1` the split is one stream
    (Zaremba et al.'s test) and `W` plays no role. Why a warm-up: an LSTM
    trained with carried state rarely sees a zero state, and its first ~100
    predictions from one are poor (on the synthetic corpus some cost 15-19
    nats more than the truth), so `B` cold starts add to the perplexity a
    term that depends on where the streams happen to start. `previous`
    (optional): the tokens that precede the split in the corpus (the train
    split before valid, valid before test; the splits are consecutive
    pieces of one text or sample): stream 0 is warmed up over its last `W`
    tokens, so that no stream starts cold. With `W = 0` (the Zaremba
    presets) every stream, and with `B = 1` the split, starts from a zero
    state, as in the paper.
    """
    ids = np.asarray(ids, dtype=np.int32)
    n = len(ids) - 1
    if n < 1:
        raise ValueError(f"An evaluation split needs at least 2 tokens. Received: {len(ids)}")
    if config.model == "lstm":
        warmup = config.eval_warmup or 0
        prefix = None if previous is None or not warmup else np.asarray(previous)[-warmup:]
        return stream_windows(ids, batch_size, config.eval_bptt or config.bptt,
                              warmup=warmup, prefix=prefix)
    context = config.ngram_order - 1
    padded_ids = np.concatenate([np.full(context, _eval_pad_id(corpus), np.int32), ids])
    all_windows = np.lib.stride_tricks.sliding_window_view(padded_ids, context)
    tokens = all_windows[1 : n + 1]  # the n-1 words before each target ids[1..n]
    targets = ids[1:]
    num_batches = -(-n // batch_size)
    total = num_batches * batch_size
    tokens = np.concatenate([tokens, np.zeros((total - n, context), np.int32)])
    targets = np.concatenate([targets, np.zeros(total - n, np.int32)])
    position = np.where(np.arange(total) < n, np.arange(total), -1)
    return (tokens.reshape(num_batches, batch_size, context),
            targets.reshape(num_batches, batch_size),
            position.reshape(num_batches, batch_size))


def stream_windows(ids, batch_size, bptt, warmup=0, prefix=None):
    """The LSTM evaluation windows of `ids` (see `eval_windows`): `B =
    batch_size` streams, `bptt`-long windows, streams after the first
    warmed up over the `warmup` tokens before them, and the first stream
    over `prefix` (the tokens that precede the split, e.g. the end of the
    previous split; none by default). Returns `(tokens, targets, position)`,
    each `[K, B, bptt]`."""
    ids = np.asarray(ids, dtype=np.int32)
    prefix = np.zeros((0,), np.int32) if prefix is None else np.asarray(prefix, np.int32)
    p = len(prefix)
    full = np.concatenate([prefix, ids])  # full[q] predicts full[q + 1]
    n = len(ids) - 1
    warmup = int(min(max(warmup, 0), n)) if batch_size > 1 else 0
    length = max(1, -(-(n - warmup) // batch_size))  # scored targets per stream b >= 1
    row = p + length + warmup  # positions read by every stream
    windows = -(-row // bptt)
    padded = windows * bptt
    offset = np.arange(padded)[None, :]
    start = np.concatenate([[0], p + np.arange(1, batch_size) * length])[:, None]
    q = start + offset  # position in `full`
    readable = q < p + n
    scored = readable.copy()
    scored[0] &= (offset[0] >= p) & (offset[0] < row)  # after the prefix
    scored[1:] &= (offset >= warmup) & (offset < warmup + length)
    tokens = np.where(readable, full[np.where(readable, q, 0)], 0).astype(np.int32)
    targets = np.where(scored, full[np.where(scored, q + 1, 0)], 0).astype(np.int32)
    position = np.where(scored, q - p, -1)

    def to_windows(a):
        return np.ascontiguousarray(a.reshape(batch_size, windows, bptt).transpose(1, 0, 2))

    return to_windows(tokens), to_windows(targets), to_windows(position)
