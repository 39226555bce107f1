"""Backend-neutral timed steps and memory readings of the benchmark scripts.

The only benchmark module that branches on the Keras backend. Import it
after `select_backend.use(...)` (it imports Keras). A step is built once and
called with the same inputs many times; every call returns the loss as a
Python float after *all* of the step's outputs (loss and gradients) are
computed, so that the time of a call is the time of the whole step:

* TensorFlow: `tf.function(jit_compile=...)` around a `tf.GradientTape`
  (mode `graph` or `xla`); sparse gradients stay `tf.IndexedSlices`.
* JAX: `jax.value_and_grad` of a pure function that maps every variable
  the step reads to its value with `keras.StatelessScope`, under `jax.jit`
  (mode `xla`) or op by op (mode `eager`). The non-trainable state
  (`state=`: the seed generators of the sampled heads, their tables) goes
  in as an input and its new value comes out, so each call draws new
  samples, as on the other backends; `jax.block_until_ready` waits for the
  loss, the gradients and the new state.
* PyTorch: the loss and `torch.autograd.grad` op by op (mode `eager`), or
  the loss function under `torch.compile` (mode `compile`).

Memory (`peak_memory()`, a `measure.py` reader): TensorFlow's CPU
allocator statistics on TensorFlow; the process' peak resident size
(`VmHWM` after resetting it) on JAX and PyTorch, whose CPU allocators keep
no such statistics.
"""

import keras
import numpy as np
import measure  # benchmarks/measure.py (the script's own folder)
import select_backend  # benchmarks/select_backend.py

BACKEND = keras.backend.backend()


def check_mode(mode):
    """Raises ValueError when `mode` is not a mode of this backend."""
    if mode not in select_backend.MODES.get(BACKEND, ()):
        raise ValueError(
            f"mode {mode!r} is not available on {BACKEND}; its modes: "
            f"{', '.join(select_backend.MODES.get(BACKEND, ()))}"
        )


def _split(inputs, wrt):
    diff = [inputs[i] for i in wrt]
    return diff


def _merge(inputs, wrt, diff):
    inputs = list(inputs)
    for i, x in zip(wrt, diff):
        inputs[i] = x
    return inputs


def _unique_state(variables, state):
    ids = {id(v) for v in variables}
    return [v for v in state if id(v) not in ids]


def grad_step(loss_fn, variables, mode, wrt=(0,), state=()):
    """A timed step: `loss_fn(*inputs)` and its gradients.

    Args:
        loss_fn: `(*inputs) -> scalar` written with Keras ops / layers.
        variables: the Keras variables to differentiate with respect to.
        mode: a mode of this backend (`select_backend.MODES`).
        wrt: indices of the inputs to differentiate with respect to.
        state: other Keras variables `loss_fn` reads or updates (on JAX they
            are passed in and their new values carried to the next call).

    Returns:
        `step(*inputs) -> float`, the loss, once the gradients are computed.
    """
    check_mode(mode)
    variables, wrt = list(variables), tuple(wrt)
    state = _unique_state(variables, state)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=mode == "xla")
        def fn(*inputs):
            with tf.GradientTape() as tape:
                diff = _split(inputs, wrt)
                tape.watch(diff)
                loss = loss_fn(*inputs)
            return loss, tape.gradient(loss, diff + variables)

        def step(*inputs):
            return float(fn(*inputs)[0])

        return step
    if BACKEND == "jax":
        return _jax_step(loss_fn, variables, mode, wrt, state, grad=True)
    if BACKEND == "torch":
        import torch

        compiled = torch.compile(loss_fn) if mode == "compile" else loss_fn
        weights = [v.value for v in variables]

        def step(*inputs):
            inputs = [keras.ops.convert_to_tensor(x) for x in inputs]
            diff = [x.detach().requires_grad_(True) for x in _split(inputs, wrt)]
            loss = compiled(*_merge(inputs, wrt, diff))
            torch.autograd.grad(loss, diff + weights, allow_unused=True)
            return float(loss.detach())

        return step
    raise NotImplementedError(f"no timed steps for backend {BACKEND!r}")


def value_step(fn, mode, state=()):
    """A timed forward step: `fn(*inputs)`, no gradients.

    Args:
        fn: `(*inputs) -> scalar` written with Keras ops / layers.
        mode: a mode of this backend (`select_backend.MODES`).
        state: Keras variables `fn` reads or updates (passed in on JAX).

    Returns:
        `step(*inputs) -> float`.
    """
    check_mode(mode)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(fn, jit_compile=mode == "xla")

        def step(*inputs):
            return float(compiled(*inputs))

        return step
    if BACKEND == "jax":
        return _jax_step(fn, [], mode, (), list(state), grad=False)
    if BACKEND == "torch":
        import torch

        compiled = torch.compile(fn) if mode == "compile" else fn

        def step(*inputs):
            with torch.no_grad():
                inputs = [keras.ops.convert_to_tensor(x) for x in inputs]
                return float(compiled(*inputs))

        return step
    raise NotImplementedError(f"no timed steps for backend {BACKEND!r}")


