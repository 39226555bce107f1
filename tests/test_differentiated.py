import os
import tempfile

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import jit
from backends import to_numpy
from backends import value_and_grad
from multibackend import sweep
from multibackend import slow_on
from battery import HeadBattery
from keras import ops
from references import numpy_log_softmax

from keras_softmax_heads.heads.differentiated_softmax import DifferentiatedSoftmax
from keras_softmax_heads.heads.differentiated_softmax import default_bands

pytestmark = pytest.mark.multibackend

V, D = 13, 6
# Not sorted by id: the frequency ranking is a real permutation.
COUNTS = np.array([3, 90, 1, 20, 50, 2, 9, 30, 1, 7, 12, 5, 4])


class TestDifferentiatedBattery(HeadBattery):
    cases = {
        # Three bands of widths 3, 2, 1 over 2 + 4 + 7 words.
        "three_bands": lambda v, d, **kw: DifferentiatedSoftmax(
            v, bands=[(2, 3), (4, 2), (7, 1)], counts=COUNTS, **kw
        ),
        # The same, chunked exact loss (tiles of 3 words: no band is a multiple).
        "three_bands_chunked": lambda v, d, **kw: DifferentiatedSoftmax(
            v, bands=[(2, 3), (4, 2), (7, 1)], counts=COUNTS, chunk_size=3, **kw
        ),
        # Default bands (paper's ratios), no counts (rank = id), no bias.
        "default_no_bias": lambda v, d, **kw: DifferentiatedSoftmax(
            v, use_bias=False, **kw
        ),
    }

    def test_tied_embedding(self, case):
        """Not supported (per-band widths): a clear error instead."""
        emb = keras.layers.Embedding(self.vocab_size, self.input_dim)
        with pytest.raises(ValueError, match="does not support weight tying"):
            self.cases[case](None, None, token_embedding=emb)


def numpy_reference(h, bands, counts, kernels, bias):
    """Block-diagonal output matrix in rank order, then one softmax over V."""
    order = np.argsort(-counts, kind="stable")
    h = h.astype("float64")
    z = np.zeros(h.shape[:-1] + (len(counts),))
    feature, word = 0, 0
    for (n, dim), kernel in zip(bands, kernels):
        words = order[word : word + n]
        z[..., words] = h[..., feature : feature + dim] @ kernel + bias[words]
        feature += dim
        word += n
    return numpy_log_softmax(z)


def randomised(head, h, seed=0):
    head(h)
    rng = np.random.default_rng(seed)
    for w in head.trainable_weights:
        w.assign(rng.normal(size=w.shape).astype("float32"))
    return head


@pytest.mark.parametrize(
    "bands", [[(2, 3), (4, 2), (7, 1)], [(5, 4), (8, 2)], [(13, 6)]], ids=["3", "2", "1"]
)
def test_numpy_reference(bands):
    rng = np.random.default_rng(0)
    h = rng.normal(size=(4, 5, D)).astype("float32")
    head = randomised(DifferentiatedSoftmax(V, bands=bands, counts=COUNTS), h)
    kernels = [k.numpy() for k in head.band_kernels]
    expected = numpy_reference(h, bands, COUNTS, kernels, head.bias.numpy())
    np.testing.assert_allclose(to_numpy(head(h)), expected, atol=1e-5)
    jitted = jit(head.log_probs)
    np.testing.assert_allclose(to_numpy(jitted(h)), expected, atol=1e-5)
    t = rng.integers(0, V, size=(4, 5))
    np.testing.assert_allclose(
        to_numpy(head.log_likelihood(h, t)),
        np.take_along_axis(expected, t[..., None], -1)[..., 0],
        atol=1e-5,
    )
    # The dense equivalent matrix is block diagonal in rank order.
    dense = to_numpy(head.output_kernel())
    z = h @ dense + head.bias.numpy()
    np.testing.assert_allclose(to_numpy(head.logits(h)), z, atol=1e-5)
    np.testing.assert_allclose(numpy_log_softmax(z), expected, atol=1e-5)


