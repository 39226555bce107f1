"""Helpers shared by the heads: context-size checks, constant
weights and sampling tables.

Every function here is public and used by more than one head module; a head
module imports them from here, never from another head's module.
"""

import numbers
import warnings

import keras
import numpy as np
from keras import ops

from keras_softmax_heads import samplers
from keras_softmax_heads.chunked.divergence import OutputLayer
from keras_softmax_heads.chunked.summed_cross_entropy import summed_cross_entropy
from keras_softmax_heads.chunked.vocab_parallel import token_losses
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_layout
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_summed
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_number


def gather_targets(values, targets):
    """`values[..., targets]` along the last axis: `[..., V]` -> `targets.shape`."""
    idx = ops.clip(targets, 0, ops.shape(values)[-1] - 1)
    picked = ops.take_along_axis(values, ops.expand_dims(idx, -1), axis=-1)
    return ops.squeeze(picked, -1)


def set_context_dim(layer, input_shape):
    """Sets `layer.input_dim` (the known last dimension `d`) and its input spec."""
    input_dim = input_shape[-1]
    if input_dim is None:
        raise ValueError(
            f"{layer.__class__.__name__} needs a known last dimension of the "
            f"context vectors. Received: input_shape={input_shape}"
        )
    layer.input_dim = int(input_dim)
    layer.input_spec = keras.InputSpec(min_ndim=2, axes={-1: layer.input_dim})


def build_context_checks(layer, input_shape):
    """Shared `build` checks: known `d`, input spec, tied embedding dims."""
    set_context_dim(layer, input_shape)
    embedding = getattr(layer, "token_embedding", None)
    if embedding is not None:
        if embedding.output_dim != layer.input_dim:
            raise ValueError(
                "The tied `token_embedding` has output_dim="
                f"{embedding.output_dim} but the context vectors have last "
                f"dimension {layer.input_dim}. Received: input_shape={input_shape}"
            )
        if not embedding.built:
            embedding.build((None,))


def add_constant_weight(layer, name, dtype, values):
    """A non-trainable weight of `layer` initialised to `values` (`dtype`).

    The values come from the initializer (not an `assign` after creation), so
    they are right even when the layer is built inside a traced function, and
    the weight is never autocast (int32 tables, float32 counts stay as they
    are under mixed precision).
    """
    values = np.asarray(values)

    def initializer(shape, dtype=None):
        del shape
        return ops.convert_to_tensor(values, dtype=dtype)

    return layer.add_weight(
        name=name,
        shape=values.shape,
        dtype=dtype,
        initializer=initializer,
        trainable=False,
        autocast=False,
    )


def config_vocab_size(config):
    """The vocabulary size a head's config describes: `vocab_size`, or the
    `input_dim` of its serialised `token_embedding` (None if neither)."""
    vocab = config.get("vocab_size")
    embedding = config.get("token_embedding")
    if vocab is None and isinstance(embedding, dict):
        vocab = embedding["config"]["input_dim"]
    return vocab


def check_num_sampled(num_sampled):
    """`num_sampled` as an int >= 1, or the string `"all"` (`SampledSoftmax`)."""
    if isinstance(num_sampled, str) and num_sampled == "all":
        return "all"
    return check_int("num_sampled", num_sampled, minimum=1)


def build_sampler_tables(layer, sampler, counts, distortion):
    """Creates a head's sampling tables as non-trainable weights.

    For `"log_uniform"` and `"unigram"`: `sampling_log_probs` (float32 `[V]`,
    `log q`), `alias_thresholds` (float32 `[V]`) and `alias_indices` (int32
    `[V]`); for `"unigram"` also `counts` (float32 `[V]`). Sets the layer
    attributes of the same names (`None` when absent) and returns the
    `samplers.CandidateSampler` reading them.
    """
    vocab = layer.vocab_size
    layer.counts = None
    layer.sampling_log_probs = None
    layer.alias_thresholds = None
    layer.alias_indices = None
    if sampler not in ("log_uniform", "unigram"):
        return samplers.CandidateSampler(vocab)
    if sampler == "unigram":
        layer.counts = add_constant_weight(layer, "counts", "float32", counts)
    probs = samplers.sampling_probs(sampler, vocab, counts, distortion)
    threshold, alias = samplers.alias_table(probs)
    with np.errstate(divide="ignore"):
        log_probs = np.log(probs)
    layer.sampling_log_probs = add_constant_weight(layer, "sampling_log_probs", "float32", log_probs)
    layer.alias_thresholds = add_constant_weight(layer, "alias_thresholds", "float32", threshold)
    layer.alias_indices = add_constant_weight(layer, "alias_indices", "int32", alias)
    return samplers.CandidateSampler(
        vocab, layer.sampling_log_probs, layer.alias_thresholds, layer.alias_indices
    )


