"""Every exact head's training step against FullSoftmax's, on one device (JAX).

Issue 28's one-call GPU table. For each vocabulary size `V` (`--vocab_sizes`)
one process builds the heads (`--heads`, FullSoftmax first), on the same
`h` `[N, d]` ~ N(0, 1) and uniform targets, and for each head:

* compiles its training step, `jax.jit(jax.value_and_grad(mean(
  head.training_loss(h, y))))` with respect to `h` and every trainable
  weight (`train_step`), and records XLA's memory analysis of it
  (`measure.compiled_memory`: argument, output, temporary bytes) and the
  first call's time (compilation included);
* times it: `--warmup` untimed calls, then `--rounds` interleaved rounds of
  one call of every head (`measure.interleaved`, the order rotated from
  round to round), each call waiting for the loss and all gradients. A
  head's ratio is the median over the rounds of its time divided by
  FullSoftmax's of the same round.

With `--torch`, PyTorch's FullSoftmax and the PLIF formula of
`torch_heads.PLIFGatherOnCumsum` under `torch.compile` (Inductor), loss and
`torch.autograd.grad`, on the same device kind, timed the same way in their
own interleaved rounds (their ratio: to PyTorch's FullSoftmax).

A head whose step fails (e.g. out of memory) is a row with its error; the
others still run. `--max_seconds` bounds the JAX heads: once it has passed,
the remaining heads are rows with `"skipped"` (the PyTorch rows, the PLIF
target's peer, still run). Raw JSON to `--out`, rewritten after each
vocabulary size's rows and after PyTorch's (`"complete"` once all ran).

Heads (`HEADS`): `full`, `plif` (K = 100,000 knots), `plif_k1000`,
`sigsoftmax`, `monotonic` (16 units), `mos15`, `mos4` (MixtureOfSoftmaxes,
the tiled default loss), `mos15_dense` (the `[N, K, V]` reference loss),
`moss15` (mixture of sigsoftmax), `mos4_plif` (MoS + PLIF, 1,000 knots),
`moc15` (MixtureOfContexts); `mos15_summed`, `mos4_summed`, `moss15_summed`,
`full_summed`, `sigsoftmax_summed`, `plif_summed`, `plif_k1000_summed`,
`mos4_plif_summed`: the head's summed objective (`summed_training_loss`, the gradient in the
forward pass: what `HeadModel` and `HeadLoss` train by default, where the
rows without the suffix time the per-token tiled `training_loss`); `plif_fused`, `plif_k1000_fused`: PLIF with
the backward tile as one Pallas kernel (`HISTOGRAM_METHOD="pallas_fused"`,
an option: the first GPU run found it slower than `"pallas"`);
`plif_scatter`, `plif_k1000_scatter`: PLIF with the scatter-add histogram
(`HISTOGRAM_METHOD="scatter"`), the head-level check of the GPU default;
`_spread` (`plif_spread`, `plif_k1000_spread`, `plif_summed_spread`,
`plif_k1000_summed_spread`, `monotonic_spread`, `mos4_plif_summed_spread`):
the histogram as a scatter into interleaved copies
(`HISTOGRAM_METHOD="spread"`, `functional.dispatch.spread_knot_histogram`);
`adaptive` (`AdaptiveSoftmax`, cutoffs `reference_inputs.adaptive_benchmark_cutoffs`:
2k/10k at V = 33,278, 2k/10k/50k at 100,000; factor 4; the platform's
default path) and `adaptive_summed` (its summed objective with
`gradient_in_forward=True`, the tails' gradients in the forward pass under
an `ops.switch`: on by default on a CPU, off on a GPU, where it has not been
measured). The adaptive rows' targets are Zipfian
(`reference_inputs.numpy_inputs`' draw, the adaptive benchmarks' and the
distribution the layer's capacities expect without counts); the other
rows' are uniform. FullSoftmax's step does not depend on the targets, so
the ratio stays to the same baseline.

Usage:
    python benchmarks/bench_device_heads.py --tokens=64 --dim=16 \
        --vocab_sizes=300 --rounds=2                     # CPU smoke test
    benchmarks/device_heads.sh OUT_DIR                   # the GPU table
"""

import argparse
import os
import statistics
import time

