import keras
import numpy as np
import pytest
from backends import to_numpy
from battery import HeadBattery
from references import numpy_log_softmax

import keras_softmax_heads as ksh

pytestmark = pytest.mark.multibackend


class TestFullSoftmaxBattery(HeadBattery):
    torch_compile_by_default = True
    cases = {
        "bias": lambda v, d, **kw: ksh.FullSoftmax(v, **kw),
        "no_bias": lambda v, d, **kw: ksh.FullSoftmax(v, use_bias=False, **kw),
    }


def test_numpy_reference():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(5, 7, 8)).astype("float32")
    head = ksh.FullSoftmax(11, bias_initializer="random_normal")
    out = to_numpy(head(h))
    z = h @ head.kernel.numpy() + head.bias.numpy()
    np.testing.assert_allclose(out, numpy_log_softmax(z), atol=1e-5)


def test_tied_weights_share_the_embedding():
    emb = keras.layers.Embedding(9, 4)
    emb.build((None,))
    head = ksh.FullSoftmax(token_embedding=emb, use_bias=False)
    h = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    expected = numpy_log_softmax(h @ emb.embeddings.numpy().T)
    np.testing.assert_allclose(to_numpy(head(h)), expected, atol=1e-5)
    assert [w.path for w in head.trainable_weights] == [emb.embeddings.path]


def test_return_probabilities():
    head = ksh.FullSoftmax(6, return_probabilities=True)
    p = to_numpy(head(np.ones((2, 3), "float32")))
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("vocab_size", [0, 1, 2.5, -3])
def test_bad_vocab_size(vocab_size):
    with pytest.raises(ValueError, match="Received: vocab_size"):
        ksh.FullSoftmax(vocab_size)


def test_token_ids_as_context_vectors_are_refused():
    head = ksh.FullSoftmax(10)
    with pytest.raises(ValueError, match=r"floating-point context vectors.*int32.*Token ids\?"):
        head(np.zeros((2, 4), "int32"))
    with pytest.raises(ValueError, match="Token ids"):
        keras.Sequential([keras.Input((4,), dtype="int32"), ksh.FullSoftmax(10)])
