"""Smoke tests of the benchmark scripts, so that they never go stale.

Each script runs end to end at tiny sizes in a fresh process. The floor
script is fast and runs by default; the three table benchmarks take one to
two minutes each with `--quick` and are marked slow.
"""

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _run(script, *args, timeout=600):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, script), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_hsm_floor(tmp_path):
    out = tmp_path / "floor.json"
    _run("hsm_floor.py", "--v", "3000", "--d", "16", "--n", "64", "--repeats", "1",
         "--full-seconds", "1.0", "--json", str(out))
    result = json.loads(out.read_text())
    # The layer's default layout: ceil(sqrt(3000)) = 55 frequency bins, split.
    assert result["clusters"] >= 55
    assert 0 < result["clusters_hit"] <= 64
    assert result["rows_hit"] <= 3000 and result["pairs"] >= result["rows_hit"]
    for mode in ("graph", "xla"):
        row = result["modes"][mode]
        assert row["floor_s"] == pytest.approx(row["cluster_s"] + 2 * row["read_rows_s"], abs=2e-4)
        assert row["hsm_step_s"] > 0
    assert result["modes"]["graph"]["hsm_dynamic_step_s"] > 0
    assert "hsm_dynamic_step_s" not in result["modes"]["xla"]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_chunked.py", "bench_exact_heads.py",
                                    "bench_large_vocab.py"])
def test_table_benchmarks_quick(script):
    out = _run(script, "--quick", timeout=900)
    assert out.strip(), "the benchmark printed no table"
