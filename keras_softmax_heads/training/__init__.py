"""Train and evaluate a language model with any head: `train_and_evaluate`.

This is the logic behind `examples/train_lm.py` (which only defines flags),
in the style of the Flax lm1b example: `train_and_evaluate(config, workdir)`
loads a corpus, builds a backbone (`LSTMLanguageModel` or
`NgramLanguageModel`) and a head from the registry, trains with `model.fit`
under a distribution strategy, checkpoints every `checkpoint_every` steps,
resumes after a kill with nothing lost, evaluates exactly on valid/test and
computes the papers' diagnostics. Everything it measures is returned and
written to `workdir/results.json`.

Modules, one job each:

* `config`: `TrainConfig` (every field with its help and choices),
  `PRESETS`, `get_config`, `validate_config`, `RESUMABLE_FIELDS`,
  `OPTIMIZERS`, `parse_options`, `read_saved_settings` (a saved run's
  settings as this version reads them: 0.3.0's head defaults where they
  changed).
* `flags`: absl flags generated from `TrainConfig` (`define_flags`,
  `config_from_flags`).
* `distribute`: `DISTRIBUTION_STRATEGIES`, `make_strategy`, `worker_info`,
  `distribute_dataset` (global batches split between replicas),
  `VocabularyParallel` (JAX: the vocabulary-sized weights split over
  devices).
* `builder`: `build_model`, `build_inference_model` (the stateless copy
  saved for inference), `make_optimizer`, the learning-rate schedule
  (`epoch_learning_rate`, `optimizer_learning_rate`), `lstm_unroll`.
* `inputs`: `train_steps_per_epoch`, `train_dataset`, `eval_windows`.
* `checkpoints`: `CheckpointManager`, the checkpoint directory and format
  (the resume design is described there).
* `callbacks`: `StepCallback` (mid-epoch checkpoints, step times, the
  training-loss curve, stopping at a signal, the test kill switch),
  `SignalCatcher`, `TrainingInterrupted`, `ProgressBar`.
* `evaluation`: `Evaluator` (exact scoring of a split), `Scorer`,
  `compute_diagnostics`.
* `loop`: `train_and_evaluate` and the multi-worker epoch loop.
* `array_loop`: `train_and_evaluate_arrays`, the same LSTM run fed from
  NumPy arrays on any backend without TensorFlow (the GPU machines).

Loss convention. `HeadModel` minimises the mean per-token loss. Zaremba et
al. (2014) minimise the per-window *sum over time* of the batch-mean loss,
with SGD. For SGD the two are exactly equivalent after rescaling: learning
rate `lr * bptt` and clipping norm `clip / bptt` (the gradient is `bptt`
times smaller). `loss_reduction="sum_over_time"` applies that rescaling, so
the presets keep the paper's numbers (lr 1.0, clip 5).
"""

from keras_softmax_heads.training import flags
from keras_softmax_heads.training.builder import build_inference_model
from keras_softmax_heads.training.builder import build_model
from keras_softmax_heads.training.builder import epoch_learning_rate
from keras_softmax_heads.training.builder import loss_time_steps
from keras_softmax_heads.training.builder import lstm_unroll
from keras_softmax_heads.training.builder import make_optimizer
from keras_softmax_heads.training.builder import optimizer_learning_rate
from keras_softmax_heads.training.config import OPTIMIZERS
from keras_softmax_heads.training.config import PRESETS
from keras_softmax_heads.training.config import RESUMABLE_FIELDS
from keras_softmax_heads.training.config import TrainConfig
from keras_softmax_heads.training.config import get_config
from keras_softmax_heads.training.config import parse_options
from keras_softmax_heads.training.config import read_saved_settings
from keras_softmax_heads.training.config import validate_config
from keras_softmax_heads.training.distribute import DISTRIBUTION_STRATEGIES
from keras_softmax_heads.training.distribute import VocabularyParallel
from keras_softmax_heads.training.distribute import distribute_dataset
from keras_softmax_heads.training.distribute import make_strategy
from keras_softmax_heads.training.distribute import worker_info
from keras_softmax_heads.training.evaluation import Evaluator
from keras_softmax_heads.training.evaluation import Scorer
from keras_softmax_heads.training.evaluation import compute_diagnostics
from keras_softmax_heads.training.flags import config_from_flags
from keras_softmax_heads.training.flags import define_flags
from keras_softmax_heads.training.inputs import eval_windows
from keras_softmax_heads.training.inputs import train_dataset
from keras_softmax_heads.training.inputs import train_steps_per_epoch

#: Names whose modules import TensorFlow (`tf.data` input, `tf.distribute`,
#: `tf.train.Checkpoint`): loaded on first access, so that the rest of this
#: package (configs, models, exact evaluation, `train_and_evaluate_arrays`)
#: loads on JAX or PyTorch without TensorFlow installed.
_LAZY = {
    "ProgressBar": "keras_softmax_heads.training.callbacks",
    "SignalCatcher": "keras_softmax_heads.training.callbacks",
    "StepCallback": "keras_softmax_heads.training.callbacks",
    "TrainingInterrupted": "keras_softmax_heads.training.callbacks",
    "CheckpointManager": "keras_softmax_heads.training.checkpoints",
    "MultiWorkerEpochRunner": "keras_softmax_heads.training.loop",
    "train_and_evaluate": "keras_softmax_heads.training.loop",
    "train_and_evaluate_arrays": "keras_softmax_heads.training.array_loop",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DISTRIBUTION_STRATEGIES",
    "OPTIMIZERS",
    "PRESETS",
    "RESUMABLE_FIELDS",
    "CheckpointManager",
    "Evaluator",
    "MultiWorkerEpochRunner",
    "Scorer",
    "ProgressBar",
    "SignalCatcher",
    "StepCallback",
    "TrainingInterrupted",
    "TrainConfig",
    "VocabularyParallel",
    "build_inference_model",
    "build_model",
    "compute_diagnostics",
    "config_from_flags",
    "define_flags",
    "distribute_dataset",
    "epoch_learning_rate",
    "eval_windows",
    "flags",
    "get_config",
    "loss_time_steps",
    "lstm_unroll",
    "make_optimizer",
    "make_strategy",
    "optimizer_learning_rate",
    "parse_options",
    "read_saved_settings",
    "train_and_evaluate",
    "train_and_evaluate_arrays",
    "train_dataset",
    "train_steps_per_epoch",
    "validate_config",
    "worker_info",
]
