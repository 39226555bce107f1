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

Kill it at any time: rerunning the same command with the same --model_dir
resumes from the last checkpoint (every --checkpoint_every steps) with
nothing lost.
"""

import json

from absl import app
from absl import flags

from keras_softmax_heads import training

FLAGS = flags.FLAGS
training.flags.define_flags()
flags.DEFINE_string("model_dir", "/tmp/train_lm", "Work directory: checkpoints, "
                    "TensorBoard logs, model.keras, results.json. Reusing it resumes.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = training.config_from_flags(FLAGS)
    results = training.train_and_evaluate(config, FLAGS.model_dir)
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
    print(f"Full results: {FLAGS.model_dir}/results.json")


if __name__ == "__main__":
    app.run(main)
