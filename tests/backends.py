"""Backend-neutral test helpers: gradients and compilation on every backend.

The tests of the heads run under whichever Keras backend `KERAS_BACKEND`
selects (TensorFlow, JAX or PyTorch). The few things `keras.ops` has no
public function for are dispatched here, once, on `keras.backend.backend()`:

* `value_and_grad(fn, inputs, variables)`: the gradient of a scalar
  `fn(*inputs)` with respect to the input tensors and Keras variables
  (`tf.GradientTape`; `jax.value_and_grad` over a `keras.StatelessScope`,
  under `jax.jit`; `torch.autograd.grad`);
* `jit(fn)`: `fn` compiled with XLA (`tf.function(jit_compile=True,
  autograph=False)`, `jax.jit`) or, on PyTorch, `fn` itself (PyTorch has no XLA here);
* `to_numpy(x)`;
* `PALLAS`: whether the Pallas kernels run (JAX with Pallas' Triton backend);
* `lower_for(jitted, args, platform)`: a jitted JAX function lowered for another
  platform (`"cuda"`, `"tpu"`) without that device;
* `sparse_gradient_rows(fn, x, variable)` (TensorFlow only): the rows of
  `variable`'s gradient, asserting it is a `tf.IndexedSlices`;
* `build_optimizer(model)`: a compiled, built model's optimizer built before
  `fit`, so that TensorFlow traces the train step once;
* `torch_flops(fn)` (PyTorch only): the matrix-product FLOPs of `fn()`;
* `run_on_simulated_devices(script, devices, *args)`: a test module run as a
  JAX child process on simulated host devices (the vocabulary-parallel
  tests), its JSON result; `count_calls(module, name, calls)`: a module
  function that records its (traced) calls; `vocabulary_sharding(mesh,
  transposed)`: a `keras.distribution` that splits a kernel on V.
"""

import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np

BACKEND = keras.backend.backend()


def _pallas():
    from keras_softmax_heads.platforms import has_pallas_triton

    return BACKEND == "jax" and has_pallas_triton()


#: The library's Pallas kernels run here: JAX with Pallas' Triton backend
#: (deprecated in JAX 0.11; where it is gone the tests of the kernels skip
#: and `test_accelerator_lowering` checks the XLA fallback).
PALLAS = _pallas()


def to_numpy(x):
    """A NumPy array of a backend tensor, variable or sparse gradient."""
    if x is None:
        return None
    if isinstance(x, keras.Variable):
        x = x.value
    if BACKEND == "tensorflow":
        import tensorflow as tf

        if isinstance(x, tf.IndexedSlices):
            x = tf.convert_to_tensor(x)
    return keras.ops.convert_to_numpy(x)


def build_optimizer(model):
    """Builds the optimizer of a compiled, built `model` for its trainable
    variables (once). Keras on TensorFlow otherwise creates the optimizer's
    variables in the first trace of the train step and then traces the step
    again; built first, `fit` traces it once (a third less time for a small
    fit). The battery's mixed-precision and `jit_compile` fits keep Keras'
    own lazy build."""
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def sparse_gradient_rows(fn, x, variable):
    """TensorFlow: the set of rows of `variable`'s gradient of scalar `fn(x)`,
    after asserting that the gradient is a `tf.IndexedSlices` (a row gather's
    sparse gradient, never a dense `[V, d]` tensor)."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = fn(tf.constant(x))
    grad = tape.gradient(loss, variable.value)
    assert isinstance(grad, tf.IndexedSlices), "the gradient should be sparse"
    return set(grad.indices.numpy())


def value_and_grad(fn, inputs=(), variables=()):
    """`(value, input_grads, variable_grads)` of a scalar `fn(*inputs)`.

    `inputs` are array-likes (converted to tensors of their dtype) and
    `variables` Keras variables `fn` reads. Gradients come back as NumPy
    arrays, in order; a gradient that does not exist is `None`. On JAX the
    value and gradients are computed under `jax.jit` (`fn` is traced either
    way: `jax.value_and_grad` sees tracers); eager JAX forward passes are
    the other tests' (`head(h)`, `log_likelihood`).
    """
    inputs = [keras.ops.convert_to_tensor(x) for x in inputs]
    variables = list(variables)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(inputs)
            value = fn(*inputs)
        grads = tape.gradient(value, inputs + variables)
    elif BACKEND == "jax":
        import jax

        def pure(input_values, variable_values):
            mapping = list(zip(variables, variable_values))
            with keras.StatelessScope(state_mapping=mapping):
                return fn(*input_values)

        # Under `jax.jit`, as JAX trains (Keras' JAX trainer compiles its
        # steps): one compilation, where eager JAX compiles every operation.
        step = jax.jit(jax.value_and_grad(pure, argnums=(0, 1)))
        value, (gi, gv) = step(inputs, [v.value for v in variables])
        grads = list(gi) + list(gv)
    elif BACKEND == "torch":
        import torch

        inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
        value = fn(*inputs)
        grads = torch.autograd.grad(
            value, inputs + [v.value for v in variables], allow_unused=True
        )
    else:
        raise NotImplementedError(f"Unsupported backend: {BACKEND}")
    grads = [to_numpy(g) for g in grads]
    return float(to_numpy(value)), grads[: len(inputs)], grads[len(inputs):]


def jit(fn):
    """`fn` compiled with XLA where the backend has it (TF, JAX)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True, autograph=False)
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    return fn