import measure  # benchmarks/measure.py (the script's own folder)

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HEADS = ("full", "plif", "plif_k1000", "sigsoftmax", "monotonic", "mos15", "mos4",
         "mos15_dense", "moss15", "mos4_plif", "moc15", "plif_fused", "plif_k1000_fused",
         "plif_scatter", "plif_k1000_scatter", "mos15_summed", "mos4_summed",
         "moss15_summed", "full_summed", "sigsoftmax_summed", "plif_summed",
         "plif_k1000_summed", "mos4_plif_summed", "plif_spread", "plif_k1000_spread",
         "plif_summed_spread", "plif_k1000_summed_spread", "monotonic_spread",
         "mos4_plif_summed_spread", "adaptive", "adaptive_summed")
PLIF_BOUND = 20.0


#: The suffixes of a head's variants: the same head, another loss or
#: histogram path (`step_of`).
VARIANTS = {"dense": None, "fused": "pallas_fused", "scatter": "scatter", "summed": None,
            "spread": "spread"}


def split_name(name):
    """`(head, variants)`: `"plif_k1000_scatter"` -> `("plif_k1000",
    ("scatter",))`, `"plif_summed_spread"` -> `("plif", ("summed",
    "spread"))`, `"mos15"` -> `("mos15", ())`."""
    variants = ()
    while True:
        base, _, suffix = name.rpartition("_")
        if not (base and suffix in VARIANTS):
            return name, variants
        name, variants = base, (suffix,) + variants


def make_head(name, vocab):
    """A fresh head `name` (one of `HEADS`) for `vocab` words; a variant
    (`VARIANTS`) builds its head's."""
    import keras_softmax_heads as ksh
    from keras_softmax_heads.heads.mixture_of_contexts import MixtureOfContexts
    from keras_softmax_heads.heads.mixture_of_softmaxes import MixtureOfSoftmaxes
    from reference_inputs import adaptive_benchmark_cutoffs

    heads = {
        "full": lambda: ksh.FullSoftmax(vocab),
        "plif": lambda: ksh.PLIFSoftmax(vocab, num_knots=100_000, knot_bound=PLIF_BOUND),
        "plif_k1000": lambda: ksh.PLIFSoftmax(vocab, num_knots=1000, knot_bound=PLIF_BOUND),
        "sigsoftmax": lambda: ksh.SigSoftmax(vocab),
        "monotonic": lambda: ksh.MonotonicSoftmax(vocab, num_units=16),
        "mos15": lambda: MixtureOfSoftmaxes(vocab, num_components=15),
        "mos4": lambda: MixtureOfSoftmaxes(vocab, num_components=4),
        "moss15": lambda: MixtureOfSoftmaxes(vocab, num_components=15, component="sigsoftmax"),
        "mos4_plif": lambda: MixtureOfSoftmaxes(vocab, num_components=4, num_knots=1000),
        "moc15": lambda: MixtureOfContexts(vocab, num_components=15),
        "adaptive": lambda: ksh.AdaptiveSoftmax(
            vocab, cutoffs=adaptive_benchmark_cutoffs(vocab), factor=4),
    }
    if name not in HEADS:
        raise ValueError(f"Unknown head {name!r}. Known: {HEADS}")
    head = heads[split_name(name)[0]]()
    if "summed" in split_name(name)[1]:  # the gradient in the forward pass
        head = type(head).from_config(dict(head.get_config(), gradient_in_forward=True))
    return head


