"""Feed-forward n-gram neural language model (Chen et al. 2016, section 2.1)."""

import keras
from keras import ops

from keras_softmax_heads.models.backbone import Backbone
from keras_softmax_heads.models.backbone import dropout_seed
from keras_softmax_heads.validation import check_input_embedding
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_rate


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class NgramLanguageModel(Backbone):
    """Feed-forward n-gram LM backbone: `n - 1` context words -> `h`.

    Chen, Grangier and Auli (2016, section 2.1): each of the `n - 1` previous
    words is embedded (`W^0`, `[V, d'_0]`), the embeddings are concatenated
    into `h^0` of size `(n - 1) d'_0`, then `k` layers
    `h^i = tanh(W^i h^{i-1} + b^i)` follow, with dropout after each tanh.
    The head (`ksh.HeadModel(backbone, head)`) is the paper's final linear
    layer plus softmax (or any of its alternatives). Train it on the n-gram
    batching `keras_softmax_heads.data.make_ngram_dataset(ids, order, ...)`.

    Weight tying: pass `backbone.token_embedding` to the head; the last hidden
    size must then equal `embedding_dim`.

    Args:
        vocab_size: int, number of words `V` (may be omitted when `embedding`
            is given).
        order: int `n >= 2`; the model reads `n - 1` context words.
        embedding_dim: int, `d'_0`, size of each word embedding.
        hidden_sizes: int or list of ints, sizes `d_1..d_k` of the tanh layers
            (`k >= 1`).
        dropout: dropout rate applied after each tanh.
        embedding: optional existing `keras.layers.Embedding` to use.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: int tensor `[..., n - 1]` of context word ids.
        training: bool, applies dropout when `True`.

    Returns:
        Context vectors `[..., d_k]`.

    Example:

    >>> import numpy as np
    >>> lm = NgramLanguageModel(vocab_size=50, order=4, embedding_dim=8,
    ...                         hidden_sizes=[16, 8])
    >>> tuple(lm(np.random.randint(0, 50, (5, 3))).shape)
    (5, 8)

    References:
        - Chen, Grangier, Auli. Strategies for Training Large Vocabulary
          Neural Language Models, ACL 2016. https://arxiv.org/abs/1512.04906
        - Bengio, Ducharme, Vincent, Jauvin. A Neural Probabilistic Language
          Model, JMLR 2003.
    """

    def __init__(
        self,
        vocab_size=None,
        order=6,
        embedding_dim=128,
        hidden_sizes=(512,),
        dropout=0.0,
        embedding=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        vocab_size = check_input_embedding(embedding, vocab_size, embedding_dim)
        self.vocab_size = check_int("vocab_size", vocab_size, 2)
        self.order = check_int("order", order, 2)
        self.embedding_dim = check_int("embedding_dim", embedding_dim, 1)
        if isinstance(hidden_sizes, int) and not isinstance(hidden_sizes, bool):
            hidden_sizes = [hidden_sizes]
        hidden_sizes = list(hidden_sizes) if hidden_sizes is not None else []
        if not hidden_sizes:
            raise ValueError(
                "`hidden_sizes` needs at least one tanh layer. "
                f"Received: hidden_sizes={hidden_sizes!r}"
            )
        self.hidden_sizes = [
            check_int(f"hidden_sizes[{i}]", size, 1) for i, size in enumerate(hidden_sizes)
        ]
        self.dropout = check_rate("dropout", dropout)
        if embedding is None:
            embedding = keras.layers.Embedding(
                self.vocab_size, self.embedding_dim, name="embedding"
            )
        self.embedding = embedding
        self.hidden_layers = [
            keras.layers.Dense(size, activation="tanh", name=f"tanh_{i}")
            for i, size in enumerate(self.hidden_sizes)
        ]
        self.dropout_layers = [
            keras.layers.Dropout(self.dropout, seed=dropout_seed(self.dropout))
            for _ in self.hidden_sizes
        ]

    @property
    def output_dim(self):
        """Size `d_k` of the context vectors."""
        return self.hidden_sizes[-1]

    def build(self, input_shape):
        context = input_shape[-1]
        if context is not None and context != self.order - 1:
            raise ValueError(
                f"NgramLanguageModel of order {self.order} reads {self.order - 1} "
                f"context words. Received: input_shape={tuple(input_shape)}"
            )
        if not self.embedding.built:
            self.embedding.build(tuple(input_shape))
        size = (self.order - 1) * self.embedding_dim
        for layer in self.hidden_layers:
            layer.build(tuple(input_shape[:-1]) + (size,))
            size = layer.units
        self.built = True

    def call(self, inputs, training=None):
        context = inputs.shape[-1]
        if context is not None and context != self.order - 1:
            raise ValueError(
                f"NgramLanguageModel of order {self.order} reads {self.order - 1} "
                f"context words. Received: inputs of shape {tuple(inputs.shape)}"
            )
        x = self.embedding(inputs)  # [..., n-1, d'0]
        lead = ops.shape(x)[:-2]
        x = ops.reshape(x, tuple(lead) + ((self.order - 1) * self.embedding_dim,))
        for dense, drop in zip(self.hidden_layers, self.dropout_layers):
            x = drop(dense(x), training=training)
        return x

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.output_dim,)

    def backbone_config(self):
        """The constructor arguments except `embedding` (`Backbone.get_config`)."""
        return {
            "vocab_size": self.vocab_size,
            "order": self.order,
            "embedding_dim": self.embedding_dim,
            "hidden_sizes": list(self.hidden_sizes),
            "dropout": self.dropout,
        }
