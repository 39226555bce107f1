"""Smoke tests of the benchmark scripts, so that they never go stale.

Each script runs end to end at tiny sizes in a fresh process. The floor
script is fast and runs by default; the three table benchmarks take one to
two minutes each with `--quick` and are marked slow. The scripts' `--backend`
runs are smoke-tested on JAX and PyTorch with the heads that run there
(`FullSoftmax`, `SigSoftmax`, the sampled heads), at tiny sizes.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _process(script, *args, timeout=600):
    """The finished process of a benchmark script (`subprocess.CompletedProcess`)."""
    # One intra-op thread: PyTorch's OpenMP pool stalls on a busy machine.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3",
               OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, os.path.join(BENCH, script), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )


def _run(script, *args, timeout=600):
    """A benchmark script's standard output; it must succeed."""
    proc = _process(script, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_head_robustness_smoke(tmp_path):
    """The seed-robustness check's script, two n-gram rows for two steps on the
    synthetic corpus: it runs, writes its JSON and judges against the softmax."""
    out = tmp_path / "check.json"
    stdout = _run("head_robustness.py", "--dataset=synthetic", "--rows=chen_ptb/softmax,chen_ptb/nce",
                  "--seeds=0", "--steps=2", "--eval_windows=1", f"--out={out}")
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"chen_ptb/softmax/seed0", "chen_ptb/nce/seed0"}
    assert data["verdicts"]["chen_ptb/softmax/seed0"]["ratio"] == 1.0
    assert "chen_ptb/nce/seed0" in stdout
    # Each run records the code it ran (runs accumulate across sessions);
    # outside a git checkout, nothing.
    provenance = data["runs"]["chen_ptb/nce/seed0"].get("provenance", {})
    if subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode == 0:
        assert len(provenance["commit"]) == 40 and isinstance(provenance["dirty"], bool)
    else:
        assert provenance == {}


#: A study row's settings at a smoke test's size (`--overrides`).
_TINY_STUDY = ("steps_per_epoch=2,epochs=1,embedding_dim=8,hidden_size=8,num_layers=1,"
               "batch_size=4,bptt=6,eval_steps=2,num_diagnostic_contexts=20,jit_compile=False")


@pytest.mark.slow
def test_parallel_study_smoke(tmp_path):
    """Two rows of a study in two processes (the arrays loop), merged into one summary."""
    out = tmp_path / "study.json"
    stdout = _run("parallel_study.py", "--study=bottleneck_ptb", "--rows=softmax,sigsoftmax",
                  "--dataset=synthetic", f"--runs_dir={tmp_path / 'runs'}", f"--out={out}",
                  f"--overrides={_TINY_STUDY}")
    data = json.loads(out.read_text())
    assert [r["row"] for r in data["rows"]] == ["softmax", "sigsoftmax"]
    assert all(r["loop"] == "arrays" and r["epochs"] == 1 for r in data["rows"])
    assert "row sigsoftmax done" in stdout


@pytest.mark.slow
def test_parallel_study_pins_rows_to_cores(tmp_path, monkeypatch):
    """With `--cores`, each row's process runs on one core with one intra-op
    thread (the row's summary records what its process had), one row per core."""
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        monkeypatch.delenv(name, raising=False)  # the pinned rows' defaults apply
    core = min(os.sched_getaffinity(0))
    out = tmp_path / "study.json"
    stdout = _run("parallel_study.py", "--study=bottleneck_ptb", "--rows=softmax,sigsoftmax",
                  "--dataset=synthetic", f"--cores={core}", f"--runs_dir={tmp_path / 'runs'}",
                  f"--out={out}", f"--overrides={_TINY_STUDY}")
    data = json.loads(out.read_text())
    assert [r["row"] for r in data["rows"]] == ["softmax", "sigsoftmax"]
    assert "1 core(s) available to the process; TF_NUM_INTRAOP_THREADS=1" in data["machine"]
    # One core: the second row starts when the first is done.
    lines = stdout.splitlines()
    assert lines.index(next(l for l in lines if "row softmax done" in l)) < lines.index(
        next(l for l in lines if "row sigsoftmax started" in l))


@pytest.mark.slow
@pytest.mark.parametrize("cores, message", [("0,0", "lists a CPU twice"), ("a", "takes CPU ids"),
                                            ("100000", "may not use")])
