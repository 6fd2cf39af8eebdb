"""Command line: ``python -m ttx_tutorial notebooks DEST`` copies the course's notebooks (and the
instructors' guide beside the exercises) out of the installed package, ``python -m ttx_tutorial
info`` prints the mode and versions."""

from __future__ import annotations

import argparse
import shutil
import sys
from importlib import resources
from pathlib import Path


def _notebook_root():
    """The folder of the shipped notebooks: ``ttx_tutorial.notebooks`` in an installed wheel or
    sdist; in an editable install of the repository (``pip install -e .``, ``make lab``), whose
    import finder does not map that folder, the repository's own ``notebooks/``."""
    try:
        return resources.files("ttx_tutorial.notebooks")
    except ModuleNotFoundError:
        repository = Path(__file__).resolve().parents[1] / "notebooks"
        if repository.is_dir():
            return repository
        raise FileNotFoundError("this installation of ttx_tutorial holds no notebooks") from None


def notebook_files() -> list[str]:
    """Every notebook shipped with the package, and the Markdown guides beside them
    (``exercises/INSTRUCTOR.md``), as paths relative to its notebook folder (exercises and their
    solutions in their subfolders), sorted."""
    root = _notebook_root()
    found: list[str] = []

    def walk(folder, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir() and not entry.name.startswith("."):
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith((".ipynb", ".md")):
                found.append(prefix + entry.name)

    walk(root, "")
    return sorted(found)


def copy_notebooks(destination: Path, *, overwrite: bool = False) -> list[Path]:
    """Copy every shipped notebook under ``destination``, keeping the subfolders. Refuses, before
    copying anything, to replace a file that exists unless ``overwrite``: it may hold your work."""
    names = notebook_files()
    if not names:
        raise FileNotFoundError("this installation of ttx_tutorial holds no notebooks")
    targets = [destination / name for name in names]
    existing = [str(target) for target in targets if target.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{len(existing)} notebook(s) already exist in {destination}, e.g. "
                              f"{existing[0]}; pass --overwrite to replace them")
    root = _notebook_root()
    for name, target in zip(names, targets):
        target.parent.mkdir(parents=True, exist_ok=True)
        shipped = root
        for part in name.split("/"):  # one step at a time: a namespace package's joinpath takes one
            shipped = shipped / part
        with resources.as_file(shipped) as source:
            shutil.copyfile(source, target)
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ttx_tutorial", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    notebooks = commands.add_parser("notebooks",
                                    help="copy the notebooks (and the instructors' guide) into a folder")
    notebooks.add_argument("destination", type=Path, help="folder to write them to (created if missing)")
    notebooks.add_argument("--overwrite", action="store_true", help="replace notebooks that exist there")
    commands.add_parser("info", help="print the mode (GPU or CPU interpreter) and the versions")
    args = parser.parse_args(argv)

    if args.command == "info":
        import ttx_tutorial

        print(ttx_tutorial.describe())
        return 0
    try:
        written = copy_notebooks(args.destination, overwrite=args.overwrite)
    except (FileExistsError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} notebooks to {args.destination}")
    print(f"open them with:  jupyter lab {args.destination}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
