"""The `--backend` flag and the other shared flags of the benchmark scripts
(imports no Keras).

A script parses its flags, then calls `use(backend)` before anything imports
Keras: it sets `KERAS_BACKEND`, which the script's child processes inherit
(and are also given as `--backend`). Each backend has its own compilation
modes (`MODES`); `TF_MODE` names the TensorFlow mode a mode is compared with
when ratios of two backends are set side by side.
"""

import os
import sys

BACKENDS = ("tensorflow", "jax", "torch")

# Compilation modes of each backend, what `steps.py` builds for them:
#   graph:   tf.function (TensorFlow's graph mode, no XLA);
#   xla:     tf.function(jit_compile=True) / jax.jit;
#   eager:   op by op (JAX without jax.jit; PyTorch's default);
#   compile: torch.compile (PyTorch's compiler, inductor on CPU).
MODES = {
    "tensorflow": ("graph", "xla"),
    "jax": ("xla", "eager"),
    "torch": ("eager", "compile"),
}
DEFAULT_MODES = {
    "tensorflow": ("graph", "xla"),
    "jax": ("xla",),
    "torch": ("eager",),
}
TF_MODE = {"graph": "graph", "xla": "xla", "eager": "graph", "compile": "xla"}


def default_backend():
    """`$KERAS_BACKEND` if it names a supported backend, else TensorFlow."""
    env = os.environ.get("KERAS_BACKEND", "tensorflow")
    return env if env in BACKENDS else "tensorflow"


def add_flag(parser, multiple=False):
    """Adds `--backend` to an argparse parser (a comma list if `multiple`)."""
    what = "comma-separated backends, each run in its own processes" if multiple else "backend"
    parser.add_argument(
        "--backend", type=str, default=default_backend(),
        help=f"Keras backend: {what} ({', '.join(BACKENDS)}; default $KERAS_BACKEND "
        "or tensorflow)",
    )


def add_budget_flags(parser, skipped="configurations"):
    """Adds `--time-budget` (seconds of timed calls per configuration) and
    `--memory-budget-gb` (skip `skipped` estimated above it)."""
    parser.add_argument(
        "--time-budget", type=float, default=60.0,
        help="stop repeating a configuration after this many seconds",
    )
    parser.add_argument(
        "--memory-budget-gb", type=float, default=None,
        help=f"skip {skipped} estimated above this (default: 80%% of MemAvailable)",
    )


def parse(value, parser=None, multiple=False):
    """The backend(s) named by `value`, checked; a list if `multiple`."""
    names = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in names if x not in BACKENDS]
    if bad or not names or (len(names) > 1 and not multiple):
        message = f"--backend={value!r}: expected {'a list of ' if multiple else ''}" \
            f"one of {', '.join(BACKENDS)}"
        if parser is not None:
            parser.error(message)
        raise ValueError(message)
    return names if multiple else names[0]


def modes(value, backend, parser=None):
    """The modes of `value` (a comma list; empty: the backend's defaults).

    Modes the backend does not have are left out (a script running several
    backends may name the modes of each); none left is an error.
    """
    names = [x for x in (value or "").split(",") if x] or list(DEFAULT_MODES[backend])
    unknown = [x for x in names if x not in TF_MODE]
    kept = [x for x in names if x in MODES[backend]]
    if unknown or not kept:
        message = (f"--modes={value!r}: none available on {backend} (its modes: "
                   f"{', '.join(MODES[backend])})")
        if parser is not None:
            parser.error(message)
        raise ValueError(message)
    return kept


def use(backend):
    """Sets `KERAS_BACKEND` for this process and its children.

    Raises:
        RuntimeError: Keras was already imported with another backend.
    """
    if "keras" in sys.modules:
        current = sys.modules["keras"].backend.backend()
        if current != backend:
            raise RuntimeError(
                f"Keras is already imported with backend {current!r}; cannot switch "
                f"to {backend!r}. Set --backend before importing Keras."
            )
    os.environ["KERAS_BACKEND"] = backend
