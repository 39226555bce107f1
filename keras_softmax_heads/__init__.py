"""keras-softmax-heads: output heads for large-vocabulary Keras models.

Every head maps context vectors `h` `[..., d]` to exact normalised
log-probabilities `[..., V]`; see `docs/head_contract.md`.
"""

from keras_softmax_heads.head_model import HeadModel
from keras_softmax_heads.heads.base import PointwiseSoftmaxHead
from keras_softmax_heads.heads.base import SoftmaxHead
from keras_softmax_heads.heads.full_softmax import FullSoftmax

__version__ = "0.1.0"
