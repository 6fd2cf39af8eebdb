"""Classroom exercises: checkers that say what is wrong, student notebooks made from solutions, grading.

* ``check_feature_map``, ``check_recurrent``, ``check_small_dot``, ``check_chunked``, ``check_scan``,
  ``check_dq``: one per exercise of ``notebooks/exercises/``; each runs the student's kernel on fresh
  random inputs and prints one line (what is wrong, or that it is right).
* ``student_version``: nbgrader's rule, a solution notebook to its student version.
* ``python -m ttx_tutorial.exercises generate`` writes the student notebooks;
  ``python -m ttx_tutorial.exercises grade PATH...`` grades submissions (see ``grading``).
"""

from ._harness import CheckResult
from .checkers import (check_chunked, check_dq, check_feature_map, check_recurrent, check_scan,
                       check_small_dot)
from .sources import run_cells, student_version

__all__ = [
    "CheckResult",
    "check_chunked",
    "check_dq",
    "check_feature_map",
    "check_recurrent",
    "check_scan",
    "check_small_dot",
    "run_cells",
    "student_version",
]
