"""Checks of constructor and function arguments (Python values).

Each check returns the value converted to a plain Python type, or raises
`ValueError` with one message shape, which names the argument, says what it
must be and echoes the bad value, as Keras' own layers do:

    `name` must be <what>. Received: name=<value!r>

One rule per kind of argument: integers (`check_int`; bools and floats are
refused even when integral), real numbers (`check_number`: finite, within
optional bounds, each bound open or closed; bools refused), booleans
(`check_bool`), choices (`check_choice`), seeds (`check_seed`). Heads,
losses, samplers, clustering and the fused loss all call these; a module
that needs a new kind of check adds it here.
"""

import math
import numbers

import numpy as np


def _received(name, value):
    return f"Received: {name}={value!r}"


def _is_integer(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_int(name, value, minimum=None, maximum=None, allow_none=False):
    """`value` as a Python int in `[minimum, maximum]` (either bound optional).

    Bools, floats and strings are rejected, even when integral; None is
    accepted (and returned) only with `allow_none=True`.

    >>> check_int("num_knots", 10, minimum=1)
    10
    """
    if value is None and allow_none:
        return None
    if minimum is not None and maximum is not None:
        what = f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        what = f"an integer >= {minimum}"
    elif maximum is not None:
        what = f"an integer <= {maximum}"
    else:
        what = "an integer"
    if allow_none:
        what += " or None"
    if not _is_integer(value):
        raise ValueError(
            f"`{name}` must be {what}. {_received(name, value)} "
            f"(type {type(value).__name__})"
        )
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"`{name}` must be {what}. {_received(name, value)}")
    return value


def number_range(low=None, high=None, low_open=False, high_open=False):
    """The words of `check_number`'s rule, e.g. `"a finite number > 0"`,
    `"a finite number in (0, 1]"`."""
    if low is not None and high is not None:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        return f"a finite number in {left}{low}, {high}{right}"
    if low is not None:
        return f"a finite number {'>' if low_open else '>='} {low}"
    if high is not None:
        return f"a finite number {'<' if high_open else '<='} {high}"
    return "a finite number"


def check_number(
    name, value, low=None, high=None, low_open=False, high_open=False, allow_none=False
):
    """`value` as a finite Python float within the bounds, or raises.

    `low` / `high` are optional bounds, closed unless `low_open` /
    `high_open`. Bools, strings, NaN and infinities are refused; None only
    with `allow_none=True` (then returned as None).

    >>> check_number("gamma", 1, low=0, high=1, low_open=True)
    1.0
    >>> check_number("alpha", -1, low=0)
    Traceback (most recent call last):
    ...
    ValueError: `alpha` must be a finite number >= 0. Received: alpha=-1
    """
    if value is None and allow_none:
        return None
    ok = _is_real(value) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        what = number_range(low, high, low_open, high_open)
        if allow_none:
            what += " or None"
        raise ValueError(f"`{name}` must be {what}. {_received(name, value)}")
    return float(value)


def check_positive(name, value, allow_none=False):
    """A finite real number `> 0`, as a Python float (`check_number`).

    >>> check_positive("init_range", 10)
    10.0
    """
    return check_number(name, value, low=0, low_open=True, allow_none=allow_none)


def check_rate(name, value):
    """A dropout-like rate: a finite number in `[0, 1)`."""
    return check_number(name, value, low=0, high=1, high_open=True)


def check_bool(name, value, allow_none=False):
    """`value` as a Python bool; rejects ints, strings and None (None is
    accepted, and returned, only with `allow_none=True`)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be a bool. {_received(name, value)}")
    return bool(value)


def check_choice(name, value, choices):
    """`value` if it is one of `choices` (compared with `==`), else raises.

    >>> check_choice("reduction", "sum", ("none", "sum", "mean"))
    'sum'
    """
    if isinstance(value, (list, dict, set)) or value not in tuple(choices):
        raise ValueError(
            f"`{name}` must be one of {tuple(choices)}. {_received(name, value)}"
        )
    return value


def check_seed(seed, allow_none=True):
    """A random seed: None (when `allow_none`) or an int in `[0, 2**32)`."""
    if seed is None and allow_none:
        return None
    if not _is_integer(seed):
        expected = "None or an integer" if allow_none else "an integer"
        raise ValueError(f"`seed` must be {expected} in [0, 2**32). {_received('seed', seed)}")
    return check_int("seed", seed, minimum=0, maximum=2**32 - 1)


def check_embedding_layer(embedding, name):
    """Raises unless `embedding` looks like a `keras.layers.Embedding`
    (has `input_dim` and `output_dim`); `name` is the argument's name."""
    if not hasattr(embedding, "input_dim") or not hasattr(embedding, "output_dim"):
        raise ValueError(
            f"`{name}` must be a keras.layers.Embedding. {_received(name, embedding)}"
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
