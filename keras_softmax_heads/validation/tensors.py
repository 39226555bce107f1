"""Checks of tensor arguments: word ids in range, floating dtypes.

The word-id checks are what every head and loss applies to its targets:
concrete (eager) values are checked on the host and raise `ValueError`
naming the first bad id; a TensorFlow graph checks them when the step runs;
under XLA (no assertions) a result gets NaN where its id is out of range
(`nan_if_invalid`). `is_concrete` is the one backend dispatch here.
"""

import keras
import numpy as np
from keras import ops

#: Input dtypes whose scores can be accumulated (in float32, or float64).
ACCUMULABLE_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_float_dtype(name, x):
    """Raises unless tensor `x` has one of `ACCUMULABLE_DTYPES`."""
    dtype = keras.backend.standardize_dtype(x.dtype)
    if dtype not in ACCUMULABLE_DTYPES:
        raise ValueError(
            f"`{name}` must be a floating tensor of one of {ACCUMULABLE_DTYPES} "
            f"(its scores are accumulated in float32). Received: {name} with "
            f"dtype={dtype}"
        )


def is_concrete(x):
    """Whether the values of tensor `x` are known now (eager execution).

    The one backend dispatch behind the target checks: `False` for a
    `keras.KerasTensor`, inside a TensorFlow graph (`tf.function`, with or
    without XLA), for a JAX tracer (`jax.jit`, `jax.grad`, `vmap`, shape
    inference), for a PyTorch tensor on the `meta` device (Keras' shape
    inference) and while `torch.compile` traces; `True` otherwise.
    """
    if isinstance(x, keras.KerasTensor):
        return False
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    if backend == "torch":
        import torch

        if torch.compiler.is_compiling():
            return False
        return not (isinstance(x, torch.Tensor) and x.device.type == "meta")
    return True


def target_error_message(values, vocab_size):
    """The message of an out-of-range target, or None if all are in range.

    `values`: a NumPy int array. Names the first bad value and its index,
    e.g. `targets must be word ids in [0, vocab_size=50). Received:
    targets[2, 7]=57 (3 of 96 out of range)`. O(size).
    """
    bad = (values < 0) | (values >= vocab_size)
    if not bad.any():
        return None
    index = np.unravel_index(int(np.argmax(bad)), values.shape)
    where = ", ".join(str(int(i)) for i in index)
    return (
        f"targets must be word ids in [0, vocab_size={vocab_size}). Received: "
        f"targets[{where}]={int(values[index])} "
        f"({int(bad.sum())} of {values.size} out of range)"
    )


def check_targets(targets, vocab_size):
    """Casts word ids to int32 and checks that they lie in `[0, vocab_size)`.

    * Concrete values (eager execution, every backend; `is_concrete`): an
      out-of-range id raises a `ValueError` naming the first bad value, its
      index and `vocab_size` (`target_error_message`). This copies the
      targets to the host (`O(size)`).
    * A TensorFlow graph (`tf.function` without XLA): a `tf.debugging.Assert`
      raises `InvalidArgumentError` with the same information when the step
      runs (TensorFlow's gather on GPU would silently return 0 instead).
    * Values unknown at trace time elsewhere (XLA: `jit_compile=True`,
      `jax.jit`, `torch.compile`): no check (XLA compiles assertions away);
      a head applies `nan_if_invalid` to its result, so such ids give NaN,
      not a number.
    """
    targets = ops.cast(ops.convert_to_tensor(targets), "int32")
    if is_concrete(targets):
        message = target_error_message(ops.convert_to_numpy(targets), vocab_size)
        if message is not None:
            raise ValueError(message)
        return targets
    if keras.backend.backend() == "tensorflow":
        return graph_target_check(targets, vocab_size)
    return targets


