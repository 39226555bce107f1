"""The model and its optimisation: backbone + head in a `HeadModel`, the
optimizer, and the learning rate of each epoch."""

from __future__ import annotations

import keras
import numpy as np

from keras_softmax_heads import clustering
from keras_softmax_heads.head_model import HeadModel
from keras_softmax_heads import models
from keras_softmax_heads.heads import registry as head_registry
from keras_softmax_heads.training.config import parse_options


def build_model(config, corpus, batch_size=None, *, compile=True, num_replicas=1):
    """Backbone + head in a `HeadModel`, built (and compiled).

    Call under `strategy.scope()`. `batch_size` is the global batch the model
    will see (`config.batch_size` by default); a stateful LSTM is given the
    per-replica share. The model is built for inputs `[B/R, bptt]` (LSTM) or
    `[B/R, n - 1]` (n-gram).

    Returns:
        `(model, info)`; `info` says whether weights are tied (`"tied"`),
        the canonical head name (`"head"`) and the `"input_shape"`.
    """
    batch_size = config.batch_size if batch_size is None else batch_size
    if batch_size % num_replicas:
        raise ValueError(
            f"The batch size must be divisible by the number of replicas. "
            f"Received: batch_size={batch_size}, replicas={num_replicas}"
        )
    per_replica = batch_size // num_replicas
    head_name = head_registry.canonical_head_name(config.head)
    tie = _tie_embeddings(config, head_name)
    model, input_shape = _head_model(config, corpus, head_name, tie, per_replica)
    model.build(input_shape)
    if compile:
        model.compile(
            optimizer=make_optimizer(config),
            jit_compile=config.jit_compile,
            steps_per_execution=config.steps_per_execution,
        )
        model.optimizer.build(model.trainable_variables)
    return model, {"tied": bool(tie), "head": head_name, "input_shape": input_shape}


def build_inference_model(config, corpus, model):
    """A stateless copy of the trained `model` for inference, same weights.

    The training LSTM is stateful with a fixed batch size (its state carried
    from one window to the next), so calling it twice on the same input
    gives different log-probabilities and any other batch size fails. The
    copy built here has `stateful=False`: every call starts from a zero
    state (a fresh context), any batch size and length work, and `predict`
    returns exact log-probabilities `[batch, time, V]`. Its outputs equal
    the training model's after `reset_states()`. The n-gram model has no
    state; its copy is built the same way.

    Call under no strategy scope (or the default one).
    """
    head_name = head_registry.canonical_head_name(config.head)
    tie = _tie_embeddings(config, head_name)
    # Data-derived head structure (e.g. k-means clusters) comes from the
    # trained head, not recomputed.
    structure = {}
    if head_name == "hierarchical":
        structure["clusters"] = model.head.get_config()["clusters"]
    inference, input_shape = _head_model(config, corpus, head_name, tie, None, **structure)
    inference.build(input_shape)
    inference.set_weights(model.get_weights())
    return inference


def _tie_embeddings(config, head_name):
    """`config.tie_embeddings`, with `None` resolved to what the head supports."""
    tie = config.tie_embeddings
    if tie is None:
        return head_registry.supports_tying(head_name)
    if tie and not head_registry.supports_tying(head_name):
        raise ValueError(
            f"Head {head_name!r} cannot tie its output projection to the input "
            "embedding. Received: tie_embeddings=True"
        )
    return tie


def _lstm_backbone(config, vocab_size, per_replica, tie, stateful=True):
    def rate(name):
        value = getattr(config, name)
        return config.dropout if value is None else value

    output_dim = None
    if tie and config.hidden_size != config.embedding_dim:
        output_dim = config.embedding_dim  # project h to the embedding size
    return models.get_model_class("lstm")(
        vocab_size=vocab_size,
        embedding_dim=config.embedding_dim,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        output_dim=output_dim,
        embedding_dropout=rate("embedding_dropout"),
        hidden_dropout=rate("hidden_dropout"),
        output_dropout=rate("output_dropout"),
        stateful=stateful,
        batch_size=per_replica,
        init_scale=config.init_scale,
        unit_forget_bias=config.unit_forget_bias,
        # Unrolling needs a fixed window length: not for inference.
        unroll=lstm_unroll(config) if stateful else False,
    )


def _ngram_backbone(config, vocab_size, tie):
    if tie and config.hidden_size != config.embedding_dim:
        raise ValueError(
            "Tying the n-gram model's output projection needs "
            "hidden_size == embedding_dim. Received: "
            f"hidden_size={config.hidden_size}, embedding_dim={config.embedding_dim} "
            "(or set tie_embeddings=False)"
        )
    return models.get_model_class("ngram")(
        vocab_size=vocab_size,
        order=config.ngram_order,
        embedding_dim=config.embedding_dim,
        hidden_sizes=[config.hidden_size] * config.num_layers,
        dropout=config.dropout,
    )


