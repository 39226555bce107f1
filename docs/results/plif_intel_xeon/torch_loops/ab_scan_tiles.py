"""A/B of session 51: `dispatch.scan_tiles` on PyTorch as a loop writing each tile into preallocated outputs (this checkout) against Keras' `ops.scan` (every tile kept, stacked at the end), swapped in one process, rounds alternated, eager training steps (`benchmarks/steps.py`), N = 2,048, one thread. `plif_summed`: PLIFSoftmax(chunk_size=4096), K = 1e5 (its tiles: `functional.scan_row_tiles`); `monotonic`: MonotonicSoftmax (its units loop, no stacked outputs).

    KERAS_BACKEND=torch taskset -c 0 python ab_scan_tiles.py V d ROUNDS ROWS OUT.json
"""
import os, sys, time, numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "benchmarks"))
import keras, torch
torch.set_num_threads(1)
from keras import ops
import keras_softmax_heads as ksh, steps
from keras_softmax_heads.functional import dispatch, plif_kernels
from reference_inputs import numpy_inputs
V, D, N = int(sys.argv[1]), int(sys.argv[2]), 2048
h_np, y_np = numpy_inputs(N, V, D)
h, y = steps.tensor(h_np), steps.tensor(y_np)
new_scan = dispatch.scan_tiles
def old_scan(body, carry, xs, ys_dtypes):
    return ops.scan(body, carry, xs)
heads = {"plif_summed": lambda: ksh.PLIFSoftmax(V, num_knots=100_000, knot_bound=20.0, chunk_size=4096),
         "monotonic": lambda: ksh.MonotonicSoftmax(V)}
which = sys.argv[4].split(",")
rows = {}
for name in which:
    keras.utils.set_random_seed(0)
    head = heads[name](); head.build((None, D))
    rows[name] = steps.train_step(head, "eager", reduction="mean", summed=True)
def run(name, scan):
    plif_kernels.scan_tiles = scan; dispatch.scan_tiles = scan
    import keras_softmax_heads.functional as F; F.scan_tiles = scan
    try: return float(rows[name](h, y))
    finally:
        plif_kernels.scan_tiles = new_scan; dispatch.scan_tiles = new_scan; F.scan_tiles = new_scan
results = {}
for name in which:
    print(name, "losses", run(name, old_scan), run(name, new_scan))
    times = {"old": [], "new": []}
    for r in range(int(sys.argv[3])):
        for k, sc in (("old", old_scan), ("new", new_scan))[:: (1 if r % 2 else -1)]:
            t = time.perf_counter(); run(name, sc); times[k].append(time.perf_counter() - t)
    o, n = np.array(times["old"]), np.array(times["new"])
    print(name, "old", np.round(o * 1e3), "new", np.round(n * 1e3), "new/old", np.round(n / o, 3), "median", np.median(n / o))
    results[name] = {"losses": [run(name, old_scan), run(name, new_scan)], "times_s": times, "new_over_old_median": float(np.median(n / o))}
import json
json.dump({"v": V, "d": D, "n": N, "rounds": int(sys.argv[3]), "rows": results,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, open(sys.argv[5], "w"), indent=1)
