r"""Per-token log-probabilities and entropies of a keras-hub causal LM without
its `[batch, seq, V]` logits, and a few policy-gradient steps through them.

Builds a tiny Gemma 2 style `GemmaCausalLM` from a config (no download;
final logit soft cap), scores random token sequences with
`keras_softmax_heads.fused.causal_lm_token_scores` (printing the
log-probabilities and entropies next to those of the stock logits), then
runs a few REINFORCE steps: sample continuations (`generate`, random
sampler), reward each sequence by the fraction of even token ids in it,
and minimise `-mean_b((R_b - mean R) sum_t logp_bt) - beta mean_b(sum_t
H_bt)` through `fit` with a `compute_loss` built on the scores (no logits in
the training step). See `docs/token_statistics.md`.

    python examples/hub_token_scores.py --steps=5
"""

import numpy as np
from absl import app
from absl import flags

FLAGS = flags.FLAGS


def define_flags():
    """The script's flags (defined when it runs, not on import)."""
    flags.DEFINE_integer("vocabulary_size", 256, "Vocabulary size V.")
    flags.DEFINE_integer("hidden_dim", 32, "Hidden size d.")
    flags.DEFINE_integer("num_layers", 1, "Decoder layers.")
    flags.DEFINE_integer("batch_size", 4, "Sequences per step.")
    flags.DEFINE_integer("prompt_len", 4, "Prompt tokens.")
    flags.DEFINE_integer("seq_len", 12, "Sequence length (prompt + continuation).")
    flags.DEFINE_integer("steps", 3, "Policy-gradient steps.")
    flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate.")
    flags.DEFINE_float("temperature", 1.0, "Sampling / scoring temperature.")
    flags.DEFINE_float("entropy_bonus", 0.01, "Weight beta of the entropy bonus.")
    flags.DEFINE_integer("chunk_size", 64, "Vocabulary tile width.")
    flags.DEFINE_integer("seed", 0, "Random seed.")


def build_model(vocabulary_size, hidden_dim, num_layers, soft_cap=30.0):
    """A tiny Gemma 2 style backbone (final logit soft cap) from a config."""
    import keras_hub

    return keras_hub.models.GemmaBackbone(
        vocabulary_size=vocabulary_size, num_layers=num_layers, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=hidden_dim, intermediate_dim=2 * hidden_dim,
        head_dim=hidden_dim // 2, query_head_dim_normalize=False,
        use_post_ffw_norm=True, use_post_attention_norm=True,
        attention_logit_soft_cap=50.0, final_logit_soft_cap=soft_cap,
    )


def policy_class(temperature, entropy_bonus, chunk_size):
    """A `GemmaCausalLM` whose training step is a REINFORCE loss with an
    entropy bonus on `causal_lm_token_scores` (`call` returns the hidden
    states in training; `y` is each sequence's advantage)."""
    import keras_hub
    from keras import ops

    from keras_softmax_heads.fused import causal_lm_token_scores

    class PolicyGemma(keras_hub.models.GemmaCausalLM):
        def call(self, inputs, training=None, mask=None):
            if training:
                return self.backbone(inputs, training=training)
            return super().call(inputs, training=training, mask=mask)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         training=True):
            ids, pad = x["token_ids"], x["padding_mask"]
            # In training `y_pred` is `call`'s hidden states; otherwise (Keras
            # also calls this with `training=False`, e.g. while JAX and PyTorch
            # build the model) the logits: the scores then run the backbone.
            log_p, ent = causal_lm_token_scores(
                self, ids, pad, hidden_states=y_pred if training else None,
                temperature=temperature,
                return_entropy=True, chunk_size=chunk_size)
            # Only the generated tokens (after the prompt) carry the reward.
            mask = ops.cast(sample_weight[:, 1:], "float32")
            advantage = ops.cast(y, "float32")[:, None]
            pg = -ops.mean(ops.sum(advantage * log_p * mask, axis=1))
            return pg - entropy_bonus * ops.mean(ops.sum(ent * mask, axis=1))

    return PolicyGemma


