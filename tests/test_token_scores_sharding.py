"""`linear_token_scores` vocabulary-parallel on JAX (4 simulated host
devices, a subprocess: `XLA_FLAGS` must be set before JAX starts): with the
kernel variable sharded on V by a `keras.distribution`, the log-probs,
entropies and their gradients (temperature, soft cap, `[d, V]` and
`[V, d]` kernels, with and without a bias) equal the single-device pass."""

import json

import pytest
from backends import run_on_simulated_devices
from backends import vocabulary_sharding

pytest.importorskip("jax")

DEVICES = 4


@pytest.mark.slow
def test_vocab_parallel_scores_match_single_device():
    result = run_on_simulated_devices(__file__, DEVICES)
    assert sorted(result) == ["plain", "plain_bias", "transposed", "transposed_bias"]
    for name, r in result.items():
        assert r["applies"], name
        assert r["value_err"] < 1e-5 * r["value_scale"], (name, r)
        assert r["grad_err"] < 1e-5 * r["grad_scale"], (name, r)


def child():
    import jax
    import keras
    import numpy as np
    from keras import ops

    from keras_softmax_heads.fused import linear_token_scores
    from keras_softmax_heads.fused import vocab_parallel_layout

    n, d, v = 8, 16, 96
    rng = np.random.default_rng(0)
    h = rng.normal(size=(n, d)).astype("float32")
    y = rng.integers(0, v, n).astype("int32")
    u, w_ent = rng.normal(size=n).astype("float32"), rng.normal(size=n).astype("float32")
    mesh = keras.distribution.DeviceMesh((1, DEVICES), ("batch", "model"),
                                         keras.distribution.list_devices())
    result = {}
    for transposed, with_bias in ((False, False), (True, False), (False, True), (True, True)):
        distribution = vocabulary_sharding(mesh, transposed)
        w = (rng.normal(size=(v, d) if transposed else (d, v)) * 0.5).astype("float32")
        # A bias variable with no layout of its own (replicated): the
        # vocabulary-parallel form splits it like the kernel.
        b = rng.normal(size=v).astype("float32")
        with distribution.scope():
            kernel = keras.Variable(w, name="kernel")
            bias = keras.Variable(b, name="bias") if with_bias else None
            applies = vocab_parallel_layout(kernel, transposed) is not None
            outs = {}
            for mode in (True, False):
                def loss(h, kval, bval, mode=mode):
                    mapping = [(kernel, kval)] + ([(bias, bval)] if with_bias else [])
                    with keras.StatelessScope(state_mapping=mapping):
                        lp, ent = linear_token_scores(
                            h, kernel, y, bias=bias, kernel_transposed=transposed,
                            temperature=0.7, logit_soft_cap=2.0, return_entropy=True,
                            chunk_size=16, vocab_parallel=mode)
                    return ops.sum(u * lp + w_ent * ent), (lp, ent)

                (val, (lp, ent)), grads = jax.jit(jax.value_and_grad(
                    loss, argnums=(0, 1, 2) if with_bias else (0, 1), has_aux=True))(
                        h, kernel.value, bias.value if with_bias else None)
                outs[mode] = [np.asarray(x) for x in (lp, ent, *grads)]
        a, b = outs[True], outs[False]
        name = ("transposed" if transposed else "plain") + ("_bias" if with_bias else "")
        result[name] = {
            "applies": applies,
            "value_err": float(max(np.abs(x - y).max() for x, y in zip(a[:2], b[:2]))),
            "value_scale": float(max(np.abs(x).max() for x in b[:2])),
            "grad_err": float(max(np.abs(x - y).max() for x, y in zip(a[2:], b[2:]))),
            "grad_scale": float(max(np.abs(x).max() for x in b[2:])),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    child()
