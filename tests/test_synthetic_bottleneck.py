"""The synthetic softmax-bottleneck experiment (Ganea et al. 2019, §5.1)."""

import csv
import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from keras_softmax_heads.experiments import synthetic

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "examples" / "synthetic_bottleneck.py"

_HEAD_MODULES = {
    "softmax": "keras_softmax_heads.heads.full_softmax",
    "mos": "keras_softmax_heads.heads.mixture_of_softmaxes",
    "lms": "keras_softmax_heads.heads.monotonic_softmax",
    "plif": "keras_softmax_heads.heads.plif_softmax",
    "sigsoftmax": "keras_softmax_heads.heads.sig_softmax",
}


def _available_models():
    return [
        name
        for name in synthetic.MODEL_NAMES
        if importlib.util.find_spec(_HEAD_MODULES[name]) is not None
    ]


# --------------------------------------------------------------- the problem
def test_dirichlet_problem_is_deterministic_and_normalised():
    p = synthetic.dirichlet_problem(200, 30, alpha=0.1, seed=3)
    assert p.shape == (200, 30) and p.dtype == np.float64
    assert np.all(p >= 0)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(p, synthetic.dirichlet_problem(200, 30, alpha=0.1, seed=3))
    assert not np.allclose(p, synthetic.dirichlet_problem(200, 30, alpha=0.1, seed=4))
    # Sequence seeds (as used per vocabulary size) are deterministic too.
    np.testing.assert_array_equal(
        synthetic.dirichlet_problem(5, 30, 0.1, seed=(0, 30)),
        synthetic.dirichlet_problem(5, 30, 0.1, seed=(0, 30)),
    )


