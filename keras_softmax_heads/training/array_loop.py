"""`train_and_evaluate_arrays(config, workdir)`: an LSTM run fed from NumPy
arrays, on any Keras backend, without TensorFlow.

It is the run `train_and_evaluate` makes for the LSTM presets, with the
same pieces: the model and optimizer (`build_model`), the learning-rate
schedule, the contiguous-stream batches (`data.stream_windows`, the NumPy
twin of `make_stream_dataset`), the exact evaluation (`Evaluator` with no
strategy) and the papers' diagnostics (`compute_diagnostics`), and it
writes the `results.json` fields that `studies.summarise` reads. It exists
for machines that have JAX or PyTorch and no TensorFlow (the GPU machines),
where `model.fit` takes the windows as arrays.

What it leaves out, with an error where a config asks for it: distribution
strategies, the n-gram model (its shuffled batches are `tf.data`), time
budgets (`train_seconds`) and mid-epoch checkpoints. A run resumes at its
last finished epoch (or goes on when `epochs` grows): the weights of every
epoch are saved to
`workdir/epoch_weights.weights.h5` and the history to `workdir/state.json`
(the presets' plain SGD has no optimizer state to lose).
"""

from __future__ import annotations

import os
import time

import keras
import numpy as np

from keras_softmax_heads.training.builder import build_model
from keras_softmax_heads.training.builder import epoch_learning_rate
from keras_softmax_heads.training.builder import optimizer_learning_rate
from keras_softmax_heads.training.config import RESUMABLE_FIELDS
from keras_softmax_heads.training.config import old_defaults_hint
from keras_softmax_heads.training.config import parse_options
from keras_softmax_heads.training.config import read_saved_settings
from keras_softmax_heads.training.config import validate_config
from keras_softmax_heads.training.evaluation import Evaluator
from keras_softmax_heads.training.evaluation import compute_diagnostics
from keras_softmax_heads.training.inputs import train_steps_per_epoch
from keras_softmax_heads.training.records import jsonable
from keras_softmax_heads.training.records import read_json as _read_json
from keras_softmax_heads.training.records import write_json as _write_json
from keras_softmax_heads.version import VERSION


def train_and_evaluate_arrays(config, workdir):
    """Trains `config`'s LSTM run in `workdir` from NumPy arrays, evaluates
    it exactly and returns (and writes to `workdir/results.json`) the
    results; a finished run is returned as it is, an unfinished one resumes
    at its last finished epoch.

    Raises:
        ValueError: a config this loop cannot run (n-gram model, a
            distribution strategy, `train_seconds`), or a `workdir` holding
            a run of other settings.
    """
    validate_config(config)
    unsupported = {
        "model": (config.model, "lstm"), "strategy": (config.strategy, "default"),
        "train_seconds": (config.train_seconds, None),
    }
    for name, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ValueError(
                f"train_and_evaluate_arrays runs {name}={wanted!r} only (use "
                f"train_and_evaluate, on TensorFlow, for the rest). Received: {name}={value!r}"
            )
    from keras_softmax_heads.data import load_dataset
    from keras_softmax_heads.data import stream_windows

    os.makedirs(workdir, exist_ok=True)
    results_path = os.path.join(workdir, "results.json")
    state_path = os.path.join(workdir, "state.json")
    weights_path = os.path.join(workdir, "epoch_weights.weights.h5")
    settings = config.to_dict()
    for path in (results_path, state_path):
        previous = _read_json(path)
        if previous is None:
            continue
        saved, filled = read_saved_settings(previous["config"], previous.get("version"))
        if _run_settings(saved) != _run_settings(settings):
            raise ValueError(f"{path} holds a run of other settings; use another workdir."
                             + old_defaults_hint(filled, saved, settings))
    finished = _read_json(results_path)
    if finished is not None and len(finished["history"]) >= config.epochs:
        return dict(finished, already_finished=True)

    corpus = load_dataset(config.dataset, config.data_dir, **parse_options(config.dataset_options))
    keras.utils.set_random_seed(config.seed)
    model, info = build_model(config, corpus)
    steps = train_steps_per_epoch(config, corpus)
    inputs, targets = stream_windows(corpus.train, config.batch_size, config.bptt)
    inputs = inputs[:steps].reshape(-1, config.bptt)
    targets = targets[:steps].reshape(-1, config.bptt)
    evaluator = Evaluator(config, corpus, model, None)

    state = _read_json(state_path) or {"config": settings, "history": []}
    state["config"], state["version"] = settings, VERSION
    history = state["history"]
    if history:
        model.load_weights(weights_path)
    step_seconds = []
    for epoch in range(len(history), config.epochs):
        model.optimizer.learning_rate = optimizer_learning_rate(config, epoch)
        model.backbone.reset_states()
        start = time.time()
        fit = model.fit(inputs, targets, batch_size=config.batch_size, epochs=1,
                        shuffle=False, verbose=config.verbose)
        seconds = time.time() - start
        step_seconds.append(seconds / steps)
        entry = {"epoch": epoch + 1, "learning_rate": epoch_learning_rate(config, epoch),
                 "train_loss": float(fit.history["loss"][-1]), "seconds": seconds,
                 "steps": steps}
        if config.validate_every_epoch:
            valid = evaluator.score(corpus.valid, config.eval_steps, previous=corpus.train)
            entry["valid_nll"], entry["valid_perplexity"] = valid["nll"], valid["perplexity"]
        history.append(entry)
        model.save_weights(weights_path)
        _write_json(state_path, state)
        if config.verbose:
            print(f"epoch {epoch + 1}: {entry}", flush=True)

    valid = evaluator.score(corpus.valid, config.eval_steps, previous=corpus.train)
    test_result = evaluator.evaluate(corpus.test, config.eval_steps,
                                     with_contexts=config.num_diagnostic_contexts,
                                     previous=corpus.valid)
    test = evaluator.summarise(test_result)
    results = {
        "config": settings, "version": VERSION, "workdir": workdir, "loop": "arrays",
        "corpus": {"name": corpus.name, "vocab_size": corpus.vocab_size,
                   "train_tokens": int(len(corpus.train)), "valid_tokens": int(len(corpus.valid)),
                   "test_tokens": int(len(corpus.test))},
        "model": {"num_parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
                  "tied_embeddings": info["tied"], "head": info["head"],
                  "context_dim": int(model.backbone.output_dim), "num_replicas": 1,
                  "backend": keras.backend.backend(), "device": _device()},
        "training": {"epochs": len(history), "steps_per_epoch": steps,
                     "global_steps": steps * len(history),
                     "train_seconds": float(sum(e["seconds"] for e in history)),
                     "stopped_by_budget": False,
                     "steps_per_second": (1.0 / float(np.mean(step_seconds))
                                          if step_seconds else None)},
        "history": history, "valid": valid, "test": test,
        "diagnostics": compute_diagnostics(config, corpus, evaluator.head, test_result, test),
    }
    results = jsonable(results)
    _write_json(results_path, results)
    return results


def _run_settings(config_dict):
    """The fields that define what a run computes, up to those a run may
    change when it resumes (`RESUMABLE_FIELDS`, e.g. more `epochs`)."""
    return {k: v for k, v in config_dict.items() if k not in RESUMABLE_FIELDS}


def _device():
    """The accelerator the backend computes on (`"cpu"` without one)."""
    if keras.backend.backend() == "jax":
        import jax

        return str(jax.devices()[0].device_kind)
    return "cpu"
