"""Synthetic corpus from a known, random, high-rank bigram language model.

Generating process (after Ganea et al. 2019, "Breaking the Softmax
Bottleneck via Learnable Monotonic Pointwise Non-linearities", §5.1, here
conditioned on the previous word so that it is a proper sequence model):

1. Zipf prior over the vocabulary: `z_w ∝ (w + 1) ** -zipf_exponent`,
   `w = 0..V-1` (id 0 is the most frequent word a priori).
2. For every context (previous word) `c`, an independent next-word
   distribution `D_c ~ Dirichlet(concentration * z)`.
3. A uniform floor makes the chain irreducible and aperiodic:
   `P(w | c) = (1 - uniform_floor) * D_c[w] + uniform_floor / V`.
4. A single Markov chain `x_0 ~ π, x_t ~ P(· | x_{t-1})` of length
   `num_train + num_valid + num_test` is sampled and cut, in that order, into
   train / valid / test, where `π` is the stationary distribution
   (`π P = π`).

Because the rows are independent Dirichlet draws, `log P` has (almost surely)
full rank V, far above any practical embedding size: a softmax head with
`d < V` cannot represent it exactly (the "softmax bottleneck").

The exact entropy rate of the chain (nats/token) is
`H = -Σ_c π(c) Σ_w P(w|c) log P(w|c)`, the best achievable expected
per-token loss. For a finite sample, the realistic floor is the empirical
cross-entropy of the split under the true model,
`-mean_t log P(x_t | x_{t-1})` (`MarkovLanguageModel.cross_entropy`), stored
in `LMCorpus.info`.

Everything is numpy-only and deterministic given `seed`.
"""

from __future__ import annotations

import numpy as np

from keras_softmax_heads.data.corpus import LMCorpus
from keras_softmax_heads.data.vocabulary import Vocabulary


