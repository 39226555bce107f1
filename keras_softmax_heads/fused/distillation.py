"""`linear_divergence`: the KL / generalised Jensen-Shannon divergence between
a student's and a teacher's output softmax, from their hidden states and
output matrices, without the `[N, V]` logits of either (distillation).

The per-token divergence is `chunked.divergence.tiled_divergence`; the
options, masks and reductions are `linear_cross_entropy`'s. How it works:
`docs/distillation.md`.
"""

from keras import ops

from keras_softmax_heads.chunked import DEFAULT_CHUNK_SIZE
from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.chunked.core import accumulation_dtype
from keras_softmax_heads.chunked.divergence import DIVERGENCES
from keras_softmax_heads.chunked.divergence import OutputLayer
from keras_softmax_heads.chunked.divergence import tiled_divergence
from keras_softmax_heads.chunked.summed_divergence import summed_divergence
from keras_softmax_heads.chunked.tiling import kernel_geometry
from keras_softmax_heads.chunked.vocab_parallel import layer_arrays
from keras_softmax_heads.chunked.vocab_parallel import layers_over
from keras_softmax_heads.chunked.vocab_parallel import tile_sized_token_chunk
from keras_softmax_heads.chunked.vocab_parallel import token_losses
from keras_softmax_heads.chunked.vocab_parallel import vocab_parallel_divergence
from keras_softmax_heads.fused.cross_entropy import broadcast_weights
from keras_softmax_heads.fused.cross_entropy import check_loss_options
from keras_softmax_heads.fused.cross_entropy import mean_of_weighted_sum
from keras_softmax_heads.fused.cross_entropy import reduce_loss
from keras_softmax_heads.fused.vocab_parallel import parallel_layout
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_choice
from keras_softmax_heads.validation import check_float_dtype
from keras_softmax_heads.validation import check_int
from keras_softmax_heads.validation import check_number


def check_divergence_options(divergence="forward_kl", beta=0.5, temperature=1.0,
                             student_soft_cap=None, teacher_soft_cap=None,
                             reduction="mean", ignore_index=None,
                             teacher_gradient=False, implementation="auto"):
    """The options of `linear_divergence`, checked and normalised: returns
    them as a dict (floats, the reduction one of `fused.REDUCTIONS`).
    Raises `ValueError` naming the first bad option."""
    reduction, ignore_index = check_loss_options(reduction, ignore_index)[:2]
    return {
        "divergence": check_choice("divergence", divergence, DIVERGENCES),
        "beta": check_number("beta", beta, low=0, high=1),
        "temperature": check_number("temperature", temperature, low=0, low_open=True),
        "student_soft_cap": check_number("student_soft_cap", student_soft_cap, low=0,
                                         low_open=True, allow_none=True),
        "teacher_soft_cap": check_number("teacher_soft_cap", teacher_soft_cap, low=0,
                                         low_open=True, allow_none=True),
        "reduction": reduction,
        "ignore_index": ignore_index,
        "teacher_gradient": check_bool("teacher_gradient", teacher_gradient),
        "implementation": check_choice("implementation", implementation, ("auto", "ops")),
    }


def _side(name, hidden, kernel, bias, transposed, cap):
    """The flat `OutputLayer` of one side and its leading shape."""
    hidden = ops.convert_to_tensor(hidden)
    kernel = ops.convert_to_tensor(kernel)
    check_float_dtype(f"{name}_hidden", hidden)
    check_float_dtype(f"{name}_kernel", kernel)
    d, vocab = kernel_geometry(hidden, kernel, check_bool(
        f"{name}_kernel_transposed", transposed))
    if bias is not None:
        bias = ops.convert_to_tensor(bias)
        check_float_dtype(f"{name}_bias", bias)
        if tuple(bias.shape) != (vocab,):
            raise ValueError(
                f"`{name}_bias` must have shape ({vocab},) (the kernel's V). "
                f"Received: {name}_bias.shape={tuple(bias.shape)}"
            )
    lead = ops.shape(hidden)[:-1]
    return OutputLayer(ops.reshape(hidden, (-1, d)), kernel, bias, transposed, cap), lead


