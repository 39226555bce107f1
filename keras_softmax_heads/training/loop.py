"""`train_and_evaluate(config, workdir)`: the driver of a training run.

It loads the corpus, builds the model under the distribution strategy,
resumes from the latest checkpoint (see `checkpoints`), trains epoch by
epoch with `model.fit` (or, under `MultiWorkerMirroredStrategy`, with
`MultiWorkerEpochRunner`), validates exactly after each epoch, evaluates
valid/test exactly at the end, computes the diagnostics and writes
`results.json`, `model.keras` (the stateful training model) and
`inference_model.keras` (its stateless copy, for use).
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from keras_softmax_heads.training.builder import build_inference_model
from keras_softmax_heads.training.builder import build_model
from keras_softmax_heads.training.builder import epoch_learning_rate
from keras_softmax_heads.training.builder import optimizer_learning_rate
from keras_softmax_heads.training.callbacks import ProgressBar
from keras_softmax_heads.training.callbacks import SignalCatcher
from keras_softmax_heads.training.callbacks import StepCallback
from keras_softmax_heads.training.callbacks import TrainingInterrupted
from keras_softmax_heads.training.checkpoints import CheckpointManager
from keras_softmax_heads.training.config import TrainConfig
from keras_softmax_heads.training.config import parse_options
from keras_softmax_heads.training.config import read_saved_settings
from keras_softmax_heads.training.config import validate_config
from keras_softmax_heads.training.distribute import VocabularyParallel
from keras_softmax_heads.training.distribute import data_parallel_devices
from keras_softmax_heads.training.distribute import distribute_dataset
from keras_softmax_heads.training.distribute import make_strategy
from keras_softmax_heads.training.distribute import vocabulary_shards
from keras_softmax_heads.training.distribute import worker_info
from keras_softmax_heads.training.evaluation import Evaluator
from keras_softmax_heads.training.evaluation import compute_diagnostics
from keras_softmax_heads.training.inputs import train_dataset
from keras_softmax_heads.training.inputs import train_steps_per_epoch
from keras_softmax_heads.training.records import jsonable as _jsonable
from keras_softmax_heads.version import VERSION


#: What `train_and_evaluate(..., overwrite=True)` removes from a workdir:
#: exactly what a run writes there (other files are left alone).
RUN_OUTPUTS = ("checkpoints", "tensorboard", "workers", "config.json", "results.json",
               "model.keras", "inference_model.keras", "vocab.txt")

#: Fields that say how a run is executed, not what it computes: a finished
#: run with other values of these only is the same finished run.
EXECUTION_FIELDS = frozenset({
    "verbose", "tensorboard", "checkpoint_every", "keep_checkpoints", "kill_after_steps",
    "kill_signal", "strategy", "tpu", "vocab_shards", "jit_compile", "steps_per_execution",
    "deterministic", "data_dir", "unroll", "mixed_precision",
})


def train_and_evaluate(config: TrainConfig, workdir: str, overwrite: bool = False) -> dict:
    """Trains `config`'s model in `workdir` (resuming if it holds a
    checkpoint of the same run), evaluates it exactly and returns (and
    writes to `workdir/results.json`) the results.

    What happens with what `workdir` holds:

    * nothing: a new run;
    * a finished run (`results.json`) of the same settings (up to
      `EXECUTION_FIELDS`): nothing is trained or evaluated; one line says
      so and its results are returned, with `"already_finished": True`;
    * an unfinished run of the same settings (up to `RESUMABLE_FIELDS`;
      e.g. more `epochs` for a finished one): it resumes from its latest
      readable checkpoint;
    * a run of other settings: `ValueError` naming the differing fields;
      nothing is written.

    `overwrite=True` first deletes what a run writes there (`RUN_OUTPUTS`)
    and starts a new run.

    A SIGINT or SIGTERM during training saves a checkpoint at the next step
    and raises `TrainingInterrupted` (rerun to resume there).

    Args:
        config: a `TrainConfig` (see `get_config` for presets) or its dict.
        workdir: directory for checkpoints, TensorBoard logs, the models
            (`model.keras`: the stateful training model, for resuming;
            `inference_model.keras`: the stateless copy to use), the
            vocabulary (`vocab.txt`, `Vocabulary.load`) and `results.json`.
            Non-chief workers of a multi-worker run use
            `workdir/workers/worker_<i>`.
        overwrite: delete a previous run's outputs from `workdir` first.

    Returns:
        A JSON-compatible dict: `valid` / `test` (`nll` in nats, `perplexity`,
        `tokens`), `history` (per epoch: learning rate, training loss,
        validation perplexity, seconds), `diagnostics` (entropy per
        frequency band, empirical rank; for the synthetic corpus KL to the
        truth, mode matching and the distance to the entropy floor),
        `training` (steps, `steps_per_second`), `files` (paths of the
        models, vocabulary and results), `corpus`, `model` and the config.

    Raises:
        ValueError: inconsistent settings, a workdir holding another run,
            or unusable data (e.g. `bptt` longer than the corpus' streams),
            with the numbers involved.
        TrainingInterrupted: SIGINT / SIGTERM during training.
    """
    if isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    validate_config(config)
    # The strategy first: MultiWorkerMirroredStrategy must be created before
    # TensorFlow runs any op.
    strategy = make_strategy(config.strategy, config.tpu, config.vocab_shards)
    is_chief, task_id = worker_info(strategy)
    if not is_chief:
        workdir = os.path.join(workdir, "workers", f"worker_{task_id}")
    if overwrite:
        clear_workdir(workdir)
    finished = finished_results(config, workdir)
    if finished is not None:
        _log(config, f"{workdir} already holds this finished run (same settings): "
                     f"results in {os.path.join(workdir, 'results.json')} (overwrite to train again).")
        return finished
    tf.io.gfile.makedirs(workdir)
    previous_policy = keras.config.dtype_policy()
    try:
        if config.deterministic:
            tf.config.experimental.enable_op_determinism()
        keras.utils.set_random_seed(config.seed)
        if config.mixed_precision:
            keras.config.set_dtype_policy(config.mixed_precision)
        return _run(config, workdir, strategy)
    finally:
        keras.config.set_dtype_policy(previous_policy)


def clear_workdir(workdir):
    """Deletes what a run writes in `workdir` (`RUN_OUTPUTS`), nothing else."""
    for name in RUN_OUTPUTS:
        path = os.path.join(workdir, name)
        if tf.io.gfile.isdir(path):
            tf.io.gfile.rmtree(path)
        elif tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)


def finished_results(config, workdir):
    """The results of a finished run of `config` in `workdir` (its
    `results.json` with `"already_finished": True`), or `None` when there
    is none or its settings differ from `config` outside
    `EXECUTION_FIELDS` (then the run is resumed, or refused)."""
    results = read_results(workdir)
    if results is None:
        return None
    try:
        saved, _ = read_saved_settings(results["config"], results.get("version"))
        saved = TrainConfig.from_dict(saved).to_dict()
    except (ValueError, KeyError, TypeError):
        return None  # from another version: resume / refuse as usual
    current = config.to_dict()
    if any(saved[k] != current[k] for k in current if k not in EXECUTION_FIELDS):
        return None
    results["already_finished"] = True
    return results


def read_results(workdir):
    """The parsed `workdir/results.json`, or `None` when it is absent or
    unreadable."""
    path = os.path.join(workdir, "results.json")
    if not tf.io.gfile.exists(path):
        return None
    try:
        with tf.io.gfile.GFile(path, "r") as f:
            results = json.load(f)
    except ValueError:
        return None
    return results if isinstance(results, dict) else None


def _run(config, workdir, strategy):
    from keras_softmax_heads.data import load_dataset

    corpus = load_dataset(config.dataset, config.data_dir, **parse_options(config.dataset_options))
    steps_per_epoch = train_steps_per_epoch(config, corpus)
    if config.strategy == "model_parallel":
        keras.distribution.set_distribution(
            VocabularyParallel(corpus.vocab_size, config.vocab_shards))
    devices, shards = data_parallel_devices(), vocabulary_shards()
    if config.batch_size % devices:
        raise ValueError(
            "The batch size must be divisible by the number of data-parallel "
            f"devices. Received: batch_size={config.batch_size}, devices={devices}"
        )
    _log(config, f"{corpus!r}; {steps_per_epoch} steps per epoch, "
                 f"{strategy.num_replicas_in_sync} replica(s)"
                 + (f", data parallel over {devices} devices" if devices > 1 else "")
                 + (f", the vocabulary split over {shards} devices" if shards > 1 else ""))
    with strategy.scope():
        model, info = build_model(config, corpus, num_replicas=strategy.num_replicas_in_sync)
    checkpoints = CheckpointManager(workdir, config, model, strategy, steps_per_epoch)
    meta = checkpoints.restore()  # refuses a checkpoint of other settings
    if meta is None:
        _check_previous_results(workdir, checkpoints)
    # The settings are accepted: only now is anything written.
    _write_json(os.path.join(workdir, "config.json"), config.to_dict())
    vocab_path = os.path.join(workdir, "vocab.txt")
    _save_vocabulary(corpus.vocab, vocab_path)
    history, start_epoch, start_step = [], 0, 0
    if meta is not None:
        history = meta["history"]
        start_epoch, start_step = meta["epoch"], meta["step_in_epoch"]
        _log(config, f"Resuming from step {meta['global_step']} (epoch {start_epoch + 1}, "
                     f"step {start_step} of {steps_per_epoch})")
    evaluator = Evaluator(config, corpus, model, strategy)
    trainer = _Trainer(config, workdir, corpus, model, strategy, checkpoints, evaluator,
                       steps_per_epoch)
    with SignalCatcher() as signals:
        final_valid, timing = trainer.train(history, start_epoch, start_step, signals)

    valid = final_valid or evaluator.score(corpus.valid, config.eval_steps, previous=corpus.train)
    test_result = evaluator.evaluate(corpus.test, config.eval_steps,
                                     with_contexts=config.num_diagnostic_contexts,
                                     previous=corpus.valid)
    test = evaluator.summarise(test_result)
    _log(config, f"valid perplexity {valid['perplexity']:.2f}, test perplexity "
                 f"{test['perplexity']:.2f} (exact, {_tokens_text(test, 'test tokens')})")
    diagnostics = compute_diagnostics(config, corpus, evaluator.head, test_result, test)
    _log_synthetic(config, diagnostics, test)

    results = {"config": config.to_dict(), "version": VERSION, "workdir": workdir}
    results["corpus"] = {
        "name": corpus.name, "vocab_size": corpus.vocab_size,
        "train_tokens": int(len(corpus.train)), "valid_tokens": int(len(corpus.valid)),
        "test_tokens": int(len(corpus.test)),
    }
    results["model"] = {
        "num_parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "tied_embeddings": info["tied"], "head": info["head"],
        "context_dim": int(model.backbone.output_dim),
        "num_replicas": strategy.num_replicas_in_sync,
        "data_parallel_devices": devices,
        "vocab_shards": shards,
        "backend": keras.backend.backend(),
    }
    results["training"] = timing
    results["history"] = history
    results["valid"], results["test"] = valid, test
    results["diagnostics"] = diagnostics
    files = {
        "inference_model": os.path.join(workdir, "inference_model.keras"),
        "training_model": os.path.join(workdir, "model.keras"),
        "vocabulary": vocab_path,
        "results": os.path.join(workdir, "results.json"),
    }
    results["files"] = files
    results = _jsonable(results)
    model.save(files["training_model"])
    build_inference_model(config, corpus, model).save(files["inference_model"])
    _write_json(files["results"], results)
    _log(config, f"Saved {files['inference_model']} (stateless, any batch size: use this one; "
                 f"words <-> ids: {files['vocabulary']}), {files['training_model']} (the stateful "
                 f"training model) and {files['results']}.")
    return results


def _save_vocabulary(vocab, path):
    """`vocab.save(path)`, also to remote paths (`gs://...`)."""
    if "://" not in path:
        vocab.save(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "vocab.txt")
        vocab.save(local)
        tf.io.gfile.copy(local, path, overwrite=True)


def _check_previous_results(workdir, checkpoints):
    """Refuses (`ValueError`, one line naming the differing fields) a
    workdir without checkpoints whose finished results belong to other
    settings; before anything is written. (A checkpoint's settings are
    checked by `CheckpointManager.restore`.)"""
    results = read_results(workdir)
    if results is not None and isinstance(results.get("config"), dict):
        checkpoints.check_resume_config(
            results["config"], os.path.join(workdir, "results.json"), results.get("version"))


def _trained_seconds(history):
    """Training seconds of the epochs in `history` (validation excluded)."""
    return float(sum(e["seconds"] for e in history))


def _budget_spent(config, history):
    """Whether the epochs in `history` used up `config.train_seconds`."""
    return bool(config.train_seconds) and bool(history) and \
        _trained_seconds(history) >= config.train_seconds


class _Trainer:
    """The epochs of one run: `fit` (or the multi-worker loop) per epoch,
    checkpoint at each epoch end, exact validation, TensorBoard."""

    def __init__(self, config, workdir, corpus, model, strategy, checkpoints, evaluator,
                 steps_per_epoch):
        self.config = config
        self.corpus = corpus
        self.model = model
        self.strategy = strategy
        self.checkpoints = checkpoints
        self.evaluator = evaluator
        self.steps_per_epoch = steps_per_epoch
        self.multi_worker = None
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            self.multi_worker = MultiWorkerEpochRunner(model, strategy, config)
        self.callbacks, self.valid_writer, self.step_writer = _tensorboard(config, workdir)
        # The training-loss curve: about 20 points per epoch, at most every 100 steps.
        self.summary_every = max(1, min(100, steps_per_epoch // 20))
        self.signals = None

    def train(self, history, start_epoch, start_step, signals=None):
        """Runs epochs `start_epoch..` (the first from batch `start_step`),
        appending to `history`. Returns `(final_valid, timing)`: the last
        epoch's validation summary when it ran here (else `None`) and the
        `training` entry of the results.

        With a `SignalCatcher`, a caught signal stops training at the next
        step boundary (after a checkpoint of that step) or, at an epoch's
        last step, after the epoch's checkpoint: `TrainingInterrupted`."""
        config = self.config
        self.signals = signals
        step_times = []
        final_valid = None
        train_start = time.time()
        epochs_run = len(history)
        if not _budget_spent(config, history):  # (a run resumed after it: no epoch)
            for epoch in range(start_epoch, config.epochs):
                skip = start_step if epoch == start_epoch else 0
                entry, times = self._train_epoch(epoch, skip, history)
                if len(times) > 1:
                    step_times.append((len(times) - 1, times[-1] - times[0]))
                valid = self._validate(epoch, entry) if config.validate_every_epoch else None
                history.append(entry)
                epochs_run = epoch + 1
                spent = _budget_spent(config, history)
                final_valid = valid if (epoch == config.epochs - 1 or spent) else None
                self.checkpoints.save(epoch + 1, 0, history)
                if signals is not None and signals.signum is not None:
                    raise TrainingInterrupted(signals.signum, (epoch + 1) * self.steps_per_epoch)
                if spent:
                    _log(config, f"Training budget of {config.train_seconds:g} s spent after "
                                 f"epoch {epoch + 1}: stopping.")
                    break
        steps_done = sum(n for n, _ in step_times)
        seconds_done = sum(s for _, s in step_times)
        timing = {
            "epochs": epochs_run, "steps_per_epoch": self.steps_per_epoch,
            "global_steps": sum(e.get("steps", self.steps_per_epoch) for e in history),
            "train_seconds": _trained_seconds(history),
            "stopped_by_budget": bool(config.train_seconds) and epochs_run < config.epochs,
            "seconds_this_process": time.time() - train_start,
            "steps_per_second": (steps_done / seconds_done) if seconds_done > 0 else None,
        }
        return final_valid, timing

    def _train_epoch(self, epoch, skip, history):
        """Trains `epoch` from batch `skip`; returns its history entry
        (without validation) and the step end times."""
        config, model = self.config, self.model
        lr = epoch_learning_rate(config, epoch)
        model.optimizer.learning_rate = optimizer_learning_rate(config, epoch)
        if skip == 0:
            model.backbone.reset_states()
        _log(config, f"Epoch {epoch + 1}/{config.epochs}: learning rate {lr:.6g}"
                     + (f", resuming at step {skip}/{self.steps_per_epoch}" if skip else ""))
        dataset = distribute_dataset(self.strategy, lambda: train_dataset(
            config, self.corpus, epoch, self.steps_per_epoch, skip))
        epoch_start = time.time()
        deadline = None
        if config.train_seconds:
            # The budget may end mid-epoch (every head gets the same time).
            deadline = epoch_start + config.train_seconds - _trained_seconds(history)
        step_cb = StepCallback(self.checkpoints, config, epoch, skip, self.steps_per_epoch,
                               history, signals=self.signals, summary_writer=self.step_writer,
                               summary_every=self.summary_every, deadline=deadline)
        steps = self.steps_per_epoch - skip
        if self.multi_worker is not None:
            train_loss = self.multi_worker.run_epoch(dataset, steps, step_cb, epoch)
        else:
            # One header per epoch (ours, above): Keras' bar without its own.
            progress = [ProgressBar()] if config.verbose else []
            fit = model.fit(
                dataset, epochs=config.epochs, initial_epoch=epoch, steps_per_epoch=steps,
                callbacks=[step_cb] + self.callbacks + progress, verbose=config.verbose,
                shuffle=False,
            )
            train_loss = float(fit.history["loss"][-1]) if fit.history.get("loss") else None
        if step_cb.interrupted_at is not None:
            raise TrainingInterrupted(self.signals.signum, step_cb.interrupted_at)
        entry = {
            "epoch": epoch + 1,
            "learning_rate": lr,
            "train_loss": train_loss,
            "seconds": time.time() - epoch_start,
            "steps": step_cb.last_step,
        }
        return entry, step_cb.times

    def _validate(self, epoch, entry):
        """Exact validation after `epoch`: recorded in `entry`, logged,
        written to TensorBoard; returns the summary."""
        config = self.config
        valid = self.evaluator.score(self.corpus.valid, config.eval_steps,
                                         previous=self.corpus.train)
        entry["valid_nll"], entry["valid_perplexity"] = valid["nll"], valid["perplexity"]
        _log(config, f"  valid perplexity {valid['perplexity']:.2f} "
                     f"(exact, {_tokens_text(valid, 'tokens')})")
        if self.valid_writer is not None:
            with self.valid_writer.as_default():
                tf.summary.scalar("perplexity", valid["perplexity"], step=epoch)
                tf.summary.scalar("learning_rate", entry["learning_rate"], step=epoch)
        return valid


class MultiWorkerEpochRunner:
    """Epochs of `model.train_step` under `MultiWorkerMirroredStrategy`.

    Keras 3's `fit` fails under that strategy (its symbolic build reduces a
    batch of per-replica values across workers; keras-team/keras#20585,
    tensorflow/tensorflow#72388), so this loop calls the public
    `train_step` through `strategy.run`, as `fit` would, and drives the
    step callback itself. The step function is traced once per run.
    """

    def __init__(self, model, strategy, config):
        self.model = model
        self.strategy = strategy
        self.config = config
        self._step_fn = None

    def _step(self):
        if self._step_fn is None:
            train_step = self.model.train_step
            if self.config.jit_compile is True:
                # Without AutoGraph, as Keras' own trainer: the step is
                # `keras.ops` code, with no Python control flow on tensors.
                train_step = tf.function(train_step, jit_compile=True, autograph=False)
            strategy = self.strategy

            @tf.function(autograph=False)
            def step_fn(iterator):
                return strategy.run(train_step, args=(next(iterator),))

            self._step_fn = step_fn
        return self._step_fn

    def run_epoch(self, dataset, steps, step_callback, epoch):
        """Runs `steps` steps of `dataset`; returns the epoch's training loss."""
        step_fn = self._step()
        callbacks = keras.callbacks.CallbackList([step_callback], model=self.model)
        self.model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        iterator = iter(dataset)
        logs = None
        for batch in range(steps):
            logs = step_fn(iterator)
            callbacks.on_train_batch_end(batch)
            if step_callback.interrupted_at is not None:
                break
        # Each replica's running mean over its own tokens; equal token counts, so
        # their mean is the global mean (a collective: every worker runs it).
        loss = float(self.strategy.reduce(tf.distribute.ReduceOp.MEAN, logs["loss"], axis=None))
        if self.config.verbose:
            print(f"{steps}/{steps} - loss: {loss:.4f}", flush=True)
        return loss


def _tensorboard(config, workdir):
    """`(callbacks, valid_writer, step_writer)`: the Keras TensorBoard
    callback (per-epoch scalars), a writer for the exact validation and one
    for the training loss every few steps (`train_steps/loss`, at the
    global step, so that resumed runs continue the curve), or
    `([], None, None)` without TensorBoard."""
    use_tensorboard = config.tensorboard and importlib.util.find_spec("tensorboard") is not None
    if config.tensorboard and not use_tensorboard:
        _log(config, "TensorBoard is not installed (pip install tensorboard): no TensorBoard logs.")
    if not use_tensorboard:
        return [], None, None
    callbacks = [keras.callbacks.TensorBoard(
        log_dir=os.path.join(workdir, "tensorboard"), update_freq="epoch")]
    writer = tf.summary.create_file_writer(os.path.join(workdir, "tensorboard", "validation_exact"))
    steps = tf.summary.create_file_writer(os.path.join(workdir, "tensorboard", "train_steps"))
    return callbacks, writer, steps


def _log_synthetic(config, diagnostics, test):
    synthetic = diagnostics.get("synthetic")
    if synthetic is None:
        return
    floor = synthetic.get("test_floor", float("nan"))
    gap = synthetic.get("gap_to_floor", synthetic["gap_to_entropy_rate"])
    _log(config, "Against the true model of the synthetic corpus (nats per token):\n"
                 f"  test cross-entropy {test['nll']:.4f}; floor {floor:.4f} (the true model's "
                 f"cross-entropy on this test sample, the best any model can do; entropy rate "
                 f"{synthetic['true_entropy_rate']:.4f}); gap to the floor {gap:.4f}\n"
                 f"  KL(truth || model) {synthetic['kl_to_truth']:.4f} (mean over "
                 f"{synthetic['num_contexts']} test contexts; 0 = the true next-word "
                 f"distribution)\n"
                 f"  mode matching {synthetic['mode_matching']:.3f} (fraction of those contexts "
                 f"whose most likely next word is the true model's most likely one)")


def _tokens_text(summary, noun):
    """`"N <noun>"`, and that the split was cut short by `eval_steps`
    (`partial`, as `results.json` records it)."""
    text = f"{summary['tokens']} {noun}"
    if summary.get("partial"):
        text += ", partial: the first windows only (eval_steps)"
    return text


def _log(config, message):
    if config.verbose:
        print(message, flush=True)


def _write_json(path, value):
    with tf.io.gfile.GFile(path, "w") as f:
        f.write(json.dumps(_jsonable(value), indent=2))
