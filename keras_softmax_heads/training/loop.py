"""`train_and_evaluate(config, workdir)`: the driver of a training run.

It loads the corpus, builds the model under the distribution strategy,
resumes from the latest checkpoint (see `checkpoints`), trains epoch by
epoch with `model.fit` (or, under `MultiWorkerMirroredStrategy`, with
`MultiWorkerEpochRunner`), validates exactly after each epoch, evaluates
valid/test exactly at the end, computes the diagnostics and writes
`results.json` and `model.keras`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time

import keras
import numpy as np
import tensorflow as tf

from keras_softmax_heads.training.builder import build_model
from keras_softmax_heads.training.builder import epoch_learning_rate
from keras_softmax_heads.training.builder import optimizer_learning_rate
from keras_softmax_heads.training.callbacks import StepCallback
from keras_softmax_heads.training.checkpoints import CheckpointManager
from keras_softmax_heads.training.config import TrainConfig
from keras_softmax_heads.training.config import parse_options
from keras_softmax_heads.training.config import validate_config
from keras_softmax_heads.training.distribute import distribute_dataset
from keras_softmax_heads.training.distribute import make_strategy
from keras_softmax_heads.training.distribute import worker_info
from keras_softmax_heads.training.evaluation import Evaluator
from keras_softmax_heads.training.evaluation import compute_diagnostics
from keras_softmax_heads.training.inputs import train_dataset
from keras_softmax_heads.training.inputs import train_steps_per_epoch


def train_and_evaluate(config: TrainConfig, workdir: str) -> dict:
    """Trains `config`'s model in `workdir` (resuming if it holds a
    checkpoint), evaluates it exactly and returns (and writes to
    `workdir/results.json`) the results.

    Args:
        config: a `TrainConfig` (see `get_config` for presets) or its dict.
        workdir: directory for checkpoints, TensorBoard logs, the final
            `model.keras` and `results.json`. Non-chief workers of a
            multi-worker run use `workdir/workers/worker_<i>`.

    Returns:
        A JSON-compatible dict: `valid` / `test` (`nll` in nats, `perplexity`,
        `tokens`), `history` (per epoch: learning rate, training loss,
        validation perplexity, seconds), `diagnostics` (entropy per
        frequency band, empirical rank; for the synthetic corpus KL to the
        truth, mode matching and the distance to the entropy floor),
        `training` (steps, `steps_per_second`), `corpus`, `model` and the
        config.

    Raises:
        ValueError: inconsistent settings or unusable data (e.g. `bptt`
            longer than the corpus' streams), with the numbers involved.
    """
    if isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    validate_config(config)
    # The strategy first: MultiWorkerMirroredStrategy must be created before
    # TensorFlow runs any op.
    strategy = make_strategy(config.strategy, config.tpu)
    is_chief, task_id = worker_info(strategy)
    if not is_chief:
        workdir = os.path.join(workdir, "workers", f"worker_{task_id}")
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


def _run(config, workdir, strategy):
    from keras_softmax_heads.data import load_dataset

    _write_json(os.path.join(workdir, "config.json"), config.to_dict())
    corpus = load_dataset(config.dataset, config.data_dir, **parse_options(config.dataset_options))
    steps_per_epoch = train_steps_per_epoch(config, corpus)
    _log(config, f"{corpus!r}; {steps_per_epoch} steps per epoch, "
                 f"{strategy.num_replicas_in_sync} replica(s)")
    with strategy.scope():
        model, info = build_model(config, corpus, num_replicas=strategy.num_replicas_in_sync)
    checkpoints = CheckpointManager(workdir, config, model, strategy, steps_per_epoch)
    meta = checkpoints.restore()
    history, start_epoch, start_step = [], 0, 0
    if meta is not None:
        history = meta["history"]
        start_epoch, start_step = meta["epoch"], meta["step_in_epoch"]
        _log(config, f"Resuming from step {meta['global_step']} (epoch {start_epoch + 1}, "
                     f"step {start_step} of {steps_per_epoch})")
    evaluator = Evaluator(config, corpus, model, strategy)
    trainer = _Trainer(config, workdir, corpus, model, strategy, checkpoints, evaluator,
                       steps_per_epoch)
    final_valid, timing = trainer.train(history, start_epoch, start_step)

    valid = final_valid or evaluator.score(corpus.valid, config.eval_steps)
    test_result = evaluator.evaluate(corpus.test, config.eval_steps,
                                     with_contexts=config.num_diagnostic_contexts)
    test = evaluator.summarise(test_result)
    _log(config, f"valid perplexity {valid['perplexity']:.2f}, test perplexity "
                 f"{test['perplexity']:.2f} (exact, {test['tokens']} test tokens)")
    diagnostics = compute_diagnostics(config, corpus, evaluator.head, test_result, test)
    _log_synthetic(config, diagnostics, test)

    results = {"config": config.to_dict(), "workdir": workdir}
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
    }
    results["training"] = timing
    results["history"] = history
    results["valid"], results["test"] = valid, test
    results["diagnostics"] = diagnostics
    results = _jsonable(results)
    model.save(os.path.join(workdir, "model.keras"))
    _write_json(os.path.join(workdir, "results.json"), results)
    return results


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
        self.callbacks, self.valid_writer = _tensorboard(config, workdir)

    def train(self, history, start_epoch, start_step):
        """Runs epochs `start_epoch..` (the first from batch `start_step`),
        appending to `history`. Returns `(final_valid, timing)`: the last
        epoch's validation summary when it ran here (else `None`) and the
        `training` entry of the results."""
        config = self.config
        step_times = []
        final_valid = None
        train_start = time.time()
        for epoch in range(start_epoch, config.epochs):
            skip = start_step if epoch == start_epoch else 0
            entry, times = self._train_epoch(epoch, skip, history)
            if len(times) > 1:
                step_times.append((len(times) - 1, times[-1] - times[0]))
            if config.validate_every_epoch:
                valid = self._validate(epoch, entry)
                final_valid = valid if epoch == config.epochs - 1 else None
            history.append(entry)
            self.checkpoints.save(epoch + 1, 0, history)
        steps_done = sum(n for n, _ in step_times)
        seconds_done = sum(s for _, s in step_times)
        timing = {
            "epochs": config.epochs, "steps_per_epoch": self.steps_per_epoch,
            "global_steps": config.epochs * self.steps_per_epoch,
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
        step_cb = StepCallback(self.checkpoints, config, epoch, skip, self.steps_per_epoch,
                               history)
        epoch_start = time.time()
        steps = self.steps_per_epoch - skip
        if self.multi_worker is not None:
            train_loss = self.multi_worker.run_epoch(dataset, steps, step_cb, epoch)
        else:
            fit = model.fit(
                dataset, epochs=config.epochs, initial_epoch=epoch, steps_per_epoch=steps,
                callbacks=[step_cb] + self.callbacks, verbose=config.verbose, shuffle=False,
            )
            train_loss = float(fit.history["loss"][-1])
        entry = {
            "epoch": epoch + 1,
            "learning_rate": lr,
            "train_loss": train_loss,
            "seconds": time.time() - epoch_start,
        }
        return entry, step_cb.times

    def _validate(self, epoch, entry):
        """Exact validation after `epoch`: recorded in `entry`, logged,
        written to TensorBoard; returns the summary."""
        config = self.config
        valid = self.evaluator.score(self.corpus.valid, config.eval_steps)
        entry["valid_nll"], entry["valid_perplexity"] = valid["nll"], valid["perplexity"]
        _log(config, f"  valid perplexity {valid['perplexity']:.2f} (exact, {valid['tokens']} tokens)")
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
                train_step = tf.function(train_step, jit_compile=True)
            strategy = self.strategy

            @tf.function
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
        # Each replica's running mean over its own tokens; equal token counts, so
        # their mean is the global mean (a collective: every worker runs it).
        loss = float(self.strategy.reduce(tf.distribute.ReduceOp.MEAN, logs["loss"], axis=None))
        if self.config.verbose:
            print(f"{steps}/{steps} - loss: {loss:.4f}", flush=True)
        return loss


def _tensorboard(config, workdir):
    """`(callbacks, valid_writer)`: the Keras TensorBoard callback and a
    writer for the exact validation, or `([], None)` without TensorBoard."""
    use_tensorboard = config.tensorboard and importlib.util.find_spec("tensorboard") is not None
    if config.tensorboard and not use_tensorboard:
        _log(config, "TensorBoard is not installed (pip install tensorboard): no TensorBoard logs.")
    if not use_tensorboard:
        return [], None
    callbacks = [keras.callbacks.TensorBoard(
        log_dir=os.path.join(workdir, "tensorboard"), update_freq="epoch")]
    writer = tf.summary.create_file_writer(os.path.join(workdir, "tensorboard", "validation_exact"))
    return callbacks, writer


def _log_synthetic(config, diagnostics, test):
    synthetic = diagnostics.get("synthetic")
    if synthetic is None:
        return
    _log(config, f"test cross-entropy {test['nll']:.4f} nats; true entropy rate "
                 f"{synthetic['true_entropy_rate']:.4f}; floor of this test sample "
                 f"{synthetic.get('test_floor', float('nan')):.4f}; gap "
                 f"{synthetic.get('gap_to_floor', synthetic['gap_to_entropy_rate']):.4f} nats; "
                 f"KL {synthetic['kl_to_truth']:.4f}, mode matching {synthetic['mode_matching']:.3f}")


def _log(config, message):
    if config.verbose:
        print(message, flush=True)


def _write_json(path, value):
    with tf.io.gfile.GFile(path, "w") as f:
        f.write(json.dumps(_jsonable(value), indent=2))


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    return value

