import os
import tempfile

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import jit
from backends import to_numpy
from backends import value_and_grad
from battery import HeadBattery
from keras import ops
from multibackend import RTOL64
from multibackend import float64  # noqa: F401 (fixture)
from multibackend import slow_off_tensorflow
from references import numpy_log_softmax

import keras_softmax_heads as ksh
from keras_softmax_heads.heads.adaptive_softmax import AdaptiveSoftmax
from keras_softmax_heads.heads.adaptive_softmax import capacity_ladder
from keras_softmax_heads.heads.adaptive_softmax import default_cutoffs
from keras_softmax_heads.heads.adaptive_softmax import tail_fractions
from keras_softmax_heads.heads.adaptive_embedding import AdaptiveEmbedding

pytestmark = pytest.mark.multibackend

needs_dynamic_shapes = pytest.mark.skipif(
    BACKEND == "jax", reason="static_shapes=False raises on JAX (data-dependent shapes)"
)

V, D = 40, 8
CUTOFFS = [4, 12]
# Frequencies not in id order: the head ranks words by them.
COUNTS = np.random.default_rng(7).permutation(np.arange(1, V + 1) ** 2)


def _tied(v, d, **kw):
    emb = AdaptiveEmbedding(v, d, CUTOFFS, factor=2, counts=COUNTS)
    return AdaptiveSoftmax(adaptive_embedding=emb, factor=2, **kw)


class TestAdaptiveBattery(HeadBattery):
    vocab_size, input_dim = V, D
    avoids_full_scores_in_training = True
    fit_epochs = 12
    # PyTorch: `supports_jit = False` (the overflow loop runs in Python).
    jit_compatible = BACKEND != "torch"
    # No `**kw`: a plain `token_embedding` cannot be tied (the battery's
    # tying test skips on the TypeError).
    cases = {
        "counts": lambda v, d: AdaptiveSoftmax(v, CUTOFFS, factor=2, counts=COUNTS),
        # Tied adaptive input / output; tiny capacities: most batches
        # overflow the first block.
        "tied_small_capacity": lambda v, d: _tied(
            v, d, use_bias=False, capacity_factor=0.05
        ),
        # Clusters' log-normalisers over tiles of 3 words (the last partial),
        # the blocks overflowing too.
        "chunked": lambda v, d: AdaptiveSoftmax(
            v, CUTOFFS, factor=2, chunk_size=3, capacity_factor=0.3
        ),
        # `HeadLoss` / `HeadModel` train the summed loss with the tails'
        # gradients in the forward pass; capacities that overflow.
        "gradient_in_forward": lambda v, d: AdaptiveSoftmax(
            v, CUTOFFS, factor=2, counts=COUNTS, capacity_factor=0.3, gradient_in_forward=True
        ),
    }


@needs_dynamic_shapes
class TestAdaptiveDynamicBattery(HeadBattery):
    vocab_size, input_dim = V, D
    avoids_full_scores_in_training = True
    jit_compatible = False
    fit_epochs = 12
    # The dynamic path trains like the static one (tested against it below):
    # its training tests run under `-m slow` only, to keep the default run short.
    slow_tests = ("test_fit_reduces_loss", "test_mixed_float16_fit", "test_sequential_head_loss")

    cases = {
        "dynamic": lambda v, d: AdaptiveSoftmax(
            v, [3, 10, 25], factor=2, static_shapes=False
        ),
    }


def randomised(head, h, seed=0):
    head(h)
    rng = np.random.default_rng(seed)
    for w in head.trainable_weights:
        w.assign(rng.normal(size=w.shape).astype(w.dtype))
    return head


