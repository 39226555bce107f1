"""The seed-robustness check: does every head train under the presets?

Every row of three studies (`studies.STUDIES`: the bottleneck heads on the
Zaremba-small LSTM, the large-vocabulary heads on Chen et al.'s n-gram
model, both on PTB, and the adaptive softmax against the full and the
hierarchical softmax on WikiText-2) is trained for the same fixed number of steps on each of several
seeds, with its study's preset, and the exact validation perplexity (of the
first `eval_windows` validation windows) is taken every `eval_every` steps.
Each run is then compared with the softmax row of its study on the same
seed at the same step (`verdicts`):

* a head passes when its last validation perplexity is within `ratio`
  (1.3) times the softmax's and below `stall_fraction` (0.8) times the
  unigram perplexity of the validation split (a stalled head sits at the
  unigram level: its backbone learned nothing);
* heads trained with a non-exact objective (NCE, Weaknorm) must in addition
  stay within `nce_ratio` (1.5) of the softmax at *every* validation: their
  exact perplexity can be far worse than their loss says.

`run_check` trains the runs one after the other and rewrites its JSON after
each (a finished run is not trained again: the check resumes run by run).
`benchmarks/head_robustness.py` is the script; the `slow` test
`tests/test_robustness.py` runs it when `../shared/data` has PTB and WikiText-2.
"""

from __future__ import annotations

import math
import time

import numpy as np

from keras_softmax_heads.training import studies

#: (study, row) pairs of the check, softmax rows first (the references).
DEFAULT_ROWS = (
    ("bottleneck_ptb", "softmax"), ("bottleneck_ptb", "sigsoftmax"),
    ("bottleneck_ptb", "plif"), ("bottleneck_ptb", "monotonic"),
    ("bottleneck_ptb", "moc"), ("bottleneck_ptb", "mos"), ("bottleneck_ptb", "moss"),
    ("bottleneck_ptb", "mos_plif"),
    ("chen_ptb", "softmax"), ("chen_ptb", "nce"), ("chen_ptb", "weaknorm"),
    ("chen_ptb", "weaknorm_sq"), ("chen_ptb", "sampling"), ("chen_ptb", "d_softmax"),
    ("chen_ptb", "hsm_random"), ("chen_ptb", "hsm_frequency"), ("chen_ptb", "hsm_kmeans"),
    ("chen_ptb", "hsm_weighted_kmeans"),
    ("adaptive_wikitext2", "softmax"), ("adaptive_wikitext2", "adaptive"),
    ("adaptive_wikitext2", "hsm"),
)
#: Rows whose training objective is not the exact NLL.
INEXACT_ROWS = {("chen_ptb", "nce"), ("chen_ptb", "weaknorm"), ("chen_ptb", "weaknorm_sq"),
                ("chen_ptb", "sampling")}
#: Steps and validation interval per study (LSTM steps cost ~4x n-gram steps).
DEFAULT_STEPS = {"bottleneck_ptb": (1000, 250), "chen_ptb": (3000, 750),
                 "adaptive_wikitext2": (1000, 250)}


def run_key(study, row, seed):
    return f"{study}/{row}/seed{seed}"


def train_run(study, row, seed, data_dir, steps, eval_every, eval_windows=40,
              dataset="ptb", corpus=None, **overrides):
    """Trains one (study, row, seed) for `steps` steps; returns its record.

    The model, optimizer and data are those of `train_and_evaluate` with the
    study's preset (`builder.build_model`, `inputs.train_dataset`), run in
    one process without checkpoints; validation is exact on the first
    `eval_windows` windows of the validation split (`Evaluator.score`).
    """
    import keras
    import tensorflow as tf

    from keras_softmax_heads.data import load_dataset
    from keras_softmax_heads.training.builder import build_model
    from keras_softmax_heads.training.evaluation import Evaluator
    from keras_softmax_heads.training.inputs import train_dataset

    config = studies.study_config(study, row, seed=seed, dataset=dataset, data_dir=data_dir,
                                  verbose=0, **overrides)
    if corpus is None:
        corpus = load_dataset(config.dataset, config.data_dir)
    keras.utils.set_random_seed(seed)
    strategy = tf.distribute.get_strategy()
    model, _ = build_model(config, corpus)
    evaluator = Evaluator(config, corpus, model, strategy)
    curve, losses, done, seconds = [], [], 0, 0.0
    while done < steps:
        chunk = min(eval_every, steps - done)
        data = train_dataset(config, corpus, 0, done + chunk, done)
        start = time.time()
        history = model.fit(data, epochs=1, steps_per_epoch=chunk, verbose=0, shuffle=False)
        seconds += time.time() - start
        done += chunk
        losses.append(float(history.history["loss"][-1]))
        valid = evaluator.score(corpus.valid, eval_windows, previous=corpus.train)
        curve.append({"step": done, "train_loss": losses[-1],
                      "valid_perplexity": valid["perplexity"], "train_seconds": seconds})
    return {
        "study": study, "row": row, "seed": seed, "head": config.head,
        "head_options": dict(config.head_options), "preset": studies.STUDIES[study]["preset"],
        "steps": steps, "eval_windows": eval_windows, "curve": curve,
        "valid_perplexity": curve[-1]["valid_perplexity"],
        "seconds_per_step": seconds / steps,
        "unigram_perplexity": unigram_perplexity(corpus),
        "overrides": dict(overrides),
    }


