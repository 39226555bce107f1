"""The papers' head comparisons as named studies of `train_and_evaluate` runs.

A study is a preset (`config.PRESETS`: the backbone, data and protocol every
row shares) and rows (a head and its options). `run_study` trains the rows
one after the other, each in its own work directory (so an interrupted study
resumes row by row, and a finished row is not trained again), and rewrites a
JSON summary after every row, so finished rows are kept as they land.
Each row records the `examples/train_lm.py` command that reruns it alone.

Studies:

* `chen_ptb`: Chen, Grangier and Auli (2016), Table 2 / Figure 2: the PTB
  6-gram NNLM, every head trained for the same wall-clock budget; the
  hierarchical softmax once per clustering strategy.
* `bottleneck_ptb`: the softmax-bottleneck heads (Yang et al. 2018, Kanai et
  al. 2018, Ganea et al. 2019) on the Zaremba-small LSTM, equal epochs.
* `adaptive_wikitext2`: the adaptive softmax (Grave et al. 2017) against the
  full and the hierarchical softmax on WikiText-2, equal training time.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex

from keras_softmax_heads.training.config import get_config
from keras_softmax_heads.training.records import read_json
from keras_softmax_heads.training.records import write_json

#: Study name -> {"preset", "paper", "rows": {row name: (head, head options)}}.
STUDIES = {
    "chen_ptb": {
        "preset": "chen_ptb_ngram",
        "paper": "Chen, Grangier, Auli (2016), Table 2 and Figure 2 (PTB)",
        "rows": {
            "softmax": ("full_softmax", {}),
            "d_softmax": ("differentiated", {}),
            "sampling": ("sampled_softmax", {"num_sampled": 1024}),
            "hsm_random": ("hierarchical", {"clustering": "random"}),
            "hsm_frequency": ("hierarchical", {"clustering": "frequency"}),
            "hsm_kmeans": ("hierarchical", {"clustering": "kmeans"}),
            "hsm_weighted_kmeans": ("hierarchical", {"clustering": "weighted_kmeans"}),
            "nce": ("nce", {"num_sampled": 1024}),
            "weaknorm": ("self_normalized", {"variant": "weaknorm"}),
            "weaknorm_sq": ("self_normalized", {"variant": "weaknorm_sq"}),
        },
    },
    "bottleneck_ptb": {
        "preset": "bottleneck_ptb_small",
        "paper": "Yang et al. (2018), Kanai et al. (2018), Ganea et al. (2019) (PTB)",
        "rows": {
            # Cheapest first: the slowest (MonotonicSoftmax, ~8x a softmax
            # step at the head) comes last.
            "softmax": ("full_softmax", {}),
            "sigsoftmax": ("sigsoftmax", {}),
            "plif": ("plif", {}),
            "moc": ("mixture_of_contexts", {}),
            "mos": ("mixture_of_softmaxes", {}),
            "moss": ("mixture_of_softmaxes", {"component": "sigsoftmax"}),
            "mos_plif": ("mixture_of_softmaxes", {"num_knots": 100000}),
            "monotonic": ("monotonic", {}),
        },
    },
}
# Issue 19's converged comparisons: the same rows on longer schedules, and a
# second seed of softmax, sigsoftmax, PLIF and MoS (a row's optional third
# element holds `TrainConfig` overrides).
STUDIES["bottleneck_ptb_converged"] = {
    "preset": "bottleneck_ptb_converged",
    "paper": STUDIES["bottleneck_ptb"]["paper"],
    "rows": dict(
        STUDIES["bottleneck_ptb"]["rows"],
        **{f"{row}_seed1": STUDIES["bottleneck_ptb"]["rows"][row] + ({"seed": 1},)
           for row in ("softmax", "sigsoftmax", "plif", "mos")}),
}
STUDIES["bottleneck_ptb_regularized"] = {
    "preset": "bottleneck_ptb_regularized",
    "paper": STUDIES["bottleneck_ptb"]["paper"],
    "rows": dict(STUDIES["bottleneck_ptb"]["rows"]),
}
STUDIES["chen_ptb_long"] = {
    "preset": "chen_ptb_ngram_long",
    "paper": STUDIES["chen_ptb"]["paper"],
    "rows": dict(STUDIES["chen_ptb"]["rows"]),
}

# Issue 21: Grave et al. (2017) on WikiText-2 (V = 33,278): cutoffs [2000,
# 10000] (a head of the 2000 most frequent words, two tails), factor 4.
STUDIES["adaptive_wikitext2"] = {
    "preset": "adaptive_wikitext2",
    "paper": "Grave, Joulin, Cissé, Grangier, Jégou (2017) (WikiText-2, equal time)",
    "dataset": "wikitext2",
    "rows": {
        "softmax": ("full_softmax", {}),
        "adaptive": ("adaptive", {"cutoffs": [2000, 10000], "factor": 4}),
        "hsm": ("hierarchical", {"clustering": "frequency"}),
    },
}


def study_config(study, row, **overrides):
    """The `TrainConfig` of `row` of `study` (`overrides` last; a
    `head_options` override is merged into the row's head options)."""
    spec = _study(study)
    if row not in spec["rows"]:
        raise ValueError(
            f"Unknown row of study {study!r}. Expected one of {sorted(spec['rows'])}. "
            f"Received: row={row!r}"
        )
    head, options, *fields = spec["rows"][row]
    fields = dict(fields[0]) if fields else {}
    options = dict(options, **overrides.pop("head_options", None) or {})
    fields.update(overrides)
    return get_config(spec["preset"], head=head, head_options=options, **fields)


def row_command(study, row, data_dir, model_dir, dataset=None):
    """The `examples/train_lm.py` command line that trains `row` alone
    (`dataset`: default the study's corpus, PTB unless it names another)."""
    spec = _study(study)
    head, options, *fields = spec["rows"][row]
    dataset = dataset or spec.get("dataset", "ptb")
    args = ["python", "examples/train_lm.py", f"--preset={spec['preset']}",
            f"--dataset={dataset}", f"--data_dir={data_dir}", f"--head={head}"]
    if options:
        args.append("--head_options=" + ",".join(f"{k}={v}" for k, v in options.items()))
    for name, value in (fields[0] if fields else {}).items():
        args.append(f"--{name}={value}")
    args.append(f"--model_dir={model_dir}")
    return " ".join(shlex.quote(a) for a in args)


#: The training loops a study can run its rows with (`run_study(loop=...)`).
LOOPS = ("tf_data", "arrays")


def run_study(study, data_dir, runs_dir, out, rows=None, dataset="ptb", loop="tf_data",
              **overrides):
    """Trains the `rows` of `study` (all by default) and writes `out`.

    Args:
        study: a key of `STUDIES`.
        data_dir: the corpus directory (`load_dataset(dataset, data_dir)`).
        runs_dir: each row runs in `runs_dir/<row>` (resumed if unfinished,
            skipped if finished with the same settings).
        out: the JSON summary, rewritten after every row; rows already in it
            that are not rerun are kept.
        rows: row names (default: all, in the study's order).
        dataset: the corpus name (tests use `"synthetic"`).
        loop: `"tf_data"` (`train_and_evaluate`, TensorFlow's input
            pipeline) or `"arrays"` (`train_and_evaluate_arrays`: LSTM
            studies on any backend without TensorFlow, e.g. JAX on a GPU).
        **overrides: `TrainConfig` fields applied to every row (smoke runs).

    Returns:
        The summary dict written to `out`.
    """
    spec = _study(study)
    if loop not in LOOPS:
        raise ValueError(f"Unknown loop. Expected one of {LOOPS}. Received: loop={loop!r}")
    if loop == "arrays":
        from keras_softmax_heads.training.array_loop import train_and_evaluate_arrays as train
    else:
        from keras_softmax_heads.training.loop import train_and_evaluate as train
    rows = list(spec["rows"]) if rows is None else list(rows)
    for row in rows:
        study_config(study, row)  # unknown rows fail before any training
    header = {
        "study": study, "paper": spec["paper"], "preset": spec["preset"],
        "machine": machine_description(), "dataset": dataset,
    }
    summary = None
    for row in rows:
        config = study_config(study, row, dataset=dataset, data_dir=data_dir, **overrides)
        workdir = os.path.join(runs_dir, row)
        results = train(config, workdir)
        entry = summarise(row, results)
        entry["command"] = row_command(study, row, data_dir, workdir, dataset)
        entry["loop"] = loop
        if overrides:
            entry["overrides"] = dict(overrides)
        # Re-read at write time: other processes (one per core) may have
        # added their rows to `out` while this one trained.
        summary = _add_rows(out, header, [entry])
    return summary if summary is not None else _add_rows(out, header, [])


def merge_summaries(out, parts):
    """Merges study summaries `parts` (paths; e.g. one per row run in its
    own process) into the summary at `out`, which is rewritten.

    A row in a part replaces the row of the same name in `out`; the rows
    keep their study's order. Parts that are absent are skipped. Returns
    the merged summary.
    """
    header, entries = {}, []
    for path in parts:
        part = read_summary(path)
        if part is None:
            continue
        header.update({k: v for k, v in part.items() if k != "rows"})
        entries += part.get("rows", [])
    return _add_rows(out, header, entries)


def _add_rows(out, header, entries):
    """Reads the summary at `out`, updates its `header` fields, puts the row
    summaries `entries` into it and writes it back, under an exclusive lock
    on `out + ".lock"` (POSIX `fcntl`; without it, unlocked), so that rows
    written by concurrent processes are kept. Returns the summary."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        fcntl = None
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".lock", "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            summary = read_summary(out) or {}
            summary.update(header)
            summary.setdefault("rows", [])
            if "study" in summary:
                _put_rows(summary, entries)
            write_summary(out, summary)
        finally:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return summary


def _put_rows(summary, entries):
    """Puts row summaries `entries` into `summary["rows"]` (replacing rows
    of the same name), in the order of `summary["study"]`'s rows; rows the
    study does not have come last, by name."""
    order = list(_study(summary["study"])["rows"])
    rows = {r["row"]: r for r in summary.get("rows", [])}
    rows.update({r["row"]: r for r in entries})
    summary["rows"] = sorted(rows.values(), key=lambda r: (
        order.index(r["row"]) if r["row"] in order else len(order), r["row"]))


def summarise(row, results):
    """The summary row of one run's `results.json` contents."""
    history = results.get("history", [])
    elapsed, curve = 0.0, []
    for entry in history:
        elapsed += entry["seconds"]
        if "valid_perplexity" in entry:
            curve.append({"epoch": entry["epoch"], "train_seconds": elapsed,
                          "valid_perplexity": entry["valid_perplexity"],
                          "train_loss": entry.get("train_loss")})
    training = results.get("training", {})
    diagnostics = results.get("diagnostics", {})
    config = results["config"]
    return {
        "row": row,
        "head": config["head"],
        "head_options": config["head_options"],
        "seed": config.get("seed"),
        "test_perplexity": results["test"]["perplexity"],
        "valid_perplexity": results["valid"]["perplexity"],
        # Evaluated on the splits' first windows only (`eval_steps`): not the
        # split's perplexity.
        "partial_evaluation": bool(results["test"].get("partial")
                                   or results["valid"].get("partial")),
        "num_parameters": results["model"]["num_parameters"],
        "epochs": training.get("epochs"),
        "global_steps": training.get("global_steps"),
        "train_seconds": float(sum(e["seconds"] for e in history)),
        "seconds_per_epoch": (float(sum(e["seconds"] for e in history)) / len(history)
                              if history else None),
        "steps_per_second": training.get("steps_per_second"),
        "examples_per_second": (training["steps_per_second"] * config["batch_size"]
                                if training.get("steps_per_second") else None),
        "valid_curve": curve,
        "empirical_rank": diagnostics.get("empirical_rank"),
        "entropy_per_frequency_band": diagnostics.get("entropy_per_frequency_band"),
        "backend": results["model"].get("backend"),
        "device": results["model"].get("device", "cpu"),
        "workdir": results.get("workdir"),
    }


def machine_description():
    """A one-line description of this machine (CPU model, cores, OS)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = "".join(f"; {name}={os.environ[name]}" for name in (
        "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS") if os.environ.get(name))
    return (f"{cpu}; {cores} core(s) available to the process" + threads
            + f"; {platform.system()} {platform.release()}; "
            + datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))


def _study(study):
    if study not in STUDIES:
        raise ValueError(f"Unknown study. Expected one of {sorted(STUDIES)}. Received: study={study!r}")
    return STUDIES[study]


def read_summary(path):
    """The JSON at `path`, or None when it is absent or unreadable."""
    return read_json(path)


def write_summary(path, summary):
    """Writes `summary` to `path` as JSON, atomically (a temporary file, then a rename)."""
    write_json(path, summary)
