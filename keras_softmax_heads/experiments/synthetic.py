"""The synthetic softmax-bottleneck experiment (Ganea et al. 2019, section 5.1).

`N` contexts `c_j` each have a "true" next-word distribution over `M` words
drawn from a symmetric Dirichlet prior,

    P*(. | c_j) ~ Dir(alpha),    j = 1..N,

(small `alpha`: sparse distributions; large `alpha`: near uniform). A model
has one free, learnable `D`-dimensional vector per context (a
`keras.layers.Embedding` over the context ids is the whole "backbone") and a
head whose word embeddings (the `[D, M]` kernel, plus bias) are shared by all
contexts. Each model is fitted by minimising the full-distribution
cross-entropy

    loss = - mean_j sum_w P*(w | c_j) log Q(w | c_j),

which differs from the average `KL(P* || Q)` by the constant entropy of `P*`
(`keras.losses.CategoricalCrossentropy(from_logits=True)` on the head's
normalised log-probabilities computes exactly this), with Adam: full batch
by default, so `epochs` is the number of optimiser steps. Context vectors
start as `N(0, 1)` draws, the heads with their own initialisers. The fitted
models are
scored with the average KL divergence (`diagnostics.kl_divergence`) and the mode
matching rate (`diagnostics.mode_matching`, the fraction of contexts whose most
likely word is the model's most likely word), over a grid of `D` and `M`.

Because the contexts are free vectors, nothing but the head limits the fit:
a Linear-Softmax head can only produce log-probability matrices of rank
`<= D + 2`, so for `D` much smaller than `M` it cannot represent `P*`; for
`D >= M - 1` it can represent any (strictly positive) `P*`. Heads that
break the bottleneck (MoS, the learnable monotonic function "LMS" of eq. 14,
PLIF, sigsoftmax) can do better at low `D` / large `M`.

Models (the `models` names of `SyntheticBottleneckConfig`):

* `"softmax"`: `FullSoftmax`, Linear-Softmax (eq. 1).
* `"mos"`: `MixtureOfSoftmaxes(num_components=mos_components)` (Yang et al.).
* `"lms"`: `MonotonicSoftmax(num_units=lms_units)`, eq. 14 (the paper's LMS).
* `"plif"`: `PLIFSoftmax(num_knots=plif_knots, knot_bound=plif_bound)`.
* `"sigsoftmax"`: `SigSoftmax` (Kanai et al. 2018).

Heads are imported when a model that needs them is built.

Example:

>>> from keras_softmax_heads.experiments import synthetic
>>> probs = synthetic.dirichlet_problem(num_contexts=4, vocab_size=5, alpha=0.1, seed=0)
>>> probs.shape, bool(np.allclose(probs.sum(-1), 1.0))
((4, 5), True)
>>> config = synthetic.SyntheticBottleneckConfig(
...     models=("softmax",), dims=(2,), vocab_sizes=(10,), num_contexts=50, epochs=5)
>>> config.num_runs
1

References:
    - Ganea, Gelly, Becigneul, Severyn, "Breaking the Softmax Bottleneck via
      Learnable Monotonic Pointwise Non-linearities", ICML 2019, section 5.1,
      figures 2 and 3. https://arxiv.org/abs/1902.08077
"""

from __future__ import annotations

import csv
import dataclasses
import os
import time

import numpy as np

from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_positive

MODEL_NAMES = ("softmax", "mos", "lms", "plif", "sigsoftmax")

MODEL_LABELS = {
    "softmax": "Linear-Softmax",
    "mos": "MoS",
    "lms": "LMS (eq. 14)",
    "plif": "LMS-PLIF",
    "sigsoftmax": "Sigsoftmax",
}

CSV_COLUMNS = (
    "model",
    "D",
    "M",
    "alpha",
    "N",
    "KL",
    "mode_matching",
    "epochs",
    "seconds",
)

CSV_NAME = "synthetic_bottleneck.csv"
MODE_MATCHING_PNG = "mode_matching.png"
KL_PNG = "kl_divergence.png"


def _int_tuple(values, name, minimum=1):
    if isinstance(values, (int, np.integer)):
        values = (values,)
    values = tuple(values)
    if not values:
        raise ValueError(f"`{name}` must not be empty. Received: {name}={values!r}")
    return tuple(check_int(name, v, minimum=minimum) for v in values)


