r"""Trains a language model with any softmax head and evaluates it exactly.

All the logic is in `keras_softmax_heads.training.train_and_evaluate`; this
file only turns flags into a `TrainConfig`. Without flags it trains a small
LSTM with a full softmax on the embedded synthetic corpus (a few minutes on
two CPU cores) and prints the valid/test perplexity and how far the test
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
from keras_softmax_heads.models import registry

_HEAD_CHOICES = sorted(set(registry.HEADS) | set(registry.HEAD_ALIASES))
_DEFAULTS = training.TrainConfig()

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "/tmp/train_lm", "Work directory: checkpoints, "
                    "TensorBoard logs, model.keras, results.json. Reusing it resumes.")
flags.DEFINE_enum("preset", None, sorted(training.PRESETS),
                  "Hyper-parameter preset; explicit flags override it.")
# Data.
flags.DEFINE_enum("dataset", _DEFAULTS.dataset, ["synthetic", "ptb", "wikitext2", "lm1b"],
                  "Corpus.")
flags.DEFINE_string("data_dir", None, "Directory of the corpus files.")
flags.DEFINE_string("dataset_options", None,
                    "Loader options, e.g. 'vocab_size=2000,num_train_tokens=100000' "
                    "for the synthetic corpus.")
# Model.
flags.DEFINE_enum("model", _DEFAULTS.model, sorted(registry.MODELS), "Backbone.")
flags.DEFINE_integer("embedding_dim", _DEFAULTS.embedding_dim, "Word-embedding size.")
flags.DEFINE_integer("hidden_size", _DEFAULTS.hidden_size, "LSTM units / tanh layer size.")
flags.DEFINE_integer("num_layers", _DEFAULTS.num_layers, "LSTM / tanh layers.")
flags.DEFINE_integer("ngram_order", _DEFAULTS.ngram_order, "n of the n-gram model.")
flags.DEFINE_float("dropout", _DEFAULTS.dropout, "Dropout rate (non-recurrent connections).")
flags.DEFINE_enum("tie_embeddings", None, ["true", "false"],
                  "Tie the output projection to the input embedding (default: when "
                  "the head supports it; presets: false).")
flags.DEFINE_float("init_scale", None, "Uniform initialisation scale of every weight.")
flags.DEFINE_enum("unroll", "auto", ["auto", "true", "false"],
                  "Unroll the LSTM over the window (auto: on CPU only).")
# Head.
flags.DEFINE_enum("head", _DEFAULTS.head, _HEAD_CHOICES, "Output head.")
flags.DEFINE_string("head_options", None,
                    "Head constructor options, e.g. 'num_knots=1000,num_components=3'.")
flags.DEFINE_integer("chunk_size", None, "Vocabulary tile of the chunked exact losses "
                     "(heads that accept it).")
# Optimisation.
flags.DEFINE_enum("optimizer", _DEFAULTS.optimizer, list(training.OPTIMIZERS), "Optimizer.")
flags.DEFINE_float("learning_rate", _DEFAULTS.learning_rate, "Learning rate.")
flags.DEFINE_float("lr_decay", _DEFAULTS.lr_decay, "Per-epoch learning-rate decay factor.")
flags.DEFINE_integer("decay_after_epochs", _DEFAULTS.decay_after_epochs,
                     "Epochs at the initial learning rate before the decay starts.")
flags.DEFINE_float("clip_norm", _DEFAULTS.clip_norm, "Global-norm gradient clipping "
                   "(0: none).")
flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size, "Global batch size.")
flags.DEFINE_integer("bptt", _DEFAULTS.bptt, "Truncated-BPTT window length.")
flags.DEFINE_integer("epochs", _DEFAULTS.epochs, "Epochs.")
flags.DEFINE_integer("steps_per_epoch", None, "Cap on the steps per epoch (smoke runs).")
flags.DEFINE_integer("eval_batch_size", None, "Streams used for evaluation "
                     "(1: the whole split as one stream).")
flags.DEFINE_integer("eval_steps", None, "Cap on evaluation windows (smoke runs).")
flags.DEFINE_integer("seed", _DEFAULTS.seed, "Random seed.")
# Infrastructure.
flags.DEFINE_enum("strategy", _DEFAULTS.strategy, list(training.STRATEGIES),
                  "Distribution strategy.")
flags.DEFINE_string("tpu", None, "TPU name or grpc:// address ('local' on a TPU VM).")
flags.DEFINE_enum("jit_compile", "auto", ["auto", "true", "false"], "XLA compilation.")
flags.DEFINE_enum("mixed_precision", None, ["mixed_float16", "mixed_bfloat16"],
                  "Mixed-precision policy.")
flags.DEFINE_integer("steps_per_execution", _DEFAULTS.steps_per_execution,
                     "Training steps per compiled call (e.g. 100 on TPU).")
flags.DEFINE_integer("checkpoint_every", _DEFAULTS.checkpoint_every,
                     "Steps between mid-epoch checkpoints (0: only at epoch ends).")
flags.DEFINE_integer("num_diagnostic_contexts", _DEFAULTS.num_diagnostic_contexts,
                     "Test contexts for the empirical rank / KL / mode matching.")
flags.DEFINE_integer("verbose", _DEFAULTS.verbose, "1: progress bar, 2: a line per epoch.")
flags.DEFINE_integer("kill_after_steps", None,
                     "Testing: SIGKILL the process after this many steps.")

# Flags copied into the config as they are (only when given explicitly, so
# that a preset's value is not overwritten by a flag default).
_PLAIN = [
    "dataset", "data_dir", "model", "embedding_dim", "hidden_size", "num_layers",
    "ngram_order", "dropout", "init_scale", "head", "chunk_size", "optimizer",
    "learning_rate", "lr_decay", "decay_after_epochs", "batch_size", "bptt",
    "epochs", "steps_per_epoch", "eval_batch_size", "eval_steps", "seed",
    "strategy", "tpu", "mixed_precision", "steps_per_execution",
    "num_diagnostic_contexts", "verbose", "kill_after_steps",
]


def config_from_flags():
    """The `TrainConfig` of the command line: defaults < preset < flags."""
    overrides = {name: FLAGS[name].value for name in _PLAIN if FLAGS[name].present}
    if FLAGS["head_options"].present:
        overrides["head_options"] = registry.parse_options(FLAGS.head_options)
    if FLAGS["dataset_options"].present:
        overrides["dataset_options"] = registry.parse_options(FLAGS.dataset_options)
    if FLAGS["tie_embeddings"].present:
        overrides["tie_embeddings"] = FLAGS.tie_embeddings == "true"
    if FLAGS["clip_norm"].present:
        overrides["clip_norm"] = FLAGS.clip_norm or None
    if FLAGS["checkpoint_every"].present:
        overrides["checkpoint_every"] = FLAGS.checkpoint_every or None
    if FLAGS["unroll"].present:
        overrides["unroll"] = {"auto": None, "true": True, "false": False}[FLAGS.unroll]
    if FLAGS["jit_compile"].present:
        overrides["jit_compile"] = {"auto": "auto", "true": True, "false": False}[FLAGS.jit_compile]
    return training.get_config(FLAGS.preset, **overrides)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = config_from_flags()
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
