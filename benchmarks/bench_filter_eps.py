r"""What gradient filtering (`filter_eps`) does to training on real text.

`linear_cross_entropy(..., filter_eps=eps)` (the Pallas kernel's `"atomic"`
backward, issue 29) skips a backward block of `bn` tokens x `bv` words whose
softmax values are all below `eps` and that holds none of its tokens' targets
(docs/chunked.md, "Gradient filtering"). This script trains the same LSTM
language model on PTB with the exact gradient and with that block rule at
several `eps`, and reports the exact validation perplexity. The rule is
applied here to the dense gradient in `keras.ops` (the kernel's criterion and
its GPU block sizes, `pallas_cross_entropy.GPU_BLOCKS`), so it runs on any
backend and at CPU speed; the kernel itself needs a GPU to be fast.

It also records, on a fixed training batch at a few steps, the fraction of
blocks skipped and the relative change of the gradients w.r.t. the hidden
states and the output matrix, `|g_filtered - g| / |g|`.

    python benchmarks/bench_filter_eps.py --data_dir=../shared/data/ptb \
        --out=docs/results/filter_eps/ptb.json
"""

import json
import os
import time

import measure  # benchmarks/measure.py
from absl import app
from absl import flags

_DATA_DIR = flags.DEFINE_string("data_dir", None, "The PTB directory.")
_OUT = flags.DEFINE_string("out", "docs/results/filter_eps/ptb.json", "JSON results.")
_EPS = flags.DEFINE_list("eps", ["none", "2**-15", "2**-12", "2**-9"],
                         "Thresholds ('none': the exact gradient).")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds.")
_STEPS = flags.DEFINE_integer("steps", 1000, "Training steps.")
_PROBE_STEPS = flags.DEFINE_list("probe_steps", ["0", "100", "300", "1000"],
                                 "Steps at which the skipped fraction is recorded.")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per batch.")
_LENGTH = flags.DEFINE_integer("length", 32, "Tokens per sequence.")
_UNITS = flags.DEFINE_integer("units", 200, "LSTM units and embedding size.")
_VALID_TOKENS = flags.DEFINE_integer("valid_tokens", 32768, "Validation tokens.")
_DATASET = flags.DEFINE_string("dataset", "ptb", "'ptb' or 'synthetic' (smoke runs).")


def parse_eps(text):
    """'none', a float, or 'base**exponent'."""
    if text.lower() == "none":
        return None
    if "**" in text:
        base, exponent = text.split("**")
        return float(base) ** float(exponent)
    return float(text)