@dataclasses.dataclass(frozen=True)
class SyntheticBottleneckConfig:
    """Settings of `run_synthetic_bottleneck`.

    The defaults run in a few minutes on 2 CPU cores; the paper used
    `num_contexts=100_000` (see `examples/synthetic_bottleneck.py --paper`).

    Args:
        models: model names, a subset of `MODEL_NAMES`
            (`"softmax"`, `"mos"`, `"lms"`, `"plif"`, `"sigsoftmax"`).
        dims: the embedding sizes `D` (context and word vectors).
        vocab_sizes: the vocabulary sizes `M`.
        alpha: the Dirichlet concentration (the same for every word).
        num_contexts: `N`, the number of contexts (true distributions).
        epochs: passes over the `N` contexts (with `batch_size=None`: full
            batch Adam steps).
        batch_size: contexts per step; `None` for full-batch training.
        learning_rate: Adam learning rate.
        mos_components: mixture components `K` of MoS.
        lms_units: hidden units `K` of the monotonic MLP of LMS (eq. 14).
        plif_knots: intervals `K` of PLIF.
        plif_bound: PLIF knot range `T` (knots cover `[-T, T]`).
        use_bias: whether the heads have a per-word bias.
        jit_compile: `jit_compile` passed to `Model.compile`.
        seed: seed of the Dirichlet draws and of the weight initialisation.
    """

    models: tuple = ("softmax", "mos", "lms", "plif")
    dims: tuple = (2, 8, 32)
    vocab_sizes: tuple = (10, 100, 500)
    alpha: float = 0.1
    num_contexts: int = 1000
    epochs: int = 300
    batch_size: int | None = None
    learning_rate: float = 0.05
    mos_components: int = 5
    lms_units: int = 5
    plif_knots: int = 1000
    plif_bound: float = 10.0
    use_bias: bool = True
    jit_compile: bool | str = "auto"
    seed: int = 0

    def __post_init__(self):
        models = (self.models,) if isinstance(self.models, str) else tuple(self.models)
        if not models:
            raise ValueError("`models` must not be empty. Received: models=()")
        unknown = [m for m in models if m not in MODEL_NAMES]
        if unknown:
            raise ValueError(
                f"Unknown model name(s) {unknown}. Expected names in "
                f"{list(MODEL_NAMES)}. Received: models={models!r}"
            )
        object.__setattr__(self, "models", models)
        object.__setattr__(self, "dims", _int_tuple(self.dims, "dims"))
        object.__setattr__(
            self, "vocab_sizes", _int_tuple(self.vocab_sizes, "vocab_sizes", minimum=2)
        )
        check_positive("alpha", self.alpha)
        for name in ("num_contexts", "epochs", "mos_components", "lms_units", "plif_knots"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        object.__setattr__(
            self, "batch_size", check_int("batch_size", self.batch_size, minimum=1, allow_none=True)
        )
        check_positive("learning_rate", self.learning_rate)
        check_positive("plif_bound", self.plif_bound)

    @property
    def num_runs(self):
        """The number of (model, D, M) fits."""
        return len(self.models) * len(self.dims) * len(self.vocab_sizes)

    def to_dict(self):
        """The settings as a plain dict (JSON-friendly)."""
        return dataclasses.asdict(self)


def dirichlet_problem(num_contexts, vocab_size, alpha, seed=0):
    """The true next-word distributions `P*(. | c_j) ~ Dir(alpha)`, `[N, M]`.

    Args:
        num_contexts: `N`.
        vocab_size: `M`.
        alpha: the symmetric Dirichlet concentration (> 0).
        seed: anything `np.random.default_rng` accepts (an int or a sequence
            of ints); the same seed gives the same matrix.

    Returns:
        float64 array `[N, M]`, non-negative rows summing to 1. (For very
        small `alpha` some entries underflow to exactly 0.)

    Example:

    >>> p = dirichlet_problem(3, 4, alpha=1.0, seed=0)
    >>> bool(np.array_equal(p, dirichlet_problem(3, 4, alpha=1.0, seed=0)))
    True
    """
    num_contexts = check_int("num_contexts", num_contexts, minimum=1)
    vocab_size = check_int("vocab_size", vocab_size, minimum=2)
    check_positive("alpha", alpha)
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(vocab_size, float(alpha)), size=num_contexts)
    # Renormalise away the last ulp of rounding.
    return probs / probs.sum(-1, keepdims=True)


