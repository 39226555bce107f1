"""The summed mixture-of-softmaxes NLL over token chunks, its gradient taken
in the forward pass: `sum_i w_i (-log p_i)` of a mixture head.

`chunked_mixture_nll` folds the `K` components into `N * K` rows of the
tiled pass, whose backward pass recomputes every score: four `N K d V`
products where the dense mixture does three. In training the loss is summed
with known weights (`HeadModel`'s token mean, `HeadLoss`'s reductions), so
every token's cotangent is the one upstream scalar times its weight, and the
gradient can be finished in the forward pass, as
`chunked.summed_cross_entropy` does for one softmax: `token_chunk_size`
tokens at a time, the chunk's `[size * K, V]` component scores over the
whole vocabulary, per component the log-sum-exp and the target's score, the
mixture's log-likelihood and its posterior responsibilities
`r_k = softmax_k(log pi_k + log p_k(t))`, and from them the component
score gradients `w r_k (p_k - onehot_t)` (times `ds/dz` when the
components normalise `log g(z)`, not `z`: MoSS, and `SigSoftmax` as a
mixture of one component), the chunk's rows of the latents' gradient, its term
of the kernel's (one vocabulary tile at a time on a CPU) and the bias's,
and the priors' gradient `-w r`. With PLIF (`raw_slopes`: MoS+PLIF, and
`PLIFSoftmax` as a mixture of one component) the components normalise
`g(f(z))`, `f` the PLIF: the score gradient is taken through `f`'s slope,
and the slopes' two histograms are summed chunk by chunk
(`functional.plif_slope_histograms`). Three products, as dense; the backward
pass only scales the stored gradients by the upstream scalar.

The same arithmetic runs on one device's shard of the vocabulary (`shards`,
as in `chunked.summed_cross_entropy`; `chunked.vocab_parallel.
vocab_parallel_mixture` runs it inside `jax.shard_map`): each component's
log-sum-exp and target score are combined across the shards, so the
likelihoods and responsibilities are the whole vocabulary's, and each device
computes its columns' score gradients, its kernel / bias shard's gradient,
its partial `d latents` and its partial slope histograms.

The price: a call whose gradient is not taken still computes it, and a
float32 `[L, V]` kernel-gradient buffer. Design and measurements:
`docs/mixtures.md`, "The gradient in the forward pass".
"""

from keras import ops

from keras_softmax_heads import functional
from keras_softmax_heads.chunked import dispatch
from keras_softmax_heads.chunked.core import accumulation_dtype
from keras_softmax_heads.chunked.core import tile_loop
from keras_softmax_heads.chunked.divergence import OutputLayer
from keras_softmax_heads.chunked.divergence import upstream_of
from keras_softmax_heads.chunked.losses import as_tensor
from keras_softmax_heads.chunked.summed_divergence import Side
from keras_softmax_heads.chunked.summed_divergence import TokenChunks
from keras_softmax_heads.chunked.summed_divergence import float_weights
from keras_softmax_heads.chunked.summed_divergence import local_to_shard
from keras_softmax_heads.chunked.summed_divergence import normaliser_and_exponentials
from keras_softmax_heads.chunked.summed_divergence import padded
from keras_softmax_heads.chunked.summed_divergence import target_scores
from keras_softmax_heads.chunked.summed_divergence import unpadded
from keras_softmax_heads.chunked.summed_divergence import unpadded_rows
from keras_softmax_heads.chunked.tiling import kernel_geometry
from keras_softmax_heads.validation import check_choice


#: The component output functions `summed_mixture_nll` differentiates in
#: the forward pass: `g` of `log_softmax(log g(z))`, as in `SigSoftmax`.
OUTPUT_FUNCTIONS = ("softmax", "sigsoftmax", "sigmoid", "relu")


def component_scores(z, output_fn="softmax", epsilon=1e-6):
    """`(s, ds/dz)` of linear scores `z`, `s = log g(z)`: `z` and 1
    (softmax components, `ds/dz` None), `z - softplus(-z)` and
    `1 + sigmoid(-z)` (sigsoftmax), `-softplus(-z)` and `sigmoid(-z)`
    (sigmoid), `log(relu(z) + epsilon)` and `[z > 0] / (relu(z) + epsilon)`
    (ReLU)."""
    if output_fn == "softmax":
        return z, None
    if output_fn == "sigsoftmax":
        return dispatch.sigsoftmax_scores(z)
    if output_fn == "sigmoid":
        return functional.log_sigmoid_output_scores(z), ops.sigmoid(-z)
    g = ops.relu(z) + ops.cast(epsilon, z.dtype)  # "relu"
    return ops.log(g), ops.where(z > 0, 1.0 / g, ops.zeros_like(g))


