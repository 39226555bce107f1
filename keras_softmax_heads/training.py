"""Train and evaluate a language model with any head: `train_and_evaluate`.

This is the logic behind `examples/train_lm.py` (which only parses flags),
in the style of the Flax lm1b example: `train_and_evaluate(config, workdir)`
loads a corpus, builds a backbone (`LSTMLanguageModel` or
`NgramLanguageModel`) and a head from the registry, trains with `model.fit`
under a distribution strategy, checkpoints every `checkpoint_every` steps,
resumes after a kill with nothing lost, evaluates exactly on valid/test and
computes the papers' diagnostics. Everything it measures is returned and
written to `workdir/results.json`.

Resuming. Keras' `BackupAndRestore` restores at epoch granularity and knows
nothing of the LSTM state carried across windows or of the position in the
data stream. Here a checkpoint (`workdir/checkpoints/ckpt-<step>.npz`, written
to a temporary name and renamed, so a kill never leaves a half-written one)
holds every model variable (weights and the dropout/sampling RNG states), the
optimizer variables, the carried LSTM state, the running training-loss
metric, the epoch and step within the epoch, and the history so far. On
restart the latest checkpoint is restored and the already consumed batches of
the interrupted epoch are skipped (`dataset.skip(k)`): the data order is a
pure function of (seed, epoch), so the resumed run continues exactly where the
killed one was and ends with the same weights and metrics.

Loss convention. `HeadModel` minimises the mean per-token loss. Zaremba et
al. (2014) minimise the per-window *sum over time* of the batch-mean loss,
with SGD. For SGD the two are exactly equivalent after rescaling: learning
rate `lr * bptt` and clipping norm `clip / bptt` (the gradient is `bptt`
times smaller). `loss_reduction="sum_over_time"` applies that rescaling, so
the presets keep the paper's numbers (lr 1.0, clip 5).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import io
import json
import math
import os
import re
import signal
import time

import keras
import numpy as np
import tensorflow as tf

from keras_softmax_heads import metrics as ksh_metrics
from keras_softmax_heads.head_model import HeadModel
from keras_softmax_heads.models import registry

STRATEGIES = ("default", "mirrored", "multi_worker", "tpu")
OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop")


# --------------------------------------------------------------------- config
@dataclasses.dataclass
class TrainConfig:
    """Everything `train_and_evaluate` needs; defaults = the quick synthetic run.

    Data:
        dataset: `"synthetic"` (offline; bigram LM with a known truth),
            `"ptb"`, `"wikitext2"` or `"lm1b"`.
        data_dir: directory of the corpus files (see
            `keras_softmax_heads.data.load_dataset`).
        dataset_options: extra arguments of the loader (e.g.
            `{"vocab_size": 1000}` for the synthetic corpus).

    Model:
        model: `"lstm"` (Zaremba et al. 2014; stream batching, carried
            state) or `"ngram"` (Chen et al. 2016 feed-forward NNLM; n-gram
            batching).
        embedding_dim, hidden_size, num_layers: sizes (`num_layers` tanh
            layers of `hidden_size` for the n-gram model).
        ngram_order: `n` of the n-gram model.
        dropout: rate of every dropout; `embedding_dropout`,
            `hidden_dropout`, `output_dropout` override it per place (LSTM).
        tie_embeddings: tie the head's output projection to the input
            embedding. `None`: tie when the head supports it. When the
            context size differs from `embedding_dim`, the LSTM gets a linear
            projection to `embedding_dim`.
        init_scale: `U(-s, s)` initialisation of every weight (Zaremba).
        unit_forget_bias: Keras' +1 forget-gate bias at initialisation.
        unroll: unroll the LSTM over the window. `None`: only when running
            on CPU (about 1.6x faster there for bptt 20; on GPU the
            non-unrolled LSTM uses cuDNN).

    Head:
        head: a name of `keras_softmax_heads.models.HEADS` (or an alias).
        head_options: constructor arguments of the head.
        chunk_size: given to heads that accept `chunk_size`.

    Optimisation:
        optimizer: one of `OPTIMIZERS`; learning_rate; lr_decay and
            decay_after_epochs: from epoch `decay_after_epochs + 1` on, the
            rate is multiplied by `lr_decay` every epoch (Zaremba).
        clip_norm: global-norm gradient clipping (`None`: none).
        loss_reduction: `"mean"` (per token) or `"sum_over_time"` (Zaremba;
            SGD rescaled as explained in the module docstring).
        batch_size, bptt: global batch and window length; epochs;
            steps_per_epoch: optional cap (smoke runs).
        eval_batch_size: streams used to evaluate (`None`: `batch_size`);
            1 scores the whole split as one stream (Zaremba's test).
        eval_bptt: window length for evaluation (`None`: `bptt`).
        eval_steps: optional cap on evaluation windows (smoke runs; the
            results are then marked partial).
        seed: seeds initialisation, dropout and the n-gram shuffling.

    Infrastructure:
        strategy: one of `STRATEGIES`; tpu: TPU name or address
            (`"local"` on a TPU VM, the default).
        jit_compile: `True`, `False` or `"auto"` (XLA).
        mixed_precision: `None`, `"mixed_float16"` or `"mixed_bfloat16"`.
        steps_per_execution: steps per compiled call (TPU: e.g. 100).
        checkpoint_every: steps between mid-epoch checkpoints (`None`: only
            at epoch ends, where there is always one); keep_checkpoints: how
            many to keep.
        tensorboard: write TensorBoard logs to `workdir/tensorboard`.
        verbose: Keras verbosity (1 = progress bar, 2 = a line per epoch).
        validate_every_epoch: exact validation perplexity after each epoch.
        deterministic: `tf.config.experimental.enable_op_determinism()`.

    Diagnostics:
        band_fractions: frequency-rank band edges as fractions of `V`
            (Chen et al. 2016, Table 5: 4K/20K/40K/70K of 100K words).
        num_diagnostic_contexts: test contexts used for the empirical rank
            (Kanai et al. 2018) and, on the synthetic corpus, KL and
            mode matching (Ganea et al. 2019).

    Testing:
        kill_after_steps: SIGKILL this process after that many global steps
            (after the step's checkpoint, if one is due); for resume tests.
    """

    dataset: str = "synthetic"
    data_dir: str | None = None
    dataset_options: dict = dataclasses.field(default_factory=dict)
    model: str = "lstm"
    embedding_dim: int = 256
    hidden_size: int = 256
    num_layers: int = 1
    ngram_order: int = 6
    dropout: float = 0.0
    embedding_dropout: float | None = None
    hidden_dropout: float | None = None
    output_dropout: float | None = None
    tie_embeddings: bool | None = None
    init_scale: float | None = None
    unit_forget_bias: bool = True
    unroll: bool | None = None
    head: str = "full_softmax"
    head_options: dict = dataclasses.field(default_factory=dict)
    chunk_size: int | None = None
    optimizer: str = "adam"
    learning_rate: float = 1e-2
    lr_decay: float = 1.0
    decay_after_epochs: int = 0
    clip_norm: float | None = 1.0
    loss_reduction: str = "mean"
    batch_size: int = 32
    bptt: int = 32
    epochs: int = 4
    steps_per_epoch: int | None = None
    eval_batch_size: int | None = None
    eval_bptt: int | None = None
    eval_steps: int | None = None
    seed: int = 0
    strategy: str = "default"
    tpu: str | None = None
    jit_compile: bool | str = "auto"
    mixed_precision: str | None = None
    steps_per_execution: int = 1
    checkpoint_every: int | None = 200
    keep_checkpoints: int = 2
    tensorboard: bool = True
    verbose: int = 1
    validate_every_epoch: bool = True
    deterministic: bool = False
    band_fractions: tuple = (0.04, 0.2, 0.4, 0.7)
    num_diagnostic_contexts: int = 1000
    kill_after_steps: int | None = None

    def replace(self, **changes):
        """A copy with `changes` applied (unknown names raise `ValueError`)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"Unknown TrainConfig fields: {unknown}")
        return dataclasses.replace(copy.deepcopy(self), **changes)

    def to_dict(self):
        out = dataclasses.asdict(self)
        out["band_fractions"] = list(out["band_fractions"])
        return out

    @classmethod
    def from_dict(cls, values):
        return cls().replace(**dict(values))


#: Zaremba et al. (2014), section 4.1: the paper's hyper-parameters. The
#: original does not tie weights; `init_scale` applies to every weight; the
#: forget-gate bias starts at 0; the loss is summed over the unrolled steps.
PRESETS = {
    "zaremba_small": dict(
        model="lstm", embedding_dim=200, hidden_size=200, num_layers=2,
        dropout=0.0, tie_embeddings=False, init_scale=0.1,
        unit_forget_bias=False, optimizer="sgd", learning_rate=1.0,
        lr_decay=0.5, decay_after_epochs=4, clip_norm=5.0,
        loss_reduction="sum_over_time", batch_size=20, bptt=20, epochs=13,
        eval_batch_size=1, eval_bptt=50,
    ),
    "zaremba_medium": dict(
        model="lstm", embedding_dim=650, hidden_size=650, num_layers=2,
        dropout=0.5, tie_embeddings=False, init_scale=0.05,
        unit_forget_bias=False, optimizer="sgd", learning_rate=1.0,
        lr_decay=1.0 / 1.2, decay_after_epochs=6, clip_norm=5.0,
        loss_reduction="sum_over_time", batch_size=20, bptt=35, epochs=39,
        eval_batch_size=1, eval_bptt=50,
    ),
    "zaremba_large": dict(
        model="lstm", embedding_dim=1500, hidden_size=1500, num_layers=2,
        dropout=0.65, tie_embeddings=False, init_scale=0.04,
        unit_forget_bias=False, optimizer="sgd", learning_rate=1.0,
        lr_decay=1.0 / 1.15, decay_after_epochs=14, clip_norm=10.0,
        loss_reduction="sum_over_time", batch_size=20, bptt=35, epochs=55,
        eval_batch_size=1, eval_bptt=50,
    ),
}

#: Fields that may change between a run and its resumption.
_RESUMABLE_CHANGES = {
    "epochs", "verbose", "checkpoint_every", "keep_checkpoints", "tensorboard",
    "kill_after_steps", "eval_steps", "eval_batch_size", "eval_bptt",
    "strategy", "tpu", "jit_compile", "steps_per_execution",
    "validate_every_epoch", "band_fractions", "num_diagnostic_contexts",
    "data_dir", "deterministic", "mixed_precision", "unroll",
}


def get_config(preset=None, **overrides):
    """A `TrainConfig`: defaults, then `PRESETS[preset]`, then `overrides`.

    Example:

    >>> cfg = get_config("zaremba_small", epochs=1)
    >>> cfg.hidden_size, cfg.learning_rate, cfg.epochs
    (200, 1.0, 1)
    """
    config = TrainConfig()
    if preset:
        if preset not in PRESETS:
            raise ValueError(
                f"Unknown preset. Expected one of {sorted(PRESETS)}. "
                f"Received: preset={preset!r}"
            )
        config = config.replace(**PRESETS[preset])
    return config.replace(**overrides)


def validate_config(config):
    """Raises `ValueError` for inconsistent settings; returns the config."""
    def positive(name, allow_none=False):
        value = getattr(config, name)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")

    for name in ("embedding_dim", "hidden_size", "num_layers", "batch_size",
                 "bptt", "epochs", "steps_per_execution", "keep_checkpoints"):
        positive(name)
    for name in ("steps_per_epoch", "eval_batch_size", "eval_bptt", "eval_steps",
                 "checkpoint_every", "kill_after_steps", "chunk_size"):
        positive(name, allow_none=True)
    if config.model not in registry.MODELS:
        raise ValueError(f"Unknown model. Expected one of {sorted(registry.MODELS)}. Received: model={config.model!r}")
    registry.canonical_head_name(config.head)
    if config.strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy. Expected one of {list(STRATEGIES)}. Received: strategy={config.strategy!r}")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer. Expected one of {list(OPTIMIZERS)}. Received: optimizer={config.optimizer!r}")
    if config.loss_reduction not in ("mean", "sum_over_time"):
        raise ValueError(f"`loss_reduction` must be 'mean' or 'sum_over_time'. Received: {config.loss_reduction!r}")
    if config.loss_reduction == "sum_over_time" and config.optimizer != "sgd":
        raise ValueError(
            "loss_reduction='sum_over_time' is implemented by rescaling SGD's learning "
            "rate and clipping norm, which is exact for SGD only. Received: "
            f"optimizer={config.optimizer!r}"
        )
    if config.mixed_precision not in (None, "mixed_float16", "mixed_bfloat16"):
        raise ValueError(f"`mixed_precision` must be None, 'mixed_float16' or 'mixed_bfloat16'. Received: {config.mixed_precision!r}")
    if not (config.learning_rate > 0):
        raise ValueError(f"`learning_rate` must be > 0. Received: {config.learning_rate!r}")
    if config.clip_norm is not None and not config.clip_norm > 0:
        raise ValueError(f"`clip_norm` must be > 0 or None. Received: {config.clip_norm!r}")
    if not (0 < config.lr_decay <= 1):
        raise ValueError(f"`lr_decay` must be in (0, 1]. Received: {config.lr_decay!r}")
    if config.model == "ngram" and config.ngram_order < 2:
        raise ValueError(f"`ngram_order` must be >= 2. Received: {config.ngram_order!r}")
    if config.jit_compile not in (True, False, "auto"):
        raise ValueError(f"`jit_compile` must be True, False or 'auto'. Received: {config.jit_compile!r}")
    fractions = list(config.band_fractions)
    if any(not 0 < f < 1 for f in fractions) or fractions != sorted(fractions):
        raise ValueError(f"`band_fractions` must be increasing in (0, 1). Received: {config.band_fractions!r}")
    return config


