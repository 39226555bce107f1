"""A/B of PLIFSoftmax's training step (session 50): this checkout's `plif_log_likelihood`
(the backward tiles recompute the interval index) against b38904d's (the forward pass
saved it), in one process, rows alternated, per-round ratios; `full` is FullSoftmax's step.
The old module is read from git (`git show b38904d:...`), with its histogram as it was
(`DenseBincount` on TensorFlow); `OLD_COMMIT=...` takes another commit's module, `FN=plif_scores` swaps that function instead (the summed passes' PLIF), `HEAD_KW="chunk_size=4096"` adds head arguments (both heads). N = 2,048, Zipf targets (`reference_inputs`), K = 1e5.

    OMP_NUM_THREADS=1 TF_NUM_INTRAOP_THREADS=1 KERAS_BACKEND=tensorflow taskset -c 0 \
        python ab.py V d ROUNDS OUT.json
"""
import os, sys, time, json, numpy as np
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "benchmarks")); sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
V = int(sys.argv[1]); D = int(sys.argv[2]); ROUNDS = int(sys.argv[3]); OUT = sys.argv[4] if len(sys.argv) > 4 else None
import keras
if keras.backend.backend() == "tensorflow":
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1); tf.config.threading.set_inter_op_parallelism_threads(1)
import keras_softmax_heads as ksh, steps
from keras_softmax_heads import functional
from keras_softmax_heads.functional import dispatch
import importlib.util, subprocess, tempfile
OLD = os.environ.get("OLD_COMMIT", "b38904d")
_src = subprocess.run(["git", "show", f"{OLD}:keras_softmax_heads/functional/plif_kernels.py"],
                      cwd=HERE, check=True, capture_output=True, text=True).stdout
_path = os.path.join(tempfile.mkdtemp(), "old_plif_kernels.py")
open(_path, "w").write(_src)
_spec = importlib.util.spec_from_file_location("old_plif_kernels", _path)
old = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(old)
def old_hist(idx, weights, num_knots, method=None):
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        idx = tf.reshape(idx, [-1])
        return tuple(tf.raw_ops.DenseBincount(input=idx, size=num_knots, weights=tf.reshape(w, [-1]), binary_output=False) for w in weights)
    return dispatch.knot_histogram(idx, weights, num_knots, method)
old.knot_histogram = old_hist
from reference_inputs import numpy_inputs
N = 2048
h_np, y_np = numpy_inputs(N, V, D)
h, y = steps.tensor(h_np), steps.tensor(y_np)
FN = os.environ.get("FN", "plif_log_likelihood")  # or plif_scores (the summed passes' PLIF)
HEAD_KW = eval(f"dict({os.environ.get('HEAD_KW', '')})")  # e.g. HEAD_KW="chunk_size=4096"
new_ll = getattr(functional, FN)
old_ll = getattr(old, FN)
if keras.backend.backend() == "tensorflow":  # autograph mixes up the two modules' functions
    new_ll = tf.autograph.experimental.do_not_convert(new_ll)
    old_ll = tf.autograph.experimental.do_not_convert(old_ll)
rows, losses = {}, {}
mode = "xla" if keras.backend.backend() != "torch" else "eager"
for name in ["full", "old", "new"]:
    keras.utils.set_random_seed(0)
    head = (ksh.FullSoftmax(V, **HEAD_KW) if name == "full"
            else ksh.PLIFSoftmax(V, num_knots=100_000, knot_bound=20.0, **HEAD_KW))
    head.build((None, D))
    step = steps.train_step(head, mode, reduction="mean", summed=True)
    setattr(functional, FN, old_ll if name == "old" else new_ll)
    try:
        losses[name] = float(step(h, y)); losses[name] = float(step(h, y))
    finally:
        setattr(functional, FN, new_ll)
    def patched(h, y, step=step, ll=(old_ll if name == "old" else new_ll)):
        # PyTorch runs eagerly: the function is looked up at every call, not once while tracing.
        setattr(functional, FN, ll)
        try:
            return step(h, y)
        finally:
            setattr(functional, FN, new_ll)
    rows[name] = patched
    print(name, "loss after 2 steps", losses[name], flush=True)
times = {k: [] for k in rows}; order = list(rows)
for r in range(ROUNDS):
    order = order[1:] + order[:1]
    for k in order:
        ts = []
        for _ in range(3):
            t = time.perf_counter(); float(rows[k](h, y)); ts.append(time.perf_counter() - t)
        times[k].append(float(np.median(ts) * 1e3))
full, oldt = np.array(times["full"]), np.array(times["old"])
res = {"old_commit": OLD, "function": FN, "head_kwargs": HEAD_KW, "backend": keras.backend.backend(), "mode": mode, "v": V, "d": D, "n": N, "knots": 100000, "rounds": ROUNDS,
       "losses_after_2_steps": losses, "times_ms": times,
       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
for k, v in times.items():
    v = np.array(v)
    res.setdefault("median_ms", {})[k] = float(np.median(v))
    res.setdefault("over_full", {})[k] = float(np.median(v / full))
    res.setdefault("over_old", {})[k] = float(np.median(v / oldt))
    print(f"{k:5s} {np.median(v):8.1f} ms  over_full {np.median(v/full):5.3f}  over_old {np.median(v/oldt):5.3f}  per-round/old {np.round(v/oldt, 2).tolist()}")
if OUT:
    json.dump(res, open(OUT, "w"), indent=1)
