"""`TrainConfig`: the one definition of a training run's settings.

Each field carries its own documentation in its dataclass metadata:
`metadata["help"]` (the flag help of `examples/train_lm.py`),
`metadata["choices"]` where the field takes one of a fixed set of values,
`metadata["resumable"]` where a resumed run may change it, and
`metadata["zero_is_none"]` where the command line spells `None` as `0`.
`keras_softmax_heads.training.flags` generates one absl flag per field from
this, so adding a field here adds its flag.
"""

from __future__ import annotations

import ast
import copy
import dataclasses

from keras_softmax_heads.data.load import DATASET_NAMES
from keras_softmax_heads import models
from keras_softmax_heads.heads import registry as head_registry
from keras_softmax_heads.training.distribute import DISTRIBUTION_STRATEGIES
from keras_softmax_heads.validation import check_int

OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop")
LOSS_REDUCTIONS = ("mean", "sum_over_time")
MIXED_PRECISION_POLICIES = (None, "mixed_float16", "mixed_bfloat16")
HEAD_NAMES = tuple(sorted(set(head_registry.HEADS) | set(head_registry.HEAD_ALIASES)))


def _field(default=dataclasses.MISSING, help="", *, default_factory=dataclasses.MISSING,
           choices=None, resumable=False, zero_is_none=False):
    """A dataclass field whose metadata documents it (see the module docstring)."""
    metadata = {"help": help, "resumable": resumable}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if zero_is_none:
        metadata["zero_is_none"] = True
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata=metadata)


