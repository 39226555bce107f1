"""How fast can an exact hierarchical-softmax step be? A measured floor.

`HierarchicalSoftmax` must score, for every target, all the words of the
target's cluster. With the layer's default frequency clustering and Zipfian
targets (the setting of `bench_large_vocab.py`), this script measures the
parts that no implementation of the exact two-level step can avoid, and
compares them with the layer's own step:

* the layout statistics of one batch: clusters hit, distinct word rows of
  the hit clusters (their embeddings must be read at least once forward and
  once backward, and their gradient written), target/word pairs;
* `cluster`: the cluster-level softmax alone, `log_softmax(h U + a)`, forward
  and backward (`N x d x C` products, the same in every implementation);
* `read rows`: reading the hit clusters' rows once (`sum(gather(W, rows))`);
* `hsm step`: the layer's exact NLL + backward (`bench_large_vocab.py`'s
  train step) at the same shapes, with static shapes and (graph mode only)
  with `static_shapes=False`.

`floor = cluster + 2 x read rows` (one read forward, one backward, not
counting the gradient write) is a lower bound on the step on this machine;
`--full-seconds` (the full-softmax step of `bench_large_vocab.py`; the
default is the chunked full softmax at V = 793k in
`docs/results/bench_large_vocab.json`) turns the times into speed-ups.
Results: `docs/results/hsm_floor.json`, discussed in `docs/hierarchical.md`.

The steps are `steps.py`'s, on the Keras backend of `--backend`
(`tensorflow`, `jax` or `torch`), in its modes (`--modes`; TensorFlow:
`graph` and `xla`; JAX: `xla`; PyTorch: `eager`, by default). The
`static_shapes=False` step runs in the modes without XLA (`graph`,
`eager`). The JSON names the `backend`.

`--measure-full` times the other side instead, and only that: the fastest
exact full-softmax train step we could fit at these shapes. It stores one
`[N, V]` float32 logits tensor (6.5 GB at V = 793k, N = 2048)
and does the three `N x d x V` products of a dense step (the chunked loss of
the library recomputes the logits: four), with no bias (one pass fewer, so
a conservative reference). The library's dense `FullSoftmax` does not fit at
V = 793k: autodiff keeps several `[N, V]` tensors. This reference is written
with `tf.custom_gradient`: TensorFlow only.

Usage:
    python benchmarks/hsm_floor.py                       # V = 793k, graph and XLA
    python benchmarks/hsm_floor.py --measure-full        # the full-softmax side
    python benchmarks/hsm_floor.py --v 100000 --modes graph --full-seconds 3.3
    python benchmarks/hsm_floor.py --backend jax         # the same parts on JAX
"""

import argparse
import json
import os
import sys

import measure  # benchmarks/measure.py (the script's own folder)
import numpy as np
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def best_time(fn, repeats, *inputs):
    """Best wall time of `repeats` calls after one warm-up (trace/compile).

    `fn(*inputs)` is a `steps.py` step: it returns once its outputs exist.
    """
    return measure.time_calls(lambda: fn(*inputs), warmup=1, repeats=repeats).best_s


def full_softmax_step(h, kernel, targets):
    """Exact full-softmax NLL + backward, three products, logits stored once.

    `h` `[N, d]`, `kernel` `[V, d]` (a variable), `targets` int32 `[N]`. The
    log-sum-exp is taken over blocks of rows, so that no second `[N, V]`
    tensor is alive in the forward pass. TensorFlow only; the step returns
    the loss and the gradients of `h` and `kernel`.
    """
    import tensorflow as tf

    n, rows = h.shape[0], 128

    @tf.custom_gradient
    def nll(h, w):
        z = tf.matmul(h, w, transpose_b=True)  # [N, V], kept for the backward
        lse = tf.concat(
            [tf.reduce_logsumexp(z[i:i + rows], axis=-1) for i in range(0, n, rows)], 0
        )
        loss = lse - tf.gather(z, targets, batch_dims=1)

        def grad(g):
            gz = tf.exp(z - lse[:, None])  # softmax
            gz = tf.tensor_scatter_nd_sub(
                gz, tf.stack([tf.range(n), targets], 1), tf.ones([n])
            )
            gz = gz * g[:, None]
            return gz @ w, tf.matmul(gz, h, transpose_a=True)

        return loss, grad

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch(h)
            loss = tf.reduce_sum(nll(h, kernel))
        return loss, tape.gradient(loss, [h, kernel])

    return step


def layout_stats(layout, counts, targets):
    """Clusters hit, distinct rows of the hit clusters, target/word pairs."""
    clusters = layout.cluster_of_word[targets]
    hit = np.unique(clusters)
    mass = np.bincount(layout.cluster_of_word, weights=counts,
                       minlength=layout.num_clusters)
    mass = mass / mass.sum()
    expected_rows = float(
        (layout.cluster_sizes * (1.0 - np.exp(-len(targets) * mass))).sum()
    )
    return {
        "clusters": int(layout.num_clusters),
        "max_cluster_size": int(layout.max_cluster_size),
        "clusters_hit": int(hit.size),
        "rows_hit": int(layout.cluster_sizes[hit].sum()),
        "rows_hit_expected": round(expected_rows),
        "pairs": int(layout.cluster_sizes[clusters].sum()),
    }


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--v", type=int, default=793_471)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--n", type=int, default=2048)
    select_backend.add_flag(parser)
    parser.add_argument("--modes", default="",
                        help="comma-separated modes (default: the backend's defaults)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--full-seconds", type=float, default=34.3,
                        help="full-softmax train step at the same shapes")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--measure-full", action="store_true",
        help="only time the fastest exact full-softmax step that fits (graph mode)",
    )
    args = parser.parse_args()
    args.backend = select_backend.parse(args.backend, parser)
    args.modes = select_backend.modes(args.modes, args.backend, parser)
    if args.measure_full and args.backend != "tensorflow":
        parser.error("--measure-full is written with tf.custom_gradient: "
                     "use --backend=tensorflow")
    return args