def reward(token_ids, prompt_len):
    """The fraction of even token ids in each continuation, `[B]`."""
    return (token_ids[:, prompt_len:] % 2 == 0).mean(axis=1).astype("float32")


def run(vocabulary_size=256, hidden_dim=32, num_layers=1, batch_size=4, prompt_len=4,
        seq_len=12, steps=3, learning_rate=0.05, temperature=1.0, entropy_bonus=0.01,
        chunk_size=64, seed=0, log=print):
    """Scores, then `steps` policy-gradient steps; returns a dict (the first
    batch's log-probs / entropies, the stock ones, the mean rewards)."""
    import keras
    import keras_hub
    from keras import ops

    from keras_softmax_heads.fused import causal_lm_token_scores

    keras.utils.set_random_seed(seed)
    backbone = build_model(vocabulary_size, hidden_dim, num_layers)
    lm = policy_class(temperature, entropy_bonus, chunk_size)(
        backbone=backbone, preprocessor=None)
    lm.compile(optimizer=keras.optimizers.SGD(learning_rate), loss=None,
               weighted_metrics=[],
               sampler=keras_hub.samplers.RandomSampler(temperature=temperature))
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocabulary_size, (batch_size, seq_len)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}

    log_p, ent = causal_lm_token_scores(lm, ids, x["padding_mask"], temperature=temperature,
                                        return_entropy=True, chunk_size=chunk_size)
    log_p, ent = ops.convert_to_numpy(log_p), ops.convert_to_numpy(ent)
    logits = np.asarray(ops.convert_to_numpy(lm(x)), "float64")[:, :-1] / temperature
    dense = logits - logits.max(-1, keepdims=True)
    dense = dense - np.log(np.exp(dense).sum(-1, keepdims=True))
    dense_lp = np.take_along_axis(dense, ids[:, 1:, None], -1)[..., 0]
    dense_ent = -(np.exp(dense) * dense).sum(-1)
    log(f"log-probs (first sequence): {[round(float(v), 3) for v in log_p[0]]}")
    log(f"entropies (first sequence): {[round(float(v), 3) for v in ent[0]]}")
    log(f"max |difference| to the stock logits: log-probs "
        f"{np.abs(log_p - dense_lp).max():.2e}, entropies {np.abs(ent - dense_ent).max():.2e}")

    rewards = []
    for step in range(steps):
        prompt = np.zeros((batch_size, seq_len), "int32")
        prompt[:, :prompt_len] = rng.integers(1, vocabulary_size, (batch_size, prompt_len))
        pad = np.zeros_like(prompt)
        pad[:, :prompt_len] = 1
        out = lm.generate({"token_ids": prompt, "padding_mask": pad}, stop_token_ids=None)
        sampled = np.asarray(ops.convert_to_numpy(out["token_ids"]), "int32")
        r = reward(sampled, prompt_len)
        generated = np.zeros_like(sampled, "float32")
        generated[:, prompt_len:] = 1.0
        history = lm.fit({"token_ids": sampled, "padding_mask": np.ones_like(sampled)},
                         r - r.mean(), sample_weight=generated, batch_size=batch_size,
                         epochs=1, verbose=0, shuffle=False).history
        rewards.append(float(r.mean()))
        log(f"step {step}: mean reward {r.mean():.3f}, loss {history['loss'][-1]:.4f}")
    return {"log_probs": log_p, "entropy": ent, "dense_log_probs": dense_lp,
            "dense_entropy": dense_ent, "rewards": rewards}


def main(argv):
    del argv
    run(FLAGS.vocabulary_size, FLAGS.hidden_dim, FLAGS.num_layers, FLAGS.batch_size,
        FLAGS.prompt_len, FLAGS.seq_len, FLAGS.steps, FLAGS.learning_rate,
        FLAGS.temperature, FLAGS.entropy_bonus, FLAGS.chunk_size, FLAGS.seed)


if __name__ == "__main__":
    define_flags()
    app.run(main)