def block_keep(prob, onehot, eps, bn, bv):
    """The kernel's rule: a `[bn, bv]` block of `prob` `[N, V]` is kept when
    one of its values is `>= eps` or it holds a target (`onehot`). Returns
    the boolean mask `[N / bn, V / bv]` of kept blocks, for `N`, `V` padded
    to the blocks."""
    from keras import ops

    n, v = prob.shape
    blocks = (n // bn, bn, v // bv, bv)
    peak = ops.max(ops.reshape(prob, blocks), axis=(1, 3))
    hit = ops.max(ops.reshape(onehot, blocks), axis=(1, 3))
    return ops.logical_or(peak >= eps, hit > 0)


def element_mask(keep, bn, bv):
    """A block mask `[N / bn, V / bv]` spread over the elements, `[N, V]`."""
    from keras import ops

    return ops.repeat(ops.repeat(keep, bn, axis=0), bv, axis=1)


def filtered_nll(eps, bn, bv):
    """Per-token NLL of `softmax(h W + b)` whose gradient drops the blocks
    the kernel would skip at `eps` (None: exact)."""
    from keras import ops

    @ops.custom_gradient
    def nll(h, kernel, bias, onehot):
        z = ops.matmul(h, kernel) + bias
        lse = ops.logsumexp(z, axis=-1, keepdims=True)
        out = ops.squeeze(lse, -1) - ops.sum(z * onehot, axis=-1)

        def grad(*args, upstream=None):
            upstream = args[-1] if upstream is None else upstream
            prob = ops.exp(z - lse)
            g = (prob - onehot) * upstream[:, None]
            if eps is not None:
                keep = element_mask(block_keep(prob, onehot, eps, bn, bv), bn, bv)
                g = g * ops.cast(keep, g.dtype)
            return (ops.matmul(g, ops.transpose(kernel)), ops.matmul(ops.transpose(h), g),
                    ops.sum(g, axis=0), ops.zeros_like(onehot))

        return out, grad

    return nll


def build_model(vocab, units, eps, bn, bv, padded_vocab, seed):
    import keras
    from keras import ops

    keras.utils.set_random_seed(seed)
    loss_fn = filtered_nll(eps, bn, bv)

    class Output(keras.layers.Layer):
        """The output layer and its loss: `(h, targets) -> per-token NLL`."""

        def build(self, input_shape):
            init = keras.initializers.RandomUniform(-0.1, 0.1)
            self.kernel = self.add_weight(shape=(units, vocab), initializer=init, name="kernel")
            self.bias = self.add_weight(shape=(vocab,), initializer="zeros", name="bias")

        def call(self, inputs):
            h, y = inputs
            shape = ops.shape(y)
            h = ops.reshape(h, (-1, units))
            y = ops.reshape(y, (-1,))
            pad = padded_vocab - vocab
            # Padded words score -1e9: probability 0, never a target.
            kernel = ops.pad(self.kernel, ((0, 0), (0, pad)))
            bias = ops.concatenate([self.bias, ops.full((pad,), -1e9)])
            onehot = ops.one_hot(y, padded_vocab)
            return ops.reshape(loss_fn(h, kernel, bias, onehot), shape)

    tokens = keras.Input((None,), dtype="int32")
    targets = keras.Input((None,), dtype="int32")
    init = keras.initializers.RandomUniform(-0.1, 0.1)
    x = keras.layers.Embedding(vocab, units, embeddings_initializer=init)(tokens)
    x = keras.layers.LSTM(units, return_sequences=True)(x)
    x = keras.layers.LSTM(units, return_sequences=True)(x)
    out = Output()((x, targets))
    model = keras.Model([tokens, targets], out)
    model.compile(optimizer=keras.optimizers.Adam(3e-3, clipnorm=5.0),
                  loss=lambda y_true, y_pred: y_pred)
    return model, keras.Model(tokens, x)


def windows(ids, batch, length, start):
    """`batch` consecutive windows of `length + 1` tokens from `start`."""
    import numpy as np

    span = batch * length
    chunk = np.asarray(ids[start:start + span + 1])
    x = chunk[:-1].reshape(batch, length)
    y = chunk[1:].reshape(batch, length)
    return x.astype("int32"), y.astype("int32")


def probe(model, features, x, y, eps, bn, bv, padded_vocab):
    """Skipped-block fraction and relative gradient change on one batch
    (float64, NumPy)."""
    import numpy as np
    from keras import ops

    out_layer = model.layers[-1]
    feature = ops.convert_to_numpy(features(x)).reshape(-1, out_layer.kernel.shape[0])
    vocab = out_layer.kernel.shape[1]
    w = np.pad(ops.convert_to_numpy(out_layer.kernel), ((0, 0), (0, padded_vocab - vocab)))
    b = np.concatenate([ops.convert_to_numpy(out_layer.bias), np.full(padded_vocab - vocab, -1e9)])
    z = feature.astype(np.float64) @ w + b
    z -= z.max(axis=1, keepdims=True)
    prob = np.exp(z)
    prob /= prob.sum(axis=1, keepdims=True)
    onehot = np.eye(padded_vocab)[y.reshape(-1)]
    g = (prob - onehot) / len(prob)
    # The training step's rule (`block_keep`), on the float64 probabilities.
    keep = ops.convert_to_numpy(block_keep(prob, onehot, eps, bn, bv))
    gf = g * ops.convert_to_numpy(element_mask(keep, bn, bv))
    rel = lambda a, r: float(np.linalg.norm(a - r) / np.linalg.norm(r))  # noqa: E731
    real_blocks = keep[:, : -(-vocab // bv)]
    return {
        "skipped_fraction": float(1.0 - real_blocks.mean()),
        "dh_relative_change": rel(gf @ w.T, g @ w.T),
        "dw_relative_change": rel(feature.T @ gf, feature.T @ g),
        "max_probability_median": float(np.median(prob.max(axis=1))),
    }


def run(corpus, eps, seed, args):
    import numpy as np
    from keras_softmax_heads.fused import pallas_cross_entropy

    bn, bv, _ = pallas_cross_entropy.GPU_BLOCKS
    vocab = len(corpus.vocab)
    padded_vocab = -(-vocab // bv) * bv
    if (args["batch"] * args["length"]) % bn:
        raise ValueError(f"batch * length must be a multiple of {bn}")
    model, features = build_model(vocab, args["units"], eps, bn, bv, padded_vocab, seed)
    span = args["batch"] * args["length"]
    starts = np.random.default_rng(seed).integers(0, len(corpus.train) - span - 1, args["steps"])
    probe_x, probe_y = windows(corpus.train, args["batch"], args["length"], 0)
    probes, losses = {}, []
    t0 = time.time()
    for step in range(args["steps"] + 1):
        if step in args["probe_steps"] and eps is not None:
            probes[step] = probe(model, features, probe_x, probe_y, eps, bn, bv, padded_vocab)
        if step == args["steps"]:
            break
        x, y = windows(corpus.train, args["batch"], args["length"], int(starts[step]))
        losses.append(float(model.train_on_batch([x, y], y)))
    train_seconds = time.time() - t0
    valid = corpus.valid[: args["valid_tokens"] + 1]
    total, count = 0.0, 0
    for start in range(0, len(valid) - span - 1, span):
        x, y = windows(valid, args["batch"], args["length"], start)
        nll = np.asarray(model.predict_on_batch([x, y]))
        total += float(nll.sum())
        count += nll.size
    return {
        "eps": eps, "seed": seed, "valid_perplexity": float(np.exp(total / count)),
        "valid_tokens": count, "train_loss_last100": float(np.mean(losses[-100:])),
        "train_seconds": train_seconds, "probes": {str(k): v for k, v in probes.items()},
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    import keras

    from keras_softmax_heads import data

    if _DATASET.value == "synthetic":
        corpus = data.make_synthetic_corpus(4000, 20_000, 5_000, 1_000, seed=0)
    else:
        corpus = data.load_ptb(_DATA_DIR.value)
    args = {"steps": _STEPS.value, "batch": _BATCH.value, "length": _LENGTH.value,
            "units": _UNITS.value, "valid_tokens": _VALID_TOKENS.value,
            "probe_steps": {int(s) for s in _PROBE_STEPS.value}}
    results = {"runs": []}
    if os.path.exists(_OUT.value):
        with open(_OUT.value) as f:
            results = json.load(f)
    done = {(r["eps"], r["seed"]) for r in results["runs"]}
    results["config"] = dict(args, probe_steps=sorted(args["probe_steps"]),
                             backend=keras.backend.backend(), dataset=_DATASET.value)
    results["command"] = measure.command_line(__file__)
    results["machine"] = measure.machine()
    for seed in (int(s) for s in _SEEDS.value):
        for eps in (parse_eps(e) for e in _EPS.value):
            if (eps, seed) in done:
                continue
            row = run(corpus, eps, seed, args)
            row["date"] = measure.machine(["date"])["date"]
            print(json.dumps({k: v for k, v in row.items() if k != "probes"}), flush=True)
            results["runs"].append(row)
            measure.save(results, _OUT.value)
    measure.save(results, _OUT.value)
    print(f"Wrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