@dataclasses.dataclass
class TrainConfig:
    """Everything `train_and_evaluate` needs; defaults = the quick synthetic run.

    The fields come in groups: data (`dataset` .. `dataset_options`), model
    (`model` .. `unroll`), head (`head` .. `chunk_size`), optimisation
    (`optimizer` .. `seed`), infrastructure (`strategy` .. `deterministic`),
    diagnostics (`band_fractions`, `num_diagnostic_contexts`) and testing
    (`kill_after_steps`). Each field's `metadata["help"]` says what it does;
    `PRESETS` holds the papers' settings.

    Loss convention: with `loss_reduction="sum_over_time"` (Zaremba et al.
    2014), the per-window sum over time of the batch-mean loss is minimised
    with SGD by rescaling the learning rate to `lr * bptt` and the clipping
    norm to `clip / bptt` (exact for SGD), so the presets keep the paper's
    numbers (lr 1.0, clip 5).
    """

    # Data.
    dataset: str = _field(
        "synthetic", "Corpus: 'synthetic' (offline; bigram LM with a known truth), 'ptb', "
        "'wikitext2' or 'lm1b'.", choices=DATASET_NAMES)
    data_dir: str | None = _field(
        None, "Directory of the corpus files (see keras_softmax_heads.data.load_dataset).",
        resumable=True)
    dataset_options: dict = _field(
        help="Loader options, e.g. 'vocab_size=2000,num_train_tokens=100000' for the "
        "synthetic corpus.", default_factory=dict)
    # Model.
    model: str = _field(
        "lstm", "Backbone: 'lstm' (Zaremba et al. 2014; stream batching, carried state) or "
        "'ngram' (Chen et al. 2016 feed-forward NNLM; n-gram batching).",
        choices=sorted(models.MODELS))
    embedding_dim: int = _field(256, "Word-embedding size.")
    hidden_size: int = _field(256, "LSTM units / tanh layer size.")
    num_layers: int = _field(1, "LSTM layers / tanh layers of the n-gram model.")
    ngram_order: int = _field(6, "n of the n-gram model.")
    dropout: float = _field(0.0, "Rate of every dropout (non-recurrent connections).")
    embedding_dropout: float | None = _field(
        None, "LSTM: dropout after the embedding (none: `dropout`).")
    hidden_dropout: float | None = _field(
        None, "LSTM: dropout between LSTM layers (none: `dropout`).")
    output_dropout: float | None = _field(
        None, "LSTM: dropout on the context vectors (none: `dropout`).")
    tie_embeddings: bool | None = _field(
        None, "Tie the head's output projection to the input embedding (none/auto: when "
        "the head supports it). When the context size differs from embedding_dim, the "
        "LSTM gets a linear projection to embedding_dim.")
    init_scale: float | None = _field(
        None, "U(-s, s) initialisation of every weight (Zaremba; none: Keras' defaults).")
    unit_forget_bias: bool = _field(
        True, "Keras' +1 forget-gate bias at initialisation.")
    unroll: bool | None = _field(
        None, "Unroll the LSTM over the window (none/auto: only when running on CPU, "
        "where it is faster; on GPU the non-unrolled LSTM uses cuDNN).", resumable=True)
    # Head.
    head: str = _field(
        "full_softmax", "Output head: a name of keras_softmax_heads.models.HEADS or an "
        "alias.", choices=HEAD_NAMES)
    head_options: dict = _field(
        help="Head constructor options, e.g. 'num_knots=1000,num_components=3'.",
        default_factory=dict)
    chunk_size: int | None = _field(
        None, "Vocabulary tile of the chunked exact losses (heads that accept it).")
    # Optimisation.
    optimizer: str = _field("adam", "Optimizer.", choices=OPTIMIZERS)
    learning_rate: float = _field(1e-2, "Learning rate.")
    lr_decay: float = _field(
        1.0, "Per-epoch learning-rate decay factor: from epoch decay_after_epochs + 1 on, "
        "the rate is multiplied by lr_decay every epoch (Zaremba).")
    decay_after_epochs: int = _field(
        0, "Epochs at the initial learning rate before the decay starts.")
    clip_norm: float | None = _field(
        1.0, "Global-norm gradient clipping (0 or none: no clipping).", zero_is_none=True)
    loss_reduction: str = _field(
        "mean", "'mean' (per token) or 'sum_over_time' (Zaremba; SGD only, applied by "
        "rescaling the learning rate and clipping norm by bptt).", choices=LOSS_REDUCTIONS)
    batch_size: int = _field(32, "Global batch size.")
    bptt: int = _field(32, "Truncated-BPTT window length.")
    epochs: int = _field(4, "Epochs.", resumable=True)
    steps_per_epoch: int | None = _field(
        None, "Cap on the training steps per epoch (smoke runs; with `train_seconds`, the "
        "interval between validations: each capped epoch is a fresh shuffle of the n-grams).")
    train_seconds: float | None = _field(
        None, "Wall-clock training budget (Chen et al. 2016's protocol: every head gets the "
        "same time): training stops after the first step that ends when the epochs' summed "
        "training seconds (validation excluded) reach it, mid-epoch if need be (that epoch "
        "is then validated and is the last), or after `epochs`. 0 or none: no budget.",
        zero_is_none=True, resumable=True)
    eval_batch_size: int | None = _field(
        None, "Streams used for evaluation (none: batch_size; 1: the whole split as one "
        "stream, Zaremba's test).", resumable=True)
    eval_bptt: int | None = _field(
        None, "Window length for evaluation (none: bptt).", resumable=True)
    eval_warmup: int = _field(
        200, "LSTM evaluation: every stream reads this many tokens before its first "
        "target without scoring them (the first stream: the end of the previous split, "
        "train before valid, valid before test; the others: the split's tokens before "
        "their piece) instead of starting cold from a zero state. 0: cold starts, the "
        "Zaremba presets' protocol. Every target is still scored exactly once.",
        resumable=True)
    eval_steps: int | None = _field(
        None, "Cap on evaluation windows (smoke runs; the results are then marked "
        "partial).", resumable=True)
    seed: int = _field(0, "Random seed of initialisation, dropout and n-gram shuffling.")
    # Infrastructure.
    strategy: str = _field(
        "default", "Distribution strategy: mirrored, multi_worker (cluster from "
        "TF_CONFIG) and tpu are tf.distribute (TensorFlow backend); "
        "data_parallel is keras.distribution.DataParallel and model_parallel "
        "keras_softmax_heads.training.VocabularyParallel (keras.distribution, JAX "
        "backend: the vocabulary-sized weights split over vocab_shards devices).",
        choices=DISTRIBUTION_STRATEGIES, resumable=True)
    tpu: str | None = _field(
        None, "TPU name or grpc:// address (none: 'local', on a TPU VM).", resumable=True)
    vocab_shards: int | None = _field(
        None, "strategy=model_parallel: the devices each vocabulary-sized weight (the "
        "embedding, the head's kernel and bias, their optimizer slots) is split over; "
        "the other devices split the batch. It must divide the vocabulary size and the "
        "number of devices (none: all devices).", resumable=True)
    jit_compile: bool | str = _field(
        "auto", "XLA compilation.", choices=(True, False, "auto"), resumable=True)
    mixed_precision: str | None = _field(
        None, "Mixed-precision policy.", choices=MIXED_PRECISION_POLICIES, resumable=True)
    steps_per_execution: int = _field(
        1, "Training steps per compiled call (e.g. 100 on TPU).", resumable=True)
    checkpoint_every: int | None = _field(
        200, "Steps between mid-epoch checkpoints (0 or none: only at epoch ends, where "
        "there is always one).", zero_is_none=True, resumable=True)
    keep_checkpoints: int = _field(2, "How many checkpoints to keep.", resumable=True)
    tensorboard: bool = _field(
        True, "Write TensorBoard logs to <workdir>/tensorboard.", resumable=True)
    verbose: int = _field(
        1, "Keras verbosity (0: silent, 1: progress bar, 2: a line per epoch).",
        resumable=True)
    validate_every_epoch: bool = _field(
        True, "Exact validation perplexity after each epoch.", resumable=True)
    deterministic: bool = _field(
        False, "tf.config.experimental.enable_op_determinism().", resumable=True)
    # Diagnostics.
    band_fractions: tuple[float, ...] = _field(
        (0.04, 0.2, 0.4, 0.7), "Frequency-rank band edges as fractions of the vocabulary "
        "size (Chen et al. 2016, Table 5: 4K/20K/40K/70K of 100K words).", resumable=True)
    num_diagnostic_contexts: int = _field(
        1000, "Test contexts for the empirical rank (Kanai et al. 2018) and, on the "
        "synthetic corpus, KL and mode matching (Ganea et al. 2019).", resumable=True)
    # Testing.
    kill_after_steps: int | None = _field(
        None, "Testing: SIGKILL this process after that many global steps (after the "
        "step's checkpoint, if one is due).", resumable=True)
    kill_signal: int = _field(
        9, "Testing: the signal kill_after_steps sends (9: SIGKILL; 15: SIGTERM and 2: "
        "SIGINT, which stop training at that step with a checkpoint).", resumable=True)

    def replace(self, **changes):
        """A copy with `changes` applied (unknown names raise `ValueError`).

        As on the command line, `0` means `None` for the fields whose help
        says "0 or none" (`clip_norm`, `train_seconds`, `checkpoint_every`).
        """
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise ValueError(f"Unknown TrainConfig fields: {unknown}")
        changes = {k: None if (fields[k].metadata.get("zero_is_none") and v == 0
                               and not isinstance(v, bool)) else v
                   for k, v in changes.items()}
        return dataclasses.replace(copy.deepcopy(self), **changes)

    def to_dict(self):
        out = dataclasses.asdict(self)
        out["band_fractions"] = list(out["band_fractions"])
        return out

    @classmethod
    def from_dict(cls, values):
        return cls().replace(**dict(values))


