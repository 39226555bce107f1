"""The backbone registry: model names -> backbone classes (imported lazily)."""

import ast
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


def parse_options(text):
    """Parses `"a=1,b=2.5,c=frequency,d=[1,2]"` into a dict.

    Values are Python literals where they parse (`ast.literal_eval`), else
    strings. Commas inside brackets or quotes do not split.

    Example:

    >>> parse_options("num_knots=1000,clustering=frequency,sizes=[1, 2]")
    {'num_knots': 1000, 'clustering': 'frequency', 'sizes': [1, 2]}
    """
    if text is None:
        return {}
    if isinstance(text, dict):
        return dict(text)
    parts, depth, quote, current = [], 0, None, []
    for ch in str(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    options = {}
    for part in parts:
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(
                "Options must be written key=value, separated by commas. "
                f"Received: {part!r} in {text!r}"
            )
        key, value = part.split("=", 1)
        key, value = key.strip(), value.strip()
        if not key.isidentifier():
            raise ValueError(f"Bad option name {key!r} in {text!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options
