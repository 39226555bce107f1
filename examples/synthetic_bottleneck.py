r"""The synthetic softmax-bottleneck experiment of Ganea et al. (2019, §5.1).

N contexts with Dirichlet(alpha) true next-word distributions over M words;
one free D-dimensional vector per context, shared word embeddings, and a head
(Linear-Softmax, MoS, LMS, PLIF, sigsoftmax) fitted by minimising the
cross-entropy to the true distributions. Writes `synthetic_bottleneck.csv`
(model, D, M, alpha, N, KL, mode_matching, epochs, seconds) and the figures
`mode_matching.png` / `kl_divergence.png` (the paper's figures 2 and 3) to
--workdir. The logic lives in `keras_softmax_heads.experiments.synthetic`.

Default grid (a few minutes on 2 CPU cores):

    python examples/synthetic_bottleneck.py

A tiny smoke run:

    python examples/synthetic_bottleneck.py --num_contexts=100 \
        --vocab_sizes=20 --dims=2 --epochs=20 --workdir=/tmp/synth

The paper's scale (N = 10^5 contexts; needs a GPU and N * M * 4 bytes of
memory for the true distributions, plus the heads' activations):

    python examples/synthetic_bottleneck.py --paper --workdir=runs/synth_paper
"""

import datetime
import functools
import json
import os
import platform
import shlex
import sys

from absl import app
from absl import flags

from keras_softmax_heads.experiments import synthetic

_DEFAULTS = synthetic.SyntheticBottleneckConfig()

_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/synthetic_bottleneck", "Output directory (CSV, PNGs, config.json)."
)
_MODELS = flags.DEFINE_list(
    "models",
    list(_DEFAULTS.models),
    f"Models to fit, among {list(synthetic.MODEL_NAMES)}.",
)
_DIMS = flags.DEFINE_list("dims", [str(d) for d in _DEFAULTS.dims], "Embedding sizes D.")
_VOCAB_SIZES = flags.DEFINE_list(
    "vocab_sizes", [str(m) for m in _DEFAULTS.vocab_sizes], "Vocabulary sizes M."
)
_ALPHA = flags.DEFINE_float("alpha", _DEFAULTS.alpha, "Dirichlet concentration.")
_NUM_CONTEXTS = flags.DEFINE_integer(
    "num_contexts", _DEFAULTS.num_contexts, "Number of contexts N (paper: 100000)."
)
_EPOCHS = flags.DEFINE_integer(
    "epochs", _DEFAULTS.epochs, "Passes over the N contexts (full-batch: Adam steps)."
)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 0, "Contexts per Adam step; 0 for full-batch training."
)
_LEARNING_RATE = flags.DEFINE_float("learning_rate", _DEFAULTS.learning_rate, "Adam learning rate.")
_MOS_COMPONENTS = flags.DEFINE_integer(
    "mos_components", _DEFAULTS.mos_components, "Mixture components of MoS."
)
_LMS_UNITS = flags.DEFINE_integer(
    "lms_units", _DEFAULTS.lms_units, "Hidden units K of the LMS monotonic MLP (eq. 14)."
)
_PLIF_KNOTS = flags.DEFINE_integer("plif_knots", _DEFAULTS.plif_knots, "PLIF intervals K.")
_PLIF_BOUND = flags.DEFINE_float("plif_bound", _DEFAULTS.plif_bound, "PLIF knot range T.")
_NO_BIAS = flags.DEFINE_bool("no_bias", False, "Heads without a per-word bias.")
_JIT = flags.DEFINE_enum("jit_compile", "auto", ["auto", "true", "false"], "XLA compilation.")
_SEED = flags.DEFINE_integer("seed", _DEFAULTS.seed, "Seed (data and initialisation).")
_PAPER = flags.DEFINE_bool(
    "paper",
    False,
    "Paper scale: N=100000 contexts, 1000 full-batch epochs, "
    "M in {100, 1000, 10000}, D in {2, 4, ..., 256} (flags given explicitly "
    "still win; the paper's exact grid of D and M is not in its text). "
    "Full-batch MoS/LMS at M=10000 hold N*M*K activations: add "
    "--batch_size=10000 where memory is short.",
)

_PAPER_SETTINGS = {
    "num_contexts": 100_000,
    "epochs": 1000,
    "vocab_sizes": (100, 1000, 10_000),
    "dims": (2, 4, 8, 16, 32, 64, 128, 256),
}


def _config_from_flags():
    values = {
        "models": tuple(_MODELS.value),
        "dims": tuple(int(d) for d in _DIMS.value),
        "vocab_sizes": tuple(int(m) for m in _VOCAB_SIZES.value),
        "alpha": _ALPHA.value,
        "num_contexts": _NUM_CONTEXTS.value,
        "epochs": _EPOCHS.value,
        "batch_size": _BATCH_SIZE.value or None,
        "learning_rate": _LEARNING_RATE.value,
        "mos_components": _MOS_COMPONENTS.value,
        "lms_units": _LMS_UNITS.value,
        "plif_knots": _PLIF_KNOTS.value,
        "plif_bound": _PLIF_BOUND.value,
        "use_bias": not _NO_BIAS.value,
        "jit_compile": {"auto": "auto", "true": True, "false": False}[_JIT.value],
        "seed": _SEED.value,
    }
    if _PAPER.value:
        for name, value in _PAPER_SETTINGS.items():
            if not flags.FLAGS[name].present:
                values[name] = value
    return synthetic.SyntheticBottleneckConfig(**values)


def _flag_args():
    """This script's flags given on the command line, as `--name=value` strings."""
    own = flags.FLAGS.get_flags_for_module(sys.argv[0])
    return [shlex.quote(flag.serialize()) for flag in sorted(own, key=lambda f: f.name)
            if flag.present]


def _machine():
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}; {cores} core(s); {platform.system()} {platform.release()}; " + \
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = _config_from_flags()
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(os.path.join(_WORKDIR.value, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)
    # What produced the results (docs/results.md cites it).
    with open(os.path.join(_WORKDIR.value, "run.json"), "w") as f:
        json.dump({"command": " ".join(["python", "examples/synthetic_bottleneck.py"]
                                       + _flag_args()),
                   "machine": _machine()}, f, indent=2)
    log = functools.partial(print, flush=True)
    rows = synthetic.run_synthetic_bottleneck(config, _WORKDIR.value, log=log)
    log(synthetic.format_table(rows))


if __name__ == "__main__":
    app.run(main)
