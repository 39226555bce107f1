"""PLIF's fused loss alone, forward and forward + backward, against the full softmax's (session 49).

TensorFlow XLA, one thread: `functional.plif_log_likelihood` on scores `z` `[2048, 10000]`
~ N(0, 9), K = 100,000 knots on [-20, 20], uniform targets, gradients w.r.t. `z` and the raw
slopes; the full softmax's `logsumexp(z) - z[y]` and its gradient w.r.t. `z`. 8 rounds of the
four rows, each the median of 3 calls.

    OMP_NUM_THREADS=1 taskset -c 0 python probe_split.py split.json
"""
import json, os, sys, time
import numpy as np
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1); tf.config.threading.set_inter_op_parallelism_threads(1)
from keras import ops
from keras_softmax_heads import functional
N, V, K, T = 2048, 10000, 100000, 20.0
rng = np.random.default_rng(0)
z = tf.constant(rng.normal(scale=3.0, size=(N, V)).astype("float32"))
y = tf.constant(rng.integers(0, V, size=N).astype("int32"))
raw = tf.Variable(rng.normal(scale=0.1, size=(K,)).astype("float32"))
def full_loss(z): return tf.reduce_sum(tf.reduce_logsumexp(z, -1) - tf.gather(z, y, batch_dims=1))
def plif_loss(z): return -tf.reduce_sum(functional.plif_log_likelihood(z, raw, T, y))
@tf.function(jit_compile=True)
def full_f(z): return full_loss(z)
@tf.function(jit_compile=True)
def plif_f(z): return plif_loss(z)
@tf.function(jit_compile=True)
def full_g(z):
    with tf.GradientTape() as t:
        t.watch(z); l = full_loss(z)
    return l, t.gradient(l, z)
@tf.function(jit_compile=True)
def plif_g(z):
    with tf.GradientTape() as t:
        t.watch(z); l = plif_loss(z)
    return (l,) + tuple(t.gradient(l, [z, raw]))


def main(path):
    rows = {"full_fwd": full_f, "plif_fwd": plif_f, "full_fwd_bwd": full_g, "plif_fwd_bwd": plif_g}
    for f in rows.values(): f(z); f(z)
    times = {k: [] for k in rows}
    for r in range(8):
        for k, f in rows.items():
            ts = []
            for _ in range(3):
                t0 = time.perf_counter(); out = f(z); _ = [o.numpy() for o in tf.nest.flatten(out)][:1]; ts.append(time.perf_counter() - t0)
            times[k].append(float(np.median(ts) * 1e3))
    med = {k: float(np.median(v)) for k, v in times.items()}
    print({k: round(v, 1) for k, v in med.items()})
    print("per-score ns: fwd extra", round((med["plif_fwd"] - med["full_fwd"]) / (N * V) * 1e6, 2),
          "bwd extra", round(((med["plif_fwd_bwd"] - med["plif_fwd"]) - (med["full_fwd_bwd"] - med["full_fwd"])) / (N * V) * 1e6, 2))
    json.dump({"n": N, "v": V, "knots": K, "threads": 1, "times_ms": times, "median_ms": med,
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
