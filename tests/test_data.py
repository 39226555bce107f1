"""Tests for keras_softmax_heads.data: corpora, vocabulary, batching, lm1b."""

import hashlib
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from keras_softmax_heads import data
import keras_softmax_heads.data.tfds_builders  # noqa: F401  (registers ptb_lm, wikitext2_lm)
from keras_softmax_heads.data import lm1b as lm1b_module
from keras_softmax_heads.data.text import encode_train

PTB_COUNTS = {"train": 929_589, "valid": 73_760, "test": 82_430}
WT2_COUNTS = {"train": 2_088_628, "valid": 217_646, "test": 245_569}


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def _ptb_cache():
    return {}


@pytest.fixture
def ptb(shared_data_dir, _ptb_cache):
    if "ptb" not in _ptb_cache:
        _ptb_cache["ptb"] = data.load_ptb(shared_data_dir / "ptb")
    return _ptb_cache["ptb"]


def _write_corpus(directory, train="a b\nc\n", valid="a\n", test="b c\n"):
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train), ("valid", valid), ("test", test)):
        if text is not None:
            (directory / f"{name}.txt").write_text(text, encoding="utf-8")
    return directory


# ------------------------------------------------------------ real corpora
def test_ptb_counts_fast_path(ptb):
    assert {s: ptb.split(s).size for s in PTB_COUNTS} == PTB_COUNTS
    assert ptb.vocab_size == 10_000
    assert ptb.name == "ptb"
    for split in ("train", "valid", "test"):
        assert ptb.split(split).dtype == np.int32
    vocab = ptb.vocab
    assert "<eos>" in vocab and "<unk>" in vocab
    # One <eos> per line: 42,068 train lines.
    assert vocab.counts[vocab.eos_id] == 42_068
    assert int((ptb.train == vocab.eos_id).sum()) == 42_068
    # Counts are the train counts, in descending order (frequency ordering).
    np.testing.assert_array_equal(vocab.counts, data.word_counts(ptb.train, 10_000))
    np.testing.assert_array_equal(vocab.counts, ptb.word_counts())
    assert np.all(np.diff(vocab.counts) <= 0)
    assert vocab.tokens[:3] == ("the", "<unk>", "<eos>")
    # First sentence of ptb.train.txt.
    assert vocab.decode(ptb.train[:3]) == ["aer", "banknote", "berlitz"]


def test_wikitext2_counts_fast_path(shared_data_dir):
    corpus = data.load_dataset("wikitext2", shared_data_dir / "wikitext-2")
    assert {s: corpus.split(s).size for s in WT2_COUNTS} == WT2_COUNTS
    assert corpus.vocab_size == 33_278
    vocab = corpus.vocab
    # 36,718 lines (12,951 of them blank) -> 36,718 <eos>.
    assert vocab.counts[vocab.eos_id] == 36_718
    assert np.all(np.diff(vocab.counts) <= 0)
    # The file starts with a blank line: " \n" -> just <eos>.
    assert vocab.decode(corpus.train[:4]) == ["<eos>", "=", "Valkyria", "Chronicles"]


def test_parent_data_dir_is_accepted(shared_data_dir, ptb):
    corpus = data.load_dataset("ptb", data_dir=shared_data_dir)  # has ptb/ inside
    np.testing.assert_array_equal(corpus.test, ptb.test)


# 15-20 s (TFDS prepares all of PTB); the builder's split generators, checksums
# and errors are checked by default below.
@pytest.mark.slow
def test_ptb_tfds_builder_matches_fast_path(shared_data_dir, tmp_path, ptb):
    builder = tfds.builder("ptb_lm", data_dir=str(tmp_path / "tfds"))
    assert isinstance(builder, data.PtbLm)
    corpus = data.load_ptb(shared_data_dir / "ptb", use_tfds=True,
                           tfds_data_dir=tmp_path / "tfds")
    assert corpus.info["source"] == "tfds:ptb_lm"
    for split in ("train", "valid", "test"):
        np.testing.assert_array_equal(corpus.split(split), ptb.split(split))
    assert corpus.vocab == ptb.vocab
    prepared = tfds.builder("ptb_lm", data_dir=str(tmp_path / "tfds"))
    assert prepared.info.splits["train"].num_examples == 42_068
    assert prepared.info.splits["validation"].num_examples == 3_370
    assert prepared.info.splits["test"].num_examples == 3_761


