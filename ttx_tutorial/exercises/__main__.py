"""``python -m ttx_tutorial.exercises grade PATH... [--csv FILE]`` and ``... generate``."""

import argparse
import sys
from pathlib import Path

from . import grading
from .sources import generate

DEFAULT_SOLUTIONS = Path("notebooks/exercises/solutions")
DEFAULT_STUDENTS = Path("notebooks/exercises")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ttx_tutorial.exercises")
    commands = parser.add_subparsers(dest="command", required=True)
    grade = commands.add_parser("grade", help="run submissions headless in CPU mode and print a table")
    grade.add_argument("paths", nargs="+", help="submitted .ipynb or .py files, or folders of them (searched "
                       "with their sub-folders)")
    grade.add_argument("--csv", metavar="FILE",
                       help="also write the table as CSV (a gradebook); '-' prints it, the table then on stderr")
    grade.add_argument("--time-limit", type=int, default=grading.TIME_LIMIT_S, help="seconds per submission")
    grade.add_argument("--memory-limit", type=int, default=grading.MEMORY_LIMIT_MB, help="MiB per submission")
    make = commands.add_parser("generate", help="write the student notebooks from the solution notebooks")
    make.add_argument("--solutions", type=Path, default=DEFAULT_SOLUTIONS)
    make.add_argument("--students", type=Path, default=DEFAULT_STUDENTS)
    args = parser.parse_args(argv)

    if args.command == "generate":
        if not args.solutions.is_dir():
            parser.error(f"no folder {args.solutions} here: run this from the repository's root, or name the "
                         f"folders with --solutions and --students")
        try:
            written = generate(args.solutions, args.students)
        except ValueError as error:
            parser.error(str(error))
        for path in written:
            print(path)
        return 0
    for name, value in (("--time-limit", args.time_limit), ("--memory-limit", args.memory_limit)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    try:
        rows = grading.grade(args.paths, time_limit_s=args.time_limit, memory_mb=args.memory_limit)
    except ValueError as error:
        parser.error(str(error))
    # With the CSV on standard output the table goes to standard error, so that the output parses.
    print(grading.format_table(rows), file=sys.stderr if args.csv == "-" else sys.stdout)
    if args.csv == "-":
        sys.stdout.write(grading.format_csv(rows))
    elif args.csv:
        Path(args.csv).write_text(grading.format_csv(rows), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
