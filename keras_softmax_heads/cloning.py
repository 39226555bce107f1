"""`clone_function_keeping_ties`: `keras.models.clone_model` of a model whose
head is tied to its input embedding, the tie kept."""

import keras

#: The constructor arguments through which a head ties to an input layer.
TIE_ARGUMENTS = ("token_embedding", "adaptive_embedding")


def clone_function_keeping_ties(clone_function=None):
    """A `clone_function` for `keras.models.clone_model` that keeps ties.

    `keras.models.clone_model` rebuilds each layer from its config. A head
    tied to an embedding (`token_embedding=`, or `AdaptiveSoftmax`'s
    `adaptive_embedding=`) carries that embedding's config, so by default
    the clone's head gets an embedding of its own: one weight more than the
    original, and `clone.set_weights(model.get_weights())` fails. The
    function returned clones each layer with `clone_function` (default:
    `layer.__class__.from_config(layer.get_config())`, Keras' own) and
    hands a tied head the clone of its embedding, which Keras clones first
    (it comes before the head in the model). A head whose embedding is not
    a layer of the model keeps Keras' behaviour (an embedding of its own).

    Make one per `clone_model` call: it remembers the layers it cloned.
    (`HeadModel` needs none: its `from_config` re-ties the head.)

    Args:
        clone_function: optional `layer -> new layer`, as
            `keras.models.clone_model`'s, applied to every layer but a tied
            head (which is rebuilt from its config with its embedding's
            clone).

    Returns:
        A function `layer -> new layer`.

    Example:

    >>> import numpy as np, keras, keras_softmax_heads as ksh
    >>> emb = keras.layers.Embedding(20, 8)
    >>> model = keras.Sequential([keras.Input((5,), dtype="int32"), emb,
    ...                           ksh.FullSoftmax(token_embedding=emb)])
    >>> clone = keras.models.clone_model(
    ...     model, clone_function=ksh.clone_function_keeping_ties())
    >>> clone.layers[-1].token_embedding is clone.layers[0]
    True
    >>> clone.set_weights(model.get_weights())
    >>> x = np.random.randint(0, 20, (2, 5))
    >>> bool(np.allclose(clone(x), model(x)))
    True
    """
    clones = {}

    def clone(layer):
        tied = {name: getattr(layer, name) for name in TIE_ARGUMENTS
                if isinstance(getattr(layer, name, None), keras.layers.Layer)
                and id(getattr(layer, name)) in clones}
        if tied:
            config = layer.get_config()
            config.update({name: clones[id(embedding)] for name, embedding in tied.items()})
            new = layer.__class__.from_config(config)
        elif clone_function is not None:
            new = clone_function(layer)
        else:
            new = layer.__class__.from_config(layer.get_config())
        clones[id(layer)] = new
        return new

    return clone
