"""Data-derived head structure survives configs, `clone_model` and `.keras`.

`HierarchicalSoftmax` (clusters), `SampledSoftmax` / `NCE` (unigram counts)
and `DifferentiatedSoftmax` (frequency ranking) carry their structure in
`get_config`, so `from_config` alone rebuilds it. Configs written by
keras-softmax-heads 0.1.0 (`clusters=None` / `counts=None`, the structure in
the weights only) still load with their weights, and raise when used before
their weights are loaded.
"""

import json
import os
import tempfile
import zipfile

import keras
import numpy as np
import pytest

import keras_softmax_heads as ksh

V, D = 12, 4
COUNTS = np.array([5, 30, 20, 12, 9, 7, 50, 4, 3, 2, 1, 1], dtype=np.float64)
DATA = os.path.join(os.path.dirname(__file__), "data")
LEGACY_HEADS = os.path.join(DATA, "legacy_v0_1_heads.keras")
LEGACY_HEAD_MODEL = os.path.join(DATA, "legacy_v0_1_head_model.keras")
# The heads of the legacy fixture (one layer of each class) whose structure
# comes from data, and the constructor argument a 0.1.0 config left as None.
LEGACY_DATA_HEADS = {
    "HierarchicalSoftmax": "clusters",
    "DifferentiatedSoftmax": "counts",
    "SampledSoftmax": "counts",
    "NCE": "counts",
}


def _kmeans_layout():
    ids = np.array([0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10, 11] * 4)
    return ksh.make_clusters(
        "kmeans", ids=ids, vocab_size=V, num_clusters=3, max_cluster_fraction=None
    )


CASES = {
    # Equal-mass bins from counts, then split (cluster_size_cap="auto").
    "hsm_frequency": lambda: ksh.HierarchicalSoftmax(V, counts=COUNTS, num_clusters=3),
    "hsm_kmeans": lambda: ksh.HierarchicalSoftmax(V, clusters=_kmeans_layout()),
    "hsm_explicit": lambda: ksh.HierarchicalSoftmax(
        V,
        clusters=np.array([2, 0, 1, 1, 2, 0, 0, 2, 1, 1, 0, 2]),
        max_cluster_size=6,
        cluster_size_cap=4,
        counts=COUNTS,
    ),
    "hsm_random": lambda: ksh.HierarchicalSoftmax(
        V, clustering="random", num_clusters=4, seed=3
    ),
    "hsm_id_order": lambda: ksh.HierarchicalSoftmax(V, num_clusters=3),
    "sampled_unigram": lambda: ksh.SampledSoftmax(
        V, num_sampled=5, sampler="unigram", counts=COUNTS, distortion=0.75, seed=1
    ),
    "sampled_float_counts": lambda: ksh.SampledSoftmax(
        V, num_sampled=5, sampler="unigram", counts=COUNTS / 3.0, seed=1
    ),
    "nce": lambda: ksh.NCE(V, num_sampled=5, counts=COUNTS.astype(np.int64), seed=2),
    "dsm_counts": lambda: ksh.DifferentiatedSoftmax(
        V, counts=COUNTS, bands=[(4, 3), (8, 1)]
    ),
    "dsm_id_order": lambda: ksh.DifferentiatedSoftmax(V, bands=[(4, 3), (8, 1)]),
}


def _inputs(seed=0, n=6):
    return np.random.default_rng(seed).normal(size=(n, D)).astype("float32")


def _targets(seed=0, n=6):
    return np.random.default_rng(seed).integers(0, V, size=n).astype("int32")


def _randomise(layer, seed=0):
    rng = np.random.default_rng(seed)
    for variable in layer.trainable_variables:
        variable.assign(rng.normal(size=variable.shape).astype("float32") * 0.5)


def _built(case):
    head = CASES[case]()
    head(_inputs())
    _randomise(head)
    return head


def _structure(layer):
    """The non-trainable weights (layout, ranking, sampling tables)."""
    return {
        w.name: np.asarray(w.numpy())
        for w in layer.non_trainable_weights
        if "seed_generator" not in w.path
    }


