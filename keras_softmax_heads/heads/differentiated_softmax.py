"""`DifferentiatedSoftmax` (D-Softmax, Chen et al. 2016, section 2.3).

Frequency bands with their own embedding width, normalised by one exact
softmax. Design notes (word order, the chunked band normalisers, what the
config saves): `docs/differentiated.md`.
"""

import numbers

import keras
import numpy as np
from keras import ops

from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.chunked import chunked_pointwise_nll
from keras_softmax_heads.heads.head_utils import add_constant_weight
from keras_softmax_heads.heads.head_utils import build_context_checks
from keras_softmax_heads.heads.softmax_head import SoftmaxHead
from keras_softmax_heads.samplers import check_counts
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid

# The paper's billionW setting (Figure 7): 1024 units for the 50K most
# frequent words, 512 for the next 100K, 64 for the remaining 643K
# (V = 793,471, d = 1600).
_PAPER_VOCAB = 793_471
_PAPER_WORDS = (50_000, 100_000)
_PAPER_DIMS = (1024, 512, 64)


def default_bands(vocab_size, input_dim):
    """The paper's three-band layout scaled to `vocab_size` and `input_dim`.

    Chen et al. (2016, Figure 7) use 1024 units for the 50K most frequent
    words, 512 for the next 100K and 64 for the rest of `V = 793K`
    (`d = 1600`). Scaled: the top 6.3% of words (at least one) get
    `d - d_2 - d_3` units, the next 12.6% get `d_2 = round(8 d / 25)` and
    the rest `d_3 = round(d / 25)` (each at least 1). With `V < 3` or
    `d < 3` there is a single band `[(V, d)]` (a plain softmax).

    Args:
        vocab_size: int `V >= 2`.
        input_dim: int `d >= 1`, the context-vector size.

    Returns:
        list of `[num_words, dim]` pairs, in descending frequency order,
        with `sum(num_words) == V` and `sum(dim) == d`.

    Example:

    >>> default_bands(793_471, 1600)
    [[50000, 1024], [100000, 512], [643471, 64]]
    >>> default_bands(13, 6)
    [[1, 3], [2, 2], [10, 1]]
    """
    vocab_size = int(vocab_size)
    input_dim = int(input_dim)
    if vocab_size < 3 or input_dim < 3:
        return [[vocab_size, input_dim]]
    n1 = max(1, round(vocab_size * _PAPER_WORDS[0] / _PAPER_VOCAB))
    n2 = max(1, round(vocab_size * _PAPER_WORDS[1] / _PAPER_VOCAB))
    n2 = min(n2, vocab_size - n1 - 1)
    total = sum(_PAPER_DIMS)
    d2 = max(1, round(input_dim * _PAPER_DIMS[1] / total))
    d3 = max(1, round(input_dim * _PAPER_DIMS[2] / total))
    d2 = min(d2, input_dim - d3 - 1)
    return [
        [n1, input_dim - d2 - d3],
        [n2, d2],
        [vocab_size - n1 - n2, d3],
    ]


def _sum_with_terms(values):
    """`(sum, "a + b + c")` of `values`, for error messages."""
    values = list(values)
    return sum(values), " + ".join(str(v) for v in values)


