"""One Billion Word benchmark through TFDS's own `lm1b` builder.

`tfds.load("lm1b", data_dir=...)` yields one `{"text": sentence}` example per
sentence (splits `train` and `test`; TFDS's `test` is the whole held-out
set). This module tokenizes on whitespace, appends one `<eos>` per sentence,
builds a count-based vocabulary from train with a min-count / max-size
cut-off and maps the remaining words to `<unk>`.

Reference vocabulary: the standard LM1B vocabulary (Chelba et al. 2013) has
793,471 entries = the words with train count >= 3 plus sentence markers and
`<UNK>`; `min_count=3` reproduces that cut-off (our markers: `<eos>`,
`<unk>`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np
import tensorflow_datasets as tfds

from keras_softmax_heads.data.corpus import LMCorpus
from keras_softmax_heads.data.text import encode_train
from keras_softmax_heads.data.vocabulary import EOS_TOKEN, UNK_TOKEN, Vocabulary

#: Words with at least this many train occurrences form the standard vocab.
LM1B_MIN_COUNT = 3


def sentence_tokens(texts: Iterable[bytes | str], eos_token: str = EOS_TOKEN) -> Iterator[list[str]]:
    """Whitespace tokens + `eos_token` for each sentence (bytes are UTF-8).

    Example:

    >>> list(sentence_tokens([b"a b", "c"]))
    [['a', 'b', '<eos>'], ['c', '<eos>']]
    """
    for text in texts:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        tokens = text.split()
        tokens.append(eos_token)
        yield tokens


def _texts(ds, max_sentences: int | None) -> Iterator[bytes]:
    if max_sentences is not None:
        ds = ds.take(max_sentences)
    for batch in tfds.as_numpy(ds.map(lambda ex: ex["text"]).batch(4096)):
        yield from batch.tolist()


def encode_sentences(texts: Iterable[bytes | str], vocab: Vocabulary) -> np.ndarray:
    """Concatenated ids of sentences (each + `<eos>`; OOV -> `<unk>`)."""
    chunks = [vocab.encode(tokens) for tokens in sentence_tokens(texts)]
    if not chunks:
        return np.zeros([0], dtype=np.int32)
    return np.concatenate(chunks).astype(np.int32, copy=False)


def load_lm1b(
    data_dir: str | os.PathLike | None = None,
    *,
    min_count: int = LM1B_MIN_COUNT,
    max_size: int | None = None,
    train_split: str = "train",
    valid_split: str = "test[:50%]",
    test_split: str = "test[50%:]",
    max_train_sentences: int | None = None,
    max_eval_sentences: int | None = None,
    download: bool = True,
) -> LMCorpus:
    """LM1B via `tfds.load("lm1b")`, whitespace-tokenized, count cut-off vocab.

    Args:
        data_dir: TFDS data dir (passed to `tfds.load`); `None` = TFDS default.
        min_count: keep words with at least this many train occurrences
            (3 = the standard 793k vocabulary).
        max_size: optional cap on the vocabulary size (`<unk>` included).
        train_split / valid_split / test_split: TFDS split strings. TFDS has
            only `train` and `test`; by default the held-out `test` split is
            halved into valid and test.
        max_train_sentences / max_eval_sentences: optional caps (the full
            train split is ~30M sentences / ~0.8B tokens: a lot of RAM).
        download: passed to `tfds.load`.

    Returns:
        An `LMCorpus` named `"lm1b"`; ordering of the vocabulary: descending
        train count, ties by first appearance; `<unk>` placed by its count.

    Raises:
        ValueError: if the train split is empty.

    Example (needs the prepared or downloadable `lm1b` dataset)::

        corpus = load_lm1b("/data/tfds", max_train_sentences=1_000_000)
    """
    splits = tfds.load(
        "lm1b",
        data_dir=None if data_dir is None else os.fspath(data_dir),
        split=[train_split, valid_split, test_split],
        shuffle_files=False,
        download=download,
    )
    train_ds, valid_ds, test_ds = splits
    try:
        train_ids, vocab = encode_train(
            sentence_tokens(_texts(train_ds, max_train_sentences)),
            min_count=min_count,
            max_size=max_size,
            unk_token=UNK_TOKEN,
            ensure_unk=True,
        )
    except ValueError as err:
        if "empty" in str(err):
            raise ValueError(f"The lm1b split {train_split!r} is empty.") from err
        raise
    valid_ids = encode_sentences(_texts(valid_ds, max_eval_sentences), vocab)
    test_ids = encode_sentences(_texts(test_ds, max_eval_sentences), vocab)
    for split, ids in (("valid", valid_ids), ("test", test_ids)):
        if ids.size == 0:
            raise ValueError(f"The lm1b {split} split is empty.")
    corpus = LMCorpus(train_ids, valid_ids, test_ids, vocab, name="lm1b")
    corpus.info.update({"min_count": min_count, "max_size": max_size,
                        "splits": (train_split, valid_split, test_split)})
    return corpus
