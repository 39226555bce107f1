"""A small token <-> id vocabulary with per-token counts."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"


class Vocabulary:
    """Bidirectional token <-> id map with a `counts` array.

    Ids are positions in `tokens`. Every token must be a non-empty string
    without whitespace (corpora are whitespace-tokenized, and the vocabulary
    file stores one token per line). Tokens must be unique.

    Args:
        tokens: sequence of unique token strings; `tokens[i]` gets id `i`.
        counts: optional length-`V` array of non-negative integer counts
            (normally the training-split frequencies). Defaults to zeros.
        unk_token: token that out-of-vocabulary words map to in `encode`;
            ignored (no OOV mapping) when it is not in `tokens`.

    Example:

    >>> vocab = Vocabulary(["<eos>", "the", "<unk>"], counts=[5, 3, 1])
    >>> vocab.encode("the cat".split())
    array([1, 2], dtype=int32)
    >>> vocab.decode([1, 0])
    ['the', '<eos>']
    """

    def __init__(
        self,
        tokens: Sequence[str],
        counts: Sequence[int] | np.ndarray | None = None,
        unk_token: str | None = UNK_TOKEN,
    ):
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("A Vocabulary needs at least one token. Received: tokens=[]")
        index: dict[str, int] = {}
        for i, token in enumerate(tokens):
            if not isinstance(token, str) or not token or token.split() != [token]:
                raise ValueError(
                    "Vocabulary tokens must be non-empty strings without "
                    f"whitespace. Received: tokens[{i}]={token!r}"
                )
            if token in index:
                raise ValueError(
                    f"Duplicate token {token!r} in vocabulary: ids {index[token]} and {i}."
                )
            index[token] = i
        if counts is None:
            counts = np.zeros(len(tokens), dtype=np.int64)
        counts = np.asarray(counts)
        if counts.shape != (len(tokens),):
            raise ValueError(
                f"`counts` must have shape ({len(tokens)},) to match the tokens. "
                f"Received: counts.shape={counts.shape}"
            )
        if counts.size and not np.issubdtype(counts.dtype, np.integer):
            if not np.all(np.isfinite(counts)) or not np.all(np.mod(counts, 1) == 0):
                raise ValueError(f"`counts` must be integers. Received: counts={counts!r}")
        counts = counts.astype(np.int64)
        if counts.size and counts.min() < 0:
            raise ValueError(
                f"`counts` must be non-negative. Received: min(counts)={counts.min()}"
            )
        self._tokens = tokens
        self._index = index
        self._counts = counts
        self._counts.setflags(write=False)
        self.unk_token = unk_token
        self._unk_id = index.get(unk_token) if unk_token is not None else None

    # ------------------------------------------------------------------ basics
    @property
    def tokens(self) -> tuple[str, ...]:
        """All tokens, ordered by id."""
        return self._tokens

    @property
    def counts(self) -> np.ndarray:
        """Read-only int64 array `[V]` of token counts."""
        return self._counts

    @property
    def size(self) -> int:
        """Number of tokens `V`."""
        return len(self._tokens)

    @property
    def unk_id(self) -> int | None:
        """Id of `unk_token`, or `None` when the vocabulary has none."""
        return self._unk_id

    @property
    def eos_id(self) -> int | None:
        """Id of `<eos>`, or `None` when the vocabulary has none."""
        return self._index.get(EOS_TOKEN)

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, token: object) -> bool:
        return token in self._index

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Vocabulary):
            return NotImplemented
        return (self._tokens == other._tokens
                and np.array_equal(self._counts, other._counts)
                and self.unk_token == other.unk_token)

    def __repr__(self) -> str:
        head = ", ".join(repr(t) for t in self._tokens[:5])
        more = ", ..." if len(self) > 5 else ""
        return f"Vocabulary(size={len(self)}, tokens=[{head}{more}])"

    def token_to_id(self, token: str) -> int:
        """Id of `token` (the `<unk>` id for unknown tokens).

        Raises:
            KeyError: if `token` is unknown and there is no `unk_token`.
        """
        i = self._index.get(token)
        if i is not None:
            return i
        if self._unk_id is None:
            raise KeyError(
                f"Token {token!r} is not in the vocabulary and the vocabulary "
                f"has no unk_token ({self.unk_token!r})."
            )
        return self._unk_id

    def id_to_token(self, i: int) -> str:
        """Token with id `i`."""
        if not 0 <= int(i) < len(self._tokens):
            raise IndexError(f"Token id out of range [0, {len(self)}). Received: {i}")
        return self._tokens[int(i)]

    def encode(self, tokens: Iterable[str]) -> np.ndarray:
        """Maps tokens to an int32 id array (OOV -> `<unk>`).

        Args:
            tokens: iterable of token strings.

        Returns:
            `np.ndarray[int32]` of ids.

        Raises:
            ValueError: on an OOV token when the vocabulary has no `unk_token`.
        """
        tokens = list(tokens)
        try:
            ids = list(map(self._index.__getitem__, tokens))
        except KeyError as err:
            if self._unk_id is None:
                raise ValueError(
                    f"Token {err.args[0]!r} is not in the vocabulary and the "
                    f"vocabulary has no unk_token ({self.unk_token!r})."
                ) from None
            get, unk = self._index.get, self._unk_id
            ids = [get(t, unk) for t in tokens]
        return np.asarray(ids, dtype=np.int32).reshape(-1)

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Maps ids back to token strings."""
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            bad = ids[(ids < 0) | (ids >= len(self))][0]
            raise IndexError(f"Token id out of range [0, {len(self)}). Received: {bad}")
        return [self._tokens[i] for i in ids.tolist()]

    # ---------------------------------------------------------------- file I/O
    def save(self, path: str | os.PathLike, with_counts: bool = True) -> None:
        """Writes the vocabulary as UTF-8 text, one token per line in id order.

        Args:
            path: output file.
            with_counts: when True each line is `token<TAB>count`; otherwise
                just `token`.

        Example:

        >>> import os, tempfile
        >>> vocab = Vocabulary(["<eos>", "the"], counts=[2, 1])
        >>> path = os.path.join(tempfile.mkdtemp(), "vocab.txt")
        >>> vocab.save(path)
        >>> open(path).read()
        '<eos>\\t2\\nthe\\t1\\n'
        >>> Vocabulary.load(path) == vocab
        True
        """
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            if with_counts:
                for token, count in zip(self._tokens, self._counts.tolist()):
                    f.write(f"{token}\t{count}\n")
            else:
                for token in self._tokens:
                    f.write(f"{token}\n")

    @classmethod
    def load(cls, path: str | os.PathLike, unk_token: str | None = UNK_TOKEN) -> "Vocabulary":
        """Reads a file written by `save` (counts column optional).

        Each non-empty line is `token` or `token<TAB>count` (any whitespace
        separates the optional count); all lines must use the same form.

        Args:
            path: vocabulary file.
            unk_token: see the constructor.

        Returns:
            A `Vocabulary`.

        Raises:
            ValueError: on a duplicate token (naming it and both line numbers),
                a malformed line, or mixed with/without-count lines.
        """
        tokens: list[str] = []
        counts: list[int] = []
        first_line: dict[str, int] = {}
        has_counts = None
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        for lineno, line in enumerate(lines, start=1):
            line = line.rstrip("\r")
            fields = line.split()
            if not fields:
                raise ValueError(f"Empty line {lineno} in vocabulary file {os.fspath(path)!r}.")
            if len(fields) > 2:
                raise ValueError(
                    f"Line {lineno} of vocabulary file {os.fspath(path)!r} must be "
                    f"'token' or 'token<TAB>count'. Received: {line!r}"
                )
            line_has_counts = len(fields) == 2
            if has_counts is None:
                has_counts = line_has_counts
            elif has_counts != line_has_counts:
                raise ValueError(
                    f"Line {lineno} of vocabulary file {os.fspath(path)!r} "
                    f"{'has' if line_has_counts else 'lacks'} a count column but "
                    f"line 1 {'does' if has_counts else 'does not'}. Received: {line!r}"
                )
            token = fields[0]
            if token in first_line:
                raise ValueError(
                    f"Duplicate token {token!r} in vocabulary file {os.fspath(path)!r}: "
                    f"lines {first_line[token]} and {lineno}."
                )
            first_line[token] = lineno
            tokens.append(token)
            if line_has_counts:
                try:
                    counts.append(int(fields[1]))
                except ValueError:
                    raise ValueError(
                        f"Line {lineno} of vocabulary file {os.fspath(path)!r}: count "
                        f"must be an integer. Received: {fields[1]!r}"
                    ) from None
        if not tokens:
            raise ValueError(f"Vocabulary file {os.fspath(path)!r} is empty.")
        return cls(tokens, counts=counts if has_counts else None, unk_token=unk_token)

    # ------------------------------------------------------------- construction
    @classmethod
    def from_counts(
        cls,
        counts: "dict[str, int]",
        min_count: int = 1,
        max_size: int | None = None,
        unk_token: str | None = UNK_TOKEN,
    ) -> "Vocabulary":
        """Builds a frequency-ordered vocabulary from a token -> count mapping.

        Ordering: descending count; ties keep the mapping's iteration order
        (for a `collections.Counter` filled from a token stream this is first
        appearance). Tokens with `count < min_count` or beyond `max_size` are
        dropped; if anything is dropped, `unk_token` is added (if absent)
        with count = the total count of dropped tokens (plus its own) and
        placed by that count (after equal-count words).

        Args:
            counts: mapping token -> count.
            min_count: minimum count to keep a token.
            max_size: maximum vocabulary size, `<unk>` included.
            unk_token: the OOV token.

        Returns:
            A `Vocabulary`.

        Example:

        >>> Vocabulary.from_counts({"a": 1, "b": 5, "c": 1}, min_count=2).tokens
        ('b', '<unk>')
        """
        types = list(counts.keys())
        values = np.fromiter((int(counts[t]) for t in types), dtype=np.int64, count=len(types))
        tokens, final_counts = _cut_and_order(types, values, min_count, max_size, unk_token)
        return cls(tokens, counts=final_counts, unk_token=unk_token)


