"""SampledSoftmax (target sampling) and the shared candidate samplers."""

import math
import os
import tempfile

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import jit
from backends import sparse_gradient_rows
from backends import to_numpy
from backends import value_and_grad
from battery import HeadBattery
from battery import assert_directional_gradients
from keras import ops
from multibackend import FD64
from multibackend import RTOL64
from multibackend import float64  # noqa: F401 (fixture)
from multibackend import jit_with_state
from references import numpy_word_major_scores

import keras_softmax_heads as ksh
from keras_softmax_heads import samplers
from keras_softmax_heads.heads.sampled_softmax import SampledSoftmax
from keras_softmax_heads.heads.sampled_softmax import sampled_softmax_nll

pytestmark = pytest.mark.multibackend


def zipf_counts(v):
    return (1000.0 / np.arange(1, v + 1)).round() + 1


def _vocab(v, kw):
    return v if v is not None else kw["token_embedding"].input_dim


class TestSampledSoftmaxBattery(HeadBattery):
    avoids_full_scores_in_training = True
    # One case (the battery costs ~13 s of CPU per case): "unigram" has the
    # sampling tables (saved weights, placeholder config); the "batch" and
    # "log_uniform" paths are compiled in `test_xla_training_step`.
    exact_training_loss = False
    cases = {
        "unigram": lambda v, d, **kw: SampledSoftmax(
            v,
            num_sampled=5,
            sampler="unigram",
            counts=zipf_counts(_vocab(v, kw)),
            distortion=0.75,
            seed=1,
            **kw,
        ),
    }


# ------------------------------------------------------------------ helpers


def numpy_sampled_loss(z, targets, cand, cand_lc, target_lc, mask, remove_hits, log_q):
    """Reference: loops over rows, explicit softmax over target + candidates."""
    out = []
    for i, t in enumerate(targets):
        lt = z[i, t] - (target_lc[i] if log_q else 0.0)
        terms = [lt]
        for j, s in enumerate(cand):
            if mask is not None and not mask[j]:
                continue
            if remove_hits and s == t:
                continue
            terms.append(z[i, s] - (cand_lc[j] if log_q else 0.0))
        terms = np.array(terms)
        out.append(np.log(np.exp(terms - terms.max()).sum()) + terms.max() - lt)
    return np.array(out)


def built_head(v=11, d=5, **kwargs):
    keras.utils.set_random_seed(0)
    head = SampledSoftmax(v, bias_initializer="random_normal", **kwargs)
    head(np.zeros((1, d), "float32"))
    return head


# -------------------------------------------------------- the loss itself
def test_numpy_reference_sampled_loss():
    for remove_hits in (True, False):
        for log_q in (True, False):
            head = built_head(
                num_sampled=4, remove_accidental_hits=remove_hits, subtract_log_q=log_q
            )
            rng = np.random.default_rng(0)
            h = rng.normal(size=(2, 3, 5)).astype("float32")
            targets = np.array([[0, 3, 7], [3, 10, 1]], "int32")
            cand = np.array([3, 5, 3, 0, 9], "int32")  # a duplicate and hits
            cand_lc = rng.normal(size=5).astype("float32")
            target_lc = rng.normal(size=6).astype("float32")
            mask = np.array([True, True, False, True, True])
            got = to_numpy(
                head.sampled_loss(h, targets, cand, cand_lc, target_lc, candidate_mask=mask)
            )
            assert got.shape == (2, 3) and got.dtype == np.float32
            z = numpy_word_major_scores(head, h.reshape(6, 5))
            want = numpy_sampled_loss(
                z, targets.ravel(), cand, cand_lc, target_lc, mask, remove_hits, log_q
            )
            np.testing.assert_allclose(got.ravel(), want, atol=1e-5)


def test_plain_function_handles_all_masked_rows():
    loss = sampled_softmax_nll(
        np.array([1.5], "float32"), np.array([[2.0, 3.0]], "float32"),
        np.array([[False, False]]),
    )
    np.testing.assert_allclose(to_numpy(loss), [0.0], atol=1e-7)