def test_dirichlet_concentration_controls_sparsity():
    sparse = synthetic.dirichlet_problem(2000, 50, alpha=0.1, seed=0)
    flat = synthetic.dirichlet_problem(2000, 50, alpha=10.0, seed=0)
    # Symmetric prior: every word has expected probability 1/M.
    np.testing.assert_allclose(sparse.mean(0), 1 / 50, atol=0.01)
    assert sparse.max(-1).mean() > 0.3 > 0.1 > flat.max(-1).mean()
    assert synthetic.mean_entropy(sparse) < synthetic.mean_entropy(flat) < np.log(50)
    # Tiny alpha: entries may underflow to 0 but rows stay normalised, no NaN.
    tiny = synthetic.dirichlet_problem(100, 10, alpha=1e-3, seed=0)
    assert np.isfinite(tiny).all()
    np.testing.assert_allclose(tiny.sum(-1), 1.0, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_contexts": 0}, "num_contexts=0"),
        ({"vocab_size": 1}, "vocab_size=1"),
        ({"alpha": 0.0}, "alpha=0.0"),
        ({"alpha": float("inf")}, "alpha=inf"),
    ],
)
def test_dirichlet_problem_rejects_bad_arguments(kwargs, match):
    args = {"num_contexts": 4, "vocab_size": 5, "alpha": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        synthetic.dirichlet_problem(**args)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"models": ("softmax", "nope")}, "nope"),
        ({"models": ()}, "models"),
        ({"dims": (2, 0)}, "dims=0"),
        ({"vocab_sizes": (1,)}, "vocab_sizes"),
        ({"epochs": 0}, "epochs=0"),
        ({"batch_size": -1}, "batch_size=-1"),
        ({"learning_rate": 0.0}, "learning_rate=0.0"),
        ({"alpha": -1.0}, "alpha=-1.0"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        synthetic.SyntheticBottleneckConfig(**kwargs)


def test_config_normalises_sequences():
    config = synthetic.SyntheticBottleneckConfig(models="softmax", dims=[4], vocab_sizes=7)
    assert config.models == ("softmax",) and config.dims == (4,)
    assert config.vocab_sizes == (7,) and config.num_runs == 1
    assert synthetic.SyntheticBottleneckConfig(**config.to_dict()) == config


# ------------------------------------------------------------------ training
@pytest.mark.multibackend
def test_softmax_without_bottleneck_fits_exactly():
    """With D >= M - 1 Linear-Softmax can represent any P*: KL -> ~0."""
    probs = synthetic.dirichlet_problem(64, 5, alpha=0.5, seed=0)
    config = synthetic.SyntheticBottleneckConfig(
        models=("softmax",), dims=(8,), vocab_sizes=(5,), epochs=300, learning_rate=0.05
    )
    row = synthetic.fit_and_score("softmax", probs, 8, config)
    assert set(row) == set(synthetic.CSV_COLUMNS)
    assert row["KL"] < 0.02, row
    assert row["mode_matching"] == 1.0, row


@pytest.mark.multibackend
def test_minibatch_training_runs():
    probs = synthetic.dirichlet_problem(50, 6, alpha=0.5, seed=0)
    config = synthetic.SyntheticBottleneckConfig(
        models=("softmax",), dims=(2,), vocab_sizes=(6,), epochs=3, batch_size=16
    )
    row = synthetic.fit_and_score("softmax", probs, 2, config)
    assert row["N"] == 50 and row["epochs"] == 3 and np.isfinite(row["KL"])
    assert row["KL"] >= 0.0


def test_streamed_data_and_sliced_scoring_agree(monkeypatch):
    """The paths for problems too big for one graph constant / one slice."""
    probs = synthetic.dirichlet_problem(40, 6, alpha=0.5, seed=0)
    config = synthetic.SyntheticBottleneckConfig(
        models=("softmax",), dims=(3,), vocab_sizes=(6,), epochs=20
    )
    reference = synthetic.fit_and_score("softmax", probs, 3, config)
    monkeypatch.setattr(synthetic, "_MAX_CONSTANT_BYTES", 0)
    monkeypatch.setattr(synthetic, "_EVAL_BATCH", 7)
    streamed = synthetic.fit_and_score("softmax", probs, 3, config)
    assert streamed["KL"] == pytest.approx(reference["KL"], rel=1e-4)
    assert streamed["mode_matching"] == reference["mode_matching"]
    minibatch = synthetic.fit_and_score(
        "softmax", probs, 3, synthetic.SyntheticBottleneckConfig(
            models=("softmax",), dims=(3,), vocab_sizes=(6,), epochs=2, batch_size=16)
    )
    assert np.isfinite(minibatch["KL"])


def test_plot_and_csv_round_trip(tmp_path):
    rows = [
        {"model": m, "D": d, "M": v, "alpha": 0.1, "N": 10, "KL": kl,
         "mode_matching": 0.5, "epochs": 1, "seconds": 0.1}
        for m, kl in (("softmax", 1.0), ("mos", 0.5))
        for d in (2, 4)
        for v in (10, 20)
    ]
    path = tmp_path / "r.csv"
    synthetic.write_csv(rows, path)
    assert synthetic.read_csv(path) == rows
    fig = synthetic.plot_results(rows, "KL", tmp_path / "kl.png")
    assert len(fig.axes) == 2
    assert (tmp_path / "kl.png").stat().st_size > 0
    table = synthetic.format_table(rows)
    assert "softmax" in table and len(table.splitlines()) == 5
    with pytest.raises(ValueError, match="metric"):
        synthetic.plot_results(rows, "accuracy")


# ------------------------------------------------------------- the script
@pytest.mark.slow
def test_script_tiny_run_writes_csv_and_figures(tmp_path):
    models = _available_models()
    workdir = tmp_path / "run"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            f"--workdir={workdir}",
            f"--models={','.join(models)}",
            "--num_contexts=100",
            "--vocab_sizes=20",
            "--dims=2",
            "--epochs=5",
            "--plif_knots=50",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    with open(workdir / synthetic.CSV_NAME, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == synthetic.CSV_COLUMNS
        rows = list(reader)
    assert [r["model"] for r in rows] == models
    for row in rows:
        assert (row["D"], row["M"], row["N"], row["epochs"]) == ("2", "20", "100", "5")
        assert float(row["KL"]) >= 0.0 and np.isfinite(float(row["KL"]))
        assert 0.0 <= float(row["mode_matching"]) <= 1.0
    for name in (synthetic.MODE_MATCHING_PNG, synthetic.KL_PNG):
        png = (workdir / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (workdir / "config.json").is_file()
