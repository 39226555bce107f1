"""The static, padded layout of a two-level word clustering.

`ClusterAssignment` holds the `[C, max_cluster_size]` tables a two-level
hierarchical softmax gathers with static shapes; `hierarchical_layout`
builds one from an assignment vector (the cluster of every word). The
strategies that compute an assignment live in the sibling modules
(`strategies`, `kmeans`); see `docs/clustering.md`.
"""

import dataclasses
import json
import math
import pathlib

import numpy as np

from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation.arrays import check_int_array
from keras_softmax_heads.validation.arrays import summarize

PAD_WORD = -1
"""Fill value of `ClusterAssignment.cluster_words` beyond a cluster's size."""

_FORMAT = "keras_softmax_heads.ClusterAssignment"
_FORMAT_VERSION = 1


def check_num_clusters(num_clusters, vocab_size):
    """`num_clusters` as an int in `[1, vocab_size]` (every cluster needs a
    word); the message echoes both, e.g. `num_clusters=14 > vocab_size=13`.

    >>> check_num_clusters(3, 10)
    3
    """
    num_clusters = check_int("num_clusters", num_clusters, minimum=1)
    if num_clusters > vocab_size:
        raise ValueError(
            "`num_clusters` cannot exceed the vocabulary size (every cluster "
            f"needs at least one word). Received: num_clusters={num_clusters} "
            f"> vocab_size={vocab_size}"
        )
    return num_clusters


def default_num_clusters(vocab_size):
    """The default number of clusters, `ceil(sqrt(vocab_size))`.

    With `C ~ sqrt(V)` balanced clusters a two-level softmax evaluates about
    `2 sqrt(V)` outputs per token instead of `V`.

    Args:
        vocab_size: int `V >= 1`.

    Returns:
        `ceil(sqrt(vocab_size))` as an int.

    Example:

    >>> default_num_clusters(100), default_num_clusters(101)
    (10, 11)
    """
    vocab_size = check_int("vocab_size", vocab_size, minimum=1)
    root = math.isqrt(vocab_size)
    return root if root * root == vocab_size else root + 1


def _readonly_int32(array):
    array = np.array(array, dtype=np.int32, copy=True)
    array.setflags(write=False)
    return array