#: Fields that may change between a run and its resumption (they do not
#: change what is trained: schedule length, logging, evaluation, hardware).
RESUMABLE_FIELDS = frozenset(
    f.name for f in dataclasses.fields(TrainConfig) if f.metadata["resumable"])

#: Head options whose default changed after 0.3.0, by head: the value that
#: every run saved by 0.3.0 or before had without naming it. Settings saved
#: then carry no `version` (`read_saved_settings` fills these in).
DEFAULTS_BEFORE_0_4 = {
    "mixture_of_softmaxes": {"use_latent_bias": True, "use_prior_bias": True},
    "mixture_of_contexts": {"use_latent_bias": True, "use_prior_bias": True},
}


def read_saved_settings(settings, version):
    """A run's saved settings as this version of the package reads them.

    `settings` is the config dict of a checkpoint, `results.json` or
    `state.json`, `version` the package version saved beside it (`None`:
    saved by 0.3.0 or before, which wrote none). Such old settings get the
    head options that were defaults then and are not now
    (`DEFAULTS_BEFORE_0_4`, e.g. a mixture's latent bias) unless they name
    them, so that a run is resumed only with the options it was trained
    with.

    Returns:
        `(settings, filled)`: a copy of the settings, and the options it
        filled in (`{}` when none).
    """
    settings = dict(settings)
    if version is not None:
        return settings, {}
    try:
        head = head_registry.canonical_head_name(settings.get("head"))
    except ValueError:
        return settings, {}
    options = parse_options(settings.get("head_options"))
    filled = {k: v for k, v in DEFAULTS_BEFORE_0_4.get(head, {}).items() if k not in options}
    if filled:
        settings["head_options"] = {**options, **filled}
    return settings, filled


