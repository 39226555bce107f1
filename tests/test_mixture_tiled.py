"""The mixtures' default tiled training loss, their unigram bias, and the
platform's tile width (`chunked.platform`), on every backend."""

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import jit
from backends import to_numpy
from backends import value_and_grad

from keras_softmax_heads import FullSoftmax
from keras_softmax_heads import MixtureOfContexts
from keras_softmax_heads import MixtureOfSoftmaxes
from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import chunked_mixture_nll
from keras_softmax_heads.chunked import chunked_pointwise_nll
from keras_softmax_heads.chunked.platform import ACCELERATOR_TILE_ELEMENTS
from keras_softmax_heads.chunked.platform import chunk_size_for
from keras_softmax_heads.platforms import current_platform
from keras_softmax_heads.platforms import forced_platform

pytestmark = pytest.mark.multibackend

V = 11


def fresh(cls, like=None, **kwargs):
    """A built head; with non-trivial random weights, or `like`'s."""
    head = cls(V, num_components=3, **kwargs)
    head.build((None, 5))
    if like is not None:
        head.set_weights(like.get_weights())
        return head
    rng = np.random.default_rng(3)
    for w in head.weights:
        w.assign(to_numpy(w) + rng.normal(scale=0.5, size=w.shape).astype("float32"))
    return head


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (MixtureOfSoftmaxes, {}),
        (MixtureOfSoftmaxes, {"component": "sigsoftmax", "num_knots": 6, "knot_bound": 2.0}),
        (MixtureOfContexts, {}),
    ],
)
def test_default_tiled_loss_matches_dense(cls, kwargs):
    """The default training loss (tiled) equals the `[N, K, V]` reference
    (`dense_log_likelihood`) in value and in every gradient. (Several
    tiles: `test_mixture.py::test_chunked_loss_matches_dense`; under jit:
    `test_mixture.py::test_jit_compiled_gradients`, whose heads now take
    this default path.)"""
    h = np.random.default_rng(0).normal(size=(3, 4, 5)).astype("float32")
    t = np.random.default_rng(1).integers(0, V, size=(3, 4)).astype("int32")
    weights = keras.ops.convert_to_tensor(
        np.random.default_rng(2).normal(size=(3, 4)).astype("float32"))
    results, base = [], fresh(cls, **kwargs)
    for chunk_size, dense in ((None, True), (None, False)):
        head = fresh(cls, like=base, chunk_size=chunk_size, **kwargs)

        def loss(x, head=head, dense=dense):
            ll = head.dense_log_likelihood(x, t) if dense else -head.training_loss(x, t)
            return keras.ops.sum(ll * weights)

        # JAX: compiled once, not op by op (eager JAX compiles every op).
        fn = jit(loss) if BACKEND == "jax" else loss
        value, grad_h, grads = value_and_grad(fn, [h], head.trainable_weights)
        results.append((value, grad_h + grads))
    reference = results[0]
    for value, grads in results[1:]:
        np.testing.assert_allclose(value, reference[0], atol=1e-5)
        for a, b in zip(grads, reference[1]):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_mixture_nll_default_width_is_the_platform_choice():
    """`chunked_mixture_nll` without `chunk_size` tiles `[N K, V]` like an
    explicit `chunk_size_for(V, components=K)`, and a forced GPU (one tile
    here) gives the same values: every platform's width is exact."""
    rng = np.random.default_rng(0)
    lat = rng.normal(size=(6, 40, 4)).astype("float32")  # K = 40: width 102
    log_pi = keras.ops.log_softmax(rng.normal(size=(6, 40)).astype("float32"), axis=-1)
    w = rng.normal(size=(4, 300)).astype("float32")
    t = rng.integers(0, 300, size=6)
    assert chunk_size_for(300, components=40, platform="cpu") == DEFAULT_CHUNK_SIZE // 40
    default = to_numpy(chunked_mixture_nll(lat, log_pi, w, None, t))
    explicit = to_numpy(chunked_mixture_nll(
        lat, log_pi, w, None, t, chunk_size=DEFAULT_CHUNK_SIZE // 40))
    with forced_platform("gpu"):
        gpu = to_numpy(chunked_mixture_nll(lat, log_pi, w, None, t))
    np.testing.assert_array_equal(default, explicit)
    np.testing.assert_allclose(gpu, default, rtol=1e-5)


def test_forced_platform_picks_the_path():
    """A forced "gpu" / "tpu" picks the accelerator's wide tiles (one tile
    when it fits, no loop); the CPU default is today's `DEFAULT_CHUNK_SIZE`
    and `chunked_pointwise_nll`'s default equals it exactly."""
    assert current_platform() == "cpu"  # the test machines
    assert chunk_size_for(33_278) == DEFAULT_CHUNK_SIZE
    assert chunk_size_for(33_278, components=15) == DEFAULT_CHUNK_SIZE // 15
    with forced_platform("gpu"):
        assert current_platform() == "gpu"
        assert chunk_size_for(33_278, rows=4096) == 33_278  # one tile
        rows = 15 * 8192
        assert chunk_size_for(33_278, rows=rows, components=15) == (
            ACCELERATOR_TILE_ELEMENTS // rows)
        with forced_platform("tpu"):
            assert current_platform() == "tpu"
    assert current_platform() == "cpu"
    with pytest.raises(ValueError, match="`platform` must be"):
        with forced_platform("fpga"):
            pass
    rng = np.random.default_rng(0)
    h = rng.normal(size=(5, 3)).astype("float32")
    w = rng.normal(size=(3, 9000)).astype("float32")
    t = rng.integers(0, 9000, size=5)
    np.testing.assert_array_equal(
        to_numpy(chunked_pointwise_nll(h, w, None, t)),
        to_numpy(chunked_pointwise_nll(h, w, None, t, chunk_size=DEFAULT_CHUNK_SIZE)))


MIXTURES = {  # MoSS first: the case run on JAX and PyTorch by default
    "moss": (MixtureOfSoftmaxes, {"component": "sigsoftmax"}),
    "mos": (MixtureOfSoftmaxes, {}),
    "mos_plif": (MixtureOfSoftmaxes, {"num_knots": 20}),
    "moss_plif": (MixtureOfSoftmaxes, {"component": "sigsoftmax", "num_knots": 20}),
    "moc": (MixtureOfContexts, {}),
}
COUNTS = np.array([5, 0, 3, 100, 1, 1, 7, 0, 2, 9, 40])
UNIGRAM = (COUNTS + 1.0) / (COUNTS + 1.0).sum()


@pytest.mark.parametrize("variant", list(MIXTURES))
def test_unigram_bias_starts_every_mixture_at_the_unigram(variant):
    """With `counts`, the `"unigram"` bias makes the untrained mixture the
    smoothed unigram wherever the latent vectors are zero (h = 0): every
    component's distribution, softmax or sigsoftmax, is the unigram.
    Without counts, the bias is zeros."""
    cls, options = MIXTURES[variant]
    head = cls(V, num_components=2, counts=COUNTS, bias_initializer="unigram", **options)
    h = np.zeros((3, 4), "float32")
    np.testing.assert_allclose(np.exp(to_numpy(head(h))), np.broadcast_to(UNIGRAM, (3, V)),
                               rtol=1e-5)
    if variant == "mos" or variant == "moc":
        # ... which for softmax components is the log unigram, as a
        # FullSoftmax given the same start has it.
        full = FullSoftmax(V, bias_initializer=keras.initializers.Constant(np.log(UNIGRAM)))
        full.build((None, 4))
        np.testing.assert_allclose(to_numpy(head.bias), to_numpy(full.bias), rtol=1e-6)
    bare = cls(V, num_components=2, **options)
    bare.build((None, 4))
    np.testing.assert_array_equal(to_numpy(bare.bias), np.zeros(V))


def test_sigsoftmax_unigram_bias_has_the_zero_starts_level():
    """A sigsoftmax component is not shift-invariant: of the biases that
    give the unigram, `"unigram"` takes the one whose scores
    `exp(b) sigmoid(b)` sum to `V / 2`, as the zero bias's do; uniform
    counts give the zero bias itself, and a word of average frequency
    `b = 0`."""
    head = MixtureOfSoftmaxes(V, component="sigsoftmax", counts=COUNTS,
                              bias_initializer="unigram")
    head.build((None, 4))
    b = to_numpy(head.bias).astype("float64")
    scores = np.exp(b) / (1.0 + np.exp(-b))
    np.testing.assert_allclose(scores / scores.sum(), UNIGRAM, rtol=1e-5)
    np.testing.assert_allclose(scores.sum(), V / 2.0, rtol=1e-5)
    # Below-average words negative, above-average positive.
    np.testing.assert_array_equal(np.sign(b), np.sign(UNIGRAM - 1.0 / V))
    uniform = MixtureOfSoftmaxes(V, component="sigsoftmax", counts=np.full(V, 3),
                                 bias_initializer="unigram")
    uniform.build((None, 4))
    np.testing.assert_allclose(to_numpy(uniform.bias), np.zeros(V), atol=1e-6)


@pytest.mark.parametrize("variant", list(MIXTURES))
def test_default_bias(variant):
    """The default start is `"unigram"` for every mixture (`None` too);
    the config keeps it."""
    cls, options = MIXTURES[variant]
    head = cls(V, num_components=2, counts=COUNTS, **options)
    head.build((None, 4))
    explicit = cls(V, num_components=2, counts=COUNTS, bias_initializer="unigram", **options)
    explicit.build((None, 4))
    np.testing.assert_array_equal(to_numpy(head.bias), to_numpy(explicit.bias))
    if cls is MixtureOfSoftmaxes:
        none = cls(V, num_components=2, counts=COUNTS, bias_initializer=None, **options)
        none.build((None, 4))
        np.testing.assert_array_equal(to_numpy(none.bias), to_numpy(head.bias))
    if options.get("component") != "sigsoftmax":
        np.testing.assert_allclose(to_numpy(head.bias), np.log(UNIGRAM), rtol=1e-6, atol=0)
    again = cls.from_config(head.get_config())
    again.build((None, 4))
    np.testing.assert_array_equal(to_numpy(again.bias), to_numpy(head.bias))


def test_moss_log_unigram_bias_is_the_sharper_start():
    """Negative control: the log unigram as a sigsoftmax bias (MoSS's start
    from f60c2c2 to the fix, which stalled on PTB) is the unigram squared,
    renormalised, far from the unigram; the test above catches it."""
    head = MixtureOfSoftmaxes(V, num_components=2, component="sigsoftmax",
                              bias_initializer=keras.initializers.Constant(np.log(UNIGRAM)))
    p = np.exp(to_numpy(head(np.zeros((1, 4), "float32"))))[0]
    sharp = UNIGRAM * UNIGRAM / (1.0 + UNIGRAM)
    np.testing.assert_allclose(p, sharp / sharp.sum(), rtol=1e-5)
    assert np.abs(p - UNIGRAM).max() > 0.1
