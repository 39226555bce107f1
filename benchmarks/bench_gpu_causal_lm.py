r"""A keras-hub Gemma training step on one device, stock against fused (issue 29).

Issue 29's keras-hub target, on JAX (the GPU machines have no TensorFlow):
a `keras_hub.models.GemmaCausalLM` training step with the fused loss
(`keras_softmax_heads.fused.fused_causal_lm`, no `[batch, seq, V]` logits)
no slower than the stock step with logits, at a sequence length where both
fit, and fitting a 4x longer sequence than the stock step.

The model: a `GemmaBackbone` built from the flags (default: Gemma 2 2B's
vocabulary and widths, V = 256,000, d = 2,304, 8 query / 4 key-value heads
of 256, feed-forward 18,432, with `--num_layers` = 2 blocks so that it
compiles in seconds: the loss's share of the step is then larger than in
the 26-block model), weights in `--dtype` (default bfloat16), tied
embeddings, `compile()` with keras-hub's defaults for both rows (Adam,
`SparseCategoricalCrossentropy(from_logits=True)`, the weighted accuracy).

The step is Keras' own: `model.train_step(state, data)` (the JAX trainer's
public stateless step: loss, gradients, the optimizer's update, the
metrics) under `jax.jit` with the state donated, as `fit` runs it. Per row
(`stock`, `fused`):

* at `--seq_len` (batch `--batch_size`): XLA's compiled memory analysis of
  the step (`argument`, `output`, `alias`, `temp` bytes; `peak_bytes` =
  argument + output - alias + temp), the first call (compilation
  included), then `--steps` interleaved rounds of both rows' steps
  (`measure.interleaved`): `step_s` is the median, `ratio_to_stock` the
  median per-round ratio;
* the longest sequence that fits: for each of `--probe_seq_lens` in
  increasing order, each row that still fits (the fused row first) has
  its step compiled (not run) for that length and its `peak_bytes`
  compared with the device's memory (`memory_stats()["bytes_limit"]`, or
  `--memory_limit_gb`); a row's probes stop at the first length that does
  not fit (or fails to compile), every row's once `--max_seconds` have
  passed. `max_seq_len` is the last length that fit; the default lengths
  go up in steps of 4x (the target's factor), so that a fused row that
  fits one more step than the stock row fits at least 4x longer
  sequences.

Raw JSON to `--out`, rewritten after each part.

Usage:
    python benchmarks/bench_gpu_causal_lm.py --out=$OUT/bench_gpu_causal_lm.json  # the GPU
    python benchmarks/bench_gpu_causal_lm.py --vocabulary_size=512 --hidden_dim=16 \
        --num_query_heads=2 --num_key_value_heads=1 --head_dim=8 --intermediate_dim=32 \
        --seq_len=16 --probe_seq_lens=16,32 --memory_limit_gb=1 --steps=1   # CPU smoke
"""

import argparse
import json
import os
import statistics
import time

import measure  # benchmarks/measure.py (the script's own folder)

os.environ.setdefault("KERAS_BACKEND", "jax")

ROWS = ("stock", "fused")
GIB = 2.0**30


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabulary_size", type=int, default=256_000)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--hidden_dim", type=int, default=2304)
    parser.add_argument("--num_query_heads", type=int, default=8)
    parser.add_argument("--num_key_value_heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=256)
    parser.add_argument("--intermediate_dim", type=int, default=18_432)
    parser.add_argument("--dtype", default="bfloat16", help="The backbone's dtype policy.")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--seq_len", type=int, default=2048, help="Tokens per sequence, timed.")
    parser.add_argument("--steps", type=int, default=5, help="Timed interleaved rounds.")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--probe_seq_lens", default="4096,16384,65536,262144",
                        help="Sequence lengths compiled (not run) for the longest that fits "
                        "(default: steps of 4x, the target's factor).")
    parser.add_argument("--fused_loss", default="{}",
                        help="The fused row's `fused_loss` options, JSON (e.g. "
                        "'{\"token_chunk_size\": 4096}': token blocks, the loss's memory "
                        "independent of the sequence length).")
    parser.add_argument("--memory_limit_gb", type=float, default=None,
                        help="The memory a step may use (GiB; default: the device's "
                        "bytes_limit).")
    parser.add_argument("--max_seconds", type=float, default=240.0,
                        help="Begin no probe after this many seconds.")
    parser.add_argument("--out", default=None, help="Raw JSON here (rewritten as it goes).")
    args = parser.parse_args(argv)
    args.rows = args.rows.split(",")
    bad = [r for r in args.rows if r not in ROWS]
    if bad:
        parser.error(f"unknown rows {bad}; rows: {ROWS}")
    args.fused_loss = json.loads(args.fused_loss)
    args.probe_seq_lens = sorted(int(x) for x in filter(None, args.probe_seq_lens.split(",")))
    return args


