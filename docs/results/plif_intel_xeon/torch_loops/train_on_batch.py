"""One process of `run_train_on_batch.sh` (session 51): `Sequential(Embedding(V, 512),
PLIFSoftmax(V, num_knots=100_000, knot_bound=20))` compiled with `HeadLoss` and SGD, one thread,
the package on `PYTHONPATH`; the first `train_on_batch` (compilation, warm-up) untimed, then
STEPS timed calls on the same [32, 64] tokens. Prints one JSON line."""
import json, os, sys, time
import numpy as np, keras, torch
torch.set_num_threads(1)
import keras_softmax_heads as ksh
V, STEPS = int(sys.argv[1]), int(sys.argv[2])
keras.utils.set_random_seed(0)
head = ksh.PLIFSoftmax(V, num_knots=100_000, knot_bound=20.0)
model = keras.Sequential([keras.layers.Embedding(V, 512), head])
model.compile(optimizer="sgd", loss=ksh.HeadLoss(head))
rng = np.random.default_rng(0)
x, y = rng.integers(0, V, (32, 64)), rng.integers(0, V, (32, 64))
model.train_on_batch(x, y)
times = []
for _ in range(STEPS):
    t = time.perf_counter(); model.train_on_batch(x, y); times.append(time.perf_counter() - t)
print(json.dumps({"package": os.path.dirname(ksh.__file__), "v": V, "steps_s": times,
                  "median_s": float(np.median(times)),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