def _cut_and_order(types, values, min_count, max_size, unk_token):
    """Shared cut-off + ordering logic; returns (tokens, counts) and the map.

    `types[i]` has count `values[i]`; input order = tie-break order.
    """
    tokens, final_counts, _ = cut_and_order_vocabulary(types, values, min_count, max_size, unk_token)
    return tokens, final_counts


def cut_and_order_vocabulary(types, values, min_count, max_size, unk_token, ensure_unk=False):
    """Applies the vocabulary cut-off and order to `types` with counts `values`.

    Returns `(tokens, counts, remap)`: the kept tokens (by descending count;
    ties keep the input order), their counts, and `remap[i]`, the new id of
    `types[i]` (dropped types map to the `unk_token` id). Like `_cut_and_order`,
    which drops `remap`.

    With `ensure_unk`, `unk_token` is added (count 0 if nothing is dropped)
    even when the cut-off keeps every type.
    """
    if min_count < 1:
        raise ValueError(f"`min_count` must be >= 1. Received: min_count={min_count}")
    if max_size is not None and max_size < 1:
        raise ValueError(f"`max_size` must be >= 1. Received: max_size={max_size}")
    n = len(types)
    order = np.argsort(-values, kind="stable")
    keep = order[values[order] >= min_count]
    if max_size is not None and keep.size > max_size:
        keep = keep[:max_size]
    dropped = keep.size < n
    add_unk = False
    if ensure_unk and unk_token is None:
        raise ValueError("`ensure_unk=True` needs an `unk_token`.")
    if dropped or ensure_unk:
        if unk_token is None:
            raise ValueError(
                "The vocabulary cut-off drops tokens but `unk_token` is None; "
                "there is nothing to map them to."
            )
        kept_types = {types[i] for i in keep.tolist()}
        if unk_token not in kept_types:
            add_unk = True
            if max_size is not None and keep.size >= max_size:
                keep = keep[: max_size - 1]
    new_tokens = [types[i] for i in keep.tolist()]
    new_counts = values[keep].copy()
    if add_unk:
        new_tokens.append(unk_token)
        new_counts = np.append(new_counts, 0)
    remap = np.full(n, -1, dtype=np.int64)
    remap[keep] = np.arange(keep.size)
    if keep.size < n:  # (re-checked: making room for <unk> may drop one more)
        unk_new = new_tokens.index(unk_token)
        # Any provisional `unk_token` type that was cut is merged too.
        oov = remap < 0
        new_counts[unk_new] += values[oov].sum()
        remap[oov] = unk_new
    # Re-sort: only <unk>'s count changed; stable sort keeps everything else.
    perm = np.argsort(-new_counts, kind="stable")
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(perm.size)
    tokens = [new_tokens[i] for i in perm.tolist()]
    return tokens, new_counts[perm], inverse[remap]
