"""Language-modeling data: corpora, vocabulary, `tf.data` batchings.

* `load_dataset(name, data_dir=None, **kwargs)` -> `LMCorpus` for
  `"synthetic"` (default), `"ptb"`, `"wikitext2"`, `"lm1b"`.
* `Vocabulary`: token <-> id with training counts; save/load as text.
* `make_stream_dataset` (contiguous BPTT streams) and its NumPy twin
  `stream_windows`, `make_ngram_dataset` (fixed windows), `word_counts`.
  TensorFlow is imported only by the `tf.data` functions.
* TFDS builders `ptb_lm` and `wikitext2_lm` (`PtbLm`, `Wikitext2Lm`,
  `load_tfds_corpus`) and `load_lm1b` need tensorflow-datasets; they are
  imported on first access (`data.PtbLm`, or
  `import keras_softmax_heads.data.tfds_builders`, which registers the
  builders with TFDS), so that importing this package does not import TFDS.

See `docs/data.md`.
"""

import importlib

from keras_softmax_heads.data.batching import (
    batchify,
    make_ngram_dataset,
    make_stream_dataset,
    num_stream_windows,
    stream_windows,
    word_counts,
)
from keras_softmax_heads.data.corpus import LMCorpus
from keras_softmax_heads.data.load import DATASET_NAMES, load_dataset
from keras_softmax_heads.data.synthetic import MarkovLanguageModel, make_synthetic_corpus
from keras_softmax_heads.data.named_corpora import load_ptb, load_wikitext2
from keras_softmax_heads.data.text import (
    PTB_FILES,
    WIKITEXT2_FILES,
    ChecksumMismatchError,
    DatasetDownloadError,
    load_text_corpus,
)
from keras_softmax_heads.data.vocabulary import EOS_TOKEN, UNK_TOKEN, Vocabulary

__all__ = [
    "DATASET_NAMES",
    "EOS_TOKEN",
    "PTB_FILES",
    "UNK_TOKEN",
    "WIKITEXT2_FILES",
    "ChecksumMismatchError",
    "DatasetDownloadError",
    "LMCorpus",
    "MarkovLanguageModel",
    "PtbLm",
    "Vocabulary",
    "Wikitext2Lm",
    "batchify",
    "load_dataset",
    "load_lm1b",
    "load_ptb",
    "load_text_corpus",
    "load_tfds_corpus",
    "load_wikitext2",
    "make_ngram_dataset",
    "make_stream_dataset",
    "make_synthetic_corpus",
    "num_stream_windows",
    "stream_windows",
    "word_counts",
]

#: Public names that need tensorflow-datasets, and their modules.
_LAZY = {
    "PtbLm": "keras_softmax_heads.data.tfds_builders",
    "Wikitext2Lm": "keras_softmax_heads.data.tfds_builders",
    "load_tfds_corpus": "keras_softmax_heads.data.tfds_builders",
    "load_lm1b": "keras_softmax_heads.data.lm1b",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