class MarkovLanguageModel:
    """A first-order (bigram) Markov language model with known probabilities.

    Args:
        transition: `[V, V]` row-stochastic matrix, `transition[c, w] =
            P(next = w | previous = c)`. All entries must be positive
            (irreducible, aperiodic chain), rows must sum to 1.

    Attributes:
        transition: the `[V, V]` float64 matrix (read-only).
        stationary: the stationary distribution `π` `[V]`.
        entropy_rate: `-Σ_c π(c) Σ_w P(w|c) log P(w|c)`, nats per token.

    Example:

    >>> model = MarkovLanguageModel.random(vocab_size=100, seed=0)
    >>> ids = model.sample(10_000, seed=1)
    >>> abs(model.cross_entropy(ids) - model.entropy_rate) < 0.1
    True
    """

    def __init__(self, transition: np.ndarray):
        p = np.array(transition, dtype=np.float64)
        if p.ndim != 2 or p.shape[0] != p.shape[1] or p.shape[0] < 2:
            raise ValueError(
                f"`transition` must be a square [V, V] matrix with V >= 2. "
                f"Received: shape={p.shape}"
            )
        if not np.all(np.isfinite(p)) or p.min() <= 0:
            raise ValueError(
                "`transition` entries must be finite and > 0 (this keeps the chain "
                f"irreducible). Received: min={p.min()}"
            )
        row_sums = p.sum(axis=1)
        if np.max(np.abs(row_sums - 1.0)) > 1e-6:
            raise ValueError(
                "`transition` rows must sum to 1. Received: max |row sum - 1| = "
                f"{np.max(np.abs(row_sums - 1.0)):.3g}"
            )
        p /= row_sums[:, None]
        p.setflags(write=False)
        self.transition = p
        self._log_p = np.log(p)
        self._log_p.setflags(write=False)
        self.stationary = _stationary_distribution(p)
        self.stationary.setflags(write=False)
        row_entropy = -np.sum(p * self._log_p, axis=1)
        self.entropy_rate = float(self.stationary @ row_entropy)
        self._cdf = None

    @property
    def vocab_size(self) -> int:
        """`V`."""
        return self.transition.shape[0]

    @classmethod
    def random(
        cls,
        vocab_size: int = 1000,
        *,
        zipf_exponent: float = 1.0,
        concentration: float | None = None,
        uniform_floor: float = 1e-3,
        seed: int = 0,
    ) -> "MarkovLanguageModel":
        """Samples a random high-rank bigram model (see the module docstring).

        Args:
            vocab_size: `V` (>= 2).
            zipf_exponent: exponent `s` of the Zipf prior `(w + 1) ** -s`.
            concentration: Dirichlet concentration `α`; each row is
                `Dirichlet(α · z)`. Larger = rows closer to the Zipf prior
                (higher entropy). Default `vocab_size / 10`.
            uniform_floor: mixing weight `ε` of the uniform distribution
                (`0 < ε < 1`).
            seed: seed of `np.random.default_rng`.

        Returns:
            A `MarkovLanguageModel`.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 2:
            raise ValueError(f"`vocab_size` must be an integer >= 2. Received: vocab_size={vocab_size!r}")
        if concentration is None:
            concentration = vocab_size / 10.0
        if not concentration > 0:
            raise ValueError(f"`concentration` must be > 0. Received: concentration={concentration}")
        if not 0 < uniform_floor < 1:
            raise ValueError(f"`uniform_floor` must be in (0, 1). Received: uniform_floor={uniform_floor}")
        if not zipf_exponent >= 0:
            raise ValueError(f"`zipf_exponent` must be >= 0. Received: zipf_exponent={zipf_exponent}")
        rng = np.random.default_rng(seed)
        zipf = zipf_prior(vocab_size, zipf_exponent)
        gammas = rng.standard_gamma(concentration * zipf, size=(vocab_size, vocab_size))
        sums = gammas.sum(axis=1, keepdims=True)
        # A row can underflow to all zeros only for absurdly small α; fall back
        # to the prior there.
        dirichlet = np.where(sums > 0, gammas / np.where(sums > 0, sums, 1.0), zipf[None, :])
        p = (1.0 - uniform_floor) * dirichlet + uniform_floor / vocab_size
        return cls(p)

    # --------------------------------------------------------------- queries
    def next_word_probs(self, context_ids) -> np.ndarray:
        """True next-word distributions for a batch of contexts.

        Args:
            context_ids: int array `[N]` of previous-word ids, or `[N, L]`
                histories (only the last column matters for a bigram model).

        Returns:
            float64 array `[N, V]` (rows sum to 1).
        """
        ctx = self._last_context(context_ids)
        return self.transition[ctx]

    def next_word_log_probs(self, context_ids) -> np.ndarray:
        """`log(next_word_probs(context_ids))`, float64 `[N, V]`."""
        return self._log_p[self._last_context(context_ids)]

    def log_prob(self, ids) -> np.ndarray:
        """Per-transition log-probabilities `log P(ids[t] | ids[t-1])`, `t >= 1`.

        Args:
            ids: 1-D id sequence of length `T >= 2`.

        Returns:
            float64 array `[T - 1]`.
        """
        ids = self._ids(ids)
        if ids.size < 2:
            raise ValueError(f"Need at least 2 tokens for a transition. Received: {ids.size}")
        return self._log_p[ids[:-1], ids[1:]]

    def cross_entropy(self, ids) -> float:
        """Empirical cross-entropy (nats/token) of `ids` under the true model.

        The mean of `-log P(ids[t] | ids[t-1])` over `t = 1..T-1`: the loss a
        perfect model attains when predicting every token but the first from
        its predecessor (the realistic floor for this finite sample).
        """
        return float(-np.mean(self.log_prob(ids)))

    # -------------------------------------------------------------- sampling
    def sample(self, num_tokens: int, seed: int | np.random.Generator = 0,
               initial: int | None = None) -> np.ndarray:
        """Samples `num_tokens` tokens from the chain.

        `x_0 ~ π` (or `P(· | initial)` when `initial` is given), then
        `x_t ~ P(· | x_{t-1})`. Implementation: for each context `c`, a buffer
        of i.i.d. draws from `P(· | c)` is pre-sampled (vectorized inverse
        CDF); the walk consumes the buffer of its current context in order,
        which is an exact sample of the chain. Deterministic given `seed`.

        Args:
            num_tokens: length `T >= 1`.
            seed: int seed or a `np.random.Generator`.
            initial: optional context before `x_0`.

        Returns:
            `np.ndarray[int32]` `[T]`.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
            raise ValueError(f"`num_tokens` must be a positive integer. Received: num_tokens={num_tokens!r}")
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        v = self.vocab_size
        if self._cdf is None:
            cdf = np.cumsum(self.transition, axis=1)
            cdf[:, -1] = 1.0
            # Row c shifted by c: one globally sorted array for searchsorted.
            self._cdf = (cdf + np.arange(v)[:, None]).ravel()
        if initial is None:
            stationary_cdf = np.cumsum(self.stationary)
            first = int(min(np.searchsorted(stationary_cdf, rng.random() * stationary_cdf[-1],
                                            side="right"), v - 1))
        else:
            first = int(self._draw(np.array([int(initial)]), rng)[0])
        # Expected visits per context + slack; refilled on demand (rare).
        need = np.ceil(num_tokens * self.stationary * 1.1 + 4 * np.sqrt(num_tokens * self.stationary) + 8)
        need = need.astype(np.int64)
        draws = self._draw(np.repeat(np.arange(v), need), rng)
        ends = np.cumsum(need).tolist()
        starts = [0] + ends[:-1]
        draws = draws.tolist()
        # Reversed so that list.pop() (from the end) consumes draws in order.
        buffers = [draws[s:e][::-1] for s, e in zip(starts, ends)]
        out = [first]
        append = out.append
        x = first
        for _ in range(num_tokens - 1):
            buf = buffers[x]
            if not buf:
                buf.extend(self._draw(np.full(64, x), rng).tolist()[::-1])
            x = buf.pop()
            append(x)
        return np.asarray(out, dtype=np.int32)

    def _draw(self, contexts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        u = rng.random(contexts.size)
        idx = np.searchsorted(self._cdf, contexts + u, side="right") - contexts * self.vocab_size
        return np.clip(idx, 0, self.vocab_size - 1).astype(np.int32)

    # --------------------------------------------------------------- helpers
    def _last_context(self, context_ids) -> np.ndarray:
        ctx = np.asarray(context_ids)
        if ctx.ndim == 2:
            ctx = ctx[:, -1]
        if ctx.ndim != 1:
            raise ValueError(
                f"`context_ids` must have shape [N] or [N, L]. Received: shape={ctx.shape}"
            )
        return self._ids(ctx, name="context_ids")

    def _ids(self, ids, name: str = "ids") -> np.ndarray:
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"`{name}` must be integer ids. Received: dtype={ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"`{name}` must be in [0, {self.vocab_size}). "
                f"Received: min={ids.min()}, max={ids.max()}"
            )
        return ids.reshape(-1)


