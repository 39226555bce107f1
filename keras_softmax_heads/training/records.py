"""JSON run records shared by the training loops and the studies:
`jsonable`, `read_json`, `write_json` (atomic)."""

from __future__ import annotations

import json
import math
import os

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


def read_json(path):
    """The JSON at `path`, or None when it is absent or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path, value):
    """Writes `jsonable(value)` to `path` as JSON, atomically (a temporary
    file, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(jsonable(value), f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
