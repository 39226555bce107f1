"""`SoftmaxHead`: the base class and contract of every output head.

A head maps context vectors `h` `[..., d]` to a distribution over `V` words:
`call` / `log_probs` return exact log-probabilities `[..., V]`,
`log_likelihood(h, targets)` the exact `log p(targets | h)` and
`training_loss(h, targets)` the per-token objective. Why the contract has
this shape, weight layouts, training with `fit` and saving:
`docs/head_contract.md`.
"""

import contextlib
import math
import weakref

import numpy as np

import keras
from keras import ops

from keras_softmax_heads.chunked.dispatch import matmul_fn
from keras_softmax_heads.functional.dispatch import exportable_graph
from keras_softmax_heads.heads.head_utils import build_context_checks
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.heads.head_utils import gather_targets
from keras_softmax_heads.heads.head_utils import load_random_states
from keras_softmax_heads.heads.head_utils import save_random_states
from keras_softmax_heads.validation import nan_if_invalid
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_embedding_layer
from keras_softmax_heads.validation import check_int


#: What `call(h, training=True)` may return (see `SoftmaxHead`).
TRAINING_OUTPUTS = ("log_probs", "contexts")

# The heads whose training output is their context vectors, weakly held, in
# the order they were set so, so that a `HeadLoss` restored from a saved model
# can find the head loaded with it.
_CONTEXT_OUTPUT_HEADS = []


def context_output_heads(name=None):
    """Live heads with `training_output="contexts"` (named `name`, if given),
    oldest first."""
    alive = [ref() for ref in _CONTEXT_OUTPUT_HEADS]
    _CONTEXT_OUTPUT_HEADS[:] = [weakref.ref(h) for h in alive if h is not None]
    return [
        h for h in alive
        if h is not None and h.training_output == "contexts"
        and (name is None or h.name == name)
    ]


