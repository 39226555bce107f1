"""The heads without a summed core on vocabulary shards (JAX, 4 simulated
host devices as a 2 x 2 mesh, a subprocess: `XLA_FLAGS` must be set before
JAX starts).

Under `training.VocabularyParallel`, each head's per-token
`log_likelihood` (its evaluation, and its `training_loss`) traced with the
distribution equals the same head traced without one, values and the
gradients of `sum(u * ll)` for a random cotangent `u` (the inputs and
every trainable weight), and the compiled pass moves nothing of
vocabulary size between devices:

* `MixtureOfContexts` (tiled, `chunk_size`): its mixed context's Linear-Softmax on each device's
  shard (`head_utils.linear_nll_on_shards`), where XLA's partitioner
  gathered the `[V, L]` matrix;
* `HierarchicalSoftmax` (frequency clusters on a `[V, d]` word matrix with
  a bias; random clusters on a tied embedding): each device scores its own
  rows of the tiles' clusters (`vocab_parallel_within_cluster`), where
  XLA's partitioner all-reduced the gathered `[tiles, M, d]` blocks;
* `MonotonicSoftmax` with `chunk_size`: the tiled pass on each device's
  shard, the shards' log-sum-exps and target scores combined
  (`chunked.vocab_parallel.vocab_parallel_pointwise_nll`), where XLA's
  partitioner gathered the matrix;
* `SampledSoftmax` with `chunk_size` (its exact evaluation, as for `NCE`
  and `SelfNormalizedSoftmax`): the Linear-Softmax on each device's shard
  (`head_utils.linear_nll_on_shards`), where XLA's partitioner gathered
  the matrix in the tiled pass;
* `PLIFSoftmax` with `chunk_size` (its summed pass on the shards, checked
  in `test_vocab_parallel_summed.py`): here, that its partial slope
  histograms inside each shard's body keep the platform's method
  (`functional.dispatch.per_shard`);
* `MonotonicSoftmax` (dense): the table's gradient, a histogram of the
  `[N, V]` scores, keeps their shape (`functional.dispatch.sharded_scatter`),
  where flattened they were gathered on every device.
"""

import json
import os
import sys

import pytest
from backends import count_calls
from backends import log_likelihood_on_shards
from backends import run_on_simulated_devices

pytest.importorskip("jax")

DEVICES = 4
V = 192


def test_heads_on_vocabulary_shards_match_single_device():
    result = run_on_simulated_devices(__file__, DEVICES)
    assert sorted(result) == ["hierarchical_frequency", "hierarchical_random_tied",
                              "mixture_of_contexts", "monotonic", "monotonic_tiled", "plif",
                              "sampled_softmax"], result
    # The knot histograms: the dense head's, of the sharded [N, V] scores,
    # keeps their shape (no flat segment_sum); PLIF's partial histograms
    # inside each shard's summed pass keep the platform's method (here the
    # flat segment_sum; a Pallas kernel on a GPU, the sorted one on a TPU).
    assert result["monotonic"]["flat_histograms"] == 0, result["monotonic"]
    assert result["plif"]["flat_histograms"] > 0, result["plif"]
    for name, r in result.items():
        if name != "monotonic":  # its path, in both traces (the value, the gradient);
            # PLIF's summed pass twice a trace (token_losses' forward and backward)
            assert r["vocab_parallel_calls"] == (4 if name == "plif" else 2), (name, r)
        assert r["value_err"] < 1e-5, (name, r)
        assert len(r["grad_err"]) == r["num_weights"] + 1, (name, r)
        # The monotonic MLP's parameters: sums over all N x V scores, which
        # cancel (measured up to 3.8e-5 of the largest, the order of the
        # devices' partial sums varying); the rest to 2.2e-7.
        assert max(r["grad_err"]) < (2e-4 if name.startswith("monotonic") else 1e-5), (name, r)
        # Nothing as large as a device's share of the [V, d] matrix crosses
        # devices (the contexts' gradient, [tiles, tile_size, d] for the
        # hierarchical head, is smaller at these shapes).
        assert r["large_collectives"] == [], (name, r)
        # The vocabulary-sized weights' gradients stay split on V.
        assert all("model" in spec for spec in r["vocab_grad_specs"]), (name, r)


