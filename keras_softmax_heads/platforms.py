"""Where the computation runs: `current_platform` (CPU, GPU or TPU), the one
query every platform-dependent choice of the library makes.

The choices that read it: the chunked losses' tile width
(`chunked.platform.chunk_size_for`), PLIF's slope histogram
(`functional.dispatch.histogram_method`) and the fused loss's Pallas kernel
(`fused.pallas_cross_entropy.uses_kernel`). Tests and studies force a
platform with `forced_platform`. Design notes: `docs/backends.md`.
"""

import contextlib

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
