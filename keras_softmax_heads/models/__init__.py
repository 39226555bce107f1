"""Language-model backbones (tokens -> context vectors `h`) and registries.

* `LSTMLanguageModel`: Zaremba et al. (2014) LSTM LM with carried state.
* `NgramLanguageModel`: Chen et al. (2016) feed-forward n-gram NNLM.
* `make_head(name, vocab_size, ...)`, `available_heads()`: head registry.

Combine a backbone with a head in `keras_softmax_heads.HeadModel`.
"""

from keras_softmax_heads.models.lstm_lm import LSTMLanguageModel
from keras_softmax_heads.models.ngram_lm import NgramLanguageModel
from keras_softmax_heads.models.registry import (
    HEAD_ALIASES,
    HEADS,
    MODELS,
    available_heads,
    canonical_head_name,
    get_head_class,
    get_model_class,
    make_head,
    parse_options,
    supports_tying,
)

__all__ = [
    "HEADS",
    "HEAD_ALIASES",
    "MODELS",
    "LSTMLanguageModel",
    "NgramLanguageModel",
    "available_heads",
    "canonical_head_name",
    "get_head_class",
    "get_model_class",
    "make_head",
    "parse_options",
    "supports_tying",
]
