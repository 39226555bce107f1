"""Runs every docstring example of the package (they must stay runnable)."""

import doctest
import importlib
import pkgutil

import pytest

import keras_softmax_heads

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(
        keras_softmax_heads.__path__, prefix="keras_softmax_heads."
    )
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
