r"""The fused cross-entropy on a GPU, side by side with its peers (issue 29).

One step is the forward and backward pass of the mean cross-entropy of the
logits `h W^T` (`h` `[N, d]`, `W` the tied `[V, d]` matrix, every 17th
target `-100`, ignored) with respect to `h` and `W`. Rows, per shape and
dtype (`--shapes`):

* `torch_dense`: `F.cross_entropy((h @ W.T).float(), t, ignore_index=-100)`
  (PyTorch, the float32 logits; TF32 off unless `--torch_tf32`);
* `liger`: Liger-Kernel's `LigerFusedLinearCrossEntropyLoss(W, h, t)`;
* `cce`: Apple's Cut Cross-Entropy `linear_cross_entropy(h, W, t)` (its
  defaults: `impl="cce"`, `filter_eps="auto"`);
* `xla_dense`: JAX `jit`, float32 logits `jnp.dot(h, W.T,
  preferred_element_type=float32)`, `log_softmax`, the masked mean;
* `ours`: `keras_softmax_heads.losses.linear_cross_entropy(h, W, t,
  kernel_transposed=True, ignore_index=-100)` under `jax.jit`
  (`--implementation`, default `"pallas"`: the Pallas kernel);
* `ours_filtered`: the same with `filter_eps=--filter_eps` (default
  `2**-12`, Cut Cross-Entropy's `"auto"` for bfloat16): the kernel's fused
  `"atomic"` backward, skipping blocks;
* `ours_atomic`: the kernel with the `"atomic"` backward and no filtering
  (`pallas_cross_entropy.pallas_pointwise_stats(..., backward="atomic")`,
  the masked mean of its `nll`): exact, to compare the two backwards;
* `ours_tiled`: the XLA tiled pass (`implementation="ops"`; the
  library's default on every platform since an H200 measured it faster
  than the kernel, `pallas_cross_entropy.AUTO_PLATFORMS`);
* `ours_blocked`: the tiled pass over token blocks (`token_chunk_size=
  --token_chunk_size`, tiles of `--blocked_chunk_size` words): its
  two-pass backward keeps no float32 `[N, d]` accumulator (issue 29's
  memory target), for a fifth `N d V` product;
* `ours_summed`: the gradient in the forward pass
  (`gradient_in_forward=True`: chunks of `--summed_token_chunk_size` tokens,
  default the library's, each scored over the whole vocabulary; three
  `N d V` products, as the dense step, where the tiled pass takes four).

The PyTorch rows run first (then PyTorch's cache is emptied), the JAX rows
next, in the same process. Per shape and framework: one warm-up call of
each row (`first_s`: compilation, autotuning), one call measured for memory
(PyTorch: `torch.cuda.max_memory_allocated` over it, minus the allocated
bytes before it, the gradients included; JAX: XLA's compiled memory analysis
of the step, `temp` and `output` = the gradients), then `--repeats`
interleaved rounds (`measure.interleaved`: one call of every row per round,
the order rotated): `step_s` is the median. Every row records its loss; the
JAX rows record the relative error of their gradients against
`xla_dense`'s (`||g - g_dense|| / ||g_dense||`, the filtered row's shows
what the filter drops). A row that fails (an error, a peer that refuses a
dtype, a missing package, no CUDA) is recorded with its `error` or
`skipped`; the others still run.

Inputs: `h ~ N(0, 1)`, `W ~ N(0, 1 / d)` drawn once in float32 with NumPy
(seeded) and rounded to each dtype on the device; targets uniform.

Usage (the GPU call: `benchmarks/device_cross_entropy.sh`):
    python benchmarks/bench_gpu_cross_entropy.py \
        --out=docs/results/gpu_cross_entropy/bench_gpu_cross_entropy.json
    python benchmarks/bench_gpu_cross_entropy.py --shapes=32x16x100:bfloat16 \
        --implementation=pallas --repeats=1 --out=/tmp/gce.json   # CPU smoke
"""

