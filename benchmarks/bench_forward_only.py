"""What a summed loss costs when its gradient is not taken (evaluation).

`gradient_in_forward=True` (`linear_cross_entropy`, and `linear_divergence`'s
summed default) computes the gradient inside the forward pass. A call whose
gradient nobody asks for (an `evaluate`) may still pay for it, or not: XLA
removes work whose results nothing reads, when the whole step is one XLA
program. This script times, in one process, the forward pass alone and the
loss with its gradients of both forms of the mean cross-entropy
(`gradient_in_forward` False / True: the tiled pass, the summed pass) and of
the mean forward KL (`linear_divergence`), interleaved rounds, on one
backend and compilation mode:

* `jax`: `jax.jit` (also XLA's compiled temporaries,
  `compiled.memory_analysis()`);
* `tensorflow`: a `tf.function` graph (`--mode=graph`: each pass its own
  nested XLA program, `chunked.dispatch.run_pass`) or `jit_compile=True`
  (`--mode=xla`: the step one XLA program);
* `torch`: eager.

Each row: `forward_s`, `train_s` (medians), their ratio, and
`forward_over_tiled_forward` (the summed form's forward pass over the tiled
form's, in the same rounds). Results: `docs/results/forward_only/`.

Usage:
    python benchmarks/bench_forward_only.py --backend=jax --out=docs/results/forward_only/jax.json
"""

import argparse
import os
import statistics

import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODES = {"jax": ("jit",), "tensorflow": ("graph", "xla"), "torch": ("eager",)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(MODES), default="jax")
    parser.add_argument("--mode", default=None,
                        help="tensorflow: graph or xla (default: both, in this process)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def losses(ksh, h, w, h_t, w_t, t):
    """`{name: loss(h, w, gradient_in_forward)}`: the mean cross-entropy and
    the mean forward KL (a teacher of twice the width, frozen)."""
    return {
        "cross_entropy": lambda h, w, gif: ksh.linear_cross_entropy(
            h, w, t, gradient_in_forward=gif),
        "forward_kl": lambda h, w, gif: ksh.linear_divergence(
            h, w, h_t, w_t, gradient_in_forward=gif),
    }


def steps(backend, mode, fn):
    """`(forward, train)`: callables of `(h, w)` that run the forward pass
    alone and the loss with its gradients with respect to `h` and `w`, both
    waiting for the result; and `compiled_mib` (JAX: the temporaries of
    each, else None)."""
    if backend == "jax":
        import jax

        forward = jax.jit(fn)
        train = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))

        def mib(step, h, w):
            return step.lower(h, w).compile().memory_analysis().temp_size_in_bytes / 2**20

        return (lambda h, w: jax.block_until_ready(forward(h, w)),
                lambda h, w: jax.block_until_ready(train(h, w)), mib, (forward, train))
    if backend == "tensorflow":
        import tensorflow as tf

        def grads(h, w):
            with tf.GradientTape() as tape:
                tape.watch([h, w])
                loss = fn(h, w)
            return loss, tape.gradient(loss, [h, w])

        jit = mode == "xla"
        forward = tf.function(fn, jit_compile=jit)
        train = tf.function(grads, jit_compile=jit)
        return (lambda h, w: forward(h, w).numpy(),
                lambda h, w: train(h, w)[0].numpy(), None, None)
    import torch

    def train(h, w):
        h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss = fn(h, w)
        torch.autograd.grad(loss, [h, w])
        return float(loss.detach())

    def forward(h, w):
        with torch.no_grad():
            return float(fn(h, w))

    return forward, train, None, None


def main(argv=None):
    args = parse_args(argv)
    select_backend.use(args.backend)
    import keras
    import numpy as np

    import keras_softmax_heads as ksh

    rng = np.random.default_rng(0)
    n, d, v = args.tokens, args.dim, args.vocab
    arrays = [rng.normal(size=(n, d)).astype("float32"),
              (rng.normal(size=(d, v)) / np.sqrt(d)).astype("float32"),
              rng.normal(size=(n, 2 * d)).astype("float32"),
              (rng.normal(size=(2 * d, v)) / np.sqrt(2 * d)).astype("float32")]
    h, w, h_t, w_t = (keras.ops.convert_to_tensor(a) for a in arrays)
    t = keras.ops.convert_to_tensor(rng.integers(0, v, n).astype("int32"))
    rows = []
    for mode in ([args.mode] if args.mode else MODES[args.backend]):
        for name, loss in losses(ksh, h, w, h_t, w_t, t).items():
            calls, compiled = {}, {}
            for form, gif in (("tiled", False), ("summed", True)):
                forward, train, mib, jitted = steps(
                    args.backend, mode, lambda h, w, gif=gif, loss=loss: loss(h, w, gif))
                calls[form] = {"forward": forward, "train": train}
                if mib is not None:
                    compiled[form] = {k: round(mib(f, h, w), 1)
                                      for k, f in zip(("forward", "train"), jitted)}
                for f in calls[form].values():
                    f(h, w)  # compiled / traced here
            times, _ = measure.interleaved(
                {(form, kind): (lambda f=calls[form][kind]: f(h, w))
                 for form in calls for kind in ("forward", "train")}, args.rounds)
            for form in calls:
                row = {"loss": name, "form": form, "mode": mode,
                       "forward_s": statistics.median(times[form, "forward"]),
                       "train_s": statistics.median(times[form, "train"]),
                       "forward_over_train": statistics.median(
                           a / b for a, b in zip(times[form, "forward"], times[form, "train"])),
                       "forward_over_tiled_forward": statistics.median(
                           a / b for a, b in zip(times[form, "forward"],
                                                 times["tiled", "forward"])),
                       "compiled_temp_mib": compiled.get(form),
                       "wall_s": {k: times[form, k] for k in ("forward", "train")}}
                rows.append(row)
                print(f"{mode} {name} {form}: forward {row['forward_s']:.3f} s, train "
                      f"{row['train_s']:.3f} s, forward / tiled forward "
                      f"{row['forward_over_tiled_forward']:.2f}", flush=True)
    measure.save({"script": "benchmarks/bench_forward_only.py", "args": vars(args),
                  "backend": args.backend, "keras": keras.__version__,
                  "machine": measure.machine(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
