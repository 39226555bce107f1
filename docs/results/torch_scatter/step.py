"""PyTorch eager train step (train_on_batch, N = 2,048 tokens, V = 10,000, d = 256) of HierarchicalSoftmax and SelfNormalizedSoftmax(gamma=0.1), the heads that call dispatch.scatter / segment_max, with FullSoftmax beside them, and predict_on_batch (512 tokens): median ms of 7 steps after 2 warm-ups (4 after 1 for predict). One line of JSON last."""
import os, sys, time, json
os.environ["KERAS_BACKEND"] = "torch"
import numpy as np, keras, torch, keras_softmax_heads as ksh
torch.set_num_threads(1)
V, d, B, T = 10000, 256, 32, 64
rng = np.random.default_rng(0)
x = rng.normal(size=(B, T, d)).astype("float32"); y = rng.integers(0, V, (B, T)).astype("int32")
out = {}
for name, make in [("hsm", lambda: ksh.HierarchicalSoftmax(V)),
                   ("weaknorm", lambda: ksh.SelfNormalizedSoftmax(V, gamma=0.1)),
                   ("full", lambda: ksh.FullSoftmax(V))]:
    keras.utils.set_random_seed(0)
    head = make()
    m = keras.Sequential([keras.Input((T, d)), head])
    m.compile(keras.optimizers.SGD(0.1), loss=ksh.HeadLoss(head))
    ts = []
    for i in range(9):
        s = time.perf_counter(); loss = m.train_on_batch(x, y); ts.append(time.perf_counter() - s)
    ps = []
    for i in range(5):
        s = time.perf_counter(); m.predict_on_batch(x[:8]); ps.append(time.perf_counter() - s)
    out[name] = {"train_ms": float(np.median(ts[2:]) * 1e3), "predict_ms": float(np.median(ps[1:]) * 1e3), "loss": float(loss)}
    print(name, out[name], flush=True)
out["package"] = os.path.dirname(ksh.__file__)
print(json.dumps(out))
