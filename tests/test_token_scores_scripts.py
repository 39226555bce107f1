"""Smoke runs of `examples/hub_token_scores.py` and
`benchmarks/bench_token_scores.py` at tiny shapes, in this process (their
importable logic, on the current backend)."""

import importlib.util
import pathlib

import numpy as np
import pytest
from backends import BACKEND

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# On every backend: JAX and PyTorch also call `compute_loss` with
# `training=False` (the logits), which the example's loss must handle.
@pytest.mark.multibackend
def test_hub_token_scores_example():
    pytest.importorskip("keras_hub")
    example = _load("examples/hub_token_scores.py", "hub_token_scores")
    lines = []
    out = example.run(vocabulary_size=64, hidden_dim=8, batch_size=2, prompt_len=2,
                      seq_len=5, steps=1, chunk_size=24, log=lines.append)
    np.testing.assert_allclose(out["log_probs"], out["dense_log_probs"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["entropy"], out["dense_entropy"], rtol=1e-5, atol=1e-5)
    assert len(out["rewards"]) == 1 and any(x.startswith("step 0") for x in lines)


# The benchmark's steps compile with XLA: 5-26 s on TensorFlow (the latter
# in the full run), about 1 s on JAX, so the default run smokes it on JAX
# (TensorFlow: -m slow; it does not run on PyTorch).
@pytest.mark.multibackend
@pytest.mark.skipif(BACKEND == "torch", reason="bench_token_scores runs on JAX or TensorFlow")
@(pytest.mark.skipif(False, reason="runs on JAX") if BACKEND == "jax" else pytest.mark.slow)
def test_bench_token_scores_smoke():
    bench = _load("benchmarks/bench_token_scores.py", "bench_token_scores")
    r = bench.measure_backend(32, 8, 96, 40, rounds=1, threads=1)
    assert set(r["rows"]) == {"fused", "dense"}
    assert r["loss_relative_difference"] < 1e-4
    assert r["ratios"]["time_fused_over_dense"] > 0
    assert all(row["step_s"] > 0 for row in r["rows"].values())
