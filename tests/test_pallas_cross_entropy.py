"""The Pallas kernel of the fused loss (`fused.pallas_cross_entropy`) in
Pallas' interpret mode on the CPU, against today's tiled pass through the
same public function (`linear_cross_entropy(..., implementation="pallas")`),
and its dispatch. JAX only: the module skips on the other backends and
where JAX lacks Pallas' Triton backend (`test_accelerator_lowering` checks
the fallback there)."""

import os

import numpy as np
import pytest
from backends import PALLAS
from backends import lower_for

pytestmark = [
    pytest.mark.multibackend,
    pytest.mark.skipif(not PALLAS, reason="The Pallas kernel is JAX's (Triton backend)."),
]

from keras_softmax_heads.platforms import forced_platform
from keras_softmax_heads.fused import linear_cross_entropy  # noqa: E402
from keras_softmax_heads.fused import pallas_cross_entropy  # noqa: E402

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

# Small shapes that are not multiples of the blocks (padding on every axis).
N, D, V = 13, 20, 75
BLOCKS = (16, 32, 16)


def inputs(dtype="float32", transposed=True, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(N, D)).astype("float32")
    w = (rng.normal(size=(V, D)) / 2).astype("float32")
    b = rng.normal(size=(V,)).astype("float32")
    y = rng.integers(0, V, size=N).astype("int32")
    y[::5] = -100
    weights = rng.uniform(0.5, 2.0, size=N).astype("float32")
    import jax.numpy as jnp

    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(h), cast(w if transposed else w.T), cast(b), y, weights


def loss_and_grads(implementation, h, w, b, y, options, filter_eps=None, jit=True):
    import jax

    def loss(h, w, b):
        out = linear_cross_entropy(
            h, w, y, b, ignore_index=-100, implementation=implementation,
            filter_eps=filter_eps, chunk_size=32, **options,
        )
        return jax.numpy.sum(out) if options.get("reduction") == "none" else out

    fn = jax.value_and_grad(loss, argnums=(0, 1) if b is None else (0, 1, 2))
    if jit:
        fn = jax.jit(fn)
    return fn(h, w, b)


def close(a, b, rtol, atol):
    np.testing.assert_allclose(
        np.asarray(a, "float32"), np.asarray(b, "float32"), rtol=rtol, atol=atol
    )


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(pallas_cross_entropy, "GPU_BLOCKS", BLOCKS)


def check_against_tiled_pass(dtype, transposed, bias, options):
    h, w, b, y, weights = inputs(dtype, transposed)
    options = dict(options, kernel_transposed=transposed)
    if options.pop("sample_weight", False):
        options["sample_weight"] = weights
    b = b if bias else None
    loss_k, grads_k = loss_and_grads("pallas", h, w, b, y, options)
    loss_x, grads_x = loss_and_grads("auto", h, w, b, y, options)
    tol = 1e-5 if dtype == "float32" else 2e-2
    close(loss_k, loss_x, tol, tol)
    for gk, gx in zip(grads_k, grads_x):
        assert gk.dtype == gx.dtype
        close(gk, gx, tol, tol * float(np.max(np.abs(np.asarray(gx, "float32")))))


# Not parametrised (on JAX a parametrised test runs its first case by
# default): every combination is the slow test below.
def test_kernel_matches_tiled_pass_float32():
    check_against_tiled_pass("float32", True, True, dict(
        label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=4.0, reduction="mean"))


def test_kernel_matches_tiled_pass_bfloat16():
    check_against_tiled_pass("bfloat16", False, False, dict(
        reduction="none", sample_weight=True))