def _assert_same_structure(a, b):
    sa, sb = _structure(a), _structure(b)
    assert list(sa) == list(sb)
    assert sa, "expected data-derived non-trainable weights"
    for name in sa:
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)


def _assert_same_outputs(a, b, h, t):
    np.testing.assert_array_equal(np.asarray(a(h)), np.asarray(b(h)))
    np.testing.assert_array_equal(
        np.asarray(a.log_likelihood(h, t)), np.asarray(b.log_likelihood(h, t))
    )


def _model(head):
    inputs = keras.Input((D,))
    hidden = keras.layers.Dense(D, name="hidden")(inputs)
    return keras.Model(inputs, head(hidden))


# ------------------------------------------------------------ new configs
@pytest.mark.parametrize("case", sorted(CASES))
def test_from_config_rebuilds_structure(case):
    head = _built(case)
    config = head.get_config()
    for key in ("clusters", "counts"):
        value = config.get(key)
        assert value is None or isinstance(value, (list, dict))
    # Plain JSON: what `.keras` files and `clone_model` carry.
    config = json.loads(json.dumps(config))
    clone = type(head).from_config(config)
    assert clone.get_config() == head.get_config()
    h, t = _inputs(1), _targets(1)
    clone(h)
    # The structure comes from the config alone, before any weights are set.
    _assert_same_structure(clone, head)
    assert [(w.name, tuple(w.shape), w.dtype) for w in clone.weights] == [
        (w.name, tuple(w.shape), w.dtype) for w in head.weights
    ]
    clone.set_weights(head.get_weights())
    _assert_same_outputs(clone, head, h, t)
    np.testing.assert_array_equal(
        np.asarray(clone.training_loss(h, t)), np.asarray(head.training_loss(h, t))
    )


def test_data_derived_configs_carry_the_structure():
    hsm = _built("hsm_frequency")
    clusters = hsm.get_config()["clusters"]
    assert ksh.ClusterAssignment.from_config(clusters) == hsm.cluster_assignment
    assert clusters["num_clusters"] == hsm.num_clusters == 5  # 3 bins, split
    assert ksh.SampledSoftmax(
        V, sampler="unigram", counts=COUNTS
    ).get_config()["counts"] == COUNTS.astype(int).tolist()
    floats = ksh.NCE(V, counts=COUNTS / 4).get_config()["counts"]
    assert floats == (COUNTS / 4).tolist()
    assert ksh.SampledSoftmax(V, counts=COUNTS).get_config()["counts"] is None
    dsm = ksh.DifferentiatedSoftmax(V, counts=COUNTS, bands=[(4, 3), (8, 1)])
    ranks = np.array(dsm.get_config()["counts"])
    np.testing.assert_array_equal(
        np.argsort(-ranks, kind="stable"), np.argsort(-COUNTS, kind="stable")
    )
    assert ksh.DifferentiatedSoftmax(V).get_config()["counts"] == list(range(V, 0, -1))


@pytest.mark.parametrize(
    "case", ["hsm_frequency", "hsm_kmeans", "hsm_random", "sampled_unigram", "nce", "dsm_counts"]
)
def test_clone_model(case):
    head = _built(case)
    model = _model(head)
    _randomise(model, seed=5)
    clone = keras.models.clone_model(model)
    _assert_same_structure(clone.layers[-1], head)
    clone.set_weights(model.get_weights())
    h = _inputs(2)
    np.testing.assert_array_equal(clone.predict(h, verbose=0), model.predict(h, verbose=0))


@pytest.mark.parametrize(
    "case", ["hsm_frequency", "hsm_kmeans", "hsm_random", "sampled_unigram", "nce", "dsm_counts"]
)
def test_keras_save_load(case, tmp_path):
    head = _built(case)
    model = _model(head)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded_head = loaded.layers[-1]
    assert loaded_head.get_config() == head.get_config()
    h, t = _inputs(3), _targets(3)
    np.testing.assert_array_equal(loaded.predict(h, verbose=0), model.predict(h, verbose=0))
    _assert_same_outputs(loaded_head, head, h, t)


