"""Output heads. Import them from `keras_softmax_heads` directly."""
