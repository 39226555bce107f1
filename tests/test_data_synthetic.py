"""Tests for the synthetic corpus (keras_softmax_heads.data.synthetic)."""

import numpy as np
import pytest

from keras_softmax_heads import data
from keras_softmax_heads.data.synthetic import zipf_prior


@pytest.fixture(scope="module")
def corpus():
    return data.make_synthetic_corpus(vocab_size=1000, seed=0)


def test_default_corpus_shape_and_splits(corpus):
    assert corpus.name == "synthetic"
    assert corpus.vocab_size == 1000
    assert (corpus.train.size, corpus.valid.size, corpus.test.size) == (250_000, 25_000, 25_000)
    for split in ("train", "valid", "test"):
        ids = corpus.split(split)
        assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < 1000
    np.testing.assert_array_equal(corpus.vocab.counts, data.word_counts(corpus.train, 1000))
    assert corpus.vocab.tokens[:2] == ("w000", "w001")
    # Zipfian: the a-priori most frequent words are frequent in the sample too.
    assert corpus.vocab.counts[:10].sum() > corpus.vocab.counts[-100:].sum()


def test_load_dataset_default_is_synthetic():
    corpus = data.load_dataset(vocab_size=50, num_train_tokens=1000, num_valid_tokens=100,
                               num_test_tokens=100, seed=3)
    assert corpus.name == "synthetic" and isinstance(corpus.true_model, data.MarkovLanguageModel)


def test_determinism():
    kwargs = dict(vocab_size=300, num_train_tokens=20_000, num_valid_tokens=2_000,
                  num_test_tokens=2_000)
    a = data.make_synthetic_corpus(seed=7, **kwargs)
    b = data.make_synthetic_corpus(seed=7, **kwargs)
    c = data.make_synthetic_corpus(seed=8, **kwargs)
    for split in ("train", "valid", "test"):
        np.testing.assert_array_equal(a.split(split), b.split(split))
    np.testing.assert_array_equal(a.true_model.transition, b.true_model.transition)
    assert a.true_model.entropy_rate == b.true_model.entropy_rate
    assert not np.array_equal(a.train, c.train)
    assert not np.allclose(a.true_model.transition, c.true_model.transition)


def test_true_model_is_a_valid_irreducible_high_rank_chain(corpus):
    model = corpus.true_model
    p = model.transition
    assert p.shape == (1000, 1000)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-12)
    assert p.min() >= 1e-3 / 1000 * (1 - 1e-9)  # uniform floor -> irreducible
    pi = model.stationary
    np.testing.assert_allclose(pi.sum(), 1.0, atol=1e-12)
    np.testing.assert_allclose(pi @ p, pi, atol=1e-12)
    # Entropy rate from its definition.
    h = -np.sum(pi[:, None] * p * np.log(p))
    assert model.entropy_rate == pytest.approx(h, rel=1e-10)
    assert 0 < model.entropy_rate < corpus.info["unigram_entropy"] < np.log(1000)
    # next_word_probs: rows of P for [N] contexts, last column for [N, L].
    np.testing.assert_array_equal(model.next_word_probs([3, 5]), p[[3, 5]])
    np.testing.assert_array_equal(model.next_word_probs([[1, 3], [2, 5]]), p[[3, 5]])
    with pytest.raises(ValueError, match="1000"):
        model.next_word_probs([1000])
    # High rank: the log-probability matrix of a small model has full rank.
    small = data.MarkovLanguageModel.random(200, seed=1)
    assert np.linalg.matrix_rank(np.log(small.transition)) == 200


def test_entropy_rate_matches_monte_carlo(corpus):
    model = corpus.true_model
    sample = model.sample(200_000, seed=123)
    nll = model.cross_entropy(sample)
    assert nll == pytest.approx(model.entropy_rate, rel=0.02)
    # The stored per-split floors are the same quantity on the corpus splits.
    for split in ("train", "valid", "test"):
        floor = corpus.info[f"{split}_cross_entropy"]
        assert floor == pytest.approx(model.cross_entropy(corpus.split(split)))
        assert floor == pytest.approx(model.entropy_rate, rel=0.03)
    # The sample's empirical unigram frequencies approach the stationary law.
    freq = np.bincount(sample, minlength=1000) / sample.size
    assert 0.5 * np.abs(freq - model.stationary).sum() < 0.05


def test_empirical_transitions_match_true_model():
    model = data.MarkovLanguageModel.random(20, concentration=5.0, seed=2)
    ids = model.sample(100_000, seed=0)
    joint = np.zeros((20, 20))
    np.add.at(joint, (ids[:-1], ids[1:]), 1)
    empirical = joint / joint.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(empirical, model.transition, atol=0.03)


def test_generator_validation():
    with pytest.raises(ValueError, match="num_test_tokens=0"):
        data.make_synthetic_corpus(vocab_size=10, num_test_tokens=0)
    with pytest.raises(ValueError, match="vocab_size=1"):
        data.MarkovLanguageModel.random(1)
    with pytest.raises(ValueError, match="uniform_floor=0"):
        data.MarkovLanguageModel.random(10, uniform_floor=0)
    with pytest.raises(ValueError, match="> 0"):
        data.MarkovLanguageModel(np.array([[1.0, 0.0], [0.5, 0.5]]))
    np.testing.assert_allclose(zipf_prior(4, 1.0), np.array([12, 6, 4, 3]) / 25)
