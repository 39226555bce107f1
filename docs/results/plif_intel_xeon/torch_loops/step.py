"""One process of the A/B in `run.sh` (session 51): with the package on `PYTHONPATH`, PLIFSoftmax's
and FullSoftmax's training steps (`benchmarks/steps.py`, eager, Zipf targets from
`reference_inputs`, N = 2,048, K = 1e5) and `functional.plif` alone on `[2048, V]` scores
(forward under `no_grad`, and forward + backward), rows alternated, medians; prints one JSON line.

    PYTHONPATH=<package> KERAS_BACKEND=torch taskset -c 0 python step.py V d ROUNDS [THREADS]
"""
import json, os, sys, time
import numpy as np
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "benchmarks"))
import keras, torch
V, D, ROUNDS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
THREADS = int(sys.argv[4]) if len(sys.argv) > 4 else 1
torch.set_num_threads(THREADS)
import keras_softmax_heads as ksh, steps
from keras_softmax_heads import functional
from reference_inputs import numpy_inputs
N = 2048
h_np, y_np = numpy_inputs(N, V, D)
h, y = steps.tensor(h_np), steps.tensor(y_np)
rows = {}
for name in ["full", "plif"]:
    keras.utils.set_random_seed(0)
    head = ksh.FullSoftmax(V) if name == "full" else ksh.PLIFSoftmax(V, num_knots=100_000, knot_bound=20.0)
    head.build((None, D))
    step = steps.train_step(head, "eager", reduction="mean", summed=True)
    rows[name] = lambda step=step: float(step(h, y))
rng = np.random.default_rng(0)
z = torch.tensor(rng.normal(size=(N, V)).astype("float32") * 3)
raw = torch.tensor(rng.normal(size=(100_000,)).astype("float32") * 0.1)
def plif_forward():
    with torch.no_grad():
        functional.plif(z, raw, 20.0)
def plif_forward_backward():
    zz, rr = z.detach().requires_grad_(True), raw.detach().requires_grad_(True)
    torch.autograd.grad(functional.plif(zz, rr, 20.0).sum(), [zz, rr])
rows["plif_fn_forward"] = plif_forward
rows["plif_fn_forward_backward"] = plif_forward_backward
losses = {k: rows[k]() for k in ("full", "plif")}
for k in rows:
    rows[k]()
times = {k: [] for k in rows}
order = list(rows)
for r in range(ROUNDS):
    order = order[1:] + order[:1]
    for k in order:
        t = time.perf_counter(); rows[k](); times[k].append((time.perf_counter() - t) * 1e3)
full = np.array(times["full"])
print(json.dumps({"package": os.path.dirname(ksh.__file__), "v": V, "d": D, "n": N, "threads": THREADS,
                  "rounds": ROUNDS, "losses": losses, "times_ms": times,
                  "median_ms": {k: float(np.median(v)) for k, v in times.items()},
                  "plif_over_full": float(np.median(np.array(times["plif"]) / full)),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