def test_stats_and_argmax_match_numpy():
    h, w, b, y, _ = inputs()
    y = np.where(y < 0, 0, y)
    import jax

    stats = jax.jit(lambda h, w, b, y: pallas_cross_entropy.pallas_pointwise_stats(
        h, w, b, y, kernel_transposed=True))
    nll, lse, total, arg = stats(h, w, b, y)
    z = np.asarray(h) @ np.asarray(w).T + np.asarray(b)
    ref_lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    close(lse, ref_lse, 1e-5, 1e-5)
    close(nll, ref_lse - z[np.arange(N), y], 1e-5, 1e-5)
    close(total, z.sum(1), 1e-5, 1e-4)
    np.testing.assert_array_equal(np.asarray(arg), z.argmax(1))
    assert arg.dtype == "int32"


def test_atomic_backward_is_exact():
    """The fused `"atomic"` backward (the one that filters) without
    `filter_eps` equals the default `"gemm"` one: `[d, V]`, a bias, the
    soft cap, all three cotangents."""
    import jax
    import jax.numpy as jnp

    from keras_softmax_heads.functional import soft_cap

    h, w, b, y, weights = inputs(transposed=False)
    y = np.where(y < 0, 0, y)
    u = jnp.asarray(np.stack([weights, weights[::-1], weights * 0.1]))

    def objective(h, w, b, backward):
        out = pallas_cross_entropy.pallas_pointwise_stats(
            h, w, b, y, transform_fn=lambda z: soft_cap(z, 3.0), backward=backward)
        return sum(jnp.sum(x * c) for x, c in zip(out[:3], u))

    grad = jax.jit(jax.grad(objective, argnums=(0, 1, 2)), static_argnums=3)
    for atomic, gemm in zip(grad(h, w, b, "atomic"), grad(h, w, b, "gemm")):
        close(atomic, gemm, 1e-5, 1e-5)
    with pytest.raises(ValueError, match="atomic"):
        pallas_cross_entropy.pallas_pointwise_stats(h, w, b, y, backward="gemm",
                                                    filter_eps=1e-3)


def test_filter_eps_drops_at_most_the_filtered_mass():
    import jax.numpy as jnp

    h, w, b, y, _ = inputs()
    h = h * 6.0  # peaked softmax: most blocks are far below the threshold
    options = dict(kernel_transposed=True, reduction="sum")
    # filter_eps=None (exact): the other tests.
    _, exact = loss_and_grads("auto", h, w, None, y, options)
    eps = 1e-3
    loss_f, filtered = loss_and_grads("pallas", h, w, None, y, options, filter_eps=eps)
    # Dropped: entries (u softmax) below eps each (u = 1 here), per gradient
    # element at most eps * (words) * max |other factor|.
    bound_h = eps * V * float(jnp.max(jnp.abs(w)))
    bound_w = eps * N * float(jnp.max(jnp.abs(h)))
    diff_h = float(jnp.max(jnp.abs(filtered[0] - exact[0])))
    diff_w = float(jnp.max(jnp.abs(filtered[1] - exact[1])))
    assert diff_h <= bound_h and diff_w <= bound_w
    assert diff_h > 0 or diff_w > 0  # something was skipped
    with pytest.raises(ValueError, match="filter_eps"):
        linear_cross_entropy(h, w, y, kernel_transposed=True, filter_eps=1.5)


def test_kernels_lower_to_triton():
    """Forward and both backwards lowered for CUDA from the CPU (JAX's
    cross-platform lowering; no GPU, nothing compiled by Triton): the Pallas
    -> Triton IR lowering of the kernels, at GPU block sizes."""
    import jax

    from keras_softmax_heads.functional import soft_cap

    n, d, v = 256, 192, 1000
    for dtype, transposed, bias, cap, eps in [
        ("bfloat16", True, False, 30.0, None),  # the "gemm" backward
        ("float32", False, True, None, 1e-4),  # the "atomic" one, filtering
    ]:
        h = jax.ShapeDtypeStruct((n, d), dtype)
        w = jax.ShapeDtypeStruct((v, d) if transposed else (d, v), dtype)
        b = jax.ShapeDtypeStruct((v,), dtype) if bias else None
        t = jax.ShapeDtypeStruct((n,), "int32")
        transform = None if cap is None else (lambda z, cap=cap: soft_cap(z, cap))

        def objective(h, w, b, t, transposed=transposed, transform=transform, eps=eps):
            nll, lse, total, _ = pallas_cross_entropy.pallas_pointwise_stats(
                h, w, b, t, transform_fn=transform, kernel_transposed=transposed,
                filter_eps=eps, blocks=(64, 128, 64), interpret=False)
            return nll.sum() + 0.1 * lse.sum() + 0.01 * total.sum()

        grad = jax.grad(objective, argnums=(0, 1, 2) if bias else (0, 1))
        try:
            lowered = lower_for(jax.jit(grad), (h, w, b, t), "cuda")
        except (ImportError, NotImplementedError) as err:  # a jaxlib without Triton
            pytest.skip(f"no Pallas Triton lowering here: {err}")
        assert lowered.as_text().count("xla.gpu.triton") == 2  # forward, backward


