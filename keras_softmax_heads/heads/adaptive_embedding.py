"""Adaptive input embeddings (Baevski & Auli, 2019).

The vocabulary, ranked by frequency, is cut into bands at `cutoffs` (as
`AdaptiveSoftmax`): band 0 (the `cutoffs[0]` most frequent words) has
embeddings of width `output_dim`, band `i` of width
`max(1, output_dim // factor**i)`, projected back to `output_dim` by a
`[d_i, output_dim]` matrix. Rare words get few parameters.

`AdaptiveSoftmax(..., adaptive_embedding=emb)` shares the tables and
projections with the output layer (fairseq's tied adaptive input / output):
the head band's word scores use the band-0 table, tail `i` projects the
context with band `i + 1`'s projection (transposed) and scores with its table.
"""

import keras
import numpy as np
from keras import ops

from keras_softmax_heads.heads.head_utils import adaptive_band_dims
from keras_softmax_heads.heads.head_utils import add_constant_weight
from keras_softmax_heads.heads.head_utils import check_cutoffs
from keras_softmax_heads.heads.head_utils import check_factor
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.heads.head_utils import frequency_order
from keras_softmax_heads.samplers import check_counts
from keras_softmax_heads.samplers import counts_to_config
from keras_softmax_heads.validation import check_int


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class AdaptiveEmbedding(keras.layers.Layer):
    """Adaptive input embedding: frequency bands of decreasing width.

    Word `w` of frequency rank `r` in band `i` (`cutoffs[i-1] <= r <
    cutoffs[i]`, band 0 from rank 0, the last band up to `V`) is embedded as
    `E_i[r - start_i] @ P_i`, with a table `E_i` `[size_i, d_i]`,
    `d_i = max(1, output_dim // factor**i)`, and a projection `P_i`
    `[d_i, output_dim]` (band 0: `d_0 = output_dim`, no projection).

    Args:
        vocab_size: int `V >= 2`.
        output_dim: int `d`, the embedding size.
        cutoffs: strictly increasing ints in `[1, V)`, the band boundaries
            in frequency rank.
        factor: number `>= 1`, the width ratio of consecutive bands
            (default 4).
        counts: optional `[V]` word counts. Without them word ids are taken
            to be frequency ranks (id 0 the most frequent word); with them
            words are ranked by descending count (ties by id) and the
            permutation is kept as int32 weights (`word_rank`, `word_order`);
            the counts are in the config.
        embeddings_initializer: initializer of the tables.
        projection_initializer: initializer of the projections.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: int word ids `[...]`, in `[0, V)` (checked eagerly).

    Returns:
        `[..., output_dim]` embeddings in the compute dtype.

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.adaptive_embedding import AdaptiveEmbedding
    >>> emb = AdaptiveEmbedding(20, 8, cutoffs=[4, 10], factor=2)
    >>> tuple(emb(np.array([[0, 5, 19]])).shape)
    (1, 3, 8)
    >>> emb.band_dims, emb.band_sizes
    ([8, 4, 2], [4, 6, 10])

    References:
        - Baevski & Auli, 2019. Adaptive Input Representations for Neural
          Language Modeling. https://arxiv.org/abs/1809.10853
    """

    def __init__(
        self,
        vocab_size,
        output_dim,
        cutoffs,
        factor=4,
        counts=None,
        embeddings_initializer="uniform",
        projection_initializer="glorot_uniform",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocab_size = check_int("vocab_size", vocab_size, 2)
        self.output_dim = check_int("output_dim", output_dim, 1)
        self.cutoffs = check_cutoffs(cutoffs, self.vocab_size)
        self.factor = check_factor(factor)
        self.counts = check_counts(counts, self.vocab_size)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.projection_initializer = keras.initializers.get(projection_initializer)
        bounds = [0] + self.cutoffs + [self.vocab_size]
        self.band_starts = bounds[:-1]
        self.band_sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        self.band_dims = adaptive_band_dims(self.output_dim, len(self.band_sizes), self.factor)

    def build(self, input_shape=None):
        del input_shape
        self.band_embeddings = [
            self.add_weight(
                name=f"embeddings_{i}",
                shape=(size, dim),
                initializer=self.embeddings_initializer,
            )
            for i, (size, dim) in enumerate(zip(self.band_sizes, self.band_dims))
        ]
        # Band 0 has no projection (None keeps the indices aligned).
        self.band_projections = [None] + [
            self.add_weight(
                name=f"projection_{i}",
                shape=(dim, self.output_dim),
                initializer=self.projection_initializer,
            )
            for i, dim in enumerate(self.band_dims[1:], start=1)
        ]
        order = frequency_order(self.counts, self.vocab_size)
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        self.word_order = add_constant_weight(self, "word_order", "int32", order)
        self.word_rank = add_constant_weight(self, "word_rank", "int32", rank)
        self.built = True

    def call(self, inputs):
        ids = check_targets(inputs, self.vocab_size)
        rank = ops.take(ops.convert_to_tensor(self.word_rank), ops.clip(ids, 0, self.vocab_size - 1))
        out = None
        for i, (start, size) in enumerate(zip(self.band_starts, self.band_sizes)):
            local = rank - start
            inside = ops.logical_and(local >= 0, local < size)
            rows = ops.take(
                ops.cast(self.band_embeddings[i], self.compute_dtype),
                ops.clip(local, 0, size - 1),
                axis=0,
            )
            if self.band_projections[i] is not None:
                rows = ops.matmul(rows, ops.cast(self.band_projections[i], self.compute_dtype))
            rows = ops.where(ops.expand_dims(inside, -1), rows, ops.zeros_like(rows))
            out = rows if out is None else out + rows
        return out

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(
            self.compute_output_shape(inputs.shape), dtype=self.compute_dtype
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocab_size": self.vocab_size,
                "output_dim": self.output_dim,
                "cutoffs": list(self.cutoffs),
                "factor": self.factor,
                "counts": counts_to_config(self.counts),
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
                "projection_initializer": keras.initializers.serialize(
                    self.projection_initializer
                ),
            }
        )
        return config