def lstm_unroll(config):
    """Whether the LSTM is unrolled: `config.unroll`, or when it is `None`,
    only on CPU (on GPU the non-unrolled LSTM uses cuDNN; a TPU compiles
    the loop)."""
    if config.unroll is not None:
        return bool(config.unroll)
    return config.strategy != "tpu" and not _has_gpu()


def _has_gpu():
    """Whether the current Keras backend sees a GPU."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_logical_devices("GPU"))
    if backend == "jax":
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    if backend == "torch":
        import torch

        return torch.cuda.is_available()
    return False


def loss_time_steps(config):
    """Target positions per example: `bptt` (LSTM windows) or 1 (n-gram)."""
    return config.bptt if config.model == "lstm" else 1


def make_optimizer(config):
    """The Keras optimizer of `config`, with global-norm clipping.

    For `loss_reduction="sum_over_time"` the learning rate is multiplied and
    the clipping norm divided by `loss_time_steps(config)`: `HeadModel`
    minimises the token mean, `T` times smaller than Zaremba's sum over time
    of the batch mean, and for SGD the rescaled step is exactly the paper's.
    """
    lr, clip = config.learning_rate, config.clip_norm
    if config.loss_reduction == "sum_over_time":
        # sum_t mean_b NLL = T * (token mean): exact SGD equivalent.
        lr = lr * loss_time_steps(config)
        clip = None if clip is None else clip / loss_time_steps(config)
    cls = {
        "sgd": keras.optimizers.SGD,
        "adam": keras.optimizers.Adam,
        "adamw": keras.optimizers.AdamW,
        "adagrad": keras.optimizers.Adagrad,
        "rmsprop": keras.optimizers.RMSprop,
    }[config.optimizer]
    return cls(learning_rate=lr, global_clipnorm=clip)


def epoch_learning_rate(config, epoch):
    """Learning rate of (0-based) `epoch` in the paper's units.

    From epoch `decay_after_epochs + 1` on (1-based), the rate is
    multiplied by `lr_decay` every epoch.
    """
    decays = max(0, epoch + 1 - config.decay_after_epochs) if config.decay_after_epochs else 0
    if config.lr_decay == 1.0:
        decays = 0
    return config.learning_rate * config.lr_decay ** decays


def optimizer_learning_rate(config, epoch):
    """The optimizer's learning rate for `epoch`: `epoch_learning_rate`,
    rescaled for `loss_reduction="sum_over_time"` as in `make_optimizer`."""
    lr = epoch_learning_rate(config, epoch)
    if config.loss_reduction == "sum_over_time":
        lr *= loss_time_steps(config)
    return lr


def _head_model(config, corpus, head_name, tie, batch_size, **structure):
    """`(HeadModel(backbone, head), input_shape)`: a stateful LSTM of
    per-replica `batch_size` (training), or a stateless one of any batch
    size when `batch_size` is None (inference). `structure`: head options
    that override the config's (the trained head's clusters)."""
    if config.model == "lstm":
        stateful = batch_size is not None
        backbone = _lstm_backbone(config, corpus.vocab_size, batch_size, tie, stateful=stateful)
        input_shape = (batch_size, config.bptt if stateful else None)
    else:
        backbone = _ngram_backbone(config, corpus.vocab_size, tie)
        input_shape = (batch_size, config.ngram_order - 1)
    options = parse_options(config.head_options)
    counts = np.asarray(corpus.vocab.counts)
    options.update(structure or _corpus_structure(head_name, options, corpus, counts))
    head = head_registry.make_head(
        head_name,
        corpus.vocab_size,
        counts=counts,
        token_embedding=backbone.token_embedding if tie else None,
        chunk_size=config.chunk_size,
        init_scale=config.init_scale,
        **options,
    )
    return HeadModel(backbone, head), input_shape


def _corpus_structure(head_name, options, corpus, counts):
    """Head options computed from the training split: the k-means clusters
    of a hierarchical softmax with `clustering="kmeans"` or
    `"weighted_kmeans"` (they need co-occurrence statistics, which only the
    token stream has). Empty for every other head."""
    strategy = options.get("clustering")
    if head_name != "hierarchical" or options.get("clusters") is not None \
            or strategy not in ("kmeans", "weighted_kmeans"):
        return {}
    layout = clustering.make_clusters(
        strategy, ids=np.asarray(corpus.train), counts=counts,
        num_clusters=options.get("num_clusters"), seed=options.get("seed", 0))
    return {"clusters": layout}
