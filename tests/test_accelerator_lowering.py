"""Every head's training step as an accelerator would compile it (JAX).

The design card promises every head on a TPU, under XLA with static shapes,
and issue 28 asks that nothing on the default path needs a data-dependent
shape. Without a TPU or GPU, JAX still lowers a program for one: each
registry head's jitted loss and gradients, its platform forced (the
accelerators' tile widths, PLIF's sorted histogram on a TPU, the Pallas
kernel through Triton on a GPU), lowered with `lowering_platforms` to
StableHLO for that platform. Nothing is compiled or run."""

import os

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


BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_every_head_lowers_for_a_tpu(monkeypatch):
    assert lowered_kernels("tpu", monkeypatch) == set()


def test_every_head_lowers_for_a_gpu(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # kernels not interpreted
    # The slope histogram's Pallas kernel (PLIF, MonotonicSoftmax's grid).
    assert lowered_kernels("gpu", monkeypatch) == {"plif", "monotonic"}


def lowered_kernels(platform, monkeypatch):
    """Lowers every registry head's step (the device table's,
    `bench_device_heads.train_step`) for `platform` with static shapes
    (asserting no dynamic dimension); returns the heads whose step holds a
    Triton (Pallas) kernel."""
    import jax

    monkeypatch.syspath_prepend(BENCH)
    from bench_device_heads import train_step

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