class _FakeDownloadManager:
    """Stands in for TFDS's DownloadManager when no manual dir is given."""

    def __init__(self, files=None, error=None):
        self.files, self.error, self.requested = files, error, None

    @property
    def manual_dir(self):
        raise AssertionError("Manual directory does not exist or is empty.")

    def download(self, urls):
        self.requested = urls
        if self.error is not None:
            raise self.error
        return {split: self.files[split] for split in urls}


def test_builder_download_path_verifies_checksums(shared_data_dir, tmp_path):
    builder = data.PtbLm(data_dir=str(tmp_path / "tfds"))
    local = {s: shared_data_dir / "ptb" / f"{s}.txt" for s in ("train", "valid", "test")}
    dl = _FakeDownloadManager(files=local)
    generators = builder._split_generators(dl)
    assert dl.requested == {s: f.url for s, f in data.PTB_FILES.items()}
    assert set(generators) == {"train", "validation", "test"}
    key, example = next(iter(generators["validation"]))
    assert key == 0 and example["text"].split()[:2] == ["consumers", "may"]
    # A download with the wrong content is rejected.
    swapped = dict(local, test=local["valid"])
    with pytest.raises(data.ChecksumMismatchError, match=data.PTB_FILES["test"].sha256):
        builder._split_generators(_FakeDownloadManager(files=swapped))
    # Offline: a clear error that points at the manual directory.
    offline = _FakeDownloadManager(error=ConnectionError("Name or service not known"))
    with pytest.raises(data.DatasetDownloadError, match="manual_dir"):
        builder._split_generators(offline)


def test_wikitext2_builder_is_registered():
    assert tfds.builder_cls("wikitext2_lm") is data.Wikitext2Lm
    assert data.Wikitext2Lm.name == "wikitext2_lm"


