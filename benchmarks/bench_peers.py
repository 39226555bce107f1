"""Our heads against what users would use instead, on the same machine in the same run.

Two *sides*, each run in its own child processes on the same machine, one
after the other for every vocabulary size `V`:

* `keras_softmax_heads (<backend> xla)`: the library's `FullSoftmax`,
  `PLIFSoftmax` (`--plif-knots` knots on `[-T, T]`, `T = --plif-bound`) and
  `MixtureOfSoftmaxes` (`--mixture-components` components) on the Keras
  backend `--our-backend` (`steps.py`, mode `xla`):

  - `tensorflow` (default): each step under `tf.function(jit_compile=True)`,
    on the CPU (the child sees no GPU);
  - `jax`: each step under `jax.jit`, on JAX's default device (its GPU
    when JAX has one, else the CPU); nothing on this side imports
    TensorFlow, so it runs where TensorFlow is not installed;
* `pytorch eager` (`--torch-device cpu`, default) or `pytorch eager (cuda)`
  (`--torch-device cuda`): plain PyTorch (no Keras), float32, op by op,
  every tensor and weight (inputs, targets, the PLIF slopes, the mixture's
  weights, the adaptive softmax's module) on that device:

  - `full softmax`: `F.linear` + `F.cross_entropy(reduction="sum")`;
  - `PLIF gather-on-cumsum`: the PLIF of Ganea et al. (2019) as written in
    its PyTorch port: logits `z = h W^T + b`, slopes `s = softplus(v)`
    `[K]`, their exclusive cumulative sum `c`, interval index
    `i = clamp(long((z + T) / delta), 0, K - 1)` with `delta = 2T / K`,
    `f(z) = (z - (-T + i delta)) s[i] + delta c[i]` (two `torch.gather`
    over the `N V` scores), then `cross_entropy` of `f(z)`; every gradient
    by autograd;
  - `MoS`: Yang et al.'s mixture of softmaxes (prior `softmax(h W_p)`
    without bias, latents `tanh(h W_l + b_l)` reshaped to `[N K, d]`,
    `logits = latent W^T + b`), in log space: the target's `log_softmax` in
    each component, `logsumexp` with the log priors (not the log of a sum
    of probabilities);
  - `AdaptiveLogSoftmaxWithLoss`: `torch.nn.AdaptiveLogSoftmaxWithLoss(d, V,
    cutoffs)` with `div_value=4` (its default) and the cutoffs
    `[round(0.02 V), round(0.1 V), round(0.5 V)]` (deduplicated, kept in
    `(0, V)`): head clusters of 2%, 8%, 40% and 50% of a frequency-sorted
    (Zipfian) vocabulary, the usual shape of its cutoffs. It is a
    different, factorised model (normalised exactly, not a full softmax):
    it is listed as the large-vocabulary head users reach for.

For both sides on one GPU: `--our-backend jax --torch-device cuda`. The
device each side ran on is in the JSON (`devices`, each row's `device`,
`machine.gpu`); the script warns when the two sides ran on different kinds
of device.

Float32 products on a GPU (`--matmul-precision`, default `float32`): JAX
computes float32 products in TensorFloat32 on recent NVIDIA GPUs unless
told otherwise, PyTorch in full float32. The default asks both for full
float32 (`jax_default_matmul_precision="float32"`,
`torch.set_float32_matmul_precision("highest")`); `tf32` asks both for
TensorFloat32 (`"tensorfloat32"`, `"high"`). It is meant for GPUs: on a
CPU both compute in float32 with the default.

Phases:

* `train`: one forward and backward pass of the summed negative
  log-likelihood with respect to `h` `[N, d]` and every weight of the head
  (our side: `steps.train_step(..., reduction="sum")`; PyTorch:
  `torch.autograd.grad` of the same sum; for the adaptive softmax,
  `forward(h, y).loss * N`);
* `eval`: the exact `sum(log p(y | h))`, forward only (our side:
  `steps.eval_step`; PyTorch under `torch.no_grad()`: `log_softmax` and a
  gather, for the adaptive softmax `log_prob(h)` gathered, which is its
  full exact log-probability matrix);
* `forward` (row `matmul`): a bare `[N, d] @ [d, V]` product and the sum of
  its `[N, V]` result (the sum returns a value: without it XLA could
  simplify the product away; it is one pass over the result, small next to
  the `2 d` flops per element), in the same mode as the side's heads (on
  JAX `jnp.sum(h @ W)` under `jax.jit`, waited for with
  `jax.block_until_ready`).

Achieved GFLOP/s, from the median step time `t`:

* `FullSoftmax` / `full softmax` train: `6 N d V / t` (three products: the
  logits, `dL/dh` and `dL/dW`; the softmax itself is not counted);
* their eval: `2 N d V / t`;
* `matmul`: `2 N d V / t`.

`efficiency` in the JSON is each side's full-softmax train GFLOP/s over
the same side's bare-matmul GFLOP/s at the same `V`.

Inputs, the same on both sides: `h ~ N(0, 0.25)` (NumPy, seed 0), targets
drawn from a Zipfian unigram distribution (`counts[r] ∝ 1 / (r + 1)`, ids
sorted by frequency; seed 1). PyTorch's weights are NumPy Glorot-uniform
draws (seed 2; the bare products of both sides use the same matrix); our
heads use their own initialisers (Glorot uniform, zero bias, PLIF slopes at
the identity; `random.seed(0)` before each head is built, from which Keras
draws the initialisers' seeds, so a head's rows have the same weights even
in separate processes), so the scores have the same distribution on both
sides.

Threads: `--threads` (default: the cores this process may run on,
`os.sched_getaffinity`) is TensorFlow's intra-op parallelism
(`tf.config.threading.set_intra_op_parallelism_threads`) and PyTorch's
`torch.set_num_threads`. JAX's thread pool is not set (its rows have no
`threads`); on a GPU the flag only bounds PyTorch's host threads.

Method: one child process per (side, `V`) builds every row's step once and
runs the rows one after the other (on JAX, one child process per row: its
device allocator's peak cannot be reset); each row makes `--warmup` calls
(at least one; the first is the tracing / XLA compilation, reported as
`first_call_s`), then `--repeats` timed calls. On a GPU every call waits
for the device before the clock is read (`jax.block_until_ready`;
`torch.cuda.synchronize()` after every call, the warm-up calls included).
`step_s` is the median wall time of the timed calls, `best_s` the fastest,
`cpu_s` the median process CPU time (user + system, all threads), `value`
what the last call returned (the summed loss or log-likelihood, or the sum
of the product: a check that both sides compute the same thing). Ratios
are to the full softmax of the same side, `V` and phase (`over_side_full`)
and to our `FullSoftmax` at the same `V` and phase (`over_ours_full`),
whichever backend our side ran on.

Peak memory (`peak_mib`), after the warm-up calls; `memory_source` names
the instrument on every row:

* our side on TensorFlow: TensorFlow's CPU allocator peak minus its usage
  before the timed calls (`steps.PeakMemory`; peak RSS does not work there,
  the allocator keeps the pages of earlier rows of the same process);
* our side on JAX: on a device whose allocator keeps statistics (a GPU),
  `peak_bytes_in_use` of `jax.devices()[0].memory_stats()` minus
  `bytes_in_use` before the timed calls (the peak covers the whole
  process, the row's compilation included, which is why each JAX row has
  its own process); on the CPU the process' peak resident size as below
  (`steps.PeakMemory`); otherwise none;
* PyTorch on the CPU: the process' peak resident size minus its resident
  size before the timed calls (`VmHWM` reset through
  `/proc/self/clear_refs`, `proc_memory.py`); close to an allocator's peak
  (PyTorch's CPU allocator returns large blocks to the system) but not the
  same instrument;
* PyTorch on CUDA: `torch.cuda.max_memory_allocated()` after
  `torch.cuda.reset_peak_memory_stats()`, minus `memory_allocated()`
  before the timed calls.

A row that fails is recorded with its error and the others still run (a
child killed, e.g. out of memory, loses only the row it was running; a new
child runs the rest). Rows whose estimated peak, `u` float32 `[N, V]`
tensors, exceeds `--memory-budget-gb` are skipped and listed with the
estimate: `u = 6` for the full-softmax-like steps, `6 K` for the mixtures
(`[N, K, V]` scores), `10` for PyTorch's PLIF (autograd keeps the index, the
knots, the gathered slopes and offsets, `f(z)` and its `log_softmax`), `2`
for the bare product.

Usage:
    python benchmarks/bench_peers.py --quick --out /tmp/peers.json   # smoke run
    python benchmarks/bench_peers.py        # V in {10k, 33k, 100k}, d=512, N=2048
    python benchmarks/bench_peers.py --v 33000 --repeats 9 --memory-budget-gb 16
    python benchmarks/bench_peers.py --our-backend jax --torch-device cuda \\
        --memory-budget-gb 40 --out /tmp/peers_gpu.json   # both sides on the GPU
"""