# ---------------------------------------------------- 0.1.0 files (legacy)
def test_legacy_heads_file_loads():
    expected = np.load(os.path.join(DATA, "legacy_v0_1_heads.npz"))
    model = keras.saving.load_model(LEGACY_HEADS)
    outputs = model.predict(expected["x"], verbose=0)
    names = set(expected.files) - {"x"}
    assert set(outputs) == names
    for name in sorted(names):
        np.testing.assert_allclose(
            outputs[name], expected[name], rtol=1e-6, atol=1e-6, err_msg=name
        )
    # Loaded, the heads carry their structure in the config again.
    heads = {layer.name: layer for layer in model.layers}
    for layer in heads.values():
        config = layer.get_config()
        if isinstance(layer, ksh.HierarchicalSoftmax):
            assert config["clusters"] == layer.cluster_assignment.to_config()
        elif isinstance(layer, (ksh.SampledSoftmax, ksh.NCE)):
            assert config["counts"] == np.asarray(layer.counts.numpy()).astype(int).tolist()
        elif isinstance(layer, ksh.DifferentiatedSoftmax):
            ranks = np.array(config["counts"])
            np.testing.assert_array_equal(
                np.argsort(-ranks, kind="stable"), layer.word_order.numpy()
            )
    # ... so a clone has the structure before any weights are set.
    clone = keras.models.clone_model(model)
    for layer in clone.layers:
        if layer.non_trainable_weights:
            _assert_same_structure(layer, heads[layer.name])
    clone.set_weights(model.get_weights())
    cloned = clone.predict(expected["x"], verbose=0)
    for name in sorted(names):
        np.testing.assert_array_equal(cloned[name], outputs[name], err_msg=name)


def test_legacy_head_model_file_loads():
    expected = np.load(os.path.join(DATA, "legacy_v0_1_head_model.npz"))
    model = keras.saving.load_model(LEGACY_HEAD_MODEL)
    assert isinstance(model, ksh.HeadModel)
    assert isinstance(model.head, ksh.HierarchicalSoftmax)
    np.testing.assert_allclose(
        model.predict(expected["tokens"], verbose=0),
        expected["log_probs"],
        rtol=1e-6,
        atol=1e-6,
    )
    assert model.head.get_config()["clusters"] is not None


def _legacy_layer_configs():
    """The layer configs of the legacy heads file, by class name."""
    with zipfile.ZipFile(LEGACY_HEADS) as archive:
        config = json.loads(archive.read("config.json"))
    return {layer["class_name"]: layer for layer in config["config"]["layers"]}


def _legacy_reference():
    """The layers of the legacy heads file, loaded with their weights."""
    model = keras.saving.load_model(LEGACY_HEADS)
    return {type(layer).__name__: layer for layer in model.layers}


@pytest.mark.parametrize("name", sorted(LEGACY_DATA_HEADS))
def test_legacy_config_is_pending_until_weights_are_set(name):
    argument = LEGACY_DATA_HEADS[name]
    entry = _legacy_layer_configs()[name]
    assert entry["config"][argument] is None  # as 0.1.0 wrote it
    layer = getattr(ksh, entry["class_name"]).from_config(entry["config"])
    h, t = _inputs(4, n=5), _targets(4, n=5)
    message = rf"{entry['class_name']}.*`{argument}=None`.*0\.1\.0"
    calls = {
        "call": lambda: layer(h),
        "log_probs": lambda: layer.log_probs(h),
        "log_likelihood": lambda: layer.log_likelihood(h, t),
        "training_loss": lambda: layer.training_loss(h, t),
        "eval_loss": lambda: layer.training_loss(h, t, training=False),
    }
    for what, fn in calls.items():
        with pytest.raises(ValueError, match=message):
            fn()
    # Still pending, its config still says so: a clone is pending too.
    assert layer.get_config()[argument] is None
    with pytest.raises(ValueError, match=message):
        type(layer).from_config(layer.get_config())(h)
    reference = _legacy_reference()[name]
    layer.set_weights(reference.get_weights())
    _assert_same_structure(layer, reference)
    _assert_same_outputs(layer, reference, h, t)
    assert layer.get_config() == reference.get_config()