def full_seconds(h, targets, rng, args):
    """Best time of `full_softmax_step` (TensorFlow)."""
    import tensorflow as tf

    kernel = tf.Variable(rng.standard_normal((args.v, args.d), dtype=np.float32) / args.d**0.5)
    full_step = full_softmax_step(h, kernel, targets)
    return best_time(lambda: float(full_step()[0]), args.repeats)


def measure_mode(row, mode, head, dynamic, parts, h, targets, args):
    """Fills `row` with the times of one mode: the floor's parts, the layer's
    steps, their speed-ups (what was measured stays if a later part fails)."""
    import steps

    cluster_loss, read_rows, rows, cluster_targets = parts
    cluster_step = steps.grad_step(cluster_loss, [head.cluster_kernel, head.cluster_bias], mode)
    cluster_s = best_time(cluster_step, args.repeats, h, cluster_targets)
    read_s = best_time(steps.value_step(read_rows, mode, state=[head.kernel]), args.repeats,
                       rows)
    floor_s = cluster_s + 2 * read_s
    row.update({
        "cluster_s": round(cluster_s, 4),
        "read_rows_s": round(read_s, 4),
        "floor_s": round(floor_s, 4),
        "floor_speedup": round(args.full_seconds / floor_s, 1),
    })
    step_s = best_time(steps.train_step(head, mode, reduction="sum"), args.repeats, h, targets)
    row["hsm_step_s"] = round(step_s, 4)
    row["hsm_speedup"] = round(args.full_seconds / step_s, 1)
    if mode in ("graph", "eager"):  # data-dependent shapes: not under XLA
        dynamic_s = best_time(steps.train_step(dynamic, mode, reduction="sum"), args.repeats,
                              h, targets)
        row["hsm_dynamic_step_s"] = round(dynamic_s, 4)
        row["hsm_dynamic_speedup"] = round(args.full_seconds / dynamic_s, 1)


def floor_parts(head, targets_np):
    """`(cluster_loss, read_rows, rows, cluster_targets)`: the floor's two
    steps (`keras.ops`) and their inputs for the batch's targets."""
    import keras
    import steps

    layout = head.cluster_assignment
    hit = np.unique(layout.cluster_of_word[targets_np])
    rows_np = np.concatenate([layout.cluster_words[c, : layout.cluster_sizes[c]] for c in hit])
    rows = steps.tensor(np.sort(rows_np).astype("int32"))
    cluster_targets = steps.tensor(layout.cluster_of_word[targets_np].astype("int32"))

    def cluster_loss(h, cluster_targets):
        return keras.ops.sum(steps.dense_nll(h, head.cluster_kernel, head.cluster_bias,
                                             cluster_targets))

    def read_rows(rows):
        return keras.ops.sum(keras.ops.take(head.kernel, rows, axis=0))

    return cluster_loss, read_rows, rows, cluster_targets


def main():
    args = parse_args()
    select_backend.use(args.backend)
    import steps

    from keras_softmax_heads.heads.hierarchical_softmax import HierarchicalSoftmax

    rng = np.random.default_rng(0)
    counts = 1.0 / (np.arange(args.v) + 1.0)
    targets_np = rng.choice(args.v, size=args.n, p=counts / counts.sum())
    h = steps.tensor(rng.normal(0.0, 0.5, (args.n, args.d)).astype("float32"))
    targets = steps.tensor(targets_np.astype("int32"))
    results = {"backend": args.backend, "v": args.v, "d": args.d, "n": args.n}
    if args.measure_full:
        results["full_softmax_step_s"] = round(full_seconds(h, targets, rng, args), 4)
        print(json.dumps(results))
        measure.save(results, args.json)
        return
    head = HierarchicalSoftmax(args.v, counts=counts)
    head.build((None, args.d))
    dynamic = HierarchicalSoftmax(args.v, counts=counts, static_shapes=False)
    dynamic.build((None, args.d))
    dynamic.set_weights(head.get_weights())
    stats = layout_stats(head.cluster_assignment, counts, targets_np)
    parts = floor_parts(head, targets_np)
    results.update(stats, modes={})
    print(json.dumps(stats))
    for mode in args.modes:
        row = {}
        try:
            measure_mode(row, mode, head, dynamic, parts, h, targets, args)
        except Exception as err:  # reported in the mode's row; the other modes run
            row["error"] = measure.error_text(err)
        results["modes"][mode] = row
        print(mode, json.dumps(row), flush=True)
    measure.save(results, args.json)
    return 1 if any("error" in row for row in results["modes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