# ------------------------------------------------------------------ strategy
def make_strategy(name="default", tpu=None):
    """The `tf.distribute` strategy `name` (see `STRATEGIES`).

    * `"default"`: the default (single-device) strategy.
    * `"mirrored"`: `MirroredStrategy` over the local GPUs, or over the
      logical CPU devices when there is no GPU.
    * `"multi_worker"`: `MultiWorkerMirroredStrategy` (cluster from
      `TF_CONFIG`).
    * `"tpu"`: the official recipe: `TPUClusterResolver(tpu=...)`,
      `experimental_connect_to_cluster`, `initialize_tpu_system`,
      `TPUStrategy`. `tpu` is the TPU's name or `grpc://` address, or
      `"local"` (default) on a TPU VM.

    Raises:
        RuntimeError: `"tpu"` when no TPU can be reached (the message says
            what was tried).
    """
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        gpus = tf.config.list_logical_devices("GPU")
        devices = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
        return tf.distribute.MirroredStrategy(devices=devices)
    if name == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        address = "local" if tpu in (None, "") else tpu
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except Exception as e:  # resolver/connection errors vary by setup
            raise RuntimeError(
                f"Could not connect to the TPU {address!r} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}). "
                "Run on a Cloud TPU VM with --tpu=local, or pass the TPU's name "
                "or grpc:// address with --tpu. See tpu_scripts/README.md."
            ) from e
        return tf.distribute.TPUStrategy(resolver)
    raise ValueError(f"Unknown strategy. Expected one of {list(STRATEGIES)}. Received: {name!r}")