import argparse
import os
import shlex
import statistics
import sys
import time

import measure  # benchmarks/measure.py (the script's own folder)

ROWS = ("torch_dense", "liger", "cce", "xla_dense", "ours", "ours_filtered", "ours_atomic",
        "ours_tiled", "ours_blocked", "ours_summed")
TORCH_ROWS = ("torch_dense", "liger", "cce")
DEFAULT_SHAPES = "8192x2304x256000:bfloat16,float32;4096x1024x131072:float32"
IGNORE_INDEX = -100
IGNORE_EVERY = 17
MIB = 2.0**20


def parse_shapes(text):
    """`"NxDxV:dtype,dtype;..."` -> `[(n, d, v, dtype), ...]`."""
    cases = []
    for part in filter(None, text.split(";")):
        dims, dtypes = part.split(":")
        n, d, v = (int(x) for x in dims.lower().split("x"))
        cases += [(n, d, v, dtype) for dtype in dtypes.split(",")]
    return cases


def host_inputs(n, d, v, seed=0):
    """`(h [n, d], W [v, d], t [n])`: float32 NumPy arrays and int32 targets,
    every `IGNORE_EVERY`-th one `IGNORE_INDEX`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n, d), dtype=np.float32)
    w = rng.standard_normal((v, d), dtype=np.float32)
    w *= d**-0.5
    t = rng.integers(0, v, n).astype(np.int32)
    t[IGNORE_EVERY - 1::IGNORE_EVERY] = IGNORE_INDEX
    return h, w, t


def skipped(rows, reason):
    return {row: {"row": row, "skipped": reason} for row in rows}


# ------------------------------------------------------------------ PyTorch
def torch_losses(rows):
    """`{row: loss_fn(h, w, t)}` of the PyTorch rows that import, and
    `{row: reason}` of those that do not."""
    import torch.nn.functional as F

    fns, missing = {}, {}
    if "torch_dense" in rows:
        fns["torch_dense"] = lambda h, w, t: F.cross_entropy(
            (h @ w.T).float(), t, ignore_index=IGNORE_INDEX)
    if "liger" in rows:
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
            fns["liger"] = lambda h, w, t: liger(w, h, t)
        except ImportError as err:
            missing["liger"] = measure.error_text(err)
    if "cce" in rows:
        try:
            from cut_cross_entropy import linear_cross_entropy as cce

            fns["cce"] = lambda h, w, t: cce(h, w, t, ignore_index=IGNORE_INDEX)
        except ImportError as err:
            missing["cce"] = measure.error_text(err)
    return fns, missing


def torch_case(case, host, rows, repeats, tf32):
    """The PyTorch rows of one `(n, d, v, dtype)` case: `{row: result}`."""
    rows = [r for r in rows if r in TORCH_ROWS]
    if not rows:
        return {}
    try:
        import torch
    except ImportError as err:
        return skipped(rows, measure.error_text(err))
    if not torch.cuda.is_available():
        return skipped(rows, "no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    dtype = case[3]
    fns, missing = torch_losses(rows)
    out = {row: {"row": row, "skipped": why} for row, why in missing.items()}
    h_np, w_np, t_np = host
    dev = torch.device("cuda")
    h = torch.from_numpy(h_np).to(dev, getattr(torch, dtype)).requires_grad_(True)
    w = torch.from_numpy(w_np).to(dev, getattr(torch, dtype)).requires_grad_(True)
    t = torch.from_numpy(t_np).to(dev).long()

    def step(fn):
        def call():
            h.grad = w.grad = None
            loss = fn(h, w, t)
            loss.backward()
            torch.cuda.synchronize()
            return float(loss)
        return call

    calls = {}
    for row, fn in fns.items():
        call = step(fn)
        try:
            _, first_s, _ = measure.clock(call)
            h.grad = w.grad = None
            reader = measure.TorchCudaPeak()
            reader.start()
            loss = call()
            out[row] = {"row": row, "first_s": first_s, "loss": loss,
                        "peak_over_inputs_mib": reader.peak_mib(),
                        "grad_mib": (h.numel() + w.numel()) * h.element_size() / MIB,
                        "memory_source": reader.source}
            calls[row] = call
        except Exception as err:  # a peer that refuses the dtype, out of memory
            out[row] = {"row": row, "error": measure.error_text(err)}
        h.grad = w.grad = None
        torch.cuda.empty_cache()
    timed(out, calls, repeats)
    del h, w, t
    torch.cuda.empty_cache()
    return out


def timed(out, calls, repeats):
    """Interleaved timed rounds of `calls`: `step_s` (median), `best_s`."""
    if not calls:
        return
    wall, _ = measure.interleaved(calls, repeats)
    for row, times in wall.items():
        out[row].update(step_s=statistics.median(times), best_s=min(times), wall_s=times)


# ---------------------------------------------------------------------- JAX
def jax_losses(rows, implementation, filter_eps, chunk_size, blocked=(2048, 2048),
               summed_tokens=None):
    """`{row: loss_fn(h, w, t)}` of the JAX rows (functions of arrays);
    `blocked` is `ours_blocked`'s `(token_chunk_size, chunk_size)`,
    `summed_tokens` `ours_summed`'s `token_chunk_size`."""
    import jax
    import jax.numpy as jnp

    from keras_softmax_heads.fused.pallas_cross_entropy import pallas_pointwise_stats
    from keras_softmax_heads.losses import linear_cross_entropy

    def dense(h, w, t):
        logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
        keep = t != IGNORE_INDEX
        log_p = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(log_p, jnp.where(keep, t, 0)[:, None], axis=1)[:, 0]
        return -jnp.sum(jnp.where(keep, picked, 0.0)) / jnp.maximum(jnp.sum(keep), 1)

    def ours(implementation, eps=None, chunk_size=chunk_size, token_chunk_size=None,
             in_forward=False):
        return lambda h, w, t: linear_cross_entropy(
            h, w, t, kernel_transposed=True, ignore_index=IGNORE_INDEX,
            implementation=implementation, filter_eps=eps, chunk_size=chunk_size,
            token_chunk_size=token_chunk_size, gradient_in_forward=in_forward)

    def atomic(h, w, t):
        keep = t != IGNORE_INDEX
        nll = pallas_pointwise_stats(h, w, None, jnp.where(keep, t, 0),
                                     kernel_transposed=True, backward="atomic")[0]
        return jnp.sum(jnp.where(keep, nll, 0.0)) / jnp.maximum(jnp.sum(keep), 1)

    fns = {"xla_dense": dense, "ours": ours(implementation),
           "ours_filtered": ours(implementation, filter_eps), "ours_atomic": atomic,
           "ours_tiled": ours("ops"),
           "ours_blocked": ours("ops", chunk_size=blocked[1], token_chunk_size=blocked[0]),
           "ours_summed": ours("ops", token_chunk_size=summed_tokens, in_forward=True)}
    return {row: fn for row, fn in fns.items() if row in rows}


