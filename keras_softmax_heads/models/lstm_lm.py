"""LSTM language-model backbone (Zaremba et al. 2014) with carried state."""

import keras
from keras import ops

from keras_softmax_heads.models.backbone import Backbone
from keras_softmax_heads.models.backbone import dropout_seed
from keras_softmax_heads.validation import check_input_embedding
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_positive
from keras_softmax_heads.validation import check_rate


def _uniform(init_scale, default):
    if init_scale is None:
        return default
    return keras.initializers.RandomUniform(-init_scale, init_scale)


class _CarriedState:
    """Plain holder, so that Keras/TF tracking ignores the state variables.

    The carried state depends on the batch size, not on what the model learnt:
    it is kept out of `weights`, `.keras` files and `get_weights()`, so that a
    model trained with one batch size can be loaded and evaluated with another.
    Training checkpoints save it explicitly (`keras_softmax_heads.training`).
    """

    def __init__(self):
        self.variables = []


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class LSTMLanguageModel(Backbone):
    """LSTM language-model backbone: tokens -> context vectors `h`.

    Embedding -> dropout -> `num_layers` LSTMs (dropout between them) ->
    dropout (-> optional linear projection), as in Zaremba et al. (2014):
    dropout acts on the non-recurrent connections only, with an independent
    mask per token. Combine with any head:
    `ksh.HeadModel(LSTMLanguageModel(...), head)`.

    With `stateful=True` (the default) the LSTM state `(h, c)` of every layer
    is carried from one call to the next, so that consecutive `[batch, bptt]`
    windows of the stream batching (`keras_softmax_heads.data.
    make_stream_dataset`) form one long sequence per batch row (truncated
    backpropagation through time). Call `reset_states()` at the start of each
    epoch and before each evaluation. The batch size is then fixed
    (`batch_size`, per replica under a distribution strategy). The carried
    state lives in variables that are *not* weights of the layer (they are
    not saved with the model), created with `synchronization="on_read"` so
    that each replica carries its own rows.

    Weight tying: pass `backbone.token_embedding` to the head
    (`FullSoftmax(token_embedding=backbone.token_embedding)`); the context
    vectors must then have the embedding's size: either
    `hidden_size == embedding_dim` or `output_dim=embedding_dim` (a linear
    projection of the last LSTM output).

    Args:
        vocab_size: int, number of words `V` (may be omitted when `embedding`
            is given).
        embedding_dim: int, word-embedding size.
        hidden_size: int, units of every LSTM layer.
        num_layers: int, number of stacked LSTM layers.
        output_dim: optional int; if set, a linear projection of the last LSTM
            output to `output_dim` (for tying when `hidden_size !=
            embedding_dim`).
        embedding_dropout: dropout rate on the embeddings (input of layer 1).
        hidden_dropout: dropout rate between LSTM layers.
        output_dropout: dropout rate on the last LSTM output.
        stateful: bool, carry the LSTM state across calls.
        batch_size: int, the (per-replica) batch size; required when
            `stateful=True`.
        init_scale: optional float `s`: initialise every weight (embedding,
            LSTM kernels and biases, projection) from `U(-s, s)` (Zaremba et
            al. use 0.1 / 0.05 / 0.04). `None` keeps the Keras defaults.
        unit_forget_bias: bool, add 1 to the LSTM forget-gate bias at
            initialisation (Keras default). Zaremba et al. do not.
        unroll: bool, unroll the LSTM loops (needs a static `bptt`; may be
            faster for short windows on CPU).
        embedding: optional existing `keras.layers.Embedding` to use (shared
            with a tied head after loading a saved model).
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: int tensor `[batch, time]` of word ids.
        training: bool, applies dropout when `True`.

    Returns:
        Context vectors `[batch, time, d]` with `d = output_dim or
        hidden_size` (`self.output_dim`).

    Example:

    >>> import numpy as np
    >>> lm = LSTMLanguageModel(vocab_size=50, embedding_dim=8, hidden_size=8,
    ...                        num_layers=2, batch_size=3)
    >>> x = np.random.randint(0, 50, (3, 5))
    >>> tuple(lm(x).shape)
    (3, 5, 8)
    >>> lm.reset_states()

    References:
        - Zaremba, Sutskever, Vinyals. Recurrent Neural Network
          Regularization, 2014. https://arxiv.org/abs/1409.2329
        - Press, Wolf. Using the Output Embedding to Improve Language
          Models, 2017. https://arxiv.org/abs/1608.05859
    """

    def __init__(
        self,
        vocab_size=None,
        embedding_dim=200,
        hidden_size=200,
        num_layers=2,
        output_dim=None,
        embedding_dropout=0.0,
        hidden_dropout=0.0,
        output_dropout=0.0,
        stateful=True,
        batch_size=None,
        init_scale=None,
        unit_forget_bias=True,
        unroll=False,
        embedding=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        vocab_size = check_input_embedding(embedding, vocab_size, embedding_dim)
        self.vocab_size = check_int("vocab_size", vocab_size, 2)
        self.embedding_dim = check_int("embedding_dim", embedding_dim, 1)
        self.hidden_size = check_int("hidden_size", hidden_size, 1)
        self.num_layers = check_int("num_layers", num_layers, 1)
        self._projection_dim = check_int("output_dim", output_dim, 1, allow_none=True)
        self.embedding_dropout = check_rate("embedding_dropout", embedding_dropout)
        self.hidden_dropout = check_rate("hidden_dropout", hidden_dropout)
        self.output_dropout = check_rate("output_dropout", output_dropout)
        self.stateful = bool(stateful)
        if self.stateful:
            if batch_size is None:
                raise ValueError(
                    "A stateful LSTMLanguageModel needs a fixed `batch_size` "
                    "(per replica). Received: batch_size=None"
                )
        self.batch_size = check_int("batch_size", batch_size, 1, allow_none=True)
        self.init_scale = check_positive("init_scale", init_scale, allow_none=True)
        self.unit_forget_bias = bool(unit_forget_bias)
        self.unroll = bool(unroll)

        if embedding is None:
            embedding = keras.layers.Embedding(
                self.vocab_size,
                self.embedding_dim,
                embeddings_initializer=_uniform(self.init_scale, "uniform"),
                name="embedding",
            )
        self.embedding = embedding
        self.lstms = [
            keras.layers.LSTM(
                self.hidden_size,
                return_sequences=True,
                return_state=True,
                unit_forget_bias=self.unit_forget_bias,
                kernel_initializer=_uniform(self.init_scale, "glorot_uniform"),
                recurrent_initializer=_uniform(self.init_scale, "orthogonal"),
                bias_initializer=_uniform(self.init_scale, "zeros"),
                unroll=self.unroll,
                name=f"lstm_{i}",
            )
            for i in range(self.num_layers)
        ]
        self.embedding_dropout_layer = keras.layers.Dropout(
            self.embedding_dropout, seed=dropout_seed(self.embedding_dropout))
        self.hidden_dropout_layers = [
            keras.layers.Dropout(self.hidden_dropout, seed=dropout_seed(self.hidden_dropout))
            for _ in range(self.num_layers - 1)
        ]
        self.output_dropout_layer = keras.layers.Dropout(
            self.output_dropout, seed=dropout_seed(self.output_dropout))
        self.projection = None
        if self._projection_dim is not None:
            self.projection = keras.layers.Dense(
                self._projection_dim,
                kernel_initializer=_uniform(self.init_scale, "glorot_uniform"),
                bias_initializer=_uniform(self.init_scale, "zeros"),
                name="projection",
            )
        self._carry = _CarriedState()

    # ------------------------------------------------------------ properties
    @property
    def output_dim(self):
        """Size `d` of the context vectors."""
        return self._projection_dim or self.hidden_size

    @property
    def carried_state_variables(self):
        """The carried `(h, c)` variables of every layer (empty if not stateful)."""
        return list(self._carry.variables)

    # ----------------------------------------------------------------- build
    def build(self, input_shape):
        batch = input_shape[0] if len(input_shape) else None
        if self.stateful and batch is not None and batch != self.batch_size:
            raise ValueError(
                f"This stateful LSTMLanguageModel has batch_size={self.batch_size} "
                f"but was built with input_shape={tuple(input_shape)}"
            )
        batch = self.batch_size if self.batch_size is not None else batch
        if not self.embedding.built:
            self.embedding.build((batch, None))
        size = self.embedding_dim
        for lstm in self.lstms:
            lstm.build((batch, None, size))
            size = self.hidden_size
        if self.projection is not None:
            self.projection.build((batch, None, self.hidden_size))
        if self.stateful and not self._carry.variables:
            for i in range(self.num_layers):
                for part in ("h", "c"):
                    self._carry.variables.append(
                        keras.Variable(
                            ops.zeros((self.batch_size, self.hidden_size)),
                            trainable=False,
                            dtype="float32",
                            synchronization="on_read",
                            aggregation="only_first_replica",
                            name=f"carried_{part}_{i}",
                        )
                    )
        self.built = True

    def reset_states(self):
        """Zeroes the carried state (every replica's, under a strategy)."""
        for v in self._carry.variables:
            v.assign(ops.zeros(v.shape, v.dtype))

    # ------------------------------------------------------------------ call
    def call(self, inputs, training=None):
        if self.stateful:
            batch = inputs.shape[0]
            if batch is not None and batch != self.batch_size:
                raise ValueError(
                    "A stateful LSTMLanguageModel needs every batch to have "
                    f"batch_size={self.batch_size} rows (the carried state's). "
                    f"Received: inputs of shape {tuple(inputs.shape)}"
                )
        x = self.embedding(inputs)
        x = self.embedding_dropout_layer(x, training=training)
        new_states = []
        for i, lstm in enumerate(self.lstms):
            initial_state = None
            if self.stateful:
                h0, c0 = self._carry.variables[2 * i : 2 * i + 2]
                # A copy: the assignment below updates the variables in
                # place, which on PyTorch would change a tensor the
                # backward pass still reads.
                initial_state = [
                    ops.cast(ops.copy(h0.value), lstm.compute_dtype),
                    ops.cast(ops.copy(c0.value), lstm.compute_dtype),
                ]
            x, h, c = lstm(x, initial_state=initial_state, training=training)
            new_states += [h, c]
            if i < self.num_layers - 1:
                x = self.hidden_dropout_layers[i](x, training=training)
        x = self.output_dropout_layer(x, training=training)
        if self.projection is not None:
            x = self.projection(x)
        if self.stateful:
            for var, value in zip(self._carry.variables, new_states):
                var.assign(ops.cast(value, var.dtype))
        return x

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    # ------------------------------------------------------------ serialising
    def backbone_config(self):
        """The constructor arguments except `embedding` (`Backbone.get_config`)."""
        return {
            "vocab_size": self.vocab_size,
            "embedding_dim": self.embedding_dim,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "output_dim": self._projection_dim,
            "embedding_dropout": self.embedding_dropout,
            "hidden_dropout": self.hidden_dropout,
            "output_dropout": self.output_dropout,
            "stateful": self.stateful,
            "batch_size": self.batch_size,
            "init_scale": self.init_scale,
            "unit_forget_bias": self.unit_forget_bias,
            "unroll": self.unroll,
        }