def zipf_prior(vocab_size: int, exponent: float = 1.0) -> np.ndarray:
    """Normalized Zipf distribution `∝ (w + 1) ** -exponent`, `w = 0..V-1`."""
    weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -float(exponent)
    return weights / weights.sum()


def _stationary_distribution(p: np.ndarray, tol: float = 1e-13, max_iter: int = 100_000) -> np.ndarray:
    """Stationary `π` of a positive stochastic matrix (`π P = π`)."""
    v = p.shape[0]
    pi = np.full(v, 1.0 / v)
    for _ in range(max_iter):
        nxt = pi @ p
        nxt /= nxt.sum()
        if np.abs(nxt - pi).sum() < tol:
            return nxt
        pi = nxt
    # Fallback: direct solve of (P^T - I) π = 0 with Σπ = 1.
    a = p.T - np.eye(v)
    a[-1, :] = 1.0
    b = np.zeros(v)
    b[-1] = 1.0
    pi = np.linalg.solve(a, b)
    pi = np.clip(pi, 0, None)
    return pi / pi.sum()


def make_synthetic_corpus(
    vocab_size: int = 1000,
    num_train_tokens: int = 250_000,
    num_valid_tokens: int = 25_000,
    num_test_tokens: int = 25_000,
    *,
    zipf_exponent: float = 1.0,
    concentration: float | None = None,
    uniform_floor: float = 1e-3,
    seed: int = 0,
) -> LMCorpus:
    """The embedded default corpus: a sample of a random high-rank bigram LM.

    See the module docstring for the generating process. Token `i` is named
    `"w{i}"` (zero-padded); ids follow the Zipf prior rank, so small ids are
    (roughly) frequent. There is no `<eos>`/`<unk>`: the corpus is one
    unbroken stream.

    Args:
        vocab_size: `V`.
        num_train_tokens: train split length.
        num_valid_tokens: valid split length.
        num_test_tokens: test split length.
        zipf_exponent: Zipf prior exponent.
        concentration: Dirichlet concentration `α` (default `V / 10`).
        uniform_floor: uniform mixing weight `ε`.
        seed: seed; the model uses `seed`, the sample an independent stream.

    Returns:
        An `LMCorpus` with `true_model` (a `MarkovLanguageModel`) and `info`
        holding `entropy_rate` and `{split}_cross_entropy` (empirical
        cross-entropy of each split under the true model).

    Example:

    >>> corpus = make_synthetic_corpus(vocab_size=1000, seed=0)
    >>> round(corpus.true_model.entropy_rate, 2) <= corpus.info["unigram_entropy"]
    True
    """
    sizes = {"train": num_train_tokens, "valid": num_valid_tokens, "test": num_test_tokens}
    for split, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
            raise ValueError(
                f"`num_{split}_tokens` must be an integer >= 2 (an empty split is "
                f"not a corpus). Received: num_{split}_tokens={n!r}"
            )
    model = MarkovLanguageModel.random(
        vocab_size,
        zipf_exponent=zipf_exponent,
        concentration=concentration,
        uniform_floor=uniform_floor,
        seed=seed,
    )
    sample_rng = np.random.default_rng([seed, 1])
    stream = model.sample(sum(sizes.values()), seed=sample_rng)
    train, valid, test = np.split(stream, np.cumsum([num_train_tokens, num_valid_tokens]))
    width = len(str(vocab_size - 1))
    vocab = Vocabulary(
        [f"w{i:0{width}d}" for i in range(vocab_size)],
        counts=np.bincount(train, minlength=vocab_size),
        unk_token=None,
    )
    pi = model.stationary
    info = {
        "entropy_rate": model.entropy_rate,
        "unigram_entropy": float(-np.sum(pi * np.log(pi))),
        "train_cross_entropy": model.cross_entropy(train),
        "valid_cross_entropy": model.cross_entropy(valid),
        "test_cross_entropy": model.cross_entropy(test),
        "generator": {
            "vocab_size": vocab_size,
            "zipf_exponent": zipf_exponent,
            "concentration": model_concentration(vocab_size, concentration),
            "uniform_floor": uniform_floor,
            "seed": seed,
        },
    }
    return LMCorpus(train, valid, test, vocab, true_model=model, name="synthetic", info=info)


def model_concentration(vocab_size: int, concentration: float | None) -> float:
    """The Dirichlet concentration actually used (`V / 10` by default)."""
    return float(vocab_size / 10.0 if concentration is None else concentration)
