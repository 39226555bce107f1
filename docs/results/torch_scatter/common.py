import os, numpy as np
import keras
from keras import ops
B = keras.backend.backend()

def to_np(x):
    if hasattr(x, 'detach'): x = x.detach().cpu()
    return np.asarray(ops.convert_to_numpy(x), dtype=np.float64)

def value_and_grad(f, arrays):
    """f(list of backend tensors) -> scalar; returns (value, [grads])"""
    if B == "jax":
        import jax, jax.numpy as jnp
        xs = [jnp.asarray(a) for a in arrays]
        v, g = jax.value_and_grad(lambda xs: f(xs))(xs)
        return to_np(v), [to_np(t) for t in g]
    if B == "tensorflow":
        import tensorflow as tf
        xs = [tf.Variable(a) for a in arrays]
        with tf.GradientTape() as tape:
            v = f(xs)
        g = tape.gradient(v, xs)
        return to_np(v), [None if t is None else to_np(t) for t in g]
    if B == "torch":
        import torch
        xs = [torch.tensor(a, requires_grad=True) for a in arrays]
        v = f(xs)
        v.backward()
        return to_np(v.detach()), [None if t.grad is None else t.grad.numpy().astype(np.float64) for t in xs]

def rel(a, b):
    a = to_np(a); b = to_np(b)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))