def train_step(head, dense=False, histogram_method=None, summed=False):
    """`jax.jit` of `(weights, h, y) -> (loss, (d weights, d h))`, the loss
    `mean(head.training_loss(h, y))` (with `dense`, the head's
    `dense_log_likelihood`; with `summed`, the head's
    `summed_training_loss(h, y, 1 / N)`, the objective `HeadModel` and
    `HeadLoss` train); `weights` are the values of
    `head.trainable_variables`. `histogram_method`: PLIF's
    `functional.dispatch.HISTOGRAM_METHOD` while the step is traced (None:
    the platform's)."""
    import jax
    import keras

    from keras_softmax_heads.functional import dispatch

    variables = head.trainable_variables
    fixed = [(v, v.value) for v in head.non_trainable_variables]

    def loss(values, h, y):
        with dispatch.forced_histogram_method(histogram_method), keras.StatelessScope(
                state_mapping=list(zip(variables, values)) + fixed):
            if summed:
                weights = keras.ops.full(keras.ops.shape(y), 1.0 / y.shape[0])
                return head.summed_training_loss(h, y, weights, training=True)
            if dense:
                per_token = -head.dense_log_likelihood(h, y, training=True)
            else:
                per_token = head.training_loss(h, y, training=True)
            return keras.ops.mean(per_token)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def step_inputs(n, d, vocab, seed=0, zipf=False):
    """`h` `[n, d]` ~ N(0, 1) float32 and uniform int32 targets `[n]` (JAX);
    with `zipf`, the targets of `reference_inputs.numpy_inputs` (Zipfian,
    `p(r) ~ 1 / (r + 1)`)."""
    import jax.numpy as jnp
    import numpy as np

    from reference_inputs import numpy_inputs

    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n, d), dtype=np.float32)
    if zipf:
        y = numpy_inputs(n, vocab, 1)[1]
    else:
        y = rng.integers(0, vocab, size=n).astype(np.int32)
    return jnp.asarray(h), jnp.asarray(y)


def step_of(name, head):
    """The training step of head `name` (`train_step` with the `_dense`
    loss, the `_summed` objective or the `_fused` / `_scatter` / `_spread`
    histogram method its name asks for)."""
    variants = split_name(name)[1]
    methods = [VARIANTS[v] for v in variants if VARIANTS[v]]
    return train_step(head, dense="dense" in variants,
                      histogram_method=methods[0] if methods else None,
                      summed="summed" in variants)


def build(name, vocab, d):
    """`(head, step, weights)`: the built head, its jitted step, its weights."""
    head = make_head(name, vocab)
    head.build((None, d))
    return head, step_of(name, head), [
        v.value for v in head.trainable_variables]


def time_rounds(rows, calls, rounds, baseline):
    """Times `calls` in interleaved rounds into their `rows`: the median
    `step_s`, every round's time, and the median per-round ratio to
    `baseline`'s step."""
    if not calls:
        return
    wall, _ = measure.interleaved(calls, rounds)
    for name, times in wall.items():
        rows[name]["step_s"] = statistics.median(times)
        rows[name]["step_s_all"] = times
        if baseline in wall:
            rows[name]["ratio_to_full"] = statistics.median(
                t / f for t, f in zip(times, wall[baseline]))


def head_rows(names, n, d, vocab, warmup, rounds, deadline, built=None):
    """The rows of one vocabulary size: memory, first call, interleaved times
    (`built(rows)`, when given, is called with the rows so far after each
    head is compiled, before any is timed)."""
    import jax

    zipf = {name: split_name(name)[0] == "adaptive" for name in names}
    inputs = {z: step_inputs(n, d, vocab, zipf=z) for z in set(zipf.values())}
    rows, calls = {}, {}
    for name in names:
        h, y = inputs[zipf[name]]
        if time.perf_counter() > deadline:
            rows[name] = {"head": name, "skipped": "time budget (--max_seconds) spent"}
            continue
        row = {"head": name}
        try:
            _, step, weights = build(name, vocab, d)
            row["compiled_memory"] = measure.compiled_memory(step, weights, h, y)
            start = time.perf_counter()
            jax.block_until_ready(step(weights, h, y))
            row["first_call_s"] = time.perf_counter() - start
            for _ in range(warmup):
                jax.block_until_ready(step(weights, h, y))

            def call(step=step, weights=weights, h=h, y=y):
                return jax.block_until_ready(step(weights, h, y))

            calls[name] = call
        except Exception as err:  # noqa: BLE001 (a failed head is a row)
            row["error"] = measure.error_text(err)
        rows[name] = row
        if built:
            built(list(rows.values()))
    time_rounds(rows, calls, rounds, "full")
    for row in rows.values():
        memory = row.get("compiled_memory")
        full = rows.get("full", {}).get("compiled_memory")
        if memory and full and full["temp"]:
            row["temp_ratio_to_full"] = memory["temp"] / full["temp"]
    return list(rows.values())