@pytest.mark.slow  # 20 s; run before a device session (docs/benchmarks.md)
def test_benchmark_rows_lower_for_a_gpu(monkeypatch):
    """The device call's JAX rows (`bench_gpu_cross_entropy.jax_losses`) at
    its shapes (the Gemma 2 2B shape in bfloat16 and float32, N = 4,096,
    d = 1,024, V = 131,072), with the default blocks (and those of its
    block sweep at the bfloat16 shape), lowered for CUDA on the CPU (nothing
    compiled or run): the kernel rows lower through Triton (forward and
    backward), the tiled and dense rows take none."""
    import jax

    monkeypatch.syspath_prepend(BENCH)
    import bench_gpu_cross_entropy as bench

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    expected = {"xla_dense": 0, "ours": 2, "ours_filtered": 2, "ours_atomic": 2,
                "ours_tiled": 0, "ours_blocked": 0, "ours_summed": 0}
    blocks_swept = [(128, 128, 64)]  # BLOCK_SWEEP=1
    shapes = bench.parse_shapes(bench.DEFAULT_SHAPES)
    for blocks in [pallas_cross_entropy.GPU_BLOCKS] + blocks_swept:
        monkeypatch.setattr(pallas_cross_entropy, "GPU_BLOCKS", blocks)
        # The sweep runs at the bfloat16 Gemma shape only (device_cross_entropy.sh).
        for n, d, v, dtype in shapes if blocks == pallas_cross_entropy.GPU_BLOCKS else shapes[:1]:
            h = jax.ShapeDtypeStruct((n, d), dtype)
            w = jax.ShapeDtypeStruct((v, d), dtype)
            t = jax.ShapeDtypeStruct((n,), "int32")
            for row, fn in bench.jax_losses(bench.ROWS, "pallas", 2.0**-12, 4096).items():
                step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
                text = lower_for(step, (h, w, t), "cuda").as_text()
                assert text.count("xla.gpu.triton") == expected[row], (blocks, n, dtype, row)


def test_dispatch():
    import jax.numpy as jnp

    h = jnp.zeros((2, 4), "float32")
    assert not pallas_cross_entropy.uses_kernel(h, h, "auto")  # the CPU
    # A GPU measured the tiled pass faster: "auto" takes it there too.
    assert pallas_cross_entropy.AUTO_PLATFORMS == ()
    assert not pallas_cross_entropy.uses_kernel(h, h, "auto", platform="gpu")
    assert not pallas_cross_entropy.uses_kernel(h, h, "ops", platform="gpu")
    assert pallas_cross_entropy.uses_kernel(h, h, "pallas")
    h64 = np.zeros((2, 4), "float64")
    with pytest.MonkeyPatch.context() as patch:  # a platform where "auto" would take it
        patch.setattr(pallas_cross_entropy, "AUTO_PLATFORMS", ("gpu",))
        assert pallas_cross_entropy.uses_kernel(h, h, "auto", platform="gpu")
        assert not pallas_cross_entropy.uses_kernel(h, h, "auto", platform="tpu")
        assert not pallas_cross_entropy.uses_kernel(h64, h64, "auto", platform="gpu")
    with pytest.raises(ValueError, match="pallas"):
        pallas_cross_entropy.uses_kernel(h64, h64, "pallas")
    with pytest.raises(ValueError, match="implementation"):
        linear_cross_entropy(h, h.T, [0, 1], implementation="triton")


