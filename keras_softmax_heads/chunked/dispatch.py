"""The backend-specific primitives of the tiled core, one function each.

The core (`chunked.core`) is written in `keras.ops`; it calls these for
what the backends do differently:

* `value_and_vjp`: the vector-Jacobian product of the pointwise transform
  over one tile (`jax.vjp`, a `tf.GradientTape`, `torch.autograd.grad`);
* `run_pass`: how a whole pass over the tiles runs. On TensorFlow with
  `implementation="auto"`, in a graph, it is compiled with XLA (a nested
  `tf.function(jit_compile=True)`), so each tile's kernel-gradient write
  (`keras.ops.slice_update`) is in place in graph mode too, where
  TensorFlow's executor would copy the buffer (`docs/chunked.md`);
* `low_precision_matmul`: JAX's low-precision products with float32
  results; `matmul_fn`: float64 products on PyTorch;
* `tile_reader`, `gradient_writer`: how a kernel tile is read in the
  accumulation dtype and how the kernel gradient is written tile by tile
  (TensorFlow handles a bfloat16 kernel as its bits: see there);
* `zeros_like`: a pass's zero gradient buffers, made so that TensorFlow
  cannot fold them into compile-time constants;
* `needs_gradient`: whether the caller's automatic differentiation will
  ask for an input's gradient (PyTorch says so when the loss is built; the
  passes then skip the products of the others); `gradients_needed`, the
  pair for an output layer's hidden states and kernel;
* `shifted_exp`, `scaled_minus_target`, `multiply`, `subtract`,
  `sigsoftmax_scores`, `update_slice`, `add_to_slice`: the elementwise
  steps and gradient writes over a chunk's `[rows, V]` or a tile's `[N, size]`
  scores (the summed cores, the tiled pass), on PyTorch outside automatic
  differentiation written into a buffer the step owns (`overwritable`)
  instead of a fresh one each.

`implementation="ops"` runs the passes as they are on every backend (the
reference the TensorFlow path is tested against).
"""

import keras
from keras import ops

from keras_softmax_heads.functional import log_sigmoid_scores
from keras_softmax_heads.functional.dispatch import xla_in_graph
from keras_softmax_heads.platforms import current_platform


def _fast_tensorflow(implementation):
    return implementation == "auto" and keras.backend.backend() == "tensorflow"