def build(row, args):
    """The compiled `stock` or `fused` GemmaCausalLM of the flags, its
    optimizer and metrics built."""
    import keras
    import keras_hub

    import keras_softmax_heads as ksh

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=args.vocabulary_size, num_layers=args.num_layers,
        num_query_heads=args.num_query_heads, num_key_value_heads=args.num_key_value_heads,
        hidden_dim=args.hidden_dim, intermediate_dim=args.intermediate_dim,
        head_dim=args.head_dim, dtype=args.dtype)
    cls = keras_hub.models.GemmaCausalLM
    if row == "fused":
        lm = ksh.fused.fused_causal_lm(cls)(backbone=backbone, preprocessor=None,
                                            fused_loss=args.fused_loss)
    else:
        lm = cls(backbone=backbone, preprocessor=None)
    lm.compile()  # keras-hub's defaults, for both rows
    # One step on 8 tokens through Keras builds the optimizer's and the
    # compiled metrics' variables: the state `train_step` returns then has
    # the structure it is given.
    x, y, weights = batch(args, 8, seed=1)
    lm.train_on_batch(x, y, weights)
    return lm


def state_of(lm):
    """The JAX trainer's state tuple of `lm`'s variables' values."""
    return (
        [v.value for v in lm.trainable_variables],
        [v.value for v in lm.non_trainable_variables],
        [v.value for v in lm.optimizer.variables],
        [v.value for v in lm.metrics_variables],
    )


def batch(args, seq_len, abstract=False, seed=0):
    """`(x, y, sample_weight)` of `batch_size` sequences of `seq_len` tokens:
    arrays (seeded), or their `jax.ShapeDtypeStruct`s with `abstract`."""
    import jax
    import numpy as np

    shape = (args.batch_size, seq_len)
    if abstract:
        ids = jax.ShapeDtypeStruct(shape, "int32")
        return {"token_ids": ids, "padding_mask": jax.ShapeDtypeStruct(shape, "bool")}, ids, \
            jax.ShapeDtypeStruct(shape, "bool")
    rng = np.random.default_rng([seed, seq_len])
    ids = rng.integers(0, args.vocabulary_size, shape).astype("int32")
    mask = np.ones(shape, bool)
    labels = rng.integers(0, args.vocabulary_size, shape).astype("int32")
    return {"token_ids": ids, "padding_mask": mask}, labels, mask


def memory_of(compiled):
    """`measure.memory_of_compiled` and `peak_bytes`: arguments + outputs -
    aliased (the donated state) + temporaries."""
    out = measure.memory_of_compiled(compiled)
    out["peak_bytes"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def memory_limit(args):
    """The bytes a step may use: `--memory_limit_gb`, else the device's."""
    import jax

    if args.memory_limit_gb:
        return int(args.memory_limit_gb * GIB), "--memory_limit_gb"
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), "memory_stats()['bytes_limit']"
    return None, "unknown (no --memory_limit_gb, no device statistics)"


