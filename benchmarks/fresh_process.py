"""Runs one benchmark row in a fresh process (shared by the benchmark scripts).

A row's script is re-run with `--row=<name>`: it prints one line
`RESULT <json>`, which the parent reads back. A fresh process per row keeps
one row's memory, compiled functions and thread pools out of the next.
"""

import json
import os
import re
import subprocess
import sys

_PREFIX = "RESULT "


def report(result):
    """Prints a row's result for `run_row` to read (call in the child)."""
    print(_PREFIX + json.dumps(result), flush=True)


def run_row(script, args):
    """Runs `python script *args` and returns the dict it `report`ed."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                         env=env, check=True).stdout
    return json.loads(out.split(_PREFIX, 1)[1].splitlines()[0])


def error_text(output, returncode):
    """One line for a failed child: its last `SomeError: message`, else its tail."""
    lines = [x.strip() for x in (output or "").splitlines() if x.strip()]
    errors = [x for x in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", x)]
    if errors:
        return f"rc={returncode}: {errors[-1][:300]}"
    if returncode is not None and returncode < 0:
        return f"killed by signal {-returncode} (out of memory?)"
    return f"rc={returncode}: " + " | ".join(lines[-2:])[-300:]