def _check_bands(bands, vocab_size):
    if isinstance(bands, (str, bytes)) or not hasattr(bands, "__len__") or len(bands) == 0:
        raise ValueError(
            "`bands` must be a non-empty list of (num_words, dim) pairs. "
            f"Received: bands={bands!r}"
        )
    checked = []
    for i, band in enumerate(bands):
        ok = hasattr(band, "__len__") and len(band) == 2
        if ok:
            ok = all(
                isinstance(v, numbers.Integral)
                and not isinstance(v, (bool, np.bool_))
                and v >= 1
                for v in band
            )
        if not ok:
            raise ValueError(
                "Every band must be a pair of positive integers "
                f"(num_words, dim). Received: bands[{i}]={band!r}"
            )
        checked.append([int(band[0]), int(band[1])])
    covered, terms = _sum_with_terms(n for n, _ in checked)
    if covered != vocab_size:
        raise ValueError(
            "The bands must cover the vocabulary exactly. Received: bands "
            f"cover {terms} = {covered} words, vocab_size={vocab_size}"
        )
    return checked


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class DifferentiatedSoftmax(SoftmaxHead):
    """Differentiated softmax: wide embeddings for frequent words, narrow for rare.

    Words are ranked by descending `counts` and cut into bands
    `(n_1, d_1), (n_2, d_2), ...` (`sum n_b = V`, `sum d_b = d`). The context
    vector is split into slices `h = [h_1; h_2; ...]` of sizes `d_b`, and a
    word `w` of band `b` scores `z_w = h_b W_b[:, w] + b_w` with its own
    kernel `W_b` `[d_b, n_b]` (the block-diagonal output matrix of Chen et
    al. 2016, Figure 1). One exact softmax normalises all `V` scores:

    `log p(w | h) = z_w - logsumexp_v z_v`.

    Cost per token `sum_b n_b d_b` multiply-adds instead of `V d`, at
    training and test time. Default bands: `default_bands(V, d)`, the
    paper's billionW setting scaled. Without `counts` word ids are taken to
    be frequency ranks. Weight tying is not supported. Design notes:
    `docs/differentiated.md`.

    Args:
        vocab_size: int, number of words `V`.
        bands: optional list of `(num_words, dim)` pairs in descending
            frequency order; `sum(num_words)` must equal `V` and, at build
            time, `sum(dim)` must equal the context size `d`.
        counts: optional unigram counts `[V]` (non-negative) that rank the
            words (ties: smaller id first).
        token_embedding: must be None (not supported).
        chunk_size: optional int >= 1: `log_likelihood` / `training_loss`
            process every band in tiles of at most `chunk_size` words and
            never hold the `[N, V]` scores (`docs/chunked.md`); `None`
            (default): one dense product per band.
        **kwargs: `use_bias`, `kernel_initializer` (of the band kernels),
            `bias_initializer` (of the `[V]` bias), `return_probabilities`
            (see `SoftmaxHead`) and standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 log-probabilities `[..., V]` in word-id order;
        `log_likelihood(inputs, targets)`: float32 of shape `targets.shape`.

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.differentiated_softmax import DifferentiatedSoftmax
    >>> counts = np.array([1, 50, 3, 20, 2, 9, 4, 1, 7, 5])
    >>> head = DifferentiatedSoftmax(10, bands=[(2, 4), (3, 2), (5, 1)], counts=counts)
    >>> h = np.random.rand(2, 3, 7).astype("float32")
    >>> log_p = head(h)
    >>> tuple(log_p.shape)
    (2, 3, 10)
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True
    >>> [tuple(k.shape) for k in head.band_kernels]  # words 1, 3 get 4 units
    [(4, 2), (2, 3), (1, 5)]

    References:
        - Chen, Grangier & Auli, 2016. Strategies for Training Large
          Vocabulary Neural Language Models (sections 2.3, 4.4).
          https://arxiv.org/abs/1512.04906
    """

    def __init__(
        self,
        vocab_size=None,
        bands=None,
        counts=None,
        token_embedding=None,
        *,
        chunk_size=None,
        **kwargs,
    ):
        if token_embedding is not None:
            raise ValueError(
                "DifferentiatedSoftmax does not support weight tying: each "
                "frequency band has its own output embedding size, a "
                "`token_embedding` has one. Pass vocab_size instead. "
                f"Received: token_embedding={token_embedding!r}"
            )
        super().__init__(vocab_size=vocab_size, **kwargs)
        self.bands = None if bands is None else _check_bands(bands, self.vocab_size)
        self.chunk_size = check_chunk_size(chunk_size, default=None)
        counts = check_counts(counts, self.vocab_size)
        if counts is None:
            self._initial_order = np.arange(self.vocab_size)
        else:
            self._initial_order = np.argsort(-counts, kind="stable")

    def build(self, input_shape):
        build_context_checks(self, input_shape)
        d = self.input_dim
        bands = self.bands if self.bands is not None else default_bands(self.vocab_size, d)
        used, terms = _sum_with_terms(dim for _, dim in bands)
        if used != d:
            raise ValueError(
                "The band dims must split the context vector exactly (band b "
                f"reads its own slice of h). Received: band dims {terms} = "
                f"{used}, but the context vectors have d={d} "
                f"(input_shape={input_shape})"
            )
        self.band_sizes = [n for n, _ in bands]
        self.band_dims = [dim for _, dim in bands]
        self.kernel = None
        self.band_kernels = [
            self.add_weight(
                name=f"kernel_{b}",
                shape=(dim, n),
                initializer=self.kernel_initializer,
            )
            for b, (n, dim) in enumerate(bands)
        ]
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias",
                shape=(self.vocab_size,),
                initializer=self.bias_initializer,
                autocast=False,  # read in float32 under mixed precision
            )
        order = self._initial_order
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        self.word_order = add_constant_weight(self, "word_order", "int32", order)
        self.word_rank = add_constant_weight(self, "word_rank", "int32", rank)
        self.build_head(input_shape)

    # ---------------------------------------------------------------- scores
    def _band_scores(self, inputs):
        """Scores of every band in rank order: list of float32 `[..., n_b]`."""
        inputs = ops.cast(self._check_inputs(inputs), self.compute_dtype)
        bias = None
        if self.bias is not None:
            bias = ops.take(
                ops.cast(self.bias, self.accumulation_dtype),
                ops.convert_to_tensor(self.word_order),
            )
        scores, feature, word = [], 0, 0
        for kernel, n, dim in zip(self.band_kernels, self.band_sizes, self.band_dims):
            part = inputs[..., feature : feature + dim]
            z = ops.cast(
                ops.matmul(part, ops.cast(kernel, self.compute_dtype)),
                self.accumulation_dtype,
            )
            if bias is not None:
                z = z + bias[word : word + n]
            scores.append(z)
            feature += dim
            word += n
        return scores

    def _to_word_order(self, ranked):
        return ops.take(ranked, ops.convert_to_tensor(self.word_rank), axis=-1)

    def logits(self, inputs):
        """Scores `z` `[..., V]` (float32) in word-id order."""
        return self._to_word_order(ops.concatenate(self._band_scores(inputs), axis=-1))

    def output_kernel(self):
        """The equivalent dense `[d, V]` block-diagonal matrix (materialised;
        for inspection only, the layer never builds it)."""
        self._check_structure()
        blocks, offset = [], 0
        d = self.input_dim
        for kernel, dim in zip(self.band_kernels, self.band_dims):
            blocks.append(ops.pad(kernel, [[offset, d - offset - dim], [0, 0]]))
            offset += dim
        return ops.cast(
            self._to_word_order(ops.concatenate(blocks, axis=-1)), self.compute_dtype
        )

    def log_probs(self, inputs):
        ranked = ops.concatenate(self._band_scores(inputs), axis=-1)
        return self._to_word_order(ops.log_softmax(ranked, axis=-1))

    def log_likelihood(self, inputs, targets):
        """Exact `log p(targets | inputs)`, without permuting `[..., V]`.

        Args:
            inputs: context vectors `[..., d]`.
            targets: int word ids `[...]` in `[0, V)`.

        Returns:
            float32 tensor of shape `targets.shape`.
        """
        targets = check_targets(targets, self.vocab_size)
        if self.chunk_size is not None:
            ll = self._chunked_log_likelihood(inputs, targets)
            return nan_if_invalid(ll, targets, self.vocab_size)
        scores = self._band_scores(inputs)
        rank = ops.take(
            ops.convert_to_tensor(self.word_rank),
            ops.clip(targets, 0, self.vocab_size - 1),
        )
        lse = ops.logsumexp(
            ops.stack([ops.logsumexp(z, axis=-1) for z in scores], axis=-1), axis=-1
        )
        target_score = ops.zeros_like(lse)
        start = 0
        for z, n in zip(scores, self.band_sizes):
            local = rank - start
            inside = ops.logical_and(local >= 0, local < n)
            picked = ops.squeeze(
                ops.take_along_axis(
                    z, ops.expand_dims(ops.clip(local, 0, n - 1), -1), axis=-1
                ),
                -1,
            )
            target_score = ops.where(inside, picked, target_score)
            start += n
        return nan_if_invalid(target_score - lse, targets, self.vocab_size)

    def _chunked_log_likelihood(self, inputs, targets):
        """`log_likelihood` with every band's normaliser computed in tiles."""
        inputs = ops.cast(self._check_inputs(inputs), self.compute_dtype)
        h = ops.reshape(inputs, (-1, self.input_dim))
        rank = ops.take(
            ops.convert_to_tensor(self.word_rank),
            ops.reshape(ops.clip(targets, 0, self.vocab_size - 1), (-1,)),
        )
        acc = self.accumulation_dtype
        bias = None
        if self.bias is not None:
            bias = ops.take(
                ops.cast(self.bias, acc), ops.convert_to_tensor(self.word_order)
            )
        band_lse, target_score = [], None
        feature = word = 0
        for kernel, n, dim in zip(self.band_kernels, self.band_sizes, self.band_dims):
            part = h[:, feature : feature + dim]
            band_bias = None if bias is None else bias[word : word + n]
            local = ops.clip(rank - word, 0, n - 1)
            # Score of word `local` of the band (the target when it is in
            # this band), float32 products of the same values the chunked
            # loss multiplies.
            columns = ops.take(ops.cast(kernel, acc), local, axis=1)  # [dim, N]
            picked = ops.sum(ops.cast(part, acc) * ops.transpose(columns), axis=-1)
            if band_bias is not None:
                picked = picked + ops.take(band_bias, local)
            nll = chunked_pointwise_nll(
                part, kernel, band_bias, local, chunk_size=self.chunk_size
            )
            band_lse.append(ops.cast(nll, acc) + picked)  # lse_b, exact gradient
            inside = ops.logical_and(rank >= word, rank < word + n)
            target_score = (
                picked if target_score is None
                else ops.where(inside, picked, target_score)
            )
            feature += dim
            word += n
        lse = ops.logsumexp(ops.stack(band_lse, axis=-1), axis=-1)
        return ops.reshape(target_score - lse, ops.shape(targets))

    # ------------------------------------------------------------ serialising
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "chunk_size": self.chunk_size,
                "bands": self.bands,
                # Counts `V - rank`, exactly the current ranking. None only
                # while a legacy (0.1.0) ranking is pending.
                "counts": (
                    None
                    if self._pending_structure is not None
                    else _rank_counts(self._current_order())
                ),
            }
        )
        return config

    def _current_order(self):
        """`word_order` (the word id at each rank) as a NumPy array."""
        if not self.built:
            return np.asarray(self._initial_order)
        return np.asarray(keras.ops.convert_to_numpy(self.word_order))

    @classmethod
    def from_config(cls, config):
        layer = super().from_config(config)
        if "counts" in config and config["counts"] is None:
            # keras-softmax-heads 0.1.0 kept the ranking in the weights only:
            # ranked by id until they are loaded, and unusable until then.
            layer._pending_structure = "counts"
        return layer


def _rank_counts(order):
    """Integer counts whose descending (stable) order is `order`: `V - rank`.

    Example:

    >>> _rank_counts(np.array([2, 0, 1]))
    [2, 1, 3]
    """
    counts = np.empty(order.size, dtype=np.int64)
    counts[order] = order.size - np.arange(order.size)
    return counts.tolist()
