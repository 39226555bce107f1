"""The one timing loop and the memory readers of every benchmark script.

Timing: `time_calls(call, warmup, repeats, ...)` runs `call()` `warmup`
times untimed (the first is timed apart: tracing / compilation), then
`repeats` timed calls, and returns a `Timing` (wall and process CPU time of
every timed call, their median and best). `interleaved(calls, rounds)` is
the same clock over several steps taken in turns, for ratios between steps
measured in the same rounds.

Memory, one reader per instrument; each has `start()` (the baseline, taken
after a `gc.collect()`), `peak_bytes()` (the raw peak since `start()`),
`peak_mib()` (the peak minus the baseline, in MiB; None when the instrument
gives nothing), `source` (the instrument's name, stored with the rows) and
`allocator` (True for an allocator's statistics, False for the process'):

* `RssPeak`: the process' peak resident size (Linux `/proc/self/status`,
  `VmHWM`, reset through `/proc/self/clear_refs`);
* `TensorFlowAllocatorPeak`: TensorFlow's CPU allocator statistics (this
  and the next two are `AllocatorPeak`s);
* `TorchCudaPeak`: PyTorch's CUDA allocator (`max_memory_allocated`);
* `JaxDevicePeak`: a JAX device's allocator (`peak_bytes_in_use`; it cannot
  be reset, so it covers the whole process);
* `NoMemory`: no reading;
* `compiled_memory(fn, *args)`: XLA's own estimate for a JAX function,
  `jax.jit(fn).lower(*args).compile().memory_analysis()`, without running it.

Each reader imports its framework when used, so this module imports
neither TensorFlow, JAX nor PyTorch (the GPU machines have no TensorFlow).
The protocols of the scripts built on it are in `docs/benchmarks.md`.
"""

import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time

MIB = 2.0**20


# ------------------------------------------------------------------ timing
@dataclasses.dataclass
class Timing:
    """What `time_calls` measured.

    Attributes:
        value: what the last call returned.
        first_s: wall time of the first (untimed) call, or None without one.
        wall: wall time of each timed call, in seconds.
        cpu: process CPU time (user + system, all threads) of each timed call.
    """

    value: object
    first_s: float
    wall: list
    cpu: list

    @property
    def median_s(self):
        """Median wall time of the timed calls (`first_s` if there were none)."""
        return statistics.median(self.wall) if self.wall else self.first_s

    @property
    def best_s(self):
        """Fastest timed call (`first_s` if there were none)."""
        return min(self.wall) if self.wall else self.first_s

    @property
    def median_cpu_s(self):
        return statistics.median(self.cpu) if self.cpu else None

    @property
    def best_cpu_s(self):
        return min(self.cpu) if self.cpu else None


def clock(call, sync=None):
    """One call of `call()`: `(value, wall seconds, CPU seconds)`.

    `sync()`, if given, waits for the device before the clock is read.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    value = call()
    if sync is not None:
        sync()
    return value, time.perf_counter() - t0, time.process_time() - c0


def time_calls(call, warmup=1, repeats=3, sync=None, memory=None, memory_covers_warmup=False,
               time_budget=None):
    """Warm-up calls, then timed calls of `call()`: the one timing loop.

    Args:
        call: the step, `call() -> value` (returns once its work is done,
            or with `sync`).
        warmup: untimed calls before the timed ones; the first is clocked
            apart as `Timing.first_s` (tracing / compilation).
        repeats: timed calls.
        sync: waits for the device after every call, before the clock.
        memory: a memory reader, started after the warm-up calls (or before
            them with `memory_covers_warmup`); read it after this returns.
        memory_covers_warmup: start `memory` before the first call, so that
            its peak includes the warm-up (allocators that keep the blocks
            of the first call).
        time_budget: stop the timed calls once this many seconds have passed
            since the first of them (at least one timed call).

    Returns:
        A `Timing`.
    """
    if memory is not None and memory_covers_warmup:
        memory.start()
    value, first = None, None
    for i in range(warmup):
        value, wall_s, _ = clock(call, sync)
        if i == 0:
            first = wall_s
    if memory is not None and not memory_covers_warmup:
        memory.start()
    wall, cpu = [], []
    end = None if time_budget is None else time.perf_counter() + time_budget
    for _ in range(repeats):
        value, wall_s, cpu_s = clock(call, sync)
        wall.append(wall_s)
        cpu.append(cpu_s)
        if end is not None and time.perf_counter() > end:
            break
    return Timing(value=value, first_s=first, wall=wall, cpu=cpu)


def interleaved(calls, rounds):
    """`rounds` rounds of one call of every step, in turns.

    The order is rotated by one from round to round (so that every step
    follows every other), and each step's times of a round can be divided
    by another's of the same round.

    Args:
        calls: `{name: call}`, in their first round's order.
        rounds: the number of rounds.

    Returns:
        `(wall, cpu)`: `{name: [seconds of each round]}` each.
    """
    names = list(calls)
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            _, wall_s, cpu_s = clock(calls[name])
            wall[name].append(wall_s)
            cpu[name].append(cpu_s)
    return wall, cpu


# ------------------------------------------------------ process memory (/proc)
def status():
    """`{"VmRSS": bytes, "VmHWM": bytes}`: resident and peak resident size."""
    with open("/proc/self/status") as f:
        text = f.read()
    return {
        key: int(re.search(key + r":\s+(\d+)", text).group(1)) * 1024
        for key in ("VmRSS", "VmHWM")
    }


def reset_peak():
    """Resets the kernel's peak-RSS counter (`VmHWM`); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_bytes():
    """`MemAvailable` of the machine, in bytes."""
    with open("/proc/meminfo") as f:
        text = f.read()
    return int(re.search(r"MemAvailable:\s+(\d+)", text).group(1)) * 1024