import argparse
import datetime
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import proc_memory  # benchmarks/proc_memory.py (the script's own folder)
import select_backend  # benchmarks/select_backend.py

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "docs", "results", "bench_peers.json")

SIDES = ("ours", "torch")
OUR_BACKENDS = ("tensorflow", "jax")
TORCH_DEVICES = ("cpu", "cuda")
MATMUL_PRECISION = {  # --matmul-precision: (JAX's setting, PyTorch's setting)
    "float32": ("float32", "highest"),
    "tf32": ("tensorfloat32", "high"),
}
# (key, row name) of each side, in the order they run.
ROWS = {
    "ours": [("full", "FullSoftmax"), ("plif", "PLIFSoftmax"),
             ("mos", "MixtureOfSoftmaxes"), ("matmul", "matmul")],
    "torch": [("full", "full softmax"), ("plif", "PLIF gather-on-cumsum"),
              ("mos", "MoS"), ("adaptive", "AdaptiveLogSoftmaxWithLoss"),
              ("matmul", "matmul")],
}
FLOPS_PER_NDV = {("full", "train"): 6, ("full", "eval"): 2, ("matmul", "forward"): 2}


def side_labels(our_backend="tensorflow", torch_device="cpu"):
    """`{side: label}`: the label names our backend and PyTorch's device."""
    return {"ours": f"keras_softmax_heads ({our_backend} xla)",
            "torch": "pytorch eager" + ("" if torch_device == "cpu" else f" ({torch_device})")}


