"""keras-softmax-heads: output heads for large-vocabulary Keras models.

Every head maps context vectors `h` `[..., d]` to exact normalised
log-probabilities `[..., V]`; see `docs/head_contract.md`.
"""

from keras_softmax_heads import clustering
from keras_softmax_heads import diagnostics
from keras_softmax_heads import functional
from keras_softmax_heads import losses
from keras_softmax_heads import metrics
from keras_softmax_heads.clustering import ClusterAssignment
from keras_softmax_heads.clustering import make_clusters
from keras_softmax_heads.head_model import HeadModel
from keras_softmax_heads.heads.base import PointwiseSoftmaxHead
from keras_softmax_heads.heads.base import SoftmaxHead
from keras_softmax_heads.heads.differentiated import DifferentiatedSoftmax
from keras_softmax_heads.heads.full_softmax import FullSoftmax
from keras_softmax_heads.heads.hierarchical import HierarchicalSoftmax
from keras_softmax_heads.heads.mixture import MixtureOfContexts
from keras_softmax_heads.heads.mixture import MixtureOfSoftmaxes
from keras_softmax_heads.heads.monotonic import MonotonicSoftmax
from keras_softmax_heads.heads.nce import NCE
from keras_softmax_heads.heads.plif import PLIFSoftmax
from keras_softmax_heads.heads.registry import available_heads
from keras_softmax_heads.heads.registry import make_head
from keras_softmax_heads.heads.sampled import SampledSoftmax
from keras_softmax_heads.heads.self_normalized import SelfNormalizedSoftmax
from keras_softmax_heads.heads.sigsoftmax import SigSoftmax
from keras_softmax_heads.heads.word_major_softmax_head import WordMajorSoftmaxHead
from keras_softmax_heads.losses import HeadLoss
from keras_softmax_heads.metrics import Perplexity
from keras_softmax_heads.models.lstm_lm import LSTMLanguageModel
from keras_softmax_heads.models.ngram_lm import NgramLanguageModel

__version__ = "0.1.0"