# --------------------------------------------------- adaptive frequency bands
def check_cutoffs(cutoffs, vocab_size):
    """Cutoffs of adaptive bands: strictly increasing ints in `[1, V)`.

    `cutoffs = [c_0, ..., c_{k-1}]` splits the frequency ranks into the head
    band `[0, c_0)` and tail bands `[c_{i-1}, c_i)`, the last one ending at
    `V` (as `torch.nn.AdaptiveLogSoftmaxWithLoss`, whose cutoffs also
    exclude `V`). Returns a list of Python ints.

    >>> check_cutoffs((2, 5), 10)
    [2, 5]
    """
    ok = (
        not isinstance(cutoffs, (str, bytes))
        and hasattr(cutoffs, "__len__")
        and len(cutoffs) >= 1
        and all(
            isinstance(c, numbers.Integral) and not isinstance(c, (bool, np.bool_))
            for c in cutoffs
        )
    )
    if ok:
        values = [int(c) for c in cutoffs]
        ok = (
            all(a < b for a, b in zip(values, values[1:]))
            and values[0] >= 1
            and values[-1] < vocab_size
        )
    if not ok:
        raise ValueError(
            "`cutoffs` must be a non-empty list of strictly increasing "
            f"integers in [1, vocab_size={vocab_size}) (the last band ends at "
            f"vocab_size). Received: cutoffs={cutoffs!r}"
        )
    return values


def check_factor(factor):
    """The size ratio of consecutive adaptive bands: a number `>= 1` (an int
    when integral)."""
    factor = check_number("factor", factor, low=1)
    return int(factor) if factor.is_integer() else factor