def relative_error(grads, reference):
    import jax.numpy as jnp

    errors = []
    for g, r in zip(grads, reference):
        g, r = jnp.asarray(g, jnp.float32), jnp.asarray(r, jnp.float32)
        errors.append(float(jnp.linalg.norm(g - r) / jnp.maximum(jnp.linalg.norm(r), 1e-30)))
    return errors


def jax_case(case, host, rows, repeats, implementation, filter_eps, chunk_size,
             blocked=(2048, 2048), summed_tokens=None):
    """The JAX rows of one `(n, d, v, dtype)` case: `{row: result}`."""
    rows = [r for r in rows if r not in TORCH_ROWS]
    if not rows:
        return {}
    import jax
    import jax.numpy as jnp

    from keras_softmax_heads.fused.pallas_cross_entropy import uses_kernel

    dtype = case[3]
    h_np, w_np, t_np = host
    h = jnp.asarray(h_np, dtype)
    w = jnp.asarray(w_np, dtype)
    t = jnp.asarray(t_np)
    out, calls, grads = {}, {}, {}
    for row, fn in jax_losses(rows, implementation, filter_eps, chunk_size, blocked,
                              summed_tokens).items():
        try:
            # Compiled once (XLA's memory analysis of what runs); `first_s`:
            # the compilation and the first call.
            start = time.perf_counter()
            compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(h, w, t).compile()
            analysis = compiled.memory_analysis()

            def call(compiled=compiled):
                loss, g = compiled(h, w, t)
                jax.block_until_ready(g)
                return loss, g

            loss, g = call()
            out[row] = {"row": row, "first_s": time.perf_counter() - start, "loss": float(loss),
                        "temp_mib": analysis.temp_size_in_bytes / MIB,
                        "output_mib": analysis.output_size_in_bytes / MIB,
                        "peak_over_inputs_mib": (analysis.temp_size_in_bytes
                                                 + analysis.output_size_in_bytes) / MIB,
                        "grad_mib": (h.size + w.size) * h.dtype.itemsize / MIB,
                        "memory_source": "XLA compiled memory_analysis (temp + output)"}
            if row != "xla_dense":
                out[row]["pallas_kernel"] = row == "ours_atomic" or bool(
                    row not in ("ours_tiled", "ours_blocked", "ours_summed")
                    and uses_kernel(h, w, implementation))
            grads[row] = g
            calls[row] = call
        except Exception as err:  # out of memory, a lowering error
            out[row] = {"row": row, "error": measure.error_text(err)}
    if "xla_dense" in grads:
        for row, g in grads.items():
            if row != "xla_dense":
                out[row]["grad_rel_err_vs_xla_dense"] = relative_error(g, grads["xla_dense"])
    grads.clear()
    timed(out, calls, repeats)
    return out