def test_all_words_equals_exact_nll():
    for kwargs in [{"sampler": "all"}, {"num_sampled": "all"}]:
        head = built_head(**kwargs)
        assert head.sampler == "all" and head.num_sampled == "all"
        h = np.random.default_rng(1).normal(size=(4, 3, 5)).astype("float32") * 3
        t = np.random.default_rng(2).integers(0, 11, size=(4, 3))
        exact = -to_numpy(head.log_likelihood(h, t))
        np.testing.assert_allclose(to_numpy(head.training_loss(h, t)), exact, atol=1e-5)
    jitted = jit_with_state(head, head.training_loss)
    np.testing.assert_allclose(to_numpy(jitted(h, t)), exact, atol=1e-5)


def test_all_candidates_through_sampled_loss_equal_exact_nll():
    """Explicit candidates = every word once with Q = 1: the exact NLL."""
    head = built_head(num_sampled=4)
    h = np.random.default_rng(1).normal(size=(6, 5)).astype("float32")
    t = np.arange(6)
    loss = head.sampled_loss(h, t, np.arange(11)[::-1], np.zeros(11), np.zeros(6))
    np.testing.assert_allclose(
        to_numpy(loss), -to_numpy(head.log_likelihood(h, t)), atol=1e-5
    )


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's own op")
def test_matches_tf_sampled_softmax_loss():
    """Same candidates and expected counts as TF's op: the same loss."""
    head = built_head(v=40, d=6, num_sampled=8)
    rng = np.random.default_rng(3)
    h = rng.normal(size=(7, 6)).astype("float32")
    t = rng.integers(0, 40, size=7).astype("int64")
    ids = rng.choice(40, size=8, replace=False).astype("int64")
    ids[0] = t[0]  # an accidental hit
    q = samplers.log_uniform_probs(40)
    true_ec = (1 - (1 - q[t]) ** 8).astype("float32")
    sampled_ec = (1 - (1 - q[ids]) ** 8).astype("float32")
    import tensorflow as tf

    want = tf.nn.sampled_softmax_loss(
        head.kernel, head.bias, t[:, None], h, num_sampled=8, num_classes=40,
        sampled_values=(ids, true_ec[:, None], sampled_ec),
        remove_accidental_hits=True,
    )
    got = head.sampled_loss(h, t, ids, np.log(sampled_ec), np.log(true_ec))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def _fixed_sample_problem():
    """A float64 head, inputs and a fixed candidate set (a duplicate masked
    out, an accidental hit), and the weighted loss `objective(x)`."""
    head = built_head(v=9, d=4, num_sampled=5)
    rng = np.random.default_rng(0)
    h = rng.normal(size=(3, 2, 4))
    t = rng.integers(0, 9, size=(3, 2))
    cand = np.array([1, 4, 4, 8, t[0, 0]])
    lc = rng.normal(size=5)
    tlc = rng.normal(size=6)
    mask = np.array([True, True, False, True, True])
    weights = ops.convert_to_tensor(rng.normal(size=t.shape))

    def objective(x):
        loss = head.sampled_loss(x, t, cand, lc, tlc, candidate_mask=mask)
        return ops.sum(loss * weights)

    return head, h, t, cand, objective, rng


def test_finite_difference_gradient_with_fixed_samples(float64):
    head, h, t, cand, objective, rng = _fixed_sample_problem()
    grads = assert_directional_gradients(
        objective, h, list(head.trainable_weights), rng, **FD64
    )
    # Only the rows of the targets and candidates get a gradient.
    touched = np.flatnonzero(np.abs(grads[1]).sum(-1))
    assert set(touched) <= set(t.ravel()) | set(cand)
    _, grads_jit_h, grads_jit = value_and_grad(jit(objective), [h], head.trainable_weights)
    for a, b in zip(grads_jit_h + grads_jit, grads):
        np.testing.assert_allclose(a, b, rtol=RTOL64, atol=RTOL64)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.IndexedSlices")
