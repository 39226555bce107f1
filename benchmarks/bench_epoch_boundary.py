"""What an epoch boundary of Keras' `fit` costs with the library's batchings,
with and without `tf.data`'s autotuning.

At an epoch's end Keras replaces the dataset's iterator, and TensorFlow 2.21
frees an autotuned iterator only once its autotuning thread wakes up; the
library's batchings (`data.make_ngram_dataset`, `data.make_stream_dataset`)
turn autotuning off (`docs/data.md`, "Autotuning"). Each row is one fresh
process: a small Keras model (embedding + dense output layer) trained by one
`fit` over `--epochs` epochs of `--steps` batches; per epoch after the first
it records the first batch's time (from `on_epoch_begin`: the old iterator's
release and the new one's first batch) and the other batches' time. Rows:
`{ngram, stream} x {library, autotuned}`, `autotuned` being the same dataset
with `Options().autotune.enabled = True`.

    TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=2 taskset -c 0 \\
        python benchmarks/bench_epoch_boundary.py --data_dir=../shared/data/ptb \\
        --out=docs/results/epoch_boundary/one_core.json

Without `--data_dir` the ids are a seeded random stream of PTB's size.
"""

import json
import os
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fresh_process  # noqa: E402
import measure  # noqa: E402

_DATA_DIR = flags.DEFINE_string("data_dir", None, "PTB directory (none: random ids).")
_KINDS = flags.DEFINE_list("kinds", ["ngram", "stream"], "Batchings: ngram, stream.")
_EPOCHS = flags.DEFINE_integer("epochs", 4, "Epochs of the one fit.")
_STEPS = flags.DEFINE_integer("steps", 300, "Batches per epoch.")
_VOCAB = flags.DEFINE_integer("vocab", 10000, "Vocabulary of the random ids.")
_ROW = flags.DEFINE_string("row", None, "(internal) one row, 'kind:setting', in this process.")
_OUT = flags.DEFINE_string("out", None, "The JSON report.")


def _ids():
    import numpy as np

    if _DATA_DIR.value:
        from keras_softmax_heads import data

        corpus = data.load_dataset("ptb", data_dir=_DATA_DIR.value)
        return corpus.train, corpus.vocab_size
    rng = np.random.default_rng(0)
    return rng.integers(0, _VOCAB.value, size=929_589).astype("int32"), _VOCAB.value


def run_row(row):
    import keras
    import tensorflow as tf

    from keras_softmax_heads import data

    kind, setting = row.split(":")
    ids, vocab = _ids()
    if kind == "ngram":
        ds = data.make_ngram_dataset(ids, order=6, batch_size=128, seed=0)
        inputs, flatten = keras.Input((5,), dtype="int32"), [keras.layers.Flatten()]
    else:
        ds = data.make_stream_dataset(ids, batch_size=20, bptt=35)
        inputs, flatten = keras.Input((35,), dtype="int32"), []
    if setting == "autotuned":
        options = tf.data.Options()
        options.autotune.enabled = True
        ds = ds.with_options(options)
    ds = ds.take(_STEPS.value)
    model = keras.Sequential([inputs, keras.layers.Embedding(vocab, 16), *flatten,
                              keras.layers.Dense(vocab)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epochs = []

        def on_epoch_begin(self, epoch, logs=None):
            self.begin, self.first = time.perf_counter(), None

        def on_train_batch_end(self, batch, logs=None):
            self.last = time.perf_counter()
            if self.first is None:
                self.first = self.last

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append({"first_batch_s": self.first - self.begin,
                                "other_batches_s": self.last - self.first})

    timer = Timer()
    start = time.perf_counter()
    model.fit(ds, epochs=_EPOCHS.value, verbose=0, callbacks=[timer])
    later = timer.epochs[1:]  # the first epoch also traces the step
    return {
        "kind": kind, "setting": setting, "epochs": timer.epochs,
        "first_batch_s_after_first_epoch": [round(e["first_batch_s"], 3) for e in later],
        "other_batches_ms_per_step": round(
            1000 * sum(e["other_batches_s"] for e in later) / (len(later) * (_STEPS.value - 1)), 2),
        "fit_s": round(time.perf_counter() - start, 2),
        "autotune_enabled": ds.options().autotune.enabled,
    }


def run_all():
    args = [f"--epochs={_EPOCHS.value}", f"--steps={_STEPS.value}", f"--vocab={_VOCAB.value}"]
    if _DATA_DIR.value:
        args.append(f"--data_dir={_DATA_DIR.value}")
    rows = []
    for kind in _KINDS.value:
        for setting in ("library", "autotuned"):
            row = fresh_process.run_row(__file__, args + [f"--row={kind}:{setting}"])
            print(json.dumps({k: row[k] for k in ("kind", "setting",
                                                 "first_batch_s_after_first_epoch",
                                                 "other_batches_ms_per_step")}), flush=True)
            rows.append(row)
    return {
        "what": "Keras fit over several epochs of the library's batchings: the first batch of "
                "each epoch after the first (the old iterator released, the new one started) "
                "with tf.data's autotuning off (the library's default) and on",
        "rows": rows,
        "command": measure.command_line("bench_epoch_boundary.py", sys.argv[1:]),
        "environment": {k: os.environ.get(k) for k in
                        ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")},
        "machine": measure.machine(),
    }


def main(argv):
    del argv
    fresh_process.dispatch(_ROW.value, run_row, run_all, _OUT.value)


if __name__ == "__main__":
    app.run(main)
