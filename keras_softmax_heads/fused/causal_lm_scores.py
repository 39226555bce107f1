"""keras-hub integration: `causal_lm_token_scores`, the per-token
log-probabilities (and entropies) of token sequences under a keras-hub
`CausalLM`, without the `[batch, seq, V]` logits. Design:
`docs/token_statistics.md`."""

from keras import ops

from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.fused.causal_lm import FusedLossCausalLM
from keras_softmax_heads.fused.token_scores import linear_token_scores
from keras_softmax_heads.validation import check_bool


def causal_lm_token_scores(
    causal_lm,
    token_ids,
    padding_mask=None,
    *,
    hidden_states=None,
    temperature=1.0,
    return_entropy=False,
    training=False,
    chunk_size=DEFAULT_CHUNK_SIZE,
    implementation="auto",
    vocab_parallel="auto",
):
    """Per-token log-probabilities of sequences under a keras-hub causal LM,
    without the logits.

    For `token_ids` `x` `[B, T]`, position `t` of the result is
    `log p(x[:, t + 1] | x[:, :t + 1])` under the model's
    `softmax(g(h_t W) / T)`, `t = 0 .. T-2`, with `h` the backbone's final
    hidden states and `g` the output projection the stock model applies
    (`token_embedding(h, reverse=True)`: the tied `[V, d]` embedding or the
    untied `[d, V]` matrix, Gemma 2's `final_logit_soft_cap`; read with
    `FusedLossCausalLM.fused_projection`). With `return_entropy`, also the
    entropy of each position's next-token distribution. Computed by
    `linear_token_scores` (vocabulary tiles, no `[B, T, V]` tensor);
    differentiable with respect to every weight of the model through
    ordinary autodiff (inside `jax.jit`, `tf.function`, a model's
    `compute_loss` / custom train step: see `docs/token_statistics.md`).

    Args:
        causal_lm: a keras-hub `CausalLM` whose `backbone.token_embedding` is
            a `ReversibleEmbedding` (GPT-2, Gemma / Gemma 2 / Gemma 3,
            Llama, Mistral, ...), not quantized.
        token_ids: int `[B, T]`, the sequences (prompt and continuation).
        padding_mask: None (all tokens real) or `[B, T]` (bool / int / float,
            nonzero for real tokens), as the backbone takes it.
        hidden_states: None (run `causal_lm.backbone` on the inputs) or the
            backbone's output `[B, T, d]` already computed (e.g. a model's
            `call` in training).
        temperature: float `> 0`, divides the (capped) logits.
        return_entropy: bool, also return the entropies.
        training: passed to the backbone (dropout).
        chunk_size, implementation, vocab_parallel: as in
            `linear_token_scores`.

    Returns:
        `log_probs` `[B, T-1]` float32 (0 where the predicted token or its
        predecessor is padding: multiply by the same mask,
        `padding_mask[:, 1:] * padding_mask[:, :-1]`, to reduce), or
        `(log_probs, entropy)`, `entropy` `[B, T-1]` (0 at the same
        positions).

    Example (not run here: keras-hub is optional):

        lm = keras_hub.models.GemmaCausalLM.from_preset("gemma2_2b_en")
        log_p, ent = ksh.fused.causal_lm_token_scores(
            lm, x["token_ids"], x["padding_mask"], return_entropy=True)
        # A policy-gradient loss, exact per token, no [B, T, V] logits:
        loss = -ops.sum(advantage[:, None] * log_p * mask) + 0.01 * ...
    """
    return_entropy = check_bool("return_entropy", return_entropy)
    token_ids = ops.convert_to_tensor(token_ids)
    if len(token_ids.shape) != 2:
        raise ValueError(
            f"`token_ids` must be [batch, seq]. Received: token_ids.shape={token_ids.shape}"
        )
    if padding_mask is None:
        padding_mask = ops.ones_like(token_ids)
    padding_mask = ops.convert_to_tensor(padding_mask)
    if hidden_states is None:
        hidden_states = causal_lm.backbone(
            {"token_ids": token_ids, "padding_mask": padding_mask}, training=training
        )
    kernel, transposed, cap = FusedLossCausalLM.fused_projection(causal_lm)
    out = linear_token_scores(
        hidden_states[:, :-1], kernel, token_ids[:, 1:], kernel_transposed=transposed,
        temperature=temperature, logit_soft_cap=cap, return_entropy=return_entropy,
        chunk_size=chunk_size, implementation=implementation,
        vocab_parallel=vocab_parallel,
    )
    real = ops.logical_and(ops.cast(padding_mask[:, 1:], "bool"),
                           ops.cast(padding_mask[:, :-1], "bool"))
    out = out if return_entropy else (out,)
    out = tuple(ops.where(real, x, ops.zeros_like(x)) for x in out)
    return out if return_entropy else out[0]
