"""Our heads against what users would use instead, on the same machine in the same run.

Two *sides*, each in its own child processes, one after the other for
every vocabulary size `V`:

* `keras_softmax_heads (<backend> xla)`: our `FullSoftmax`, `PLIFSoftmax`,
  `MixtureOfSoftmaxes` and a bare `[N, d] @ [d, V]` product, on the Keras
  backend `--our-backend` (`tensorflow`: `tf.function(jit_compile=True)` on
  the CPU; `jax`: `jax.jit` on JAX's default device, no TensorFlow
  imported);
* `pytorch eager` (`--torch-device cpu`) or `pytorch eager (cuda)`: the
  PyTorch references of `torch_heads.py` (full softmax, PLIF
  gather-on-cumsum, MoS, `AdaptiveLogSoftmaxWithLoss`) and the same product.

Phases `train` (forward and backward of the summed NLL: on our side the
head's `summed_training_loss`, what `HeadLoss` and `HeadModel` train, which
for the mixture is its tiled summed core), `eval` (the exact summed
log-likelihood) and `forward` (the product). Each row is timed by
`measure.step_row`; its memory is read by the side's `measure` reader. The
protocol (inputs, GFLOP/s, threads, memory instruments, skipped rows) is in
`docs/benchmarks.md`.

Usage:
    python benchmarks/bench_peers.py --quick --out /tmp/peers.json   # smoke run
    python benchmarks/bench_peers.py        # V in {10k, 33k, 100k}, d=512, N=2048
    python benchmarks/bench_peers.py --v 33000 --repeats 9 --memory-budget-gb 16
    python benchmarks/bench_peers.py --our-backend jax --torch-device cuda \\
        --memory-budget-gb 40 --out /tmp/peers_gpu.json   # both sides on the GPU
"""

import argparse
import functools
import os
import random
import time

import fresh_process  # benchmarks/fresh_process.py (the script's own folder)
import measure  # benchmarks/measure.py
import select_backend  # benchmarks/select_backend.py
from reference_inputs import INPUTS, adaptive_cutoffs, glorot, numpy_inputs

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
CPU_DEVICE = {"kind": "cpu", "name": "cpu", "platform": "cpu"}


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
    if key == "mos":  # ours: vocabulary tiles, no [N, K, V] (`chunked_mixture_nll`)
        return 6 if side == "ours" else 6 * components
    if key == "plif" and side == "torch":
        return 10
    return 6


# ------------------------------------------------------------- children
def run_tasks(tasks, make_call, make_memory, args, sync=None):
    """Measures every `key:phase` task (`make_call(task) -> call`) and
    reports each; a task that fails is reported with its error."""
    for task in tasks:
        try:
            result = measure.step_row(make_call(task), args.warmup, args.repeats,
                                      make_memory(), sync)
        except Exception as err:  # reported as the row's error
            result = {"error": measure.error_text(err)}
        fresh_process.report({"task": task, **result})


def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def jax_side(args):
    """Our side on JAX: `(info, memory reader factory)`."""
    import jax

    jax.config.update("jax_default_matmul_precision", MATMUL_PRECISION[args.matmul_precision][0])
    import keras
    import steps

    device = jax.devices()[0]
    if measure.JaxDevicePeak.available(device):
        make_memory = functools.partial(measure.JaxDevicePeak, device)
    elif device.platform == "cpu":
        make_memory = steps.peak_memory
    else:
        make_memory = measure.NoMemory
    is_gpu = device.platform in ("gpu", "cuda", "rocm")
    info = {"versions": {"jax": jax.__version__, "jaxlib": _jaxlib_version(),
                         "keras": keras.__version__},
            "threads": None,
            "device": {"kind": "gpu" if is_gpu else device.platform,
                       "name": device.device_kind, "platform": device.platform},
            "mode": "jax.jit",
            "matmul_precision": MATMUL_PRECISION[args.matmul_precision][0]}
    return info, make_memory