def test_checksum_tables_match_shared_sha256sums(shared_data_dir):
    sums = {}
    for line in (shared_data_dir / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        sums[name] = digest
    for split in ("train", "valid", "test"):
        assert data.PTB_FILES[split].sha256 == sums[f"ptb/{split}.txt"]
        assert data.WIKITEXT2_FILES[split].sha256 == sums[f"wikitext-2/{split}.txt"]


def _corrupted_ptb_copy(shared_data_dir, tmp_path):
    local = tmp_path / "ptb"
    shutil.copytree(shared_data_dir / "ptb", local)
    for path in local.iterdir():
        path.chmod(0o644)
    valid = local / "valid.txt"
    raw = bytearray(valid.read_bytes())
    raw[100] = ord("X") if raw[100] != ord("X") else ord("Y")
    valid.write_bytes(bytes(raw))
    return local, hashlib.sha256(bytes(raw)).hexdigest()


def test_checksum_mismatch_is_reported(shared_data_dir, tmp_path):
    local, bad_hash = _corrupted_ptb_copy(shared_data_dir, tmp_path)
    with pytest.raises(data.ChecksumMismatchError) as info:
        data.load_ptb(local)
    msg = str(info.value)
    assert "valid.txt" in msg
    assert data.PTB_FILES["valid"].sha256 in msg and bad_hash in msg
    # The TFDS builder verifies the manual-dir files the same way.
    with pytest.raises(data.ChecksumMismatchError, match=bad_hash):
        data.load_tfds_corpus("ptb", data_dir=tmp_path / "tfds", manual_dir=local)
    # Opting out of verification loads the altered file.
    assert data.load_ptb(local, verify_checksums=False).valid.size == PTB_COUNTS["valid"]


def test_missing_split_is_reported(tmp_path):
    local = _write_corpus(tmp_path / "corpus", test=None)
    missing = str(local / "test.txt")
    with pytest.raises(FileNotFoundError, match="test.txt") as info:
        data.load_text_corpus(local)
    assert missing in str(info.value)
    with pytest.raises(FileNotFoundError, match="test.txt"):
        data.load_ptb(local)
    with pytest.raises(FileNotFoundError, match="not found"):
        data.load_ptb(tmp_path / "does_not_exist")


@pytest.mark.parametrize("pattern", ["ptb.{}.txt", "wiki.{}.tokens"])
def test_standard_file_names_are_accepted(tmp_path, pattern):
    """The public PTB names (`ptb.train.txt`, ...) and WikiText-2's
    (`wiki.train.tokens`, ...) load like `train.txt`, ..., also from a
    parent directory; a missing split names the file expected."""
    reference = data.load_text_corpus(_write_corpus(tmp_path / "plain"))
    named = tmp_path / "named" / "ptb"
    for split in ("train", "valid", "test"):
        named.mkdir(parents=True, exist_ok=True)
        (named / pattern.format(split)).write_text(
            (tmp_path / "plain" / f"{split}.txt").read_text())
    for directory in (named, named.parent):
        corpus = data.load_ptb(directory, verify_checksums=False)
        assert corpus.vocab == reference.vocab
        np.testing.assert_array_equal(corpus.test, reference.test)
    from keras_softmax_heads.data.text import resolve_split_paths

    assert resolve_split_paths(named)["valid"] == named / pattern.format("valid")
    (named / pattern.format("test")).unlink()
    with pytest.raises(FileNotFoundError, match=pattern.format("test").replace(".", r"\.")):
        data.load_ptb(named, verify_checksums=False)
    # The split under another naming: the message says the three must share one.
    (named / "test.txt").write_text((tmp_path / "plain" / "test.txt").read_text())
    with pytest.raises(FileNotFoundError, match=r"test\.txt is there: the three splits must"):
        data.load_ptb(named, verify_checksums=False)
    # A file where the directory should be.
    with pytest.raises(FileNotFoundError, match="is a file: pass the directory"):
        data.load_ptb(named / pattern.format("train"), verify_checksums=False)


def test_missing_split_in_tfds_manual_dir(tmp_path):
    manual = _write_corpus(tmp_path / "manual", valid=None)
    builder = tfds.builder("ptb_lm", data_dir=str(tmp_path / "tfds"))
    with pytest.raises(FileNotFoundError, match="valid.txt"):
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=str(manual),
                                                         try_download_gcs=False))


def test_empty_corpus_is_rejected(tmp_path):
    local = _write_corpus(tmp_path / "empty", train="")
    with pytest.raises(ValueError, match="train split .* is empty"):
        data.load_text_corpus(local)
    with pytest.raises(ValueError, match="empty"):
        data.make_stream_dataset(np.zeros([0], np.int32), batch_size=2, bptt=3)
    with pytest.raises(ValueError, match="empty"):
        data.make_ngram_dataset(np.zeros([0], np.int32), order=3, batch_size=2)
    with pytest.raises(ValueError, match="empty"):
        encode_train([])


def test_small_text_corpus_conventions(tmp_path):
    # Blank line -> just <eos>; vocabulary by descending count, ties by first
    # appearance; valid/test OOV -> <unk>.
    local = _write_corpus(tmp_path / "c", train="b a\n \nc a <unk>\n", valid="a zzz\n",
                          test="c\n")
    corpus = data.load_text_corpus(local, name="tiny")
    assert corpus.vocab.tokens == ("<eos>", "a", "b", "c", "<unk>")
    np.testing.assert_array_equal(corpus.vocab.counts, [3, 2, 1, 1, 1])
    assert corpus.vocab.decode(corpus.train) == ["b", "a", "<eos>", "<eos>", "c", "a",
                                                 "<unk>", "<eos>"]
    assert corpus.vocab.decode(corpus.valid) == ["a", "<unk>", "<eos>"]


def test_download_failure_says_to_pass_data_dir(tmp_path, monkeypatch):
    import keras

    def offline_get_file(*args, **kwargs):
        raise Exception("URL fetch failure: Name or service not known")

    monkeypatch.setattr(keras.utils, "get_file", offline_get_file)
    with pytest.raises(data.DatasetDownloadError, match="data_dir"):
        data.load_dataset("wikitext2", cache_dir=tmp_path)