def memory_budget(gigabytes=None, gib=True):
    """`gigabytes` in bytes (GiB, or GB with `gib=False`), or, when it is
    None or 0, 80% of the memory available now (a shared machine)."""
    if gigabytes:
        return gigabytes * (2**30 if gib else 1e9)
    return 0.8 * available_bytes()


# ------------------------------------------------------------------ readers
class NoMemory:
    """No memory reading (a device whose allocator keeps no statistics)."""

    source = None
    reset = False
    allocator = False

    def start(self):
        self.baseline = None

    def peak_bytes(self):
        return None

    def peak_mib(self):
        return None


class RssPeak:
    """Peak resident size of the process after `start()`, minus its resident
    size there (the kernel's `VmHWM` counter is reset at `start()`; if the
    kernel refuses, `reset` is False and the peak before is the baseline)."""

    source = "process peak RSS (VmHWM)"
    allocator = False

    def __init__(self):
        self.baseline = None
        self.reset = False

    def start(self):
        gc.collect()
        self.reset = reset_peak()
        self.baseline = status()["VmRSS" if self.reset else "VmHWM"]

    def peak_bytes(self):
        return status()["VmHWM"]

    def peak_mib(self):
        return (self.peak_bytes() - self.baseline) / MIB


class AllocatorPeak:
    """An allocator's peak after `start()` minus its usage there.

    A subclass reads its allocator: `in_use()` (bytes now), `peak_bytes()`
    (the peak since the last `reset_peak()`), `reset_peak()`.
    """

    source = None
    allocator = True
    reset = True

    def __init__(self, device=None):
        self.device = device
        self.baseline = None

    def start(self):
        gc.collect()
        self.baseline = self.in_use()
        self.reset_peak()

    def reset_peak(self):
        """Resets the allocator's peak counter (nothing where it has none)."""

    def peak_mib(self):
        if self.baseline is None:
            return None
        return (self.peak_bytes() - self.baseline) / MIB


class TensorFlowAllocatorPeak(AllocatorPeak):
    """TensorFlow's CPU allocator (`tf.config.experimental.get_memory_info`);
    None where the allocator keeps no statistics."""

    source = "TensorFlow CPU allocator peak"

    def __init__(self, device="CPU:0"):
        super().__init__(device)

    def start(self):
        try:
            super().start()
        except (ValueError, RuntimeError):
            self.baseline = None

    def in_use(self):
        import tensorflow as tf

        return tf.config.experimental.get_memory_info(self.device)["current"]

    def reset_peak(self):
        import tensorflow as tf

        tf.config.experimental.reset_memory_stats(self.device)

    def peak_bytes(self):
        import tensorflow as tf

        if self.baseline is None:
            return None
        return tf.config.experimental.get_memory_info(self.device)["peak"]


