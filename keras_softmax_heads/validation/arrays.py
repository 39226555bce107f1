"""Checks of array-valued arguments: word counts, integer arrays, token ids.

Each check returns the value as a NumPy array of a fixed dtype, or raises
`ValueError` in the package's one message shape (see `arguments`): it names
the argument, says what it must be and echoes the bad value, here the first
bad entry with its index (`"Received: counts[4]=-2"`). `summarize` writes
the short text of an array that these messages (and their callers') use.
"""

import numpy as np


def summarize(values, limit=8):
    """Short text of an array for an error message: its first `limit` values.

    >>> summarize([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    '[3, 1, 4, 1, 5, 9, 2, 6, ...]'
    >>> summarize(np.array([0.5, 2.0]))
    '[0.5, 2.0]'
    """
    flat = np.asarray(values).ravel()
    head = ", ".join(str(v) for v in flat[:limit].tolist())
    return f"[{head}{', ...' if flat.size > limit else ''}]"


def _is_numeric(array):
    return array.dtype != object and (
        np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_
    )


def check_counts(counts, vocab_size=None, allow_none=False, allow_all_zero=True):
    """Word counts: a non-empty 1-D array of finite numbers `>= 0`.

    One count per word: with `vocab_size`, the length must equal it. Bool
    arrays are accepted (as 0 / 1); object and string arrays are refused.

    Args:
        counts: array-like `[V]` of counts (or unigram probabilities).
        vocab_size: optional int `V`, the required length.
        allow_none: if True, `None` is accepted and returned as `None`.
        allow_all_zero: if False, counts summing to 0 are refused (a
            distribution needs some mass).

    Returns:
        a float64 NumPy array `[V]` (or `None`).

    Raises:
        ValueError: naming the first bad entry, e.g.
            `Received: counts[4]=-2 (bad word ids [4])`, or the shape,
            e.g. `Received: counts.shape=(12,), vocab_size=13`.

    Example:

    >>> check_counts([3, 0, 1], 3)
    array([3., 0., 1.])
    >>> check_counts([3, -2, 1])
    Traceback (most recent call last):
    ...
    ValueError: `counts` must be finite and non-negative (one count per word). Received: counts[1]=-2 (bad word ids [1])
    """
    if counts is None and allow_none:
        return None
    array = np.asarray(counts)
    if not _is_numeric(array):
        raise ValueError(
            "`counts` must be a 1-D array of numbers (one count per word). "
            f"Received: counts with dtype={array.dtype}"
        )
    wrong_length = vocab_size is not None and array.size != vocab_size
    if array.ndim != 1 or array.size == 0 or wrong_length:
        received = f"counts.shape={array.shape}"
        if vocab_size is not None:
            received += f", vocab_size={vocab_size}"
            if array.ndim == 1:
                received += f" (len(counts)={array.size} != vocab_size={vocab_size})"
        raise ValueError(
            "`counts` must be a non-empty 1-D array with one entry per word. "
            f"Received: {received}"
        )
    array = array.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(array) | (array < 0))
    if bad.size:
        raise ValueError(
            "`counts` must be finite and non-negative (one count per word). "
            f"Received: counts[{int(bad[0])}]={array[bad[0]]:g} "
            f"(bad word ids {summarize(bad)})"
        )
    if not allow_all_zero and array.sum() <= 0:
        raise ValueError(
            f"`counts` must not be all zero. Received: counts={summarize(array)}"
        )
    return array


def check_int_array(name, values):
    """`values` as an int64 NumPy array; float, bool and object input refused.

    An empty list (which NumPy reads as float64) is accepted as an empty
    int64 array.

    >>> check_int_array("assignment", [0, 2, 1])
    array([0, 2, 1])
    >>> check_int_array("ids", [0.0, 1.0])
    Traceback (most recent call last):
    ...
    ValueError: `ids` must contain integers. Received: ids with dtype=float64, first values [0.0, 1.0]
    """
    array = np.asarray(values)
    if array.size == 0 and array.dtype == np.float64:  # `[]` -> float64
        array = array.astype(np.int64)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"`{name}` must contain integers. Received: {name} with "
            f"dtype={array.dtype}, first values {summarize(array)}"
        )
    return array.astype(np.int64)


def check_ids(ids, vocab_size):
    """A non-empty 1-D stream of token ids in `[0, vocab_size)`, as int64.

    >>> check_ids([0, 2, 1], 3)
    array([0, 2, 1])
    >>> check_ids([0, 5], 3)
    Traceback (most recent call last):
    ...
    ValueError: `ids` must lie in [0, vocab_size=3). Received: an id equal to 5 (ids[1]=5)
    """
    array = check_int_array("ids", ids)
    if array.ndim != 1:
        raise ValueError(
            "`ids` must be a 1-D token-id stream (flatten / concatenate your "
            f"sentences first). Received: ids.shape={array.shape}"
        )
    if array.size == 0:
        raise ValueError("`ids` must not be empty. Received: ids=[]")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        index = int(np.argmin(array) if low < 0 else np.argmax(array))
        bad = int(array[index])
        raise ValueError(
            f"`ids` must lie in [0, vocab_size={vocab_size}). Received: an id "
            f"equal to {bad} (ids[{index}]={bad})"
        )
    return array
