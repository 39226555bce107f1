"""Tests of the mixture heads: MoS, MoSS, MoS+PLIF and Mixture of Contexts."""

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import jit
from backends import to_numpy
from backends import value_and_grad
from multibackend import slow_off_tensorflow
from multibackend import sweep
from battery import HeadBattery
from references import numpy_plif

import keras_softmax_heads as ksh
from keras_softmax_heads import functional
from keras_softmax_heads.heads.mixture_of_contexts import MixtureOfContexts
from keras_softmax_heads.heads.mixture_of_softmaxes import MixtureOfSoftmaxes

pytestmark = pytest.mark.multibackend

# --------------------------------------------------------------- NumPy oracle


def np_softmax(a):
    a = a - a.max(-1, keepdims=True)
    e = np.exp(a)
    return e / e.sum(-1, keepdims=True)


def np_sigsoftmax(a):
    """`exp(a) sigmoid(a) / sum`, Kanai et al. eq. 13 (probability space)."""
    sig = 1.0 / (1.0 + np.exp(-a))
    m = a.max(-1, keepdims=True)
    unnorm = np.exp(a - m) * sig
    return unnorm / unnorm.sum(-1, keepdims=True)


def np_mixture_log_probs(head, h):
    """The papers' formulas in probability space, float64, then the log."""
    w = {v.path.split("/")[-1]: v.numpy().astype("float64") for v in head.weights}
    h = h.astype("float64")
    k, latent_dim = head.num_components, head.latent_units
    prior_logits = h @ w["prior_kernel"] + w.get("prior_bias", 0.0)
    sig = getattr(head, "component", "softmax") == "sigsoftmax"
    pi = np_sigsoftmax(prior_logits) if sig else np_softmax(prior_logits)
    latent = np.tanh(h @ w["latent_kernel"] + w.get("latent_bias", 0.0))
    latent = latent.reshape(h.shape[:-1] + (k, latent_dim))
    kernel = w["kernel"] if head.token_embedding is None else w["embeddings"].T
    bias = w.get("bias", 0.0)
    if isinstance(head, MixtureOfContexts):
        mixed = (pi[..., None] * latent).sum(-2)  # Yang et al. sec. 2.3
        return np.log(np_softmax(mixed @ kernel + bias))
    z = latent @ kernel + bias  # [..., K, V]
    if head.num_knots is not None:
        z = numpy_plif(z, w["raw_slopes"], head.knot_bound)
    comp = np_sigsoftmax(z) if sig else np_softmax(z)
    return np.log((pi[..., None] * comp).sum(-2))  # sum_k pi_k softmax_k