def is_target_error(exc):
    """Whether `exc` is the error a head raises for out-of-range targets
    (a `ValueError` eagerly; TensorFlow's `InvalidArgumentError` from a
    graph-mode check)."""
    if isinstance(exc, ValueError):
        return True
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return isinstance(exc, tf.errors.InvalidArgumentError)
    return False


def lower_for(jitted, args, platform):
    """`jitted.trace(*args).lower(lowering_platforms=(platform,))` (JAX) on
    a machine without that device. For `"cuda"` traced and lowered inside an
    abstract mesh whose device is an H100: from JAX 0.11 Pallas' Triton
    lowering asks for the GPU's kind (a real GPU, or the trace's abstract
    device) to pick its target."""
    if platform != "cuda":
        return jitted.trace(*args).lower(lowering_platforms=(platform,))
    import jax

    device = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), (jax.sharding.AxisType.Auto,),
                                     abstract_device=device)  # no sharding in types
    with jax.sharding.use_abstract_mesh(mesh):
        return jitted.trace(*args).lower(lowering_platforms=("cuda",))


def torch_flops(fn):
    """The FLOPs PyTorch's `FlopCounterMode` counts (matrix products) while
    `fn()` runs, e.g. a loss and its `backward()`."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


RENDEZVOUS_ATTEMPTS = 3
"""Runs of a simulated-devices child that XLA's CPU collectives ended (40 s
rendezvous timeout; the 2 x 2 model-parallel PLIF test's child, on 2
cores). The cause, `predict` running ahead, is fixed
(`training/evaluation._step_by_step`, docs/results/simulated_devices_deadlock/);
a run that still ends so is run again, with a warning; any other failure
is not."""


def run_on_simulated_devices(script, devices, *args, timeout=600):
    """Runs `script` (a path: a test module whose `__main__` prints one JSON
    line last) with `args` in a child process on JAX with `devices`
    simulated host devices (`XLA_FLAGS` must be set before JAX starts),
    the repository on its path; asserts it succeeded and returns that
    JSON (up to `RENDEZVOUS_ATTEMPTS` runs when XLA's collectives end it)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env.update(KERAS_BACKEND="jax",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p]))
    for _ in range(RENDEZVOUS_ATTEMPTS):
        out = subprocess.run([sys.executable, os.path.abspath(script), *map(str, args)],
                             env=env, capture_output=True, text=True, timeout=timeout)
        if out.returncode == 0 or "Termination timeout for `all reduce" not in out.stderr:
            break
        warnings.warn(f"{os.path.basename(script)} {' '.join(map(str, args))}: XLA's CPU "
                      "collectives ended the child (rendezvous timeout); running it again")
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def count_calls(module, name, calls, key=None):
    """Replaces `module.name` by a wrapper that appends `key` (default
    `name`) to the list `calls` at each call (under `jit`: each trace)."""
    fn = getattr(module, name)

    def call(*args, **kwargs):
        calls.append(key or name)
        return fn(*args, **kwargs)

    setattr(module, name, call)


def vocabulary_sharding(mesh, transposed, path="kernel"):
    """A `keras.distribution.ModelParallel` over `mesh` (axes `"batch"`,
    `"model"`) whose layout splits the variable at `path` (a regex of its
    whole path) on its vocabulary axis over `"model"`: the first of a
    `[V, d]` (`transposed`) matrix, the second of a `[d, V]` one."""
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[path] = ("model", None) if transposed else (None, "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def log_likelihood_on_shards(head, h, y, u, distribution, calls, compiled="evaluation"):
    """A head's `log_likelihood(h, y)` and the gradients of `sum(u * ll)`
    with respect to `h` and its trainable weights (JAX), traced under
    `distribution` (each device its vocabulary shard where the head has
    such a path) and traced again without one.

    Returns a dict: `value_err` and `grad_err` (the inputs', then each
    weight's: largest difference relative to the largest entry),
    `num_weights`, `calls` (what was appended to the list `calls`,
    `count_calls`, while tracing under the distribution), `grads` (the
    sharded weights' gradients) and `compiled`: the evaluation (`"evaluation"`)
    or the gradient step (`"step"`) compiled under the distribution."""
    import jax

    weights = head.trainable_weights

    def loss(h, values):
        with keras.StatelessScope(state_mapping=list(zip(weights, values))):
            ll = head.log_likelihood(h, y)
        return jax.numpy.sum(ll * u), ll

    def step():  # a new function, traced anew (jit caches by function)
        return jax.jit(jax.value_and_grad(lambda h, v: loss(h, v), argnums=(0, 1),
                                          has_aux=True))

    values = [w.value for w in weights]
    before = len(calls)
    with distribution.scope():  # traced under the distribution
        (_, ll_sharded), grads_sharded = step()(h, values)
        program = (step() if compiled == "step"
                   else jax.jit(lambda h, values: loss(h, values)[1]))
        program = program.lower(h, values).compile()
    traced = calls[before:]
    (_, ll_single), grads_single = step()(h, values)  # traced without one
    flat = lambda g: [np.asarray(g[0])] + [np.asarray(x) for x in g[1]]
    return {
        "value_err": float(np.abs(np.asarray(ll_sharded) - np.asarray(ll_single)).max()
                           / np.abs(np.asarray(ll_single)).max()),
        "grad_err": [float(np.abs(x - z).max() / max(np.abs(z).max(), 1e-12))
                     for x, z in zip(flat(grads_sharded), flat(grads_single))],
        "num_weights": len(weights),
        "calls": traced,
        "grads": grads_sharded[1],
        "compiled": program,
    }
