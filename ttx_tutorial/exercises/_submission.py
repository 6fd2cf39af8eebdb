"""Child process of the grader: run one submission in the current folder, which it may not leave.

Run as ``python -m ttx_tutorial.exercises._submission FILE`` by ``grading.grade_one``, which has
already set the resource limits and the environment. The audit hook goes in before any of the
submission's code runs and cannot be removed from Python.
"""

import json
import os
import sys
import traceback
from pathlib import Path


def _inside(path, folder: str) -> bool:
    try:
        resolved = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return resolved == folder or resolved.startswith(folder + os.sep) or resolved == os.devnull


def _write_guard(folder: str, allowed_programs: tuple):
    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                      (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
            if writing and not _inside(args[0], folder):
                raise PermissionError(f"the grader refuses writes outside the submission's folder: {args[0]}")
        elif event in ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link",
                       "os.truncate", "os.chmod", "os.chown", "shutil.rmtree", "os.utime"):
            if args and isinstance(args[0], (str, bytes, os.PathLike)) and not _inside(args[0], folder):
                raise PermissionError(f"the grader refuses {event} outside the submission's folder: {args[0]}")
            if event in ("os.rename", "os.symlink", "os.link") and len(args) > 1 \
                    and isinstance(args[1], (str, bytes, os.PathLike)) and not _inside(args[1], folder):
                raise PermissionError(f"the grader refuses {event} outside the submission's folder: {args[1]}")
        elif event in ("os.system", "os.exec", "os.spawn", "os.fork", "os.forkpty"):
            raise PermissionError(f"the grader refuses {event} in a submission")
        elif event in ("subprocess.Popen", "os.posix_spawn"):
            # (executable, args, ...) and (path, argv, env): Triton runs ptxas this way
            program = args[0] or (args[1][0] if args[1] else "")
            if not os.path.realpath(os.fsdecode(program)).startswith(allowed_programs):
                raise PermissionError(f"the grader refuses to start {program!r} from a submission")
    return hook


def _ipython(namespace: dict):
    """IPython's cell transformer, with a shell whose namespace is ``namespace`` (so that ``%time``,
    ``display()`` and the other IPython-only lines of a notebook run as Jupyter runs them), or
    None where IPython is not installed: the cells then run as plain Python."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.display import display
        from traitlets.config import Config
    except ImportError:
        return None
    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # nothing written for a run that is thrown away
    InteractiveShell.instance(config=config, user_ns=namespace)
    namespace.setdefault("display", display)
    return TransformerManager().transform_cell


def _cells(path: Path) -> list[tuple[str, bool]]:
    """(source, graded) of each code cell: graded for a notebook's read-only check cell (nbgrader's
    metadata: locked, neither a solution nor a grade cell), whose checker call the grader counts."""
    from ttx_tutorial.exercises.sources import code_cells

    if path.suffix != ".ipynb":
        return [(path.read_text(encoding="utf-8"), False)]
    cells = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell.get("cell_type") != "code":
            continue
        marks = cell.get("metadata", {}).get("nbgrader", {})
        graded = bool(marks.get("locked")) and not marks.get("solution") and not marks.get("grade")
        cells.append((code_cells({"cells": [cell]})[0], graded))
    return cells


def main(argv):
    (name,) = argv
    folder = os.path.realpath(os.getcwd())
    import triton  # before the hook: importing it may write nothing, but finds its tools' folder

    tools = os.path.join(os.path.dirname(os.path.realpath(triton.__file__)), "backends")
    sys.addaudithook(_write_guard(folder, (tools,)))

    from ttx_tutorial.exercises.sources import run_cells

    cells = _cells(Path(folder) / name)
    sys.argv = [name]
    namespace = {"__name__": "__main__"}
    transform = _ipython(namespace) if name.endswith(".ipynb") else None
    report = os.environ.get("TTX_EXERCISES_REPORT")
    for number, (source, graded) in enumerate(cells, start=1):
        if report:  # which cell the next results come from (grading.rows_from_report)
            with open(report, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"cell": number, "graded": graded}) + "\n")
        try:
            run_cells([transform(source) if transform else source], namespace, name=name, first_index=number)
        except BaseException as error:  # the grader's table shows this last line
            traceback.print_exc()
            first_line = (str(error).strip().splitlines() or [""])[0][:200]
            print(f"code cell {number} raised {type(error).__name__}: {first_line}", flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