def randomise(head, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    for w in head.trainable_weights:
        value = w.numpy()
        w.assign((value + scale * rng.normal(size=value.shape)).astype(value.dtype))


# -------------------------------------------------------------------- battery


class TestMixtureBattery(HeadBattery):
    fit_epochs = 12  # the mixtures learn the cycle task fast; halves the time
    cases = {
        "mos": lambda v, d, **kw: MixtureOfSoftmaxes(v, num_components=3, **kw),
        "moc": lambda v, d, **kw: MixtureOfContexts(v, num_components=3, **kw),
    }

    def test_extreme_inputs(self, case):
        """Component / prior scores ~1e4 through large weights.

        The battery's version scales `h` until `logits(h)` is ~1e4, but here
        the scores are linear in a tanh-bounded latent, so scaling `h` only
        saturates the tanh. Instead, saturate the tanh (large `h`) and scale
        the output projection and the prior weights so that the component
        (MoC: mixed-context) scores and the prior logits reach ~1e4.
        """
        head = self.built(case)
        h = self.inputs() * 100.0
        target = self.extreme_scale
        z = to_numpy(head.logits(h))
        s = target / np.abs(z).max()
        head.kernel.assign(head.kernel.numpy() * s)
        head.bias.assign(head.bias.numpy() * s)
        prior_bias = 0.0 if head.prior_bias is None else head.prior_bias.numpy()
        prior = h @ head.prior_kernel.numpy() + prior_bias
        s = target / np.abs(prior).max()
        head.prior_kernel.assign(head.prior_kernel.numpy() * s)
        if head.prior_bias is not None:
            head.prior_bias.assign(prior_bias * s)
        assert np.abs(to_numpy(head.logits(h))).max() > 0.5 * target
        log_p = to_numpy(head(h))
        assert np.all(np.isfinite(log_p)), "non-finite log-probs at |score|~1e4"
        assert np.all(log_p <= 1e-5)
        assert log_p.min() < -0.1 * target  # really extreme
        lse = np.log(np.exp(log_p.astype("float64")).sum(-1))
        np.testing.assert_allclose(lse, 0.0, atol=1e-4)
        t = self.targets()
        ll = to_numpy(head.log_likelihood(h, t))
        assert np.all(np.isfinite(ll))
        expected = np.take_along_axis(log_p, t[..., None], -1)[..., 0]
        np.testing.assert_allclose(ll, expected, rtol=1e-5, atol=1e-2)
        _, _, grads = value_and_grad(
            lambda: keras.ops.sum(head.training_loss(h, t, training=False)),
            variables=head.trainable_weights,
        )
        for var, grad in zip(head.trainable_weights, grads):
            assert np.all(np.isfinite(grad)), var.path


class TestMixtureVariantsBattery(TestMixtureBattery):
    """MoSS, MoS+PLIF and the chunked losses: the full battery, but the two
    `model.fit` tests (the slowest, ~10-20 s each, and the same code path as
    MoS) run only with `-m slow`; `test_jit_compiled_gradients` below covers
    XLA for them."""

    cases = {
        "moss": lambda v, d, **kw: MixtureOfSoftmaxes(
            v, num_components=3, component="sigsoftmax", **kw
        ),
        # Glorot latents: the float32 finite differences of the piecewise
        # linear PLIF straddle a knot with the larger near-identity latents.
        # With both optional biases: the first case, so JAX and PyTorch's
        # default runs (first case only) cover them too.
        "mos_plif": lambda v, d, **kw: MixtureOfSoftmaxes(
            v, num_components=3, num_knots=16, knot_bound=4.0,
            latent_initializer="glorot_uniform", use_latent_bias=True,
            use_prior_bias=True, **kw
        ),
        # V = 13 in tiles of 5, 5 and 3.
        "moss_plif_chunked": lambda v, d, **kw: MixtureOfSoftmaxes(
            v,
            num_components=3,
            component="sigsoftmax",
            num_knots=16,
            knot_bound=4.0,
            chunk_size=5,
            use_latent_bias=True,  # the optional biases, every test
            use_prior_bias=True,
            **kw,
        ),
    }

    slow_tests = ("test_fit_reduces_loss", "test_jit_compile_fit_step")


# The chunked MoS+PLIF under `-m slow` (7-10 s on TensorFlow): the chunked
# mixture's compiled gradients are test_chunked's by default.
@pytest.mark.parametrize("kwargs", sweep(
    [{"component": "sigsoftmax", "num_knots": 8, "latent_dropout": 0.2},
     {"num_knots": 8, "chunk_size": 4}],
    keep=[{"component": "sigsoftmax", "num_knots": 8, "latent_dropout": 0.2}]))
@slow_off_tensorflow
def test_jit_compiled_gradients(kwargs):
    """Loss and gradients under XLA match the eager ones (dropout off)."""
    h = np.random.default_rng(0).normal(size=(4, 3, 5)).astype("float32")
    t = np.random.default_rng(1).integers(0, 11, size=(4, 3)).astype("int32")
    head = MixtureOfSoftmaxes(11, num_components=3, **kwargs)
    head(h)
    randomise(head)

    def loss_fn(training):
        return lambda x: keras.ops.mean(head.training_loss(x, t, training=training))

    def loss_and_grads(fn):
        loss, _, grads = value_and_grad(fn, [h], head.trainable_weights)
        return loss, grads

    eager = loss_and_grads(loss_fn(False))
    loss, grads = loss_and_grads(jit(loss_fn(False)))
    np.testing.assert_allclose(loss, eager[0], rtol=1e-5)
    for g, e in zip(grads, eager[1]):
        np.testing.assert_allclose(g, e, atol=1e-5)
    loss, grads = loss_and_grads(jit(loss_fn(True)))
    assert np.isfinite(loss)
    assert all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (MixtureOfSoftmaxes, {}),
        (MixtureOfSoftmaxes, {"component": "sigsoftmax", "use_bias": False}),
        (MixtureOfSoftmaxes, {"num_knots": 8, "knot_bound": 2.0, "tied": True}),
        (MixtureOfContexts, {"tied": True}),
    ],
)
def test_chunked_loss_matches_dense(cls, kwargs):
    """`chunk_size` changes neither the loss nor any gradient."""
    kwargs = dict(kwargs)
    h = np.random.default_rng(0).normal(size=(3, 4, 5)).astype("float32")
    t = np.random.default_rng(1).integers(0, 11, size=(3, 4)).astype("int32")
    weights = keras.ops.convert_to_tensor(
        np.random.default_rng(2).normal(size=(3, 4)), "float32")
    if kwargs.pop("tied", False):
        emb = keras.layers.Embedding(11, 5)
        dense = cls(token_embedding=emb, num_components=3, **kwargs)
        tiled = cls(token_embedding=emb, num_components=3, chunk_size=4, **kwargs)
    else:
        dense = cls(11, num_components=3, **kwargs)
        tiled = cls(11, num_components=3, chunk_size=4, **kwargs)
    dense(h)
    tiled(h)
    randomise(dense)
    tiled.set_weights(dense.get_weights())
    results = []
    for head in (dense, tiled):
        _, grad_h, grads = value_and_grad(
            lambda x: keras.ops.sum(head.training_loss(x, t) * weights),
            [h], head.trainable_weights,
        )
        results.append((to_numpy(head.training_loss(h, t)), grad_h + grads))
    np.testing.assert_allclose(results[1][0], results[0][0], atol=1e-5)
    for a, b in zip(results[1][1], results[0][1]):
        np.testing.assert_allclose(a, b, atol=1e-5)