def tasks_of(side):
    """`key:phase` of every row of `side`."""
    out = []
    for key, _ in ROWS[side]:
        out += [f"{key}:forward"] if key == "matmul" else [f"{key}:train", f"{key}:eval"]
    return out


def row_name(side, key):
    return dict(ROWS[side])[key]


def units(side, key, components):
    """Estimated peak of a row in float32 `[N, V]` tensors."""
    if key == "matmul":
        return 2
    if key == "mos":
        return 6 * components
    if key == "plif" and side == "torch":
        return 10
    return 6


def adaptive_cutoffs(v):
    """`[round(0.02 V), round(0.1 V), round(0.5 V)]`, deduplicated, in `(0, V)`."""
    cuts = sorted({round(v * f) for f in (0.02, 0.1, 0.5)})
    return [c for c in cuts if 0 < c < v]


# ------------------------------------------------------------------- inputs
def numpy_inputs(n, v, d):
    """`h` `[N, d]` ~ N(0, 0.25) and Zipfian int32 targets `[N]` (NumPy)."""
    import numpy as np

    h = np.random.default_rng(0).standard_normal((n, d), dtype=np.float32) * 0.5
    p = 1.0 / np.arange(1, v + 1, dtype=np.float64)
    y = np.random.default_rng(1).choice(v, size=n, p=p / p.sum()).astype(np.int32)
    return h, y


def glorot(shape, seed):
    """A float32 Glorot-uniform `[fan_out, fan_in]` draw (NumPy)."""
    import numpy as np

    limit = math.sqrt(6.0 / (shape[0] + shape[1]))
    rng = np.random.default_rng(seed)
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


# -------------------------------------------------------------------- timing
def measure(call, warmup, repeats, memory, sync=None):
    """Warm-up and timed calls of `call()`; a row's timing and memory.

    `sync()`, if given, waits for the device after every call (the warm-up
    calls included), before the clock is read.
    """
    import numpy as np

    sync = sync or (lambda: None)
    t0 = time.perf_counter()
    value = call()
    sync()
    first = time.perf_counter() - t0
    for _ in range(max(warmup, 1) - 1):
        call()
    sync()
    memory.start()
    wall, cpu = [], []
    for _ in range(max(repeats, 1)):
        t0, c0 = time.perf_counter(), time.process_time()
        value = call()
        sync()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {
        "step_s": float(np.median(wall)), "best_s": float(min(wall)),
        "cpu_s": float(np.median(cpu)), "first_call_s": first, "wall_s": wall,
        "peak_mib": memory.peak_mib(), "memory_source": memory.source,
        "value": value,
    }


class RssPeak:
    """Peak resident size of the calls after `start()`, minus the RSS there."""

    source = "process peak RSS (VmHWM)"

    def __init__(self):
        self._base = None

    def start(self):
        import gc

        gc.collect()
        reset = proc_memory.reset_peak()
        self._base = proc_memory.status()["VmRSS" if reset else "VmHWM"]

    def peak_mib(self):
        return (proc_memory.status()["VmHWM"] - self._base) / 2**20


class NoMemory:
    """No memory reading (a device whose allocator keeps no statistics)."""

    source = None

    def start(self):
        pass

    def peak_mib(self):
        return None


