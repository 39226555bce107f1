"""Generates `docs/results.md` and its figures from the raw results in `docs/results/`.

Every number on the page comes from a committed raw file (JSON / CSV) of
`docs/results/`, produced by the command recorded with it (in the file, or
in `SOURCES` below for files that predate recording it). The page's prose
lives in `docs/results.template.md`; each `{{name}}` placeholder there is
replaced by a table or figure generated here. Rerun after adding results:

    python benchmarks/results_page.py            # writes docs/results.md + PNGs
    python benchmarks/results_page.py --check    # exit 1 if docs/results.md is stale

Figures go to `docs/results/figures/` (matplotlib, Agg backend). The
markdown does not depend on the figures' bytes, so `--check` compares text
only.
"""

import argparse
import glob
import json
import math
import os
import re
import sys

from keras_softmax_heads.experiments import synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "docs", "results")
FIGURES = os.path.join(RESULTS, "figures")
TEMPLATE = os.path.join(REPO, "docs", "results.template.md")
PAGE = os.path.join(REPO, "docs", "results.md")

#: Raw files that do not carry their own command / machine.
SOURCES = {
    "study_bottleneck_ptb_converged.json": dict(
        machine="one NVIDIA H200 (lent GPU machine, 16-core Xeon host), JAX 0.11.2, "
                "Keras 3.15.1; the 12 rows ran at once, one process each; 2026-11-26"),
    "study_bottleneck_ptb_regularized.json": dict(
        machine="one NVIDIA H200 (lent GPU machine, 16-core Xeon host), JAX 0.11.2, "
                "Keras 3.15.1; the 8 rows ran at once, one process each; 2026-11-26"),
    "ptb_zaremba_small.json": dict(
        command="python examples/train_lm.py --preset=zaremba_small --dataset=ptb "
                "--data_dir=../shared/data/ptb --model_dir=/work/runs/ptb_zaremba_small",
        machine="2-core CPU (this project's development machine), TensorFlow 2.21"),
    "bench_large_vocab.json": dict(
        command="python benchmarks/bench_large_vocab.py   (V = 10k, 100k, 793k; d = 512, N = 2048)",
        machine="2-vCPU Intel Xeon (this project's development machine), both cores, "
                "TensorFlow 2.21; 0339c4a, 2026-12-01"),
    "bench_large_vocab_gpu_jax.json": dict(
        command="KERAS_BACKEND=jax python benchmarks/bench_large_vocab.py --backend jax "
                "--v 10000,33000,100000,793471 --in-process --memory-budget-gb 60 --repeats 5 "
                "--time-budget 20 --json docs/results/bench_large_vocab_gpu_jax.json",
        machine="NVIDIA H100 80GB HBM3 (16-core host), JAX 0.11.2 + CUDA, Keras 3.15.1"),
    "bench_exact_heads_gpu_jax.json": dict(
        command="KERAS_BACKEND=jax python benchmarks/bench_exact_heads.py --backend jax "
                "--v 10000,33000,100000 --d 512 --no-memory --rounds 7 "
                "--json docs/results/bench_exact_heads_gpu_jax.json",
        machine="NVIDIA H100 80GB HBM3 (16-core host), JAX 0.11.2 + CUDA, Keras 3.15.1"),
    "plif_histogram/cpu_jax.json": dict(
        command="python benchmarks/bench_plif_histogram.py --rows histogram --rounds 2 "
                "--out docs/results/plif_histogram/cpu_jax.json"),
    "plif_histogram/cpu_jax_n64.json": dict(
        command="python benchmarks/bench_plif_histogram.py --n 64 --rounds 2 "
                "--out docs/results/plif_histogram/cpu_jax_n64.json"),
    "plif_histogram/gpu_jax.json": dict(
        command="benchmarks/device_heads.sh OUT_DIR (its last run: python "
                "benchmarks/bench_plif_histogram.py --n 8192 --methods scatter,pallas,pallas:32,"
                "pallas_fused,pallas_fused:32,sorted --rows loss_grad,histogram), "
                "OUT_DIR/plif_histogram_gpu_jax.json copied here"),
}

#: Chen et al. (2016), Table 2, PTB test perplexity (24 h on a K40 each).
CHEN_TABLE2 = {
    "softmax": 123.8, "d_softmax": 121.1, "sampling": 124.2, "hsm": 138.2,
    "nce": 143.1, "weaknorm": 124.4, "weaknorm_sq": 122.1,
}
#: Kanai et al. (2018) Table 1 (PTB test perplexity, AWD-LSTM, d = 400) and
#: Table 3 (rank of the test log-probability matrix); Ganea et al. (2019)
#: Table 1 (PTB test perplexity, AWD-LSTM w/o finetuning, and s/epoch).
BOTTLENECK_PAPERS = {
    "softmax": dict(kanai_test=50.5, kanai_rank=402, ganea_test=58.37, ganea_sec=60),
    "sigsoftmax": dict(kanai_test=49.2, kanai_rank=4640),
    "plif": dict(ganea_test=57.25, ganea_sec=70),
    "mos": dict(kanai_test=48.0, kanai_rank=9980, ganea_test=56.43, ganea_sec=150),
    "moss": dict(kanai_test=47.7, kanai_rank=9986),
    "mos_plif": dict(ganea_test=56.02, ganea_sec=220),
}


def load(name):
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def present(names, sources):
    """`(name, data)` of each results file of `names` that exists; for each
    that does not, its `missing` note appended to `sources`."""
    for name in names:
        data = load(name)
        if data is None:
            sources.append(missing(name))
        else:
            yield name, data


def fmt(x, digits=2):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(name, data=None):
    """`*Source:* file, command, machine.` for raw file `name`."""
    meta = dict(SOURCES.get(name, {}))
    if isinstance(data, dict):
        meta.setdefault("command", data.get("command"))
        meta.setdefault("machine", data.get("machine"))
    parts = [f"*Raw:* [`docs/results/{name}`](results/{name})"]
    if meta.get("command"):
        parts.append(f"*command:* `{meta['command']}`")
    if meta.get("machine"):
        parts.append(f"*machine:* {meta['machine']}")
    return "; ".join(parts) + "."


def missing(name):
    return f"*Not measured yet: `docs/results/{name}` is absent.*"


def figure(name, alt):
    return f"![{alt}](results/figures/{name})"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------- sections
def section_loop():
    names = sorted(n for n in os.listdir(RESULTS) if re.fullmatch(r"bench_train_loop.*\.json", n))
    if not names:
        return missing("bench_train_loop.json")
    parts = []
    for name in names:
        data = load(name)
        jit = data.get("settings", {}).get("jit_compile", "auto")
        rows = [[r["row"], r["head"], fmt(1000 * r["step_s"], 1)] for r in data["rows"]]
        line = f"XLA (`jit_compile`): `{jit}`."
        if data.get("train_lm_over_bare") is not None:
            line += (f" `train_lm.py` / bare loop: **{data['train_lm_over_bare']:.2f}×** "
                     "(target ≤ 1.15×).")
        if data.get("compare_head_over_head") is not None:
            # The compared head is the row that is not the baseline's.
            names = {"plif": "PLIF", "monotonic": "MonotonicSoftmax"}
            head = data.get("settings", {}).get("head", "full_softmax")
            other = next((r["head"] for r in data["rows"] if r["head"] != head), "plif")
            target = " (target ≤ 1.3×)" if other == "plif" else " (PLIF's target: ≤ 1.3×)"
            line += (f" {names.get(other, other)} / full softmax, whole model: "
                     f"**{data['compare_head_over_head']:.2f}×**{target}.")
        parts += [table(["row", "head", "ms / step"], rows), line, provenance(name, data)]
    return "\n\n".join(parts)


def section_zaremba():
    name = "ptb_zaremba_small.json"
    data = load(name)
    if data is None:
        return missing(name)
    test = data["test"]["perplexity"]
    return "\n\n".join([
        table(["head", "valid ppl", "test ppl", "paper (Zaremba et al. 2014)", "difference"],
              [["FullSoftmax", fmt(data["valid"]["perplexity"]), fmt(test), "114.5",
                f"{100 * (test / 114.5 - 1):+.1f}%"]]),
        provenance(name, data),
    ])


def _study_rows(data):
    return {r["row"]: r for r in data["rows"]}


