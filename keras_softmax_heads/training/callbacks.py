"""`StepCallback`: per-step work of the training loop (mid-epoch
checkpoints, step timing, the test kill switch)."""

from __future__ import annotations

import os
import signal
import time

import keras


class StepCallback(keras.callbacks.Callback):
    """Checkpoints every `checkpoint_every` steps, times steps, kills (tests).

    One instance per epoch. It runs under `fit(epochs=config.epochs,
    initial_epoch=epoch)` (so the progress bar says "Epoch e/E") and stops
    training at the end of that one epoch: the loop over epochs is the
    caller's.

    Args:
        checkpoints: the run's `CheckpointManager`.
        config: the run's `TrainConfig` (`checkpoint_every`,
            `kill_after_steps`).
        epoch: the 0-based epoch this callback runs.
        offset: batches of `epoch` already done before this `fit` (resumed
            mid-epoch); the dataset starts after them.
        steps_per_epoch: training steps of a whole epoch.
        history: the run's per-epoch history list, saved with checkpoints.

    Attributes:
        times: `time.perf_counter()` at the end of every step.
    """

    def __init__(self, checkpoints, config, epoch, offset, steps_per_epoch, history):
        super().__init__()
        self.checkpoints = checkpoints
        self.config = config
        self.epoch = epoch
        self.offset = offset
        self.steps_per_epoch = steps_per_epoch
        self.history = history
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        # Resuming mid-epoch: continue the running mean of the training loss.
        if self.offset:
            self.checkpoints.restore_running_metrics()

    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = True

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())
        step_in_epoch = self.offset + batch + 1
        global_step = self.epoch * self.steps_per_epoch + step_in_epoch
        every = self.config.checkpoint_every
        if (every and step_in_epoch < self.steps_per_epoch
                and global_step // every > self.checkpoints.last_saved_step // every):
            self.checkpoints.save(self.epoch, step_in_epoch, self.history)
        if self.config.kill_after_steps and global_step >= self.config.kill_after_steps:
            os.kill(os.getpid(), signal.SIGKILL)
