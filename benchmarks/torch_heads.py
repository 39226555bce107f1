"""The PyTorch reference heads and losses the benchmarks measure ours against.

Plain PyTorch (no Keras), float32, op by op, every gradient by autograd.
Each head holds its weights (`parameters`, on `device`) and gives the
summed negative log-likelihood of targets `y` (`loss(x, y)`, the training
step's) and their exact summed log-likelihood (`log_likelihood(x, y)`,
forward only). `train_call` / `eval_call` wrap a head into the timed calls
of `measure.time_calls`. The formulas are in `docs/benchmarks.md`:

* `FullSoftmax`: `F.linear` + `F.cross_entropy(reduction="sum")`;
* `PLIFGatherOnCumsum`: the PLIF of Ganea et al. (2019) as its PyTorch port
  writes it (two gathers on the slopes and their cumulative sum);
* `MixtureOfSoftmaxes`: Yang et al.'s MoS, in log space;
* `AdaptiveSoftmax`: `torch.nn.AdaptiveLogSoftmaxWithLoss`;
* `linear_cross_entropy_step`: PyTorch's chunked `F.linear_cross_entropy`
  and the dense `F.cross_entropy(h @ W.T, t)`.

Imports PyTorch; import this module only in the processes that run it.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F


def parameter(array, device):
    """A float32 leaf tensor on `device` that requires gradients, from NumPy."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device).requires_grad_(True)


def zeros(*shape, device):
    """Zeros on `device` that require gradients."""
    return torch.zeros(*shape, device=device, requires_grad=True)


def gather_sum(log_p, y):
    """`sum_i log_p[i, y_i]`."""
    return log_p.gather(1, y[:, None]).sum()


class FullSoftmax:
    """`log_softmax(x W^T + b)`: weights `W` `[V, d]` (`nn.Linear`'s layout),
    `b` zeros.

    Args:
        kernel: the NumPy `[V, d]` weights.
        device: the `torch.device` of the weights.
    """

    def __init__(self, kernel, device):
        self.parameters = [parameter(kernel, device), zeros(kernel.shape[0], device=device)]

    def scores(self, x):
        return F.linear(x, self.parameters[0], self.parameters[1])

    def loss(self, x, y):
        return F.cross_entropy(self.scores(x), y, reduction="sum")

    def log_likelihood(self, x, y):
        return gather_sum(F.log_softmax(self.scores(x), dim=-1), y)


class PLIFGatherOnCumsum(FullSoftmax):
    """The PLIF of Ganea et al. (2019), as its PyTorch port writes it.

    Logits `z = x W^T + b`; slopes `s = softplus(v)` `[K]` (at the identity:
    `v = log(e - 1)`), their exclusive cumulative sum `c`, interval index
    `i = clamp(long((z + T) / delta), 0, K - 1)`, `delta = 2T / K`;
    `f(z) = (z - (-T + i delta)) s[i] + delta c[i]`.

    Args:
        kernel: the NumPy `[V, d]` weights.
        knots: `K`.
        bound: `T`.
        device: the `torch.device` of the weights.
    """

    def __init__(self, kernel, knots, bound, device):
        super().__init__(kernel, device)
        self.knots, self.bound, self.delta = knots, bound, 2.0 * bound / knots
        self.parameters.append(torch.full((knots,), math.log(math.e - 1.0), device=device,
                                          requires_grad=True))

    def scores(self, x):
        z = super().scores(x)
        flat = z.reshape(-1)
        idx = torch.clamp(((flat + self.bound) / self.delta).detach().long(),
                          min=0, max=self.knots - 1)
        slopes = F.softplus(self.parameters[2])
        cum = torch.cumsum(slopes, dim=-1) - slopes
        s = torch.gather(slopes, -1, idx)
        c = torch.gather(cum, -1, idx)
        knot = -self.bound + self.delta * idx.float()
        return ((flat - knot) * s + self.delta * c).view(z.shape)