def _jax_step(fn, variables, mode, wrt, state, grad):
    import jax

    def pure(variable_values, diff, state_values, inputs):
        mapping = list(zip(variables, variable_values)) + list(zip(state, state_values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            value = fn(*_merge(inputs, wrt, diff))
        new_state = []
        for v, old in zip(state, state_values):
            new = scope.get_current_value(v)
            new_state.append(old if new is None else new)
        return value, new_state

    if grad:
        fn_jax = jax.value_and_grad(pure, argnums=(0, 1), has_aux=True)
    else:
        fn_jax = pure
    if mode == "xla":
        fn_jax = jax.jit(fn_jax)
    variable_values = [v.value for v in variables]
    carried = {"state": [v.value for v in state]}

    def step(*inputs):
        inputs = [keras.ops.convert_to_tensor(x) for x in inputs]
        out = fn_jax(variable_values, _split(inputs, wrt), carried["state"], inputs)
        out = jax.block_until_ready(out)
        (value, new_state) = out[0] if grad else out
        carried["state"] = new_state
        return float(value)

    return step


# ------------------------------------------------------------------ heads
def train_step(head, mode, reduction="mean", summed=False):
    """Step of `reduction(head.training_loss(h, y))` and its gradients.

    Gradients are taken with respect to `h` and every trainable weight of
    the head; `reduction` is `"mean"` or `"sum"`. With `summed`, the loss is
    `head.summed_training_loss(h, y, weights)` with weights `1 / N` (mean)
    or 1 (sum): the objective `HeadLoss` and `HeadModel` train (the same
    value; heads with a summed core compute its gradient in the forward
    pass).
    """
    reduce = keras.ops.mean if reduction == "mean" else keras.ops.sum

    def loss_fn(h, y):
        if summed:
            weight = 1.0 / y.shape[0] if reduction == "mean" else 1.0
            weights = keras.ops.full(keras.ops.shape(y), weight)
            return head.summed_training_loss(h, y, weights, training=True)
        return reduce(head.training_loss(h, y, training=True))

    return grad_step(loss_fn, head.trainable_variables, mode, wrt=(0,),
                     state=head.non_trainable_variables)


def eval_step(head, mode):
    """Forward step of the exact `sum(head.log_likelihood(h, y))`."""

    def fn(h, y):
        return keras.ops.sum(head.log_likelihood(h, y))

    return value_step(fn, mode, state=head.variables)


def dense_nll(h, kernel, bias, targets):
    """`-log softmax(h kernel + bias)[targets]` `[N]`, the dense way.

    On TensorFlow: `tf.nn.log_softmax` and a batched `tf.gather` (the ops
    of the dense reference measured before the other backends); elsewhere
    the same with Keras ops.
    """
    if BACKEND == "tensorflow":
        import tensorflow as tf

        log_p = tf.nn.log_softmax(tf.matmul(h, kernel) + bias)
        return -tf.gather(log_p, targets, batch_dims=1)
    log_p = keras.ops.log_softmax(keras.ops.matmul(h, kernel) + bias)
    picked = keras.ops.take_along_axis(log_p, keras.ops.expand_dims(targets, -1), axis=-1)
    return -keras.ops.squeeze(picked, -1)


def fused_xent(h, kernel, bias, targets):
    """Sparse softmax cross-entropy from logits, the backend's fused op."""
    logits = keras.ops.matmul(h, kernel) + bias
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits)
    return keras.ops.sparse_categorical_crossentropy(targets, logits, from_logits=True)


def normal(shape, scale=1.0, seed=0):
    """A float32 tensor of `N(0, scale^2)` draws (NumPy), on the backend."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= scale
    return keras.ops.convert_to_tensor(x)


def tensor(array):
    """`array` as a tensor of the backend."""
    return keras.ops.convert_to_tensor(array)


def aligned_empty(shape, dtype):
    """An uninitialised NumPy array on a 128-byte boundary (TensorFlow takes
    only aligned buffers without a copy, and aborts on unaligned ones)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + 128, np.uint8)
    offset = (-raw.ctypes.data) % 128
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def host_tensor(array):
    """A tensor sharing the memory of the NumPy `array` where possible.

    DLPack on TensorFlow and JAX (no copy for an aligned buffer), a shared
    buffer on PyTorch; a copy where the backend refuses.
    """
    try:
        if BACKEND == "tensorflow":
            import tensorflow as tf

            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        if BACKEND == "jax":
            import jax

            return jax.dlpack.from_dlpack(array)
        if BACKEND == "torch":
            import torch

            return torch.from_numpy(array)
    except (TypeError, ValueError, RuntimeError):
        pass
    return keras.ops.convert_to_tensor(array)


# ----------------------------------------------------------------- memory
def peak_memory():
    """The memory reader of this backend's CPU steps (`measure.py`).

    TensorFlow: its CPU allocator's statistics
    (`measure.TensorFlowAllocatorPeak`). JAX and PyTorch, whose CPU
    allocators keep no statistics: the process' peak resident size
    (`measure.RssPeak`).
    """
    if BACKEND == "tensorflow":
        return measure.TensorFlowAllocatorPeak()
    return measure.RssPeak()