def test_band_structure_follows_frequency():
    head = DifferentiatedSoftmax(V, bands=[(2, 3), (4, 2), (7, 1)], counts=COUNTS)
    h = np.random.default_rng(0).normal(size=(3, D)).astype("float32")
    head(h)
    assert [tuple(k.shape) for k in head.band_kernels] == [(3, 2), (2, 4), (1, 7)]
    order = head.word_order.numpy()
    assert order[:2].tolist() == [1, 4]  # the two most frequent words
    assert order[2:6].tolist() == [7, 3, 10, 6]
    np.testing.assert_array_equal(head.word_rank.numpy()[order], np.arange(V))
    # A rare word's score depends only on the last slice of h.
    z = to_numpy(head.logits(h))
    h2 = h.copy()
    h2[:, :5] += 1.0
    z2 = to_numpy(head.logits(h2))
    rare = order[6:]
    np.testing.assert_allclose(z2[:, rare], z[:, rare], atol=1e-6)
    assert not np.allclose(z2[:, order[:6]], z[:, order[:6]])


def test_default_bands():
    assert default_bands(793_471, 1600) == [[50000, 1024], [100000, 512], [643471, 64]]
    assert default_bands(13, 6) == [[1, 3], [2, 2], [10, 1]]
    assert default_bands(2, 6) == [[2, 6]]
    assert default_bands(100, 2) == [[100, 2]]
    for vocab in [3, 4, 17, 100, 1000, 100_000]:
        for dim in [3, 4, 7, 64, 512]:
            bands = default_bands(vocab, dim)
            assert sum(n for n, _ in bands) == vocab
            assert sum(d for _, d in bands) == dim
            assert all(n >= 1 and d >= 1 for n, d in bands)
    head = DifferentiatedSoftmax(100)
    head(np.zeros((2, 512), "float32"))
    assert head.band_dims == [328, 164, 20]
    assert head.band_sizes == [6, 13, 81]
    assert head.get_config()["bands"] is None


def test_fewer_multiply_adds_than_full_softmax():
    head = DifferentiatedSoftmax(1000)
    head(np.zeros((1, 64), "float32"))
    params = sum(int(np.prod(k.shape)) for k in head.band_kernels)
    assert params < 0.15 * 1000 * 64  # ~11% of the dense [d, V] kernel


def test_keras_round_trip_keeps_permutation():
    rng = np.random.default_rng(0)
    head = DifferentiatedSoftmax(V, bands=[(3, 4), (10, 2)], counts=COUNTS)
    inputs = keras.Input((D,))
    model = keras.Model(inputs, head(inputs))
    h = rng.normal(size=(7, D)).astype("float32")
    randomised(head, h)
    # The ranking as counts `V - rank`: the same permutation, exactly.
    ranks = head.get_config()["counts"]
    np.testing.assert_array_equal(np.argsort(-np.array(ranks), kind="stable"),
                                  head.word_order.numpy())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dsm.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    loaded_head = loaded.layers[-1]
    assert loaded_head is not head
    np.testing.assert_array_equal(loaded_head.word_order.numpy(), head.word_order.numpy())
    assert loaded_head.word_order.numpy().tolist() != list(range(V))
    np.testing.assert_array_equal(loaded.predict(h, verbose=0), model.predict(h, verbose=0))


# ----------------------------------------------------------------- bad input
def test_bands_must_cover_vocabulary():
    with pytest.raises(ValueError, match=r"cover 2 \+ 4 \+ 6 = 12 words, vocab_size=13"):
        DifferentiatedSoftmax(V, bands=[(2, 3), (4, 2), (6, 1)])
    with pytest.raises(ValueError, match=r"cover 10 \+ 4 = 14 words"):
        DifferentiatedSoftmax(V, bands=[(10, 3), (4, 2)])
    with pytest.raises(ValueError, match=r"bands\[1\]=\(4, 0\)"):
        DifferentiatedSoftmax(V, bands=[(9, 3), (4, 0)])
    with pytest.raises(ValueError, match=r"bands\[0\]=\(13,\)"):
        DifferentiatedSoftmax(V, bands=[(13,)])
    with pytest.raises(ValueError, match="non-empty list"):
        DifferentiatedSoftmax(V, bands=[])
    with pytest.raises(ValueError, match="non-empty list"):
        DifferentiatedSoftmax(V, bands=np.zeros((0, 2), "int64"))
    # A NumPy array of pairs is a list of pairs (it raised NumPy's "truth
    # value of an array is ambiguous"); the config holds Python ints.
    head = DifferentiatedSoftmax(V, bands=np.array([[3, 4], [10, 2]]))
    assert head.get_config()["bands"] == [[3, 4], [10, 2]]


