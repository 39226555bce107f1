r"""`AdaptiveSoftmax` on JAX: whole clusters against `chunk_size` tiles.

For each `V` (cutoffs `reference_inputs.adaptive_benchmark_cutoffs`, as
`bench_adaptive.py`'s), two heads with the same weights,
`AdaptiveSoftmax(V, cutoffs, factor=4)` (static shapes) and the same
with `chunk_size=--chunk_size`, each compiled with `jax.jit` as the summed
training loss `-sum(log_likelihood(h, t))` and its gradients with respect
to `h` and every weight (what a JAX or TPU training step runs). Recorded per
head: XLA's compiled memory (`measure.compiled_memory`: temporaries,
arguments, outputs), the first call (compilation) and the wall time of
`--rounds` rounds in which the two steps take turns (`measure.interleaved`),
their medians and the ratio of the medians, chunked over whole. The loss of
both is recorded: they are the same to float32 rounding.

Inputs: `reference_inputs.numpy_inputs` (`h ~ N(0, 0.25)`, Zipfian
targets), as `bench_adaptive.py`. Threads: whatever JAX's CPU client uses
(set `taskset` to pin the process); on a GPU / TPU the same script measures
that device.

    taskset -c 0,1 python benchmarks/bench_adaptive_jax.py \
        --out=docs/results/adaptive_memory/jax_chunked.json
    # smoke (seconds):
    python benchmarks/bench_adaptive_jax.py --vocab_sizes=2000 --tokens=64 --dim=16 \
        --rounds=1 --chunk_size=256 --out=/tmp/adaptive_jax.json
"""

import argparse
import os
import statistics

import measure  # benchmarks/measure.py
from reference_inputs import INPUTS, adaptive_benchmark_cutoffs, numpy_inputs

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab_sizes", default="33278,100000,793471")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--chunk_size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def compare(vocab, tokens, dim, chunk_size, rounds):
    """One `V`'s row: `{"whole": {...}, "chunked": {...}, "ratio"}`."""
    import jax
    import keras
    from keras import ops

    from keras_softmax_heads import AdaptiveSoftmax

    cutoffs = adaptive_benchmark_cutoffs(vocab)
    h, t = numpy_inputs(tokens, vocab, dim)
    steps, row = {}, {"v": vocab, "n": tokens, "d": dim, "cutoffs": cutoffs,
                      "chunk_size": chunk_size}
    keras.utils.set_random_seed(0)
    weights = None
    for name, chunk in (("whole", None), ("chunked", chunk_size)):
        head = AdaptiveSoftmax(vocab, cutoffs=cutoffs, factor=4, chunk_size=chunk)
        head.build((None, dim))
        if weights is None:  # the first head's draw, for both
            weights = [keras.ops.convert_to_numpy(w) for w in head.get_weights()]
        head.set_weights(weights)
        variables = head.trainable_weights

        def loss(values, h, t, head=head, variables=variables):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return -ops.sum(head.log_likelihood(h, t))

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        values = [v.value for v in variables]
        memory = measure.compiled_memory(step, values, h, t)
        value, first_s, _ = measure.clock(
            lambda step=step, values=values: jax.block_until_ready(step(values, h, t)))
        steps[name] = lambda step=step, values=values: jax.block_until_ready(
            step(values, h, t))
        row[name] = {"loss": float(value[0]), "first_call_s": first_s,
                     "temp_mib": memory["temp"] / measure.MIB,
                     "argument_mib": memory["argument"] / measure.MIB,
                     "output_mib": memory["output"] / measure.MIB,
                     "capacities": head.tail_capacities(tokens)}
    wall, _ = measure.interleaved(steps, rounds)
    for name, times in wall.items():
        row[name].update(wall_s=times, step_s=statistics.median(times))
    row["ratio"] = row["chunked"]["step_s"] / row["whole"]["step_s"]
    row["temp_ratio"] = row["chunked"]["temp_mib"] / max(row["whole"]["temp_mib"], 1e-9)
    return row


def main(argv=None):
    args = parse_args(argv)
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import jax
    import keras

    rows = []
    for vocab in (int(v) for v in args.vocab_sizes.split(",")):
        row = compare(vocab, args.tokens, args.dim, args.chunk_size, args.rounds)
        rows.append(row)
        print(f"V={vocab}: whole {1e3 * row['whole']['step_s']:.1f} ms, "
              f"{row['whole']['temp_mib']:.0f} MiB; chunked {1e3 * row['chunked']['step_s']:.1f}"
              f" ms, {row['chunked']['temp_mib']:.0f} MiB; ratio {row['ratio']:.2f}", flush=True)
    result = {"command": measure.command_line(__file__),
              "machine": measure.machine(keys=("cpu", "cores", "os", "python", "date")),
              "device": str(jax.devices()[0]),
              "versions": {"jax": jax.__version__, "keras": keras.__version__},
              "inputs": INPUTS, "rounds": args.rounds, "rows": rows}
    measure.save(result, args.out)
    return result


if __name__ == "__main__":
    main()