def test_legacy_hsm_placeholder_differs_from_the_real_layout():
    """What the pending mark protects against: the placeholder is wrong."""
    entry = _legacy_layer_configs()["HierarchicalSoftmax"]
    layer = ksh.HierarchicalSoftmax.from_config(entry["config"])
    layer.build((None, D))
    reference = _legacy_reference()["HierarchicalSoftmax"]
    placeholder = np.asarray(layer.cluster_of_word.numpy())
    assert placeholder.tolist() != reference.cluster_assignment.cluster_of_word.tolist()
    with pytest.raises(ValueError, match="clusters=None"):
        layer.cluster_assignment


def test_legacy_config_with_load_weights():
    """`load_weights` (through `load_own_variables`) clears the pending mark."""
    expected = np.load(os.path.join(DATA, "legacy_v0_1_heads.npz"))
    with zipfile.ZipFile(LEGACY_HEADS) as archive:
        config = json.loads(archive.read("config.json"))
        weights = archive.read("model.weights.h5")
    model = keras.saving.deserialize_keras_object(config)
    x = expected["x"]
    for layer in model.layers[1:]:
        if type(layer).__name__ in LEGACY_DATA_HEADS:
            with pytest.raises(ValueError, match="0.1.0"):
                layer.log_probs(x)
        else:
            layer.log_probs(x)  # the other heads have no data-derived structure
    with pytest.raises(ValueError, match="0.1.0"):
        model.predict(x, verbose=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "legacy.weights.h5")
        with open(path, "wb") as f:
            f.write(weights)
        model.load_weights(path)
    outputs = model.predict(x, verbose=0)
    for name in sorted(set(expected.files) - {"x"}):
        np.testing.assert_allclose(
            outputs[name], expected[name], rtol=1e-6, atol=1e-6, err_msg=name
        )


def test_new_config_of_a_head_without_data_is_not_pending():
    """Heads built without counts round-trip without being marked pending."""
    h = _inputs()
    for head in (
        ksh.HierarchicalSoftmax(V, clustering="random"),
        ksh.HierarchicalSoftmax(V),
        ksh.DifferentiatedSoftmax(V, bands=[(4, 3), (8, 1)]),
        ksh.SampledSoftmax(V),
        ksh.NCE(V, sampler="log_uniform"),
    ):
        clone = type(head).from_config(head.get_config())
        clone(h)  # does not raise


# ------------------------------------- 0.3.0 files (before the re-layout)
@pytest.mark.multibackend
@pytest.mark.parametrize("name", ["heads", "head_model"])
def test_v0_3_files_load_with_the_same_outputs(name):
    """`.keras` files written by 0.3.0 (`tests/data/make_v0_3_fixture.py`,
    every head) load and give the outputs 0.3.0 gave, within float32
    rounding: on TensorFlow, where they were written, to 1e-6 (identical on
    the CPU that wrote them but for the PLIF kernels, which a graph now
    compiles with XLA, `functional.dispatch.xla_in_graph`; on a CPU without
    AVX-512 TensorFlow's kernels round the adaptive head's outputs an ulp
    apart, found in session 27), elsewhere to 2e-6."""
    expected = np.load(os.path.join(DATA, f"v0_3_{name}.npz"))
    model = keras.saving.load_model(os.path.join(DATA, f"v0_3_{name}.keras"))
    if name == "heads":
        outputs = model.predict(expected["x"], verbose=0)
        names = sorted(set(expected.files) - {"x"})
        assert sorted(outputs) == names
    else:
        outputs = {"log_probs": model.predict(expected["tokens"], verbose=0)}
        names = ["log_probs"]
    for key in names:
        got = np.asarray(outputs[key])
        if keras.backend.backend() == "tensorflow":
            np.testing.assert_allclose(got, expected[key], rtol=1e-6, atol=1e-6, err_msg=key)
        else:
            np.testing.assert_allclose(got, expected[key], rtol=2e-6, atol=2e-6, err_msg=key)