def test_band_dims_must_fit_context():
    head = DifferentiatedSoftmax(V, bands=[(3, 4), (10, 3)])
    with pytest.raises(ValueError, match=r"band dims 4 \+ 3 = 7, but the context vectors have d=6"):
        head(np.zeros((2, D), "float32"))
    head = DifferentiatedSoftmax(V, bands=[(3, 2), (10, 3)])
    with pytest.raises(ValueError, match=r"2 \+ 3 = 5, but .* d=6"):
        head(np.zeros((2, D), "float32"))


def test_bad_counts():
    with pytest.raises(ValueError, match=r"counts.shape=\(12,\), vocab_size=13"):
        DifferentiatedSoftmax(V, counts=COUNTS[:12])
    bad = COUNTS.astype("float64")
    bad[3] = -1.5
    with pytest.raises(ValueError, match=r"counts\[3\]=-1.5"):
        DifferentiatedSoftmax(V, counts=bad)
    bad[3] = np.nan
    with pytest.raises(ValueError, match=r"counts\[3\]=nan"):
        DifferentiatedSoftmax(V, counts=bad)


def test_bad_targets():
    head = DifferentiatedSoftmax(V, counts=COUNTS)
    h = np.zeros((2, D), "float32")
    with pytest.raises(ValueError,
                       match=r"vocab_size=13\)\. Received: targets\[1\]=13 \(1 of 2"):
        head.log_likelihood(h, np.array([0, 13]))
    with pytest.raises(ValueError, match=r"targets\[0\]=-1"):
        head.training_loss(h, np.array([-1, 0]))
    if BACKEND != "torch":  # values unknown under XLA: NaN
        out = to_numpy(jit(head.log_likelihood)(h, np.array([0, 13], "int32")))
        assert np.isfinite(out[0]) and np.isnan(out[1])


# Tiles of one word under -m slow (test time): 3 leaves ragged tiles, 64 one
# tile; under XLA (4-7 s a case on TensorFlow) ragged tiles with a bias.
@pytest.mark.parametrize("mode,chunk_size,use_bias", sweep(
    [(mode, chunk, bias) for mode in ("xla", "eager") for chunk in (3, 64, 1)
     for bias in (True, False)],
    keep=[("xla", 3, True)] + [("eager", c, b) for c in (3, 64) for b in (True, False)]))
# JAX under `-m slow` (13 s): the chunked core's JAX path is test_chunked's there.
@slow_on("jax")
def test_chunked_matches_dense(use_bias, chunk_size, mode):
    """Loss and every gradient (h, band kernels, bias) equal the dense path."""
    rng = np.random.default_rng(3)
    bands = [(2, 3), (4, 2), (7, 1)]
    h = rng.normal(size=(5, 7, D)).astype("float32") * 3.0
    t = rng.integers(0, V, size=(5, 7))
    dense = randomised(
        DifferentiatedSoftmax(V, bands=bands, counts=COUNTS, use_bias=use_bias), h
    )
    chunked = DifferentiatedSoftmax(
        V, bands=bands, counts=COUNTS, use_bias=use_bias, chunk_size=chunk_size
    )
    chunked(h)
    chunked.set_weights(dense.get_weights())

    weights = ops.convert_to_tensor(np.arange(35.0, dtype="float32").reshape(5, 7))

    def loss_and_grads(head):
        def fn(x):
            return ops.sum(head.training_loss(x, t) * weights)

        loss, grad_h, grads = value_and_grad(
            jit(fn) if mode == "xla" else fn, [h], head.trainable_weights
        )
        return loss, grad_h + grads

    ref_loss, ref_grads = loss_and_grads(dense)
    loss, grads = loss_and_grads(chunked)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        to_numpy(chunked.log_likelihood(h, t)), to_numpy(dense.log_likelihood(h, t)),
        atol=1e-5,
    )


def test_chunk_size_validation_and_config():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            DifferentiatedSoftmax(V, chunk_size=bad)
    head = DifferentiatedSoftmax(V, chunk_size=4)
    assert head.get_config()["chunk_size"] == 4
    assert DifferentiatedSoftmax.from_config(head.get_config()).chunk_size == 4