def torch_rows(n, d, vocab, rounds, knots=100_000):
    """PyTorch's FullSoftmax and PLIF (`torch.compile`) steps, interleaved."""
    import numpy as np
    import torch
    import torch_heads  # benchmarks/torch_heads.py

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = np.random.default_rng(0)
    kernel = (rng.standard_normal((vocab, d)) / np.sqrt(d)).astype(np.float32)
    h = torch.from_numpy(rng.standard_normal((n, d), dtype=np.float32)).to(device)
    y = torch.from_numpy(rng.integers(0, vocab, size=n)).to(device)
    heads = {
        "torch_full_compile": torch_heads.FullSoftmax(kernel, device),
        "torch_plif_compile": torch_heads.PLIFGatherOnCumsum(kernel, knots, PLIF_BOUND, device),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, calls = {}, {}
    for name, head in heads.items():
        row = {"head": name, "device": device.type, "tf32": torch.backends.cuda.matmul.allow_tf32}
        try:
            head.loss = torch.compile(head.loss)
            call = torch_heads.train_call(head, h, y)

            def synced(call=call):
                value = call()
                sync()
                return value

            start = time.perf_counter()
            synced()
            row["first_call_s"] = time.perf_counter() - start
            synced()
            calls[name] = synced
        except Exception as err:  # noqa: BLE001 (a failed head is a row)
            row["error"] = measure.error_text(err)
        rows[name] = row
    time_rounds(rows, calls, rounds, "torch_full_compile")
    calls.clear()
    heads.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # JAX's rows of the next vocabulary size allocate after
    return list(rows.values())


def run(args, save=None):
    """The whole table as a JSON-ready dict; `save(result)`, when given, is
    called after each head is compiled, after each vocabulary size's rows
    are timed and after PyTorch's, so a run stopped from outside (a device
    call's time limit) keeps what it had."""
    import jax
    import keras

    deadline = time.perf_counter() + args.max_seconds
    result = {
        "script": "benchmarks/bench_device_heads.py", "args": vars(args),
        "machine": measure.machine(), "loadavg": os.getloadavg(),
        "devices": [str(x) for x in jax.devices()], "jax": jax.__version__,
        "keras": keras.__version__, "rows": [],
        "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision),
    }
    names = ["full"] + [x for x in args.heads if x != "full"]
    for vocab in args.vocab_sizes:
        def tagged(rows, vocab=vocab):
            return [dict(row, vocab=vocab, tokens=args.tokens, dim=args.dim) for row in rows]

        def built(rows, tagged=tagged):  # compiled, not yet timed
            save(dict(result, rows=result["rows"] + tagged(rows), complete=False))

        result["rows"] += tagged(head_rows(names, args.tokens, args.dim, vocab, args.warmup,
                                           args.rounds, deadline, built if save else None))
        if save:
            save(dict(result, complete=False))
        if args.torch:  # the peers of the PLIF target: run even past the deadline
            try:
                peers = torch_rows(args.tokens, args.dim, vocab, args.rounds)
            except Exception as err:  # noqa: BLE001 (no PyTorch: a row, not a crash)
                peers = [{"head": "torch", "error": measure.error_text(err)}]
            for row in peers:
                result["rows"].append(dict(row, vocab=vocab, tokens=args.tokens, dim=args.dim))
            if save:
                save(dict(result, complete=False))
    result["wall_s"] = args.max_seconds - (deadline - time.perf_counter())
    result["complete"] = True
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab_sizes", type=str, default="33278,100000")
    parser.add_argument("--heads", type=str, default=",".join(HEADS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--torch", action="store_true",
                        help="also time torch.compile of FullSoftmax and PLIF")
    parser.add_argument("--max_seconds", type=float, default=270.0,
                        help="skip the remaining heads after this many seconds")
    parser.add_argument("--out", type=str, default=None, help="raw JSON here")
    args = parser.parse_args(argv)
    args.vocab_sizes = [int(x) for x in args.vocab_sizes.split(",")]
    args.heads = args.heads.split(",")
    for name in args.heads:
        if name not in HEADS:
            parser.error(f"unknown head {name!r}; known: {', '.join(HEADS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    result = run(args, save=lambda partial: measure.save(partial, args.out))
    for row in result["rows"]:
        print(row["vocab"], row["head"], {k: row.get(k) for k in (
            "step_s", "ratio_to_full", "temp_ratio_to_full", "error", "skipped")})
    measure.save(result, result["args"]["out"])


if __name__ == "__main__":
    main()
