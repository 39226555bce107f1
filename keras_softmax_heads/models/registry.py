"""The backbone registry: model names -> backbone classes (imported lazily)."""

import importlib

#: Model name -> (module, class name).
MODELS = {
    "lstm": ("keras_softmax_heads.models.lstm_lm", "LSTMLanguageModel"),
    "ngram": ("keras_softmax_heads.models.ngram_lm", "NgramLanguageModel"),
}



def get_model_class(name):
    """The backbone class registered as `name` (`"lstm"`, `"ngram"`)."""
    key = str(name).lower()
    if key not in MODELS:
        raise ValueError(
            f"Unknown model. Expected one of {sorted(MODELS)}. Received: model={name!r}"
        )
    module_name, class_name = MODELS[key]
    return getattr(importlib.import_module(module_name), class_name)
