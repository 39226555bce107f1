"""PLIFSoftmax's step on this CPU against FullSoftmax's, with variants, in one process.

A probe (session 49), not a benchmark of record. TensorFlow, one thread, XLA
(`steps.train_step(head, "xla", summed=True)`: the objective `HeadLoss` trains), N = 2,048,
`reference_inputs.numpy_inputs` (Zipf targets), K = 100,000 knots on [-20, 20]. Rows: `full`;
`plif` (the library's path); `tileP` (`plif_kernels.TILE_ELEMENTS = 2**P` while traced);
`hist_spread` (the histogram as a scatter into interleaved copies); ablations that give
wrong gradients, to price a piece: `no_hist` (the two slope histograms replaced by zeros),
`no_lookup` (the two table lookups replaced by an elementwise stand-in), `no_both`. Each
round runs every row (the median of 3 calls), order rotated; ratios are per round.

    OMP_NUM_THREADS=1 taskset -c 0 python probe_plif.py V d ROUNDS OUT.json plif,no_hist,...
"""
import contextlib, json, os, random, sys, time
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
V = int(sys.argv[1]); D = int(sys.argv[2]); ROUNDS = int(sys.argv[3]); OUT = sys.argv[4]
VARIANTS = sys.argv[5].split(",")
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras_softmax_heads as ksh
import steps
from keras_softmax_heads.functional import dispatch, plif_kernels
from reference_inputs import numpy_inputs
N = 2048
h_np, y_np = numpy_inputs(N, V, D)
h, y = steps.tensor(h_np), steps.tensor(y_np)

@contextlib.contextmanager
def variant(name):
    saved = plif_kernels.TILE_ELEMENTS
    try:
        if name.startswith("tile"):
            plif_kernels.TILE_ELEMENTS = 2 ** int(name[4:])
        if name in ("no_hist", "no_both"):
            from keras import ops
            plif_kernels.knot_histogram = lambda idx, ws, k, method=None: tuple(
                ops.zeros((k,), w.dtype) + 0.0 * ops.sum(w) for w in ws)
        if name in ("no_lookup", "no_both"):
            from keras import ops
            plif_kernels.lookup = lambda table, idx: ops.cast(idx, table.dtype) * 1e-9 + table[0]
        if name.startswith("hist_"):
            with dispatch.forced_histogram_method(name[5:]):
                yield
        else:
            yield
    finally:
        plif_kernels.TILE_ELEMENTS = saved
        plif_kernels.knot_histogram = dispatch.knot_histogram
        plif_kernels.lookup = dispatch.lookup

rows, first, losses = {}, {}, {}
for name in ["full"] + VARIANTS:
    random.seed(0)
    head = ksh.FullSoftmax(V) if name == "full" else ksh.PLIFSoftmax(V, num_knots=100_000, knot_bound=20.0)
    head.build((None, D))
    step = steps.train_step(head, "xla", reduction="mean", summed=True)
    with variant(name):
        t = time.perf_counter(); losses[name] = float(step(h, y)); first[name] = time.perf_counter() - t
    rows[name] = step
    print(name, "first", round(first[name], 1), "loss", losses[name], flush=True)
for s in rows.values():
    s(h, y); s(h, y)
times = {k: [] for k in rows}
order = list(rows)
for r in range(ROUNDS):
    order = order[1:] + order[:1]
    for k in order:
        ts = []
        for _ in range(3):
            t = time.perf_counter(); rows[k](h, y); ts.append(time.perf_counter() - t)
        times[k].append(float(np.median(ts) * 1e3))
full = np.asarray(times["full"])
res = {k: {"median_ms": float(np.median(v)), "over_full": float(np.median(np.asarray(v) / full)),
           "ms": v, "first_call_s": first[k], "loss": losses[k]} for k, v in times.items()}
base = np.asarray(times[VARIANTS[0]])
for k in res:
    res[k]["over_" + VARIANTS[0]] = float(np.median(np.asarray(times[k]) / base))
print({k: (round(v["median_ms"]), round(v["over_full"], 3), round(v["over_" + VARIANTS[0]], 3)) for k, v in res.items()}, flush=True)
json.dump({"v": V, "d": D, "n": N, "rounds": ROUNDS, "cpu": "Intel Xeon (2 vCPU)", "threads": 1,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": res}, open(OUT, "w"), indent=1)
