"""The head registry: head names -> head classes, and `make_head`.

Heads are imported lazily, so that the training script works with whichever
heads the installed version provides: `available_heads()` lists them.
`make_head` passes every head what it accepts: `counts` (the training word
counts, for frequency-based heads), `token_embedding` (weight tying),
`chunk_size` (chunked exact losses), initialisers, plus the head options.
"""

import importlib
import inspect

import keras

#: Head name -> (module, class name). Aliases are listed in `HEAD_ALIASES`.
HEADS = {
    "full_softmax": ("keras_softmax_heads.heads.full_softmax", "FullSoftmax"),
    "sigsoftmax": ("keras_softmax_heads.heads.sig_softmax", "SigSoftmax"),
    "monotonic": ("keras_softmax_heads.heads.monotonic_softmax", "MonotonicSoftmax"),
    "plif": ("keras_softmax_heads.heads.plif_softmax", "PLIFSoftmax"),
    "mixture_of_softmaxes": ("keras_softmax_heads.heads.mixture_of_softmaxes", "MixtureOfSoftmaxes"),
    "mixture_of_contexts": ("keras_softmax_heads.heads.mixture_of_contexts", "MixtureOfContexts"),
    "sampled_softmax": ("keras_softmax_heads.heads.sampled_softmax", "SampledSoftmax"),
    "nce": ("keras_softmax_heads.heads.nce", "NCE"),
    "self_normalized": ("keras_softmax_heads.heads.self_normalized_softmax", "SelfNormalizedSoftmax"),
    "hierarchical": ("keras_softmax_heads.heads.hierarchical_softmax", "HierarchicalSoftmax"),
    "differentiated": ("keras_softmax_heads.heads.differentiated_softmax", "DifferentiatedSoftmax"),
    "adaptive": ("keras_softmax_heads.heads.adaptive_softmax", "AdaptiveSoftmax"),
}

HEAD_ALIASES = {
    "softmax": "full_softmax",
    "full": "full_softmax",
    "linear_softmax": "full_softmax",
    "mos": "mixture_of_softmaxes",
    "moc": "mixture_of_contexts",
    "sampled": "sampled_softmax",
    "target_sampling": "sampled_softmax",
    "weaknorm": "self_normalized",
    "hsm": "hierarchical",
    "d_softmax": "differentiated",
    "dsoftmax": "differentiated",
    "adaptive_softmax": "adaptive",
}

#: Heads whose constructor takes `token_embedding` but that cannot be tied
#: (D-Softmax, adaptive softmax: each frequency band has its own embedding
#: size; the adaptive softmax ties to an `AdaptiveEmbedding` instead).
NO_TYING = {"differentiated", "adaptive"}


def canonical_head_name(name):
    """`name` with aliases resolved; raises `ValueError` for unknown names."""
    key = str(name).lower().replace("-", "_")
    key = HEAD_ALIASES.get(key, key)
    if key not in HEADS:
        raise ValueError(
            f"Unknown head. Expected one of {sorted(HEADS)} (or an alias in "
            f"{sorted(HEAD_ALIASES)}). Received: head={name!r}"
        )
    return key


def get_head_class(name):
    """The head class registered as `name` (imported on first use).

    Raises:
        ValueError: unknown name, or the head's module/class is not part of
            this installation (yet).
    """
    key = canonical_head_name(name)
    module_name, class_name = HEADS[key]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise ValueError(
            f"Head {key!r} is not available in this installation (module "
            f"{module_name} not found). Available heads: {available_heads()}"
        ) from None
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ValueError(
            f"Head {key!r} is not available: {module_name} has no {class_name}. "
            f"Available heads: {available_heads()}"
        ) from None


def available_heads():
    """Sorted names of the registered heads that can be imported."""
    names = []
    for key, (module_name, class_name) in HEADS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        if hasattr(module, class_name):
            names.append(key)
    return sorted(names)


def head_parameters(name):
    """Names of the constructor arguments of head `name`."""
    cls = get_head_class(name)
    params = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        sig = inspect.signature(klass.__init__)
        params |= {
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name != "self"
        }
        if not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
            break
    return params


def make_head(
    name,
    vocab_size,
    *,
    counts=None,
    token_embedding=None,
    chunk_size=None,
    init_scale=None,
    **options,
):
    """Builds head `name` for a vocabulary of `vocab_size` words.

    Args:
        name: a key of `HEADS` or an alias.
        vocab_size: int `V`.
        counts: optional `[V]` training counts; given to heads that take
            `counts` (hierarchical clustering, differentiated bands, unigram
            samplers) unless `options` sets it.
        token_embedding: optional `keras.layers.Embedding` to tie the output
            projection to. Raises `ValueError` if the head cannot be tied.
        chunk_size: optional int, given to heads that accept `chunk_size`
            (chunked exact losses); ignored by the others.
        init_scale: optional float `s`: `U(-s, s)` kernel and bias
            initialisers, for heads that accept them (Zaremba et al.); a
            head with a named bias start (`named_bias_initializers`: NCE,
            `SelfNormalizedSoftmax`, the mixtures) keeps its default bias
            start.
        **options: further constructor arguments of the head (e.g.
            `num_knots=1000`, `num_components=3`).

    Returns:
        The head layer.

    Example:

    >>> head = make_head("full_softmax", 100)
    >>> head.__class__.__name__, head.vocab_size
    ('FullSoftmax', 100)
    """
    cls = get_head_class(name)
    params = head_parameters(name)
    kwargs = dict(options)
    unknown = sorted(k for k in kwargs if k not in params)
    if unknown:
        raise ValueError(
            f"Head {canonical_head_name(name)!r} ({cls.__name__}) does not take "
            f"{unknown}. Its options are: {sorted(params)}"
        )
    if counts is not None and "counts" in params:
        kwargs.setdefault("counts", counts)
    if token_embedding is not None:
        if "token_embedding" not in params:
            raise ValueError(
                f"Head {canonical_head_name(name)!r} ({cls.__name__}) cannot tie "
                "its output projection to the input embedding. Received: "
                "token_embedding (use tie_embeddings=False)"
            )
        kwargs["token_embedding"] = token_embedding
    if chunk_size is not None and "chunk_size" in params:
        kwargs.setdefault("chunk_size", chunk_size)
    if init_scale is not None:
        for arg in ("kernel_initializer", "bias_initializer"):
            # A head whose bias starts from its structure (NCE's "noise",
            # the self-normalised "normalized") keeps that start.
            if arg == "bias_initializer" and getattr(cls, "named_bias_initializers", ()):
                continue
            if arg in params:
                kwargs.setdefault(
                    arg, keras.initializers.RandomUniform(-init_scale, init_scale)
                )
    return cls(vocab_size=vocab_size, **kwargs)


def supports_tying(name):
    """Whether head `name` can tie its output projection to an embedding."""
    key = canonical_head_name(name)
    return key not in NO_TYING and "token_embedding" in head_parameters(key)
