"""`CheckpointManager`: the checkpoint directory of a run and its format.

Resuming. Keras' `BackupAndRestore` restores at epoch granularity and knows
nothing of the LSTM state carried across windows or of the position in the
data stream. Here a checkpoint (`workdir/checkpoints/ckpt-<step>.npz`, written
to a temporary name, fsynced and renamed, so neither a kill nor a power loss
leaves a half-written one under the final name)
holds every model variable (weights and the dropout/sampling RNG states), the
optimizer variables, the carried LSTM state, the running training-loss
metric, the epoch and step within the epoch, and the history so far. On
restart the latest checkpoint is restored and the already consumed batches of
the interrupted epoch are skipped (`dataset.skip(k)`): the data order is a
pure function of (seed, epoch), so the resumed run continues exactly where the
killed one was and ends with the same weights and metrics. A checkpoint that
cannot be read (e.g. truncated by a full disk) is reported and skipped: the
previous one is restored instead.

Format of `ckpt-<global step, 10 digits>.npz` (one `np.savez` archive):
`model_<i>` (the `i`-th of `model.variables`), `optimizer_<i>`, `carry_<i>`
(the `i`-th carried LSTM state variable, all local replicas concatenated
along the batch axis), `metric_<i>` (running-metric variables; mid-epoch
checkpoints only) and `meta` (JSON: epoch, step_in_epoch, global_step,
steps_per_epoch, history, config, variable counts, time, the package
`version`; 0.3.0 and before wrote none).
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from keras_softmax_heads.training.config import RESUMABLE_FIELDS
from keras_softmax_heads.training.config import old_defaults_hint
from keras_softmax_heads.training.config import read_saved_settings
from keras_softmax_heads.version import VERSION


class CheckpointManager:
    """Saves and restores the state of one run in `workdir/checkpoints`.

    Args:
        workdir: the run's work directory.
        config: the run's `TrainConfig` (saved with every checkpoint and
            compared on restore).
        model: the training `HeadModel`, compiled (its optimizer built).
        strategy: the strategy the model was built under (the carried LSTM
            state is read and written per local replica).
        steps_per_epoch: training steps per epoch (global step =
            `epoch * steps_per_epoch + step_in_epoch`).
    """

    def __init__(self, workdir, config, model, strategy, steps_per_epoch):
        self._directory = os.path.join(workdir, "checkpoints")
        self._config = config
        self._model = model
        self._strategy = strategy
        self._steps_per_epoch = steps_per_epoch
        self._last_saved_step = 0
        self._resumed_metric_values = None

    @property
    def directory(self):
        """`workdir/checkpoints`."""
        return self._directory

    @property
    def last_saved_step(self):
        """Global step of the last checkpoint saved or restored (0: none)."""
        return self._last_saved_step

    def list_checkpoints(self):
        """`[(global_step, path)]` of the complete checkpoints, oldest first."""
        found = []
        for path in tf.io.gfile.glob(os.path.join(self._directory, "ckpt-*.npz")):
            m = re.search(r"ckpt-(\d+)\.npz$", path)
            if m:
                found.append((int(m.group(1)), path))
        return sorted(found)

    # ------------------------------------------------------------ save
    def save(self, epoch, step_in_epoch, history):
        """Writes the checkpoint of global step `epoch * steps_per_epoch +
        step_in_epoch` (atomically) and deletes all but the newest
        `config.keep_checkpoints`.

        `step_in_epoch=0` is the end of epoch `epoch - 1`: no running
        metric is saved then (the next epoch starts a new mean); mid-epoch
        checkpoints save the running training-loss mean.
        """
        global_step = epoch * self._steps_per_epoch + step_in_epoch
        model = self._model
        arrays = {}
        for i, v in enumerate(model.variables):
            arrays[f"model_{i}"] = keras.ops.convert_to_numpy(v)
        for i, v in enumerate(model.optimizer.variables):
            arrays[f"optimizer_{i}"] = keras.ops.convert_to_numpy(v)
        for i, value in enumerate(self.read_carried_state()):
            arrays[f"carry_{i}"] = value
        for i, value in enumerate(self.running_metric_values() if step_in_epoch else []):
            arrays[f"metric_{i}"] = value
        meta = {
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "global_step": global_step,
            "steps_per_epoch": self._steps_per_epoch,
            "history": history,
            "config": self._config.to_dict(),
            "num_model_variables": len(model.variables),
            "num_optimizer_variables": len(model.optimizer.variables),
            "time": time.time(),
            "version": VERSION,
        }
        arrays["meta"] = np.array(json.dumps(meta))
        tf.io.gfile.makedirs(self._directory)
        final = os.path.join(self._directory, f"ckpt-{global_step:010d}.npz")
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        write_atomically(final, buffer.getvalue())
        for _, path in self.list_checkpoints()[: -self._config.keep_checkpoints]:
            tf.io.gfile.remove(path)
        self._last_saved_step = global_step

    # --------------------------------------------------------- restore
    def restore(self):
        """Restores the latest readable checkpoint; returns its metadata or
        `None` when there is none.

        A checkpoint that cannot be read (truncated, not a zip archive, a
        missing array) is skipped with one line on stderr naming the file
        and the reason, and the previous one is tried; once one is
        restored, the damaged newer files are renamed `*.damaged` (kept for
        inspection, out of the way of later resumes). Temporary files of
        saves interrupted by a kill are removed. The running metric of a
        mid-epoch checkpoint is kept until `restore_running_metrics()` puts
        it back (after Keras resets the metrics at the start of the resumed
        epoch).

        Raises:
            ValueError: the checkpoint belongs to a different run (config,
                steps per epoch or variable counts differ), or no checkpoint
                in the directory can be read (the message says what to do).
        """
        found = self.list_checkpoints()
        damaged = []
        for step, path in reversed(found):
            try:
                arrays, meta = read_checkpoint(path)
            except Exception as err:  # any reading failure: try the previous one
                reason = f"{type(err).__name__}: {err}".strip().rstrip(":")
                print(f"Skipping damaged checkpoint {path} ({reason}); trying the previous one.",
                      file=sys.stderr, flush=True)
                damaged.append(path)
                continue
            self.check_resume_config(meta["config"], path, meta.get("version"))
            self._check_compatible(meta, path)
            self._assign(arrays)
            for bad in damaged:
                tf.io.gfile.rename(bad, bad + ".damaged", overwrite=True)
            self._remove_stale_temporaries()
            self._last_saved_step = step
            return meta
        if damaged:
            raise ValueError(
                f"No readable checkpoint in {self._directory}: all {len(damaged)} are damaged "
                f"(newest: {damaged[0]}). Delete that directory (or rerun with --overwrite) "
                "to train from scratch."
            )
        self._remove_stale_temporaries()
        return None

    def _remove_stale_temporaries(self):
        for stale in tf.io.gfile.glob(os.path.join(self._directory, "*.tmp-*")):
            tf.io.gfile.remove(stale)  # a save interrupted by a kill

    def _assign(self, arrays):
        for i, v in enumerate(self._model.variables):
            v.assign(arrays[f"model_{i}"])
        for i, v in enumerate(self._model.optimizer.variables):
            v.assign(arrays[f"optimizer_{i}"])
        carried = self._model.backbone.carried_state_variables
        self.write_carried_state([arrays[f"carry_{i}"] for i in range(len(carried))])
        # Mid-epoch checkpoints hold the running training-loss mean.
        self._resumed_metric_values = [
            arrays[f"metric_{i}"] for i in range(len(self._metric_variables()))
            if f"metric_{i}" in arrays
        ] or None

    def _check_compatible(self, meta, path):
        if meta["steps_per_epoch"] != self._steps_per_epoch:
            raise ValueError(
                f"{path} was written with {meta['steps_per_epoch']} steps per epoch; "
                f"this run has {self._steps_per_epoch}."
            )
        variables = self._model.variables
        opt_variables = self._model.optimizer.variables
        if (meta["num_model_variables"] != len(variables)
                or meta["num_optimizer_variables"] != len(opt_variables)):
            raise ValueError(
                f"{path} does not match this model: {meta['num_model_variables']} model / "
                f"{meta['num_optimizer_variables']} optimizer variables saved, "
                f"{len(variables)} / {len(opt_variables)} here."
            )

    def check_resume_config(self, saved, path, version):
        """Raises `ValueError` naming every field of `saved` (a checkpoint's
        config dict, from `path`, saved by package `version`: `None` for
        0.3.0 and before) that differs from this run's config, except
        `RESUMABLE_FIELDS`. Old settings are read with the head defaults
        of their time (`config.read_saved_settings`); the error then says
        which options resume them."""
        saved, filled = read_saved_settings(saved, version)
        current = self._config.to_dict()
        differing = sorted(
            k for k in current
            if k not in RESUMABLE_FIELDS and saved.get(k) != current[k]
            and not (isinstance(current[k], (list, tuple)) and list(saved.get(k) or []) == list(current[k]))
        )
        if differing:
            details = ", ".join(f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in differing)
            raise ValueError(
                f"The workdir holds a checkpoint ({path}) of a different run "
                f"({details}). Use another workdir or the same settings."
                + old_defaults_hint(filled, saved, current)
            )

    # ------------------------------------------------ running metrics
    def _metric_variables(self):
        return [v for m in self._model.metrics for v in m.variables]

    def running_metric_values(self):
        """Current values of the model's metric variables (the running
        training-loss mean), as NumPy arrays."""
        return [keras.ops.convert_to_numpy(v) for v in self._metric_variables()]

    def restore_running_metrics(self):
        """Assigns the running metric of the restored mid-epoch checkpoint
        to the model's metric variables, once; later calls (and calls
        without such a checkpoint) do nothing. Returns whether it did."""
        values, self._resumed_metric_values = self._resumed_metric_values, None
        if values is None:
            return False
        for v, value in zip(self._metric_variables(), values):
            v.assign(value)
        return True

    # -------------------------------------------- carried LSTM state
    def read_carried_state(self):
        """The backbone's carried state, one array per state variable with
        the local replicas' rows concatenated (`[local batch, units]`)."""
        out = []
        for var in self._model.backbone.carried_state_variables:
            parts = self._strategy.experimental_local_results(var.value)
            out.append(np.concatenate([keras.ops.convert_to_numpy(p) for p in parts], axis=0))
        return out

    def write_carried_state(self, values):
        """Inverse of `read_carried_state`: splits each array's rows between
        the local replicas."""
        variables = self._model.backbone.carried_state_variables
        if len(values) != len(variables):
            raise ValueError(
                f"The checkpoint carries {len(values)} LSTM states but the model "
                f"has {len(variables)}."
            )
        for var, value in zip(variables, values):
            parts = self._strategy.experimental_local_results(var.value)
            local = len(parts)
            rows = parts[0].shape[0]
            if value.shape[0] != local * rows:
                raise ValueError(
                    "The checkpoint's carried LSTM state has "
                    f"{value.shape[0]} rows but this process holds {local} replica(s) "
                    f"of {rows} rows; resume with the same global batch size."
                )
            chunks = [value[i * rows:(i + 1) * rows] for i in range(local)]
            if local == 1 and self._strategy.num_replicas_in_sync == 1:
                var.assign(chunks[0])
                continue
            for part, chunk in zip(parts, chunks):
                part.assign(chunk)


