"""JSON-ready run records: `jsonable` (shared by both training loops)."""

from __future__ import annotations

import math

import numpy as np


def jsonable(value):
    """`value` with NumPy scalars and arrays as Python numbers and lists,
    dict keys as strings, and non-finite floats as `None`."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    return value