def test_kernel_gradient_is_sparse_on_tensorflow(float64):
    """A row gather: `IndexedSlices` of the target and candidate rows, never
    a dense `[V, d]` tensor."""
    head, h, t, cand, objective, _ = _fixed_sample_problem()
    assert sparse_gradient_rows(objective, h, head.kernel) <= set(t.ravel()) | set(cand)


# --------------------------------------------------------------- sampling
def test_sampler_draws_follow_q():
    for sampler in ("uniform", "log_uniform", "unigram"):
        _check_sampler_draws(sampler)


def _check_sampler_draws(sampler):
    v = 30
    counts = zipf_counts(v)
    counts[7] = 0  # never drawn
    q = samplers.sampling_probs(sampler, v, counts, 0.75)
    head = SampledSoftmax(v, sampler=sampler, counts=counts, distortion=0.75, seed=3)
    head(np.zeros((1, 2), "float32"))
    draws = to_numpy(head._sampler.sample(200_000, head.seed_generator))
    freq = np.bincount(draws, minlength=v) / draws.size
    # 5 standard deviations of a binomial proportion.
    tol = 5 * np.sqrt(q * (1 - q) / draws.size) + 1e-9
    assert np.all(np.abs(freq - q) <= tol), np.max(np.abs(freq - q) / tol)
    if sampler == "unigram":
        assert freq[7] == 0
    log_q = to_numpy(head._sampler.log_prob(np.arange(v)))
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(log_q, np.log(q).astype("float32"), rtol=1e-6)


def test_alias_table_is_exact():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(500, 0.1))
    probs[[3, 17]] = 0.0
    probs /= probs.sum()
    threshold, alias = samplers.alias_table(probs)
    recovered = threshold.copy()
    np.add.at(recovered, alias, 1.0 - threshold)
    np.testing.assert_allclose(recovered / probs.size, probs, atol=1e-15)


def test_candidate_log_counts():
    for sampler in ("log_uniform", "unigram"):
        for unique in (True, False):
            _check_candidate_log_counts(sampler, unique)


def _check_candidate_log_counts(sampler, unique):
    v, m = 25, 6
    counts = zipf_counts(v)
    head = SampledSoftmax(
        v, num_sampled=m, sampler=sampler, counts=counts, unique=unique, seed=0
    )
    head(np.zeros((1, 2), "float32"))
    targets = np.array([0, 5, 24], "int32")
    s = head.sample_candidates(targets)
    ids = to_numpy(s["candidates"])
    q = samplers.sampling_probs(sampler, v, counts)
    expect = (lambda p: 1 - (1 - p) ** m) if unique else (lambda p: m * p)
    np.testing.assert_allclose(
        np.exp(to_numpy(s["candidate_log_counts"])), expect(q[ids]), rtol=1e-5
    )
    np.testing.assert_allclose(
        np.exp(to_numpy(s["target_log_counts"])), expect(q[targets]), rtol=1e-5
    )
    assert ids.shape == (m,)
    if unique:
        mask = to_numpy(s["candidate_mask"])
        assert sorted(ids[mask]) == sorted(set(ids.tolist()))
    else:
        assert s["candidate_mask"] is None