def check_context_dtype(layer, inputs):
    """Raises unless `inputs` are floating-point context vectors (integer
    inputs are almost always token ids fed to a head without a backbone)."""
    dtype = keras.backend.standardize_dtype(inputs.dtype)
    if "float" not in dtype:
        raise ValueError(
            f"{layer.__class__.__name__} expects floating-point context vectors "
            f"`h` of shape [..., d]. Received: inputs of dtype {dtype} and shape "
            f"{tuple(inputs.shape)}. Token ids? Put a backbone (e.g. "
            "keras.layers.Embedding) before the head."
        )


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class SoftmaxHead(keras.layers.Layer):
    """Base class of all output heads: linear scores `z = h W + b`, then a head.

    `W` is the head's `[d, V]` `kernel` or, tied, the `[V, d]` matrix of an
    input `keras.layers.Embedding` (`W = E^T`). The product runs in the
    compute dtype and `z` is returned in float32: every normalisation happens
    in float32. Subclasses implement `log_probs(h)` and override
    `log_likelihood` / `training_loss` where they have a cheaper exact
    likelihood or a different training objective (`docs/head_contract.md`).

    Args:
        vocab_size: int `V >= 2`; may be omitted when `token_embedding` is
            given.
        token_embedding: optional `keras.layers.Embedding` (or
            `keras.layers.ReversibleEmbedding`) `[V, d]` whose matrix,
            transposed, is the output projection (weight tying).
        use_bias: bool, add a per-word output bias.
        kernel_initializer: initializer of the owned `[d, V]` kernel.
        bias_initializer: initializer of the `[V]` bias.
        return_probabilities: bool, `call` returns probabilities instead of
            log-probabilities (other methods are unaffected).
        training_output: what `call(h, training=True)` returns:
            `"log_probs"` (default, for a standard Keras loss) or
            `"contexts"` (`h[..., None, :]`, for
            `keras_softmax_heads.HeadLoss`, which sets it). Heads whose
            objective is not the exact NLL (`exact_training_objective =
            False`) refuse `"log_probs"` in training.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: float context vectors `[..., d]`.
        training: bool.

    Returns:
        float32 log-probabilities `[..., V]` (probabilities with
        `return_probabilities=True`).

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads.heads.softmax_head import SoftmaxHead
    >>> class Linear(SoftmaxHead):
    ...     def log_probs(self, inputs):
    ...         return ops.log_softmax(self.logits(inputs), axis=-1)
    >>> head = Linear(vocab_size=5)
    >>> h = np.zeros((2, 3), "float32")
    >>> tuple(head(h).shape), tuple(head.log_likelihood(h, np.array([0, 4])).shape)
    ((2, 5), (2,))
    """

    exact_training_objective = True
    """Whether `training_loss` is the exact negative log-likelihood."""

    named_bias_initializers = ()
    """Names a head accepts as `bias_initializer` for a start computed from
    its own structure (`named_bias_values`), e.g. NCE's `"noise"`."""

    def named_bias_values(self, name):
        """The initial bias `[V]` (NumPy) of the named start `name`."""
        raise NotImplementedError(name)

    def __init__(
        self,
        vocab_size=None,
        token_embedding=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        return_probabilities=False,
        training_output="log_probs",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if vocab_size is None and token_embedding is None:
            raise ValueError(
                "One of `vocab_size` or `token_embedding` must be set. "
                "Received: vocab_size=None, token_embedding=None"
            )
        if token_embedding is not None:
            check_embedding_layer(token_embedding, "token_embedding")
            if vocab_size is not None and vocab_size != token_embedding.input_dim:
                raise ValueError(
                    "`vocab_size` must equal the input dimension of "
                    "`token_embedding`. Received: "
                    f"vocab_size={vocab_size}, "
                    f"token_embedding.input_dim={token_embedding.input_dim}"
                )
            vocab_size = token_embedding.input_dim
        self.vocab_size = check_int("vocab_size", vocab_size, minimum=2)
        self.token_embedding = token_embedding
        self.use_bias = check_bool("use_bias", use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        # A named data-dependent start (`named_bias_initializers`, e.g. NCE's
        # "noise") is kept as its name (the config) and resolved in `build`
        # by `named_bias_values`.
        self.bias_initializer_name = None
        if isinstance(bias_initializer, str) and bias_initializer in self.named_bias_initializers:
            self.bias_initializer_name = bias_initializer
            self.bias_initializer = None
        else:
            self.bias_initializer = keras.initializers.get(bias_initializer)
        self.return_probabilities = check_bool("return_probabilities", return_probabilities)
        self.training_output = training_output
        self.last_output = None
        self.last_output_masked = False
        self.supports_masking = True

    @property
    def training_output(self):
        """`"log_probs"` or `"contexts"`: what `call` returns in training."""
        return self._training_output

    @training_output.setter
    def training_output(self, value):
        self._training_output = check_choice("training_output", value, TRAINING_OUTPUTS)
        if value == "contexts" and all(r() is not self for r in _CONTEXT_OUTPUT_HEADS):
            _CONTEXT_OUTPUT_HEADS.append(weakref.ref(self))

    word_major = False
    """Layout of an owned output matrix: `kernel` `[d, V]` (False, as in
    `keras.layers.Dense`) or `[V, d]` (True: heads that gather rows of it,
    see `docs/head_contract.md`). A tied embedding is always `[V, d]`."""

    # ------------------------------------------------------------------ build
    def build(self, input_shape):
        build_context_checks(self, input_shape)
        self.kernel = None
        if self.token_embedding is None:
            d, vocab = self.input_dim, self.vocab_size
            self.kernel = self.add_weight(
                name="kernel",
                shape=(vocab, d) if self.word_major else (d, vocab),
                initializer=self.kernel_initializer,
            )
        self.bias = self.build_bias()
        self.build_head(input_shape)

    def build_bias(self):
        """Adds and returns the `[V]` output bias (None without `use_bias`).

        Starts from `bias_initializer`, or for a named start (one of
        `named_bias_initializers`) from `named_bias_values(name)`. Every
        head with a per-word output bias builds it here.
        """
        if not self.use_bias:
            return None
        initializer = self.bias_initializer
        if self.bias_initializer_name is not None:
            values = np.asarray(self.named_bias_values(self.bias_initializer_name))

            def named_start(shape, dtype=None):
                return ops.cast(np.broadcast_to(values, shape), dtype)

            initializer = named_start
        return self.add_weight(
            name="bias",
            shape=(self.vocab_size,),
            initializer=initializer,
            autocast=False,  # read in float32 under mixed precision
        )

    def build_head(self, input_shape):
        """Hook for subclasses: create the head's own weights."""

    # ---------------------------------------------------------------- helpers
    def _check_inputs(self, inputs):
        self._check_structure()
        inputs = ops.convert_to_tensor(inputs)
        check_context_dtype(self, inputs)
        if not self.built:
            self.build(tuple(inputs.shape))
        last = inputs.shape[-1]
        if last is not None and last != self.input_dim:
            raise ValueError(
                f"{self.__class__.__name__} was built for context vectors of "
                f"dimension {self.input_dim}. Received: inputs with last "
                f"dimension {last} (shape {tuple(inputs.shape)})"
            )
        return inputs

    @property
    def accumulation_dtype(self):
        """float32 (float64 when the layer computes in float64)."""
        return "float64" if self.compute_dtype == "float64" else "float32"

    def output_embeddings(self):
        """The word-major `[V, d]` output matrix (a variable, not cast): the
        tied `token_embedding` or a `word_major` kernel."""
        if self.token_embedding is not None:
            return self.token_embedding.embeddings
        if not self.word_major:
            raise ValueError(
                f"{self.__class__.__name__} stores its kernel as [d, V]; use "
                "`output_kernel()`."
            )
        return self.kernel

    def output_kernel(self):
        """The `[d, V]` output projection, in the compute dtype."""
        if self.token_embedding is not None or self.word_major:
            kernel = ops.transpose(self.output_embeddings())
        else:
            kernel = self.kernel
        return ops.cast(kernel, self.compute_dtype)

    def chunked_projection(self):
        """The output matrix as stored, for the chunked losses:
        `(matrix, kernel_transposed)`.

        `(kernel [d, V], False)` for an owned `[d, V]` kernel, `(embeddings
        [V, d], True)` for a tied `token_embedding` or a `word_major` kernel
        (no transposed copy).
        """
        if self.token_embedding is not None or self.word_major:
            return self.output_embeddings(), True
        return self.kernel, False

    def logits(self, inputs):
        """Linear scores `z = h W + b`, shape `[..., V]`.

        The product runs in the compute dtype (fast under mixed precision);
        the result is returned in `accumulation_dtype` (float32).
        """
        inputs = ops.cast(self._check_inputs(inputs), self.compute_dtype)
        if self.word_major:
            # A 2-D product with the `[V, d]` rows: the gradient of TF's
            # einsum "...d,vd->...v" with respect to them broadcasts to
            # [N, V, d] (4 GB at N=205, V=10k).
            words = ops.cast(self.output_embeddings(), self.compute_dtype)
            flat = ops.reshape(inputs, (-1, self.input_dim))
            z = ops.cast(ops.einsum("nd,vd->nv", flat, words), self.accumulation_dtype)
            z = ops.reshape(z, (*ops.shape(inputs)[:-1], self.vocab_size))
        elif keras.backend.standardize_dtype(inputs.dtype) == "float64":
            # `matmul_fn`: Keras' PyTorch `matmul` computes float64 products in float32.
            flat = ops.reshape(inputs, (-1, self.input_dim))
            kernel = ops.cast(self.output_kernel(), "float64")
            z = ops.reshape(matmul_fn("float64")(flat, kernel),
                            (*ops.shape(inputs)[:-1], self.vocab_size))
            z = ops.cast(z, self.accumulation_dtype)
        else:
            z = ops.cast(
                ops.matmul(inputs, self.output_kernel()), self.accumulation_dtype
            )
        if self.bias is not None:
            z = z + ops.cast(self.bias, self.accumulation_dtype)
        return z

    # --------------------------------------------------------------- contract
    def log_probs(self, inputs):
        """Exact normalised log-probabilities, float32 `[..., V]`."""
        raise NotImplementedError

    def call(self, inputs, training=None):
        if training:
            contexts = self.training_contexts(inputs)
            if contexts is not None:
                return contexts
        self.last_output = "log_probs"
        if training:
            log_p = self.call_log_probs(inputs, training)
        else:
            # Plain ops in an inference graph, which `model.export` converts
            # (ONNX cannot inline a nested XLA function, `docs/export.md`).
            with exportable_graph():
                log_p = self.call_log_probs(inputs, training)
        if self.return_probabilities:
            return ops.exp(log_p)
        return log_p

    def call_log_probs(self, inputs, training=None):
        """The log-probabilities `call` returns: `log_probs(inputs)`; heads
        whose log-probabilities depend on `training` (dropout) override it."""
        del training
        return self.log_probs(inputs)

    @contextlib.contextmanager
    def compiled_with(self, jit_compile):
        """A context in which the step being traced is compiled with XLA
        (`jit_compile` true) or not; `HeadModel` enters it around each step
        it traces. Most heads take the same path either way (this one does
        nothing); `HierarchicalSoftmax` picks its tiles by it."""
        del jit_compile
        yield

    def training_contexts(self, inputs):
        """`call`'s training-mode output when it is not log-probabilities.

        Returns `inputs[..., None, :]` (the context vectors, with an axis
        that tells them apart from `[..., V]` log-probabilities) when
        `training_output == "contexts"`, else None. Raises for a head whose
        training objective is not the exact NLL: its log-probabilities in
        training mode would make a Keras loss train the full softmax.
        Records what was returned in `last_output` (read by `HeadLoss` in
        the same traced step).
        """
        if self.training_output == "contexts":
            self.last_output = "contexts"
            return ops.expand_dims(self._check_inputs(inputs), -2)
        if not self.exact_training_objective:
            name = self.__class__.__name__
            raise ValueError(
                f"{name} {self.name!r} trains with its own objective "
                "(`training_loss`), but it was called in training mode to "
                "return log-probabilities: a Keras loss on them (e.g. "
                "SparseCategoricalCrossentropy) would train the full softmax "
                f"over all {self.vocab_size} words instead, at full cost. "
                "Compile with `loss=keras_softmax_heads.HeadLoss(head)` (the "
                "head then returns its context vectors in training and the "
                "loss computes its objective), or train backbone and head with "
                "`keras_softmax_heads.HeadModel`. For log-probabilities in "
                "training on purpose, call `head.log_probs(h)`."
            )
        return None

    def log_likelihood(self, inputs, targets):
        """Exact `log p(targets | inputs)`.

        Args:
            inputs: context vectors `[..., d]`.
            targets: integer word ids, shape `[...]` (the leading shape of
                `inputs`), values in `[0, V)`.

        Returns:
            float32 tensor of shape `targets.shape`.
        """
        targets = check_targets(targets, self.vocab_size)
        ll = gather_targets(self.log_probs(inputs), targets)
        return nan_if_invalid(ll, targets, self.vocab_size)

    def training_loss(self, inputs, targets, training=True):
        """Per-token training objective, shape `targets.shape`.

        For exact heads this is the negative log-likelihood. Heads that train
        with a different objective (sampling, NCE, self-normalisation)
        override it; their evaluation still uses `log_likelihood`.
        """
        del training
        return -self.log_likelihood(inputs, targets)

    #: Whether `summed_training_loss` computes its gradient in the forward
    #: pass (`HeadModel` and `HeadLoss` then train through it); heads with
    #: such a path set it from their `gradient_in_forward` option.
    gradient_in_forward = False

    def summed_training_loss(self, inputs, targets, weights, training=True):
        """`sum_i weights_i training_loss_i`, a float32 scalar.

        The training objective as `HeadModel` and `HeadLoss` reduce it
        (`weights` `[...]`, shape `targets.shape`: sample weights over the
        token count). Here `training_loss` weighted and summed; a head with
        `gradient_in_forward=True` overrides it with a pass that computes
        the gradient while it computes the loss (three `N d V` products in
        place of four, `docs/mixtures.md`).
        """
        per_token = ops.cast(self.training_loss(inputs, targets, training=training),
                             "float32")
        return ops.sum(per_token * ops.cast(weights, "float32"))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.vocab_size,)

    def compute_output_spec(self, inputs):
        check_context_dtype(self, inputs)
        return keras.KerasTensor(
            self.compute_output_shape(inputs.shape), dtype=self.accumulation_dtype
        )

    def compute_mask(self, inputs, mask=None):
        # Keras asks after every call: whether the last call's output
        # carries a Keras mask (`HeadLoss` then reduces per token, as Keras
        # weighs a masked loss).
        self.last_output_masked = mask is not None
        return mask

    # ------------------------------------------------- data-derived structure
    # Heads whose structure comes from data (`HierarchicalSoftmax` clusters,
    # the counts of `SampledSoftmax` / `NCE` / `DifferentiatedSoftmax`) carry
    # it in their config. Configs written by keras-softmax-heads 0.1.0 did
    # not (`clusters=None` / `counts=None`, the structure only in the
    # weights): their `from_config` builds a layer of the right shape and
    # marks it pending (`_pending_structure`, the missing argument's name)
    # until its weights are loaded; until then every entry point raises.
    _pending_structure = None

    def _check_structure(self):
        """Raises if the layer's data-derived structure is still pending."""
        argument = self._pending_structure
        if argument is None:
            return
        raise ValueError(
            f"{self.__class__.__name__} layer '{self.name}' has no "
            f"`{argument}`: its config carries `{argument}=None` (a file "
            "from keras-softmax-heads 0.1.0, which kept what "
            f"`{argument}` determines only in the weights), so it holds a "
            "placeholder. Load its weights (`keras.saving.load_model`, "
            "`model.load_weights` or this layer's `set_weights`) or build "
            f"it with `{argument}=`."
        )

    def save_own_variables(self, store):
        super().save_own_variables(store)
        # The samplers' and dropouts' generator states (Keras saves none):
        # `load_model` + `fit` then resumes the same draws.
        save_random_states(self, store)

    def load_own_variables(self, store):
        load_random_states(self, store, super().load_own_variables)
        self._pending_structure = None  # the structure came with the weights

    def set_weights(self, weights):
        super().set_weights(weights)
        self._pending_structure = None  # the structure came with the weights

    # ------------------------------------------------------- parameter count
    def count_params(self):
        """The number of the head's own parameters.

        A tied `token_embedding` is not counted: its matrix belongs to the
        embedding layer (the backbone's), which counts it in its own row of
        `model.summary()`. (The head still tracks the layer, so `weights`
        lists the matrix and a `.keras` file of the head alone keeps it; a
        model's total counts every variable once.)
        """
        if self.token_embedding is None or not self.built:
            return super().count_params()  # raises if not built
        tied = {id(v) for v in self.token_embedding.weights}
        return int(sum(
            math.prod(v.shape) for v in self.weights if id(v) not in tied
        ))

    # ------------------------------------------------------------ serialising
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocab_size": self.vocab_size,
                "token_embedding": (
                    keras.layers.serialize(self.token_embedding)
                    if self.token_embedding is not None
                    else None
                ),
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "bias_initializer": (
                    self.bias_initializer_name
                    or keras.initializers.serialize(self.bias_initializer)
                ),
                "return_probabilities": self.return_probabilities,
                "training_output": self.training_output,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        embedding = config.get("token_embedding")
        if isinstance(embedding, dict):
            config["token_embedding"] = keras.layers.deserialize(embedding)
        return cls(**config)
