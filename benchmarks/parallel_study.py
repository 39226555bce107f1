r"""Runs the rows of a study in parallel processes and merges their summaries.

Each row is one `examples/paper_comparisons.py --rows=<row>` process (its
log in `--runs_dir/<row>.log`, its summary in `--runs_dir/<row>.json`); when
a row finishes, its summary is merged into `--out`
(`studies.merge_summaries`). Rerunning resumes unfinished rows and skips
finished ones, as `paper_comparisons.py` does. Meant for a machine with an
accelerator, where one row does not use it fully, e.g. the bottleneck study
on a GPU with JAX and no TensorFlow:

    KERAS_BACKEND=jax XLA_PYTHON_CLIENT_PREALLOCATE=false \
    python benchmarks/parallel_study.py --study=bottleneck_ptb_converged \
        --loop=arrays --data_dir=/path/to/ptb --runs_dir=runs/converged \
        --out=docs/results/study_bottleneck_ptb_converged.json

On a CPU, `--cores` pins each row's process to one core of the list (a row
takes a free core when it starts; at most one row per core) and gives it one
TensorFlow intra-op / OpenMP thread and two inter-op threads unless the
environment sets them, so that equal-time rows get equal machines, e.g. the
WikiText-2 study on a 2-core machine:

    python benchmarks/parallel_study.py --study=adaptive_wikitext2 \
        --loop=tf_data --dataset=wikitext2 --data_dir=/path/to/wikitext-2 \
        --cores=0,1 --runs_dir=runs/wt2 --out=study_adaptive_wikitext2.json
"""

import os
import pathlib
import subprocess
import sys
import time

from absl import app
from absl import flags

from keras_softmax_heads.training import studies

REPO = pathlib.Path(__file__).resolve().parents[1]

_STUDY = flags.DEFINE_enum("study", None, sorted(studies.STUDIES), "The study.")
_ROWS = flags.DEFINE_list("rows", None, "Rows (default: all).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "The corpus directory.")
_DATASET = flags.DEFINE_string("dataset", "ptb", "The corpus.")
_RUNS_DIR = flags.DEFINE_string("runs_dir", "runs/parallel", "Rows' work directories.")
_OUT = flags.DEFINE_string("out", "study.json", "The merged JSON summary.")
_LOOP = flags.DEFINE_enum("loop", "arrays", list(studies.LOOPS), "The training loop.")
_OVERRIDES = flags.DEFINE_string("overrides", None, "TrainConfig fields for every row.")
_PROCESSES = flags.DEFINE_integer("processes", 0, "Rows at a time (0: all, or one per core of --cores).")
_CORES = flags.DEFINE_list(
    "cores", None, "CPU ids to pin rows to, one row per core at a time (default: no pinning).")

# A pinned row's threads, unless the environment sets them.
PINNED_THREADS = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
                  "OMP_NUM_THREADS": "1"}


def parse_cores(values):
    """The CPU ids of `--cores`, checked against the ones this process may use."""
    try:
        cores = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--cores takes CPU ids. Received: cores={values}")
    if len(set(cores)) != len(cores):
        raise app.UsageError(f"--cores lists a CPU twice. Received: cores={values}")
    if not hasattr(os, "sched_setaffinity"):
        raise app.UsageError("--cores needs os.sched_setaffinity (Linux).")
    unavailable = sorted(set(cores) - os.sched_getaffinity(0))
    if unavailable:
        raise app.UsageError(
            f"--cores lists CPUs this process may not use: {unavailable}. "
            f"Available: {sorted(os.sched_getaffinity(0))}")
    return cores


def row_command(row):
    """The `paper_comparisons.py` command line of one row."""
    args = [sys.executable, str(REPO / "examples" / "paper_comparisons.py"),
            f"--study={_STUDY.value}", f"--rows={row}", f"--dataset={_DATASET.value}",
            f"--runs_dir={_RUNS_DIR.value}", f"--out={os.path.join(_RUNS_DIR.value, row)}.json",
            f"--loop={_LOOP.value}"]
    if _DATA_DIR.value:
        args.append(f"--data_dir={_DATA_DIR.value}")
    if _OVERRIDES.value:
        args.append(f"--overrides={_OVERRIDES.value}")
    return args


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    rows = _ROWS.value or list(studies.STUDIES[_STUDY.value]["rows"])
    cores = parse_cores(_CORES.value) if _CORES.value else None
    os.makedirs(_RUNS_DIR.value, exist_ok=True)
    limit = _PROCESSES.value or (len(cores) if cores else len(rows))
    if cores and limit > len(cores):
        raise app.UsageError(
            f"--processes={limit} rows at a time need as many --cores. Received: cores={cores}")
    pending, running, failed = list(rows), {}, []
    free = list(cores or [])
    start = time.time()
    while pending or running:
        while pending and len(running) < limit:
            row = pending.pop(0)
            log = open(os.path.join(_RUNS_DIR.value, f"{row}.log"), "w")
            core, env, pin = None, None, None
            if cores:
                core = free.pop(0)
                env = {**PINNED_THREADS, **os.environ}
                pin = lambda core=core: os.sched_setaffinity(0, {core})  # noqa: E731
            running[row] = (subprocess.Popen(row_command(row), stdout=log, env=env,
                                             stderr=subprocess.STDOUT, preexec_fn=pin),
                            log, core)
            print(f"{time.time() - start:7.1f} s: row {row} started"
                  + (f" on CPU {core}" if core is not None else ""), flush=True)
        time.sleep(2)
        for row, (proc, log, core) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[row]
            if core is not None:
                free.append(core)
            if proc.returncode:
                failed.append(row)
            else:
                studies.merge_summaries(
                    _OUT.value, [os.path.join(_RUNS_DIR.value, f"{row}.json")])
            print(f"{time.time() - start:7.1f} s: row {row} "
                  f"{'failed' if proc.returncode else 'done'}", flush=True)
    if failed:
        print(f"Failed rows (logs in {_RUNS_DIR.value}): {failed}")
        return 1
    print(f"Wrote {_OUT.value}")
    return 0


if __name__ == "__main__":
    flags.mark_flags_as_required(["study"])
    app.run(main)