def section_chen(make_figures, name="study_chen_ptb.json", png="chen_ptb_valid_curves.png",
                 title="PTB 6-gram NNLM, equal time budget (cf. Chen et al. 2016, Fig. 2)"):
    data = load(name)
    if data is None:
        return missing(name), ""
    rows = _study_rows(data)
    base = rows.get("softmax")
    out = []
    for key, r in rows.items():
        paper = CHEN_TABLE2.get("hsm" if key.startswith("hsm") else key)
        speed = (r["examples_per_second"] / base["examples_per_second"]
                 if base and r.get("examples_per_second") and base.get("examples_per_second")
                 else None)
        out.append([key, r["head"], fmt(r["valid_perplexity"]), fmt(r["test_perplexity"]),
                    fmt(paper, 1), fmt(r["train_seconds"], 0), r["global_steps"],
                    fmt(r["examples_per_second"], 0), fmt(speed), r["num_parameters"]])
    text = "\n\n".join([
        table(["row", "head", "valid ppl", "test ppl", "paper test ppl", "train s",
               "steps", "examples / s", "speed / softmax", "parameters"], out),
        provenance(name, data),
    ])
    fig = ""
    if make_figures:
        plt = _plt()
        fig_, ax = plt.subplots(figsize=(7, 4.5))
        for key, r in rows.items():
            xs = [p["train_seconds"] for p in r["valid_curve"]]
            ys = [p["valid_perplexity"] for p in r["valid_curve"]]
            ax.plot(xs, ys, marker="o", markersize=3, label=key)
        ax.set_xlabel("training time (s, one CPU core)")
        ax.set_ylabel("validation perplexity")
        ax.set_yscale("log")
        finals = sorted(r["valid_perplexity"] for r in rows.values())
        top = 3 * finals[len(finals) // 2]  # rows far above the rest leave the plot
        ax.set_ylim(0.9 * finals[0], top)
        off = [k for k, r in rows.items() if r["valid_perplexity"] > top]
        if off:
            ax.text(0.99, 0.98, "above the plot: " + ", ".join(off), transform=ax.transAxes,
                    ha="right", va="top", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7, ncol=2)
        fig_.tight_layout()
        fig_.savefig(os.path.join(FIGURES, png), dpi=110)
        plt.close(fig_)
    fig = figure(png, "validation perplexity against training time")
    return text, fig


def section_bottleneck(make_figures):
    name = "study_bottleneck_ptb.json"
    data = load(name)
    if data is None:
        return missing(name), "", ""
    rows = _study_rows(data)
    base = rows.get("softmax")
    out, bands_rows, band_names = [], [], None

    # The steps' own time (the first step, which compiles, and the epoch's
    # set-up excluded): the epoch's wall time hid the heads' differences
    # (four heads at 323 +- 1 s, with step rates 7.8-9.2/s).
    def step_s(row):
        return 1.0 / row["steps_per_second"] if row.get("steps_per_second") else None

    for key, r in rows.items():
        paper = BOTTLENECK_PAPERS.get(key, {})
        ratio = (step_s(r) / step_s(base) if base and step_s(base) and step_s(r)
                 else None)
        paper_ratio = (paper["ganea_sec"] / BOTTLENECK_PAPERS["softmax"]["ganea_sec"]
                       if "ganea_sec" in paper else None)
        rank = r.get("empirical_rank") or {}
        out.append([key, fmt(r["valid_perplexity"]), fmt(r["test_perplexity"]),
                    fmt(r["seconds_per_epoch"], 0),
                    fmt(1000 * step_s(r), 0) if step_s(r) else "–", fmt(ratio), fmt(paper_ratio),
                    f"{rank.get('rank', '–')} / {rank.get('num_contexts', '–')}",
                    rank.get("linear_softmax_bound", "–"),
                    fmt(paper.get("kanai_test"), 1), paper.get("kanai_rank", "–"),
                    fmt(paper.get("ganea_test"), 2)])
        bands = r.get("entropy_per_frequency_band") or []
        band_names = [b["band"] for b in bands]
        bands_rows.append([key] + [fmt(b["entropy_bits"]) for b in bands])
    text = "\n\n".join([
        table(["row", "valid ppl", "test ppl", "s / epoch (wall)", "ms / step",
               "step time / softmax",
               "paper time / softmax (Ganea, P100)", "empirical rank / contexts",
               "softmax bound d+2", "Kanai test ppl", "Kanai rank", "Ganea test ppl"], out),
        provenance(name, data),
    ])
    bands_text = table(["row"] + [f"words {b}" for b in (band_names or [])], bands_rows)
    fig = ""
    if make_figures and band_names:
        plt = _plt()
        fig_, ax = plt.subplots(figsize=(7, 4))
        for key, r in rows.items():
            ys = [b["entropy_bits"] for b in r["entropy_per_frequency_band"]]
            ax.plot(range(len(ys)), ys, marker="o", label=key)
        ax.set_xticks(range(len(band_names)))
        ax.set_xticklabels(band_names, fontsize=8)
        ax.set_xlabel("frequency-rank band of the target word")
        ax.set_ylabel("test entropy (bits / token)")
        ax.set_title("Entropy per frequency band (cf. Chen et al. 2016, Table 5)")
        ax.legend(fontsize=7, ncol=2)
        fig_.tight_layout()
        fig_.savefig(os.path.join(FIGURES, "bottleneck_entropy_bands.png"), dpi=110)
        plt.close(fig_)
    if band_names:
        fig = figure("bottleneck_entropy_bands.png", "entropy per frequency band")
    return text, bands_text, fig


CONVERGED_STUDIES = ("study_bottleneck_ptb_converged.json",
                     "study_bottleneck_ptb_regularized.json")


def section_converged(name):
    """A converged bottleneck study (issue 19): every row and seed, the
    validation curve, the train / valid gap and the rank on 10k contexts."""
    data = load(name)
    if data is None:
        return missing(name)
    rows = data["rows"]
    softmax = {r["seed"]: r for r in rows if r["head"] == "full_softmax"}
    out = []
    for r in rows:
        base = softmax.get(r["seed"])
        ratio = r["test_perplexity"] / base["test_perplexity"] if base else None
        curve = r["valid_curve"]
        valid = " → ".join(fmt(p["valid_perplexity"], 1) for p in curve)
        train_loss = curve[-1].get("train_loss") if curve else None
        train_ppl = math.exp(train_loss) if train_loss is not None else None
        gap = r["valid_perplexity"] / train_ppl if train_ppl else None
        rank = r.get("empirical_rank") or {}
        out.append([r["row"], r["seed"], fmt(r["test_perplexity"]), fmt(ratio, 3), valid,
                    fmt(train_ppl, 1), fmt(gap), f"{rank.get('rank', '–')} / "
                    f"{rank.get('num_contexts', '–')}", fmt(r["seconds_per_epoch"], 0)])
    text = table(["row", "seed", "test ppl", "test / softmax (same seed)",
                  "valid ppl after each epoch", "train ppl (last epoch)", "valid / train",
                  "empirical rank / contexts (bound d+2 = 202)",
                  "s / epoch (GPU shared by all rows)"], out)
    return "\n\n".join([text, provenance(name, data)])


ROBUSTNESS_FILES = ("head_robustness.json", "head_robustness_b.json", "head_robustness_chen.json",
                    "head_robustness_mos_plif_summed.json", "head_robustness_every_head_a.json",
                    "head_robustness_every_head_b.json", "head_robustness_moc_summed.json")
"""The check's files, in order: a run of a later file replaces the same run
of an earlier one in the table (the default's code: MoS+PLIF's and MoC's summed runs)."""
#: The head-fix diagnostics (`benchmarks/head_gradients.py`), in page order.
HEAD_FIX_RUNS = (
    ("soft_s0", "softmax"),
    ("mos_s0", "MoS, 0.2 start (Glorot latents, zero bias)"),
    ("mos_s1", "MoS, 0.2 start, seed 1"),
    ("mos_s0_id", "MoS, identity latents, zero bias"),
    ("mos_s0_idu", "MoS, identity latents, unigram bias (the new defaults)"),
    ("mono_s0", "MonotonicSoftmax, 0.2 (parameter_scale 1)"),
    ("mono_s0_sc", "MonotonicSoftmax, parameter_scale 0.05"),
)


def section_robustness():
    """The seed-robustness check (issue 19) and the head-fix diagnostics."""
    from keras_softmax_heads.training import robustness

    runs, meta = {}, None
    for name in ROBUSTNESS_FILES:
        data = load(name)
        if data is not None:
            runs.update(data["runs"])
            meta = meta or data
    if not runs:
        return missing(ROBUSTNESS_FILES[0])
    verdicts = robustness.verdicts(runs)
    out = []
    order = [pair for pair in robustness.DEFAULT_ROWS
             if any(r["study"] == pair[0] and r["row"] == pair[1] for r in runs.values())]
    for study, row in order:
        cells, ratios, passed = [], [], []
        for seed in (0, 1, 2):
            key = robustness.run_key(study, row, seed)
            run, verdict = runs.get(key), verdicts.get(key)
            if run is None:
                cells.append("–")
                continue
            cell = fmt(run["valid_perplexity"], 1)
            if verdict:
                cell += f" ({verdict['ratio']:.2f}×)"
                ratios.append(verdict["max_ratio"])
                passed.append(verdict["passed"] and not verdict["stalled"])
            cells.append(cell)
        first = next(r for r in runs.values() if r["study"] == study and r["row"] == row)
        out.append([study, row, first["steps"], *cells, fmt(max(ratios)) if ratios else "–",
                    ("yes" if all(passed) else "**no**") if passed else "–"])
    text = table(["study", "row", "steps", "seed 0: valid ppl (/ softmax)", "seed 1", "seed 2",
                  "worst ratio at any validation", "passes"], out)
    command = ("python benchmarks/head_robustness.py --data_dir=../shared/data "
               "--out=docs/results/head_robustness.json (LSTM rows; the n-gram rows: "
               "--rows=chen_ptb/... --out=docs/results/head_robustness_chen.json; the rows "
               "added on 2026-11-30: --rows=... --seeds=... "
               "--out=docs/results/head_robustness_every_head_{a,b}.json, two processes)")
    parts = [text, "; ".join(
        ["*Raw:* " + ", ".join(f"[`docs/results/{n}`](results/{n})" for n in ROBUSTNESS_FILES
                               if load(n) is not None),
         f"*command:* `{command}`", f"*machine:* {meta.get('machine')}"]) + "."]
    diag = []
    for name, label in HEAD_FIX_RUNS:
        data = load(f"head_fixes/{name}.json")
        if data is None:
            continue
        grads = data[0]["gnorms"]
        backbone = math.sqrt(sum(v * v for k, v in grads.items()
                                 if "lstm" in k or "embedding" in k))
        valid = {r["step"]: r.get("valid_ppl") for r in data}
        diag.append([label, fmt(backbone, 3)] + [fmt(valid.get(s), 0) for s in (100, 300, 500, 900)])
    if diag:
        parts.append("The diagnostics behind the fixes (`docs/recipes.md`): the gradient norm "
                     "that reaches the backbone at the first step, and the validation "
                     "perplexity along the first 1000 steps.")
        parts.append(table(["run (seed 0 unless said)", "backbone gradient norm, step 0",
                            "valid ppl, step 100", "300", "500", "900"], diag))
        parts.append("*Raw:* [`docs/results/head_fixes/`](results/head_fixes/); *command:* "
                     "`python benchmarks/head_gradients.py bottleneck_ptb_small HEAD \"\" SEED "
                     "1000 100 OUT.json` (runs stopped early where the outcome was clear); "
                     "*machine:* one core of the 2-core CPU, TensorFlow 2.21, XLA.")
    return "\n\n".join(parts)


def section_synthetic(make_figures):
    parts = []
    dirs = sorted(d for d in os.listdir(RESULTS) if d.startswith("synthetic_alpha")) \
        if os.path.isdir(RESULTS) else []
    if not dirs:
        return missing("synthetic_alpha*/synthetic_bottleneck.csv")
    for d in dirs:
        path = os.path.join(RESULTS, d, "synthetic_bottleneck.csv")
        if not os.path.exists(path):
            continue
        rows = synthetic.read_csv(path)
        meta = {}
        meta_path = os.path.join(RESULTS, d, "run.json")
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
        alpha = rows[0]["alpha"]
        models = list(dict.fromkeys(r["model"] for r in rows))
        keys = sorted({(r["M"], r["D"]) for r in rows})
        body = []
        for m, dim in keys:
            cells = [str(m), str(dim)]
            for model in models:
                hit = [r for r in rows if (r["M"], r["D"], r["model"]) == (m, dim, model)]
                cells.append(f"{hit[0]['mode_matching'] * 100:.1f}% / {hit[0]['KL']:.3f}"
                             if hit else "–")
            body.append(cells)
        parts.append(f"#### α = {alpha:g} (N = {rows[0]['N']} contexts, {rows[0]['epochs']} "
                     "full-batch Adam steps)")
        parts.append("Mode matching / KL(P*‖Q) (nats), per vocabulary size M and dimension D:")
        parts.append(table(["M", "D"] + models, body))
        src = f"*Raw:* [`docs/results/{d}/synthetic_bottleneck.csv`](results/{d}/synthetic_bottleneck.csv)"
        if meta.get("command"):
            src += f"; *command:* `{meta['command']}`"
        if meta.get("machine"):
            src += f"; *machine:* {meta['machine']}"
        parts.append(src + ".")
        figures = {"mode_matching": f"{d}_mode_matching.png", "KL": f"{d}_kl.png"}
        if make_figures:
            for metric, png in figures.items():
                synthetic.plot_results(rows, metric, path=os.path.join(FIGURES, png))
        parts += [figure(png, f"synthetic bottleneck alpha={alpha:g}, {metric}")
                  for metric, png in figures.items()]
    return "\n\n".join(parts)


def _large_vocab_rows(data, mode):
    rows = {}
    for r in data:
        if r.get("mode") != mode or "step_s" not in r:
            continue
        rows[(r["row"], r["v"], r["phase"])] = r
    return rows


def section_speed_large(make_figures, names=("bench_large_vocab.json",),
                        where="TensorFlow", machine="2 CPU cores",
                        png="speed_vs_vocab.png"):
    loaded = {name: load(name) for name in names}
    loaded = {name: d for name, d in loaded.items() if d is not None}
    data = [r for d in loaded.values() for r in (d["rows"] if isinstance(d, dict) else d)]
    if not data:
        return missing(names[0]), ""
    mode = "xla"
    rows = _large_vocab_rows(data, mode)
    vs = sorted({v for _, v, _ in rows})
    heads = list(dict.fromkeys(r for r, _, _ in rows))
    out = []
    for head in heads:
        for phase in ("train", "eval"):
            cells = [head, phase]
            have = False
            for v in vs:
                r = rows.get((head, v, phase))
                full = rows.get(("FullSoftmax", v, phase)) or rows.get(("FullSoftmax (chunked)", v, phase))
                if r is None:
                    cells.append("–")
                    continue
                have = True
                ratio = r["step_s"] / full["step_s"] if full else None
                cell = f"{1000 * r['step_s']:.1f} ms ({fmt(ratio)}×)"
                if r.get("peak_mb"):
                    cell += f", {r['peak_mb']:.0f} MB"
                if r.get("n") and r["n"] != 2048:
                    cell += f" [N={r['n']}]"
                cells.append(cell)
            if have:
                out.append(cells)
    memory = any(r.get("peak_mb") for r in rows.values())
    text = "\n\n".join([
        f"{where}, `{mode}` mode; d = 512, N = 2048. Each cell: step time (ratio to the "
        "full softmax of the same V and phase; where the dense full softmax does not fit, "
        "the chunked exact one)" + (", peak memory of the step" if memory else "") + ".",
        table(["head", "phase"] + [f"V = {v:,}" for v in vs], out),
        "; ".join(provenance(n, d) for n, d in loaded.items()),
    ])
    if make_figures:
        plt = _plt()
        fig_, ax = plt.subplots(figsize=(7, 4.5))
        for head in heads:
            pts = [(v, rows[(head, v, "train")]["step_s"]) for v in vs if (head, v, "train") in rows]
            if len(pts) >= 2:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=head)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("vocabulary size V")
        ax.set_ylabel("train step time (s), d=512, N=2048")
        ax.set_title(f"Train step time against V ({where} {mode}, {machine})")
        ax.legend(fontsize=7)
        fig_.tight_layout()
        fig_.savefig(os.path.join(FIGURES, png), dpi=110)
        plt.close(fig_)
    return text, figure(png, "train step time against V")


