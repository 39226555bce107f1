"""The summed cores' elementwise primitives of `chunked.dispatch`
(`shifted_exp`, `scaled_minus_target`, `multiply`): equal to NumPy and to
their `keras.ops` form on every backend; on PyTorch written in place of a
buffer of their own outside automatic differentiation (the path seen to be
taken), never in place of the caller's inputs, and differentiable as the
`keras.ops` form where autograd records them."""

import keras
import numpy as np
import pytest
from backends import BACKEND
from backends import to_numpy
from keras import ops
from multibackend import float64_enabled

from keras_softmax_heads.chunked import dispatch

pytestmark = pytest.mark.multibackend


def _inputs(dtype="float32"):
    rng = np.random.default_rng(0)
    s = (3.0 * rng.normal(size=(5, 7))).astype(dtype)
    scale = rng.uniform(0.1, 2.0, size=5).astype(dtype)
    targets = np.array([0, 6, 3, 3, 1], "int32")
    delta = rng.uniform(-1.0, 1.0, size=5).astype(dtype)
    return s, scale, targets, delta


def _oracle(e, scale, targets, delta):
    out = e.astype("float64") * scale[:, None]
    out[np.arange(len(targets)), targets] -= delta
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_primitives_match_numpy_and_the_ops_form(dtype, monkeypatch):
    s, scale, targets, delta = _inputs(dtype)
    peak = s.max(axis=1)
    tol = 1e-6 if dtype == "float32" else 1e-12

    def run():
        e = dispatch.shifted_exp(ops.convert_to_tensor(s), ops.convert_to_tensor(peak))
        e_np = to_numpy(e).copy()
        out = dispatch.scaled_minus_target(e, scale, targets, delta)
        out = dispatch.multiply(out, ops.convert_to_tensor(np.full((5, 1), 2.0, dtype)))
        return e_np, to_numpy(out)

    with float64_enabled():
        e, out = run()
    assert e.dtype == dtype and out.dtype == dtype
    np.testing.assert_allclose(e, np.exp(s - peak[:, None]), rtol=tol)
    np.testing.assert_allclose(out, 2.0 * _oracle(e, scale, targets, delta), rtol=tol, atol=tol)
    monkeypatch.setattr(dispatch, "overwritable", lambda *tensors: False)
    with float64_enabled():
        e_ops, out_ops = run()
    np.testing.assert_array_equal(e_ops, e)
    np.testing.assert_array_equal(out_ops, out)


def test_in_place_only_on_pytorch_and_never_of_the_inputs():
    """On PyTorch (outside autograd) `shifted_exp` leaves its scores and
    `scaled_minus_target` / `multiply` return the buffer they were given;
    the scores themselves are untouched; elsewhere nothing is overwritten."""
    s, scale, targets, delta = _inputs()
    s_t = ops.convert_to_tensor(s)
    e = dispatch.shifted_exp(s_t, ops.max(s_t, axis=1))
    np.testing.assert_array_equal(to_numpy(s_t), s)
    e_before = to_numpy(e).copy()
    out = dispatch.scaled_minus_target(e, ops.convert_to_tensor(scale), targets,
                                       ops.convert_to_tensor(delta))
    doubled = dispatch.multiply(out, 2.0)
    assert dispatch.overwritable(e) == (BACKEND == "torch")
    if BACKEND == "torch":
        assert out.data_ptr() == e.data_ptr() and doubled.data_ptr() == e.data_ptr()
    else:
        np.testing.assert_array_equal(to_numpy(e), e_before)
    assert dispatch.multiply(out, 1.0) is out
    unscaled = dispatch.scaled_minus_target(ops.convert_to_tensor(s), None, targets,
                                            ops.convert_to_tensor(delta))
    np.testing.assert_allclose(to_numpy(unscaled), _oracle(s, np.ones(5), targets, delta),
                               rtol=1e-6, atol=1e-6)


def test_multiply_falls_back_where_it_cannot_write_in_place():
    """A factor of another dtype, or one that broadcasts `a` to a larger
    shape, is multiplied as `keras.ops.multiply` does (a new tensor of the
    promoted dtype and shape; `a` untouched), on every backend."""
    a = ops.convert_to_tensor(np.ones((1, 3), "float32"))
    wider = dispatch.multiply(a, ops.convert_to_tensor(np.full((2, 3), 3.0, "float32")))
    assert tuple(wider.shape) == (2, 3)
    np.testing.assert_array_equal(to_numpy(a), np.ones((1, 3)))
    half = ops.convert_to_tensor(np.ones((1, 3), "float16"))
    other = dispatch.multiply(half, ops.convert_to_tensor(np.full((1, 3), 2.0, "float32")))
    assert keras.backend.standardize_dtype(other.dtype) == "float32"
    np.testing.assert_array_equal(to_numpy(half), np.ones((1, 3)))


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's autograd")
def test_recorded_by_autograd_they_are_the_ops_form_and_differentiable():
    """Where autograd records the scores, the primitives are the
    `keras.ops` form (no in-place write of a tensor autograd saved), and
    their gradient is the oracle's."""
    import torch

    s, scale, targets, delta = _inputs("float64")
    x = torch.tensor(s, requires_grad=True)
    peak = torch.max(x, dim=1).values.detach()
    e = dispatch.shifted_exp(x, peak)
    assert not dispatch.overwritable(e)
    out = dispatch.multiply(dispatch.scaled_minus_target(e, torch.tensor(scale), targets,
                                                         torch.tensor(delta)), 2.0)
    (grad,) = torch.autograd.grad(out.sum(), [x])
    expected = 2.0 * np.exp(s - s.max(axis=1, keepdims=True)) * scale[:, None]
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-12)