def numpy_reference(head, h):
    """torch's AdaptiveLogSoftmaxWithLoss.log_prob, in rank order, then
    permuted to word ids."""
    h = np.asarray(h, "float64")
    f = lambda w: np.asarray(to_numpy(w), "float64")  # noqa: E731
    c0 = head.cutoffs[0]
    head_lp = numpy_log_softmax(h @ f(head.head_matrix()) + (
        f(head.head_bias) if head.head_bias is not None else 0.0))
    parts = [head_lp[..., :c0]]
    for i in range(head.num_clusters):
        z = (h @ f(head.tail_projection(i))) @ f(head.tail_kernel(i))
        if head.tail_biases:
            z = z + f(head.tail_biases[i])
        parts.append(numpy_log_softmax(z) + head_lp[..., c0 + i : c0 + i + 1])
    ranked = np.concatenate(parts, -1)
    order = np.argsort(-COUNTS, kind="stable") if head.counts is not None or (
        head.adaptive_embedding is not None) else np.arange(head.vocab_size)
    out = np.empty_like(ranked)
    out[..., order] = ranked
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda: AdaptiveSoftmax(V, CUTOFFS, counts=COUNTS),
        lambda: AdaptiveSoftmax(V, [5], factor=3, use_bias=False),
        lambda: _tied(V, D),
    ],
    ids=["counts", "one_tail", "tied"],
)
def test_numpy_reference(make):
    rng = np.random.default_rng(0)
    h = rng.normal(size=(4, 5, D)).astype("float32")
    head = randomised(make(), h)
    expected = numpy_reference(head, h)
    np.testing.assert_allclose(to_numpy(head(h)), expected, atol=1e-5)
    t = rng.integers(0, V, size=(4, 5))
    want = np.take_along_axis(expected, t[..., None], -1)[..., 0]
    np.testing.assert_allclose(to_numpy(head.log_likelihood(h, t)), want, atol=1e-5)
    np.testing.assert_allclose(to_numpy(jit(head.log_likelihood)(h, t)), want, atol=1e-5)
    np.testing.assert_allclose(to_numpy(head.training_loss(h, t)), -want, atol=1e-5)


def _dense_objective(head, t, weights):
    def dense(x):
        log_p = head.log_probs(x)
        picked = ops.take_along_axis(log_p, ops.convert_to_tensor(t[:, None]), axis=-1)
        return ops.sum(picked[:, 0] * weights)
    return dense


@slow_off_tensorflow
def test_gradients_match_dense_autodiff_float64(float64):
    """The cheap `log_likelihood`'s gradients (context, every weight; tight
    capacities, so the members overflow the first block) equal the dense
    path's, eagerly and compiled."""
    rng = np.random.default_rng(3)
    h = rng.normal(size=(17, D))
    t = np.where(rng.random(17) < 0.6, 30 + rng.integers(0, 10, size=17),
                 rng.integers(0, V, size=17))
    # Compiled (the overflow loop) for the tight heads; the tied ones eagerly.
    # `chunk_size`: the clusters in tiles of 3 words (5 for the tied head).
    for head, compiled in ((AdaptiveSoftmax(V, CUTOFFS, factor=2, capacity_factor=0.1), True),
                           (_tied(V, D), False),
                           (AdaptiveSoftmax(V, CUTOFFS, factor=2, capacity_factor=0.1,
                                            chunk_size=3), True),
                           (_tied(V, D, capacity_factor=0.1, chunk_size=5), False)):
        head = randomised(head, h)
        weights = ops.convert_to_tensor(rng.normal(size=17))

        def cheap(x):
            return ops.sum(head.log_likelihood(x, t) * weights)

        assert_matches_dense(head, h, _dense_objective(head, t, weights),
                             (cheap, jit(cheap)) if compiled else (cheap,))


def assert_matches_dense(head, h, dense, fns):
    """Each of `fns(x)` has the value and the gradients (w.r.t. `h` and
    every trainable weight of `head`) of `dense(x)`, to float64 tolerance."""
    variables = head.trainable_weights
    want_value, want_h, want_vars = value_and_grad(dense, [h], variables)
    for fn in fns:
        value, got_h, got_vars = value_and_grad(fn, [h], variables)
        np.testing.assert_allclose(value, want_value, rtol=RTOL64)
        for got, want, w in zip(got_h + got_vars, want_h + want_vars, ["h"] + variables):
            np.testing.assert_allclose(got, want, rtol=RTOL64, atol=RTOL64, err_msg=str(w))