def test_load_dataset_rejects_unknown_names():
    with pytest.raises(ValueError, match="Received: name='ptb2'"):
        data.load_dataset("ptb2")
    with pytest.raises(ValueError, match="data_dir"):
        data.load_dataset("synthetic", data_dir="/tmp")


# -------------------------------------------------------------- vocabulary
def test_vocabulary_roundtrip(tmp_path):
    vocab = data.Vocabulary(["<eos>", "the", "<unk>", "ça"], counts=[5, 3, 1, 0])
    path = tmp_path / "vocab.txt"
    vocab.save(path)
    assert path.read_text(encoding="utf-8").splitlines()[0] == "<eos>\t5"
    assert data.Vocabulary.load(path) == vocab
    vocab.save(path, with_counts=False)
    loaded = data.Vocabulary.load(path)
    assert loaded.tokens == vocab.tokens
    np.testing.assert_array_equal(loaded.counts, np.zeros(4))
    assert vocab.token_to_id("dog") == vocab.unk_id == 2
    np.testing.assert_array_equal(vocab.encode(["the", "dog"]), [1, 2])
    assert vocab.decode(np.array([3, 0])) == ["ça", "<eos>"]
    assert vocab.id_to_token(1) == "the"


def test_vocabulary_duplicates_are_rejected(tmp_path):
    path = tmp_path / "dup.txt"
    path.write_text("a\t3\nthe\t2\nb\t2\nthe\t1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"Duplicate token 'the'.*lines 2 and 4"):
        data.Vocabulary.load(path)
    with pytest.raises(ValueError, match="Duplicate token 'x'"):
        data.Vocabulary(["x", "y", "x"])


def test_vocabulary_validation(tmp_path):
    with pytest.raises(ValueError, match="whitespace"):
        data.Vocabulary(["a b"])
    with pytest.raises(ValueError, match="shape"):
        data.Vocabulary(["a", "b"], counts=[1])
    no_unk = data.Vocabulary(["a"], unk_token=None)
    with pytest.raises(ValueError, match="'b' is not in the vocabulary"):
        no_unk.encode(["a", "b"])
    path = tmp_path / "mixed.txt"
    path.write_text("a\t1\nb\n", encoding="utf-8")
    with pytest.raises(ValueError, match="count column"):
        data.Vocabulary.load(path)


def test_vocabulary_from_counts_cutoff_and_ordering():
    counts = {"x": 1, "b": 5, "a": 2, "c": 2, "y": 1}
    vocab = data.Vocabulary.from_counts(counts)
    assert vocab.tokens == ("b", "a", "c", "x", "y")  # ties: mapping order
    vocab = data.Vocabulary.from_counts(counts, min_count=2)
    assert vocab.tokens == ("b", "a", "c", "<unk>")
    np.testing.assert_array_equal(vocab.counts, [5, 2, 2, 2])
    vocab = data.Vocabulary.from_counts(counts, max_size=3)
    assert vocab.tokens == ("b", "<unk>", "a")  # <unk> holds c, x, y = 4
    np.testing.assert_array_equal(vocab.counts, [5, 4, 2])


# ---------------------------------------------------------------- batching
def test_stream_dataset_continuity_and_shapes():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=1003).astype(np.int32)
    batch, bptt = 4, 7
    ds = data.make_stream_dataset(ids, batch_size=batch, bptt=bptt)
    assert ds.element_spec[0].shape == (batch, bptt)
    assert ds.element_spec[1].shape == (batch, bptt)
    assert ds.element_spec[0].dtype == tf.int32
    windows = list(ds.as_numpy_iterator())
    length = 1003 // batch  # 250 tokens per stream, remainder (3) trimmed
    assert len(windows) == (length - 1) // bptt == data.num_stream_windows(1003, batch, bptt)
    assert int(ds.cardinality()) == len(windows)
    streams = ids[: batch * length].reshape(batch, length)
    for k, (x, y) in enumerate(windows):
        np.testing.assert_array_equal(x, streams[:, k * bptt:(k + 1) * bptt])
        np.testing.assert_array_equal(y, streams[:, k * bptt + 1:(k + 1) * bptt + 1])
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets = shifted inputs
        if k:
            prev_x, prev_y = windows[k - 1]
            # Window k of stream b starts where window k-1 ended.
            np.testing.assert_array_equal(x[:, 0], prev_y[:, -1])
    # Stream b is a contiguous piece of the corpus.
    np.testing.assert_array_equal(windows[0][0][1], ids[length:length + bptt])


