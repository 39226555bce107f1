"""`fused_causal_lm` / `FusedLossCausalLM` on keras-hub causal LMs built
from tiny local configs (no preset downloads): GPT-2 (tied), a Gemma 2 style
Gemma (tied, final-logit soft cap, attention soft cap, sliding window, post
norms), a text-only Gemma 3 with a final soft cap (tied) and Llama (untied
`reverse_embeddings`).

For each: `fit` through the fused loss equals `fit` of the stock CausalLM
with the same weights (loss history, the first step's gradients, the weights
after two steps), training never calls the output projection
(`token_embedding(h, reverse=True)`, the `[batch, seq, V]` logits), nor
does the fused evaluation (`evaluate`, `test_on_batch`, `fit`'s validation),
which reports the exact loss, perplexity and token accuracy, `predict` /
`generate` are the stock model's, and a `.keras` round trip predicts the
same and resumes `fit`.
LoRA on the tied embedding (`backbone.enable_lora`) trains through the
merged matrix, as the stock model does.
"""

import os

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

import keras  # noqa: E402
from keras import ops  # noqa: E402
from multibackend import slow_off_tensorflow  # noqa: E402
from multibackend import sweep  # noqa: E402

import keras_softmax_heads as ksh  # noqa: E402

pytestmark = pytest.mark.multibackend

V, T, B = 96, 8, 4
LR = 0.5


def tiny_gpt2():
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16, dropout=0.0,
    ), keras_hub.models.GPT2CausalLM


def tiny_gemma2(num_layers=2):
    # Gemma 2's options on the Gemma backbone; a small final soft cap so
    # that capping changes the loss.
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=V, num_layers=num_layers, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8,
        query_head_dim_normalize=False, use_post_ffw_norm=True,
        use_post_attention_norm=True, attention_logit_soft_cap=50.0,
        final_logit_soft_cap=1.5, use_sliding_window_attention=True,
        sliding_window_size=4,
    ), keras_hub.models.GemmaCausalLM


def tiny_llama():
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=V, num_layers=1, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
        tie_word_embeddings=False,
    ), keras_hub.models.LlamaCausalLM


def _gemma3():
    # Text only (no vision encoder); Gemma 3 has no soft caps by default:
    # set a final one to exercise it through the Gemma 3 backbone too.
    return keras_hub.models.Gemma3Backbone(
        vocabulary_size=V, image_size=16, num_layers=2, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8,
        use_post_ffw_norm=True, use_post_attention_norm=True,
        final_logit_soft_cap=1.5, use_sliding_window_attention=True,
        sliding_window_size=4,
    ), keras_hub.models.Gemma3CausalLM


MODELS = {"gpt2": tiny_gpt2, "gemma2": tiny_gemma2, "llama": tiny_llama, "gemma3": _gemma3}


def _data(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T), "int32")
    mask[1, -3:] = 0  # padding
    x = {"token_ids": rng.integers(1, V, (B, T)).astype("int32"),
         "padding_mask": mask}
    y = rng.integers(0, V, (B, T)).astype("int32")
    return x, y, mask.astype("float32")


def _compile(lm):
    lm.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"),
        weighted_metrics=[],
        sampler="greedy",
    )
    return lm


def _pair(name, lora=None, fused_loss=None):
    """A fused LM and the stock LM with the same weights."""
    keras.utils.set_random_seed(0)
    backbone, cls = MODELS[name]()
    stock_backbone = backbone.__class__.from_config(backbone.get_config())
    if lora:  # the target layer names
        for b in (backbone, stock_backbone):
            b.enable_lora(2, target_layer_names=lora)
    fused = ksh.fused.fused_causal_lm(cls)(
        backbone=backbone, preprocessor=None, fused_loss=fused_loss or {"chunk_size": 40})
    stock = cls(backbone=stock_backbone, preprocessor=None)
    if lora and "token_embedding" in lora:  # B = 0 at init: make the LoRA term count
        emb = backbone.token_embedding
        emb.lora_embeddings_b.assign(
            np.random.default_rng(1).normal(0, 0.3, emb.lora_embeddings_b.shape))
    stock.set_weights(fused.get_weights())
    return _compile(fused), _compile(stock)


