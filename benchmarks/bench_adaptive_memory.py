r"""XLA's planned memory of `AdaptiveSoftmax`'s static training step (JAX).

Compiles (nothing runs) the loss and its gradients of the head's exact NLL,
`-mean(log_likelihood(h, t))` with respect to `h` and every weight, for each
`V, N, cutoffs` row at `d` (default 512), and records
`compiled.memory_analysis()`: temporaries and arguments, next to the tails'
first-block capacities `tail_capacities(N)` and what one dense tail's
`[N, size]` float32 scores would take. `--chunk_size=C` builds the head
with `chunk_size=C` (the clusters' log-normalisers over tiles of `C` words). A CPU is enough: the figures are
XLA's buffer assignment for the step, the memory a TPU or GPU would need.

    python benchmarks/bench_adaptive_memory.py --out=docs/results/adaptive_memory/after.json
    python benchmarks/bench_adaptive_memory.py --chunk_size=8192 \
        --out=docs/results/adaptive_memory/chunked_8192.json
"""

import argparse
import json
import os
import platform
import time

import measure  # benchmarks/measure.py (the script's own folder)


ROWS = ("100000:2048:2000/10000/50000", "267735:8192:20000/60000",
        "793471:2048:60000/100000/640000", "793471:8192:60000/100000/640000")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS),
                        help="comma-separated V:N:c1/c2/... (cutoffs)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--chunk_size", type=int, default=None,
                        help="the head's chunk_size (default: None, whole clusters)")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def planned_memory(vocab, tokens, cutoffs, dim, chunk_size=None):
    """`{"temp_mib", "argument_mib", "capacities", "tail_sizes",
    "dense_tail_mib"}` of one compiled step."""
    import jax
    import keras
    from keras import ops

    from keras_softmax_heads import AdaptiveSoftmax

    head = AdaptiveSoftmax(vocab, cutoffs=cutoffs, chunk_size=chunk_size)
    head.build((None, dim))
    variables = head.trainable_weights

    def loss(values, h, targets):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            return -ops.mean(head.log_likelihood(h, targets))

    values = [v.value for v in variables]
    # Shapes only: the targets are an argument (as in a training step), so
    # nothing about them is folded into the plan.
    h = jax.ShapeDtypeStruct((tokens, dim), "float32")
    targets = jax.ShapeDtypeStruct((tokens,), "int32")
    start = time.perf_counter()
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    compiled = step.lower(values, h, targets).compile()
    analysis = compiled.memory_analysis()
    return {
        "temp_mib": analysis.temp_size_in_bytes / 2**20,
        "argument_mib": analysis.argument_size_in_bytes / 2**20,
        "capacities": head.tail_capacities(tokens),
        "tail_sizes": [int(s) for s in head.tail_sizes],
        "dense_tail_mib": tokens * max(head.tail_sizes) * 4 / 2**20,
        "compile_s": time.perf_counter() - start,
    }


def main(argv=None):
    args = parse_args(argv)
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import jax
    import keras

    rows = []
    for spec in args.rows.split(","):
        vocab, tokens, cutoffs = spec.split(":")
        row = {"vocab_size": int(vocab), "tokens": int(tokens), "dim": args.dim,
               "cutoffs": [int(c) for c in cutoffs.split("/")], "chunk_size": args.chunk_size}
        row.update(planned_memory(row["vocab_size"], row["tokens"], row["cutoffs"], args.dim,
                                  args.chunk_size))
        rows.append(row)
        print(f"V={row['vocab_size']} N={row['tokens']} cutoffs={row['cutoffs']}: "
              f"temporaries {row['temp_mib']:.0f} MiB (one dense tail's scores "
              f"{row['dense_tail_mib']:.0f} MiB; capacities {row['capacities']})", flush=True)
    result = {"command": measure.command_line(__file__),
              "machine": f"{platform.processor() or platform.machine()}; {platform.platform()}",
              "versions": {"jax": jax.__version__, "keras": keras.__version__},
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
