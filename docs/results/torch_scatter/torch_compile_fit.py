# PyTorch: jit_compile=True (torch.compile) vs False for heavier heads with HeadLoss
import os, sys, time; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import *
import keras_softmax_heads as ksh
V, d, L, Nseq = 60, 16, 6, 32
rng = np.random.default_rng(0)
xs = rng.integers(1, V, (Nseq, L)).astype("int32"); ys = rng.integers(0, V, (Nseq, L)).astype("int32")
heads = {
  "PLIFSoftmax": lambda: ksh.PLIFSoftmax(V, num_knots=64), "FullSoftmax": lambda: ksh.FullSoftmax(V),
  "MixtureOfSoftmaxes": lambda: ksh.MixtureOfSoftmaxes(V, num_components=3),
  "AdaptiveSoftmax": lambda: ksh.AdaptiveSoftmax(V, cutoffs=[10, 30]),
  "HierarchicalSoftmax": lambda: ksh.HierarchicalSoftmax(V, num_clusters=8),
}
only = sys.argv[1:] or list(heads)
for name in only:
    res = {}
    for jit in [False, True]:
        keras.utils.set_random_seed(0)
        head = heads[name]()
        m = keras.Sequential([keras.Input((L,), dtype="int32"), keras.layers.Embedding(V, d), keras.layers.Dense(d), head])
        m.compile(optimizer=keras.optimizers.SGD(0.5), loss=ksh.HeadLoss(head), jit_compile=jit)
        if jit is False: w0 = m.get_weights()
        else: m.set_weights(w0)
        t = time.time()
        try:
            h = m.fit(xs, ys, batch_size=8, epochs=3, verbose=0, shuffle=False).history
            ev = m.evaluate(xs, ys, batch_size=8, verbose=0)
            pr = to_np(m.predict(xs[:4], verbose=0))
            res[jit] = (h["loss"], ev, pr, m.jit_compile)
            print(B, name, "jit_compile=%s (model.jit_compile=%s)" % (jit, m.jit_compile), "losses", np.round(h["loss"], 6), "eval", round(float(ev), 6), "%.0fs" % (time.time() - t), flush=True)
        except Exception as e:
            print(B, name, "jit", jit, "FAILED", type(e).__name__, str(e)[:400], flush=True)
    if len(res) == 2:
        print("   max |loss diff|", np.max(np.abs(np.array(res[True][0]) - np.array(res[False][0]))),
              "eval diff", abs(res[True][1] - res[False][1]), "predict rel diff %.1e" % rel(res[True][2], res[False][2]))