class ReverseCalls:
    """Counts `ReversibleEmbedding(h, reverse=True)` calls (traced or eager)
    made inside the models' `train_step` (or `step`: "test_step"; JAX /
    PyTorch also trace the inference call symbolically once, to build the
    model, outside it)."""

    def __init__(self, monkeypatch, *models, step="train_step"):
        self.count = 0
        self.steps = 0
        inside = []
        original = keras.layers.ReversibleEmbedding.call

        def call(layer, inputs, reverse=False):
            if reverse and inside:
                self.count += 1
            return original(layer, inputs, reverse=reverse)

        for model in models:
            def wrapped_step(*args, _step=getattr(model, step), **kwargs):
                inside.append(True)
                self.steps += 1
                try:
                    return _step(*args, **kwargs)
                finally:
                    inside.pop()

            monkeypatch.setattr(model, step, wrapped_step)
        monkeypatch.setattr(keras.layers.ReversibleEmbedding, "call", call)
        self.undo = monkeypatch.undo


def _weights(model):
    return [np.asarray(ops.convert_to_numpy(v), "float64") for v in model.trainable_variables]


def _assert_close_lists(a, b, rtol, names):
    # atol: rtol times the largest entry of all (some gradients, e.g. the
    # attention key bias's, are 0 up to round-off).
    scale = max(max(float(np.abs(v).max()) for v in b), 1e-12)
    assert len(a) == len(b) == len(names)
    for u, v, name in zip(a, b, names):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=rtol * scale, err_msg=name)


def _dense_loss(logits, y, sw):
    logits = np.asarray(logits, "float64")
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    nll = lse - np.take_along_axis(logits, y[..., None], -1)[..., 0]
    return (nll * sw).sum() / sw.sum()


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=slow_off_tensorflow)] + [
    pytest.param(n, marks=pytest.mark.slow) for n in MODELS if n != "gpt2"])