def chunk_mixture(s, log_priors, targets, weights, num_components, shards=None):
    """`(nll, ds, dlog_priors)` of a chunk: `s` `[size * K, V]` component
    scores (rows token-major), `log_priors` `[size, K]`, `targets` and
    `weights` `[size]`. Per token `-log p(t)` `[size]`; the gradients of
    `sum_i w_i (-log p(t_i))` with respect to `s` and to the log-priors (a
    weight-0 token's, even with NaN responsibilities, are 0).

    With `shards` (see `summed_mixture_nll`) `s` is this device's columns
    and `targets` are shifted into them (negative: another shard's word);
    `nll` and the log-priors' gradient are the whole vocabulary's, `ds`
    this shard's columns."""
    rows = s.shape[0]
    size = rows // num_components
    row_targets = ops.repeat(targets, num_components)
    lse, e, total = normaliser_and_exponentials(s, shards)
    row_targets, target_score, inside = target_scores(s, row_targets, shards)
    joint = log_priors + ops.reshape(target_score - lse, (size, num_components))
    ll = ops.logsumexp(joint, axis=1)
    resp = ops.exp(joint - ll[:, None])  # posterior responsibilities [size, K]
    keep = (weights != 0)[:, None]
    scale = ops.where(keep, weights[:, None] * resp, ops.zeros_like(resp))
    row_scale = ops.reshape(scale, (rows,))
    # w r_k (p_k - onehot_t), p_k = e / total.
    ds = dispatch.scaled_minus_target(e, row_scale / total, row_targets,
                                      local_to_shard(row_scale, inside))
    return -ll, ds, -scale


