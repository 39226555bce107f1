import numpy as np
import pytest

from keras_softmax_heads import diagnostics


def test_kl_and_mode_matching():
    p = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    q = np.array([[0.6, 0.3, 0.1], [0.5, 0.25, 0.25]])
    kl = diagnostics.kl_divergence(p, np.log(q))
    expected = np.mean((p * np.log(p / q)).sum(-1))
    assert kl == pytest.approx(expected)
    assert diagnostics.kl_divergence(p, np.log(p)) == pytest.approx(0.0, abs=1e-12)
    assert diagnostics.mode_matching(p, np.log(q)) == 0.5
    with pytest.raises(ValueError, match="same shape"):
        diagnostics.kl_divergence(p, q[:1])


def test_kl_ignores_zero_probability_words():
    p = np.array([[1.0, 0.0]])
    q = np.log(np.array([[0.5, 0.5]]))
    assert diagnostics.kl_divergence(p, q) == pytest.approx(np.log(2.0))


def test_perplexity():
    assert diagnostics.perplexity(np.log(114.5)) == pytest.approx(114.5)


def test_entropy_per_frequency_band():
    counts = np.array([1, 100, 10, 1000])  # ranks: w3=0, w1=1, w2=2, w0=3
    targets = np.array([3, 3, 1, 0])
    ll = np.log(np.array([0.5, 0.5, 0.25, 0.125]))
    bands = diagnostics.entropy_per_frequency_band(ll, targets, counts, [1, 3])
    assert [b["band"] for b in bands] == ["0-1", "1-3", "3-4"]
    assert [b["tokens"] for b in bands] == [2, 1, 1]
    np.testing.assert_allclose([b["entropy_bits"] for b in bands], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="increasing"):
        diagnostics.entropy_per_frequency_band(ll, targets, counts, [3, 1])