@slow_off_tensorflow
def test_gradient_in_forward_matches_dense_autodiff_float64(float64):
    """`gradient_in_forward=True`: the summed objective and its gradients
    (context, every weight) equal the dense path's, eagerly and compiled,
    with zero weights among the tokens, for ample capacities (the blocks
    under one switch), capacities whose members fit in fewer blocks than
    the switch's fewest, tight ones (the overflow loop) and a tied head."""
    rng = np.random.default_rng(5)
    n = 37
    h = rng.normal(size=(n, D))
    t = np.where(rng.random(n) < 0.6, 30 + rng.integers(0, 10, size=n),
                 rng.integers(0, V, size=n))
    weights = rng.normal(size=n) * (rng.random(n) < 0.8)
    for head in (AdaptiveSoftmax(V, CUTOFFS, factor=2, gradient_in_forward=True),
                 AdaptiveSoftmax(V, CUTOFFS, factor=2, capacity_factor=4.0,
                                 gradient_in_forward=True),
                 AdaptiveSoftmax(V, CUTOFFS, factor=2, capacity_factor=0.1,
                                 gradient_in_forward=True),
                 _tied(V, D, use_bias=False, gradient_in_forward=True)):
        head = randomised(head, h)

        def summed(x):
            return head.summed_training_loss(x, t, weights)

        assert_matches_dense(head, h, _dense_objective(head, t, ops.convert_to_tensor(-weights)),
                             (summed, jit(summed)))