def _worker_info(strategy):
    """(is_chief, task_id) of this process in a multi-worker cluster."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return True, 0
    task_type, task_id = resolver.task_type, resolver.task_id or 0
    if task_type is None:
        return True, 0
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    is_chief = task_type == "chief" or (task_type == "worker" and task_id == 0 and not has_chief)
    return is_chief, (0 if task_type == "chief" else task_id + (1 if has_chief else 0))


def _distribute(strategy, make_dataset):
    """Distributes a dataset of global batches so that, in every step,
    replica `r` (of `R`) gets rows `[r*B/R, (r+1)*B/R)` of the global batch.

    The same rows go to the same replica in every step, so each replica's
    carried LSTM state continues its own streams; the result equals
    single-device training. `make_dataset()` builds the global-batch dataset
    (static shapes) and is called once per input pipeline (worker).
    """
    if strategy.num_replicas_in_sync == 1:
        return make_dataset()

    def fn(ctx):
        ds = make_dataset()
        local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        first = ctx.input_pipeline_id * local

        def split(*element):
            element = element[0] if len(element) == 1 else element

            def cut(t):
                rows = t.shape[0] // ctx.num_replicas_in_sync
                mine = t[first * rows:(first + local) * rows]
                return tf.reshape(mine, [local, rows] + t.shape[1:].as_list())
            return tf.nest.map_structure(cut, element)

        return ds.map(split).unbatch().prefetch(2)

    return strategy.distribute_datasets_from_function(fn)


# -------------------------------------------------------------------- models
def build_model(config, corpus, batch_size=None, *, compile=True, num_replicas=1):
    """Backbone + head in a `HeadModel`, built (and compiled).

    Call under `strategy.scope()`. `batch_size` is the global batch the model
    will see (`config.batch_size` by default); a stateful LSTM is given the
    per-replica share.

    Returns:
        `(model, info)`; `info` says whether weights are tied.
    """
    batch_size = config.batch_size if batch_size is None else batch_size
    if batch_size % num_replicas:
        raise ValueError(
            f"The batch size must be divisible by the number of replicas. "
            f"Received: batch_size={batch_size}, replicas={num_replicas}"
        )
    per_replica = batch_size // num_replicas
    vocab_size = corpus.vocab_size
    head_name = registry.canonical_head_name(config.head)
    tie = config.tie_embeddings
    if tie is None:
        tie = registry.supports_tying(head_name)
    elif tie and not registry.supports_tying(head_name):
        raise ValueError(
            f"Head {head_name!r} cannot tie its output projection to the input "
            "embedding. Received: tie_embeddings=True"
        )
    def rate(name):
        value = getattr(config, name)
        return config.dropout if value is None else value

    if config.model == "lstm":
        output_dim = None
        if tie and config.hidden_size != config.embedding_dim:
            output_dim = config.embedding_dim  # project h to the embedding size
        backbone = registry.get_model_class("lstm")(
            vocab_size=vocab_size,
            embedding_dim=config.embedding_dim,
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            output_dim=output_dim,
            embedding_dropout=rate("embedding_dropout"),
            hidden_dropout=rate("hidden_dropout"),
            output_dropout=rate("output_dropout"),
            stateful=True,
            batch_size=per_replica,
            init_scale=config.init_scale,
            unit_forget_bias=config.unit_forget_bias,
            unroll=_unroll(config),
        )
        input_shape = (per_replica, config.bptt)
    else:
        if tie and config.hidden_size != config.embedding_dim:
            raise ValueError(
                "Tying the n-gram model's output projection needs "
                "hidden_size == embedding_dim. Received: "
                f"hidden_size={config.hidden_size}, embedding_dim={config.embedding_dim} "
                "(or set tie_embeddings=False)"
            )
        backbone = registry.get_model_class("ngram")(
            vocab_size=vocab_size,
            order=config.ngram_order,
            embedding_dim=config.embedding_dim,
            hidden_sizes=[config.hidden_size] * config.num_layers,
            dropout=config.dropout,
        )
        input_shape = (per_replica, config.ngram_order - 1)
    head = registry.make_head(
        head_name,
        vocab_size,
        counts=np.asarray(corpus.vocab.counts),
        token_embedding=backbone.token_embedding if tie else None,
        chunk_size=config.chunk_size,
        init_scale=config.init_scale,
        **registry.parse_options(config.head_options),
    )
    model = HeadModel(backbone, head)
    model.build(input_shape)
    if compile:
        model.compile(
            optimizer=_make_optimizer(config),
            jit_compile=config.jit_compile,
            steps_per_execution=config.steps_per_execution,
        )
        model.optimizer.build(model.trainable_variables)
    return model, {"tied": bool(tie), "head": head_name, "input_shape": input_shape}


def _unroll(config):
    if config.unroll is not None:
        return bool(config.unroll)
    return config.strategy != "tpu" and not tf.config.list_logical_devices("GPU")


def _time_steps(config):
    return config.bptt if config.model == "lstm" else 1


def _make_optimizer(config):
    lr, clip = config.learning_rate, config.clip_norm
    if config.loss_reduction == "sum_over_time":
        # sum_t mean_b NLL = T * (token mean): exact SGD equivalent.
        lr = lr * _time_steps(config)
        clip = None if clip is None else clip / _time_steps(config)
    cls = {
        "sgd": keras.optimizers.SGD,
        "adam": keras.optimizers.Adam,
        "adamw": keras.optimizers.AdamW,
        "adagrad": keras.optimizers.Adagrad,
        "rmsprop": keras.optimizers.RMSprop,
    }[config.optimizer]
    return cls(learning_rate=lr, global_clipnorm=clip)


def _epoch_learning_rate(config, epoch):
    """Learning rate of (0-based) `epoch` in the paper's units."""
    decays = max(0, epoch + 1 - config.decay_after_epochs) if config.decay_after_epochs else 0
    if config.lr_decay == 1.0:
        decays = 0
    return config.learning_rate * config.lr_decay ** decays


