"""absl flags generated from `TrainConfig`: one flag per field, plus `--preset`.

`define_flags()` reads each field's name, type, default and metadata
(`help`, `choices`, `zero_is_none`) and defines a flag that parses:

* `int` / `float` / `str`: the value (`str` with `choices`: one of them);
* `bool`: `--name` / `--noname` / `--name=true|false`;
* `X | None`: as `X`, or `none` (any case) for `None`; with
  `zero_is_none`, `0` also means `None` (`--clip_norm=0`: no clipping);
* `bool | None` (`tie_embeddings`, `unroll`): `true`, `false`, `auto` or
  `none` (both `None`: decided automatically); `bool | str` with choices
  (`jit_compile`): `true`, `false`, `auto`;
* `dict` (`head_options`, `dataset_options`): `k=v,k2=v2` (`parse_options`);
* `tuple[float, ...]` (`band_fractions`): comma-separated floats.

`config_from_flags()` builds the config: defaults < preset < the flags
given on the command line (a flag left out never overwrites a preset).

Example:

>>> from absl import flags
>>> flag_values = flags.FlagValues()
>>> define_flags(flag_values)
>>> _ = flag_values(["prog", "--preset=zaremba_small", "--epochs=2",
...                  "--head_options=static_shapes=false", "--clip_norm=0"])
>>> config = config_from_flags(flag_values)
>>> config.epochs, config.hidden_size, config.head_options, config.clip_norm
(2, 200, {'static_shapes': False}, None)
"""

from __future__ import annotations

import dataclasses
import types
import typing

from absl import flags as absl_flags

from keras_softmax_heads.training.config import PRESETS
from keras_softmax_heads.training.config import TrainConfig
from keras_softmax_heads.training.config import get_config
from keras_softmax_heads.training.config import parse_options

# Flags defined by `define_flags` belong to its caller (e.g. the script's
# `__main__`, so that `--help` lists them), not to this module.
absl_flags.disclaim_key_flags()

_TRUE_FALSE = {"true": True, "false": False}


class _NoneOr(absl_flags.ArgumentParser):
    """`none` (any case) -> `None`, else `inner`'s value (`0` -> `None`
    with `zero_is_none`)."""

    def __init__(self, inner, zero_is_none=False):
        super().__init__()
        self.inner = inner
        self.zero_is_none = zero_is_none
        self.syntactic_help = f"{inner.syntactic_help or 'a string'} or " + (
            "0 or none for none" if zero_is_none else "none")

    def parse(self, argument):
        if argument is None or (isinstance(argument, str) and argument.strip().lower() == "none"):
            return None
        value = self.inner.parse(argument)
        if self.zero_is_none and value == 0:
            return None
        return value

    def flag_type(self):
        return self.inner.flag_type()


class _WordsParser(absl_flags.ArgumentParser):
    """One of a few words (any case), each standing for a value."""

    def __init__(self, words):
        super().__init__()
        self.words = dict(words)
        self.syntactic_help = "one of " + "|".join(self.words)

    def parse(self, argument):
        if isinstance(argument, str):
            key = argument.strip().lower()
            if key in self.words:
                return self.words[key]
        elif any(argument is v or (argument == v and type(argument) is type(v))
                 for v in self.words.values()):
            return argument
        raise ValueError(f"value should be one of <{'|'.join(self.words)}>")

    def flag_type(self):
        return "string"


class _WordsSerializer(absl_flags.ArgumentSerializer):
    def __init__(self, words):
        self.words = dict(words)

    def serialize(self, value):
        for word, v in self.words.items():
            if v is value or (v == value and type(v) is type(value)):
                return word
        return str(value)


class _OptionsParser(absl_flags.ArgumentParser):
    """`k=v,k2=v2` -> dict (`parse_options`)."""

    syntactic_help = "comma-separated key=value pairs"

    def parse(self, argument):
        return parse_options(argument)

    def flag_type(self):
        return "options"


class _OptionsSerializer(absl_flags.ArgumentSerializer):
    def serialize(self, value):
        return ",".join(f"{k}={v!r}" for k, v in dict(value).items())


class _TupleParser(absl_flags.ArgumentParser):
    """Comma-separated values -> tuple, each parsed by `inner`."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.syntactic_help = f"comma-separated, each {inner.syntactic_help}"

    def parse(self, argument):
        if isinstance(argument, str):
            argument = [part for part in argument.split(",") if part.strip()]
        return tuple(self.inner.parse(part) for part in argument)

    def flag_type(self):
        return "tuple"


class _TupleSerializer(absl_flags.ArgumentSerializer):
    def serialize(self, value):
        return ",".join(str(v) for v in value)


def _scalar_parser(kind, choices):
    if kind is int:
        return absl_flags.IntegerParser()
    if kind is float:
        return absl_flags.FloatParser()
    if kind is str and choices:
        return absl_flags.EnumParser([c for c in choices if c is not None])
    if kind is str:
        return absl_flags.ArgumentParser()
    raise TypeError(f"No flag type for {kind!r}")


def _flag_spec(field, hint):
    """`(parser, serializer, help)` of the flag of a `TrainConfig` field."""
    choices = field.metadata.get("choices")
    help_text = field.metadata["help"]
    members = set(typing.get_args(hint)) if isinstance(hint, types.UnionType) else {hint}
    optional = type(None) in members
    members.discard(type(None))
    if members == {bool} and optional or members == {bool, str}:
        # bool | None: `auto` and `none` both mean "decide automatically".
        words = dict(_TRUE_FALSE, auto=None, none=None) if optional else {
            str(c).lower(): c for c in choices}
        return (_WordsParser(words), _WordsSerializer(words),
                f"<{'|'.join(words)}>: {help_text}")
    (kind,) = members
    if kind is dict:
        return _OptionsParser(), _OptionsSerializer(), help_text
    if typing.get_origin(kind) is tuple:
        inner = _scalar_parser(typing.get_args(kind)[0], None)
        return _TupleParser(inner), _TupleSerializer(), help_text
    parser = _scalar_parser(kind, choices)
    if choices:
        names = [c for c in choices if c is not None] + (["none"] if optional else [])
        help_text = f"<{'|'.join(names)}>: {help_text}"
    if optional:
        parser = _NoneOr(parser, zero_is_none=field.metadata.get("zero_is_none", False))
    return parser, absl_flags.ArgumentSerializer(), help_text


def _default(field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def define_flags(flag_values=absl_flags.FLAGS):
    """Defines `--preset` and one flag per `TrainConfig` field in
    `flag_values` (by default absl's global `FLAGS`), with the field's
    default, help and choices."""
    absl_flags.DEFINE_enum("preset", None, sorted(PRESETS),
                           "Hyper-parameter preset; explicit flags override it.",
                           flag_values=flag_values)
    hints = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        hint = hints[field.name]
        default = _default(field)
        if hint is bool:
            absl_flags.DEFINE_boolean(field.name, default, field.metadata["help"],
                                      flag_values=flag_values)
            continue
        parser, serializer, help_text = _flag_spec(field, hint)
        absl_flags.DEFINE(parser, field.name, default, help_text, flag_values=flag_values,
                          serializer=serializer)


def config_from_flags(flag_values=absl_flags.FLAGS):
    """The `TrainConfig` of the parsed command line: the defaults, then
    `--preset`, then the field flags given explicitly."""
    overrides = {
        field.name: flag_values[field.name].value
        for field in dataclasses.fields(TrainConfig)
        if flag_values[field.name].present
    }
    return get_config(flag_values["preset"].value, **overrides)
