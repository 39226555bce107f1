"""`HierarchicalSoftmax`: a two-level softmax over a fixed word clustering.

The layer owns the weights and the contract; its tile kernels and layout
planning are in `hierarchical_kernels` (re-exported here). Design notes and
measurements: `docs/hierarchical.md`.
"""

import contextlib
import functools

import keras
import numpy as np
from keras import ops

from keras_softmax_heads import clustering
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_layout
from keras_softmax_heads.clustering import CLUSTERING_STRATEGIES
from keras_softmax_heads.functional.dispatch import segment_max
from keras_softmax_heads.functional.dispatch import segment_sum
from keras_softmax_heads.heads.head_utils import add_constant_weight
from keras_softmax_heads.heads.head_utils import check_static_shapes
from keras_softmax_heads.heads.head_utils import config_vocab_size
from keras_softmax_heads.heads.hierarchical_kernels import dynamic_plan
from keras_softmax_heads.heads.hierarchical_kernels import dynamic_within_cluster
from keras_softmax_heads.heads.hierarchical_kernels import num_static_tiles
from keras_softmax_heads.heads.hierarchical_kernels import placeholder_layout
from keras_softmax_heads.heads.hierarchical_kernels import split_large_clusters
from keras_softmax_heads.heads.hierarchical_kernels import static_within_cluster
from keras_softmax_heads.heads.hierarchical_kernels import vocab_parallel_within_cluster
from keras_softmax_heads.heads.softmax_head import SoftmaxHead
from keras_softmax_heads.samplers import check_counts
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import nan_if_invalid