def _optimizer_rate(config, epoch):
    lr = _epoch_learning_rate(config, epoch)
    if config.loss_reduction == "sum_over_time":
        lr *= _time_steps(config)
    return lr


class _Scorer(keras.Model):
    """`{"tokens", "targets"}` -> exact `log p(target)` (and optionally h)."""

    def __init__(self, backbone, head, return_contexts=False, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.head = head
        self.return_contexts = return_contexts
        self.built = True

    def call(self, inputs, training=False):
        h = self.backbone(inputs["tokens"], training=False)
        ll = self.head.log_likelihood(h, inputs["targets"])
        if self.return_contexts:
            return ll, keras.ops.cast(h, "float32")
        return ll


# ---------------------------------------------------------------------- data
def _train_steps_per_epoch(config, corpus):
    from keras_softmax_heads import data as ksh_data

    if config.model == "lstm":
        steps = ksh_data.num_stream_windows(len(corpus.train), config.batch_size, config.bptt)
        if steps < 1:
            # make_stream_dataset raises the explanatory error.
            ksh_data.make_stream_dataset(corpus.train, config.batch_size, config.bptt)
    else:
        steps = (len(corpus.train) - (config.ngram_order - 1)) // config.batch_size
        if steps < 1:
            raise ValueError(
                f"Received: batch_size={config.batch_size} but the training split "
                f"has only {len(corpus.train)} tokens, fewer n-gram examples than "
                "one batch."
            )
    if config.steps_per_epoch:
        steps = min(steps, config.steps_per_epoch)
    return steps


def _train_dataset(config, corpus, epoch, steps, skip):
    """Global-batch dataset of `epoch`, its first `skip` batches skipped."""
    from keras_softmax_heads import data as ksh_data

    if config.model == "lstm":
        ds = ksh_data.make_stream_dataset(corpus.train, config.batch_size, config.bptt)
    else:
        ds = ksh_data.make_ngram_dataset(
            corpus.train, config.ngram_order, config.batch_size, shuffle=True,
            seed=config.seed * 100_003 + epoch, drop_remainder=True,
        )
    return ds.take(steps).skip(skip).prefetch(2)


def _eval_pad_id(corpus):
    eos = getattr(corpus.vocab, "eos_id", None)
    return 0 if eos is None else int(eos)


def _eval_arrays(config, corpus, ids, batch_size):
    """Every token but the first of `ids` as a target, exactly once.

    Returns window-major arrays `(tokens, targets, position)` of shapes
    `[K, B, bptt]` (LSTM; `tokens` likewise) or `[K, B, n-1]` / `[K, B]`
    (n-gram), where `position` is the index `t - 1` of the target `ids[t]`
    (`-1` for padding). The LSTM streams: stream `b` holds targets
    `b*L .. (b+1)*L - 1`, `L = ceil((N - 1) / B)`, and starts from a zero
    state; with `B = 1` the split is one stream (Zaremba et al.'s test).
    """
    ids = np.asarray(ids, dtype=np.int32)
    n = len(ids) - 1
    if n < 1:
        raise ValueError(f"An evaluation split needs at least 2 tokens. Received: {len(ids)}")
    if config.model == "lstm":
        bptt = config.eval_bptt or config.bptt
        length = -(-n // batch_size)
        windows = -(-length // bptt)
        padded = windows * bptt
        position = np.arange(batch_size)[:, None] * length + np.arange(padded)[None, :]
        position[(np.arange(padded)[None, :] >= length) | (position >= n)] = -1
        valid = position >= 0
        tokens = np.where(valid, ids[np.where(valid, position, 0)], 0).astype(np.int32)
        targets = np.where(valid, ids[np.where(valid, position + 1, 0)], 0).astype(np.int32)

        def to_windows(a):
            return np.ascontiguousarray(a.reshape(batch_size, windows, bptt).transpose(1, 0, 2))

        return to_windows(tokens), to_windows(targets), to_windows(position)
    context = config.ngram_order - 1
    padded_ids = np.concatenate([np.full(context, _eval_pad_id(corpus), np.int32), ids])
    all_windows = np.lib.stride_tricks.sliding_window_view(padded_ids, context)
    tokens = all_windows[1 : n + 1]  # the n-1 words before each target ids[1..n]
    targets = ids[1:]
    num_batches = -(-n // batch_size)
    total = num_batches * batch_size
    tokens = np.concatenate([tokens, np.zeros((total - n, context), np.int32)])
    targets = np.concatenate([targets, np.zeros(total - n, np.int32)])
    position = np.where(np.arange(total) < n, np.arange(total), -1)
    return (tokens.reshape(num_batches, batch_size, context),
            targets.reshape(num_batches, batch_size),
            position.reshape(num_batches, batch_size))


# ------------------------------------------------------------------ the run
class _Run:
    """State of one `train_and_evaluate` call."""

    def __init__(self, config, workdir):
        self.config = config
        self.workdir = workdir

    # ----------------------------------------------------------- checkpoints
    @property
    def ckpt_dir(self):
        return os.path.join(self.workdir, "checkpoints")

    def _checkpoints(self):
        found = []
        for path in tf.io.gfile.glob(os.path.join(self.ckpt_dir, "ckpt-*.npz")):
            m = re.search(r"ckpt-(\d+)\.npz$", path)
            if m:
                found.append((int(m.group(1)), path))
        return sorted(found)

    def carried_variables(self):
        return self.model.backbone.carried_state_variables

    def _read_carry(self):
        out = []
        for var in self.carried_variables():
            parts = self.strategy.experimental_local_results(var.value)
            out.append(np.concatenate([np.asarray(p.numpy()) for p in parts], axis=0))
        return out

    def _write_carry(self, values):
        variables = self.carried_variables()
        if len(values) != len(variables):
            raise ValueError(
                f"The checkpoint carries {len(values)} LSTM states but the model "
                f"has {len(variables)}."
            )
        for var, value in zip(variables, values):
            parts = self.strategy.experimental_local_results(var.value)
            local = len(parts)
            rows = parts[0].shape[0]
            if value.shape[0] != local * rows:
                raise ValueError(
                    "The checkpoint's carried LSTM state has "
                    f"{value.shape[0]} rows but this process holds {local} replica(s) "
                    f"of {rows} rows; resume with the same global batch size."
                )
            chunks = [value[i * rows:(i + 1) * rows] for i in range(local)]
            if local == 1 and self.strategy.num_replicas_in_sync == 1:
                var.assign(chunks[0])
                continue
            for part, chunk in zip(parts, chunks):
                part.assign(chunk)

    def _metric_variables(self):
        return [v for m in self.model.metrics for v in m.variables]

    def save_checkpoint(self, epoch, step_in_epoch, history, metric_values=None):
        global_step = epoch * self.steps_per_epoch + step_in_epoch
        arrays = {}
        for i, v in enumerate(self.model.variables):
            arrays[f"model_{i}"] = np.asarray(v.numpy())
        for i, v in enumerate(self.model.optimizer.variables):
            arrays[f"optimizer_{i}"] = np.asarray(v.numpy())
        for i, value in enumerate(self._read_carry()):
            arrays[f"carry_{i}"] = value
        if metric_values is None:
            metric_values = [np.asarray(v.numpy()) for v in self._metric_variables()]
        for i, value in enumerate(metric_values):
            arrays[f"metric_{i}"] = value
        meta = {
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "global_step": global_step,
            "steps_per_epoch": self.steps_per_epoch,
            "history": history,
            "config": self.config.to_dict(),
            "num_model_variables": len(self.model.variables),
            "num_optimizer_variables": len(self.model.optimizer.variables),
            "time": time.time(),
        }
        arrays["meta"] = np.array(json.dumps(meta))
        tf.io.gfile.makedirs(self.ckpt_dir)
        final = os.path.join(self.ckpt_dir, f"ckpt-{global_step:010d}.npz")
        tmp = final + f".tmp-{os.getpid()}"
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        with tf.io.gfile.GFile(tmp, "wb") as f:
            f.write(buffer.getvalue())
        tf.io.gfile.rename(tmp, final, overwrite=True)
        for _, path in self._checkpoints()[: -self.config.keep_checkpoints]:
            tf.io.gfile.remove(path)
        self.last_saved_step = global_step

    def restore_checkpoint(self):
        """Restores the latest checkpoint; returns its metadata or None."""
        found = self._checkpoints()
        for stale in tf.io.gfile.glob(os.path.join(self.ckpt_dir, "*.tmp-*")):
            tf.io.gfile.remove(stale)  # a save interrupted by a kill
        if not found:
            return None
        step, path = found[-1]
        with tf.io.gfile.GFile(path, "rb") as f:
            data = np.load(io.BytesIO(f.read()), allow_pickle=False)
            arrays = {k: data[k] for k in data.files}
        meta = json.loads(str(arrays["meta"]))
        self._check_resume_config(meta["config"], path)
        if meta["steps_per_epoch"] != self.steps_per_epoch:
            raise ValueError(
                f"{path} was written with {meta['steps_per_epoch']} steps per epoch; "
                f"this run has {self.steps_per_epoch}."
            )
        variables = self.model.variables
        opt_variables = self.model.optimizer.variables
        if (meta["num_model_variables"] != len(variables)
                or meta["num_optimizer_variables"] != len(opt_variables)):
            raise ValueError(
                f"{path} does not match this model: {meta['num_model_variables']} model / "
                f"{meta['num_optimizer_variables']} optimizer variables saved, "
                f"{len(variables)} / {len(opt_variables)} here."
            )
        for i, v in enumerate(variables):
            v.assign(arrays[f"model_{i}"])
        for i, v in enumerate(opt_variables):
            v.assign(arrays[f"optimizer_{i}"])
        self._write_carry([arrays[f"carry_{i}"] for i in range(len(self.carried_variables()))])
        # Mid-epoch checkpoints hold the running training-loss mean.
        self.resume_metric_values = [
            arrays[f"metric_{i}"] for i in range(len(self._metric_variables()))
            if f"metric_{i}" in arrays
        ] or None
        self.last_saved_step = step
        return meta

    def _check_resume_config(self, saved, path):
        current = self.config.to_dict()
        differing = sorted(
            k for k in current
            if k not in _RESUMABLE_CHANGES and saved.get(k) != current[k]
            and not (isinstance(current[k], (list, tuple)) and list(saved.get(k) or []) == list(current[k]))
        )
        if differing:
            details = ", ".join(f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in differing)
            raise ValueError(
                f"The workdir holds a checkpoint ({path}) of a different run "
                f"({details}). Use another workdir or the same settings."
            )


class _StepCallback(keras.callbacks.Callback):
    """Checkpoints every `checkpoint_every` steps, times steps, kills (tests)."""

    def __init__(self, run, epoch, offset, history):
        super().__init__()
        self.run = run
        self.epoch = epoch
        self.offset = offset
        self.history = history
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        # Resuming mid-epoch: continue the running mean of the training loss.
        values = getattr(self.run, "resume_metric_values", None)
        if self.offset and values is not None:
            for v, value in zip(self.run._metric_variables(), values):
                v.assign(value)
        self.run.resume_metric_values = None

    def on_epoch_end(self, epoch, logs=None):
        # fit(epochs=config.epochs, initial_epoch=epoch) runs one epoch (so the
        # progress bar says "Epoch e/E"); the loop over epochs is ours.
        self.model.stop_training = True

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())
        run, config = self.run, self.run.config
        step_in_epoch = self.offset + batch + 1
        global_step = self.epoch * run.steps_per_epoch + step_in_epoch
        every = config.checkpoint_every
        if (every and step_in_epoch < run.steps_per_epoch
                and global_step // every > run.last_saved_step // every):
            run.save_checkpoint(self.epoch, step_in_epoch, self.history)
        if config.kill_after_steps and global_step >= config.kill_after_steps:
            os.kill(os.getpid(), signal.SIGKILL)


def _fit_epoch_multi_worker(run, model, strategy, dataset, steps, step_cb, config, epoch):
    """One epoch of `model.train_step` under `MultiWorkerMirroredStrategy`.

    Keras 3's `fit` fails under that strategy (its symbolic build reduces a
    batch of per-replica values across workers; keras-team/keras#20585,
    tensorflow/tensorflow#72388), so this loop calls the public
    `train_step` through `strategy.run`, as `fit` would, and drives the
    step callback itself. Returns the epoch's training loss.
    """
    step_fn = getattr(run, "multi_worker_step", None)
    if step_fn is None:
        train_step = model.train_step
        if config.jit_compile is True:
            train_step = tf.function(train_step, jit_compile=True)

        @tf.function
        def step_fn(iterator):
            return strategy.run(train_step, args=(next(iterator),))

        run.multi_worker_step = step_fn
    callbacks = keras.callbacks.CallbackList([step_cb], model=model)
    model.reset_metrics()
    callbacks.on_epoch_begin(epoch)
    iterator = iter(dataset)
    logs = None
    for batch in range(steps):
        logs = step_fn(iterator)
        callbacks.on_train_batch_end(batch)
    # Each replica's running mean over its own tokens; equal token counts, so
    # their mean is the global mean (a collective: every worker runs it).
    loss = float(strategy.reduce(tf.distribute.ReduceOp.MEAN, logs["loss"], axis=None))
    if config.verbose:
        print(f"{steps}/{steps} - loss: {loss:.4f}", flush=True)
    return loss


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


def train_and_evaluate(config: TrainConfig, workdir: str) -> dict:
    """Trains `config`'s model in `workdir` (resuming if it holds a
    checkpoint), evaluates it exactly and returns (and writes to
    `workdir/results.json`) the results.

    Args:
        config: a `TrainConfig` (see `get_config` for presets).
        workdir: directory for checkpoints, TensorBoard logs, the final
            `model.keras` and `results.json`. Non-chief workers of a
            multi-worker run use `workdir/workers/worker_<i>`.

    Returns:
        A JSON-compatible dict: `valid` / `test` (`nll` in nats, `perplexity`,
        `tokens`), `history` (per epoch: learning rate, training loss,
        validation perplexity, seconds), `diagnostics` (entropy per
        frequency band, empirical rank; for the synthetic corpus KL to the
        truth, mode matching and the distance to the entropy floor),
        `steps_per_second`, and the config.

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
    is_chief, task_id = _worker_info(strategy)
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
        return _train_and_evaluate(config, workdir, strategy)
    finally:
        keras.config.set_dtype_policy(previous_policy)


def _log(config, message):
    if config.verbose:
        print(message, flush=True)


def _train_and_evaluate(config, workdir, strategy):
    from keras_softmax_heads.data import load_dataset

    run = _Run(config, workdir)
    run.strategy = strategy
    replicas = strategy.num_replicas_in_sync
    with tf.io.gfile.GFile(os.path.join(workdir, "config.json"), "w") as f:
        f.write(json.dumps(_jsonable(config.to_dict()), indent=2))

    corpus = load_dataset(config.dataset, config.data_dir, **registry.parse_options(config.dataset_options))
    run.steps_per_epoch = _train_steps_per_epoch(config, corpus)
    _log(config, f"{corpus!r}; {run.steps_per_epoch} steps per epoch, {replicas} replica(s)")

    with strategy.scope():
        model, info = build_model(config, corpus, num_replicas=replicas)
    run.model = model
    run.last_saved_step = 0
    run.resume_metric_values = None
    meta = run.restore_checkpoint()
    history = []
    start_epoch, start_step = 0, 0
    if meta is not None:
        history = meta["history"]
        start_epoch, start_step = meta["epoch"], meta["step_in_epoch"]
        _log(config, f"Resuming from step {meta['global_step']} (epoch {start_epoch + 1}, "
                     f"step {start_step} of {run.steps_per_epoch})")

    # Evaluation runs on the training replicas, except for multi-worker runs,
    # where each worker evaluates a local copy (predict gathers local replicas).
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    eval_strategy = tf.distribute.get_strategy() if multi_worker else strategy
    eval_replicas = eval_strategy.num_replicas_in_sync
    eval_batch = config.eval_batch_size or config.batch_size
    if eval_batch % eval_replicas:
        eval_batch = -(-eval_batch // eval_replicas) * eval_replicas
    stateful = config.model == "lstm"
    if (eval_strategy is strategy and
            (not stateful or eval_batch == config.batch_size)):
        eval_model = model
    else:
        with eval_strategy.scope():
            eval_model, _ = build_model(config, corpus, eval_batch, compile=False,
                                        num_replicas=eval_replicas)
    with eval_strategy.scope():
        scorer = _Scorer(eval_model.backbone, eval_model.head, name="scorer")
        scorer.compile(jit_compile=config.jit_compile)
        context_scorer = _Scorer(eval_model.backbone, eval_model.head, return_contexts=True,
                                 name="context_scorer")
        context_scorer.compile(jit_compile=config.jit_compile)

    def evaluate(ids, max_windows=None, with_contexts=0):
        """Exact per-target log-likelihoods of split `ids`, in stream order."""
        if eval_model is not model:
            eval_model.set_weights(model.get_weights())
        tokens, targets, position = _eval_arrays(config, corpus, ids, eval_batch)
        windows = len(tokens) if not max_windows else min(max_windows, len(tokens))
        partial = windows < len(tokens)
        tokens, targets, position = tokens[:windows], targets[:windows], position[:windows]

        def predict(scorer_model, count):
            eval_model.backbone.reset_states()
            sub = {"tokens": tokens[:count], "targets": targets[:count]}
            dataset = _distribute(eval_strategy, lambda: tf.data.Dataset.from_tensor_slices(sub))
            return scorer_model.predict(dataset, steps=count, verbose=0)

        valid = position >= 0
        order = np.argsort(position[valid], kind="stable")
        ll = np.asarray(predict(scorer, windows)).reshape(position.shape)
        out = {
            "ll": ll[valid][order].astype(np.float64),
            "targets": targets[valid][order],
            "partial": partial,
        }
        if with_contexts:
            per_window = int(np.prod(position.shape[1:]))
            count = min(windows, -(-with_contexts // per_window))
            _, h = predict(context_scorer, count)
            h = np.asarray(h).reshape(position[:count].shape + (-1,))
            sub_valid = valid[:count]
            sub_order = np.argsort(position[:count][sub_valid], kind="stable")
            last_input = tokens[:count] if config.model == "lstm" else tokens[:count][..., -1]
            out["contexts"] = h[sub_valid][sub_order][:with_contexts]
            out["context_inputs"] = last_input[sub_valid][sub_order][:with_contexts]
        return out

    def summarise(result):
        nll = float(-np.mean(result["ll"]))
        return {"nll": nll, "perplexity": float(np.exp(nll)),
                "bits_per_token": nll / math.log(2.0),
                "tokens": int(result["ll"].size), "partial": bool(result["partial"])}

    callbacks_common = []
    use_tensorboard = config.tensorboard and importlib.util.find_spec("tensorboard") is not None
    if config.tensorboard and not use_tensorboard:
        _log(config, "TensorBoard is not installed (pip install tensorboard): no TensorBoard logs.")
    if use_tensorboard:
        callbacks_common.append(keras.callbacks.TensorBoard(
            log_dir=os.path.join(workdir, "tensorboard"), update_freq="epoch"))
    valid_writer = (tf.summary.create_file_writer(os.path.join(workdir, "tensorboard", "validation_exact"))
                    if use_tensorboard else None)

    step_times = []
    final_valid = None  # the last epoch's validation, when it ran here
    train_start = time.time()
    for epoch in range(start_epoch, config.epochs):
        skip = start_step if epoch == start_epoch else 0
        lr = _epoch_learning_rate(config, epoch)
        model.optimizer.learning_rate = _optimizer_rate(config, epoch)
        if skip == 0:
            model.backbone.reset_states()
        _log(config, f"Epoch {epoch + 1}/{config.epochs}: learning rate {lr:.6g}"
                     + (f", resuming at step {skip}/{run.steps_per_epoch}" if skip else ""))
        dataset = _distribute(strategy, lambda: _train_dataset(
            config, corpus, epoch, run.steps_per_epoch, skip))
        step_cb = _StepCallback(run, epoch, skip, history)
        epoch_start = time.time()
        if multi_worker:
            train_loss = _fit_epoch_multi_worker(
                run, model, strategy, dataset, run.steps_per_epoch - skip, step_cb, config, epoch)
        else:
            fit = model.fit(
                dataset, epochs=config.epochs, initial_epoch=epoch,
                steps_per_epoch=run.steps_per_epoch - skip,
                callbacks=[step_cb] + callbacks_common, verbose=config.verbose, shuffle=False,
            )
            train_loss = float(fit.history["loss"][-1])
        if len(step_cb.times) > 1:
            step_times.append((len(step_cb.times) - 1, step_cb.times[-1] - step_cb.times[0]))
        entry = {
            "epoch": epoch + 1,
            "learning_rate": lr,
            "train_loss": train_loss,
            "seconds": time.time() - epoch_start,
        }
        if config.validate_every_epoch:
            valid = summarise(evaluate(corpus.valid, config.eval_steps))
            entry["valid_nll"], entry["valid_perplexity"] = valid["nll"], valid["perplexity"]
            final_valid = valid if epoch == config.epochs - 1 else None
            _log(config, f"  valid perplexity {valid['perplexity']:.2f} (exact, {valid['tokens']} tokens)")
            if valid_writer is not None:
                with valid_writer.as_default():
                    tf.summary.scalar("perplexity", valid["perplexity"], step=epoch)
                    tf.summary.scalar("learning_rate", lr, step=epoch)
        history.append(entry)
        run.save_checkpoint(epoch + 1, 0, history, metric_values=[])
    train_seconds = time.time() - train_start

    # ------------------------------------------------------ final evaluation
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
    steps_done = sum(n for n, _ in step_times)
    seconds_done = sum(s for _, s in step_times)
    results["training"] = {
        "epochs": config.epochs, "steps_per_epoch": run.steps_per_epoch,
        "global_steps": config.epochs * run.steps_per_epoch,
        "seconds_this_process": train_seconds,
        "steps_per_second": (steps_done / seconds_done) if seconds_done > 0 else None,
    }
    results["history"] = history
    valid = final_valid or summarise(evaluate(corpus.valid, config.eval_steps))
    num_ctx = config.num_diagnostic_contexts
    test_result = evaluate(corpus.test, config.eval_steps, with_contexts=num_ctx)
    test = summarise(test_result)
    results["valid"], results["test"] = valid, test
    _log(config, f"valid perplexity {valid['perplexity']:.2f}, test perplexity "
                 f"{test['perplexity']:.2f} (exact, {test['tokens']} test tokens)")

    # ------------------------------------------------------------ diagnostics
    vocab_size = corpus.vocab_size
    edges = sorted({max(1, min(vocab_size - 1, int(round(f * vocab_size)))) for f in config.band_fractions})
    diagnostics = {
        "entropy_per_frequency_band": ksh_metrics.entropy_per_frequency_band(
            test_result["ll"], test_result["targets"], np.asarray(corpus.vocab.counts), edges),
        "band_edges": edges,
    }
    contexts = test_result["contexts"]
    log_q = ksh_metrics.log_prob_matrix(eval_model.head, contexts.astype("float32"))
    diagnostics["empirical_rank"] = {
        "rank": ksh_metrics.empirical_rank(log_q),
        "num_contexts": int(len(contexts)),
        "vocab_size": vocab_size,
        "context_dim": int(contexts.shape[-1]),
        "linear_softmax_bound": int(contexts.shape[-1]) + 2,
    }
    true_model = getattr(corpus, "true_model", None)
    if true_model is not None:
        true_probs = true_model.next_word_probs(test_result["context_inputs"])
        floor = corpus.info.get("test_cross_entropy") if getattr(corpus, "info", None) else None
        synthetic = {
            "kl_to_truth": ksh_metrics.kl_divergence(true_probs, log_q),
            "mode_matching": ksh_metrics.mode_matching(true_probs, log_q),
            "num_contexts": int(len(contexts)),
            "true_entropy_rate": float(true_model.entropy_rate),
            "test_cross_entropy": test["nll"],
            "gap_to_entropy_rate": test["nll"] - float(true_model.entropy_rate),
        }
        if floor is not None:
            synthetic["test_floor"] = float(floor)
            synthetic["gap_to_floor"] = test["nll"] - float(floor)
            synthetic["floor_perplexity"] = float(np.exp(floor))
        diagnostics["synthetic"] = synthetic
        _log(config, f"test cross-entropy {test['nll']:.4f} nats; true entropy rate "
                     f"{true_model.entropy_rate:.4f}; floor of this test sample "
                     f"{synthetic.get('test_floor', float('nan')):.4f}; gap "
                     f"{synthetic.get('gap_to_floor', synthetic['gap_to_entropy_rate']):.4f} nats; "
                     f"KL {synthetic['kl_to_truth']:.4f}, mode matching {synthetic['mode_matching']:.3f}")
    results["diagnostics"] = diagnostics
    results = _jsonable(results)

    model.save(os.path.join(workdir, "model.keras"))
    with tf.io.gfile.GFile(os.path.join(workdir, "results.json"), "w") as f:
        f.write(json.dumps(results, indent=2))
    return results