class TorchCudaPeak:
    """`torch.cuda.max_memory_allocated()` of the calls after `start()`, minus
    `memory_allocated()` there (the peak counter is reset at `start()`)."""

    source = "torch CUDA allocator peak (max_memory_allocated)"

    def __init__(self, device):
        self._device = device
        self._base = None

    def start(self):
        import gc

        import torch

        gc.collect()
        torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        self._base = torch.cuda.memory_allocated(self._device)

    def peak_mib(self):
        import torch

        torch.cuda.synchronize(self._device)
        return (torch.cuda.max_memory_allocated(self._device) - self._base) / 2**20


class JaxDevicePeak:
    """`peak_bytes_in_use` of a JAX device's allocator minus its `bytes_in_use`
    at `start()`. JAX cannot reset the peak: it covers the whole process (the
    row's compilation included), hence one process per JAX row."""

    source = "JAX device allocator peak_bytes_in_use (process lifetime, one process per row)"

    def __init__(self, device):
        self._device = device
        self._base = None

    def start(self):
        import gc

        gc.collect()
        self._base = self._device.memory_stats()["bytes_in_use"]

    def peak_mib(self):
        return (self._device.memory_stats()["peak_bytes_in_use"] - self._base) / 2**20


def _error_text(err):
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


# ------------------------------------------------------------ child: ours
def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def child_ours(args):
    select_backend.use(args.our_backend)
    if args.our_backend == "jax":
        import jax
        import jax.numpy as jnp

        jax.config.update("jax_default_matmul_precision",
                          MATMUL_PRECISION[args.matmul_precision][0])
        import keras
        import steps

        device = jax.devices()[0]
        stats = device.memory_stats()
        if stats and "peak_bytes_in_use" in stats and "bytes_in_use" in stats:
            make_memory = lambda: JaxDevicePeak(device)  # noqa: E731
        elif device.platform == "cpu":
            make_memory = steps.PeakMemory
        else:
            make_memory = NoMemory
        is_gpu = device.platform in ("gpu", "cuda", "rocm")
        info = {"versions": {"jax": jax.__version__, "jaxlib": _jaxlib_version(),
                             "keras": keras.__version__},
                "threads": None,
                "device": {"kind": "gpu" if is_gpu else device.platform,
                           "name": device.device_kind, "platform": device.platform},
                "mode": "jax.jit",
                "matmul_precision": MATMUL_PRECISION[args.matmul_precision][0]}
    else:
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        except RuntimeError:  # the runtime is already initialised
            pass
        import keras
        import steps

        make_memory = steps.PeakMemory
        info = {"versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
                "threads": tf.config.threading.get_intra_op_parallelism_threads(),
                "device": {"kind": "cpu", "name": "cpu", "platform": "cpu"},
                "mode": "tf.function(jit_compile=True)"}

    from keras_softmax_heads import FullSoftmax, MixtureOfSoftmaxes, PLIFSoftmax

    fresh_process.report({"task": "_info", **info})
    n, v, d = args.n, args.v[0], args.d
    h_np, y_np = numpy_inputs(n, v, d)
    h, y = steps.tensor(h_np), steps.tensor(y_np)
    heads = {}

    def head_of(key):
        if key not in heads:
            # An unseeded Keras initialiser draws its seed from Python's
            # `random`: the same head has the same weights in every process
            # (on JAX, each row runs in its own).
            random.seed(0)
            if key == "full":
                head = FullSoftmax(v)
            elif key == "plif":
                head = PLIFSoftmax(v, num_knots=args.plif_knots, knot_bound=args.plif_bound)
            else:
                head = MixtureOfSoftmaxes(v, num_components=args.mixture_components)
            head.build((None, d))
            heads[key] = head
        return heads[key]

    for task in args.tasks:
        key, phase = task.split(":")
        try:
            if key == "matmul" and args.our_backend == "jax":
                w = jnp.asarray(glorot((v, d), seed=2).T.copy())
                fn = jax.jit(lambda a, b: jnp.sum(a @ b))

                def call(fn=fn, w=w):
                    return float(jax.block_until_ready(fn(h, w)))
            elif key == "matmul":
                w = steps.tensor(glorot((v, d), seed=2).T.copy())
                fn = steps.value_step(
                    lambda a, b: keras.ops.sum(keras.ops.matmul(a, b)), "xla")
                call = lambda fn=fn, w=w: fn(h, w)  # noqa: E731
            else:
                head = head_of(key)
                if phase == "train":
                    fn = steps.train_step(head, "xla", reduction="sum")
                else:
                    fn = steps.eval_step(head, "xla")
                call = lambda fn=fn: fn(h, y)  # noqa: E731
            result = measure(call, args.warmup, args.repeats, make_memory())
        except Exception as err:  # reported as the row's error
            result = {"error": _error_text(err)}
        fresh_process.report({"task": task, **result})


