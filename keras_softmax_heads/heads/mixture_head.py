"""Mixture heads: Mixture of Softmaxes (and its MoSS / MoS+PLIF variants) and
the low-rank Mixture of Contexts baseline.

Both heads share the parameterisation of Yang et al. (2018): from the context
vector `h` `[..., d]` they compute `K` mixture priors
`pi_k = softmax(h W_pi + b_pi)_k` and `K` latent context vectors
`c_k = tanh(h W_k + b_k)` of dimension `latent_dim`, which are scored against
the shared output projection (`kernel` `[latent_dim, V]`, or a tied
`token_embedding` `[V, latent_dim]`) and bias. They differ in where the
mixture happens:

* `MixtureOfSoftmaxes` mixes *probabilities*:
  `p = sum_k pi_k softmax(c_k W + b)`, computed in log space as
  `log p = logsumexp_k(log pi_k + log_softmax(c_k W + b))`. Its matrix of
  log-probabilities is not limited to rank `d + 2` (it breaks the softmax
  bottleneck).
* `MixtureOfContexts` mixes the *context vectors* first,
  `h' = sum_k pi_k c_k`, then applies one softmax: `softmax(h' W + b)`. It is
  a Linear-Softmax on a non-linear function of `h` and stays low rank
  (`<= latent_dim + 2`).
"""

import keras
import numpy as np
from keras import ops

from keras_softmax_heads import samplers
from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.heads.softmax_head import SoftmaxHead
from keras_softmax_heads.heads.head_utils import set_context_dim

def is_int(value):
    """Whether `value` is an integer (an `__index__` type), not a bool."""
    return hasattr(value, "__index__") and not isinstance(value, bool)


