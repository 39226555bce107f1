r"""The seed-robustness check: every head on PTB (and WikiText-2), three seeds, fixed steps.

Each row of the three studies trains for a fixed number of steps under its
study's preset (bottleneck heads: Zaremba small, 1000 steps, validated every
250; large-vocabulary heads: Chen et al.'s n-gram model, 3000 steps, every
750; the adaptive softmax on WikiText-2: Zaremba small, 1000 steps, every
250), on seeds 0, 1 and 2, and is compared with the softmax of its study on
the same seed at the same step (`keras_softmax_heads.training.robustness`).
A finished run is not trained again: rerunning resumes the check.

    python benchmarks/head_robustness.py --data_dir=../shared/data \
        --out=docs/results/head_robustness.json
    python benchmarks/head_robustness.py --rows=bottleneck_ptb/mos --seeds=0 ...
"""

import os

from absl import app
from absl import flags

_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "The corpora's directory (holding ptb/ and wikitext-2/), or one corpus's.")
_OUT = flags.DEFINE_string("out", "docs/results/head_robustness.json", "The JSON results.")
_ROWS = flags.DEFINE_list("rows", None, "study/row pairs (default: all of the check's).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of every row.")
_EVAL_WINDOWS = flags.DEFINE_integer("eval_windows", 40, "Validation windows per validation.")
_DATASET = flags.DEFINE_string(
    "dataset", None, "The corpus of every run ('synthetic' for smoke runs; default: each "
    "study's own, PTB or WikiText-2).")
_STEPS = flags.DEFINE_integer(
    "steps", None, "Steps of every run, validated halfway and at the end (smoke runs; "
    "default: 1000 for the LSTM rows, 3000 for the n-gram rows).")


def code_provenance():
    """`{"commit": ..., "dirty": bool}` of this checkout (empty without git)."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--", "keras_softmax_heads"))}
    except (OSError, subprocess.CalledProcessError):
        return {}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from keras_softmax_heads.training import robustness

    rows = robustness.DEFAULT_ROWS
    if _ROWS.value:
        rows = tuple(tuple(r.split("/", 1)) for r in _ROWS.value)
    steps = None
    if _STEPS.value:
        steps = {study: (_STEPS.value, max(1, _STEPS.value // 2))
                 for study in robustness.DEFAULT_STEPS}
    summary = robustness.run_check(_DATA_DIR.value, _OUT.value, rows=rows,
                                   seeds=[int(s) for s in _SEEDS.value], steps=steps,
                                   eval_windows=_EVAL_WINDOWS.value, dataset=_DATASET.value,
                                   provenance=code_provenance())
    for key, verdict in sorted(summary["verdicts"].items()):
        run = summary["runs"][key]
        print(f"{key:>32}: valid ppl {run['valid_perplexity']:8.1f}, "
              f"{verdict['ratio']:.2f}x softmax (max {verdict['max_ratio']:.2f}x)"
              f"{', STALLED' if verdict['stalled'] else ''}: "
              f"{'pass' if verdict['passed'] else 'FAIL'}")
    print(f"Wrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
