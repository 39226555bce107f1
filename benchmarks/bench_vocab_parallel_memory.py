"""Per-device memory and collectives of `train_lm`'s training step under
`VocabularyParallel` (JAX, simulated host devices), against one device.

For each head (`FullSoftmax`, `SigSoftmax`, `PLIFSoftmax`, MoS(4), all with
`chunk_size`, so that they train their summed objective with its gradient in
the forward pass; with `--heads`, also `MixtureOfContexts` (tiled),
`HierarchicalSoftmax`, `MonotonicSoftmax` and `SampledSoftmax`, which train
their per-token loss or a sampled one; `name:dense` builds a head without
`chunk_size`), the model
`examples/train_lm.py` builds (a tied LSTM) is built three times: under
`VocabularyParallel(V, vocab_shards=devices)` (the vocabulary-sized
weights split over every device), the same with the library's
vocabulary-parallel passes turned off (`vocab_parallel_layout` made to
answer None and the knot histogram flattened: XLA's partitioner then
shards the single-device pass from the layouts, as it did for the mixture
heads before `vocab_parallel_mixture`), and without a distribution. Keras' own `train_step` is compiled for one batch (`jax.jit`,
nothing runs), and so are the head's training pass alone (its summed
objective and gradients given the contexts) and its per-token
`log_likelihood` of the batch's contexts (the evaluation); XLA's
`compiled.memory_analysis()` read: the arguments
(weights, optimizer state, the batch) and the temporaries of one device;
and the collectives of the compiled step (`all-gather`, `all-reduce`, ...)
that move at least a device's share of the `[V, d]` matrix, with their
result shapes, so that a `[V, d]` matrix or a `[rows, V]` score tile
gathered on every device shows.

Usage:
    python benchmarks/bench_vocab_parallel_memory.py \
        --out=docs/results/vocab_parallel/memory_cpu_v65536.json
    python benchmarks/bench_vocab_parallel_memory.py \
        --heads=mixture_of_contexts,hierarchical,monotonic,monotonic:dense,sampled_softmax \
        --out=docs/results/vocab_parallel/memory_cpu_v65536_per_token_heads.json
    python benchmarks/bench_vocab_parallel_memory.py --vocab=256 --dim=8 --heads=plif
"""

import argparse
import os
import re
import sys

HEADS = ("full_softmax", "sigsoftmax", "plif", "mixture_of_softmaxes")
#: Heads without a summed core (`--heads`): they train their per-token loss
#: (`SampledSoftmax` its sampled objective; its evaluation is exact).
PER_TOKEN_HEADS = ("mixture_of_contexts", "hierarchical", "monotonic", "monotonic:dense",
                   "sampled_softmax")
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=64, help="embedding and LSTM size")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--bptt", type=int, default=32)
    parser.add_argument("--chunk_size", type=int, default=512)
    parser.add_argument("--devices", type=int, default=4,
                        help="simulated host devices, all on the vocabulary axis")
    parser.add_argument("--heads", default=",".join(HEADS),
                        help=f"comma-separated; also {', '.join(PER_TOKEN_HEADS)}")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def collectives(text, min_elements):
    """`["all-gather f32[256,65536]", ...]`: the compiled step's collectives
    whose result has at least `min_elements` elements, those whose replica
    groups are single devices (which move nothing: `jax.shard_map`'s
    transpose sums over a mesh axis of size 1) left out."""
    found = set()
    pattern = r"= \(?(\w+\[[\d,]*\])[^\n]*? (" + "|".join(COLLECTIVES) + r")(?:-start)?\("
    lines = [line for line in text.splitlines()
             if not re.search(r"replica_groups=\{(\{\d+\},?)+\}", line)]
    for shape, op in re.findall(pattern, "\n".join(lines)):
        dims = [int(x) for x in re.findall(r"\d+", shape.split("[")[1])]
        size = 1
        for x in dims:
            size *= x
        if size >= min_elements:
            found.add(f"{op} {shape}")
    return sorted(found)


