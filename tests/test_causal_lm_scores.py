"""`causal_lm_token_scores` on keras-hub causal LMs built from tiny local
configs (no downloads): GPT-2 (tied), a Gemma 2 style Gemma (tied, final
logit soft cap) and Llama (untied).

The log-probabilities and entropies equal those of the stock model's logits
(`log_softmax(causal_lm(x) / T)`) to float32 tolerance, the computation
never calls the output projection (`token_embedding(h, reverse=True)`) nor,
on JAX, forms any `[.., V]` tensor (checked on the traced program), and a
policy-gradient `fit` step through the scores (a custom `compute_loss`)
equals the same step through the stock logits.
"""

import functools

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

import keras  # noqa: E402
from backends import BACKEND  # noqa: E402
from multibackend import slow_off_tensorflow  # noqa: E402
from keras import ops  # noqa: E402
from test_fused_causal_lm import V as BUILDERS_V  # noqa: E402
from test_fused_causal_lm import tiny_gemma2  # noqa: E402
from test_fused_causal_lm import tiny_gpt2  # noqa: E402
from test_fused_causal_lm import tiny_llama  # noqa: E402

from keras_softmax_heads.fused import causal_lm_token_scores  # noqa: E402

pytestmark = pytest.mark.multibackend

V, T, B = BUILDERS_V, 8, 3  # the vocabulary of the tiny models
CHUNK = 40
TEMPERATURE = 0.8
LR = 0.5


# Gemma 2 (the soft cap) in the default run; the others under -m slow.
MODELS = {"gemma2": functools.partial(tiny_gemma2, num_layers=1), "gpt2": tiny_gpt2,
          "llama": tiny_llama}
NAMES = ["gemma2"] + [pytest.param(n, marks=pytest.mark.slow) for n in ("gpt2", "llama")]


def _data(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T), "int32")
    mask[1, -3:] = 0  # right padding
    ids = rng.integers(1, V, (B, T)).astype("int32")
    advantage = rng.normal(size=(B,)).astype("float32")
    return {"token_ids": ids, "padding_mask": mask}, advantage


def _dense_scores(logits, ids, mask):
    """Float64 NumPy reference from the stock logits: (log_probs, entropy),
    zero where the shifted mask is."""
    g = np.asarray(logits, "float64")[:, :-1] / TEMPERATURE
    m = g.max(-1, keepdims=True)
    log_p = g - m - np.log(np.exp(g - m).sum(-1, keepdims=True))
    lp = np.take_along_axis(log_p, ids[:, 1:, None], -1)[..., 0]
    ent = -(np.exp(log_p) * log_p).sum(-1)
    real = mask[:, 1:] * mask[:, :-1]
    return lp * real, ent * real


class ReverseCalls:
    """Counts `ReversibleEmbedding(h, reverse=True)` calls while active."""

    def __init__(self, monkeypatch):
        self.count = 0
        original = keras.layers.ReversibleEmbedding.call

        def call(layer, inputs, reverse=False):
            if reverse:
                self.count += 1
            return original(layer, inputs, reverse=reverse)

        monkeypatch.setattr(keras.layers.ReversibleEmbedding, "call", call)
        self.undo = monkeypatch.undo


def _scored(cls, fused):
    """A policy-gradient LM: `compute_loss` is
    `-mean_b(A_b sum_t logp_bt) - 0.1 mean_b(sum_t H_bt)` over the real
    positions, through `causal_lm_token_scores` (`fused`, `call` returns the
    hidden states) or the stock logits."""

    class Scored(cls):
        def call(self, inputs, training=None, mask=None):
            if fused:
                return self.backbone(inputs, training=training)
            return super().call(inputs, training=training, mask=mask)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         training=True):
            ids, pad = x["token_ids"], x["padding_mask"]
            real = ops.cast(ops.logical_and(ops.cast(pad[:, 1:], "bool"),
                                            ops.cast(pad[:, :-1], "bool")), "float32")
            if fused:
                lp, ent = causal_lm_token_scores(
                    self, ids, pad, hidden_states=y_pred, temperature=TEMPERATURE,
                    return_entropy=True, chunk_size=CHUNK)
            else:
                log_p = ops.log_softmax(ops.cast(y_pred[:, :-1], "float32") / TEMPERATURE)
                lp = ops.take_along_axis(
                    log_p, ops.cast(ids[:, 1:, None], "int32"), axis=-1)[..., 0]
                ent = -ops.sum(ops.exp(log_p) * log_p, axis=-1)
            pg = -ops.mean(ops.cast(y, "float32") * ops.sum(lp * real, axis=1))
            return pg - 0.1 * ops.mean(ops.sum(ent * real, axis=1))

    return Scored