def graph_target_check(targets, vocab_size):
    """TensorFlow graphs only: `targets` behind a `tf.debugging.Assert`.

    The assertion runs with the step (graph mode); XLA drops it, which
    `nan_if_invalid` covers.
    """
    import tensorflow as tf

    message = f"targets must be word ids in [0, vocab_size={vocab_size})"
    bad = tf.logical_or(targets < 0, targets >= vocab_size)
    flat_bad = tf.reshape(bad, [-1])
    first = tf.argmax(tf.cast(flat_bad, tf.int32), output_type=tf.int32)
    shape = tf.shape(targets, out_type=tf.int32)
    strides = tf.math.cumprod(shape, exclusive=True, reverse=True)
    index = (first // strides) % shape  # unravel_index, which XLA lacks
    check = tf.debugging.Assert(
        tf.logical_not(tf.reduce_any(flat_bad)),
        [f"{message}. Received: targets at index", index, "=",
         tf.gather(tf.reshape(targets, [-1]), first),
         "; number out of range:", tf.reduce_sum(tf.cast(flat_bad, tf.int32))],
        summarize=8,
    )
    with tf.control_dependencies([check]):
        return tf.identity(targets)


def nan_if_invalid(values, targets, vocab_size):
    """`values` with NaN wherever `targets` is outside `[0, vocab_size)`."""
    valid = ops.logical_and(targets >= 0, targets < vocab_size)
    return ops.where(valid, values, ops.full_like(values, float("nan")))


class _KerasMaskReader(keras.losses.Loss):
    """A loss of ones per position: called with `reduction="none"`, Keras'
    `Loss.__call__` multiplies them by the Keras mask of `y_pred`."""

    def call(self, y_true, y_pred):
        return ops.ones(ops.shape(y_pred)[:-1], "float32")


_MASK_READER = _KerasMaskReader(name="keras_mask", reduction="none", dtype="float32")


def keras_mask_weights(x):
    """float32 weights `[...]` of tensor `x` `[..., d]` from its Keras mask:
    1 where the mask is true, 0 where it is false; ones without a mask.

    The mask a layer such as `Embedding(mask_zero=True)` or an RNN hands on
    with its output. Keras has no public accessor for it; its losses and
    metrics read it from `y_pred` in `Loss.__call__`, which this calls (a
    loss of ones, unreduced), so a loss or metric that does its own
    reduction honours the mask as Keras' own do.

    >>> import numpy as np, keras
    >>> h = keras.layers.Embedding(5, 2, mask_zero=True)(np.array([[3, 1, 0]]))
    >>> keras.ops.convert_to_numpy(keras_mask_weights(h)).tolist()
    [[1.0, 1.0, 0.0]]
    """
    return _MASK_READER(ops.zeros((), "float32"), x)


class _KerasMaskCopier(keras.layers.Layer):
    """`(source, x) -> x` carrying `source`'s Keras mask: Keras'
    `Layer.__call__` sets a masking layer's output mask from its first
    argument's."""

    def __init__(self):
        super().__init__(name="keras_mask_copier")
        self.supports_masking = True

    def call(self, source, x):
        return x

    def compute_mask(self, source, mask=None):
        return mask


_MASK_COPIER = _KerasMaskCopier()


def with_keras_mask_of(source, x):
    """`x` `[..., V]` with the Keras mask of `source` `[..., d]` (none if
    `source` has none): what Keras' losses and metrics read from `y_pred`,
    for an output computed outside a layer's `__call__`.

    >>> import numpy as np, keras
    >>> h = keras.layers.Embedding(5, 2, mask_zero=True)(np.array([[3, 1, 0]]))
    >>> x = with_keras_mask_of(h, keras.ops.zeros((1, 3, 4)))
    >>> keras.ops.convert_to_numpy(keras_mask_weights(x)).tolist()
    [[1.0, 1.0, 0.0]]
    """
    return _MASK_COPIER(source, x)


def per_replica(loss):
    """`loss` divided by the replicas of the current `tf.distribute`
    strategy; unchanged on the other backends, whose distribution computes
    the global mean directly.

    TensorFlow sums the replicas' gradients and Keras multiplies the
    reported loss back by the replica count, so a Keras loss with a mean
    reduction divides by it (as Keras' own losses do); a loss or model that
    reduces by itself calls this on its mean."""
    if keras.backend.backend() != "tensorflow":
        return loss
    import tensorflow as tf

    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return loss / replicas if replicas > 1 else loss


def keras_integer_targets(y):
    """`y`, word ids handed to a Keras loss hook, as an int32 tensor when
    they come as floats (Keras' own sparse losses cast them; Keras traces a
    model's first `evaluate` under a `tf.distribute` strategy with float
    placeholders)."""
    y = ops.convert_to_tensor(y)
    if "int" not in keras.backend.standardize_dtype(y.dtype):
        y = ops.cast(y, "int32")
    return y
