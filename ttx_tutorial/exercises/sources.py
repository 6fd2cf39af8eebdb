"""One source, two versions: the student notebook is made from the solution notebook.

The solution notebooks follow nbgrader's conventions, cell metadata included, so a course that runs
nbgrader can use them as its source notebooks, and this module makes the same student version
without nbgrader:

* in a code cell, the lines from ``### BEGIN SOLUTION`` to ``### END SOLUTION`` become
  ``# YOUR CODE HERE`` and ``raise NotImplementedError()``, indented like the first marker;
* in a markdown cell, that region becomes ``YOUR ANSWER HERE``;
* the lines from ``### BEGIN HIDDEN TESTS`` to ``### END HIDDEN TESTS`` are removed; the cell
  stays, with its nbgrader metadata, so that nbgrader's autograde can put the tests back into a
  submitted copy (it finds them by the cell's ``grade_id``);
* outputs and execution counts are cleared, so no solution leaks through an output.

As nbgrader does, a solution region must sit in a cell marked as a solution cell
(``metadata.nbgrader.solution``), and hidden tests in a grade cell (``metadata.nbgrader.grade``,
with its points); a source that breaks this is refused.
"""

from __future__ import annotations

import copy
import json
import linecache
from pathlib import Path

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"


def _source_text(cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _replace_regions(text: str, begin: str, end: str, replacement, where: str) -> str:
    """Each region from a ``begin`` line to an ``end`` line replaced by ``replacement(indent)``
    (a list of lines); unbalanced markers raise ValueError naming ``where``."""
    out, indent = [], None
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        marker = line.strip()
        if marker == begin:
            if indent is not None:
                raise ValueError(f"{where}, line {number}: {begin!r} inside another {begin!r}")
            indent = line[:len(line) - len(line.lstrip())]
            out.extend(replacement(indent))
        elif marker == end:
            if indent is None:
                raise ValueError(f"{where}, line {number}: {end!r} without {begin!r}")
            indent = None
        elif indent is None:
            out.append(line)
    if indent is not None:
        raise ValueError(f"{where}: {begin!r} without {end!r}")
    return "".join(out)


def _code_blank(indent):
    return [f"{indent}# YOUR CODE HERE\n", f"{indent}raise NotImplementedError()\n"]


def _answer_blank(indent):
    return [f"{indent}YOUR ANSWER HERE\n"]


def _check_marked(cell, text: str, where: str) -> None:
    """nbgrader's rule: solution regions only in solution cells, hidden tests only in grade cells."""
    marks = cell.get("metadata", {}).get("nbgrader", {})
    if any(line.strip() == BEGIN_SOLUTION for line in text.splitlines()) and not marks.get("solution"):
        raise ValueError(f"{where}: a solution region in a cell not marked as a solution cell "
                         f"(metadata.nbgrader.solution); nbgrader refuses it")
    if any(line.strip() == BEGIN_HIDDEN for line in text.splitlines()):
        if not marks.get("grade") or marks.get("points") is None:
            raise ValueError(f"{where}: hidden tests in a cell not marked as a grade cell with its points "
                             f"(metadata.nbgrader.grade, .points); nbgrader needs both")


def _lock(cell: dict) -> None:
    """The cell locks nbgrader's generate_assignment sets, as Jupyter's own cell metadata, which
    JupyterLab and Notebook obey: a solution cell cannot be deleted; a locked or grade cell (not a
    solution) can be neither edited nor deleted, so the check call and the grade cell that
    autograde fills stay as the source has them."""
    marks = cell.get("metadata", {}).get("nbgrader")
    if not marks:
        return
    if marks.get("solution"):
        cell["metadata"]["deletable"] = False
    elif marks.get("locked") or marks.get("grade"):
        cell["metadata"]["editable"] = False
        cell["metadata"]["deletable"] = False


def student_version(notebook: dict, *, name: str = "notebook") -> dict:
    """The student version of a solution notebook (a dict as stored in an .ipynb file)."""
    if not isinstance(notebook, dict) or "cells" not in notebook:
        raise TypeError(f"{name}: notebook must be a dict with 'cells' (a parsed .ipynb file)")
    student = copy.deepcopy(notebook)
    for index, cell in enumerate(student["cells"]):
        where = f"{name}, cell {index}"
        text = _source_text(cell)
        _check_marked(cell, text, where)
        text = _replace_regions(text, BEGIN_HIDDEN, END_HIDDEN, lambda indent: [], where)
        blank = _code_blank if cell["cell_type"] == "code" else _answer_blank
        text = _replace_regions(text, BEGIN_SOLUTION, END_SOLUTION, blank, where)
        cell["source"] = text.splitlines(keepends=True)
        _lock(cell)
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
            cell.get("metadata", {}).pop("execution", None)
    return student


def notebook_text(notebook: dict) -> str:
    """An .ipynb file's text, as Jupyter writes it (one-space indent, sorted keys)."""
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def generate(solutions: Path, students: Path) -> list[Path]:
    """Write the student version of every ``solutions/*.ipynb`` into ``students``; the paths written."""
    solutions, students = Path(solutions), Path(students)
    sources = sorted(solutions.glob("*.ipynb"))
    if not sources:
        raise ValueError(f"no .ipynb files in {solutions}")
    students.mkdir(parents=True, exist_ok=True)
    written = []
    for source in sources:
        notebook = json.loads(source.read_text(encoding="utf-8"))
        target = students / source.name
        target.write_text(notebook_text(student_version(notebook, name=source.name)), encoding="utf-8")
        written.append(target)
    return written


def code_cells(notebook: dict) -> list[str]:
    """The sources of a notebook's code cells, in order."""
    return [_source_text(cell) for cell in notebook["cells"] if cell["cell_type"] == "code"]


def run_cells(sources, namespace: dict, *, name: str = "notebook", first_index: int = 0) -> dict:
    """Execute code cells one after another in ``namespace``, as a notebook kernel would.

    Each cell's text is registered with ``linecache`` under its own file name (``<name cell N>``),
    so ``inspect.getsource`` works, which ``@triton.jit`` needs to read a kernel."""
    for index, source in enumerate(sources, start=first_index):
        filename = f"<{name} cell {index}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        exec(compile(source, filename, "exec"), namespace)
    return namespace