#: `linear_cross_entropy` options checked kernel against tiled pass.
CHECK_OPTIONS = (
    dict(reduction="mean"),
    dict(reduction="none", weighted=True),
    dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=30.0, reduction="sum"),
)
#: `(dtype, kernel_transposed, bias)` of the option checks.
CHECK_LAYOUTS = (
    ("float32", True, False), ("float32", False, True), ("bfloat16", True, True),
    ("bfloat16", False, False), ("float16", True, False),
)


def option_checks(n=300, d=200, v=1000):
    """The kernel (`implementation="pallas"`) against the tiled pass
    (`"ops"`) at a small shape, for every `CHECK_LAYOUTS` and
    `CHECK_OPTIONS` entry: the relative differences of the loss and
    of each gradient (`||g_kernel - g_tiled|| / ||g_tiled||`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from keras_softmax_heads.losses import linear_cross_entropy

    h_np, w_np, t_np = host_inputs(n, d, v, seed=1)
    b_np = np.random.default_rng(2).standard_normal(v).astype("float32")
    weights = np.random.default_rng(3).uniform(0.5, 2, n).astype("float32")
    out = []
    for dtype, transposed, bias in CHECK_LAYOUTS:
        h = jnp.asarray(h_np, dtype)
        w = jnp.asarray(w_np if transposed else w_np.T, dtype)
        b = jnp.asarray(b_np, dtype) if bias else None
        for options in CHECK_OPTIONS:
            options = dict(options)
            weighted = options.pop("weighted", False)

            def loss(h, w, b, implementation, options=options, weighted=weighted):
                value = linear_cross_entropy(
                    h, w, t_np, b, kernel_transposed=transposed,
                    ignore_index=IGNORE_INDEX, implementation=implementation,
                    sample_weight=weights if weighted else None, **options)
                return jnp.sum(value)

            argnums = (0, 1, 2) if bias else (0, 1)
            results = [jax.jit(jax.value_and_grad(loss, argnums), static_argnums=3)(
                h, w, b, impl) for impl in ("pallas", "ops")]
            (lk, gk), (lt, gt) = results
            out.append(dict(
                dtype=dtype, transposed=transposed, bias=bias, options=options,
                weighted=weighted, loss_rel_err=float(abs(lk - lt) / abs(lt)),
                grad_rel_err=relative_error(gk, gt)))
    return out


# ------------------------------------------------------------------- driver
def ratios_of(case_rows):
    """Time and memory of each row over `xla_dense`'s and `cce`'s."""
    out = {}
    for base in ("xla_dense", "cce"):
        ref = case_rows.get(base, {})
        if "step_s" not in ref:
            continue
        for row, r in case_rows.items():
            if row != base and "step_s" in r:
                out[f"time_{row}_over_{base}"] = r["step_s"] / ref["step_s"]
    return out


def run(settings, save=None):
    """All the cases: `{"rows": [...], "ratios": [...]}` (and
    `"option_checks"`, `option_checks()`, with `check_options`).

    `save(partial)`, when given, is called with the results so far after the
    option checks and after each case, so that a run stopped from outside
    (a device call's time limit) keeps every finished case. Cases not begun
    within `settings["max_seconds"]` (if set) are recorded as skipped."""
    rows, ratios = [], []
    checks = host = None
    deadline = (time.perf_counter() + settings["max_seconds"]
                if settings.get("max_seconds") else None)

    def partial():
        return {"rows": list(rows), "ratios": list(ratios), "option_checks": checks}

    if settings["check_options"]:
        try:
            checks = option_checks()
            worst = max(max([c["loss_rel_err"]] + c["grad_rel_err"]) for c in checks)
            print(f"option checks: {len(checks)} cases, largest relative error {worst:.2e}",
                  flush=True)
        except Exception as err:  # a lowering error: the table still runs
            checks = {"error": measure.error_text(err)}
            print(f"option checks failed: {checks['error']}", flush=True)
        if save:
            save(partial())
    for case in settings["cases"]:
        n, d, v, dtype = case
        if deadline is not None and time.perf_counter() > deadline:
            rows += [{"row": row, "skipped": "time budget (--max_seconds) spent",
                      "n": n, "d": d, "v": v, "dtype": dtype} for row in settings["rows"]]
            print(f"N={n} d={d} V={v} {dtype}: skipped (--max_seconds)", flush=True)
            continue
        print(f"N={n} d={d} V={v} {dtype}", flush=True)
        if host is None or host[0].shape != (n, d) or host[1].shape[0] != v:
            host = None
            host = host_inputs(n, d, v)  # the same values for every row and dtype
        results = torch_case(case, host, settings["rows"], settings["repeats"],
                             settings["torch_tf32"])
        results.update(jax_case(case, host, settings["rows"], settings["repeats"],
                                settings["implementation"], settings["filter_eps"],
                                settings["chunk_size"],
                                (settings["token_chunk_size"], settings["blocked_chunk_size"]),
                                settings["summed_token_chunk_size"]))
        for row in settings["rows"]:
            r = dict(results.get(row, {"row": row, "skipped": "not run"}),
                     n=n, d=d, v=v, dtype=dtype)
            rows.append(r)
            print("  " + summary(r), flush=True)
        ratios.append(dict(n=n, d=d, v=v, dtype=dtype, **ratios_of(results)))
        if save:
            save(partial())
    return partial()


def summary(r):
    if "step_s" not in r:
        return f"{r['row']:>14}: {r.get('error') or r.get('skipped')}"
    return (f"{r['row']:>14}: {1e3 * r['step_s']:9.2f} ms  peak over inputs "
            f"{r['peak_over_inputs_mib']:10.1f} MiB  loss {r['loss']:.6f}")


def versions():
    out = {}
    for name in ("jax", "jaxlib", "keras", "torch", "triton", "liger_kernel",
                 "cut_cross_entropy"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "unknown")
        except Exception:  # absent, or fails to import
            out[name] = None
    return out


def devices():
    out = {}
    try:
        import jax

        out["jax"] = [str(x) for x in jax.devices()]
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            out["torch"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return out


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="Cases 'NxDxV:dtype,dtype;...' (default: issue 29's).")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"Rows, of {ROWS}.")
    parser.add_argument("--repeats", type=int, default=10, help="Timed interleaved rounds.")
    parser.add_argument("--implementation", default="pallas", choices=["auto", "pallas"],
                        help="`ours` rows: 'pallas' (the kernel; interpret mode off a "
                        "GPU) or 'auto' (the library's default, today the tiled pass).")
    parser.add_argument("--filter_eps", type=float, default=2.0**-12,
                        help="filter_eps of `ours_filtered`.")
    parser.add_argument("--chunk_size", type=int, default=4096,
                        help="chunk_size of the `ours` rows (the kernel's backward chunk "
                        "bound; the tiled pass's tile width).")
    parser.add_argument("--token_chunk_size", type=int, default=2048,
                        help="token_chunk_size of `ours_blocked` (tokens per block).")
    parser.add_argument("--blocked_chunk_size", type=int, default=2048,
                        help="chunk_size of `ours_blocked` (words per tile).")
    parser.add_argument("--summed_token_chunk_size", type=int, default=None,
                        help="token_chunk_size of `ours_summed` (default: the library's).")
    parser.add_argument("--blocks", default=None,
                        help="The kernel's 'block_n,block_v,block_d' "
                        "(pallas_cross_entropy.GPU_BLOCKS; default its own).")
    parser.add_argument("--torch_tf32", action="store_true",
                        help="Allow TF32 in PyTorch's float32 products.")
    parser.add_argument("--check_options", action="store_true",
                        help="First compare the kernel with the tiled pass for every "
                        "option at N=300, d=200, V=1000 (`option_checks`).")
    parser.add_argument("--max_seconds", type=float, default=None,
                        help="Begin no case after this many seconds (the rest are "
                        "recorded as skipped).")
    parser.add_argument("--out", default=None, help="Write the results to this JSON file "
                        "(rewritten after each case).")
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    bad = [r for r in rows if r not in ROWS]
    if bad:
        parser.error(f"unknown rows {bad}; rows: {ROWS}")
    return args, {"cases": parse_shapes(args.shapes), "rows": rows, "repeats": args.repeats,
                  "implementation": args.implementation, "filter_eps": args.filter_eps,
                  "torch_tf32": args.torch_tf32, "check_options": args.check_options,
                  "chunk_size": args.chunk_size, "max_seconds": args.max_seconds,
                  "token_chunk_size": args.token_chunk_size,
                  "blocked_chunk_size": args.blocked_chunk_size,
                  "summed_token_chunk_size": args.summed_token_chunk_size,
                  "blocks": [int(x) for x in args.blocks.split(",")] if args.blocks else None}


def main(argv=None):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    args, settings = parse_args(sys.argv[1:] if argv is None else argv)
    from keras_softmax_heads.fused import pallas_cross_entropy

    if settings["blocks"]:
        pallas_cross_entropy.GPU_BLOCKS = tuple(settings["blocks"])
    settings["blocks"] = list(pallas_cross_entropy.GPU_BLOCKS)
    header = dict(
        command="python " + " ".join(shlex.quote(x) for x in sys.argv),
        settings={k: (v if k != "cases" else [list(c) for c in v]) for k, v in settings.items()},
        machine=measure.machine(), devices=devices(), versions=versions(),
        loadavg_before=os.getloadavg())

    def save(partial, final=False):
        if args.out:
            measure.save(dict(header, **partial, complete=final,
                              loadavg_after=os.getloadavg()), args.out)

    result = run(settings, save)
    save(result, final=True)
    return dict(header, **result, complete=True)


if __name__ == "__main__":
    main()