def section_speed_exact(name="bench_exact_heads.json"):
    raw = load(name)
    if raw is None:
        return missing(name)
    data = raw["rows"] if isinstance(raw, dict) else raw
    keys = sorted({(r["v"], r["d"], r["mode"]) for r in data})
    heads = list(dict.fromkeys(r["head"] for r in data))
    out = []
    for head in heads:
        cells = [head]
        for key in keys:
            hit = [r for r in data if (r["v"], r["d"], r["mode"], r["head"]) == (*key, head)]
            if not hit or hit[0].get("wall_ms") is None:
                cells.append("–")
                continue
            ratios = sorted(hit[0]["wall_ratios"])
            median = ratios[len(ratios) // 2]
            cells.append(f"{hit[0]['wall_ms']:.0f} ms ({median:.2f}×)")
        out.append(cells)
    header = ["head"] + [f"V={v:,} d={d} {m}" for v, d, m in keys]
    return "\n\n".join([
        "Train step (forward + backward of "
        + (f"`{raw['objective']}`" if isinstance(raw, dict) and raw.get("objective")
           else "the training loss")
        + "), N = 2048; the ratio is the median over rounds of the head's step against the "
        "full softmax's step of the same round.",
        table(header, out), provenance(name, _machine_text(raw) if isinstance(raw, dict)
                                       else raw)])


def section_peers(name="bench_peers.json"):
    data = load(name)
    if data is None:
        return missing(name)
    ratios = {(r["side"], r["row"], r["v"], r["phase"]): r for r in data.get("ratios", [])}
    out = []
    for r in data["rows"]:
        if "step_s" not in r:
            out.append([r.get("side", ""), r["row"], r.get("phase", ""), f"{r['v']:,}",
                        str(r.get("error") or r.get("skipped") or "failed")[:60],
                        "–", "–", "–", "–"])
            continue
        ratio = ratios.get((r["side"], r["row"], r["v"], r["phase"]), {})
        out.append([r["side"], r["row"], r["phase"], f"{r['v']:,}", f"{1000 * r['step_s']:.1f}",
                    fmt(ratio.get("over_side_full")), fmt(ratio.get("over_ours_full")),
                    fmt(r.get("gflops"), 1), fmt(r.get("peak_mib"), 0)])
    eff = [[e["side"], f"{e['v']:,}", fmt(e["full_train_gflops"], 1),
            fmt(e["matmul_gflops"], 1), fmt(e["full_train_over_matmul"])]
           for e in data.get("efficiency", [])]
    settings = data.get("settings", {})
    return "\n\n".join([
        f"d = {settings.get('d')}, N = {settings.get('n')}; median of the timed calls; "
        "ratios to the full softmax of the same side and to our `FullSoftmax` "
        f"({settings.get('our_backend', 'tensorflow')}, XLA) at the same V and phase; "
        f"float32 products ({settings.get('matmul_precision', 'float32')} precision asked of "
        "both sides). Peak memory is each side's own instrument (allocator peak or peak "
        "resident size: not the same measure across sides)."
        + (f" Our train rows: `{settings['our_train_objective']}`."
           if settings.get("our_train_objective") else ""),
        table(["side", "row", "phase", "V", "ms", "/ full (same side)", "/ our FullSoftmax",
               "GFLOP/s", "peak MiB"], out),
        "Achieved GFLOP/s of the full-softmax train step (6NdV flops) against a bare "
        "`[N, d] @ [d, V]` product (2NdV) on the same side:",
        table(["side", "V", "full-softmax train GFLOP/s", "bare matmul GFLOP/s", "ratio"], eff),
        provenance(name, data)])


def section_adaptive_bench(name="bench_adaptive.json"):
    """Issue 21's benchmark: the adaptive softmax (static and dynamic paths)
    against torch's module, the full and the hierarchical softmax."""
    data = load(name)
    if data is None:
        return missing(name)
    out = []
    for r in data["rows"]:
        cut = "/".join(str(c) for c in r.get("cutoffs", [])) or "–"
        if "step_s" not in r:
            out.append([f"{r['v']:,}", r["row"], r.get("mode", ""), r["phase"], cut,
                        str(r.get("error", "failed"))[:60], "–"])
            continue
        out.append([f"{r['v']:,}", r["row"], r.get("mode", ""), r["phase"], cut,
                    f"{1000 * r['step_s']:.1f}", fmt(r.get("peak_mib"), 0)])
    settings = data.get("settings", {})
    parts = [
        f"d = {settings.get('d')}, N = {settings.get('n')}, factor / div_value "
        f"{settings.get('factor')}, {settings.get('threads')} thread(s); median of "
        f"{settings.get('repeats')} timed calls, each row in a fresh process.",
        table(["V", "row", "mode", "phase", "cutoffs", "ms", "peak MiB"], out)]
    if any(r["key"] == "chunked" for r in data["rows"]):
        # The `chunk_size` run: the chunked row against the static one and torch's.
        ratios = [[f"{e['v']:,}", fmt(e.get("chunked_over_static_train")),
                   fmt(e.get("chunked_over_static_eval")), fmt(e.get("static_over_torch_train")),
                   fmt(e.get("chunked_over_torch_train"))] for e in data.get("ratios", [])]
        parts += [f"Ratios (`chunk_size={settings.get('chunk_size')}`; < 1: the first is faster):",
                  table(["V", "chunked / static (train)", "chunked / static (eval)",
                         "static / torch (train)", "chunked / torch (train)"], ratios)]
    else:
        ratios = [[f"{e['v']:,}", fmt(e.get("static_over_torch_train")),
                   fmt(e.get("dynamic_over_torch_train")), fmt(e.get("static_over_full_eval")),
                   fmt(e.get("dynamic_over_full_eval")), fmt(e.get("hsm_over_full_eval"))]
                  for e in data.get("ratios", [])]
        parts += ["Ratios (train: < 1 means ours is faster than torch's module; eval: exact "
                  "log-likelihood over the `FullSoftmax`'s):",
                  table(["V", "static / torch (train)", "dynamic / torch (train)",
                         "static / full (eval)", "dynamic / full (eval)", "HSM / full (eval)"],
                        ratios)]
    note = f" {data['note']}" if data.get("note") else ""
    return "\n\n".join(parts + [provenance(name, data) + note])


def section_adaptive_threads(folder="adaptive_threads"):
    """Issue 28's thread-count check of the adaptive softmax: the static
    path's train step before and after the saved first rung, the dynamic
    path and torch's module, at 1 and 2 threads, per round (a file's
    suffix: `after_t2_3.json` is round 3 at 2 threads)."""
    paths = sorted(glob.glob(os.path.join(RESULTS, folder, "after_t*_*.json")))
    if not paths:
        return missing(f"{folder}/after_t*_*.json")
    out = []
    for path in paths:
        threads, rnd = re.match(r"after_t(\d+)_(\w+)\.json$", os.path.basename(path)).groups()
        after = {(r["key"], r["v"]): r for r in load(os.path.join(folder, os.path.basename(path)))["rows"]}
        before_data = load(os.path.join(folder, f"before_t{threads}_{rnd}.json")) or {"rows": []}
        before = {(r["key"], r["v"]): r for r in before_data["rows"]}
        for v in sorted({v for _, v in after}):
            rows = {"before": before.get(("static", v)), "after": after.get(("static", v)),
                    "dynamic": after.get(("dynamic", v)), "torch": after.get(("torch", v))}
            ms = {k: 1000 * r["step_s"] for k, r in rows.items() if r and "step_s" in r}
            mem = [(rows[k] or {}).get("peak_mib") for k in ("before", "after")]
            out.append([threads, f"{v:,}", rnd]
                       + [f"{ms[k]:.1f}" if k in ms else "–"
                          for k in ("before", "after", "dynamic", "torch")]
                       + [fmt(ms[k] / ms["torch"]) if k in ms and "torch" in ms else "–"
                          for k in ("before", "after", "dynamic")]
                       + [f"{fmt(mem[0], 0)} → {fmt(mem[1], 0)}"])
    blocks = adaptive_blocks_rows(folder)
    parts = [
        table(["threads", "V", "round", "static before (ms)", "static after (ms)",
               "dynamic (ms)", "torch (ms)", "before / torch", "after / torch",
               "dynamic / torch", "static peak MiB (before → after)"], out),
        f"*Raw:* [`docs/results/{folder}/`](results/{folder}/README.md); *command:* "
        f"`bash docs/results/{folder}/run.sh` (V = 793,471: `run_793k.sh`)."]
    if blocks:
        parts += [
            "The same check after the static tails became blocks of their capacity "
            "(`blocks_t{threads}_{round}.json`):",
            table(["threads", "V", "round", "static (ms)", "dynamic (ms)", "torch (ms)",
                   "static / torch", "dynamic / torch", "static peak MiB"], blocks),
            f"*Command:* `SRC=<checkout> bash docs/results/{folder}/run_blocks.sh`."]
    return "\n\n".join(parts)


def adaptive_blocks_rows(folder):
    """Table rows of `folder/blocks_t{threads}_{round}.json` (`run_blocks.sh`):
    threads, V, round, the static / dynamic / torch times, the two ratios
    to torch and the static path's peak."""
    out = []
    for path in sorted(glob.glob(os.path.join(RESULTS, folder, "blocks_t*_*.json"))):
        threads, rnd = re.match(r"blocks_t(\d+)_(\w+)\.json$", os.path.basename(path)).groups()
        rows = {(r["key"], r["v"]): r for r in load(os.path.join(folder, os.path.basename(path)))["rows"]}
        for v in sorted({v for _, v in rows}):
            ms = {k: 1000 * rows[(k, v)]["step_s"] for k in ("static", "dynamic", "torch")
                  if (k, v) in rows and "step_s" in rows[(k, v)]}
            out.append([threads, f"{v:,}", rnd]
                       + [f"{ms[k]:.1f}" if k in ms else "–" for k in ("static", "dynamic", "torch")]
                       + [fmt(ms[k] / ms["torch"]) if k in ms and "torch" in ms else "–"
                          for k in ("static", "dynamic")]
                       + [fmt(rows.get(("static", v), {}).get("peak_mib"), 0)])
    return out


def adaptive_in_forward_rows(folder, name):
    """The table of `run_blocks.sh`'s `static,in_forward,torch` rows in
    `{name}_t{threads}_{round}.json` (None if there are none)."""
    out = []
    pattern = os.path.join(RESULTS, folder, f"{name}_t*_*.json")
    for path in sorted(glob.glob(pattern)):
        threads, rnd = re.match(rf"{name}_t(\d+)_(\w+)\.json$", os.path.basename(path)).groups()
        rows = {(r["key"], r["v"]): r for r in load(os.path.join(folder, os.path.basename(path)))["rows"]}
        for v in sorted({v for _, v in rows}):
            got = {k: rows[(k, v)] for k in ("static", "in_forward", "torch")
                   if "step_s" in rows.get((k, v), {})}
            if len(got) < 3:
                continue
            ms = {k: 1000 * r["step_s"] for k, r in got.items()}
            out.append(
                [threads, f"{v:,}", rnd] + [f"{ms[k]:.1f}" for k in ("static", "in_forward", "torch")]
                + [fmt(ms["static"] / ms["torch"]), fmt(ms["in_forward"] / ms["torch"]),
                   fmt(ms["in_forward"] / ms["static"]),
                   f"{fmt(got['static']['peak_mib'], 0)} → {fmt(got['in_forward']['peak_mib'], 0)}",
                   f"{got['static']['first_call_s']:.1f} / {got['in_forward']['first_call_s']:.1f}"])
    if not out:
        return None
    return table(["threads", "V", "round", "static (ms)", "in_forward (ms)", "torch (ms)",
                  "static / torch", "in_forward / torch", "in_forward / static",
                  "peak MiB (static → in_forward)", "first call s (static / in_forward)"], out)


def section_adaptive_gradient_blocks(folder="adaptive_threads/intel_xeon/gradient_blocks"):
    """How many switch branches the summed tails compile (`probe_blocks.py`:
    each row's step over the static path's, per-round, and its two first
    calls), then `run_blocks.sh`'s in_forward rows with the kept default."""
    out = []
    for name in ("blocks_t1", "loops_t1", "halves_t1", "loops_t2", "halves_t2", "ab_t2"):
        data = load(f"{folder}/{name}.json")
        if data is None:
            continue
        for v, r in data["vocab"].items():
            for key, st in r["step"].items():
                out.append([name + ".json", str(data["machine"]["threads"]), f"{int(v):,}", key,
                            fmt(st["median_ms"], 1), fmt(st["over_static"]),
                            f"{st['first_call_s']:.1f} / {st['first_call_s_again']:.1f}"])
    if not out:
        return missing(f"{folder}/blocks_t1.json")
    parts = [table(["file", "threads", "V", "row", "step (ms)", "step / static",
                    "first call s (in order / again)"], out),
             f"*Raw and reading:* [`docs/results/{folder}/`](results/{folder}/README.md); "
             f"*command:* `OMP_NUM_THREADS=1 taskset -c 1 python docs/results/{folder}/"
             f"probe_blocks.py --threads=1 --blocks=4,8 --halves=8 --out=halves_t1.json`."]
    bench = adaptive_in_forward_rows("adaptive_threads/intel_xeon", "in_forward_min4")
    if bench:
        parts += [
            "`bench_adaptive.py`'s fresh processes again with five branches a tail (the "
            "package at fc0ee02; `in_forward_min4_t{threads}_{round}.json` in the folder above):",
            bench,
            "*Command:* `SRC=<checkout> OUT=<dir> ROWS=static,in_forward,torch "
            "NAME=in_forward_min4 bash docs/results/adaptive_threads/run_blocks.sh`."]
    return "\n\n".join(parts)


def section_adaptive_intel(folder="adaptive_threads/intel_xeon"):
    """The thread-count check rerun on an Intel Xeon (`run_blocks.sh`), and
    the probe that explains it (`probe.py`: the step's products by XLA,
    TensorFlow's graph and torch; the step with exact capacities and with
    `capacity_factor=1.0`)."""
    blocks = adaptive_blocks_rows(folder)
    if not blocks:
        return missing(f"{folder}/blocks_t*_*.json")
    parts = [table(["threads", "V", "round", "static (ms)", "dynamic (ms)", "torch (ms)",
                    "static / torch", "dynamic / torch", "static peak MiB"], blocks),
             f"*Raw:* [`docs/results/{folder}/`](results/{folder}/README.md); *command:* "
             f"`SRC=<checkout> OUT=<dir> bash docs/results/adaptive_threads/run_blocks.sh`."]
    in_forward = adaptive_in_forward_rows(folder, "in_forward")
    if in_forward:
        parts += [
            "With `gradient_in_forward=True` (the `in_forward` row of `bench_adaptive.py`: the "
            "summed objective `HeadLoss` trains, each tail's gradient computed in the forward pass "
            "in blocks of an eighth of its capacity; `in_forward_t{threads}_{round}.json`):",
            in_forward,
            "*Command:* `SRC=<checkout> OUT=<dir> ROWS=static,in_forward,torch NAME=in_forward "
            "bash docs/results/adaptive_threads/run_blocks.sh`."]
    gemm, step = [], []
    for threads in (1, 2):
        data = load(f"{folder}/probe_t{threads}.json")
        if data is None:
            continue
        for shape, row in data["gemm"].items():
            gemm.append([str(threads), shape.replace("x", " × ")]
                        + [fmt(row[k]["median_ms"], 2) for k in ("xla", "graph", "torch")]
                        + [fmt(row[k]["over_torch"]) for k in ("xla", "graph")])
        st = data["step"]
        step.append([str(threads)] + [fmt(st[k]["median_ms"], 1)
                                      for k in ("default", "factor_1.0", "exact", "torch")]
                    + [fmt(st[k]["over_torch"]) for k in ("default", "factor_1.0", "exact")]
                    + [fmt(st["default"]["over_exact"])])
    if gemm:
        parts += [
            "The probe (`probe.py`, one process, rows alternated over 8 rounds, the median of the "
            "per-round ratios), first the step's products (`sum(a @ b)`; the head cluster, then "
            "the two tails' blocks at their capacities):",
            table(["threads", "product", "XLA (ms)", "TF graph, oneDNN (ms)", "torch (ms)",
                   "XLA / torch", "graph / torch"], gemm),
            "then the step as the library builds it, with `capacity_factor=1.0`, with each "
            "tail's capacity set to the batch's member count (`exact`), and torch's module:",
            table(["threads", "default (ms)", "capacity_factor=1.0 (ms)", "exact (ms)",
                   "torch (ms)", "default / torch", "1.0 / torch", "exact / torch",
                   "default / exact"], step),
            f"*Command:* `OMP_NUM_THREADS=1 taskset -c 1 python docs/results/{folder}/probe.py "
            f"--threads=1 --out=probe_t1.json` (two threads: `OMP_NUM_THREADS=2`, `--threads=2`, "
            f"no `taskset`)."]
    return "\n\n".join(parts)


def section_adaptive_in_forward_probe(folder="adaptive_threads/intel_xeon"):
    """`probe.py` rerun with the `in_forward` row (`in_forward_probe_t*.json`):
    each row's median and its per-round ratios to the default and to torch."""
    out = []
    keys = ("default", "factor_1.0", "exact", "in_forward", "torch")
    for threads in (1, 2):
        data = load(f"{folder}/in_forward_probe_t{threads}.json")
        if data is None:
            continue
        st = data["step"]
        out.append([str(threads)] + [fmt(st[k]["median_ms"], 1) for k in keys]
                   + [fmt(st["in_forward"]["over_default"]), fmt(st["in_forward"]["over_exact"]),
                      fmt(st["in_forward"]["over_torch"]), fmt(st["default"]["over_torch"])])
    if not out:
        return missing(f"{folder}/in_forward_probe_t*.json")
    return "\n\n".join([
        table(["threads", "default (ms)", "capacity_factor=1.0 (ms)", "exact (ms)",
               "in_forward (ms)", "torch (ms)", "in_forward / default", "in_forward / exact",
               "in_forward / torch", "default / torch"], out),
        f"*Raw:* `docs/results/{folder}/in_forward_probe_t{{1,2}}.json`; *command:* as the "
        f"probe's above, `--out=in_forward_probe_t1.json`."])


def section_adaptive_memory(folder="adaptive_memory"):
    """XLA's planned temporaries of the static adaptive step, before (the
    capacity ladder) and after (blocks of the capacity)."""
    before, after = load(f"{folder}/before.json"), load(f"{folder}/after.json")
    if after is None:
        return missing(f"{folder}/after.json")
    old = {(r["vocab_size"], r["tokens"]): r for r in (before or {}).get("rows", [])}
    chunked_name = f"{folder}/chunked_4096.json"
    chunked = load(chunked_name)
    tiled = {(r["vocab_size"], r["tokens"]): r for r in (chunked or {}).get("rows", [])}
    out = []
    for r in after["rows"]:
        was = old.get((r["vocab_size"], r["tokens"]))
        tile = tiled.get((r["vocab_size"], r["tokens"]))
        out.append([f"{r['vocab_size']:,}", "/".join(str(c) for c in r["cutoffs"]),
                    f"{r['tokens']:,}", str(r["capacities"]),
                    fmt(was["temp_mib"], 0) if was else "–", fmt(r["temp_mib"], 0),
                    fmt(was["temp_mib"] / r["temp_mib"], 1) + "×" if was else "–",
                    fmt(tile["temp_mib"], 0) if tile else "–",
                    fmt(r["dense_tail_mib"], 0)])
    text = table(["V", "cutoffs", "N", "capacities K_i", "ladder (before) MiB",
                  "blocks (now) MiB", "before / now", "blocks, chunk_size=4096 MiB",
                  "one dense tail's [N, size] MiB"], out)
    source = (provenance(f"{folder}/after.json", after)
              + f" Before: `{folder}/before.json` ({(before or {}).get('code', '')}).")
    if chunked:
        source += f" `chunk_size=4096`: `{chunked_name}` (`{chunked['command']}`)."
    return "\n\n".join([text, source])


def section_adaptive_jax(name="adaptive_memory/jax_chunked.json"):
    """`bench_adaptive_jax.py`: the adaptive softmax's JAX training step,
    whole clusters against `chunk_size` tiles, same process."""
    data = load(name)
    if data is None:
        return missing(name)
    out = [[f"{r['v']:,}", "/".join(str(c) for c in r["cutoffs"]), f"{r['n']:,}",
            f"{1e3 * r['whole']['step_s']:.1f}", f"{1e3 * r['chunked']['step_s']:.1f}",
            fmt(r["ratio"]), fmt(r["whole"]["temp_mib"], 0), fmt(r["chunked"]["temp_mib"], 0)]
           for r in data["rows"]]
    chunk = data["rows"][0]["chunk_size"] if data["rows"] else "?"
    return "\n\n".join([
        table(["V", "cutoffs", "N", "whole (ms)", f"chunk_size={chunk} (ms)", "chunked / whole",
               "whole: XLA temporaries MiB", "chunked: XLA temporaries MiB"], out),
        provenance(name, data) + f" Device: {data.get('device')}; medians of "
        f"{data.get('rounds')} interleaved rounds."])


def section_adaptive_torch(folder="adaptive_threads"):
    """`bench_adaptive_torch.py`: our layer on the PyTorch backend against
    torch's module, before and after the one-hot products went."""
    after = load(f"{folder}/torch_backend.json")
    if after is None:
        return missing(f"{folder}/torch_backend.json")
    before = load(f"{folder}/torch_backend_before.json") or {"rows": []}
    was = {r["v"]: r for r in before["rows"]}
    names = list(after["rows"][0]["step_s"]) if after["rows"] else []
    out = []
    for r in after["rows"]:
        for name in names:
            old = was.get(r["v"], {}).get("over_torch", {}).get(name)
            out.append([f"{r['v']:,}", name, f"{1e3 * r['step_s'][name]:.1f}",
                        fmt(old) if old is not None else "–", fmt(r["over_torch"][name])])
    return "\n\n".join([
        table(["V", "row", "ms (after)", "/ torch (before)", "/ torch (after)"], out),
        provenance(f"{folder}/torch_backend.json", after)
        + f" Before: `{folder}/torch_backend_before.json` ({before.get('code', '')}); "
        f"{after.get('threads')} thread, medians of {after.get('rounds')} interleaved rounds."])


def section_adaptive_study(name="study_adaptive_wikitext2.json"):
    """Issue 21's study: equal training time on WikiText-2."""
    data = load(name)
    if data is None:
        return missing(name)
    rows = data["rows"]
    softmax = next((r for r in rows if r["head"] == "full_softmax"), None)
    out = []
    for r in rows:
        ratio = (r["test_perplexity"] / softmax["test_perplexity"]) if softmax else None
        out.append([r["row"], r["head"], fmt(r["test_perplexity"]), fmt(ratio, 3),
                    fmt(r["valid_perplexity"]), fmt(r["train_seconds"], 0),
                    fmt(r.get("epochs")) if r.get("epochs") is not None else "–",
                    fmt(r.get("steps_per_second"), 1)])
    return "\n\n".join([
        table(["row", "head", "test ppl", "test / softmax", "valid ppl", "train s", "epochs",
               "steps / s"], out),
        provenance(name, data)])
def _machine_text(data):
    """`data` with its `machine` dict as one line (for `provenance`)."""
    m = data.get("machine")
    if not isinstance(m, dict):
        return data
    text = f"{m.get('cpu')}, {m.get('cores')} of {m.get('cpu_count')} cores, " \
           f"{m.get('memory_gib')} GiB; {m.get('date', '')[:10]}"
    return dict(data, machine=text)


def section_fused_lce(name="bench_linear_cross_entropy.json"):
    """Fused linear cross-entropy against the dense logits and PyTorch (issue 20)."""
    data = load(name)
    if data is None:
        return missing(name)
    settings = data.get("settings", {})
    gpu = settings.get("device") == "gpu"
    backend = settings.get("backend", "tensorflow")
    mode = settings.get("mode") or {"tensorflow": "graph", "jax": "xla"}.get(backend, "eager")
    ratios = {(e["v"], e["dtype"]): e for e in data.get("ratios", [])}
    out = []
    for r in data["rows"]:
        cells = [f"{r['v']:,}", r["dtype"], r["row"]]
        if "step_s" not in r:
            why = str(r.get("skipped") or r.get("error") or "failed")[:60]
            out.append(cells + [why, "–", "–", "–", "–"])
            continue
        ratio = {}
        if r["row"] in ("ours", "ours_summed"):  # the `ours_summed_...` keys
            ratio = ratios.get((r["v"], r["dtype"]), {})
        key = r["row"]
        out.append(cells + [fmt(r["step_s"], 3), fmt(r["extra_mib"], 0),
                            fmt(ratio.get(f"time_{key}_over_keras_dense")),
                            fmt(ratio.get(f"time_{key}_over_torch_chunked")),
                            fmt(ratio.get(f"extra_memory_{key}_over_keras_dense"), 3)])
    where = (f"{_gpu_name(data)}, Keras rows on JAX ({settings.get('backend')})"
             if gpu else f"{settings.get('threads')} threads, Keras rows on {backend} ({mode})")
    memory = ("the GPU allocator's peak (JAX `memory_stats`, `torch.cuda`)" if gpu
              else "peak resident size")
    return "\n\n".join([
        f"N = {settings.get('n')} tokens, d = {settings.get('d')}, "
        f"{where}; forward + backward with respect to h and W, "
        f"median of the timed calls, each row in a fresh process. *Extra MiB*: {memory} "
        "over the inputs and weights, minus the two gradients' size.",
        table(["V", "dtype", "row", "s / step", "extra MiB", "row / keras_dense time",
               "row / torch_chunked time", "row / keras_dense extra memory"], out),
        provenance(name, _machine_text(data))])


FROZEN_KERNEL_FILES = tuple(f"frozen_kernel/bench_lce_frozen_{b}.json"
                            for b in ("torch", "tensorflow", "jax"))


def section_fused_lce_frozen(names=FROZEN_KERNEL_FILES):
    """The fused loss with a frozen output matrix: the gradient with respect
    to `h` only, beside the same step with `W`'s (`ours_frozen`, `ours`)
    and PyTorch's chunked loss both ways, one file per backend."""
    out, sources = [], []
    for name, data in present(names, sources):
        settings = data.get("settings", {})
        backend = settings.get("backend", "tensorflow")
        mode = settings.get("mode") or {"tensorflow": "graph", "jax": "xla"}.get(backend, "eager")
        by = {(r["v"], r["dtype"], r["row"]): r for r in data["rows"]}
        ratios = {(e["v"], e["dtype"]): e for e in data.get("ratios", [])}
        for (v, dtype), e in ratios.items():
            def step(row):
                r = by.get((v, dtype, row), {})
                return fmt(r.get("step_s"), 3) if "step_s" in r else "–"

            out.append([f"{backend} ({mode})", f"{v:,}", dtype, step("ours"), step("ours_frozen"),
                        fmt(e.get("time_ours_frozen_over_ours")), step("torch_chunked"),
                        step("torch_chunked_frozen"),
                        fmt(e.get("time_ours_frozen_over_torch_chunked_frozen"))])
        sources.append(provenance(name, _machine_text(data)))
    if not out:
        return "\n\n".join(sources)
    return "\n\n".join([
        "Seconds a step (median of the timed calls, each row in a fresh process); `_frozen`: "
        "`W` frozen, the gradient with respect to `h` only.",
        table(["Keras backend", "V", "dtype", "ours", "ours_frozen", "frozen / ours",
               "torch_chunked", "torch_chunked_frozen", "ours_frozen / torch_chunked_frozen"],
              out)] + sources)


def _gpu_name(data):
    names = {r.get("device") for r in data.get("rows", []) if r.get("device")}
    return " / ".join(sorted(names)) or "GPU"


def section_fused_lce_gpu():
    """The same table on a lent GPU (issue 20): `docs/results/lce_gpu/`."""
    parts = []
    for title, name in [
        ("float32 and the first bfloat16 rows (tiles upcast to float32 before their products)",
         "lce_gpu/bench_linear_cross_entropy_gpu.json"),
        ("bfloat16 with the products in bfloat16 on float32 accumulators (current code)",
         "lce_gpu/bench_linear_cross_entropy_gpu_bf16_products.json"),
        ("Cut Cross-Entropy's Gemma 2 (2B) shape, first run",
         "lce_gpu/bench_linear_cross_entropy_gpu_gemma2.json"),
        ("Gemma 2 (2B) shape, bfloat16 products (current code)",
         "lce_gpu/bench_linear_cross_entropy_gpu_gemma2_bf16_products.json"),
    ]:
        parts.append(f"**{title}**\n\n{section_fused_lce(name)}")
    return "\n\n".join(parts)


def section_fused_causal_lm(name="bench_fused_causal_lm.json"):
    """A keras-hub Gemma's training step, stock and fused (issue 20)."""
    data = load(name)
    if data is None:
        return missing(name)
    settings = data.get("settings", {})
    caps = {c["row"]: c for c in data.get("memory_cap", [])}
    out = []
    for r in data["rows"]:
        cap = caps.get(r["row"], {})
        longest = cap.get("max_seq_len_under_cap")
        longest = "–" if not cap else (f"{longest:,}" if longest else "none tried")
        if "step_s" not in r:
            out.append([r["row"], str(r.get("error") or "failed")[:60], "–", "–", longest])
            continue
        out.append([r["row"], fmt(r["step_s"], 3), fmt(r["peak_mib"], 0),
                    fmt(r["peak_over_baseline_mib"], 0), longest])
    evals = []
    for r in data.get("eval_rows", []):
        if "step_s" not in r:
            evals.append([r["row"], str(r.get("error") or "failed")[:60], "–", "–"])
            continue
        logs = ", ".join(f"{k} {v:.4g}" for k, v in sorted(r.get("logs", {}).items()))
        evals.append([r["row"], fmt(r["step_s"], 3), fmt(r["peak_over_baseline_mib"], 0), logs])
    model = settings.get("model", {})
    return "\n\n".join([
        f"`GemmaCausalLM`, V = {model.get('vocabulary_size', 0):,}, d = "
        f"{model.get('hidden_dim')}, {model.get('num_layers')} layer(s), batch "
        f"{settings.get('batch_size')} x {settings.get('seq_len')} tokens, "
        f"{settings.get('threads')} threads; `train_on_batch`, median of the timed steps. "
        f"Longest sequence: the longest of {settings.get('cap_seq_lens')} whose whole-process "
        f"peak resident size stayed under {settings.get('memory_cap_gb')} GiB.",
        table(["row", "s / step", "peak MiB", "MiB over the built model",
               "longest sequence under the cap"], out)]
        + ([f"The evaluation step (`test_on_batch`, each row in a fresh process; the fused "
            f"model's is its default fused evaluation, without logits):",
            table(["row", "s / step", "MiB over the built model", "logs"], evals)]
           if evals else [])
        + [provenance(name, _machine_text(data))])


def _loadavg(values):
    """A recorded `os.getloadavg()` (1, 5, 15 minutes) as one cell."""
    return " / ".join(f"{x:.1f}" for x in values) if values else "–"


def _sci(x):
    """`x` in scientific notation (one decimal), `–` when absent."""
    return "–" if x is None else f"{x:.1e}"


def _error_cell(row):
    return str(row.get("error") or row.get("skipped") or "failed")[:60]


def _args_command(data):
    """`python SCRIPT --flag=value ...` from a raw file's `script` and
    `args` (argparse destinations; `None` and `False` left out)."""
    args = data.get("args") or {}
    flags = []
    for key, value in args.items():
        if value is None or value is False:
            continue
        if value is True:
            flags.append(f"--{key}")
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        flags.append(f"--{key}={value}")
    return " ".join(["python", data.get("script", "?")] + flags)


def _with_command(data):
    """`data` with a `command` from its `script` / `args` and its machine as
    one line, for `provenance` (the files of `bench_mixture_memory.py` and
    `bench_device_heads.py`, which record their arguments, not a command)."""
    data = _machine_text(data)
    if "command" not in data and data.get("script"):
        data = dict(data, command=_args_command(data))
    return data


#: Keras' compiled modes per backend (`bench_token_scores.py`).
TOKEN_SCORES_MODES = {"jax": "jax.jit", "tensorflow": "XLA (`jit_compile=True`)"}
TOKEN_SCORES_FILES = ("token_scores/bench_token_scores_jax.json",
                      "token_scores/bench_token_scores_tensorflow.json",
                      "token_scores/bench_token_scores_tensorflow_run1.json")


def section_token_scores(names=TOKEN_SCORES_FILES):
    """Per-token log-probabilities and entropy, tiled against dense (issue 30)."""
    loaded = {name: load(name) for name in names}
    loaded = {name: d for name, d in loaded.items() if d is not None}
    if not loaded:
        return missing(names[0])
    out = []
    for data in loaded.values():
        load_cells = [_loadavg(data.get("loadavg_before")), _loadavg(data.get("loadavg_after"))]
        for backend, r in data.get("backends", {}).items():
            mode = f"{backend} / {TOKEN_SCORES_MODES.get(backend, r.get('mode', ''))}"
            if "rows" not in r:
                out.append([mode, _error_cell(r)] + ["–"] * 9 + load_cells)
                continue
            rows, ratios = r["rows"], r.get("ratios", {})
            measure_ = ratios.get("memory_measure")
            fused, dense = rows.get("fused", {}), rows.get("dense", {})
            rounds = ", ".join(fmt(x) for x in ratios.get("time_fused_over_dense_rounds", []))
            out.append([mode, f"{r.get('n'):,}", f"{r.get('d'):,}", f"{r.get('v'):,}",
                        fmt(fused.get("step_s"), 1), fmt(dense.get("step_s"), 1),
                        f"{fmt(ratios.get('time_fused_over_dense'))} ({rounds or '–'})",
                        f"`{measure_}`" if measure_ else "–",
                        fmt(fused.get(measure_), 0), fmt(dense.get(measure_), 0),
                        fmt(ratios.get("extra_memory_fused_over_dense"), 3)] + load_cells)
    first = next(iter(loaded.values()))
    settings = next((r for r in first.get("backends", {}).values() if "rows" in r), {})
    return "\n\n".join([
        f"Forward + backward of `sum(u·logp + v·H)` with respect to h and W, float32, "
        f"{settings.get('threads')} threads, tile width {settings.get('chunk_size')}; "
        "*fused*: `linear_token_scores(..., return_entropy=True)`, *dense*: the `keras.ops` "
        "logits, `log_softmax`, gather and entropy; both compiled, timed in interleaved "
        "rounds of one process per backend (the time ratio is the median of the per-round "
        "ratios, listed in brackets). Memory: `temp_mib` is XLA's compiled scratch memory "
        "(JAX), `rss_extra_mib` the process' peak resident size over one call after the "
        "warm-up (TensorFlow).",
        table(["backend / mode", "N", "d", "V", "fused s / step", "dense s / step",
               "fused / dense time (rounds)", "memory measure", "fused MiB", "dense MiB",
               "fused / dense memory", "load avg before", "load avg after"], out),
        "\n".join(f"- {provenance(n, _machine_text(d))}" for n, d in loaded.items())])


def section_distillation(name="distillation/bench_distillation.json"):
    """The tiled forward KL against the dense KL and PyTorch's (issue 30)."""
    data = load(name)
    if data is None:
        return missing(name)
    out = []
    for r in data["rows"]:
        cells = [r.get("backend", "?"), r.get("mode", "")]
        if "error" in r:
            out.append(cells + [_error_cell(r)] + ["–"] * 9)
            continue
        ratios = r.get("ratios", {})
        rounds = ""
        times = r.get("times_s", {})
        if times.get("tiled") and times.get("dense"):
            rounds = " (" + ", ".join(fmt(t / d) for t, d in zip(times["tiled"], times["dense"])) + ")"
        time_ratio = ratios.get("time_tiled_over_dense")
        step_memory = ratios.get("temp_memory_tiled_over_dense")
        if step_memory is None and "tiled_allocator_peak_mib" in r:
            # TensorFlow's allocator peaks less the gradients (both steps').
            grad = r.get("grad_mib", 0.0)
            step_memory = ((r["tiled_allocator_peak_mib"] - grad)
                           / (r["dense_allocator_peak_mib"] - grad))
        out.append(cells + [
            fmt(r.get("tiled_step_s"), 1), fmt(r.get("dense_step_s"), 1),
            fmt(r.get("torch_dense_step_s"), 1),
            (fmt(time_ratio) + rounds) if time_ratio is not None else "–",
            fmt(r.get("tiled_extra_mib"), 0), fmt(r.get("dense_extra_mib"), 0),
            fmt(r.get("torch_dense_extra_mib"), 0),
            fmt(ratios.get("extra_memory_tiled_over_dense"), 3),
            fmt(step_memory, 3),
            fmt(ratios.get("time_tiled_over_torch_dense_process"))])
    settings = data.get("settings", {})
    token_chunk = settings.get("token_chunk_size") or "the backend's default"
    return "\n\n".join([
        f"N = {settings.get('tokens'):,}, d = {settings.get('dim'):,} (student and teacher), "
        f"V = {settings.get('vocab'):,}, tile width {settings.get('chunk_size')}, "
        f"token chunk {token_chunk}, "
        f"{settings.get('threads')} threads, float32; forward + backward of the mean forward "
        "KL with respect to the student's h and W; *tiled*: `fused.linear_divergence`, "
        "*dense*: both `[N, V]` logits in `keras.ops`, *torch dense*: PyTorch's eager "
        "`F.kl_div` in its own process. Time ratios: medians over the interleaved rounds "
        "(per round in brackets); against PyTorch, the medians of two processes. Extra "
        "memory: peak resident size of one call in a fresh process over the inputs and the "
        "two gradients (for the torch row, its dense step's; on TensorFlow over both calls, "
        "XLA's compilation included); step memory: XLA's compiled scratch memory (JAX) or "
        f"TensorFlow's allocator peak over one call less the gradients. Load average {_loadavg(data.get('loadavg_before'))} before, "
        f"{_loadavg(data.get('loadavg_after'))} after.",
        table(["backend", "mode", "tiled s", "dense s", "torch dense s",
               "tiled / dense time (rounds)", "tiled extra MiB", "dense extra MiB",
               "torch dense extra MiB",
               "tiled / dense extra memory", "tiled / dense step memory",
               "tiled / torch dense time"], out),
        provenance(name, _machine_text(data))])


#: The one device call that writes `docs/results/device_heads/` (issue 28).
DEVICE_HEADS_COMMAND = "benchmarks/device_heads.sh docs/results/device_heads"

#: The mixtures' memory files (`bench_mixture_memory.py`), in column order.
MIXTURE_MEMORY_FILES = (
    ("V = 33,278", "mixture_memory/mixture_memory_cpu_v33278.json"),
    ("V = 100,000", "mixture_memory/mixture_memory_cpu_v100000.json"),
    ("V = 33,278, GPU tile widths", "mixture_memory/mixture_memory_gpu_widths_on_cpu_v33278.json"),
)


def section_mixture_memory(files=MIXTURE_MEMORY_FILES):
    """XLA's compiled temp memory of the mixtures' training step (issue 28)."""
    loaded = [(title, name, load(name)) for title, name in files]
    loaded = [(title, name, d) for title, name, d in loaded if d is not None]
    if not loaded:
        return missing(files[0][1])
    heads = list(dict.fromkeys(r["head"] for _, _, d in loaded for r in d["rows"]))
    out = []
    for head in heads:
        cells = [f"`{head}`"]
        for _, _, d in loaded:
            r = next((x for x in d["rows"] if x["head"] == head), None)
            if r is None or "memory" not in r:
                cells.append("–" if r is None else _error_cell(r))
                continue
            tile = f", tiles of {r['chunk_size']:,}" if r.get("chunk_size") else ""
            cells.append(f"{r['memory']['temp'] / 2**20:,.0f} MiB "
                         f"({fmt(r.get('temp_ratio_to_full'))}×{tile})")
        out.append(cells)
    first = loaded[0][2]["rows"][0]
    return "\n\n".join([
        f"XLA's compiled temporary memory (`compiled.memory_analysis()`, nothing run) of one "
        f"training step (mean training loss, gradients with respect to h and every weight, "
        f"float32, JAX on the CPU), N = {first['tokens']:,}, d = {first['dim']}; in brackets "
        "the ratio to `full` (FullSoftmax) of the same file and the vocabulary tile width. "
        "`mos15_dense` is the `[N, K, V]` reference loss. The last column compiles for the "
        "CPU with the tile widths chosen for a GPU (`--platform=gpu`).",
        table(["head"] + [title for title, _, _ in loaded], out),
        "\n".join(f"- {title}: " + provenance(name, _with_command(d))
                  for title, name, d in loaded)])


def section_device_heads(name, command=None):
    """Every exact head's training step against FullSoftmax in one process
    (`bench_device_heads.py`, issue 28): a GPU run or the CPU's. `command`:
    the one that writes `name`, said while it is absent."""
    data = load(name)
    if data is None:
        return missing(name) + (f" Command: `{command}`." if command else "")
    out = []
    for r in data["rows"]:
        cells = [f"{r.get('vocab', 0):,}", f"`{r['head']}`"]
        if "step_s" not in r:
            out.append(cells + [_error_cell(r), "–", "–", "–", "–"])
            continue
        temp = (r.get("compiled_memory") or {}).get("temp")
        temp_mib = temp / 2**20 if temp is not None else None
        out.append(cells + [fmt(1000 * r["step_s"], 1), fmt(r.get("ratio_to_full")),
                            fmt(temp_mib, 0), fmt(r.get("temp_ratio_to_full")),
                            fmt(r.get("first_call_s"), 1)])
    args = data.get("args", {})
    return "\n\n".join([
        f"{', '.join(data.get('devices', [])) or 'device ?'}, JAX {data.get('jax')}; "
        f"N = {args.get('tokens')}, d = {args.get('dim')}; jitted loss + gradients with "
        f"respect to h and every weight, median of {args.get('rounds')} interleaved rounds; "
        "the ratio is the median per-round ratio to FullSoftmax (`full`) of the same process. "
        f"Load average {_loadavg(data.get('loadavg'))} at the start.",
        table(["V", "head", "ms / step", "/ full (time)", "XLA temp MiB", "/ full (temp)",
               "first call s"], out),
        provenance(name, _with_command(data))])


#: `bench_mixture_summed.py`'s twin rows by suffix, and what the results
#: page says of them.
TWIN_TEXTS = {
    "_keras_ops": (" A `_keras_ops` row is the row before the suffix with Keras' "
                   "`ops.segment_sum` and `ops.take` in PLIF's kernels (PyTorch's paths "
                   "before session 34); its last column is its ratio to that row, which "
                   "takes `dispatch.segment_sum` and `dispatch.lookup` (on PyTorch "
                   "`index_add_` and `index_select`)."),
    "_two_exp": (" A `_two_exp` row is the `_summed` row before the suffix with the "
                 "summed cores' softmax as before session 34 (`ops.logsumexp`, then "
                 "`exp(s - lse)`); its last column is its ratio to that row, which takes "
                 "one exponential pass (`normaliser_and_exponentials`)."),
    "_copying": (" A `_copying` row is the `_summed` row before the suffix with every "
                 "elementwise step of the summed cores into a fresh tensor, as before "
                 "session 35 (`chunked.dispatch.overwritable` False); its last column is "
                 "its ratio to that row, whose steps PyTorch writes in place."),
}


MIXTURE_SUMMED_FILES = ("mixture_summed/keras_step_tf_n2048_v10000.json",
                        "mixture_summed/keras_step_torch_n2048_v10000.json")


def section_mixture_summed(names=MIXTURE_SUMMED_FILES):
    """The mixtures' Keras training step with the gradient in the forward
    pass against the tiled loss's (`bench_mixture_summed.py`), per backend."""
    loaded = [(name, load(name)) for name in names]
    loaded = [(name, d) for name, d in loaded if d is not None]
    if not loaded:
        return missing(names[0])
    out, sources, twins = [], [], set()
    for name, data in loaded:
        for r in data["rows"]:
            twins.update(kind for kind in TWIN_TEXTS if r["head"].endswith(kind))
            out.append([data.get("backend"), f"`{r['head']}`", fmt(1000 * r["step_s"], 0),
                        fmt(r.get("ratio_to_full")),
                        fmt(r.get("ratio_to_tiled", r.get("ratio_to_dispatch")))])
        sources.append(provenance(name, _with_command(data)))
    args = loaded[0][1].get("args", {})
    twin_text = "".join(text for kind, text in TWIN_TEXTS.items() if kind in twins)
    return "\n\n".join([
        f"`Sequential(Embedding, head)` + `HeadLoss`, SGD, `train_on_batch` on "
        f"B = {args.get('batch')} x T = {args.get('length')} tokens, d = {args.get('dim')}, "
        f"V = {args.get('vocab'):,}; median of {args.get('rounds')} interleaved rounds, each "
        "ratio the median per-round ratio (`/ tiled`: the `_summed` row, "
        "`gradient_in_forward=True`, to the same mixture with `False`)." + twin_text,
        table(["backend", "head", "ms / step", "/ full", "/ tiled"], out)] + sources)


#: PyTorch's summed cores with their elementwise steps in place against
#: fresh tensors (`bench_mixture_summed.py --copying`; the same program on
#: TensorFlow and JAX).
COPYING_FILES = ("mixture_summed/keras_step_torch_copying_n2048_v32768.json",
                 "mixture_summed/keras_step_torch_copying_n2048_v10000.json",
                 "mixture_summed/keras_step_torch_copying_plif_n2048_v10000.json",
                 "mixture_summed/keras_step_torch_copying_sig_n2048_v32768.json")


def keras_step_files(stem):
    """The three backends' `bench_mixture_summed.py` files of one run:
    `mixture_summed/keras_step_{backend}_{stem}.json`."""
    return tuple(f"mixture_summed/keras_step_{b}_{stem}.json"
                 for b in ("tensorflow", "jax", "torch"))


def section_plif_histogram(names=("plif_histogram/cpu_jax.json",
                                  "plif_histogram/cpu_jax_n64.json",
                                  "plif_histogram/cpu_jax_spread.json",
                                  "plif_histogram/gpu_jax.json")):
    """PLIF's slope histogram per method (scatter / sorted / pallas), issue 28."""
    loaded = [(name, load(name)) for name in names]
    loaded = [(name, d) for name, d in loaded if d is not None]
    if not loaded:
        return missing(names[0])
    out = []
    for _, d in loaded:
        args = d.get("args", {})
        shape = f"{args.get('n'):,} × {args.get('v'):,}"
        for r in d["rows"]:
            cells = [shape, r["row"], f"{r['knots']:,}", r["method"]]
            if "median_ms" not in r:
                out.append(cells + [_error_cell(r), "–", "–"])
                continue
            out.append(cells + [fmt(r["median_ms"], 1), fmt(r.get("ratio_to_first_method")),
                                _sci(r.get("max_abs_diff_to_first_method_rel"))])
        first = d.get("first_calls") if not d.get("complete", True) else None
        if first:  # a run stopped from outside while this row's methods ran
            for method, seconds in first["first_s"].items():
                out.append([shape, first["row"], f"{first['knots']:,}", method,
                            f"stopped: first call only, {fmt(seconds, 1)} s", "–", "–"])
    return "\n\n".join([
        "JAX (`jax.jit`), float32: `histogram` is the two slope histograms of the N × V "
        "scores into K bins, `loss_grad` `plif_log_likelihood`'s loss and gradients; each "
        "method timed in the same interleaved rounds, the ratio and the largest relative "
        "difference against the first method (`scatter`).",
        table(["N × V", "row", "K", "method", "median ms", "/ scatter",
               "max relative difference"], out),
        "\n".join(f"- {provenance(name, _machine_text(d))} Load average "
                  f"{_loadavg(d.get('loadavg'))}." for name, d in loaded)])


def missing_from_device_call(name, script):
    """`missing(name)` and the device call of issue 29 that writes it."""
    return (missing(name) + " Command: `benchmarks/device_cross_entropy.sh OUT_DIR` "
            f"(`benchmarks/{script}`).")


def section_plif_tile_memory(name="plif_histogram/tile_memory_cpu.json"):
    """PLIF's compiled temporary memory per accelerator tile (issue 28)."""
    data = load(name)
    if data is None:
        return missing(name)
    tiles = sorted({r["tile_elements"] for r in data["rows"]})
    paths = list(dict.fromkeys((r["platform"], r["method"] or "sorted") for r in data["rows"]))
    temp = {(r["platform"], r["method"] or "sorted", r["tile_elements"]): r["temp_gib"]
            for r in data["rows"]}
    out = [[f"2^{t.bit_length() - 1}"] + [fmt(temp.get(p + (t,)), 2) for p in paths]
           for t in tiles]
    args = data.get("args", {})
    return "\n\n".join([
        f"XLA's compiled temporary memory (GiB) of `plif_log_likelihood`'s loss and gradients "
        f"at N = {args.get('n'):,}, V = {args.get('v'):,}, K = {args.get('knots'):,}, each "
        "platform's path compiled on this CPU (nothing run; the scores themselves are "
        f"{args.get('n', 0) * args.get('v', 0) * 4 / 2**30:.2f} GiB):",
        table(["tile (scores)"] + [f"{p.upper()}, `{m}`" for p, m in paths], out),
        provenance(name, _with_command(data))])


def section_gpu_causal_lm(name="gpu_cross_entropy/bench_gpu_causal_lm.json"):
    """A keras-hub Gemma training step on a GPU, stock against fused (issue 29)."""
    data = load(name)
    if data is None:
        return missing_from_device_call(name, "bench_gpu_causal_lm.py")
    out = []
    for r in data["rows"].values():
        cells = [f"`{r['row']}`", f"{r.get('seq_len', 0):,}"]
        if "step_s" not in r:
            cells += [_error_cell(r), "–", "–"]
        else:
            cells += [fmt(1000 * r["step_s"], 1), fmt(r.get("ratio_to_stock")),
                      fmt(r["memory"]["peak_bytes"] / 2**30, 2)]
        probes = ", ".join(
            f"{p['seq_len']:,}: " + (f"{p['peak_bytes'] / 2**30:.1f} GiB"
                                     + ("" if p.get("fits") else " (does not fit)")
                                     if "peak_bytes" in p else _error_cell(p))
            for p in r.get("probes", []))
        out.append(cells + [probes or "–", fmt(r.get("max_seq_len"))])
    args = data.get("args", {})
    limit = data.get("memory_limit_bytes")
    return "\n\n".join([
        f"{', '.join(data.get('devices', [])) or 'device ?'}, JAX {data.get('jax')}, Keras "
        f"{data.get('keras')}; `GemmaBackbone` with V = {args.get('vocabulary_size'):,}, "
        f"d = {args.get('hidden_dim'):,}, {args.get('num_layers')} blocks, "
        f"{args.get('dtype')}, batch {args.get('batch_size')}; Keras' `train_step` (loss, "
        "gradients, Adam, metrics) under `jax.jit`, median of "
        f"{args.get('steps')} interleaved rounds. Peak: XLA's compiled memory (arguments + "
        "outputs - aliased + temporaries); a probe fits when its peak is at most "
        + (f"{limit / 2**30:.1f} GiB" if limit else "the device's memory")
        + f" ({data.get('memory_limit_source')}).",
        table(["row", "tokens", "ms / step", "/ stock (time)", "peak GiB",
               "probes (compiled peak)", "longest that fits"], out),
        provenance(name, _machine_text(data))])


def _eps_label(eps):
    """`2^-12` for a power of two, else the number."""
    if eps is None:
        return "exact"
    exponent = math.log2(eps)
    return f"2^{int(exponent)}" if exponent == int(exponent) else f"{eps:g}"


def section_filter_eps(name="filter_eps/ptb.json"):
    """Gradient filtering's effect on training (`bench_filter_eps.py`, issue 29)."""
    data = load(name)
    if data is None:
        return missing(name)
    exact = {r["seed"]: r["valid_perplexity"] for r in data["runs"] if r["eps"] is None}
    steps = [str(s) for s in data["config"]["probe_steps"]]
    rows = []
    for r in sorted(data["runs"], key=lambda r: (r["seed"], r["eps"] or 0)):
        probes = r.get("probes", {})
        skipped = " / ".join(f"{100 * probes[s]['skipped_fraction']:.0f}%" if s in probes else "–"
                             for s in steps)
        change = " / ".join(f"{100 * probes[s]['dw_relative_change']:.1f}%" if s in probes
                            else "–" for s in steps)
        ratio = r["valid_perplexity"] / exact[r["seed"]] if r["seed"] in exact else None
        rows.append([_eps_label(r["eps"]), r["seed"], fmt(r["valid_perplexity"], 1),
                     fmt(ratio) + "×" if ratio else "–",
                     skipped if r["eps"] is not None else "–",
                     change if r["eps"] is not None else "–"])
    c = data["config"]
    return "\n\n".join([
        f"PTB, a 2-layer LSTM ({c['units']} units), batches of {c['batch']} × {c['length']} "
        f"tokens, Adam, {c['steps']:,} steps; exact validation perplexity on the first "
        f"{c['valid_tokens']:,} validation tokens. Skipped blocks and the relative change of "
        f"the output matrix's gradient on one fixed training batch at steps "
        f"{' / '.join(steps)}.",
        table(["filter_eps", "seed", "valid ppl", "vs exact", "blocks skipped",
               "dW changed by"], rows),
        provenance(name, _with_command(data))])


def _sci_pair(x):
    """`_sci` of a number, or of each of a list's numbers joined by " / "."""
    if isinstance(x, (list, tuple)):
        return " / ".join(_sci(v) for v in x)
    return _sci(x)


def _cross_entropy_rows(data, extra=0):
    """`(row, cells)` per row of a `bench_gpu_cross_entropy.py` file: the row
    with its case's `"ratio"` entry added, and its time, memory and ratio to
    XLA's dense step (an error row: its error and `2 + extra` dashes)."""
    ratios = {(e["n"], e["d"], e["v"], e["dtype"]): e for e in data.get("ratios", [])}
    for r in data["rows"]:
        r = dict(r, ratio=ratios.get((r["n"], r["d"], r["v"], r["dtype"]), {}))
        if "step_s" not in r:
            yield r, [_error_cell(r)] + ["–"] * (2 + extra)
            continue
        yield r, [fmt(1000 * r["step_s"], 2), fmt(r.get("peak_over_inputs_mib"), 0),
                  fmt(r["ratio"].get(f"time_{r['row']}_over_xla_dense"))]


def section_gpu_cross_entropy(name="gpu_cross_entropy/bench_gpu_cross_entropy.json"):
    """The fused cross-entropy on a GPU against its peers (issue 29)."""
    data = load(name)
    if data is None:
        return missing_from_device_call(name, "bench_gpu_cross_entropy.py")
    out = []
    for r, measured in _cross_entropy_rows(data, extra=2):
        label = r["row"]
        if label == "ours_blocked":
            label += f" ({_tile_label(data, label)})"
        cells = [f"{r['n']:,} × {r['d']:,} × {r['v']:,}", r["dtype"], label] + measured
        if "step_s" in r:
            cells += [fmt(r["ratio"].get(f"time_{r['row']}_over_cce")),
                      _sci_pair(r.get("grad_rel_err_vs_xla_dense"))]
        out.append(cells)
    return "\n\n".join([
        "Forward + backward of the mean cross-entropy of `h Wᵀ` with respect to h and W "
        "(every 17th target ignored); median of the interleaved rounds. Gradient error: the "
        "largest relative error of dh / dW against XLA's dense step. Memory: PyTorch "
        "rows the CUDA allocator's peak over one step, JAX rows XLA's compiled `temp` + "
        "`output` (the gradients included on both).",
        table(["N × d × V", "dtype", "row", "ms / step", "MiB over the inputs",
               "/ xla_dense time", "/ cce time", "gradient error vs xla_dense"], out),
        provenance(name, _machine_text(data))])


def section_tail_tile(name="bench_tail_tile.json"):
    """The balanced tail tile against the old `chunk_size`-wide one."""
    data = load(name)
    if data is None:
        return missing(name)
    a = data["args"]
    out = [[f"{r['chunk_size']:,}", f"{r['old_width']:,} ({r['old_masked_columns']:,})",
            f"{r['new_width']:,} ({r['new_masked_columns']:,})",
            fmt(1000 * r["old_s"], 0), fmt(1000 * r["new_s"], 0), fmt(r["new_over_old"], 3),
            _sci(r["loss_relative_difference"])] for r in data["rows"]]
    return "\n\n".join([
        f"`linear_cross_entropy` loss and gradients, N = {a['n']:,}, d = {a['d']:,}, "
        f"V = {a['v']:,}, float32, `jax.jit`, median of {a['rounds']} interleaved rounds:",
        table(["chunk_size", "old width (masked columns)", "new width (masked columns)",
               "old ms", "new ms", "new / old time", "loss difference"], out),
        provenance(name, _with_command(data))])


#: `bench_forward_only.py`'s files, one per backend.
FORWARD_ONLY_FILES = tuple(f"forward_only/{b}.json" for b in ("jax", "tensorflow", "torch"))
FORWARD_ONLY_MODES = {"jit": "`jax.jit`", "graph": "`tf.function` graph",
                      "xla": "`tf.function(jit_compile=True)`", "eager": "eager"}


def section_forward_only(names=FORWARD_ONLY_FILES):
    """A summed loss's forward pass alone (evaluation), the tiled form's and
    the summed form's (`gradient_in_forward`), per backend and mode."""
    out, sources, shape = [], [], None
    for name, data in present(names, sources):
        a = data["args"]
        shape = f"N = {a['tokens']:,}, d = {a['dim']:,}, V = {a['vocab']:,}"
        by = {(r["mode"], r["loss"], r["form"]): r for r in data["rows"]}
        for mode, loss, form in by:
            if form != "summed":
                continue
            r, tiled = by[mode, loss, form], by[mode, loss, "tiled"]
            memory = r["compiled_temp_mib"]
            out.append([data["backend"], FORWARD_ONLY_MODES.get(mode, mode),
                        loss.replace("_", " "), fmt(tiled["forward_s"], 3),
                        fmt(r["forward_s"], 3), f"**{fmt(r['forward_over_tiled_forward'])}**",
                        fmt(r["train_s"], 3),
                        "–" if memory is None else
                        f"{fmt(memory['forward'], 0)} / {fmt(memory['train'], 0)}"])
        sources.append(provenance(name, _with_command(data)))
    if not out:
        return "\n\n".join(sources)
    return "\n\n".join([
        f"Mean loss, float32, {shape} (the forward KL's teacher twice as wide), the "
        f"forward pass alone (evaluation) against the loss with its gradients, medians of "
        f"interleaved rounds in one process per backend:",
        table(["backend", "mode", "loss", "tiled forward s", "summed forward s",
               "summed / tiled forward", "summed train s",
               "summed compiled temp MiB (forward / train)"], out),
        *sources])


VOCAB_PARALLEL_HEADS = {"full_softmax": "`FullSoftmax`", "sigsoftmax": "`SigSoftmax`",
                        "plif": "`PLIFSoftmax`", "mixture_of_softmaxes": "MoS(4)",
                        "mixture_of_contexts": "MoC(4)",
                        "hierarchical": "`HierarchicalSoftmax`",
                        "monotonic": "`MonotonicSoftmax`",
                        "monotonic:dense": "`MonotonicSoftmax`, dense (no `chunk_size`)",
                        "sampled_softmax": "`SampledSoftmax`"}


VOCAB_PARALLEL_FILES = ("vocab_parallel/memory_cpu_v65536.json",
                        "vocab_parallel/memory_cpu_v65536_d512.json",
                        "vocab_parallel/memory_cpu_v65536_per_token_heads.json",
                        "vocab_parallel/memory_cpu_v65536_adaptive_differentiated.json",
                        "vocab_parallel/memory_cpu_v65536_moc_summed.json")
# Rows whose head trained another way in another file: (file, head) -> label.
VOCAB_PARALLEL_LABELS = {
    ("vocab_parallel/memory_cpu_v65536_per_token_heads.json", "mixture_of_contexts"):
        "MoC(4), per-token (`gradient_in_forward=False`)",
    ("vocab_parallel/memory_cpu_v65536_moc_summed.json", "mixture_of_contexts"):
        "MoC(4), summed (its default)",
}


def section_vocab_parallel(names=VOCAB_PARALLEL_FILES):
    """Per-device compiled memory of `train_lm`'s training step and of its
    head's evaluation under `VocabularyParallel`, with the library's
    vocabulary-parallel passes and with XLA's partitioning of the same
    layouts, against one device (`bench_vocab_parallel_memory.py`)."""
    out, sources, shape = [], [], None
    for name, data in present(names, sources):
        shape = data["shape"]
        for r in data["rows"]:
            one, ours, xla = r["one_device"], r["sharded"], r["sharded_by_xla"]
            # XLA's all-gathers, and the all-reduces of a gathered array
            # (the hierarchical head's blocks).
            gathered = [(c.split()[1].split("{")[0] if c.startswith("all-gather")
                         else f"{c.split()[0]} {c.split()[1].split('{')[0]}")
                        for c in xla["collectives"] + xla.get("eval_collectives", [])
                        + xla.get("head_collectives", [])
                        if c.startswith(("all-gather", "all-reduce"))]
            label = VOCAB_PARALLEL_LABELS.get(
                (name, r["head"]), VOCAB_PARALLEL_HEADS.get(r["head"], r["head"]))
            out.append([f"{shape['dim']:,}", label,
                        fmt(one["temp_mib"], 1), fmt(one["argument_mib"], 1),
                        f"{fmt(ours['temp_mib'], 1)} ({fmt(r['temp_ratio'])}x)",
                        f"{fmt(ours['argument_mib'], 1)} ({fmt(r['argument_ratio'])}x)",
                        f"{fmt(xla['temp_mib'], 1)} ({fmt(r['temp_ratio_by_xla'])}x)",
                        " / ".join(fmt(x["head_train_temp_mib"], 1) for x in (one, ours, xla)),
                        " / ".join(fmt(x["eval_temp_mib"], 1) for x in (one, ours, xla)),
                        "yes" if r["gathers_vocabulary"] or r.get("eval_gathers_vocabulary")
                        else "none",
                        ", ".join(f"`{g}`" for g in sorted(set(gathered))) or "none"])
        sources.append(provenance(name, _with_command(data)))
    if not out:
        return "\n\n".join(sources)
    return "\n\n".join([
        f"One device of {shape['devices']} (simulated CPU devices, all on the vocabulary axis), "
        f"the tied LSTM of `examples/train_lm.py` (d below), V = {shape['vocab']:,}, a batch of "
        f"{shape['batch']} x {shape['bptt']} tokens, `chunk_size` {shape['chunk_size']:,}, "
        f"Adam; XLA's `compiled.memory_analysis()` of Keras' `train_step` (temporaries; "
        f"arguments: weights, optimizer state, batch; the LSTM's unrolled steps take most of "
        f"the step's temporaries at d = 512), of the head's training pass alone (its summed "
        f"objective and gradients given the contexts) and of its per-token `log_likelihood` "
        f"of the batch (evaluation), MiB. The first four heads and MoC (summed) train their "
        f"summed objective (the gradient in the forward pass), the others their per-token loss "
        f"(`SampledSoftmax` its sampled loss; its evaluation is exact); a dense head "
        f"is built without `chunk_size`:",
        table(["d", "head", "one device: step temp", "args",
               "vocabulary-parallel: step temp", "args", "XLA's partitioning: step temp",
               "head's training pass temp (one / ours / XLA's)",
               "evaluation temp (one / ours / XLA's)", "ours gathers V",
               "XLA's all-gathers (and all-reduces)"], out),
        *sources])


def section_tiled_memory(name="gpu_cross_entropy/tiled_memory_cpu.json"):
    """The tiled pass's compiled memory per tile width (`bench_cross_entropy_memory.py`)."""
    data = load(name)
    if data is None:
        return missing(name)
    a = data["args"]
    out = [[f"{r['chunk_size']:,}", fmt(r["temp_mib"], 1), fmt(r["tile_mib"], 1),
            fmt(r["temp_mib"] - data["dh_float32_accumulator_mib"], 1)] for r in data["rows"]]
    return "\n\n".join([
        f"XLA's compiled temporaries of the tiled pass's step (`implementation=\"ops\"`) at "
        f"N = {a['n']:,}, d = {a['d']:,}, V = {a['v']:,}, {a['dtype']}, compiled on this CPU "
        f"(nothing run); the float32 `dh` accumulator alone is "
        f"{data['dh_float32_accumulator_mib']:.0f} MiB, the gradients "
        f"{data['gradients_mib']:,.0f} MiB:",
        table(["chunk_size", "temp MiB", "one [N, chunk] float32 tile MiB",
               "temp beyond the dh accumulator MiB"], out),
        provenance(name, _with_command(data))])


def _tile_label(data, row):
    """`ours_blocked`'s token block × tile width (`bench_gpu_cross_entropy.py`
    settings), the `chunk_size` of the others' (the kernel's backward chunk,
    the tiled pass's tile width)."""
    settings = data.get("settings", {})
    if row == "ours_blocked":
        return (f"{settings.get('token_chunk_size', 2048):,} × "
                f"{settings.get('blocked_chunk_size', 2048):,}")
    if row == "ours_summed":
        tokens = settings.get("summed_token_chunk_size")
        return f"{tokens:,} tokens" if tokens else "default tokens"
    chunk = settings.get("chunk_size")
    return f"{chunk:,}" if chunk else "–"


def section_gpu_cross_entropy_blocks(folder="gpu_cross_entropy"):
    """The third device call (`BLOCK_SWEEP=1`, issue 29): one table of the
    `bench_gpu_cross_entropy_blocks_*.json` (the kernel's blocks),
    `bench_gpu_cross_entropy_chunk_*.json` (the tiled pass's tile width) and
    `bench_gpu_cross_entropy_blocked_*.json` (token blocks) and
    `bench_gpu_cross_entropy_summed_*.json` (the gradient in the forward
    pass) files, each row's ratio to XLA's dense step of its own process."""
    names = sorted(f for f in os.listdir(os.path.join(RESULTS, folder))
                   if f.startswith(("bench_gpu_cross_entropy_blocks_",
                                    "bench_gpu_cross_entropy_chunk_",
                                    "bench_gpu_cross_entropy_blocked_",
                                    "bench_gpu_cross_entropy_summed_")) and f.endswith(".json"))
    if not names:
        return ("*Not measured yet: no `bench_gpu_cross_entropy_blocks_*.json`.* Command: "
                "`BLOCK_SWEEP=1 benchmarks/device_cross_entropy.sh OUT_DIR`.")
    out, sources = [], []
    for file in names:
        data = load(f"{folder}/{file}")
        blocks = data["settings"].get("blocks")
        for r, measured in _cross_entropy_rows(data):
            out.append([" × ".join(str(b) for b in blocks) if blocks else "default",
                        _tile_label(data, r["row"]),
                        f"{r['n']:,} × {r['d']:,} × {r['v']:,}", r["dtype"], r["row"]]
                       + measured)
        sources.append(provenance(f"{folder}/{file}", _machine_text(data)))
    return "\n\n".join([
        table(["kernel blocks (n × v × d)",
               "chunk_size (ours_blocked: tokens × words; ours_summed: tokens)",
               "N × d × V", "dtype", "row", "ms / step", "MiB over the inputs",
               "/ xla_dense time"], out), "\n".join(sources)])


def section_token_blocks(names=("bench_token_blocks.json", "bench_token_blocks_long.json",
                                "gpu_cross_entropy/token_blocks_memory_cpu.json")):
    """Token blocks against the one-pass tiled pass (`bench_token_blocks.py`):
    compiled temporaries and, where run, the time on this CPU."""
    out, sources = [], []
    for name in names:
        data = load(name)
        if data is None:
            out.append([f"`{name}` missing"] + ["–"] * 6)
            continue
        a = data["args"]
        for r in data["rows"]:
            tokens = r["token_chunk_size"]
            out.append([f"{a['n']:,} × {a['d']:,} × {a['v']:,}",
                        f"{tokens:,} × {r['chunk_size']:,}" if tokens
                        else f"all × {r['chunk_size']:,} (one pass)",
                        fmt(r["temp_mib"], 1), fmt(r["temp_ratio"], 2),
                        fmt(1000 * r["step_s"], 0) if "step_s" in r else "compiled only",
                        fmt(r.get("time_ratio"), 2) if "step_s" in r else "–",
                        _sci(max(r["grad_rel_err"])) if "grad_rel_err" in r else "–"])
        sources.append(provenance(name, _with_command(data)))
    return "\n\n".join([
        table(["N × d × V (float32)", "tile: tokens × words", "temp MiB", "/ first row",
               "ms / step", "/ first row", "gradient difference"], out), "\n".join(sources)])


# ----------------------------------------------------------- README lines
README = os.path.join(REPO, "README.md")
SUMMARY_START = "<!-- results-summary: generated by benchmarks/results_page.py -->"
SUMMARY_END = "<!-- /results-summary -->"


def readme_summary():
    """The README's three headline lines (Markdown list), from the raw results."""
    lines = []
    data = []
    for name in ("bench_large_vocab.json", "bench_large_vocab_v33k.json"):
        d = load(name)
        if d is not None:
            data += d["rows"] if isinstance(d, dict) else d
    rows = _large_vocab_rows(data, "xla")
    v = 100_000
    full = rows.get(("FullSoftmax", v, "train"))
    if full:
        picks = [("HierarchicalSoftmax", "hierarchical"), ("SampledSoftmax log_uniform", "sampled"),
                 ("NCE unigram", "NCE"), ("DifferentiatedSoftmax", "D-Softmax")]
        parts = [f"{label} {full['step_s'] / rows[(row, v, 'train')]['step_s']:.0f}×"
                 for row, label in picks if (row, v, "train") in rows]
        lines.append(f"**Speed** (V = 100k, d = 512, N = 2048, TensorFlow XLA, 2 CPU cores): a "
                     f"training step is faster than the full softmax's by {', '.join(parts)}.")
    # The 20-minute study ran every head with today's defaults (NCE's and
    # Weaknorm's starts); the 300 s one (study_chen_ptb.json) predates them.
    chen = load("study_chen_ptb_long.json") or load("study_chen_ptb.json")
    if chen and chen["rows"]:
        r = _study_rows(chen)
        ranked = sorted(r.values(), key=lambda x: x["test_perplexity"])
        best = ranked[0]
        soft = r.get("softmax")
        seconds = min(x["train_seconds"] for x in ranked)
        budget = f"{seconds / 60:.0f} minutes" if seconds >= 120 else f"{seconds:.0f} s"
        text = (f"**PTB, equal time** (Chen et al. 2016's protocol, 6-gram NNLM, "
                f"{budget} each on one core): best test perplexity "
                f"{best['row']} {fmt(best['test_perplexity'], 1)}")
        if soft:
            text += f", softmax {fmt(soft['test_perplexity'], 1)}"
        text += f", worst {ranked[-1]['row']} {fmt(ranked[-1]['test_perplexity'], 1)}."
        lines.append(text)
    bottleneck = load("study_bottleneck_ptb.json")
    if bottleneck and bottleneck["rows"]:
        r = _study_rows(bottleneck)
        soft = r.get("softmax")
        others = sorted((x for k, x in r.items() if k != "softmax"),
                        key=lambda x: x["test_perplexity"])
        text = "**PTB, bottleneck heads** (Zaremba-small LSTM, one epoch each): test perplexity "
        if soft:
            text += f"softmax {fmt(soft['test_perplexity'], 1)}; "
            better = [x for x in others if x["test_perplexity"] < soft["test_perplexity"]]
            worse = [x for x in others if x not in better]
            parts = [f"{x['row']} {fmt(x['test_perplexity'], 1)}" for x in better]
            text += ", ".join(parts) + (" (below it)" if parts else "")
            if worse:
                text += "; " + ", ".join(f"{x['row']} {fmt(x['test_perplexity'], 1)}"
                                         for x in worse)
        else:
            text += ", ".join(f"{x['row']} {fmt(x['test_perplexity'], 1)}" for x in others)
        lines.append(text + ".")
    gpu = _gpu_summary()
    if gpu:
        lines.append(gpu)
    lines.append("Everything, with commands and machines: [docs/results.md](docs/results.md).")
    return "\n".join(f"* {line}" if not line.startswith("Everything") else line
                     for line in lines)


def _gpu_summary():
    """The README's GPU line: the mixtures' and PLIF's step against the full
    softmax's (`device_heads_v33278.json`), the fused loss's default against
    XLA's dense step at the Gemma bfloat16 shape (`bench_gpu_cross_entropy.json`);
    None until both exist."""
    heads = load("device_heads/device_heads_v33278.json")
    loss = load("gpu_cross_entropy/bench_gpu_cross_entropy.json")
    if heads is None or loss is None:
        return None
    ratio = {r["head"]: r.get("ratio_to_full") for r in heads["rows"] if r.get("vocab") == 33278}
    rows = {r["row"]: r for r in loss["rows"]
            if r.get("dtype") == "bfloat16" and r.get("v") == 256000 and "step_s" in r}
    if not all(ratio.get(k) for k in ("mos15", "plif")) or not {"xla_dense", "ours_tiled"} <= set(rows):
        return None
    dense, tiled = rows["xla_dense"], rows["ours_tiled"]
    device = (loss.get("devices") or {}).get("torch") or "one GPU"
    return (f"**On a GPU** (one {device}, JAX; N = 8,192 tokens): "
            f"MixtureOfSoftmaxes(15) trains at V = 33,278 in {ratio['mos15']:.1f}× the full "
            f"softmax's step; PLIF takes {ratio['plif']:.1f}×"
            + (" (issue 28's target: 1.5×)" if ratio["plif"] > 1.5 else "")
            + "; the fused cross-entropy (default, tiled) at the Gemma 2 2B shape in "
            f"bfloat16 takes {tiled['step_s'] / dense['step_s']:.2f}× XLA's dense step with "
            f"{tiled['peak_over_inputs_mib'] / dense['peak_over_inputs_mib'] * 100:.0f}% of its "
            f"memory.")


def updated_readme():
    with open(README) as f:
        text = f.read()
    if SUMMARY_START not in text or SUMMARY_END not in text:
        raise ValueError(f"README.md lacks the markers {SUMMARY_START} ... {SUMMARY_END}")
    head, rest = text.split(SUMMARY_START, 1)
    _, tail = rest.split(SUMMARY_END, 1)
    return head + SUMMARY_START + "\n" + readme_summary() + "\n" + SUMMARY_END + tail


# ------------------------------------------------------------------- page
def build(make_figures=True):
    if make_figures:
        os.makedirs(FIGURES, exist_ok=True)
    chen, chen_fig = section_chen(make_figures)
    chen_long, chen_long_fig = section_chen(
        make_figures, "study_chen_ptb_long.json", "chen_ptb_long_valid_curves.png",
        "PTB 6-gram NNLM, 20 minutes per head, dropout 0.5")
    chen_nodrop, _ = section_chen(
        False, "study_chen_ptb_long_nodropout.json", "-", "")
    bottleneck, bands, bands_fig = section_bottleneck(make_figures)
    speed_large, speed_fig = section_speed_large(make_figures)
    gpu_large, gpu_fig = section_speed_large(
        make_figures, ("bench_large_vocab_gpu_jax.json",), where="JAX", machine="H100",
        png="speed_vs_vocab_gpu.png")
    parts = {
        "loop": section_loop(),
        "zaremba": section_zaremba(),
        "chen_table": chen,
        "chen_figure": chen_fig,
        "bottleneck_table": bottleneck,
        "bottleneck_bands": bands,
        "bottleneck_figure": bands_fig,
        "robustness": section_robustness(),
        "chen_long_table": chen_long,
        "chen_long_figure": chen_long_fig if load("study_chen_ptb_long.json") else "",
        "chen_long_nodropout": chen_nodrop,
        "converged": section_converged(CONVERGED_STUDIES[0]),
        "regularized": section_converged(CONVERGED_STUDIES[1]),
        "synthetic": section_synthetic(make_figures),
        "speed_large": speed_large,
        "speed_figure": speed_fig,
        "speed_exact": section_speed_exact(),
        "speed_peers": section_peers(),
        "gpu_large": gpu_large,
        "gpu_figure": gpu_fig,
        "gpu_exact": section_speed_exact("bench_exact_heads_gpu_jax.json"),
        "gpu_peers": section_peers("bench_peers_gpu.json"),
        "adaptive_bench": section_adaptive_bench(),
        "adaptive_chunked": section_adaptive_bench("bench_adaptive_chunked.json"),
        "adaptive_jax": section_adaptive_jax(),
        "adaptive_torch": section_adaptive_torch(),
        "adaptive_study": section_adaptive_study(),
        "adaptive_threads": section_adaptive_threads(),
        "adaptive_intel": section_adaptive_intel(),
        "adaptive_in_forward_probe": section_adaptive_in_forward_probe(),
        "adaptive_gradient_blocks": section_adaptive_gradient_blocks(),
        "adaptive_memory": section_adaptive_memory(),
        "fused_lce": section_fused_lce(),
        "fused_lce_xla": section_fused_lce("bench_linear_cross_entropy_xla.json"),
        "fused_lce_jax": section_fused_lce("bench_linear_cross_entropy_jax.json"),
        "fused_lce_summed_jax": section_fused_lce("bench_linear_cross_entropy_summed_jax.json"),
        "fused_lce_summed_tf": section_fused_lce("bench_linear_cross_entropy_summed_tf.json"),
        "fused_lce_summed_jax_v131072": section_fused_lce(
            "bench_linear_cross_entropy_summed_jax_v131072.json"),
        "fused_lce_frozen": section_fused_lce_frozen(),
        "fused_lce_gpu": section_fused_lce_gpu(),
        "fused_causal_lm": section_fused_causal_lm(),
        "token_scores": section_token_scores(),
        "distillation": section_distillation(),
        "mixture_memory": section_mixture_memory(),
        "mixture_step_time": section_device_heads(
            "mixture_memory/mixture_step_time_cpu_n2048_v10000.json"),
        "mixture_summed_step_time": section_device_heads(
            "mixture_summed/step_time_cpu_n2048_v10000.json"),
        "mixture_summed_keras": section_mixture_summed(),
        "full_chunked_summed_keras": section_mixture_summed(keras_step_files("full_chunked_n2048_v32768")),
        "sig_chunked_summed_keras": section_mixture_summed(keras_step_files("sigsoftmax_n2048_v32768")),
        "plif_chunked_summed_keras": section_mixture_summed(keras_step_files("plif_n2048_v32768")),
        "mos_plif_summed_keras": section_mixture_summed(keras_step_files("mos_plif_n2048_v10000")),
        "two_exp_keras": section_mixture_summed(keras_step_files("two_exp_n2048_v10000")),
        **{f"copying_keras_{i}": section_mixture_summed((name,))
           for i, name in enumerate(COPYING_FILES)},
        "plif_histogram": section_plif_histogram(),
        "plif_tile_memory": section_plif_tile_memory(),
        "device_heads_v33278": section_device_heads(
            "device_heads/device_heads_v33278.json", DEVICE_HEADS_COMMAND),
        "device_heads_v100000": section_device_heads(
            "device_heads/device_heads_v100000.json", DEVICE_HEADS_COMMAND),
        "distillation_tensorflow_allocator": section_distillation(
            "distillation/bench_distillation_tensorflow_allocator.json"),
        "distillation_tensorflow_chunk256": section_distillation(
            "distillation/bench_distillation_tensorflow_chunk256.json"),
        "distillation_n2048": section_distillation(
            "distillation/bench_distillation_n2048_v32768.json"),
        "distillation_n2048_tensorflow": section_distillation(
            "distillation/bench_distillation_n2048_v32768_tensorflow.json"),
        "gpu_cross_entropy": section_gpu_cross_entropy(),
        "gpu_cross_entropy_blocks": section_gpu_cross_entropy_blocks(),
        "token_blocks": section_token_blocks(),
        "tiled_memory": section_tiled_memory(),
        "tail_tile": section_tail_tile(),
        "forward_only": section_forward_only(),
        "vocab_parallel": section_vocab_parallel(),
        "gpu_causal_lm": section_gpu_causal_lm(),
        "filter_eps": section_filter_eps(),
    }
    with open(TEMPLATE) as f:
        template = f.read()
    used = set(re.findall(r"\{\{(\w+)\}\}", template))
    unknown = used - set(parts)
    if unknown:
        raise ValueError(f"Unknown placeholders in {TEMPLATE}: {sorted(unknown)}")
    page = re.sub(r"\{\{(\w+)\}\}", lambda m: parts[m.group(1)], template)
    header = ("<!-- Generated by benchmarks/results_page.py from docs/results.template.md "
              "and docs/results/: edit those, not this file. -->\n")
    return header + page


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="Exit 1 if docs/results.md differs from what would be generated.")
    args = parser.parse_args(argv)
    page = build(make_figures=not args.check)
    readme = updated_readme()
    if args.check:
        stale = []
        for path, text in ((PAGE, page), (README, readme)):
            with open(path) as f:
                if f.read() != text:
                    stale.append(os.path.relpath(path, REPO))
        if stale:
            print(f"{', '.join(stale)} stale: run python benchmarks/results_page.py",
                  file=sys.stderr)
            return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(page)
    with open(README, "w") as f:
        f.write(readme)
    print(f"Wrote {PAGE}, {FIGURES}/*.png and the summary in {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