def test_gradient_in_forward_summed_loss():
    """float32, every backend: the same value and gradients as the default
    summed loss, compiled; NaN for an out-of-range target with a weight."""
    rng = np.random.default_rng(6)
    n = 64
    h = rng.normal(size=(n, D)).astype("float32")
    t = rng.integers(0, V, size=n)
    weights = rng.random(n).astype("float32")
    fast = randomised(AdaptiveSoftmax(V, CUTOFFS, counts=COUNTS, gradient_in_forward=True), h)
    default = AdaptiveSoftmax.from_config({**fast.get_config(), "gradient_in_forward": False})
    default(h)
    default.set_weights(fast.get_weights())
    assert AdaptiveSoftmax.from_config(fast.get_config()).gradient_in_forward
    results = [value_and_grad(jit(lambda x, head=head: head.summed_training_loss(x, t, weights)),
                              [h], head.trainable_weights)
               for head in (fast, default)]
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5)
    for got, want in zip(results[0][1] + results[0][2], results[1][1] + results[1][2]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    bad = t.copy()
    bad[3] = V
    if BACKEND == "torch":  # eager: the target check raises
        with pytest.raises(ValueError, match=r"Received: targets\[3\]=40"):
            fast.summed_training_loss(h, bad, weights)
        return
    assert np.isnan(to_numpy(jit(lambda x: fast.summed_training_loss(x, bad, weights))(h)))
    weights[3] = 0.0
    assert np.isfinite(to_numpy(jit(lambda x: fast.summed_training_loss(x, bad, weights))(h)))


def test_gradient_in_forward_default_follows_the_platform():
    """`gradient_in_forward=None` (the default): on for the static
    whole-block path on a CPU, off on a GPU / TPU and for the tiled or
    dynamic path; an explicit value wins; the config keeps the option."""
    from keras_softmax_heads.platforms import forced_platform

    head = AdaptiveSoftmax(V, CUTOFFS)
    assert head.get_config()["gradient_in_forward"] is None
    with forced_platform("cpu"):
        assert head.gradient_in_forward
        assert not AdaptiveSoftmax(V, CUTOFFS, chunk_size=8).gradient_in_forward
        assert not AdaptiveSoftmax(V, CUTOFFS, gradient_in_forward=False).gradient_in_forward
    for platform in ("gpu", "tpu"):
        with forced_platform(platform):
            assert not head.gradient_in_forward
            assert AdaptiveSoftmax(V, CUTOFFS, gradient_in_forward=True).gradient_in_forward


def test_capacity_overflow_is_exact():
    """A batch whose tail tokens exceed the first capacity gives the same
    log-likelihood as ample capacity (and, off JAX, the dynamic path)."""
    rng = np.random.default_rng(1)
    n = 48
    h = rng.normal(size=(n, D)).astype("float32")
    # Words ranked 30..39 (last tail) for 40 of 48 tokens.
    order = np.argsort(-COUNTS, kind="stable")
    t = np.where(np.arange(n) < 40, order[30 + rng.integers(0, 10, size=n)],
                 rng.integers(0, V, size=n))
    tight = randomised(AdaptiveSoftmax(V, CUTOFFS, counts=COUNTS, capacity_factor=0.05), h)
    caps = tight.tail_capacities(n)
    assert caps[-1] < 40, caps  # the first block overflows
    assert capacity_ladder(n, caps[-1])[-1] == n  # eagerly: one block of up to n rows
    reference = numpy_reference(tight, h)[np.arange(n), t]
    got = to_numpy(tight.log_likelihood(h, t))
    np.testing.assert_allclose(got, reference, atol=1e-5)
    np.testing.assert_allclose(to_numpy(jit(tight.log_likelihood)(h, t)), reference, atol=1e-5)
    ample = AdaptiveSoftmax.from_config({**tight.get_config(), "capacity_factor": 100.0})
    ample(h)
    ample.set_weights(tight.get_weights())
    assert ample.tail_capacities(n) == [n, n]
    np.testing.assert_allclose(to_numpy(ample.log_likelihood(h, t)), got, atol=1e-6)
    if BACKEND != "jax":
        dynamic = AdaptiveSoftmax.from_config({**tight.get_config(), "static_shapes": False})
        dynamic(h)
        dynamic.set_weights(tight.get_weights())
        np.testing.assert_allclose(to_numpy(dynamic.log_likelihood(h, t)), got, atol=1e-6)
    for static in (True, False) if BACKEND != "jax" else (True,):
        chunked = AdaptiveSoftmax.from_config(
            {**tight.get_config(), "chunk_size": 3, "static_shapes": static})
        chunked(h)
        chunked.set_weights(tight.get_weights())
        np.testing.assert_allclose(to_numpy(chunked.log_likelihood(h, t)), got, atol=1e-5)
        if static:
            np.testing.assert_allclose(to_numpy(jit(chunked.log_likelihood)(h, t)), got,
                                       atol=1e-5)


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's compiled memory analysis (JAX)")
def test_xla_plans_static_tail_blocks_not_the_batch():
    """XLA's temporaries for the loss and gradients scale with the tails'
    capacities, not with the batch: an overflow is a loop over blocks of the
    first capacity (a `cond` over capacities up to `N` made XLA reserve the
    `[N, size]` scores of its largest branch: 14 GB at V = 267,735,
    N = 8,192, d = 512, against 3.4 GB now, `docs/adaptive.md`)."""
    import jax

    v, d, n = 20_000, 64, 4096
    head = AdaptiveSoftmax(v, [500, 2000], factor=4)
    head.build((None, d))
    caps = head.tail_capacities(n)
    variables = head.trainable_weights
    t = np.random.default_rng(0).integers(0, v, size=n).astype("int32")

    def loss(values, h):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            return -ops.mean(head.log_likelihood(h, t))

    values = [w.value for w in variables]
    h = np.zeros((n, d), "float32")
    step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(values, h).compile()
    temp = step.memory_analysis().temp_size_in_bytes
    # The last tail's scores for every token would take n * size * 4 bytes;
    # its first block's (kept for the backward pass), its softmax in the
    # backward pass and the smaller tail's stay well under that.
    dense_tail = n * head.tail_sizes[-1] * 4
    blocks = sum(k * s * 4 for k, s in zip(caps, head.tail_sizes))
    assert caps[-1] < n / 2, caps
    assert temp < 0.5 * dense_tail, (temp, dense_tail, blocks)
    assert temp < 4 * blocks + n * (d + 2000) * 4, (temp, blocks)


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's compiled memory analysis (JAX)")
def test_xla_plans_chunked_clusters_in_tiles():
    """With `chunk_size`, XLA's temporaries for the loss and gradients hold
    tiles of the clusters, not the head's `[N, c_0 + C]` scores nor a tail
    block's `[K_i, size_i]`: below the largest block's scores alone, and
    below a third of the unchunked step's."""
    import jax

    v, d, n = 40_000, 64, 4096
    t = np.random.default_rng(0).integers(0, v, size=n).astype("int32")
    h = np.zeros((n, d), "float32")
    temps = {}
    for chunk in (None, 1024):
        head = AdaptiveSoftmax(v, [4000, 8000], factor=4, chunk_size=chunk)
        head.build((None, d))
        variables = head.trainable_weights

        def loss(values, h, head=head, variables=variables):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return -ops.mean(head.log_likelihood(h, t))

        values = [w.value for w in variables]
        step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(values, h).compile()
        temps[chunk] = step.memory_analysis().temp_size_in_bytes
    caps = head.tail_capacities(n)
    largest_block = max(k * s * 4 for k, s in zip(caps, head.tail_sizes))
    head_scores = n * (4000 + 2) * 4
    assert temps[1024] < largest_block, (temps, largest_block)
    assert temps[1024] < head_scores, (temps, head_scores)
    assert temps[1024] < temps[None] / 3, temps


@needs_dynamic_shapes
def test_static_and_dynamic_gradients_agree():
    rng = np.random.default_rng(2)
    h = rng.normal(size=(20, D)).astype("float32")
    t = rng.integers(0, V, size=20)
    static = randomised(AdaptiveSoftmax(V, CUTOFFS, capacity_factor=0.2), h)
    dynamic = AdaptiveSoftmax(V, CUTOFFS, static_shapes=False)
    dynamic(h)
    dynamic.set_weights(static.get_weights())
    results = []
    for head in (static, dynamic):
        results.append(value_and_grad(
            lambda x: ops.sum(head.training_loss(x, t)), [h], head.trainable_weights))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
    for a, b in zip(results[0][1] + results[0][2], results[1][1] + results[1][2]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if BACKEND == "tensorflow":  # a graph with data-dependent shapes
        import tensorflow as tf

        np.testing.assert_allclose(
            to_numpy(tf.function(dynamic.log_likelihood, autograph=False)(h, t)),
            to_numpy(static.log_likelihood(h, t)), atol=1e-6)


def test_counts_permute_words():
    """With counts, the head equals an id-ordered head on ranked ids."""
    rng = np.random.default_rng(4)
    h = rng.normal(size=(6, D)).astype("float32")
    ranked = randomised(AdaptiveSoftmax(V, CUTOFFS, counts=COUNTS), h)
    plain = AdaptiveSoftmax(V, CUTOFFS)
    plain(h)
    plain.set_weights(
        [w for w in ranked.get_weights()[:-2]]
        + [np.arange(V, dtype="int32")] * 2)  # word_order, word_rank
    order = np.argsort(-COUNTS, kind="stable")
    np.testing.assert_allclose(
        to_numpy(ranked(h))[:, order], to_numpy(plain(h)), atol=1e-6)
    # The most frequent word is in the head cluster.
    assert int(to_numpy(ranked.word_rank)[int(np.argmax(COUNTS))]) == 0
    config = ranked.get_config()
    assert config["counts"] == [int(c) for c in COUNTS]
    assert config["cutoffs"] == CUTOFFS


def test_tail_sizes_and_capacities():
    head = AdaptiveSoftmax(V, CUTOFFS, factor=2)
    head(np.zeros((1, 16), "float32"))
    assert head.tail_dims == [8, 4] and head.tail_sizes == [8, 28]
    assert [tuple(k.shape) for k in head.tail_projections] == [(16, 8), (16, 4)]
    assert [tuple(k.shape) for k in head.tail_kernels] == [(8, 8), (4, 28)]
    assert tuple(head.head_kernel.shape) == (16, 6)
    fractions = tail_fractions(CUTOFFS, V, COUNTS)
    sorted_counts = np.sort(COUNTS)[::-1]
    np.testing.assert_allclose(
        fractions, [sorted_counts[4:12].sum() / COUNTS.sum(),
                    sorted_counts[12:].sum() / COUNTS.sum()])
    assert capacity_ladder(100, 10) == [10, 20, 40, 80, 100]
    assert capacity_ladder(8, 8) == [8]
    assert default_cutoffs(10000) == [500, 2000] and default_cutoffs(10) == [1, 2]


def test_keras_round_trip_tied():
    """A model with a tied adaptive input and output saves, loads and keeps
    the tie (the loaded head reads the loaded embedding's weights)."""
    keras.utils.set_random_seed(0)
    emb = AdaptiveEmbedding(V, D, CUTOFFS, factor=2, counts=COUNTS, name="adaptive_input")
    head = AdaptiveSoftmax(adaptive_embedding=emb, factor=2)
    tokens = keras.Input((5,), dtype="int32")
    model = keras.Model(tokens, head(keras.layers.Dense(D)(emb(tokens))))
    x = np.random.default_rng(0).integers(0, V, size=(3, 5))
    out = model.predict(x, verbose=0)
    assert head.count_params() == D * 2 + 6 + 8 + 28  # cluster kernel + biases
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adaptive.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), out)
    loaded_head = loaded.layers[-1]
    assert loaded_head.adaptive_embedding is loaded.get_layer("adaptive_input")
    # Training the tied model moves the shared tables through both uses.
    emb_config = emb.get_config()
    assert emb_config["cutoffs"] == CUTOFFS and emb_config["factor"] == 2
    clone = AdaptiveEmbedding.from_config(emb_config)
    assert clone.get_config() == emb_config


