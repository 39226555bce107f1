"""`PointwiseSoftmaxHead`: heads of the form `log_softmax(g(h W + b))`."""

import keras
from keras import ops

from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.chunked import chunked_pointwise_nll
from keras_softmax_heads.chunked.losses import as_tensor
from keras_softmax_heads.chunked.vocab_parallel import summed_mixture_nll_auto
from keras_softmax_heads.chunked.vocab_parallel import tile_sized_token_chunk
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_layout
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_mixture
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_pointwise_nll
from keras_softmax_heads.heads.head_utils import linear_nll_on_shards
from keras_softmax_heads.heads.head_utils import summed_over_valid_targets
from keras_softmax_heads.heads.head_utils import token_nll_on_shards
from keras_softmax_heads.heads.softmax_head import SoftmaxHead
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class PointwiseSoftmaxHead(SoftmaxHead):
    """A head `log p = log_softmax(g(h W + b))` with `g` pointwise.

    Linear-Softmax (`g` the identity), sigsoftmax and its siblings, and the
    learnable monotonic functions (MLP, PLIF) share this form. Subclasses
    implement `score_transform(z)` (`g`); the layer normalises in float32.
    With `chunk_size` set, `log_likelihood` and `training_loss` compute the
    exact NLL in vocabulary tiles (`keras_softmax_heads.chunked`), never
    holding the `[N, V]` scores, at the cost of one extra `N x d x V` matrix
    product per step; `call` and `log_probs` still return `[..., V]`. See
    `docs/chunked.md`.

    Args:
        chunk_size: optional int >= 1, the vocabulary tile width of the
            chunked exact loss (4096 to 8192 on CPU, `docs/chunked.md`);
            `None` (default): the dense path.
        *args, **kwargs: the `SoftmaxHead` arguments (`vocab_size`,
            `token_embedding`, `use_bias`, ...).

    Example:

    >>> import numpy as np, keras_softmax_heads as ksh
    >>> h = np.random.default_rng(0).normal(size=(2, 5, 4)).astype("float32")
    >>> y = np.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    >>> head = ksh.FullSoftmax(10, chunk_size=3)  # tiles of 3, 3, 3 and 1 words
    >>> loss = head.training_loss(h, y)  # never holds the [2, 5, 10] scores
    >>> tuple(loss.shape)
    (2, 5)
    >>> log_p = np.asarray(head(h))  # `call` still returns [2, 5, 10]
    >>> dense = -np.take_along_axis(log_p, y[..., None], axis=-1)[..., 0]
    >>> bool(np.allclose(loss, dense, atol=1e-5))
    True
    """

    def __init__(self, *args, chunk_size=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk_size = check_chunk_size(chunk_size, default=None)

    def score_transform(self, z):
        """The pointwise output function `g(z)`; identity by default."""
        return z

    def has_score_transform(self):
        """Whether `score_transform` is not the identity (the chunked loss
        then differentiates through it). True when a subclass overrides
        `score_transform`; a subclass whose transform is optional
        overrides this too."""
        return type(self).score_transform is not PointwiseSoftmaxHead.score_transform

    def log_probs(self, inputs):
        return ops.log_softmax(self.score_transform(self.logits(inputs)), axis=-1)

    def score_transform_variables(self):
        """The variables `score_transform` may read, for the chunked loss.

        Every floating-point weight of the head except the output projection
        and bias (the PLIF slopes, the monotonic MLP's weights, ...). The
        chunked loss passes their values into its custom gradient explicitly
        and returns their gradients. A subclass whose `score_transform`
        reads other variables overrides this method.
        """
        projection = {id(self.kernel), id(self.bias)}
        if self.token_embedding is not None:
            projection.add(id(self.token_embedding.embeddings))
        return [
            w
            for w in self.weights
            if id(w) not in projection
            and "float" in keras.backend.standardize_dtype(w.dtype)
        ]

    def _chunked_nll(self, inputs, targets):
        """`-log p(targets)` by `chunked_pointwise_nll`, shape `targets.shape`.

        The chunked scores are the exact float32 products of the inputs (the
        kernel is read in its variable dtype), where the dense path
        multiplies in the compute dtype.
        """
        inputs = ops.cast(self._check_inputs(inputs), self.compute_dtype)
        kernel, transposed = self.chunked_projection()
        transform, variables = self._tiled_transform()
        return chunked_pointwise_nll(
            inputs, kernel, self.bias, targets, transform_fn=transform,
            transform_params=variables, chunk_size=self.chunk_size,
            kernel_transposed=transposed,
        )

    def _tiled_transform(self):
        """`(transform_fn, transform_params)` of the tiled pass
        (`chunked_pointwise_nll` and its vocabulary-parallel form):
        `score_transform` and the variables it reads, or `(None, [])` for
        the identity (no vector-Jacobian product)."""
        if not self.has_score_transform():
            return None, []

        def transform(z, *values):
            # The tiled pass makes the variables read as `values` while this
            # runs, and returns their gradients.
            del values
            return self.score_transform(z)

        return transform, self.score_transform_variables()

    def _summed_core_options(self):
        """The options of this head's one component in the summed mixture
        core (`summed_mixture_nll`: `output_fn` and `epsilon`, or
        `raw_slopes` and `knot_bound`), or None where it has none
        (`MonotonicSoftmax`; `FullSoftmax` has a core of its own)."""
        return None

    def _vocab_parallel_operands(self, inputs):
        """`(layout, rows, kernel, transposed, token_chunk)` for a per-token
        pass on each device's vocabulary shard (JAX, the kernel or tied
        embedding sharded on V by the current `keras.distribution`), or
        None: the rows `[N, d]` in the compute dtype, the token chunk (`tile_sized_token_chunk`: as many chunks as a
        `chunk_size` tiling has tiles)."""
        inputs = self._check_inputs(inputs)  # builds the head on first use
        kernel, transposed = self.chunked_projection()
        layout = vocab_parallel_layout(kernel, transposed)
        if layout is None:
            return None
        rows = ops.reshape(ops.cast(inputs, self.compute_dtype), (-1, self.input_dim))
        chunk = tile_sized_token_chunk(rows.shape[0], self.vocab_size, self.chunk_size)
        return layout, rows, kernel, transposed, chunk

    def _vocab_parallel_nll(self, inputs, targets):
        """`-log p(targets)` (shape `targets.shape`) computed on each
        device's vocabulary shard where the kernel is sharded on V (JAX):
        the summed core with its per-token losses
        (`chunked.vocab_parallel.token_losses`), exact gradients for any
        cotangent; for the Linear-Softmax scores of the sampled and
        self-normalised heads (their exact evaluation) the summed
        cross-entropy's (`head_utils.linear_nll_on_shards`), and for a head
        with a transform but no summed core (`MonotonicSoftmax`) the tiled
        pass on each shard (`_vocab_parallel_tiled_nll`); None elsewhere."""
        operands = self._vocab_parallel_operands(inputs)
        if operands is None:
            return None
        layout, rows, kernel, transposed, chunk = operands
        options = self._summed_core_options()
        if options is None and not self.has_score_transform():  # Linear-Softmax scores
            return linear_nll_on_shards(rows, kernel, self.bias, transposed, layout, targets,
                                        self.vocab_size, chunk)
        if options is None:  # no summed core (`MonotonicSoftmax`): the tiled pass per shard
            return ops.reshape(self._vocab_parallel_tiled_nll(layout, rows, kernel, transposed,
                                                              targets), ops.shape(targets))
        options = dict(options)
        raw_slopes = options.pop("raw_slopes", None)
        extra = [x for x in (self.bias, raw_slopes) if x is not None]
        has_bias = self.bias is not None

        def summed(weights, t, h, w, *rest):
            return vocab_parallel_mixture(
                h[:, None, :], ops.zeros_like(h[:, :1]), w, rest[0] if has_bias else None, t,
                weights, layout, kernel_transposed=transposed,
                raw_slopes=rest[-1] if raw_slopes is not None else None,
                token_chunk_size=chunk, return_per_token=True, **options)

        return token_nll_on_shards(summed, [rows, kernel, *extra], targets, self.vocab_size)

    def _vocab_parallel_tiled_nll(self, layout, rows, kernel, transposed, targets):
        """`[N]` NLLs of a head without a summed core on each device's
        vocabulary shard: the tiled pass with `score_transform` on the
        shard, the shards' log-sum-exps and target scores combined
        (`chunked.vocab_parallel.vocab_parallel_pointwise_nll`)."""
        ids = ops.clip(ops.reshape(targets, (-1,)), 0, self.vocab_size - 1)
        transform, variables = self._tiled_transform()
        return vocab_parallel_pointwise_nll(
            rows, kernel, self.bias, ids, layout, transform_fn=transform,
            transform_params=variables, chunk_size=self.chunk_size,
            kernel_transposed=transposed)

    def _summed_loss_operands(self, inputs, targets):
        """`(rows, targets, kernel, transposed, bias)` of a summed training
        loss computed over token chunks (`gradient_in_forward`): the checked
        inputs as `[N, d]` rows in the compute dtype, the checked targets,
        the projection as `chunked_projection` gives it and the bias (None
        without one)."""
        inputs = ops.cast(self._check_inputs(inputs), self.compute_dtype)
        targets = check_targets(targets, self.vocab_size)
        kernel, transposed = self.chunked_projection()
        bias = None if self.bias is None else as_tensor(self.bias)
        return (ops.reshape(inputs, (-1, self.input_dim)), targets, as_tensor(kernel),
                transposed, bias)

    def _gradient_in_forward_option(self, value):
        """The `gradient_in_forward` option of a subclass with a summed
        path (`FullSoftmax`, `SigSoftmax`, `PLIFSoftmax`): `None` means on
        with `chunk_size` (without, the dense loss already runs three
        products), else a bool."""
        if value is None:
            value = self.chunk_size is not None
        return check_bool("gradient_in_forward", value)

    def _summed_one_component(self, inputs, targets, weights, **options):
        """The summed training objective through the summed mixture core
        with one component (`chunked.summed_mixture.summed_mixture_nll`,
        its gradient in the forward pass; vocabulary-parallel on JAX when
        the kernel is sharded on V, `chunked.vocab_parallel.
        summed_mixture_nll_auto`): `options` are the core's output
        function (`output_fn`, `epsilon`) or PLIF (`raw_slopes`,
        `knot_bound`). NaN for a word id outside `[0, V)` with a non-zero
        weight."""
        rows, targets, _, transposed, bias = self._summed_loss_operands(inputs, targets)
        latents = rows[:, None, :]  # [N, 1, d]: one component
        log_priors = ops.zeros_like(rows[:, :1])
        kernel = self.chunked_projection()[0]  # the variable: its layout decides

        def summed(ids, weights):
            return summed_mixture_nll_auto(latents, log_priors, kernel, bias, ids, weights,
                                           kernel_transposed=transposed, **options)

        return summed_over_valid_targets(targets, weights, self.vocab_size, summed)

    def log_likelihood(self, inputs, targets):
        if self.chunk_size is None:
            return super().log_likelihood(inputs, targets)
        targets = check_targets(targets, self.vocab_size)
        nll = self._vocab_parallel_nll(inputs, targets)
        if nll is None:
            nll = self._chunked_nll(inputs, targets)
        return nan_if_invalid(-nll, targets, self.vocab_size)

    def training_loss(self, inputs, targets, training=True):
        """`-log_likelihood`: the chunked exact NLL when `chunk_size` is set."""
        del training
        return -self.log_likelihood(inputs, targets)

    def get_config(self):
        config = super().get_config()
        config.update({"chunk_size": self.chunk_size})
        return config
