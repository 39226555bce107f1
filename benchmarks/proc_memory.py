"""Process memory readings and the machine's description, shared by the
benchmark scripts (Linux `/proc`)."""

import datetime
import os
import platform
import re


def status():
    """`{"VmRSS": bytes, "VmHWM": bytes}`: resident and peak resident size."""
    text = open("/proc/self/status").read()
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
    text = open("/proc/meminfo").read()
    return int(re.search(r"MemAvailable:\s+(\d+)", text).group(1)) * 1024


def machine():
    """The machine, in a dict (CPU model, cores this process may use, memory,
    versions, date)."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model, "cores": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "os": platform.platform(), "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