def summed_mixture_nll(latents, log_priors, kernel, bias, targets, weights, *,
                       output_fn="softmax", epsilon=1e-6, raw_slopes=None,
                       knot_bound=None, kernel_transposed=False,
                       token_chunk_size=None, implementation="auto", shards=None,
                       return_per_token=False):
    """`sum_i w_i (-log p(t_i))` of a mixture of softmaxes, its gradient
    computed in the forward pass.

    The core behind the mixture heads' `summed_training_loss` with
    `gradient_in_forward=True` (which checks the arguments): `log p(t) =
    logsumexp_k(log pi_k + log_softmax(g(z_k))_t)`, `z_k = latent_k W + b`,
    `log g` the identity (`output_fn="softmax"`: MoS) or one of
    `SigSoftmax`'s output functions (`"sigsoftmax"`: MoSS; `"sigmoid"`,
    `"relu"` with `epsilon`; with `K = 1` the `SigSoftmax` head); with
    `raw_slopes` `[K']` and `knot_bound` `T` the scores pass through the
    PLIF `f` first (`functional.plif`), `log g(f(z_k))` (MoS+PLIF; with one
    component the `PLIFSoftmax` head). `latents`
    `[N, K, L]`, `log_priors` `[N, K]` (normalised), `kernel` `[L, V]`
    (`[V, L]` with `kernel_transposed`), `bias` `[V]` or None, `targets`
    `[N]` int ids in `[0, V)` (not checked), `weights` `[N]` (0: the token
    adds nothing, even a non-finite loss). At most `token_chunk_size`
    tokens a chunk (default: the platform's
    `summed_divergence.default_token_chunk(V) // K`, so a chunk holds as
    many scores as one softmax's). `implementation`: as in
    `chunked.chunked_pointwise_nll`.

    `shards` (None: one device) runs it on one device's columns of a
    vocabulary split over devices, inside a `jax.shard_map`, as
    `chunked.summed_cross_entropy`'s `shards` does: `kernel` and `bias`
    are this device's shard, `targets` are shifted into it (-1 for another
    shard's word), `shards.max` / `shards.sum` combine the per-component
    statistics. The sum is the whole vocabulary's; the gradients of the
    kernel and bias are this shard's, those of `latents` and `raw_slopes`
    its partial sums (scaled by `shards.sum` of the upstream cotangent, the
    slopes' gradient being linear in the histograms), those of `log_priors`
    and `weights` the whole vocabulary's, scaled by this device's share of
    the cotangent (`chunked.vocab_parallel.vocab_parallel_mixture`).

    `return_per_token=True` also returns the per-token NLLs `[N]` the pass
    computes (without a gradient of their own: the sum carries it), from
    which `chunked.vocab_parallel.token_losses` makes a per-token loss.

    Returns:
        The weighted sum, a float32 scalar (float64 for float64 inputs),
        with gradients for `latents`, `log_priors`, `kernel`, `bias`,
        `raw_slopes` and `weights`; with `return_per_token=True` the pair
        `(sum, per_token)`.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> rng = np.random.default_rng(0)
    >>> lat = rng.normal(size=(5, 3, 4)).astype("float32")
    >>> log_pi = ops.log_softmax(rng.normal(size=(5, 3)).astype("float32"))
    >>> w = rng.normal(size=(4, 20)).astype("float32")
    >>> t = np.array([0, 3, 19, 5, 5], "int32")
    >>> weights = np.array([1.0, 0.5, 0.0, 2.0, 1.0], "float32")
    >>> total = summed_mixture_nll(lat, log_pi, w, None, t, weights, token_chunk_size=2)
    >>> comp = ops.log_softmax(ops.einsum("nkd,dv->nkv", lat, w), axis=-1)
    >>> log_p = ops.convert_to_numpy(ops.logsumexp(log_pi[..., None] + comp, axis=1))
    >>> nll = -log_p[np.arange(5), t]
    >>> bool(np.isclose(float(total), (weights * nll).sum(), rtol=1e-5))
    True
    """
    output_fn = check_choice("output_fn", output_fn, OUTPUT_FUNCTIONS)
    latents = as_tensor(latents)
    _, num_components, latent_dim = latents.shape
    if num_components is None or latent_dim is None:
        raise ValueError(
            "`latents` needs static last two dimensions [K, L]. "
            f"Received: latents.shape={latents.shape}"
        )
    kernel = as_tensor(kernel)
    _, vocab = kernel_geometry(latents, kernel, kernel_transposed)
    chunks = TokenChunks.of(latents, vocab, token_chunk_size, components=num_components)
    n = chunks.n
    acc = accumulation_dtype(latents, kernel)
    has_bias = bias is not None
    rows = ops.reshape(latents, (-1, latent_dim))
    args = [rows, as_tensor(log_priors), kernel]
    if has_bias:
        args.append(as_tensor(bias))
    plif = PLIF.of(raw_slopes, knot_bound)
    if plif is not None:
        args.append(plif.raw)
    gradients = dispatch.gradients_needed(latents, kernel)
    k = num_components

    @ops.custom_gradient
    def summed_fn(targets, weights, *args):
        layer = OutputLayer(args[0], args[2], args[3] if has_bias else None,
                            kernel_transposed)
        side = Side(layer, acc, chunks.pad * k, chunks.kernel_tile, gradients)
        transform = plif.tables(args[-1], acc) if plif is not None else None
        lp_all = padded(ops.cast(args[1], acc), chunks.pad)
        t_all = padded(targets, chunks.pad)
        w_all = padded(ops.cast(weights, acc), chunks.pad)

        def score_gradient(x, lp, t, w):
            """`(nll, d x, d log-priors)` of the components' scores `x`
            (`[tokens K, V]`: `z`, or PLIF's `f(z)`) through the output
            function and the mixture."""
            s, ds_dx = component_scores(x, output_fn, epsilon)
            nll, ds, dlp_rows = chunk_mixture(s, lp, t, w, k, shards)
            return nll, (ds if ds_dx is None else dispatch.multiply(ds, ds_dx)), dlp_rows

        def plif_tile(sums, xs):
            """A row tile of the chunk through the PLIF: `xs` = the scores
            `[tokens, K, V]`, log-priors, targets and weights."""
            z, lp, t, w = xs
            f, slope, idx, offset = functional.plif_scores(transform, ops.reshape(z, (-1, vocab)))
            nll, d_f, dlp_rows = score_gradient(f, lp, t, w)
            if plif.gradient:
                tile_sums = functional.plif_slope_histograms(transform, idx, offset, d_f)
                sums = tuple(a + b for a, b in zip(sums, tile_sums))
            return sums, (nll, ops.reshape(dispatch.multiply(d_f, slope), (-1, k, vocab)),
                          dlp_rows)

        def body(i, state):
            total, per_token, dlp, grads, sums = state
            start = i * chunks.size
            h = side.rows(start * k, chunks.size * k)
            z, _ = side.scores(h, 1.0)
            t = ops.slice(t_all, [start], [chunks.size])
            w = ops.slice(w_all, [start], [chunks.size])
            lp = ops.slice(lp_all, [start, 0], [chunks.size, k])
            if transform is None:
                nll, dz, dlp_rows = score_gradient(z, lp, t, w)
            else:  # the per-score work in PLIF's tiles (a CPU's cache)
                sums, (nll, dz, dlp_rows) = functional.scan_row_tiles(
                    plif_tile, sums, (ops.reshape(z, (chunks.size, k, vocab)), lp, t, w),
                    (acc, acc, acc))
                dz = ops.reshape(dz, (-1, vocab))
            total = total + ops.sum(ops.where(w != 0, w * nll, ops.zeros_like(nll)))
            per_token = ops.slice_update(per_token, [start], nll)
            dlp = ops.slice_update(dlp, [start, 0], dlp_rows)
            grads = side.gradients(h, dz, grads, start * k)
            return total, per_token, dlp, grads, sums

        def forward():
            sums = (ops.zeros((), acc),) * 2
            if plif is not None and plif.gradient:
                sums = (ops.zeros((plif.num_knots,), acc),) * 2
            state = (ops.zeros((), acc), ops.zeros_like(w_all), ops.zeros_like(lp_all),
                     side.zeros(implementation), sums)
            # `chunks.count` is a tensor when `N` is known only when the step runs.
            total, per_token, dlp, grads, sums = tile_loop(chunks.count, body, state)
            return (total, unpadded(per_token, n), unpadded(dlp, n),
                    unpadded_rows(grads, n * k), sums)

        total, per_token, dlp, grads, sums = dispatch.run_pass(forward, implementation)

        def grad_fn(*args, upstream=None, variables=None):
            u = upstream_of(args, upstream, variables, "summed_mixture_nll")
            u = ops.cast(u[0] if return_per_token else u, acc)
            # Under `shards` each device receives its share of `u`: the
            # log-priors' and weights' gradients (the whole vocabulary's)
            # take that share, the partial sums (`h`, the slopes) and this
            # shard's kernel / bias the whole (`jax.shard_map` adds the
            # shares and the partial sums across the shards).
            whole = u if shards is None else shards.sum(u)
            layer_inputs = [inputs[0], *inputs[2:3 + has_bias]]
            dh, dkernel, *dbias = side.scaled(whole, grads, layer_inputs)
            out = [dh, ops.cast(u * dlp, inputs[1].dtype), dkernel, *dbias]
            if plif is not None:
                out.append(plif.raw_gradient(whole, sums, inputs[-1], acc))
            return (None, ops.cast(u * per_token, weights.dtype), *out)

        inputs = args
        if return_per_token:  # one output: the sum, then the per-token NLLs
            return ops.concatenate([total[None], per_token]), grad_fn
        return total, grad_fn

    targets = ops.cast(ops.reshape(ops.convert_to_tensor(targets), (-1,)), "int32")
    out = summed_fn(targets, float_weights(weights, acc), *args)
    if not return_per_token:
        return out
    return out[0], ops.stop_gradient(out[1:])


