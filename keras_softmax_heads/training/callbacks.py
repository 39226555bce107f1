"""Per-step work of the training loop: `StepCallback` (mid-epoch
checkpoints, step timing, the training-loss curve, stopping at a signal,
the test kill switch), `SignalCatcher` and `TrainingInterrupted` (Ctrl-C /
SIGTERM: checkpoint at the next step and stop), and `ProgressBar`."""

from __future__ import annotations

import os
import signal
import threading
import time

import keras
import tensorflow as tf


class TrainingInterrupted(Exception):
    """Training stopped at a step boundary on SIGINT / SIGTERM, after saving
    a checkpoint of that step: rerunning the same command resumes there.

    Attributes:
        signum: the signal received.
        global_step: the step of the checkpoint saved.
        exit_code: `128 + signum` (130 for SIGINT, 143 for SIGTERM), the
            status a shell expects of a process stopped by that signal.
    """

    def __init__(self, signum, global_step):
        self.signum = int(signum)
        self.global_step = int(global_step)
        super().__init__(
            f"Interrupted at step {self.global_step} ({signal.Signals(self.signum).name}); "
            "checkpoint saved. Rerun the same command to resume."
        )

    @property
    def exit_code(self):
        return 128 + self.signum


class SignalCatcher:
    """Context manager: while active (in the main thread), SIGINT and
    SIGTERM do not stop the process but set `signum`, which the training
    loop reads at the next step boundary. The first signal also puts the
    previous handlers back, so a second Ctrl-C stops at once. The previous
    handlers are restored on exit. Outside the main thread (where Python
    cannot install handlers) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
        self._restore()

    def _restore(self):
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def __exit__(self, *exc):
        self._restore()
        return False


class ProgressBar(keras.callbacks.ProgbarLogger):
    """Keras' progress bar without its own "Epoch e/E" line: the training
    loop prints one header per epoch (with the learning rate)."""

    def set_params(self, params):
        super().set_params(params)
        self.epochs = 1  # ProgbarLogger prints its header only when epochs > 1


class StepCallback(keras.callbacks.Callback):
    """Checkpoints every `checkpoint_every` steps, times steps, stops on a
    signal, kills (tests).

    One instance per epoch. It runs under `fit(epochs=config.epochs,
    initial_epoch=epoch)` and stops training at the end of that one epoch:
    the loop over epochs is the caller's.

    Args:
        checkpoints: the run's `CheckpointManager`.
        config: the run's `TrainConfig` (`checkpoint_every`,
            `kill_after_steps`, `kill_signal`).
        epoch: the 0-based epoch this callback runs.
        offset: batches of `epoch` already done before this `fit` (resumed
            mid-epoch); the dataset starts after them.
        steps_per_epoch: training steps of a whole epoch.
        history: the run's per-epoch history list, saved with checkpoints.
        signals: optional `SignalCatcher`; once it has caught a signal, the
            next step that is not the last of the epoch saves a checkpoint
            (unless one of that step exists) and stops training
            (`interrupted_at` is then its global step). At the last step
            the epoch ends normally; the caller stops after its checkpoint.
        summary_writer: optional `tf.summary` writer; every `summary_every`
            global steps it gets `loss`, the running mean of the training
            loss since the start of the epoch (Keras' `loss` log).
        summary_every: see `summary_writer`.
        deadline: optional `time.time()` value (the training budget,
            `config.train_seconds`): the first step that ends after it stops
            training.

    Attributes:
        times: `time.perf_counter()` at the end of every step.
        interrupted_at: global step at which a signal stopped training, or
            `None`.
        last_step: the step in the epoch of the last step run.
    """

    def __init__(self, checkpoints, config, epoch, offset, steps_per_epoch, history,
                 signals=None, summary_writer=None, summary_every=0, deadline=None):
        super().__init__()
        self.checkpoints = checkpoints
        self.config = config
        self.epoch = epoch
        self.offset = offset
        self.steps_per_epoch = steps_per_epoch
        self.history = history
        self.signals = signals
        self.summary_writer = summary_writer
        self.summary_every = summary_every
        self.deadline = deadline
        self.times = []
        self.interrupted_at = None
        self.last_step = offset

    def on_epoch_begin(self, epoch, logs=None):
        # Resuming mid-epoch: continue the running mean of the training loss.
        if self.offset:
            self.checkpoints.restore_running_metrics()

    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = True

    def _save(self, step_in_epoch):
        # Reading `self.model` makes Keras write the JAX trainer's state
        # (held outside the variables during `fit`) back to the variables.
        self.model  # noqa: B018
        self.checkpoints.save(self.epoch, step_in_epoch, self.history)

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())
        step_in_epoch = self.offset + batch + 1
        self.last_step = step_in_epoch
        global_step = self.epoch * self.steps_per_epoch + step_in_epoch
        every = self.config.checkpoint_every
        mid_epoch = step_in_epoch < self.steps_per_epoch
        if (every and mid_epoch
                and global_step // every > self.checkpoints.last_saved_step // every):
            self._save(step_in_epoch)
        if (self.summary_writer is not None and self.summary_every
                and global_step % self.summary_every == 0 and logs and "loss" in logs):
            with self.summary_writer.as_default():
                tf.summary.scalar("loss", float(logs["loss"]), step=global_step)
        if self.config.kill_after_steps and global_step >= self.config.kill_after_steps:
            os.kill(os.getpid(), self.config.kill_signal)
        if self.signals is not None and self.signals.signum is not None and mid_epoch:
            if self.checkpoints.last_saved_step != global_step:
                self._save(step_in_epoch)
            self.interrupted_at = global_step
            self.model.stop_training = True
        elif self.deadline is not None and mid_epoch and time.time() >= self.deadline:
            self.model.stop_training = True