def test_batch_sampler_candidates():
    v, m = 50, 4
    head = SampledSoftmax(v, num_sampled=m, sampler="batch", seed=0)
    head(np.zeros((1, 2), "float32"))
    targets = np.array([3, 3, 10, 41, 10], "int32")
    s = head.sample_candidates(targets)
    ids = to_numpy(s["candidates"])
    mask = to_numpy(s["candidate_mask"])
    log_counts = to_numpy(s["candidate_log_counts"])
    assert ids.shape == (targets.size + m,)
    kept = ids[mask]
    assert len(kept) == len(set(kept.tolist()))  # no duplicates left
    assert {3, 10, 41} <= set(kept.tolist())
    in_batch = np.isin(ids, targets)
    np.testing.assert_array_equal(log_counts[mask & in_batch], 0.0)
    p_in = 1 - (1 - 1 / v) ** m
    np.testing.assert_allclose(log_counts[mask & ~in_batch], np.log(p_in), rtol=1e-6)
    np.testing.assert_array_equal(to_numpy(s["target_log_counts"]), 0.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sampler": "log_uniform", "unique": True},
        {"sampler": "log_uniform", "unique": False},
        {"sampler": "unigram", "unique": True, "distortion": 0.5},
        {"sampler": "batch"},
    ],
)
def test_corrected_partition_estimate_is_unbiased(kwargs):
    """E[sum over candidates of exp(z - log Q)] = sum over all words of exp(z)."""
    v, m = 20, 5
    head = SampledSoftmax(v, num_sampled=m, counts=zipf_counts(v), seed=0, **kwargs)
    h = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    head(h)
    z = to_numpy(head.logits(h)).astype("float64")
    targets = np.array([2, 17], "int32")
    # Compiled: the draws advance the layer's seed state on every backend.
    sample = jit_with_state(head, head.sample_candidates)
    estimates = []
    for _ in range(600):
        s = sample(targets)
        ids = to_numpy(s["candidates"])
        weight = np.exp(-to_numpy(s["candidate_log_counts"]).astype("float64"))
        if s["candidate_mask"] is not None:
            weight = weight * to_numpy(s["candidate_mask"])
        if kwargs["sampler"] == "batch":
            # Given the batch {2, 17}: their exact terms + the sampled rest.
            keep = ~np.isin(ids, targets)
            est = np.exp(z[:, targets]).sum(-1) + (np.exp(z[:, ids]) * weight * keep).sum(-1)
        else:
            est = (np.exp(z[:, ids]) * weight).sum(-1)
        estimates.append(est)
    estimates = np.array(estimates)
    exact = np.exp(z).sum(-1)
    stderr = estimates.std(0) / np.sqrt(len(estimates))
    assert np.all(np.abs(estimates.mean(0) - exact) < 5 * stderr + 1e-6 * exact), (
        estimates.mean(0),
        exact,
        stderr,
    )


def test_seeded_sampling_is_reproducible_and_advances():
    def make():
        head = SampledSoftmax(100, num_sampled=10, seed=7)
        head(np.zeros((1, 3), "float32"))
        return head

    t = np.arange(4)
    for compiled in (False, True):
        a, b = make(), make()
        sample_a, sample_b = a.sample_candidates, b.sample_candidates
        if compiled:
            sample_a, sample_b = jit_with_state(a, sample_a), jit_with_state(b, sample_b)
        first_a = to_numpy(sample_a(t)["candidates"])
        np.testing.assert_array_equal(first_a, to_numpy(sample_b(t)["candidates"]))
        second_a = to_numpy(sample_a(t)["candidates"])
        assert not np.array_equal(first_a, second_a)
        # The seed state is layer state: restoring it replays the draws.
        state = [v.numpy() for v in a.non_trainable_variables]
        third = to_numpy(sample_a(t)["candidates"])
        for v, value in zip(a.non_trainable_variables, state):
            v.assign(value)
        np.testing.assert_array_equal(to_numpy(sample_a(t)["candidates"]), third)


@pytest.mark.parametrize("sampler", ["log_uniform", "batch"])
def test_xla_training_step(sampler):
    """Loss and gradients compile with jit_compile=True (the battery's
    jit fit step covers "unigram", `test_all_words...` "all")."""
    head = SampledSoftmax(
        30, num_sampled=6, sampler=sampler, counts=zipf_counts(30), unique=False, seed=0
    )
    h = np.random.default_rng(0).normal(size=(4, 3, 5)).astype("float32")
    t = np.random.default_rng(1).integers(0, 30, size=(4, 3)).astype("int32")
    head(h)

    def loss_fn(x):
        return ops.mean(head.training_loss(x, t))

    loss, grad_h, grads = value_and_grad(jit(loss_fn), [h], head.trainable_weights)
    assert np.isfinite(loss)
    assert all(np.all(np.isfinite(g)) for g in grad_h + grads)


