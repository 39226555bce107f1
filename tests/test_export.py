"""Every head survives `model.export`, the way a model is deployed.

`model.export(path)` writes a TensorFlow SavedModel on TensorFlow and on JAX
(through jax2tf, with a symbolic batch dimension and the heads' custom
gradients saved), `format="torch"` a `torch.export` program on PyTorch, and
`format="onnx"` an ONNX file (tf2onnx on TensorFlow). Each exported artifact
is loaded without Keras or this library and must give the model's
log-probabilities. `docs/export.md` says which formats hold for which head.
"""

import os

import keras
import numpy as np
import pytest
from backends import BACKEND

from keras_softmax_heads.heads.registry import HEADS
from keras_softmax_heads.heads.registry import make_head

pytestmark = pytest.mark.multibackend

V, D, T = 50, 8, 5
COUNTS = np.arange(V, 0, -1).astype("float64")


def _model(name):
    head = make_head(name, V, counts=COUNTS)
    model = keras.Sequential(
        [keras.Input((T,), dtype="int32"), keras.layers.Embedding(V, D),
         keras.layers.Dense(D, activation="tanh"), head]
    )
    return model


def _tokens(batch):
    return np.random.default_rng(batch).integers(0, V, size=(batch, T)).astype("int32")


def _check(out, model, x, name):
    ref = keras.ops.convert_to_numpy(model(x))
    # The exported graph may round differently (XLA, fused kernels).
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5, err_msg=name)


#: A plain head, PLIF's custom gradient and the hierarchical layout on
#: TensorFlow; on JAX (jax2tf, 5 s a head) PLIF, whose tiling must not
#: compare the symbolic batch. `-m slow` exports the others too.
SAVED_MODEL_DEFAULT = ("full_softmax", "plif", "hierarchical") if BACKEND != "jax" else ("plif",)


@pytest.mark.skipif(BACKEND == "torch", reason="PyTorch exports with format='torch'")
def test_every_head_exports_a_saved_model(tmp_path):
    """The SavedModel's `serve` at another batch size than the one traced
    (JAX: a symbolic batch, which PLIF's tiling must not compare)."""
    _export_saved_models(tmp_path, SAVED_MODEL_DEFAULT)


# Under `-m slow` (11 s on TensorFlow; jax2tf takes 2 s a head): by default
# test_every_head_exports_onnx traces every head's TensorFlow inference graph.
@pytest.mark.slow
@pytest.mark.skipif(BACKEND == "torch", reason="PyTorch exports with format='torch'")
def test_every_other_head_exports_a_saved_model(tmp_path):
    _export_saved_models(tmp_path, [h for h in HEADS if h not in SAVED_MODEL_DEFAULT])


def _export_saved_models(tmp_path, names):
    import tensorflow as tf

    for name in names:
        model = _model(name)
        model(_tokens(2))
        path = str(tmp_path / name)
        model.export(path, verbose=False)
        x = _tokens(3)
        loaded = tf.saved_model.load(path)
        _check(loaded.serve(tf.constant(x)).numpy(), model, x, name)


@pytest.mark.skipif(BACKEND != "torch", reason="format='torch' is PyTorch's")
def test_every_head_exports_a_torch_program(tmp_path):
    import torch

    x = _tokens(1)  # Keras' torch export specialises the batch it traces
    for name in HEADS:
        model = _model(name)
        model(x)
        path = str(tmp_path / f"{name}.pt2")
        model.export(path, format="torch", verbose=False)
        out = torch.export.load(path).module()(torch.as_tensor(x))
        _check(out.detach().numpy(), model, x, name)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the TensorFlow graph's property")
def test_inference_graph_holds_no_xla_function():
    """The inference call (`training=False`, what `model.export` traces)
    adds no nested XLA-compiled function, which converters that inline a
    graph op by op cannot handle (tf2onnx wrote an invalid ONNX file);
    the training loss keeps it (`test_plif`)."""
    import tensorflow as tf

    def compiled_functions(fn, spec):
        graph = tf.function(fn, autograph=False).get_concrete_function(spec).graph
        library = graph.as_graph_def().library.function
        return [f.signature.name for f in library if f.attr["_XlaMustCompile"].b]

    for name in ("plif", "monotonic"):
        model = _model(name)
        head = model.layers[-1]
        tokens = tf.TensorSpec([None, T], tf.int32)
        assert not compiled_functions(lambda x: model(x, training=False), tokens), name
        # The same head's log-probabilities outside `call` keep the kernel.
        contexts = tf.TensorSpec([None, T, D], tf.float32)
        assert compiled_functions(head.log_probs, contexts), name


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf2onnx converts TensorFlow graphs")
def test_every_head_exports_onnx(tmp_path):
    pytest.importorskip("tf2onnx")
    ort = pytest.importorskip("onnxruntime")
    for name in HEADS:
        model = _model(name)
        model(_tokens(2))
        path = os.path.join(tmp_path, f"{name}.onnx")
        model.export(path, format="onnx", verbose=False)
        session = ort.InferenceSession(path)
        x = _tokens(3)
        _check(session.run(None, {session.get_inputs()[0].name: x})[0], model, x, name)


@pytest.mark.skipif(BACKEND == "torch", reason="PyTorch exports with format='torch'")
def test_head_model_exports_an_int32_id_signature(tmp_path):
    """`HeadModel` (what `examples/train_lm.py` saves as
    `inference_model.keras`) on the library's LSTM backbone: `model.export`
    infers the signature from its input dtype, word ids (`int32`; it wrote
    float32 and `serve` refused int32 ids), and the SavedModel gives the
    model's log-probabilities."""
    import tensorflow as tf

    import keras_softmax_heads as ksh
    from keras_softmax_heads.models import get_model_class

    backbone = get_model_class("lstm")(vocab_size=V, embedding_dim=D, hidden_size=D,
                                       num_layers=1, stateful=False)
    model = ksh.HeadModel(backbone, make_head("full_softmax", V))
    assert model.input_dtype == "int32"
    x = _tokens(2)
    model(x)
    path = str(tmp_path / "head_model")
    model.export(path, verbose=False)
    loaded = tf.saved_model.load(path)
    spec = loaded.signatures["serving_default"].structured_input_signature[1]
    assert [s.dtype for s in spec.values()] == [tf.int32], spec
    _check(loaded.serve(tf.constant(x)).numpy(), model, x, "head_model")
    sequential = ksh.HeadModel(keras.Sequential([keras.Input((T,), dtype="int32"),
                                                 keras.layers.Embedding(V, D)]),
                               make_head("full_softmax", V))
    assert sequential.input_dtype == "int32"