def test_stream_dataset_compiles_with_xla():
    ds = data.make_stream_dataset(np.arange(200) % 13, batch_size=2, bptt=5)

    @tf.function(autograph=False, jit_compile=True)
    def step(x, y):
        return tf.reduce_sum(x * y)

    for x, y in ds.take(2):
        step(x, y)


def test_bptt_too_large_is_reported():
    ids = np.zeros(1000, np.int32)
    with pytest.raises(ValueError, match="bptt=500 but each of the 20 streams has only 50 tokens"):
        data.make_stream_dataset(ids, batch_size=20, bptt=500)
    with pytest.raises(ValueError, match="bptt=50 but"):  # needs bptt + 1 tokens
        data.make_stream_dataset(ids, batch_size=20, bptt=50)
    assert len(list(data.make_stream_dataset(ids, batch_size=20, bptt=49))) == 1
    with pytest.raises(ValueError, match="bptt"):
        data.make_stream_dataset(ids, batch_size=20, bptt=0)
    with pytest.raises(ValueError, match="batch_size=2000"):
        data.make_stream_dataset(ids, batch_size=2000, bptt=2)


def test_batchings_turn_autotuning_off():
    """Keras' fit replaces a dataset's iterator at every epoch's end, and
    TensorFlow frees an autotuned iterator only after its autotuning thread
    wakes up: seconds per epoch on one core (docs/data.md, "Autotuning").
    The library's batchings carry `autotune.enabled = False`, and so do the
    datasets made from them (the training loop's `take` / `skip` /
    `prefetch`)."""
    ids = np.arange(2000, dtype=np.int32) % 97
    for ds in (data.make_stream_dataset(ids, batch_size=4, bptt=10),
               data.make_ngram_dataset(ids, order=4, batch_size=8, seed=0),
               data.make_ngram_dataset(ids, order=4, batch_size=8, shuffle=False)):
        assert ds.options().autotune.enabled is False
        assert ds.take(3).skip(1).prefetch(2).options().autotune.enabled is False
        assert len(list(ds.take(3))) == 3


def test_ngram_dataset_examples():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 1000, size=57).astype(np.int32)
    order = 4
    expected = sorted((tuple(ids[t - 3:t].tolist()), int(ids[t])) for t in range(3, 57))
    ds = data.make_ngram_dataset(ids, order=order, batch_size=8, seed=3, drop_remainder=False)
    got = [(tuple(c.tolist()), int(t)) for cb, tb in ds.as_numpy_iterator()
           for c, t in zip(cb, tb)]
    assert sorted(got) == expected
    # Shuffled with a seed: deterministic per seed, different from file order.
    again = data.make_ngram_dataset(ids, order=order, batch_size=8, seed=3, drop_remainder=False)
    got_again = [int(t) for _, tb in again.as_numpy_iterator() for t in tb]
    assert got_again == [t for _, t in got]
    in_order = [int(ids[t]) for t in range(3, 57)]
    assert [t for _, t in got] != in_order
    # drop_remainder: 54 examples -> 6 full batches of 8, static shapes.
    ds = data.make_ngram_dataset(ids, order=order, batch_size=8, shuffle=False)
    assert ds.element_spec[0].shape == (8, 3) and ds.element_spec[1].shape == (8,)
    batches = list(ds.as_numpy_iterator())
    assert len(batches) == 6
    np.testing.assert_array_equal(batches[0][0][0], ids[:3])
    assert batches[0][1][0] == ids[3]
    # pad_id: every token becomes a target.
    ds = data.make_ngram_dataset(ids, order=order, batch_size=57, shuffle=False, pad_id=0)
    context, target = next(ds.as_numpy_iterator())
    np.testing.assert_array_equal(target, ids)
    np.testing.assert_array_equal(context[0], [0, 0, 0])
    np.testing.assert_array_equal(context[3], ids[:3])
    with pytest.raises(ValueError, match="order"):
        data.make_ngram_dataset(ids, order=1, batch_size=2)