# ------------------------------------------------------------ NumPy reference

REFERENCE_CASES = {
    "mos": dict(num_components=3),
    "mos_latent_dim": dict(num_components=4, latent_dim=3),
    "moss": dict(num_components=3, component="sigsoftmax"),
    "mos_plif": dict(num_components=3, num_knots=16, knot_bound=2.0),
    "moss_plif": dict(
        num_components=2, component="sigsoftmax", num_knots=5, knot_bound=1.5
    ),
    "mos_no_bias": dict(num_components=2, use_bias=False),
    "mos_latent_bias": dict(num_components=3, use_latent_bias=True),
    "moss_prior_bias": dict(num_components=3, component="sigsoftmax", use_prior_bias=True),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_CASES))
def test_numpy_reference_mos(name):
    h = np.random.default_rng(0).normal(size=(2, 3, 5)).astype("float32")
    head = MixtureOfSoftmaxes(11, **REFERENCE_CASES[name])
    head(h)
    randomise(head)
    out = to_numpy(head(h))
    np.testing.assert_allclose(out, np_mixture_log_probs(head, h), atol=1e-5)
    if head.num_knots is not None:  # the PLIF pieces are really exercised
        z = to_numpy(head.logits(h))
        assert (z < -head.knot_bound).any() and (z > -head.knot_bound + 1).any()


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"latent_dim": 3, "use_bias": False},
     {"use_latent_bias": True, "use_prior_bias": True}],
)
def test_numpy_reference_moc(kwargs):
    h = np.random.default_rng(0).normal(size=(2, 3, 5)).astype("float32")
    head = MixtureOfContexts(11, num_components=3, **kwargs)
    head(h)
    randomise(head)
    np.testing.assert_allclose(
        to_numpy(head(h)), np_mixture_log_probs(head, h), atol=1e-5
    )


def test_numpy_reference_tied_embedding():
    """d != embedding dim is fine when latent_dim matches the embedding."""
    emb = keras.layers.Embedding(11, 3)
    head = MixtureOfSoftmaxes(token_embedding=emb, num_components=2, latent_dim=3)
    h = np.random.default_rng(1).normal(size=(4, 6)).astype("float32")
    head(h)
    randomise(head)
    assert head.kernel is None
    assert emb.embeddings.path in [w.path for w in head.trainable_weights]
    np.testing.assert_allclose(
        to_numpy(head(h)), np_mixture_log_probs(head, h), atol=1e-5
    )


# --------------------------------------------------------- property tests


