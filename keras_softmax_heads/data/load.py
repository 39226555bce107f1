"""`load_dataset`: the single entry point for every corpus."""

from __future__ import annotations

import os

from keras_softmax_heads.data.corpus import LMCorpus

DATASET_NAMES = ("synthetic", "ptb", "wikitext2", "lm1b")
_ALIASES = {"penn_treebank": "ptb", "ptb_lm": "ptb", "wikitext-2": "wikitext2",
            "wikitext_2": "wikitext2", "wikitext2_lm": "wikitext2", "wt2": "wikitext2"}


def load_dataset(name: str = "synthetic", data_dir: str | os.PathLike | None = None,
                 **kwargs) -> LMCorpus:
    """Loads a language-modeling corpus by name.

    Args:
        name: one of `"synthetic"` (default; the embedded corpus sampled from
            a known bigram model, see `make_synthetic_corpus`), `"ptb"`,
            `"wikitext2"`, `"lm1b"`.
        data_dir: for `"ptb"` / `"wikitext2"`: a directory with `train.txt`,
            `valid.txt`, `test.txt` (or its parent holding `ptb/` /
            `wikitext-2/`); `None` downloads the public files (offline this
            fails with a `DatasetDownloadError` asking for `data_dir`).
            For `"lm1b"`: the TFDS data dir. Must be `None` for `"synthetic"`.
        **kwargs: forwarded to `make_synthetic_corpus`, `load_ptb`,
            `load_wikitext2` or `load_lm1b`.

    Returns:
        An `LMCorpus` (`train`, `valid`, `test` int32 arrays, `vocab`, and
        `true_model` for `"synthetic"`).

    Raises:
        ValueError: unknown `name`.

    Example:

    >>> corpus = load_dataset("synthetic", vocab_size=1000, seed=0)
    >>> round(corpus.true_model.entropy_rate, 2)  # nats/token
    4.05

    With local copies of the real corpora::

        ptb = load_dataset("ptb", data_dir="/data/ptb")  # train.txt, valid.txt, test.txt
    """
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key == "synthetic":
        if data_dir is not None:
            raise ValueError(
                "The synthetic corpus is generated in memory and takes no data_dir. "
                f"Received: data_dir={os.fspath(data_dir)!r}"
            )
        from keras_softmax_heads.data.synthetic import make_synthetic_corpus

        return make_synthetic_corpus(**kwargs)
    if key == "ptb":
        from keras_softmax_heads.data.named_corpora import load_ptb

        return load_ptb(data_dir, **kwargs)
    if key == "wikitext2":
        from keras_softmax_heads.data.named_corpora import load_wikitext2

        return load_wikitext2(data_dir, **kwargs)
    if key == "lm1b":
        from keras_softmax_heads.data.lm1b import load_lm1b

        return load_lm1b(data_dir, **kwargs)
    raise ValueError(f"Unknown dataset. Expected one of {list(DATASET_NAMES)}. Received: name={name!r}")
