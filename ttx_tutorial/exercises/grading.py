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
import re
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
#: Each checker's exercise, as its result line and the grade table name it.
EXERCISE_NAMES = {"check_feature_map": "feature map", "check_recurrent": "recurrent",
                  "check_small_dot": "small tl.dot blocks", "check_chunked": "chunked",
                  "check_scan": "scan step", "check_dq": "backward dQ"}


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


def grade_one(path: Path, *, label: str | None = None, time_limit_s=TIME_LIMIT_S, memory_mb=MEMORY_LIMIT_MB,
              output_bytes=OUTPUT_LIMIT_BYTES) -> list[Row]:
    """Run one submission in a temporary copy and return its rows of the table, named ``label``
    (by default the file's name): one row per exercise it checked, then one for a run that
    stopped badly (see ``rows_from_report``)."""
    path = Path(path)
    name = path.name
    label = name if label is None else label
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
        report = folder / REPORT_NAME
        lines = report.read_text(encoding="utf-8", errors="replace").splitlines() if report.exists() else []
        problem = _problem(returncode, timed_out, elapsed, time_limit_s, output, output_bytes)
    return rows_from_report(label, lines, problem, _checkers_called(path))


def rows_from_report(label: str, lines, problem: str | None, checkers=()) -> list[Row]:
    """The rows of one submission from its report's lines (JSON: a code cell starting, with
    ``graded`` true for a notebook's read-only check cell, or a checker's result) and the way its
    run ended (``problem``: None, or why it stopped badly).

    One row per exercise, in the order first checked. Its result is the checker call made in the
    notebook's read-only check cell, the cell nbgrader grades; where there is none (a .py file,
    or that cell never ran), the exercise's last checker call. Scratch checks elsewhere therefore
    do not count twice. A run that then stopped badly (an error, a crash, the time limit, an
    output flood) adds a failing row of its own, exercise "(run)", and leaves the exercises'
    rows as they were, as nbgrader's autograde scores each grade cell by itself. A run that
    stopped before any checker reported fails the exercises its check cells name (``checkers``,
    the checker functions the submission calls), or "?" where it names none."""
    graded_cell, latest, from_graded = False, {}, {}
    for line in lines:
        try:
            entry = json.loads(line)
            if "cell" in entry:
                graded_cell = bool(entry.get("graded"))
                continue
            row = Row(label, str(entry["exercise"]), bool(entry["passed"]), str(entry["message"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        latest[row.exercise] = row
        if graded_cell:
            from_graded[row.exercise] = row
    results = [from_graded.get(exercise, row) for exercise, row in latest.items()]
    if problem and results:
        results.append(Row(label, "(run)", False, f"after its checks, {problem}"))
    elif problem:
        exercises = [EXERCISE_NAMES[name] for name in checkers if name in EXERCISE_NAMES] or ["?"]
        results += [Row(label, exercise, False, problem) for exercise in exercises]
    if not results:
        results.append(Row(label, "?", False, "no checker was called: is the check cell still there?"))
    return results


def _checkers_called(path: Path) -> list[str]:
    """The checker functions a submission's code calls, in order, each once."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    found = []
    for name in re.findall(r"\b(check_\w+)\s*\(", text):
        if name in EXERCISE_NAMES and name not in found:
            found.append(name)
    return found


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


def _hidden(path: Path, root: Path) -> bool:
    """Whether ``path`` lies in a hidden folder below ``root`` (``.ipynb_checkpoints``, ``.git``)."""
    return any(part.startswith(".") for part in path.relative_to(root).parts[:-1])


def submissions(paths) -> list[tuple[Path, str]]:
    """(file, label) for the .ipynb and .py files named, or found in the folders named and their
    sub-folders (hidden ones skipped), sorted. A file named directly is labelled as it was
    written; a file found in a folder by its path below that folder (``ana/ex1.ipynb``, as in
    nbgrader's ``submitted/<student>/<assignment>/``), or, where several folders are named, below
    the folder that holds them all (``submitted/ana/ex1.ipynb`` for ``submitted other``;
    ``ana/ex1/ex1.ipynb`` for ``submitted/ana/ex1 submitted/ben/ex1``, one assignment of every
    student), so that no two labels are alike."""
    paths = list(map(Path, paths))
    folders = [Path(os.path.abspath(path)) for path in paths if path.is_dir()]
    # Below the folders' common parent: their parents when they are siblings, and the folder of
    # the students when each is one student's copy of an assignment.
    common = Path(os.path.commonpath([folder.parent for folder in folders])) if len(folders) > 1 else None
    found = []
    for path in paths:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in (".ipynb", ".py") and p.is_file()
                           and not _hidden(p, path))
            if not files:
                raise ValueError(f"no .ipynb or .py files in {path} or its sub-folders")
            if common is None:
                found += [(p, p.relative_to(path).as_posix()) for p in files]
            else:
                found += [(p, Path(os.path.abspath(p)).relative_to(common).as_posix()) for p in files]
        elif path.is_file() and path.suffix in (".ipynb", ".py"):
            found.append((path, str(path)))
        else:
            raise ValueError(f"not a notebook, a .py file or a folder: {path}")
    return found


def grade(paths, **limits) -> list[Row]:
    rows = []
    for path, label in submissions(paths):
        rows += grade_one(path, label=label, **limits)
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