def mean_entropy(probs):
    """Average entropy (nats) of the rows of `probs` (`0 log 0 = 0`)."""
    probs = np.asarray(probs, dtype=np.float64)
    safe = np.where(probs > 0, probs, 1.0)
    return float(-np.sum(probs * np.log(safe), axis=-1).mean())


def make_head(name, vocab_size, config):
    """The output head of model `name` (see the module docstring)."""
    kwargs = {"use_bias": config.use_bias}
    if name == "softmax":
        from keras_softmax_heads.heads.full_softmax import FullSoftmax

        return FullSoftmax(vocab_size, **kwargs)
    if name == "mos":
        from keras_softmax_heads.heads.mixture_of_softmaxes import MixtureOfSoftmaxes

        return MixtureOfSoftmaxes(vocab_size, num_components=config.mos_components, **kwargs)
    if name == "lms":
        from keras_softmax_heads.heads.monotonic_softmax import MonotonicSoftmax

        return MonotonicSoftmax(vocab_size, num_units=config.lms_units, **kwargs)
    if name == "plif":
        from keras_softmax_heads.heads.plif_softmax import PLIFSoftmax

        return PLIFSoftmax(
            vocab_size,
            num_knots=config.plif_knots,
            knot_bound=config.plif_bound,
            **kwargs,
        )
    if name == "sigsoftmax":
        from keras_softmax_heads.heads.sig_softmax import SigSoftmax

        return SigSoftmax(vocab_size, **kwargs)
    raise ValueError(f"Unknown model. Expected one of {list(MODEL_NAMES)}. Received: {name!r}")


def build_model(name, num_contexts, dim, vocab_size, config):
    """Free context vectors (an `Embedding` over context ids) and a head.

    Returns:
        A `keras.Sequential` mapping int context ids `[batch]` to the head's
        log-probabilities `[batch, M]`.
    """
    import keras

    return keras.Sequential(
        [
            keras.Input(shape=(), dtype="int32"),
            keras.layers.Embedding(
                num_contexts,
                dim,
                embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0),
                name="context_vectors",
            ),
            make_head(name, vocab_size, config),
        ],
        name=f"{name}_D{dim}_M{vocab_size}",
    )


_MAX_CONSTANT_BYTES = 1 << 30
_EVAL_BATCH = 4096


