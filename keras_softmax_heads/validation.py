"""Argument checks shared by every layer of the package.

Each check returns the value converted to a plain Python type, or raises
`ValueError` with a message that names the argument and echoes the bad value
(`"... Received: seed=-1"`), as Keras' own layers do. This module is the
bottom of the package's layering: it imports nothing from the package.
"""

import math
import numbers

import numpy as np


def check_int(name, value, minimum=None, maximum=None):
    """`value` as a Python int in `[minimum, maximum]` (either bound optional).

    Bools, floats and strings are rejected, even when integral.

    >>> check_int("num_knots", 10, minimum=1)
    10
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(
            f"`{name}` must be an integer{bound}. Received: {name}={value!r} "
            f"(type {type(value).__name__})"
        )
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. Received: {name}={value}"
        )
    if maximum is not None and value > maximum:
        raise ValueError(
            f"`{name}` must be an integer <= {maximum}. Received: {name}={value}"
        )
    return value


def check_seed(seed, allow_none=True):
    """A random seed: None (when `allow_none`) or an int in `[0, 2**32)`."""
    if seed is None and allow_none:
        return None
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        expected = "None or an integer" if allow_none else "an integer"
        raise ValueError(
            f"`seed` must be {expected} in [0, 2**32). Received: seed={seed!r}"
        )
    return check_int("seed", seed, minimum=0, maximum=2**32 - 1)


def check_bool(name, value):
    """`value` as a Python bool; rejects ints, strings and None."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return bool(value)


def check_rate(name, value):
    """A dropout-like rate: a float in `[0, 1)`."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Real)
        or not 0.0 <= value < 1.0
    ):
        raise ValueError(
            f"`{name}` must be a float in [0, 1). Received: {name}={value!r}"
        )
    return float(value)


def check_positive(name, value):
    """A finite real number `> 0`, as a Python float (bools rejected).

    >>> check_positive("init_range", 10)
    10.0
    """
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"`{name}` must be a finite number > 0. Received: {name}={value!r}")
    return float(value)


def check_embedding_layer(embedding, name):
    """Raises unless `embedding` looks like a `keras.layers.Embedding`
    (has `input_dim` and `output_dim`); `name` is the argument's name."""
    if not hasattr(embedding, "input_dim") or not hasattr(embedding, "output_dim"):
        raise ValueError(
            f"`{name}` must be a keras.layers.Embedding. "
            f"Received: {name}={embedding!r}"
        )


def check_input_embedding(embedding, vocab_size, embedding_dim):
    """Validates a shared input `embedding` against `vocab_size` /
    `embedding_dim`; returns `vocab_size` (taken from the embedding when
    None)."""
    if embedding is not None:
        check_embedding_layer(embedding, "embedding")
        if vocab_size is None:
            vocab_size = embedding.input_dim
        if vocab_size != embedding.input_dim or (
            embedding_dim != embedding.output_dim
        ):
            raise ValueError(
                "`embedding` does not match vocab_size/embedding_dim. "
                f"Received: vocab_size={vocab_size}, "
                f"embedding_dim={embedding_dim}, embedding of shape "
                f"[{embedding.input_dim}, {embedding.output_dim}]"
            )
    if vocab_size is None:
        raise ValueError(
            "One of `vocab_size` or `embedding` must be set. "
            "Received: vocab_size=None, embedding=None"
        )
    return vocab_size
