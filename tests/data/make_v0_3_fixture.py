"""Writes tests/data/v0_3_*.keras with keras-softmax-heads 0.3.0 (commit b3ae0db),
the last main before the issue-27 re-layout: every head (and the heads' options
that change their structure) in one functional model, and a HeadModel with an
LSTM backbone and a tied HierarchicalSoftmax.
Run from the repository root of that commit: `python tests/data/make_v0_3_fixture.py`."""
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, keras, keras_softmax_heads as ksh
keras.utils.set_random_seed(0)
V, d = 12, 4
counts = np.array([50, 30, 20, 12, 9, 7, 5, 4, 3, 2, 1, 1], dtype=np.float64)
heads = {
    "full": ksh.FullSoftmax(V),
    "full_capped": ksh.FullSoftmax(V, logit_soft_cap=3.0),
    "sig": ksh.SigSoftmax(V),
    "sig_relu": ksh.SigSoftmax(V, output_fn="relu"),
    "mono": ksh.MonotonicSoftmax(V),
    "plif": ksh.PLIFSoftmax(V, num_knots=20),
    "mos": ksh.MixtureOfSoftmaxes(V, num_components=2),
    "moss": ksh.MixtureOfSoftmaxes(V, num_components=2, component="sigsoftmax"),
    "mos_plif": ksh.MixtureOfSoftmaxes(V, num_components=2, num_knots=10),
    "moc": ksh.MixtureOfContexts(V, num_components=2),
    "sampled": ksh.SampledSoftmax(V, num_sampled=4, sampler="unigram", counts=counts),
    "nce": ksh.NCE(V, num_sampled=4, counts=counts),
    "hsm": ksh.HierarchicalSoftmax(V, counts=counts, num_clusters=3),
    "hsm_clusters": ksh.HierarchicalSoftmax(
        V, clusters=ksh.make_clusters("random", vocab_size=V, num_clusters=4, seed=1)),
    "dsm": ksh.DifferentiatedSoftmax(V, counts=counts, bands=[(4, 3), (8, 1)]),
    "adaptive": ksh.AdaptiveSoftmax(V, cutoffs=[4, 8], counts=counts),
    "selfnorm": ksh.SelfNormalizedSoftmax(V),
}
inp = keras.Input((d,))
model = keras.Model(inp, {k: h(inp) for k, h in heads.items()})
rng = np.random.default_rng(0)
for v in model.trainable_variables:  # non-trivial weights
    v.assign(rng.normal(size=v.shape).astype("float32") * 0.5)
x = rng.normal(size=(5, d)).astype("float32")
out = model.predict(x, verbose=0)
model.save("tests/data/v0_3_heads.keras")
np.savez("tests/data/v0_3_heads.npz", x=x, **{k: np.asarray(v) for k, v in out.items()})
bb = ksh.LSTMLanguageModel(vocab_size=V, embedding_dim=d, hidden_size=d, stateful=False)
hm = ksh.HeadModel(bb, ksh.HierarchicalSoftmax(counts=counts, token_embedding=bb.token_embedding))
tok = rng.integers(0, V, size=(2, 5)).astype("int32")
hm.build(tok.shape)
for v in hm.trainable_variables:
    v.assign(rng.normal(size=v.shape).astype("float32") * 0.5)
hm_out = hm.predict(tok, verbose=0)
hm.save("tests/data/v0_3_head_model.keras")
np.savez("tests/data/v0_3_head_model.npz", tokens=tok, log_probs=np.asarray(hm_out))
print({k: np.asarray(v).shape for k, v in out.items()}, np.asarray(hm_out).shape)