def value_and_vjp(fn, primals):
    """`fn(*primals)` and its vector-Jacobian product.

    Returns `(out, vjp)`: `out = fn(*primals)` and a function `vjp(cotangent)`
    giving the gradients of `sum(out * cotangent)` with respect to each of
    `primals`, as a list of dense tensors of their shapes (zeros for a primal
    `out` does not depend on). `fn` is differentiated by the backend's
    automatic differentiation: `jax.vjp`, a `tf.GradientTape`,
    `torch.autograd.grad`. The chunked losses call it on one `[N, chunk]`
    tile at a time.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> x = ops.convert_to_tensor(np.array([1.0, 2.0], "float32"))
    >>> out, vjp = value_and_vjp(lambda x: x * x, [x])
    >>> [ops.convert_to_numpy(g).tolist() for g in vjp(ops.ones((2,)))]
    [[2.0, 4.0]]
    """
    backend = keras.backend.backend()
    primals = list(primals)
    if backend == "jax":
        import jax

        out, pullback = jax.vjp(fn, *primals)
        return out, lambda cotangent: list(pullback(cotangent))
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(primals)
            out = fn(*primals)

        def tf_vjp(cotangent):
            grads = tape.gradient(
                out,
                primals,
                output_gradients=cotangent,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            return [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices

        return out, tf_vjp
    if backend == "torch":
        import torch

        leaves = [p.detach().requires_grad_(True) for p in primals]
        with torch.enable_grad():
            out = fn(*leaves)

        def torch_vjp(cotangent):
            if not out.requires_grad:
                return [torch.zeros_like(p) for p in leaves]
            grads = torch.autograd.grad(
                out, leaves, grad_outputs=cotangent, allow_unused=True
            )
            return [
                torch.zeros_like(p) if g is None else g for g, p in zip(grads, leaves)
            ]

        return out.detach(), torch_vjp
    raise NotImplementedError(
        "The chunked losses need automatic differentiation: the TensorFlow, "
        f"JAX or PyTorch backend. Received: backend {backend!r}"
    )


def needs_gradient(x):
    """Whether the gradient of `x` can be asked for: False only where the
    backend says so while the loss is built.

    On PyTorch, `x.requires_grad` with gradients enabled: a frozen Keras
    variable (`trainable=False`: LoRA's base weights, a frozen backbone)
    and a tensor under `stop_gradient` do not require one, so the chunked
    passes skip the products of its gradient (a frozen output matrix: one
    `N d V` product of four; frozen hidden states: one more). TensorFlow's
    and JAX's tapes do not say which inputs they differentiate: True there.
    Under `jax.jit`, and TensorFlow's `jit_compile=True`, XLA removes the
    products of a gradient nobody reads by itself (`docs/chunked.md`,
    "Frozen inputs").

    Example:

    >>> import numpy as np
    >>> frozen = keras.Variable(np.ones((2, 3), "float32"), trainable=False)
    >>> needs_gradient(frozen) == (keras.backend.backend() != "torch")
    True
    """
    if keras.backend.backend() != "torch":
        return True
    import torch

    value = getattr(x, "value", x)  # a Keras variable: its tensor
    return bool(torch.is_grad_enabled() and getattr(value, "requires_grad", False))


def gradients_needed(hidden, kernel):
    """`(needs_gradient(hidden), needs_gradient(kernel))`: the flags of an
    output layer's inputs that `chunked.core.CoreSpec` and the summed
    passes' `Side` take as `gradients`."""
    return needs_gradient(hidden), needs_gradient(kernel)


def overwritable(*tensors):
    """Whether the chunked passes may overwrite these fresh tensors of their
    own (the primitives below, `shifted_exp` to `add_to_slice`): on PyTorch,
    when automatic differentiation does not record them (the forward of a
    custom gradient runs without it); never on the other backends, whose
    arrays are immutable (XLA fuses the steps and reuses buffers itself).

    Eager PyTorch allocates every intermediate afresh, and on a CPU a
    `[rows, V]` float32 tensor of a chunk (256 MiB at the default
    `2**26` scores) is a new mapping whose page faults cost more than
    the arithmetic: a sum `a - b` of two such tensors took 114 ms, the
    same into a buffer already touched 22 ms (`docs/chunked.md`,
    "PyTorch: the chunk's buffers").
    """
    if keras.backend.backend() != "torch":
        return False
    import torch

    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def shifted_exp(s, shift):
    """`exp(s - shift[:, None])` for `s` `[rows, V]` and `shift` `[rows]`:
    on PyTorch (`overwritable`) the exponential is taken in place of the
    difference, one fresh `[rows, V]` buffer instead of two; elsewhere
    `keras.ops`.

    Example:

    >>> import numpy as np
    >>> s = np.array([[0.0, 1.0], [2.0, 2.0]], "float32")
    >>> out = ops.convert_to_numpy(shifted_exp(s, ops.max(s, axis=1)))
    >>> bool(np.allclose(out, np.exp(s - s.max(axis=1, keepdims=True))))
    True
    """
    s, shift = ops.convert_to_tensor(s), ops.convert_to_tensor(shift)
    if overwritable(s, shift):
        return (s - shift[:, None]).exp_()
    return ops.exp(s - shift[:, None])


def scaled_minus_target(e, scale, targets, delta):
    """`e * scale[:, None]`, less `delta` at each row's target column:
    `out[i, v] = e[i, v] scale[i] - delta[i] [v = targets[i]]`, for `e`
    `[rows, V]`, `scale` `[rows]` (None: `e` as it is) and `delta`
    `[rows]`, `targets` `[rows]` int ids
    in `[0, V)` (not checked): the softmax's score gradient
    `w (p - onehot)` from the exponentials. `e` may be overwritten.

    On PyTorch (`overwritable`): `e.mul_` then one `scatter_add_` of
    `-delta`, no `[rows, V]` buffer; elsewhere a compare of the columns
    against the targets and a `where` (`keras.ops`, which XLA fuses into
    one pass).

    Example:

    >>> import numpy as np
    >>> e = np.ones((2, 3), "float32")
    >>> out = scaled_minus_target(e, np.array([0.5, 2.0], "float32"),
    ...                           np.array([2, 0], "int32"), np.array([1.0, 3.0], "float32"))
    >>> ops.convert_to_numpy(out).tolist()
    [[0.5, 0.5, -0.5], [-1.0, 2.0, 2.0]]
    """
    e, delta = ops.convert_to_tensor(e), ops.convert_to_tensor(delta)
    if scale is not None:
        scale = ops.convert_to_tensor(scale)
    if overwritable(e, delta, *([] if scale is None else [scale])):
        import torch

        index = ops.convert_to_tensor(targets).long()[:, None]
        out = e if scale is None else e.mul_(scale[:, None])
        return out.scatter_add_(1, index, torch.neg(delta)[:, None].to(out.dtype))
    vocab = e.shape[1]
    hit = ops.equal(ops.arange(vocab, dtype="int32")[None, :],
                    ops.cast(targets, "int32")[:, None])
    out = e if scale is None else e * scale[:, None]
    return ops.where(hit, out - delta[:, None], out)


def sigsoftmax_scores(z):
    """`(s, ds/dz)` of SigSoftmax's component scores: `s = log(exp(z)
    sigmoid(z)) = z - softplus(-z)` (`functional.log_sigmoid_scores`) and
    `ds/dz = 1 + sigmoid(-z)`, for `z` `[rows, V]`. On PyTorch
    (`overwritable`) two fresh buffers (`-z`, its softplus) where the
    `keras.ops` form, used elsewhere, makes six.

    Example:

    >>> import numpy as np
    >>> z = np.array([[-30.0, 0.0, 2.0]], "float32")
    >>> s, slope = sigsoftmax_scores(z)
    >>> bool(np.allclose(ops.convert_to_numpy(s), z - np.logaddexp(0.0, -z)))
    True
    >>> bool(np.allclose(ops.convert_to_numpy(slope), 1.0 + 1.0 / (1.0 + np.exp(z))))
    True
    """
    z = ops.convert_to_tensor(z)
    if overwritable(z):
        import torch

        neg = torch.neg(z)
        s = torch.nn.functional.softplus(neg).neg_().add_(z)
        return s, neg.sigmoid_().add_(1.0)
    return log_sigmoid_scores(z), 1.0 + ops.sigmoid(-z)


def multiply(a, b):
    """`a * b` (broadcasting `b`, a tensor or a Python number; `a` itself
    for the number 1); `a` may be overwritten: on PyTorch (`overwritable`,
    `b` of `a`'s dtype and shape or broadcast to it) `a.mul_(b)`,
    elsewhere `keras.ops.multiply`.

    Example:

    >>> import numpy as np
    >>> ops.convert_to_numpy(multiply(np.ones((1, 2), "float32"), 3.0)).tolist()
    [[3.0, 3.0]]
    """
    a = ops.convert_to_tensor(a)
    if isinstance(b, (int, float)):
        if b == 1:
            return a
        return a.mul_(b) if overwritable(a) else a * b
    b = ops.convert_to_tensor(b)
    if overwritable(a, b) and b.dtype == a.dtype:
        import torch

        if torch.broadcast_shapes(a.shape, b.shape) == a.shape:
            return a.mul_(b)
    return ops.multiply(a, b)


def subtract(a, b):
    """`a - b` for `a` `[rows, V]` and `b` of its shape and dtype; `a` may
    be overwritten: on PyTorch (`overwritable`) `a.sub_(b)`, elsewhere
    `keras.ops.subtract`.

    Example:

    >>> import numpy as np
    >>> a, b = np.full((1, 2), 3.0, "float32"), np.ones((1, 2), "float32")
    >>> ops.convert_to_numpy(subtract(a, b)).tolist()
    [[2.0, 2.0]]
    """
    a, b = ops.convert_to_tensor(a), ops.convert_to_tensor(b)
    if overwritable(a, b) and a.dtype == b.dtype and a.shape == b.shape:
        return a.sub_(b)
    return ops.subtract(a, b)


def _slice_in_place(buffer, begin, values):
    """The view of `buffer` that `values` would update at `begin`, where
    `buffer` may be written in place (`overwritable`, `begin` Python ints,
    the same dtype); else None."""
    import operator

    try:
        start = [operator.index(b) for b in begin]
    except TypeError:  # a tensor
        return None
    if not (overwritable(buffer, values) and values.dtype == buffer.dtype):
        return None
    return buffer[tuple(slice(b, b + n) for b, n in zip(start, values.shape))]


def update_slice(buffer, begin, values):
    """`keras.ops.slice_update(buffer, begin, values)`; `buffer` (a pass's
    own gradient buffer) may be overwritten: on PyTorch (`overwritable`,
    `begin` Python ints, `values` of its dtype) `values` are written into
    it in place, where Keras' PyTorch `slice_update` clones the whole
    buffer at each write (a 64 MiB kernel gradient eight times a pass at
    V = 32,768, d = 512).

    Example:

    >>> import numpy as np
    >>> out = update_slice(ops.zeros((2, 3)), [0, 1], np.ones((2, 1), "float32"))
    >>> ops.convert_to_numpy(out).tolist()
    [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    """
    buffer, values = ops.convert_to_tensor(buffer), ops.convert_to_tensor(values)
    view = _slice_in_place(buffer, begin, values)
    if view is None:
        return ops.slice_update(buffer, begin, values)
    view.copy_(values)
    return buffer


def add_to_slice(buffer, begin, values):
    """`buffer` with `values` added to its slice at `begin` (the slice's
    shape is `values`'); `buffer` may be overwritten: on PyTorch
    (`overwritable`, `begin` Python ints, the same dtype) `add_` into the
    slice in place, elsewhere `keras.ops.slice_update` of the slice plus
    `values`.

    Example:

    >>> import numpy as np
    >>> out = add_to_slice(ops.ones((2, 3)), [1, 0], np.ones((1, 2), "float32"))
    >>> ops.convert_to_numpy(out).tolist()
    [[1.0, 1.0, 1.0], [2.0, 2.0, 1.0]]
    """
    buffer, values = ops.convert_to_tensor(buffer), ops.convert_to_tensor(values)
    view = _slice_in_place(buffer, begin, values)
    if view is None:
        shape = list(values.shape)
        return ops.slice_update(buffer, begin, ops.slice(buffer, begin, shape) + values)
    view.add_(values)
    return buffer


def run_pass(fn, implementation="auto"):
    """`fn()`: one pass (the forward or the backward) over the tiles.

    On TensorFlow with `implementation="auto"`, inside a `tf.function`, the
    pass is a nested `tf.function(jit_compile=True)`: XLA updates the
    loop-carried kernel gradient in place, where TensorFlow's graph
    executor copies it at each tile's write; under an enclosing
    `jit_compile=True` it is simply part of that program
    (`functional.dispatch.xla_in_graph`). Eagerly, and on the other
    backends, `fn()` as is.
    """
    if not _fast_tensorflow(implementation):
        return fn()
    return xla_in_graph(fn)


def zeros_like(x, dtype, implementation="auto"):
    """Zeros of `x`'s shape in `dtype`: a pass's gradient buffer.

    On TensorFlow with `implementation="auto"`, in a graph, they are
    `tf.raw_ops.ZerosLike` of `x`, an op on an input that XLA turns into a
    broadcast of 0. `keras.ops.zeros` of a static shape is a constant
    subgraph, and TensorFlow's XLA bridge folds constant subgraphs: it
    evaluates a `[d, V]` zero kernel gradient while it compiles, and inside
    a nested pass (`run_pass`) under a caller's own `jit_compile=True` the
    process kept that memory (`docs/results/relayout_ab/run3`). Elsewhere,
    `keras.ops.zeros`.
    """
    if _fast_tensorflow(implementation):
        import tensorflow as tf

        if not tf.executing_eagerly():
            return ops.cast(tf.raw_ops.ZerosLike(x=x), dtype)
    return ops.zeros(ops.shape(x), dtype)


def low_precision_matmul(*tensors):
    """For bfloat16 / float16 inputs on JAX: `(a, b) -> a @ b` taking both in
    the inputs' dtype and returning the exact float32 products
    (`preferred_element_type`: the GPU's low-precision matrix units,
    accumulated in float32, no rounding of the result). None elsewhere, and
    for bfloat16 on a CPU: the tiles are then upcast to float32 before their
    products (`tile_reader`)."""
    low = {keras.backend.standardize_dtype(t.dtype) for t in tensors if t is not None}
    if keras.backend.backend() != "jax" or len(low) != 1 or low - {"bfloat16", "float16"}:
        return None
    if low == {"bfloat16"} and current_platform() == "cpu":
        return None  # no bfloat16 units: tiles widened on their own (tile_reader)
    import jax.numpy as jnp

    (dtype,) = low

    def matmul(a, b):
        return jnp.matmul(
            ops.cast(a, dtype), ops.cast(b, dtype), preferred_element_type=jnp.float32
        )

    return matmul


def _bfloat16_bits(dtype, implementation):
    """Whether a bfloat16 kernel is handled as its bits: on TensorFlow, and
    on JAX on a CPU, with `implementation="auto"`."""
    if keras.backend.standardize_dtype(dtype) != "bfloat16" or implementation != "auto":
        return False
    backend = keras.backend.backend()
    return backend == "tensorflow" or (backend == "jax" and current_platform() == "cpu")


def _bitcast(x, dtype):
    """`x`'s bits as `dtype` (of the same width): `tf.bitcast`,
    `jax.lax.bitcast_convert_type`."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.bitcast(x, dtype)
    import jax

    return jax.lax.bitcast_convert_type(x, dtype)


def tile_reader(kernel, acc, implementation="auto"):
    """`read(begin, size)`: the tile `kernel[begin : begin + size]` (a
    static `size` per axis) in the accumulation dtype `acc`.

    A bfloat16 kernel on TensorFlow, or on JAX on a CPU, with
    `implementation="auto"`, is sliced as its `uint16` bits and widened to
    float32 by a 16-bit shift (exact: bfloat16 is the top half of a
    float32). XLA's CPU compiler would otherwise widen the whole kernel
    before slicing it and hoist that out of the tile loop: a float32 copy
    of the kernel alive through each pass (`docs/chunked.md`). Elsewhere:
    `keras.ops.slice` then `keras.ops.cast`.
    """
    if not (acc == "float32" and _bfloat16_bits(kernel.dtype, implementation)):
        return lambda begin, size: ops.cast(ops.slice(kernel, begin, size), acc)
    bits = _bitcast(ops.convert_to_tensor(kernel), "uint16")

    def read(begin, size):
        tile = ops.cast(ops.slice(bits, begin, size), "uint32")
        return _bitcast(ops.left_shift(tile, 16), "float32")

    return read


def gradient_writer(kernel, implementation="auto"):
    """`(buffer, write, finish)`: the gradient of `kernel` written tile by
    tile (the kernel's; in the blocked backward also `h`'s, block by block).

    `buffer` is the zero gradient (`zeros_like`), `write(buffer, begin, tile)` writes a
    float32 tile into it (rounded once to `dtype`), `finish(buffer)` is the
    gradient in `dtype`. A bfloat16 gradient on TensorFlow, or on JAX on a
    CPU, with `implementation="auto"`, is kept as its `uint16` bits: XLA's
    CPU compiler would otherwise widen the whole buffer to float32 and back
    at each tile's write. Elsewhere: `keras.ops.slice_update` on a `dtype`
    buffer.
    """
    dtype = kernel.dtype
    if not _bfloat16_bits(dtype, implementation):
        def write(buffer, begin, tile):
            return update_slice(buffer, begin, ops.cast(tile, dtype))

        return zeros_like(kernel, dtype, implementation), write, lambda buffer: buffer

    def write_bits(buffer, begin, tile):
        return ops.slice_update(buffer, begin, _bitcast(ops.cast(tile, "bfloat16"), "uint16"))

    return (zeros_like(kernel, "uint16", implementation), write_bits,
            lambda buffer: _bitcast(buffer, "bfloat16"))


def matmul_fn(dtype):
    """`ops.matmul`, or for float64 an `ops.einsum` (Keras' PyTorch `matmul`
    computes float64 products in float32)."""
    if dtype == "float64":
        return lambda a, b: ops.einsum("ij,jk->ik", a, b)
    return ops.matmul