def test_fit_matches_stock_without_logits(name, monkeypatch, tmp_path):
    fused, stock = _pair(name)
    x, y, sw = _data()
    names = [v.path for v in fused.trainable_variables]
    w0 = _weights(fused)
    embedding = fused.backbone.token_embedding
    cap = fused.fused_projection()[2]
    assert cap == (1.5 if name.startswith("gemma") else None)
    assert embedding.tie_weights == (name != "llama")

    # The fused training loss is the stock loss of the logits (soft cap
    # included; without it the loss would differ).
    logits = ops.convert_to_numpy(stock.predict(x, verbose=0))
    hidden = fused(x, training=True)
    assert tuple(hidden.shape) == (B, T, 16)
    loss = float(ops.convert_to_numpy(fused.compute_loss(x, y, hidden, sw, training=True)))
    np.testing.assert_allclose(loss, _dense_loss(logits, y, sw), rtol=1e-5)
    if cap is not None:
        kernel, transposed, _ = fused.fused_projection()
        uncapped = float(ops.convert_to_numpy(ksh.linear_cross_entropy(
            hidden, kernel, y, sample_weight=sw, kernel_transposed=transposed)))
        assert abs(uncapped - loss) > 1e-3

    # One SGD step each: the same loss and gradients (w0 - w1) / lr; the
    # fused step never calls the output projection.
    calls = ReverseCalls(monkeypatch, fused)
    h_fused = fused.fit(x, y, sample_weight=sw, batch_size=B, epochs=1, verbose=0,
                        shuffle=False).history
    assert calls.steps > 0
    assert calls.count == 0, "the fused training step formed the logits"
    calls.undo()
    calls = ReverseCalls(monkeypatch, stock)
    h_stock = stock.fit(x, y, sample_weight=sw, batch_size=B, epochs=1, verbose=0,
                        shuffle=False).history
    assert calls.count > 0  # the stock step does
    calls.undo()
    np.testing.assert_allclose(h_fused["loss"], h_stock["loss"], rtol=1e-5)
    np.testing.assert_allclose(h_fused["loss"][0], _dense_loss(logits, y, sw), rtol=1e-5)
    g_fused = [(a - b) / LR for a, b in zip(w0, _weights(fused))]
    g_stock = [(a - b) / LR for a, b in zip(w0, _weights(stock))]
    _assert_close_lists(g_fused, g_stock, 1e-4, names)
    assert max(float(np.abs(g).max()) for g in g_fused) > 1e-3

    # A second step, with validation, then the fused evaluation (the
    # default): the exact loss, token accuracy and perplexity, without the
    # logits, over two batches of unequal weight (`fit`'s validation calls
    # `evaluate`; `test_on_batch` shares its compiled step).
    calls = ReverseCalls(monkeypatch, fused, step="test_step")
    half = B // 2
    h_fused = fused.fit(x, y, sample_weight=sw, batch_size=B, verbose=0, shuffle=False,
                        validation_data=(x, y, sw), validation_batch_size=half).history
    h_stock = stock.fit(x, y, sample_weight=sw, batch_size=B, verbose=0, shuffle=False).history
    np.testing.assert_allclose(h_fused["loss"], h_stock["loss"], rtol=1e-4)
    _assert_close_lists(_weights(fused), _weights(stock), 1e-5, names)
    halves = [slice(0, half), slice(half, B)]
    on_batch = [fused.test_on_batch({k: v[s] for k, v in x.items()}, y[s], sample_weight=sw[s],
                                    return_dict=True) for s in halves]
    result = fused.evaluate(x, y, sample_weight=sw, batch_size=half, verbose=0,
                            return_dict=True)
    assert calls.steps > 0
    assert calls.count == 0, "the fused evaluation step formed the logits"
    calls.undo()
    logits = ops.convert_to_numpy(fused.predict(x, verbose=0))
    np.testing.assert_allclose(logits, ops.convert_to_numpy(stock.predict(x, verbose=0)),
                               rtol=1e-4, atol=1e-5)
    assert set(result) == {"loss", "token_accuracy", "perplexity"}
    batch_losses = [_dense_loss(logits[s], y[s], sw[s]) for s in halves]
    assert batch_losses[0] != pytest.approx(batch_losses[1])
    for r, expected in zip(on_batch, batch_losses):
        np.testing.assert_allclose(r["loss"], expected, rtol=1e-5)
    # Keras' `loss`: the batches' losses averaged by batch size; the
    # perplexity: token-weighted over the whole set.
    np.testing.assert_allclose(result["loss"], np.mean(batch_losses), rtol=1e-5)
    perplexity = np.exp(_dense_loss(logits, y, sw))
    np.testing.assert_allclose(result["perplexity"], perplexity, rtol=1e-5)
    np.testing.assert_allclose(h_fused["val_perplexity"], [perplexity], rtol=1e-5)
    correct = (logits.argmax(-1) == y) * sw
    np.testing.assert_allclose(result["token_accuracy"], correct.sum() / sw.sum(), rtol=1e-6)
    assert sorted(h_fused) == ["loss", "val_loss", "val_perplexity", "val_token_accuracy"]

    # generate (greedy) is the stock model's.
    prompt = {"token_ids": x["token_ids"][:2].copy(),
              "padding_mask": np.zeros((2, T), "int32")}
    prompt["padding_mask"][:, :3] = 1
    prompt["token_ids"][:, 3:] = 0
    if name == "gemma3":
        # keras-hub's `generate` without a preprocessor fails on a text-only
        # Gemma 3 (None image outputs), stock model too: its generate_step.
        def generate(lm):
            return lm.generate_step(
                {k: ops.convert_to_tensor(v) for k, v in prompt.items()}, stop_token_ids=None)
    else:
        def generate(lm):
            return lm.generate(prompt, stop_token_ids=None)
    out = generate(fused)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(out["token_ids"]), ops.convert_to_numpy(generate(stock)["token_ids"]))
    assert np.all(ops.convert_to_numpy(out["padding_mask"]))

    # .keras round trip: same class, options, predictions; fit resumes.
    path = os.path.join(tmp_path, "lm.keras")
    fused.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(fused)
    assert loaded.fused_loss == fused.fused_loss
    assert loaded.fused_evaluate is True
    assert loaded.fused_projection()[1:] == fused.fused_projection()[1:]
    np.testing.assert_array_equal(ops.convert_to_numpy(loaded.predict(x, verbose=0)), logits)
    # keras-hub's CausalLM overrides `compile`, so `load_model` does not
    # re-compile it (stock models too): compile again (SGD has no state).
    _compile(loaded)
    fused.fit(x, y, sample_weight=sw, batch_size=B, verbose=0, shuffle=False)
    loaded.fit(x, y, sample_weight=sw, batch_size=B, verbose=0, shuffle=False)
    _assert_close_lists(_weights(loaded), _weights(fused), 1e-6, names)


