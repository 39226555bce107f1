"""Tests for `keras_softmax_heads.clustering` (numpy / scikit-learn only)."""

import json

import numpy as np
import pytest
import scipy.sparse
from sklearn.metrics import adjusted_rand_score

from keras_softmax_heads import clustering
from keras_softmax_heads.clustering import (
    ClusterAssignment,
    cooccurrence_matrix,
    frequency_clusters,
    hierarchical_layout,
    kmeans_clusters,
    make_clusters,
    random_clusters,
)

# NumPy / SciPy only: the same on every Keras backend.
pytestmark = pytest.mark.multibackend

NUM_TOPICS = 6
WORDS_PER_TOPIC = 10
VOCAB = NUM_TOPICS * WORDS_PER_TOPIC


def topic_corpus(seed=0, num_sentences=300, length=40, topic_probs=None):
    """Sentences drawn from one topic each; topic t owns words
    [t * 10, (t + 1) * 10), Zipfian within the topic. Words of a topic only
    share contexts with their own topic (up to sentence boundaries)."""
    rng = np.random.default_rng(seed)
    within = 1.0 / np.arange(1, WORDS_PER_TOPIC + 1)
    within /= within.sum()
    if topic_probs is None:
        topic_probs = np.full(NUM_TOPICS, 1.0 / NUM_TOPICS)
    topics = rng.choice(NUM_TOPICS, size=num_sentences, p=topic_probs)
    sentences = [
        t * WORDS_PER_TOPIC + rng.choice(WORDS_PER_TOPIC, size=length, p=within) for t in topics
    ]
    return np.concatenate(sentences)


def truth():
    return np.arange(VOCAB) // WORDS_PER_TOPIC


