"""The inputs every side of a peer benchmark sees (NumPy, seeded).

`bench_peers.py` and `bench_adaptive.py` feed the same arrays to our heads
and to the PyTorch references (`torch_heads.py`): `h ~ N(0, 0.25)` (seed 0),
Zipfian targets (`counts[r] ∝ 1 / (r + 1)`, ids sorted by frequency; seed 1),
Glorot-uniform weights, and the adaptive softmax's usual cutoffs.
"""

import math

INPUTS = "h ~ N(0, 0.25) seed 0; Zipfian targets (1/(r+1)) seed 1"


def numpy_inputs(n, v, d):
    """`h` `[N, d]` ~ N(0, 0.25) and Zipfian int32 targets `[N]` (NumPy)."""
    import numpy as np

    h = np.random.default_rng(0).standard_normal((n, d), dtype=np.float32) * 0.5
    p = 1.0 / np.arange(1, v + 1, dtype=np.float64)
    y = np.random.default_rng(1).choice(v, size=n, p=p / p.sum()).astype(np.int32)
    return h, y


def glorot(shape, seed):
    """A float32 Glorot-uniform `[fan_out, fan_in]` draw (NumPy)."""
    import numpy as np

    limit = math.sqrt(6.0 / (shape[0] + shape[1]))
    rng = np.random.default_rng(seed)
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


#: The adaptive softmax benchmarks' cutoffs of their vocabulary sizes
#: (`bench_adaptive.py`'s docstring says where each comes from).
ADAPTIVE_CUTOFFS = {
    33278: [2000, 10000],
    100000: [2000, 10000, 50000],
    793471: [60000, 100000, 640000],
}


def adaptive_benchmark_cutoffs(v):
    """The adaptive softmax benchmarks' cutoffs: `ADAPTIVE_CUTOFFS[V]`, else
    `adaptive_cutoffs(V)`."""
    return list(ADAPTIVE_CUTOFFS[v]) if v in ADAPTIVE_CUTOFFS else adaptive_cutoffs(v)


def adaptive_cutoffs(v):
    """`[round(0.02 V), round(0.1 V), round(0.5 V)]`, deduplicated, in `(0, V)`."""
    cuts = sorted({round(v * f) for f in (0.02, 0.1, 0.5)})
    return [c for c in cuts if 0 < c < v]