def gathers_vocabulary(found, vocab):
    """Whether the collectives `found` gather an array with a V-sized axis."""
    return any(c.startswith("all-gather") and re.search(rf"[\[,]{vocab}[\],]", c)
               for c in found)


def step_memory(head, args, sharded, corpus, partitioned_by_xla=False):
    """`{"argument_mib", "temp_mib", "collectives"}` of one device's
    compiled training step of `head`'s model, and `eval_temp_mib`,
    `eval_collectives` of its head's per-token log-likelihood of a batch;
    `partitioned_by_xla`: with the vocabulary-parallel passes off."""
    import jax
    import keras
    import numpy as np
    from keras import ops

    from keras_softmax_heads import training
    from keras_softmax_heads.chunked import vocab_parallel
    from keras_softmax_heads.functional import dispatch
    from keras_softmax_heads.heads import full_softmax
    from keras_softmax_heads.heads import hierarchical_softmax
    from keras_softmax_heads.heads import mixture_of_contexts
    from keras_softmax_heads.heads import mixture_of_softmaxes
    from keras_softmax_heads.heads import pointwise_softmax_head

    # Where the heads ask whether the vocabulary-parallel passes apply.
    askers = (vocab_parallel, full_softmax, mixture_of_softmaxes, pointwise_softmax_head,
              mixture_of_contexts, hierarchical_softmax)
    layout = vocab_parallel.vocab_parallel_layout
    sharded_scatter = dispatch.sharded_scatter
    for module in askers:
        module.vocab_parallel_layout = (lambda *a: None) if partitioned_by_xla else layout
    dispatch.sharded_scatter = (lambda: False) if partitioned_by_xla else sharded_scatter

    keras.distribution.set_distribution(
        training.VocabularyParallel(args.vocab, args.devices) if sharded else None)
    config = training.get_config(
        dataset_options=dict(vocab_size=args.vocab), head=head.split(":")[0],
        embedding_dim=args.dim,
        hidden_size=args.dim, num_layers=1, batch_size=args.batch, bptt=args.bptt,
        # "name:dense": without `chunk_size`.
        chunk_size=None if head.endswith(":dense") else args.chunk_size, tensorboard=False)
    model, _ = training.build_model(config, corpus)
    model.optimizer.build(model.trainable_variables)
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
        model.metrics_variables))
    data = (np.zeros((args.batch, args.bptt), "int32"),) * 2
    if sharded:
        distribution = keras.distribution.distribution()
        data = tuple(jax.device_put(x, distribution.get_data_layout(x.shape).backend_layout)
                     for x in data)
    compiled = jax.jit(model.train_step).lower(state, data).compile()
    analysis = compiled.memory_analysis()
    # Evaluation: the head's per-token log-likelihood of the batch's
    # contexts (what the exact perplexity and `predict` compute).
    head = model.head

    def log_likelihood(values, h, y):
        with keras.StatelessScope(state_mapping=list(zip(weights, values))):
            return head.log_likelihood(h, y)

    def head_training(values, h, y):  # the head's summed objective and its gradients
        def loss(values, h):
            with keras.StatelessScope(state_mapping=list(zip(weights, values))):
                return head.summed_training_loss(h, y, ops.ones(y.shape, "float32"))
        return jax.grad(loss, argnums=(0, 1))(values, h)

    contexts = np.zeros((args.batch, args.bptt, args.dim), "float32")
    values = [w.value for w in head.trainable_weights]
    weights = head.trainable_weights
    evaluation = jax.jit(log_likelihood).lower(values, contexts, data[1]).compile()
    head_step = jax.jit(head_training).lower(values, contexts, data[1]).compile()
    keras.distribution.set_distribution(None)
    for module in askers:
        module.vocab_parallel_layout = layout
    dispatch.sharded_scatter = sharded_scatter
    return {
        "argument_mib": analysis.argument_size_in_bytes / 2**20,
        "temp_mib": analysis.temp_size_in_bytes / 2**20,
        # Collectives as large as a device's share of the [V, d] matrix.
        "collectives": collectives(compiled.as_text(), args.vocab * args.dim // args.devices),
        "head_train_temp_mib": head_step.memory_analysis().temp_size_in_bytes / 2**20,
        "head_collectives": collectives(head_step.as_text(),
                                        args.vocab * args.dim // args.devices),
        "eval_temp_mib": evaluation.memory_analysis().temp_size_in_bytes / 2**20,
        "eval_collectives": collectives(evaluation.as_text(),
                                        args.vocab * args.dim // args.devices),
    }


def main(argv=None):
    args = parse_args(argv)
    # Before JAX starts: the simulated host devices.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import types

    import measure  # benchmarks/measure.py
    import numpy as np

    # A stand-in corpus: the model needs the vocabulary size and the
    # training split's word counts (a Zipf sample), not a corpus on disk.
    train = (np.random.default_rng(0).zipf(1.2, 200_000).clip(1, args.vocab) - 1).astype("int32")
    corpus = types.SimpleNamespace(
        vocab_size=args.vocab, train=train,
        vocab=types.SimpleNamespace(counts=np.bincount(train, minlength=args.vocab)))
    rows = []
    for head in args.heads.split(","):
        row = {"head": head}
        for sharded in (True, False):
            row["sharded" if sharded else "one_device"] = step_memory(head, args, sharded, corpus)
        row["sharded_by_xla"] = step_memory(head, args, True, corpus, partitioned_by_xla=True)
        row["temp_ratio"] = row["sharded"]["temp_mib"] / row["one_device"]["temp_mib"]
        row["temp_ratio_by_xla"] = (row["sharded_by_xla"]["temp_mib"]
                                    / row["one_device"]["temp_mib"])
        row["argument_ratio"] = (row["sharded"]["argument_mib"]
                                 / row["one_device"]["argument_mib"])
        row["gathers_vocabulary"] = gathers_vocabulary(row["sharded"]["collectives"], args.vocab)
        row["head_train_temp_ratio"] = (row["sharded"]["head_train_temp_mib"]
                                        / row["one_device"]["head_train_temp_mib"])
        row["eval_temp_ratio"] = (row["sharded"]["eval_temp_mib"]
                                  / row["one_device"]["eval_temp_mib"])
        row["eval_gathers_vocabulary"] = gathers_vocabulary(
            row["sharded"]["eval_collectives"], args.vocab)
        rows.append(row)
        print(f"{head}: head's training pass {row['head_train_temp_ratio']:.2f}x; "
              f"temporaries {row['sharded']['temp_mib']:.1f} MiB a device "
              f"({row['temp_ratio']:.2f}x one device's; XLA's partitioning "
              f"{row['temp_ratio_by_xla']:.2f}x, collectives "
              f"{row['sharded_by_xla']['collectives']}); evaluation "
              f"{row['eval_temp_ratio']:.2f}x (by XLA "
              f"{row['sharded_by_xla']['eval_temp_mib'] / row['one_device']['eval_temp_mib']:.2f}x, "
              f"{row['sharded_by_xla']['eval_collectives']}), arguments "
              f"{row['sharded']['argument_mib']:.1f} MiB ({row['argument_ratio']:.2f}x); "
              f"collectives {row['sharded']['collectives']}", flush=True)
    result = {
        "benchmark": "vocab_parallel_memory",
        "command": measure.command_line(__file__, argv),
        "shape": {k: getattr(args, k) for k in ("vocab", "dim", "batch", "bptt", "chunk_size",
                                                 "devices")},
        "rows": rows,
        "machine": measure.machine(),
    }
    measure.save(result, args.out)
    return result


if __name__ == "__main__":
    main()
