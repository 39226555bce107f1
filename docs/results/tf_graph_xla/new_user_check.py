import numpy as np, keras, keras_softmax_heads as ksh, time
V = 2000
rng = np.random.default_rng(0)
x = rng.integers(0, V, (203, 12)); y = rng.integers(0, V, (203, 12))
for make, loss in [(lambda: ksh.PLIFSoftmax(V), "head"), (lambda: ksh.PLIFSoftmax(V), "scce"),
                   (lambda: ksh.MonotonicSoftmax(V), "head"), (lambda: ksh.MonotonicSoftmax(V, grid_size=None), "head")]:
    head = make()
    model = keras.Sequential([keras.layers.Embedding(V, 32), keras.layers.LSTM(32, return_sequences=True), head])
    l = ksh.HeadLoss(head) if loss == "head" else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile("adam", loss=l, metrics=[ksh.Perplexity()])
    t = time.time()
    h = model.fit(x, y, batch_size=32, epochs=2, verbose=0)   # last batch of 11: another shape
    ev = model.evaluate(x, y, verbose=0)
    p = model.predict(x[:5], verbose=0)
    model.save("/tmp/nu.keras"); m2 = keras.saving.load_model("/tmp/nu.keras")
    same = np.array_equal(m2.predict(x[:5], verbose=0), p)
    print(type(head).__name__, loss, "loss", [round(v, 3) for v in h.history["loss"]], "eval", [round(e, 2) for e in ev],
          "normalised", np.allclose(np.exp(p).sum(-1), 1, atol=1e-4), "reload identical", same, "%.1fs" % (time.time() - t))
