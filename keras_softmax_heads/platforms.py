"""Where the computation runs: `current_platform` (CPU, GPU or TPU), the one
query every platform-dependent choice of the library makes.

The choices that read it: the chunked losses' tile width
(`chunked.platform.chunk_size_for`), PLIF's slope histogram
(`functional.dispatch.histogram_method`), the fused loss's Pallas kernel
(`fused.pallas_cross_entropy.uses_kernel`) and whether the evaluation's
`predict` waits for each step (`training.evaluation._step_by_step`: on JAX's
host CPU devices). Tests and studies force a
platform with `forced_platform`. Those GPU kernels are written for Pallas'
Triton backend; `has_pallas_triton` says whether the installed JAX has it
(JAX 0.11 deprecated it), and without it the GPU takes the XLA paths.
Design notes: `docs/backends.md`.
"""

import contextlib
import functools

import keras

from keras_softmax_heads.validation import check_choice

#: The platforms `current_platform` reports.
PLATFORMS = ("cpu", "gpu", "tpu")

FORCED = []  # the stack of `forced_platform` scopes


@contextlib.contextmanager
def forced_platform(platform):
    """Within the scope `current_platform()` is `platform` (tests, studies).

    >>> with forced_platform("gpu"):
    ...     current_platform()
    'gpu'
    """
    FORCED.append(check_choice("platform", platform, PLATFORMS))
    try:
        yield
    finally:
        FORCED.pop()


def current_platform(tensor=None):
    """`"cpu"`, `"gpu"` or `"tpu"`: where the backend runs the computation.

    JAX: `jax.default_backend()` (where `jax.jit` places it); TensorFlow: a
    visible TPU or GPU (TensorFlow places ops on it); PyTorch: the device
    of `tensor`, or without one a GPU when CUDA is available (Keras puts its
    tensors there). A `forced_platform` scope overrides it.

    >>> current_platform() in PLATFORMS
    True
    """
    if FORCED:
        return FORCED[-1]
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        name = jax.default_backend()
        if name in ("gpu", "cuda", "rocm"):
            return "gpu"
        return "tpu" if name == "tpu" else "cpu"
    if backend == "tensorflow":
        import tensorflow as tf

        for platform, kind in (("tpu", "TPU"), ("gpu", "GPU")):
            if tf.config.list_logical_devices(kind):
                return platform
        return "cpu"
    if backend == "torch":
        device = getattr(tensor, "device", None)
        if device is None:
            import torch

            return "gpu" if torch.cuda.is_available() else "cpu"
        return "gpu" if device.type in ("cuda", "xpu", "mps") else "cpu"
    return "cpu"


@functools.cache
def has_pallas_triton():
    """Whether the installed JAX has Pallas' Triton backend
    (`jax.experimental.pallas.triton` with `CompilerParams` and
    `atomic_add`), in which the library's GPU kernels are written.

    JAX 0.11 deprecated that backend for removal in a later version. Where
    it is missing, the JAX GPU defaults take the XLA paths (PLIF's
    `"scatter"` histogram, the fused loss's tiled `keras.ops` loop) and
    asking for a kernel by name raises `require_pallas_triton`'s error.
    """
    try:
        from jax.experimental.pallas import triton
    except ImportError:
        return False
    return all(hasattr(triton, name) for name in ("CompilerParams", "atomic_add"))


def require_pallas_triton(name, value, instead):
    """Raises a `ValueError` where `has_pallas_triton()` is false: the
    option `name=value` asked for a Pallas kernel; `instead` names the
    choices that need none."""
    if not has_pallas_triton():
        import jax

        raise ValueError(
            f"`{name}={value!r}` needs Pallas' Triton backend "
            f"(`jax.experimental.pallas.triton`), which JAX {jax.__version__} "
            f"does not have; {instead} need no kernel. Received: {name}={value!r}"
        )
