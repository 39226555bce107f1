"""The mixtures' Keras training step with and without `gradient_in_forward`.

`MixtureOfSoftmaxes(K)` as the last layer of a `Sequential` (`Embedding`
then the head) compiled with `HeadLoss` (SGD; `jit_compile` as Keras'
default picks it unless `--jit_compile` is given), one `train_on_batch` on
the same `[B, T]` tokens per call: the per-token tiled loss
(`gradient_in_forward=False`, the default) against the summed objective
with its gradient in the forward pass (`docs/mixtures.md`), timed in
interleaved rounds (`measure.interleaved`) on the backend `KERAS_BACKEND`
names, with FullSoftmax's step in the same rounds, and the chunked
FullSoftmax (`chunk_size=4096`) without and with the option (`full_chunked`,
`full_chunked_summed`); with `--sigsoftmax` also `SigSoftmax` dense
(`sig`) and chunked without and with the option (`sig_chunked`,
`sig_chunked_summed`: a mixture of one component); with `--plif`
`PLIFSoftmax` (`--knots`, default 100,000) the same way (`plif`,
`plif_chunked`, `plif_chunked_summed`) and each mixture with PLIF
(`mos4_plif`, `mos4_plif_summed`); with `--keras_ops` each PLIF row also
runs with the PLIF kernels' `dispatch.segment_sum` and `dispatch.lookup`
replaced by Keras' `ops.segment_sum` and `ops.take`, in the `keras.ops`
tiles (the `_keras_ops` rows, `ratio_to_dispatch`: on PyTorch the paths
before session 34, Keras' ops against `index_add_` and `index_select`, and
since session 50 also the `keras.ops` tiles against PyTorch's in-place
ones, `functional/plif_torch.py`; on JAX the same ops; on
TensorFlow `ops.take` against `tf.gather`, its histograms' `DenseBincount`
unchanged); with `--two_exp` each `_summed` row also runs with the summed
cores' softmax as before session 34 (`ops.logsumexp`, then `exp(s - lse)`:
the `_two_exp` rows, `ratio_to_dispatch` their ratio to the row with one
exponential pass, `chunked.summed_divergence.normaliser_and_exponentials`);
with `--copying` each `_summed` row also runs with the summed cores'
elementwise steps as fresh tensors on every backend (`chunked.dispatch.
overwritable` False: the `_copying` rows, `ratio_to_dispatch` their ratio
to the row whose steps PyTorch writes in place; on TensorFlow and JAX the
two rows are the same program). `--rows` keeps only the named rows (and
`full`, and their twins).
Raw JSON to `--out`.

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/bench_mixture_summed.py \
        --batch 32 --length 64 --dim 256 --vocab 10000 --components 4,15
"""

import argparse
import contextlib
import os
import statistics
import time

import measure  # benchmarks/measure.py (the script's own folder)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def make_model(head, length, vocab, dim, jit_compile):
    import keras

    import keras_softmax_heads as ksh

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((length,), dtype="int32"),
                              keras.layers.Embedding(vocab, dim), head])
    model.compile(keras.optimizers.SGD(0.1), loss=ksh.HeadLoss(head),
                  jit_compile=jit_compile)
    return model


def heads(components, vocab, sigsoftmax=False, plif_knots=None):
    """`{name: make}`: FullSoftmax (dense), FullSoftmax(chunk_size=4096)
    without / with `gradient_in_forward` (with `sigsoftmax` SigSoftmax's
    three the same way, with `plif_knots` PLIFSoftmax's), and each mixture
    without / with it (with `plif_knots` also with PLIF)."""
    from functools import partial

    import keras_softmax_heads as ksh

    out = {"full": lambda: ksh.FullSoftmax(vocab)}
    pointwise = {"full": ksh.FullSoftmax}
    if sigsoftmax:
        out["sig"] = lambda: ksh.SigSoftmax(vocab)
        pointwise["sig"] = ksh.SigSoftmax
    if plif_knots:
        pointwise["plif"] = partial(ksh.PLIFSoftmax, num_knots=plif_knots)
        out["plif"] = lambda: pointwise["plif"](vocab)
    for prefix, cls in pointwise.items():
        for flag in (False, True):  # chunked (4,096-word tiles)
            out[prefix + "_chunked" + ("_summed" if flag else "")] = (
                lambda cls=cls, flag=flag: cls(vocab, chunk_size=4096,
                                               gradient_in_forward=flag))
    mixtures = {"": {}}
    if plif_knots:
        mixtures["_plif"] = {"num_knots": plif_knots}
    for k in components:
        for suffix, options in mixtures.items():
            for flag in (False, True):
                name = f"mos{k}{suffix}" + ("_summed" if flag else "")
                out[name] = (lambda k=k, flag=flag, options=options: ksh.MixtureOfSoftmaxes(
                    vocab, num_components=k, gradient_in_forward=flag, **options))
    return out


KERAS_OPS = "_keras_ops"
TWO_EXP = "_two_exp"
COPYING = "_copying"
TWINS = (KERAS_OPS, TWO_EXP, COPYING)


def two_exponentials(s, shards=None):
    """The summed cores' softmax before session 34, in the form of
    `normaliser_and_exponentials`: `(logsumexp(s), exp(s - lse), 1)` (one
    device: `shards` must be None)."""
    from keras import ops

    if shards is not None:
        raise ValueError(f"two_exponentials runs on one device. Received: shards={shards!r}")

    lse = ops.logsumexp(s, axis=1)
    return lse, ops.exp(s - lse[:, None]), ops.ones_like(lse)