def tensorflow_side(args):
    """Our side on TensorFlow: `(info, memory reader factory)`."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    except RuntimeError:  # the runtime is already initialised
        pass
    import keras
    import steps

    info = {"versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
            "threads": tf.config.threading.get_intra_op_parallelism_threads(),
            "device": CPU_DEVICE, "mode": "tf.function(jit_compile=True)"}
    return info, steps.peak_memory


def our_head(key, args):
    """Our head of row `key`, built, seeded.

    An unseeded Keras initialiser draws its seed from Python's `random`:
    the same head has the same weights in every process (on JAX, each row
    runs in its own).
    """
    from keras_softmax_heads import FullSoftmax, MixtureOfSoftmaxes, PLIFSoftmax

    v = args.v[0]
    random.seed(0)
    if key == "full":
        head = FullSoftmax(v)
    elif key == "plif":
        head = PLIFSoftmax(v, num_knots=args.plif_knots, knot_bound=args.plif_bound)
    else:
        head = MixtureOfSoftmaxes(v, num_components=args.mixture_components)
    head.build((None, args.d))
    return head


def our_matmul_call(h, args):
    """`call()`: the bare product's sum, in our side's mode."""
    import keras
    import steps

    w_np = glorot((args.v[0], args.d), seed=2).T.copy()
    if args.our_backend == "jax":
        import jax
        import jax.numpy as jnp

        fn, w = jax.jit(lambda a, b: jnp.sum(a @ b)), jnp.asarray(w_np)
        return lambda: float(jax.block_until_ready(fn(h, w)))
    fn = steps.value_step(lambda a, b: keras.ops.sum(keras.ops.matmul(a, b)), "xla")
    w = steps.tensor(w_np)
    return lambda: fn(h, w)


def our_call(task, h, y, heads, args):
    """`call()` of one of our rows (`heads`: the heads built so far)."""
    import steps

    key, phase = task.split(":")
    if key == "matmul":
        return our_matmul_call(h, args)
    if key not in heads:
        heads[key] = our_head(key, args)
    if phase == "train":
        fn = steps.train_step(heads[key], "xla", reduction="sum", summed=True)
    else:
        fn = steps.eval_step(heads[key], "xla")
    return lambda: fn(h, y)


def child_ours(args):
    select_backend.use(args.our_backend)
    info, make_memory = (jax_side if args.our_backend == "jax" else tensorflow_side)(args)
    import steps

    fresh_process.report({"task": "_info", **info})
    h_np, y_np = numpy_inputs(args.n, args.v[0], args.d)
    h, y = steps.tensor(h_np), steps.tensor(y_np)
    make_call = functools.partial(our_call, h=h, y=y, heads={}, args=args)
    run_tasks(args.tasks, make_call, make_memory, args)


def torch_side(args):
    """The PyTorch side: `(device, sync, memory reader factory, info)`."""
    import torch
    import torch_heads  # benchmarks/torch_heads.py (imports PyTorch)

    threads = torch_heads.set_threads(args.threads)
    torch.set_float32_matmul_precision(MATMUL_PRECISION[args.matmul_precision][1])
    versions = {"torch": torch.__version__}
    if args.torch_device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--torch-device cuda: torch.cuda.is_available() is False")
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        versions["torch_cuda"] = torch.version.cuda
        device = {"kind": "gpu", "name": torch.cuda.get_device_name(0), "platform": "cuda"}
        sync = functools.partial(torch.cuda.synchronize, dev)
        make_memory = functools.partial(measure.TorchCudaPeak, dev)
    else:
        dev, device, sync, make_memory = torch.device("cpu"), CPU_DEVICE, None, measure.RssPeak
    try:
        precision = torch.get_float32_matmul_precision()
    except (AttributeError, RuntimeError):
        precision = MATMUL_PRECISION[args.matmul_precision][1]
    info = {"versions": versions, "threads": threads, "device": device, "mode": "eager",
            "matmul_precision": precision}
    return dev, sync, make_memory, info


def torch_head(key, kernel, args, device):
    """The PyTorch reference head of row `key` (`torch_heads.py`)."""
    import torch_heads

    if key == "full":
        return torch_heads.FullSoftmax(kernel, device)
    if key == "plif":
        return torch_heads.PLIFGatherOnCumsum(kernel, args.plif_knots, args.plif_bound, device)
    if key == "mos":
        return torch_heads.MixtureOfSoftmaxes(kernel, args.mixture_components, device)
    return torch_heads.AdaptiveSoftmax(args.d, args.v[0], adaptive_cutoffs(args.v[0]),
                                       div_value=4.0, device=device)


def torch_call(task, h, y, kernel, heads, args, device):
    """`call()` of one PyTorch row (`heads`: the heads built so far)."""
    import numpy as np
    import torch
    import torch_heads

    key, phase = task.split(":")
    if key == "matmul":
        return torch_heads.matmul_call(h, torch.from_numpy(np.ascontiguousarray(kernel.T)).to(device))
    if key not in heads:
        heads[key] = torch_head(key, kernel, args, device)
    if phase == "train":
        return torch_heads.train_call(heads[key], h, y)
    return torch_heads.eval_call(heads[key].log_likelihood, h, y)


def child_torch(args):
    import numpy as np
    import torch

    device, sync, make_memory, info = torch_side(args)
    fresh_process.report({"task": "_info", **info})
    h_np, y_np = numpy_inputs(args.n, args.v[0], args.d)
    h = torch.from_numpy(h_np).to(device)
    y = torch.from_numpy(y_np.astype(np.int64)).to(device)
    kernel = glorot((args.v[0], args.d), seed=2)  # [V, d], as nn.Linear stores it
    make_call = functools.partial(torch_call, h=h, y=y, kernel=kernel, heads={}, args=args,
                                  device=device)
    run_tasks(args.tasks, make_call, make_memory, args, sync)


# -------------------------------------------------------------------- parent
def run_side(side, v, tasks, args):
    """Runs `tasks` of `side` at `V` in child processes: `{task: result}`, info.

    On JAX (our side with `--our-backend jax`) every row has its own child.
    """
    if side == "ours" and args.our_backend == "jax":
        results, info = {}, {}
        for task in tasks:
            r, i = run_children(side, v, [task], args)
            results.update(r)
            info = info or i
        return results, info
    return run_children(side, v, tasks, args)


def child_flags(side, v, tasks, args):
    return ["--child", side, "--tasks", ",".join(tasks), "--v", str(v), "--d", str(args.d),
            "--n", str(args.n), "--repeats", str(args.repeats),
            "--warmup", str(args.warmup), "--threads", str(args.threads),
            "--plif-knots", str(args.plif_knots), "--plif-bound", str(args.plif_bound),
            "--mixture-components", str(args.mixture_components),
            "--our-backend", args.our_backend, "--torch-device", args.torch_device,
            "--matmul-precision", args.matmul_precision]


def child_env(side, args):
    """TensorFlow and PyTorch on the CPU see no GPU; JAX and PyTorch on CUDA
    keep the GPUs this process sees."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "3"}
    if (side == "ours" and args.our_backend == "tensorflow") or (
            side == "torch" and args.torch_device == "cpu"):
        env["CUDA_VISIBLE_DEVICES"] = ""
    if side == "ours":
        env["KERAS_BACKEND"] = args.our_backend
    return env