@dataclasses.dataclass(frozen=True, eq=False)
class ClusterAssignment:
    """Static, padded two-level HSM layout of a word clustering.

    All shapes are fixed by `(V, C, max_cluster_size)`, so an HSM layer can
    gather `[C, max_cluster_size]` word tables with static shapes (no ragged
    tensors, no data-dependent shapes: XLA / TPU friendly) and mask the
    padding. Build one with `hierarchical_layout` / `from_assignment`; the
    arrays are read-only int32. Invariants (checked on construction):
    `cluster_words[cluster_of_word[w], position_in_cluster[w]] == w` for every
    word, `cluster_words[c, i] == PAD_WORD` (-1) exactly for
    `i >= cluster_sizes[c]`, every cluster is non-empty, and
    `max_cluster_size == max(cluster_sizes)`. Words within a cluster are in
    ascending id order.

    Attributes:
        cluster_of_word: `[V]` cluster of each word.
        position_in_cluster: `[V]` index of each word inside its cluster.
        cluster_words: `[C, max_cluster_size]` word ids, padded with -1.
        cluster_sizes: `[C]` number of words per cluster.

    Example:

    >>> layout = ClusterAssignment.from_assignment([1, 0, 1, 1])
    >>> layout.num_clusters, layout.max_cluster_size, layout.vocab_size
    (2, 3, 4)
    >>> layout.cluster_words.tolist()
    [[1, -1, -1], [0, 2, 3]]
    >>> layout.position_in_cluster.tolist()
    [0, 0, 1, 2]
    >>> ClusterAssignment.from_config(layout.to_config()) == layout
    True
    """

    cluster_of_word: np.ndarray
    position_in_cluster: np.ndarray
    cluster_words: np.ndarray
    cluster_sizes: np.ndarray

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = check_int_array(field.name, getattr(self, field.name))
            object.__setattr__(self, field.name, _readonly_int32(value))
        cow, pos = self.cluster_of_word, self.position_in_cluster
        words, sizes = self.cluster_words, self.cluster_sizes
        if cow.ndim != 1 or pos.shape != cow.shape or words.ndim != 2 or sizes.shape != words.shape[:1]:
            raise ValueError(
                "Inconsistent ClusterAssignment shapes. Received: "
                f"cluster_of_word {cow.shape}, position_in_cluster {pos.shape}, "
                f"cluster_words {words.shape}, cluster_sizes {sizes.shape}"
            )
        vocab_size, (num_clusters, width) = cow.size, words.shape
        consistent = (
            vocab_size > 0
            and sizes.min() >= 1
            and width == sizes.max()
            and int(sizes.sum()) == vocab_size
            and cow.min() >= 0
            and cow.max() < num_clusters
            and pos.min() >= 0
            and np.all(pos < sizes[cow])
            and np.array_equal(words[cow, pos], np.arange(vocab_size))
            and np.array_equal(words >= 0, np.arange(width)[None, :] < sizes[:, None])
            and np.all(words[words < 0] == PAD_WORD)
        )
        if not consistent:
            raise ValueError(
                "Inconsistent ClusterAssignment arrays; build it with "
                "`hierarchical_layout(assignment)` / "
                "`ClusterAssignment.from_assignment(assignment)`. Received: "
                f"cluster_sizes={summarize(sizes)}, "
                f"cluster_of_word={summarize(cow)}"
            )

    @classmethod
    def from_assignment(cls, assignment, num_clusters=None):
        """Same as `hierarchical_layout(assignment, num_clusters)`."""
        return hierarchical_layout(assignment, num_clusters)

    @property
    def vocab_size(self):
        """Number of words `V`."""
        return int(self.cluster_of_word.size)

    @property
    def num_clusters(self):
        """Number of clusters `C`."""
        return int(self.cluster_words.shape[0])

    @property
    def max_cluster_size(self):
        """Padded cluster width, `max(cluster_sizes)`."""
        return int(self.cluster_words.shape[1])

    @property
    def mask(self):
        """Bool `[C, max_cluster_size]`, True where `cluster_words` is a word."""
        return self.cluster_words >= 0

    def padded_cluster_words(self, fill_value=PAD_WORD):
        """`cluster_words` with the padding replaced by `fill_value`.

        Useful for a gather-safe table (`fill_value=0` or `V`) used together
        with `mask`.

        Args:
            fill_value: int written into padded slots.

        Returns:
            A new (writable) int32 array `[C, max_cluster_size]`.
        """
        fill_value = check_int("fill_value", fill_value)
        return np.where(self.mask, self.cluster_words, np.int32(fill_value)).astype(np.int32)

    # -- serialisation (no pickle) ------------------------------------------

    def to_config(self):
        """Plain-Python dict (lists and ints) for a Keras layer's `get_config`.

        Only the assignment is stored; everything else is rebuilt by
        `from_config`.
        """
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "num_clusters": self.num_clusters,
            "cluster_of_word": self.cluster_of_word.tolist(),
        }

    @classmethod
    def from_config(cls, config):
        """Inverse of `to_config`."""
        if not isinstance(config, dict) or "cluster_of_word" not in config:
            keys = sorted(config) if isinstance(config, dict) else type(config).__name__
            raise ValueError(
                "A ClusterAssignment config must be a dict with key "
                f"'cluster_of_word'. Received: {keys}"
            )
        version = config.get("version", _FORMAT_VERSION)
        if version != _FORMAT_VERSION:
            raise ValueError(
                f"Unsupported ClusterAssignment config version. Received: "
                f"version={version!r}, supported: {_FORMAT_VERSION}"
            )
        return hierarchical_layout(config["cluster_of_word"], config.get("num_clusters"))

    def to_json(self):
        """JSON string of `to_config()`."""
        return json.dumps(self.to_config(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text):
        """Inverse of `to_json`."""
        return cls.from_config(json.loads(text))

    def save(self, path):
        """Writes the assignment to `path`, without pickle.

        A path ending in `.json` gets JSON (`to_json`); any other path gets a
        numpy `.npz` archive holding int arrays only (written to `path`
        exactly, no suffix appended).

        Args:
            path: str or `pathlib.Path`.
        """
        path = pathlib.Path(path)
        if path.suffix.lower() == ".json":
            path.write_text(self.to_json())
            return
        with open(path, "wb") as f:
            np.savez(
                f,
                cluster_of_word=self.cluster_of_word,
                num_clusters=np.int64(self.num_clusters),
                version=np.int64(_FORMAT_VERSION),
            )

    @classmethod
    def load(cls, path):
        """Reads a file written by `save` (JSON or `.npz`, detected from the
        content); `.npz` files are opened with `allow_pickle=False`."""
        path = pathlib.Path(path)
        with open(path, "rb") as f:
            start = f.read(1)
        if start == b"{":
            return cls.from_json(path.read_text())
        with np.load(path, allow_pickle=False) as data:
            config = {
                "cluster_of_word": data["cluster_of_word"],
                "num_clusters": int(data["num_clusters"]),
                "version": int(data["version"]),
            }
        return cls.from_config(config)

    def __eq__(self, other):
        if not isinstance(other, ClusterAssignment):
            return NotImplemented
        return self.num_clusters == other.num_clusters and np.array_equal(
            self.cluster_of_word, other.cluster_of_word
        )

    __hash__ = None

    def __repr__(self):
        return (
            f"ClusterAssignment(vocab_size={self.vocab_size}, "
            f"num_clusters={self.num_clusters}, "
            f"max_cluster_size={self.max_cluster_size})"
        )


def hierarchical_layout(assignment, num_clusters=None):
    """Builds the static padded HSM layout from an assignment vector.

    Empty clusters are rejected rather than silently compacted, so cluster ids
    keep the meaning the caller gave them (compact first with
    `np.unique(assignment, return_inverse=True)[1]` if that is what you want).

    Args:
        assignment: integer array `[V]`, the cluster of each word, values in
            `[0, num_clusters)`.
        num_clusters: `C`; defaults to `max(assignment) + 1`.

    Returns:
        A `ClusterAssignment`.

    Example:

    >>> hierarchical_layout([0, 2, 1, 0]).cluster_words.tolist()
    [[0, 3], [2, -1], [1, -1]]
    """
    assignment = check_int_array("assignment", assignment)
    if assignment.ndim != 1 or assignment.size == 0:
        raise ValueError(
            "`assignment` must be a non-empty 1-D array (one cluster id per "
            f"word). Received: assignment.shape={assignment.shape}"
        )
    vocab_size = assignment.size
    low, high = int(assignment.min()), int(assignment.max())
    if low < 0:
        word = int(np.argmin(assignment))
        raise ValueError(
            "`assignment` values must be >= 0. Received: "
            f"assignment[{word}]={low}"
        )
    if num_clusters is None:
        num_clusters = high + 1
    num_clusters = check_num_clusters(num_clusters, vocab_size)
    if high >= num_clusters:
        word = int(np.argmax(assignment))
        raise ValueError(
            f"`assignment` values must be < num_clusters={num_clusters}. "
            f"Received: assignment[{word}]={high}"
        )
    sizes = np.bincount(assignment, minlength=num_clusters)
    if np.any(sizes == 0):
        empty = np.flatnonzero(sizes == 0)
        raise ValueError(
            f"Every cluster must hold at least one word; {empty.size} of "
            f"num_clusters={num_clusters} are empty: {summarize(empty)}. "
            "Compact the ids (e.g. `np.unique(assignment, "
            "return_inverse=True)[1]`) or lower `num_clusters`."
        )
    order = np.argsort(assignment, kind="stable")
    starts = np.cumsum(sizes) - sizes
    position = np.empty(vocab_size, dtype=np.int64)
    position[order] = np.arange(vocab_size) - starts[assignment[order]]
    cluster_words = np.full((num_clusters, int(sizes.max())), PAD_WORD, dtype=np.int64)
    cluster_words[assignment, position] = np.arange(vocab_size)
    return ClusterAssignment(
        cluster_of_word=assignment,
        position_in_cluster=position,
        cluster_words=cluster_words,
        cluster_sizes=sizes,
    )
