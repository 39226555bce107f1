"""keras-softmax-heads: output heads for large-vocabulary Keras models.

Every head maps context vectors `h` `[..., d]` to exact normalised
log-probabilities `[..., V]`; see `docs/head_contract.md`. Train a head as
the last layer of a Keras model with `HeadLoss(head)` (its own objective:
sampled, NCE, self-normalised, hierarchical, chunked), or compose a backbone
and a head in `HeadModel`.

Modules: `heads` (the heads, one per module, and the head registry),
`losses` (`HeadLoss`, `LinearCrossEntropy`, `linear_cross_entropy`),
`fused` (the fused linear + cross-entropy, per-token statistics and
distillation divergences without the logits, the keras-hub integrations), `metrics` (`Perplexity`, `HeadMetric`), `head_model`,
`functional` (log-space output functions, PLIF kernels), `chunked`,
`samplers`, `clustering`, `diagnostics` (the papers' NumPy diagnostics),
`models` (backbones), `data` (corpora, `tf.data`), `training`
(`train_and_evaluate`), `experiments`. Layering: `docs/architecture.md`.
"""

from keras_softmax_heads import clustering
from keras_softmax_heads import diagnostics
from keras_softmax_heads import functional
from keras_softmax_heads import fused
from keras_softmax_heads import losses
from keras_softmax_heads import metrics
from keras_softmax_heads.cloning import clone_function_keeping_ties
from keras_softmax_heads.clustering import ClusterAssignment
from keras_softmax_heads.clustering import make_clusters
from keras_softmax_heads.head_model import HeadModel
from keras_softmax_heads.heads.adaptive_embedding import AdaptiveEmbedding
from keras_softmax_heads.heads.adaptive_softmax import AdaptiveSoftmax
from keras_softmax_heads.heads.differentiated_softmax import DifferentiatedSoftmax
from keras_softmax_heads.heads.full_softmax import FullSoftmax
from keras_softmax_heads.heads.hierarchical_softmax import HierarchicalSoftmax
from keras_softmax_heads.heads.mixture_of_contexts import MixtureOfContexts
from keras_softmax_heads.heads.mixture_of_softmaxes import MixtureOfSoftmaxes
from keras_softmax_heads.heads.monotonic_softmax import MonotonicSoftmax
from keras_softmax_heads.heads.nce import NCE
from keras_softmax_heads.heads.plif_softmax import PLIFSoftmax
from keras_softmax_heads.heads.pointwise_softmax_head import PointwiseSoftmaxHead
from keras_softmax_heads.heads.registry import available_heads
from keras_softmax_heads.heads.registry import make_head
from keras_softmax_heads.heads.sampled_softmax import SampledSoftmax
from keras_softmax_heads.heads.self_normalized_softmax import SelfNormalizedSoftmax
from keras_softmax_heads.heads.sig_softmax import SigSoftmax
from keras_softmax_heads.heads.softmax_head import SoftmaxHead
from keras_softmax_heads.heads.word_major_softmax_head import WordMajorSoftmaxHead
from keras_softmax_heads.fused import LinearCrossEntropy
from keras_softmax_heads.fused import linear_cross_entropy
from keras_softmax_heads.fused import linear_divergence
from keras_softmax_heads.fused import linear_token_scores
from keras_softmax_heads.losses import HeadLoss
from keras_softmax_heads.metrics import HeadMetric
from keras_softmax_heads.metrics import Perplexity
from keras_softmax_heads.models.lstm_lm import LSTMLanguageModel
from keras_softmax_heads.models.ngram_lm import NgramLanguageModel
from keras_softmax_heads.version import VERSION as __version__

__all__ = [
    "clustering",
    "diagnostics",
    "functional",
    "fused",
    "losses",
    "metrics",
    "AdaptiveEmbedding",
    "AdaptiveSoftmax",
    "ClusterAssignment",
    "DifferentiatedSoftmax",
    "FullSoftmax",
    "HeadLoss",
    "HeadMetric",
    "HeadModel",
    "HierarchicalSoftmax",
    "LSTMLanguageModel",
    "LinearCrossEntropy",
    "MixtureOfContexts",
    "MixtureOfSoftmaxes",
    "MonotonicSoftmax",
    "NCE",
    "NgramLanguageModel",
    "PLIFSoftmax",
    "Perplexity",
    "PointwiseSoftmaxHead",
    "SampledSoftmax",
    "SelfNormalizedSoftmax",
    "SigSoftmax",
    "SoftmaxHead",
    "WordMajorSoftmaxHead",
    "available_heads",
    "clone_function_keeping_ties",
    "linear_cross_entropy",
    "linear_divergence",
    "linear_token_scores",
    "make_clusters",
    "make_head",
]
