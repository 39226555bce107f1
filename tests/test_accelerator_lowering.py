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
from backends import PALLAS
from backends import lower_for

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
    expected = {"plif", "monotonic"} if PALLAS else set()
    assert lowered_kernels("gpu", monkeypatch) == expected


def test_adaptive_softmax_with_chunk_size_lowers(monkeypatch):
    """`AdaptiveSoftmax(chunk_size=...)`: the tiled clusters inside the
    static tails' blocks lower with static shapes for a TPU and a GPU."""
    for platform in ("tpu", "gpu"):
        assert lowered_kernels(platform, monkeypatch, ["adaptive"], chunk_size=128) == set()


def test_without_pallas_triton_the_gpu_takes_the_xla_paths(monkeypatch):
    """Where JAX has no Pallas Triton backend (deprecated in JAX 0.11 for
    removal), the GPU defaults need no kernel: PLIF's and MonotonicSoftmax's
    steps lower without one, and the fused loss's `"auto"` is the tiled
    pass; asking for a kernel by name is a clear error, not an
    `ImportError` from inside JAX."""
    import jax
    import jax.numpy as jnp

    import keras_softmax_heads as ksh
    from keras_softmax_heads import functional
    from keras_softmax_heads import platforms
    from keras_softmax_heads.functional import dispatch
    from keras_softmax_heads.fused import pallas_cross_entropy

    monkeypatch.setattr(platforms, "has_pallas_triton", lambda: False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    h = jnp.ones((4, 8), "float32")
    with forced_platform("gpu"):
        assert dispatch.histogram_method() == "scatter"
        assert not pallas_cross_entropy.uses_kernel(h, h, "auto")
        idx, w = jnp.zeros((3,), "int32"), jnp.ones((3,), "float32")
        for method in ("pallas", "pallas_fused"):
            with pytest.raises(ValueError, match=rf"Triton backend.*Received: method='{method}'"):
                functional.knot_histogram(idx, (w,), 4, method=method)
        with pytest.raises(ValueError, match=r"Triton backend.*implementation='pallas'"):
            ksh.linear_cross_entropy(h, h.T, jnp.zeros((4,), "int32"), implementation="pallas")
        with dispatch.forced_histogram_method("pallas_fused"):
            z = jnp.ones((2, 5), "float32")
            with pytest.raises(ValueError, match="HISTOGRAM_METHOD='pallas_fused'"):
                jax.grad(lambda z: jnp.sum(functional.plif_log_likelihood(
                    z, jnp.zeros((6,)), 2.0, jnp.zeros((2,), "int32"))))(z)
    assert lowered_kernels("gpu", monkeypatch, names=("plif", "monotonic")) == set()


def lowered_kernels(platform, monkeypatch, names=HEADS, **options):
    """Lowers the step of every registry head in `names` (the device
    table's, `bench_device_heads.train_step`; `options` for `make_head`) for
    `platform` with static shapes (asserting no dynamic dimension); returns
    the heads whose step holds a Triton (Pallas) kernel."""
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
        for name in names:
            head = make_head(name, vocab, counts=counts, **options)
            head.build((None, d))
            weights = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in head.trainable_variables]
            text = lower_for(train_step(head), (weights, h, y), target).as_text()
            assert "tensor<?" not in text, f"{name}: a dynamic shape on the {platform}"
            if "xla.gpu.triton" in text:
                kernels.add(name)
    return kernels