class MixtureOfSoftmaxes(FullSoftmax):
    """Yang et al.'s mixture of softmaxes, in log space.

    Prior `softmax(x W_p)` (no bias), latents `tanh(x W_l + b_l)` reshaped to
    `[N K, d]`, `logits = latent W^T + b`; the target's `log_softmax` in each
    component, `logsumexp` with the log priors.

    Args:
        kernel: the NumPy `[V, d]` output weights.
        components: `K` (at least 1).
        device: the `torch.device` of the weights.
    """

    def __init__(self, kernel, components, device):
        if components < 1:
            raise ValueError(f"--mixture-components must be >= 1, got {components}")
        from reference_inputs import glorot  # benchmarks/reference_inputs.py

        super().__init__(kernel, device)
        d = kernel.shape[1]
        self.components = components
        self.parameters += [parameter(glorot((components, d), seed=3), device),
                            parameter(glorot((components * d, d), seed=4), device),
                            zeros(components * d, device=device)]

    def component_log_likelihoods(self, x, y):
        """`[N, K]`: log prior plus the target's log-probability per component."""
        n, d = x.shape
        v, k = self.parameters[0].shape[0], self.components
        log_prior = F.log_softmax(F.linear(x, self.parameters[2]), dim=-1)
        latent = torch.tanh(F.linear(x, self.parameters[3], self.parameters[4])).view(n * k, d)
        log_p = F.log_softmax(F.linear(latent, self.parameters[0], self.parameters[1]),
                              dim=-1).view(n, k, v)
        return log_prior + log_p.gather(2, y.view(n, 1, 1).expand(n, k, 1)).squeeze(2)

    def log_likelihood(self, x, y):
        return torch.logsumexp(self.component_log_likelihoods(x, y), dim=1).sum()

    def loss(self, x, y):
        return -self.log_likelihood(x, y)


class AdaptiveSoftmax:
    """`torch.nn.AdaptiveLogSoftmaxWithLoss(d, V, cutoffs, div_value)`,
    initialised after `torch.manual_seed(seed)`.

    `loss` is `forward(x, y).loss * N`; `log_likelihood` gathers the full
    exact `log_prob(x)` matrix at the targets; `target_log_likelihood` sums
    `forward(x, y).output`, the same numbers without the `[N, V]` matrix.
    """

    def __init__(self, dim, vocab_size, cutoffs, div_value=4.0, seed=0, device="cpu"):
        torch.manual_seed(seed)
        self.module = torch.nn.AdaptiveLogSoftmaxWithLoss(
            dim, vocab_size, list(cutoffs), div_value=float(div_value)).to(device)
        self.parameters = list(self.module.parameters())

    def loss(self, x, y):
        return self.module(x, y).loss * x.shape[0]

    def log_likelihood(self, x, y):
        return gather_sum(self.module.log_prob(x), y)

    def target_log_likelihood(self, x, y):
        return self.module(x, y).output.sum()


def train_call(head, h, y):
    """`call() -> float`: the loss and `torch.autograd.grad` with respect to
    `h` and every weight of `head`."""

    def call():
        x = h.detach().requires_grad_(True)
        loss = head.loss(x, y)
        torch.autograd.grad(loss, [x] + head.parameters)
        return float(loss.detach())

    return call


def eval_call(log_likelihood, h, y):
    """`call() -> float`: `log_likelihood(h, y)` under `torch.no_grad()`."""

    def call():
        with torch.no_grad():
            return float(log_likelihood(h, y))

    return call


def matmul_call(h, w):
    """`call() -> float`: `sum(h @ w)` under `torch.no_grad()`."""

    def call():
        with torch.no_grad():
            return float(torch.matmul(h, w).sum())

    return call


def linear_cross_entropy_step(row):
    """`step(h, w, t) -> float`: the mean cross-entropy of `h w^T` and its
    gradients by `loss.backward()` (`.grad` cleared first); `row` is
    `torch_chunked` (`F.linear_cross_entropy`) or `torch_dense`."""

    def step(h, w, t):  # `w` may be frozen (no `requires_grad`)
        h.grad = w.grad = None
        if row == "torch_chunked":
            loss = F.linear_cross_entropy(h, w, t, options=torch.nn.LinearCrossEntropyOptions())
        else:
            loss = F.cross_entropy(h @ w.T, t)
        loss.backward()
        return float(loss.detach())

    return step


def set_threads(threads, interop=None):
    """`torch.set_num_threads(threads)` (and the inter-op pool, if not yet
    started); returns the intra-op thread count."""
    torch.set_num_threads(threads)
    if interop is not None:
        try:
            torch.set_num_interop_threads(interop)
        except RuntimeError:  # already started
            pass
    return torch.get_num_threads()
