"""Helpers of the multi-backend head tests (on top of `backends`).

* `jit_with_state(layer, fn)`: compile a function that advances a layer's
  random state;
* the `float64` fixture and `RTOL64`, for float64 checks on every backend;
* `slow_on(*backends)`, `slow` in those backends' runs only, and
  `slow_off_tensorflow` (`slow_on("jax", "torch")`) for long tests run by
  default on TensorFlow only;
* `sweep(values, keep)`, a parametrisation whose other values run under `-m slow`.

`backends.jit` compiles a pure function. A head that samples (sampled
softmax, NCE, self-normalisation) draws with `keras.random` and its
`SeedGenerator`, whose state is a variable of the layer that every draw
advances. TensorFlow's `tf.function` and eager PyTorch update it in place;
under `jax.jit` an assignment would leak a tracer, so on JAX the layer's
variables are passed in and out through a `keras.StatelessScope` (what
Keras' own JAX trainer does) and written back after the call.
"""

import contextlib

import keras
import pytest
from backends import BACKEND
from backends import jit

# Keras' type promotion maps float64 to float32 except on TensorFlow, so on
# JAX and PyTorch some `keras.ops` (`matmul` on PyTorch, `tanh`, ...) return
# float32 for float64 inputs: float64 comparisons there hold to float32
# rounding only, and finite differences need a float32-sized step.
RTOL64 = 1e-10 if BACKEND == "tensorflow" else 1e-5


def sweep(values, keep):
    """`values` for `pytest.mark.parametrize`, those not in `keep` marked
    `slow`: the default run takes the representative values (each code path
    once), `-m slow` the rest of the sweep. The first value is kept (off
    TensorFlow, conftest runs a test's first parametrisation by default).
    A tuple value is one parametrisation of several arguments."""
    values = list(values)
    if values[0] not in keep or any(k not in values for k in keep):
        raise ValueError(f"keep must hold the first value and only values; "
                         f"Received: keep={keep!r}, values={values!r}")

    def param(value):
        args = value if isinstance(value, tuple) else (value,)
        return pytest.param(*args, marks=() if value in keep else pytest.mark.slow)
    return [param(v) for v in values]


def slow_on(*backends):
    """`slow` in these backends' runs only: a test whose logic holds on every
    backend, long in those runs, whose backend-specific paths other tests
    there cover by default; the other runs check it by default."""
    if BACKEND in backends:
        return pytest.mark.slow
    return pytest.mark.skipif(False, reason=f"slow on {', '.join(backends)} only")


#: `slow` off TensorFlow: in TensorFlow's default run, and on JAX and
#: PyTorch under `-m slow` (a test whose other backends' runs are long and
#: whose logic is backend-neutral; keeps the three backends in the time budget).
slow_off_tensorflow = slow_on("jax", "torch")


# `assert_directional_gradients` keywords for float64 objectives.
FD64 = (
    dict(eps=1e-6, rtol=1e-6, atol=1e-7)
    if BACKEND == "tensorflow"
    else dict(eps=1e-3, rtol=2e-2, atol=2e-2)
)


@contextlib.contextmanager
def float64_enabled():
    """float64 arrays on JAX (off by default there); a no-op elsewhere."""
    if BACKEND == "jax":
        import jax

        with jax.enable_x64(True):
            yield
    else:
        yield


@pytest.fixture
def float64():
    """float64 layers on every backend (JAX: 64-bit types enabled)."""
    keras.config.set_dtype_policy("float64")
    with float64_enabled():
        yield


def jit_with_state(layer, fn):
    """`fn(*args)` compiled with XLA (TF, JAX; PyTorch: as is); the state
    `fn` assigns to `layer`'s variables (seed states) is kept."""
    if BACKEND != "jax":
        return jit(fn)
    import jax

    variables = list(layer.variables)

    def pure(values, *args):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope:
            out = fn(*args)
            new = [scope.get_current_value(v) for v in variables]
        return out, [old if n is None else n for old, n in zip(values, new)]

    compiled = jax.jit(pure)

    def run(*args):
        out, new = compiled([v.value for v in variables], *args)
        for variable, value in zip(variables, new):
            variable.assign(value)
        return out

    return run
