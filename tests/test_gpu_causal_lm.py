"""Smoke test of `benchmarks/bench_gpu_causal_lm.py`, issue 29's keras-hub
Gemma step on a device (JAX), at tiny shapes on the CPU."""

import os

import pytest
from backends import BACKEND

pytestmark = [
    pytest.mark.multibackend,
    pytest.mark.skipif(BACKEND != "jax", reason="the device benchmarks are JAX scripts"),
]

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.slow  # about 30 s: two keras-hub models, each compiled four times
def test_stock_and_fused_steps_and_probes(monkeypatch):
    """Both rows train through Keras' own step (the same loss from the same
    weights), are timed in the same rounds, and probe sequence lengths by
    compiled memory until the first that does not fit; the fused step needs
    less memory than the stock one at every probed length."""
    pytest.importorskip("keras_hub")
    monkeypatch.syspath_prepend(BENCH)
    import bench_gpu_causal_lm as bench

    args = bench.parse_args([
        "--vocabulary_size=4096", "--hidden_dim=16", "--num_query_heads=2",
        "--num_key_value_heads=1", "--head_dim=8", "--intermediate_dim=32", "--seq_len=16",
        # A vocabulary large enough that the logits dominate from 64 tokens
        # (at 16 the fused step's fixed buffers can outweigh them, JAX 0.11);
        # the limit (10 MB) between the stock peak at 256 tokens (13-18 MB on
        # JAX 0.10-0.11) and the fused one (7-8 MB), above the stock one at 64.
        "--probe_seq_lens=64,256,1024", "--memory_limit_gb=0.0093", "--steps=2"])
    saved = []
    result = bench.run(args, save=lambda partial: saved.append(partial["complete"]))
    # Saved after each row's compilation, after the timed rounds, after each
    # probe, and at the end.
    assert len(saved) == 2 + 1 + 5 + 1 and saved[-1] and not any(saved[:-1])
    assert result["complete"]
    stock, fused = result["rows"]["stock"], result["rows"]["fused"]
    for row in (stock, fused):
        assert row["step_s"] > 0 and row["memory"]["peak_bytes"] > 0, row
        probes = row["probes"]
        assert [p["fits"] for p in probes] == [True] * (len(probes) - 1) + [False], probes
        assert row["max_seq_len"] == probes[-2]["seq_len"]
    assert fused["loss"] == pytest.approx(stock["loss"], rel=1e-3)
    assert stock["ratio_to_stock"] == 1.0 and fused["ratio_to_stock"] > 0
    for s, f in zip(stock["probes"], fused["probes"]):
        assert f["peak_bytes"] < s["peak_bytes"], (s, f)
    assert result["max_seq_len_fused_over_stock"] == 4.0  # 256 against 64 tokens


def test_fused_loss_flag(monkeypatch):
    """`--fused_loss` (JSON) is the fused row's `fused_loss` (the device call
    passes token blocks)."""
    monkeypatch.syspath_prepend(BENCH)
    import bench_gpu_causal_lm as bench

    assert bench.parse_args([]).fused_loss == {}
    args = bench.parse_args(['--fused_loss={"token_chunk_size": 4096}'])
    assert args.fused_loss == {"token_chunk_size": 4096}