# The kernels' public names stay importable from here (tests, benchmarks).
from keras_softmax_heads.heads.hierarchical_kernels import (  # noqa: F401 (re-export)
    DYNAMIC_MAX_TILE,
    DYNAMIC_TILE_SCORES,
    SIZE_CLASS_RATIO,
    TOP_CLASS_RATIO,
    ops_dynamic_within_cluster,
    pack_tiles,
    size_class_widths,
    slots_of_tokens,
    tf_dynamic_within_cluster,
)


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class HierarchicalSoftmax(SoftmaxHead):
    """Two-level hierarchical softmax over a fixed word clustering.

    Every word `w` belongs to one cluster `c(w)` of `C`, and

    `log p(w | h) = log_softmax(h U + a)[c(w)]
    + log_softmax_{v in c(w)}(h W_v + b_v)[w]`,

    with a cluster kernel `U` `[d, C]`, cluster bias `a` `[C]`, word
    embeddings `W` `[V, d]` (the layer's `kernel`, word-major) and word bias
    `b` `[V]`. `log_likelihood` (and so `training_loss`, the exact NLL)
    costs `O((C + M) d)` per token, `M = max_cluster_size`, and never scores
    all `V` words; `call` / `log_probs` return the full normalised
    distribution (`O(V d)`, for decoding). The clustering comes from
    `clusters`, or the layer builds it from `counts` (equal unigram mass
    per cluster, split to at most `ceil(V / C)` words by default) or at
    random. Design, cost model and measurements: `docs/hierarchical.md`;
    the clusterings: `docs/clustering.md`.

    Args:
        vocab_size: int `V` (or omit and pass `token_embedding`).
        num_clusters: int `C` in `[1, V]`; default `ceil(sqrt(V))`, or the
            number of clusters of `clusters`.
        clusters: optional `clustering.ClusterAssignment`, its `to_config()`
            dict, or an int array `[V]` with the cluster of every word.
        counts: optional non-negative unigram counts `[V]`, for the
            `"frequency"` clustering (without them word ids are taken to be
            frequency ranks, cut into `C` contiguous blocks).
        clustering: `"frequency"` (default) or `"random"`, used when
            `clusters` is None (`"kmeans"` / `"weighted_kmeans"` need
            `clustering.make_clusters` and raise).
        cluster_size_cap: `"auto"` (default: cap the layer's own frequency
            clusters at `ceil(V / C)` words), None (never split) or an int
            (split any layout); see `split_large_clusters`.
        max_cluster_size: optional int `>=` the largest cluster, the padded
            width `M` (e.g. a multiple of 128 for TPU tiles).
        tile_size: int `>= 1`, tokens per tile in `log_likelihood`
            (default 16).
        static_shapes: None (default), True or False. True: the static
            tiles (XLA-compatible). False: only the tiles a batch uses
            (data-dependent shapes: TensorFlow graphs and PyTorch;
            `supports_jit = False`; raises on JAX). None: the static tiles,
            except in a TensorFlow step compiled without XLA by a model that
            says so (`HeadModel`, through `compiled_with`: Keras'
            `jit_compile="auto"` on a CPU), where the dynamic ones are
            faster at every clustering (`docs/hierarchical.md`).
        seed: int `>= 0`, seed of the `"random"` clustering.
        **kwargs: `token_embedding`, `use_bias`, `kernel_initializer` (of
            `W` and `U`), `bias_initializer` (of `b` and `a`),
            `return_probabilities` (see `SoftmaxHead`) and standard
            `keras.layers.Layer` arguments.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 log-probabilities `[..., V]` in word-id order (`O(V d)`);
        `log_likelihood(inputs, targets)`: the exact `log p(targets |
        inputs)`, float32 of shape `targets.shape`, `O((C + M) d)` a token.

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.hierarchical_softmax import HierarchicalSoftmax
    >>> counts = np.array([40, 20, 10, 8, 6, 5, 4, 3, 2, 1])
    >>> head = HierarchicalSoftmax(vocab_size=10, counts=counts)
    >>> head.cluster_assignment.cluster_of_word.tolist()  # last bin split
    [0, 1, 2, 2, 3, 3, 3, 4, 4, 4]
    >>> head.num_clusters, head.max_cluster_size
    (5, 3)
    >>> head.likelihood_cost(num_tokens=6)
    {'tiles': 5, 'gathered_rows': 15, 'word_scores': 240, 'cluster_scores': 30}
    >>> h = np.random.rand(2, 3, 8).astype("float32")
    >>> log_p = np.asarray(head(h))
    >>> log_p.shape
    (2, 3, 10)
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True
    >>> targets = np.array([[0, 5, 9], [1, 2, 3]])
    >>> ll = head.log_likelihood(h, targets)  # never scores all V words
    >>> bool(np.allclose(ll, np.take_along_axis(log_p, targets[..., None], -1)[..., 0],
    ...                  atol=1e-5))
    True

    References:
        - Chen, Grangier & Auli, 2016. Strategies for Training Large
          Vocabulary Neural Language Models (section 2.2).
          https://arxiv.org/abs/1512.04906
        - Goodman, 2001. Classes for fast maximum entropy training.
          https://arxiv.org/abs/cs/0108006
        - Mikolov et al., 2011. Extensions of recurrent neural network
          language model.
    """

    def __init__(
        self,
        vocab_size=None,
        num_clusters=None,
        clusters=None,
        counts=None,
        clustering="frequency",
        cluster_size_cap="auto",
        max_cluster_size=None,
        tile_size=16,
        static_shapes=None,
        seed=0,
        **kwargs,
    ):
        super().__init__(vocab_size=vocab_size, **kwargs)
        vocab = self.vocab_size
        self.clustering = check_choice("clustering", clustering, CLUSTERING_STRATEGIES)
        self.tile_size = check_int("tile_size", tile_size, 1)
        if static_shapes is not None:
            static_shapes = check_static_shapes(
                static_shapes, "builds tiles of data-dependent shapes")
        self.static_shapes = static_shapes
        # Keras turns `jit_compile="auto"` (and `True`, with a warning) off
        # for a model with this layer when the shapes are data-dependent.
        self.supports_jit = static_shapes is not False
        self._graph_without_xla = False
        self.seed = check_int("seed", seed, 0)
        if num_clusters is not None:
            num_clusters = check_int("num_clusters", num_clusters, 1)
            if num_clusters > vocab:
                raise ValueError(
                    "`num_clusters` cannot exceed the vocabulary size (every "
                    f"cluster needs a word). Received: num_clusters="
                    f"{num_clusters} > vocab_size={vocab}"
                )
        if cluster_size_cap not in (None, "auto"):
            cluster_size_cap = check_int("cluster_size_cap", cluster_size_cap, 1)
        self.cluster_size_cap = cluster_size_cap
        counts = check_counts(counts, vocab)
        layout = self._resolve_layout(clusters, counts, num_clusters)
        if cluster_size_cap == "auto":
            if clusters is None and self.clustering == "frequency":
                cap = -(-vocab // layout.num_clusters)
                layout = split_large_clusters(layout, cap, counts)
        elif cluster_size_cap is not None:
            layout = split_large_clusters(layout, cluster_size_cap, counts)
        if max_cluster_size is None:
            max_cluster_size = layout.max_cluster_size
        max_cluster_size = check_int("max_cluster_size", max_cluster_size, 1)
        if max_cluster_size < layout.max_cluster_size:
            raise ValueError(
                "`max_cluster_size` must be at least the size of the largest "
                f"cluster ({layout.max_cluster_size}). Received: "
                f"max_cluster_size={max_cluster_size}"
            )
        self.num_clusters = layout.num_clusters
        self.max_cluster_size = max_cluster_size
        self._initial_layout = layout

    def _resolve_layout(self, clusters, counts, num_clusters):
        vocab = self.vocab_size
        if clusters is not None:
            if isinstance(clusters, dict):
                clusters = clustering.ClusterAssignment.from_config(clusters)
            if isinstance(clusters, clustering.ClusterAssignment):
                layout = clusters
            else:
                array = np.asarray(clusters)
                if array.ndim != 1 or array.size != vocab:
                    raise ValueError(
                        "`clusters` must give the cluster of every word, shape "
                        f"[vocab_size]. Received: clusters.shape={array.shape}, "
                        f"vocab_size={vocab}"
                    )
                layout = clustering.hierarchical_layout(array, num_clusters)
            if layout.vocab_size != vocab:
                raise ValueError(
                    "`clusters` covers a different vocabulary. Received: "
                    f"clusters.vocab_size={layout.vocab_size}, vocab_size={vocab}"
                )
            if num_clusters is not None and num_clusters != layout.num_clusters:
                raise ValueError(
                    "`num_clusters` disagrees with `clusters`. Received: "
                    f"num_clusters={num_clusters}, clusters has "
                    f"{layout.num_clusters} clusters"
                )
            return layout
        if num_clusters is None:
            num_clusters = clustering.default_num_clusters(vocab)
        if self.clustering in ("kmeans", "weighted_kmeans"):
            raise ValueError(
                f"clustering={self.clustering!r} needs word co-occurrence "
                "statistics, not only counts. Build the layout with "
                f"`keras_softmax_heads.clustering.make_clusters("
                f"{self.clustering!r}, ids=token_ids, counts=counts)` and pass "
                "it as `clusters=`. Received: clusters=None"
            )
        if self.clustering == "random":
            return clustering.make_clusters(
                "random", vocab_size=vocab, num_clusters=num_clusters, seed=self.seed
            )
        if counts is None:
            return placeholder_layout(vocab, num_clusters)
        return clustering.make_clusters(
            "frequency", counts=counts, num_clusters=num_clusters
        )

    word_major = True

    # ------------------------------------------------------------------ build
    def build_head(self, input_shape):
        """Cluster weights and the layout (after `kernel` `[V, d]` and `bias`)."""
        d, num_clusters = self.input_dim, self.num_clusters
        self.cluster_bias = None
        self.cluster_kernel = self.add_weight(
            name="cluster_kernel",
            shape=(d, num_clusters),
            initializer=self.kernel_initializer,
        )
        if self.use_bias:
            self.cluster_bias = self.add_weight(
                name="cluster_bias",
                shape=(num_clusters,),
                initializer=self.bias_initializer,
                autocast=False,
            )
        layout = self._initial_layout
        table = np.zeros((num_clusters, self.max_cluster_size), np.int32)
        table[:, : layout.max_cluster_size] = layout.padded_cluster_words(0)
        self.cluster_of_word = add_constant_weight(
            self, "cluster_of_word", "int32", layout.cluster_of_word
        )
        self.position_in_cluster = add_constant_weight(
            self, "position_in_cluster", "int32", layout.position_in_cluster
        )
        self.cluster_words = add_constant_weight(self, "cluster_words", "int32", table)
        self.cluster_sizes = add_constant_weight(
            self, "cluster_sizes", "int32", layout.cluster_sizes
        )

    @property
    def cluster_assignment(self):
        """The current layout as a `clustering.ClusterAssignment`."""
        self._check_structure()
        if not self.built:
            return self._initial_layout
        return clustering.hierarchical_layout(
            np.asarray(keras.ops.convert_to_numpy(self.cluster_of_word)),
            self.num_clusters,
        )

    # ---------------------------------------------------------------- scores
    def cluster_log_probs(self, inputs):
        """`log p(c | h)`, float32 `[..., C]`."""
        inputs = ops.cast(self._check_inputs(inputs), self.compute_dtype)
        kernel = ops.cast(self.cluster_kernel, self.compute_dtype)
        zc = ops.cast(ops.matmul(inputs, kernel), self.accumulation_dtype)
        if self.cluster_bias is not None:
            zc = zc + ops.cast(self.cluster_bias, self.accumulation_dtype)
        return ops.log_softmax(zc, axis=-1)

    def log_probs(self, inputs):
        """Exact `log p(w | h)` for all `V` words, float32 `[..., V]`."""
        inputs = self._check_inputs(inputs)
        lead = ops.shape(inputs)[:-1]
        z = ops.reshape(self.logits(inputs), (-1, self.vocab_size))  # [N, V]
        class_lp = ops.reshape(
            self.cluster_log_probs(inputs), (-1, self.num_clusters)
        )  # [N, C]
        # Per-cluster logsumexp of the word scores, with a per-cluster max.
        cow = ops.convert_to_tensor(self.cluster_of_word)
        zt = ops.transpose(z)  # [V, N]
        peak = segment_max(zt, cow, self.num_clusters)  # [C, N]
        peak_w = ops.take(peak, cow, axis=0)  # [V, N]
        total = segment_sum(ops.exp(zt - peak_w), cow, self.num_clusters)
        lse_w = ops.take(ops.log(total) + peak, cow, axis=0)  # [V, N]
        word_lp = ops.transpose(zt - lse_w)  # [N, V]
        log_p = word_lp + ops.take(class_lp, cow, axis=1)
        return ops.reshape(log_p, tuple(lead) + (self.vocab_size,))

    # ------------------------------------------------------- cheap likelihood
    def log_likelihood(self, inputs, targets):
        """Exact `log p(targets | inputs)` in `O((C + M) d)` per token.

        Args:
            inputs: context vectors `[..., d]`.
            targets: int word ids `[...]` in `[0, V)`.

        Returns:
            float32 tensor of shape `targets.shape`. Out-of-range ids raise
            a `ValueError` eagerly (`InvalidArgumentError` from a TensorFlow
            graph) and give NaN under XLA / `jax.jit` / `torch.compile`
            (`validation.check_targets`).
        """
        inputs = self._check_inputs(inputs)
        targets = check_targets(targets, self.vocab_size)
        out_shape = ops.shape(targets)
        d = self.input_dim
        h = ops.reshape(inputs, (-1, d))
        t = ops.clip(ops.reshape(targets, (-1,)), 0, self.vocab_size - 1)
        cluster = ops.take(ops.convert_to_tensor(self.cluster_of_word), t)  # [N]
        class_lp = self.cluster_log_probs(h)  # [N, C]
        ll_class = ops.squeeze(
            ops.take_along_axis(class_lp, ops.expand_dims(cluster, -1), axis=-1), -1
        )
        position = ops.take(ops.convert_to_tensor(self.position_in_cluster), t)
        if self.uses_static_shapes:
            # On JAX with the word matrix sharded on V by a
            # `keras.distribution`: each device scores its own rows.
            layout = vocab_parallel_layout(self.output_embeddings(), True)
            within = static_within_cluster
            if layout is not None:
                within = functools.partial(vocab_parallel_within_cluster, layout=layout)
            ll_word = within(
                h,
                self.output_embeddings(),
                self.bias,
                cluster,
                position,
                ops.convert_to_tensor(self.cluster_words),
                ops.convert_to_tensor(self.cluster_sizes),
                self.tile_size,
                self.compute_dtype,
                self.accumulation_dtype,
            )
        else:
            ll_word = dynamic_within_cluster(
                ops.cast(h, self.compute_dtype),
                ops.cast(self.output_embeddings(), self.compute_dtype),
                None if self.bias is None else ops.cast(self.bias, self.accumulation_dtype),
                self._dynamic_plan(cluster, position),
                self.accumulation_dtype,
            )
        ll = ops.reshape(ll_class + ll_word, out_shape)
        return nan_if_invalid(ll, targets, self.vocab_size)

    @property
    def uses_static_shapes(self):
        """Whether `log_likelihood` traced now builds the static tiles:
        `static_shapes`, or with None, unless inside `compiled_with(False)`
        on TensorFlow."""
        if self.static_shapes is not None:
            return self.static_shapes
        return not self._graph_without_xla

    @contextlib.contextmanager
    def compiled_with(self, jit_compile):
        """A context in which the step being traced is compiled with XLA
        (`jit_compile` true) or not.

        With `static_shapes=None`, a TensorFlow step compiled without XLA
        builds only the tiles a batch uses (`static_shapes=False`'s path,
        the same values). `HeadModel` enters it around each step it traces,
        with its `jit_compile`. The config is not changed: a saved model
        loads as it was built, on any backend.
        """
        previous = self._graph_without_xla
        self._graph_without_xla = keras.backend.backend() == "tensorflow" and not jit_compile
        try:
            yield
        finally:
            self._graph_without_xla = previous

    def _dynamic_plan(self, cluster, position):
        """`hierarchical_kernels.dynamic_plan` on this layer's layout, for
        targets of clusters `cluster` and positions `position` (int32 `[N]`)."""
        return dynamic_plan(
            cluster,
            position,
            ops.convert_to_tensor(self.cluster_words),
            ops.convert_to_tensor(self.cluster_sizes),
            self.num_clusters,
        )

    def likelihood_cost(self, num_tokens):
        """Static sizes of one `log_likelihood` call on `num_tokens` tokens.

        Args:
            num_tokens: int `N`.

        Returns:
            dict: `tiles` (`K`), `gathered_rows` (`K * M` rows of the
            `[V, d]` word embeddings gathered; their gradient has as many),
            `word_scores` (`K * tile_size * M`) and `cluster_scores`
            (`N * C`). A dense softmax computes `N * V` scores.
        """
        n = check_int("num_tokens", num_tokens, 0)
        tile, width, num_clusters = self.tile_size, self.max_cluster_size, self.num_clusters
        tiles = num_static_tiles(n, tile, num_clusters)
        return {
            "tiles": tiles,
            "gathered_rows": tiles * width,
            "word_scores": tiles * tile * width,
            "cluster_scores": n * num_clusters,
        }

    # ------------------------------------------------------------ serialising
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_clusters": self.num_clusters,
                # The final layout rebuilds everything `counts` was used
                # for. None only while a legacy (0.1.0) layout is pending.
                "clusters": (
                    None
                    if self._pending_structure is not None
                    else self.cluster_assignment.to_config()
                ),
                "counts": None,
                "clustering": self.clustering,
                "cluster_size_cap": self.cluster_size_cap,
                "max_cluster_size": self.max_cluster_size,
                "tile_size": self.tile_size,
                "static_shapes": self.static_shapes,
                "seed": self.seed,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        # 0.1.0 wrote both keys as None; the current `get_config` never does
        # (except for a layer still pending).
        legacy = all(
            key in config and config[key] is None for key in ("clusters", "counts")
        )
        if legacy:
            # keras-softmax-heads 0.1.0 kept the layout in the weights only:
            # a placeholder of the saved shape, pending until they are loaded.
            vocab = config_vocab_size(config)
            num_clusters = config.get("num_clusters")
            if vocab is not None and num_clusters is not None:
                config["clusters"] = placeholder_layout(vocab, num_clusters)
        layer = super().from_config(config)
        if legacy:
            layer._pending_structure = "clusters"
        return layer