def test_adaptive_embedding_reference():
    emb = AdaptiveEmbedding(V, D, CUTOFFS, factor=2, counts=COUNTS)
    ids = np.random.default_rng(5).integers(0, V, size=(3, 7))
    out = to_numpy(emb(ids))
    assert out.shape == (3, 7, D)
    rank = np.argsort(np.argsort(-COUNTS, kind="stable"))[ids]
    tables = [to_numpy(e) for e in emb.band_embeddings]
    projections = [None] + [to_numpy(p) for p in emb.band_projections[1:]]
    bounds = [0] + CUTOFFS + [V]
    expected = np.zeros((3, 7, D))
    for i in range(3):
        inside = (rank >= bounds[i]) & (rank < bounds[i + 1])
        rows = tables[i][np.clip(rank - bounds[i], 0, bounds[i + 1] - bounds[i] - 1)]
        if projections[i] is not None:
            rows = rows @ projections[i]
        expected += np.where(inside[..., None], rows, 0.0)
    np.testing.assert_allclose(out, expected, atol=1e-6)
    assert emb.band_dims == [8, 4, 2]
    with pytest.raises(ValueError, match="targets"):
        emb(np.array([V]))


def test_registry():
    head = ksh.make_head("adaptive_softmax", 200, counts=np.arange(200, 0, -1))
    assert isinstance(head, ksh.AdaptiveSoftmax)
    assert head.cutoffs == default_cutoffs(200) == [10, 40]
    assert ksh.make_head("adaptive", 50, cutoffs=[5]).cutoffs == [5]
    assert "adaptive" in ksh.available_heads()
    from keras_softmax_heads.heads import registry

    assert not registry.supports_tying("adaptive")