@slow_off_tensorflow
# LoRA on the embedding by default; attention-only LoRA (the embedding
# frozen) and the in-forward gradient under `-m slow` (10 s each).
@pytest.mark.parametrize("targets, in_forward", sweep([
    (["token_embedding", "query"], False), (None, False), (["token_embedding", "query"], True)],
    keep=[(["token_embedding", "query"], False)]),
    ids=["embedding", "default", "embedding-in-forward"])
def test_lora_on_tied_embedding_uses_merged_matrix(targets, in_forward, monkeypatch):
    """`backbone.enable_lora(r, target_layer_names=[..., "token_embedding"])`:
    the fused loss uses `W + (alpha / r) A B`, like the stock reverse call;
    the frozen `W` stays put, `A` and `B` get the stock gradients. With the
    default targets (attention only) the embedding is simply frozen."""
    # 32 tokens in blocks of 8 (`token_chunk_size`): the two-pass backward
    # through keras-hub's soft cap and LoRA; or the gradient in the forward
    # pass, in chunks of 8 tokens.
    fused, stock = _pair("gemma2", lora=targets or ["query", "value"],
                         fused_loss={"chunk_size": 40, "token_chunk_size": 12,
                                     "gradient_in_forward": in_forward})
    x, y, sw = _data(1)
    embedding = fused.backbone.token_embedding
    assert embedding.lora_enabled == bool(targets)
    names = [v.path for v in fused.trainable_variables]
    assert any("lora_embeddings_b" in n for n in names) == bool(targets)
    assert any("lora_kernel_a" in n for n in names)
    frozen = [v for v in fused.non_trainable_variables if v.path.endswith("token_embedding/embeddings")]
    assert len(frozen) == 1
    frozen0 = np.asarray(ops.convert_to_numpy(frozen[0]))
    w0 = _weights(fused)
    logits = ops.convert_to_numpy(stock.predict(x, verbose=0))
    hidden = fused(x, training=True)
    loss = float(ops.convert_to_numpy(fused.compute_loss(x, y, hidden, sw, training=True)))
    np.testing.assert_allclose(loss, _dense_loss(logits, y, sw), rtol=1e-5)
    calls = ReverseCalls(monkeypatch, fused)
    h_fused = fused.fit(x, y, sample_weight=sw, batch_size=B, verbose=0).history
    assert calls.steps > 0 and calls.count == 0
    h_stock = stock.fit(x, y, sample_weight=sw, batch_size=B, verbose=0).history
    calls.undo()
    np.testing.assert_allclose(h_fused["loss"], h_stock["loss"], rtol=1e-5)
    g_fused = [(a - b) / LR for a, b in zip(w0, _weights(fused))]
    g_stock = [(a - b) / LR for a, b in zip(w0, _weights(stock))]
    _assert_close_lists(g_fused, g_stock, 1e-4, names)
    if targets:
        lora_b = names.index(next(n for n in names if "lora_embeddings_b" in n))
        assert float(np.abs(g_fused[lora_b]).max()) > 1e-4
    np.testing.assert_array_equal(np.asarray(ops.convert_to_numpy(frozen[0])), frozen0)


