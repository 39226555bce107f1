"""Language-model backbones: tokens -> context vectors `h`.

* `LSTMLanguageModel`: Zaremba et al. (2014) LSTM LM with carried state.
* `NgramLanguageModel`: Chen et al. (2016) feed-forward n-gram NNLM.
* `MODELS`, `get_model_class(name)`: the backbone registry.
* `Backbone`: their base (the tieable input embedding, its config, the
  carried-state interface).

Backbones know nothing of heads; combine one with a head in
`keras_softmax_heads.HeadModel`. The head registry is
`keras_softmax_heads.heads.registry`.
"""

from keras_softmax_heads.models.backbone import Backbone
from keras_softmax_heads.models.lstm_lm import LSTMLanguageModel
from keras_softmax_heads.models.ngram_lm import NgramLanguageModel
from keras_softmax_heads.models.registry import MODELS
from keras_softmax_heads.models.registry import get_model_class

__all__ = [
    "MODELS",
    "Backbone",
    "LSTMLanguageModel",
    "NgramLanguageModel",
    "get_model_class",
]