def test_bad_arguments():
    for bad in ([], [0, 3], [5, 5], [3, 40], "4,12", [2.5]):
        with pytest.raises(ValueError, match=r"Received: cutoffs="):
            AdaptiveSoftmax(V, bad)
    with pytest.raises(ValueError, match=r"Received: factor=0.5"):
        AdaptiveSoftmax(V, CUTOFFS, factor=0.5)
    with pytest.raises(ValueError, match=r"Received: capacity_factor=0"):
        AdaptiveSoftmax(V, CUTOFFS, capacity_factor=0)
    with pytest.raises(ValueError, match="static_shapes='no'"):
        AdaptiveSoftmax(V, CUTOFFS, static_shapes="no")
    with pytest.raises(ValueError, match=r"Received: chunk_size=0"):
        AdaptiveSoftmax(V, CUTOFFS, chunk_size=0)
    with pytest.raises(ValueError, match=r"gradient_in_forward=True, static_shapes=True, "
                                         r"chunk_size=8"):
        AdaptiveSoftmax(V, CUTOFFS, gradient_in_forward=True, chunk_size=8)
    with pytest.raises(ValueError, match="gradient_in_forward"):
        AdaptiveSoftmax(V, CUTOFFS, gradient_in_forward="yes")
    with pytest.raises(ValueError, match="adaptive_embedding"):
        AdaptiveSoftmax(V, CUTOFFS, token_embedding=keras.layers.Embedding(V, D))
    with pytest.raises(ValueError, match="counts"):
        AdaptiveSoftmax(V, CUTOFFS, counts=np.ones(V - 1))
    emb = AdaptiveEmbedding(V, D, CUTOFFS, factor=2)
    with pytest.raises(ValueError, match=r"cutoffs=\[4, 13\]"):
        AdaptiveSoftmax(adaptive_embedding=emb, cutoffs=[4, 13], factor=2)
    with pytest.raises(ValueError, match=r"factor=4"):
        AdaptiveSoftmax(adaptive_embedding=emb)
    with pytest.raises(ValueError, match="pass `counts` to the AdaptiveEmbedding"):
        AdaptiveSoftmax(adaptive_embedding=emb, factor=2, counts=COUNTS)
    head = AdaptiveSoftmax(adaptive_embedding=emb, factor=2)
    with pytest.raises(ValueError, match="output_dim"):
        head(np.zeros((2, D + 1), "float32"))
    with pytest.raises(ValueError, match=r"Received: targets\[1\]=40"):
        AdaptiveSoftmax(V, CUTOFFS).log_likelihood(np.zeros((2, D), "float32"), [0, 40])
    if BACKEND == "jax":
        with pytest.raises(ValueError, match="JAX"):
            AdaptiveSoftmax(V, CUTOFFS, static_shapes=False)


