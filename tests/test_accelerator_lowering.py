"""Every head's training step as an accelerator would compile it (JAX).

The design card promises every head on a TPU, under XLA with static shapes,
and issue 28 asks that nothing on the default path needs a data-dependent
shape. Without a TPU or GPU, JAX still lowers a program for one: each
registry head's jitted loss and gradients, its platform forced (the
accelerators' tile widths, PLIF's sorted histogram on a TPU, the Pallas
kernel through Triton on a GPU), lowered with `lowering_platforms` to
StableHLO for that platform. Nothing is compiled or run."""

import numpy as np
import pytest
from backends import BACKEND

from keras_softmax_heads.heads.registry import HEADS
from keras_softmax_heads.heads.registry import make_head
from keras_softmax_heads.platforms import forced_platform

pytestmark = [
    pytest.mark.multibackend,
    pytest.mark.skipif(BACKEND != "jax", reason="lowering for another platform is JAX's"),
]


def train_step(head):
    """`jax.jit` of `(weights, h, y) -> (mean training loss, gradients)`."""
    import jax
    import keras

    variables = head.trainable_variables
    fixed = [(v, v.value) for v in head.non_trainable_variables]

    def loss(values, h, y):
        with keras.StatelessScope(state_mapping=list(zip(variables, values)) + fixed):
            return keras.ops.mean(head.training_loss(h, y, training=True))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def test_every_head_lowers_for_a_tpu():
    assert lowered_kernels("tpu") == set()


def test_every_head_lowers_for_a_gpu(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # kernels not interpreted
    # The slope histogram's Pallas kernel (PLIF, MonotonicSoftmax's grid).
    assert lowered_kernels("gpu") == {"plif", "monotonic"}


def lowered_kernels(platform):
    """Lowers every registry head's step for `platform` with static shapes
    (asserting no dynamic dimension); returns the heads whose step holds a
    Triton (Pallas) kernel."""
    import jax

    target = {"gpu": "cuda", "tpu": "tpu"}[platform]
    n, d, vocab = 256, 32, 1000
    counts = (1e5 / np.arange(1, vocab + 1)).astype("int64")  # Zipf
    h = jax.ShapeDtypeStruct((n, d), "float32")
    y = jax.ShapeDtypeStruct((n,), "int32")
    kernels = set()
    with forced_platform(platform):
        for name in HEADS:
            head = make_head(name, vocab, counts=counts)
            head.build((None, d))
            weights = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in head.trainable_variables]
            text = train_step(head).trace(weights, h, y).lower(
                lowering_platforms=(target,)).as_text()
            assert "tensor<?" not in text, f"{name}: a dynamic shape on the {platform}"
            if "xla.gpu.triton" in text:
                kernels.add(name)
    return kernels
