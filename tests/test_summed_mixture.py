"""The mixtures' summed training objective with its gradient in the forward
pass (`gradient_in_forward=True`, `chunked.summed_mixture`): equal to the
tiled per-token loss in value and gradients, and the same training step
through `HeadModel` and `HeadLoss`, on every backend."""

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import count_calls
from backends import jit
from backends import to_numpy
from backends import torch_flops
from backends import value_and_grad

from keras_softmax_heads import HeadLoss
from keras_softmax_heads import HeadModel
from keras_softmax_heads import MixtureOfSoftmaxes
from keras_softmax_heads.chunked import chunked_mixture_nll
from keras_softmax_heads.chunked.summed_mixture import summed_mixture_nll

pytestmark = pytest.mark.multibackend

V = 13


def numpy_nll(lat, log_pi, w, b, t, sigsoftmax=False):
    """The mixture NLL per token from the `[N, K, V]` scores, in float64."""
    z = np.einsum("nkd,dv->nkv", lat.astype("float64"), w.astype("float64"))
    if b is not None:
        z = z + b
    if sigsoftmax:
        z = z - np.logaddexp(0.0, -z)
    log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
    joint = log_pi[:, :, None] + log_p
    m = joint.max(1)
    mix = m + np.log(np.exp(joint - m[:, None]).sum(1))
    return -mix[np.arange(len(t)), t]


@pytest.mark.parametrize("sigsoftmax,transposed,bias", [
    (False, False, True), (True, True, False)])
