r"""Distils a keras-hub causal LM into a smaller one without the logits.

Two tiny Gemma 2 style keras-hub models are built from configs (no
downloads; the teacher wider than the student, both with a final logit soft
cap), and `keras_softmax_heads.fused.DistillationCausalLM` trains the
student towards the frozen teacher with `fit` on random token sequences:
`linear_divergence` on both backbones' hidden states, so neither model's
`[batch, seq, V]` logits are formed. Prints the divergence after each step
(it goes down) and checks that the teacher did not change.

    python examples/hub_distillation.py
    python examples/hub_distillation.py --divergence=jsd --beta=0.5 \
        --temperature=2 --steps=30

With `--model_parallel=n` (JAX, `n` devices) both models are built under a
`keras.distribution.ModelParallel` with keras-hub's Gemma layout map, which
shards the token embeddings on the vocabulary axis: the divergence is then
computed vocabulary-parallel, each device on its own `V / n` words of both
models (to try it on a CPU, simulate devices):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 KERAS_BACKEND=jax \
        python examples/hub_distillation.py --model_parallel=4

See `docs/distillation.md`.
"""

import argparse
import sys

import keras
import numpy as np

from keras_softmax_heads.fused import DistillationCausalLM


def gemma_lm(vocab_size, hidden_dim, soft_cap, seed, heads=(2, 1)):
    """A tiny Gemma 2 style `GemmaCausalLM` (tied embedding, final soft
    cap), built from a config; `heads`: its query and key / value heads."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=vocab_size, num_layers=2, num_query_heads=heads[0],
        num_key_value_heads=heads[1], hidden_dim=hidden_dim, intermediate_dim=2 * hidden_dim,
        head_dim=hidden_dim // 2, query_head_dim_normalize=False,
        use_post_ffw_norm=True, use_post_attention_norm=True,
        final_logit_soft_cap=soft_cap, attention_logit_soft_cap=50.0,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def random_batch(vocab_size, batch_size, seq_len, seed):
    """`(x, y, padding_mask)` of random tokens (the last two positions of
    the first sequence are padding)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab_size, (batch_size, seq_len + 1)).astype("int32")
    mask = np.ones((batch_size, seq_len), "int32")
    mask[0, -2:] = 0
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask}
    return x, tokens[:, 1:], mask.astype("float32")


def vocabulary_sharding(devices):
    """A `keras.distribution.ModelParallel` over `devices` devices (JAX)
    with keras-hub's Gemma layout map: the token embeddings `[V, d]` split
    on the vocabulary axis ("model"), the batch not split."""
    import keras_hub

    if keras.backend.backend() != "jax":
        raise SystemExit("--model_parallel needs the JAX backend (KERAS_BACKEND=jax).")
    available = keras.distribution.list_devices()
    if len(available) < devices:
        raise SystemExit(f"--model_parallel={devices} needs {devices} devices; JAX sees "
                         f"{len(available)}. On a CPU: XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={devices}")
    mesh = keras.distribution.DeviceMesh((1, devices), ("batch", "model"),
                                         available[:devices])
    return keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
        batch_dim_name="batch")


def distil(*, vocab_size=512, student_dim=32, teacher_dim=64, batch_size=4, seq_len=16,
           steps=20, divergence="forward_kl", beta=0.5, temperature=1.0,
           learning_rate=3e-3, chunk_size=128, seed=0, model_parallel=0):
    """Runs the distillation; returns `(divergences, teacher_unchanged)`:
    the divergence of each `fit` step (one epoch over one batch) and
    whether the teacher's weights are as before. `model_parallel`: the
    number of devices whose `ModelParallel` distribution to train under
    (0: none)."""
    heads = (2, 1)
    if model_parallel:
        keras.distribution.set_distribution(vocabulary_sharding(model_parallel))
        heads = (model_parallel, model_parallel)  # the layout map splits the heads too
    teacher = gemma_lm(vocab_size, teacher_dim, 30.0, seed + 1, heads)
    student = gemma_lm(vocab_size, student_dim, 30.0, seed, heads)
    teacher_weights = [np.array(w) for w in teacher.get_weights()]
    distiller = DistillationCausalLM(
        student, teacher, divergence=divergence, beta=beta,
        temperature=temperature, chunk_size=chunk_size)
    distiller.compile(optimizer=keras.optimizers.Adam(learning_rate))
    x, y, mask = random_batch(vocab_size, batch_size, seq_len, seed)
    history = distiller.fit(x, y, sample_weight=mask, batch_size=batch_size,
                            epochs=steps, verbose=0, shuffle=False).history
    unchanged = all(np.array_equal(a, b)
                    for a, b in zip(teacher_weights, teacher.get_weights()))
    return [float(v) for v in history["divergence"]], unchanged


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--student_dim", type=int, default=32)
    parser.add_argument("--teacher_dim", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="fit epochs (one batch each)")
    parser.add_argument("--divergence", default="forward_kl",
                        choices=["forward_kl", "reverse_kl", "jsd"])
    parser.add_argument("--beta", type=float, default=0.5, help="the JSD's mixing weight")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--chunk_size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model_parallel", type=int, default=0,
                        help="devices to shard the models' vocabulary over (JAX; 0: none)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    divergences, unchanged = distil(**vars(args))
    for step, value in enumerate(divergences, 1):
        print(f"step {step:3d}  {args.divergence} {value:.6f}")
    print(f"teacher unchanged: {unchanged}")
    return divergences, unchanged


if __name__ == "__main__":
    main()