class TorchCudaPeak(AllocatorPeak):
    """PyTorch's CUDA allocator: `max_memory_allocated()` after `start()`
    minus `memory_allocated()` there (the peak counter is reset there)."""

    source = "torch CUDA allocator peak (max_memory_allocated)"

    def in_use(self):
        import torch

        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self):
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self):
        import torch

        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


class JaxDevicePeak(AllocatorPeak):
    """A JAX device's allocator: `peak_bytes_in_use` minus `bytes_in_use` at
    `start()`. JAX cannot reset the peak: it covers the whole process (the
    compilation included), hence one process per measured step."""

    source = "JAX device allocator peak_bytes_in_use (process lifetime, one process per row)"

    def stats(self):
        import jax

        return (self.device or jax.devices()[0]).memory_stats()

    def in_use(self):
        return self.stats()["bytes_in_use"]

    def peak_bytes(self):
        return self.stats()["peak_bytes_in_use"]

    @staticmethod
    def available(device):
        """Whether `device`'s allocator keeps the statistics this reads."""
        stats = device.memory_stats()
        return bool(stats) and {"peak_bytes_in_use", "bytes_in_use"} <= set(stats)


def compiled_memory(fn, *args, **kwargs):
    """XLA's memory analysis of `fn` compiled for `args` (JAX), in bytes.

    `fn` is a function or a `jax.jit` of one; nothing runs. Returns
    `{"argument", "output", "alias", "temp", "generated_code"}` bytes:
    `temp` is the scratch memory a call needs beyond its inputs and outputs.
    """
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return memory_of_compiled(jitted.lower(*args, **kwargs).compile())


def memory_of_compiled(compiled):
    """XLA's memory analysis of a compiled JAX program, in bytes (the
    dict of `compiled_memory`)."""
    analysis = compiled.memory_analysis()
    return {
        "argument": analysis.argument_size_in_bytes,
        "output": analysis.output_size_in_bytes,
        "alias": analysis.alias_size_in_bytes,
        "temp": analysis.temp_size_in_bytes,
        "generated_code": analysis.generated_code_size_in_bytes,
    }


# ----------------------------------------------------------------- machine
def cpu_model():
    """The CPU's model name (`/proc/cpuinfo`), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
    except OSError:
        found = None
    return found.group(1).strip() if found else (platform.processor() or "unknown")


def machine(keys=None):
    """The machine, in a dict (CPU model, cores this process may use, memory,
    versions, date); `keys` keeps only those entries, in that order."""
    out = {
        "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "os": platform.platform(), "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return out if keys is None else {k: out[k] for k in keys}


def command_line(script, args=None):
    """The `command` of a results file: `python benchmarks/<script's file
    name> <args>`, the arguments shell-quoted (`args`: the arguments after
    the script's name; default `sys.argv[1:]`).

    >>> command_line("/repo/benchmarks/bench_x.py", ["--v", "1,2", "--note", "a b"])
    "python benchmarks/bench_x.py --v 1,2 --note 'a b'"
    """
    args = sys.argv[1:] if args is None else args
    return shlex.join(["python", f"benchmarks/{os.path.basename(script)}", *args])


def save(result, path, indent=1):
    """Writes the JSON `result` to `path` (its folder made if needed; nothing
    when `path` is None), through a temporary file renamed over it: a run
    killed while writing leaves the previous file whole."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=indent)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")


def error_text(err):
    """One line for an exception raised by a row (its type and message)."""
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


def step_row(call, warmup, repeats, memory, sync=None):
    """A row of `bench_peers.py` / `bench_adaptive.py`: `max(warmup, 1)`
    warm-up calls, `repeats` timed ones, `memory` started between them.

    Returns `{"step_s" (median), "best_s", "cpu_s" (median), "first_call_s",
    "wall_s", "peak_mib", "memory_source", "value"}`.
    """
    t = time_calls(call, max(warmup, 1), max(repeats, 1), sync=sync, memory=memory)
    return {
        "step_s": float(t.median_s), "best_s": float(t.best_s), "cpu_s": float(t.median_cpu_s),
        "first_call_s": t.first_s, "wall_s": t.wall,
        "peak_mib": memory.peak_mib(), "memory_source": memory.source, "value": t.value,
    }