def zipf_counts(vocab_size, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.round(1e5 / np.arange(1, vocab_size + 1)).astype(np.int64)
    return counts[rng.permutation(vocab_size)]  # word ids not sorted by count


def masses(assignment, counts, num_clusters):
    return np.bincount(assignment, weights=counts, minlength=num_clusters)


def assert_layout_consistent(layout, vocab_size, num_clusters):
    assert layout.vocab_size == vocab_size
    assert layout.num_clusters == num_clusters
    words = np.arange(vocab_size)
    np.testing.assert_array_equal(
        layout.cluster_words[layout.cluster_of_word, layout.position_in_cluster], words
    )
    assert layout.cluster_words.shape == (num_clusters, layout.max_cluster_size)
    assert layout.max_cluster_size == layout.cluster_sizes.max()
    assert layout.cluster_sizes.min() >= 1
    np.testing.assert_array_equal(layout.mask.sum(axis=1), layout.cluster_sizes)
    assert np.all(layout.cluster_words[~layout.mask] == clustering.PAD_WORD)
    assert sorted(layout.cluster_words[layout.mask].tolist()) == words.tolist()
    for array in (layout.cluster_of_word, layout.position_in_cluster, layout.cluster_words, layout.cluster_sizes):
        assert array.dtype == np.int32
        assert not array.flags.writeable


# ---------------------------------------------------------------- random


def test_random_is_balanced_and_seeded():
    a = random_clusters(103, 10, seed=0)
    assert a.shape == (103,) and a.dtype == np.int32
    sizes = np.bincount(a, minlength=10)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == 103
    np.testing.assert_array_equal(a, random_clusters(103, 10, seed=0))
    assert not np.array_equal(a, random_clusters(103, 10, seed=1))


# ------------------------------------------------------------- frequency


def test_frequency_flat_counts_give_equal_mass():
    counts = np.random.default_rng(0).integers(1, 11, size=100)
    a = frequency_clusters(counts, 7)
    m = masses(a, counts, 7)
    assert np.all(np.abs(m - counts.sum() / 7) <= counts.max())
    # Cluster ids are non-decreasing along the frequency ranking.
    order = np.argsort(-counts, kind="stable")
    assert np.all(np.diff(a[order]) >= 0)
    np.testing.assert_array_equal(a, frequency_clusters(counts, 7))


def test_frequency_zipf_heavy_words_get_their_own_cluster():
    counts = zipf_counts(400)
    num_clusters = 20
    a = frequency_clusters(counts, num_clusters)
    sizes = np.bincount(a, minlength=num_clusters)
    m = masses(a, counts, num_clusters)
    assert sizes.min() >= 1
    # The most frequent word (~15% of the mass) is alone in cluster 0.
    top = int(np.argmax(counts))
    assert a[top] == 0 and sizes[0] == 1
    # Leading heavy singletons: each reaches remaining mass / remaining clusters.
    head, remaining = 0, float(counts.sum())
    while sizes[head] == 1 and m[head] >= remaining / (num_clusters - head):
        remaining -= m[head]
        head += 1
    assert head >= 2
    tail_words = a >= head
    tail_target = remaining / (num_clusters - head)
    # The other clusters have equal mass up to the heaviest tail word.
    assert np.all(np.abs(m[head:] - tail_target) <= counts[tail_words].max())
    assert np.all(m[:head] >= tail_target)


def test_frequency_all_mass_on_few_words():
    a = frequency_clusters([10, 0, 0, 0, 0], 3)
    assert sorted(np.bincount(a).tolist()) == [1, 2, 2]
    assert a[0] == 0


# ---------------------------------------------------------------- k-means


def test_cooccurrence_matrix_counts_symmetric_windows():
    ids = np.array([0, 1, 2, 0, 1])
    m = cooccurrence_matrix(ids, vocab_size=4, window=2, context_size=2)
    assert scipy.sparse.issparse(m) and m.shape == (4, 2)
    # Context columns: words 0 and 1 (most frequent, ties by id).
    dense = m.toarray()
    brute = np.zeros((4, 2))
    for i, w in enumerate(ids):
        for j in range(max(0, i - 2), min(len(ids), i + 3)):
            if j != i and ids[j] in (0, 1):
                brute[w, ids[j]] += 1
    np.testing.assert_array_equal(dense, brute)


@pytest.mark.parametrize("strategy", ["kmeans", "weighted_kmeans"])
def test_kmeans_recovers_topics(strategy):
    ids = topic_corpus()
    layout = make_clusters(
        strategy, ids=ids, vocab_size=VOCAB, num_clusters=NUM_TOPICS, max_cluster_fraction=None
    )
    assert adjusted_rand_score(truth(), layout.cluster_of_word) > 0.95
    assert_layout_consistent(layout, VOCAB, NUM_TOPICS)
    again = make_clusters(
        strategy, ids=ids, vocab_size=VOCAB, num_clusters=NUM_TOPICS, max_cluster_fraction=None
    )
    assert again == layout


def test_kmeans_accepts_a_cooccurrence_matrix():
    ids = topic_corpus()
    matrix = cooccurrence_matrix(ids, VOCAB, window=3)
    a = kmeans_clusters(matrix, NUM_TOPICS, max_cluster_fraction=None, embedding_dim=16)
    assert adjusted_rand_score(truth(), a) > 0.95
    b = kmeans_clusters(matrix.toarray(), NUM_TOPICS, max_cluster_fraction=None, embedding_dim=16)
    np.testing.assert_array_equal(a, b)


def test_kmeans_cap_holds_and_binds():
    # One topic carries ~55% of the tokens: uncapped k-means gives it one
    # cluster of >10% mass; with the cap every cluster is <= 10% or a
    # single (heavier) word.
    probs = np.array([0.55, 0.09, 0.09, 0.09, 0.09, 0.09])
    ids = topic_corpus(topic_probs=probs)
    counts = np.bincount(ids, minlength=VOCAB)
    num_clusters = 16
    free = kmeans_clusters(ids, num_clusters, vocab_size=VOCAB, max_cluster_fraction=None)
    assert masses(free, counts, num_clusters).max() > 0.1 * counts.sum()
    for weighted in (False, True):
        a = kmeans_clusters(ids, num_clusters, vocab_size=VOCAB, weighted=weighted, max_cluster_fraction=0.1)
        m = masses(a, counts, num_clusters)
        sizes = np.bincount(a, minlength=num_clusters)
        assert sizes.min() >= 1
        over = m > 0.1 * counts.sum()
        assert np.all(sizes[over] == 1)
        assert np.all(np.diff(m) <= 0)  # clusters ordered by descending mass
        # Words pushed out of a full cluster go to the nearest centroid with
        # room; here topics are orthogonal, so some clusters get mixed.
        purity = sum(np.bincount(truth()[a == c]).max() for c in range(num_clusters)) / VOCAB
        assert purity >= (0.95 if weighted else 0.75)


def test_kmeans_heavy_word_gets_own_cluster():
    ids = topic_corpus()
    counts = np.bincount(ids, minlength=VOCAB).astype(np.float64)
    counts[7] = counts.sum()  # word 7 now holds ~50% of the mass
    a = kmeans_clusters(ids, 12, counts=counts, vocab_size=VOCAB, max_cluster_fraction=0.1)
    assert a[7] == 0 and np.sum(a == 0) == 1
    assert np.all(masses(a, counts, 12)[1:] <= 0.1 * counts.sum() + 1e-6)


def test_kmeans_fills_empty_clusters_with_duplicate_points():
    # Two distinct context profiles, four clusters requested.
    ids = np.array([0, 1] * 20 + [2, 3] * 20)
    a = kmeans_clusters(ids, 4, vocab_size=4, max_cluster_fraction=None)
    assert sorted(a.tolist()) == [0, 1, 2, 3]


def test_default_num_clusters_and_make_clusters_random():
    assert clustering.default_num_clusters(50) == 8
    layout = make_clusters("random", counts=np.ones(50))
    assert layout.num_clusters == 8
    assert_layout_consistent(layout, 50, 8)
    assert make_clusters("random", vocab_size=50, seed=3) == make_clusters("random", vocab_size=50, seed=3)
    assert make_clusters("random", vocab_size=50, seed=3) != make_clusters("random", vocab_size=50, seed=4)


def test_make_clusters_frequency_from_ids():
    ids = topic_corpus()
    counts = np.bincount(ids, minlength=VOCAB)
    a = make_clusters("frequency", ids=ids, vocab_size=VOCAB, num_clusters=5)
    b = make_clusters("frequency", counts=counts, num_clusters=5)
    assert a == b
    assert_layout_consistent(a, VOCAB, 5)


# ---------------------------------------------------------------- layout


def test_layout_arrays():
    layout = hierarchical_layout([2, 0, 2, 1, 2, 0])
    assert layout.num_clusters == 3 and layout.max_cluster_size == 3
    assert layout.cluster_words.tolist() == [[1, 5, -1], [3, -1, -1], [0, 2, 4]]
    assert layout.cluster_sizes.tolist() == [2, 1, 3]
    assert layout.position_in_cluster.tolist() == [0, 0, 1, 0, 2, 1]
    assert layout.padded_cluster_words(6).tolist() == [[1, 5, 6], [3, 6, 6], [0, 2, 4]]
    assert_layout_consistent(layout, 6, 3)
    assert "num_clusters=3" in repr(layout)


@pytest.mark.parametrize("suffix", [".json", ".npz", ".bin"])
def test_save_load_round_trip(tmp_path, suffix):
    layout = make_clusters("random", vocab_size=37, num_clusters=5, seed=1)
    path = tmp_path / f"clusters{suffix}"
    layout.save(path)
    assert path.exists()
    loaded = ClusterAssignment.load(path)
    assert loaded == layout
    for name in ("cluster_of_word", "position_in_cluster", "cluster_words", "cluster_sizes"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(layout, name))
    if suffix != ".json":
        with np.load(path, allow_pickle=False) as data:  # no object arrays
            assert all(data[k].dtype != object for k in data.files)


def test_config_and_json_are_plain_python():
    layout = make_clusters("frequency", counts=zipf_counts(30), num_clusters=4)
    config = layout.to_config()
    assert json.loads(json.dumps(config)) == config
    assert all(type(v) is int for v in config["cluster_of_word"])
    assert ClusterAssignment.from_config(config) == layout
    assert ClusterAssignment.from_json(layout.to_json()) == layout


def test_frozen_and_validated():
    layout = hierarchical_layout([0, 1, 1])
    with pytest.raises(Exception):
        layout.num_clusters = 4
    with pytest.raises(ValueError):
        layout.cluster_words[0, 0] = 2
    bad = layout.cluster_words.copy()
    bad[1, :] = bad[1, ::-1]
    with pytest.raises(ValueError, match="Inconsistent"):
        ClusterAssignment(layout.cluster_of_word, layout.position_in_cluster, bad, layout.cluster_sizes)


# ------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: random_clusters(100, 120), "num_clusters=120 > vocab_size=100"),
        (lambda: random_clusters(100, 0), "num_clusters=0"),
        (lambda: random_clusters(100, 2.5), "num_clusters=2.5"),
        (lambda: random_clusters(10, 2, seed=-1), "seed=-1"),
        (lambda: frequency_clusters([3, 2, 1], 4), "num_clusters=4 > vocab_size=3"),
        (lambda: frequency_clusters([3, -2, 1], 2), r"counts\[1\]=-2"),
        (lambda: frequency_clusters([0, 0, 0], 2), "all zero"),
        (lambda: frequency_clusters([[1, 2]], 1), r"shape=\(1, 2\)"),
        (lambda: frequency_clusters([1.0, np.nan], 1), "finite"),
        (lambda: make_clusters("frequency", counts=[1, 2, 3], vocab_size=4), r"vocab_size=4, len\(counts\)=3"),
        (lambda: kmeans_clusters([0, 1, 0], 2, counts=[1, 2, 3, 4], vocab_size=3), "len\\(counts\\)=4 != vocab_size=3"),
        (lambda: make_clusters("hierarchical", vocab_size=10), "strategy='hierarchical'"),
        (lambda: make_clusters("random"), "vocab_size"),
        (lambda: make_clusters("kmeans", vocab_size=10), "ids"),
        (lambda: make_clusters("frequency", vocab_size=10), "counts"),
        (lambda: cooccurrence_matrix([0.0, 1.0], 2), "dtype=float64"),
        (lambda: cooccurrence_matrix([0, 5], 3), "equal to 5"),
        (lambda: cooccurrence_matrix([0, -1], 3), "equal to -1"),
        (lambda: cooccurrence_matrix([0, 1], 3, window=0), "window=0"),
        (lambda: hierarchical_layout([0, 3, 1], num_clusters=3), r"assignment\[1\]=3"),
        (lambda: hierarchical_layout([0, -1, 1]), r"assignment\[1\]=-1"),
        (lambda: hierarchical_layout([0, 2, 2]), "empty: \\[1\\]"),
        (lambda: hierarchical_layout([0.0, 1.0]), "dtype=float64"),
        (lambda: hierarchical_layout([]), "non-empty"),
        (lambda: ClusterAssignment.from_config({"foo": 1}), "cluster_of_word"),
        (lambda: kmeans_clusters([0, 1], 2, vocab_size=2, max_cluster_fraction=1.5), "max_cluster_fraction=1.5"),
    ],
)
def test_bad_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_impossible_cap_raises():
    ids = topic_corpus()
    # 5 clusters x 10% can hold at most half of the mass.
    with pytest.raises(ValueError, match="max_cluster_fraction=0.1 is impossible with num_clusters=5"):
        kmeans_clusters(ids, 5, vocab_size=VOCAB, max_cluster_fraction=0.1)
    with pytest.raises(ValueError, match="max_cluster_fraction=0.1"):
        make_clusters("kmeans", ids=ids, vocab_size=VOCAB, num_clusters=5)