def child():
    # The memory benchmark's filter of a compiled program's collectives.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "benchmarks"))
    from bench_vocab_parallel_memory import collectives
    import keras
    import numpy as np

    import keras_softmax_heads as ksh
    from keras_softmax_heads import training
    from keras_softmax_heads.functional import dispatch
    from keras_softmax_heads.heads import hierarchical_softmax
    from keras_softmax_heads.heads import mixture_of_contexts
    from keras_softmax_heads.heads import pointwise_softmax_head

    rng = np.random.default_rng(0)
    b, t, dim = 4, 6, 16
    h = rng.normal(size=(b, t, dim)).astype("float32")
    y = rng.integers(0, V, (b, t)).astype("int32")
    u = rng.normal(size=(b, t)).astype("float32")
    calls = []
    count_calls(mixture_of_contexts, "linear_nll_on_shards", calls)
    count_calls(hierarchical_softmax, "vocab_parallel_within_cluster", calls)
    count_calls(pointwise_softmax_head, "vocab_parallel_pointwise_nll", calls)
    count_calls(pointwise_softmax_head, "linear_nll_on_shards", calls, "pointwise_linear")
    count_calls(pointwise_softmax_head, "vocab_parallel_mixture", calls)
    count_calls(dispatch, "segment_sum", calls, "flat_histogram")
    distribution = training.VocabularyParallel(V, vocab_shards=DEVICES // 2)  # 2 x 2
    counts = rng.zipf(1.3, V).astype("float64")

    def tied_hierarchical():
        embedding = keras.layers.Embedding(V, dim)
        embedding.build((None,))
        return ksh.HierarchicalSoftmax(V, token_embedding=embedding, clustering="random",
                                       num_clusters=11, tile_size=4)

    result = {}
    for name, make in (
            ("mixture_of_contexts", lambda: ksh.MixtureOfContexts(V, num_components=3,
                                                                       chunk_size=32)),
            ("hierarchical_frequency", lambda: ksh.HierarchicalSoftmax(V, counts=counts,
                                                                       tile_size=4)),
            ("hierarchical_random_tied", tied_hierarchical),
            ("monotonic", lambda: ksh.MonotonicSoftmax(V, num_units=4, grid_size=64)),
            ("monotonic_tiled", lambda: ksh.MonotonicSoftmax(V, num_units=4, grid_size=64,
                                                             chunk_size=32)),
            ("sampled_softmax", lambda: ksh.SampledSoftmax(V, num_sampled=8, chunk_size=32)),
            ("plif", lambda: ksh.PLIFSoftmax(V, chunk_size=32, num_knots=64))):
        with distribution.scope():
            head = make()
            head.build((None, None, dim))
        calls_of = {"hierarchical_frequency": "vocab_parallel_within_cluster",
                    "hierarchical_random_tied": "vocab_parallel_within_cluster",
                    "monotonic_tiled": "vocab_parallel_pointwise_nll",
                    "sampled_softmax": "pointwise_linear",
                    "plif": "vocab_parallel_mixture"}.get(
                        name, "linear_nll_on_shards")
        r = log_likelihood_on_shards(head, h, y, u, distribution, calls, compiled="step")
        result[name] = {
            "vocab_parallel_calls": r["calls"].count(calls_of),
            "flat_histograms": r["calls"].count("flat_histogram"),
            "value_err": r["value_err"],
            "num_weights": r["num_weights"],
            "grad_err": r["grad_err"],
            "large_collectives": collectives(r["compiled"].as_text(), V * dim // 2),
            "vocab_grad_specs": [str(g.sharding.spec)
                                 for w, g in zip(head.trainable_weights, r["grads"])
                                 if V in w.shape],
        }
    print(json.dumps(result))


if __name__ == "__main__":
    child()
