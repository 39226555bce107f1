import os
import tempfile

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import is_target_error
from backends import jit
from backends import to_numpy
from backends import value_and_grad
from battery import HeadBattery
from keras import ops
from multibackend import RTOL64
from multibackend import float64  # noqa: F401 (fixture)
from multibackend import slow_off_tensorflow
from multibackend import slow_on
from references import numpy_log_softmax

import keras_softmax_heads as ksh
from keras_softmax_heads import clustering
from keras_softmax_heads.heads.hierarchical_softmax import HierarchicalSoftmax
from keras_softmax_heads.heads.hierarchical_softmax import ops_dynamic_within_cluster
from keras_softmax_heads.heads.hierarchical_softmax import size_class_widths
from keras_softmax_heads.heads.hierarchical_softmax import split_large_clusters
from keras_softmax_heads.heads.hierarchical_softmax import tf_dynamic_within_cluster

pytestmark = pytest.mark.multibackend

# `static_shapes=False` has data-dependent shapes: TensorFlow graphs and
# PyTorch run it; JAX refuses it at construction.
needs_dynamic_shapes = pytest.mark.skipif(
    BACKEND == "jax", reason="static_shapes=False raises on JAX (data-dependent shapes)"
)
tensorflow_only = pytest.mark.skipif(
    BACKEND != "tensorflow", reason="TensorFlow graphs / fast path"
)


V, D = 13, 6
COUNTS = np.array([90, 50, 30, 20, 12, 9, 7, 5, 4, 3, 2, 1, 1])
# 3 clusters of sizes 5, 4, 4 (ids interleaved, not contiguous).
ASSIGNMENT = np.arange(V) % 3


def _vocab(v, kw):
    return v if v is not None else kw["token_embedding"].input_dim


class TestHierarchicalBattery(HeadBattery):
    avoids_full_scores_in_training = True
    cases = {
        # Frequency clusters from counts (C = ceil(sqrt(13)) = 4), tiles of 16.
        "frequency": lambda v, d, **kw: HierarchicalSoftmax(
            v, counts=COUNTS[: _vocab(v, kw)], **kw
        ),
        # Explicit assignment, one block per token, no biases.
        "explicit": lambda v, d, **kw: HierarchicalSoftmax(
            v,
            clusters=np.arange(_vocab(v, kw)) % 3,
            tile_size=1,
            use_bias=False,
            **kw,
        ),
    }


@needs_dynamic_shapes
class TestHierarchicalDynamicBattery(HeadBattery):
    """`static_shapes=False`: data-dependent tiles (not XLA; not JAX)."""
    avoids_full_scores_in_training = True

    jit_compatible = False

    # As AdaptiveSoftmax's dynamic battery: its training tests (16 s for the
    # loss-goes-down fit on TensorFlow) under `-m slow`; by default
    # `test_jit_compile_fit_step` fits it (graph mode) and
    # `test_dynamic_tiles_equal_static_tiles` checks its gradients against
    # the static path's.
    slow_tests = ("test_fit_reduces_loss", "test_mixed_float16_fit", "test_sequential_head_loss")
    cases = {
        "dynamic": lambda v, d, **kw: HierarchicalSoftmax(
            v, counts=COUNTS[: _vocab(v, kw)], static_shapes=False, **kw
        ),
        # Interleaved (non-contiguous) clusters, padded width, no biases.
        "dynamic_explicit": lambda v, d, **kw: HierarchicalSoftmax(
            v,
            clusters=np.arange(_vocab(v, kw)) % 3,
            max_cluster_size=7,
            use_bias=False,
            static_shapes=False,
            **kw,
        ),
    }


def numpy_reference(head, h):
    """log p(w|h) = log_softmax(h U + a)[c(w)] + log_softmax over c(w)'s words."""
    h = h.astype("float64")
    words = to_numpy(head.kernel).astype("float64")  # [V, d]
    z = h @ words.T + head.bias.numpy()
    zc = h @ head.cluster_kernel.numpy() + head.cluster_bias.numpy()
    class_lp = numpy_log_softmax(zc)
    layout = head.cluster_assignment
    out = np.empty(h.shape[:-1] + (head.vocab_size,))
    for c in range(layout.num_clusters):
        members = layout.cluster_words[c, : layout.cluster_sizes[c]]
        out[..., members] = class_lp[..., c : c + 1] + numpy_log_softmax(z[..., members])
    return out


