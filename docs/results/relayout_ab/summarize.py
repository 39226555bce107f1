"""A/B summary: per configuration, base (b3ae0db) and main (re-laid-out) times and memory, per round, and ratios main/base of the best time and of the smallest memory over the rounds."""
import glob, json, os, collections
OUT = "/work/ab/out"
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for path in glob.glob(f"{OUT}/lce_*.json") + glob.glob(f"{OUT}/bf16_*.json"):
    name = os.path.basename(path)[:-5]
    parts = name.split("_")
    rnd = parts[-1]
    lib = parts[-2] if not name.startswith("bf16") else "_".join(parts[1:-1])
    for r in json.load(open(path))["rows"]:
        key = ("lce", r["framework"].split("(")[-1].rstrip(")"), r["mode"], r["dtype"], r["n"], r["d"], r["v"])
        rows[key][lib].append((r["step_s"], r["extra_mib"]))
for path in glob.glob(f"{OUT}/chunked_*.json"):
    name = os.path.basename(path)[:-5]
    _, lib, rnd = name.split("_")
    for r in json.load(open(path)):
        key = ("chunked", r["backend"], r["mode"], "float32", r["n"], r["d"], r["v"])
        rows[key][lib].append((r["step_s"], r["peak_mb"]))
summary = []
for key in sorted(rows):
    libs = rows[key]
    line = {"config": list(key)}
    for lib, vals in libs.items():
        line[lib] = {"step_s": [round(v[0], 3) for v in vals], "extra_mib": [round(v[1], 1) for v in vals]}
    for lib in libs:
        if lib == "base" or "base" not in libs:
            continue
        line[f"{lib}/base"] = {
            "time_best": round(min(v[0] for v in libs[lib]) / min(v[0] for v in libs["base"]), 3),
            "time_median": round(sorted(v[0] for v in libs[lib])[len(libs[lib]) // 2] / sorted(v[0] for v in libs["base"])[len(libs["base"]) // 2], 3),
            "memory_min": round(min(v[1] for v in libs[lib]) / min(v[1] for v in libs["base"]), 3),
            "memory_max": round(max(v[1] for v in libs[lib]) / max(v[1] for v in libs["base"]), 3),
        }
    summary.append(line)
    print(json.dumps(line))
json.dump(summary, open(f"{OUT}/summary.json", "w"), indent=1)