class PLIF:
    """The PLIF stage of `summed_mixture_nll`: the raw slopes (an input of
    its custom gradient), the knot bound, and whether the slopes get a
    gradient (`dispatch.needs_gradient`: a frozen PLIF's histograms are
    skipped)."""

    def __init__(self, raw, knot_bound):
        self.raw = raw
        self.knot_bound = knot_bound
        self.num_knots = raw.shape[0]
        self.gradient = dispatch.needs_gradient(raw)

    @classmethod
    def of(cls, raw_slopes, knot_bound):
        """None without `raw_slopes`; else the stage, its inputs checked."""
        if raw_slopes is None:
            if knot_bound is not None:
                raise ValueError(
                    "`knot_bound` is the bound of a PLIF: pass `raw_slopes` with it. "
                    f"Received: raw_slopes=None, knot_bound={knot_bound}"
                )
            return None
        knot_bound = functional.check_knot_bound(knot_bound)
        return cls(functional.check_raw_slopes(as_tensor(raw_slopes)), knot_bound)

    def tables(self, raw, acc):
        """The tables (`functional.plif_tables`) of `raw` in `acc`."""
        return functional.plif_tables(ops.cast(raw, acc), self.knot_bound)

    def raw_gradient(self, u, sums, raw, acc):
        """`u` times the raw slopes' gradient from the summed histograms, in
        `raw`'s dtype (None for slopes without a gradient)."""
        if not self.gradient:
            return None
        grad = functional.plif_raw_slope_gradient(sums, ops.cast(raw, acc), self.knot_bound)
        return ops.cast(u * grad, raw.dtype)