@needs_dynamic_shapes
def test_dynamic_config_and_jit_fallback():
    head = AdaptiveSoftmax(V, CUTOFFS, static_shapes=False)
    assert head.get_config()["static_shapes"] is False
    assert head.supports_jit is False
    assert AdaptiveSoftmax.from_config(head.get_config()).static_shapes is False


@pytest.mark.skipif(BACKEND != "tensorflow", reason="one backend is enough for the smoke run")
def test_train_lm_smoke(tmp_path):
    """`examples/train_lm.py --head=adaptive`'s path: the registry gives the
    head the corpus counts (default cutoffs), untied; a few steps train."""
    from keras_softmax_heads import training

    config = training.get_config(
        head="adaptive", dataset_options=dict(
            vocab_size=40, num_train_tokens=3000, num_valid_tokens=400,
            num_test_tokens=401),
        embedding_dim=8, hidden_size=8, num_layers=1, batch_size=4, bptt=6,
        epochs=1, steps_per_epoch=3, verbose=0, num_diagnostic_contexts=50,
        tensorboard=False, validate_every_epoch=False)
    results = training.train_and_evaluate(config, str(tmp_path))
    assert np.isfinite(results["test"]["nll"])
    assert results["model"]["tied_embeddings"] is False


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a batch size unknown at trace time: "
                    "TensorFlow graphs (Keras' fit / evaluate on tf.data, a partial last batch)")
@pytest.mark.parametrize("chunk_size", [None, 16])
def test_unknown_batch_size_scores_each_token_its_own_target(chunk_size):
    """In a TensorFlow graph whose batch size is unknown (`[None, d]`, with
    and without XLA) each token gets its own target's log-likelihood and
    gradient, with head and tail words interleaved: the path read the
    scores of token `j` for the `j`-th member of a tail (104 nats off, and
    the gradients with it, whenever a tail's members were not the batch's
    first tokens)."""
    import tensorflow as tf

    V, d = 200, 8
    rng = np.random.default_rng(0)
    head = AdaptiveSoftmax(V, cutoffs=[10, 50], chunk_size=chunk_size,
                           kernel_initializer=keras.initializers.RandomNormal(stddev=3.0))
    h = tf.constant(rng.normal(size=(12, d)).astype("float32"))
    y = tf.constant([0, 60, 1, 120, 15, 2, 199, 70, 3, 11, 180, 4], "int32")
    head.build((None, d))

    def exact(x):
        return tf.gather(head.log_probs(x), y, batch_dims=1)

    for jit_compile in (False, True):
        graph = tf.function(head.log_likelihood, jit_compile=jit_compile, autograph=False,
                            input_signature=[tf.TensorSpec([None, d]),
                                             tf.TensorSpec([None], tf.int32)])
        results = []
        for fn in (lambda x: graph(x, y), exact):
            with tf.GradientTape() as tape:
                tape.watch(h)
                ll = fn(h)
                loss = -tf.reduce_sum(ll * tf.range(1.0, 13.0))  # a different weight per token
            results.append((ll.numpy(), tape.gradient(loss, h).numpy()))
        (ll, grad), (ll_ref, grad_ref) = results
        np.testing.assert_allclose(ll, ll_ref, rtol=1e-5, atol=1e-4, err_msg=str(jit_compile))
        np.testing.assert_allclose(grad, grad_ref, rtol=1e-4, atol=1e-4, err_msg=str(jit_compile))