def unigram_perplexity(corpus):
    """Perplexity of the training unigram on the validation split."""
    counts = np.asarray(corpus.vocab.counts, dtype=np.float64) + 1.0
    log_q = np.log(counts / counts.sum())
    valid = np.asarray(corpus.valid)[1:]
    return float(math.exp(-log_q[valid].mean()))


def run_check(data_dir, out, rows=DEFAULT_ROWS, seeds=(0, 1, 2), steps=None,
              eval_windows=40, dataset=None, provenance=None, **overrides):
    """Trains every (row, seed) not yet in `out` and rewrites `out` after each.

    Args:
        data_dir: the corpus directory (see `dataset`).
        out: the JSON file (`{"runs": {key: record}, ...}`).
        rows: `(study, row)` pairs.
        seeds: the seeds of every row.
        steps: `{study: (steps, eval_every)}` (default `DEFAULT_STEPS`).
        eval_windows: validation windows scored at each validation.
        dataset: the corpus of every run (`"synthetic"` for smoke runs), or
            None: each study's own (`studies.STUDIES[study]["dataset"]`,
            PTB unless it names another), loaded from `data_dir` (a corpus
            directory, or its parent holding `ptb/` and `wikitext-2/`).
        provenance: optional dict stored in every run trained by this call
            (`"provenance"`), e.g. the code's commit: runs accumulate
            across sessions and code versions.
        **overrides: `TrainConfig` fields for every run (smoke tests).

    Returns:
        The summary written to `out`, with `verdicts`.
    """
    from keras_softmax_heads.data import load_dataset

    steps = dict(DEFAULT_STEPS, **(steps or {}))
    summary = studies.read_summary(out) or {}
    summary.setdefault("runs", {})
    datasets = sorted({study_dataset(study, dataset) for study, _ in rows})
    summary.update({"machine": studies.machine_description(),
                    "dataset": datasets[0] if len(datasets) == 1 else datasets,
                    "eval_windows": eval_windows})
    corpora = {}
    for study, row in rows:
        name = study_dataset(study, dataset)
        for seed in seeds:
            key = run_key(study, row, seed)
            if key in summary["runs"]:
                continue
            if name not in corpora:
                corpora[name] = load_dataset(name, data_dir)
            n, every = steps[study]
            record = train_run(study, row, seed, data_dir, n, every, eval_windows, name,
                               corpora[name], **overrides)
            if provenance:
                record["provenance"] = dict(provenance)
            summary["runs"][key] = record
            summary["verdicts"] = verdicts(summary["runs"])
            studies.write_summary(out, summary)
    summary["verdicts"] = verdicts(summary["runs"])
    studies.write_summary(out, summary)
    return summary


def study_dataset(study, dataset=None):
    """The corpus of `study`'s runs: `dataset` if given, else the study's own
    (PTB unless it names another)."""
    return dataset or studies.STUDIES[study].get("dataset", "ptb")


def verdicts(runs, ratio=1.3, nce_ratio=1.5, stall_fraction=0.8):
    """Each run against the softmax of its study on the same seed.

    Returns:
        `{key: {"ratio", "max_ratio", "stalled", "passed"}}` for every run
        whose softmax reference is in `runs` (`ratio`: last validation
        perplexity over the softmax's; `max_ratio`: the largest over all
        validations).
    """
    out = {}
    for key, run in runs.items():
        ref = runs.get(run_key(run["study"], "softmax", run["seed"]))
        if ref is None:
            continue
        ref_curve = {p["step"]: p["valid_perplexity"] for p in ref["curve"]}
        ratios = [p["valid_perplexity"] / ref_curve[p["step"]] for p in run["curve"]
                  if p["step"] in ref_curve]
        if not ratios:
            continue
        last = run["curve"][-1]["valid_perplexity"]
        stalled = not last < stall_fraction * run["unigram_perplexity"]
        inexact = (run["study"], run["row"]) in INEXACT_ROWS
        passed = ratios[-1] <= ratio and not stalled and (not inexact or max(ratios) <= nce_ratio)
        out[key] = {"ratio": ratios[-1], "max_ratio": max(ratios), "stalled": stalled,
                    "passed": bool(passed)}
    return out