def token_weights(loss, targets=None, sample_weight=None, ignore_index=None):
    """`(weights, ignored)`: per-token weights of `loss`'s shape
    (`sample_weight` broadcast over trailing axes, 0 where `targets ==
    ignore_index`) and the boolean mask of the ignored tokens (or None)."""
    weights = broadcast_weights(sample_weight, loss)
    ignored = None
    if ignore_index is not None:
        if targets is None:
            raise ValueError(
                "`ignore_index` needs the `targets` (the token ids it is compared "
                f"with). Received: targets=None, ignore_index={ignore_index}"
            )
        ignored = ops.equal(ops.cast(ops.convert_to_tensor(targets), "int32"), ignore_index)
        weights = ops.where(ignored, ops.zeros_like(weights), weights)
    return weights, ignored


def linear_divergence(
    student_hidden,
    student_kernel,
    teacher_hidden,
    teacher_kernel,
    targets=None,
    *,
    student_bias=None,
    teacher_bias=None,
    student_kernel_transposed=False,
    teacher_kernel_transposed=False,
    divergence="forward_kl",
    beta=0.5,
    temperature=1.0,
    student_soft_cap=None,
    teacher_soft_cap=None,
    ignore_index=None,
    sample_weight=None,
    reduction="mean",
    chunk_size=DEFAULT_CHUNK_SIZE,
    teacher_gradient=False,
    implementation="auto",
    gradient_in_forward=None,
    token_chunk_size=None,
    vocab_parallel="auto",
):
    """Divergence between a student's and a teacher's output softmax, tiled.

    Per token, with `s = g_s(h_s W_s + b_s) / T` (the student's scores),
    `t = g_t(h_t W_t + b_t) / T` (the teacher's), `g` the identity or the
    soft cap `cap * tanh(z / cap)` of that side, `q = softmax(s)`,
    `p = softmax(t)`:

    * `"forward_kl"`: `KL(p || q) = sum_v p_v log(p_v / q_v)` (the usual
      distillation loss, mode-covering);
    * `"reverse_kl"`: `KL(q || p)` (mode-seeking);
    * `"jsd"`: the generalised Jensen-Shannon divergence in Liger's / TRL's
      convention, `beta KL(p || m) + (1 - beta) KL(q || m)` with
      `m = beta p + (1 - beta) q`; `beta = 0` is `KL(p || q)` and
      `beta = 1` is `KL(q || p)`, as in TRL's `generalized_jsd_loss`.

    No `[N, V]` tensor of either side is formed, and the accumulation is
    in float32 (float64 for float64 inputs). With `reduction="none"` the
    vocabulary is processed in tiles of at most `chunk_size` words and the
    backward pass recomputes them (`chunked.divergence.tiled_divergence`).
    With `"sum"` / `"mean"`, by default at most `token_chunk_size` tokens
    are scored over the whole vocabulary at a time and the gradient is computed in the forward pass
    (`chunked.summed_divergence`): as many products as the dense
    divergence, but a call whose gradient is not taken (evaluation) pays
    for it too in a TensorFlow graph without XLA (not under `jax.jit`,
    `jit_compile=True` or PyTorch's `no_grad`: `docs/results/forward_only/`);
    `gradient_in_forward=False` avoids it everywhere. Gradients are exact
    per token for every reduction, weight and mask; they reach the student's hidden
    states, kernel and bias, and the teacher's only with
    `teacher_gradient=True` (by default the teacher is under
    `stop_gradient`). Temperature: the divergence is not multiplied by
    `T**2` (multiply it yourself for Hinton's scaling).

    Args:
        student_hidden: float tensor `[..., d_s]`.
        student_kernel: `[d_s, V]`, or `[V, d_s]` with
            `student_kernel_transposed=True` (a tied embedding matrix).
        teacher_hidden: float tensor `[..., d_t]` (the same leading shape;
            `d_t` may differ from `d_s`).
        teacher_kernel: `[d_t, V]`, or `[V, d_t]` with
            `teacher_kernel_transposed=True` (the same `V`).
        targets: None, or integer token ids of the leading shape: only
            compared with `ignore_index`.
        student_bias, teacher_bias: `[V]` or None.
        student_kernel_transposed, teacher_kernel_transposed: bool.
        divergence: `"forward_kl"` (default), `"reverse_kl"` or `"jsd"`.
        beta: float in `[0, 1]`, the JSD's mixing weight of the teacher.
        temperature: float > 0, divides both sides' (capped) scores.
        student_soft_cap, teacher_soft_cap: None or a positive float (Gemma
            2's `final_logit_soft_cap`), applied before the temperature.
        ignore_index: None or a token id whose tokens (in `targets`) get
            weight 0 and no gradient.
        sample_weight: None or float weights of the leading shape (or a
            prefix of it).
        reduction: `"mean"` (default: `sum(w D) / sum(w)` over the
            non-ignored tokens, 0 if that is 0), `"sum"` (`sum(w D)`) or
            `"none"` (`w D` per token, the leading shape).
        chunk_size: maximum vocabulary tile width (`chunked.tile_width`).
        teacher_gradient: bool (default False): also differentiate with
            respect to the teacher's inputs.
        implementation: `"auto"` or `"ops"`, as in
            `chunked.chunked_pointwise_nll`.
        gradient_in_forward: None (default: True for the `"sum"` / `"mean"`
            reductions), True or False: compute the gradient in the forward
            pass, over chunks of tokens (True needs a summed reduction).
        token_chunk_size: None (default: about `2**26` scores a chunk,
            `2**25` on TensorFlow: `chunked.summed_divergence.
            default_token_chunk`) or an integer >= 1, the most tokens a
            chunk with `gradient_in_forward`.
        vocab_parallel: `"auto"` (default), True or False. On JAX, under a
            `keras.distribution` whose layout shards the student's kernel
            variable on its vocabulary axis (`linear_cross_entropy`'s
            `vocab_parallel`), `"auto"` and True run the summed pass
            (`gradient_in_forward`) on each device's columns of both sides
            (the teacher's kernel and the biases split the same way) and
            combine the per-token log-sum-exps and sums across that mesh
            axis: no device gathers either `[V, d]` matrix
            (`chunked.vocab_parallel.vocab_parallel_divergence`). The
            per-token form (`reduction="none"`, `gradient_in_forward=False`)
            runs the same pass keeping its per-token divergences, its
            gradient for any cotangent by a second pass with the cotangent
            as the weights (`chunked.vocab_parallel.token_losses`), chunks
            as many as `chunk_size` tiles, each device 1 / n of a tile's
            scores. False: the single-device
            passes (XLA's partitioner gathers the matrices).

    Returns:
        The divergence, float32 (float64 for float64 inputs), reduced as
        `reduction` says.

    Raises:
        ValueError: for kernels of different `V`, a kernel whose `d` does
            not match its hidden states, a non-floating dtype, or a bad
            option.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> from keras_softmax_heads.fused import linear_divergence
    >>> rng = np.random.default_rng(0)
    >>> h_s = rng.normal(size=(2, 3, 8)).astype("float32")
    >>> h_t = rng.normal(size=(2, 3, 16)).astype("float32")
    >>> w_s = rng.normal(size=(8, 37)).astype("float32")
    >>> emb_t = rng.normal(size=(37, 16)).astype("float32")   # tied [V, d_t]
    >>> kl = linear_divergence(h_s, w_s, h_t, emb_t, teacher_kernel_transposed=True,
    ...                        temperature=2.0, chunk_size=16)
    >>> log_q = ops.convert_to_numpy(ops.log_softmax(h_s @ w_s / 2, axis=-1))
    >>> log_p = ops.convert_to_numpy(ops.log_softmax(h_t @ emb_t.T / 2, axis=-1))
    >>> dense = (np.exp(log_p) * (log_p - log_q)).sum(-1).mean()
    >>> bool(np.isclose(float(kl), dense, rtol=1e-4))
    True

    References:
        Hinton, Vinyals and Dean, "Distilling the Knowledge in a Neural
        Network" (2015); Agarwal et al., "On-Policy Distillation of
        Language Models: Learning from Self-Generated Mistakes" (GKD, 2024),
        the generalised JSD.
    """
    options = check_divergence_options(
        divergence, beta, temperature, student_soft_cap, teacher_soft_cap,
        reduction, ignore_index, teacher_gradient, implementation)
    chunk_size = check_chunk_size(chunk_size)
    student, lead = _side("student", student_hidden, student_kernel, student_bias,
                          student_kernel_transposed, options["student_soft_cap"])
    teacher, _ = _side("teacher", teacher_hidden, teacher_kernel, teacher_bias,
                       teacher_kernel_transposed, options["teacher_soft_cap"])
    if tuple(student_hidden.shape[:-1]) != tuple(teacher_hidden.shape[:-1]):
        raise ValueError(
            "The student's and the teacher's hidden states must have the same "
            f"leading shape. Received: student_hidden.shape={student_hidden.shape}, "
            f"teacher_hidden.shape={teacher_hidden.shape}"
        )
    gradient_in_forward = check_bool("gradient_in_forward", gradient_in_forward,
                                     allow_none=True)
    token_chunk_size = check_int("token_chunk_size", token_chunk_size, minimum=1,
                                 allow_none=True)
    if gradient_in_forward and options["reduction"] == "none":
        raise ValueError(
            "`gradient_in_forward=True` needs a summed reduction (\"sum\" or "
            "\"mean\"): per-token results get their cotangents in the backward "
            f"pass. Received: reduction={options['reduction']!r}"
        )
    if gradient_in_forward is None:
        gradient_in_forward = options["reduction"] != "none"
    layout = parallel_layout(student_kernel, student.kernel_transposed, vocab_parallel)
    if gradient_in_forward:
        # Weights in the accumulation dtype, as the per-token form's are.
        acc = accumulation_dtype(student.hidden, student.kernel, teacher.hidden,
                                 teacher.kernel)
        weights, _ = token_weights(ops.zeros(lead, acc), targets, sample_weight,
                                   options["ignore_index"])
        summed = dict(beta=options["beta"], temperature=options["temperature"],
                      token_chunk_size=token_chunk_size,
                      teacher_gradient=options["teacher_gradient"],
                      implementation=options["implementation"])
        flat = ops.reshape(weights, (-1,))
        if layout is None:
            total = summed_divergence(student, teacher, flat, options["divergence"], **summed)
        else:  # each device its vocabulary shard of both sides
            total = vocab_parallel_divergence(student, teacher, flat, layout,
                                              options["divergence"], **summed)
        if options["reduction"] == "sum":
            return total
        return mean_of_weighted_sum(total, weights)
    if layout is None:
        per_token = tiled_divergence(
            student, teacher, options["divergence"], beta=options["beta"],
            temperature=options["temperature"], chunk_size=chunk_size,
            teacher_gradient=options["teacher_gradient"],
            implementation=options["implementation"],
        )
    else:  # each device its vocabulary shard of both sides, per token
        per_token = vocab_parallel_token_divergence(student, teacher, layout, options,
                                                    chunk_size)
    per_token = ops.reshape(per_token, lead)
    weights, ignored = token_weights(per_token, targets, sample_weight,
                                     options["ignore_index"])
    if ignored is not None:
        per_token = ops.where(ignored, ops.zeros_like(per_token), per_token)
    return reduce_loss(per_token, weights, options["reduction"])


def vocab_parallel_token_divergence(student, teacher, layout, options, chunk_size):
    """The per-token divergences `[N]` on each device's vocabulary shard of
    both sides (JAX): `chunked.vocab_parallel.token_losses` over
    `vocab_parallel_divergence`, exact gradients for any cotangent (the
    teacher's only with `teacher_gradient`), in as many chunks as the tiled
    pass has `chunk_size` tiles (`tile_sized_token_chunk`)."""
    sides = (student, teacher)
    _, vocab = kernel_geometry(student.hidden, student.kernel, student.kernel_transposed)
    chunk = tile_sized_token_chunk(student.hidden.shape[0], vocab, chunk_size)

    def summed(weights, *args):
        local = layers_over(sides, args)
        return vocab_parallel_divergence(
            local[0], local[1], weights, layout, options["divergence"], return_per_token=True,
            beta=options["beta"], temperature=options["temperature"], token_chunk_size=chunk,
            teacher_gradient=options["teacher_gradient"],
            implementation=options["implementation"])

    return token_losses(summed, layer_arrays(sides))
