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


def main(argv):
    (name,) = argv
    folder = os.path.realpath(os.getcwd())
    import triton  # before the hook: importing it may write nothing, but finds its tools' folder

    tools = os.path.join(os.path.dirname(os.path.realpath(triton.__file__)), "backends")
    sys.addaudithook(_write_guard(folder, (tools,)))

    from ttx_tutorial.exercises.sources import code_cells, run_cells

    path = Path(folder) / name
    if path.suffix == ".ipynb":
        sources = code_cells(json.loads(path.read_text(encoding="utf-8")))
    else:
        sources = [path.read_text(encoding="utf-8")]
    sys.argv = [name]
    namespace = {"__name__": "__main__"}
    for index, source in enumerate(sources):
        try:
            run_cells([source], namespace, name=name, first_index=index)
        except BaseException as error:  # the grader's table shows this last line
            traceback.print_exc()
            first_line = (str(error).strip().splitlines() or [""])[0][:200]
            print(f"code cell {index} raised {type(error).__name__}: {first_line}", flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