@pytest.mark.parametrize("use_latent_bias", [False, True])
def test_single_component_is_full_softmax_on_the_latent(use_latent_bias):
    """MoS and MoC with K = 1 are Linear-Softmax on tanh(h W_1 [+ b_1])."""
    h = np.random.default_rng(0).normal(size=(6, 5)).astype("float32")
    full = ksh.FullSoftmax(11)
    full(np.zeros((1, 5), "float32"))
    for cls in (MixtureOfSoftmaxes, MixtureOfContexts):
        head = cls(11, num_components=1, use_latent_bias=use_latent_bias)
        head(h)
        randomise(head)
        pre = h @ head.latent_kernel.numpy()
        if use_latent_bias:
            pre = pre + head.latent_bias.numpy()
        else:
            assert head.latent_bias is None
        latent = np.tanh(pre)
        full.kernel.assign(head.kernel.numpy())
        full.bias.assign(head.bias.numpy())
        np.testing.assert_allclose(
            to_numpy(head(h)), to_numpy(full(latent)), atol=1e-5
        )


def test_untrained_plif_equals_mos():
    """Identity-initialised PLIF: MoS+PLIF == MoS with the same weights,
    including scores far outside the knot range [-T, T]."""
    h = np.random.default_rng(0).normal(size=(4, 3, 5)).astype("float32")
    mos = MixtureOfSoftmaxes(11, num_components=3)
    plif = MixtureOfSoftmaxes(11, num_components=3, num_knots=16, knot_bound=1.0)
    mos(h)
    plif(h)
    randomise(mos, scale=1.0)
    for w in mos.weights:
        dict((v.path.split("/")[-1], v) for v in plif.weights)[
            w.path.split("/")[-1]
        ].assign(w.numpy())
    z = to_numpy(mos.logits(h))
    assert np.abs(z).max() > 2.0  # some scores lie outside [-1, 1]
    np.testing.assert_allclose(to_numpy(plif(h)), to_numpy(mos(h)), atol=1e-5)
    np.testing.assert_allclose(
        plif.raw_slopes.numpy(), functional.plif_identity_raw_slope(), rtol=1e-6
    )


def test_component_log_probs_and_logits():
    h = np.random.default_rng(0).normal(size=(2, 3, 5)).astype("float32")
    head = MixtureOfSoftmaxes(11, num_components=4, component="sigsoftmax")
    log_pi, comp = (to_numpy(x).astype("float64") for x in head.component_log_probs(h))
    assert log_pi.shape == (2, 3, 4) and comp.shape == (2, 3, 4, 11)
    np.testing.assert_allclose(np.exp(log_pi).sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.exp(comp).sum(-1), 1.0, atol=1e-5)
    mixture = np.log((np.exp(log_pi)[..., None] * np.exp(comp)).sum(-2))
    np.testing.assert_allclose(to_numpy(head(h)), mixture, atol=1e-5)
    assert tuple(head.logits(h).shape) == (2, 3, 4, 11)
    moc = MixtureOfContexts(11, num_components=4)
    assert tuple(moc.logits(h).shape) == (2, 3, 11)


def test_log_likelihood_is_log_space_for_tiny_probabilities():
    """Targets with p < 1e-45 (below float32's smallest subnormal, log p <
    -103.3) get their exact log-probability, not -inf: the mixture is a
    log-sum-exp."""
    h = np.random.default_rng(0).normal(size=(3, 5)).astype("float32")
    head = MixtureOfSoftmaxes(11, num_components=3)
    head(h)
    head.kernel.assign(head.kernel.numpy() * 300.0)
    log_p = to_numpy(head(h))
    t = np.argmin(log_p, -1).astype("int32")
    ll = to_numpy(head.log_likelihood(h, t))
    assert np.all(np.isfinite(ll)) and ll.min() < -104
    np.testing.assert_allclose(ll, log_p.min(-1), rtol=1e-5)


