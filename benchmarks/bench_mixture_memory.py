"""XLA's compiled memory of the mixture heads' training step vs FullSoftmax's.

Issue 28's CPU-checkable target: the temporary memory XLA allocates for one
training step (loss `mean(head.training_loss(h, y))` and its gradients with
respect to `h` and every trainable weight, `jax.jit`, float32) of
`MixtureOfSoftmaxes(15)` at N = 8,192 tokens, d = 512, V = 33,278 is at most
2x FullSoftmax's. Nothing runs: each step is lowered and compiled on
abstract inputs and `compiled.memory_analysis()` read
(`measure.compiled_memory`). The rows: FullSoftmax, MoS(15), MoS(4), MoSS(15),
MoS(4)+PLIF, MoC(15) (their default, tiled loss) and MoS(15) / MoS(4) with
the `[N, K, V]` reference loss (`dense_log_likelihood`, the default before
issue 28), MoS(15) / MoS(4) with `gradient_in_forward=True` (their summed
objective, `summed_training_loss`), each with the platform's tile width (`chunked.platform`;
`--platform=gpu` forces a GPU's wider tiles, still compiled for the CPU).

Usage:
    python benchmarks/bench_mixture_memory.py \
        --out=docs/results/mixture_memory/mixture_memory_cpu.json
    python benchmarks/bench_mixture_memory.py --platform=gpu  # the GPU's widths
    python benchmarks/bench_mixture_memory.py --tokens=64 --dim=16 --vocab=300
"""

import argparse
import os

import measure  # benchmarks/measure.py (the script's own folder)

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROWS = ("full", "mos15", "mos4", "moss15", "mos4_plif", "moc15", "mos15_dense",
        "mos15_summed", "mos4_summed")


def tile_chunk_size(name, head, n, vocab):
    """The `chunk_size` a head's default training loss tiles with (None:
    not tiled: FullSoftmax's dense default, the `[N, K, V]` reference, the
    summed loss's token chunks over the whole vocabulary)."""
    from keras_softmax_heads.chunked.platform import chunk_size_for

    if name.endswith(("_dense", "_summed")) or not name.startswith(("mos", "moc")):
        return head.chunk_size
    k = head.num_components if name.startswith("mos") else 1
    return head.chunk_size or chunk_size_for(vocab, rows=n * k, components=k)


def memory_rows(names, n, d, vocab):
    """`compiled_memory` of each head's training step, and its temporary
    memory's ratio to FullSoftmax's (the first row must be `"full"`)."""
    import jax
    import jax.numpy as jnp
    from bench_device_heads import build  # benchmarks/bench_device_heads.py

    from keras_softmax_heads.platforms import current_platform

    h = jax.ShapeDtypeStruct((n, d), jnp.float32)
    y = jax.ShapeDtypeStruct((n,), jnp.int32)
    rows = []
    for name in names:
        row = {"head": name, "tokens": n, "dim": d, "vocab": vocab}
        try:
            head, step, weights = build(name, vocab, d)
            weights = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights]
            row["memory"] = measure.compiled_memory(step, weights, h, y)
            row["chunk_size"] = tile_chunk_size(name, head, n, vocab)
        except Exception as err:  # noqa: BLE001 (a failed head is a row)
            row["error"] = measure.error_text(err)
        rows.append(row)
    full = rows[0].get("memory", {}).get("temp")
    for row in rows:
        if full and "memory" in row:
            row["temp_ratio_to_full"] = row["memory"]["temp"] / full
    return {"platform": current_platform(), "rows": rows}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=33278)
    parser.add_argument("--heads", type=str, default=",".join(ROWS))
    parser.add_argument("--platform", type=str, default=None,
                        help="force the tile width of this platform (cpu, gpu, tpu)")
    parser.add_argument("--out", type=str, default=None, help="raw JSON here")
    args = parser.parse_args(argv)
    args.heads = ["full"] + [x for x in args.heads.split(",") if x != "full"]
    return args


def main(argv=None):
    args = parse_args(argv)
    import jax
    import keras

    import contextlib

    from keras_softmax_heads.platforms import forced_platform

    scope = forced_platform(args.platform) if args.platform else contextlib.nullcontext()
    with scope:
        result = memory_rows(args.heads, args.tokens, args.dim, args.vocab)
    result.update(script="benchmarks/bench_mixture_memory.py", args=vars(args),
                  machine=measure.machine(), loadavg=os.getloadavg(),
                  jax=jax.__version__, keras=keras.__version__)
    for row in result["rows"]:
        temp = row.get("memory", {}).get("temp")
        print(f"{row['head']:12s} temp {temp and temp / 2**20:10.1f} MiB  "
              f"x full {row.get('temp_ratio_to_full')}  {row.get('error', '')}")
    measure.save(result, args.out)


if __name__ == "__main__":
    main()
