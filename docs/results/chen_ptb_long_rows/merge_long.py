"""Merge the per-row rerun files into docs/results/study_chen_ptb_long.json (study order),
and print each row's idle share from its log (1 - steps per wall second / the progress
bar's step rate at each epoch's end)."""
import json, re, sys, glob, os
order = ["softmax", "d_softmax", "sampling", "hsm_random", "hsm_frequency", "hsm_kmeans",
         "hsm_weighted_kmeans", "nce", "weaknorm", "weaknorm_sq"]
rows, header = [], None
for name in order:
    f = f"/work/study_runs/out/chen_ptb_long__{name}.json"
    if not os.path.exists(f):
        print("missing", name); continue
    d = json.load(open(f))
    header = header or {k: v for k, v in d.items() if k != "rows"}
    (r,) = d["rows"]
    log = open(f"/work/study_runs/chen_ptb_long__{name}.log", errors="replace").read()
    full = re.findall(r"(\d+)/(\d+)\x1b\[0m[^/]*?(\d+)ms/step", log)
    # each full epoch's mean ms/step (Keras prints the last update twice);
    # the last epoch was cut by the budget
    bars = [(int(a), float(m)) for a, b, m in full if a == b][::2]
    curve = r["valid_curve"]
    bars = bars[:len(curve) - 1]
    busy = sum(n * m / 1000.0 for n, m in bars)
    wall = curve[len(bars) - 1]["train_seconds"] if bars and len(curve) >= len(bars) else None
    rate = len(bars) and 1000.0 * len(bars) / sum(m for _, m in bars)
    r["idle_share"] = None if not wall else 1 - busy / wall
    print(f"{name:22s} test {r['test_perplexity']:7.1f} valid {r['valid_perplexity']:7.1f} steps {r['global_steps']:6d} "
          f"epochs {r['epochs']:3d} steps/s {r['steps_per_second']:6.2f} bar {rate and round(rate,2)} idle {r['idle_share']}")
    r.pop("idle_share")
    rows.append(r)
if len(sys.argv) > 1 and len(rows) == len(order):
    json.dump({**header, "rows": rows}, open(sys.argv[1], "w"), indent=2)
    print("wrote", sys.argv[1])