def test_sigsoftmax_scores_match_the_ops_form(monkeypatch):
    """SigSoftmax's component scores and their slope, wide and tiny `z`
    included, equal NumPy's and, bit for bit, the `keras.ops` form; `z`
    untouched."""
    z = np.array([[-40.0, -3.0, 0.0, 0.5, 25.0], [1.0, -1.0, 2.0, -2.0, 30.0]], "float32")
    z_t = ops.convert_to_tensor(z)
    s, slope = (to_numpy(x) for x in dispatch.sigsoftmax_scores(z_t))
    np.testing.assert_array_equal(to_numpy(z_t), z)
    np.testing.assert_allclose(s, z - np.logaddexp(0.0, -z.astype("float64")), rtol=1e-6)
    np.testing.assert_allclose(slope, 1.0 + 1.0 / (1.0 + np.exp(z.astype("float64"))),
                               rtol=1e-6)
    monkeypatch.setattr(dispatch, "overwritable", lambda *tensors: False)
    s_ops, slope_ops = (to_numpy(x) for x in dispatch.sigsoftmax_scores(z_t))
    np.testing.assert_array_equal(s, s_ops)
    np.testing.assert_array_equal(slope, slope_ops)


@pytest.mark.parametrize("transposed_begin", [False, True])
def test_slice_writes_match_the_ops_form(transposed_begin, monkeypatch):
    """`update_slice` and `add_to_slice` equal `keras.ops.slice_update`
    (on PyTorch written into the buffer itself, the path seen taken);
    a tensor `begin` takes the `keras.ops` form on every backend."""
    rng = np.random.default_rng(1)
    base = rng.normal(size=(4, 6)).astype("float32")
    values = rng.normal(size=(2, 3)).astype("float32")
    begin = [2, 3] if transposed_begin else [1, 0]
    expected_set, expected_add = base.copy(), base.copy()
    rows, cols = slice(begin[0], begin[0] + 2), slice(begin[1], begin[1] + 3)
    expected_set[rows, cols] = values
    expected_add[rows, cols] += values
    for fn, expected in ((dispatch.update_slice, expected_set),
                         (dispatch.add_to_slice, expected_add)):
        buffer = ops.convert_to_tensor(base.copy())
        out = fn(buffer, begin, ops.convert_to_tensor(values))
        np.testing.assert_allclose(to_numpy(out), expected, rtol=1e-6)
        if BACKEND == "torch":
            assert out.data_ptr() == buffer.data_ptr()
        tensor_begin = [ops.convert_to_tensor(b, "int32") for b in begin]
        out = fn(ops.convert_to_tensor(base.copy()), tensor_begin, ops.convert_to_tensor(values))
        np.testing.assert_allclose(to_numpy(out), expected, rtol=1e-6)
    monkeypatch.setattr(dispatch, "overwritable", lambda *tensors: False)
    buffer = ops.convert_to_tensor(base.copy())
    out = dispatch.add_to_slice(buffer, begin, ops.convert_to_tensor(values))
    np.testing.assert_allclose(to_numpy(out), expected_add, rtol=1e-6)
    np.testing.assert_array_equal(to_numpy(buffer), base)


def test_subtract_matches_numpy_in_place_on_pytorch():
    """`subtract` equals `a - b`; on PyTorch into `a` itself, `b` untouched;
    a broadcast `b` takes the `keras.ops` form on every backend."""
    a_np, b_np = np.full((2, 3), 3.0, "float32"), np.arange(6, dtype="float32").reshape(2, 3)
    a, b = ops.convert_to_tensor(a_np), ops.convert_to_tensor(b_np)
    out = dispatch.subtract(a, b)
    np.testing.assert_array_equal(to_numpy(out), a_np - b_np)
    np.testing.assert_array_equal(to_numpy(b), b_np)
    if BACKEND == "torch":
        assert out.data_ptr() == a.data_ptr()
    row = ops.convert_to_tensor(np.ones((1, 3), "float32"))
    wide = dispatch.subtract(row, b)
    np.testing.assert_array_equal(to_numpy(wide), 1.0 - b_np)
    np.testing.assert_array_equal(to_numpy(row), np.ones((1, 3)))