# ------------------------------------------------------------------ errors
BAD_ARGUMENTS = [
    ({"counts": np.ones(5)}, "counts.shape=\\(5,\\), vocab_size=11"),
    ({"counts": -np.ones(11)}, "counts\\[0\\]=-1"),
    ({"counts": np.full(11, np.nan)}, "finite"),
    ({"counts": ["a"] * 11}, "numbers"),
    ({"counts": np.zeros(11), "sampler": "unigram"}, "positive"),
    ({"sampler": "unigram"}, "needs the word `counts`"),
    ({"sampler": "zipf"}, "Received: sampler='zipf'"),
    ({"num_sampled": 0}, "Received: num_sampled=0"),
    ({"num_sampled": 2.5}, "Received: num_sampled=2.5"),
    ({"distortion": -1}, "Received: distortion=-1"),
    ({"unique": "yes"}, "Received: unique='yes'"),
    ({"seed": -3}, "Received: seed=-3"),
]


def test_bad_arguments():
    # One test for all cases: the per-test Keras session reset costs ~0.5 s.
    for kwargs, match in BAD_ARGUMENTS:
        with pytest.raises(ValueError, match=match):
            SampledSoftmax(11, **kwargs)


def test_bad_targets():
    head = built_head()
    h = np.zeros((2, 5), "float32")
    with pytest.raises(ValueError, match=r"vocab_size=11\). Received: targets\[1\]=11"):
        head.training_loss(h, np.array([0, 11]))
    with pytest.raises(ValueError, match=r"targets\[0\]=-1"):
        head.training_loss(h, np.array([-1, 0]))
    with pytest.raises(ValueError, match="leading shape"):
        head.training_loss(np.zeros((2, 3, 5), "float32"), np.zeros((3, 2), "int32"))
    if BACKEND != "torch":  # values unknown under XLA: NaN
        jitted = jit_with_state(head, head.training_loss)
        out = to_numpy(jitted(h, np.array([0, 11], "int32")))
        assert np.isfinite(out[0]) and np.isnan(out[1])


# ------------------------------------------------------- saving and training
def test_counts_survive_keras_save_load():
    counts = zipf_counts(17)
    head = SampledSoftmax(17, sampler="unigram", counts=counts, distortion=0.75)
    assert head.get_config()["counts"] == counts.astype(int).tolist()
    inputs = keras.Input((3,))
    model = keras.Model(inputs, head(inputs))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.keras")
        model.save(path)
        loaded = keras.models.load_model(path).layers[-1]
    np.testing.assert_array_equal(loaded.counts.numpy(), counts.astype("float32"))
    for name in ("sampling_log_probs", "alias_thresholds", "alias_indices"):
        np.testing.assert_array_equal(
            getattr(loaded, name).numpy(), getattr(head, name).numpy()
        )
    q = samplers.unigram_probs(counts, 0.75)
    np.testing.assert_allclose(
        np.exp(loaded.sampling_log_probs.numpy()), q, rtol=1e-6
    )


def test_sampled_training_lowers_exact_loss():
    """A tiny LM trained with 10 samples out of 200 words: exact NLL falls."""
    keras.utils.set_random_seed(0)
    v = 200
    x = (np.arange(8)[None, :] * 7 + np.arange(64)[:, None] * 3) % v
    y = (x * 5 + 1) % v
    backbone = keras.Sequential([keras.layers.Embedding(v, 16)])
    head = SampledSoftmax(v, num_sampled=10, sampler="log_uniform", seed=0)
    model = ksh.HeadModel(backbone, head)
    model.compile(optimizer=keras.optimizers.Adam(0.05))
    before = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    model.fit(x, y, batch_size=16, epochs=15, verbose=0)
    after = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    assert before > 0.9 * math.log(v)
    assert after < 0.5 * before, (before, after)