def run(args, save=None):
    """Both rows' timed steps and probes, as a JSON-ready dict."""
    import jax
    import keras

    start = time.perf_counter()
    limit, limit_source = memory_limit(args)
    result = {"script": "benchmarks/bench_gpu_causal_lm.py", "args": vars(args),
              "command": measure.command_line(__file__),
              "machine": measure.machine(), "devices": [str(d) for d in jax.devices()],
              "jax": jax.__version__, "keras": keras.__version__,
              "memory_limit_bytes": limit, "memory_limit_source": limit_source,
              "rows": {}, "complete": False}

    def saved():
        if save:
            save(result)

    models, calls = {}, {}
    data = batch(args, args.seq_len)
    for row in args.rows:
        entry = result["rows"][row] = {"row": row, "seq_len": args.seq_len}
        try:
            lm = models[row] = build(row, args)
            step = jax.jit(lm.train_step, donate_argnums=0)
            t0 = time.perf_counter()
            compiled = step.lower(state_of(lm), data).compile()
            entry["memory"] = memory_of(compiled)
            holder = {"state": state_of(lm)}

            def call(compiled=compiled, holder=holder):
                logs, holder["state"] = compiled(holder["state"], data)
                jax.block_until_ready(holder["state"])
                return logs

            logs = call()
            entry["first_call_s"] = time.perf_counter() - t0
            entry["loss"] = float(logs["loss"])
            entry["parameters"] = int(lm.count_params())
            calls[row] = call
        except Exception as err:  # out of memory, a failed compile: a row with its error
            entry["error"] = measure.error_text(err)
        print(row, {k: entry.get(k) for k in ("first_call_s", "loss", "error")}, flush=True)
        saved()
    if calls:
        wall, _ = measure.interleaved(calls, args.steps)
        for row, times in wall.items():
            entry = result["rows"][row]
            entry.update(step_s=statistics.median(times), wall_s=times)
            if "stock" in wall:
                entry["ratio_to_stock"] = statistics.median(
                    t / s for t, s in zip(times, wall["stock"]))
            print(row, f"{1e3 * entry['step_s']:.1f} ms", flush=True)
    calls.clear()
    saved()

    # The probes go up in length, every row still fitting at each length,
    # the fused row first: an earlier version probed the stock row to its
    # limit first, and the fused row's probes found --max_seconds spent.
    steps, probing = {}, []
    for row in sorted(models, key=lambda r: r != "fused"):
        lm = models[row]
        result["rows"][row]["probes"] = []
        steps[row] = (jax.jit(lm.train_step, donate_argnums=0),
                      jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                   state_of(lm)))
        probing.append(row)
    for seq_len in args.probe_seq_lens:
        for row in list(probing):
            probes = result["rows"][row]["probes"]
            if time.perf_counter() - start > args.max_seconds:
                probes.append({"seq_len": seq_len, "skipped": "--max_seconds spent"})
                probing.remove(row)
                continue
            step, state = steps[row]
            probe = {"seq_len": seq_len}
            try:
                compiled = step.lower(state, batch(args, seq_len, abstract=True)).compile()
                probe.update(memory_of(compiled))
                probe["fits"] = limit is None or probe["peak_bytes"] <= limit
            except Exception as err:  # noqa: BLE001 (a compile failure ends the probes)
                probe.update(error=measure.error_text(err), fits=False)
            probes.append(probe)
            print(row, seq_len, probe.get("peak_bytes"), probe["fits"], flush=True)
            saved()
            if not probe["fits"]:
                probing.remove(row)
    for row in steps:
        fitting = [p["seq_len"] for p in result["rows"][row]["probes"] if p.get("fits")]
        result["rows"][row]["max_seq_len"] = max(fitting) if fitting else None
    rows = result["rows"]
    if rows.get("stock", {}).get("max_seq_len") and rows.get("fused", {}).get("max_seq_len"):
        result["max_seq_len_fused_over_stock"] = (
            rows["fused"]["max_seq_len"] / rows["stock"]["max_seq_len"])
    result["wall_s"] = time.perf_counter() - start
    result["complete"] = True
    saved()
    return result


def main(argv=None):
    args = parse_args(argv)
    return run(args, save=lambda result: measure.save(result, args.out))


if __name__ == "__main__":
    main()