def test_word_counts():
    np.testing.assert_array_equal(data.word_counts(np.array([0, 2, 2]), 4), [1, 0, 2, 0])
    with pytest.raises(ValueError, match="vocab_size=2"):
        data.word_counts(np.array([0, 2]), 2)


# -------------------------------------------------------------------- lm1b
def _fake_lm1b(calls):
    sentences = {
        "train": ["the cat sat", "the dog sat", "a cat ran", "the end"],
        "test[:50%]": ["the cat flew", "a dog"],
        "test[50%:]": ["zebra sat"],
    }

    def fake_load(name, data_dir=None, split=None, shuffle_files=False, download=True):
        calls.append({"name": name, "data_dir": data_dir, "split": split,
                      "shuffle_files": shuffle_files})
        return [tf.data.Dataset.from_tensor_slices({"text": tf.constant(sentences[s])})
                for s in split]

    return fake_load


def test_lm1b_loader_on_fake_dataset(monkeypatch):
    calls = []
    monkeypatch.setattr(tfds, "load", _fake_lm1b(calls))
    corpus = data.load_dataset("lm1b", data_dir="/fake/tfds", min_count=2)
    assert calls == [{"name": "lm1b", "data_dir": "/fake/tfds",
                      "split": ["train", "test[:50%]", "test[50%:]"], "shuffle_files": False}]
    vocab = corpus.vocab
    # train counts: <eos> 4, the 3, cat 2, sat 2, a/dog/ran/end 1 (-> <unk> 4).
    assert vocab.tokens == ("<eos>", "<unk>", "the", "cat", "sat")
    np.testing.assert_array_equal(vocab.counts, [4, 4, 3, 2, 2])
    assert vocab.decode(corpus.train[:8]) == ["the", "cat", "sat", "<eos>",
                                              "the", "<unk>", "sat", "<eos>"]
    assert vocab.decode(corpus.valid) == ["the", "cat", "<unk>", "<eos>", "<unk>", "<unk>", "<eos>"]
    assert vocab.decode(corpus.test) == ["<unk>", "sat", "<eos>"]
    np.testing.assert_array_equal(vocab.counts, data.word_counts(corpus.train, len(vocab)))
    # max_size caps the vocabulary (<unk> included).
    small = data.load_lm1b("/fake/tfds", min_count=1, max_size=3)
    assert small.vocab.tokens == ("<unk>", "<eos>", "the")  # <unk> = 8 dropped tokens
    # max_train_sentences truncates train; <unk> is always in the vocabulary.
    tiny = data.load_lm1b(min_count=1, max_train_sentences=1)
    assert tiny.train.size == 4
    assert tiny.vocab.tokens[-1] == "<unk>" and tiny.vocab.counts[-1] == 0
    assert tiny.vocab.decode(tiny.test) == ["<unk>", "sat", "<eos>"]


def test_lm1b_sentence_tokens():
    assert list(lm1b_module.sentence_tokens([b"a  b", "\xe9t\xe9 ."])) == [
        ["a", "b", "<eos>"], ["\xe9t\xe9", ".", "<eos>"]]


def test_lm1b_real_if_prepared():
    data_dir = os.path.expanduser(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets"))
    if not os.path.isdir(os.path.join(data_dir, "lm1b")):
        pytest.skip(f"lm1b is not prepared under {data_dir} (no network here)")
    corpus = data.load_lm1b(data_dir, download=False, max_train_sentences=10_000,
                            max_eval_sentences=1_000)
    assert corpus.train.size > 0 and corpus.vocab.unk_id is not None
