"""`MixtureHead`: what the mixture heads share (priors, latents, dropout).

`MixtureOfSoftmaxes` and `MixtureOfContexts` compute, from the context vector
`h`, `K` priors `pi = softmax(h W_pi)` (`softmax(h W_pi + b_pi)` with
`use_prior_bias=True`) and `K` latent context vectors `c_k = tanh(h W_k)`
(`tanh(h W_k + b_k)` with `use_latent_bias=True`) scored
against one output projection; they differ in where they mix (probabilities
or contexts). The parameterisation, the initialisation and the memory of
each path: `docs/mixtures.md`.
"""

import keras
import numpy as np
from keras import ops

from keras_softmax_heads import samplers
from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.heads.head_utils import set_context_dim
from keras_softmax_heads.heads.softmax_head import SoftmaxHead
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_rate


def near_identity_initializer(num_components, seed=None):
    """Initializer of a `[d, K * L]` latent kernel: each component's `[d, L]`
    block is the identity (`eye(d, L)`) plus a Glorot-uniform draw.

    With it a mixture head starts close to the Linear-Softmax on `tanh(h)`
    that it generalises (the backbone gets a softmax's gradient from the
    first step) and the Glorot draw makes the components differ. Why:
    `docs/mixtures.md` and `docs/recipes.md`.

    Args:
        num_components: int `K`, the number of `[d, L]` blocks.
        seed: optional int, seed of the Glorot draw.

    Returns:
        An initializer `(shape, dtype=None) -> tensor` for `shape = (d, K * L)`.

    Example:

    >>> from keras import ops
    >>> init = near_identity_initializer(2, seed=0)
    >>> tuple(ops.shape(init((3, 4), dtype="float32")))
    (3, 4)
    """
    glorot = keras.initializers.GlorotUniform(seed=seed)

    def initializer(shape, dtype=None):
        d, kl = shape
        eye = np.tile(np.eye(d, kl // num_components), (1, num_components))
        return ops.cast(eye, dtype) + glorot(shape, dtype=dtype)

    return initializer


class MixtureHead(SoftmaxHead):
    """Shared machinery of the mixture heads: priors, latents, dropout.

    Not a public head; see `MixtureOfSoftmaxes` (whose docstring lists these
    arguments) and `MixtureOfContexts`.
    """

    def __init__(
        self,
        vocab_size=None,
        num_components=4,
        latent_dim=None,
        latent_dropout=0.0,
        token_embedding=None,
        *,
        bias_initializer="unigram",
        prior_initializer="glorot_uniform",
        latent_initializer="identity",
        use_latent_bias=False,
        use_prior_bias=False,
        seed=None,
        chunk_size=None,
        counts=None,
        gradient_in_forward=None,
        **kwargs,
    ):
        super().__init__(
            vocab_size=vocab_size,
            token_embedding=token_embedding,
            bias_initializer=bias_initializer,
            **kwargs,
        )
        num_components = check_int("num_components", num_components, minimum=1)
        latent_dim = check_int("latent_dim", latent_dim, minimum=1, allow_none=True)
        latent_dropout = check_rate("latent_dropout", latent_dropout)
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
        self.num_components = num_components
        self.latent_dim = latent_dim
        self.latent_dropout = latent_dropout
        self.prior_initializer = keras.initializers.get(prior_initializer)
        self.latent_initializer = (
            latent_initializer
            if latent_initializer == "identity"
            else keras.initializers.get(latent_initializer)
        )
        self.use_latent_bias = check_bool("use_latent_bias", use_latent_bias)
        self.use_prior_bias = check_bool("use_prior_bias", use_prior_bias)
        self.seed = seed
        # Both mixtures train their summed objective by default (`None`: on).
        self.gradient_in_forward = check_bool(
            "gradient_in_forward", True if gradient_in_forward is None else gradient_in_forward)
        self.seed_generator = None
        if self.latent_dropout > 0.0:
            self.seed_generator = keras.random.SeedGenerator(seed)

    named_bias_initializers = ("unigram",)

    def named_bias_values(self, name):
        """`"unigram"`: `log((counts + 1) / sum(counts + 1))`, zeros without
        `counts` (why: `docs/mixtures.md`)."""
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
        self.bias = self.build_bias()
        k = self.num_components
        self.prior_kernel = self.add_weight(
            name="prior_kernel",
            shape=(self.input_dim, k),
            initializer=self.prior_initializer,
        )
        self.prior_bias = None
        if self.use_prior_bias:
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
        self.latent_bias = None
        if self.use_latent_bias:
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
        )
        if self.prior_bias is not None:
            prior_logits = prior_logits + ops.cast(self.prior_bias, acc)
        log_priors = self._prior_log_normaliser(prior_logits)
        latent = ops.matmul(x, ops.cast(self.latent_kernel, self.compute_dtype))
        if self.latent_bias is not None:
            latent = latent + ops.cast(self.latent_bias, self.compute_dtype)
        latent = ops.tanh(latent)
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
                "use_latent_bias": self.use_latent_bias,
                "use_prior_bias": self.use_prior_bias,
                "seed": self.seed,
                "chunk_size": self.chunk_size,
                "counts": samplers.counts_to_config(self._counts),
                "gradient_in_forward": self.gradient_in_forward,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        # Configs written before these options existed (`use_latent_bias`:
        # 0.3.0 and before) do not name them: their heads had these biases
        # (trained variables in the file).
        config = dict(config)
        config.setdefault("use_latent_bias", True)
        config.setdefault("use_prior_bias", True)
        return super().from_config(config)