def near_identity_initializer(num_components, seed=None):
    """Initializer of a `[d, K * L]` latent kernel: each component's `[d, L]`
    block is the identity (`eye(d, L)`) plus a Glorot-uniform draw.

    With it a mixture head starts close to the Linear-Softmax on `tanh(h)`
    that it generalises: the gradient reaching the backbone is that of a
    softmax (with a Glorot-only kernel it is about 3x weaker at the start,
    and on PTB under Zaremba's SGD the backbone can stall while the output
    bias learns the unigram; `docs/recipes.md`), and the Glorot draw makes
    the components differ from the first step.
    """
    glorot = keras.initializers.GlorotUniform(seed=seed)

    def initializer(shape, dtype=None):
        d, kl = shape
        eye = np.tile(np.eye(d, kl // num_components), (1, num_components))
        return ops.cast(eye, dtype) + glorot(shape, dtype=dtype)

    return initializer


class MixtureHead(SoftmaxHead):
    """Shared machinery of the mixture heads: priors, latents, dropout.

    Not a public head; see `MixtureOfSoftmaxes` and `MixtureOfContexts`.
    """

    def __init__(
        self,
        vocab_size=None,
        num_components=4,
        latent_dim=None,
        latent_dropout=0.0,
        token_embedding=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="unigram",
        prior_initializer="glorot_uniform",
        latent_initializer="identity",
        seed=None,
        chunk_size=None,
        return_probabilities=False,
        counts=None,
        **kwargs,
    ):
        super().__init__(
            vocab_size=vocab_size,
            token_embedding=token_embedding,
            use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            return_probabilities=return_probabilities,
            **kwargs,
        )
        if not is_int(num_components) or num_components < 1:
            raise ValueError(
                "`num_components` must be an integer >= 1. "
                f"Received: num_components={num_components!r}"
            )
        if latent_dim is not None and (not is_int(latent_dim) or latent_dim < 1):
            raise ValueError(
                "`latent_dim` must be None (use the input dimension) or an "
                f"integer >= 1. Received: latent_dim={latent_dim!r}"
            )
        if (
            isinstance(latent_dropout, bool)
            or not isinstance(latent_dropout, (int, float))
            or not 0.0 <= latent_dropout < 1.0
        ):
            raise ValueError(
                "`latent_dropout` must be a float in [0, 1). "
                f"Received: latent_dropout={latent_dropout!r}"
            )
        if (
            latent_dim is not None
            and token_embedding is not None
            and token_embedding.output_dim != latent_dim
        ):
            raise ValueError(
                "With a tied `token_embedding`, `latent_dim` must equal its "
                f"output_dim={token_embedding.output_dim} (the latent context "
                "vectors are scored against the embedding rows). Received: "
                f"latent_dim={latent_dim}"
            )
        self._counts = samplers.check_counts(counts, self.vocab_size)
        self.chunk_size = check_chunk_size(chunk_size, default=None)
        self.num_components = int(num_components)
        self.latent_dim = None if latent_dim is None else int(latent_dim)
        self.latent_dropout = float(latent_dropout)
        self.prior_initializer = keras.initializers.get(prior_initializer)
        self.latent_initializer = (
            latent_initializer
            if latent_initializer == "identity"
            else keras.initializers.get(latent_initializer)
        )
        self.seed = seed
        self.seed_generator = None
        if self.latent_dropout > 0.0:
            self.seed_generator = keras.random.SeedGenerator(seed)

    named_bias_initializers = ("unigram",)

    def named_bias_values(self, name):
        """`"unigram"`: `log((counts + 1) / sum(counts + 1))`, zeros without
        `counts`.

        Started at the unigram, the components' scores carry no shared
        "frequent words" gradient in the first steps; from zeros that
        gradient is the largest of the head and, under Zaremba's SGD, drives
        the latent vectors towards the unigram direction while the backbone
        stalls (`docs/recipes.md`).
        """
        del name
        if self._counts is None:
            return np.zeros(self.vocab_size)
        smoothed = np.asarray(self._counts, "float64") + 1.0
        return np.log(smoothed / smoothed.sum())

    # ------------------------------------------------------------------ build
    def build(self, input_shape):
        set_context_dim(self, input_shape)
        latent_dim = self.latent_dim if self.latent_dim is not None else self.input_dim
        self.latent_units = latent_dim
        self.kernel = None
        if self.token_embedding is not None:
            emb_dim = self.token_embedding.output_dim
            if emb_dim != latent_dim:
                raise ValueError(
                    f"The tied `token_embedding` has output_dim={emb_dim} but "
                    f"the latent context vectors have dimension {latent_dim} "
                    f"(`latent_dim={self.latent_dim}`; None means the input "
                    f"dimension {self.input_dim}). Pass latent_dim={emb_dim}. "
                    f"Received: input_shape={input_shape}"
                )
            if not self.token_embedding.built:
                self.token_embedding.build((None,))
        else:
            self.kernel = self.add_weight(
                name="kernel",
                shape=(latent_dim, self.vocab_size),
                initializer=self.kernel_initializer,
            )
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias",
                shape=(self.vocab_size,),
                initializer=self.bias_initializer,
                autocast=False,  # read in float32 under mixed precision
            )
        k = self.num_components
        self.prior_kernel = self.add_weight(
            name="prior_kernel",
            shape=(self.input_dim, k),
            initializer=self.prior_initializer,
        )
        self.prior_bias = self.add_weight(
            name="prior_bias", shape=(k,), initializer="zeros"
        )
        self.latent_kernel = self.add_weight(
            name="latent_kernel",
            shape=(self.input_dim, k * latent_dim),
            initializer=(
                near_identity_initializer(k, self.seed)
                if self.latent_initializer == "identity"
                else self.latent_initializer
            ),
        )
        self.latent_bias = self.add_weight(
            name="latent_bias", shape=(k * latent_dim,), initializer="zeros"
        )
        self.build_head(input_shape)

    # ---------------------------------------------------------------- helpers
    def _prior_log_normaliser(self, prior_logits):
        """`log pi` from the `[N, K]` prior logits (float32)."""
        return ops.log_softmax(prior_logits, axis=-1)

    def _priors_and_latents(self, inputs, training):
        """Flattened `log pi` `[N, K]` (float32) and latents `[N, K, L]`.

        The latents are in the compute dtype, with dropout applied when
        `training` and `latent_dropout > 0`.
        """
        x = ops.cast(inputs, self.compute_dtype)
        x = ops.reshape(x, (-1, self.input_dim))
        acc = self.accumulation_dtype
        prior_logits = ops.cast(
            ops.matmul(x, ops.cast(self.prior_kernel, self.compute_dtype)), acc
        ) + ops.cast(self.prior_bias, acc)
        log_priors = self._prior_log_normaliser(prior_logits)
        latent = ops.tanh(
            ops.matmul(x, ops.cast(self.latent_kernel, self.compute_dtype))
            + ops.cast(self.latent_bias, self.compute_dtype)
        )
        latent = ops.reshape(latent, (-1, self.num_components, self.latent_units))
        if training and self.seed_generator is not None:
            latent = keras.random.dropout(
                latent, self.latent_dropout, seed=self.seed_generator
            )
        return log_priors, latent

    def _project(self, latent):
        """`latent W + b` in float32: `[..., L]` -> `[..., V]`."""
        z = ops.cast(ops.matmul(latent, self.output_kernel()), self.accumulation_dtype)
        if self.bias is not None:
            z = z + ops.cast(self.bias, self.accumulation_dtype)
        return z

    def _chunk_kernel(self):
        """The output projection for the chunked loss, never transposed."""
        if self.token_embedding is not None:
            return self.token_embedding.embeddings, True
        return self.kernel, False

    def _output_shape_of(self, inputs):
        return tuple(ops.shape(inputs)[:-1]) + (self.vocab_size,)

    # --------------------------------------------------------------- contract
    def call_log_probs(self, inputs, training=None):
        """`log_probs` with latent dropout when `training`."""
        return self.log_probs(inputs, training=training)

    def training_loss(self, inputs, targets, training=True):
        """`-log p(targets | inputs)`, with latent dropout when `training`."""
        return -self.log_likelihood(inputs, targets, training=training)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_components": self.num_components,
                "latent_dim": self.latent_dim,
                "latent_dropout": self.latent_dropout,
                "prior_initializer": keras.initializers.serialize(
                    self.prior_initializer
                ),
                "latent_initializer": (
                    self.latent_initializer
                    if self.latent_initializer == "identity"
                    else keras.initializers.serialize(self.latent_initializer)
                ),
                "seed": self.seed,
                "chunk_size": self.chunk_size,
                "counts": samplers.counts_to_config(self._counts),
            }
        )
        return config
