"""Runs benchmark rows in fresh processes (shared by the benchmark scripts).

A row's script is re-run with its child flags: it prints one line
`RESULT <json>` per row (`report`), which the parent reads back (`run`).
A fresh process per row keeps one row's memory, compiled functions and
thread pools out of the next.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import measure  # benchmarks/measure.py (the script's own folder)
import select_backend  # benchmarks/select_backend.py

_PREFIX = "RESULT "


def report(result):
    """Prints a row's result for `run` to read (call in the child)."""
    print(_PREFIX + json.dumps(result), flush=True)


@dataclasses.dataclass
class Child:
    """A finished child process: the rows it reported and how it ended."""

    results: list
    returncode: int
    output: str  # its stderr, then its stdout

    @property
    def error(self):
        """One line for a failed child (`error_text`)."""
        return error_text(self.output, self.returncode)

    def result(self):
        """The first row it reported, else `{"error": ...}`."""
        return self.results[0] if self.results else {"error": self.error}


def run(script, args, env=None):
    """Runs `python script *args` (environment: this one, `env` over it) and
    returns the `Child`, whatever its exit status."""
    full_env = {"TF_CPP_MIN_LOG_LEVEL": "3", **os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, os.path.abspath(script), *args],
                          capture_output=True, text=True, env=full_env)
    results = [json.loads(line[len(_PREFIX):]) for line in proc.stdout.splitlines()
               if line.startswith(_PREFIX)]
    return Child(results, proc.returncode, (proc.stderr or "") + (proc.stdout or ""))


def run_row(script, args):
    """Runs `python script *args` and returns the dict it `report`ed.

    Raises:
        RuntimeError: the child reported nothing (with its error line).
    """
    child = run(script, args)
    if not child.results:
        raise RuntimeError(f"{os.path.basename(script)}: {child.error}")
    return child.results[0]


def dispatch(row, run_row, run_all, out=None, indent=2):
    """A row-per-process script's `main`: in a child (`row` set) measures
    `run_row(row)` and reports it; in the parent runs `run_all()` (which
    starts the children) and writes its JSON report to `out`, if given."""
    if row:
        report(run_row(row))
        return
    measure.save(run_all(), out, indent=indent)


def absl_main(run_row, run_all, flags):
    """`main(argv)` for `absl.app.run` of a script whose absl `flags` have
    `backend`, `row` and `out`: selects the backend, then `dispatch`es."""

    def main(argv):
        del argv
        select_backend.use(flags.backend)
        dispatch(flags.row, run_row, run_all, flags.out)

    return main


def error_text(output, returncode):
    """One line for a failed child: its last `SomeError: message`, else its tail."""
    lines = [x.strip() for x in (output or "").splitlines() if x.strip()]
    errors = [x for x in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", x)]
    if errors:
        return f"rc={returncode}: {errors[-1][:300]}"
    if returncode is not None and returncode < 0:
        return f"killed by signal {-returncode} (out of memory?)"
    return f"rc={returncode}: " + " | ".join(lines[-2:])[-300:]