def old_defaults_hint(filled, saved, current):
    """The sentence that tells how to resume a run saved by 0.3.0 or before
    whose head options `read_saved_settings` filled in (`filled`), given
    the saved settings as read (`saved`) and this run's (`current`): `""`
    when none were filled or the head options agree."""
    if not filled or parse_options(saved.get("head_options")) == parse_options(
            current.get("head_options")):
        return ""
    options = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                       for k, v in filled.items())
    return (f" It was saved by keras-softmax-heads 0.3.0 or before, whose head had "
            f"{options} by default: to resume it, add {options} to the head options "
            f"(--head_options).")


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
        eval_batch_size=1, eval_bptt=50, eval_warmup=0,
    ),
    "zaremba_medium": dict(
        model="lstm", embedding_dim=650, hidden_size=650, num_layers=2,
        dropout=0.5, tie_embeddings=False, init_scale=0.05,
        unit_forget_bias=False, optimizer="sgd", learning_rate=1.0,
        lr_decay=1.0 / 1.2, decay_after_epochs=6, clip_norm=5.0,
        loss_reduction="sum_over_time", batch_size=20, bptt=35, epochs=39,
        eval_batch_size=1, eval_bptt=50, eval_warmup=0,
    ),
    "zaremba_large": dict(
        model="lstm", embedding_dim=1500, hidden_size=1500, num_layers=2,
        dropout=0.65, tie_embeddings=False, init_scale=0.04,
        unit_forget_bias=False, optimizer="sgd", learning_rate=1.0,
        lr_decay=1.0 / 1.15, decay_after_epochs=14, clip_norm=10.0,
        loss_reduction="sum_over_time", batch_size=20, bptt=35, epochs=55,
        eval_batch_size=1, eval_bptt=50, eval_warmup=0,
    ),
    # Chen, Grangier and Auli (2016), section 3, at the scale of a 2-core CPU:
    # the PTB 6-gram feed-forward NNLM, every head trained for the same
    # wall-clock budget (the paper: 24 h on a K40; here 300 s on one core),
    # validated every 1500 steps (each "epoch" a fresh shuffle of 1500 x 128
    # n-grams). Adam instead of the paper's tuned SGD: there is no budget for
    # a per-head search. `examples/paper_comparisons.py --study=chen_ptb`.
    "chen_ptb_ngram": dict(
        model="ngram", ngram_order=6, embedding_dim=128, hidden_size=512, num_layers=1,
        dropout=0.0, tie_embeddings=False, optimizer="adam", learning_rate=1e-3,
        clip_norm=1.0, loss_reduction="mean", batch_size=128, steps_per_epoch=1500,
        epochs=1000, train_seconds=300.0, eval_batch_size=1024,
    ),
}
# The bottleneck heads (Yang 2018, Kanai 2018, Ganea 2019) on Zaremba small
# for one epoch (lr 1, no decay): what fits a session on 2 CPU cores. The
# evaluation reads 20 streams, each warmed up over the 200 tokens before it
# (every target still scored once), not one stream: the slow heads' exact
# evaluation would otherwise cost minutes of a one-stream pass. XLA on: on a
# CPU, Keras' "auto" means no XLA, and the pointwise heads' passes over the
# [N, V] scores then run unfused.
# `examples/paper_comparisons.py --study=bottleneck_ptb`.
PRESETS["bottleneck_ptb_small"] = dict(PRESETS["zaremba_small"], epochs=1, eval_batch_size=20,
                                       eval_bptt=50, eval_warmup=200, jit_compile=True)
# The converged comparison (issue 19): Zaremba small's schedule cut to 5
# epochs, lr 1 for 3 then halved each epoch (the 13-epoch schedule's valid
# perplexity is 119.0 after its 5th epoch and at best 118.3), and the
# empirical rank on 10,000 test contexts.
# `examples/paper_comparisons.py --study=bottleneck_ptb_converged`.
PRESETS["bottleneck_ptb_converged"] = dict(
    PRESETS["bottleneck_ptb_small"], epochs=5, decay_after_epochs=3,
    num_diagnostic_contexts=10000)
# The regularised variant (issue 19): in the converged study the heads with
# more capacity than the softmax reach a lower training loss and a higher
# validation perplexity (the unregularised LSTM overfits after epoch 4), so
# the same LSTM with dropout 0.4 on its non-recurrent connections and 8
# epochs (lr 1 for 4, then halved each epoch) compares them without that
# confound. `examples/paper_comparisons.py --study=bottleneck_ptb_regularized`.
PRESETS["bottleneck_ptb_regularized"] = dict(
    PRESETS["bottleneck_ptb_converged"], dropout=0.4, epochs=8, decay_after_epochs=4)
# Chen et al.'s protocol with 20 minutes per head (on one core the softmax's
# validation curve has flattened by then).
# Dropout 0.5 after the tanh layer (as Chen et al.): without it the
# softmax's validation perplexity is lowest after ~8 minutes (186.1) and
# climbs to 238.8 by 20 (docs/results/study_chen_ptb_long_nodropout.json);
# Chen et al. tune dropout so that "the chosen training times are not long
# enough to observe over-fitting".
PRESETS["chen_ptb_ngram_long"] = dict(PRESETS["chen_ptb_ngram"], train_seconds=1200.0,
                                      dropout=0.5)

