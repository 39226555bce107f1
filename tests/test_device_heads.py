"""Smoke tests of the issue-28 benchmarks (JAX scripts): the one-call GPU
table `benchmarks/bench_device_heads.py` and the mixtures' compiled memory
`benchmarks/bench_mixture_memory.py`, at tiny shapes on the CPU."""

import json
import os
import subprocess
import sys

import pytest
from backends import BACKEND
from backends import PALLAS
from backends import lower_for

pytestmark = [
    pytest.mark.multibackend,
    pytest.mark.skipif(BACKEND != "jax", reason="the benchmarks are JAX scripts"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def test_device_heads_and_mixture_memory_in_process(monkeypatch):
    """Every row of a tiny table has its compiled memory and its time, the
    ratios are to FullSoftmax of the same rounds, and the tiled MoS needs
    less temporary memory than its `[N, K, V]` reference loss."""
    monkeypatch.syspath_prepend(BENCH)
    import bench_device_heads
    import bench_mixture_memory

    args = bench_device_heads.parse_args(
        ["--tokens=16", "--dim=8", "--vocab_sizes=40", "--rounds=1", "--warmup=0",
         "--heads=full,mos4,mos4_summed,sigsoftmax_summed,adaptive,adaptive_summed"])
    saved = []
    result = bench_device_heads.run(
        args, save=lambda partial: saved.append(
            (len(partial["rows"]), all("step_s" in r for r in partial["rows"]))))
    rows = {r["head"]: r for r in result["rows"]}
    # Saved after each head is compiled, then after the timed rounds (a
    # device call's limit keeps what was done).
    assert saved == [(k, False) for k in range(1, 7)] + [(6, True)]
    assert result["complete"]
    assert list(rows) == ["full", "mos4", "mos4_summed", "sigsoftmax_summed", "adaptive",
                          "adaptive_summed"]
    assert rows["full"]["ratio_to_full"] == 1.0
    for row in rows.values():
        assert row["step_s"] > 0 and row["compiled_memory"]["temp"] >= 0, row
    assert bench_device_heads.split_name("plif_k1000_summed_spread") == (
        "plif_k1000", ("summed", "spread"))
    assert bench_device_heads.split_name("mos15") == ("mos15", ())
    # The adaptive rows: their own (Zipfian) targets, the summed row with the
    # tails' gradients in the forward pass.
    assert bench_device_heads.make_head("adaptive_summed", 40).gradient_in_forward
    zipf = bench_device_heads.step_inputs(4096, 2, 40, zipf=True)[1]
    assert float((zipf < 4).mean()) > 0.4  # the 4 most frequent words of 40
    memory = bench_mixture_memory.memory_rows(["full", "mos15", "mos15_dense"], 32, 8, 40)
    assert memory["platform"] == "cpu"
    temp = {r["head"]: r["memory"]["temp"] for r in memory["rows"]}
    assert temp["mos15"] < temp["mos15_dense"]


@pytest.mark.slow
def test_device_heads_script_end_to_end(tmp_path):
    """The script as the device call runs it (with PyTorch's compiled rows)."""
    out = tmp_path / "device_heads.json"
    env = dict(os.environ, KERAS_BACKEND="jax", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, os.path.join(BENCH, "bench_device_heads.py"), "--tokens=32",
         "--dim=8", "--vocab_sizes=50", "--rounds=2", "--warmup=1", "--torch",
         f"--out={out}"], check=True, env=env, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert {r["head"] for r in rows} >= {"full", "mos15_dense", "torch_plif_compile"}
    assert all("error" not in r for r in rows), rows


@pytest.mark.slow  # 45 s; run before a device session (docs/benchmarks.md)
@pytest.mark.skipif(not PALLAS, reason="counts the Pallas (Triton) kernels")
def test_every_head_step_lowers_for_a_gpu(monkeypatch):
    """The device call's steps as a GPU runs them, at its shape (N = 8,192,
    d = 512, V = 33,278), lowered for CUDA on the CPU (nothing compiled or
    run): JAX reporting a GPU backend, the library takes its GPU paths
    (tile widths, the Pallas kernels lowered through Triton, not
    interpreted), so a Python-level failure of a GPU path shows here, not in
    a device session."""
    import jax

    monkeypatch.syspath_prepend(BENCH)
    import bench_device_heads

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    n, d, vocab = 8192, 512, 33278
    h = jax.ShapeDtypeStruct((n, d), "float32")
    y = jax.ShapeDtypeStruct((n,), "int32")
    kernels, fused, spread = {}, {}, {}
    for name in bench_device_heads.HEADS:
        head = bench_device_heads.make_head(name, vocab)
        head.build((None, d))
        step = bench_device_heads.step_of(name, head)
        weights = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in head.trainable_variables]
        text = lower_for(step, (weights, h, y), "cuda").as_text()
        kernels[name] = text.count("xla.gpu.triton")
        fused[name] = "plif_ll_gradient" in text
        spread[name] = "stablehlo.scatter" in text
    # PLIF's slope histogram (and MonotonicSoftmax's grid's) is the kernel; the
    # `_scatter` and `_spread` rows take a scatter-add instead.
    assert {k for k, count in kernels.items() if count} == {
        "plif", "plif_k1000", "monotonic", "mos4_plif", "plif_fused", "plif_k1000_fused",
        "plif_summed", "plif_k1000_summed", "mos4_plif_summed"}, kernels
    # The fused backward tile replaces the histogram kernel in the `_fused` rows only.
    assert {k for k, is_fused in fused.items() if is_fused} == {"plif_fused",
                                                                 "plif_k1000_fused"}
    spread_rows = {k for k in kernels if k.endswith("_spread")}
    assert spread_rows and all(spread[k] and not kernels[k] for k in spread_rows), spread
