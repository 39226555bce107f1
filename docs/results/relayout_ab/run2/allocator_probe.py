import os, sys, json
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
impl, lib = sys.argv[1], sys.argv[2]
sys.path.insert(0, f"/work/{lib}"); sys.path.insert(0, "/work/main/benchmarks")
import numpy as np, tensorflow as tf, keras
tf.config.threading.set_intra_op_parallelism_threads(2); tf.config.threading.set_inter_op_parallelism_threads(2)
import keras_softmax_heads as ksh
from keras_softmax_heads.losses import linear_cross_entropy
import measure
N, d, V = 2048, 1024, 65536
DT = sys.argv[4] if len(sys.argv) > 4 else "float32"
rng = np.random.default_rng(0)
h = tf.constant(rng.normal(size=(N, d)).astype("float32") * 0.1, dtype=DT)
W = tf.Variable(rng.normal(size=(d, V)).astype("float32") * 0.02, dtype=DT)
y = tf.constant(rng.integers(0, V, size=(N,)).astype("int32"))
kw = {} if lib == "base" else {"implementation": impl}
mode = sys.argv[3] if len(sys.argv) > 3 else "xla"
@tf.function(jit_compile=(mode == "xla"))
def step(h, y):
    with tf.GradientTape() as tape:
        tape.watch(h)
        loss = linear_cross_entropy(h, W, y, **kw)
    return loss, tape.gradient(loss, [h, W])
step(h, y)
m = measure.TensorFlowAllocatorPeak(); m.start()
import time; t=[]
for _ in range(1):
    t0=time.perf_counter(); out = step(h, y); float(out[0]); t.append(time.perf_counter()-t0)
print(json.dumps({"impl": impl, "lib": lib, "mode": mode, "dtype": DT, "peak_mib": m.peak_mib(), "times": t}))
