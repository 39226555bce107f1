r"""`AdaptiveSoftmax` on the PyTorch backend against `AdaptiveLogSoftmaxWithLoss`.

A Keras user on `KERAS_BACKEND=torch` trains our layer eagerly (Keras runs
PyTorch without `torch.compile` for it: `supports_jit` is False there). For
each `V` (cutoffs `reference_inputs.adaptive_benchmark_cutoffs`, as
`bench_adaptive.py`'s), in one process, the training
step (the summed loss and `torch.autograd.grad` with respect to `h` and
every weight) of:

* `static`: `AdaptiveSoftmax(V, cutoffs, factor=4)` (the default, static
  shapes: blocks of the tails' capacities);
* `dynamic`: the same with `static_shapes=False` (each tail gathers exactly
  its tokens);
* `chunked`: `static` with `chunk_size=--chunk_size`;
* `torch`: `torch.nn.AdaptiveLogSoftmaxWithLoss(d, V, cutoffs,
  div_value=4)` (`torch_heads.AdaptiveSoftmax`), which has no biases; our
  heads have a head and tail biases by default (`use_bias`), and the
  `*_nobias` rows drop them (`--no_bias_rows`).

The steps take turns for `--rounds` rounds (`measure.interleaved`); the
medians and their ratios to torch's module are recorded. Threads:
`--threads` (`torch.set_num_threads`; set `OMP_NUM_THREADS` to match and
pin with `taskset`).

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/bench_adaptive_torch.py \
        --threads=1 --out=docs/results/adaptive_threads/torch_backend.json
    # smoke (seconds):
    python benchmarks/bench_adaptive_torch.py --vocab_sizes=2000 --tokens=64 \
        --dim=16 --rounds=1 --chunk_size=256 --out=/tmp/adaptive_torch.json
"""

import argparse
import os
import statistics

import measure  # benchmarks/measure.py
from reference_inputs import INPUTS, adaptive_benchmark_cutoffs, numpy_inputs

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab_sizes", default="33278,100000")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--chunk_size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no_bias_rows", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def our_step(vocab, cutoffs, dim, h, t, **options):
    """`call()`: our head's summed loss and its gradients (PyTorch eager)."""
    import keras
    import torch

    from keras_softmax_heads import AdaptiveSoftmax

    keras.utils.set_random_seed(0)  # the same weights for every row of the same shapes
    head = AdaptiveSoftmax(vocab, cutoffs=cutoffs, factor=4, **options)
    head.build((None, dim))
    params = [v.value for v in head.trainable_weights]
    x, y = torch.tensor(h), torch.tensor(t)

    def call():
        inputs = x.detach().requires_grad_(True)
        loss = -head.log_likelihood(inputs, y).sum()
        torch.autograd.grad(loss, [inputs] + params)
        return float(loss.detach())

    return call


def compare(vocab, tokens, dim, chunk_size, rounds, no_bias_rows):
    import torch
    import torch_heads  # benchmarks/torch_heads.py

    cutoffs = adaptive_benchmark_cutoffs(vocab)
    h, t = numpy_inputs(tokens, vocab, dim)
    rows = {"static": {}, "dynamic": {"static_shapes": False},
            "chunked": {"chunk_size": chunk_size}}
    if no_bias_rows:
        rows.update({"static_nobias": {"use_bias": False},
                     "dynamic_nobias": {"static_shapes": False, "use_bias": False}})
    calls = {name: our_step(vocab, cutoffs, dim, h, t, **options)
             for name, options in rows.items()}
    module = torch_heads.AdaptiveSoftmax(dim, vocab, cutoffs, div_value=4, seed=0)
    calls["torch"] = torch_heads.train_call(module, torch.tensor(h),
                                            torch.tensor(t, dtype=torch.long))
    losses = {}
    for name, call in calls.items():
        losses[name] = call()  # warm-up
        call()
    wall, _ = measure.interleaved(calls, rounds)
    medians = {name: statistics.median(times) for name, times in wall.items()}
    return {"v": vocab, "n": tokens, "d": dim, "cutoffs": cutoffs, "chunk_size": chunk_size,
            "options": {name: dict(options) for name, options in rows.items()},
            "wall_s": wall, "step_s": medians, "first_loss": losses,
            "over_torch": {name: m / medians["torch"] for name, m in medians.items()}}


def main(argv=None):
    args = parse_args(argv)
    os.environ["KERAS_BACKEND"] = "torch"
    import keras
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for vocab in (int(v) for v in args.vocab_sizes.split(",")):
        row = compare(vocab, args.tokens, args.dim, args.chunk_size, args.rounds,
                      args.no_bias_rows)
        rows.append(row)
        print(f"V={vocab}: " + ", ".join(
            f"{name} {1e3 * s:.1f} ms ({row['over_torch'][name]:.2f}x)"
            for name, s in row["step_s"].items()), flush=True)
    result = {"command": measure.command_line(__file__),
              "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ},
              "machine": measure.machine(keys=("cpu", "cores", "os", "python", "date")),
              "versions": {"torch": torch.__version__, "keras": keras.__version__},
              "threads": torch.get_num_threads(), "inputs": INPUTS, "rounds": args.rounds,
              "rows": rows}
    measure.save(result, args.out)
    return result


if __name__ == "__main__":
    main()
