r"""Trains a language model with any softmax head and evaluates it exactly.

All the logic is in `keras_softmax_heads.training.train_and_evaluate`; this
file only turns flags into a `TrainConfig`: `training.flags` generates one
flag per `TrainConfig` field (`--help` lists them). Without flags it trains
a small LSTM with a full softmax on the embedded synthetic corpus (a few
minutes on two CPU cores) and prints the valid/test perplexity and how far the test
cross-entropy is from the true entropy of the corpus.

Examples:

    # The default quick run (synthetic corpus, offline).
    python examples/train_lm.py --model_dir=/tmp/lm

    # Zaremba et al. (2014) small LSTM on Penn Treebank (target: test
    # perplexity ~114.5).
    python examples/train_lm.py --preset=zaremba_small --dataset=ptb \
        --data_dir=/path/to/ptb --model_dir=/tmp/ptb_small

    # Another head, with options.
    python examples/train_lm.py --head=plif --head_options=num_knots=1000

    # A Cloud TPU VM (see tpu_scripts/README.md).
    python examples/train_lm.py --strategy=tpu --tpu=local ...

Stop it at any time: Ctrl-C or SIGTERM saves a checkpoint at the next step
and exits (status 130 / 143); rerunning the same command with the same
--model_dir resumes there with nothing lost (after a SIGKILL or a crash:
from the last checkpoint, every --checkpoint_every steps). A --model_dir
holding a finished run of the same settings is not trained again (its
results.json is named); --overwrite starts afresh; one holding a run of
other settings is refused.

Outputs in --model_dir: inference_model.keras (stateless, any batch size: the
model to use, see the README's "Use the trained model"), vocab.txt (words <->
ids), results.json, model.keras (the stateful training model), checkpoints/,
tensorboard/.
"""

import os
import sys


def _import_tensorflow_quietly():
    """Imports TensorFlow without its C++ log noise on a CPU machine, unless
    the user set `TF_CPP_MIN_LOG_LEVEL`: level 2 (no INFO / WARNING lines),
    3 where there is no NVIDIA device (the `failed call to cuInit` ERROR line
    is then noise), and the lines TensorFlow prints while loading, before
    any level applies (oneDNN, CUDA stubs), are dropped: stderr is closed
    only for the import; an import error is still shown."""
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        import tensorflow  # noqa: F401
        return
    gpu = os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2" if gpu else "3"
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_import_tensorflow_quietly()

import json  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from keras_softmax_heads import training  # noqa: E402
from keras_softmax_heads.data import ChecksumMismatchError  # noqa: E402
from keras_softmax_heads.data import DatasetDownloadError  # noqa: E402

FLAGS = flags.FLAGS
training.flags.define_flags()
flags.DEFINE_string("model_dir", "/tmp/train_lm", "Work directory: checkpoints, "
                    "TensorBoard logs, the models, vocab.txt, results.json. Reusing it resumes "
                    "an unfinished run of the same settings.")
flags.DEFINE_boolean("overwrite", False, "Delete a previous run's outputs from --model_dir "
                     "first and train from scratch.")

#: Errors that are the user's to fix (settings, data): one line, status 2.
EXPECTED_ERRORS = (ValueError, FileNotFoundError, ChecksumMismatchError, DatasetDownloadError)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = training.config_from_flags(FLAGS)
    try:
        results = training.train_and_evaluate(config, FLAGS.model_dir, overwrite=FLAGS.overwrite)
    except training.TrainingInterrupted as err:
        print(err, file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print("Interrupted (SIGINT) outside the training steps; rerun the same command to "
              "resume from the last checkpoint.", file=sys.stderr, flush=True)
        sys.exit(130)
    except EXPECTED_ERRORS as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    results_path = os.path.join(FLAGS.model_dir, "results.json")
    if results.get("already_finished"):
        print(f"Already finished: {results_path}")
        return
    summary = {
        "valid_perplexity": results["valid"]["perplexity"],
        "test_perplexity": results["test"]["perplexity"],
    }
    synthetic = results["diagnostics"].get("synthetic")
    if synthetic:
        summary["test_cross_entropy_nats"] = synthetic["test_cross_entropy"]
        summary["true_entropy_rate_nats"] = synthetic["true_entropy_rate"]
        summary["gap_to_floor_nats"] = synthetic.get("gap_to_floor")
    print(json.dumps(summary, indent=2))
    print(f"Inference model: {results['files']['inference_model']} "
          f"(vocabulary {results['files']['vocabulary']}); full results: {results_path}")


if __name__ == "__main__":
    app.run(main)
