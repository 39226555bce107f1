"""The training budget (`train_seconds`), the study presets, `training.studies`
and `examples/paper_comparisons.py`."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from keras_softmax_heads import clustering
from keras_softmax_heads import training
from keras_softmax_heads.training import studies

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(
    dataset_options=dict(vocab_size=40, num_train_tokens=3000, num_valid_tokens=400,
                         num_test_tokens=401),
    embedding_dim=8, hidden_size=8, num_layers=1, batch_size=4, bptt=6,
    steps_per_epoch=3, verbose=0, num_diagnostic_contexts=50, tensorboard=False,
)


def test_budget_stops_after_the_epoch_that_spends_it(tmp_path):
    # A budget a little above nothing: the first epoch spends it.
    config = training.get_config(**TINY, epochs=50, train_seconds=1e-3)
    results = training.train_and_evaluate(config, str(tmp_path))
    assert results["training"]["epochs"] == 1 and results["training"]["stopped_by_budget"]
    # It ends mid-epoch: the first step after the deadline.
    assert results["training"]["global_steps"] == 1 == results["history"][0]["steps"]
    assert len(results["history"]) == 1
    # The last epoch's validation is the final one (not recomputed).
    assert results["valid"]["perplexity"] == pytest.approx(
        results["history"][0]["valid_perplexity"])
    assert results["training"]["train_seconds"] == pytest.approx(
        results["history"][0]["seconds"])
    # A bigger budget resumes the run (train_seconds is resumable) and trains on.
    more = training.train_and_evaluate(config.replace(train_seconds=1e9, epochs=2),
                                       str(tmp_path))
    assert [h["epoch"] for h in more["history"]] == [1, 2]
    assert more["history"][1]["steps"] == 3 and more["training"]["global_steps"] == 4
    assert not more["training"]["stopped_by_budget"]


def test_budget_validation():
    for bad in (-1.0, True, "10"):
        with pytest.raises(ValueError, match="train_seconds"):
            training.validate_config(training.get_config(train_seconds=bad))
    assert training.validate_config(training.get_config(train_seconds=None))
    # 0: no budget, as `--train_seconds=0` says.
    assert training.get_config(train_seconds=0.0).train_seconds is None


def test_study_presets():
    chen = training.get_config("chen_ptb_ngram")
    assert (chen.model, chen.ngram_order, chen.train_seconds) == ("ngram", 6, 300.0)
    small = training.get_config("zaremba_small").to_dict()
    bottleneck = training.get_config("bottleneck_ptb_small").to_dict()
    assert {k for k in small if small[k] != bottleneck[k]} == {
        "epochs", "eval_batch_size", "eval_warmup", "jit_compile"}
    for study, spec in studies.STUDIES.items():
        for row in spec["rows"]:
            training.validate_config(studies.study_config(study, row))
    with pytest.raises(ValueError, match="Unknown study"):
        studies.study_config("nope", "softmax")
    with pytest.raises(ValueError, match="Unknown row"):
        studies.study_config("chen_ptb", "nope")
    # Chen's table: HSM with each clustering strategy.
    chen_rows = studies.STUDIES["chen_ptb"]["rows"]
    assert {opts["clustering"] for head, opts in chen_rows.values()
            if head == "hierarchical"} == set(clustering.CLUSTERING_STRATEGIES)


def test_adaptive_wikitext2_study():
    """Issue 21's study: Zaremba small on WikiText-2, equal time, three heads."""
    base = training.get_config("bottleneck_ptb_small").to_dict()
    preset = training.get_config("adaptive_wikitext2").to_dict()
    assert {k for k in base if base[k] != preset[k]} == {
        "dataset", "epochs", "lr_decay", "train_seconds"}
    assert (preset["dataset"], preset["train_seconds"], preset["jit_compile"]) == (
        "wikitext2", 1200.0, True)
    spec = studies.STUDIES["adaptive_wikitext2"]
    assert list(spec["rows"]) == ["softmax", "adaptive", "hsm"]
    config = studies.study_config("adaptive_wikitext2", "adaptive")
    assert (config.head, config.head_options) == (
        "adaptive", {"cutoffs": [2000, 10000], "factor": 4})
    assert studies.study_config("adaptive_wikitext2", "hsm").head_options == {
        "clustering": "frequency"}
    # A head_options override adds to the row's options (an A/B of one option).
    assert studies.study_config("adaptive_wikitext2", "adaptive", seed=3,
                                head_options={"factor": 2, "chunk_size": 64}).head_options == {
        "cutoffs": [2000, 10000], "factor": 2, "chunk_size": 64}
    # `0` is "no budget" / "no clipping" in an override too, as on the command
    # line (paper_comparisons.py --overrides=train_seconds=0 raised).
    config = studies.study_config("chen_ptb", "softmax", train_seconds=0, clip_norm=0,
                                  checkpoint_every=0)
    assert (config.train_seconds, config.clip_norm, config.checkpoint_every) == (None,) * 3
    training.validate_config(config)
    assert training.get_config(epochs=1).replace(clip_norm=2.0).clip_norm == 2.0
    command = studies.row_command("adaptive_wikitext2", "adaptive", "wt2", "runs/a")
    assert "--dataset=wikitext2" in command and "--preset=adaptive_wikitext2" in command
    assert "--dataset=ptb" in studies.row_command("chen_ptb", "softmax", "ptb", "runs/s")
    assert training.parse_options("cutoffs=[2000, 10000],factor=4") == {
        "cutoffs": [2000, 10000], "factor": 4}


