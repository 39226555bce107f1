"""The `LMCorpus` container returned by every loader."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import numpy as np

from keras_softmax_heads.data.vocabulary import Vocabulary


@runtime_checkable
class TrueModel(Protocol):
    """What `LMCorpus.true_model` provides when the generating model is known."""

    entropy_rate: float

    def next_word_probs(self, context_ids) -> np.ndarray:  # pragma: no cover - protocol
        ...


@dataclasses.dataclass
class LMCorpus:
    """A language-modeling corpus: three int32 id streams and a vocabulary.

    Attributes:
        train: `np.ndarray[int32]` `[N_train]`, the training id stream.
        valid: `np.ndarray[int32]` `[N_valid]`.
        test: `np.ndarray[int32]` `[N_test]`.
        vocab: the `Vocabulary` (built from `train`; `vocab.counts` are the
            training-split counts).
        true_model: the generating model when known (synthetic corpus): an
            object with `.entropy_rate` (nats/token) and
            `.next_word_probs(context_ids)`; `None` for real corpora.
        name: short dataset name (`"ptb"`, `"wikitext2"`, ...).
        info: free-form extra facts (e.g. for the synthetic corpus the
            empirical cross-entropy of each split under the true model).

    Example:

    >>> from keras_softmax_heads.data import load_dataset
    >>> corpus = load_dataset("synthetic", vocab_size=500, num_train_tokens=20_000)
    >>> corpus.train.dtype, corpus.vocab_size
    (dtype('int32'), 500)
    """

    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    vocab: Vocabulary
    true_model: Any = None
    name: str = ""
    info: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for split in ("train", "valid", "test"):
            arr = np.asarray(getattr(self, split))
            if arr.ndim != 1:
                raise ValueError(
                    f"LMCorpus.{split} must be 1-D. Received: shape={arr.shape}"
                )
            if arr.size and (arr.min() < 0 or arr.max() >= len(self.vocab)):
                raise ValueError(
                    f"LMCorpus.{split} has ids outside [0, {len(self.vocab)}). "
                    f"Received: min={arr.min()}, max={arr.max()}"
                )
            setattr(self, split, arr.astype(np.int32, copy=False))

    @property
    def vocab_size(self) -> int:
        """`V`, the vocabulary size."""
        return len(self.vocab)

    def word_counts(self) -> np.ndarray:
        """Length-`V` int64 count array of the training split."""
        return np.bincount(self.train, minlength=self.vocab_size).astype(np.int64)

    def split(self, name: str) -> np.ndarray:
        """Returns the id stream of split `name` ("train", "valid" or "test")."""
        if name not in ("train", "valid", "test"):
            raise ValueError(
                f"Unknown split. Expected one of 'train', 'valid', 'test'. Received: {name!r}"
            )
        return getattr(self, name)

    def __repr__(self) -> str:
        return (
            f"LMCorpus(name={self.name!r}, vocab_size={self.vocab_size}, "
            f"train={self.train.size}, valid={self.valid.size}, test={self.test.size}, "
            f"true_model={type(self.true_model).__name__ if self.true_model is not None else None})"
        )