# ----------------------------------------------------------- child: torch
def child_torch(args):
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision(MATMUL_PRECISION[args.matmul_precision][1])
    dev = torch.device(args.torch_device)
    versions = {"torch": torch.__version__}
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--torch-device cuda: torch.cuda.is_available() is False")
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        versions["torch_cuda"] = torch.version.cuda
        device = {"kind": "gpu", "name": torch.cuda.get_device_name(0), "platform": "cuda"}

        def sync():
            torch.cuda.synchronize(dev)

        def make_memory():
            return TorchCudaPeak(dev)
    else:
        device = {"kind": "cpu", "name": "cpu", "platform": "cpu"}
        sync, make_memory = None, RssPeak
    try:
        precision = torch.get_float32_matmul_precision()
    except (AttributeError, RuntimeError):
        precision = MATMUL_PRECISION[args.matmul_precision][1]
    fresh_process.report({"task": "_info", "versions": versions,
                          "threads": torch.get_num_threads(), "device": device,
                          "mode": "eager", "matmul_precision": precision})
    n, v, d = args.n, args.v[0], args.d
    kc, knots, bound = args.mixture_components, args.plif_knots, args.plif_bound
    h_np, y_np = numpy_inputs(n, v, d)
    h = torch.from_numpy(h_np).to(dev)
    y = torch.from_numpy(y_np.astype(np.int64)).to(dev)
    w_np = glorot((v, d), seed=2)  # [V, d], as nn.Linear stores it

    def param(array):
        return torch.from_numpy(np.ascontiguousarray(array)).to(dev).requires_grad_(True)

    def zeros(*shape):
        return torch.zeros(*shape, device=dev, requires_grad=True)

    def full_params():
        return [param(w_np), zeros(v)]

    def full_ll(x, p):
        log_p = F.log_softmax(F.linear(x, p[0], p[1]), dim=-1)
        return log_p.gather(1, y[:, None]).sum()

    def full_loss(x, p):
        return F.cross_entropy(F.linear(x, p[0], p[1]), y, reduction="sum")

    delta = 2.0 * bound / knots

    def plif_params():
        return full_params() + [torch.full((knots,), math.log(math.e - 1.0),
                                           device=dev, requires_grad=True)]

    def plif_scores(x, p):
        # Ganea et al.'s PyTorch port: two gathers on the slopes and their
        # exclusive cumulative sum, autograd for every gradient.
        z = F.linear(x, p[0], p[1])
        flat = z.reshape(-1)
        idx = torch.clamp(((flat + bound) / delta).detach().long(), min=0, max=knots - 1)
        slopes = F.softplus(p[2])
        cum = torch.cumsum(slopes, dim=-1) - slopes
        s = torch.gather(slopes, -1, idx)
        c = torch.gather(cum, -1, idx)
        knot = -bound + delta * idx.float()
        return ((flat - knot) * s + delta * c).view(z.shape)

    def plif_ll(x, p):
        log_p = F.log_softmax(plif_scores(x, p), dim=-1)
        return log_p.gather(1, y[:, None]).sum()

    def plif_loss(x, p):
        return F.cross_entropy(plif_scores(x, p), y, reduction="sum")

    def mos_params():
        if kc < 1:
            raise ValueError(f"--mixture-components must be >= 1, got {kc}")
        return full_params() + [param(glorot((kc, d), seed=3)),
                                param(glorot((kc * d, d), seed=4)), zeros(kc * d)]

    def mos_ll(x, p):
        log_prior = F.log_softmax(F.linear(x, p[2]), dim=-1)  # [N, K]
        latent = torch.tanh(F.linear(x, p[3], p[4])).view(n * kc, d)
        log_p = F.log_softmax(F.linear(latent, p[0], p[1]), dim=-1).view(n, kc, v)
        comp = log_p.gather(2, y.view(n, 1, 1).expand(n, kc, 1)).squeeze(2)
        return torch.logsumexp(log_prior + comp, dim=1).sum()

    def mos_loss(x, p):
        return -mos_ll(x, p)

    asm = {}

    def adaptive_params():
        torch.manual_seed(0)
        asm["m"] = torch.nn.AdaptiveLogSoftmaxWithLoss(d, v, adaptive_cutoffs(v),
                                                       div_value=4.0).to(dev)
        return list(asm["m"].parameters())

    def adaptive_ll(x, p):
        return asm["m"].log_prob(x).gather(1, y[:, None]).sum()

    def adaptive_loss(x, p):
        return asm["m"](x, y).loss * n

    makers = {"full": (full_params, full_loss, full_ll),
              "plif": (plif_params, plif_loss, plif_ll),
              "mos": (mos_params, mos_loss, mos_ll),
              "adaptive": (adaptive_params, adaptive_loss, adaptive_ll)}
    params = {}
    for task in args.tasks:
        key, phase = task.split(":")
        try:
            if key == "matmul":
                w = torch.from_numpy(np.ascontiguousarray(w_np.T)).to(dev)  # [d, V]

                def call(w=w):
                    with torch.no_grad():
                        return float(torch.matmul(h, w).sum())
            else:
                make, loss_fn, ll_fn = makers[key]
                if key not in params:
                    params[key] = make()
                p = params[key]
                if phase == "train":
                    def call(p=p, loss_fn=loss_fn):
                        x = h.detach().requires_grad_(True)
                        loss = loss_fn(x, p)
                        torch.autograd.grad(loss, [x] + p)
                        return float(loss.detach())
                else:
                    def call(p=p, ll_fn=ll_fn):
                        with torch.no_grad():
                            return float(ll_fn(h, p))
            result = measure(call, args.warmup, args.repeats, make_memory(), sync)
        except Exception as err:  # reported as the row's error
            result = {"error": _error_text(err)}
        fresh_process.report({"task": task, **result})