@pytest.mark.parametrize("name", NAMES)
def test_scores_match_stock_logits_without_them(name, monkeypatch):
    keras.utils.set_random_seed(0)
    backbone, cls = MODELS[name]()
    lm = cls(backbone=backbone, preprocessor=None)
    x, advantage = _data()
    logits = ops.convert_to_numpy(lm(x))
    ref_lp, ref_ent = _dense_scores(logits, x["token_ids"], x["padding_mask"])

    def scores(ids, pad):
        lp, ent = causal_lm_token_scores(lm, ids, pad, temperature=TEMPERATURE,
                                         return_entropy=True, chunk_size=CHUNK)
        only = causal_lm_token_scores(lm, ids, pad, temperature=TEMPERATURE,
                                      chunk_size=CHUNK)
        return lp, ent, only

    calls = ReverseCalls(monkeypatch)
    if BACKEND == "jax":  # compiled; the traced program has no V-wide tensor
        import jax

        traced = jax.jit(scores).trace(x["token_ids"], x["padding_mask"])
        shapes = []

        def walk(jp):
            for eqn in jp.eqns:
                shapes.extend(tuple(v.aval.shape) for v in eqn.outvars)
                # The sub-jaxprs of scans, conds and custom gradients, open
                # or closed (`jax.core.jaxprs_in_params` is gone in JAX 0.11).
                for value in eqn.params.values():
                    for sub in value if isinstance(value, (tuple, list)) else (value,):
                        if hasattr(getattr(sub, "jaxpr", None), "eqns"):
                            sub = sub.jaxpr
                        if hasattr(sub, "eqns"):
                            walk(sub)

        walk(traced.jaxpr.jaxpr)
        assert shapes and not [s for s in shapes if len(s) >= 2 and s[-1] == V]
        lp, ent, only = traced.lower().compile()(x["token_ids"], x["padding_mask"])
    else:
        lp, ent, only = scores(x["token_ids"], x["padding_mask"])
    assert calls.count == 0, "the scores formed the logits"
    calls.undo()
    assert tuple(lp.shape) == (B, T - 1)
    np.testing.assert_allclose(ops.convert_to_numpy(lp), ref_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.convert_to_numpy(ent), ref_ent, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.convert_to_numpy(only), ref_lp, rtol=1e-5, atol=1e-5)


@slow_off_tensorflow
@pytest.mark.parametrize("name", NAMES)
def test_policy_gradient_step_matches_stock(name, monkeypatch):
    """One SGD `fit` step of a REINFORCE loss with an entropy bonus,
    through the scores and through the stock logits: the same loss and
    weights; the fused train step never forms the logits."""
    keras.utils.set_random_seed(0)
    backbone, cls = MODELS[name]()
    x, advantage = _data(1)
    models = []
    for fused in (True, False):
        b = backbone.__class__.from_config(backbone.get_config())
        lm = _scored(cls, fused)(backbone=b, preprocessor=None)
        lm.compile(optimizer=keras.optimizers.SGD(LR), loss=None, weighted_metrics=[])
        models.append(lm)
    models[1].set_weights(models[0].get_weights())
    before = models[0].get_weights()
    calls = ReverseCalls(monkeypatch)
    h_fused = models[0].fit(x, advantage, batch_size=B, epochs=1, verbose=0,
                            shuffle=False).history
    fused_count = calls.count
    calls.undo()
    h_stock = models[1].fit(x, advantage, batch_size=B, epochs=1, verbose=0,
                            shuffle=False).history
    np.testing.assert_allclose(h_fused["loss"], h_stock["loss"], rtol=1e-5)
    assert fused_count == 0, "the fused train step formed the logits"
    moved = 0.0
    for a, b, w0 in zip(models[0].get_weights(), models[1].get_weights(), before):
        # The step (w0 - w) / lr is the gradient: compare those.
        ga, gb = (w0 - a) / LR, (w0 - b) / LR
        moved = max(moved, float(np.abs(gb).max()))
        np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-4 * max(moved, 1e-3))
    assert moved > 1e-3
