"""`AdaptiveSoftmax` (Grave et al., 2017): exact, with static or dynamic tails.

Besides the layer: the capacity model of the static tails (`tail_fractions`,
`capacity`, `capacity_ladder`) and the static tail kernel
(`static_tail_log_likelihood`: blocks of the capacity, a custom gradient); the layer's
`tail_log_likelihood` is the one dispatch between it and the dynamic path.
Design notes: `docs/adaptive.md`.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_softmax_heads.chunked import check_chunk_size
from keras_softmax_heads.chunked import chunked_pointwise_nll
from keras_softmax_heads.chunked import linear_nll_backward
from keras_softmax_heads.chunked import linear_nll_forward
from keras_softmax_heads.chunked.dispatch import scaled_minus_target
from keras_softmax_heads.heads.adaptive_embedding import AdaptiveEmbedding
from keras_softmax_heads.heads.head_utils import adaptive_band_dims
from keras_softmax_heads.heads.head_utils import add_constant_weight
from keras_softmax_heads.heads.head_utils import build_context_checks
from keras_softmax_heads.heads.head_utils import check_cutoffs
from keras_softmax_heads.heads.head_utils import check_factor
from keras_softmax_heads.heads.head_utils import check_static_shapes
from keras_softmax_heads.heads.head_utils import frequency_order
from keras_softmax_heads.heads.head_utils import gather_targets
from keras_softmax_heads.heads.head_utils import summed_over_valid_targets
from keras_softmax_heads.heads.softmax_head import SoftmaxHead
from keras_softmax_heads.platforms import current_platform
from keras_softmax_heads.samplers import check_counts
from keras_softmax_heads.samplers import counts_to_config
from keras_softmax_heads.validation import check_bool
from keras_softmax_heads.validation import check_positive
from keras_softmax_heads.validation import check_targets
from keras_softmax_heads.validation import is_concrete
from keras_softmax_heads.validation import nan_if_invalid


def default_cutoffs(vocab_size):
    """Default `cutoffs`: `[ceil(V / 20), ceil(V / 5)]` (fewer for tiny `V`).

    A heuristic (a head of 5% of the words, a first tail up to 20%), for the
    registry; pass `cutoffs` for real use.

    >>> default_cutoffs(10000)
    [500, 2000]
    >>> default_cutoffs(3)
    [1]
    """
    vocab_size = int(vocab_size)
    cutoffs = []
    for c in (math.ceil(vocab_size / 20), math.ceil(vocab_size / 5)):
        if 1 <= c < vocab_size and (not cutoffs or c > cutoffs[-1]):
            cutoffs.append(c)
    return cutoffs or [1]


def tail_fractions(cutoffs, vocab_size, counts=None):
    """Expected share of tokens in each tail cluster, `[C]` floats.

    From the counts (their sum over the tail's ranks over the total) or,
    without counts (word ids are frequency ranks), from Zipf's law
    `p(rank r) ~ 1 / (r + 1)`.

    >>> [round(f, 3) for f in tail_fractions([10, 100], 1000)]
    [0.302, 0.307]
    """
    bounds = list(cutoffs) + [vocab_size]
    if counts is None:
        weights = 1.0 / np.arange(1, vocab_size + 1, dtype=np.float64)
    else:
        weights = -np.sort(-np.asarray(counts, np.float64), kind="stable")
    total = float(weights.sum())
    if total <= 0:
        weights, total = np.ones(vocab_size), float(vocab_size)
    return [float(weights[a:b].sum() / total) for a, b in zip(bounds, bounds[1:])]


def capacity(num_tokens, fraction, capacity_factor):
    """Tokens tail gathers statically: `min(N, max(1, ceil(capacity_factor *
    N * f + 2 sqrt(N f))))` (an int for an int `N`, else a scalar tensor).

    >>> capacity(2048, 0.1, 1.25)
    285
    """
    if isinstance(num_tokens, int):
        mean = num_tokens * fraction
        value = math.ceil(capacity_factor * mean + 2.0 * math.sqrt(mean))
        return int(min(num_tokens, max(1, value)))
    mean = ops.cast(num_tokens, "float32") * fraction
    value = ops.cast(ops.ceil(capacity_factor * mean + 2.0 * ops.sqrt(mean)), "int32")
    return ops.minimum(num_tokens, ops.maximum(value, 1))


def capacity_ladder(num_tokens, first):
    """`K, 2K, 4K, ..., N` (int `N`), or `[K, N]`: the block sizes of an
    eager call (the first that holds the tail's members)."""
    if not isinstance(num_tokens, int):
        return [first, num_tokens]
    ladder = [first]
    while ladder[-1] < num_tokens:
        ladder.append(min(2 * ladder[-1], num_tokens))
    return ladder


def split_capacity(capacity, num_tokens, splits):
    """`(block, kept)`: a traced tail's blocks of `ceil(K / splits)` rows
    (`K = capacity` clipped into `[1, num_tokens]`) and how many of them
    cover the capacity (Python ints; `tail_blocks`).

    >>> split_capacity(410, 2048, 8)
    (52, 8)
    """
    block = int(min(max(1, capacity), num_tokens))
    sub = -(-block // max(1, int(splits)))
    return sub, -(-block // sub)


def fewest_scored_blocks(kept, blocks, min_blocks):
    """The fewest of a tail's `kept` blocks that `static_tail_summed_nll`
    scores: `min_blocks` of `blocks`, scaled to `kept` (at least one).

    >>> fewest_scored_blocks(8, 8, 4), fewest_scored_blocks(3, 8, 4)
    (4, 1)
    """
    return min(kept, max(1, min_blocks * kept // max(1, blocks)))


def tail_blocks(member, capacity, splits=1):
    """How a static tail's kernel lays out its members' rows.

    The tail's tokens are sorted first (token order) in `order`, padded to
    whole blocks; a member's row in it is `slot`. Traced, the blocks have
    `ceil(capacity / splits)` rows and the first `kept` of them (`splits`,
    or fewer for a short batch) cover the capacity. Eagerly, one block holds
    every member (a loop would make JAX compile its body at every eager
    call): on JAX, whose eager operations compile per shape, a size from the
    ladder K, 2K, ..., N, so that few shapes occur; elsewhere (PyTorch,
    whose layers Keras runs eagerly, TensorFlow's eager mode) exactly the
    members' rows, as the dynamic path and torch's module score.

    Args:
        member: bool `[N]` (static `N`), whether a token is the tail's.
        capacity: Python int `K`, the rows the tail is planned for.
        splits: int `>= 1`, the blocks the capacity is cut into.

    Returns:
        `(member_int, order, slot, block, kept, num_blocks, padded)`: the
        int32 membership, the `[padded]` row order and the `[N]` slots
        (tensors); the block's rows, the kept blocks, all blocks and
        `num_blocks * block` (Python ints).
    """
    n = int(member.shape[0])
    member_int = ops.cast(member, "int32")
    positions = ops.arange(n, dtype="int32")
    order = ops.cast(ops.argsort(ops.where(member, positions, positions + n)), "int32")
    slot = ops.cumsum(member_int) - 1  # a member's row in `order`
    block = int(min(max(1, capacity), n))
    kept = 1
    if is_concrete(member_int):
        count = int(ops.convert_to_numpy(ops.sum(member_int)))
        if keras.backend.backend() == "jax":
            block = next(k for k in capacity_ladder(n, block) if count <= k)
        else:
            block = max(1, count)
    else:
        block, kept = split_capacity(capacity, n, splits)
    num_blocks = -(-n // block)
    kept = min(kept, num_blocks)
    padded = num_blocks * block
    if padded > n:  # rows past N read token 0 and are never members
        order = ops.concatenate([order, ops.zeros((padded - n,), "int32")])
    return member_int, order, slot, block, kept, num_blocks, padded


def static_tail_log_likelihood(h, member, local, projection, kernel, bias, capacity,
                                accumulation_dtype, chunk_size=None):
    """One tail's `log_softmax((h P) W + b)` at the targets of its members,
    with static shapes: blocks of `capacity` rows, and a custom gradient.

    The tail's tokens are placed first (in token order) in `order`; block
    `j` computes rows `order[j K : (j + 1) K]` for `K = capacity`. Block 0
    is computed unconditionally and its products are kept for the backward
    pass (the scores `z` and the rows' inputs), so when it holds the
    members (nearly always: `capacity`) the backward pass takes two products
    per tail, as autodiff would. The members beyond it (an overflowing
    batch) are computed by an `ops.while_loop` over the next blocks, as many
    as they fill, in the forward pass and (recomputing the blocks' scores) in
    the backward pass. Every block has the same `[K, size]` shape, so what
    XLA plans for a step is a few blocks of `K` rows whatever the batch
    holds, not the `[N, size]` scores of a dense tail (a `cond` over larger
    capacities, the layer's earlier form, made XLA reserve its largest
    branch: `docs/adaptive.md`). The gradient is written out
    (`d ll / d z = onehot - softmax(z)`), not taken through the loop.

    With `chunk_size`, a block's `[K, size]` scores are never held either:
    its log-normaliser is computed over tiles of at most `chunk_size` words
    of the tail (`chunked.linear_nll_forward`, an online log-sum-exp), only
    the rows' `[K]` log-normalisers are kept, and the backward pass
    recomputes every block's tiles (`chunked.linear_nll_backward`): memory
    `O(K chunk_size)` a tail, one more product of the tail's scores a step.

    Args:
        h: `[N, d]` context vectors, compute dtype, static `N`.
        member: bool `[N]`, whether a token's target is in this tail.
        local: int32 `[N]`, the target's position in the tail (clipped).
        projection: `[d, d_i]`; kernel: `[d_i, size]` (compute dtype).
        bias: `[size]` (accumulation dtype) or None.
        capacity: Python int `K` in `[1, N]`, the rows of a block.
        accumulation_dtype: dtype of the scores.
        chunk_size: None (a block's scores at once) or an int, the widest
            tile of the tail's words (`chunked.tile_width`).

    Returns:
        `[N]` log-probabilities (0 for non-members), `accumulation_dtype`.
    """
    acc = accumulation_dtype
    has_bias = bias is not None
    member_int, order, slot, block, _, num_blocks, padded = tail_blocks(member, capacity)

    # Every tensor the forward and backward passes read is an argument (JAX's
    # custom gradients cannot close over traced values).
    @ops.custom_gradient
    def tail_fn(member_int, local, order, slot, h, projection, kernel, *maybe_bias):
        b = maybe_bias[0] if maybe_bias else None
        is_member = member_int > 0
        count = ops.sum(member_int)

        def at(*indices):
            # One index dtype (Python ints are int64 under JAX's x64).
            return tuple(ops.convert_to_tensor(i, "int32") for i in indices)

        def block_inputs(start):
            """Rows `order[start:start + K]`, their `h` and `x = h P`:
            `(rows, h_rows, x)`."""
            rows = ops.slice(order, at(start), (block,))
            h_rows = ops.take(h, rows, axis=0)  # [K, d]
            return rows, h_rows, ops.matmul(h_rows, projection)  # x: [K, d_i]

        def scores(start):
            """`(rows, h_rows, x, z)` of block `start`."""
            rows, h_rows, x = block_inputs(start)
            z = ops.cast(ops.matmul(x, kernel), acc)  # [K, size]
            if b is not None:
                z = z + b
            return rows, h_rows, x, z

        def targets_of(rows):
            return ops.take(local, rows)

        def row_is_member(start):
            return start + ops.arange(block, dtype="int32") < count

        def with_all_rows(first_rows):
            """Block 0's values, `[K, ...]`, as the `[padded, ...]` buffer of
            every row (zeros until the overflow blocks write theirs)."""
            rest = ops.zeros((padded - block,) + tuple(first_rows.shape[1:]), first_rows.dtype)
            return ops.concatenate([first_rows, rest], axis=0)

        def to_tokens(per_row):
            """Rows' values (`[padded, ...]`, in `order`) back to the tokens
            (zero for non-members: only members' rows are read)."""
            pad = ops.zeros((1,) + tuple(per_row.shape[1:]), per_row.dtype)
            rows = ops.concatenate([per_row, pad], axis=0)
            return ops.take(rows, ops.where(is_member, slot, padded), axis=0)

        def overflow(fn, carry):
            """`carry` after `fn(start, carry)` for the blocks past the first
            that hold members (none unless the batch overflows `K`)."""
            if num_blocks == 1:
                return carry

            def body(j, *carry):
                return (j + 1, *fn(j * block, carry))

            _, *carry = ops.while_loop(lambda j, *_: j * block < count, body,
                                       (ops.convert_to_tensor(1, "int32"), *carry),
                                       maximum_iterations=num_blocks - 1)
            return tuple(carry)

        def log_likelihood(rows, z):
            # The target's score by a gather: no `[K, size]` one-hot (on
            # PyTorch `ops.one_hot` builds an int64 one and converts it).
            return gather_targets(z, targets_of(rows)) - ops.logsumexp(z, axis=-1)

        def chunked_forward(start):
            """Block `start`'s `(ll, lse)` over tiles of the tail's words."""
            rows, _, x = block_inputs(start)
            nll, lse = linear_nll_forward(x, kernel, b, targets_of(rows), chunk_size)
            return -nll, lse

        if chunk_size is None:
            first = scores(0)
            ll_rows = with_all_rows(log_likelihood(first[0], first[3]))
            carry = (ll_rows,)

            def forward_block(start, carry):
                rows, _, _, z = scores(start)
                return (ops.slice_update(carry[0], at(start), log_likelihood(rows, z)),)
        else:
            # Only the rows' log-normalisers are kept for the backward pass.
            carry = tuple(with_all_rows(v) for v in chunked_forward(0))

            def forward_block(start, carry):
                return tuple(ops.slice_update(c, at(start), v)
                             for c, v in zip(carry, chunked_forward(start)))

        carry = overflow(forward_block, carry)
        ll = to_tokens(carry[0])
        lse_rows = carry[1] if chunk_size is not None else None

        def grad_fn(*args, upstream=None, variables=None):
            # TensorFlow and JAX call grad_fn(upstream); PyTorch
            # grad_fn(*inputs, upstream=upstream).
            del variables
            if upstream is None:
                (upstream,) = args
            upstream = ops.cast(upstream, acc)

            def member_upstream(start, rows):
                return ops.where(row_is_member(start), ops.take(upstream, rows), 0.0)

            def products(dx, h_rows):
                """`(dh_rows, d_projection)` from the gradient of `x`."""
                return (ops.matmul(dx, ops.transpose(projection)),
                        ops.matmul(ops.transpose(h_rows), dx))

            def gradients(start, rows, h_rows, x, z):
                g = member_upstream(start, rows)
                # g (onehot - softmax): the softmax scaled by -g, g added at
                # the target (in place on PyTorch, one fused pass under XLA).
                dz = scaled_minus_target(ops.softmax(z, axis=-1), -g, targets_of(rows), -g)
                dz_c = ops.cast(dz, h.dtype)
                d_kernel = ops.matmul(ops.transpose(x), dz_c)
                dx = ops.matmul(dz_c, ops.transpose(kernel))
                dh_rows, d_projection = products(dx, h_rows)
                return dh_rows, d_projection, d_kernel, ops.sum(dz, axis=0)

            def chunked_gradients(start):
                rows, h_rows, x = block_inputs(start)
                lse = ops.slice(lse_rows, at(start), (block,))
                # ll = -nll: the upstream of the nll is -g.
                grads = linear_nll_backward(x, kernel, b, targets_of(rows), lse,
                                            -member_upstream(start, rows), chunk_size)
                dh_rows, d_projection = products(grads[0], h_rows)
                d_bias = ops.cast(grads[2], acc) if b is not None else ops.zeros((), acc)
                return dh_rows, d_projection, grads[1], d_bias

            def block_gradients(start):
                if chunk_size is None:
                    return gradients(start, *scores(start))
                return chunked_gradients(start)

            if chunk_size is None:
                dh_first, d_projection, d_kernel, d_bias = gradients(0, *first)
            else:
                dh_first, d_projection, d_kernel, d_bias = chunked_gradients(0)
            if num_blocks > 1:  # overflow blocks add to them: float32 sums
                d_projection, d_kernel = ops.cast(d_projection, acc), ops.cast(d_kernel, acc)
            dh_rows = with_all_rows(dh_first)

            def backward_block(start, carry):
                dh_rows, d_projection, d_kernel, d_bias = carry
                dh, dp, dk, db = block_gradients(start)
                return (ops.slice_update(dh_rows, at(start, 0), dh),
                        d_projection + ops.cast(dp, acc), d_kernel + ops.cast(dk, acc),
                        d_bias + db)

            dh_rows, d_projection, d_kernel, d_bias = overflow(
                backward_block, (dh_rows, d_projection, d_kernel, d_bias))
            grads = [
                ops.cast(to_tokens(dh_rows), h.dtype),
                ops.cast(d_projection, projection.dtype),
                ops.cast(d_kernel, kernel.dtype),
            ]
            if b is not None:
                grads.append(ops.cast(d_bias, b.dtype))
            return (None, None, None, None, *grads)  # None: integer inputs

        return ll, grad_fn

    args = [member_int, local, order, slot, h, projection, kernel]
    return tail_fn(*args + ([bias] if has_bias else []))


#: Blocks a tail's capacity is split into by `static_tail_summed_nll`: a
#: step scores its members' rows rounded up to one of them.
GRADIENT_BLOCKS = 8
#: The fewest of them a step scores: its `ops.switch` has a branch for each
#: count from this one up (five, not eight). A capacity holds 1.25x the
#: expected members plus slack, so a batch rarely fits in half of it
#: (`docs/adaptive.md`); each branch is compiled, and the first call's time
#: grows with their number.
MIN_GRADIENT_BLOCKS = 4


def static_tail_summed_nll(h, member, local, weights, projection, kernel, bias, capacity,
                           accumulation_dtype, blocks=GRADIENT_BLOCKS,
                           min_blocks=MIN_GRADIENT_BLOCKS):
    """One tail's `sum_i weights_i (-log_softmax((h P) W + b)[local_i])`
    over its members, with the gradient computed in the forward pass.

    The weights are known in the forward pass (the summed objective
    `HeadLoss` and `HeadModel` train), so each block of rows computes its
    loss and its gradients at once (`d z = w (softmax(z) - onehot)`, three
    products) and keeps nothing of its scores for the backward pass, which
    only scales the sums by the upstream value. The capacity `K` is split
    into `blocks` blocks of `ceil(K / blocks)` rows; one `ops.switch` runs
    the fewest of them that hold every member, and at least `min_blocks` of
    them, as one product (a branch per count, static shapes), and an
    `ops.while_loop` adds the blocks past the capacity when a batch
    overflows it. So a step scores the members' rows rounded up to a block
    rather than the whole capacity: the padding a capacity costs
    `static_tail_log_likelihood` on every step (whose kept scores would have
    to be padded to the largest branch: a copy per step).

    Args:
        h: `[N, d]` context vectors, compute dtype, static `N`.
        member: bool `[N]`, whether a token's target is in this tail.
        local: int32 `[N]`, the target's position in the tail (clipped).
        weights: `[N]` float token weights (no gradient).
        projection: `[d, d_i]`; kernel: `[d_i, size]` (compute dtype).
        bias: `[size]` (accumulation dtype) or None.
        capacity: Python int `K` in `[1, N]`.
        accumulation_dtype: dtype of the scores and of the sums.
        blocks: int `>= 1`, the blocks the capacity is split into.
        min_blocks: int `>= 1`, the fewest of them a step scores (scaled
            down where the capacity has fewer than `blocks` rows).

    Returns:
        A scalar, `accumulation_dtype`.
    """
    acc = accumulation_dtype
    member_int, order, slot, block, kept, num_blocks, padded = tail_blocks(
        member, capacity, blocks)

    @ops.custom_gradient
    def tail_fn(member_int, local, order, slot, weights, h, projection, kernel, *maybe_bias):
        b = maybe_bias[0] if maybe_bias else None
        is_member = member_int > 0
        count = ops.sum(member_int)
        w = ops.cast(weights, acc)

        def at(*indices):
            return tuple(ops.convert_to_tensor(i, "int32") for i in indices)

        def rows_loss_and_grads(start, length):
            """Rows `order[start:start + length]`: `(loss, dh_rows,
            d_projection, d_kernel, d_bias)`, the sums float32."""
            rows = ops.slice(order, at(start), (length,))
            h_rows = ops.take(h, rows, axis=0)
            x = ops.matmul(h_rows, projection)
            z = ops.cast(ops.matmul(x, kernel), acc)
            if b is not None:
                z = z + b
            targets = ops.take(local, rows)
            is_row = start + ops.arange(length, dtype="int32") < count
            g = ops.where(is_row, ops.take(w, rows), 0.0)
            lse = ops.logsumexp(z, axis=-1)
            loss = ops.sum(g * (lse - gather_targets(z, targets)))
            dz = scaled_minus_target(ops.exp(z - ops.expand_dims(lse, -1)), g, targets, g)
            dz_c = ops.cast(dz, h.dtype)
            dx = ops.matmul(dz_c, ops.transpose(kernel))
            return (loss, ops.matmul(dx, ops.transpose(projection)),
                    ops.cast(ops.matmul(ops.transpose(h_rows), dx), acc),
                    ops.cast(ops.matmul(ops.transpose(x), dz_c), acc),
                    ops.sum(dz, axis=0))

        def fewest_blocks(k):
            def branch():
                loss, dh, *sums = rows_loss_and_grads(0, (k + 1) * block)
                rest = ops.zeros((padded - int(dh.shape[0]), int(dh.shape[1])), dh.dtype)
                return (loss, ops.concatenate([dh, rest], axis=0), *sums)
            return branch

        lowest = fewest_scored_blocks(kept, blocks, min_blocks) - 1
        if lowest == kept - 1:
            out = fewest_blocks(lowest)()
        else:
            index = ops.clip((count + block - 1) // block - 1, lowest, kept - 1) - lowest
            out = ops.switch(index, [fewest_blocks(k) for k in range(lowest, kept)])
        if num_blocks > kept:  # an overflowing batch: the blocks past the capacity
            def body(j, loss, dh_rows, *sums):
                start = j * block
                block_loss, dh, *grads = rows_loss_and_grads(start, block)
                return (j + 1, loss + block_loss, ops.slice_update(dh_rows, at(start, 0), dh),
                        *(s + g for s, g in zip(sums, grads)))

            _, *out = ops.while_loop(lambda j, *_: j * block < count, body,
                                     (ops.convert_to_tensor(kept, "int32"), *out),
                                     maximum_iterations=num_blocks - kept)
        loss, dh_rows, d_projection, d_kernel, d_bias = out
        pad = ops.zeros((1, int(dh_rows.shape[1])), dh_rows.dtype)
        dh = ops.take(ops.concatenate([dh_rows, pad], axis=0),
                      ops.where(is_member, slot, padded), axis=0)

        def grad_fn(*args, upstream=None, variables=None):
            # TensorFlow and JAX call grad_fn(upstream); PyTorch
            # grad_fn(*inputs, upstream=upstream).
            del variables
            if upstream is None:
                (upstream,) = args
            u = ops.cast(upstream, acc)
            grads = [ops.cast(ops.cast(dh, acc) * u, h.dtype),
                     ops.cast(d_projection * u, projection.dtype),
                     ops.cast(d_kernel * u, kernel.dtype)]
            if b is not None:
                grads.append(ops.cast(d_bias * u, b.dtype))
            # None: integer inputs; the weights get no gradient.
            return (None, None, None, None, ops.zeros_like(weights), *grads)

        return loss, grad_fn

    args = [member_int, local, order, slot, weights, h, projection, kernel]
    return tail_fn(*args + ([bias] if bias is not None else []))


@keras.saving.register_keras_serializable(package="keras_softmax_heads")
class AdaptiveSoftmax(SoftmaxHead):
    """Adaptive softmax: a frequent-word head and cheaper tail clusters.

    Words ranked by frequency (by `counts`, or word ids already in
    frequency order) are cut at `cutoffs = [c_0, ..., c_{C-1}]`: the head
    cluster holds ranks `[0, c_0)` plus one token per tail cluster, tail `i`
    ranks `[c_i, c_{i+1})` (the last up to `V`). With `z = h U + a`
    (`U` `[d, c_0 + C]`, the layer's `head_kernel`),

    * `log p(w | h) = log_softmax(z)[r(w)]` for a head word;
    * `log p(w | h) = log_softmax(z)[c_0 + i] + log_softmax((h P_i) W_i +
      b_i)[r(w) - c_i]` for a word of tail `i`, with `P_i` `[d, d_i]`,
      `d_i = max(1, d // factor**(i+1))`, `W_i` `[d_i, size_i]`, as
      `torch.nn.AdaptiveLogSoftmaxWithLoss` (plus optional biases).

    `call` / `log_probs` return the exact normalised `[..., V]` distribution
    in word-id order; `log_likelihood` and `training_loss` (the exact NLL)
    compute each tail only for the tokens whose target lies in it. `logits`
    returns the `[..., V]` within-cluster scores (not normalised together),
    `head_logits` returns `z`. Static shapes (default) give tail `i` a
    capacity `tail_capacities(N)` and score its tokens in blocks of that
    many rows, the first always, more only when a batch overflows it: no
    token is ever dropped, and XLA plans memory for blocks, not for `N`.
    Design notes: `docs/adaptive.md`.

    Args:
        vocab_size: int `V` (or omit and pass `adaptive_embedding`).
        cutoffs: strictly increasing ints in `[1, V)`; default
            `default_cutoffs(V)` or the embedding's.
        factor: number `>= 1`, the width ratio of consecutive clusters
            (default 4; torch's `div_value`).
        counts: optional `[V]` word counts: rank words (else ids are ranks)
            and set the capacities. Kept in the config.
        adaptive_embedding: optional `AdaptiveEmbedding` (same `V`,
            `cutoffs`, `factor`, `output_dim = d`) whose tables and
            projections the head shares (tied adaptive input / output);
            `counts` must then be None.
        static_shapes: bool (default `True`, XLA / JAX / TPU). `False`
            gathers exactly each tail's tokens (data-dependent shapes:
            TensorFlow graphs and PyTorch; raises on JAX).
        capacity_factor: number `> 0`, the capacity's margin over the
            expected tail load (default 1.25). Speed only, never the
            result: a smaller factor scores fewer padded rows and overflows
            into an extra block more often (`docs/adaptive.md`).
        chunk_size: optional int >= 1: `log_likelihood` / `training_loss`
            compute the head cluster's and every tail's log-normaliser over
            tiles of at most `chunk_size` words (`chunked`), recomputing
            them in the backward pass: no `[N, c_0 + C]` head scores and no
            `[K_i, size_i]` block of a tail's scores are held, at the cost
            of one more product of the scores a step. Same values. Default
            None (whole clusters at once; `call` is dense either way).
        gradient_in_forward: None (default), True or False. `True`: the
            summed objective `HeadLoss` and `HeadModel` train
            (`summed_training_loss`) computes each tail's gradient in the
            forward pass, in blocks of an eighth of its capacity, at least
            four of them (`static_tail_summed_nll`), so a step scores the
            members' rows rounded up to a block rather than the whole
            capacity, and keeps
            no tail scores between the passes. Same values and gradients
            (to float32 rounding). Needs `static_shapes=True` and
            `chunk_size=None`. `None`: on where that holds and the step runs
            on a CPU (`platforms.current_platform()`, at trace time), off on
            a GPU / TPU (not measured there; XLA's GPU conditionals read
            their branch index on the host). The resolved value is the
            `gradient_in_forward` property.
        token_embedding: must be None (a plain embedding cannot be tied).
        **kwargs: `use_bias` (head bias `a`, tail biases `b_i`),
            `kernel_initializer` (of `U`, `P_i`, `W_i`), `bias_initializer`,
            `return_probabilities` (see `SoftmaxHead`) and standard
            `keras.layers.Layer` arguments.

    Call arguments:
        inputs: context vectors, float tensor `[..., d]`.

    Returns:
        float32 log-probabilities `[..., V]` in word-id order;
        `log_likelihood(inputs, targets)`: the exact `log p(targets |
        inputs)`, float32 of shape `targets.shape`, each tail scored for its
        own tokens only.

    Example:

    >>> import numpy as np
    >>> from keras_softmax_heads.heads.adaptive_softmax import AdaptiveSoftmax
    >>> head = AdaptiveSoftmax(20, cutoffs=[4, 10], factor=2)
    >>> h = np.random.rand(3, 8).astype("float32")
    >>> log_p = np.asarray(head(h))
    >>> bool(np.allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5))
    True
    >>> [tuple(k.shape) for k in head.tail_kernels]
    [(4, 6), (2, 10)]
    >>> t = np.array([0, 7, 19])
    >>> bool(np.allclose(head.log_likelihood(h, t), log_p[np.arange(3), t], atol=1e-5))
    True
    >>> tiled = AdaptiveSoftmax.from_config({**head.get_config(), "chunk_size": 3})
    >>> tiled.build((None, 8)); tiled.set_weights(head.get_weights())
    >>> bool(np.allclose(tiled.log_likelihood(h, t), log_p[np.arange(3), t], atol=1e-5))
    True

    References:
        - Grave, Joulin, Cissé, Grangier & Jégou, 2017. Efficient softmax
          approximation for GPUs. https://arxiv.org/abs/1609.04309
        - Baevski & Auli, 2019. Adaptive Input Representations for Neural
          Language Modeling. https://arxiv.org/abs/1809.10853
    """

    def __init__(
        self,
        vocab_size=None,
        cutoffs=None,
        factor=4,
        counts=None,
        adaptive_embedding=None,
        static_shapes=True,
        capacity_factor=1.25,
        chunk_size=None,
        gradient_in_forward=None,
        token_embedding=None,
        **kwargs,
    ):
        if token_embedding is not None:
            raise ValueError(
                "AdaptiveSoftmax cannot tie to a plain `token_embedding`: its "
                "tail clusters use narrower word vectors. Tie it to an "
                "adaptive input with `adaptive_embedding=AdaptiveEmbedding(...)`"
                f". Received: token_embedding={token_embedding!r}"
            )
        if isinstance(adaptive_embedding, dict):
            adaptive_embedding = keras.layers.deserialize(adaptive_embedding)
        if adaptive_embedding is not None:
            if not isinstance(adaptive_embedding, AdaptiveEmbedding):
                raise ValueError(
                    "`adaptive_embedding` must be a "
                    "keras_softmax_heads.AdaptiveEmbedding. Received: "
                    f"adaptive_embedding={adaptive_embedding!r}"
                )
            emb = adaptive_embedding
            if vocab_size is not None and vocab_size != emb.vocab_size:
                raise ValueError(
                    "`vocab_size` must equal the adaptive embedding's. Received: "
                    f"vocab_size={vocab_size}, adaptive_embedding.vocab_size="
                    f"{emb.vocab_size}"
                )
            vocab_size = emb.vocab_size
            if cutoffs is not None and list(cutoffs) != emb.cutoffs:
                raise ValueError(
                    "`cutoffs` must equal the adaptive embedding's. Received: "
                    f"cutoffs={cutoffs!r}, adaptive_embedding.cutoffs={emb.cutoffs}"
                )
            cutoffs = emb.cutoffs
            if check_factor(factor) != emb.factor:
                raise ValueError(
                    "`factor` must equal the adaptive embedding's. Received: "
                    f"factor={factor!r}, adaptive_embedding.factor={emb.factor}"
                )
            if counts is not None:
                raise ValueError(
                    "A head tied to an adaptive embedding uses the embedding's "
                    "word ranking: pass `counts` to the AdaptiveEmbedding. "
                    "Received: counts (not None) with adaptive_embedding"
                )
        super().__init__(vocab_size=vocab_size, **kwargs)
        vocab = self.vocab_size
        self.adaptive_embedding = adaptive_embedding
        if cutoffs is None:
            cutoffs = default_cutoffs(vocab)
        self.cutoffs = check_cutoffs(cutoffs, vocab)
        self.factor = check_factor(factor)
        self.counts = check_counts(counts, vocab)
        self.static_shapes = check_static_shapes(
            static_shapes, "gathers each tail's tokens with data-dependent shapes")
        # Keras turns `jit_compile` off for a model with this layer when the
        # shapes are data-dependent, and on PyTorch, where the static tails'
        # overflow loop runs in Python (`torch.compile` would break its graph
        # at every tail and recompile as the number of blocks changes).
        self.supports_jit = self.static_shapes and keras.backend.backend() != "torch"
        self.capacity_factor = check_positive("capacity_factor", capacity_factor)
        self.chunk_size = check_chunk_size(chunk_size, default=None)
        self.gradient_in_forward_option = check_bool(
            "gradient_in_forward", gradient_in_forward, allow_none=True)
        if gradient_in_forward and (self.chunk_size is not None or not self.static_shapes):
            raise ValueError(
                "`gradient_in_forward=True` computes the static tails' blocks "
                "whole (static_shapes=True, chunk_size=None): it has no tiled "
                "or dynamic form. Received: gradient_in_forward=True, "
                f"static_shapes={self.static_shapes}, chunk_size={self.chunk_size}"
            )
        bounds = self.cutoffs + [vocab]
        self.num_clusters = len(self.cutoffs)
        self.tail_sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        fraction_counts = self.counts
        if adaptive_embedding is not None:
            fraction_counts = adaptive_embedding.counts
        self.tail_fractions = tail_fractions(self.cutoffs, vocab, fraction_counts)

    @property
    def gradient_in_forward(self):
        """Whether `summed_training_loss` computes the tails' gradients in
        the forward pass: the `gradient_in_forward` option, or with `None`
        whether the static whole-block path runs on a CPU."""
        option = self.gradient_in_forward_option
        if option is not None:
            return option
        return (self.static_shapes and self.chunk_size is None
                and current_platform() == "cpu")

    # ------------------------------------------------------------------ build
    def build(self, input_shape):
        build_context_checks(self, input_shape)
        d, c0, num = self.input_dim, self.cutoffs[0], self.num_clusters
        emb = self.adaptive_embedding
        if emb is not None:
            if not emb.built:
                emb.build()
            if emb.output_dim != d:
                raise ValueError(
                    "The tied `adaptive_embedding` has output_dim="
                    f"{emb.output_dim} but the context vectors have last "
                    f"dimension {d}. Received: input_shape={input_shape}"
                )
        self.tail_dims = adaptive_band_dims(d, num + 1, self.factor)[1:]
        self.kernel = None
        self.bias = None
        self.head_kernel = self.cluster_kernel = None
        if emb is None:
            self.head_kernel = self.add_weight(
                name="head_kernel", shape=(d, c0 + num),
                initializer=self.kernel_initializer,
            )
        else:
            self.cluster_kernel = self.add_weight(
                name="cluster_kernel", shape=(d, num),
                initializer=self.kernel_initializer,
            )
        self.head_bias = None
        if self.use_bias:
            self.head_bias = self.add_weight(
                name="head_bias", shape=(c0 + num,),
                initializer=self.bias_initializer, autocast=False,
            )
        self.tail_projections = []
        self.tail_kernels = []
        self.tail_biases = []
        for i, (dim, size) in enumerate(zip(self.tail_dims, self.tail_sizes)):
            if emb is None:
                self.tail_projections.append(self.add_weight(
                    name=f"tail_projection_{i}", shape=(d, dim),
                    initializer=self.kernel_initializer,
                ))
                self.tail_kernels.append(self.add_weight(
                    name=f"tail_kernel_{i}", shape=(dim, size),
                    initializer=self.kernel_initializer,
                ))
            if self.use_bias:
                self.tail_biases.append(self.add_weight(
                    name=f"tail_bias_{i}", shape=(size,),
                    initializer=self.bias_initializer, autocast=False,
                ))
        self.word_order = self.word_rank = None
        if emb is None:
            order = frequency_order(self.counts, self.vocab_size)
            rank = np.empty_like(order)
            rank[order] = np.arange(order.size)
            self.word_order = add_constant_weight(self, "word_order", "int32", order)
            self.word_rank = add_constant_weight(self, "word_rank", "int32", rank)

    # ------------------------------------------------------------- weights
    def _rank_table(self):
        emb = self.adaptive_embedding
        table = self.word_rank if emb is None else emb.word_rank
        return ops.convert_to_tensor(table)

    def head_matrix(self):
        """`U` `[d, c_0 + C]` in the compute dtype (tied: `[E_0^T, U_c]`)."""
        if self.adaptive_embedding is None:
            kernel = self.head_kernel
        else:
            kernel = ops.concatenate(
                [ops.transpose(self.adaptive_embedding.band_embeddings[0]),
                 self.cluster_kernel],
                axis=-1,
            )
        return ops.cast(kernel, self.compute_dtype)

    def tail_projection(self, i):
        """`P_i` `[d, d_i]` in the compute dtype."""
        if self.adaptive_embedding is None:
            matrix = self.tail_projections[i]
        else:
            matrix = ops.transpose(self.adaptive_embedding.band_projections[i + 1])
        return ops.cast(matrix, self.compute_dtype)

    def tail_kernel(self, i):
        """`W_i` `[d_i, size_i]` in the compute dtype."""
        if self.adaptive_embedding is None:
            matrix = self.tail_kernels[i]
        else:
            matrix = ops.transpose(self.adaptive_embedding.band_embeddings[i + 1])
        return ops.cast(matrix, self.compute_dtype)

    def output_kernel(self):
        raise ValueError(
            "AdaptiveSoftmax has no single [d, V] output matrix (its tail "
            "clusters project h to narrower vectors); use `head_matrix()`, "
            "`tail_projection(i)` and `tail_kernel(i)`."
        )

    # ---------------------------------------------------------------- scores
    def head_logits(self, inputs):
        """Head-cluster scores `z = h U + a`, float32 `[..., c_0 + C]`."""
        inputs = ops.cast(self._check_inputs(inputs), self.compute_dtype)
        return self._head_scores(inputs)

    def _head_scores(self, h):
        z = ops.cast(ops.matmul(h, self.head_matrix()), self.accumulation_dtype)
        if self.head_bias is not None:
            z = z + ops.cast(self.head_bias, self.accumulation_dtype)
        return z

    def tail_weights(self, i):
        """`(P_i, W_i, b_i or None)` as tensors (compute dtype; bias float32)."""
        bias = None
        if self.tail_biases:
            bias = ops.cast(self.tail_biases[i], self.accumulation_dtype)
        return self.tail_projection(i), self.tail_kernel(i), bias

    def tail_scores(self, h, i, weights=None):
        """Tail `i`'s scores `(h P_i) W_i + b_i`, float32 `[..., size_i]`,
        for `h` in the compute dtype (`weights`: `tail_weights(i)`)."""
        projection, kernel, bias = weights or self.tail_weights(i)
        x = ops.matmul(h, projection)
        z = ops.cast(ops.matmul(x, kernel), self.accumulation_dtype)
        if bias is not None:
            z = z + bias
        return z

    def _to_word_order(self, ranked):
        return ops.take(ranked, self._rank_table(), axis=-1)

    def logits(self, inputs):
        """Within-cluster scores `[..., V]` (float32), word-id order: head
        words' head scores, tail words' tail scores (see the class doc)."""
        h = ops.cast(self._check_inputs(inputs), self.compute_dtype)
        parts = [self._head_scores(h)[..., : self.cutoffs[0]]]
        parts += [self.tail_scores(h, i) for i in range(self.num_clusters)]
        return self._to_word_order(ops.concatenate(parts, axis=-1))

    def log_probs(self, inputs):
        """Exact normalised log-probabilities, float32 `[..., V]`."""
        h = ops.cast(self._check_inputs(inputs), self.compute_dtype)
        head_lp = ops.log_softmax(self._head_scores(h), axis=-1)
        c0 = self.cutoffs[0]
        parts = [head_lp[..., :c0]]
        for i in range(self.num_clusters):
            tail_lp = ops.log_softmax(self.tail_scores(h, i), axis=-1)
            parts.append(tail_lp + head_lp[..., c0 + i : c0 + i + 1])
        return self._to_word_order(ops.concatenate(parts, axis=-1))

    # ------------------------------------------------------- cheap likelihood
    def log_likelihood(self, inputs, targets):
        """Exact `log p(targets | inputs)` without the `[..., V]` scores.

        The head softmax for every token (`c_0 + C` scores) and, per tail,
        the scores of the tokens whose target lies in it
        (`tail_log_likelihood`).

        Args:
            inputs: context vectors `[..., d]`.
            targets: int word ids `[...]` in `[0, V)`.

        Returns:
            float32 tensor of shape `targets.shape`. Out-of-range ids raise
            a `ValueError` eagerly (`InvalidArgumentError` from a TensorFlow
            graph) and give NaN under XLA (`validation.check_targets`).
        """
        h = self._rows(inputs)
        targets = check_targets(targets, self.vocab_size)
        rank, band, head_index = self._clusters_of(targets)
        if self.chunk_size is None:
            ll = gather_targets(ops.log_softmax(self._head_scores(h), axis=-1), head_index)
        else:
            head_bias = None
            if self.head_bias is not None:
                head_bias = ops.cast(self.head_bias, self.accumulation_dtype)
            ll = -ops.cast(chunked_pointwise_nll(
                h, self.head_matrix(), head_bias, head_index, chunk_size=self.chunk_size,
            ), self.accumulation_dtype)
        for i in range(self.num_clusters):
            member, local = self._tail_members(rank, band, i)
            ll = ll + self.tail_log_likelihood(h, member, local, i)
        ll = ops.reshape(ll, ops.shape(targets))
        return nan_if_invalid(ll, targets, self.vocab_size)

    def _rows(self, inputs):
        """The checked inputs as `[N, d]` rows in the compute dtype."""
        inputs = self._check_inputs(inputs)
        return ops.reshape(ops.cast(inputs, self.compute_dtype), (-1, self.input_dim))

    def _clusters_of(self, targets):
        """`(rank, band, head_index)` of checked `targets`, all `[N]`
        (flattened, clipped into `[0, V)`): each target's frequency rank,
        its cluster (`band`: 0 the head, `i + 1` tail `i`) and its column of
        the head cluster (its rank, or `c_0 + i` for tail `i`)."""
        t = ops.clip(ops.reshape(targets, (-1,)), 0, self.vocab_size - 1)
        rank = ops.take(self._rank_table(), t)
        cutoffs = ops.convert_to_tensor(np.asarray(self.cutoffs, np.int32))
        band = ops.sum(
            ops.cast(ops.expand_dims(rank, -1) >= ops.expand_dims(cutoffs, 0), "int32"),
            axis=-1,
        )
        head_index = ops.where(band == 0, rank, self.cutoffs[0] + band - 1)
        return rank, band, head_index

    def _tail_members(self, rank, band, i):
        """`(member, local)` of tail `i`: bool `[N]` and the targets'
        positions in the tail (clipped)."""
        return band == i + 1, ops.clip(rank - self.cutoffs[i], 0, self.tail_sizes[i] - 1)

    def summed_training_loss(self, inputs, targets, weights, training=True):
        """`sum_i weights_i (-log p(targets_i | inputs_i))`, a float32 scalar.

        With `gradient_in_forward=True`, the head cluster's NLL by autodiff
        and each tail's by `static_tail_summed_nll` (its gradient computed
        in the forward pass, blocks of an eighth of its capacity), in
        `head_utils.summed_over_valid_targets`' frame; otherwise
        `training_loss` weighted and summed. A word id outside `[0, V)` with
        a non-zero weight makes the sum NaN.
        """
        if not self.gradient_in_forward:
            return super().summed_training_loss(inputs, targets, weights, training)
        h = self._rows(inputs)
        n = ops.shape(h)[0]
        if not isinstance(n, int):  # no static batch size: no capacity
            return super().summed_training_loss(inputs, targets, weights, training)
        targets = check_targets(targets, self.vocab_size)
        capacities = self.tail_capacities(n)

        def summed(ids, w):
            rank, band, head_index = self._clusters_of(ids)
            head_ll = gather_targets(ops.log_softmax(self._head_scores(h), axis=-1), head_index)
            loss = -ops.sum(w * head_ll)
            for i in range(self.num_clusters):
                member, local = self._tail_members(rank, band, i)
                projection, kernel, bias = self.tail_weights(i)
                loss = loss + static_tail_summed_nll(
                    h, member, local, w, projection, kernel, bias, capacities[i],
                    self.accumulation_dtype)
            return loss

        return summed_over_valid_targets(targets, weights, self.vocab_size, summed,
                                         dtype=self.accumulation_dtype)

    def tail_log_likelihood(self, h, member, local, i):
        """`log p(w | tail i, h)` for the members of tail `i`, 0 elsewhere.

        The one dispatch point between the static path (blocks of the tail's
        capacity, XLA) and the dynamic path (`static_shapes=False`).

        Args:
            h: `[N, d]` context vectors (compute dtype).
            member: bool `[N]`, whether a token's target is in tail `i`.
            local: int32 `[N]`, the target's position in tail `i` (clipped).
            i: int, the tail.

        Returns:
            `[N]` float32.
        """
        if not self.static_shapes:
            rows = ops.cast(ops.nonzero(member)[0], "int32")  # data-dependent
            return self.gathered_tail_log_likelihood(h, member, local, rows, i)
        weights = self.tail_weights(i)
        n = ops.shape(h)[0]
        if not isinstance(n, int):
            # Batch size unknown at trace time (a TensorFlow graph with a
            # `None` batch): no static capacity; every token scored, in token
            # order, the members' values kept.
            ll = self._tail_rows_log_likelihood(h, local, i, weights)
            return ops.where(member, ll, ops.zeros_like(ll))
        projection, kernel, bias = weights
        return static_tail_log_likelihood(
            h, member, local, projection, kernel, bias,
            capacity(n, self.tail_fractions[i], self.capacity_factor), self.accumulation_dtype,
            chunk_size=self.chunk_size,
        )

    def gathered_tail_log_likelihood(self, h, member, local, rows, i, weights=None):
        """Tail `i`'s log-softmax at the targets of tokens `rows` (members
        first, in token order, then any padding rows), scattered back.

        `O(K (d d_i + d_i size_i))` for `K = len(rows)`; rows beyond the
        members are computed and never read.
        """
        ll_rows = self._tail_rows_log_likelihood(
            ops.take(h, rows, axis=0), ops.take(local, rows), i, weights)  # [K]
        k = ops.shape(rows)[0]
        slot = ops.cumsum(ops.cast(member, "int32")) - 1  # a member's row
        padded = ops.concatenate([ll_rows, ops.zeros((1,), ll_rows.dtype)], axis=0)
        return ops.take(padded, ops.where(member, slot, k))

    def _tail_rows_log_likelihood(self, h_rows, local_rows, i, weights=None):
        """`log p(local_rows | tail i, h_rows)`, `[K]` float32: each row's
        tail log-softmax at its target (tiled with `chunk_size`)."""
        if self.chunk_size is not None:
            projection, kernel, bias = weights or self.tail_weights(i)
            return -ops.cast(chunked_pointwise_nll(
                ops.matmul(h_rows, projection), kernel, bias, local_rows,
                chunk_size=self.chunk_size,
            ), self.accumulation_dtype)
        z = self.tail_scores(h_rows, i, weights)  # [K, size_i]
        # The target's score by a gather, as in `static_tail_log_likelihood`.
        return gather_targets(z, local_rows) - ops.logsumexp(z, axis=-1)

    def tail_capacities(self, num_tokens):
        """The capacities `K_i` (rows of a block) for a batch of `num_tokens`.

        >>> AdaptiveSoftmax(1000, cutoffs=[10, 100]).tail_capacities(2048)
        [823, 837]
        """
        n = int(num_tokens)
        return [capacity(n, f, self.capacity_factor) for f in self.tail_fractions]

    def count_params(self):
        """The head's own parameters; a tied `adaptive_embedding`'s tables
        and projections are counted by the embedding layer."""
        if self.adaptive_embedding is None or not self.built:
            return super().count_params()
        tied = {id(v) for v in self.adaptive_embedding.weights}
        return int(sum(math.prod(v.shape) for v in self.weights if id(v) not in tied))

    # ------------------------------------------------------------ serialising
    def get_config(self):
        config = super().get_config()
        config.pop("token_embedding", None)
        config.update(
            {
                "cutoffs": list(self.cutoffs),
                "factor": self.factor,
                "counts": counts_to_config(self.counts),
                "adaptive_embedding": (
                    keras.layers.serialize(self.adaptive_embedding)
                    if self.adaptive_embedding is not None
                    else None
                ),
                "static_shapes": self.static_shapes,
                "capacity_factor": self.capacity_factor,
                "chunk_size": self.chunk_size,
                "gradient_in_forward": self.gradient_in_forward_option,
            }
        )
        return config