# -------------------------------------------------------------------- parent
def run_side(side, v, tasks, args):
    """Runs `tasks` of `side` at `V` in child processes: `{task: result}`, info.

    On JAX (our side with `--our-backend jax`) every row has its own child.
    """
    if side == "ours" and args.our_backend == "jax":
        results, info = {}, {}
        for task in tasks:
            r, i = _run_children(side, v, [task], args)
            results.update(r)
            info = info or i
        return results, info
    return _run_children(side, v, tasks, args)


def _run_children(side, v, tasks, args):
    """Runs `tasks` of `side` at `V` in child processes: `{task: result}`, info.

    A child that dies loses the row it was running (recorded with the
    child's error); a new child runs the rows after it. A child that dies
    before its first row (e.g. an import error) fails every row.
    """
    results, info = {}, {}
    while tasks:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", side,
               "--tasks", ",".join(tasks), "--v", str(v), "--d", str(args.d),
               "--n", str(args.n), "--repeats", str(args.repeats),
               "--warmup", str(args.warmup), "--threads", str(args.threads),
               "--plif-knots", str(args.plif_knots), "--plif-bound", str(args.plif_bound),
               "--mixture-components", str(args.mixture_components),
               "--our-backend", args.our_backend, "--torch-device", args.torch_device,
               "--matmul-precision", args.matmul_precision]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        # TensorFlow and PyTorch on the CPU see no GPU; JAX and PyTorch on
        # CUDA keep the GPUs this process sees.
        if (side == "ours" and args.our_backend == "tensorflow") or (
                side == "torch" and args.torch_device == "cpu"):
            env["CUDA_VISIBLE_DEVICES"] = ""
        if side == "ours":
            env["KERAS_BACKEND"] = args.our_backend
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                task = result.pop("task")
                if task == "_info":
                    info = result
                else:
                    results[task] = result
        missing = [t for t in tasks if t not in results]
        if not missing:
            break
        error = fresh_process.error_text(proc.stderr + proc.stdout, proc.returncode)
        if not info:  # the child died before its first row: so would the next one
            results.update({t: {"error": error} for t in missing})
            break
        results[missing[0]] = {"error": error}
        tasks = missing[1:]
    return results, info