def test_auto_dispatch_on_a_forced_gpu_platform(monkeypatch):
    """On a (forced) GPU, `"auto"` takes the tiled pass (`AUTO_PLATFORMS` is
    empty: a GPU measured it faster); a platform listed there runs the
    kernel through the same public function, `filter_eps` passed on."""
    import jax

    calls = []
    real = pallas_cross_entropy.pallas_pointwise_stats

    def spy(*args, **kwargs):
        calls.append(kwargs.get("filter_eps"))
        return real(*args, **kwargs)

    from keras_softmax_heads.fused import vocab_parallel

    monkeypatch.setattr(vocab_parallel, "pallas_pointwise_stats", spy)
    h, w, b, y, _ = inputs()

    def loss(h, w, filter_eps=None):
        return linear_cross_entropy(h, w, y, kernel_transposed=True, ignore_index=-100,
                                    filter_eps=filter_eps)

    jax.jit(loss).lower(h, w)  # traced, not compiled
    assert calls == []  # "auto" on the CPU: the tiled pass
    with forced_platform("gpu"):
        jax.jit(loss, static_argnums=2).lower(h, w, 1e-6)
    assert calls == []  # "auto" on a GPU: the tiled pass too
    monkeypatch.setattr(pallas_cross_entropy, "AUTO_PLATFORMS", ("gpu",))
    with forced_platform("gpu"):  # another filter_eps: a new trace
        jax.jit(loss, static_argnums=2).lower(h, w, 2e-6)
    assert calls == [2e-6]  # the same public function, the kernel