def run_children(side, v, tasks, args):
    """Runs `tasks` of `side` at `V` in child processes: `{task: result}`, info.

    A child that dies loses the row it was running (recorded with the
    child's error); a new child runs the rows after it. A child that dies
    before its first row (e.g. an import error) fails every row.
    """
    results, info = {}, {}
    while tasks:
        child = fresh_process.run(__file__, child_flags(side, v, tasks, args),
                                  child_env(side, args))
        for result in child.results:
            task = result.pop("task")
            if task == "_info":
                info = result
            else:
                results[task] = result
        missing = [t for t in tasks if t not in results]
        if not missing:
            break
        if not info:  # the child died before its first row: so would the next one
            results.update({t: {"error": child.error} for t in missing})
            break
        results[missing[0]] = {"error": child.error}
        tasks = missing[1:]
    return results, info


def plan(side, v, args):
    """`(tasks to run, {task: why skipped})` of `side` at `V` (memory budget)."""
    tasks, skipped = [], {}
    for task in tasks_of(side):
        est = units(side, task.split(":")[0], args.mixture_components) * args.n * v * 4
        if est > args.memory_budget_gb * 1e9:
            skipped[task] = (f"estimated {est / 1e9:.3g} GB > --memory-budget-gb "
                             f"{args.memory_budget_gb:g}")
        else:
            tasks.append(task)
    return tasks, skipped