def test_soft_cap_option_must_match_the_model():
    backbone, cls = tiny_gemma2()
    fused_class = ksh.fused.fused_causal_lm(cls)
    lm = fused_class(backbone=backbone, preprocessor=None, fused_loss={"logit_soft_cap": 1.5})
    assert lm.fused_loss == {} and lm.fused_projection()[2] == 1.5
    with pytest.raises(ValueError, match="soft cap"):
        fused_class(backbone=backbone, preprocessor=None, fused_loss={"logit_soft_cap": 30.0})
    with pytest.raises(ValueError, match="vocab_parallel"):
        fused_class(backbone=backbone, preprocessor=None, fused_loss={"vocab_parallel": "yes"})
    for options in ({"gradient_in_forward": True, "reduction": "none"},
                    {"reduction": "none"}, {"reduction": None}):
        # One scalar to train on: per-token losses trained their sum on
        # TensorFlow (reporting the mean) and failed on JAX / PyTorch.
        with pytest.raises(ValueError, match="'mean' .* or 'sum'"):
            fused_class(backbone=backbone, preprocessor=None, fused_loss=options)
    with pytest.raises(ValueError, match="gradient_in_forward"):
        fused_class(backbone=backbone, preprocessor=None,
                    fused_loss={"gradient_in_forward": "yes"})


def test_linear_cross_entropy_adopts_the_layers_soft_cap():
    """`LinearCrossEntropy(backbone.token_embedding)` of a soft-capped model
    (Gemma 2's `final_logit_soft_cap`, on its `ReversibleEmbedding`) is the
    stock model's loss without `logit_soft_cap` being passed (it ignored
    the cap: the uncapped loss); the cap is in its config; another cap is
    an error."""
    backbone, cls = tiny_gemma2()
    rng = np.random.default_rng(3)
    embeddings = backbone.token_embedding.embeddings
    embeddings.assign(ops.convert_to_numpy(embeddings) * 20.0)  # the cap matters
    x = {"token_ids": rng.integers(1, V, (B, T)).astype("int32"),
         "padding_mask": np.ones((B, T), "int32")}
    y = rng.integers(1, V, (B, T)).astype("int32")
    logits = np.asarray(ops.convert_to_numpy(cls(backbone=backbone, preprocessor=None)(x)),
                        "float64")
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    stock = (lse - np.take_along_axis(logits, y[..., None], -1)[..., 0]).mean()
    h = backbone(x)
    loss = ksh.LinearCrossEntropy(backbone.token_embedding)
    np.testing.assert_allclose(float(loss(y, h)), stock, rtol=1e-5)
    assert loss.logit_soft_cap == 1.5 and loss.get_config()["logit_soft_cap"] == 1.5
    uncapped = ksh.LinearCrossEntropy(embeddings, kernel_transposed=True)
    assert abs(float(uncapped(y, h)) - stock) > 1e-2 * stock  # the cap changes the loss
    with pytest.raises(ValueError, match="soft-capped at 1.5"):
        ksh.LinearCrossEntropy(backbone.token_embedding, logit_soft_cap=30.0)


def test_fused_evaluate_must_be_bool():
    backbone, cls = tiny_gpt2()
    with pytest.raises(ValueError, match="Received: fused_evaluate=1"):
        ksh.fused.fused_causal_lm(cls)(backbone=backbone, preprocessor=None, fused_evaluate=1)
