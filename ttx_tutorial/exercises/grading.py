"""Grade submitted notebooks (or .py files) headless, in CPU mode, one child process each.

Submissions are untrusted code. Each one runs:

* in its own process and process group, so a crash or an endless loop ends that student's
  run only (the group is killed at the time limit);
* in a fresh temporary folder holding a copy of the submission, which is its working folder,
  its ``HOME``, ``TMPDIR`` and Triton cache;
* under ``resource.setrlimit`` limits: CPU seconds, address space (memory), size of any file it
  writes, and its output goes to a file in that folder, so a flood of output is cut at the limit;
* with an audit hook (``sys.addaudithook``) installed before the student's first line, which
  refuses to open files for writing, remove, rename or create them outside that folder, and
  refuses to start programs other than Triton's own compiler tools.

What this does not do: it is not a security sandbox. Code that calls the operating system
directly (``ctypes``) escapes the audit hook; the submission can read any file the grader can
read, use the network, and forge its own result line (the checker runs in its process). Run the
grader as a user who owns nothing of value, or in a container, for submissions you do not trust.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: Wall-clock seconds a submission may run (CPU mode is slow: the solutions take a few seconds).
TIME_LIMIT_S = 120
#: Address-space limit; torch and Triton map about 2 GiB of virtual memory before any work.
MEMORY_LIMIT_MB = 6144
#: Largest file (its output included) a submission may write.
OUTPUT_LIMIT_BYTES = 1 << 20
REPORT_NAME = ".ttx_exercises_report.jsonl"
OUTPUT_NAME = ".ttx_exercises_output.txt"


@dataclass
class Row:
    """One line of the grade table: a student file, an exercise, pass or fail, and why."""

    student_file: str
    exercise: str
    passed: bool
    diagnosis: str


def _limits(memory_mb: int, cpu_s: int, output_bytes: int):
    import resource

    def apply():
        os.setsid()  # its own process group, killed as a whole at the time limit
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 5))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _child_environment(folder: Path) -> dict:
    env = {name: value for name, value in os.environ.items()
           if name in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(folder), TMPDIR=str(folder), TRITON_CACHE_DIR=str(folder / ".triton"),
               TTX_TUTORIAL_DEVICE="cpu", TTX_EXERCISES_REPORT=str(folder / REPORT_NAME),
               MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def _tail(path: Path, limit=300) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def grade_one(path: Path, *, time_limit_s=TIME_LIMIT_S, memory_mb=MEMORY_LIMIT_MB,
              output_bytes=OUTPUT_LIMIT_BYTES) -> list[Row]:
    """Run one submission in a temporary copy and return its rows of the table."""
    path = Path(path)
    name = path.name
    with tempfile.TemporaryDirectory(prefix="ttx-grade-") as temporary:
        folder = Path(temporary)
        copy = folder / name
        shutil.copyfile(path, copy)
        output = folder / OUTPUT_NAME
        start = time.monotonic()
        with open(output, "wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "ttx_tutorial.exercises._submission", name],
                cwd=folder, env=_child_environment(folder), stdin=subprocess.DEVNULL, stdout=sink,
                stderr=subprocess.STDOUT, preexec_fn=_limits(memory_mb, time_limit_s, output_bytes))
            try:
                returncode = process.wait(timeout=time_limit_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                returncode, timed_out = process.returncode, True
        elapsed = time.monotonic() - start
        results = []
        report = folder / REPORT_NAME
        if report.exists():
            for line in report.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                    results.append(Row(name, str(entry["exercise"]), bool(entry["passed"]), str(entry["message"])))
                except (ValueError, KeyError, TypeError):
                    continue
        problem = _problem(returncode, timed_out, elapsed, time_limit_s, output, output_bytes)
    if problem:
        results.append(Row(name, results[-1].exercise if results else "?", False, problem))
    if not results:
        results.append(Row(name, "?", False, "no checker was called: is the check cell still there?"))
    return results


def _problem(returncode, timed_out, elapsed, time_limit_s, output, output_bytes) -> str | None:
    if timed_out or returncode == -signal.SIGXCPU:
        return f"stopped after {min(elapsed, time_limit_s):.0f} s, the time limit (an endless loop?)"
    if returncode == -signal.SIGXFSZ or (output.exists() and output.stat().st_size >= output_bytes):
        return f"stopped: its output passed the limit of {output_bytes} bytes"
    if returncode == 0:
        return None
    if returncode < 0:
        return f"crashed (signal {signal.Signals(-returncode).name}); last output: {_tail(output)}"
    return f"stopped with an error: {_tail(output)}"


def submissions(paths) -> list[Path]:
    """The .ipynb and .py files named, or found (not recursively) in the folders named."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(p for p in path.iterdir() if p.suffix in (".ipynb", ".py") and p.is_file())
        elif path.is_file() and path.suffix in (".ipynb", ".py"):
            found.append(path)
        else:
            raise ValueError(f"not a notebook, a .py file or a folder: {path}")
    return found


def grade(paths, **limits) -> list[Row]:
    rows = []
    for path in submissions(paths):
        rows += grade_one(path, **limits)
    return rows


def format_table(rows) -> str:
    header = ("student file", "exercise", "result", "diagnosis")
    cells = [(r.student_file, r.exercise, "pass" if r.passed else "fail", r.diagnosis) for r in rows]
    widths = [max(len(row[i]) for row in [header] + cells) for i in range(3)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
             for row in [header] + cells]
    lines.insert(1, "  ".join("-" * width for width in widths) + "  " + "-" * len(header[3]))
    return "\n".join(lines)


def format_csv(rows) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["student_file", "exercise", "passed", "diagnosis"])
    for row in rows:
        writer.writerow([row.student_file, row.exercise, row.passed, row.diagnosis])
    return buffer.getvalue()