def randomised(head, h, seed=0):
    head(h)
    rng = np.random.default_rng(seed)
    for w in head.trainable_weights:
        w.assign(rng.normal(size=w.shape).astype("float32"))
    return head


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(counts=COUNTS),
        dict(clusters=ASSIGNMENT, tile_size=3),
        dict(clustering="random", num_clusters=5, seed=3, max_cluster_size=8),
    ],
    ids=["frequency", "explicit", "random_padded"],
)
def test_numpy_reference(kwargs):
    rng = np.random.default_rng(0)
    h = rng.normal(size=(4, 5, D)).astype("float32")
    head = randomised(HierarchicalSoftmax(V, **kwargs), h)
    expected = numpy_reference(head, h)
    np.testing.assert_allclose(to_numpy(head(h)), expected, atol=1e-5)
    t = rng.integers(0, V, size=(4, 5))
    want = np.take_along_axis(expected, t[..., None], -1)[..., 0]
    np.testing.assert_allclose(to_numpy(head.log_likelihood(h, t)), want, atol=1e-5)
    np.testing.assert_allclose(
        to_numpy(jit(head.log_likelihood)(h, t)), want, atol=1e-5
    )


@slow_off_tensorflow
def test_gradients_match_dense_autodiff_float64(float64):
    """The cheap tiled `log_likelihood`'s gradients (context, both kernels,
    both biases) equal those of the dense `log_probs` path, in float64,
    eagerly and compiled."""
    rng = np.random.default_rng(3)
    h = rng.normal(size=(9, D))
    t = np.where(rng.random(9) < 0.4, 0, rng.integers(0, V, size=9))
    head = randomised(HierarchicalSoftmax(V, counts=COUNTS, tile_size=2), h)
    weights = ops.convert_to_tensor(rng.normal(size=9))

    def cheap(x):
        return ops.sum(head.log_likelihood(x, t) * weights)

    def dense(x):
        log_p = head.log_probs(x)
        picked = ops.take_along_axis(log_p, ops.convert_to_tensor(t[:, None]), axis=-1)
        return ops.sum(picked[:, 0] * weights)

    variables = head.trainable_weights
    want_value, want_h, want_vars = value_and_grad(dense, [h], variables)
    for fn in (cheap, jit(cheap)):
        value, got_h, got_vars = value_and_grad(fn, [h], variables)
        np.testing.assert_allclose(value, want_value, rtol=RTOL64)
        for got, want, w in zip(got_h + got_vars, want_h + want_vars, ["h"] + variables):
            np.testing.assert_allclose(got, want, rtol=RTOL64, atol=RTOL64, err_msg=str(w))


def test_float64_probabilities_sum_to_one(float64):
    """In float64 the per-cluster sums of `log_probs` stay in float64 on
    every backend (Keras' PyTorch `segment_sum` alone sums in float32: an
    error of 1e-7 there before `functional.dispatch.segment_sum`)."""
    rng = np.random.default_rng(4)
    h = 3 * rng.normal(size=(7, 8))
    head = randomised(HierarchicalSoftmax(57, counts=rng.integers(1, 1000, 57), tile_size=4), h)
    log_p = to_numpy(head.log_probs(ops.convert_to_tensor(h)))
    assert log_p.dtype == np.float64
    np.testing.assert_allclose(np.exp(log_p).sum(-1), 1.0, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tile_size", [1, 5, 64])
# JAX under `-m slow` (10 s; no JAX-specific path: the battery's
# normalisation test runs there).
@slow_on("jax")
def test_probabilities_sum_to_one_and_cheap_likelihood_matches(tile_size):
    """Random inputs, skewed targets (many tokens in one cluster), all tiles."""
    rng = np.random.default_rng(tile_size)
    vocab = 57
    counts = rng.integers(1, 1000, size=vocab)
    head = HierarchicalSoftmax(vocab, counts=counts, tile_size=tile_size)
    h = (3 * rng.normal(size=(37, 8))).astype("float32")
    head = randomised(head, h, seed=tile_size)
    log_p = to_numpy(head(h))
    np.testing.assert_allclose(np.exp(log_p.astype("float64")).sum(-1), 1.0, atol=1e-5)
    jitted_log_p = jit(head.log_probs)(h)
    np.testing.assert_allclose(to_numpy(jitted_log_p), log_p, atol=1e-5)
    t = np.where(rng.random(37) < 0.5, 0, rng.integers(0, vocab, size=37))
    ll = to_numpy(head.log_likelihood(h, t))
    np.testing.assert_allclose(ll, log_p[np.arange(37), t], atol=1e-5)
    np.testing.assert_allclose(to_numpy(jit(head.log_likelihood)(h, t)), ll, atol=1e-5)


@tensorflow_only
def test_unknown_batch_size_in_a_graph():
    import tensorflow as tf

    rng = np.random.default_rng(5)
    head = randomised(HierarchicalSoftmax(57, counts=rng.integers(1, 1000, size=57)),
                      np.zeros((1, 8), "float32"))
    h = rng.normal(size=(37, 8)).astype("float32")
    t = rng.integers(0, 57, size=37).astype("int32")
    spec = [tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None], tf.int32)]
    dynamic = tf.function(head.log_likelihood, autograph=False, input_signature=spec)
    np.testing.assert_allclose(
        to_numpy(dynamic(h, t)), to_numpy(head.log_likelihood(h, t)), atol=1e-5
    )