@contextlib.contextmanager
def twin_scope(name):
    """For a `KERAS_OPS` row: the PLIF kernels' `segment_sum` and `lookup`
    are Keras' `ops.segment_sum` and `ops.take` within the scope (PyTorch
    traces at every call, so every call of the row runs in it); for a
    `TWO_EXP` row the summed cores' softmax is `two_exponentials`; for a
    `COPYING` row nothing is overwritten (`chunked.dispatch.overwritable`
    False); other rows: unchanged."""
    from keras import ops

    from keras_softmax_heads.functional import dispatch
    from keras_softmax_heads.functional import plif_kernels
    from keras_softmax_heads.functional import tabulated

    from keras_softmax_heads.chunked import dispatch as chunked_dispatch
    from keras_softmax_heads.chunked import summed_cross_entropy
    from keras_softmax_heads.chunked import summed_mixture

    def take(table, idx):
        return ops.take(table, idx, axis=0)

    swaps = []
    if name.endswith(KERAS_OPS):
        swaps = [(dispatch, "segment_sum",
                  lambda data, ids, n: ops.segment_sum(data, ids, num_segments=n)),
                 (plif_kernels, "lookup", take), (tabulated, "lookup", take),
                 # The keras.ops tiles (PyTorch's in-place tiles, session 50, use neither op).
                 (plif_kernels, "uses_torch_tiles", lambda *tensors: False)]
    elif name.endswith(TWO_EXP):
        swaps = [(module, "normaliser_and_exponentials", two_exponentials)
                 for module in (summed_cross_entropy, summed_mixture)]
    elif name.endswith(COPYING):
        swaps = [(chunked_dispatch, "overwritable", lambda *tensors: False)]
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in swaps]
    for module, attr, value in swaps:
        setattr(module, attr, value)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def run(args):
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, args.vocab, (args.batch, args.length)).astype("int32")
    y = rng.integers(0, args.vocab, (args.batch, args.length)).astype("int32")
    jit = "auto" if args.jit_compile is None else args.jit_compile == "true"
    rows, calls = {}, {}
    plif_knots = args.knots if args.plif else None
    makers = heads(args.components, args.vocab, args.sigsoftmax, plif_knots)
    if args.rows:
        unknown = sorted(set(args.rows) - set(makers) - {"full"})
        if unknown:
            raise ValueError(f"--rows names no such row: {unknown}; rows: {sorted(makers)}")
        makers = {name: make for name, make in makers.items()
                  if name in args.rows or name == "full"}
    if args.keras_ops:
        makers.update({name + KERAS_OPS: make for name, make in list(makers.items())
                       if "plif" in name})
    summed = [(name, make) for name, make in makers.items() if name.endswith("_summed")]
    if args.two_exp:
        makers.update({name + TWO_EXP: make for name, make in summed})
    if args.copying:
        makers.update({name + COPYING: make for name, make in summed})
    for name, make in makers.items():
        keras.utils.set_random_seed(0)  # the head's initializers draw their seeds
        model = make_model(make(), args.length, args.vocab, args.dim, jit)
        start = time.perf_counter()
        with twin_scope(name):
            loss = float(model.train_on_batch(x, y))
            rows[name] = {"head": name, "first_call_s": time.perf_counter() - start,
                          "first_loss": loss}
            for _ in range(args.warmup):
                model.train_on_batch(x, y)

        def call(model=model, name=name):
            with twin_scope(name):
                return model.train_on_batch(x, y)

        calls[name] = call
    wall, _ = measure.interleaved(calls, args.rounds)
    for name, times in wall.items():
        rows[name]["step_s"] = statistics.median(times)
        rows[name]["step_s_all"] = times
        rows[name]["ratio_to_full"] = statistics.median(
            t / f for t, f in zip(times, wall["full"]))
        if name.endswith(TWINS):
            base = name
            for suffix in TWINS:
                base = base.removesuffix(suffix)
            rows[name]["ratio_to_dispatch"] = statistics.median(
                t / f for t, f in zip(times, wall[base]))
            continue
        base = name.removesuffix("_summed")
        if base != name and base in wall:  # (--rows may leave the tiled row out)
            rows[name]["ratio_to_tiled"] = statistics.median(
                t / f for t, f in zip(times, wall[base]))
    return {"script": "benchmarks/bench_mixture_summed.py", "args": vars(args),
            "backend": keras.backend.backend(), "keras": keras.__version__,
            "machine": measure.machine(), "loadavg": os.getloadavg(),
            "rows": list(rows.values())}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=10000)
    parser.add_argument("--components", type=str, default="4,15")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--jit_compile", choices=("true", "false"), default=None)
    parser.add_argument("--sigsoftmax", action="store_true",
                        help="also SigSoftmax: dense, chunked, chunked with the option")
    parser.add_argument("--plif", action="store_true",
                        help="also PLIFSoftmax and each mixture with PLIF")
    parser.add_argument("--knots", type=int, default=100_000,
                        help="PLIF's knots with --plif")
    parser.add_argument("--keras_ops", action="store_true",
                        help="also each PLIF row with Keras' ops.segment_sum and ops.take")
    parser.add_argument("--two_exp", action="store_true",
                        help="also each _summed row with the softmax's two exponential passes")
    parser.add_argument("--copying", action="store_true",
                        help="also each _summed row with no tensor overwritten (PyTorch)")
    parser.add_argument("--rows", type=str, default="",
                        help="only these rows (and full, and their twins); default all")
    parser.add_argument("--out", type=str, default=None, help="raw JSON here")
    args = parser.parse_args(argv)
    args.components = [int(k) for k in args.components.split(",") if k]
    args.rows = [name for name in args.rows.split(",") if name]
    return args


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    for row in result["rows"]:
        print(row["head"], {k: row.get(k) for k in (
            "first_loss", "step_s", "ratio_to_full", "ratio_to_tiled", "ratio_to_dispatch")})
    measure.save(result, args.out)


if __name__ == "__main__":
    main()
