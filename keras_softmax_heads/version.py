"""The package version: `VERSION` (`keras_softmax_heads.__version__`), also
saved with every training run's settings (`training.read_saved_settings`
reads old settings by it)."""

VERSION = "0.4.0.dev0"