def adaptive_band_dims(dim, num_bands, factor):
    """Band widths `max(1, dim // factor**i)` for `i = 0 .. num_bands - 1`.

    >>> adaptive_band_dims(16, 3, 4)
    [16, 4, 1]
    """
    return [max(1, int(dim // factor**i)) for i in range(num_bands)]


def frequency_order(counts, vocab_size):
    """The word id at each frequency rank (descending `counts`, ties by id):
    `arange(V)` without counts."""
    if counts is None:
        return np.arange(vocab_size)
    return np.argsort(-np.asarray(counts, np.float64), kind="stable")


def check_static_shapes(static_shapes, dynamic_work):
    """`static_shapes` as a bool; `False` raises on JAX, which cannot trace
    data-dependent shapes. `dynamic_work` completes "static_shapes=False
    ..." in the message (what the dynamic path does)."""
    static_shapes = check_bool("static_shapes", static_shapes)
    if not static_shapes and keras.backend.backend() == "jax":
        raise ValueError(
            f"static_shapes=False {dynamic_work}, which the JAX backend cannot trace "
            "(`jax.jit` needs static shapes). Use static_shapes=True (the default, exact "
            "and XLA-compatible) on JAX, or the TensorFlow or PyTorch backend for "
            "static_shapes=False. Received: static_shapes=False with KERAS_BACKEND='jax'"
        )
    return static_shapes


def token_weights(tokens, sample_weight):
    """float32 weights of the shape of `tokens`: ones, or `sample_weight`
    broadcast (a per-sequence `[B]` weight over the sequence's tokens)."""
    shape = ops.shape(tokens)
    if sample_weight is None:
        return ops.ones(shape, "float32")
    weight = ops.cast(sample_weight, "float32")
    while len(weight.shape) < len(shape):
        weight = ops.expand_dims(weight, -1)
    return ops.broadcast_to(weight, shape)


def summed_over_valid_targets(targets, weights, vocab_size, summed_fn, dtype="float32"):
    """`summed_fn(ids, weights)` on the flattened `[N]` ids (clipped into
    `[0, vocab_size)`) and weights of `dtype` (float32 unless a head
    accumulates in float64), cast to `dtype`; NaN when an id outside
    `[0, vocab_size)` has a non-zero weight (as the per-token losses' NaN,
    `validation.nan_if_invalid`). The frame of the heads'
    `summed_training_loss` with `gradient_in_forward`."""
    ids = ops.reshape(ops.cast(targets, "int32"), (-1,))
    weights = ops.cast(ops.reshape(weights, (-1,)), dtype)
    bad = ops.logical_and(ops.logical_or(ids < 0, ids >= vocab_size), weights != 0)
    total = ops.cast(summed_fn(ops.clip(ids, 0, vocab_size - 1), weights), dtype)
    return ops.where(ops.any(bad), ops.full_like(total, float("nan")), total)


def token_nll_on_shards(summed, inputs, targets, vocab_size):
    """`-log p(targets)` (shape `targets.shape`) from a vocabulary-parallel
    summed pass `summed(weights, ids, *inputs)` returning `(sum, per-token
    NLLs)` (`chunked.vocab_parallel.token_losses`: exact gradients for any
    cotangent), on the flattened ids clipped into `[0, vocab_size)` (the
    caller marks the invalid ones NaN, `validation.nan_if_invalid`). The
    frame of the heads' per-token `log_likelihood` on vocabulary shards."""
    ids = ops.clip(ops.reshape(targets, (-1,)), 0, vocab_size - 1)
    return ops.reshape(token_losses(summed, inputs, ids), ops.shape(targets))


def linear_nll_on_shards(rows, kernel, bias, transposed, layout, targets, vocab_size,
                         token_chunk, soft_cap=None):
    """`-log p(targets)` of the Linear-Softmax `log_softmax(rows W + b)`
    (soft-capped with `soft_cap`), shape `targets.shape`, on each device's
    vocabulary shard (`layout`: `chunked.vocab_parallel.vocab_parallel_layout`
    of `kernel`): the summed cross-entropy with its per-token losses
    (`vocab_parallel_summed`, `token_losses`), exact gradients for `rows`,
    `kernel` and `bias` whatever the cotangent, in chunks of `token_chunk`
    tokens. `FullSoftmax` and `MixtureOfContexts` (on its mixed context)
    evaluate and train through it where their kernel is sharded on V."""
    has_bias = bias is not None

    def summed(weights, t, h, w, *b):
        layer = OutputLayer(h, w, b[0] if has_bias else None, transposed, soft_cap)
        return vocab_parallel_summed(layer, t, weights, layout, token_chunk_size=token_chunk,
                                     return_per_token=True)

    return token_nll_on_shards(summed, [rows, kernel] + ([bias] if has_bias else []),
                               targets, vocab_size)


def summed_linear_cross_entropy(layer, kernel_variable, targets, weights, vocab_size):
    """`sum_i weights_i (-log p(targets_i))` of the Linear-Softmax `layer`
    (a `chunked.divergence.OutputLayer`), its gradient computed in the
    forward pass (`chunked.summed_cross_entropy`); on each device's
    vocabulary shard (`vocab_parallel_summed`) where the layout of
    `kernel_variable` (the variable `layer.kernel` was read from) shards
    it on V (JAX). A float32 scalar, NaN for an id outside `[0, V)` with a
    non-zero weight (`summed_over_valid_targets`). The summed objective of
    `FullSoftmax` and of `MixtureOfContexts` (on its mixed context)."""
    layout = vocab_parallel_layout(kernel_variable, layer.kernel_transposed)

    def total(ids, weights):
        if layout is None:
            return summed_cross_entropy(layer, ids, weights)
        return vocab_parallel_summed(layer, ids, weights, layout)

    return summed_over_valid_targets(targets, weights, vocab_size, total)


# The `save_own_variables` keys of the random-number generators' states
# (`SEED_STATE_KEY.format(i)`), next to Keras' own "0", "1", ... keys.
SEED_STATE_PREFIX = "seed_state_"
SEED_STATE_KEY = SEED_STATE_PREFIX + "{}"


def random_states(layer):
    """The state variables of the random-number generators of `layer` and
    its sublayers (dropout, samplers): Keras' `variables` (all layer state,
    random seeds included) less `weights`, in tracking order (the same for
    a layer rebuilt from its config)."""
    weights = {id(w) for w in layer.weights}
    return [v for v in layer.variables if id(v) not in weights]


def save_random_states(layer, store):
    """Adds `random_states(layer)` to `layer.save_own_variables`' `store`:
    Keras saves no `SeedGenerator` state, so a loaded model would draw its
    dropout masks and samples afresh from the initial seeds."""
    for i, state in enumerate(random_states(layer)):
        store[SEED_STATE_KEY.format(i)] = state


def load_random_states(layer, store, load_weights):
    """`layer.load_own_variables(store)`: `load_weights` (the superclass'
    method) on Keras' own keys, then the random states `save_random_states`
    wrote, if the file has them (files from before have none)."""
    seed_keys = [k for k in store.keys() if k.startswith(SEED_STATE_PREFIX)]
    load_weights({k: store[k] for k in store.keys() if k not in seed_keys})
    if not seed_keys:
        return
    states = random_states(layer)
    if len(seed_keys) != len(states):
        warnings.warn(
            f"{layer.__class__.__name__} '{layer.name}': not restoring the "
            f"random-number generators' states: the file has "
            f"{len(seed_keys)}, the layer {len(states)}.",
            stacklevel=3,
        )
        return
    for i, state in enumerate(states):
        state.assign(store[SEED_STATE_KEY.format(i)])