def test_paper_comparisons_script_smoke(tmp_path):
    """The study script, one row, a few steps (the example never goes stale);
    the k-means HSM row gets its clusters from the training split, and its
    inference model the trained head's clusters."""
    out = tmp_path / "study.json"
    overrides = ("steps_per_epoch=2,epochs=2,eval_steps=2,num_diagnostic_contexts=20,"
                 "verbose=0,tensorboard=False,embedding_dim=8,hidden_size=8,batch_size=4,"
                 "eval_batch_size=4,dataset_options={'vocab_size':40,'num_train_tokens':3000,"
                 "'num_valid_tokens':400,'num_test_tokens':401}")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "paper_comparisons.py"), "--study=chen_ptb",
         "--rows=hsm_kmeans", "--dataset=synthetic", f"--runs_dir={tmp_path / 'runs'}",
         f"--out={out}", f"--overrides={overrides}"],
        capture_output=True, text=True, env=env, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(partial: eval_steps)" in proc.stdout
    summary = json.loads(out.read_text())
    assert summary["study"] == "chen_ptb" and summary["preset"] == "chen_ptb_ngram"
    assert [r["row"] for r in summary["rows"]] == ["hsm_kmeans"]
    for row in summary["rows"]:
        assert np.isfinite(row["test_perplexity"]) and row["train_seconds"] > 0
        assert row["partial_evaluation"]  # eval_steps=2: the splits' first windows
        assert len(row["valid_curve"]) == 2 and row["epochs"] == 2
        assert row["command"].startswith("python examples/train_lm.py --preset=chen_ptb_ngram")
        assert row["empirical_rank"]["rank"] >= 1
    import keras

    run = tmp_path / "runs" / "hsm_kmeans"
    trained = keras.saving.load_model(run / "model.keras")
    inference = keras.saving.load_model(run / "inference_model.keras")
    a, b = trained.head.get_config()["clusters"], inference.head.get_config()["clusters"]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert trained.head.clustering == "kmeans"


def test_run_study_keeps_rows_written_meanwhile(tmp_path, monkeypatch):
    """Rows of one study run in parallel processes (one per core) share the
    summary file: a row that another process wrote while this one trained
    is kept (the summary is re-read, under a lock, when a row is written)."""
    from keras_softmax_heads.training import loop

    out = str(tmp_path / "study.json")
    studies.write_summary(out, {"study": "chen_ptb", "rows": [{"row": "nce", "x": 1}]})

    def fake_train(config, workdir):
        # Another process finishes its row while this one trains.
        other = studies.read_summary(out)
        other["rows"].append({"row": "sampling", "x": 2})
        studies.write_summary(out, other)
        return {"row_of": workdir}

    monkeypatch.setattr(loop, "train_and_evaluate", fake_train)
    monkeypatch.setattr(studies, "summarise", lambda row, results: {"row": row})
    summary = studies.run_study("chen_ptb", "unused", str(tmp_path / "runs"), out,
                                rows=["softmax"])
    assert [r["row"] for r in summary["rows"]] == ["softmax", "sampling", "nce"]
    assert studies.read_summary(out) == summary


def test_machine_description_names_the_thread_settings(monkeypatch):
    # Equal-time rows depend on both (docs/benchmarks.md: one inter-op thread
    # adds a fixed cost to every step of `fit`), so a summary records both.
    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "1")
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "2")
    line = studies.machine_description()
    assert "TF_NUM_INTRAOP_THREADS=1" in line and "TF_NUM_INTEROP_THREADS=2" in line
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS")
    monkeypatch.delenv("TF_NUM_INTEROP_THREADS")
    assert "TF_NUM" not in studies.machine_description()
