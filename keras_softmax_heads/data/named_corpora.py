"""`load_ptb` and `load_wikitext2`: the named text corpora.

Each is read directly from its three text files (`text.load_text_corpus`,
the fast path) or, with `use_tfds=True`, through its TFDS builder
(`tfds_builders`, imported only then, so that reading the files never
imports tensorflow-datasets). Without a `data_dir` the public files are
downloaded from their URLs and checked against their sha256
(`text.PTB_FILES`, `text.WIKITEXT2_FILES`).
"""

from __future__ import annotations

import os

from keras_softmax_heads.data.corpus import LMCorpus
from keras_softmax_heads.data.text import corpus_spec
from keras_softmax_heads.data.text import download_corpus_files
from keras_softmax_heads.data.text import load_text_corpus


def _load_named(name, data_dir, verify_checksums, cache_dir, use_tfds, tfds_data_dir):
    files, aliases = corpus_spec(name)
    if use_tfds:
        from keras_softmax_heads.data.tfds_builders import load_tfds_corpus

        return load_tfds_corpus(name, data_dir=tfds_data_dir, manual_dir=data_dir)
    if data_dir is None:
        data_dir = download_corpus_files(name, cache_dir=cache_dir)
    checksums = {s: f.sha256 for s, f in files.items()} if verify_checksums else None
    return load_text_corpus(data_dir, checksums=checksums, name=name, aliases=aliases)


def load_ptb(
    data_dir: str | os.PathLike | None = None,
    *,
    verify_checksums: bool = True,
    cache_dir: str | os.PathLike | None = None,
    use_tfds: bool = False,
    tfds_data_dir: str | os.PathLike | None = None,
) -> LMCorpus:
    """Penn Treebank (Mikolov preprocessing): 929,589 / 73,760 / 82,430 tokens, V=10,000.

    Args:
        data_dir: directory with `train.txt`, `valid.txt`, `test.txt` (or a
            parent with a `ptb/` sub-directory). `None` downloads the public
            files (`PTB_FILES`); offline this raises `DatasetDownloadError`.
        verify_checksums: check the files' sha256 against `PTB_FILES`
            (the TFDS builder always checks).
        cache_dir: download cache root (when `data_dir` is None).
        use_tfds: read through the `ptb_lm` TFDS builder instead of the fast
            direct path (`data_dir` becomes the builder's manual dir).
        tfds_data_dir: TFDS data dir for the prepared dataset (`use_tfds`).

    Returns:
        An `LMCorpus` named `"ptb"`.

    Example (needs the files)::

        corpus = load_ptb("/data/ptb")
        corpus.train.size, corpus.vocab_size  # (929589, 10000)
    """
    return _load_named("ptb", data_dir, verify_checksums, cache_dir, use_tfds, tfds_data_dir)


def load_wikitext2(
    data_dir: str | os.PathLike | None = None,
    *,
    verify_checksums: bool = True,
    cache_dir: str | os.PathLike | None = None,
    use_tfds: bool = False,
    tfds_data_dir: str | os.PathLike | None = None,
) -> LMCorpus:
    """WikiText-2 v1 (tokenized): 2,088,628 / 217,646 / 245,569 tokens, V=33,278.

    Args:
        data_dir: directory with `train.txt`, `valid.txt`, `test.txt` (the
            `wiki.*.tokens` files renamed), or a parent with a `wikitext-2/`
            sub-directory. `None` downloads the public files
            (`WIKITEXT2_FILES`); offline this raises `DatasetDownloadError`.
        verify_checksums: check the files' sha256 against `WIKITEXT2_FILES`
            (the TFDS builder always checks).
        cache_dir: download cache root (when `data_dir` is None).
        use_tfds: read through the `wikitext2_lm` TFDS builder instead.
        tfds_data_dir: TFDS data dir for the prepared dataset (`use_tfds`).

    Returns:
        An `LMCorpus` named `"wikitext2"`.

    Example (needs the files)::

        corpus = load_wikitext2("/data/wikitext-2")
        corpus.train.size, corpus.vocab_size  # (2088628, 33278)
    """
    return _load_named("wikitext2", data_dir, verify_checksums, cache_dir, use_tfds, tfds_data_dir)