def read_checkpoint(path):
    """`(arrays, meta)` of the checkpoint file `path`: every array of the
    archive (read in full, so that a damaged file fails here) and the
    decoded `meta` dict. Raises whatever reading a damaged file raises
    (`zipfile.BadZipFile`, `OSError`, `ValueError`, `KeyError`, ...)."""
    with tf.io.gfile.GFile(path, "rb") as f:
        raw = f.read()
    with np.load(io.BytesIO(raw), allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    if "meta" not in arrays:
        raise KeyError("no 'meta' entry")
    meta = json.loads(str(arrays["meta"]))
    return arrays, meta


def write_atomically(path, payload):
    """Writes bytes `payload` to `path` through a temporary file and a
    rename, so that `path` is either absent or complete. On local paths the
    file is fsynced before the rename and its directory after it (where
    the platform allows), so a power loss cannot leave a renamed but empty
    file; other file systems (`gs://`, ...) get `tf.io.gfile`'s guarantees."""
    tmp = path + f".tmp-{os.getpid()}"
    if "://" in path:
        with tf.io.gfile.GFile(tmp, "wb") as f:
            f.write(payload)
        tf.io.gfile.rename(tmp, path, overwrite=True)
        return
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:
        return  # e.g. Windows: directories cannot be opened
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
