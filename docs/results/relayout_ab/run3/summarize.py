"""Run 3 summary: per configuration and round, base (b3ae0db) and main times and extra memory,
and the ratios main / base of the round (the rows of one round ran back to back)."""
import collections, glob, json, os, sys

OUT = sys.argv[1] if len(sys.argv) > 1 else "/work/ab3/out"
rows = collections.defaultdict(dict)  # (config, round) -> lib -> (time, memory)
for path in glob.glob(f"{OUT}/lce_*.json"):
    *_, lib, rnd = os.path.basename(path)[:-5].split("_")
    for r in json.load(open(path))["rows"]:
        key = ("lce", "tensorflow", r["mode"], r["dtype"], r["n"], r["d"], r["v"])
        rows[key, rnd][lib] = (r["step_s"], r["extra_mib"])
for path in glob.glob(f"{OUT}/chunked_*.json"):
    _, lib, rnd = os.path.basename(path)[:-5].split("_")
    for r in json.load(open(path)):
        key = ("chunked", r["backend"], r["mode"], "float32", r["n"], r["d"], r["v"])
        rows[key, rnd][lib] = (r["step_s"], r["peak_mb"])
summary = []
for (key, rnd) in sorted(rows):
    libs = rows[key, rnd]
    line = {"config": list(key), "round": int(rnd),
            **{lib: {"step_s": round(t, 3), "memory_mib": round(m, 1)} for lib, (t, m) in libs.items()}}
    if "base" in libs and "main" in libs:
        line["main/base"] = {"time": round(libs["main"][0] / libs["base"][0], 3),
                             "memory": round(libs["main"][1] / libs["base"][1], 3)}
    summary.append(line)
    print(json.dumps(line))
json.dump(summary, open(os.path.join(os.path.dirname(__file__), "summary.json"), "w"), indent=1)