def side_rows(side, v, label, results, info, skipped, args):
    """The JSON rows of `side` at `V`, with their GFLOP/s."""
    rows = []
    for task in tasks_of(side):
        key, phase = task.split(":")
        row = {"side": label, "row": row_name(side, key), "key": key,
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
            print(f"  {label} V={v} {row['row']} {phase}: {row['error']}", flush=True)
    return rows


def machine(devices=None):
    """The machine (`measure.machine`'s CPU, cores, OS, Python, date) and the
    GPUs the sides ran on."""
    out = measure.machine(keys=("cpu", "cores", "os", "python", "date"))
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


def parse_args(argv=None):
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
    args = parser.parse_args(argv)
    args.v = [int(x) for x in args.v.split(",") if x]
    args.tasks = [t for t in args.tasks.split(",") if t]
    if args.threads <= 0:
        args.threads = len(os.sched_getaffinity(0))
    sides = [s for s in args.sides.split(",") if s]
    if not sides or any(s not in SIDES for s in sides):
        parser.error(f"--sides={args.sides!r}: expected a list of {', '.join(SIDES)}")
    args.sides = sides
    if args.quick and not args.child:
        args.v, args.n, args.d = [1000], 64, 32
        args.repeats, args.warmup = 2, 1
        args.plif_knots, args.mixture_components = 1000, 2
    args.out = args.out or (None if args.quick else DEFAULT_OUT)
    return args


def run_all(args, labels):
    """Every side at every `V`: `(rows, versions, devices, side_info)`."""
    rows, versions, devices, side_info = [], {}, {}, {}
    for v in args.v:
        for side in args.sides:
            t0 = time.perf_counter()
            tasks, skipped = plan(side, v, args)
            results, info = run_side(side, v, tasks, args) if tasks else ({}, {})
            versions.update(info.get("versions", {}))
            if info.get("device"):
                devices[labels[side]] = info["device"]
            if info:
                side_info[labels[side]] = {"mode": info.get("mode"),
                                           "matmul_precision": info.get("matmul_precision")}
            rows += side_rows(side, v, labels[side], results, info, skipped, args)
            print(f"  {labels[side]} V={v}: done in {time.perf_counter() - t0:.0f} s",
                  flush=True)
    return rows, versions, devices, side_info


def print_devices(devices):
    print()
    for label, device in devices.items():
        print(f"# {label}: {device['kind']} ({device['name']})")
    if len({d["kind"] for d in devices.values()}) > 1:
        print("# WARNING: the two sides ran on different kinds of device: "
              + ", ".join(f"{k} on {d['kind']}" for k, d in devices.items()), flush=True)


def settings_of(args, labels, side_info):
    return {
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
        "matmul_precision_by_side": {k: i["matmul_precision"] for k, i in side_info.items()},
        "modes": {labels["ours"]: ("jax.jit" if args.our_backend == "jax"
                                   else "tf.function(jit_compile=True)"),
                  labels["torch"]: "eager"},
        "inputs": INPUTS,
        "our_train_objective": "summed_training_loss (what HeadLoss trains)",
    }


def main():
    args = parse_args()
    if args.child:
        return (child_ours if args.child == "ours" else child_torch)(args)
    labels = side_labels(args.our_backend, args.torch_device)
    print(f"# N={args.n}, d={args.d}, V={args.v}; {args.repeats} timed calls after "
          f"{args.warmup} warm-up; {args.threads} threads; PLIF K={args.plif_knots} on "
          f"[-{args.plif_bound:g}, {args.plif_bound:g}]; mixtures K={args.mixture_components}; "
          f"sides: {', '.join(labels[s] for s in args.sides)}; matmul precision "
          f"{args.matmul_precision}", flush=True)
    rows, versions, devices, side_info = run_all(args, labels)
    ratios = ratios_of(rows, labels["ours"])
    efficiency = efficiency_of(rows, [labels[s] for s in args.sides])
    print_table(rows, ratios, efficiency)
    print_devices(devices)
    if args.out:
        result = {
            "command": measure.command_line(__file__),
            "machine": machine(devices), "devices": devices, "versions": versions,
            "settings": settings_of(args, labels, side_info),
            "rows": rows, "ratios": ratios, "efficiency": efficiency,
        }
        measure.save(result, args.out)


if __name__ == "__main__":
    main()