def intermediate_sizes(fn, *args):
    """Element counts of every intermediate of the traced `fn(*args)` (a
    TensorFlow graph or a JAX jaxpr, nested jaxprs included)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        graph = tf.function(fn, autograph=False).get_concrete_function(*args).graph
        return [
            int(np.prod(op.outputs[0].shape))
            for op in graph.get_operations()
            if op.outputs and op.outputs[0].shape.is_fully_defined()
        ]
    import jax

    sizes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return sizes


@pytest.mark.skipif(BACKEND == "torch", reason="no traced graph to inspect")
def test_log_likelihood_never_scores_all_words():
    """The cheap path gathers at most `K` cluster blocks, never `[N, V]`."""
    head = HierarchicalSoftmax(400, clustering="random", num_clusters=20, tile_size=8)
    h = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    t = np.random.default_rng(1).integers(0, 400, size=64).astype("int32")
    head(h)
    sizes = intermediate_sizes(head.log_likelihood, h, t)
    # K = min(64, (64 + 7 * 20) // 8) = 25 tiles of 8 tokens and 20 words:
    # scores [25, 8, 20]; gathered blocks [25, 20, d=4]; kernel [400, 4].
    assert max(sizes) == 25 * 8 * 20 < 64 * 400


def test_layout_from_clustering_module():
    layout = clustering.make_clusters("random", vocab_size=V, num_clusters=4, seed=1)
    head = HierarchicalSoftmax(V, clusters=layout)
    assert head.num_clusters == 4 and head.cluster_assignment == layout
    from_dict = HierarchicalSoftmax(V, clusters=layout.to_config())
    assert from_dict.cluster_assignment == layout
    bins = clustering.make_clusters("frequency", counts=COUNTS)
    paper = HierarchicalSoftmax(V, counts=COUNTS, cluster_size_cap=None)
    assert paper.cluster_assignment == bins
    assert paper.num_clusters == clustering.default_num_clusters(V) == 4
    # Default: bins of more than ceil(13 / 4) = 4 words are split.
    freq = HierarchicalSoftmax(V, counts=COUNTS)
    assert bins.max_cluster_size > 4
    assert freq.cluster_assignment == split_large_clusters(bins, 4, COUNTS)
    assert freq.max_cluster_size <= 4 and freq.num_clusters > 4
    # No counts: contiguous blocks of ids (ids assumed sorted by frequency).
    plain = HierarchicalSoftmax(10, num_clusters=3)
    assert plain.cluster_assignment.cluster_of_word.tolist() == [0] * 4 + [1] * 3 + [2] * 3


def test_split_large_clusters():
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 100, size=200).astype("float64")
    bins = clustering.make_clusters("frequency", counts=counts, num_clusters=8)
    split = split_large_clusters(bins, 12, counts)
    assert split.max_cluster_size <= 12
    assert split.num_clusters == int(np.ceil(bins.cluster_sizes / 12).sum())
    sizes = split.cluster_sizes
    for c in range(bins.num_clusters):
        # The pieces of bin c: consecutive ids, near-equal sizes, same words.
        pieces = np.unique(split.cluster_of_word[bins.cluster_of_word == c])
        assert np.array_equal(pieces, np.arange(pieces[0], pieces[-1] + 1))
        assert sizes[pieces].max() - sizes[pieces].min() <= 1
        assert set(np.flatnonzero(np.isin(split.cluster_of_word, pieces))) == set(
            np.flatnonzero(bins.cluster_of_word == c)
        )
        # Taken in descending count order: earlier pieces hold frequent words.
        means = [counts[split.cluster_of_word == p].min() for p in pieces[:-1]]
        nexts = [counts[split.cluster_of_word == p].max() for p in pieces[1:]]
        assert all(a >= b for a, b in zip(means, nexts))
    assert split_large_clusters(bins, 10_000) is bins
    # Explicit layouts are split only with an explicit cap.
    explicit = HierarchicalSoftmax(V, clusters=ASSIGNMENT)
    assert explicit.cluster_assignment.cluster_sizes.tolist() == [5, 4, 4]
    capped = HierarchicalSoftmax(V, clusters=ASSIGNMENT, cluster_size_cap=2)
    assert capped.num_clusters == 7 and capped.max_cluster_size == 2
    with pytest.raises(ValueError, match="cap=0"):
        HierarchicalSoftmax(V, cluster_size_cap=0)
    with pytest.raises(ValueError, match="cluster_size_cap='big'"):
        HierarchicalSoftmax(V, cluster_size_cap="big")


def test_likelihood_cost_matches_the_graph():
    head = HierarchicalSoftmax(400, clustering="random", num_clusters=20, tile_size=8)
    cost = head.likelihood_cost(64)
    assert cost == {
        "tiles": 25,
        "gathered_rows": 500,
        "word_scores": 4000,
        "cluster_scores": 1280,
    }
    assert head.likelihood_cost(1)["tiles"] == 1


def test_kmeans_layout_built_outside():
    ids = np.array([0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3] * 3)
    layout = clustering.make_clusters(
        "kmeans", ids=ids, vocab_size=4, num_clusters=2, max_cluster_fraction=None
    )
    head = HierarchicalSoftmax(4, clusters=layout)
    h = np.ones((2, 3), "float32")
    np.testing.assert_allclose(np.exp(to_numpy(head(h))).sum(-1), 1.0, atol=1e-6)
    with pytest.raises(ValueError, match="make_clusters"):
        HierarchicalSoftmax(4, counts=[4, 3, 2, 1], clustering="kmeans")


# JAX under `-m slow` (8 s): the layout's config, checked on TensorFlow and PyTorch.
@slow_on("jax")
def test_keras_round_trip_keeps_layout():
    """A fresh object loaded from `.keras` has the saved (non-default) layout."""
    rng = np.random.default_rng(0)
    head = HierarchicalSoftmax(V, clusters=rng.permutation(ASSIGNMENT), max_cluster_size=6)
    inputs = keras.Input((D,))
    model = keras.Model(inputs, head(inputs))
    h = rng.normal(size=(7, D)).astype("float32")
    randomised(head, h)
    config = head.get_config()
    assert config["clusters"] == head.cluster_assignment.to_config()
    assert config["counts"] is None
    assert config["num_clusters"] == 3 and config["max_cluster_size"] == 6
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hsm.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    loaded_head = loaded.layers[-1]
    assert isinstance(loaded_head, HierarchicalSoftmax)
    assert loaded_head is not head
    assert loaded_head.cluster_assignment == head.cluster_assignment
    assert loaded_head.cluster_assignment != _placeholder(V, 3)
    np.testing.assert_array_equal(loaded.predict(h, verbose=0), model.predict(h, verbose=0))
    t = rng.integers(0, V, size=7)
    np.testing.assert_allclose(
        to_numpy(loaded_head.log_likelihood(h, t)),
        to_numpy(head.log_likelihood(h, t)),
        atol=1e-6,
    )


def _placeholder(vocab, num_clusters):
    return clustering.hierarchical_layout((np.arange(vocab) * num_clusters) // vocab)


def test_head_model_training_lowers_exact_eval_loss():
    keras.utils.set_random_seed(0)
    vocab, n = 40, 64
    x = (np.arange(8)[None, :] + np.arange(n)[:, None]) % vocab
    y = (3 * x + 1) % vocab
    counts = np.bincount(y.ravel(), minlength=vocab) + 1
    backbone = keras.Sequential([keras.layers.Embedding(vocab, 16)])
    model = ksh.HeadModel(backbone, HierarchicalSoftmax(vocab, counts=counts))
    model.compile(optimizer=keras.optimizers.Adam(0.05))
    before = model.evaluate(x, y, verbose=0, return_dict=True)
    model.fit(x, y, batch_size=32, epochs=10, verbose=0)
    after = model.evaluate(x, y, verbose=0, return_dict=True)
    assert after["loss"] < 0.3 * before["loss"], (before, after)
    # The evaluation loss is the exact NLL of the full distribution.
    log_p = to_numpy(model.predict(x, verbose=0))
    nll = -np.take_along_axis(log_p, y[..., None], -1).mean()
    np.testing.assert_allclose(after["loss"], nll, rtol=1e-4)


def test_tied_embedding_gathers_embedding_rows():
    emb = keras.layers.Embedding(V, D)
    emb.build((None,))
    head = HierarchicalSoftmax(token_embedding=emb, clusters=ASSIGNMENT, use_bias=False)
    h = np.random.default_rng(0).normal(size=(5, D)).astype("float32")
    head(h)
    assert head.kernel is None
    assert emb.embeddings.path in [w.path for w in head.trainable_weights]
    z = to_numpy(head.logits(h))
    np.testing.assert_allclose(z, h @ emb.embeddings.numpy().T, atol=1e-5)


# ----------------------------------------------------------------- bad input
def test_bad_counts():
    with pytest.raises(ValueError, match=r"counts.shape=\(12,\), vocab_size=13"):
        HierarchicalSoftmax(V, counts=COUNTS[:12])
    bad = COUNTS.copy()
    bad[4] = -2
    with pytest.raises(ValueError, match=r"counts\[4\]=-2"):
        HierarchicalSoftmax(V, counts=bad)


def test_bad_cluster_numbers():
    with pytest.raises(ValueError, match="num_clusters=14 > vocab_size=13"):
        HierarchicalSoftmax(V, num_clusters=14)
    with pytest.raises(ValueError, match="num_clusters=0"):
        HierarchicalSoftmax(V, num_clusters=0)
    with pytest.raises(ValueError, match="clustering='kmean'"):
        HierarchicalSoftmax(V, clustering="kmean")
    with pytest.raises(ValueError, match="max_cluster_size=4"):
        HierarchicalSoftmax(V, clusters=ASSIGNMENT, max_cluster_size=4)
    with pytest.raises(ValueError, match="tile_size=0"):
        HierarchicalSoftmax(V, tile_size=0)


def test_bad_assignment():
    with pytest.raises(ValueError, match=r"clusters.shape=\(12,\), vocab_size=13"):
        HierarchicalSoftmax(V, clusters=ASSIGNMENT[:12])
    out_of_range = ASSIGNMENT.copy()
    out_of_range[5] = 7
    with pytest.raises(ValueError, match=r"assignment\[5\]=7"):
        HierarchicalSoftmax(V, clusters=out_of_range, num_clusters=3)
    negative = ASSIGNMENT.copy()
    negative[2] = -1
    with pytest.raises(ValueError, match=r"assignment\[2\]=-1"):
        HierarchicalSoftmax(V, clusters=negative)
    with pytest.raises(ValueError, match="num_clusters=4"):
        HierarchicalSoftmax(V, clusters=ASSIGNMENT, num_clusters=4)
    small = clustering.make_clusters("random", vocab_size=10)
    with pytest.raises(ValueError, match="vocab_size=10, vocab_size=13"):
        HierarchicalSoftmax(V, clusters=small)


def test_bad_targets():
    head = HierarchicalSoftmax(V, counts=COUNTS)
    h = np.zeros((2, D), "float32")
    with pytest.raises(ValueError,
                       match=r"vocab_size=13\)\. Received: targets\[1\]=13 \(1 of 2"):
        head.log_likelihood(h, np.array([0, 13]))
    with pytest.raises(ValueError, match=r"targets\[0\]=-1"):
        head.training_loss(h, np.array([-1, 0]))
    if BACKEND != "torch":  # values unknown under XLA: NaN, not a number
        out = to_numpy(jit(head.log_likelihood)(h, np.array([0, 13], "int32")))
        assert np.isfinite(out[0]) and np.isnan(out[1])


@tensorflow_only
def test_bad_targets_in_a_tensorflow_graph():
    import tensorflow as tf

    head = HierarchicalSoftmax(V, counts=COUNTS)
    h = np.zeros((2, D), "float32")
    with pytest.raises(Exception, match=r"vocab_size=13\)\. Received: targets at index") as info:
        tf.function(head.log_likelihood, autograph=False)(h, np.array([0, 13], "int32"))
    assert is_target_error(info.value)


# ------------------------------------------------------ static_shapes=False
def _nll_and_grads(head, h, t, weights, compile=False):
    """`log_likelihood` and the gradients of its weighted sum (`h` first, then
    the trainable weights), eagerly, compiled with XLA, or (`"graph"`) in a
    TensorFlow graph without XLA."""

    def loss(x):
        return -ops.sum(head.log_likelihood(x, t) * ops.convert_to_tensor(weights))

    if compile == "graph":
        import tensorflow as tf

        fn = tf.function(loss, autograph=False)
    else:
        fn = jit(loss) if compile else loss
    _, (grad_h,), grad_vars = value_and_grad(fn, [h], head.trainable_weights)
    return to_numpy(head.log_likelihood(h, t)), [grad_h] + grad_vars


_LAYOUTS = [
    dict(counts=np.random.default_rng(1).integers(1, 1000, size=57)),
    dict(clusters=np.arange(57) % 5, use_bias=False),
    dict(clustering="random", num_clusters=9, max_cluster_size=11, seed=2),
    dict(clusters=np.minimum(np.arange(57) // 2, 20)),  # sizes 2 ... 17
]
_LAYOUT_IDS = ["frequency", "interleaved_no_bias", "random_padded", "unequal"]
DYNAMIC_LAYOUTS = pytest.mark.parametrize("kwargs", _LAYOUTS, ids=_LAYOUT_IDS)
#: The same, all but the last under -m slow (7-12 s each on TensorFlow): the
#: unequal layout (clusters of 2 to 17 words, many tiles of one cluster)
#: covers the tiles' edge cases by default.
DYNAMIC_LAYOUTS_ONE_DEFAULT = pytest.mark.parametrize(
    "kwargs",
    [pytest.param(k, marks=pytest.mark.slow) if i < 3 else k for i, k in enumerate(_LAYOUTS)],
    ids=_LAYOUT_IDS,
)


@needs_dynamic_shapes
@DYNAMIC_LAYOUTS_ONE_DEFAULT
def test_dynamic_tiles_equal_static_tiles(kwargs):
    """Same log-likelihood and gradients (h, both kernels, both biases) as the
    static path (itself checked against NumPy, and compiled here), eagerly
    and (TensorFlow) in a graph, also with an unknown batch size; skewed
    targets fill many tiles of one cluster."""
    rng = np.random.default_rng(0)
    vocab, n = 57, 45
    h = (2 * rng.normal(size=(n, 8))).astype("float32")
    t = np.where(rng.random(n) < 0.5, 0, rng.integers(0, vocab, size=n)).astype("int32")
    static = randomised(HierarchicalSoftmax(vocab, **kwargs), h, seed=1)
    dynamic = HierarchicalSoftmax(vocab, static_shapes=False, **kwargs)
    dynamic(h)
    for a, b in zip(static.weights, dynamic.weights):
        b.assign(a.numpy())
    weights = np.linspace(0.5, 2.0, n).astype("float32")
    ll, grads = _nll_and_grads(static, h, t, weights, compile=True)
    log_p = to_numpy(static(h))
    np.testing.assert_allclose(ll, log_p[np.arange(n), t], atol=1e-5)
    modes = [False] + (["graph"] if BACKEND == "tensorflow" else [])
    for mode in modes:
        got_ll, got_grads = _nll_and_grads(dynamic, h, t, weights, compile=mode)
        np.testing.assert_allclose(got_ll, ll, atol=1e-5)
        for got, want, w in zip(got_grads, grads, ["h"] + static.trainable_weights):
            np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"{mode} {w}")
    if BACKEND == "tensorflow":
        import tensorflow as tf

        spec = [tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None], tf.int32)]
        unknown = tf.function(dynamic.log_likelihood, input_signature=spec, autograph=False)
        np.testing.assert_allclose(to_numpy(unknown(h, t)), ll, atol=1e-5)
    # One token, and every token in the same cluster.
    np.testing.assert_allclose(
        to_numpy(dynamic.log_likelihood(h[:1], t[:1])), ll[:1], atol=1e-5
    )
    same = np.zeros(n, "int32")
    np.testing.assert_allclose(
        to_numpy(dynamic.log_likelihood(h, same)), log_p[:, 0], atol=1e-5
    )


@tensorflow_only
@DYNAMIC_LAYOUTS
def test_tensorflow_dynamic_fast_path_matches_keras_ops_reference(kwargs, float64):
    """The custom-gradient TensorFlow path (one `IndexedSlices` gradient for
    the word embeddings and bias) equals the `keras.ops` autodiff reference
    in float64: values and gradients of the context, embeddings and bias."""
    import tensorflow as tf

    rng = np.random.default_rng(2)
    vocab, n = 57, 45
    h = rng.normal(size=(n, 8))
    t = np.where(rng.random(n) < 0.5, 0, rng.integers(0, vocab, size=n)).astype("int32")
    head = randomised(HierarchicalSoftmax(vocab, static_shapes=False, **kwargs), h)
    layout = head.cluster_assignment
    plan = head._dynamic_plan(
        ops.convert_to_tensor(layout.cluster_of_word[t]),
        ops.convert_to_tensor(layout.position_in_cluster[t]),
    )
    weights = ops.convert_to_tensor(rng.normal(size=n))
    variables = [v for v in (head.kernel, head.bias) if v is not None]

    def objective(fn):
        def run(x):
            bias = None if head.bias is None else ops.convert_to_tensor(head.bias)
            ll = fn(x, ops.convert_to_tensor(head.kernel), bias, plan, "float64")
            return ops.sum(ll * weights)

        return run

    want = value_and_grad(objective(ops_dynamic_within_cluster), [h], variables)
    got = value_and_grad(objective(tf_dynamic_within_cluster), [h], variables)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    for a, b in zip(got[1] + got[2], want[1] + want[2]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    with tf.GradientTape() as tape:
        loss = objective(tf_dynamic_within_cluster)(tf.constant(h))
    grads = tape.gradient(loss, variables)
    assert all(isinstance(g, tf.IndexedSlices) for g in grads)


@needs_dynamic_shapes
def test_dynamic_tiles_gather_only_the_clusters_hit():
    """Data-dependent tiles: the gathered rows follow the clusters the batch
    hits (size classes M, M/2, ...), not the static worst case."""
    vocab = 4000
    counts = 1.0 / np.arange(1, vocab + 1)
    head = HierarchicalSoftmax(vocab, counts=counts, static_shapes=False)
    h = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    head(h)
    layout = head.cluster_assignment

    def plan_for(t):
        return head._dynamic_plan(
            ops.convert_to_tensor(layout.cluster_of_word[t].astype("int32")),
            ops.convert_to_tensor(layout.position_in_cluster[t].astype("int32")),
        )

    t = np.full(64, vocab - 1)  # one (large) cluster
    rows = sum(int(np.prod(words.shape)) for _, _, words, _ in plan_for(t))
    assert rows == -(-64 // max(1, 4096 // layout.max_cluster_size)) * layout.max_cluster_size
    assert rows < head.likelihood_cost(64)["gathered_rows"] / 4
    t = np.zeros(64, "int32")  # the most frequent word: a one-word cluster
    assert sum(int(np.prod(words.shape)) for _, _, words, _ in plan_for(t)) == 1


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX refusal")
def test_dynamic_shapes_refused_on_jax():
    with pytest.raises(ValueError, match=r"JAX.*static_shapes=True.*TensorFlow or PyTorch"):
        HierarchicalSoftmax(V, counts=COUNTS, static_shapes=False)
    config = HierarchicalSoftmax(V, counts=COUNTS).get_config()
    config["static_shapes"] = False
    with pytest.raises(ValueError, match="KERAS_BACKEND='jax'"):
        HierarchicalSoftmax.from_config(config)


def test_size_class_widths():
    assert size_class_widths(1) == [1]
    assert size_class_widths(891, top_ratio=2) == [891, 446, 223, 112, 56, 28, 14, 7, 4, 2, 1]
    assert size_class_widths(891) == [891, 743, 620, 517, 446, 223, 112, 56, 28, 14, 7, 4, 2, 1]
    assert size_class_widths(3) == [3, 2, 1] and size_class_widths(2) == [2, 1]
    for m in range(1, 300):
        widths = size_class_widths(m)
        assert widths[0] == m and widths[-1] == 1
        assert all(a > b for a, b in zip(widths, widths[1:]))
        # Padding of a cluster in its class: < 2x, and < 1.2x (+1 for the
        # rounding) above M / 2.
        for a, b in zip(widths, widths[1:]):
            assert a <= 2 * b
            if b >= (m + 1) // 2:
                assert a <= 1.2 * b + 1


@pytest.mark.parametrize("jit_compile", [False, True])
def test_default_tiles_follow_the_compiled_step(jit_compile):
    """`static_shapes=None` (the default): `HeadModel` traces the dynamic
    tiles in a TensorFlow step without XLA (faster there at every
    clustering), the static ones under XLA and on JAX / PyTorch; the same
    values and steps as `static_shapes=True`; the config keeps None."""
    head = HierarchicalSoftmax(V, counts=COUNTS, clustering="random", num_clusters=7)
    assert head.static_shapes is None and head.supports_jit and head.uses_static_shapes
    assert head.get_config()["static_shapes"] is None
    assert HierarchicalSoftmax.from_config(head.get_config()).static_shapes is None
    dynamic = BACKEND == "tensorflow" and not jit_compile
    rng = np.random.default_rng(0)
    x = rng.integers(0, V, (8, 5)).astype("int32")
    y = rng.integers(0, V, (8, 5)).astype("int32")
    runs = []
    for static_shapes in (None, True):
        keras.utils.set_random_seed(0)
        head = HierarchicalSoftmax(V, counts=COUNTS, clustering="random", num_clusters=7,
                                   static_shapes=static_shapes)
        seen = []
        log_likelihood = head.log_likelihood

        def spy(*args, head=head, seen=seen, log_likelihood=log_likelihood, **kwargs):
            seen.append(head.uses_static_shapes)
            return log_likelihood(*args, **kwargs)

        head.log_likelihood = spy
        model = ksh.HeadModel(keras.Sequential([keras.layers.Embedding(V, D)]), head)
        model.compile(optimizer=keras.optimizers.SGD(0.5), jit_compile=jit_compile)
        losses = [model.train_on_batch(x, y, return_dict=True)["loss"] for _ in range(2)]
        losses.append(model.evaluate(x, y, verbose=0, return_dict=True)["loss"])
        runs.append((losses, [to_numpy(w) for w in model.weights], seen))
        assert head.uses_static_shapes  # outside a step: the static tiles
    (losses, weights, seen), (static_losses, static_weights, static_seen) = runs
    assert seen and set(seen) == {not dynamic} and set(static_seen) == {True}
    np.testing.assert_allclose(losses, static_losses, rtol=1e-5)
    for a, b in zip(weights, static_weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@needs_dynamic_shapes
def test_static_shapes_config_and_jit_fallback():
    head = HierarchicalSoftmax(V, counts=COUNTS, static_shapes=False)
    assert head.get_config()["static_shapes"] is False
    assert HierarchicalSoftmax.from_config(head.get_config()).static_shapes is False
    assert not head.supports_jit and HierarchicalSoftmax(V).supports_jit
    with pytest.raises(ValueError, match="static_shapes='no'"):
        HierarchicalSoftmax(V, static_shapes="no")
    # Keras' default on CPU/GPU (`jit_compile="auto"`) leaves XLA off.
    backbone = keras.Sequential([keras.layers.Embedding(V, D)])
    model = ksh.HeadModel(backbone, head)
    model.compile(optimizer="adam")
    assert not model.jit_compile


def test_dispatch_scatter_and_segment_max_numpy_reference():
    """`dispatch.scatter` (duplicates summed; indices of depth 1 and 2, rows
    of values) and `dispatch.segment_max` (rows, an empty segment) against
    NumPy on every backend, and the scatter's gradient with respect to its
    values (a gather of the upstream gradient). On PyTorch they are one
    `index_put_` / `scatter_reduce_` where Keras' `scatter` loops in Python
    and its `segment_max` repeats the ids with a data-dependent shape."""
    from keras_softmax_heads.functional import dispatch

    rng = np.random.default_rng(0)
    idx = np.array([[2], [0], [2], [4]], "int32")
    values = rng.normal(size=(4,)).astype("float32")
    expected = np.zeros(6, "float32")
    np.add.at(expected, idx[:, 0], values)
    np.testing.assert_allclose(to_numpy(dispatch.scatter(idx, values, (6,))), expected,
                               rtol=1e-6)
    # Depth 2 into a [3, 4, 2] tensor: each index writes a row of 2.
    idx2 = np.array([[0, 1], [2, 3], [0, 1]], "int32")
    rows = rng.normal(size=(3, 2)).astype("float32")
    expected2 = np.zeros((3, 4, 2), "float32")
    np.add.at(expected2, (idx2[:, 0], idx2[:, 1]), rows)
    np.testing.assert_allclose(to_numpy(dispatch.scatter(idx2, rows, (3, 4, 2))), expected2,
                               rtol=1e-6)
    upstream = rng.normal(size=(6,)).astype("float32")
    _, (grad,), _ = value_and_grad(
        lambda v: ops.sum(dispatch.scatter(idx, v, (6,)) * ops.convert_to_tensor(upstream)),
        [values])
    np.testing.assert_allclose(grad, upstream[idx[:, 0]], rtol=1e-6)

    data = rng.normal(size=(7, 3)).astype("float32")
    ids = np.array([3, 0, 3, 1, 0, 3, 1], "int32")  # segment 2 empty
    out = to_numpy(dispatch.segment_max(data, ids, 4))
    for s in (0, 1, 3):
        np.testing.assert_array_equal(out[s], data[ids == s].max(0))
    np.testing.assert_array_equal(np.delete(out, 2, 0),
                                  np.delete(to_numpy(ops.segment_max(data, ids, 4)), 2, 0))


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile")
def test_training_losses_compile_without_graph_breaks_on_torch():
    """`torch.compile(fullgraph=True)` of `HierarchicalSoftmax`'s exact NLL
    (its static tiles: `pack_tiles`' counts and scatters) and of
    `SelfNormalizedSoftmax`'s Weaknorm loss: no graph break (Keras'
    PyTorch `segment_sum` / `scatter` made several a step, and `fit` with
    `jit_compile=True` reached dynamo's recompile limit), same values as
    eager. Dynamo's graph capture with its `"eager"` backend: the graph
    breaks are found there, without Inductor's minutes of code generation."""
    import torch

    rng = np.random.default_rng(0)
    h = rng.normal(size=(24, D)).astype("float32")
    t = rng.integers(0, V, 24).astype("int32")
    hsm = HierarchicalSoftmax(V, num_clusters=4)
    hsm.build((None, D))
    h_t, t_t = ops.convert_to_tensor(h), ops.convert_to_tensor(t)
    eager = to_numpy(hsm.log_likelihood(h_t, t_t))
    compiled = torch.compile(lambda a, b: hsm.log_likelihood(a, b), fullgraph=True,
                             backend="eager")
    np.testing.assert_allclose(to_numpy(compiled(h_t, t_t)), eager, rtol=1e-5, atol=1e-6)
    from keras_softmax_heads.heads.self_normalized_softmax import weaknorm_nll
    scores = ops.convert_to_tensor(rng.normal(size=(24,)).astype("float32"))
    log_z = ops.convert_to_tensor(rng.normal(size=(12,)).astype("float32"))
    rows = ops.convert_to_tensor(np.arange(0, 24, 2).astype("int32"))
    fn = lambda s, z, r: weaknorm_nll(s, z, r, 24, 1.0, "weaknorm")  # noqa: E731
    compiled_fn = torch.compile(fn, fullgraph=True, backend="eager")
    np.testing.assert_allclose(to_numpy(compiled_fn(scores, log_z, rows)),
                               to_numpy(fn(scores, log_z, rows)), rtol=1e-6)
