"""Process memory readings shared by the benchmark scripts (Linux `/proc`)."""

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
