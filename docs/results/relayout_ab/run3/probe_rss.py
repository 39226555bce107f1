"""Process RSS of one `linear_cross_entropy` step under `tf.function(jit_compile=True)`.

Usage (from the library's checkout): `python probe_rss.py {auto|ops|base} [xla|graph]`;
`base` passes no `implementation` (the library at b3ae0db has its own default). Prints the RSS
growth of the trace, the first (compiling) call and a second call, and the process' maximum RSS over
a warmed-up TensorFlow (one trivial function run first), in MiB. N = 2048, d = 1024, V = 65,536,
float32, two threads.
"""
import os
import resource
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
import psutil
import tensorflow as tf

from keras_softmax_heads.losses import linear_cross_entropy

variant = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "xla"
tf.config.threading.set_intra_op_parallelism_threads(2)
tf.config.threading.set_inter_op_parallelism_threads(2)
N, d, V = 2048, 1024, 65536
rng = np.random.default_rng(0)
h = tf.constant(rng.normal(size=(N, d)).astype("float32") * 0.1)
W = tf.Variable(rng.normal(size=(d, V)).astype("float32") * 0.02)
y = tf.constant(rng.integers(0, V, size=(N,)).astype("int32"))
kwargs = {} if variant == "base" else {"implementation": variant}


@tf.function(jit_compile=(mode == "xla"))
def step(h, y):
    with tf.GradientTape() as tape:
        tape.watch(h)
        loss = linear_cross_entropy(h, W, y, **kwargs)
    return loss, tape.gradient(loss, [h, W])


process = psutil.Process()


def rss():
    return process.memory_info().rss / 2**20


start = rss()
tf.function(lambda x: x * 2)(tf.constant(1.0))  # TensorFlow's runtime, warmed up
warm = rss()
step.get_concrete_function(h, y)
traced = rss()
out = step(h, y)
float(out[0])
first = rss()
out = step(h, y)
float(out[0])
second = rss()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(variant, mode, "warm", round(warm - start), "trace", round(traced - warm),
      "call1", round(first - traced), "call2", round(second - first),
      "maxrss-over-warm", round(peak - warm))