def test_parallel_study_rejects_bad_cores(cores, message):
    proc = _process("parallel_study.py", "--study=bottleneck_ptb", f"--cores={cores}",
                    "--runs_dir=/nonexistent/never", "--out=/nonexistent/never.json", timeout=300)
    assert proc.returncode != 0 and message in proc.stderr


@pytest.mark.slow
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
def test_hsm_floor_full_reference(tmp_path):
    out = tmp_path / "full.json"
    _run("hsm_floor.py", "--measure-full", "--v", "300", "--d", "8", "--n", "200",
         "--repeats", "1", "--json", str(out))
    assert json.loads(out.read_text())["full_softmax_step_s"] > 0


def test_full_softmax_step_is_exact():
    """The reference step of `--measure-full` is the exact NLL and gradient."""
    sys.path.insert(0, BENCH)
    try:
        import hsm_floor
    finally:
        sys.path.remove(BENCH)
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(1)
    h = tf.constant(rng.standard_normal((300, 4)).astype("float32"))
    kernel = tf.Variable(rng.standard_normal((7, 4)).astype("float32"))
    targets = tf.constant(rng.integers(0, 7, 300).astype("int32"))
    loss, (d_h, d_kernel) = hsm_floor.full_softmax_step(h, kernel, targets)()
    with tf.GradientTape() as tape:
        tape.watch(h)
        z = tf.matmul(h, kernel, transpose_b=True)
        ref = tf.reduce_sum(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=z)
        )
    ref_h, ref_kernel = tape.gradient(ref, [h, kernel])
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    np.testing.assert_allclose(d_h, ref_h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_kernel, ref_kernel, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_chunked.py", "bench_exact_heads.py",
                                    "bench_large_vocab.py"])
def test_table_benchmarks_quick(script):
    out = _run(script, "--quick", timeout=900)
    assert out.strip(), "the benchmark printed no table"


@pytest.mark.slow
def test_train_loop_benchmark(tmp_path):
    out = tmp_path / "loop.json"
    _run("bench_train_loop.py", "--steps", "6", "--preset", "", "--compare_head", "sigsoftmax",
         "--out", str(out))
    result = json.loads(out.read_text())
    assert {r["row"] for r in result["rows"]} == {"bare", "train_lm", "train_lm_sigsoftmax"}
    assert result["train_lm_over_bare"] > 0 and result["compare_head_over_head"] > 0


@pytest.mark.slow
def test_sequential_benchmark(tmp_path):
    out = tmp_path / "sequential.json"
    _run("bench_sequential.py", "--vocab_size", "500", "--dim", "16", "--tokens", "64",
         "--num_sampled", "8", "--steps", "2", "--out", str(out))
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 4 and all(r["median_s"] > 0 for r in result["rows"])
    assert result["ratios"]["full_over_sequential_sampled"] > 0


def _installed(module):
    # Found, not imported: importing JAX and PyTorch at collection costs
    # every test process seconds.
    return importlib.util.find_spec(module) is not None


BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(not _installed(m), reason=f"{m} not installed"))
    for b, m in (("jax", "jax"), ("torch", "torch"))
]
# The backends' default modes (JAX: `xla`, PyTorch: `eager`).
MODES = {"jax": "xla", "torch": "eager"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_heads_backend(backend, tmp_path):
    out = tmp_path / "exact.json"
    stdout = _run("bench_exact_heads.py", "--quick", f"--backend={backend}",
                  "--modes", MODES[backend], "--heads", "full,sigsoftmax", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["command"].startswith("python benchmarks/bench_exact_heads.py --quick")
    assert result["objective"].startswith("summed_training_loss")
    rows = result["rows"]
    assert {r["head"] for r in rows} == {"full", "sigsoftmax"}, stdout
    for r in rows:
        assert r["backend"] == backend and "error" not in r, r
        assert r["wall_ms"] > 0 and len(r["wall_ratios"]) == 3  # --quick: 3 rounds
        assert r["memory_source"] == "process peak RSS (VmHWM)"
    assert "peak MiB on " + backend in stdout


@pytest.mark.slow
def test_exact_heads_two_backends_compared(tmp_path):
    """`--backend tensorflow,jax` sets JAX's ratios next to TensorFlow's."""
    if not _installed("jax"):
        pytest.skip("jax not installed")
    out = tmp_path / "exact.json"
    stdout = _run("bench_exact_heads.py", "--quick", "--backend=tensorflow,jax", "--modes",
                  f"graph,{MODES['jax']}", "--heads", "full,sigsoftmax", "--rounds", "2",
                  "--no-memory", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {(r["backend"], r["head"]) for r in rows} == {
        (b, h) for b in ("tensorflow", "jax") for h in ("full", "sigsoftmax")}
    assert f"| sigsoftmax | jax {MODES['jax']} |" in stdout, stdout


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_vocab_backend(backend, tmp_path):
    out = tmp_path / "large.json"
    stdout = _run("bench_large_vocab.py", "--quick", f"--backend={backend}",
                  "--modes", MODES[backend], "--rows", "SampledSoftmax unigram,NCE,tf.nn",
                  "--json", str(out))
    rows = json.loads(out.read_text())
    assert all(r["backend"] == backend for r in rows)
    timed = {(r["row"], r["phase"]) for r in rows if "step_s" in r}
    assert {("FullSoftmax", "train"), ("SampledSoftmax unigram", "train"),
            ("NCE unigram", "train"), ("FullSoftmax", "eval")} <= timed, stdout
    tf_rows = [r for r in rows if r["row"].startswith("tf.nn.")]
    assert tf_rows and all("TensorFlow op" in r["skipped"] for r in tf_rows)


def test_failed_head_is_a_row(tmp_path):
    """A head that fails is reported with its error; the others are measured."""
    out = tmp_path / "exact.json"
    _run("bench_exact_heads.py", "--n", "64", "--v", "500", "--d", "32", "--modes", "graph",
         "--heads", "full,mos,moc", "--mixture-components", "0", "--rounds", "1",
         "--warmup", "1", "--no-memory", "--json", str(out))
    rows = {r["head"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["full"]["wall_ms"] > 0
    # Every head asked for is a row (a head whose class moved was once skipped silently).
    assert "num_components" in rows["mos"]["error"] and "num_components" in rows["moc"]["error"]


@pytest.mark.slow
@pytest.mark.parametrize("our_backend", ["tensorflow", "jax"])
def test_peers_benchmark(tmp_path, our_backend):
    """Our heads (TensorFlow XLA or JAX jit) and the PyTorch peers, same run, with ratios."""
    if not _installed("torch"):
        pytest.skip("torch not installed")
    if not _installed(our_backend):
        pytest.skip(f"{our_backend} not installed")
    out = tmp_path / "peers.json"
    stdout = _run("bench_peers.py", "--quick", "--threads", "1", "--our-backend", our_backend,
                  "--out", str(out), timeout=300)
    result = json.loads(out.read_text())
    assert result["command"].startswith("python ") and result["machine"]["cores"] >= 1
    assert result["settings"]["our_backend"] == our_backend
    assert result["settings"]["torch_device"] == "cpu"
    ours = f"keras_softmax_heads ({our_backend} xla)"
    torch_side = "pytorch eager"
    rows = result["rows"]
    sides = {r["side"] for r in rows}
    assert sides == {ours, torch_side}, stdout
    assert set(result["devices"]) == sides and "gpu" not in result["machine"]
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["step_s"] > 0 and 0 < r["best_s"] <= r["step_s"], r
    timed = {(r["side"], r["row"], r["phase"]) for r in rows}
    assert (torch_side, "AdaptiveLogSoftmaxWithLoss", "eval") in timed
    assert (ours, "matmul", "forward") in timed
    # Same weights on the PyTorch side: PLIF at its identity initialisation
    # is the full softmax; both sides' bare products sum the same matrix.
    # Our heads are seeded: a head's train and eval rows (separate processes
    # on JAX) see the same weights.
    value = {(r["side"], r["row"], r["phase"]): r["value"] for r in rows}
    assert value[(torch_side, "PLIF gather-on-cumsum", "eval")] == pytest.approx(
        value[(torch_side, "full softmax", "eval")], rel=1e-5)
    assert value[(torch_side, "matmul", "forward")] == pytest.approx(
        value[(ours, "matmul", "forward")], abs=1e-3)
    assert -value[(ours, "FullSoftmax", "eval")] == pytest.approx(
        value[(ours, "FullSoftmax", "train")], rel=1e-4)
    ratios = result["ratios"]
    assert len(ratios) == len([r for r in rows if r["key"] != "matmul"])
    assert all(e["over_side_full"] > 0 and e["over_ours_full"] > 0 for e in ratios)
    assert {e["side"] for e in result["efficiency"]} == sides


def test_adaptive_benchmark_smoke(tmp_path):
    """bench_adaptive.py end to end at tiny sizes, cheaply: torch's row in a
    fresh process, a full-softmax row over the memory budget as an error
    row, the ratios and the JSON."""
    if not _installed("torch"):
        pytest.skip("torch not installed")
    out = tmp_path / "adaptive.json"
    _run("bench_adaptive.py", "--vocab_sizes=300", "--tokens=64", "--dim=16",
         "--rows=full,torch", "--phases=train", "--repeats=1", "--warmup=1", "--threads=1",
         "--memory_budget_gb=1e-9", f"--out={out}", timeout=120)
    result = json.loads(out.read_text())
    assert result["command"].startswith("python benchmarks/bench_adaptive.py")
    assert result["settings"]["cutoffs"] == {"300": [6, 30, 150]}
    rows = {r["key"]: r for r in result["rows"]}
    assert rows["full"]["skipped"] and "budget" in rows["full"]["error"]
    assert rows["torch"]["step_s"] > 0 and rows["torch"]["cutoffs"] == [6, 30, 150]
    assert result["ratios"] == [{"v": 300, **{k: None for k in result["ratios"][0] if k != "v"}}]


@pytest.mark.slow
def test_adaptive_benchmark_rows_in_process(monkeypatch):
    """Our static and dynamic rows measure the same loss and exact
    log-likelihood (seeded weights); torch's `forward(...).output` is exact."""
    monkeypatch.syspath_prepend(BENCH)  # the script imports its neighbours lazily
    import bench_adaptive as bench
    assert bench.cutoffs_for(793471) == [60000, 100000, 640000]
    assert bench.cutoffs_for(793471, ["793471:4000/40000/200000"]) == [4000, 40000, 200000]
    value = {}
    for key in ("static", "dynamic", "chunked"):
        for phase in ("train", "eval"):
            r = bench.run_row(key, phase, 300, 16, 64, [20, 100], 1, 1, 1, chunk_size=64)
            assert r["step_s"] > 0 and r["capacities"], r
            value[key, phase] = r["value"]
    assert value["static", "train"] == pytest.approx(-value["static", "eval"], rel=1e-4)
    assert value["chunked", "eval"] == pytest.approx(value["static", "eval"], rel=1e-4)
    assert value["chunked", "train"] == pytest.approx(value["static", "train"], rel=1e-4)
    assert value["dynamic", "eval"] == pytest.approx(value["static", "eval"], rel=1e-4)
    assert value["dynamic", "train"] == pytest.approx(value["static", "train"], rel=1e-4)
    r = bench.run_row("in_forward", "train", 300, 16, 64, [20, 100], 1, 1, 1)
    assert r["value"] == pytest.approx(value["static", "train"], rel=1e-4)
    if _installed("torch"):
        assert bench.torch_eval_is_exact()
    ratios = bench.ratios_of([
        {"key": "static", "phase": "train", "v": 9, "step_s": 1.0},
        {"key": "torch", "phase": "train", "v": 9, "step_s": 2.0},
        {"key": "full", "phase": "eval", "v": 9, "step_s": 4.0},
        {"key": "static", "phase": "eval", "v": 9, "step_s": 2.0},
        {"key": "dynamic", "phase": "eval", "v": 9, "error": "x"}])
    assert ratios[0]["static_over_torch_train"] == 0.5
    assert ratios[0]["static_over_full_eval"] == 0.5
    assert ratios[0]["dynamic_over_full_eval"] is None
    met = bench.targets_met(ratios)
    assert met["static_over_torch_train@9"] and met["dynamic_over_torch_train@9"] is None


def test_results_page_is_generated_from_the_committed_results(monkeypatch, capsys):
    """docs/results.md is what benchmarks/results_page.py makes of docs/results/
    (`--check`, in process: a subprocess would import TensorFlow again)."""
    monkeypatch.syspath_prepend(BENCH)
    import results_page

    assert results_page.main(["--check"]) == 0, capsys.readouterr().err


@pytest.mark.slow
def test_linear_cross_entropy_benchmark_smoke(tmp_path):
    """Every row at tiny sizes, in one process (`--in_process`): each is
    timed and measured, the rows compute the same loss, the ratios are set;
    the frozen rows return `h`'s gradient only."""
    pytest.importorskip("torch")
    out = tmp_path / "lce.json"
    _run("bench_linear_cross_entropy.py", "--tokens=32", "--dim=8", "--vocab_sizes=96",
         "--dtypes=bfloat16", "--chunk_size=40", "--repeats=1", "--threads=1",
         "--in_process", f"--out={out}", timeout=300)
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"keras_dense", "ours", "ours_summed", "ours_frozen", "torch_chunked",
                         "torch_dense", "torch_chunked_frozen"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["step_s"] > 0 and r["grad_mib"] > 0 and r["dtype"] == "bfloat16", r
    assert rows["ours_frozen"]["grad_mib"] < rows["ours"]["grad_mib"]
    assert rows["ours_frozen"]["loss"] == pytest.approx(rows["ours"]["loss"], rel=1e-6)
    # bfloat16 inputs; the fused rows accumulate in float32.
    assert rows["ours"]["loss"] == pytest.approx(rows["torch_chunked"]["loss"], rel=2e-2)
    assert rows["ours"]["loss"] == pytest.approx(rows["keras_dense"]["loss"], rel=2e-2)
    (ratio,) = result["ratios"]
    assert ratio["time_ours_over_keras_dense"] > 0 and ratio["time_ours_over_torch_chunked"] > 0
    assert ratio["time_ours_frozen_over_ours"] > 0
    assert ratio["time_ours_frozen_over_torch_chunked_frozen"] > 0
    assert result["command"].startswith("python ") and result["machine"]["cores"] >= 1


@pytest.mark.slow  # 41 s: three heads' compilations on 4 simulated devices
def test_vocab_parallel_memory_benchmark_smoke(tmp_path):
    """Three heads at a tiny shape on 4 simulated devices (a dense one, built
    without `chunk_size`): each row's memory on one device and sharded, its
    collectives, no vocabulary gathered."""
    pytest.importorskip("jax")
    out = tmp_path / "memory.json"
    _run("bench_vocab_parallel_memory.py", "--vocab=256", "--dim=8",
         "--heads=plif,full_softmax,monotonic:dense", f"--out={out}", timeout=300)
    result = json.loads(out.read_text())
    assert [r["head"] for r in result["rows"]] == ["plif", "full_softmax", "monotonic:dense"]
    for r in result["rows"]:
        assert 0 < r["temp_ratio"] < 1 and 0 < r["argument_ratio"] <= 1, r
        assert not r["gathers_vocabulary"] and not r["eval_gathers_vocabulary"], r
        assert 0 < r["eval_temp_ratio"] < 1, r
        assert not any(c.startswith("all-gather") for c in r["sharded"]["collectives"]), r
        assert r["one_device"]["collectives"] == [], r
    assert result["shape"]["devices"] == 4 and result["machine"]["cores"] >= 1


# TensorFlow's two modes: 25 s.
@pytest.mark.parametrize("backend", [pytest.param("tensorflow", marks=pytest.mark.slow)] + BACKENDS)
def test_forward_only_benchmark_smoke(backend, tmp_path):
    """Both losses, both forms, every mode of the backend at tiny sizes:
    each row timed (forward alone and with gradients), its ratios set; on
    JAX the compiled temporaries too."""
    out = tmp_path / "forward_only.json"
    _run("bench_forward_only.py", f"--backend={backend}", "--tokens=32", "--dim=8",
         "--vocab=96", "--rounds=1", f"--out={out}", timeout=300)
    result = json.loads(out.read_text())
    modes = {"jax": {"jit"}, "tensorflow": {"graph", "xla"}, "torch": {"eager"}}[backend]
    rows = result["rows"]
    assert {(r["mode"], r["loss"], r["form"]) for r in rows} == {
        (m, loss, form) for m in modes for loss in ("cross_entropy", "forward_kl")
        for form in ("tiled", "summed")}
    for r in rows:
        assert r["forward_s"] > 0 and r["train_s"] > 0 and r["forward_over_tiled_forward"] > 0, r
        assert (r["compiled_temp_mib"] is not None) == (backend == "jax"), r
    assert result["backend"] == backend and result["machine"]["cores"] >= 1


@pytest.mark.slow
def test_fused_causal_lm_benchmark_smoke(tmp_path):
    """A tiny Gemma's fit step, stock and fused, and the memory-cap search
    (`--in_process`, one sequence length under a cap no row reaches)."""
    pytest.importorskip("keras_hub")
    out = tmp_path / "causal_lm.json"
    _run("bench_fused_causal_lm.py", "--vocabulary_size=256", "--seq_len=8", "--hidden_dim=8",
         "--intermediate_dim=16", "--head_dim=4", "--steps=1", "--cap_seq_lens=8",
         "--memory_cap_gb=64", "--threads=1", "--in_process", f"--out={out}", timeout=300)
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"stock", "fused"}
    assert all(r["step_s"] > 0 and r["peak_mib"] > 0 for r in rows.values()), rows
    # Same weights and data: the first step's loss is the same.
    assert rows["fused"]["loss"] == pytest.approx(rows["stock"]["loss"], rel=1e-4)
    assert result["ratios"]["time_fused_over_stock"] > 0
    # The evaluation step: fused (no logits) and stock agree on the loss.
    evals = {r["row"]: r for r in result["eval_rows"]}
    assert set(evals["fused"]["logs"]) == {"loss", "token_accuracy", "perplexity"}
    assert evals["fused"]["loss"] == pytest.approx(evals["stock"]["loss"], rel=1e-4)
    assert result["ratios"]["eval_time_fused_over_stock"] > 0
    assert [c["max_seq_len_under_cap"] for c in result["memory_cap"]] == [8, 8]


@pytest.mark.slow  # 17 s; the GPU study's script (docs/benchmarks.md)
def test_filter_eps_study_smoke(tmp_path):
    """`bench_filter_eps.py` on the synthetic corpus, two steps, resuming a
    results file whose exact row is done: that row is kept as it was and
    only the threshold that skips blocks (eps = 0.5) trains, with its probes
    (one process: the resumed run and the training in one call)."""
    out = tmp_path / "filter_eps.json"
    done = {"eps": None, "seed": 0, "valid_perplexity": 1234.5, "probes": {}}
    out.write_text(json.dumps({"runs": [done]}))
    args = ["--dataset=synthetic", "--steps=2", "--probe_steps=0,2", "--eps=none,0.5",
            "--batch=4", "--length=16", "--units=8", "--valid_tokens=256", f"--out={out}"]
    assert "Wrote" in _run("bench_filter_eps.py", *args, timeout=300)
    runs = json.loads(out.read_text())["runs"]
    assert [r["eps"] for r in runs] == [None, 0.5]
    assert runs[0] == done and runs[1]["valid_perplexity"] > 1
    probe = runs[1]["probes"]["0"]
    assert 0 < probe["skipped_fraction"] < 1 and probe["dh_relative_change"] > 0


def test_mixture_summed_benchmark_smoke(monkeypatch):
    """`bench_mixture_summed.py` in process at tiny sizes: every row timed,
    and the two losses of a head's first step (the chunked FullSoftmax,
    SigSoftmax and PLIFSoftmax, a mixture with and without PLIF; the same
    seed, with and without `gradient_in_forward`) equal; each PLIF row's
    twin with Keras' `segment_sum` and `take` too, and each summed row's
    with the softmax's two exponential passes and with nothing written in
    place."""
    monkeypatch.syspath_prepend(BENCH)
    import bench_mixture_summed

    args = bench_mixture_summed.parse_args(
        ["--batch=2", "--length=3", "--dim=4", "--vocab=20", "--components=2",
         "--rounds=1", "--warmup=0", "--jit_compile=false", "--sigsoftmax", "--plif",
         "--knots=8", "--keras_ops", "--two_exp", "--copying"])
    rows = {r["head"]: r for r in bench_mixture_summed.run(args)["rows"]}
    plif_rows = ["plif", "plif_chunked", "plif_chunked_summed", "mos2_plif", "mos2_plif_summed"]
    summed = ["full_chunked_summed", "sig_chunked_summed", "plif_chunked_summed", "mos2_summed",
              "mos2_plif_summed"]
    assert list(rows) == ["full", "sig", "plif", "full_chunked", "full_chunked_summed",
                          "sig_chunked", "sig_chunked_summed", "plif_chunked",
                          "plif_chunked_summed", "mos2", "mos2_summed", "mos2_plif",
                          "mos2_plif_summed"] + [name + "_keras_ops" for name in plif_rows] + [
                          name + "_two_exp" for name in summed] + [
                          name + "_copying" for name in summed]
    for name in plif_rows:  # Keras' ops: the same first loss, a ratio
        twin = rows[name + "_keras_ops"]
        assert abs(twin["first_loss"] - rows[name]["first_loss"]) < 1e-6
        assert twin["ratio_to_dispatch"] > 0
    for name in summed:  # the two-exponential softmax; fresh tensors
        for twin in (rows[name + "_two_exp"], rows[name + "_copying"]):
            assert abs(twin["first_loss"] - rows[name]["first_loss"]) < 1e-6
            assert twin["ratio_to_dispatch"] > 0
    assert all(r["step_s"] > 0 for r in rows.values())
    for name in ("full_chunked", "sig_chunked", "plif_chunked", "mos2", "mos2_plif"):
        assert abs(rows[name]["first_loss"] - rows[name + "_summed"]["first_loss"]) < 1e-5
        assert rows[name + "_summed"]["ratio_to_tiled"] > 0


def test_adaptive_jax_benchmark_smoke(tmp_path):
    """bench_adaptive_jax.py at a tiny size: both heads' loss (the same),
    compiled memory and interleaved times."""
    pytest.importorskip("jax")
    out = tmp_path / "adaptive_jax.json"
    _run("bench_adaptive_jax.py", "--vocab_sizes=2000", "--tokens=64", "--dim=16",
         "--rounds=2", "--chunk_size=256", f"--out={out}", timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["chunked"]["loss"] == pytest.approx(row["whole"]["loss"], rel=1e-5)
    for name in ("whole", "chunked"):
        assert len(row[name]["wall_s"]) == 2 and row[name]["temp_mib"] >= 0, row
    assert row["ratio"] > 0 and row["cutoffs"] == [40, 200, 1000], row


def test_adaptive_torch_benchmark_smoke(tmp_path):
    """bench_adaptive_torch.py at a tiny size: our layer on the PyTorch
    backend (every row the same loss) beside torch's module."""
    if not _installed("torch"):
        pytest.skip("torch not installed")
    out = tmp_path / "adaptive_torch.json"
    _run("bench_adaptive_torch.py", "--vocab_sizes=2000", "--tokens=64", "--dim=16",
         "--rounds=1", "--chunk_size=256", "--no-no_bias_rows", f"--out={out}", timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["step_s"]) == {"static", "dynamic", "chunked", "torch"}, row
    ours = [row["first_loss"][k] for k in ("static", "dynamic", "chunked")]
    assert ours == pytest.approx([ours[0]] * 3, rel=1e-5), row
    assert row["over_torch"]["torch"] == 1.0


def test_adaptive_memory_benchmark_smoke(tmp_path):
    """Two small rows: XLA's planned temporaries of the static adaptive step
    and the capacities they are planned for (the property itself, blocks and
    not the batch: `test_adaptive.py`)."""
    pytest.importorskip("jax")
    out = tmp_path / "memory.json"
    _run("bench_adaptive_memory.py", "--rows=2000:64:100/500,20000:512:2000", "--dim=32",
         "--chunk_size=256", f"--out={out}", timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["vocab_size"], r["tokens"]) for r in rows] == [(2000, 64), (20000, 512)]
    for r in rows:
        assert r["temp_mib"] > 0 and len(r["capacities"]) == len(r["cutoffs"]), r
        assert all(1 <= k <= r["tokens"] for k in r["capacities"]), r
        assert r["chunk_size"] == 256, r


@pytest.mark.slow  # two fresh TensorFlow processes: 15-35 s
def test_epoch_boundary_benchmark_smoke(tmp_path):
    """`bench_epoch_boundary.py` at tiny sizes: a row with the library's
    batching (autotuning off) and one with autotuning forced on."""
    out = tmp_path / "epoch_boundary.json"
    _run("bench_epoch_boundary.py", "--kinds=stream", "--epochs=2", "--steps=3",
         "--vocab=50", f"--out={out}")
    result = json.loads(out.read_text())
    settings = {row["setting"]: row for row in result["rows"]}
    assert settings["library"]["autotune_enabled"] is False
    assert settings["autotuned"]["autotune_enabled"] is True
    for row in settings.values():
        assert len(row["epochs"]) == 2 and len(row["first_batch_s_after_first_epoch"]) == 1
    assert result["command"].startswith("python benchmarks/bench_epoch_boundary.py")