@pytest.mark.parametrize("cls", [MixtureOfSoftmaxes, MixtureOfContexts])
def test_dropout_only_in_training(cls):
    h = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    t = np.arange(4, dtype="int32")
    head = cls(11, num_components=3, latent_dropout=0.5, seed=3)
    infer = to_numpy(head(h))
    np.testing.assert_array_equal(to_numpy(head(h, training=False)), infer)
    np.testing.assert_array_equal(to_numpy(head.log_probs(h)), infer)
    train = to_numpy(head(h, training=True))
    assert np.abs(train - infer).max() > 1e-3
    np.testing.assert_allclose(np.exp(train).sum(-1), 1.0, atol=1e-5)
    ll = to_numpy(head.log_likelihood(h, t))
    np.testing.assert_allclose(
        to_numpy(head.training_loss(h, t, training=False)), -ll, atol=1e-6
    )
    assert np.abs(to_numpy(head.training_loss(h, t)) + ll).max() > 1e-3
    if BACKEND == "tensorflow":
        # A tf.function under XLA reads and advances the seed state: the
        # dropout still differs between steps and from inference. (A jitted
        # JAX function is pure: Keras' fit threads the state through it.)
        step = jit(lambda: head.training_loss(h, t, training=True))
        first, second = to_numpy(step()), to_numpy(step())
        assert np.all(np.isfinite(first)) and np.abs(first - second).max() > 1e-3
        assert np.abs(first + ll).max() > 1e-3
    # Without dropout, training makes no difference.
    plain = cls(11, num_components=3)
    np.testing.assert_array_equal(
        to_numpy(plain(h, training=True)), to_numpy(plain(h))
    )
    # Keras passes `training` through a model.
    inputs = keras.Input((5,))
    model = keras.Model(inputs, head(inputs))
    np.testing.assert_allclose(model.predict(h, verbose=0), infer, atol=1e-6)
    assert np.abs(to_numpy(model(h, training=True)) - infer).max() > 1e-3


BAD_ARGUMENTS = [
    ("num_components", 0),
    ("num_components", 2.5),
    ("latent_dim", 0),
    ("latent_dim", -3),
    ("latent_dropout", 1.0),
    ("latent_dropout", -0.1),
    ("component", "sparsemax"),
    ("num_knots", 0),
    ("num_knots", 3.5),
    ("knot_bound", 0.0),
    ("knot_bound", -2.0),
    ("use_latent_bias", "yes"),
    ("use_latent_bias", 1),
    ("use_prior_bias", "no"),
    ("use_prior_bias", 0),
]


def test_bad_arguments():
    """Every bad constructor argument raises ValueError echoing the value."""
    shared = ("num_components", "latent_dim", "latent_dropout", "use_latent_bias",
              "use_prior_bias")
    for name, value in BAD_ARGUMENTS:
        classes = [MixtureOfSoftmaxes]
        if name in shared:
            classes.append(MixtureOfContexts)
        for cls in classes:
            with pytest.raises(ValueError, match=f"Received: {name}={value!r}"):
                cls(11, **{name: value})


@pytest.mark.parametrize("cls", [MixtureOfSoftmaxes, MixtureOfContexts])
def test_tied_embedding_latent_dim_mismatch(cls):
    emb = keras.layers.Embedding(11, 6)
    with pytest.raises(ValueError, match="latent_dim=4"):
        cls(token_embedding=emb, latent_dim=4)
    # latent_dim defaults to d (5 here) != output_dim 6: clear error at build.
    head = cls(token_embedding=emb)
    with pytest.raises(ValueError, match="output_dim=6.*latent_dim=6"):
        head(np.zeros((2, 5), "float32"))


@pytest.mark.parametrize("cls", [MixtureOfSoftmaxes, MixtureOfContexts])
@pytest.mark.parametrize("bias, shape", [("latent_bias", (2 * 5,)), ("prior_bias", (2,))])
def test_biases_are_off_by_default_and_on_for_old_configs(cls, bias, shape):
    """The default latents and priors are the papers' `tanh(h W_k)` and
    `softmax(h W_pi)`: no `latent_bias` / `prior_bias` variable, and the
    config says so. A config without `use_latent_bias` / `use_prior_bias`
    (written before the option existed, when every mixture had the bias:
    `use_latent_bias` by 0.3.0 and before) builds a head with it, so old
    files load their trained bias."""
    option = "use_" + bias
    h = np.zeros((2, 5), "float32")
    head = cls(11, num_components=2)
    head(h)
    assert getattr(head, bias) is None
    assert bias not in [w.path.split("/")[-1] for w in head.weights]
    config = head.get_config()
    assert config[option] is False
    assert getattr(cls.from_config(config), option) is False
    del config[option]
    old = cls.from_config(config)
    old(h)
    assert getattr(old, option) is True
    assert tuple(getattr(old, bias).shape) == shape
