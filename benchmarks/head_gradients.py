r"""Gradient statistics of a head while it trains on PTB under a preset.

The evidence behind the head fixes of issue 19 (`docs/recipes.md`): every
`every` steps, on the current batch, the gradient norm of every variable
(how much of the global clipping norm each takes), the spread of the
backbone's context vectors across tokens, for the mixture heads the spread
and saturation of the latent vectors and the mean priors, and the exact
validation perplexity of the first 40 validation windows.

    python benchmarks/head_gradients.py PRESET HEAD HEAD_OPTIONS SEED STEPS EVERY OUT.json \
        [CONFIG_OVERRIDES]
    python benchmarks/head_gradients.py bottleneck_ptb_small mos "" 0 1000 100 mos_s0.json

`KSH_PTB` names the PTB directory (default `../shared/data/ptb`). Ablations
of the mixture heads' old start: `LATENT_GLOROT=1` (Glorot latent kernel),
`BIAS_UNIGRAM=1` (output bias at the log unigram, for heads without counts).
One thread, TensorFlow, XLA.
"""
import json, os, sys, time
import numpy as np
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras
from keras_softmax_heads.training.config import get_config, parse_options
from keras_softmax_heads.training.builder import build_model
from keras_softmax_heads.training.inputs import train_dataset
from keras_softmax_heads.training.evaluation import Evaluator
from keras_softmax_heads.data import load_dataset

preset, head, opts, seed, steps, every, out = sys.argv[1:8]
extra = parse_options(sys.argv[8]) if len(sys.argv) > 8 else {}
cfg = get_config(preset, head=head, head_options=parse_options(opts), seed=int(seed),
                 dataset="ptb", data_dir=os.environ.get("KSH_PTB", "../shared/data/ptb"), verbose=0, **extra)
keras.utils.set_random_seed(cfg.seed)
corpus = load_dataset("ptb", cfg.data_dir)
model, info = build_model(cfg, corpus)
if os.environ.get("BIAS_UNIGRAM"):
    c = np.asarray(corpus.vocab.counts, "float64") + 1.0
    model.head.bias.assign((np.log(c / c.sum())).astype("float32"))
if os.environ.get("LATENT_GLOROT"):
    lk = model.head.latent_kernel
    lk.assign(keras.initializers.GlorotUniform(seed=cfg.seed)(lk.shape))
ev = Evaluator(cfg, corpus, model, tf.distribute.get_strategy())
ds = train_dataset(cfg, corpus, 0, int(steps), 0)
model.optimizer.learning_rate = cfg.learning_rate * (cfg.bptt if cfg.loss_reduction == "sum_over_time" and cfg.model == "lstm" else 1)
if cfg.loss_reduction == "sum_over_time" and cfg.model=="ngram": pass
head_l = model.head
groups = {}
for v in model.trainable_variables:
    name = v.path
    g = "head" if "head" in name or name.startswith(head_l.name) else "backbone"
    groups[v.path] = g

@tf.function(jit_compile=True)
def grads_of(x, y):
    with tf.GradientTape() as tape:
        h = model.backbone(x, training=True)
        loss = tf.reduce_mean(model.head.training_loss(h, y, training=True))
    g = tape.gradient(loss, model.trainable_variables)
    return loss, g, h

rows = []
t0 = time.time(); losses = []
for i, (x, y) in enumerate(ds):
    if i % int(every) == 0:
        loss, g, h = grads_of(x, y)
        norms = {v.path: float(tf.norm(tf.convert_to_tensor(gg))) for v, gg in zip(model.trainable_variables, g) if gg is not None}
        stat = {"step": i, "loss": float(loss), "gnorm_total": float(np.sqrt(sum(n*n for n in norms.values()))), "gnorms": norms}
        if hasattr(head_l, "latent_kernel"):
            hh = tf.reshape(tf.cast(h, tf.float32), (-1, head_l.input_dim))
            latent_bias = 0.0 if head_l.latent_bias is None else head_l.latent_bias
            lat = tf.tanh(hh @ head_l.latent_kernel + latent_bias)
            stat["sat_frac"] = float(tf.reduce_mean(tf.cast(tf.abs(lat) > 0.99, tf.float32)))
            stat["latent_token_std"] = float(tf.reduce_mean(tf.math.reduce_std(lat, axis=0)))
            stat["latent_bias_absmean"] = float(tf.reduce_mean(tf.abs(latent_bias)))
            stat["pre_absmean"] = float(tf.reduce_mean(tf.abs(hh @ head_l.latent_kernel)))
            prior_bias = 0.0 if head_l.prior_bias is None else head_l.prior_bias
            pri = tf.nn.softmax(hh @ head_l.prior_kernel + prior_bias)
            stat["prior_mean"] = [float(a) for a in tf.reduce_mean(pri, 0)]
        hh = tf.cast(h, tf.float32)
        stat["h_token_std"] = float(tf.reduce_mean(tf.math.reduce_std(tf.reshape(hh, (-1, hh.shape[-1])), axis=0)))
        if i > 0:
            v = ev.score(corpus.valid, 40, previous=corpus.train)
            stat["valid_ppl"] = v["perplexity"]
        stat["train_loss_recent"] = float(np.mean(losses[-int(every):])) if losses else None
        stat["seconds"] = time.time() - t0
        rows.append(stat)
        print(json.dumps({k: v for k, v in stat.items() if k != "gnorms"}), flush=True)
        json.dump(rows, open(out, "w"), indent=1)
    l = model.train_on_batch(x, y)
    losses.append(float(l if np.isscalar(l) else l[0]))