@pytest.mark.slow
@pytest.mark.parametrize("backward", ["gemm", "atomic"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_tiled_pass_every_option(dtype, transposed, bias, backward,
                                                monkeypatch):
    real = pallas_cross_entropy.pallas_pointwise_stats
    from keras_softmax_heads.fused import vocab_parallel

    monkeypatch.setattr(vocab_parallel, "pallas_pointwise_stats",
                        lambda *a, **k: real(*a, **k, backward=backward))
    h, w, b, y, weights = inputs(dtype, transposed, seed=1)
    b = b if bias else None
    tol = 1e-5 if dtype == "float32" else 3e-2
    for options in (
        dict(reduction="mean"), dict(reduction="none", sample_weight=weights),
        dict(label_smoothing=0.2, reduction="sum"), dict(z_loss=1e-2),
        dict(logit_soft_cap=3.0, label_smoothing=0.1, z_loss=1e-3),
    ):
        options = dict(options, kernel_transposed=transposed)
        loss_k, grads_k = loss_and_grads("pallas", h, w, b, y, options)
        loss_x, grads_x = loss_and_grads("auto", h, w, b, y, options)
        close(loss_k, loss_x, tol, tol)
        for gk, gx in zip(grads_k, grads_x):
            close(gk, gx, tol, tol * float(np.max(np.abs(np.asarray(gx, "float32")))))


def test_gpu_benchmark_smoke(tmp_path, monkeypatch):
    """`benchmarks/bench_gpu_cross_entropy.py` at a tiny shape on the CPU:
    the JAX rows (the kernel in interpret mode) run and agree, the PyTorch
    rows are skipped without CUDA."""
    import json

    monkeypatch.syspath_prepend(BENCH)
    import bench_gpu_cross_entropy as bench

    out = tmp_path / "gce.json"
    bench.main(["--shapes=40x16x100:bfloat16", "--implementation=pallas", "--repeats=1",
                "--rows=torch_dense,xla_dense,ours,ours_blocked", "--token_chunk_size=16",
                "--blocked_chunk_size=32", f"--out={out}"])
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"torch_dense", "xla_dense", "ours", "ours_blocked"}
    assert not rows["ours_blocked"]["pallas_kernel"]
    for name in ("xla_dense", "ours", "ours_blocked"):
        r = rows[name]
        assert r["step_s"] > 0 and r["peak_over_inputs_mib"] > 0, r
        assert r["loss"] == pytest.approx(rows["xla_dense"]["loss"], rel=1e-3)
    assert rows["ours"]["pallas_kernel"]
    assert max(rows["ours"]["grad_rel_err_vs_xla_dense"]) < 2e-2
    import torch

    if not torch.cuda.is_available():
        assert rows["torch_dense"]["skipped"] == "no CUDA device"
    assert result["ratios"][0]["time_ours_over_xla_dense"] > 0
    assert result["complete"]

    # A device call's time limit can stop the run: every finished case is
    # saved as it ends, and no case begins after --max_seconds.
    _, settings = bench.parse_args(["--shapes=8x4x10:float32;8x4x12:float32",
                                    "--rows=xla_dense", "--repeats=1"])
    saved = []
    bench.run(settings, save=lambda partial: saved.append(len(partial["rows"])))
    assert saved == [1, 2]
    settings["max_seconds"] = 1e-9
    skipped = bench.run(settings)["rows"]
    assert [r["skipped"] for r in skipped] == ["time budget (--max_seconds) spent"] * 2


@pytest.mark.slow  # 30 s; run before a device session (docs/benchmarks.md)
def test_filter_study_applies_the_kernels_rule(monkeypatch):
    """`benchmarks/bench_filter_eps.py` trains with the kernel's filtering
    rule applied to the dense gradient: its gradients equal the kernel's
    (interpreted) at the GPU blocks, where blocks are skipped."""
    import jax
    import jax.numpy as jnp

    monkeypatch.syspath_prepend(BENCH)
    import bench_filter_eps

    bn, bv, _ = pallas_cross_entropy.GPU_BLOCKS
    n, d, v, eps = 2 * bn, 16, 2 * bv, 2e-3
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(size=(n, d)) * 2.0, "float32")
    w = jnp.asarray(rng.normal(size=(d, v)), "float32")
    # The second word block is improbable (its bias 60 lower); the first row
    # block has no target there (skipped), the second row block has one (kept).
    b = jnp.asarray(rng.normal(size=v) - 60.0 * (np.arange(v) >= bv), "float32")
    y = rng.integers(0, bv, size=n).astype("int32")
    y[-1] = v - 1
    nll = bench_filter_eps.filtered_nll(eps, bn, bv)
    onehot = jax.nn.one_hot(y, v)
    study = jax.grad(lambda *a: jnp.sum(nll(*a, onehot)), argnums=(0, 1, 2))(h, w, b)
    kernel = jax.grad(
        lambda *a: linear_cross_entropy(*a[:2], y, a[2], reduction="sum",
                                        implementation="pallas", filter_eps=eps),
        argnums=(0, 1, 2))(h, w, b)
    exact = jax.grad(
        lambda *a: linear_cross_entropy(*a[:2], y, a[2], reduction="sum"),
        argnums=(0, 1, 2))(h, w, b)
    for s, k, e in zip(study, kernel, exact):
        np.testing.assert_allclose(np.asarray(s), np.asarray(k), rtol=1e-4, atol=1e-5)
    # Only the skipped block's terms are missing: the second word block's
    # gradient is the second row block's alone.
    second_rows = jax.grad(lambda w: jnp.sum(nll(h[bn:], w, b, onehot[bn:])))(w)
    np.testing.assert_allclose(np.asarray(study[1][:, bv:]), np.asarray(second_rows[:, bv:]),
                               rtol=1e-5, atol=1e-30)
    assert not np.allclose(np.asarray(study[1][:, bv:]), np.asarray(exact[1][:, bv:]),
                           rtol=1e-3, atol=0)