def test_core_matches_numpy_and_tiled_gradients(sigsoftmax, transposed, bias):
    """`summed_mixture_nll` over chunks of 4 tokens (11 tokens: a padded
    last chunk) equals the NumPy oracle, and its gradients (latents,
    priors, kernel, bias, weights) equal those of the tiled per-token
    `chunked_mixture_nll` weighted and summed; weight-0 tokens add nothing."""
    rng = np.random.default_rng(0)
    n, k, d = 11, 3, 5
    lat = np.tanh(rng.normal(size=(n, k, d))).astype("float32")
    prior_logits = rng.normal(size=(n, k))
    log_pi = (prior_logits - np.log(np.exp(prior_logits).sum(1, keepdims=True)))
    log_pi = log_pi.astype("float32")
    w = rng.normal(size=(d, V)).astype("float32")
    b = rng.normal(size=(V,)).astype("float32") if bias else None
    t = rng.integers(0, V, size=n).astype("int32")
    weights = rng.uniform(0.2, 2.0, size=n).astype("float32")
    weights[3] = 0.0
    kernel = w.T.copy() if transposed else w
    transform = None
    if sigsoftmax:
        def transform(z):
            return z - keras.ops.softplus(-z)

    oracle = (weights * numpy_nll(lat, log_pi, w, b, t, sigsoftmax)).sum()
    variables = [keras.Variable(kernel)] + ([keras.Variable(b)] if bias else [])

    def summed(lat, log_pi, weights):
        return summed_mixture_nll(lat, log_pi, variables[0], variables[1] if bias else None,
                                  t, weights,
                                  output_fn="sigsoftmax" if sigsoftmax else "softmax",
                                  kernel_transposed=transposed, token_chunk_size=4)

    def tiled(lat, log_pi, weights):
        nll = chunked_mixture_nll(lat, log_pi, variables[0], variables[1] if bias else None,
                                  t, transform_fn=transform, chunk_size=5,
                                  kernel_transposed=transposed)
        return keras.ops.sum(nll * weights)

    results = []
    for fn in (summed, tiled):
        fn = jit(fn) if BACKEND == "jax" else fn
        results.append(value_and_grad(fn, [lat, log_pi, weights], variables))
    (value, grads_in, grads_w), (ref, ref_in, ref_w) = results
    np.testing.assert_allclose(value, oracle, rtol=1e-5)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    for a, r in zip(list(grads_in) + list(grads_w), list(ref_in) + list(ref_w)):
        np.testing.assert_allclose(a, r, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(to_numpy(grads_in[0])[3], 0.0)  # weight 0


def numpy_plif(z, raw, bound):
    """PLIF in float64: `f(z) = f(l_i) + s_i (z - l_i)`, `s = softplus(raw)`."""
    raw = raw.astype("float64")
    k, width = len(raw), 2.0 * bound / len(raw)
    slopes = np.logaddexp(0.0, raw)
    left = -bound + width * np.concatenate([[0.0], np.cumsum(slopes)[:-1]])
    i = np.clip(np.floor((z + bound) / width), 0, k - 1).astype(int)
    return left[i] + slopes[i] * (z - (-bound + width * i))


@pytest.mark.parametrize("components,sigsoftmax,transposed,small_tiles", [
    (3, False, False, True), (1, False, True, False), (2, True, False, True)])
def test_core_with_plif_matches_numpy_and_tiled_gradients(components, sigsoftmax,
                                                          transposed, small_tiles,
                                                          monkeypatch):
    """With PLIF (`raw_slopes`, MoS+PLIF; one component: `PLIFSoftmax`) the
    summed core over chunks of 4 tokens equals the NumPy oracle, and its
    gradients (latents, priors, kernel, bias and the raw slopes, whose
    gradient is the histogram summed over the chunks) equal those of the
    tiled `chunked_mixture_nll` with the PLIF transform, weighted and
    summed. Scores reach past the knot bound (the end pieces) and the
    slopes are far from the identity. `small_tiles`: PLIF's row tiles of 3
    tokens in chunks of 5 (a full tile and a remainder in each chunk, as a
    CPU's tiles at a real shape), else one tile a chunk."""
    from keras_softmax_heads import functional
    from keras_softmax_heads.functional import plif_kernels

    chunk = 4
    if small_tiles:
        monkeypatch.setattr(plif_kernels, "TILE_ELEMENTS", 3 * components * V)
        chunk = 5

    rng = np.random.default_rng(7)
    n, d, knots, bound = 11, 5, 16, 2.0
    lat = np.tanh(rng.normal(size=(n, components, d))).astype("float32")
    prior_logits = rng.normal(size=(n, components))
    log_pi = prior_logits - np.log(np.exp(prior_logits).sum(1, keepdims=True))
    log_pi = log_pi.astype("float32")
    w = (1.5 * rng.normal(size=(d, V))).astype("float32")
    b = rng.normal(size=(V,)).astype("float32")
    raw = rng.normal(size=(knots,)).astype("float32")
    t = rng.integers(0, V, size=n).astype("int32")
    weights = rng.uniform(0.2, 2.0, size=n).astype("float32")
    weights[5] = 0.0
    kernel = w.T.copy() if transposed else w

    z = np.einsum("nkd,dv->nkv", lat.astype("float64"), w.astype("float64")) + b
    assert np.abs(z).max() > bound  # the end pieces are exercised
    f = numpy_plif(z, raw, bound)
    if sigsoftmax:
        f = f - np.logaddexp(0.0, -f)
    log_p = f - np.log(np.exp(f).sum(-1, keepdims=True))
    joint = log_pi[:, :, None] + log_p
    mix = np.log(np.exp(joint).sum(1))
    oracle = (weights * -mix[np.arange(n), t]).sum()

    variables = [keras.Variable(kernel), keras.Variable(b), keras.Variable(raw)]

    def summed(lat, log_pi, weights):
        return summed_mixture_nll(lat, log_pi, variables[0], variables[1], t, weights,
                                  output_fn="sigsoftmax" if sigsoftmax else "softmax",
                                  raw_slopes=variables[2], knot_bound=bound,
                                  kernel_transposed=transposed, token_chunk_size=chunk)

    def transform(z, raw_slopes):
        f = functional.plif(z, raw_slopes, bound)
        return f - keras.ops.softplus(-f) if sigsoftmax else f

    def tiled(lat, log_pi, weights):
        nll = chunked_mixture_nll(lat, log_pi, variables[0], variables[1], t,
                                  transform_fn=transform, transform_params=[variables[2]],
                                  chunk_size=5, kernel_transposed=transposed)
        return keras.ops.sum(nll * weights)

    results = []
    for fn in (summed, tiled):
        fn = jit(fn) if BACKEND == "jax" else fn
        results.append(value_and_grad(fn, [lat, log_pi, weights], variables))
    np.testing.assert_allclose(results[0][0], oracle, rtol=1e-5)
    assert_same_values_and_gradients(results[1], results[0])
    assert np.abs(to_numpy(results[0][2][2])).max() > 1e-2  # the slopes learn
    np.testing.assert_array_equal(to_numpy(results[0][1][0])[5], 0.0)  # weight 0


def assert_same_values_and_gradients(reference, result):
    """Two `value_and_grad` results agree: the value and every gradient."""
    (ref, ref_in, ref_w), (value, grads_in, grads_w) = reference, result
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    for a, r in zip(list(grads_in) + list(grads_w), list(ref_in) + list(ref_w)):
        np.testing.assert_allclose(a, r, atol=2e-5, rtol=1e-5)


def without_and_with_option(make, h, t, weights, rng):
    """`(head, [result_without, result_with])`: `value_and_grad` of the
    head's `summed_training_loss(h, t, weights)` (jitted on JAX) with
    respect to `h` and the trainable weights, for `make(False)` and
    `make(True)` (`gradient_in_forward`), both heads given the same random
    weights. `head` is the second."""
    results, base = [], None
    for flag in (False, True):
        head = make(flag)
        head.build((None, h.shape[-1]))
        if base is None:
            base = [rng.normal(size=w.shape).astype("float32") for w in head.weights]
        for w, b in zip(head.weights, base):
            w.assign(b)
        fn = (lambda x, head=head: head.summed_training_loss(x, t, weights))
        fn = jit(fn) if BACKEND == "jax" else fn
        results.append(value_and_grad(fn, [h], head.trainable_weights))
    return head, results


def built(like=None, **kwargs):
    head = MixtureOfSoftmaxes(V, num_components=3, use_prior_bias=True, **kwargs)
    head.build((None, 6))
    if like is not None:
        head.set_weights(like.get_weights())
    return head


def test_head_summed_loss_matches_per_token_loss():
    """`summed_training_loss` with and without `gradient_in_forward` (a
    sigsoftmax mixture under jit on JAX): the same value and gradients with
    respect to the inputs and every weight."""
    rng = np.random.default_rng(1)
    h = rng.normal(size=(2, 5, 6)).astype("float32")
    t = rng.integers(0, V, size=(2, 5)).astype("int32")
    weights = rng.uniform(0.0, 1.0, size=(2, 5)).astype("float32")
    base = built(component="sigsoftmax")
    results = []
    for flag in (False, True):
        head = built(like=base, component="sigsoftmax", gradient_in_forward=flag)

        def loss(x, head=head):
            return head.summed_training_loss(x, t, weights)

        fn = jit(loss) if BACKEND == "jax" else loss
        results.append(value_and_grad(fn, [h], head.trainable_weights))
    assert_same_values_and_gradients(*results)


@pytest.mark.parametrize("kind", ["head_loss", "head_model", "masked", "sum",
                                  "weight_mean"])
def test_training_step_matches_per_token_path(kind):
    """One compiled SGD step through `HeadLoss` (sum-over-batch-size
    reduction, per-token sample weights) or `HeadModel` (per-sequence
    weights) moves every weight as the per-token path's step does, and
    reports the same loss; with a Keras mask (`mask_zero`) `HeadLoss`
    reduces per token as Keras weighs a masked loss; `"sum"` (the
    reduction's weights without the token count) and
    `"mean_with_sample_weight"` (over the weights' sum) too. Each step
    takes the summed path exactly when it should."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, V, size=(4, 6)).astype("int32")
    y = np.roll(x, -1, axis=1)
    x[:, -2:] = 0  # padding, masked with mask_zero
    sample_weight = (rng.uniform(0.0, 2.0, size=(4,)) if kind == "head_model"
                     else rng.uniform(0.0, 2.0, size=(4, 6))).astype("float32")
    reduction = {"sum": "sum", "weight_mean": "mean_with_sample_weight"}.get(
        kind, "sum_over_batch_size")
    outcomes = []
    for flag in (False, True):
        keras.utils.set_random_seed(0)
        embed = keras.layers.Embedding(V, 6, mask_zero=kind == "masked")
        head = MixtureOfSoftmaxes(V, num_components=3, gradient_in_forward=flag)
        if kind != "head_model":
            model = keras.Sequential([keras.Input((6,), dtype="int32"), embed, head])
            model.compile(keras.optimizers.SGD(0.5 / (24 if kind == "sum" else 1)),
                          loss=HeadLoss(head, reduction=reduction))
        else:
            backbone = keras.Sequential([keras.Input((6,), dtype="int32"), embed])
            model = HeadModel(backbone, head)
            model.compile(keras.optimizers.SGD(0.5))
        calls = []
        count_calls(head, "summed_training_loss", calls)
        outcomes.append(sgd_step(model, x, y, sample_weight))
        # The summed path is the one taken, except under a Keras mask.
        assert bool(calls) == (flag and kind != "masked")
    assert_same_steps(*outcomes)


def sgd_step(model, x, y, sample_weight):
    """`(loss, trainable weights)` after one `train_on_batch`."""
    loss = model.train_on_batch(x, y, sample_weight=sample_weight)
    return loss, [to_numpy(v) for v in model.trainable_weights]


def assert_same_steps(reference, result):
    """Two `sgd_step` results agree: the loss and every weight."""
    (ref_loss, ref_w), (loss, weights) = reference, result
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, r in zip(weights, ref_w):
        np.testing.assert_allclose(a, r, atol=1e-5)


def test_refusals_config_and_invalid_targets():
    """A bad option value is refused; the option round-trips through the
    config; a word id outside `[0, V)` with a non-zero weight makes the sum
    NaN, as the per-token loss's NaN; the core refuses a knot bound without
    slopes, and slopes that are not a vector."""
    with pytest.raises(ValueError, match="knot_bound=2.0"):
        summed_mixture_nll(np.zeros((2, 1, 3), "float32"), np.zeros((2, 1), "float32"),
                           np.zeros((3, V), "float32"), None, [0, 1], [1.0, 1.0],
                           knot_bound=2.0)
    with pytest.raises(ValueError, match="raw_slopes"):
        summed_mixture_nll(np.zeros((2, 1, 3), "float32"), np.zeros((2, 1), "float32"),
                           np.zeros((3, V), "float32"), None, [0, 1], [1.0, 1.0],
                           raw_slopes=np.zeros((2, 2), "float32"), knot_bound=2.0)
    with pytest.raises(ValueError, match="gradient_in_forward"):
        MixtureOfSoftmaxes(V, gradient_in_forward="yes")
    head = built(gradient_in_forward=True)
    assert MixtureOfSoftmaxes.from_config(head.get_config()).gradient_in_forward
    h = np.zeros((3, 6), "float32")
    total = head.summed_training_loss(h, np.array([1, 2, 3]), np.ones(3, "float32"))
    assert np.isfinite(to_numpy(total))
    if BACKEND == "jax":  # eager TensorFlow / PyTorch check the ids and raise
        bad = jit(lambda t: head.summed_training_loss(h, t, np.ones(3, "float32")))
        assert np.isnan(to_numpy(bad(np.array([1, V, 3], "int32"))))


@pytest.mark.parametrize("options", [
    {"logit_soft_cap": 3.0}, {"tied": True, "use_bias": False}])
def test_chunked_full_softmax_summed_matches_chunked_loss(options):
    """`FullSoftmax(chunk_size=...)` trains through the summed cross-entropy
    by default (`gradient_in_forward` on with `chunk_size`): its summed
    objective equals the chunked per-token loss's, weighted and summed, in
    value and in the gradients of the inputs and every weight (soft cap; a
    tied `[V, d]` embedding); off without `chunk_size`."""
    from keras_softmax_heads import FullSoftmax

    options = dict(options)
    tied = options.pop("tied", False)
    rng = np.random.default_rng(4)
    h = rng.normal(size=(3, 4, 6)).astype("float32")
    t = rng.integers(0, V, size=(3, 4)).astype("int32")
    weights = rng.uniform(0.0, 1.0, size=(3, 4)).astype("float32")
    assert not FullSoftmax(V).gradient_in_forward
    results, base = [], None
    for flag in (False, True):
        keras.utils.set_random_seed(0)
        embedding = keras.layers.Embedding(V, 6) if tied else None
        head = FullSoftmax(V, chunk_size=5, gradient_in_forward=flag,
                           token_embedding=embedding, **options)
        head.build((None, 6))
        if base is None:
            base = [to_numpy(w) for w in head.weights]
        for w, b in zip(head.weights, base):
            w.assign(b + 0.3)
        fn = (lambda x, head=head: head.summed_training_loss(x, t, weights))
        fn = jit(fn) if BACKEND == "jax" else fn
        results.append(value_and_grad(fn, [h], head.trainable_weights))
    assert_same_values_and_gradients(*results)


@pytest.mark.parametrize("output_fn,tied", [
    ("sigsoftmax", False), ("sigmoid", True), ("relu", False)])
def test_chunked_sigsoftmax_summed_matches_chunked_loss(output_fn, tied):
    """`SigSoftmax(chunk_size=...)` trains through the summed mixture core
    with one component by default: its summed objective equals the chunked
    per-token loss's, weighted and summed, in value and in the gradients of
    the inputs and every weight, for each output function (a tied `[V, d]`
    embedding without a bias for g:sigmoid); off without `chunk_size`, and
    the option round-trips through the config."""
    from keras_softmax_heads import SigSoftmax

    rng = np.random.default_rng(5)
    h = rng.normal(size=(3, 4, 6)).astype("float32")
    t = rng.integers(0, V, size=(3, 4)).astype("int32")
    weights = rng.uniform(0.0, 1.0, size=(3, 4)).astype("float32")
    weights[0, 1] = 0.0
    assert not SigSoftmax(V).gradient_in_forward

    def make(flag):
        embedding = keras.layers.Embedding(V, 6) if tied else None
        return SigSoftmax(V, output_fn=output_fn, chunk_size=5, gradient_in_forward=flag,
                          token_embedding=embedding, use_bias=not tied)

    head, results = without_and_with_option(make, h, t, weights, rng)
    assert_same_values_and_gradients(*results)
    assert SigSoftmax.from_config(head.get_config()).gradient_in_forward
    with pytest.raises(ValueError, match="gradient_in_forward"):
        SigSoftmax(V, gradient_in_forward=1)


@pytest.mark.parametrize("head_kind", ["plif", "mos_plif"])
def test_plif_heads_summed_match_per_token_loss(head_kind):
    """`PLIFSoftmax(chunk_size=...)` (by default) and MoS+PLIF
    (`MixtureOfSoftmaxes(num_knots=..., gradient_in_forward=True)`) train
    through the summed mixture core: the summed objective equals the
    per-token loss's, weighted and summed, in value and in the gradients of
    the inputs and every weight, the raw slopes included (trained slopes:
    not the identity); the option round-trips through the config."""
    from keras_softmax_heads import PLIFSoftmax

    rng = np.random.default_rng(6)
    h = (2.0 * rng.normal(size=(3, 4, 6))).astype("float32")
    t = rng.integers(0, V, size=(3, 4)).astype("int32")
    weights = rng.uniform(0.0, 1.0, size=(3, 4)).astype("float32")
    weights[1, 2] = 0.0
    if head_kind == "plif":
        assert not PLIFSoftmax(V).gradient_in_forward
        assert PLIFSoftmax(V, chunk_size=5).gradient_in_forward

    def make(flag):
        if head_kind == "plif":
            return PLIFSoftmax(V, num_knots=32, knot_bound=3.0, chunk_size=5,
                               gradient_in_forward=flag)
        return MixtureOfSoftmaxes(V, num_components=2, num_knots=32, knot_bound=3.0,
                                  use_prior_bias=True, gradient_in_forward=flag)

    head, results = without_and_with_option(make, h, t, weights, rng)
    assert_same_values_and_gradients(*results)
    slopes = [i for i, w in enumerate(head.trainable_weights) if "raw_slopes" in w.path]
    assert len(slopes) == 1 and np.abs(to_numpy(results[1][2][slopes[0]])).max() > 1e-3
    assert type(head).from_config(head.get_config()).gradient_in_forward


def test_frozen_plif_slopes_skip_their_histograms(monkeypatch):
    """PLIF's slopes frozen (a non-trainable variable) in the summed core:
    the other inputs' gradients are the same; on PyTorch, which says so
    while the loss is built, the slope histograms are not computed at all
    (`functional.plif_slope_histograms` not called), elsewhere they are."""
    from keras_softmax_heads import functional

    rng = np.random.default_rng(8)
    n, k, d = 6, 2, 5
    latents = rng.normal(size=(n, k, d)).astype("float32")
    log_priors = np.log(rng.dirichlet(np.ones(k), n)).astype("float32")
    kernel = rng.normal(size=(d, V)).astype("float32")
    raw = rng.normal(size=(16,)).astype("float32")
    targets, weights = rng.integers(0, V, n), rng.uniform(0.5, 1.5, n).astype("float32")
    calls = []
    histograms = functional.plif_slope_histograms
    monkeypatch.setattr(functional, "plif_slope_histograms",
                        lambda *args: calls.append(1) or histograms(*args))

    def loss(lat, lp, w, slopes):
        return summed_mixture_nll(lat, lp, w, None, targets, weights, raw_slopes=slopes,
                                  knot_bound=2.0, token_chunk_size=4)

    _, full, _ = value_and_grad(loss, (latents, log_priors, kernel, raw))
    assert calls
    calls.clear()
    frozen = keras.Variable(raw, trainable=False)
    _, alone, _ = value_and_grad(lambda lat, lp, w: loss(lat, lp, w, frozen),
                                 (latents, log_priors, kernel))
    for a, f, name in zip(alone, full[:3], ("latents", "log_priors", "kernel")):
        np.testing.assert_allclose(a, f, rtol=1e-6, atol=1e-7, err_msg=name)
    assert bool(calls) == (BACKEND != "torch")


def test_frozen_kernel_skips_its_gradient():
    """The summed mixture loss with its output matrix frozen (a non-trainable
    variable): the other inputs' gradients are the same; on PyTorch, which
    says so while the loss is built, the kernel's products are skipped
    (`torch.utils.flop_counter`)."""
    rng = np.random.default_rng(3)
    n, k, d, v = 6, 3, 8, 50
    latents = rng.normal(size=(n, k, d)).astype("float32")
    log_priors = np.log(rng.dirichlet(np.ones(k), n)).astype("float32")
    kernel = rng.normal(size=(d, v)).astype("float32")
    bias = rng.normal(size=(v,)).astype("float32")
    targets, weights = rng.integers(0, v, n), rng.uniform(0.5, 1.5, n).astype("float32")

    def loss(lat, lp, w, b):
        return summed_mixture_nll(lat, lp, w, b, targets, weights, token_chunk_size=4)

    _, full, _ = value_and_grad(loss, (latents, log_priors, kernel, bias))
    frozen = keras.Variable(kernel, trainable=False)
    _, alone, _ = value_and_grad(lambda lat, lp, b: loss(lat, lp, frozen, b),
                                 (latents, log_priors, bias))
    for a, f, name in zip(alone, (full[0], full[1], full[3]), ("latents", "log_priors", "bias")):
        np.testing.assert_allclose(a, f, rtol=1e-6, atol=1e-7, err_msg=name)
    if BACKEND == "torch":
        import torch

        def flops(kernel_grad):
            args = [torch.tensor(latents).requires_grad_(True), torch.tensor(log_priors),
                    torch.tensor(kernel).requires_grad_(kernel_grad), torch.tensor(bias)]
            return torch_flops(lambda: loss(*args).backward())

        # In the forward pass: the scores, dh, dW; frozen, the first two.
        assert flops(False) / flops(True) == pytest.approx(2 / 3)


@pytest.mark.parametrize("tied", [False, True])
def test_mixture_of_contexts_summed_matches_tiled_loss(tied):
    """`MixtureOfContexts` trains through the summed cross-entropy of its
    mixed context by default (`gradient_in_forward`): its summed objective
    equals the tiled per-token loss's, weighted and summed (a weight-0
    token), in value and in the gradients of the inputs and every weight
    (priors, latents, kernel or tied embedding, bias); one SGD step through
    `HeadLoss` moves every weight as the per-token path's; the option
    round-trips through the config and a bad value is refused."""
    from keras_softmax_heads import MixtureOfContexts

    rng = np.random.default_rng(9)
    h = rng.normal(size=(3, 4, 6)).astype("float32")
    t = rng.integers(0, V, size=(3, 4)).astype("int32")
    weights = rng.uniform(0.0, 1.0, size=(3, 4)).astype("float32")
    weights[2, 0] = 0.0
    assert MixtureOfContexts(V).gradient_in_forward

    def make(flag):
        embedding = keras.layers.Embedding(V, 6) if tied else None
        return MixtureOfContexts(V, num_components=3, chunk_size=5, use_prior_bias=True,
                                 token_embedding=embedding, use_bias=not tied,
                                 gradient_in_forward=flag)

    head, results = without_and_with_option(make, h, t, weights, rng)
    assert_same_values_and_gradients(*results)
    assert MixtureOfContexts.from_config(head.get_config()).gradient_in_forward
    assert not MixtureOfContexts.from_config(
        MixtureOfContexts(V, gradient_in_forward=False).get_config()).gradient_in_forward
    with pytest.raises(ValueError, match="gradient_in_forward"):
        MixtureOfContexts(V, gradient_in_forward="yes")

    x = rng.integers(0, V, size=(4, 6)).astype("int32")
    y, sample_weight = np.roll(x, -1, axis=1), rng.uniform(0, 2, (4, 6)).astype("float32")
    outcomes = []
    for flag in (False, True):
        keras.utils.set_random_seed(0)
        head = MixtureOfContexts(V, num_components=3, gradient_in_forward=flag)
        model = keras.Sequential([keras.Input((6,), dtype="int32"),
                                  keras.layers.Embedding(V, 6), head])
        model.compile(keras.optimizers.SGD(0.5), loss=HeadLoss(head))
        outcomes.append(sgd_step(model, x, y, sample_weight))
    assert_same_steps(*outcomes)
