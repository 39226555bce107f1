import keras
import numpy as np
import pytest
from backends import to_numpy
from backends import value_and_grad
from battery import HeadBattery
from references import numpy_log_softmax

import keras_softmax_heads as ksh

pytestmark = pytest.mark.multibackend


class TestFullSoftmaxBattery(HeadBattery):
    cases = {
        "bias": lambda v, d, **kw: ksh.FullSoftmax(v, **kw),
        "no_bias": lambda v, d, **kw: ksh.FullSoftmax(v, use_bias=False, **kw),
        "soft_cap": lambda v, d, **kw: ksh.FullSoftmax(v, logit_soft_cap=0.5, **kw),
    }


def test_numpy_reference():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(5, 7, 8)).astype("float32")
    head = ksh.FullSoftmax(11, bias_initializer="random_normal")
    out = to_numpy(head(h))
    z = h @ head.kernel.numpy() + head.bias.numpy()
    np.testing.assert_allclose(out, numpy_log_softmax(z), atol=1e-5)


def test_logit_soft_cap_numpy_reference_and_chunked_gradients():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(6, 8)).astype("float32") * 3
    t = rng.integers(0, 11, size=(6,))
    dense = ksh.FullSoftmax(11, logit_soft_cap=2.0, bias_initializer="random_normal")
    chunked = ksh.FullSoftmax(11, logit_soft_cap=2.0, chunk_size=4)
    dense(h)
    chunked(h)
    chunked.set_weights(dense.get_weights())
    z = h @ dense.kernel.numpy() + dense.bias.numpy()
    expected = numpy_log_softmax(2.0 * np.tanh(z / 2.0))
    np.testing.assert_allclose(to_numpy(dense(h)), expected, atol=1e-5)
    for head in (dense, chunked):
        np.testing.assert_allclose(to_numpy(head.log_likelihood(h, t)),
                                   expected[np.arange(6), t], atol=1e-5)
    grads = [value_and_grad(lambda x, head=head: keras.ops.mean(head.training_loss(x, t)),
                            [h], head.trainable_weights) for head in (dense, chunked)]
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-5)
    for a, b in zip(grads[0][1] + grads[0][2], grads[1][1] + grads[1][2]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert ksh.FullSoftmax.from_config(dense.get_config()).logit_soft_cap == 2.0
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="logit_soft_cap"):
            ksh.FullSoftmax(5, logit_soft_cap=bad)


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