# Issue 21: the adaptive softmax against the full and hierarchical softmax on
# WikiText-2 (V = 33,278) with Zaremba small's LSTM, every head trained for
# the same wall-clock budget (20 minutes, validation excluded; Chen et al.
# 2016's protocol). Full epochs (no `steps_per_epoch` cap: the LSTM reads the
# corpus as streams), lr 1 throughout (an epoch-based decay would favour the
# faster heads, which run more epochs), XLA and the 20-stream evaluation of
# `bottleneck_ptb_small`. `examples/paper_comparisons.py
# --study=adaptive_wikitext2 --dataset=wikitext2`.
PRESETS["adaptive_wikitext2"] = dict(
    PRESETS["bottleneck_ptb_small"], dataset="wikitext2", epochs=1000, lr_decay=1.0,
    train_seconds=1200.0)


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
    check_int("eval_warmup", config.eval_warmup, minimum=0)
    for name in ("embedding_dim", "hidden_size", "num_layers", "batch_size",
                 "bptt", "epochs", "steps_per_execution", "keep_checkpoints"):
        check_int(name, getattr(config, name), minimum=1)
    for name in ("steps_per_epoch", "eval_batch_size", "eval_bptt", "eval_steps",
                 "checkpoint_every", "kill_after_steps", "chunk_size"):
        check_int(name, getattr(config, name), minimum=1, allow_none=True)
    if config.model not in models.MODELS:
        raise ValueError(f"Unknown model. Expected one of {sorted(models.MODELS)}. Received: model={config.model!r}")
    head_registry.canonical_head_name(config.head)
    if config.strategy not in DISTRIBUTION_STRATEGIES:
        raise ValueError(f"Unknown strategy. Expected one of {list(DISTRIBUTION_STRATEGIES)}. Received: strategy={config.strategy!r}")
    check_int("vocab_shards", config.vocab_shards, minimum=1, allow_none=True)
    if config.vocab_shards is not None and config.strategy != "model_parallel":
        raise ValueError(
            "`vocab_shards` splits the vocabulary under strategy='model_parallel' only. "
            f"Received: vocab_shards={config.vocab_shards!r}, strategy={config.strategy!r}")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer. Expected one of {list(OPTIMIZERS)}. Received: optimizer={config.optimizer!r}")
    if config.loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"`loss_reduction` must be 'mean' or 'sum_over_time'. Received: {config.loss_reduction!r}")
    if config.loss_reduction == "sum_over_time" and config.optimizer != "sgd":
        raise ValueError(
            "loss_reduction='sum_over_time' is implemented by rescaling SGD's learning "
            "rate and clipping norm, which is exact for SGD only. Received: "
            f"optimizer={config.optimizer!r}"
        )
    if config.mixed_precision not in MIXED_PRECISION_POLICIES:
        raise ValueError(f"`mixed_precision` must be None, 'mixed_float16' or 'mixed_bfloat16'. Received: {config.mixed_precision!r}")
    if config.train_seconds is not None and (
            isinstance(config.train_seconds, bool)
            or not isinstance(config.train_seconds, (int, float))
            or not config.train_seconds > 0):
        raise ValueError(f"`train_seconds` must be > 0 or None. Received: {config.train_seconds!r}")
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


_WORDS = {"true": True, "false": False, "none": None}


def parse_options(text):
    """Parses `"a=1,b=2.5,c=frequency,d=[1,2]"` into a dict.

    Values are Python literals where they parse (`ast.literal_eval`), or
    `true` / `false` / `none` in any case (`True` / `False` / `None`), else
    strings. Commas inside brackets or quotes do not split. A dict is
    returned as a copy; `None` gives `{}`.

    Example:

    >>> parse_options("num_knots=1000,clustering=frequency,sizes=[1, 2]")
    {'num_knots': 1000, 'clustering': 'frequency', 'sizes': [1, 2]}
    >>> parse_options("static_shapes=false,verify_checksums=True,seed=none")
    {'static_shapes': False, 'verify_checksums': True, 'seed': None}
    """
    if text is None:
        return {}
    if isinstance(text, dict):
        return dict(text)
    parts, depth, quote, current = [], 0, None, []
    for ch in str(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    options = {}
    for part in parts:
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(
                "Options must be written key=value, separated by commas. "
                f"Received: {part!r} in {text!r}"
            )
        key, value = part.split("=", 1)
        key, value = key.strip(), value.strip()
        if not key.isidentifier():
            raise ValueError(f"Bad option name {key!r} in {text!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = _WORDS.get(value.lower(), value)
    return options