def machine(devices=None):
    model = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {
        "cpu": model or platform.processor() or "unknown",
        "cores": len(os.sched_getaffinity(0)),
        "os": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    gpus = sorted({d["name"] for d in (devices or {}).values() if d.get("kind") == "gpu"})
    if gpus:
        out["gpu"] = ", ".join(gpus)
    return out


def ratios_of(rows, ours_label):
    """Each timed row over its side's full softmax and over our FullSoftmax
    (`ours_label`: our side's label, whichever backend it ran on)."""
    ref = {(r["side"], r["v"], r["phase"]): r["step_s"]
           for r in rows if r["key"] == "full" and "step_s" in r}
    out = []
    for r in rows:
        if "step_s" not in r or r["key"] == "matmul":
            continue
        entry = {"side": r["side"], "row": r["row"], "v": r["v"], "phase": r["phase"]}
        side_full = ref.get((r["side"], r["v"], r["phase"]))
        ours_full = ref.get((ours_label, r["v"], r["phase"]))
        entry["over_side_full"] = r["step_s"] / side_full if side_full else None
        entry["over_ours_full"] = r["step_s"] / ours_full if ours_full else None
        out.append(entry)
    return out


def efficiency_of(rows, labels):
    """Full-softmax train GFLOP/s over the bare product's, per side and V."""
    gf = {(r["side"], r["v"], r["key"], r["phase"]): r.get("gflops") for r in rows}
    out = []
    for side in labels:
        for v in sorted({r["v"] for r in rows}):
            train = gf.get((side, v, "full", "train"))
            matmul = gf.get((side, v, "matmul", "forward"))
            if train and matmul:
                out.append({"side": side, "v": v, "full_train_gflops": train,
                            "matmul_gflops": matmul, "full_train_over_matmul": train / matmul})
    return out


def _fmt(x, scale=1.0, digits=1):
    return "-" if x is None else f"{x * scale:.{digits}f}"


def print_table(rows, ratios, efficiency):
    ratio = {(e["side"], e["row"], e["v"], e["phase"]): e for e in ratios}
    print()
    print("| side | V | row | phase | median ms | best ms | cpu ms | GFLOP/s "
          "| / side full | / our FullSoftmax | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['side']} | {r['v']} | {r['row']} | {r['phase']} "
        if "step_s" not in r:
            what = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            print(head + f"| {what[:160]} | | | | | | |")
            continue
        e = ratio.get((r["side"], r["row"], r["v"], r["phase"]), {})
        print(head + f"| {_fmt(r['step_s'], 1e3)} | {_fmt(r['best_s'], 1e3)} "
              f"| {_fmt(r['cpu_s'], 1e3)} | {_fmt(r.get('gflops'))} "
              f"| {_fmt(e.get('over_side_full'), digits=2)} "
              f"| {_fmt(e.get('over_ours_full'), digits=2)} | {_fmt(r.get('peak_mib'))} |")
    if efficiency:
        print()
        print("| side | V | full-softmax train GFLOP/s | bare matmul GFLOP/s | ratio |")
        print("|---|---|---|---|---|")
        for e in efficiency:
            print(f"| {e['side']} | {e['v']} | {e['full_train_gflops']:.1f} "
                  f"| {e['matmul_gflops']:.1f} | {e['full_train_over_matmul']:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke run (V=1000, N=64, d=32, 2 repeats, 1000 knots, "
                        "2 components); writes JSON only with --out")
    parser.add_argument("--child", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--tasks", type=str, default="", help=argparse.SUPPRESS)
    parser.add_argument("--v", type=str, default="10000,33000,100000",
                        help="comma-separated vocabulary sizes")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed calls per row (the first compiles)")
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow intra-op threads and torch.set_num_threads "
                        "(0: the cores this process may use; JAX's pool is not set)")
    parser.add_argument("--our-backend", choices=OUR_BACKENDS, default="tensorflow",
                        help="Keras backend of our side: tensorflow (tf.function XLA, CPU) "
                        "or jax (jax.jit, JAX's default device: its GPU if it has one)")
    parser.add_argument("--torch-device", choices=TORCH_DEVICES, default="cpu",
                        help="device of the PyTorch side")
    parser.add_argument("--matmul-precision", choices=sorted(MATMUL_PRECISION),
                        default="float32",
                        help="float32 products on a GPU, both sides: full float32 or "
                        "TensorFloat32 (meant for GPUs)")
    parser.add_argument("--plif-knots", type=int, default=100_000)
    parser.add_argument("--plif-bound", type=float, default=20.0)
    parser.add_argument("--mixture-components", type=int, default=4)
    parser.add_argument("--memory-budget-gb", type=float, default=8.0,
                        help="skip rows whose estimated peak exceeds this")
    parser.add_argument("--sides", type=str, default="ours,torch",
                        help="comma-separated sides to run (ours, torch)")
    parser.add_argument("--out", type=str, default=None,
                        help=f"JSON output (default {os.path.relpath(DEFAULT_OUT, REPO)}; "
                        "none with --quick)")
    args = parser.parse_args()
    args.v = [int(x) for x in args.v.split(",") if x]
    if args.threads <= 0:
        args.threads = len(os.sched_getaffinity(0))

    if args.child:
        args.tasks = [t for t in args.tasks.split(",") if t]
        return (child_ours if args.child == "ours" else child_torch)(args)

    sides = [s for s in args.sides.split(",") if s]
    if not sides or any(s not in SIDES for s in sides):
        parser.error(f"--sides={args.sides!r}: expected a list of {', '.join(SIDES)}")
    if args.quick:
        args.v, args.n, args.d = [1000], 64, 32
        args.repeats, args.warmup = 2, 1
        args.plif_knots, args.mixture_components = 1000, 2
    out = args.out or (None if args.quick else DEFAULT_OUT)
    budget = args.memory_budget_gb * 1e9

    labels = side_labels(args.our_backend, args.torch_device)
    print(f"# N={args.n}, d={args.d}, V={args.v}; {args.repeats} timed calls after "
          f"{args.warmup} warm-up; {args.threads} threads; PLIF K={args.plif_knots} on "
          f"[-{args.plif_bound:g}, {args.plif_bound:g}]; mixtures K={args.mixture_components}; "
          f"sides: {', '.join(labels[s] for s in sides)}; matmul precision "
          f"{args.matmul_precision}", flush=True)
    rows, versions, devices, side_info = [], {}, {}, {}
    for v in args.v:
        for side in sides:
            t0 = time.perf_counter()
            tasks, skipped = [], {}
            for task in tasks_of(side):
                key = task.split(":")[0]
                est = units(side, key, args.mixture_components) * args.n * v * 4
                if est > budget:
                    skipped[task] = (f"estimated {est / 1e9:.3g} GB > --memory-budget-gb "
                                     f"{args.memory_budget_gb:g}")
                else:
                    tasks.append(task)
            results, info = run_side(side, v, tasks, args) if tasks else ({}, {})
            versions.update(info.get("versions", {}))
            if info.get("device"):
                devices[labels[side]] = info["device"]
            if info:
                side_info[labels[side]] = {"mode": info.get("mode"),
                                           "matmul_precision": info.get("matmul_precision")}
            for task in tasks_of(side):
                key, phase = task.split(":")
                row = {"side": labels[side], "row": row_name(side, key), "key": key,
                       "v": v, "d": args.d, "n": args.n, "phase": phase}
                if task in skipped:
                    row["skipped"] = skipped[task]
                else:
                    row.update(results.get(task, {"error": "no result"}))
                    if info.get("threads") is not None:
                        row["threads"] = info["threads"]
                    if info.get("device"):
                        row["device"] = info["device"]["name"]
                flops = FLOPS_PER_NDV.get((key, phase))
                if flops and "step_s" in row:
                    work = flops * args.n * args.d * v
                    row["gflops"] = work / row["step_s"] / 1e9
                    row["gflops_best"] = work / row["best_s"] / 1e9
                rows.append(row)
                if "error" in row:
                    print(f"  {labels[side]} V={v} {row['row']} {phase}: {row['error']}",
                          flush=True)
            print(f"  {labels[side]} V={v}: done in {time.perf_counter() - t0:.0f} s",
                  flush=True)
    ratios = ratios_of(rows, labels["ours"])
    efficiency = efficiency_of(rows, [labels[s] for s in sides])
    print_table(rows, ratios, efficiency)
    print()
    for label, device in devices.items():
        print(f"# {label}: {device['kind']} ({device['name']})")
    if len({d["kind"] for d in devices.values()}) > 1:
        print("# WARNING: the two sides ran on different kinds of device: "
              + ", ".join(f"{k} on {d['kind']}" for k, d in devices.items()), flush=True)
    if out:
        result = {
            "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "machine": machine(devices),
            "devices": devices,
            "versions": versions,
            "settings": {
                "n": args.n, "d": args.d, "v": args.v, "repeats": args.repeats,
                "warmup": args.warmup, "threads": args.threads, "dtype": "float32",
                "plif_knots": args.plif_knots, "plif_bound": args.plif_bound,
                "mixture_components": args.mixture_components,
                "adaptive_cutoffs": {str(v): adaptive_cutoffs(v) for v in args.v},
                "adaptive_div_value": 4.0,
                "memory_budget_gb": args.memory_budget_gb,
                "our_backend": args.our_backend,
                "torch_device": args.torch_device,
                "matmul_precision": args.matmul_precision,
                "matmul_precision_by_side": {k: i["matmul_precision"]
                                             for k, i in side_info.items()},
                "modes": {labels["ours"]: ("jax.jit" if args.our_backend == "jax"
                                           else "tf.function(jit_compile=True)"),
                          labels["torch"]: "eager"},
                "inputs": "h ~ N(0, 0.25) seed 0; Zipfian targets (1/(r+1)) seed 1",
            },
            "rows": rows,
            "ratios": ratios,
            "efficiency": efficiency,
        }
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