def _dataset(probs, batch_size, seed):
    import tensorflow as tf

    num_contexts = len(probs)
    ids = np.arange(num_contexts, dtype=np.int32)
    probs = probs.astype(np.float32)
    if batch_size is None or batch_size >= num_contexts:
        batch_size = num_contexts
    steps = -(-num_contexts // batch_size)
    if steps == 1 and probs.nbytes <= _MAX_CONSTANT_BYTES:
        return tf.data.Dataset.from_tensors((ids, probs)).repeat(), 1
    if probs.nbytes > _MAX_CONSTANT_BYTES:
        # Too big for a graph constant (2 GB limit): stream from NumPy.
        def batches():
            rng = np.random.default_rng(seed)
            while True:
                order = rng.permutation(num_contexts) if steps > 1 else ids
                for i in range(steps):
                    sel = np.sort(order[i * batch_size : (i + 1) * batch_size])
                    yield ids[sel], probs[sel]

        spec = (
            tf.TensorSpec([None], tf.int32),
            tf.TensorSpec([None, probs.shape[1]], tf.float32),
        )
        return tf.data.Dataset.from_generator(batches, output_signature=spec), steps
    ds = tf.data.Dataset.from_tensor_slices((ids, probs))
    ds = ds.shuffle(num_contexts, seed=seed, reshuffle_each_iteration=True)
    return ds.batch(batch_size).repeat(), steps


def fit_and_score(name, probs, dim, config, seed=0):
    """Fits model `name` with context dimension `dim` to `probs`; one CSV row.

    Args:
        name: a model name of `MODEL_NAMES`.
        probs: the `[N, M]` true distributions (`dirichlet_problem`).
        dim: `D`.
        config: a `SyntheticBottleneckConfig` (optimiser and head settings).
        seed: weight-initialisation seed.

    Returns:
        dict with the keys of `CSV_COLUMNS`: `KL` is the average
        `KL(P* || Q)` in nats, `mode_matching` the fraction of contexts
        whose modes match, `seconds` the training wall time (including
        tracing and compilation).
    """
    import keras

    from keras_softmax_heads import diagnostics

    num_contexts, vocab_size = probs.shape
    keras.utils.set_random_seed(int(seed))
    model = build_model(name, num_contexts, dim, vocab_size, config)
    model.compile(
        optimizer=keras.optimizers.Adam(config.learning_rate),
        loss=keras.losses.CategoricalCrossentropy(from_logits=True),
        jit_compile=config.jit_compile,
    )
    start = time.perf_counter()
    if keras.backend.backend() == "tensorflow":
        # tf.data: one `fit` epoch of all the steps (no per-epoch overhead).
        dataset, steps_per_epoch = _dataset(probs, config.batch_size, seed)
        total_steps = steps_per_epoch * config.epochs
        model.fit(dataset, epochs=1, steps_per_epoch=total_steps, shuffle=False, verbose=0)
    else:
        # JAX / PyTorch (TensorFlow need not be installed): NumPy arrays.
        batch_size = min(config.batch_size or num_contexts, num_contexts)
        model.fit(np.arange(num_contexts, dtype=np.int32), probs.astype(np.float32),
                  batch_size=batch_size, epochs=config.epochs,
                  shuffle=batch_size < num_contexts, verbose=0)
    seconds = time.perf_counter() - start
    # Scored in slices: never hold [N, M] float64 log-probabilities at once.
    kl_sum = mode_sum = 0.0
    for lo in range(0, num_contexts, _EVAL_BATCH):
        ids = np.arange(lo, min(lo + _EVAL_BATCH, num_contexts), dtype=np.int32)
        log_q = diagnostics.log_prob_matrix(model, ids, batch_size=_EVAL_BATCH)
        kl_sum += diagnostics.kl_divergence(probs[ids], log_q) * len(ids)
        mode_sum += diagnostics.mode_matching(probs[ids], log_q) * len(ids)
    return {
        "model": name,
        "D": int(dim),
        "M": int(vocab_size),
        "alpha": float(config.alpha),
        "N": int(num_contexts),
        "KL": kl_sum / num_contexts,
        "mode_matching": mode_sum / num_contexts,
        "epochs": int(config.epochs),
        "seconds": round(seconds, 3),
    }


def write_csv(rows, path):
    """Writes result rows (dicts with the keys of `CSV_COLUMNS`) to `path`."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row)


def read_csv(path):
    """Reads a CSV written by `write_csv` back into typed row dicts."""
    casts = {"D": int, "M": int, "N": int, "epochs": int, "alpha": float, "KL": float,
             "mode_matching": float, "seconds": float}
    with open(path, newline="") as f:
        return [
            {k: casts.get(k, str)(v) for k, v in row.items()} for row in csv.DictReader(f)
        ]


def format_table(rows):
    """A plain-text table: one line per (M, D), `KL / mode matching` per model."""
    models = [m for m in MODEL_NAMES if any(r["model"] == m for r in rows)]
    by_key = {(r["M"], r["D"], r["model"]): r for r in rows}
    header = f"{'M':>6s} {'D':>4s} " + " ".join(f"{m + ' KL/mode':>20s}" for m in models)
    lines = [header]
    for vocab_size, dim in sorted({(r["M"], r["D"]) for r in rows}):
        cells = []
        for m in models:
            r = by_key.get((vocab_size, dim, m))
            cells.append(
                f"{r['KL']:>11.4f} / {r['mode_matching']:.3f}" if r else f"{'-':>20s}"
            )
        lines.append(f"{vocab_size:>6d} {dim:>4d} " + " ".join(cells))
    return "\n".join(lines)


def plot_results(rows, metric, path=None, title=None):
    """One panel per vocabulary size `M`: `metric` against `D`, a line per model.

    The layout of Ganea et al. (2019), figures 2 (`metric="mode_matching"`,
    shown in percent) and 3 (`metric="KL"`).

    Args:
        rows: result rows (`run_synthetic_bottleneck` or `read_csv`).
        metric: `"mode_matching"` or `"KL"`.
        path: optional PNG path to save to.
        title: optional figure title.

    Returns:
        The `matplotlib.figure.Figure` (made without `pyplot`, so no display
        backend is needed).
    """
    from matplotlib.figure import Figure

    if metric not in ("mode_matching", "KL"):
        raise ValueError(f"`metric` must be 'mode_matching' or 'KL'. Received: metric={metric!r}")
    vocab_sizes = sorted({r["M"] for r in rows})
    models = [m for m in MODEL_NAMES if any(r["model"] == m for r in rows)]
    fig = Figure(figsize=(4.0 * max(1, len(vocab_sizes)), 3.4), layout="constrained")
    axes = fig.subplots(1, max(1, len(vocab_sizes)), squeeze=False)[0]
    scale = 100.0 if metric == "mode_matching" else 1.0
    for ax, vocab_size in zip(axes, vocab_sizes):
        for model in models:
            pts = sorted(
                (r["D"], r[metric] * scale)
                for r in rows
                if r["M"] == vocab_size and r["model"] == model
            )
            if pts:
                ds, values = zip(*pts)
                ax.plot(ds, values, marker="o", label=MODEL_LABELS.get(model, model))
        ax.set_xscale("log", base=2)
        dims = sorted({r["D"] for r in rows if r["M"] == vocab_size})
        ax.set_xticks(dims, [str(d) for d in dims])
        ax.minorticks_off()
        ax.set_xlabel("embedding size D")
        ax.set_title(f"M = {vocab_size}")
        ax.grid(True, alpha=0.3)
        if metric == "mode_matching":
            ax.set_ylabel("mode matching (%)")
            ax.set_ylim(-2, 102)
        else:
            ax.set_ylabel("average KL(P* || Q) (nats)")
            ax.set_ylim(bottom=0)
    axes[0].legend()
    alphas = sorted({r["alpha"] for r in rows})
    contexts = sorted({r["N"] for r in rows})
    if title is None:
        what = "Mode matching" if metric == "mode_matching" else "KL(P* || Q)"
        title = (
            f"{what}, alpha={', '.join(f'{a:g}' for a in alphas)}, "
            f"N={', '.join(map(str, contexts))}"
        )
    fig.suptitle(title, fontsize="medium")
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def run_synthetic_bottleneck(config, workdir, log=None):
    """Runs the grid of `config` and writes the CSV and the two figures.

    For every vocabulary size `M` one problem `P*` (`N` Dirichlet draws,
    seeded by `(config.seed, M)`) is shared by all models and all `D`. Every
    (`M`, `D`, model) is fitted from scratch (`fit_and_score`). The CSV is
    rewritten after every fit, so an interrupted run keeps its results.

    Args:
        config: a `SyntheticBottleneckConfig` or a dict of its fields.
        workdir: output directory (created); receives
            `synthetic_bottleneck.csv`, `mode_matching.png` and
            `kl_divergence.png`.
        log: optional callable taking a message string (default:
            `absl.logging.info`).

    Returns:
        list of dicts, the CSV rows (keys `CSV_COLUMNS`).
    """
    if isinstance(config, dict):
        config = SyntheticBottleneckConfig(**config)
    if log is None:
        from absl import logging

        log = logging.info
    workdir = os.fspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    csv_path = os.path.join(workdir, CSV_NAME)
    rows = []
    run = 0
    for vocab_size in config.vocab_sizes:
        probs = dirichlet_problem(
            config.num_contexts, vocab_size, config.alpha, seed=(config.seed, vocab_size)
        )
        entropy = mean_entropy(probs)
        log(f"M={vocab_size}: N={config.num_contexts} Dirichlet(alpha={config.alpha}) "
            f"distributions, mean entropy {entropy:.3f} nats")
        for dim in config.dims:
            for name in config.models:
                run += 1
                row = fit_and_score(name, probs, dim, config, seed=config.seed)
                rows.append(row)
                write_csv(rows, csv_path)
                log(
                    f"[{run}/{config.num_runs}] {name:>10s} D={dim:<4d} M={vocab_size:<6d} "
                    f"KL={row['KL']:.4f} mode={row['mode_matching']:.3f} "
                    f"({row['seconds']:.1f} s)"
                )
    plot_results(rows, "mode_matching", os.path.join(workdir, MODE_MATCHING_PNG))
    plot_results(rows, "KL", os.path.join(workdir, KL_PNG))
    log(f"Wrote {csv_path}, {MODE_MATCHING_PNG} and {KL_PNG} in {workdir}")
    return rows
