r"""Runs one of the papers' head comparisons (a study) and writes its summary.

The studies, their rows and the shared preset are defined in
`keras_softmax_heads.training.studies`; each row is one `train_and_evaluate`
run in `--runs_dir/<row>` (rerunning resumes an unfinished row and skips a
finished one), and `--out` is rewritten after every row.

    # Chen et al. (2016) Table 2 at CPU scale: 10 heads x 300 s on PTB.
    python examples/paper_comparisons.py --study=chen_ptb \
        --data_dir=/path/to/ptb --runs_dir=runs/chen_ptb \
        --out=docs/results/study_chen_ptb.json

    # The bottleneck heads on the Zaremba-small LSTM (one epoch each).
    python examples/paper_comparisons.py --study=bottleneck_ptb \
        --data_dir=/path/to/ptb --runs_dir=runs/bottleneck_ptb \
        --out=docs/results/study_bottleneck_ptb.json

    # One row.
    python examples/paper_comparisons.py --study=chen_ptb --rows=hsm_kmeans ...

    # An LSTM study without TensorFlow (JAX, e.g. on a GPU):
    KERAS_BACKEND=jax python examples/paper_comparisons.py --loop=arrays \
        --study=bottleneck_ptb_converged --data_dir=/path/to/ptb ...
"""

from absl import app
from absl import flags

from keras_softmax_heads.training import studies

_STUDY = flags.DEFINE_enum("study", None, sorted(studies.STUDIES), "The study to run.")
_ROWS = flags.DEFINE_list("rows", None, "Rows to run (default: all, in order).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "The corpus directory.")
_DATASET = flags.DEFINE_string("dataset", "ptb", "The corpus ('synthetic' for smoke runs).")
_RUNS_DIR = flags.DEFINE_string("runs_dir", "runs/study", "Work directory of the rows.")
_OUT = flags.DEFINE_string("out", "study.json", "The JSON summary (rewritten after each row).")
_LOOP = flags.DEFINE_enum(
    "loop", "tf_data", list(studies.LOOPS),
    "tf_data: train_and_evaluate (TensorFlow input pipeline); arrays: "
    "train_and_evaluate_arrays (LSTM studies on JAX or PyTorch without TensorFlow, "
    "e.g. on a GPU machine).")
_OVERRIDES = flags.DEFINE_string(
    "overrides", None, "TrainConfig fields for every row, e.g. 'steps_per_epoch=5,epochs=1' "
    "(smoke runs; the summary records them).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from keras_softmax_heads.training.config import parse_options

    summary = studies.run_study(
        _STUDY.value, _DATA_DIR.value, _RUNS_DIR.value, _OUT.value, rows=_ROWS.value,
        dataset=_DATASET.value, loop=_LOOP.value, **parse_options(_OVERRIDES.value))
    for row in summary["rows"]:
        partial = " (partial: eval_steps)" if row.get("partial_evaluation") else ""
        print(f"{row['row']:>22}: test perplexity {row['test_perplexity']:8.2f}{partial}, "
              f"{row['train_seconds']:7.1f} s of training, {row['epochs']} epoch(s)")
    print(f"Wrote {_OUT.value}")


if __name__ == "__main__":
    flags.mark_flag_as_required("study")
    app.run(main)
